"""Row-invariant cross-entropy over a vocabulary, with the mean over tokens in the canonical order.

Per token ``i`` with logits row ``x`` (V entries) and target ``t``:
``loss_i = logsumexp(x) - x[t]`` (0 for ``t == ignore_index``), computed by one program per row
with an online max / sum-of-exp in fp32 over chunks of ``min(4096, next_pow2(V))`` logits in order
(Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018). The mean is the canonical
sum of the token losses (leaves of ``leaf_tokens`` tokens folded in token order, the pairwise tree
over leaves) divided by the number of counted tokens, or by ``num_global_tokens``. Backward is
elementwise: ``dlogits = (softmax(x) - onehot(t)) * scale_i``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import launch
from det_core.runtime import as_index, check_kernel_device

from ..accum._leaf_sums import leaf_layout, tree_in_place
from ._library import Op

__all__ = ["cross_entropy"]

# Fixed config table, keyed by V only (never by N, so rows are batch-invariant). The forward's
# block changes bits (the chunk order of the online logsumexp and the tl.max / tl.sum tree inside
# a chunk); so do its warps. The backward is elementwise: its block does not change bits.
MAX_BLOCK_V = 4096
MAX_BWD_BLOCK_V = 4096


def _fwd_config(v: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the forward for vocabulary size ``v`` (both change bits)."""
    block = min(MAX_BLOCK_V, runtime.next_power_of_2(v))
    return block, 8 if block >= 4096 else 4 if block >= 1024 else 1


