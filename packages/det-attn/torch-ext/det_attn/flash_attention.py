"""Deterministic flash attention: host launchers, autograd, and the public ``attention`` functions.

Reading order: the fixed config table, input checks, forward/backward launchers, the
``torch.autograd.Function``, then ``attention`` (padded batch) and ``attention_varlen`` (packed).
The forward kernel is in ``_fwd_kernel.py``, the backward kernels in ``_kernels.py``; a plain-torch
reference is in ``reference.py``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from det_core import rng, runtime

from . import _descriptors, _fwd_kernel, _kernels

__all__ = ["MAX_SEQLEN", "SUPPORTED_HEAD_DIMS", "attention", "attention_varlen"]

SUPPORTED_HEAD_DIMS = (64, 128)
# Dropout packs query and key positions into 22 bits each of the Philox index (see _kernels).
MAX_SEQLEN = 1 << 22
_MAX_HEADS = 1 << 19  # head (plus head_offset) gets the remaining 19 bits
_MAX_GRID_YZ = 65535  # CUDA grid limit for the sequence and head axes
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)

if _kernels.DROPOUT_STREAM.value != rng.STREAM_ATTN_DROPOUT:  # pragma: no cover - guards an edit
    raise ImportError("det_attn kernels use a dropout stream other than rng.STREAM_ATTN_DROPOUT")


@dataclass(frozen=True)
class _Config:
    """Launch parameters of the three main kernels.

    Reduction-order-defining (changing one changes bits, so they depend only on head dim and the
    interpreter switch, never on batch, sequence length or packing): ``fwd_block_n`` (keys per
    online-softmax step), ``dkdv_block_m`` (queries per dK/dV step), ``dq_block_n`` (keys per dQ
    step). ``fwd_block_m`` and ``fwd_warps`` set the register layout of the softmax row sums,
    which could fix another fp32 order within a row; on the H200 they did not (run 8: forward
    tiles of 64 x 64 at 4 warps and 128 x 64 at 8 warps gave the same bits;
    ``benchmarks/ablate_attention.py`` checks it). The others (stages, the backward kernels'
    owned-block sizes and warps, the forward's load path ``fwd_tma`` and register cap
    ``fwd_maxnreg``) only change which rows a program owns, when loads are issued and how
    registers are allocated (same bits; ``ablate_attention.py --forward`` checks it on the GPU).
    """

    fwd_block_m: int
    fwd_block_n: int
    fwd_warps: int
    fwd_stages: int
    dkdv_block_m: int
    dkdv_block_n: int
    dkdv_warps: int
    dkdv_stages: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int
    dq_stages: int
    # forward pipeline depth with dropout on (its Philox tiles need shared memory for layout
    # changes: 128 KiB for the D128 row at 2 stages; 128 x 128 tiles at 3 stages would exceed the
    # H200's 227 KiB); 0 = fwd_stages. No effect on bits.
    fwd_dropout_stages: int = 0
    # dK/dV kernel: all query blocks in one masked loop instead of diagonal / full / tail loops
    # (fewer registers, a mask on every step). No effect on bits.
    dkdv_one_loop: bool = False
    # Forward load path: host TMA descriptors over (B, T, H * D) for padded batches (packed calls,
    # inputs not 16-byte aligned and Triton without host descriptors take the pointer loads: the
    # same bits); False: pointer loads always. See _fwd_kernel.
    fwd_tma: bool = False
    # Forward register cap (ptxas maxnreg; 0: none) of the descriptor path, without dropout only:
    # the Philox tiles need more registers (sm_90a, Triton 3.6, D128 row: 126 used under a cap of
    # 128; 220 with dropout, which would spill 348 bytes under 128). No effect on bits.
    fwd_maxnreg: int = 0
    # Forward tiles of the pointer loads (packed input, inputs not 16-byte aligned, Triton without
    # host descriptors, fwd_tma=False): (block_m, warps, stages, maxnreg or 0; the cap without
    # dropout only); None: fwd_block_m, fwd_warps, fwd_stages and no cap. block_m and warps are
    # bit-neutral on the H200 (runs 8, 9: 64 x 64 tiles at 4 warps give the bits of 128 x 64 at 8
    # warps), so a packed sequence keeps the bits of the same sequence in a padded batch (tested
    # on the GPU). D128: 128 x 64 under a cap of 128 like the descriptor path (182 registers
    # uncapped; under the cap ptxas spills 76 bytes, and it still ran 1.2-1.5x faster, two
    # programs per SM). No effect on bits.
    fwd_pointers: tuple | None = None


# Fixed table (no autotune), bf16 and fp16 alike, causal or not. Each row is the fastest measured
# on an H200 (benchmarks/bench_attention.py --sweep at B4 H32 T4096 causal, and
# benchmarks/ablate_attention.py at T1024/T4096); the fields marked * set a summation order, so
# changing one changes bits (for every input alike: never chosen per shape).
#                 fwd: BM  BN* warps stages | dK/dV: BM* BN warps stages | dQ: BM BN* warps stages
# Forward rows from run 8's ablation, confirmed by run 9's (ablate_attention.py --forward; H200,
# torch 2.11, Triton 3.6, 2026-11-30; B4 H32 bf16; eager / CUDA-graph ratio to SDPA cuDNN, run 9).
# D128: 128 x 64 tiles, 8 warps, 2 stages, host TMA descriptors, a cap of 128 registers (sm_90a:
# 126 used, 96 KiB shared memory, so two programs per SM): causal T1024 0.84 / 0.87, T4096
# 0.81 / 0.87, T8192 0.84 / 0.86, non-causal T4096 0.71 / 0.79. The row before (128, 128, 8, 3,
# host descriptors; BN* other bits): 0.76 / 0.79, 0.87 / 0.86, 0.84 / 0.85, 0.72 / 0.80. Pointer
# loads (packed input; a second ablation, where the row measured 0.85 / 0.87, 0.81 / 0.88,
# 0.84 / 0.86, 0.74 / 0.79): the same tiles under the same cap (two programs per SM; ptxas spills
# 76 bytes, measured faster than without): 0.78 / 0.80, 0.78 / 0.82, 0.80 / 0.80, 0.74 / 0.74; without
# the cap (one program per SM) 0.64 / 0.67, 0.58 / 0.64, 0.60 / 0.61, 0.50 / 0.54; 64 x 64 at 4
# warps, 3 stages 0.79 / 0.79, 0.72 / 0.74, 0.71 / 0.71, 0.72 / 0.68 (every one the table's bits).
# D64 (128, 64, 8, 3, host descriptors): T4096 0.89 / 0.93 (pointer loads 0.92 / 0.92). Tried in
# run 8 and slower, so no longer in the kernel: FlashAttention-3-style overlap of P V with the
# next softmax (0.55-0.74), descriptors made in the kernel (0.61-0.81), one masked key loop (at
# most the row's speed). Not kept either: O * (1/l) instead of O / l (0-4% in graph time).
_GPU_CONFIGS = {
    64: _Config(128, 64, 8, 3, 64, 64, 4, 3, 64, 64, 4, 3, fwd_tma=True),
    128: _Config(
        128,
        64,
        8,
        2,
        64,
        128,
        8,
        3,
        128,
        64,
        8,
        3,
        fwd_dropout_stages=2,
        fwd_tma=True,
        fwd_maxnreg=128,
        fwd_pointers=(128, 8, 2, 128),
    ),
}
# Interpreter: small, unequal blocks so tiny CPU tests cross many tile and diagonal boundaries.
_INTERPRETER_CONFIG = _Config(32, 16, 1, 1, 16, 32, 1, 1, 32, 16, 1, 1)


# Triton reads TRITON_INTERPRET when the kernels are decorated (at import), so read it once too.
_INTERPRET = runtime.interpreter_active()


def _config(head_dim: int, interpreter: bool) -> _Config:
    return _INTERPRETER_CONFIG if interpreter else _GPU_CONFIGS[head_dim]


def _cdiv(a: int, b: int) -> int:
    # plain int math: triton.cdiv is a constexpr_function, tens of microseconds per host call
    return -(-a // b)


# --------------------------------------------------------------------------- checks


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: int, op: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            layout = "(B, T, H, D)" if dims == 4 else "(total_tokens, H, D)"
            raise ValueError(f"{op}: {name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{op}: q has dtype {q.dtype}; supported are torch.bfloat16 and torch.float16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    runtime.check_kernel_device(q, k, v, op=op)
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{op}: head dim {head_dim} is not supported; supported head dims are {SUPPORTED_HEAD_DIMS} "
            "(256 is not implemented: pad or split the heads)"
        )
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(
            f"{op}: q, k, v must share the head dim, got {head_dim}, {k.shape[-1]}, {v.shape[-1]}"
        )
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    h_q, h_kv = q.shape[-2], k.shape[-2]
    if h_q == 0 or h_kv == 0 or h_q % h_kv:
        raise ValueError(
            f"{op}: query heads ({h_q}) must be a positive multiple of key/value heads ({h_kv}) (GQA/MQA)"
        )
    if h_q > _MAX_GRID_YZ:
        raise ValueError(f"{op}: at most {_MAX_GRID_YZ} query heads are supported, got {h_q}")


def _check_dropout(
    dropout_p: float,
    seed: int | None,
    sequence_offset: int,
    head_offset: int,
    heads: int,
    batch: int,
    op: str,
) -> tuple[float, int | None, int, int]:
    """Validate the dropout arguments; returns them as (float, int or None, int, int). Plain values
    in range (a float ``dropout_p``, int offsets, no seed without dropout or an int seed with it:
    every call of a training loop) are returned after comparisons alone; anything else goes through
    the conversions and their errors."""
    if (
        type(dropout_p) is float
        and type(sequence_offset) is int
        and type(head_offset) is int
        and 0.0 <= dropout_p < 1.0
        and 0 <= sequence_offset
        and sequence_offset + batch <= 2**32
        and 0 <= head_offset
        and head_offset + heads <= _MAX_HEADS
        and (seed is None if dropout_p == 0.0 else type(seed) is int and 0 <= seed < 2**64)
    ):
        return dropout_p, seed, sequence_offset, head_offset
    dropout_p = _as_dropout_p(dropout_p, "dropout_p", op)
    if seed is not None:
        seed = _as_seed(seed, "seed", op)
    elif dropout_p > 0.0:
        raise ValueError(f"{op}: dropout_p > 0 needs an explicit integer seed (there is no global generator)")
    sequence_offset = runtime.as_index(
        sequence_offset, "sequence_offset", op, "; pass the global index of the batch's first sequence"
    )
    head_offset = runtime.as_index(
        head_offset, "head_offset", op, "; pass the global index of the first query head"
    )
    if not 0 <= sequence_offset or sequence_offset + batch > 2**32:
        raise ValueError(
            f"{op}: sequence_offset + sequences must be in [0, 2**32], got {sequence_offset} + {batch}"
        )
    if not 0 <= head_offset or head_offset + heads > _MAX_HEADS:
        raise ValueError(
            f"{op}: head_offset + heads must be in [0, {_MAX_HEADS}], got {head_offset} + {heads}"
        )
    return dropout_p, seed, sequence_offset, head_offset


def _as_dropout_p(value, name: str, op: str) -> float:
    """``value`` as a float in ``[0, 1)``: any real number (int, float, numpy scalar), never a bool,
    str or tensor."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{op}: {name} must be a real number in [0, 1), got {type(value).__name__} {value!r}; "
            "pass a Python float such as 0.1"
        )
    p = float(value)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")
    return p


