"""Host-time probe: microseconds of Python per ``det_attn.attention`` call, forward and backward.

    python packages/det-attn/benchmarks/host_attention.py                  # CPU, launches stubbed
    python packages/det-attn/benchmarks/host_attention.py --mode direct    # CPU, launch keying kept
    python packages/det-attn/benchmarks/host_attention.py --gpu --shape 1,128,2,128   # H200

On CPU (default; under ``TRITON_INTERPRET=1``, so the interpreter's config row: the same Python
path as on the GPU, other block sizes) nothing is computed (outputs are garbage), in two modes:

- ``stub``: every launch (det-core's ``launch`` and ``kernel[grid]``) is a no-op, as in
  ``examples/profile_host.py``: the host time of det_attn's own Python.
- ``direct``: det-core's ``launch`` and ``BoundLaunch`` take their direct path (the one
  Triton 3.6 gets on the GPU: keying the arguments, finding the compiled kernel), only the final
  ``compiled.run`` stubbed: det_attn's Python plus what its launches cost on the host there.

Large CPU tensors cost an ``mmap`` per allocation (B4 T1024 H32 D128 bf16 is 32 MiB: above glibc's
largest mmap threshold), host time a GPU's caching allocator does not spend; the same for every
version of the code, so before / after differences stand. With ``--gpu`` the launches are real: the
wall time per call is the host time when the shape's device time is shorter (a small shape such as
``1,128,2,128``). Rows: ``attention()`` without grad, the launcher alone (the plan and its forward
launch, ``_plans``: no checks, no autograd), ``attention()`` forward with grad, forward + backward
(``torch.autograd.grad``); each the minimum over repeats of the mean per call.
``DET_ATTN_SRC=DIR`` imports det_attn from ``DIR`` (a checkout of another version: before / after
on the same machine). Not a test, not a benchmark of the kernels (``bench_attention.py`` is).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys
import time
from pathlib import Path

if "--gpu" not in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the device checks
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [
    os.environ.get("DET_ATTN_SRC", str(ROOT / "packages/det-attn/torch-ext")),
    str(ROOT / "shared/det-core"),
]

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from det_attn import _fwd_kernel, attention  # noqa: E402
from det_attn import flash_attention as fa  # noqa: E402

try:
    from det_attn import _bwd_kernels, _plans  # noqa: E402
except ImportError:  # a version from before the host code was split by role (DET_ATTN_SRC)
    from det_attn import _kernels as _bwd_kernels  # noqa: E402

    _plans = None
from det_core import launch as det_launch  # noqa: E402
from det_core import runtime  # noqa: E402

KERNELS = ("attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")


def keep_freed_memory() -> None:
    """glibc: reuse freed blocks as the CUDA caching allocator does (no trimming; mmap only above
    glibc's largest threshold)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's maximum
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


class _Compiled:
    """Stands for a compiled kernel: ``run`` does nothing."""

    function = packed_metadata = None

    def run(self, *args):
        pass


class _FakeKernel:
    """A kernel for ``det_core.launch``'s direct path on CPU: the real ``JITFunction``'s parameters (what
    the launch keys read); ``kernel[grid](...)`` returns a ``_Compiled`` without compiling."""

    def __init__(self, fn) -> None:
        dns = ["n_tiles"] if "n_tiles" in fn.__code__.co_varnames else None
        real = jit.JITFunction(fn, do_not_specialize=dns)
        self.params, self.signature, self.__name__ = real.params, real.signature, fn.__name__
        self.pre_run_hooks, self.used_global_vals = [], {}
        self._compiled = _Compiled()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._compiled


def stub_all() -> None:
    def getitem(kernel, grid):
        return lambda *args, **kwargs: None

    def no_launch(kernel, grid, *args, **kwargs):
        return None

    runtime.launch = no_launch  # det_attn versions that call det_core.runtime.launch
    if _plans is not None and hasattr(_plans, "launch"):
        _plans.launch = no_launch  # det_attn versions that import it from det_core.launch
    jit.JITFunction.__getitem__ = getitem
    interpreter.InterpretedFunction.__getitem__ = getitem


def direct_path() -> None:
    from triton import knobs

    for module in (_fwd_kernel, _bwd_kernels):
        for name in KERNELS:
            if hasattr(module, name):
                setattr(module, name, _FakeKernel(getattr(module, name).fn))
    torch.cuda.current_device = lambda: 0
    det_launch._direct_launch, det_launch._knobs = True, knobs


def _per_call(fn, calls: int, repeats: int, grad: bool, sync) -> float:
    with torch.set_grad_enabled(grad):
        fn()
        fn()  # plans, caches, compiles
        sync()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("stub", "direct"), default="stub", help="CPU launch mode")
    p.add_argument("--gpu", action="store_true", help="real launches on the GPU")
    p.add_argument("--shape", default="4,1024,32,128", help="B,T,H,D")
    p.add_argument("--kv-heads", type=int, default=0, help="H_kv (0: H)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout_p (a new seed per call)")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--profile", type=int, default=0, help="cProfile rows of the no_grad call (0: none)")
    args = p.parse_args(argv)
    if args.gpu:
        device, sync, mode = torch.device("cuda"), torch.cuda.synchronize, "gpu"
    else:
        device, sync, mode = torch.device("cpu"), lambda: None, args.mode
        torch.set_num_threads(1)
        keep_freed_memory()
        if args.mode == "direct":
            direct_path()
        else:
            stub_all()
    b, t, h, d = map(int, args.shape.split(","))
    h_kv = args.kv_heads or h
    q = torch.randn(b, t, h, d, device=device).to(torch.bfloat16)
    k = torch.randn(b, t, h_kv, d, device=device).to(torch.bfloat16)
    v = torch.randn(b, t, h_kv, d, device=device).to(torch.bfloat16)
    do = torch.randn(b, t, h, d, device=device).to(torch.bfloat16)
    seeds = iter(range(1 << 62))
    kw = dict(causal=args.causal, dropout_p=args.dropout)

    def call(q, k, v):
        return attention(q, k, v, seed=next(seeds) if args.dropout else None, **kw)

    flat = tuple(x.view(b * t, *x.shape[2:]) for x in (q, k, v))
    scale = 1.0 / math.sqrt(d)

    def launcher():
        seed = next(seeds) if args.dropout else None
        if _plans is None:
            fa._forward(*flat, None, None, (b, t, t), t, scale, args.causal, args.dropout, seed, 0, 0, t)
            return
        plan = _plans.padded_plan(q, k, v, None, args.causal, scale, args.dropout > 0.0)
        drop = _plans.dropout_args(args.dropout, seed, 0, 0) if plan.dropout else None
        _plans.launch_forward(plan, *_plans.kernel_inputs(q, k, v, plan.dense), None, None, drop)

    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    rows = (
        ("attention, no grad", lambda: call(q, k, v), False),
        ("launcher (plan + launch)", launcher, False),
        ("attention, grad", lambda: call(qg, kg, vg), True),
        ("forward + backward", lambda: torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do), True),
    )
    print(f"det_attn from {Path(fa.__file__).parent}")
    print(f"{mode}: B,T,H,D = {args.shape}, H_kv {h_kv}, causal {args.causal}, dropout {args.dropout}")
    for name, fn, grad in rows:
        print(f"  {name:22s} {_per_call(fn, args.calls, args.repeats, grad, sync):8.1f} us/call")
    print(f"  plans cached: {len(fa._PLANS if _plans is None else _plans.PLANS)}")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        with torch.no_grad():
            prof.enable()
            for _ in range(args.calls):
                call(q, k, v)
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
