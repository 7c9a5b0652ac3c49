"""Host-time diagnostic (GPU): where an eager det step's host time goes, beside torch's.

    python examples/host_time.py                      # step at 16 micro-batches, launch costs, RMSNorm
    python examples/host_time.py --micro-batches 8 --impl det --top 40

Three parts, each printed as ``## ...`` lines (the cProfile tables follow the step lines):

* **step**: bench_step.py's eager training step (the gpu preset, 32 x 1024 tokens in
  ``--micro-batches`` micro-batches) of each ``--impl``: the host time to enqueue a step and its
  wall time (equal when the step is host-bound), with autograd's default device thread and with the
  backward on the calling thread; then the Python functions with the most own time over one step
  (``cProfile``, ``--top`` rows; ``--top 0`` skips it).
* **launch**: host microseconds per call of one 4-pointer Triton kernel launched four ways
  (``det_core.launch.BoundLaunch``, ``kernel[grid]``, the compiled kernel's ``run``) and of a few
  torch calls every op makes (``torch.empty``, an in-place add, a view), on this machine.
* **ops**: host and wall time per call of ``det_train.rms_norm`` forward + backward
  (``torch.autograd.grad``) against ``F.rms_norm`` at 1024 x 768, with the default and the calling
  thread.

Host time here is not device time: it is what an eager step pays on this machine's CPU, which
``examples/profile_host.py`` estimates without a GPU. A diagnostic, not a benchmark with a target
(``examples/bench_step.py`` and ``packages/det-train/benchmarks/bench_norms.py`` are).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402
import train_gpt as tg  # noqa: E402


def host_and_wall(fn, calls: int) -> tuple[float, float]:
    """Seconds per call to enqueue ``calls`` calls of ``fn`` (no synchronisation between them) and
    until the device finished them."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / calls


def on_calling_thread(fn):
    """``fn`` with every backward run on the calling thread (not autograd's device thread)."""

    def run():
        with torch.autograd.set_multithreading_enabled(False):
            fn()

    return run


def top_functions(fn, rows: int) -> str:
    """The ``rows`` Python functions with the most own time over one call of ``fn`` (cProfile)."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def step_part(micro_batches: int, impls: list[str], top: int) -> None:
    overrides = dict(batch_seqs=32, micro_batch_seqs=32 // micro_batches)
    configs = {
        "torch": tg.make_config(
            "gpu", kernels="torch", optimizer="torch_adamw", rounding="nearest", **overrides
        ),
        "det": tg.make_config("gpu", **overrides),
    }
    for name in impls:
        step = bench_step.make_step(configs[name], micro_batches, "cuda")
        for _ in range(2):  # compilation, autotuning-free plans, allocator warm-up
            step.run()
        host, wall = host_and_wall(step.run, 3)
        host1, wall1 = host_and_wall(on_calling_thread(step.run), 3)
        print(
            f"## step {name} {micro_batches} micro-batches: host {host * 1e3:.1f} wall {wall * 1e3:.1f} "
            f"ms/step (default threading); host {host1 * 1e3:.1f} wall {wall1 * 1e3:.1f} (backward on the "
            "calling thread)",
            flush=True,
        )
        if top:
            print(top_functions(step.run, top), flush=True)
        del step
        torch.cuda.empty_cache()


def launch_part() -> None:
    import triton
    import triton.language as tl
    from det_core.launch import BoundLaunch

    @triton.jit
    def copy_kernel(a, b, c, d, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(b + offs, tl.load(a + offs, mask=offs < n), mask=offs < n)

    a = torch.randn(1024, device="cuda")
    b = torch.empty_like(a)
    bound = BoundLaunch(copy_kernel, 4, (1024,), BLOCK=1024)
    for _ in range(3):
        bound((1,), a, b, a, b)
    compiled = copy_kernel[(1,)](a, b, a, b, 1024, BLOCK=1024)
    stream = torch.cuda.current_stream().cuda_stream
    meta, function = compiled.packed_metadata, compiled.function
    args = (a, b, a, b, 1024, 1024)  # the constexpr too: Triton 3.6's C launch takes every parameter
    cases = {
        "BoundLaunch": lambda: bound((1,), a, b, a, b),
        "kernel[grid]": lambda: copy_kernel[(1,)](a, b, a, b, 1024, BLOCK=1024),
        "compiled.run": lambda: compiled.run(1, 1, 1, stream, function, meta, None, None, None, *args),
        "torch.empty": lambda: torch.empty(16, device="cuda"),
        "add_": lambda: a.add_(1),
        "view": lambda: a.view(-1),
    }
    cells = []
    for name, fn in cases.items():
        host, _ = host_and_wall(fn, 2000)
        cells.append(f"{name} {host * 1e6:.2f}")
    print("## launch host us per call: " + ", ".join(cells), flush=True)


def ops_part() -> None:
    import det_train
    import torch.nn.functional as F

    x = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    cases = {
        "det rms_norm": lambda: torch.autograd.grad(det_train.rms_norm(x, w, 1e-6), (x, w), dy),
        "torch F.rms_norm": lambda: torch.autograd.grad(F.rms_norm(x, (768,), w, 1e-6), (x, w), dy),
    }
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        host, wall = host_and_wall(fn, 200)
        host1, wall1 = host_and_wall(on_calling_thread(fn), 200)
        print(
            f"## ops {name} fwd+bwd 1024x768: host {host * 1e6:.1f} wall {wall * 1e6:.1f} us/call; "
            f"calling thread host {host1 * 1e6:.1f} wall {wall1 * 1e6:.1f}",
            flush=True,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", type=int, default=16, help="micro-batches of the 32 x 1024-token batch")
    p.add_argument("--impl", default="torch,det", help="comma-separated: torch, det")
    p.add_argument("--top", type=int, default=28, help="cProfile rows per step (0: none)")
    p.add_argument("--parts", default="step,launch,ops", help="comma-separated: step, launch, ops")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_time.py needs a CUDA GPU (examples/profile_host.py is the CPU probe)")
        return 1
    parts = args.parts.split(",")
    if "step" in parts:
        step_part(args.micro_batches, args.impl.split(","), args.top)
    if "launch" in parts:
        launch_part()
    if "ops" in parts:
        ops_part()
    return 0


if __name__ == "__main__":
    sys.exit(main())
