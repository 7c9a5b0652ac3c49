"""Ablation (GPU): the open leaf's dW fold (``weight_grad_fold``) in 8 micro-batches vs cuBLAS's same GEMMs.

A micro-batch that ends inside a canonical leaf (8192 tokens) leaves the leaf's fp32 dW fold open;
the next micro-batch's ``weight_grad_fold`` loads each ``(block_n, block_k)`` fp32 tile of it,
adds its own tokens in 64-token steps and stores the tile (what ``det_train.linear``'s deposit does
through ``CanonicalGradAccumulator``). For each shape M x K x N (M tokens in ``MICRO_BATCHES``
contiguous micro-batches of M / 8 tokens, K in, N out), this times the chain of 8 fold calls (the
first from no carry, the others resumed, ping-pong fp32 buffers: no allocation) for every
candidate, side by side with cuBLAS:

- ``peer``: cuBLAS's same 8 GEMMs accumulated into a bf16 ``p.grad`` (the first assigned, the
  others ``add_``: AccumulateGrad's way; ``bench_matmul``'s peer of ``dW 8mb``, target 0.90x);
- ``gemm``: the 8 GEMMs alone (``out=``, no adds): 8x "one cuBLAS GEMM of M / 8 tokens".

Candidates: the shipped kernel (``_weight_grad_fold_kernel``) under other ``WeightGradConfig``
tiles / warps / stages / grouping (``config=``; only ``block_t`` changes bits and every candidate
keeps 64), and ``x:`` variants of a kernel defined here only (persistent, the next tile's carry
prefetched while the current tile's dots run, the carry loaded / stored by TMA): the same
``tl.dot`` sequence per tile, so the same bits, but shipping one needs a kernel change.
Each chain's fp32 result is compared bit for bit with the current table entry's chain.

Device time: each chain captured in a CUDA graph and replayed (``sweep_micro_batches._device_us``,
median per call: no host time). The floor: the fold's HBM bytes (first micro-batch writes 4 B per
output element, each later one reads and writes 8 B, plus the dY / X rows once) at 4.0 TB/s (an
H200's achievable; 4.8 peak), or its FLOPs at 800 TFLOP/s if that is longer; ``ceiling`` = peer
time / floor, the best ratio any fold kernel could reach.

Prints one line per (candidate, shape) as measured, then a table: candidate, registers / spills of
its compiled kernels (max over the resumed and unresumed variants), per shape the ratio to the peer
(and to the 8 bare GEMMs), bits, and the best candidate with identical bits (worst ratio over the
shapes). ``--budget`` seconds (default 85, compiles included): no new candidate starts after it.
JSON after every candidate in ``OUT/det-train_ablate_fold.json``. Finally (time permitting), the
accumulator paths themselves, eager wall time: ``bench_matmul``'s ``dW 8mb`` as it is measured
today (``deposit_rows`` without ``fold=``: the open leaf's *rows* are copied and one dW kernel runs
at ``reduce``) and ``det_train.linear``'s deposit (``fold=``: the fp32 carry, this kernel).

    python packages/det-train/benchmarks/ablate_fold.py --out DIR            # GPU, < 100 s on an H200
    python packages/det-train/benchmarks/ablate_fold.py --dry-run            # CPU, interpreter, tiny shapes
    python packages/det-train/benchmarks/ablate_fold.py --aot                # CPU: sm_90a compile, registers
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

DRY = "--dry-run" in sys.argv[1:]
if DRY:  # read when triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

_ROOT = Path(__file__).resolve().parents[3]
for _p in (_ROOT / "packages/det-train/torch-ext", _ROOT / "shared/det-core", Path(__file__).parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from det_train.ops import configs  # noqa: E402
from det_train.ops._leaf_fold import _weight_grad_fold_kernel, dw_tma_operands, tma_step, weight_grad_fold  # noqa: E402
from det_train.ops._tiles import INTERPRET, dot_precision, grouped_tile  # noqa: E402
from det_train.ops.configs import WeightGradConfig  # noqa: E402

MICRO_BATCHES = 8
LEAF_TOKENS = 8192  # grad_accum.DEFAULT_LEAF_TOKENS: every shape here is one (open) leaf
# M x K x N (bench_matmul's order): 8 x 128 tokens (issue 33's 0.88x), 8 x 1024 tokens (the
# 0.50-0.55x of one fold call vs one GEMM), the wide 14336 layer
SHAPES = ["512x256x256", "1024x256x384"] if DRY else ["1024x4096x4096", "8192x4096x4096", "8192x4096x14336"]
DEVICE = "cpu" if DRY else "cuda"
HBM_BPS = 4.0e12  # achievable on an H200 (peak 4.8e12)
HBM_PEAK_BPS = 4.8e12
MMA_FLOPS = 800e12  # achievable dense bf16 on an H200 (989 peak)

_W = WeightGradConfig


@dataclasses.dataclass(frozen=True)
class XVariant:
    """A fold kernel defined here only (same dots per tile, another schedule): ships only with a
    kernel change."""

    config: WeightGradConfig
    prefetch: bool = False  # the next tile's carry loaded (pointer loads) before this tile's dots
    carry_tma: bool = False  # the carry tile loaded by TMA (fp32 descriptor) instead of pointers
    store_tma: bool = False  # the result tile stored by TMA
    programs_per_sm: int = 1  # persistent: this many programs per SM walk the tiles


# In priority order (a run cut by --budget keeps the first). block_t 64 everywhere (the bits).
CANDIDATES: dict[str, WeightGradConfig | XVariant] = {
    "128x256 w8 s3 g8": _W(128, 256, 64, 8, 8, 3, 1),  # the wide dW entry's tile: today's fold
    "128x128 w8 s3 g8": _W(128, 128, 64, 8, 8, 3, 1),  # the large fold entry: 2 programs / SM
    "128x128 w8 s2 g8": _W(128, 128, 64, 8, 8, 2, 1),  # less smem: up to 3 / SM
    "64x128 w4 s3 g8": _W(64, 128, 64, 8, 4, 3, 1),
    "x persistent prefetch 128x128 w8 s3": XVariant(_W(128, 128, 64, 8, 8, 3, 1), prefetch=True),
    "x persistent prefetch+TMA store 128x128 w8 s3": XVariant(
        _W(128, 128, 64, 8, 8, 3, 1), prefetch=True, store_tma=True
    ),
    "x persistent 128x128 w8 s3 2/SM": XVariant(_W(128, 128, 64, 8, 8, 3, 1), programs_per_sm=2),
    "x persistent TMA carry 128x128 w8 s2": XVariant(
        _W(128, 128, 64, 8, 8, 2, 1), carry_tma=True, store_tma=True
    ),
    "x persistent prefetch 64x128 w4 s3 2/SM": XVariant(
        _W(64, 128, 64, 8, 4, 3, 1), prefetch=True, programs_per_sm=2
    ),
    "x persistent 64x128 w4 s3 3/SM": XVariant(_W(64, 128, 64, 8, 4, 3, 1), programs_per_sm=3),
    "64x128 w4 s4 g8": _W(64, 128, 64, 8, 4, 4, 1),  # the mid fold entry
    "128x256 w8 s2 g8": _W(128, 256, 64, 8, 8, 2, 1),
    "128x256 w8 s4 g8": _W(128, 256, 64, 8, 8, 4, 1),
    "256x128 w8 s3 g8": _W(256, 128, 64, 8, 8, 3, 1),
    "128x256 w8 s3 g1": _W(128, 256, 64, 1, 8, 3, 1),
    "128x128 w4 s3 g8": _W(128, 128, 64, 8, 4, 3, 1),
    "64x256 w4 s3 g8": _W(64, 256, 64, 8, 4, 3, 1),
}  # fmt: skip


# --- the x: kernel (benchmark only) -------------------------------------------------------------


@triton.jit
def _carry_tile(
    acc_ptr, acc_desc, tile, num_tiles, tiles_n, tiles_k, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr, CARRY_TMA: tl.constexpr,
):  # fmt: skip
    """The stored fold's tile number ``tile`` (zeros past the last tile)."""
    pid_n, pid_k = grouped_tile(tile, tiles_n, tiles_k, GROUP_N)
    if CARRY_TMA:  # coordinates past the tensor are zero-filled
        c = acc_desc.load([pid_n * BLOCK_N, pid_k * BLOCK_K])
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        n_end = tl.where(tile < num_tiles, N, 0)  # past the last tile: nothing loaded
        mask = (rows[:, None] < n_end) & (cols[None, :] < K)
        c = tl.load(acc_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    return c


@triton.jit(do_not_specialize=["T"])
def _fold_x_kernel(
    dy_desc, x_desc, acc_ptr, out_ptr, acc_desc, out_desc,
    T, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr,
    RESUME: tl.constexpr, PREFETCH: tl.constexpr, CARRY_TMA: tl.constexpr, STORE_TMA: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``_weight_grad_fold_kernel``'s TMA path, persistent: each program walks tiles ``pid, pid +
    programs, ...``; per tile the same dots in the same order from the same carry (same bits)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    num_tiles = tiles_n * tiles_k
    progs = tl.num_programs(0)
    first = tl.program_id(0)
    nxt = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if RESUME and PREFETCH:
        nxt = _carry_tile(
            acc_ptr, acc_desc, first, num_tiles, tiles_n, tiles_k, N, K, BLOCK_N, BLOCK_K, GROUP_N, CARRY_TMA
        )
    for tile in range(first, num_tiles, progs):
        pid_n, pid_k = grouped_tile(tile, tiles_n, tiles_k, GROUP_N)
        if RESUME:
            if PREFETCH:  # in flight while this tile's dots run
                acc = nxt
                nxt = _carry_tile(
                    acc_ptr, acc_desc, tile + progs, num_tiles, tiles_n, tiles_k, N, K,
                    BLOCK_N, BLOCK_K, GROUP_N, CARRY_TMA,
                )  # fmt: skip
            else:
                acc = _carry_tile(
                    acc_ptr, acc_desc, tile, num_tiles, tiles_n, tiles_k, N, K,
                    BLOCK_N, BLOCK_K, GROUP_N, CARRY_TMA,
                )  # fmt: skip
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for t in range(0, T, BLOCK_T):
            a, b = tma_step(dy_desc, x_desc, t, pid_n * BLOCK_N, pid_k * BLOCK_K, BLOCK_N, BLOCK_T, UPCAST)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if STORE_TMA:
            out_desc.store([pid_n * BLOCK_N, pid_k * BLOCK_K], acc)
        else:
            rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
            mask = (rows[:, None] < N) & (cols[None, :] < K)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], acc, mask=mask)


