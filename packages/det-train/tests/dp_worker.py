"""One rank of a gloo data-parallel test (run by test_distributed.py as a separate process).

``run_rank`` is started once per rank by test_distributed.py (forked from the test process, so
torch is not imported again); by hand: python dp_worker.py CASES RANK WORLD INIT_METHOD OUT_FILE.
Each case computes this rank's share of a fixed global batch and reduces gradients across the group.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from det_core.testing import contiguous_splits  # noqa: E402
from det_train.accum.grad_accum import CanonicalGradAccumulator  # noqa: E402

LEAF = 4
DEVICE = torch.device("cpu")  # run_rank sets cuda:<rank> for the NCCL test
TOKENS = 48  # 12 leaves


def _toy_batch():
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(TOKENS, 5, generator=g),
        torch.randn(TOKENS, 5, generator=g),
        torch.randn(5, generator=g),
    )


def case_accum_contiguous(rank, world):
    """Each rank holds a contiguous run of leaves, split again into two micro-batches."""
    from _canonical_toy import toy_scale

    x, dy, w0 = _toy_batch()
    w = w0.clone().requires_grad_()
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    start, end = contiguous_splits(TOKENS, world, LEAF)[rank]
    n_leaves = (end - start) // LEAF
    for a, b in contiguous_splits(end - start, min(2, n_leaves), LEAF):
        with acc.micro_batch(token_offset=start + a):
            toy_scale(x[start + a : start + b], w).backward(dy[start + a : start + b])
    acc.reduce(total_tokens=TOKENS)
    return {"w": w.grad}


def case_accum_interleaved(rank, world):
    """Round-robin leaves over ranks (not contiguous): leaf j goes to rank j % world."""
    from _canonical_toy import toy_scale

    x, dy, w0 = _toy_batch()
    w = w0.clone().requires_grad_()
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    for leaf in range(rank, TOKENS // LEAF, world):
        s = leaf * LEAF
        with acc.micro_batch(token_offset=s):
            toy_scale(x[s : s + LEAF], w).backward(dy[s : s + LEAF])
    acc.reduce(total_tokens=TOKENS)
    return {"w": w.grad}


# ---------------------------------------------------------------- a tiny model of det_train ops
V, D = 11, 6


class TinyLM(torch.nn.Module):
    """Embedding -> RMSNorm -> an elementwise (row-invariant) head -> cross-entropy."""

    def __init__(self, emb_dtype):
        import det_train

        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.emb = det_train.Embedding(V, D, dtype=emb_dtype)
        self.norm = det_train.RMSNorm(D)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(V, D, generator=g))
            self.norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))

    def forward(self, ids, targets, num_global_tokens):
        import det_train

        h = self.norm(self.emb(ids))
        logits = torch.cat([h, 0.5 * h[:, : V - D]], dim=1)
        return det_train.cross_entropy(logits, targets, num_global_tokens=num_global_tokens)


def _lm_batch(tokens):
    g = torch.Generator().manual_seed(3)
    ids, targets = torch.randint(0, V, (tokens,), generator=g), torch.randint(0, V, (tokens,), generator=g)
    return ids.to(DEVICE), targets.to(DEVICE)


def case_ops_accum(rank, world):
    """TinyLM through the accumulator: 46 tokens (12 leaves of 4, last short), 2 micro-batches per rank."""
    tokens = 46
    ids, targets = _lm_batch(tokens)
    model = TinyLM(torch.bfloat16).to(DEVICE)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    start, _ = contiguous_splits(48, world, LEAF)[rank]
    for a, b in contiguous_splits(48 // world, 2, LEAF):
        s, e = start + a, min(start + b, tokens)
        with acc.micro_batch(token_offset=s):
            model(ids[s:e], targets[s:e], tokens).backward()
    acc.reduce(total_tokens=tokens)
    return {name: p.grad for name, p in model.named_parameters()}


def case_ops_accum_odd(rank, world):
    """As ops_accum, each rank's shard cut into micro-batches of 3 tokens: leaves of 4 split between
    micro-batches, their rows carried by the accumulator (``deposit_rows``)."""
    tokens = 46
    ids, targets = _lm_batch(tokens)
    model = TinyLM(torch.bfloat16).to(DEVICE)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    start, end = contiguous_splits(48, world, LEAF)[rank]
    for s in range(start, min(end, tokens), 3):
        e = min(s + 3, end, tokens)
        with acc.micro_batch(token_offset=s):
            model(ids[s:e], targets[s:e], tokens).backward()
    acc.reduce(total_tokens=tokens)
    return {name: p.grad for name, p in model.named_parameters()}


def case_ops_accum_fixed(rank, world):
    """As ops_accum with fixed folds (``recoverable=False``): the RMSNorm weight's leaves folded in
    its fixed buffer, one micro-batch per leaf; the batch's short last leaf is still open at
    ``reduce`` (closed there, on the rank that holds it)."""
    tokens = 46
    ids, targets = _lm_batch(tokens)
    model = TinyLM(torch.bfloat16).to(DEVICE)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF, recoverable=False)
    acc.fixed_folds(model)
    start, end = contiguous_splits(48, world, LEAF)[rank]
    for s in range(start, min(end, tokens), LEAF):
        e = min(s + LEAF, tokens)
        with acc.micro_batch(s, num_tokens=e - s):
            model(ids[s:e], targets[s:e], tokens).backward()
    acc.reduce(total_tokens=tokens)
    return {name: p.grad for name, p in model.named_parameters()}


def _reduce_refused(
    rank: int, shard: tuple[int, int], total_tokens: int, want: str, poison: bool = False
) -> int:
    """One rank's micro-batch over ``shard`` of a 32-token toy batch, then ``reduce``: 1 if it raised
    an error matching ``want``, 2 for another message (printed), 0 if it did not raise. ``poison``:
    the accumulator is ``recoverable=False`` and the micro-batch raises after its backward (caught)."""
    import re

    from _canonical_toy import toy_scale_rows

    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(32, 5, generator=g), torch.randn(32, 5, generator=g)
    w = torch.randn(5, generator=g).requires_grad_()
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF, recoverable=not poison)
    start, end = shard
    try:
        with acc.micro_batch(token_offset=start):
            toy_scale_rows(x[start:end], w).backward(dy[start:end])
            if poison:
                raise KeyError("a simulated failure after the backward")
    except KeyError:
        pass
    try:
        acc.reduce(total_tokens=total_tokens)
    except (ValueError, RuntimeError) as err:
        if not re.search(want, str(err)):
            print(f"rank {rank}: {err}", file=sys.stderr)
        return 1 if re.search(want, str(err)) else 2
    return 0


def case_refused(rank, world):
    """Rank 0's shard ends inside a leaf (a user error): every rank's reduce raises, none hangs."""
    want = "leaf 3 .* is open" if rank == 0 else "data-parallel rank 0 refused the reduce: ValueError: w"
    shard = (0, 13) if rank == 0 else (16, 32)
    return {"refused": torch.tensor(_reduce_refused(rank, shard, 32, want))}


def case_poisoned(rank, world):
    """Rank 1's micro-batch raises after its deposits under recoverable=False (poisoned): its reduce
    raises the poisoning error and rank 0's names rank 1's, instead of waiting in a collective."""
    want = "is poisoned" if rank == 1 else "data-parallel rank 1 refused the reduce: RuntimeError: .*poisoned"
    shard = (0, 16) if rank == 0 else (16, 32)
    return {"poisoned": torch.tensor(_reduce_refused(rank, shard, 32, want, poison=rank == 1))}


def case_total_mismatch(rank, world):
    """The last rank passes another total_tokens to reduce (a user error): every rank raises the same
    ValueError naming each rank's value, before any data collective (none waits for another)."""
    want = r"ranks passed different total_tokens to reduce: rank 0: 32, rank 1: 36"
    shard, total = ((0, 16), 32) if rank == 0 else ((16, 32), 32 + LEAF)
    return {"mismatch": torch.tensor(_reduce_refused(rank, shard, total, want))}


