"""Mixture-of-experts SwiGLU experts with batch-invariant rows and expert weight gradients in the
canonical token order, whatever the micro-batch split.

``moe_experts(x, indices, weights, gate_up_proj, down_proj)`` computes, for every token ``t`` and
slot ``j`` of its top-k, expert ``e = indices[t, j]``'s
``y_tj = down_proj[e] @ swiglu(gate_up_proj[e] @ x_t)`` and returns
``out_t = sum_j weights[t, j] * y_tj`` (transformers' ``Qwen3MoeExperts`` with the 3-D parameters
``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``).

- Forward and dX: each expert's tokens are gathered (grouped by a stable sort of the expert indices,
  token order within an expert) and run through det_train's GEMM (fixed K order, no split-K) and
  ``swiglu``: a token's rows do not depend on which other tokens chose the same expert.
- The combine (and the sum of a token's k input gradients) is an fp32 sum over the k slots in slot
  order, rounded once: no atomics, no ``index_add_``. Each (token, slot) is written exactly once.
- The gradient of ``weights``: per token and slot ``sum_h dout[t, h] * y_tj[h]``, one program per
  token (``_slot_dot_kernel``), so row invariant.
- Expert weight gradients (``_expert_leaves`` / ``_expert_fold``): expert e's dW over ALL tokens of
  the micro-batch, the dY rows of tokens not routed to e being zero, so the rows are the micro-batch's
  tokens in order and the accumulator's leaves, folds and open-leaf carries apply unchanged. Each
  expert's slice is a Linear weight's canonical dW (``weight_grad_partial`` / ``weight_grad_fold``);
  the (E, N, K) partial tree stacks them, so the 3-D parameter stays one tracked tensor. Cost: E / k
  times the dW FLOPs the routed tokens need, and (T, E, N) rows; a later kernel may skip all-zero token
  blocks (a block whose contribution is exactly +0.0 leaves an fp32 fold's bits unchanged, except where
  the fold holds -0.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import launch
from det_core.reduce import TreePartial, num_leaves

from ..accum import deposit
from ._leaf_fold import weight_grad_fold
from ._library import Op
from .configs import weight_grad_config
from .matmul import launch_linear, matmul_rows
from .swiglu import swiglu_backward_op, swiglu_op
from .weight_grad import weight_grad_partial

__all__ = ["moe_experts"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OP = "det_train.moe_experts"
# columns per step of the slot-dot kernel (a function of H only: a token's sum order never depends on T)
_MAX_BLOCK_H = 1024


@triton.jit
def _slot_dot_kernel(dout, y, out, H, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t, j] = sum_h dout[t, h] * y[t, j, h] in fp32: one token per program, a fixed (BLOCK_K, BLOCK_H)
    # accumulator folded over H in steps of BLOCK_H, then one fixed-shape reduction
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + cols
        d = tl.load(dout + row * H + c, mask=c < H, other=0.0).to(tl.float32)
        m = (slots[:, None] < K) & (c[None, :] < H)
        v = tl.load(y + row * K * H + slots[:, None] * H + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += v * d[None, :]
    tl.store(out + row * K + slots, tl.sum(acc, 1), mask=slots < K)


def _slot_dot(dout: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(T, K)`` fp32 ``sum_h dout[t, h] * y[t, j, h]`` of contiguous ``dout (T, H)``, ``y (T, K, H)``."""
    t, k, h = y.shape
    out = torch.empty((t, k), dtype=torch.float32, device=y.device)
    if t:
        block_h = min(triton.next_power_of_2(h), _MAX_BLOCK_H)
        launch(
            _slot_dot_kernel, (t,), dout, y, out, h, K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_H=block_h,
            num_warps=4,
        )  # fmt: skip
    return out