def _as_max_seqlen(value, name: str, lengths: torch.Tensor, op: str) -> int:
    """``value`` as an int, at least the longest of ``lengths`` and at most ``MAX_SEQLEN``."""
    given = runtime.as_index(value, name, op, "; pass the longest sequence length, e.g. int(seqlens.max())")
    longest = int(lengths.max())
    if given < longest:
        raise ValueError(f"{op}: {name}={given} is below the longest sequence ({longest})")
    if given > MAX_SEQLEN:
        raise ValueError(f"{op}: {name}={given} exceeds the supported {MAX_SEQLEN}")
    return given


def _as_seed(value, name: str, op: str) -> int:
    return rng.as_seed(value, op, name, "; pass an int such as 0, a new one per training step")


def _check_cu_seqlens(cu: torch.Tensor, total: int, device: torch.device, name: str, op: str) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{op}: {name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{op}: {name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{op}: {name} is on {cu.device} but q is on {device}")
    host = cu.cpu()  # one small device-to-host copy: the checks below need the values
    if int(host[0]) != 0 or int(host[-1]) != total:
        raise ValueError(
            f"{op}: {name} must start at 0 and end at the token count {total}, "
            f"got {int(host[0])} ... {int(host[-1])}"
        )
    lengths = host[1:] - host[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"{op}: {name} must be non-decreasing (monotone), got {host.tolist()}")
    return lengths


# --------------------------------------------------------------------------- launchers

# The dropout arguments (seed_lo, seed_hi, seq_offset, head_offset, threshold, drop_scale) of a
# call without dropout: the kernels read them only under DROPOUT (the offsets too: seq_id and
# head_id feed _dropout_keep alone), so these fixed values let the launches bind them.
_NO_DROPOUT = (0, 0, 0, 0, 0, 1.0)


def _dropout_args(dropout_p: float, seed: int | None, sequence_offset: int, head_offset: int) -> tuple:
    """Kernel arguments seed_lo, seed_hi, seq_offset, head_offset, threshold, drop_scale."""
    if dropout_p == 0.0:
        return _NO_DROPOUT
    seed_lo, seed_hi = rng.split_seed(int(seed))
    # keep an element iff its 32 random bits are >= threshold: P(keep) = 1 - threshold / 2**32
    threshold = min(int(round(dropout_p * 2**32)), 2**32 - 1)
    return seed_lo, seed_hi, sequence_offset, head_offset, threshold, 1.0 / (1.0 - dropout_p)


def _grid(n_tiles: int, heads: int, batch: int) -> tuple[int, int]:
    # axis 0: tile rank major over heads (see _kernels._program_tile); axis 1: sequences
    if n_tiles * heads >= 2**31:  # pragma: no cover - needs > 2**31 (tile, head) pairs
        raise ValueError(f"det_attn: {n_tiles} tiles x {heads} heads exceed the CUDA grid; split the heads")
    return (n_tiles * heads, batch)


# Per-shape launch arguments (grids, sizes, strides, meta) and bound launches, built once and
# reused: the host side of a call is then a dict lookup plus the launches (it bounds the speed at
# short sequences). The key holds everything the arguments are computed from, the config by its
# id (hashing the dataclass costs a microsecond per call; the plan keeps the config alive, so its
# id is not reused while the plan is cached).
_PLANS = runtime.PlanCache()


@dataclass(frozen=True)
class _FwdLaunch:
    """One forward kernel of a plan: grid, sizes (n_tiles, heads, seqlen_q, seqlen_k, group,
    qk_scale), constexprs and options, and the bound launch (None with dropout: see _Plan)."""

    grid: tuple
    sizes: tuple
    meta: dict
    bound: runtime.BoundLaunch | None


@dataclass(frozen=True)
class _Plan:
    cfg: _Config
    dense: bool  # a padded batch (no cu_seqlens tensors)
    lse_shape: tuple  # (heads, total_q)
    fwd: _FwdLaunch  # descriptors where fwd_tma, else pointer loads
    fwd_pointers: _FwdLaunch  # pointer loads: for inputs not 16-byte aligned (fwd itself without fwd_tma)
    fwd_strides: tuple
    fwd_tma: bool  # host descriptors for this call shape (the config's choice, where they fit)
    fwd_descs: tuple | None  # host descriptor templates of q, k, v, o (base set per call)
    pre_grid: tuple
    pre_args: tuple  # total_q, strides
    pre_meta: dict
    dkdv_grid: tuple
    dkdv_sizes: tuple  # n_tiles, kv_heads, seqlen_q, seqlen_k, group, scale, qk_scale
    dkdv_strides: tuple
    dkdv_meta: dict
    dq_grid: tuple
    dq_sizes: tuple
    dq_strides: tuple
    dq_meta: dict
    # Bound launches (runtime.BoundLaunch: every argument after the tensors fixed, so a call keys
    # only its tensors). Without dropout the dropout arguments are the fixed _NO_DROPOUT; with
    # dropout they change per call (the seed), so the forward, dK/dV and dQ launches go through
    # runtime.launch and these three are None.
    pre_launch: runtime.BoundLaunch
    dkdv_launch: runtime.BoundLaunch | None
    dq_launch: runtime.BoundLaunch | None


def _plan(q, k, dense, batch, max_q, max_k, scale, causal, dropout) -> _Plan:
    interp = _INTERPRET
    head_dim = q.shape[2]
    cfg = _config(head_dim, interp)
    key = (
        q.shape, q.stride(), k.shape, k.stride(), dense, batch, max_q, max_k, scale, causal, dropout, id(cfg)
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    total_q, heads, _ = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    seqlen_q, seqlen_k = (dense[1], dense[2]) if dense is not None else (0, 0)
    qk_scale = scale * math.log2(math.e)
    o_strides = torch.empty_like(q, device="meta").stride()  # o, dq = empty_like(q)
    lse_stride = total_q  # lse2, delta: (heads, total_q) contiguous
    do_strides = (heads * head_dim, head_dim)  # dO is made contiguous
    dk_strides = torch.empty_like(k, device="meta").stride()
    common = dict(HEAD_DIM=head_dim, CAUSAL=causal, DROPOUT=dropout, UPCAST=interp, DENSE=dense is not None)
    n_kv = _cdiv(max_k, cfg.dkdv_block_n)
    n_dq = _cdiv(max_q, cfg.dq_block_m)
    pre_block = 32  # fixed: each row is summed alike wherever it sits in a tile (packing-safe)
    fwd_strides = (*q.stride()[:2], *k.stride()[:2], *o_strides[:2], lse_stride)

    def fwd_launch(block_m, warps, stages, maxnreg, **tma):
        meta = dict(
            BLOCK_M=block_m,
            BLOCK_N=cfg.fwd_block_n,
            num_warps=warps,
            num_stages=cfg.fwd_dropout_stages if dropout and cfg.fwd_dropout_stages else stages,
            **common,
            **tma,
        )
        if maxnreg and not dropout:  # the Philox tiles need more registers (see _Config)
            meta["maxnreg"] = maxnreg
        n_fwd = _cdiv(max_q, block_m)
        sizes = (n_fwd, heads, seqlen_q, seqlen_k, group, qk_scale)
        # without dropout every argument after the tensors is fixed (_NO_DROPOUT): a bound launch
        bound = None if dropout else runtime.BoundLaunch(
            _fwd_kernel.attn_fwd_kernel, 7, (*sizes, *_NO_DROPOUT, *fwd_strides), **meta
        )  # fmt: skip
        return _FwdLaunch(_grid(n_fwd, heads, batch), sizes, meta, bound)

    fwd_pointers = fwd_launch(*(cfg.fwd_pointers or (cfg.fwd_block_m, cfg.fwd_warps, cfg.fwd_stages, 0)))
    tma = cfg.fwd_tma and _descriptors.fwd_descriptors_fit(q, k, o_strides, dense)
    fwd, descs = fwd_pointers, None
    if tma:
        fwd = fwd_launch(cfg.fwd_block_m, cfg.fwd_warps, cfg.fwd_stages, cfg.fwd_maxnreg, TMA=True)
        descs = _descriptors.fwd_descriptor_templates(
            q, k, o_strides, dense, cfg.fwd_block_m, cfg.fwd_block_n
        )
    pre_args = (total_q, *o_strides[:2], *do_strides, lse_stride)
    pre_meta = dict(HEAD_DIM=head_dim, BLOCK_M=pre_block)
    dkdv_sizes = (n_kv, kv_heads, seqlen_q, seqlen_k, group, scale, qk_scale)
    dkdv_strides = (*q.stride()[:2], *k.stride()[:2], *do_strides, *dk_strides[:2], lse_stride)
    dkdv_meta = dict(
        BLOCK_M=cfg.dkdv_block_m,
        BLOCK_N=cfg.dkdv_block_n,
        ONE_LOOP=cfg.dkdv_one_loop,
        num_warps=cfg.dkdv_warps,
        num_stages=cfg.dkdv_stages,
        **common,
    )
    dq_sizes = (n_dq, heads, seqlen_q, seqlen_k, group, scale, qk_scale)
    dq_strides = (*q.stride()[:2], *k.stride()[:2], *do_strides, *o_strides[:2], lse_stride)
    dq_meta = dict(
        BLOCK_M=cfg.dq_block_m,
        BLOCK_N=cfg.dq_block_n,
        num_warps=cfg.dq_warps,
        num_stages=cfg.dq_stages,
        **common,
    )
    dkdv_launch = dq_launch = None
    if not dropout:  # the launches' arguments after the tensors, as runtime.launch gets them
        bound = runtime.BoundLaunch
        dkdv_launch = bound(
            _kernels.attn_bwd_dkdv_kernel, 10, (*dkdv_sizes, *_NO_DROPOUT, *dkdv_strides), **dkdv_meta
        )
        dq_launch = bound(_kernels.attn_bwd_dq_kernel, 9, (*dq_sizes, *_NO_DROPOUT, *dq_strides), **dq_meta)
    plan = _Plan(
        cfg=cfg,
        dense=dense is not None,
        lse_shape=(heads, total_q),
        fwd=fwd,
        fwd_pointers=fwd_pointers,
        fwd_strides=fwd_strides,
        fwd_tma=tma,
        fwd_descs=descs,
        pre_grid=(_cdiv(total_q, pre_block), heads),
        pre_args=pre_args,
        pre_meta=pre_meta,
        dkdv_grid=_grid(n_kv, kv_heads, batch),
        dkdv_sizes=dkdv_sizes,
        dkdv_strides=dkdv_strides,
        dkdv_meta=dkdv_meta,
        dq_grid=_grid(n_dq, heads, batch),
        dq_sizes=dq_sizes,
        dq_strides=dq_strides,
        dq_meta=dq_meta,
        pre_launch=runtime.BoundLaunch(_kernels.attn_bwd_preprocess_kernel, 3, pre_args, **pre_meta),
        dkdv_launch=dkdv_launch,
        dq_launch=dq_launch,
    )
    return _PLANS.put(key, plan)


def _launch_forward(plan: _Plan, q, k, v, cu_q, cu_k, drop: tuple | None):
    """``(o, lse2)`` of one forward call; ``drop``: the dropout arguments, None without dropout
    (then the plan's bound launch, whose arguments are the same as runtime.launch would get)."""
    o = torch.empty_like(q)
    lse2 = q.new_empty(plan.lse_shape, dtype=torch.float32)
    if plan.dense:  # a padded batch: no cu_seqlens tensors (any pointer will do)
        cu_q = cu_k = lse2
    fwd = plan.fwd
    q_arg, k_arg, v_arg, o_arg = q, k, v, o
    if plan.fwd_tma:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:  # o is a fresh allocation
            fwd = plan.fwd_pointers
        else:
            q_arg, k_arg, v_arg, o_arg = (d(t) for d, t in zip(plan.fwd_descs, (q, k, v, o), strict=True))
    tensors = (q_arg, k_arg, v_arg, o_arg, lse2, cu_q, cu_k)
    if drop is None:
        fwd.bound(fwd.grid, *tensors)
    else:
        kernel = _fwd_kernel.attn_fwd_kernel
        runtime.launch(kernel, fwd.grid, *tensors, *fwd.sizes, *drop, *plan.fwd_strides, **fwd.meta)
    return o, lse2


def _launch_backward(plan: _Plan, do, q, k, v, o, lse2, cu_q, cu_k, drop: tuple | None):
    """``(dq, dk, dv)`` of one backward call (``drop`` as in ``_launch_forward``)."""
    if not do.is_contiguous():
        do = do.contiguous()
    delta = torch.empty_like(lse2)
    plan.pre_launch(plan.pre_grid, o, do, delta)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if plan.dense:
        cu_q = cu_k = delta
    dkdv_tensors = (q, k, v, do, lse2, delta, dk, dv, cu_q, cu_k)
    dq_tensors = (q, k, v, do, lse2, delta, dq, cu_q, cu_k)
    if drop is None:
        plan.dkdv_launch(plan.dkdv_grid, *dkdv_tensors)
        plan.dq_launch(plan.dq_grid, *dq_tensors)
    else:
        kernel = _kernels.attn_bwd_dkdv_kernel
        runtime.launch(
            kernel,
            plan.dkdv_grid,
            *dkdv_tensors,
            *plan.dkdv_sizes,
            *drop,
            *plan.dkdv_strides,
            **plan.dkdv_meta,
        )
        kernel = _kernels.attn_bwd_dq_kernel
        runtime.launch(
            kernel, plan.dq_grid, *dq_tensors, *plan.dq_sizes, *drop, *plan.dq_strides, **plan.dq_meta
        )
    return dq, dk, dv


def _plan_and_dropout(q, k, cu_q, call: tuple) -> tuple:
    """The plan of a call (``call``: dense, max_q, max_k, scale, causal, dropout_p, seed,
    sequence_offset, head_offset) and its dropout arguments (None without dropout)."""
    dense, max_q, max_k, scale, causal, dropout_p, seed, sequence_offset, head_offset = call
    batch = dense[0] if dense is not None else cu_q.shape[0] - 1
    plan = _plan(q, k, dense, batch, max_q, max_k, scale, causal, dropout_p > 0.0)
    if dropout_p == 0.0:
        return plan, None
    return plan, _dropout_args(dropout_p, seed, sequence_offset, head_offset)


def _forward(
    q, k, v, cu_q, cu_k, dense, max_q, scale, causal, dropout_p, seed, sequence_offset, head_offset, max_k=0
):
    """The forward launch without checks or autograd (``benchmarks/ablate_attention.py``): ``(o, lse2)``.
    max_k (only the backward grid needs it) makes the forward share the backward's plan."""
    call = (dense, max_q, max_k, scale, causal, dropout_p, seed, sequence_offset, head_offset)
    plan, drop = _plan_and_dropout(q, k, cu_q, call)
    return _launch_forward(plan, q, k, v, cu_q, cu_k, drop)


def _backward(
    do, q, k, v, o, lse2, cu_q, cu_k, dense, max_q, max_k, scale, causal, dropout_p, seed, sequence_offset,
    head_offset,
):  # fmt: skip
    """The backward launches without autograd (``benchmarks/ablate_attention.py``): ``(dq, dk, dv)``."""
    call = (dense, max_q, max_k, scale, causal, dropout_p, seed, sequence_offset, head_offset)
    plan, drop = _plan_and_dropout(q, k, cu_q, call)
    return _launch_backward(plan, do, q, k, v, o, lse2, cu_q, cu_k, drop)


def _kernel_inputs(q, k, v, dense):
    """q, k, v as the kernels read them: ``(tokens, heads, head_dim)`` (a padded batch's
    ``(B, T, H, D)`` reshaped: a view where one exists, else a copy), the last dim unit-stride, v
    with k's strides (a copy where not)."""
    if dense is not None:
        batch, t_q, t_k = dense
        q = q.reshape(batch * t_q, q.shape[2], q.shape[3])
        k = k.reshape(batch * t_k, k.shape[2], k.shape[3])
        v = v.reshape(batch * t_k, v.shape[2], v.shape[3])
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride() != k.stride():  # the kernels read v with k's strides
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def _attend(q, k, v, cu_q, cu_k, call: tuple):
    """``(o, lse2)`` with o ``(tokens, H_q, D)``: ``_AttentionFunction.apply``, or, when no
    gradient can flow (grad mode off, or no input requires one), the same forward launch without
    autograd (whose per-call host time shows at short sequences). ``call`` as in
    ``_plan_and_dropout``; q, k, v ``(B, T, H, D)`` for a padded batch (``call[0]``, dense)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionFunction.apply(q, k, v, cu_q, cu_k, call)
    q, k, v = _kernel_inputs(q, k, v, call[0])
    plan, drop = _plan_and_dropout(q, k, cu_q, call)
    return _launch_forward(plan, q, k, v, cu_q, cu_k, drop)


class _AttentionFunction(torch.autograd.Function):
    # A padded batch's (B, T, H, D) inputs are reshaped in here, not before: the reshapes then
    # add no autograd nodes (three view nodes per call, forward and backward, in host time); the
    # gradients are viewed back (splitting the token dim is always a view: the same layout the
    # reshapes' backward gives).
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, call):
        shapes = (q.shape, k.shape, v.shape) if call[0] is not None else None
        q, k, v = _kernel_inputs(q, k, v, call[0])
        plan, drop = _plan_and_dropout(q, k, cu_q, call)
        o, lse2 = _launch_forward(plan, q, k, v, cu_q, cu_k, drop)
        ctx.save_for_backward(q, k, v, o, lse2, cu_q, cu_k)
        ctx.plan, ctx.drop, ctx.shapes = plan, drop, shapes  # the backward's launches: the forward's plan
        ctx.mark_non_differentiable(lse2)
        # lse2 never gets a gradient: do not let autograd allocate and zero-fill one per backward
        ctx.set_materialize_grads(False)
        return o, lse2

    @staticmethod
    def backward(ctx, do, _dlse2):
        runtime.check_first_order("det_attn.attention")
        q, k, v, o, lse2, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _launch_backward(ctx.plan, do, q, k, v, o, lse2, cu_q, cu_k, ctx.drop)
        if ctx.shapes is not None:
            q_shape, k_shape, v_shape = ctx.shapes
            dq, dk, dv = dq.view(q_shape), dk.view(k_shape), dv.view(v_shape)
        return dq, dk, dv, None, None, None


def _scale(softmax_scale: float | None, head_dim: int, op: str) -> float:
    """``softmax_scale`` as a float: None gives ``1 / sqrt(head_dim)``; else a real number (int,
    float, numpy scalar; not a bool, str or tensor), finite and positive."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"{op}: softmax_scale must be a real number or None, got {type(softmax_scale).__name__} "
            f"{softmax_scale!r}; pass a Python float such as 0.125"
        )
    try:
        scale = float(softmax_scale)
    except OverflowError:  # an int beyond the float range
        scale = math.inf
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"{op}: softmax_scale must be a finite positive number, got {softmax_scale}")
    return scale


def _check_causal(causal, op: str) -> None:
    """``causal`` must be a Python bool: a string, number or tensor is a mistake, never a flag."""
    if not isinstance(causal, bool):
        raise TypeError(
            f"{op}: causal must be a bool, got {type(causal).__name__} {causal!r}; pass True or False"
        )


# Calls whose checks that depend only on the call signature passed, by that signature (argument
# types, shapes, dtypes, devices and the flags the checks read): a repeated signature skips them
# (the checks of values that change per call, dropout's and cu_seqlens', always run). A call of
# other argument kinds (a tensor subclass, a non-bool causal, ...) is never cached: it takes the
# checks every time. CPU tensors pass the device check only under the interpreter, which is an
# environment switch: their entries say so and the switch is read again on each hit.
_PADDED_CALLS = runtime.PlanCache()  # attention: signature -> (scale, on CPU)
_PACKED_CALLS = runtime.PlanCache()  # attention_varlen: signature -> on CPU
_TENSOR = torch.Tensor


def _signature(q, k, v, *flags) -> tuple | None:
    """The cache key of a call's signature, or None when q, k, v are not plain tensors."""
    if type(q) is not _TENSOR or type(k) is not _TENSOR or type(v) is not _TENSOR:
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, *flags)