@functools.cache
def _sms() -> int:
    return 4 if DRY else torch.cuda.get_device_properties(0).multi_processor_count


def fold_x(dy, x, acc, out, v: XVariant):
    """One fold call of the x: kernel (``weight_grad_fold``'s contract, ``out`` given)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = v.config
    T, N = dy.shape
    K = x.shape[1]
    descs = dw_tma_operands(dy, x, cfg, cfg.block_t)
    if descs is None:
        raise ValueError("x: variants need TMA-able operands")
    out_desc = TensorDescriptor(out, [N, K], [K, 1], [cfg.block_n, cfg.block_k])
    acc_desc = out_desc if acc is None else TensorDescriptor(acc, [N, K], [K, 1], [cfg.block_n, cfg.block_k])
    tiles = triton.cdiv(N, cfg.block_n) * triton.cdiv(K, cfg.block_k)
    grid = (min(tiles, _sms() * v.programs_per_sm),)
    _fold_x_kernel[grid](
        *descs, out if acc is None else acc, out, acc_desc, out_desc, T, N, K,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_T=cfg.block_t, GROUP_N=cfg.group_n,
        RESUME=acc is not None, PREFETCH=v.prefetch, CARRY_TMA=v.carry_tma, STORE_TMA=v.store_tma,
        UPCAST=INTERPRET, DOT_PRECISION=dot_precision(dy.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# --- measurement --------------------------------------------------------------------------------


def _device_us(fn) -> float | str:
    if DRY:  # no CUDA graphs: one timed call of the interpreter (checks the logic, not the speed)
        try:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        except Exception as exc:
            traceback.print_exc(limit=2)
            return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    from sweep_micro_batches import _device_us as graph_us

    return graph_us(fn)


def _wall_us(fn) -> float | str:
    try:
        if DRY:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        import triton.testing

        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1e3
    except Exception as exc:
        traceback.print_exc(limit=2)
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"


def _compiled(kernel) -> dict:
    """id -> compiled kernel of each specialization Triton holds for ``kernel`` (none: interpreter)."""
    found = {}
    for cache in getattr(kernel, "device_caches", {}).values():
        table = cache[0] if isinstance(cache, tuple) else cache
        if isinstance(table, dict):
            found.update({id(v): v for v in table.values()})
    return found


def _regs(new: list) -> tuple[int | None, int | None]:
    for c in new:  # registers are read when the kernel's module is loaded (done by its launch)
        if getattr(c, "n_regs", None) is None and hasattr(c, "_init_handles"):
            try:
                c._init_handles()
            except Exception:
                pass
    regs = [r for r in (getattr(c, "n_regs", None) for c in new) if r is not None]
    spills = [s for s in (getattr(c, "n_spills", None) for c in new) if s is not None]
    return (max(regs) if regs else None), (max(spills) if spills else None)


def _fold_fields(cfg: WeightGradConfig) -> tuple:
    """The fields the fold kernel reads (its tile, token step and schedule)."""
    return cfg.block_n, cfg.block_k, cfg.block_t, cfg.group_n, cfg.num_warps, cfg.num_stages


class Shape:
    """One M x K x N case: inputs cut into micro-batches, the fp32 ping-pong buffers, the peers."""

    def __init__(self, spec: str, gen) -> None:
        self.spec = spec
        self.m, self.k, self.n = (int(v) for v in spec.split("x"))
        m, k, n = self.m, self.k, self.n
        if m % MICRO_BATCHES or (m // MICRO_BATCHES) % 64 or m > LEAF_TOKENS:
            raise ValueError(f"{spec}: M must be 8 micro-batches of a multiple of 64 tokens, one leaf")
        self.t = m // MICRO_BATCHES
        self.x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        self.dy = torch.randn(m, n, device=DEVICE, generator=gen).to(torch.bfloat16)
        cuts = [(i * self.t, (i + 1) * self.t) for i in range(MICRO_BATCHES)]
        self.dys = [self.dy[s:e] for s, e in cuts]
        self.xs = [self.x[s:e] for s, e in cuts]
        self.bufs = [torch.empty(n, k, device=DEVICE, dtype=torch.float32) for _ in range(2)]
        self.gemm_out = torch.empty(n, k, device=DEVICE, dtype=torch.bfloat16)
        self.table = configs.weight_grad_fold_config(torch.bfloat16, n, k)
        e = n * k
        self.flops = 2.0 * m * n * k
        rows = m * (n + k) * 2
        self.fold_bytes = 4 * e + (MICRO_BATCHES - 1) * 8 * e + rows
        # the peer: each GEMM writes 2 B per element, each add_ reads 4 and writes 2
        self.peer_bytes = MICRO_BATCHES * 2 * e + (MICRO_BATCHES - 1) * 6 * e + rows
        self.floor_us = max(self.fold_bytes / HBM_BPS, self.flops / MMA_FLOPS) * 1e6
        self.floor_peak_us = max(self.fold_bytes / HBM_PEAK_BPS, self.flops / MMA_FLOPS) * 1e6

    def chain(self, fold):
        """The 8 fold calls of one step: ``fold(dy, x, acc, out)``; returns the final fp32 fold."""
        dys, xs, bufs = self.dys, self.xs, self.bufs

        def run():
            fold(dys[0], xs[0], None, bufs[0])
            for i in range(1, MICRO_BATCHES):
                fold(dys[i], xs[i], bufs[(i - 1) % 2], bufs[i % 2])
            return bufs[(MICRO_BATCHES - 1) % 2]

        return run

    def peer(self):
        dys, xs = self.dys, self.xs

        def run():
            grad = torch.matmul(dys[0].t(), xs[0])
            for i in range(1, MICRO_BATCHES):
                grad.add_(torch.matmul(dys[i].t(), xs[i]))
            return grad

        return run

    def gemms(self):
        dys, xs, out = self.dys, self.xs, self.gemm_out

        def run():
            for i in range(MICRO_BATCHES):
                torch.matmul(dys[i].t(), xs[i], out=out)

        return run


def _fold_fn(cand):
    if isinstance(cand, XVariant):
        return lambda dy, x, acc, out: fold_x(dy, x, acc, out, cand)
    return lambda dy, x, acc, out: weight_grad_fold(dy, x, acc, out=out, config=cand)


def _kernel_of(cand):
    return _fold_x_kernel if isinstance(cand, XVariant) else _weight_grad_fold_kernel


def _fmt_us(v) -> str:
    return f"{v:9.1f}" if isinstance(v, float) else f"{str(v)[:40]:>9}"


def measure_refs(shapes: list[Shape]) -> dict:
    """cuBLAS peers, the floor, the finish cast and the table's chain (the reference bits) per shape."""
    refs = {}
    for s in shapes:
        peer = _device_us(s.peer())
        gemm = _device_us(s.gemms())
        fin = torch.empty(s.n, s.k, device=DEVICE, dtype=torch.bfloat16)
        finish = _device_us(lambda s=s, fin=fin: fin.copy_(s.bufs[0]))
        ref = s.chain(lambda dy, x, acc, out: weight_grad_fold(dy, x, acc, out=out))().clone()
        ceiling = peer / s.floor_us if isinstance(peer, float) else None
        refs[s.spec] = dict(
            peer_us=peer, gemm_us=gemm, finish_us=finish, floor_us=s.floor_us, floor_peak_us=s.floor_peak_us,
            fold_bytes=s.fold_bytes, peer_bytes=s.peer_bytes, ceiling=ceiling, ref=ref,
            table=dataclasses.asdict(s.table), micro_batch_tokens=s.t,
        )  # fmt: skip
        print(
            f"{s.spec:16} 8 x {s.t:4} tok: cuBLAS peer (8 GEMMs + bf16 adds) {_fmt_us(peer)} us, 8 GEMMs "
            f"{_fmt_us(gemm)} us | fold floor {s.floor_us:7.1f} us at 4.0 TB/s ({s.floor_peak_us:.1f} at "
            f"4.8; {s.fold_bytes / 1e6:.0f} MB vs the peer's {s.peer_bytes / 1e6:.0f} MB) -> ceiling "
            f"{ceiling or 0:.2f}x peer | finish fp32->bf16 {_fmt_us(finish)} us | table fold "
            f"{_fold_fields(s.table)}",
            flush=True,
        )
    return refs


