"""A mixture-of-experts router's gate after its logits: fp32 softmax, top-k with ties to the lower
expert index, optional renormalisation of the k chosen probabilities, forward and backward as our own
row-wise kernels.

``moe_router(logits, top_k, norm_topk_prob)`` takes the router's logits ``(T, E)`` (the bf16 output
of ``det_train.linear(hidden, router_weight)``, the GEMM HF's routers run in the model's dtype) and
returns the routing weights ``(T, k)`` in the logits' dtype and the expert indices ``(T, k)`` int64,
what transformers' ``Qwen3MoeTopKRouter`` computes with ``softmax(logits, dtype=float)``,
``torch.topk`` and ``/ sum``.

Why kernels of ours: each token's row is reduced on its own (an fp32 softmax with a fixed reduction
shape, k rounds of "largest probability, lowest index among equals", the renormalisation summed in
slot order), so a row's result never depends on the other rows or on their number (torch's reductions
choose their order by the tensor's shape; ``torch.topk`` does not say which of equal values it
returns). The backward recomputes the probabilities from the saved logits. With ``return_probs``
the forward also stores every expert's fp32 probability, and the backward takes their gradient
(``dP``, from the load-balancing loss) into the same row kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import launch

from ._library import Op

__all__ = ["moe_router"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# tokens per program: a constant, so a token's reductions have one tile shape whatever T (each row is
# reduced on its own; the rows of a tile share nothing)
_ROWS = 16


@triton.jit
def _softmax_rows(logits, first, T, stride, E, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    # ROWS tokens' probabilities in fp32 (masked columns 0), each row reduced on its own over the same
    # (ROWS, BLOCK_E) tile shape whatever T; the row and column index vectors
    rows = first + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    mask = (rows[:, None] < T) & (cols[None, :] < E)
    z = tl.load(logits + rows[:, None] * stride + cols[None, :], mask=mask, other=-float("inf"))
    z = tl.where(mask, z.to(tl.float32), -float("inf"))
    m = tl.max(z, 1)
    m = tl.where(rows < T, m, 0.0)  # padding rows: no inf - inf
    e = tl.where(mask, tl.exp(z - m[:, None]), 0.0)
    s = tl.sum(e, 1)
    return e / tl.where(rows < T, s, 1.0)[:, None], rows, cols, mask


@triton.jit
def _router_fwd_kernel(
    logits, weights, indices, probs, T, E, stride_l, K: tl.constexpr, NORM: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, STORE_P: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0).to(tl.int64) * ROWS
    p, rows, cols, mask = _softmax_rows(logits, first, T, stride_l, E, ROWS, BLOCK_E)
    if STORE_P:  # the fp32 probabilities, for a loss on them (the load-balancing loss)
        tl.store(probs + rows[:, None] * E + cols[None, :], p, mask=mask)
    avail = tl.where(mask, p, -1.0)  # probabilities are >= 0: -1 marks taken / padding columns
    slots = tl.arange(0, BLOCK_K)
    top_v = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((ROWS, BLOCK_K), dtype=tl.int64)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(avail, 1)
        # the lowest index among equals
        pick = tl.min(tl.where(avail == best[:, None], cols[None, :], BLOCK_E), 1)
        top_v = tl.where(slots[None, :] == j, best[:, None], top_v)
        top_i = tl.where(slots[None, :] == j, pick.to(tl.int64)[:, None], top_i)
        total = total + best  # slot order
        avail = tl.where(cols[None, :] == pick[:, None], -1.0, avail)
    if NORM:
        top_v = top_v / tl.where(rows < T, total, 1.0)[:, None]
    out = (rows[:, None] < T) & (slots[None, :] < K)
    at = rows[:, None] * K + slots[None, :]
    tl.store(weights + at, top_v, mask=out)
    tl.store(indices + at, top_i, mask=out)


@triton.jit
def _router_bwd_kernel(
    logits, indices, d_weights, d_probs, d_logits, T, E, stride_l, K: tl.constexpr, NORM: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_E: tl.constexpr, HAS_DP: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0).to(tl.int64) * ROWS
    p, rows, cols, mask = _softmax_rows(logits, first, T, stride_l, E, ROWS, BLOCK_E)
    live = rows < T
    # the chosen probabilities, their sum S and sum_j g_j p_j, in slot order (as the forward)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    dot = tl.zeros((ROWS,), dtype=tl.float32)
    for j in tl.static_range(K):
        pick = tl.load(indices + rows * K + j, mask=live, other=0)
        g = tl.load(d_weights + rows * K + j, mask=live, other=0.0).to(tl.float32)
        pj = tl.sum(tl.where(cols[None, :] == pick[:, None], p, 0.0), 1)  # exact: one value and zeros
        total = total + pj
        dot = dot + g * pj
    total = tl.where(live, total, 1.0)
    # dL/dp_i for a chosen i: g_i / S - (sum_j g_j p_j) / S^2 (renormalised), else g_i; 0 otherwise
    dp = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    for j in tl.static_range(K):
        pick = tl.load(indices + rows * K + j, mask=live, other=0)
        g = tl.load(d_weights + rows * K + j, mask=live, other=0.0).to(tl.float32)
        if NORM:
            g = g / total - dot / (total * total)
        dp = tl.where(cols[None, :] == pick[:, None], g[:, None], dp)
    if HAS_DP:  # the probabilities' own gradient (a loss on them), added once in fp32
        dp = dp + tl.load(d_probs + rows[:, None] * E + cols[None, :], mask=mask, other=0.0)
    # softmax: dz_i = p_i (dp_i - sum_e dp_e p_e)
    dz = p * (dp - tl.sum(dp * p, 1)[:, None])
    tl.store(d_logits + rows[:, None] * E + cols[None, :], dz, mask=mask)


def _grid(t: int) -> tuple[int]:
    return (runtime.cdiv(t, _ROWS),)


def _blocks(e: int, k: int) -> tuple[int, int]:
    return triton.next_power_of_2(e), triton.next_power_of_2(k)


def _route(logits: torch.Tensor, top_k: int, norm: bool, return_probs: bool):
    """The forward kernel's fp32 ``(weights, indices, probs)``; ``probs`` is ``(0,)`` unless asked for."""
    t, e = logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    indices = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    probs = torch.empty((t, e) if return_probs else (0,), dtype=torch.float32, device=logits.device)
    if t:
        block_e, block_k = _blocks(e, top_k)
        launch(
            _router_fwd_kernel, _grid(t), logits, weights, indices, probs if return_probs else weights,
            t, e, logits.stride(0), K=top_k, NORM=norm, ROWS=_ROWS, BLOCK_E=block_e, BLOCK_K=block_k,
            STORE_P=return_probs, num_warps=4,
        )  # fmt: skip
    return weights, indices, probs