@triton.jit
def _ce_fwd_kernel(
    x_ptr,
    t_ptr,
    loss_ptr,
    lse_ptr,
    V,
    stride_x,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    x_t = tl.load(base + tl.where(valid, t, 0)).to(tl.float32)
    loss = tl.where(valid, lse - x_t, 0.0)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(
    x_ptr,
    t_ptr,
    lse_ptr,
    scale_ptr,
    dx_ptr,
    V,
    stride_x,
    stride_dx,
    scale_stride,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    t = tl.load(t_ptr + row)
    scale = tl.load(scale_ptr + row * scale_stride)
    scale = tl.where(t != ignore_index, scale, 0.0)
    p = tl.exp(x - lse)
    g = (p - tl.where(cols == t, 1.0, 0.0)) * scale
    tl.store(dx_ptr + row * stride_dx + cols, g.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_leaf_sum_kernel(loss_ptr, out_ptr, N, LEAF: tl.constexpr, LANES: tl.constexpr):
    # lane j folds tokens j, j + LANES, ... of the leaf in order; then a fixed tl.sum over lanes
    leaf = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, LANES)
    acc = tl.zeros((LANES,), dtype=tl.float32)
    for start in range(0, LEAF, LANES):
        local = start + offs
        idx = leaf * LEAF + local
        acc += tl.load(loss_ptr + idx, mask=(local < LEAF) & (idx < N), other=0.0)
    tl.store(out_ptr + leaf, tl.sum(acc, axis=0))


_LANES = 128  # changes bits of the loss sum (fixed)


# ----------------------------------------------------------------------------- torch.library ops
# Two op pairs with one implementation. The counting pair (reduction "mean" without
# num_global_tokens) counts the non-ignored targets on the host and returns that denominator as a
# CPU tensor for the backward: data_dependent, so CUDA-graph trees run it between graph partitions
# (they refuse a CPU tensor as a partition's input or output). The fixed-scale pair (reduction
# "none" or "sum", or "mean" with num_global_tokens: every accumulator micro-batch) takes the
# denominator as an int and returns CUDA tensors only, so CUDA-graph trees capture it with the ops
# around it; its only host read is the target range check, skipped during capture as the
# counting pair's. Same kernels, same arithmetic: the same bits.
def _forward(logits2, targets1, ignore_index: int, reduction: str, denominator: int | None):
    """``(loss, lse, denominator)``; ``denominator`` None: count the non-ignored targets (host)."""
    n, v = logits2.shape
    count = None
    if logits2.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # CUDA graph capture: reading a device value (the range check, the token count) is
        # impossible here; the graph replays the kernels on whatever targets the buffer holds
        if reduction == "mean" and denominator is None and targets1.numel():
            raise RuntimeError(
                "cross_entropy: reduction='mean' without num_global_tokens counts the non-ignored tokens "
                "on the host, which CUDA graph capture cannot do; pass num_global_tokens"
            )
    elif targets1.numel():
        valid = targets1 != ignore_index
        # one host sync for the range check and (mean) the token count: the denominator, or (given)
        # what it must cover
        bad = (valid & ((targets1 < 0) | (targets1 >= v))).any()
        if reduction == "mean":
            n_bad, count = torch.stack([bad.to(torch.int64), valid.sum()]).tolist()
        else:
            n_bad = int(bad)
        if n_bad:
            first = int(targets1[valid & ((targets1 < 0) | (targets1 >= v))][0])
            raise ValueError(f"cross_entropy: target {first} is outside [0, {v}) and is not ignore_index")
        if reduction == "mean" and denominator is not None and count > denominator:
            raise ValueError(
                f"cross_entropy: num_global_tokens={denominator} is smaller than the {count} non-ignored "
                "tokens of this call alone; it must count the non-ignored tokens of the whole global batch "
                "(every micro-batch and data-parallel rank)"
            )
    if reduction != "mean":
        denominator = 0
    elif denominator is None:
        denominator = int(count or 0)
    loss = torch.empty((n,), dtype=torch.float32, device=logits2.device)
    lse = torch.empty((n,), dtype=torch.float32, device=logits2.device)
    if n:
        launch(
            _ce_fwd_kernel,
            (n,),
            logits2,
            targets1,
            loss,
            lse,
            v,
            logits2.stride(0),
            ignore_index,
            BLOCK_V=_fwd_config(v)[0],
            num_warps=_fwd_config(v)[1],
        )
    if reduction == "none":
        return loss, lse, denominator
    total = _canonical_token_sum(loss)
    # a Python int divisor, as before (on CUDA a CPU scalar divides as a * (1 / b), a device one does not)
    return (total if reduction == "sum" else total / denominator), lse, denominator


def _loss_fake(logits2, reduction: str) -> torch.Tensor:
    n = logits2.shape[0]
    return logits2.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)


@Op("cross_entropy", data_dependent=True)
def cross_entropy_op(
    logits2: torch.Tensor,
    targets1: torch.Tensor,
    ignore_index: int,
    reduction: str,
    num_global_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``det_train::cross_entropy`` op on ``(N, V)`` logits and ``(N,)`` int64 targets
    (``cross_entropy`` after its checks; the counting path, ``reduction="mean"`` without
    ``num_global_tokens``, though it accepts any): ``(loss, lse, denominator)``, ``loss`` the fp32
    per-token losses (``"none"``) or their canonical sum (``"sum"``) or mean (``"mean"``), ``lse
    (N,)`` fp32 for the backward, ``denominator`` a CPU int64 scalar (``num_global_tokens``, else
    the counted tokens; 0 when unused). The target range check and the token count read device
    values here (one host sync), skipped during CUDA graph capture."""
    loss, lse, denominator = _forward(logits2, targets1, ignore_index, reduction, num_global_tokens)
    return loss, lse, torch.tensor(denominator, dtype=torch.int64)  # a CPU scalar: no device copy


@cross_entropy_op.register_fake
def _(logits2, targets1, ignore_index, reduction, num_global_tokens):
    count = torch.empty((), dtype=torch.int64, device="cpu")
    return _loss_fake(logits2, reduction), logits2.new_empty((logits2.shape[0],), dtype=torch.float32), count


def _cross_entropy_setup(ctx, inputs, output):
    logits2, targets1, ignore_index, reduction, num_global_tokens = inputs
    ctx.save_for_backward(logits2, targets1, output[1], output[2])
    ctx.ignore_index, ctx.reduction = ignore_index, reduction


def _cross_entropy_backward(ctx, grad_out, _dlse, _dcount):
    runtime.check_first_order("det_train.cross_entropy")
    logits2, targets1, lse, denominator = ctx.saved_tensors
    dx = cross_entropy_backward_op(
        grad_out, logits2, targets1, lse, denominator, ctx.ignore_index, ctx.reduction
    )
    return dx, None, None, None, None


cross_entropy_op.register_autograd(
    _cross_entropy_backward, setup_context=_cross_entropy_setup, nondifferentiable=(1,)
)


@Op("cross_entropy_fixed_scale")
def cross_entropy_fixed_scale_op(
    logits2: torch.Tensor,
    targets1: torch.Tensor,
    ignore_index: int,
    reduction: str,
    denominator: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``det_train::cross_entropy_fixed_scale`` op: ``(loss, lse)`` as ``cross_entropy_op``'s,
    the mean divided by ``denominator`` (``num_global_tokens``; unused for ``"none"`` / ``"sum"``),
    no token count and no CPU output: what CUDA-graph trees can capture."""
    loss, lse, _ = _forward(logits2, targets1, ignore_index, reduction, denominator)
    return loss, lse


@cross_entropy_fixed_scale_op.register_fake
def _(logits2, targets1, ignore_index, reduction, denominator):
    return _loss_fake(logits2, reduction), logits2.new_empty((logits2.shape[0],), dtype=torch.float32)


def _fixed_scale_setup(ctx, inputs, output):
    logits2, targets1, ignore_index, reduction, denominator = inputs
    ctx.save_for_backward(logits2, targets1, output[1])
    ctx.ignore_index, ctx.reduction, ctx.denominator = ignore_index, reduction, denominator


def _fixed_scale_backward(ctx, grad_out, _dlse):
    runtime.check_first_order("det_train.cross_entropy")
    logits2, targets1, lse = ctx.saved_tensors
    dx = cross_entropy_fixed_scale_backward_op(
        grad_out, logits2, targets1, lse, ctx.ignore_index, ctx.reduction, ctx.denominator
    )
    return dx, None, None, None, None


cross_entropy_fixed_scale_op.register_autograd(
    _fixed_scale_backward, setup_context=_fixed_scale_setup, nondifferentiable=(1,)
)


def _backward(grad_out, logits2, targets1, lse, ignore_index: int, reduction: str, denominator: int):
    """dlogits ``(N, V)`` = ``(softmax - onehot) * scale``, one fp32 scale per token (``"none"``) or
    for all (``grad_out``, divided by ``denominator`` for ``"mean"``)."""
    n, v = logits2.shape
    dx = torch.empty_like(logits2, memory_format=torch.contiguous_format)
    if reduction == "none":
        scale, scale_stride = grad_out.to(torch.float32).contiguous(), 1
    elif reduction == "sum":
        scale, scale_stride = grad_out.to(torch.float32).reshape(1), 0
    else:
        # the same fp32 scalar for every token of every micro-batch: elementwise, so split-invariant
        scale, scale_stride = (grad_out.to(torch.float32) / denominator).reshape(1), 0
    if n:
        block = min(MAX_BWD_BLOCK_V, runtime.next_power_of_2(v))
        grid = (n, runtime.cdiv(v, block))
        launch(
            _ce_bwd_kernel,
            grid,
            logits2,
            targets1,
            lse,
            scale,
            dx,
            v,
            logits2.stride(0),
            dx.stride(0),
            scale_stride,
            ignore_index,
            BLOCK_V=block,
        )
    return dx


@Op("cross_entropy_backward", data_dependent=True)
def cross_entropy_backward_op(
    grad_out: torch.Tensor,
    logits2: torch.Tensor,
    targets1: torch.Tensor,
    lse: torch.Tensor,
    denominator: torch.Tensor,
    ignore_index: int,
    reduction: str,
) -> torch.Tensor:
    """The ``det_train::cross_entropy_backward`` op (the counting path's): dlogits ``(N, V)``, the
    mean's scale divided by the CPU ``denominator``'s value (a host read)."""
    return _backward(grad_out, logits2, targets1, lse, ignore_index, reduction, int(denominator))


@cross_entropy_backward_op.register_fake
def _(grad_out, logits2, targets1, lse, denominator, ignore_index, reduction):
    return torch.empty_like(logits2, memory_format=torch.contiguous_format)


@Op("cross_entropy_fixed_scale_backward")
def cross_entropy_fixed_scale_backward_op(
    grad_out: torch.Tensor,
    logits2: torch.Tensor,
    targets1: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    reduction: str,
    denominator: int,
) -> torch.Tensor:
    """The ``det_train::cross_entropy_fixed_scale_backward`` op: dlogits ``(N, V)`` as
    ``cross_entropy_backward_op``'s, the mean's scale divided by the int ``denominator``."""
    return _backward(grad_out, logits2, targets1, lse, ignore_index, reduction, denominator)


@cross_entropy_fixed_scale_backward_op.register_fake
def _(grad_out, logits2, targets1, lse, ignore_index, reduction, denominator):
    return torch.empty_like(logits2, memory_format=torch.contiguous_format)


def _canonical_token_sum(loss: torch.Tensor) -> torch.Tensor:
    """Canonical sum of per-token fp32 losses: per-sub-leaf sums in a fixed order (128 lanes, each a
    fold in token order, then a fixed tl.sum), pairwise tree over sub-leaves (``_leaf_sums``; 1024
    tokens for the default leaf). The returned value is this call's partial sum.
    """
    n = loss.shape[0]
    if n == 0:
        return loss.new_zeros(())
    leaf = leaf_layout(1)[2]  # the sub-leaf: one program per leaf of 8192 tokens would be slow
    n_leaves = -(-n // leaf)
    sums = torch.empty((n_leaves,), dtype=torch.float32, device=loss.device)
    launch(_token_leaf_sum_kernel, (n_leaves,), loss, sums, n, LEAF=leaf, LANES=_LANES, num_warps=4)
    # the pairwise tree over the leaves in one kernel (TreePartial's bits, no host round-trip)
    return tree_in_place(sums.view(n_leaves, 1), 0, torch.float32).view(())


def _as_token_count(value) -> int:
    """``num_global_tokens`` as a positive int: any integer type (``operator.index``: int, numpy
    integers, 1-element integer tensors), never a bool, float or str (no silent truncation)."""
    count = as_index(value, "num_global_tokens", "cross_entropy", "; pass the global batch's token count")
    if count <= 0:
        raise ValueError(f"cross_entropy: num_global_tokens must be a positive int, got {count}")
    return count


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_global_tokens: int | None = None,
) -> torch.Tensor:
    """Token-level cross-entropy loss over the last dimension of ``logits``.

    Args:
        logits: ``(..., V)`` float32 / bfloat16 / float16 (classes on the LAST dim, as in language
            models; unlike ``torch.nn.functional.cross_entropy``'s ``(N, C, d...)``). Rows may be
            strided; a non-unit last stride is copied.
        targets: ``(...)`` int64 / int32 class indices in ``[0, V)`` or ``ignore_index``.
        ignore_index: target value whose token has loss 0, gradient 0 and is not counted.
        reduction: ``"mean"`` (canonical sum / count), ``"sum"`` (canonical sum) or ``"none"``.
        num_global_tokens: for ``"mean"`` only: divide by this count instead of the call's own
            non-ignored tokens. Use the global batch's token count when micro-batching or data
            parallel, so every micro-batch's gradient is scaled by the same 1/N.

    Returns:
        fp32 scalar (``"mean"``, ``"sum"``) or fp32 ``(...)`` per-token losses (``"none"``). A mean
        over zero counted tokens is NaN (as in torch).

    **Determinism:** bitwise run to run. Row invariance: a token's loss and its dlogits row depend
    only on its logits row, target and the gradient scale (one program per row, its config keyed by V only),
    not on N or the other rows. The sum / mean uses the canonical order over token sub-leaves
    (of ``DEFAULT_LEAF_TOKENS``, or of the active accumulator's ``leaf_tokens``), so it is the same
    for any batch holding the same sub-leaves; across micro-batches the partial losses of each call are
    returned (their sum is for logging, not canonical). dlogits with ``num_global_tokens`` is
    invariant to micro-batching. Not across GPU models / Triton versions (exp/log lowering).

    Raises:
        TypeError: bad dtypes; ``ignore_index`` or ``num_global_tokens`` not an integer (a bool,
            float or str; any ``operator.index`` type such as int or a numpy integer is accepted,
            never truncated).
        ValueError: 0-d logits (no class dim), shape mismatch, unknown reduction, ``ignore_index``
            outside int64,
            ``num_global_tokens`` not positive, given with a reduction other than ``"mean"`` or
            smaller than this call's own non-ignored tokens (read with the range check);
            ``reduction="mean"`` without ``num_global_tokens`` inside an accumulator's micro-batch,
            a target out of range (checked on the host:
            one device sync). The range check is skipped while a CUDA graph is being captured
            (``torch.cuda.is_current_stream_capturing()``): no device value can be read then,
            as for torch's own ops that cannot check device values during capture; keeping the
            targets in ``[0, V)`` or ``ignore_index`` is then the caller's job (an out-of-range
            target reads outside its logits row: undefined loss and gradient).
        RuntimeError: device problems; ``reduction="mean"`` without ``num_global_tokens`` while a
            CUDA graph is being captured (the token count is read on the host: pass
            ``num_global_tokens``).

    Reference: the softmax cross-entropy gradient ``softmax - onehot``; kernel layout after
    Liger-Kernel ``ops/cross_entropy.py`` (which computes the gradient in the forward instead).
    """
    for name, value in (("logits", logits), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"cross_entropy: {name} must be a torch.Tensor, got {type(value).__module__}."
                f"{type(value).__qualname__} (convert it with torch.as_tensor / torch.from_numpy)"
            )
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"cross_entropy: logits dtype {logits.dtype} is not supported (float32, bfloat16, float16)"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"cross_entropy: targets must be int64 or int32, got {targets.dtype}")
    if logits.dim() < 1:
        raise ValueError(
            "cross_entropy: logits must have at least 1 dim, the class dim (last), got a 0-d tensor; "
            "pass (..., V) logits"
        )
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"cross_entropy: targets shape {tuple(targets.shape)} must equal logits shape without the "
            f"class dim, {tuple(logits.shape[:-1])} (classes are on the last dim)"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    # an integer, never truncated: the kernels compare int(ignore_index), the token count compares
    # the value as given (0.5 would ignore class 0 in the loss but count its tokens)
    ignore_index = as_index(ignore_index, "ignore_index", "cross_entropy", "; pass an int such as -100")
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"cross_entropy: ignore_index must fit in int64, got {ignore_index}")
    if num_global_tokens is not None:
        if reduction != "mean":
            raise ValueError("cross_entropy: num_global_tokens applies to reduction='mean' only")
        num_global_tokens = _as_token_count(num_global_tokens)
    elif reduction == "mean":
        from ..accum.grad_accum import current_accumulator

        if current_accumulator() is not None:  # each micro-batch would divide by its own count
            raise ValueError(
                "cross_entropy: reduction='mean' inside a CanonicalGradAccumulator micro-batch needs "
                "num_global_tokens (the global batch's token count); dividing by each micro-batch's own "
                "count would make the gradients depend on the split"
            )
    check_kernel_device(logits, targets, op="cross_entropy")
    v = logits.shape[-1]
    if v == 0:
        raise ValueError("cross_entropy: the class dimension is empty")
    logits2 = logits.reshape(-1, v)
    if logits2.stride(-1) != 1:
        logits2 = logits2.contiguous()
    targets1 = targets.reshape(-1).to(torch.int64).contiguous()
    # the target range check and the token count read device values: in the op, when it runs
    if reduction == "mean" and num_global_tokens is None:
        out = cross_entropy_op(logits2, targets1, int(ignore_index), reduction, None)[0]
    else:  # the denominator known (or none needed): the op CUDA-graph trees capture
        denominator = num_global_tokens if num_global_tokens is not None else 0
        out = cross_entropy_fixed_scale_op(logits2, targets1, int(ignore_index), reduction, denominator)[0]
    return out.view(targets.shape) if reduction == "none" else out
