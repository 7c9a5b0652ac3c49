"""Tensor-parallel linear layers whose results equal the unsplit ``det_train.linear`` bit for bit.

Megatron-style splits (Shoeybi et al., "Megatron-LM", 2019) over a ``torch.distributed`` group,
with the one sum that crosses ranks done in ``matmul``'s own K order instead of an all-reduce:

- ``row_parallel_linear``: rank r holds ``W[:, K_r]`` and ``x[..., K_r]`` (consecutive K parts in
  rank order). Y sums over K: rank r continues rank r - 1's fp32 accumulator
  (``matmul_partial``), the last rank adds the bias, rounds, and broadcasts Y. Backward: dX_r =
  dY W_r and dW_r = dY^T X_r are local (dY is replicated).
- ``column_parallel_linear``: rank r holds ``W[N_r]`` (and ``b[N_r]``); Y_r is local. Backward: dX
  sums over N: the same chain over ranks, the last rank broadcasts dX.

The chain runs over row chunks (``chunk_rows``), so rank r + 1 starts on chunk 0 while rank r
works on chunk 1; rows are independent, so the chunking does not change a bit.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from det_core import runtime
from torch.utils.weak import WeakIdKeyDictionary

from ..ops._library import Op
from ..ops.configs import matmul_config
from ..ops.linear import GradPlan, check_linear, param_grads, plan_grads
from ..ops.matmul import chain_part, launch_matmul, matmul_op

__all__ = ["column_parallel_linear", "row_parallel_linear"]


def _group_ranks(group) -> tuple[int, int, list[int]]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor-parallel linear needs an initialized torch.distributed process group")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranks = (
        [dist.get_global_rank(group, r) for r in range(world)] if group is not None else list(range(world))
    )
    return rank, world, ranks


def _part_problem(rank: int, world: int, dtype: torch.dtype, n: int, k: int) -> str | None:
    """Why rank ``rank``'s part of ``k`` elements of the summed axis cannot continue the unsplit
    fold (every part but the last a multiple of the K step), or None."""
    k_step = matmul_config(dtype, "nn", n, k).block_k
    if rank == world - 1 or k % k_step == 0:
        return None
    return (
        f"rank {rank}'s part of the summed axis has {k} elements; every part but the last must "
        f"be a multiple of {k_step} (the K step of the fixed order) for bitwise-unsplit results"
    )


# weight -> the (dtype, n, k, group) its split was checked for on every rank of the group
_SPLIT_CHECKED = WeakIdKeyDictionary()


def _check_parts_on_every_rank(
    weight: torch.Tensor, dtype: torch.dtype, n: int, k: int, group, group_name: str
) -> None:
    """Raise the same ``ValueError`` on every rank if any rank's part cannot chain, so that no rank
    is left waiting in the chain for a peer that refused (the chain checks only its own part).

    Once per weight, shapes and group (an ``all_gather_object`` of each rank's verdict): ranks call
    the same layers in the same order, as the chain itself needs. Not while tracing: a compiled
    graph keeps the chain's own check, on the rank whose part it is.
    """
    if torch.compiler.is_compiling():
        return
    key = (dtype, n, k, group_name)
    if key in _SPLIT_CHECKED.get(weight, ()):
        return
    rank, world, _ = _group_ranks(group)
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, _part_problem(rank, world, dtype, n, k), group=group)
    refused = [p for p in problems if p is not None]
    if refused:
        raise ValueError(f"{refused[0]} (refused on every rank of the group)")
    _SPLIT_CHECKED.setdefault(weight, set()).add(key)


def _chained_sum(a: torch.Tensor, b: torch.Tensor, bias, out_dtype, group, chunk_rows: int) -> torch.Tensor:
    """Sum over ranks of ``a_r @ b_r`` in the unsplit K order: each rank continues its predecessor's
    fp32 accumulator chunk by chunk; the last rank rounds (adding ``bias``) and broadcasts."""
    rank, world, ranks = _group_ranks(group)
    m, n = a.shape[0], b.shape[1]
    last = rank == world - 1
    problem = _part_problem(rank, world, a.dtype, n, a.shape[1])
    if problem is not None:
        raise ValueError(problem)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    for s in range(0, max(m, 1), chunk_rows):
        e = min(s + chunk_rows, m)
        carry = None
        if rank > 0:
            carry = torch.empty((e - s, n), dtype=torch.float32, device=a.device)
            dist.recv(carry, src=ranks[rank - 1], group=group)
        part = chain_part(a[s:e], b, carry, bias if last else None, last)
        if last:
            out[s:e] = part
        else:
            dist.send(part, dst=ranks[rank + 1], group=group)
    dist.broadcast(out, src=ranks[-1], group=group)
    return out


def _group_name(group) -> str:
    """The name of ``group`` (None: the default group) for the ops, which take a process group as
    its registered name (``torch.library`` schemas have no process-group type)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor-parallel linear needs an initialized torch.distributed process group")
    return (group if group is not None else dist.group.WORLD).group_name


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# ----------------------------------------------------------------------------- torch.library ops
# The collectives (send / recv / broadcast of the chain) run inside these opaque ops: a compiled
# graph calls them in its own order, the same on every rank (one graph, one schedule).
@Op("row_parallel_linear")
def row_parallel_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    chunk_rows: int,
    ticket: torch.Tensor | None,
    leaf_tokens: int,
    deposit_weight: bool,
    deposit_bias: bool,
) -> torch.Tensor:
    """The ``det_train::row_parallel_linear`` op: ``row_parallel_linear`` after its checks (the
    chain over the ranks of the group named ``group_name``); the rest is ``linear_op``'s plan."""
    x2d = x.reshape(-1, x.shape[-1])
    y = _chained_sum(x2d, weight.t(), bias, x.dtype, _group(group_name), chunk_rows)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@row_parallel_op.register_fake
