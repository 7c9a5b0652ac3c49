"""Benchmark: the deterministic data-parallel reduction against NCCL's own collectives.

    torchrun --nproc-per-node 8 examples/bench_reduce.py --out docs/benchmarks
    torchrun --nproc-per-node 4 examples/bench_reduce.py --leaves-per-rank 3
    torchrun --nproc-per-node 2 examples/bench_reduce.py --device cpu --preset tiny   # gloo smoke run

The gradients are those of the main job's GPT (examples/train_gpt.py, ``--preset``: "gpu" is
~100 M parameters in bf16). Every rank holds the partial canonical trees a rank of a data-parallel
step holds before ``CanonicalGradAccumulator.reduce``: ``--leaves-per-rank`` consecutive leaves of
the global batch, as maximal aligned subtrees (1 node per parameter for a power of two, e.g. 2 for
3 leaves). Timed, side by side in one process group of W ranks:

* **owner (replicated)**: ``dp_reduce.exchange_node_keys`` + ``owner_reduce`` (the metadata
  all-gather, per 32 MiB bucket one all-to-all of node slices, the owner's tree, one all-gather in
  bf16): every rank ends with the full gradient, as after DDP's all-reduce;
* **owner (FSDP2)**: the same with every parameter sharded (no all-gather): each rank ends with
  its dim-0 ``torch.chunk``, as after FSDP2's reduce-scatter;
* **NCCL all-reduce fp32** and **NCCL reduce-scatter fp32** of one flat fp32 buffer of all
  gradients (the non-deterministic references for the two rows above);
* **all-gather of fp32 nodes**: ``all_gather_single`` of one fp32 copy of the gradients per rank,
  the traffic of the reduction this one replaced (one ``all_gather`` per parameter of every
  rank's nodes).

"bytes per rank" is what this rank sends (wrappers count the collectives' logical transfers: an
all-to-all's splits for other ranks, ``(W - 1)`` times an all-gather's input), for the NCCL rows
the ring algorithm's ``(W - 1) / W`` of the buffer per phase. Median of ``--repeat`` timed calls
after ``--warmup``, each ended by a device synchronisation and a barrier. Writes
``DIR/det-train_dp_reduce_W<W>.md`` and ``.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

_ROOT = Path(__file__).resolve().parent.parent
for _src in ("packages/det-train/torch-ext", "shared/det-core"):
    if str(_ROOT / _src) not in sys.path:
        sys.path.insert(0, str(_ROOT / _src))
sys.path.insert(0, str(_ROOT / "examples"))


def parameter_shapes(preset: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the main job's GPT parameters for ``preset`` (built on the meta device)."""
    import train_gpt as tg
    from gpt import GPT

    with torch.device("meta"):
        model = GPT(tg.make_config(preset).model_config(), kernels="torch")
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def rank_partials(shapes, rank: int, leaves_per_rank: int, device) -> dict:
    """This rank's partial trees: leaves ``[rank * k, (rank + 1) * k)`` of each parameter, random fp32."""
    from det_core.reduce import TreePartial

    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    partials = {}
    first = rank * leaves_per_rank
    for index, (_, shape) in enumerate(shapes):
        tree = TreePartial()
        for leaf in range(first, first + leaves_per_rank):
            tree.add_leaves(leaf, [torch.randn(shape, generator=gen, device=device)])
        partials[(index, 0)] = tree
    return partials


