"""A mixture-of-experts router's gate after its logits: fp32 softmax, top-k with ties to the lower
expert index, optional renormalisation of the k chosen probabilities, forward and backward as our own
row-wise kernels.

``moe_router(logits, top_k, norm_topk_prob)`` takes the router's logits ``(T, E)`` (the bf16 output
of ``det_train.linear(hidden, router_weight)``, the GEMM HF's routers run in the model's dtype) and
returns the routing weights ``(T, k)`` in the logits' dtype and the expert indices ``(T, k)`` int64,
what transformers' ``Qwen3MoeTopKRouter`` computes with ``softmax(logits, dtype=float)``,
``torch.topk`` and ``/ sum``.

Why kernels of ours: one program computes one token's row (an fp32 softmax with a fixed reduction
shape, k rounds of "largest probability, lowest index among equals", the renormalisation summed in
slot order), so a row's result never depends on the other rows or on their number (torch's reductions
choose their order by the tensor's shape; ``torch.topk`` does not say which of equal values it
returns). The backward recomputes the probabilities from the saved logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import launch

__all__ = ["moe_router"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _softmax_row(logits, row, stride, E, BLOCK_E: tl.constexpr):
    # one token's probabilities in fp32 (masked columns 0) and the column index vector
    cols = tl.arange(0, BLOCK_E)
    mask = cols < E
    z = tl.load(logits + row * stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.where(mask, tl.exp(z - tl.max(z, 0)), 0.0)
    return e / tl.sum(e, 0), cols, mask


@triton.jit
def _router_fwd_kernel(
    logits, weights, indices, E, stride_l, K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    p, cols, mask = _softmax_row(logits, row, stride_l, E, BLOCK_E)
    avail = tl.where(mask, p, -1.0)  # probabilities are >= 0: -1 marks taken / padding columns
    slots = tl.arange(0, BLOCK_K)
    top_v = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
    total = 0.0
    for j in tl.static_range(K):
        best = tl.max(avail, 0)
        pick = tl.min(tl.where(avail == best, cols, BLOCK_E), 0)  # the lowest index among equals
        top_v = tl.where(slots == j, best, top_v)
        top_i = tl.where(slots == j, pick.to(tl.int64), top_i)
        total = total + best  # slot order
        avail = tl.where(cols == pick, -1.0, avail)
    if NORM:
        top_v = top_v / total
    out = slots < K
    tl.store(weights + row * K + slots, top_v, mask=out)
    tl.store(indices + row * K + slots, top_i, mask=out)


@triton.jit
def _router_bwd_kernel(
    logits, indices, d_weights, d_logits, E, stride_l, K: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    p, cols, mask = _softmax_row(logits, row, stride_l, E, BLOCK_E)
    # the chosen probabilities, their sum S and sum_j g_j p_j, in slot order (as the forward)
    total = 0.0
    dot = 0.0
    for j in tl.static_range(K):
        pick = tl.load(indices + row * K + j)
        g = tl.load(d_weights + row * K + j).to(tl.float32)
        pj = tl.sum(tl.where(cols == pick, p, 0.0), 0)  # exact: one value and zeros
        total = total + pj
        dot = dot + g * pj
    # dL/dp_i for a chosen i: g_i / S - (sum_j g_j p_j) / S^2 (renormalised), else g_i; 0 otherwise
    dp = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for j in tl.static_range(K):
        pick = tl.load(indices + row * K + j)
        g = tl.load(d_weights + row * K + j).to(tl.float32)
        if NORM:
            g = g / total - dot / (total * total)
        dp = tl.where(cols == pick, g, dp)
    # softmax: dz_i = p_i (dp_i - sum_e dp_e p_e)
    dz = p * (dp - tl.sum(dp * p, 0))
    tl.store(d_logits + row * E + cols, dz, mask=mask)


def _blocks(e: int, k: int) -> tuple[int, int]:
    return triton.next_power_of_2(e), triton.next_power_of_2(k)


class _Router(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, top_k: int, norm: bool):
        t, e = logits.shape
        weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
        indices = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
        if t:
            block_e, block_k = _blocks(e, top_k)
            launch(
                _router_fwd_kernel, (t,), logits, weights, indices, e, logits.stride(0), K=top_k, NORM=norm,
                BLOCK_E=block_e, BLOCK_K=block_k, num_warps=1,
            )  # fmt: skip
        ctx.save_for_backward(logits, indices)
        ctx.top_k, ctx.norm = top_k, norm
        ctx.mark_non_differentiable(indices)
        # one rounding (nearest even, torch's cast on every device) from fp32, as HF's .to(logits.dtype)
        return weights.to(logits.dtype), indices

    @staticmethod
    def backward(ctx, d_weights: torch.Tensor, _d_indices):
        runtime.check_first_order("det_train.moe_router")
        logits, indices = ctx.saved_tensors
        t, e = logits.shape
        d_logits = torch.empty((t, e), dtype=torch.float32, device=logits.device)
        if t:
            block_e, _ = _blocks(e, ctx.top_k)
            launch(
                _router_bwd_kernel, (t,), logits, indices, d_weights.contiguous(), d_logits, e,
                logits.stride(0), K=ctx.top_k, NORM=ctx.norm, BLOCK_E=block_e, num_warps=1,
            )  # fmt: skip
        return d_logits.to(logits.dtype), None, None


@torch.compiler.disable
def moe_router(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k router's routing weights and expert indices from its logits, row by row.

    Args:
        logits: ``(T, E)`` router logits, float32 / bfloat16 / float16, unit last stride (the
            output of ``det_train.linear(hidden, router_weight)``); differentiable.
        top_k: experts per token, ``1 <= top_k <= E``.
        norm_topk_prob: divide the k chosen probabilities by their sum (transformers'
            ``config.norm_topk_prob``); else they are the softmax probabilities themselves.

    Returns:
        ``(weights (T, top_k) in logits.dtype, indices (T, top_k) int64)``: per token, in slot
        order, the experts of the largest probabilities ``p = softmax(fp32(logits))`` (ties: the
        lower expert index first) and their weights, computed in fp32 and rounded once. The weights
        are differentiable (the indices are not): the gradient flows through the renormalisation
        and the softmax to the logits (fp32, rounded once to the logits' dtype).

    Raises:
        TypeError: ``logits`` not a tensor of a supported dtype, ``top_k`` not an int.
        ValueError: ``logits`` not 2-D with unit last stride, ``top_k`` out of range.
        RuntimeError: a device the kernels do not run on; a double backward.

    **Determinism:** bitwise run to run and row invariant: one program computes one token's row
    with a fixed reduction shape (``BLOCK_E``, the next power of two of E), so a token's weights,
    indices and logit gradient depend only on its own logits (and its weights' gradient), never on
    the other tokens or their number. Ties among equal probabilities go to the lower expert index
    (``torch.topk`` promises no order among equal values). A NaN logit gives unspecified routing
    for its token. Eager only: under ``torch.compile`` the call is a graph break
    (``torch.compiler.disable``). Not equal to transformers' bits (its softmax and sum orders are
    torch's), nor across GPU models / Triton versions (the ``exp`` lowering).

    Method: the sparsely-gated mixture of experts' top-k softmax gate (Shazeer et al., "Outrageously
    Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer", 2017), renormalised over
    the chosen experts as Qwen3-MoE's ``norm_topk_prob``.
    """
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _DTYPES:
        raise TypeError(
            "moe_router: logits must be a float32 / bfloat16 / float16 tensor, got "
            f"{getattr(logits, 'dtype', type(logits).__name__)}"
        )
    if logits.dim() != 2 or (logits.numel() and logits.stride(1) != 1):
        raise ValueError(
            f"moe_router: logits must be (T, E) with unit last stride, got shape {tuple(logits.shape)}; "
            "reshape the router's output to (tokens, experts)"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"moe_router: top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_router: top_k must be in [1, {logits.shape[1]}] (the experts), got {top_k}")
    runtime.check_kernel_device(logits, op="moe_router")
    return _Router.apply(logits, top_k, bool(norm_topk_prob))