def _(x, weight, bias, group_name, chunk_rows, ticket, leaf_tokens, deposit_weight, deposit_bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _tp_setup(ctx, inputs, output):
    x, weight, bias, group_name, chunk_rows, ticket, leaf_tokens, deposit_weight, deposit_bias = inputs
    ctx.save_for_backward(x, weight, bias)  # saved leaves unpack as the Parameters
    ctx.has_bias, ctx.group_name, ctx.chunk_rows = bias is not None, group_name, chunk_rows
    ctx.plan = GradPlan(leaf_tokens, deposit_weight, deposit_bias, ticket)  # the ticket: not saved


def _row_parallel_backward(ctx, dy):
    runtime.check_first_order("det_train.row_parallel_linear")
    x, weight, bias = ctx.saved_tensors
    x2d = x.reshape(-1, x.shape[-1])
    dy2d = dy.reshape(-1, weight.shape[0])
    grad_x = None
    if ctx.needs_input_grad[0]:  # dX_r = dY W_r: local
        grad_x = matmul_op(dy2d, weight).reshape(x.shape)
    want_b = ctx.has_bias and ctx.needs_input_grad[2]
    grad_w, grad_b = param_grads(dy2d, x2d, weight, bias, ctx.needs_input_grad[1], want_b, ctx.plan)
    return grad_x, grad_w, grad_b, *(None,) * 6


row_parallel_op.register_autograd(_row_parallel_backward, setup_context=_tp_setup)


@Op("column_parallel_linear")
def column_parallel_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    chunk_rows: int,
    ticket: torch.Tensor | None,
    leaf_tokens: int,
    deposit_weight: bool,
    deposit_bias: bool,
) -> torch.Tensor:
    """The ``det_train::column_parallel_linear`` op: this rank's columns ``Y[..., N_r]`` (local; the
    backward's dX is the chain, ``column_parallel_input_grad``)."""
    x2d = x.reshape(-1, x.shape[-1])
    y = torch.empty((x2d.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if y.numel():
        launch_matmul(x2d, weight.t(), y, bias=bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@column_parallel_op.register_fake
def _(x, weight, bias, group_name, chunk_rows, ticket, leaf_tokens, deposit_weight, deposit_bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _column_parallel_backward(ctx, dy):
    runtime.check_first_order("det_train.column_parallel_linear")
    x, weight, bias = ctx.saved_tensors
    x2d = x.reshape(-1, x.shape[-1])
    dy2d = dy.reshape(-1, weight.shape[0])
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = column_parallel_input_grad_op(dy2d, weight, ctx.group_name, ctx.chunk_rows).reshape(x.shape)
    want_b = ctx.has_bias and ctx.needs_input_grad[2]
    grad_w, grad_b = param_grads(dy2d, x2d, weight, bias, ctx.needs_input_grad[1], want_b, ctx.plan)
    return grad_x, grad_w, grad_b, *(None,) * 6


column_parallel_op.register_autograd(_column_parallel_backward, setup_context=_tp_setup)


@Op("column_parallel_input_grad")
def column_parallel_input_grad_op(
    dy2d: torch.Tensor, weight: torch.Tensor, group_name: str, chunk_rows: int
) -> torch.Tensor:
    """The ``det_train::column_parallel_input_grad`` op: dX = the sum over ranks of ``dY_r W_r``,
    chained in the unsplit order and broadcast (every rank gets the unsplit dX)."""
    return _chained_sum(dy2d, weight, None, dy2d.dtype, _group(group_name), chunk_rows)


@column_parallel_input_grad_op.register_fake
def _(dy2d, weight, group_name, chunk_rows):
    return dy2d.new_empty((dy2d.shape[0], weight.shape[1]))


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    chunk_rows: int = 4096,
) -> torch.Tensor:
    """Row-parallel (input-feature split) ``linear``: every rank gets the full, unsplit Y.

    Args:
        x: this rank's input features ``(*, K_r)``; ranks hold consecutive K parts in group-rank
            order, every part but the last a multiple of 64 (bf16 / fp16; 32 for fp32).
        weight: this rank's ``W[:, K_r]``, ``(N, K_r)``.
        bias: the full ``(N,)`` bias (replicated; added once, by the last rank), or None.
        group: the tensor-parallel process group (None: the default group).
        chunk_rows: rows per pipelined chunk of the chain (does not change bits).

    Returns:
        ``(*, N)`` on every rank, bitwise equal to ``linear(x_full, W_full, bias)``.

    Backward: dX_r = dY W_r and dW_r (canonical token order, accumulator-aware) are local, also
    bitwise equal to the matching slices of the unsplit gradients. dY must be the same on every
    rank (it is, when Y feeds replicated computation).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: as ``linear``; a K part (not the last) that is not a multiple of the K step,
            raised on every rank (checked once per weight and shapes, with one
            ``all_gather_object``; in a compiled graph only on the rank whose part it is).
        TypeError: as ``linear``.

    **Determinism:** Y is the unsplit fold over K (rank r continues rank r - 1's fp32 accumulator),
    so any split at multiples of the K step, any rank count and any ``chunk_rows`` give the unsplit
    bits. Cost: the ranks' work is a chain (pipelined over row chunks); each hop sends an fp32
    chunk; the last rank broadcasts Y.
    """
    check_linear(x, weight, bias)
    name = _group_name(group)
    _check_parts_on_every_rank(weight, x.dtype, weight.shape[0], weight.shape[1], group, name)
    plan = plan_grads(math.prod(x.shape[:-1]), weight, bias)
    args = (plan.ticket, plan.leaf_tokens, plan.weight, plan.bias)
    return row_parallel_op(x, weight, bias, name, int(chunk_rows), *args)


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    chunk_rows: int = 4096,
) -> torch.Tensor:
    """Column-parallel (output-feature split) ``linear``: rank r computes ``Y[..., N_r]``.

    Args:
        x: the full input ``(*, K)`` (replicated).
        weight: this rank's rows ``W[N_r]``, ``(N_r, K)``; consecutive N parts in group-rank order,
            every part but the last a multiple of 64 (bf16 / fp16; 32 for fp32).
        bias: this rank's ``b[N_r]`` or None.
        group, chunk_rows: as ``row_parallel_linear`` (used by the backward's dX chain).

    Returns:
        ``(*, N_r)``, bitwise equal to the matching columns of the unsplit ``linear``.

    Backward: dX = sum over ranks of dY_r W_r, chained in the unsplit order and broadcast, so every
    rank gets the unsplit dX; dW_r and db_r are local (canonical token order).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: as ``linear``; an N part (not the last) that is not a multiple of the K step
            (when ``x`` requires grad: the dX chain), raised on every rank as in
            ``row_parallel_linear``.
        TypeError: as ``linear``.

    **Determinism:** Y_r, dW_r, db_r are column / row slices of the unsplit results; dX equals the
    unsplit dX for any split at multiples of the K step and any ``chunk_rows``.
    """
    check_linear(x, weight, bias)
    name = _group_name(group)
    if torch.is_grad_enabled() and x.requires_grad:  # the backward's dX chain sums over the N parts
        _check_parts_on_every_rank(weight, x.dtype, weight.shape[1], weight.shape[0], group, name)
    plan = plan_grads(math.prod(x.shape[:-1]), weight, bias)
    args = (plan.ticket, plan.leaf_tokens, plan.weight, plan.bias)
    return column_parallel_op(x, weight, bias, name, int(chunk_rows), *args)