class SentBytes:
    """Counts the bytes this rank sends through all_to_all_single / all_gather_single while active."""

    def __init__(self) -> None:
        self.sent = 0

    def __enter__(self):
        from det_train.accum import dp_reduce

        self._saved = dist.all_to_all_single, dp_reduce.all_gather_single
        a2a, gather = self._saved
        world, rank = dist.get_world_size(), dist.get_rank()

        def counted_a2a(out, inp, out_splits=None, in_splits=None, **kw):
            splits = in_splits or [inp.numel() // world] * world
            self.sent += (sum(splits) - splits[rank]) * inp.element_size()
            return a2a(out, inp, out_splits, in_splits, **kw)

        def counted_gather(out, inp, group=None, async_op=False):
            self.sent += (world - 1) * inp.numel() * inp.element_size()
            return gather(out, inp, group, async_op)

        dist.all_to_all_single, dp_reduce.all_gather_single = counted_a2a, counted_gather
        return self

    def __exit__(self, *exc):
        from det_train.accum import dp_reduce

        dist.all_to_all_single, dp_reduce.all_gather_single = self._saved


def timed(fn, device, warmup: int, repeat: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` calls (each synchronised, then a barrier)."""
    times = []
    for i in range(warmup + repeat):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpu", help="train_gpt.py preset whose parameters are reduced")
    p.add_argument("--leaves-per-rank", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--out", default=None, help="folder for det-train_dp_reduce_W<W>.md / .json")
    args = p.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        print("bench_reduce.py runs a process per rank: torchrun --nproc-per-node W examples/bench_reduce.py")
        return 1

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        rows = run(args, device, world, rank)
        dist.barrier()  # no rank leaves while another is still in a collective
    finally:
        dist.destroy_process_group()
    if rank == 0:
        report(args, rows, world, device)
    return 0


def run(args, device, world: int, rank: int) -> list[dict]:
    from det_train.accum import dp_reduce

    shapes = parameter_shapes(args.preset)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    partials = rank_partials(shapes, rank, args.leaves_per_rank, device)
    total_leaves = world * args.leaves_per_rank
    flat = torch.randn(numel, device=device)

    def owner(sharded: bool):
        specs = [dp_reduce.GradSpec(n, s, torch.bfloat16, device, sharded=sharded) for n, s in shapes]

        def call():
            keys = dp_reduce.exchange_node_keys(partials, specs)
            return dp_reduce.owner_reduce(specs, partials, keys, total_leaves)

        return call

    chunk = -(-numel // world)
    padded = torch.nn.functional.pad(flat, (0, chunk * world - numel))
    shard = torch.empty(chunk, device=device)
    gathered = torch.empty(world * numel, device=device)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ring = (world - 1) / world * numel * 4  # bytes a rank sends in one ring phase over the fp32 buffer
    all_nodes = (world - 1) * numel * 4  # an all-gather of one fp32 node per rank
    lib = dist.get_backend().upper()  # NCCL on GPUs (gloo: a CPU smoke run)
    cases = [
        ("owner (replicated)", owner(False), None, f"{lib} all-reduce fp32"),
        ("owner (FSDP2)", owner(True), None, f"{lib} reduce-scatter fp32"),
        (f"{lib} all-reduce fp32", lambda: dist.all_reduce(flat), 2 * ring, None),
        (f"{lib} reduce-scatter fp32", lambda: reduce_scatter(shard, padded), ring, None),
        ("all-gather of fp32 nodes", lambda: dp_reduce.all_gather_single(gathered, flat), all_nodes, None),
    ]  # fmt: skip
    rows = []
    for name, fn, sent, versus in cases:
        if sent is None:
            with SentBytes() as counter:
                fn()
            sent = counter.sent
        ms = timed(fn, device, args.warmup, args.repeat)
        rows.append({"op": name, "bytes_per_rank": int(sent), "ms": ms, "versus": versus})
    times = {r["op"]: r["ms"] for r in rows}
    for r in rows:
        r["ratio"] = r["ms"] / times[r["versus"]] if r["versus"] else None
    rows.append({"numel": numel, "leaves_per_rank": args.leaves_per_rank})
    return rows


def report(args, rows, world: int, device) -> None:
    meta = rows.pop()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo)"
    title = (
        f"W = {world}, {meta['numel']:,} parameters ({args.preset} preset, bf16), "
        f"{meta['leaves_per_rank']} leaves per rank, {gpu}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    lines = [
        title,
        "",
        "| W | op | bytes per rank | ms | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x {r['versus']}" if r["ratio"] is not None else ""
        lines.append(f"| {world} | {r['op']} | {r['bytes_per_rank']:,} | {r['ms']:.3f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"det-train_dp_reduce_W{world}.md").write_text(table + "\n")
        payload = {"title": title, "world": world, **meta, "rows": rows}
        (out / f"det-train_dp_reduce_W{world}.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