def _slot_sum(rows: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``sum_j weights[:, j] * rows[:, j]`` of ``rows (T, K, H)`` (weights None: 1) in fp32, slot 0 first,
    rounded once to ``dtype``: elementwise torch arithmetic (exactly rounded, the same on every row)."""
    acc = rows[:, 0].float()
    if weights is not None:
        acc = acc * weights[:, 0:1].float()
    for j in range(1, rows.shape[1]):
        term = rows[:, j].float()
        acc = acc + (term * weights[:, j : j + 1].float() if weights is not None else term)
    return acc.to(dtype)


def _expert_rows(x: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e``'s input rows: ``x (T, K)`` shared by all experts, or its slice of ``x (T, E, K)``."""
    return x if x.dim() == 2 else x[:, e]


def _expert_leaves(leaf_tokens: int, first_leaf: int, rows: tuple) -> TreePartial:
    """The accumulator's leaf-sum function of a 3-D expert weight: rows ``(dY (T, E, N), X)`` of whole
    leaves -> the partial tree of ``(E, N, K)`` fp32 nodes, expert e's slice being the Linear weight's
    canonical leaf sums of ``(dY[:, e], X_e)``."""
    dy, x = rows
    parts = [
        weight_grad_partial(dy[:, e], _expert_rows(x, e), leaf_tokens=leaf_tokens, first_leaf=first_leaf)
        for e in range(dy.shape[1])
    ]
    stacked = TreePartial()
    # every expert's tree has the same nodes (same tokens, same leaves): stacking them is elementwise
    stacked.nodes = {key: torch.stack([p.nodes[key] for p in parts]) for key in parts[0].nodes}
    return stacked


def _expert_fold(rows: tuple, acc: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The accumulator's resumable fold of a 3-D expert weight: ``acc (E, N, K)`` continued over rows
    ``(dY (T, E, N), X)``, expert by expert (each the Linear weight's fold); ``out``: written into
    (``acc`` itself under ``recoverable=False``: expert ``e``'s fold in place, ``weight_grad_fold``)."""
    dy, x = rows
    if out is not None:
        for e in range(dy.shape[1]):
            weight_grad_fold(dy[:, e], _expert_rows(x, e), None if acc is None else acc[e], out=out[e])
        return out
    return torch.stack(
        [
            weight_grad_fold(dy[:, e], _expert_rows(x, e), None if acc is None else acc[e])
            for e in range(dy.shape[1])
        ]
    )


def _scatter(rows: torch.Tensor, where: torch.Tensor, total: int) -> torch.Tensor:
    """A zero ``(total, *rows.shape[1:])`` tensor with ``rows`` at the distinct indices ``where`` (each
    written once: a plain deterministic copy)."""
    out = rows.new_zeros((total, *rows.shape[1:]))
    out[where] = rows
    return out


def _bounds(sorted_e: torch.Tensor, experts: int) -> list[int]:
    """Where each expert's run of the sorted ``(token, slot)`` assignments starts, and the end."""
    return torch.searchsorted(sorted_e, torch.arange(experts + 1, device=sorted_e.device)).tolist()


# ------------------------------------------------------------------ torch.library ops
# The tokens per expert are data-dependent: every op below keeps them inside and returns tensors whose
# shapes follow from its arguments' shapes alone (T, k, E, H, I), so a compiled graph has static shapes.
@Op("moe_experts", data_dependent=True)
def experts_op(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ticket: torch.Tensor | None,
    leaf_tokens: int,
    deposit_gate_up: bool,
    deposit_down: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``det_train::moe_experts`` op: ``(y (T, H), y_slots (T*k, H), h (T*k, 2I), a (T*k, I),
    order (T*k,), sorted_e (T*k,))``, ``moe_experts``'s output and what its backward reads (the
    slots' outputs in ``(token, slot)`` order; the GEMM inputs, ``order`` and ``sorted_e`` grouped by
    expert). ``ticket``, ``leaf_tokens`` and the ``deposit_*`` flags are the forward's plan."""
    t, hidden = x.shape
    k = indices.shape[1]
    experts, two_i = gate_up.shape[0], gate_up.shape[1]
    flat = indices.reshape(-1)
    # the (token, slot) assignments grouped by expert, in (token, slot) order within an expert
    sorted_e, order = torch.sort(flat, stable=True)
    bounds = _bounds(sorted_e, experts)
    tokens = order // k
    h_all = x.new_empty((t * k, two_i))
    a_all = x.new_empty((t * k, two_i // 2))
    y_slots = x.new_empty((t * k, hidden))  # row t * k + j: expert indices[t, j]'s output for token t
    for e in range(experts):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        h = torch.empty((hi - lo, two_i), dtype=x.dtype, device=x.device)
        launch_linear(x.index_select(0, tokens[lo:hi]), gate_up[e], h)
        a = swiglu_op(h)
        y = torch.empty((hi - lo, hidden), dtype=x.dtype, device=x.device)
        launch_linear(a, down[e], y)
        h_all[lo:hi], a_all[lo:hi] = h, a
        y_slots[order[lo:hi]] = y
    out = _slot_sum(y_slots.view(t, k, hidden), weights, x.dtype)
    return out, y_slots, h_all, a_all, order, sorted_e


@experts_op.register_fake
def _(x, indices, weights, gate_up, down, ticket, leaf_tokens, deposit_gate_up, deposit_down):
    t, hidden = x.shape
    slots = t * indices.shape[1]
    two_i = gate_up.shape[1]
    long = torch.int64
    return (
        x.new_empty((t, hidden)),
        x.new_empty((slots, hidden)),
        x.new_empty((slots, two_i)),
        x.new_empty((slots, two_i // 2)),
        x.new_empty((slots,), dtype=long),
        x.new_empty((slots,), dtype=long),
    )


def _experts_setup(ctx, inputs, output):
    x, indices, weights, gate_up, down, ticket, leaf_tokens, deposit_gate_up, deposit_down = inputs
    _, y_slots, h_all, a_all, order, sorted_e = output
    ctx.save_for_backward(x, weights, gate_up, down, y_slots, h_all, a_all, order, sorted_e)
    # the ticket is mutated by the backward's deposit ops: not saved (saving checks its version)
    ctx.plan = (ticket, leaf_tokens, deposit_gate_up, deposit_down)


def _experts_backward(ctx, dout, *_saved_grads):
    runtime.check_first_order(_OP)
    x, weights, gate_up, down, y_slots, h_all, a_all, order, sorted_e = ctx.saved_tensors
    ticket, leaf, deposit_gate_up, deposit_down = ctx.plan
    want = ctx.needs_input_grad
    dx, d_weights, dh_rows, dy_rows, a_rows = experts_backward_op(
        dout, x, weights, gate_up, down, y_slots, h_all, a_all, order, sorted_e, want[0], want[2],
        want[3], want[4],
    )  # fmt: skip
    grad_gate_up = grad_down = None
    if want[3]:
        grad_gate_up = _expert_weight_grad(dh_rows, x, gate_up, deposit_gate_up, leaf, ticket)
    if want[4]:
        grad_down = _expert_weight_grad(dy_rows, a_rows, down, deposit_down, leaf, ticket)
    return (
        dx if want[0] else None, None, d_weights if want[2] else None, grad_gate_up, grad_down,
        None, None, None, None,
    )  # fmt: skip


experts_op.register_autograd(_experts_backward, setup_context=_experts_setup, nondifferentiable=(1, 2, 3))


@Op("moe_experts_backward", data_dependent=True)
def experts_backward_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    y_slots: torch.Tensor,
    h_all: torch.Tensor,
    a_all: torch.Tensor,
    order: torch.Tensor,
    sorted_e: torch.Tensor,
    want_x: bool,
    want_weights: bool,
    want_gate_up: bool,
    want_down: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``det_train::moe_experts_backward`` op: ``(dx (T, H), d_weights (T, k), dh_rows (T, E, 2I),
    dy_rows (T, E, H), a_rows (T, E, I))``, the last three the expert weights' per-token rows over
    all T tokens (zero where a token is routed elsewhere). An output not wanted is an empty ``(0,)``."""
    t, hidden = x.shape
    k = weights.shape[1]
    experts = gate_up.shape[0]
    bounds = _bounds(sorted_e, experts)
    dout = dout.contiguous()

    def none():  # a distinct empty tensor per output (an op's outputs may not alias one another)
        return x.new_empty((0,))

    d_weights = _slot_dot(dout, y_slots.view(t, k, hidden)).to(weights.dtype) if want_weights else none()
    # dL/dy_tj = weights[t, j] * dout[t]: fp32, rounded once; grouped by expert as the forward
    dy_slots = (dout.float()[:, None, :] * weights.float()[:, :, None]).to(x.dtype)
    dy_grouped = dy_slots.view(t * k, hidden).index_select(0, order)
    dh_all = torch.empty_like(h_all)
    dx_slots = x.new_empty((t * k, hidden))
    for e in range(experts):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        da = matmul_rows(dy_grouped[lo:hi], down[e])  # (R, I) = dY W_down[e]
        dh = swiglu_backward_op(da, h_all[lo:hi])
        dh_all[lo:hi] = dh
        dx_slots[order[lo:hi]] = matmul_rows(dh, gate_up[e])  # (R, H) = dH W_gate_up[e]
    dx = _slot_sum(dx_slots.view(t, k, hidden), None, x.dtype) if want_x else none()
    # the expert weights' rows over all T tokens: (token, expert) row t * E + e, zero where not routed
    where = (order // k) * experts + sorted_e
    dh_rows = _scatter(dh_all, where, t * experts).view(t, experts, -1) if want_gate_up else none()
    dy_rows, a_rows = none(), none()
    if want_down:
        dy_rows = _scatter(dy_grouped, where, t * experts).view(t, experts, -1)
        a_rows = _scatter(a_all, where, t * experts).view(t, experts, -1)
    return dx, d_weights, dh_rows, dy_rows, a_rows


@experts_backward_op.register_fake
def _(dout, x, weights, gate_up, down, y_slots, h_all, a_all, order, sorted_e, want_x, want_weights,
      want_gate_up, want_down):  # fmt: skip
    t, hidden = x.shape
    experts, two_i = gate_up.shape[0], gate_up.shape[1]

    def none():
        return x.new_empty((0,))

    return (
        x.new_empty((t, hidden)) if want_x else none(),
        weights.new_empty(weights.shape) if want_weights else none(),
        x.new_empty((t, experts, two_i)) if want_gate_up else none(),
        x.new_empty((t, experts, hidden)) if want_down else none(),
        x.new_empty((t, experts, two_i // 2)) if want_down else none(),
    )


@Op("moe_experts_weight_grad")
def expert_weight_grad_op(
    dy: torch.Tensor, x: torch.Tensor, leaf_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ``det_train::moe_experts_weight_grad`` op: a 3-D expert weight's gradient ``(E, N, K)`` in
    ``dtype`` from rows ``dy (T, E, N)`` and ``x (T, K)`` or ``(T, E, K)``, the canonical tree over
    this call's leaves of ``leaf_tokens`` (zeros for no tokens)."""
    if dy.shape[0] == 0:
        return torch.zeros((dy.shape[1], dy.shape[2], x.shape[-1]), dtype=dtype, device=dy.device)
    tree = _expert_leaves(leaf_tokens, 0, (dy, x))
    return tree.result(num_leaves(dy.shape[0], leaf_tokens)).to(dtype)


@expert_weight_grad_op.register_fake
def _(dy, x, leaf_tokens, dtype):
    return dy.new_empty((dy.shape[1], dy.shape[2], x.shape[-1]), dtype=dtype)


@Op("moe_experts_deposit", ("ticket",))
def expert_deposit_op(dy: torch.Tensor, x: torch.Tensor, param: torch.Tensor, ticket: torch.Tensor) -> None:
    """The ``det_train::moe_experts_deposit`` op: deposit a 3-D expert weight's gradient from rows
    ``dy (T, E, N)`` and ``x`` into the active accumulator (with the resumable fold), at run time."""
    step = weight_grad_config(dy.dtype, dy.shape[2], x.shape[-1]).block_t
    deposit.rows(_OP, param, (dy, x), _expert_leaves, fold=(step, _expert_fold))
    ticket.add_(1)


@expert_deposit_op.register_fake
def _(dy, x, param, ticket):
    return None


def _expert_weight_grad(dy, x, param, deposit_it: bool, leaf: int, ticket):
    """dW of a 3-D expert weight ``param (E, N, K)`` from rows ``dy (T, E, N)`` and ``x``: deposited
    into the active accumulator (returns None) or finished over ``leaf``-token leaves."""
    if deposit_it:
        expert_deposit_op(dy, x, param, ticket)
        return None
    return expert_weight_grad_op(dy, x, leaf, param.dtype)


def _check(x, indices, weights, gate_up, down) -> None:
    op = "moe_experts"
    for name, v in (("x", x), ("weights", weights), ("gate_up_proj", gate_up), ("down_proj", down)):
        if not isinstance(v, torch.Tensor) or v.dtype not in _DTYPES:
            raise TypeError(
                f"{op}: {name} must be a float32 / bfloat16 / float16 tensor, got "
                f"{getattr(v, 'dtype', type(v).__name__)}"
            )
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise TypeError(
            f"{op}: x ({x.dtype}), gate_up_proj ({gate_up.dtype}) and down_proj ({down.dtype}) must have one "
            "dtype; cast the model or the input"
        )
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64:
        got = getattr(indices, "dtype", type(indices).__name__)
        raise TypeError(f"{op}: indices must be an int64 tensor (the router's expert indices), got {got}")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(
            f"{op}: gate_up_proj must be (E, 2I, H) and down_proj (E, H, I), got {tuple(gate_up.shape)} and "
            f"{tuple(down.shape)}"
        )
    experts, two_i, hidden = gate_up.shape
    if tuple(down.shape) != (experts, hidden, two_i // 2):
        raise ValueError(
            f"{op}: down_proj must be (E, H, I) = {(experts, hidden, two_i // 2)} for gate_up_proj "
            f"{tuple(gate_up.shape)}, got {tuple(down.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"{op}: x must be (T, {hidden}), got {tuple(x.shape)}")
    if indices.dim() != 2 or indices.shape[0] != x.shape[0] or tuple(weights.shape) != tuple(indices.shape):
        raise ValueError(
            f"{op}: indices and weights must both be (T, k) with T = {x.shape[0]}, got "
            f"{tuple(indices.shape)} and {tuple(weights.shape)}"
        )
    runtime.check_kernel_device(x, indices, weights, gate_up, down, op=op)
    if not gate_up.is_contiguous() or not down.is_contiguous():
        raise ValueError(f"{op}: gate_up_proj and down_proj must be contiguous (transformers' layout)")


def moe_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """A mixture-of-experts layer's SwiGLU experts applied to routed tokens, combined by the routing weights.

    Args:
        x: ``(T, H)`` tokens, float32 / bfloat16 / float16.
        indices: ``(T, k)`` int64 expert of each token's slot (distinct within a token, in ``[0, E)``;
            ``moe_router``'s output).
        weights: ``(T, k)`` routing weights (any of the three float dtypes); differentiable.
        gate_up_proj: ``(E, 2I, H)`` contiguous, x's dtype: rows ``[:I]`` the gate, ``[I:]`` the up
            projection of each expert (transformers' concatenated layout).
        down_proj: ``(E, H, I)`` contiguous, x's dtype.

    Returns:
        ``(T, H)`` in x's dtype: ``sum_j weights[t, j] * down_proj[e] @ swiglu(gate_up_proj[e] @ x_t)``
        with ``e = indices[t, j]``; each GEMM accumulates in fp32 and rounds once (bf16 outputs),
        the k-slot sum is fp32 in slot order, rounded once.

    Gradients: dX (the k slots' input gradients summed in fp32 in slot order), d weights, and the
    expert weights' gradients: with an active ``CanonicalGradAccumulator`` (leaf parameters) deposited
    there, else returned, summed over the tokens in the canonical order (leaves of ``leaf_tokens``
    tokens, the Linear weight's fp32 fold in each, the fixed tree over leaves), expert by expert over
    all T tokens with zero rows for tokens routed elsewhere. Memory and time of that first version:
    E / k times the routed tokens' dW FLOPs and ``(T, E, N)`` rows per expert weight.

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes, indices not int64.
        ValueError: inconsistent shapes, non-contiguous expert weights.
        RuntimeError: devices differ, a device the kernels do not run on (CPU without the Triton
            interpreter), a double backward; an expert index out of range fails in the gather.

    **Determinism:** bitwise run to run; a token's output and input gradient are batch invariant
    (they depend only on its own row, its routing and the weights, not on the other tokens, their
    number or which of them share its experts); the expert weight gradients have equal bits for any
    split into micro-batches (cuts inside leaves included) under the accumulator. The call is the
    ``det_train::moe_experts`` custom op (backward ``moe_experts_backward``, ``moe_experts_weight_grad``
    / ``moe_experts_deposit``), the tokens per expert kept inside the ops (static output shapes):
    ``torch.compile(fullgraph=True)`` traces it and runs the eager kernels (``tests/test_compile.py``).
    Not transformers' bits
    (it sums the k slots in bf16 with ``index_add_``), nor across GPU models / Triton versions.

    Method: the sparsely-gated mixture of experts (Shazeer et al., 2017) with SwiGLU experts
    (Shazeer, 2020), grouped by expert as in MegaBlocks (Gale et al., 2023) but with fixed-order
    GEMMs (He et al., "Defeating Nondeterminism in LLM Inference", 2025) and the canonical pairwise
    tree for the weight gradients (Higham, SISC 1993).
    """
    _check(x, indices, weights, gate_up_proj, down_proj)
    leaf, active = deposit.accumulation()
    tokens = x.shape[0]
    dep_gate_up = active and tokens > 0 and gate_up_proj.is_leaf
    dep_down = active and tokens > 0 and down_proj.is_leaf
    ticket = deposit.ticket() if dep_gate_up or dep_down else None
    args = (x, indices, weights, gate_up_proj, down_proj, ticket, leaf, dep_gate_up, dep_down)
    return experts_op(*args)[0]