def measure(name: str, cand, shapes: list[Shape], refs: dict) -> dict:
    kernel = _kernel_of(cand)
    before = _compiled(kernel)
    cfg = cand.config if isinstance(cand, XVariant) else cand
    row = dict(
        name=name, kind="x" if isinstance(cand, XVariant) else "config", config=dataclasses.asdict(cfg)
    )
    if isinstance(cand, XVariant):
        row["variant"] = {
            f: getattr(cand, f) for f in ("prefetch", "carry_tma", "store_tma", "programs_per_sm")
        }
    row["shapes"] = {}
    for s in shapes:
        r = refs[s.spec]
        run = s.chain(_fold_fn(cand))
        us = _device_us(run)
        try:
            bits = "same" if torch.equal(run(), r["ref"]) else "DIFF"
        except Exception as exc:
            bits = f"error: {type(exc).__name__}"
        ok = isinstance(us, float)
        ratio = r["peer_us"] / us if ok and isinstance(r["peer_us"], float) else None
        ratio_gemm = r["gemm_us"] / us if ok and isinstance(r["gemm_us"], float) else None
        of_floor = s.floor_us / us if ok else None
        mark = "*" if not isinstance(cand, XVariant) and _fold_fields(cand) == _fold_fields(s.table) else ""
        row["shapes"][s.spec] = dict(
            us=us, ratio=ratio, ratio_gemm=ratio_gemm, of_floor=of_floor, bits=bits, mark=mark,
            tflops=s.flops / (us * 1e-6) / 1e12 if ok else None,
        )  # fmt: skip
        print(
            f"  {mark:1} {name:46} {s.spec:16} {_fmt_us(us)} us  {ratio or 0:5.2f}x peer  "
            f"{ratio_gemm or 0:5.2f}x gemms  {of_floor or 0:4.0%} of floor  bits {bits}",
            flush=True,
        )
    new = [c for i, c in _compiled(kernel).items() if i not in before]
    row["regs"], row["spills"] = _regs(new)
    if row["regs"] is not None:
        print(
            f"    {name}: {row['regs']} registers, {row['spills']} spills (max of {len(new)} compiled)",
            flush=True,
        )
    return row


