"""What one training step costs the host (GPU): host time per step, kernel launches per step, and a
profile of where the time goes. Used by examples/bench_step.py (``--counts``, ``--compile``,
``--profile``); each function takes the step as a no-argument callable.

**Determinism:** measurements only: the step runs as it would unmeasured (a profiled step runs the
same kernels on the same data).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HOST_NOTE = (
    "Host ms: time.perf_counter around one eager step started on an idle device (after "
    "torch.cuda.synchronize, not waiting for the device: the step's Python and launch time), median of 5 "
    "steps; a step that fills the device's launch queue blocks in its launches, and then counts device "
    "time too. Launches: the kernels one eager step runs (torch.profiler, ProfilerActivity.CUDA: Triton, "
    "cuBLAS, cuDNN and torch kernels; copies and memsets not counted), one profiled step."
)


def profile_step(step, steps: int = 3, top: int = 30) -> str:
    """Host wall time per step against device busy time, and the ops with the most device time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    enqueue_ms = (time.perf_counter() - t0) / steps * 1e3  # python returns before the GPU finishes...
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3  # ...so launch-bound when enqueue_ms ~ wall_ms
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [  # device events without record_function's GPU ranges (they overlap the kernels)
        e
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    device_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        step()
    host.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(35)
    table = events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    return (
        f"host {enqueue_ms:.1f} ms/step to enqueue, wall {wall_ms:.1f} ms/step, "
        f"device busy {device_ms:.1f} ms/step (sum of kernel times)\n{table}\n{by_cpu}\n"
        f"python functions by own time ({steps} steps):\n{text.getvalue()}"
    )


def host_ms(fn: Callable[[], None], steps: int = 5, synchronize=torch.cuda.synchronize) -> float:
    """Median host milliseconds of one call of ``fn`` started on an idle device (after
    ``synchronize()``), not waiting for the device: the step's Python and launch time. A launch
    blocks while the device's launch queue is full, so a step that enqueues more work than the queue
    holds also counts device time."""
    times = []
    for _ in range(steps):
        synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    synchronize()
    return statistics.median(times) * 1e3


def kernel_launches(fn: Callable[[], None], device_type: str = "cuda") -> int:
    """Device kernels (Triton's, cuBLAS's, cuDNN's, torch's) that one call of ``fn`` runs, counted in
    a torch.profiler trace (``ProfilerActivity.CUDA``); memory copies and memsets are not kernels.
    ``device_type="cpu"`` profiles the host only (0 kernels: the tests' dry run).

    Raises:
        RuntimeError: a CUDA trace without any kernel (the profiler saw no device activity).
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device_type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync()
    with profile(activities=activities) as prof:
        fn()
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.json"
        prof.export_chrome_trace(str(path))
        count = count_kernels(json.loads(path.read_text(errors="replace")))
    if cuda and count == 0:
        raise RuntimeError("the profiler recorded no kernel: CUPTI collected no device activity")
    return count


def count_kernels(trace: dict) -> int:
    """The kernel events (category ``"kernel"``, one per launch) of a chrome trace's ``traceEvents``."""
    return sum(1 for event in trace.get("traceEvents", []) if str(event.get("cat", "")).lower() == "kernel")
