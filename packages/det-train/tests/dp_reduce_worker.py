"""One rank of test_dp_reduce.py: the main job (examples/train_gpt.py) on a gloo group, measured.

``run_rank`` is forked once per rank and DP degree by test_dp_reduce.py (torch and the kernels are
already loaded in the parent) and runs several jobs in one process group. For every step it
records the gradients the optimizer sees (gathered to full tensors under FSDP2) and, inside
``CanonicalGradAccumulator.reduce``, every torch.distributed collective with its bytes sent and
received by this rank (through wrappers around the collectives) and the tensor memory the reduce
allocates (an allocation meter over torch's dispatcher).
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import re
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).parent))

import det_train  # noqa: E402
from det_train.accum import dp_reduce  # noqa: E402

from examples import train_gpt as tg  # noqa: E402


def config(**overrides) -> tg.TrainConfig:
    """The main job's tiny preset, shortened for the interpreter: 8-token sequences, one leaf each
    (8 leaves per global batch of 8 sequences), ``STEPS`` steps."""
    base = dict(steps=STEPS, batch_seqs=8, seq_len=8, leaf_tokens=8)
    return tg.make_config("tiny", **{**base, **overrides})


STEPS = 1


# ------------------------------------------------------------------ measuring instruments
class CollectiveMeter:
    """Wraps torch.distributed's collectives: per call (name, bytes sent, bytes received) by this rank.

    Bytes are the data each rank must move (what a ring or direct algorithm transfers): an
    all-to-all sends its splits for other ranks and receives theirs for it (its own split is a local
    copy); an all-gather of ``n`` bytes per rank sends ``(W - 1) * n`` and receives ``(W - 1) * n``;
    ``all_gather_object`` counts the pickled objects (the metadata).
    """

    WRAPPED = ("all_to_all_single", "all_to_all", "all_gather_single", "all_gather_into_tensor", "all_gather",
               "all_gather_object", "all_reduce", "reduce_scatter_tensor", "reduce_scatter", "broadcast",
               "send", "recv", "isend", "irecv")  # fmt: skip

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    @contextlib.contextmanager
    def active(self):
        saved = {name: getattr(dist, name) for name in self.WRAPPED if hasattr(dist, name)}
        for name, fn in saved.items():
            setattr(dist, name, functools.partial(self._call, name, fn))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)

    def _call(self, name, fn, *args, **kwargs):
        group = kwargs.get("group")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        result = fn(*args, **kwargs)
        if name == "all_to_all_single":
            out, inp = args[0], args[1]
            out_splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
            in_splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            in_splits = in_splits or [inp.numel() // world] * world
            out_splits = out_splits or [out.numel() // world] * world
            es = inp.element_size()
            sent = (sum(in_splits) - in_splits[rank]) * es
            received = (sum(out_splits) - out_splits[rank]) * es
        elif name in ("all_gather_single", "all_gather_into_tensor"):
            n = args[1].numel() * args[1].element_size()
            sent = received = (world - 1) * n
        elif name == "all_gather_object":
            sizes = [len(pickle.dumps(obj)) for obj in args[0]]
            sent, received = (world - 1) * sizes[rank], sum(sizes) - sizes[rank]
        else:  # not used by the reduction: recorded so that a test can say which ran
            sent = received = -1
        self.calls.append((name, sent, received))
        return result


class AllocationMeter(TorchDispatchMode):
    """Bytes of tensor storage allocated by torch ops while active: live now, peak, and in total.

    A storage counts from the op that creates it (an output whose storage is none of the op's
    inputs': ``empty``, ``cat``, ``add``, ...; views and in-place ops allocate nothing) until the
    tensor that received it is freed (views keep their base alive).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.total = 0
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self._tracked:
                continue
            self._tracked.add(ptr)
            self.live += nbytes
            self.total += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, ptr, nbytes)
        return out

    def _free(self, ptr: int, nbytes: int) -> None:
        self._tracked.discard(ptr)
        self.live -= nbytes