def measure_accumulator(shapes: list[Shape]) -> list[dict]:
    """The accumulator paths, eager wall time (do_bench) and device time: rows carried (bench_matmul's
    ``dW 8mb`` today) vs the fp32 fold carried (``det_train.linear``'s deposit), and the cuBLAS peer."""
    from det_train.accum.grad_accum import CanonicalGradAccumulator
    from det_train.ops.linear import _weight_fold, _weight_leaves

    out = []
    for s in shapes:
        if s.n * s.k > (1 << 24):
            continue  # the 4096 x 4096 shapes only (time)
        weight = torch.nn.Parameter(torch.empty(s.n, s.k, device=DEVICE, dtype=torch.bfloat16))
        results = {}
        for path, fold in (
            ("rows (bench_matmul dW 8mb)", None),
            ("fold (linear's deposit)", (64, _weight_fold)),
        ):
            acc = CanonicalGradAccumulator([weight], leaf_tokens=LEAF_TOKENS)
            leaves = functools.partial(_weight_leaves, LEAF_TOKENS)

            def run(acc=acc, leaves=leaves, fold=fold, weight=weight, s=s):
                weight.grad = None
                for i in range(MICRO_BATCHES):
                    with acc.micro_batch(token_offset=i * s.t):
                        acc.deposit_rows(weight, (s.dys[i], s.xs[i]), leaves, fold=fold)
                acc.reduce(total_tokens=s.m)
                return weight.grad

            results[path] = run
        results["cuBLAS peer"] = s.peer()
        ref = None
        for path, fn in results.items():
            wall = _wall_us(fn)
            dev = "—" if DRY else _device_us(fn)
            grad = fn()
            if path.startswith("cuBLAS"):
                bits = "—"
            elif ref is None:
                ref, bits = grad.clone(), "reference"
            else:
                bits = "same" if torch.equal(grad, ref) else "DIFF"
            out.append(dict(shape=s.spec, path=path, wall_us=wall, device_us=dev, bits=bits))
            print(
                f"  {s.spec:16} {path:28} eager {_fmt_us(wall)} us  device {_fmt_us(dev)} us  "
                f"p.grad bits {bits}",
                flush=True,
            )
        del results, weight
    return out


