"""Ablation (GPU): RMSNorm backward prefetch depth and chunk-fold plans; det_train.rms_norm vs torch.

At the RMSNorm shapes M x D in {1024x768, 2048x768, 4096x768, 8192x4096} (bf16 rows, bf16 weight):

(a) ``_rms_norm_bwd_kernel`` alone (dX and the fp32 chunk sums of dweight, 16 rows per chunk) at
    ``PREFETCH`` 0 (the former kernel: each row waits on its own loads) and 1 (the shipped depth);
(b) the chunk folds as the backward produces them: ``M / 16`` chunk rows of ``N = D`` fp32, 64
    chunks per sub-leaf of 1024 tokens; ``_fold_chunks_resume_kernel`` from the leaf's start (skip
    0) and resumed 32 chunks into a leaf from a stored fold (skip 32, init), and ``_fold_chunks_kernel``;
    each at the former plan (BLOCK 1024, UNROLL 1, 4 warps), ``_fold_plan``'s and a few others;
(c) ``det_train.rms_norm`` fwd+bwd (canonical dweight, default leaves) vs ``torch.nn.functional.rms_norm``
    fwd+bwd: eager wall time (``triton.testing.do_bench``, median) and device time.

Device time: each call captured ``n`` times in one CUDA graph and replayed (``sweep_micro_batches``'s
``_device_us``: the median per call, no host time). Every variant's outputs are compared bit for
bit with the shipped setting's (``bits``: ``same`` / ``DIFF``; none of these settings may change
bits). One line per measurement, printed as it is measured. About a minute on an H200 (a cold
Triton cache included).

    python packages/det-train/benchmarks/ablate_norms.py            # on the GPU
    python packages/det-train/benchmarks/ablate_norms.py --dry-run  # CPU, interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv[1:]
if DRY:  # read when triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

_ROOT = Path(__file__).resolve().parents[3]
for _p in (_ROOT / "packages/det-train/torch-ext", _ROOT / "shared/det-core", Path(__file__).parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import det_train  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from det_train.accum import _leaf_sums as sums  # noqa: E402

rms = importlib.import_module("det_train.ops.rms_norm")  # the package's rms_norm is the function

SHAPES = ((32, 64), (48, 96)) if DRY else ((1024, 768), (2048, 768), (4096, 768), (8192, 4096))
ROWS = rms.MAX_ROWS_PER_CHUNK
CHUNKS_PER_LEAF = 2 if DRY else 1024 // ROWS  # a sub-leaf of 1024 tokens (tiny leaves in the dry run)
SKIP = 1 if DRY else 32
EPS = 1e-6
DEVICE = "cpu" if DRY else "cuda"
FOLD_PLANS = {"former 1024/U1/w4": (1024, 1, 4), "128/U8/w1": (128, 8, 1), "256/U8/w2": (256, 8, 2),
              "64/U32/w1": (64, 32, 1), "32/U16/w1": (32, 16, 1)}  # fmt: skip


def _device_us(fn) -> float | str:
    if DRY:  # no CUDA graphs: one timed call of the interpreter (checks the logic, not the speed)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from sweep_micro_batches import _device_us as graph_us

    return graph_us(fn)


def _wall_ms(fn) -> float:
    if DRY:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _fmt(v, unit="") -> str:
    return f"{v:10.2f}{unit}" if isinstance(v, float) else f"{str(v)[:40]:>10}"


def _line(part, shape, variant, us, base_us=None, bits="-", wall="-") -> None:
    ratio = f"{base_us / us:6.2f}x" if isinstance(us, float) and isinstance(base_us, float) else "     -"
    print(f"{part:<14} {shape:<10} {variant:<26} {_fmt(us)} us  {ratio}  wall {_fmt(wall)} ms  bits {bits}",
          flush=True)  # fmt: skip


def _same(got: tuple, ref: tuple) -> str:
    return "same" if all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)) else "DIFF"


def _launch(kernel, grid, args: tuple, meta: dict):
    return lambda: kernel[grid](*args, **meta)


def ablate_rms_bwd(m: int, d: int, gen) -> None:
    x = torch.randn(m, d, device=DEVICE, generator=gen).bfloat16()
    dy = torch.randn(m, d, device=DEVICE, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(d, device=DEVICE, generator=gen)).bfloat16()
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
    n_chunks = triton.cdiv(m, ROWS)
    block_d = triton.next_power_of_2(d)

    def run(prefetch):
        dx = torch.empty_like(x)
        partial = torch.empty((n_chunks, d), dtype=torch.float32, device=DEVICE)

        def call():
            rms._rms_norm_bwd_kernel[(n_chunks,)](
                dy, x, w, rstd, dx, partial, m, d, d, d, d, HAS_WEIGHT=True, OFFSET=0.0,
                ROWS_PER_CHUNK=ROWS, BLOCK_D=block_d, PREFETCH=prefetch, num_warps=rms.num_warps_for(block_d),
            )  # fmt: skip

        call()
        return call, (dx.clone(), partial.clone())

    _, ref = run(rms.BWD_PREFETCH)
    base = None
    for prefetch in (0, 1):
        call, out = run(prefetch)
        us = _device_us(call)
        base = us if prefetch == 0 else base
        label = f"prefetch {prefetch}" + (" (former)" if prefetch == 0 else "")
        label += " *" if prefetch == rms.BWD_PREFETCH else ""
        _line("(a) rms bwd", f"{m}x{d}", label, us, base, _same(out, ref))


def ablate_fold(m: int, d: int, gen) -> None:
    n_chunks = triton.cdiv(m, ROWS)
    partials = torch.randn(n_chunks, d, device=DEVICE, generator=gen) * torch.logspace(
        -3, 3, n_chunks, device=DEVICE
    ).unsqueeze(1)
    init = torch.randn(d, device=DEVICE, generator=gen)
    plans = dict(FOLD_PLANS)  # the former plan first: the baseline of the ratios
    plans["_fold_plan *"] = sums._fold_plan(d)
    for name, skip in (("(b) resume", 0), ("(b) resume", SKIP), ("(b) fold", 0)):
        resume = name == "(b) resume" and skip > 0
        n_out = triton.cdiv(skip + n_chunks, CHUNKS_PER_LEAF)
        if name == "(b) fold":
            ref = sums.fold_chunks(partials, CHUNKS_PER_LEAF)
        else:
            ref = sums.fold_chunks_resume(partials, CHUNKS_PER_LEAF, skip, init if resume else None)
        base = None
        for label, (block, unroll, warps) in plans.items():
            out = torch.empty((n_out, d), dtype=torch.float32, device=DEVICE)
            grid = (n_out, triton.cdiv(d, block))
            meta = dict(CHUNKS_PER_LEAF=CHUNKS_PER_LEAF, BLOCK=block, UNROLL=unroll, num_warps=warps)
            if name == "(b) fold":
                call = _launch(sums._fold_chunks_kernel, grid, (partials, out, n_chunks, d), meta)
            else:
                args = (partials, init if resume else partials, out, n_chunks, d, skip)
                call = _launch(sums._fold_chunks_resume_kernel, grid, args, dict(meta, RESUME=resume))
            call()
            bits = _same((out,), (ref,))
            us = _device_us(call)
            base = us if base is None else base
            if label.startswith("_fold_plan"):
                label = f"plan {block}/U{unroll}/w{warps} *"
            _line(f"{name} s{skip}", f"{m}x{d}", label, us, base, bits)


def compare_torch(m: int, d: int, gen) -> None:
    import torch.nn.functional as F

    x = torch.randn(m, d, device=DEVICE, generator=gen).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(d, device=DEVICE, generator=gen)).bfloat16().requires_grad_()
    dy = torch.randn(m, d, device=DEVICE, generator=gen).bfloat16()
    ours = lambda: torch.autograd.grad(det_train.rms_norm(x, w, EPS), (x, w), dy)  # noqa: E731
    peer = lambda: torch.autograd.grad(F.rms_norm(x, (d,), w, EPS), (x, w), dy)  # noqa: E731
    ref = ours()
    bits = _same(ours(), ref)  # run to run
    t_us, t_ms = _device_us(peer), _wall_ms(peer)
    o_us, o_ms = _device_us(ours), _wall_ms(ours)
    _line("(c) fwd+bwd", f"{m}x{d}", "torch F.rms_norm", t_us, t_us, "-", t_ms)
    _line("(c) fwd+bwd", f"{m}x{d}", "det_train.rms_norm", o_us, t_us, bits + " (run to run)", o_ms)
    if isinstance(o_ms, float):
        print(f"{'(c) wall':<14} {m}x{d:<6} torch / ours eager wall time: {t_ms / o_ms:.2f}x", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes (logic only)")
    parser.parse_args(argv)
    if not DRY and not torch.cuda.is_available():
        print("ablate_norms: needs a CUDA GPU (or --dry-run on the CPU)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    name = "cpu (interpreter, dry run)" if DRY else torch.cuda.get_device_name()
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}; ratio = baseline / this")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for m, d in SHAPES:
        ablate_rms_bwd(m, d, gen)
    for m, d in SHAPES:
        ablate_fold(m, d, gen)
    for m, d in SHAPES:
        compare_torch(m, d, gen)
    print(f"# done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
