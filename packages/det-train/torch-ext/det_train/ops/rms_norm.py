"""Deterministic, row-invariant RMSNorm forward and backward (Triton).

``y = x / sqrt(mean(x**2) + eps) * weight`` over the last dimension (Zhang & Sennrich, "Root Mean
Square Layer Normalization", NeurIPS 2019; kernel layout after Liger-Kernel ``ops/rms_norm.py``).

Reduction orders (fixed; the table below names what changes bits):
- forward and dX: one program per row, fp32 math over the whole row in one block of
  ``next_pow2(D)`` elements (``tl.sum``), so a row's bits depend on the row and D alone;
- dweight = sum over tokens of ``dy * x_hat`` in the canonical order: each program folds
  ``rows_per_chunk`` consecutive tokens sequentially in fp32, the chunks of a sub-leaf (at most
  ``_leaf_sums.SUB_LEAF_TOKENS`` tokens, a power-of-two part of the leaf) are folded in chunk order
  (``_leaf_sums.fold_chunks``) and sub-leaves are combined by the canonical pairwise tree
  on the GPU (``_leaf_sums.tree_in_place``: ``TreePartial``'s bits, no host round-trip), or its
  maximal subtrees are deposited into the active ``CanonicalGradAccumulator``.
- per-head rows (``rows_per_token`` ``g > 1``, a q/k norm over ``(B, T, H, D)``): the rows are
  tokens x ``g``, token-major, and the same order runs over them with leaves of ``leaf_tokens * g``
  rows (the canonical token leaves); a micro-batch boundary is a token, i.e. a multiple of ``g`` rows.

The kernels and their config table are in ``_rms_norm_kernels.py``, the interpreter's many-row
tiles (shared with LayerNorm) in ``_norm_tiles.py``; this module holds the op, its checks, launch
plans and autograd.
"""

from __future__ import annotations

import functools
import weakref

import torch
from det_core import runtime
from det_core.launch import BoundLaunch, PlanCache

from ..accum import deposit
from ..accum._leaf_sums import (
    SubLeafFold,
    chunk_subtrees,
    finish_param_grad,
    fold_chunks,
    fold_into_sub_leaves,
    sub_leaf_tokens,
    sub_leaves_node,
)
from ._library import Op
from ._norm_tiles import chunk_tile, forward_rows
from ._rms_norm_checks import _check_args, _check_eps, _check_offset, positive_shape
from ._rms_norm_kernels import (
    BWD_PREFETCH,
    MAX_ROWS_PER_CHUNK,
    _rms_norm_bwd_kernel,
    _rms_norm_fwd_kernel,
    num_warps_for,
)

__all__ = ["RMSNorm", "rms_norm"]


# Launches with their sizes, strides and constexprs bound (BoundLaunch), by what they are
# computed from: a call keys only its tensors (host time per launch).
_BOUND = PlanCache()


def _layout(leaf: int) -> tuple[int, int]:
    """``(sub_leaf_tokens, rows_per_chunk)`` of leaves of ``leaf`` tokens: the sub-leaf, and the largest
    power of two <= ``MAX_ROWS_PER_CHUNK`` dividing it (part of the order; never a function of M)."""
    sub = sub_leaf_tokens(leaf)
    rows = MAX_ROWS_PER_CHUNK
    while sub % rows:
        rows //= 2
    return sub, rows


