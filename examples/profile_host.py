"""Host-time probe (CPU): one det training step of the main job with every Triton launch stubbed out.

    python examples/profile_host.py                 # gpu preset's code paths at width 256, 12 layers
    python examples/profile_host.py --width 64      # less torch CPU arithmetic (shape classes forced)
    python examples/profile_host.py --top 40 --sort cumtime

The step is bench_step.py's det eager step (forward + backward of each micro-batch under the
CanonicalGradAccumulator, ``acc.reduce``, ``AdamWSR.step``, ``zero_grad``) on CPU, with every
``kernel[grid](...)`` replaced by a counter (``det_core.launch``'s ``launch`` and ``BoundLaunch``,
in every package's vendored copy too, are ``kernel[grid]`` under the interpreter): outputs are
garbage, only the host's Python and torch work runs. It reports the host time per step without
launches (min over repeats), the launches per step by kernel, the torch ops per step
(torch.profiler) and the Python functions with the most time (cProfile).

The shapes keep the gpu preset's code paths: 32 sequences (of 64 tokens here, 1024 there) in
``--micro-batches`` micro-batches, leaves of ``--leaf-seqs`` sequences (8: the preset's 8192-token
leaves, so at 8 and 16 micro-batches every leaf is split in 2 and 4 and carried as open leaves),
every Linear in the "large" shape class, the TMA forward (1024 rows). At ``--width`` below 256 the
shape class is forced to "large" (configs.shape_class):
the host path of the gpu preset with less CPU arithmetic. What remains of torch's CPU arithmetic
(elementwise ops, tree adds) is host time here but device time on a GPU; glibc is told to keep
freed memory (mallopt) so that allocations cost about what the CUDA caching allocator's do.
CPU only; not a benchmark of the GPU step (examples/bench_step.py is).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import importlib
import io
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the ops' device checks
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step  # noqa: E402
import torch  # noqa: E402
import train_gpt as tg  # noqa: E402

LAUNCHES: collections.Counter = collections.Counter()


def _count_launch(kernel, grid, *args, **kwargs):
    LAUNCHES[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1


def stub_launches() -> None:
    """Replace every Triton launch (``kernel[grid]`` of jitted and interpreted kernels, which
    ``det_core.launch.launch`` and ``BoundLaunch`` call under the interpreter) by a counter."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    def getitem(kernel, grid):
        return lambda *args, **kwargs: _count_launch(kernel, grid)

    jit.JITFunction.__getitem__ = getitem
    interpreter.InterpretedFunction.__getitem__ = getitem


def keep_freed_memory() -> None:
    """glibc: no mmap per large tensor and no trimming, so a freed block is reused as the CUDA
    caching allocator reuses its blocks (otherwise each large CPU allocation is a syscall and page
    faults, which a GPU step does not pay)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    libc.mallopt(m_trim_threshold, 1 << 30)


def make_step(
    width: int, layers: int, micro_batches: int = 2, leaf_seqs: int = 8, fixed_folds: bool = False
) -> bench_step.Step:
    if width < 256:  # every Linear in the large shape class, as at the gpu preset's widths
        importlib.import_module("det_train.ops.configs").shape_class = lambda n, k: "large"
    cfg = tg.make_config(
        "gpu", d_model=width, n_head=width // 64, d_ff=width, seq_len=64, batch_seqs=32,
        micro_batch_seqs=32 // micro_batches, leaf_tokens=64 * leaf_seqs, n_layer=layers,
    )  # fmt: skip
    return bench_step.make_step(cfg, micro_batches, torch.device("cpu"), fixed_folds=fixed_folds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256, help="d_model = d_ff (a multiple of 64)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches of the 32 sequences")
    p.add_argument("--leaf-seqs", type=int, default=8, help="sequences per canonical leaf (preset: 8)")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="the minimum over repeats is reported")
    p.add_argument(
        "--fixed-folds", action="store_true", help="the accumulator's fixed_folds (recoverable=False)"
    )
    p.add_argument("--top", type=int, default=25, help="Python functions listed (0: none)")
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumtime, ...)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    stub_launches()
    if 32 % args.micro_batches:
        p.error(f"--micro-batches must divide the 32 sequences, got {args.micro_batches}")
    step = make_step(args.width, args.layers, args.micro_batches, args.leaf_seqs, args.fixed_folds)
    for _ in range(3):  # plans, caches and optimizer states
        step.run()
    times = []
    for _ in range(args.repeats):
        LAUNCHES.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            step.run()
        times.append((time.perf_counter() - start) / args.steps)
    print(
        f"host time per step, launches stubbed: {min(times) * 1e3:.2f} ms (min of {args.repeats}; "
        f"{args.micro_batches} micro-batches, leaves of {args.leaf_seqs} sequences)"
    )
    per_step = {name: count / args.steps for name, count in LAUNCHES.items()}
    print(f"launches per step: {sum(per_step.values()):.0f}")
    for name, count in sorted(per_step.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {count:6.1f}  {name}")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step.run()
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    print(f"torch ops per step: {sum(e.count for e in ops)}")
    for e in sorted(ops, key=lambda e: -e.count)[:12]:
        print(f"  {e.count:6d}  {e.key}")

    import cProfile
    import pstats

    host = cProfile.Profile()
    host.enable()
    for _ in range(args.steps):
        step.run()
    host.disable()
    stats = pstats.Stats(host)
    print(f"Python function calls per step: {stats.total_calls / args.steps:.0f}")
    if args.top:
        text = io.StringIO()
        stats.stream = text
        stats.sort_stats(args.sort).print_stats(args.top)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