# ------------------------------------------------------------------ the main job, instrumented
def _instrumented_train(cfg: tg.TrainConfig, rank: int, world: int, **kwargs) -> dict:
    """``tg.train`` on this rank, recording per step the gradients, collectives, memory and node keys."""
    steps: list[dict] = []
    reduce, build_optimizer, exchange = (
        det_train.CanonicalGradAccumulator.reduce,
        tg.build_optimizer,
        dp_reduce.exchange_node_keys,
    )

    def measured_reduce(acc, *args, **kw):
        meter, memory = CollectiveMeter(), AllocationMeter()
        local_nodes = [max((len(tree.nodes) for tree in acc._partials.values()), default=0)]
        keys.clear()
        with meter.active(), memory:
            reduce(acc, *args, **kw)
        outputs = sum(_local(p.grad).numel() * p.element_size() for p in acc._params)
        # nodes per (parameter, use) on each rank (the most of any parameter)
        nodes = [max((len(k) for k in rank_keys.values()), default=0) for rank_keys in keys] or local_nodes
        steps.append(
            {
                "calls": meter.calls,
                "peak": memory.peak - outputs,
                "total": memory.total,
                "grad_bytes": outputs,
                "nodes": nodes,
            }
        )

    def recorded_exchange(*args, **kw):
        keys[:] = exchange(*args, **kw)
        return keys

    def optimizer_with_grad_hook(cfg, model, **kw):
        opt = build_optimizer(cfg, model, **kw)
        names = [name for name, _ in model.named_parameters()]

        def record(optimizer, _args, _kwargs):
            params = dict(zip(names, model.parameters(), strict=True))
            steps[-1]["grads"] = {n: tg.full_tensor(p.grad).detach().clone() for n, p in params.items()}

        opt.register_step_pre_hook(record)
        return opt

    keys: list = []  # the node keys of the current reduce's exchange
    det_train.CanonicalGradAccumulator.reduce = measured_reduce
    tg.build_optimizer = optimizer_with_grad_hook
    dp_reduce.exchange_node_keys = recorded_exchange
    try:
        result = tg.train(cfg, rank=rank, world=world, device="cpu", **kwargs)
    finally:
        det_train.CanonicalGradAccumulator.reduce = reduce
        tg.build_optimizer = build_optimizer
        dp_reduce.exchange_node_keys = exchange
    return {
        "weights": result["state_dict"],
        "digest": result["digest"],
        "steps": steps,
        "numel": sum(t.numel() for t in result["state_dict"].values()),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def job_main(rank, world, micro_batch_seqs, batch_seqs=8, bucket_numel=None, fsdp=False):
    saved = dp_reduce.BUCKET_NUMEL
    if bucket_numel is not None:
        dp_reduce.BUCKET_NUMEL = bucket_numel
    try:
        cfg = config(micro_batch_seqs=micro_batch_seqs, batch_seqs=batch_seqs)
        return _instrumented_train(cfg, rank, world, fsdp=fsdp)
    finally:
        dp_reduce.BUCKET_NUMEL = saved


TIED_TOKENS, TIED_LEAF = 48, 4  # 12 leaves


def tied_batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(TIED_TOKENS, 37, generator=g)
    dy = torch.randn(3, TIED_TOKENS, 37, generator=g)
    return x, dy, torch.randn(37, generator=g), torch.randn(37, generator=g)


def job_tied(rank, world, bucket_numel=16):
    """``w`` used twice per micro-batch (two slots, the same node keys: one group holding each piece
    twice) and ``v`` once, fp32; rank shards of 3, 3, 2, 2, 2 ... leaves (1 or 2 nodes each), each
    cut into micro-batches of 5 tokens (open leaves carried), buckets of ``bucket_numel``
    elements: 37-element gradients cut across buckets."""
    from _canonical_toy import toy_scale_rows
    from det_core.testing import contiguous_splits

    x, dy, w0, v0 = tied_batch()
    w, v = w0.clone().requires_grad_(), v0.clone().requires_grad_()
    acc = det_train.CanonicalGradAccumulator([("w", w), ("v", v)], leaf_tokens=TIED_LEAF)
    start, end = contiguous_splits(TIED_TOKENS, world, TIED_LEAF)[rank]
    saved, dp_reduce.BUCKET_NUMEL = dp_reduce.BUCKET_NUMEL, bucket_numel
    try:
        for s in range(start, end, 5):
            e = min(s + 5, end)
            with acc.micro_batch(token_offset=s):
                for use, param, scale in ((0, w, 1.0), (1, w, 2.0), (2, v, 1.0)):
                    toy_scale_rows(x[s:e] * scale, param).backward(dy[use, s:e])
        acc.reduce(total_tokens=TIED_TOKENS)
    finally:
        dp_reduce.BUCKET_NUMEL = saved
    return {"w": w.grad, "v": v.grad}


def job_refused(rank, world, refusing=1):
    """Rank ``refusing``'s shard ends inside a leaf: its reduce raises its own error and every other
    rank's a ValueError naming it; none waits in a collective. Returns 1 per rank that raised as
    expected (2: raised something else; 0: did not raise)."""
    from _canonical_toy import toy_scale_rows

    leaf, tokens = 4, 8 * world
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(tokens, 5, generator=g), torch.randn(tokens, 5, generator=g)
    w = torch.randn(5, generator=g).requires_grad_()
    acc = det_train.CanonicalGradAccumulator([("w", w)], leaf_tokens=leaf)
    start, end = 8 * rank, 8 * rank + (7 if rank == refusing else 8)
    with acc.micro_batch(token_offset=start):
        toy_scale_rows(x[start:end], w).backward(dy[start:end])
    want = (
        "is open" if rank == refusing else f"data-parallel rank {refusing} refused the reduce: ValueError: w"
    )
    try:
        acc.reduce(total_tokens=tokens)
    except ValueError as err:
        if not re.search(want, str(err)):
            print(f"rank {rank}: {err}", file=sys.stderr)
        return {"code": 1 if re.search(want, str(err)) else 2}
    return {"code": 0}


def run_rank(rank: int, world: int, jobs: list[tuple[str, dict]], init_method: str, out_file: str) -> None:
    """Join a gloo group of ``world`` ranks, run ``jobs`` (``(name, kwargs)`` of ``job_<name>``) in
    order, and ``torch.save`` the list of their results."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        results = [globals()[f"job_{name}"](rank, world, **kwargs) for name, kwargs in jobs]
        torch.save(results, out_file)
    finally:
        dist.destroy_process_group()