def case_fsdp_accum(rank, world):
    """As ops_accum, with the model sharded by FSDP2 (fully_shard, uneven shards; an empty one at DP 4)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tokens = 46
    ids, targets = _lm_batch(tokens)
    model = TinyLM(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.emb, mesh=mesh)
    fully_shard(model.norm, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF).track_fsdp(model)
    start, _ = contiguous_splits(48, world, LEAF)[rank]
    for a, b in contiguous_splits(48 // world, 2, LEAF):
        s, e = start + a, min(start + b, tokens)
        with acc.micro_batch(token_offset=s):
            model(ids[s:e], targets[s:e], tokens).backward()
    acc.reduce(total_tokens=tokens)
    return {
        name.replace("_fsdp_wrapped_module.", ""): p.grad.full_tensor()
        for name, p in model.named_parameters()
    }


def _ddp_hook_case(rank, world, n_leaves):
    import det_train
    import det_train.accum._leaf_sums as leaf_sums
    import det_train.accum.deposit as deposit
    from torch.nn.parallel import DistributedDataParallel as DDP

    leaf_sums.DEFAULT_LEAF_TOKENS = LEAF  # the ops' plain-backward leaf size, small for the test
    deposit.DEFAULT_LEAF_TOKENS = LEAF  # what accumulation() gives the ops outside a micro-batch
    tokens = n_leaves * LEAF
    ids, targets = _lm_batch(tokens)
    model = TinyLM(torch.float32).to(DEVICE)
    model = DDP(model, device_ids=[DEVICE.index]) if DEVICE.type == "cuda" else DDP(model)
    model.register_comm_hook(
        det_train.DeterministicAllreduceState(average=False), det_train.deterministic_allreduce_hook
    )
    start, end = contiguous_splits(tokens, world, LEAF)[rank]
    model(ids[start:end], targets[start:end], tokens).backward()
    return {name: p.grad for name, p in model.module.named_parameters()}


def case_hook8(rank, world):
    return _ddp_hook_case(rank, world, 8)


def case_hook12(rank, world):
    return _ddp_hook_case(rank, world, 12)


def run_rank(rank, world, cases, init_method, out_file, backend="gloo"):
    """Join the group, run each case (comma-separated names), torch.save the gradients (on CPU).

    ``backend="nccl"`` runs on cuda:<rank> (the cases that support a device: ops_accum, hook*).
    """
    global DEVICE
    torch.set_num_threads(1)
    if backend == "nccl":
        DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        out = {}
        for case in cases.split(","):
            for name, value in globals()[f"case_{case}"](rank, world).items():
                out[f"{case}/{name}"] = value.detach().cpu().clone()
        torch.save(out, out_file)
    finally:
        dist.destroy_process_group()


def main():
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any det_train kernel module is imported
    cases, rank, world, init_method, out_file = sys.argv[1:6]
    run_rank(int(rank), int(world), cases, init_method, out_file)


if __name__ == "__main__":
    main()