def _d_logits(logits, indices, d_weights, d_probs, top_k: int, norm: bool) -> torch.Tensor:
    """The backward kernel's logit gradient in the logits' dtype (``d_probs`` None: no probabilities'
    term)."""
    t, e = logits.shape
    has_dp = d_probs is not None
    if has_dp:
        d_probs = d_probs.to(torch.float32).contiguous()
    d_logits = torch.empty((t, e), dtype=torch.float32, device=logits.device)
    if t:
        block_e, _ = _blocks(e, top_k)
        launch(
            _router_bwd_kernel, _grid(t), logits, indices, d_weights.contiguous(),
            d_probs if has_dp else d_logits, d_logits, t, e, logits.stride(0), K=top_k,
            NORM=norm, ROWS=_ROWS, BLOCK_E=block_e, HAS_DP=has_dp, num_warps=4,
        )  # fmt: skip
    return d_logits.to(logits.dtype)


@Op("moe_router")
def router_op(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``det_train::moe_router`` op (no probabilities): ``(weights (T, k) in logits' dtype, indices
    (T, k) int64)``, ``moe_router`` after its checks."""
    weights, indices, _ = _route(logits, top_k, norm, False)
    # one rounding (nearest even, torch's cast on every device) from fp32, as HF's .to(logits.dtype)
    return weights.to(logits.dtype), indices


@router_op.register_fake
def _(logits, top_k, norm):
    t = logits.shape[0]
    return logits.new_empty((t, top_k)), logits.new_empty((t, top_k), dtype=torch.int64)


def _router_setup(ctx, inputs, output):
    logits, top_k, norm = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.top_k, ctx.norm = top_k, norm


def _router_backward(ctx, d_weights, _d_indices):
    runtime.check_first_order("det_train.moe_router")
    logits, indices = ctx.saved_tensors
    return router_backward_op(logits, indices, d_weights, ctx.top_k, ctx.norm), None, None


router_op.register_autograd(_router_backward, setup_context=_router_setup, nondifferentiable=(1,))


@Op("moe_router_backward")
def router_backward_op(
    logits: torch.Tensor, indices: torch.Tensor, d_weights: torch.Tensor, top_k: int, norm: bool
) -> torch.Tensor:
    """The ``det_train::moe_router_backward`` op: the logits' gradient ``(T, E)`` in their dtype from
    the routing weights' gradient (``d_weights (T, k)``), the probabilities recomputed."""
    return _d_logits(logits, indices, d_weights, None, top_k, norm)


@router_backward_op.register_fake
def _(logits, indices, d_weights, top_k, norm):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


class _RouterWithProbs(torch.autograd.Function):
    """``moe_router(..., return_probs=True)``: eager only (the load-balancing loss's path)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, top_k: int, norm: bool):
        weights, indices, probs = _route(logits, top_k, norm, True)
        ctx.save_for_backward(logits, indices)
        ctx.top_k, ctx.norm = top_k, norm
        ctx.mark_non_differentiable(indices)
        # a gradient that never came is None (not zeros): no d_probs leaves the kernel's no-probs path
        ctx.set_materialize_grads(False)
        # one rounding (nearest even, torch's cast on every device) from fp32, as HF's .to(logits.dtype)
        return weights.to(logits.dtype), indices, probs

    @staticmethod
    def backward(ctx, d_weights: torch.Tensor | None, _d_indices, d_probs: torch.Tensor | None):
        runtime.check_first_order("det_train.moe_router")
        logits, indices = ctx.saved_tensors
        if d_weights is None:  # no materialised zeros: weights unused
            d_weights = torch.zeros((logits.shape[0], ctx.top_k), dtype=torch.float32, device=logits.device)
        return _d_logits(logits, indices, d_weights, d_probs, ctx.top_k, ctx.norm), None, None


@torch.compiler.disable
def _router_with_probs(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, ...]:
    # the probabilities feed the aux loss's per-sequence Python: a graph break under torch.compile
    return _RouterWithProbs.apply(logits, top_k, norm)


def moe_router(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True, return_probs: bool = False
) -> tuple[torch.Tensor, ...]:
    """A top-k router's routing weights and expert indices from its logits, row by row.

    Args:
        logits: ``(T, E)`` router logits, float32 / bfloat16 / float16, unit last stride (the
            output of ``det_train.linear(hidden, router_weight)``); differentiable.
        top_k: experts per token, ``1 <= top_k <= E``.
        norm_topk_prob: divide the k chosen probabilities by their sum (transformers'
            ``config.norm_topk_prob``); else they are the softmax probabilities themselves.
        return_probs: also return the fp32 probabilities of every expert (the load-balancing
            loss's ``P``, ``det_train.ops.moe_balance_loss``).

    Returns:
        ``(weights (T, top_k) in logits.dtype, indices (T, top_k) int64)``: per token, in slot
        order, the experts of the largest probabilities ``p = softmax(fp32(logits))`` (ties: the
        lower expert index first) and their weights, computed in fp32 and rounded once. The weights
        are differentiable (the indices are not): the gradient flows through the renormalisation
        and the softmax to the logits (fp32, rounded once to the logits' dtype). With
        ``return_probs``, a third output ``probs (T, E)`` float32, ``softmax(fp32(logits))`` as the
        kernel computed it, differentiable: its gradient (the "dP" of a loss on the probabilities)
        is added in fp32 to the chosen weights' ``dL/dp`` in the same row kernel, before the
        softmax's backward, so a token's logit gradient stays a function of its own row.

    Raises:
        TypeError: ``logits`` not a tensor of a supported dtype, ``top_k`` not an int,
            ``return_probs`` not a bool.
        ValueError: ``logits`` not 2-D with unit last stride, ``top_k`` out of range.
        RuntimeError: a device the kernels do not run on; a double backward.

    **Determinism:** bitwise run to run and row invariant: each token's row is reduced on its own
    over a fixed tile shape (16 rows x ``BLOCK_E``, the next power of two of E), so a token's weights,
    indices, probabilities and logit gradient depend only on its own logits (and its weights' and
    probabilities' gradients), never on the other tokens or their number. Without
    ``return_probs`` the kernels compile without the probabilities' store and add (constexpr
    flags): the same bits as before the option existed. Ties among equal probabilities go to the
    lower expert index (``torch.topk`` promises no order among equal values). A NaN logit gives
    unspecified routing for its token. Without ``return_probs`` the call is the ``det_train::moe_router``
    custom op (its backward ``det_train::moe_router_backward``): ``torch.compile(fullgraph=True)``
    traces it and runs the eager kernels (``tests/test_compile.py``); with ``return_probs`` it is a
    graph break (``torch.compiler.disable``: the load-balancing loss's path is eager only). Not equal
    to transformers' bits (its softmax and sum orders are torch's), nor across GPU models / Triton
    versions (the ``exp`` lowering).

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
    if not isinstance(return_probs, bool):
        raise TypeError(f"moe_router: return_probs must be a bool, got {type(return_probs).__name__}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_router: top_k must be in [1, {logits.shape[1]}] (the experts), got {top_k}")
    runtime.check_kernel_device(logits, op="moe_router")
    if return_probs:
        return _router_with_probs(logits, top_k, bool(norm_topk_prob))
    return router_op(logits, top_k, bool(norm_topk_prob))