def _check_padded(q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, op) -> tuple:
    """Every check of ``attention``, in order; returns ``(scale, dropout_p, seed, sequence_offset,
    head_offset)``."""
    _check_qkv(q, k, v, 4, op)
    batch, t_q, heads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"{op}: q and k must share the batch size, got {batch} and {k.shape[0]}")
    t_k = k.shape[1]
    if batch == 0 or t_q == 0 or t_k == 0:
        raise ValueError(f"{op}: empty input (B={batch}, T_q={t_q}, T_k={t_k}); every size must be >= 1")
    if max(t_q, t_k) > MAX_SEQLEN:
        raise ValueError(f"{op}: sequence length {max(t_q, t_k)} exceeds the supported {MAX_SEQLEN}")
    if batch > _MAX_GRID_YZ:
        raise ValueError(f"{op}: batch {batch} exceeds {_MAX_GRID_YZ}; split it into several calls")
    _check_causal(causal, op)
    if causal and t_k < t_q:
        raise ValueError(
            f"{op}: causal attention needs T_k >= T_q (bottom-right alignment), got {t_k} < {t_q}"
        )
    dropout_p, seed, sequence_offset, head_offset = _check_dropout(
        dropout_p, seed, sequence_offset, head_offset, heads, batch, op
    )
    return _scale(softmax_scale, head_dim, op), dropout_p, seed, sequence_offset, head_offset


