"""Deterministic, row-invariant LayerNorm forward and backward (Triton).

``y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the trailing ``normalized_shape``
(Ba, Kiros & Hinton, "Layer Normalization", 2016; the biased variance, as ``torch.nn.LayerNorm``).
Same structure as ``rms_norm.py`` (kernel layout after Liger-Kernel ``ops/layer_norm.py``).

Reduction orders (fixed; the table in docs/det-train.md names what changes bits):
- forward and dX: one program per row, fp32 math over the whole row in one block of
  ``next_pow2(D)`` elements (``tl.sum`` for the mean, then for the variance of ``x - mean``), so a
  row's bits depend on the row and D alone;
- dweight = sum over tokens of ``dy * x_hat`` in the canonical order, exactly as RMSNorm's weight:
  each backward program folds ``rows_per_chunk`` consecutive tokens sequentially in fp32, the
  chunks of a sub-leaf are folded in chunk order (``_leaf_sums.fold_chunks``) and the sub-leaves
  combined by the canonical tree (``_leaf_sums.tree_in_place``), or deposited into the active
  ``CanonicalGradAccumulator``;
- dbias = sum over tokens of ``dy``: ``weight_grad.bias_grad_partial``, the canonical order of a
  Linear's bias gradient (same bits as a Linear bias given the same ``dy``).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import BoundLaunch, PlanCache
from det_core.reduce import TreePartial
from det_core.runtime import check_kernel_device

from ..accum import deposit
from ..accum._leaf_sums import cast_out, chunk_subtrees, finish_param_grad, fold_chunks, sub_leaf_tokens
from ._library import Op
from ._norm_tiles import chunk_grads, chunk_tile, forward_rows, row_block, row_sum
from ._rms_norm_checks import positive_shape
from ._rms_norm_kernels import MAX_D, MAX_ROWS_PER_CHUNK, num_warps_for
from .linear import GradPlan, bias_grad_op, deposit_bias_op

__all__ = ["LayerNorm", "layer_norm"]

# The fixed config table is RMSNorm's (MAX_D, MAX_ROWS_PER_CHUNK, num_warps_for: keyed by D only).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    D,
    stride_x,
    stride_y,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr = 1,
):
    # ROWS rows per program (a divisor of M): 1 on the GPU, a tile in the interpreter (_norm_tiles)
    row, cols, mask = row_block(D, ROWS, BLOCK_D)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = row_sum(x, ROWS) / D
    xc = tl.where(mask, x - mean, 0.0)
    var = row_sum(xc * xc, ROWS) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, cast_out(y, y_ptr), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    M,
    D,
    stride_dy,
    stride_x,
    stride_dx,
    HAS_WEIGHT: tl.constexpr,
    ROWS_PER_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr = 0,
):
    # TILE (the interpreter, BLOCK_D >= 2): the chunk's rows as one tile (_norm_tiles.chunk_grads);
    # the GPU computes them one after another: the same values and operations, the same non-NaN bits
    chunk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if TILE:
        first = chunk.to(tl.int64) * ROWS_PER_CHUNK
        row, cols2, dx, lmask, dw_acc = chunk_grads(
            dy_ptr, x_ptr, mean_ptr, rstd_ptr, w if HAS_WEIGHT else cols, first, M, D, cols, mask,
            stride_dy, stride_x, HAS_WEIGHT, True, ROWS_PER_CHUNK,
        )  # fmt: skip
        tl.store(dx_ptr + row * stride_dx + cols2, cast_out(dx, dx_ptr), mask=lmask)
    else:
        for r in range(0, ROWS_PER_CHUNK):
            # rows past M (short last chunk): dy = 0 adds exact zeros to dw_acc and dx is not stored
            row = tl.minimum(chunk.to(tl.int64) * ROWS_PER_CHUNK + r, M - 1)
            lmask = mask & ((chunk.to(tl.int64) * ROWS_PER_CHUNK + r + cols * 0) < M)
            dy = tl.load(dy_ptr + row * stride_dy + cols, mask=lmask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
            x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
            if HAS_WEIGHT:
                wdy = dy * w
                dw_acc += dy * x_hat
            else:
                wdy = dy
            c1 = tl.sum(x_hat * wdy, axis=0) / D
            c2 = tl.sum(wdy, axis=0) / D
            dx = (wdy - (x_hat * c1 + c2)) * rstd
            tl.store(dx_ptr + row * stride_dx + cols, cast_out(dx, dx_ptr), mask=lmask)
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + chunk.to(tl.int64) * D + cols, dw_acc, mask=mask)


# Launches with their sizes, strides and constexprs bound (BoundLaunch), by what they are
# computed from: a call keys only its tensors (host time per launch).
_BOUND = PlanCache()


def _rows_of(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` as ``(M, D)`` rows with a unit last stride (a view where the strides allow)."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _layout(leaf: int) -> tuple[int, int]:
    """``(sub_leaf_tokens, rows_per_chunk)`` of leaves of ``leaf`` tokens (RMSNorm's rule)."""
    sub = sub_leaf_tokens(leaf)
    rows = MAX_ROWS_PER_CHUNK
    while sub % rows:
        rows //= 2
    return sub, rows


# ----------------------------------------------------------------------------- torch.library ops
@Op("layer_norm")
def layer_norm_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    d: int,
    ticket: torch.Tensor | None,
    leaf_tokens: int,
    deposit_weight: bool,
    deposit_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``det_train::layer_norm`` op: ``(y, mean, rstd)`` (``layer_norm`` after its checks; the
    fp32 ``(M,)`` statistics are saved for the backward). ``ticket`` / ``leaf_tokens`` /
    ``deposit_*``: what the forward decided for the weight and bias gradients."""
    x2 = _rows_of(x, d)
    m = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # not a view: FSDP2 hooks want a base
    mean = torch.empty((m,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m > 0:
        per = forward_rows(m)
        key = ("fwd", d, x2.stride(0), eps.hex(), weight is not None, bias is not None, per)
        bound = _BOUND.get(key)
        if bound is None:
            block_d = runtime.next_power_of_2(d)
            bound = _BOUND.put(key, BoundLaunch(
                _layer_norm_fwd_kernel, 6,
                (d, x2.stride(0), d, eps),  # y is contiguous: row stride D
                HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_D=block_d, ROWS=per,
                num_warps=num_warps_for(block_d),
            ))  # fmt: skip
        w_arg = weight if weight is not None else x2
        b_arg = bias if bias is not None else x2
        bound((m // per,), x2, w_arg, b_arg, y, mean, rstd)
    return y, mean, rstd


@layer_norm_op.register_fake
def _(x, weight, bias, eps, d, ticket, leaf_tokens, deposit_weight, deposit_bias):
    m = x.numel() // d
    stats = (x.new_empty((m,), dtype=torch.float32), x.new_empty((m,), dtype=torch.float32))
    return x.new_empty(x.shape), *stats


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, eps, d, ticket, leaf_tokens, deposit_weight, deposit_bias = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])  # saved leaves unpack as the Parameters
    ctx.d = d
    ctx.plan = GradPlan(leaf_tokens, deposit_weight, deposit_bias, ticket)  # the ticket: not saved


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    runtime.check_first_order("det_train.layer_norm")
    x, weight, bias, mean, rstd = ctx.saved_tensors
    d, plan = ctx.d, ctx.plan
    want_w = weight is not None and ctx.needs_input_grad[1]
    want_b = bias is not None and ctx.needs_input_grad[2]
    none = (None,) * 6
    if x.numel() == 0:
        dw = torch.zeros_like(weight) if want_w else None
        db = torch.zeros_like(bias) if want_b else None
        return torch.empty(x.shape, dtype=x.dtype, device=x.device), dw, db, *none
    x2, dy2 = _rows_of(x, d), _rows_of(dy, d)
    dw = db = None
    if want_w and plan.weight:
        dx = layer_norm_backward_deposit_op(dy2, x2, weight, mean, rstd, plan.ticket)
    else:
        dx, dw = layer_norm_backward_op(dy2, x2, weight, mean, rstd, plan.leaf_tokens, want_w)
        dw = dw if want_w else None
    if want_b:  # a Linear bias's gradient: the same ops, the same bits for the same dy
        if plan.bias:
            deposit_bias_op(dy2, bias, plan.ticket)
        else:
            db = bias_grad_op(dy2, plan.leaf_tokens, bias.dtype)
    return dx.view(x.shape), dw, db, *none


layer_norm_op.register_autograd(
    _layer_norm_backward, setup_context=_layer_norm_setup, nondifferentiable=(1, 2)
)


@Op("layer_norm_backward")
def layer_norm_backward_op(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    leaf_tokens: int,
    want_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``det_train::layer_norm_backward`` op: ``(dX (M, D), dweight)``, dweight the canonical
    tree over this call's sub-leaves (of leaves of ``leaf_tokens``) in the weight's dtype; an empty
    tensor for dweight when ``want_dw`` is False."""
    sub, rows = _layout(leaf_tokens)
    dx, partial = _backward(dy2, x2, weight, mean, rstd, rows)
    if not want_dw:
        return dx, dx.new_empty((0,))
    return dx, finish_param_grad(weight, fold_chunks(partial, sub // rows))


@layer_norm_backward_op.register_fake
def _(dy2, x2, weight, mean, rstd, leaf_tokens, want_dw):
    dw = weight.new_empty(weight.shape) if want_dw else dy2.new_empty((0,))
    return x2.new_empty(x2.shape), dw


@Op("layer_norm_backward_deposit", ("ticket",))
def layer_norm_backward_deposit_op(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    ticket: torch.Tensor,
) -> torch.Tensor:
    """The ``det_train::layer_norm_backward_deposit`` op: dX, with dweight deposited into the active
    accumulator at run time (as RMSNorm's weight)."""
    leaf = deposit.leaf_tokens("det_train.layer_norm")
    sub, rows = _layout(leaf)
    dx, partial = _backward(dy2, x2, weight, mean, rstd, rows)
    # whole leaves: this pass's chunk sums; an open leaf: its rows, summed with the rest of the leaf
    deposit.rows(
        "det_train.layer_norm",
        weight,
        (dy2, x2, mean, rstd),
        functools.partial(_dweight_leaves, weight, sub, rows),
        whole=functools.partial(chunk_subtrees, partial, sub // rows, leaf // sub, weight.shape),
    )
    ticket.add_(1)
    return dx


@layer_norm_backward_deposit_op.register_fake
def _(dy2, x2, weight, mean, rstd, ticket):
    return x2.new_empty(x2.shape)


def _backward(dy2, x2, weight, mean, rstd, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dX ``(M, D)`` and the fp32 chunk sums ``(ceil(M / rows), D)`` of ``dy * x_hat`` (``(1,)``
    without weight) of rows ``dy2``, ``x2`` (M, D) with their saved ``mean`` and ``rstd``."""
    m, d = x2.shape
    has_w = weight is not None
    dx = torch.empty((m, d), dtype=x2.dtype, device=x2.device)
    n_chunks = runtime.cdiv(m, rows)
    partial = torch.empty((n_chunks, d) if has_w else (1,), dtype=torch.float32, device=x2.device)
    key = ("bwd", m, d, dy2.stride(0), x2.stride(0), has_w, rows)
    bound = _BOUND.get(key)
    if bound is None:
        block_d = runtime.next_power_of_2(d)
        bound = _BOUND.put(key, BoundLaunch(
            _layer_norm_bwd_kernel, 7,
            (m, d, dy2.stride(0), x2.stride(0), d),  # dx is contiguous: row stride D
            HAS_WEIGHT=has_w, ROWS_PER_CHUNK=rows, BLOCK_D=block_d, TILE=chunk_tile(block_d),
            num_warps=num_warps_for(block_d),
        ))  # fmt: skip
    bound((n_chunks,), dy2, x2, weight if has_w else x2, mean, rstd, dx, partial)
    return dx, partial


def _dweight_leaves(weight, sub: int, rows: int, leaf: int, first_leaf: int, leaf_rows: tuple) -> TreePartial:
    """The accumulator's leaf-sum function of the LayerNorm weight: rows ``(dy, x, mean, rstd)`` of
    whole leaves, through the backward kernel (its dX is discarded), so the bits of an aligned call."""
    dy2, x2, mean, rstd = leaf_rows
    _, partial = _backward(dy2, x2, weight, mean, rstd, rows)
    return chunk_subtrees(partial, sub // rows, leaf // sub, weight.shape, first_leaf)


def _check_eps(eps, op: str) -> float:
    """``eps`` as a finite float ``>= 0`` (a negative one can make ``var + eps`` negative: NaN rows)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    value = float(eps)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}; torch's default is 1e-5")
    return value


def _normalized(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | tuple[int, ...],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Layer normalisation over the trailing ``normalized_shape`` dims (``F.layer_norm``'s signature).

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the mean and the biased variance over
    the ``D = prod(normalized_shape)`` trailing elements of each row.

    Args:
        x: ``(..., *normalized_shape)`` float32 / bfloat16 / float16, on CUDA (or CPU under
            ``TRITON_INTERPRET=1``). Rows may be strided; a non-unit last stride is copied.
        normalized_shape: int or tuple, the trailing dims normalised together; ``1 <= D <= 65536``.
        weight, bias: ``normalized_shape`` (any of the three dtypes, contiguous) or None.
        eps: added to the variance, finite and ``>= 0`` (default 1e-5, as torch).

    Returns:
        ``y`` of ``x``'s shape and dtype (as ``torch.nn.functional.layer_norm``; fp32 math, one
        rounding to nearest even).

    Gradients: dX row-local; dweight = sum over tokens of ``dy * x_hat`` and dbias = sum of ``dy``,
    both in the canonical order (deposited into the active ``CanonicalGradAccumulator`` if any;
    their autograd gradients are None then).

    **Determinism:** bitwise run to run; a row's y and dX do not depend on the number of rows, its
    position or the other rows (one program per row, config keyed by D only). dweight and dbias
    are invariant to micro-batch splits of any size and to leaf-aligned data-parallel splits under
    a ``CanonicalGradAccumulator``; without one they are the canonical sums over the call's own
    tokens (leaf size ``DEFAULT_LEAF_TOKENS``), which equal the accumulator's with that leaf size.
    Bits may differ between GPU models, Triton versions and the CPU interpreter (``tl.sum``'s
    tree, ``sqrt`` lowering, FMA contraction); they are not torch's bits (another summation order).

    Raises:
        TypeError: ``x``, ``weight`` or ``bias`` not a tensor or of an unsupported dtype; ``eps``
            not a real number.
        ValueError: an empty ``normalized_shape``, ``x`` not ending with it; a ``weight`` / ``bias``
            of another shape or not contiguous; ``D`` of 0 or over 65536; ``eps`` negative, NaN or infinite;
            tensors on different devices.
        RuntimeError: CPU tensors without the Triton interpreter, or another unsupported device.

    Method: Ba, Kiros & Hinton, "Layer Normalization" (2016); the backward
    ``dx = rstd * (w dy - mean(w dy) - x_hat * mean(w dy * x_hat))``.
    """
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"layer_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and t.dtype not in _DTYPES:
            raise TypeError(
                f"layer_norm: {name} dtype {t.dtype} is not supported (float32, bfloat16, float16)"
            )
    shape = _normalized(normalized_shape)
    if not shape:  # prod(()) is 1: every "row" would be one element of nothing normalized
        raise ValueError(
            "layer_norm: normalized_shape is (): the normalized dims must be at least one (torch: "
            "'Expected normalized_shape to be at least 1-dimensional'); e.g. normalized_shape=x.shape[-1:]"
        )
    d = math.prod(shape)
    trailing = tuple(x.shape[max(x.dim() - len(shape), 0) :])
    if x.dim() < len(shape) or trailing != shape:
        raise ValueError(
            f"layer_norm: x of shape {tuple(x.shape)} does not end with normalized_shape {shape}"
        )
    if d == 0 or d > MAX_D:
        raise ValueError(f"layer_norm: normalized size {d} must be in [1, {MAX_D}] (one row per program)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(
                f"layer_norm: {name} of shape {tuple(t.shape)} must have normalized_shape {shape}"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"layer_norm: {name} must be contiguous (it is read as a flat vector of D elements)"
            )
    check_kernel_device(x, *(t for t in (weight, bias) if t is not None), op="layer_norm")
    eps = _check_eps(eps, "layer_norm")
    leaf, active = deposit.accumulation()
    tokens = x.numel() > 0
    dep_w = active and tokens and weight is not None and weight.is_leaf
    dep_b = active and tokens and bias is not None and bias.is_leaf
    ticket = deposit.ticket() if dep_w or dep_b else None
    return layer_norm_op(x, weight, bias, eps, d, ticket, leaf, dep_w, dep_b)[0]


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for ``torch.nn.LayerNorm`` running ``det_train.layer_norm`` (same arguments, init and
    state_dict): ``y = (x - mean) / sqrt(var + eps) * weight + bias`` over ``normalized_shape``.

    Args:
        normalized_shape: int or tuple, the trailing dims normalized together (``D <= 65536``).
        eps: finite and ``>= 0`` (default 1e-5).
        elementwise_affine: learn ``weight`` (ones) and, with ``bias=True``, ``bias`` (zeros).
        bias: learn the additive ``bias`` (default True).
        device, dtype: of the parameters: float32, bfloat16 or float16.

    Forward: ``x (..., *normalized_shape)`` gives ``y`` of ``x``'s shape and dtype; fp32 math.

    Raises:
        TypeError: at construction, a parameter ``dtype`` other than float32 / bfloat16 / float16;
            at forward, as ``layer_norm``.
        ValueError: at construction, ``eps`` negative, NaN or infinite; at forward, as
            ``layer_norm`` (shapes, devices).

    **Determinism:** bitwise run to run; each row's output and input gradient are row invariant.
    ``weight`` and ``bias`` gradients are sums over tokens in the canonical order: equal bits for
    any micro-batch split and leaf-aligned data-parallel split under a ``CanonicalGradAccumulator``.
    Not torch's bits, nor guaranteed across GPU models or Triton versions; details in ``layer_norm``.

    Method: Ba, Kiros & Hinton, "Layer Normalization" (2016).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        eps = _check_eps(eps, "det_train.LayerNorm")
        normalized_shape = positive_shape(normalized_shape, "det_train.LayerNorm")
        if elementwise_affine and dtype is not None and dtype not in _DTYPES:
            raise TypeError(
                f"det_train.LayerNorm: dtype {dtype} is not supported (float32, bfloat16, float16)"
            )
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, tuple(self.normalized_shape), self.weight, self.bias, self.eps)