def _rows_of(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` as ``(M, D)`` rows with a unit last stride (a view where the strides allow)."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _out_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    if weight is None or weight.dtype == x.dtype:
        return x.dtype
    return torch.promote_types(x.dtype, weight.dtype)


# ----------------------------------------------------------------------------- torch.library ops
@Op("rms_norm")
def rms_norm_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    d: int,
    offset: float,
    ticket: torch.Tensor | None,
    leaf_tokens: int,
    deposit: bool,
    rows_per_token: int = 1,
    fold: torch.Tensor | None = None,
    fold_pos: torch.Tensor | None = None,
    fold_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``det_train::rms_norm`` op: ``(y, rstd)`` (``rms_norm`` after its checks; ``rstd (M,)`` fp32
    is saved for the backward). ``ticket`` / ``leaf_tokens`` / ``deposit``: what the forward decided
    for the weight gradient (deposit it into the active accumulator, or return it); ``rows_per_token``:
    the rows of one token (a per-head norm's heads); ``fold`` / ``fold_pos`` / ``fold_count``: the
    weight's fixed sub-leaf folds, the micro-batch's first token in its leaf and the fold's counter
    (``CanonicalGradAccumulator.fixed_folds``: the backward continues them in place instead of
    depositing), or None."""
    x2 = _rows_of(x, d)
    m = x2.shape[0]
    # not a view: FSDP2 hooks want a base
    y = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m > 0:
        per = forward_rows(m)
        key = ("fwd", d, x2.stride(0), eps.hex(), weight is not None, offset, per)
        bound = _BOUND.get(key)
        if bound is None:
            block_d = runtime.next_power_of_2(d)
            bound = _BOUND.put(key, BoundLaunch(
                _rms_norm_fwd_kernel, 4,
                (d, x2.stride(0), d, eps),  # y is contiguous: row stride D
                HAS_WEIGHT=weight is not None, OFFSET=offset, BLOCK_D=block_d, ROWS=per,
                num_warps=num_warps_for(block_d),
            ))  # fmt: skip
        bound((m // per,), x2, weight if weight is not None else x2, y, rstd)
    return y, rstd


@rms_norm_op.register_fake
def _(x, weight, eps, d, offset, ticket, leaf_tokens, deposit, rows_per_token=1, *fold):
    y = x.new_empty(x.shape, dtype=_out_dtype(x, weight))
    return y, x.new_empty((x.numel() // d,), dtype=torch.float32)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, d, offset, ticket, leaf_tokens, deposit, *rest = (
        inputs  # trailing defaults may be left out
    )
    rows_per_token = rest[0] if rest else 1
    ctx.fold = tuple(rest[1:4]) if len(rest) > 3 and rest[1] is not None else None  # mutated: not saved
    ctx.save_for_backward(x, weight, output[1])  # a saved leaf unpacks as the Parameter itself
    ctx.d, ctx.offset, ctx.leaf_tokens, ctx.deposit = d, offset, leaf_tokens, deposit
    ctx.rows_per_token, ctx.n_rest = rows_per_token, len(inputs) - 2  # the gradients after dX, dweight
    ctx.ticket = ticket  # mutated by the deposit op: not saved (saving checks its version)


def _rms_norm_backward(ctx, dy, _drstd):
    runtime.check_first_order("det_train.rms_norm")
    x, weight, rstd = ctx.saved_tensors
    d = ctx.d
    want_w = weight is not None and ctx.needs_input_grad[1]
    if x.numel() == 0:
        dw = torch.zeros_like(weight) if want_w else None
        return torch.empty(x.shape, dtype=x.dtype, device=x.device), dw, *(None,) * ctx.n_rest
    x2, dy2 = _rows_of(x, d), _rows_of(dy, d)
    if want_w and ctx.fold is not None:
        if deposit.fold_wanted("det_train.rms_norm", weight, dy2):
            args = (dy2, x2, weight, rstd, ctx.offset, ctx.leaf_tokens, *ctx.fold)
            return rms_norm_backward_fold_op(*args).view(x.shape), None, *(None,) * ctx.n_rest
        want_w = False  # a backward that leaves the weight's gradient alone: dX only
    if want_w and ctx.deposit:
        dx = rms_norm_backward_deposit_op(dy2, x2, weight, rstd, ctx.offset, ctx.ticket, ctx.rows_per_token)
        return dx.view(x.shape), None, *(None,) * ctx.n_rest
    leaf_rows = ctx.leaf_tokens * ctx.rows_per_token  # a leaf of leaf_tokens tokens
    dx, dw = rms_norm_backward_op(dy2, x2, weight, rstd, ctx.offset, leaf_rows, want_w)
    return dx.view(x.shape), dw if want_w else None, *(None,) * ctx.n_rest


rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup, nondifferentiable=(1,))


@Op("rms_norm_backward")
def rms_norm_backward_op(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    leaf_tokens: int,
    want_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``det_train::rms_norm_backward`` op: ``(dX (M, D), dweight)``, dweight the canonical tree
    over this call's sub-leaves (of leaves of ``leaf_tokens`` rows) in the weight's dtype; an empty
    tensor for dweight when ``want_dw`` is False."""
    has_w = weight is not None
    sub, rows = _layout(leaf_tokens) if has_w else (1, MAX_ROWS_PER_CHUNK)
    dx, partial = _backward(dy2, x2, weight, rstd, rows, offset)
    if not want_dw:
        return dx, dx.new_empty((0,))
    return dx, finish_param_grad(weight, fold_chunks(partial, sub // rows))


@rms_norm_backward_op.register_fake
def _(dy2, x2, weight, rstd, offset, leaf_tokens, want_dw):
    dw = weight.new_empty(weight.shape) if want_dw else dy2.new_empty((0,))
    return x2.new_empty(x2.shape), dw


@Op("rms_norm_backward_deposit", ("ticket",))
def rms_norm_backward_deposit_op(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    ticket: torch.Tensor,
    rows_per_token: int = 1,
) -> torch.Tensor:
    """The ``det_train::rms_norm_backward_deposit`` op: dX, with dweight deposited into the active
    accumulator at run time (whole leaves: this pass's chunk sums; rows of a leaf split between
    micro-batches: carried, and summed from all its rows by the same kernel). ``rows_per_token``
    ``g``: the rows are tokens x ``g`` (a leaf is ``leaf_tokens * g`` rows)."""
    leaf = deposit.leaf_tokens("det_train.rms_norm") * rows_per_token  # in rows
    sub, rows = _layout(leaf)
    dx, partial = _backward(dy2, x2, weight, rstd, rows, offset)
    # whole leaves: this pass's chunk sums; an open leaf: carried as its sub-leaf folds
    deposit.rows(
        "det_train.rms_norm",
        weight,
        (dy2, x2, rstd),
        functools.partial(_dweight_leaves, weight, sub, rows, offset),
        fold=_dweight_fold(weight, leaf, sub, rows, offset, dy2, partial),
        whole=functools.partial(chunk_subtrees, partial, sub // rows, leaf // sub, weight.shape),
        rows_per_token=rows_per_token,
    )
    ticket.add_(1)
    return dx


@rms_norm_backward_deposit_op.register_fake
def _(dy2, x2, weight, rstd, offset, ticket, rows_per_token=1):
    return x2.new_empty(x2.shape)


@Op("rms_norm_backward_fold", ("fold", "fold_count"))
def rms_norm_backward_fold_op(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    leaf_tokens: int,
    fold: torch.Tensor,
    fold_pos: torch.Tensor,
    fold_count: torch.Tensor,
) -> torch.Tensor:
    """The ``det_train::rms_norm_backward_fold`` op: dX, with dweight's chunk sums added to the
    weight's fixed sub-leaf folds in place (``CanonicalGradAccumulator.fixed_folds``) and 1 to
    ``fold_count``: no host bookkeeping, so a CUDA graph may hold it (not tagged ``cudagraph_unsafe``)."""
    deposit.fold_checked("det_train.rms_norm", fold_count)
    sub, rows = _layout(leaf_tokens)
    dx, partial = _backward(dy2, x2, weight, rstd, rows, offset)
    fold_into_sub_leaves(partial, fold, fold_pos, rows, sub // rows)
    fold_count.add_(1)
    return dx


@rms_norm_backward_fold_op.register_fake
def _(dy2, x2, weight, rstd, offset, leaf_tokens, fold, fold_pos, fold_count):
    return x2.new_empty(x2.shape)


def takes_fixed_fold(module: torch.nn.Module) -> bool:
    """Whether ``CanonicalGradAccumulator.fixed_folds`` gives ``module``'s weight a fixed fold here:
    a ``det_train.RMSNorm`` with a weight and one row per token (no ``heads``)."""
    return (
        isinstance(module, RMSNorm) and module.weight is not None and getattr(module, "heads", None) is None
    )


def fixed_fold_spec(weight: torch.Tensor, leaf_tokens: int) -> tuple:
    """``(shape, step, close)`` of an RMSNorm weight's fixed fold: its leaf's sub-leaf folds
    ``(leaf_tokens / sub, *weight.shape)`` fp32, continued at multiples of the chunk rows, closed by
    the canonical tree over the sub-leaves present (``SubLeafFold.close``'s bits)."""
    sub, rows = _layout(leaf_tokens)
    close = functools.partial(sub_leaves_node, sub=sub, shape=weight.shape)
    return (leaf_tokens // sub, weight.numel()), rows, close


def _prefetch() -> int:
    # the interpreter runs a program's loads one after another: a prefetch there is only more Python
    return 0 if runtime.interpreter_active() else BWD_PREFETCH


def _backward(dy2, x2, weight, rstd, rows: int, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """dX ``(M, D)`` and the fp32 chunk sums ``(ceil(M / rows), D)`` of ``dy * x_hat`` (``(1,)``
    without weight) of rows ``dy2``, ``x2`` (M, D) with their saved ``rstd``."""
    m, d = x2.shape
    has_w = weight is not None
    dx = torch.empty((m, d), dtype=x2.dtype, device=x2.device)
    n_chunks = runtime.cdiv(m, rows)
    partial = torch.empty((n_chunks, d) if has_w else (1,), dtype=torch.float32, device=x2.device)
    key = ("bwd", m, d, dy2.stride(0), x2.stride(0), has_w, rows, offset)
    bound = _BOUND.get(key)
    if bound is None:
        block_d = runtime.next_power_of_2(d)
        bound = _BOUND.put(key, BoundLaunch(
            _rms_norm_bwd_kernel, 6,
            (m, d, dy2.stride(0), x2.stride(0), d),  # dx is contiguous: row stride D
            HAS_WEIGHT=has_w, OFFSET=offset, ROWS_PER_CHUNK=rows, BLOCK_D=block_d,
            PREFETCH=_prefetch(), TILE=chunk_tile(block_d), num_warps=num_warps_for(block_d),
        ))  # fmt: skip
    bound((n_chunks,), dy2, x2, weight if has_w else x2, rstd, dx, partial)
    return dx, partial


def _dweight_leaves(weight, sub: int, rows: int, offset: float, leaf: int, first_leaf: int, leaf_rows: tuple):
    """The accumulator's leaf-sum function of the RMSNorm weight: rows ``(dy, x, rstd)`` of whole
    leaves, through the backward kernel (its dX is discarded), so the bits of an aligned call."""
    dy2, x2, rstd = leaf_rows
    _, partial = _backward(dy2, x2, weight, rstd, rows, offset)
    return chunk_subtrees(partial, sub // rows, leaf // sub, weight.shape, first_leaf)


def _dweight_fold(weight, leaf: int, sub: int, rows: int, offset: float, dy2, chunk_sums) -> tuple:
    """The accumulator's resumable fold of the RMSNorm weight (``(step, fold, close)``): a leaf a
    micro-batch ends inside is carried as its sub-leaf folds (``SubLeafFold``: the finished
    sub-leaves' subtrees and the open sub-leaf's fp32 chunk fold), continued by the next
    micro-batch from its chunk sums; on the chunk step (``rows`` tokens) the bits of one batch.

    The chunk sums this micro-batch's backward already computed (``chunk_sums`` of ``dy2``'s
    chunks) serve the rows that are chunk-aligned views of ``dy2`` (held weakly: the carried state
    keeps no rows); other rows (the few copied ones that complete a step) run the backward kernel.
    """
    dy_ref, sums_ref = weakref.ref(dy2), weakref.ref(chunk_sums)
    ratio = leaf // sub

    def chunk_sums_of(leaf_rows: tuple) -> torch.Tensor:
        dy, x, rstd = leaf_rows
        src, sums = dy_ref(), sums_ref()
        if src is not None and sums is not None and dy.dtype == src.dtype and dy.stride() == src.stride():
            row_bytes = src.stride(0) * src.element_size()
            off = dy.data_ptr() - src.data_ptr()
            r, m = (off // row_bytes if row_bytes else -1), dy.shape[0]
            if off >= 0 and row_bytes and off % row_bytes == 0 and r + m <= src.shape[0] and r % rows == 0:
                if m % rows == 0 or r + m == src.shape[0]:  # whole chunks of this pass
                    return sums[r // rows : runtime.cdiv(r + m, rows)]
        return _backward(dy, x, weight, rstd, rows, offset)[1]  # its dX is discarded

    def fold(leaf_rows: tuple, state: SubLeafFold | None) -> SubLeafFold:
        state = SubLeafFold() if state is None else state
        return state.advance(chunk_sums_of(leaf_rows), leaf_rows[0].shape[0], sub, rows)

    return rows, fold, lambda state: state.close(sub, ratio, weight.shape)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    normalized_shape: tuple[int, ...] | None = None,
    *,
    offset: float = 0.0,
    rows_per_token: int = 1,
) -> torch.Tensor:
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dims, times
    ``offset + weight``.

    Args:
        x: ``(..., *normalized_shape)`` float32 / bfloat16 / float16, on CUDA (or CPU under
            ``TRITON_INTERPRET=1``). Rows may be strided; a non-unit last stride is copied.
        weight: ``normalized_shape`` (any of the three dtypes) or None (no affine scale).
        eps: added to the mean square, finite and ``>= 0``; None means ``torch.finfo(x.dtype).eps``
            (as torch.nn.RMSNorm).
        normalized_shape: trailing dims normalised together; default ``weight.shape`` or ``x.shape[-1:]``.
        offset: added to the weight in fp32 before it scales the row: ``y = x_hat * (offset + w)``
            (``w`` widened to fp32 first, then one fp32 add: Gemma's ``1.0 + weight.float()``, whose
            weight is stored zero-centred); 0.0 (default) is the plain ``x_hat * w``. Finite;
            needs a ``weight``. The weight gradient is the same either way (``dy * x_hat``).
        rows_per_token: ``g``, the rows (of ``x`` flattened to ``(M, D)``) of one token: 1 (default)
            for a norm over tokens; ``H`` for a per-head q/k norm over ``(B, T, H, D)`` (rows
            token-major, heads inner: Qwen3's, Gemma 3's ``q_norm`` / ``k_norm``). ``M`` must be a
            multiple of ``g``; the weight gradient's leaves are then ``leaf_tokens`` tokens
            (``leaf_tokens * g`` rows), so it sums over the micro-batch's tokens like the other ops.

    Returns:
        ``y`` of ``x``'s shape, dtype ``promote_types(x.dtype, weight.dtype)`` (``x.dtype`` without
        weight). All math is fp32.

    Gradients: dX row-local; dweight = sum over tokens of ``dy * x_hat`` in the canonical order
    (deposited into the active ``CanonicalGradAccumulator`` if any, autograd gradient None then).

    **Determinism:** bitwise run to run; a row's y and dX do not depend on the number of rows, its
    position or the other rows (one program per row, config keyed by D only). dweight is
    invariant to micro-batching (any token boundaries; with ``rows_per_token`` > 1 too, the order
    over a leaf's rows being fixed by its tokens) and data-parallel splits at leaf boundaries when a
    ``CanonicalGradAccumulator`` is active; without one it is the canonical sum over the call's own
    tokens (leaf size ``DEFAULT_LEAF_TOKENS`` tokens). Bits may differ between GPU models, Triton versions
    and the CPU interpreter (``tl.sum``'s tree and ``sqrt`` lowering).

    Raises:
        TypeError: ``x`` or ``weight`` not a tensor; non-float or unsupported dtypes.
        ValueError: a 0-d ``x``, an empty ``normalized_shape`` (or a 0-d weight giving it), as
            torch; weight shape or size mismatch (a weight whose shape is not ``x``'s trailing
            dims), trailing shape mismatch, normalized size 0 (must be >= 1) or over 65536,
            ``eps`` negative, NaN or infinite; ``offset`` not finite, or non-zero without a
            weight; ``rows_per_token`` not a positive int or not dividing the rows; tensors on
            different devices.
        RuntimeError: CPU tensors without the Triton interpreter, or another unsupported device.

    Reference: Zhang & Sennrich, "Root Mean Square Layer Normalization" (NeurIPS 2019), as
    ``torch.nn.functional.rms_norm``; the weight gradient's order is det_core's canonical leaf /
    tree order (docs/det-train.md, "RMSNorm").
    """
    key = _signature(x, weight, eps, normalized_shape, offset, rows_per_token)
    checked = None if key is None else _CHECKED.get(key)
    if checked is None:
        checked = _check_args(x, weight, eps, normalized_shape, offset, rows_per_token)
        if key is not None:
            _CHECKED.put(key, checked)
    d, eps, offset = checked
    leaf, active = deposit.accumulation()
    deposits = active and weight is not None and weight.is_leaf and x.numel() > 0
    fixed = None
    if deposits and rows_per_token == 1:
        fixed = deposit.fixed_fold("det_train.rms_norm", weight, x.numel() // d)
    ticket = deposit.ticket() if deposits and fixed is None else None
    fold = (None, None, None) if fixed is None else (fixed[0], deposit.fixed_fold_pos(), fixed[1])
    return rms_norm_op(x, weight, eps, d, offset, ticket, leaf, deposits, int(rows_per_token), *fold)[0]


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# ``_check_args``'s results ``(d, eps, offset)`` by everything they are computed from
_CHECKED = PlanCache()


def _signature(x, weight, eps, normalized_shape, offset, rows_per_token) -> tuple | None:
    """What ``_check_args`` reads, for plain eager tensors on a kernel device and plain Python
    arguments (a float or None eps, a float offset, a tuple of ints or None shape); None otherwise
    (then it checks in full: traced calls, other types, CPU without the interpreter)."""
    if torch.compiler.is_compiling() or type(x) not in _PLAIN or type(offset) is not float:
        return None
    if type(rows_per_token) is not int:
        return None
    if weight is not None and type(weight) not in _PLAIN:
        return None
    if eps is not None and type(eps) is not float:
        return None
    if normalized_shape is not None and (
        type(normalized_shape) is not tuple or any(type(s) is not int for s in normalized_shape)
    ):
        return None
    device = x.device
    if device.type != "cuda" and not runtime.interpreter_active():
        return None
    w = None if weight is None else (weight.dtype, weight.shape, weight.stride(), weight.device)
    # eps by its bits: -0.0 and 0.0 are equal keys but different kernel constants
    eps_bits = None if eps is None else eps.hex()
    return (x.dtype, x.shape, device, w, eps_bits, normalized_shape, offset, rows_per_token)


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in for ``torch.nn.RMSNorm`` running ``det_train.rms_norm`` (same arguments, init and
    state_dict): ``y = x / sqrt(mean(x**2) + eps) * (offset + weight)`` over the trailing
    ``normalized_shape`` (``offset`` 0 by default: torch's ``x_hat * weight``).

    Args:
        normalized_shape: int or tuple, the trailing dims normalized together; their product ``D``
            is at most 65536.
        eps: finite and ``>= 0``; None (default) means ``torch.finfo(x.dtype).eps`` at each call.
        elementwise_affine: learn a ``weight`` of shape ``normalized_shape``, initialised to
            ``1 - offset`` (ones by default; zeros for Gemma's ``offset=1.0``: a scale of 1).
        device, dtype: of ``weight``: float32, bfloat16 or float16, on CUDA (or CPU under
            ``TRITON_INTERPRET=1``).
        offset: keyword-only, added to the weight in fp32 (``rms_norm``'s ``offset``; Gemma-style
            norms store ``weight`` zero-centred and scale by ``1 + weight``). Not in the state_dict.
        heads: keyword-only, None (default) or ``H``: a per-head norm (Qwen3's, Gemma 3's q/k
            norms) whose input has ``H`` rows per token. Its head axis is the leading dim that is
            innermost in memory (the smallest stride among those of size > 1: a view of the q / k
            projection's output, ``(B, T, H, D)`` or its transpose ``(B, H, T, D)``), and must have
            ``H`` elements; the other leading dims, in order, are the tokens. The rows are handed
            to ``rms_norm`` token-major (``rows_per_token=H``; a view, no copy). Not in the
            state_dict.

    Forward: ``x`` of shape ``(..., *normalized_shape)`` (float32 / bfloat16 / float16) gives ``y``
    of ``x``'s shape in ``promote_types(x.dtype, weight.dtype)``; fp32 math.
    With ``heads``, ``x`` needs a head axis besides ``normalized_shape``.

    Raises:
        TypeError: at construction, ``normalized_shape`` not an int or a sequence of ints, a weight
            ``dtype`` other than float32, bfloat16, float16, or an ``offset`` that is not a real number.
        ValueError: at construction, an empty ``normalized_shape`` or one with a dim below 1,
            ``eps`` negative, NaN or infinite, ``offset`` not finite or non-zero without a weight. At
            forward, as ``rms_norm``: TypeError for unsupported dtypes; ValueError for a trailing
            shape other than ``normalized_shape`` or ``D`` over 65536, or (with ``heads``) an input
            whose innermost leading dim in memory does not have ``heads`` elements; RuntimeError /
            ValueError for device problems.

    **Determinism:** bitwise run to run; each row's output and input gradient do not depend on
    the number of rows, its position or the other rows. The weight gradient is a sum over tokens in
    the canonical order: invariant to micro-batch and data-parallel splits under a
    ``CanonicalGradAccumulator`` (with ``heads`` too: its leaves are tokens, each of ``heads``
    rows). Not guaranteed across GPU models, Triton versions or the CPU interpreter; details in
    ``rms_norm``.

    Method: Zhang & Sennrich, "Root Mean Square Layer Normalization" (NeurIPS 2019); the
    ``1 + weight`` form is Gemma's (Gemma Team, "Gemma: Open Models Based on Gemini Research and
    Technology", 2024; transformers ``GemmaRMSNorm``).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        offset: float = 0.0,
        heads: int | None = None,
    ) -> None:
        eps = _check_eps(eps, "det_train.RMSNorm")
        normalized_shape = positive_shape(normalized_shape, "det_train.RMSNorm")
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise ValueError(f"det_train.RMSNorm: heads must be None or a positive int, got {heads!r}")
        if (
            elementwise_affine
            and dtype is not None
            and dtype not in (torch.float32, torch.bfloat16, torch.float16)
        ):
            raise TypeError(
                f"det_train.RMSNorm: weight dtype {dtype} is not supported (float32, bfloat16, float16)"
            )
        offset = _check_offset(offset, True if elementwise_affine else None, "det_train.RMSNorm")
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.offset, self.heads = offset, heads
        if offset != 0.0:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ``1 - offset`` (a scale of one), as ``torch.nn.RMSNorm`` sets ones."""
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(1.0 - getattr(self, "offset", 0.0))

    def extra_repr(self) -> str:
        heads = getattr(self, "heads", None)
        return (
            super().extra_repr()
            + (f", offset={self.offset}" if self.offset else "")
            + (f", heads={heads}" if heads is not None else "")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        heads = getattr(self, "heads", None)  # a module rebuilt by convert from an older one has none
        if heads is None:
            return rms_norm(x, self.weight, self.eps, shape, offset=self.offset)
        axis = _head_axis(x, heads, len(shape))
        rows = x.movedim(axis, -len(shape) - 1)  # tokens (the other leading dims) x heads x shape
        y = rms_norm(rows, self.weight, self.eps, shape, offset=self.offset, rows_per_token=heads)
        return y.movedim(-len(shape) - 1, axis)


def _head_axis(x: torch.Tensor, heads: int, k: int) -> int:
    """The head axis of a per-head norm's input: the leading dim (before the ``k`` normalized ones)
    innermost in memory among those of size > 1 (the projection's heads, whatever the view's dim
    order), checked to have ``heads`` elements."""
    lead = x.dim() - k
    if lead < 1:
        raise ValueError(
            f"det_train.RMSNorm(heads={heads}): x of shape {tuple(x.shape)} has no dim besides its {k} "
            "normalized one(s): a per-head norm takes (B, T, H, D) or (B, H, T, D)"
        )
    dims = [i for i in range(lead) if x.shape[i] > 1]
    # the smallest stride; among equal strides (size-1 neighbours) the last dim (no min(key=...):
    # Dynamo does not trace it)
    axis = -min([(x.stride(i), -i) for i in dims])[1] if dims else lead - 1
    if x.shape[axis] != heads:
        raise ValueError(
            f"det_train.RMSNorm(heads={heads}): x of shape {tuple(x.shape)} (strides {x.stride()}) has "
            f"no head axis of {heads} elements innermost in memory before its {k} normalized dim(s): a "
            "per-head norm takes a view of the q / k projection's output, (B, T, H, D) or its "
            "transpose (B, H, T, D), H being the heads of that projection"
        )
    return axis