def _check_packed_qkv(q, k, v, op: str) -> None:
    """``attention_varlen``'s checks of q, k, v alone (the first ones it makes)."""
    _check_qkv(q, k, v, 3, op)
    total_q, total_k = q.shape[0], k.shape[0]
    if total_q == 0 or total_k == 0:
        raise ValueError(f"{op}: empty input (total_q={total_q}, total_k={total_k}); need at least one token")


# --------------------------------------------------------------------------- public API


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    return_lse: bool = False,
    sequence_offset: int = 0,
    head_offset: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Deterministic scaled dot-product attention over a padded batch, with autograd.

    Computes ``softmax(q k^T * softmax_scale [+ causal mask]) v`` per sequence and head, with
    optional dropout on the attention probabilities. The backward pass gives dq, dk, dv.

    Args:
        q: ``(B, T_q, H_q, D)`` bf16 or fp16, on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        k: ``(B, T_k, H_kv, D)``, same dtype and device; ``H_q`` a multiple of ``H_kv`` (GQA/MQA:
            query head ``h`` uses key/value head ``h // (H_q // H_kv)``).
        v: ``(B, T_k, H_kv, D)``.
        causal: causal mask aligned to the bottom-right corner (flash-attn convention): query
            ``i`` sees keys ``j <= i + T_k - T_q``; needs ``T_k >= T_q``.
        softmax_scale: multiplier of ``q k^T``; default ``1 / sqrt(D)``.
        dropout_p: probability of zeroing an attention probability (kept ones scale by
            ``1 / (1 - dropout_p)``); a real number (int, float, numpy scalar; not a bool, str or
            tensor) in ``[0, 1)``.
        seed: Philox seed, an integer (int or numpy integer; not a bool, float or str) with
            ``0 <= seed < 2**64``; required when ``dropout_p > 0``, checked whenever given. Use a
            new seed per training step.
        return_lse: also return the natural log-sum-exp of the scaled scores, ``(B, H_q, T_q)``
            fp32 (no gradient flows through it).
        sequence_offset: global index of this batch's first sequence in the dropout key (data
            parallelism: give each rank its global offset to draw the undivided batch's mask); an
            integer (int or numpy integer; a float is rejected, never truncated).
        head_offset: global index of the first query head in the dropout key (tensor
            parallelism); an integer, as ``sequence_offset``.

    Returns:
        ``o`` of shape ``(B, T_q, H_q, D)`` in q's dtype; with ``return_lse``, ``(o, lse)``.

    Raises:
        TypeError: a non-tensor input, dtype other than bf16/fp16, or mixed dtypes; ``causal``
            not a bool; ``softmax_scale`` or ``dropout_p`` not a real number (a bool, str or
            tensor); ``seed``, ``sequence_offset`` or ``head_offset`` not an integer (a bool,
            float or str).
        ValueError: wrong ranks or shapes, head dim not 64 or 128, ``T = 0``, ``T > MAX_SEQLEN``
            (``2**22``), ``H_q`` not a multiple of ``H_kv``, causal with ``T_k < T_q``, a
            ``softmax_scale`` that is not finite and positive,
            ``dropout_p`` outside ``[0, 1)``, a seed outside ``[0, 2**64)`` or missing with
            dropout, offsets out of range, tensors on different devices.
        RuntimeError: CPU tensors without the Triton interpreter.

    **Determinism:** bitwise identical run to run (O, LSE, dq, dk, dv; no atomics: each gradient
    element is written once, summed in a fixed order). A sequence's outputs and gradients are the
    same bits whatever its batch size, position in the batch or neighbours, and equal to the same
    sequence given to ``attention_varlen`` beside any neighbours. Heads are independent, so
    splitting heads across ranks (keeping GQA groups together, with ``head_offset`` for dropout)
    reproduces the unsplit bits. Under causal context parallelism (a rank holds a chunk of queries
    and the keys up to the chunk's end) O, LSE and dq keep their bits when every chunk starts at
    a multiple of 128 tokens (then each row keeps its place in its tiles; other starts are checked
    on the GPU but not guaranteed); dk and dv do not (the ranks' partial sums are added outside
    the kernel, in another order). Dropout masks are a pure
    function of (seed, sequence index, head, query position, key position). Not guaranteed across
    GPU models, Triton versions, or between the GPU and the CPU interpreter (other block sizes).

    Method: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) after the Triton fused-attention
    tutorial, with atomics-free backward (separate dK/dV and dQ kernels).
    """
    op = "det_attn.attention"
    # a signature seen before has passed every check but dropout's (see _PADDED_CALLS); otherwise
    # every check runs, in order
    plain = type(causal) is bool and (softmax_scale is None or type(softmax_scale) in (float, int))
    key = _signature(q, k, v, causal, softmax_scale) if plain else None
    known = None if key is None else _PADDED_CALLS.get(key)
    if known is not None and (not known[1] or runtime.interpreter_active()):
        batch, t_q, heads, head_dim = q.shape
        scale = known[0]
        dropout_p, seed, sequence_offset, head_offset = _check_dropout(
            dropout_p, seed, sequence_offset, head_offset, heads, batch, op
        )
    else:
        scale, dropout_p, seed, sequence_offset, head_offset = _check_padded(
            q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, op
        )
        batch, t_q, heads, head_dim = q.shape
        if key is not None:
            _PADDED_CALLS.put(key, (scale, q.device.type == "cpu"))
    t_k = k.shape[1]
    # padded batch: sequence b starts at token b * T (no cu_seqlens tensors, no host sync)
    call = ((batch, t_q, t_k), t_q, t_k, scale, bool(causal), dropout_p, seed, sequence_offset, head_offset)
    o, lse2 = _attend(q, k, v, None, None, call)
    o = o.view(batch, t_q, heads, head_dim)
    if not return_lse:
        return o
    return o, (lse2 * math.log(2.0)).view(heads, batch, t_q).permute(1, 0, 2)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    return_lse: bool = False,
    sequence_offset: int = 0,
    head_offset: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Deterministic attention over packed variable-length sequences, with autograd.

    Sequence ``b`` holds query tokens ``cu_seqlens_q[b] : cu_seqlens_q[b+1]`` and key tokens
    ``cu_seqlens_k[b] : cu_seqlens_k[b+1]``; tokens attend only inside their own sequence.

    Args:
        q: ``(total_q, H_q, D)`` bf16 or fp16.
        k: ``(total_k, H_kv, D)``; ``H_q`` a multiple of ``H_kv``.
        v: ``(total_k, H_kv, D)``.
        cu_seqlens_q: ``(B + 1,)`` int32, non-decreasing, from 0 to ``total_q``.
        cu_seqlens_k: ``(B + 1,)`` int32, non-decreasing, from 0 to ``total_k``.
        max_seqlen_q: an integer (int, numpy integer; not bool or float) >= the longest query
            sequence (sets the launch grid).
        max_seqlen_k: an integer >= the longest key sequence.
        causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset: as in ``attention``;
            the dropout key's sequence index is ``sequence_offset + b`` and query/key positions
            count from the start of the sequence.
        return_lse: also return the natural LSE as ``(H_q, total_q)`` fp32.

    Returns:
        ``o`` of shape ``(total_q, H_q, D)``; with ``return_lse``, ``(o, lse)``.

    Raises:
        TypeError: as in ``attention``; cu_seqlens not int32 tensors; a max_seqlen that is a bool
            or not an integer.
        ValueError: as in ``attention``; cu_seqlens not 1-D, of different lengths, not monotone,
            not from 0 to the token count, on another device; a max_seqlen below the longest
            sequence or above ``MAX_SEQLEN``; a sequence with queries but no keys; causal with a
            sequence whose key length is below its query length.

    **Determinism:** as ``attention``: tiles start at each sequence's first token, so a
    sequence's O, LSE, dq, dk, dv are the same bits whatever is packed beside it, and equal to
    ``attention`` on that sequence alone (with the same sequence index for dropout). Validating
    ``cu_seqlens`` reads them on the host (one small copy, a synchronisation).

    Method: as ``attention`` (FlashAttention-2 varlen layout, Dao 2023).
    """
    op = "det_attn.attention_varlen"
    key = _signature(q, k, v)  # q, k, v's checks: as in attention (see _PACKED_CALLS)
    on_cpu = None if key is None else _PACKED_CALLS.get(key)
    if on_cpu is None or (on_cpu and not runtime.interpreter_active()):
        _check_packed_qkv(q, k, v, op)
        if key is not None:
            _PACKED_CALLS.put(key, q.device.type == "cpu")
    total_q, heads, head_dim = q.shape
    total_k = k.shape[0]
    len_q = _check_cu_seqlens(cu_seqlens_q, total_q, q.device, "cu_seqlens_q", op)
    len_k = _check_cu_seqlens(cu_seqlens_k, total_k, q.device, "cu_seqlens_k", op)
    if len_q.numel() != len_k.numel():
        raise ValueError(
            f"{op}: cu_seqlens_q and cu_seqlens_k describe {len_q.numel()} and "
            f"{len_k.numel()} sequences; they must match"
        )
    if len_q.numel() > _MAX_GRID_YZ:
        raise ValueError(f"{op}: {len_q.numel()} sequences exceed {_MAX_GRID_YZ}; split into several calls")
    max_seqlen_q = _as_max_seqlen(max_seqlen_q, "max_seqlen_q", len_q, op)
    max_seqlen_k = _as_max_seqlen(max_seqlen_k, "max_seqlen_k", len_k, op)
    if bool(((len_q > 0) & (len_k == 0)).any()):
        raise ValueError(f"{op}: a sequence has queries but no keys (its attention is undefined)")
    _check_causal(causal, op)
    if causal and bool((len_k < len_q).any()):
        raise ValueError(f"{op}: causal attention needs every key length >= its query length (bottom-right)")
    dropout_p, seed, sequence_offset, head_offset = _check_dropout(
        dropout_p, seed, sequence_offset, head_offset, heads, len_q.numel(), op
    )
    scale = _scale(softmax_scale, head_dim, op)
    max_q, max_k = max(max_seqlen_q, 1), max(max_seqlen_k, 1)
    call = (None, max_q, max_k, scale, bool(causal), dropout_p, seed, sequence_offset, head_offset)
    # the kernels read cu_seqlens with unit stride (a strided view's values were checked above)
    o, lse2 = _attend(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), call)
    if not return_lse:
        return o
    return o, lse2 * math.log(2.0)