def summarize(rows: list[dict], shapes: list[Shape], refs: dict) -> dict:
    specs = [s.spec for s in shapes]
    head = "| candidate | regs / spills | " + " | ".join(
        f"{sp} (8x{s.t})" for sp, s in zip(specs, shapes, strict=True)
    )
    lines = [head + " | bits |", "|---" * (len(specs) + 3) + "|"]
    lines.append(
        "| **floor** (4.0 TB/s) -> ceiling vs peer | | "
        + " | ".join(f"{refs[sp]['floor_us']:.0f} us -> {refs[sp]['ceiling'] or 0:.2f}x" for sp in specs)
        + " | |"
    )
    best, best_worst = None, -1.0
    for r in rows:
        cells = []
        for sp in specs:
            c = r["shapes"].get(sp)
            if c is None or c["ratio"] is None:
                cells.append("—" if c is None else str(c["us"])[:30])
            else:
                cells.append(
                    f"{c['mark']}{c['ratio']:.2f}x ({c['ratio_gemm']:.2f}x gemms, {c['of_floor']:.0%} floor)"
                )
        bits = sorted({c["bits"] for c in r["shapes"].values()})
        bits_s = "same" if bits == ["same"] else "/".join(bits)
        rs = f"{r['regs']} / {r['spills']}" if r.get("regs") is not None else "—"
        lines.append(f"| {r['name']} | {rs} | " + " | ".join(cells) + f" | {bits_s} |")
        ratios = [r["shapes"][sp]["ratio"] for sp in specs if sp in r["shapes"]]
        if bits == ["same"] and len(ratios) == len(specs) and all(x is not None for x in ratios):
            if min(ratios) > best_worst:
                best, best_worst = r["name"], min(ratios)
    table = "\n".join(lines)
    print("\n" + table + "\n", flush=True)
    print("ratio = cuBLAS peer (8 GEMMs + bf16 adds) device time / the candidate's 8-call fold chain; "
          "'gemms' = 8 bare GEMMs / chain; floor = fold floor / chain; * = today's table entry")  # fmt: skip
    summary = dict(best=best, worst_ratio=best_worst if best else None)
    if best is None:
        print("no candidate ran every shape with identical bits")
    else:
        cand = CANDIDATES[best]
        print(
            f"best with identical bits: {best!r}, worst ratio {best_worst:.2f}x peer over {specs} "
            "(target 0.90x)"
        )
        if isinstance(cand, XVariant):
            print(f"  an x: variant: needs a kernel change ({cand!r})")
        else:
            print(
                f'  configs.py _WEIGHT_GRAD_FOLD_TABLE[("half", "wide")] = {cand!r}  (a new wide fold entry)'
            )
    return summary


