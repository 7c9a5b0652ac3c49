"""Launch plans of det_attn: per call signature, every launch argument but the tensors, and the
launches themselves, built once and kept in one ``det_core.launch.PlanCache``.

The host side of a repeated call is then one dictionary lookup plus the launches (it bounds the
speed at short sequences). A plan also records what the signature-only argument checks found
(the scale, whether the tensors are on the CPU), so a call whose signature has a plan skips those
checks; the checks of per-call values (dropout arguments, ``cu_seqlens``) run on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from det_core import rng, runtime
from det_core.launch import BoundLaunch, PlanCache, launch

from . import _bwd_kernels, _configs, _descriptors, _fwd_kernel

# Plans by call signature (see padded_key, packed_key). A plan is a pure function of its key and
# of the config row it was built from; ``cached`` drops one whose row is no longer the table's.
PLANS = PlanCache()

# The dropout arguments (seed_lo, seed_hi, seq_offset, head_offset, threshold, drop_scale) of a
# call without dropout: the kernels read them only under DROPOUT (the offsets too: seq_id and
# head_id feed dropout_keep alone), so these fixed values let the launches bind them.
NO_DROPOUT = (0, 0, 0, 0, 0, 1.0)

_TENSOR = torch.Tensor
_PLAIN_SCALES = (type(None), float, int)  # softmax_scale (and softcap) kinds a key may hold as given
_PLAIN_REALS = (float, int)
_PLAIN_WINDOWS = (type(None), int)


@dataclass(frozen=True)
class FwdLaunch:
    """One forward kernel of a plan: grid, sizes (n_tiles, heads, seqlen_q, seqlen_k, group,
    qk_scale), constexprs and options, and the bound launch (None with dropout: see Plan)."""

    grid: tuple
    sizes: tuple
    meta: dict
    bound: BoundLaunch | None


@dataclass(frozen=True)
class Plan:
    """Everything the launches of one call signature need but the tensors and the dropout seed."""

    cfg: _configs.Config
    head_dim: int
    dense: tuple | None  # (B, T_q, T_k) of a padded batch; None: packed (cu_seqlens tensors)
    scale: float  # softmax_scale as checked
    causal: bool
    dropout: bool
    window: int  # sliding window (0: none), as checked
    softcap: float  # logit soft-cap (0.0: none), as checked
    on_cpu: bool  # CPU tensors: valid while the interpreter is on
    lse_shape: tuple  # (heads, total_q)
    fwd: FwdLaunch  # descriptors where fwd_tma, else pointer loads
    fwd_pointers: FwdLaunch  # pointer loads: for inputs not 16-byte aligned (fwd itself without fwd_tma)
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
    # Bound launches (BoundLaunch: every argument after the tensors fixed, so a call keys
    # only its tensors). Without dropout the dropout arguments are the fixed NO_DROPOUT; with
    # dropout they change per call (the seed), so the forward, dK/dV and dQ launches go through
    # ``launch`` and these two are None (as is fwd.bound).
    pre_launch: BoundLaunch
    dkdv_launch: BoundLaunch | None
    dq_launch: BoundLaunch | None


# --------------------------------------------------------------------------- keys and the cache


def _signature(q, k, v, *rest) -> tuple:
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
        q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, *rest,
    )  # fmt: skip


def _plain(q, k, v, causal, softmax_scale, dropout_p, window=None, softcap=None) -> bool:
    """Arguments of the kinds a training loop passes (plain tensors, a bool ``causal``, a None,
    float or int ``softmax_scale`` and ``softcap``, a float or int ``dropout_p``, a None or int
    ``window``): a key may hold them as given. Other kinds (a tensor subclass, a numpy scalar, ...)
    are checked on every call."""
    return (
        type(q) is _TENSOR
        and type(k) is _TENSOR
        and type(v) is _TENSOR
        and type(causal) is bool
        and type(softmax_scale) in _PLAIN_SCALES
        and type(dropout_p) in _PLAIN_REALS
        and type(window) in _PLAIN_WINDOWS
        and type(softcap) in _PLAIN_SCALES
    )


def padded_key(q, k, v, causal, softmax_scale, dropout_p, window=None, softcap=None) -> tuple | None:
    """The cache key of an ``attention`` call from its arguments as given (before any check), or
    None for other argument kinds (see ``_plain``). The operator finds the same key from its own
    arguments (``padded_signature``): the public function passes a plain ``softmax_scale``,
    ``window`` and ``softcap`` on as given (None included)."""
    if not _plain(q, k, v, causal, softmax_scale, dropout_p, window, softcap):
        return None
    return _signature(q, k, v, causal, softmax_scale, dropout_p != 0, window, softcap)


def padded_signature(
    q, k, v, causal: bool, softmax_scale: float | None, dropout: bool, window=None, softcap=None
) -> tuple:
    """The cache key of an ``attention_forward`` / ``attention_backward`` operator call (``_ops``)."""
    return _signature(q, k, v, causal, softmax_scale, dropout, window, softcap)


def packed_key(
    q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout_p, window=None,
    softcap=None,
):  # fmt: skip
    """The cache key of an ``attention_varlen`` call from its arguments as given, or None for other
    argument kinds (also: cu_seqlens_q not a plain tensor, a max_seqlen not an int); the same key
    as ``packed_signature`` of the operator call it makes."""
    if not (
        _plain(q, k, v, causal, softmax_scale, dropout_p, window, softcap)
        and type(cu_seqlens_q) is _TENSOR
        and type(max_seqlen_q) is int
        and type(max_seqlen_k) is int
    ):
        return None
    n_cu = cu_seqlens_q.shape[0] if cu_seqlens_q.dim() == 1 else None
    return _signature(
        q, k, v, n_cu, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout_p != 0, window, softcap
    )


def packed_signature(
    q, k, v, n_cu: int, max_seqlen_q: int, max_seqlen_k: int, causal, softmax_scale, dropout, window=None,
    softcap=None,
):  # fmt: skip
    """The cache key of an ``attention_varlen_forward`` / ``_backward`` operator call (``_ops``;
    ``n_cu``: the number of ``cu_seqlens`` entries)."""
    return _signature(
        q, k, v, n_cu, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout, window, softcap
    )


def cached(key) -> Plan | None:
    """The plan cached under ``key`` (None: no key), if it still holds: built from the table's
    current row for its head dim (benchmarks swap rows) and, for CPU tensors, with the interpreter
    still on (the device check passed only under it)."""
    plan = None if key is None else PLANS.get(key)
    if plan is None or plan.cfg is not _configs.config(plan.head_dim):
        return None
    if plan.on_cpu and not runtime.interpreter_active():
        return None
    return plan


def padded_plan(
    q, k, v, key, causal: bool, scale: float, dropout: bool, window: int = 0, softcap: float = 0.0
) -> Plan:
    """The plan of an ``attention`` call whose arguments passed every check: q, k, v as given
    (``(B, T, H, D)``); cached under ``key`` (``padded_key``; None: the key of the checked values).
    ``window`` and ``softcap`` as checked (0: none)."""
    if key is None:
        key = _signature(q, k, v, causal, scale, dropout, window or None, softcap or None)
    plan = cached(key)
    if plan is None:
        batch, t_q = q.shape[:2]
        t_k = k.shape[1]
        dense = (batch, t_q, t_k)
        qm, km, _ = kernel_inputs(*(_meta(t) for t in (q, k, v)), dense)
        plan = PLANS.put(
            key, build(qm, km, dense, batch, t_q, t_k, scale, causal, dropout, _on_cpu(q), window, softcap)
        )
    return plan


def packed_plan(
    q, k, v, key, batch: int, max_seqlen_q: int, max_seqlen_k: int, causal, scale, dropout, window=0,
    softcap=0.0,
) -> Plan:  # fmt: skip
    """The plan of an ``attention_varlen`` call whose arguments passed every check (``batch``
    sequences; the max_seqlen, window and softcap as checked); cached under ``key``
    (``packed_key``; None: the key of the checked values)."""
    if key is None:
        key = _signature(
            q, k, v, batch + 1, max_seqlen_q, max_seqlen_k, causal, scale, dropout, window or None,
            softcap or None,
        )  # fmt: skip
    plan = cached(key)
    if plan is None:
        qm, km, _ = kernel_inputs(*(_meta(t) for t in (q, k, v)), None)
        max_q, max_k = max(max_seqlen_q, 1), max(max_seqlen_k, 1)
        plan = PLANS.put(
            key, build(qm, km, None, batch, max_q, max_k, scale, causal, dropout, _on_cpu(q), window, softcap)
        )
    return plan


def _meta(t: torch.Tensor) -> torch.Tensor:
    # a tensor of t's layout that holds no data: the plan reads shapes and strides only
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _on_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


# --------------------------------------------------------------------------- building a plan


def kernel_inputs(q, k, v, dense):
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


def dropout_args(dropout_p: float, seed: int | None, sequence_offset: int, head_offset: int) -> tuple:
    """Kernel arguments seed_lo, seed_hi, seq_offset, head_offset, threshold, drop_scale."""
    if dropout_p == 0.0:
        return NO_DROPOUT
    seed_lo, seed_hi = rng.split_seed(int(seed))
    # keep an element iff its 32 random bits are >= threshold: P(keep) = 1 - threshold / 2**32
    threshold = min(int(round(dropout_p * 2**32)), 2**32 - 1)
    return seed_lo, seed_hi, sequence_offset, head_offset, threshold, 1.0 / (1.0 - dropout_p)


def _grid(n_tiles: int, heads: int, batch: int) -> tuple[int, int]:
    # axis 0: tile rank major over heads (see _tiles.program_tile); axis 1: sequences
    if n_tiles * heads >= 2**31:  # pragma: no cover - needs > 2**31 (tile, head) pairs
        raise ValueError(f"det_attn: {n_tiles} tiles x {heads} heads exceed the CUDA grid; split the heads")
    return (n_tiles * heads, batch)


def build(
    q, k, dense, batch, max_q, max_k, scale, causal, dropout, on_cpu=False, window=0, softcap=0.0
) -> Plan:
    """The plan of kernel inputs q, k (``kernel_inputs``; meta tensors will do: only shapes and
    strides are read) under the table's current row; ``dense``: ``(B, T_q, T_k)`` of a padded
    batch, or None (packed: ``batch`` sequences of at most ``max_q`` / ``max_k`` tokens).
    ``window`` (0: none) and ``softcap`` (0.0: none) become the kernels' ``WINDOW`` and ``SOFTCAP``
    constexprs, passed only when set: without them the launches are today's, argument for
    argument."""
    interp = _configs.INTERPRET
    head_dim = q.shape[2]
    cfg = _configs.config(head_dim)
    total_q, heads, _ = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    seqlen_q, seqlen_k = (dense[1], dense[2]) if dense is not None else (0, 0)
    # with a soft-cap the kernels take the tanh argument's scale (see _tiles)
    qk_scale = scale / softcap if softcap else scale * math.log2(math.e)
    o_strides = torch.empty_like(q, device="meta").stride()  # o, dq = empty_like(q)
    lse_stride = total_q  # lse2, delta: (heads, total_q) contiguous
    do_strides = (heads * head_dim, head_dim)  # dO is made contiguous
    dk_strides = torch.empty_like(k, device="meta").stride()
    common = dict(HEAD_DIM=head_dim, CAUSAL=causal, DROPOUT=dropout, UPCAST=interp, DENSE=dense is not None)
    if window:
        common["WINDOW"] = window
    if softcap:
        common["SOFTCAP"] = softcap
    n_kv = runtime.cdiv(max_k, cfg.dkdv_block_n)
    n_dq = runtime.cdiv(max_q, cfg.dq_block_m)
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
        if maxnreg and not dropout:  # the Philox tiles need more registers (see Config)
            meta["maxnreg"] = maxnreg
        n_fwd = runtime.cdiv(max_q, block_m)
        sizes = (n_fwd, heads, seqlen_q, seqlen_k, group, qk_scale)
        # without dropout every argument after the tensors is fixed (NO_DROPOUT): a bound launch
        bound = None if dropout else BoundLaunch(
            _fwd_kernel.attn_fwd_kernel, 7, (*sizes, *NO_DROPOUT, *fwd_strides), **meta
        )  # fmt: skip
        return FwdLaunch(_grid(n_fwd, heads, batch), sizes, meta, bound)

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
    if not dropout:  # the launches' arguments after the tensors, as ``launch`` gets them
        bound = BoundLaunch
        dkdv_launch = bound(
            _bwd_kernels.attn_bwd_dkdv_kernel, 10, (*dkdv_sizes, *NO_DROPOUT, *dkdv_strides), **dkdv_meta
        )
        dq_launch = bound(
            _bwd_kernels.attn_bwd_dq_kernel, 9, (*dq_sizes, *NO_DROPOUT, *dq_strides), **dq_meta
        )
    return Plan(
        cfg=cfg,
        head_dim=head_dim,
        dense=dense,
        scale=scale,
        causal=causal,
        dropout=dropout,
        window=window,
        softcap=softcap,
        on_cpu=on_cpu,
        lse_shape=(heads, total_q),
        fwd=fwd,
        fwd_pointers=fwd_pointers,
        fwd_strides=fwd_strides,
        fwd_tma=tma,
        fwd_descs=descs,
        pre_grid=(runtime.cdiv(total_q, pre_block), heads),
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
        pre_launch=BoundLaunch(_bwd_kernels.attn_bwd_preprocess_kernel, 3, pre_args, **pre_meta),
        dkdv_launch=dkdv_launch,
        dq_launch=dq_launch,
    )


# --------------------------------------------------------------------------- launches


def launch_forward(plan: Plan, q, k, v, cu_q, cu_k, drop: tuple | None):
    """``(o, lse2)`` of one forward call on kernel inputs; ``drop``: the dropout arguments
    (``dropout_args``), None without dropout (then the plan's bound launch, whose arguments are
    the same as ``launch`` would get)."""
    o = torch.empty_like(q)
    lse2 = q.new_empty(plan.lse_shape, dtype=torch.float32)
    if plan.dense is not None:  # a padded batch: no cu_seqlens tensors (any pointer will do)
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
        launch(kernel, fwd.grid, *tensors, *fwd.sizes, *drop, *plan.fwd_strides, **fwd.meta)
    return o, lse2


def launch_backward(plan: Plan, do, q, k, v, o, lse2, cu_q, cu_k, drop: tuple | None):
    """``(dq, dk, dv)`` of one backward call (``drop`` as in ``launch_forward``)."""
    if not do.is_contiguous():
        do = do.contiguous()
    delta = torch.empty_like(lse2)
    plan.pre_launch(plan.pre_grid, o, do, delta)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if plan.dense is not None:
        cu_q = cu_k = delta
    dkdv_tensors = (q, k, v, do, lse2, delta, dk, dv, cu_q, cu_k)
    dq_tensors = (q, k, v, do, lse2, delta, dq, cu_q, cu_k)
    if drop is None:
        plan.dkdv_launch(plan.dkdv_grid, *dkdv_tensors)
        plan.dq_launch(plan.dq_grid, *dq_tensors)
    else:
        kernel = _bwd_kernels.attn_bwd_dkdv_kernel
        launch(
            kernel,
            plan.dkdv_grid,
            *dkdv_tensors,
            *plan.dkdv_sizes,
            *drop,
            *plan.dkdv_strides,
            **plan.dkdv_meta,
        )
        kernel = _bwd_kernels.attn_bwd_dq_kernel
        launch(kernel, plan.dq_grid, *dq_tensors, *plan.dq_sizes, *drop, *plan.dq_strides, **plan.dq_meta)
    return dq, dk, dv