def aot(cands: dict) -> int:
    """Compile every candidate (the resumed kernel) for sm_90a without a GPU; ptxas registers / spills."""
    import aot_compile_check as aot_check  # Triton's ahead-of-time path, as that script uses it

    bad = 0
    for name, cand in cands.items():
        cfg = cand.config if isinstance(cand, XVariant) else cand
        dy_t = f"tensordesc<bf16[{cfg.block_t}, {cfg.block_n}]>"
        x_t = f"tensordesc<bf16[{cfg.block_t}, {cfg.block_k}]>"
        meta = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_T=cfg.block_t, GROUP_N=cfg.group_n,
                    RESUME=True, UPCAST=False, DOT_PRECISION=None)  # fmt: skip
        if isinstance(cand, XVariant):
            acc_t = f"tensordesc<fp32[{cfg.block_n}, {cfg.block_k}]>"
            types = dict(
                dy_desc=dy_t, x_desc=x_t, acc_ptr="*fp32", out_ptr="*fp32", acc_desc=acc_t, out_desc=acc_t
            )
            meta.update(PREFETCH=cand.prefetch, CARRY_TMA=cand.carry_tma, STORE_TMA=cand.store_tma)
            kernel = _fold_x_kernel
        else:
            types = dict(dy_ptr=dy_t, x_ptr=x_t, acc_ptr="*fp32", out_ptr="*fp32")
            meta.update(TMA=True, EVEN_T=True, stride_dyn=1, stride_xk=1)
            kernel = _weight_grad_fold_kernel
        bad += not aot_check.compile_one(name, kernel, types, meta, cfg.num_warps, cfg.num_stages)
    print("every candidate compiles without spills" if not bad else f"{bad} candidates failed or spill")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="M x K x N, comma-separated")
    parser.add_argument(
        "--only", default="", help="candidates whose name contains any of these (comma-separated)"
    )
    parser.add_argument(
        "--budget", type=float, default=85.0, help="seconds after which no new candidate starts"
    )
    parser.add_argument("--aot", action="store_true", help="no GPU: compile the candidates for sm_90a, regs")
    parser.add_argument("--no-accumulator", action="store_true", help="skip the accumulator paths at the end")
    args = parser.parse_args(argv)
    cands = CANDIDATES
    if args.only:
        keys = args.only.split(",")
        cands = {n: c for n, c in CANDIDATES.items() if any(k in n for k in keys)}
    if args.aot:
        return aot(cands)
    if not DRY and not torch.cuda.is_available():
        print("ablate_fold: needs a CUDA GPU (or --dry-run)")
        return 1
    t0 = time.time()
    dev = "CPU (interpreter)" if DRY else f"{torch.cuda.get_device_name()} ({_sms()} SMs)"
    print(f"{dev} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shapes = [Shape(sp, gen) for sp in args.shapes.split(",")]
    refs = measure_refs(shapes)
    rows: list[dict] = []
    payload = dict(device=dev, shapes=args.shapes.split(","), hbm_bps=HBM_BPS, mma_flops=MMA_FLOPS)
    payload["refs"] = {sp: {k: v for k, v in r.items() if k != "ref"} for sp, r in refs.items()}

    def write():
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "det-train_ablate_fold.json").write_text(json.dumps(payload, indent=1, default=str))

    write()
    for name, cand in cands.items():
        if time.time() - t0 > args.budget:
            print(f"budget {args.budget:.0f} s spent: candidates from {name!r} on not run", flush=True)
            break
        start = time.time()
        rows.append(measure(name, cand, shapes, refs))
        rows[-1]["seconds"] = time.time() - start
        payload["rows"] = rows
        write()
    payload["summary"] = summarize(rows, shapes, refs)
    write()
    if not args.no_accumulator and time.time() - t0 < args.budget:
        print("\naccumulator paths (one step of 8 micro-batches, reduce included):", flush=True)
        payload["accumulator"] = measure_accumulator(shapes)
        write()
    print(f"\nelapsed {time.time() - t0:.0f} s (compiles included)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
