"""Deterministic linear layer: ``Y = X W^T + b`` with a batch-invariant forward and dX, and dW / db
summed over tokens in the canonical order (fp32 leaf sums combined by det_core's fixed tree).

- Forward and dX are ``matmul`` (fixed K order, no split-K): row invariant.
- dW = dY^T X and db = sum of dY over tokens, in the canonical order (``weight_grad.py``: fp32
  leaf sums of ``leaf_tokens`` tokens combined by det_core's fixed tree, whole aligned subtrees
  finished in-kernel).
- With an active ``CanonicalGradAccumulator`` the leaf sums are deposited there (``accum/grad_accum.py``)
  and the autograd gradient of the weight / bias is None.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from det_core import runtime
from det_core.launch import PlanCache
from det_core.reduce import TreePartial, num_leaves

from ..accum import deposit
from ._leaf_fold import weight_grad_fold
from ._library import Op
from .configs import weight_grad_config
from .matmul import check_bias, launch_linear, matmul_rows
from .weight_grad import bias_grad_partial, weight_grad_partial

__all__ = ["Linear", "bias_grad_partial", "linear", "weight_grad_partial"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- torch.library ops
@dataclasses.dataclass(frozen=True)
class GradPlan:
    """What a forward decided for its backward's parameter gradients (``plan_grads``).

    ``leaf_tokens``: the canonical order's leaf (the accumulator's, else ``DEFAULT_LEAF_TOKENS``);
    ``weight`` / ``bias``: deposit that gradient into the active accumulator (the autograd gradient
    is then None) instead of returning it; ``ticket``: the deposit ops' mutated ticket, or None;
    ``fold`` / ``fold_count``: the weight's fixed fold (``CanonicalGradAccumulator.fixed_folds``), which
    the backward continues in place instead of depositing through the ticket's ops, and its counter,
    or None.

    **Determinism:** part of the op's schema arguments (so of a compiled graph): the leaf size is
    part of the canonical order; depositing or returning gives the same sums for a leaf-aligned
    call, and deposits make the gradient independent of the micro-batch split.
    """

    leaf_tokens: int
    weight: bool = False
    bias: bool = False
    ticket: torch.Tensor | None = None
    fold: torch.Tensor | None = None
    fold_count: torch.Tensor | None = None


def plan_grads(tokens: int, weight: torch.Tensor, bias: torch.Tensor | None) -> GradPlan:
    """Deposit or return the gradients of ``weight`` / ``bias`` of a Linear-like op over ``tokens`` rows?

    Inside an accumulator's micro-batch, leaf parameters (the tensors it tracks) are deposited;
    a cast or view of one (not a leaf) gets an autograd gradient in the accumulator's leaf order;
    a call with no tokens returns zero gradients. Read in the forward, so that ``torch.compile``
    traces (and guards) one choice per graph.

    Args: ``tokens`` the call's rows, ``weight`` / ``bias`` the op's parameters (bias may be None).
    Returns a ``GradPlan``; raises nothing.

    **Determinism:** a pure function of the active accumulator (or its absence) and the tensors'
    leaf status; the token offset is read later, by the deposit ops at run time.
    """
    leaf, active = deposit.accumulation()
    if not (active and tokens):
        return grad_plan(leaf, False, False, None)
    dep_w = weight.is_leaf
    dep_b = bias is not None and bias.is_leaf
    return grad_plan(leaf, dep_w, dep_b, _TICKET if dep_w or dep_b else None)


_GRAD_PLANS = PlanCache()
_TICKET = deposit.ticket()  # one tensor for the process: read once, not a call per plan


def grad_plan(leaf_tokens: int, weight: bool, bias: bool, ticket: torch.Tensor | None) -> GradPlan:
    """``GradPlan(leaf_tokens, weight, bias, ticket)``, one object per distinct value in eager execution
    (building a frozen dataclass costs host time on every call; a Linear-like op built two). Under
    ``torch.compile`` a new one (Dynamo traces the constructor, not a cache it would guard on).

    **Determinism:** a frozen value object: the cached one equals the one it replaces."""
    if torch.compiler.is_compiling() or (ticket is not None and ticket is not _TICKET):
        return GradPlan(leaf_tokens, weight, bias, ticket)
    key = (leaf_tokens, weight, bias, ticket is not None)
    plan = _GRAD_PLANS.get(key)
    return plan if plan is not None else _GRAD_PLANS.put(key, GradPlan(leaf_tokens, weight, bias, ticket))


def fixed_plan(plan: GradPlan, weight: torch.Tensor, tokens: int) -> GradPlan:
    """``plan`` with the weight's fixed fold when the active accumulator has one for it (then the
    ticket only for a deposited bias); ``plan`` itself otherwise. Raises ValueError when ``tokens``
    is not the micro-batch's ``num_tokens``.

    **Determinism:** chooses where the weight's leaf folds are kept, not their order or bits."""
    if not plan.weight:
        return plan
    fixed = deposit.fixed_fold("det_train.linear", weight, tokens)
    if fixed is None:
        return plan
    return GradPlan(plan.leaf_tokens, True, plan.bias, plan.ticket if plan.bias else None, *fixed)


def takes_fixed_fold(module: torch.nn.Module) -> bool:
    """Whether ``CanonicalGradAccumulator.fixed_folds`` gives ``module``'s weight a fixed fold here:
    a ``det_train.Linear``."""
    return isinstance(module, Linear)


def fixed_fold_spec(weight: torch.Tensor, leaf_tokens: int) -> tuple:
    """``(shape, step, close)`` of a Linear weight's fixed fold: fp32 of the weight's shape, continued
    at multiples of the dW fold's token step (``weight_grad_config``'s ``block_t``), closed as a copy."""
    step = weight_grad_config(weight.dtype, weight.shape[0], weight.shape[1]).block_t
    return weight.shape, step, _fold_node


def _fold_node(fold: torch.Tensor, tokens: int) -> torch.Tensor:
    return fold.clone()  # the leaf's node: the fold itself (a copy: the buffer holds the next leaf)


@Op("linear")
def linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ticket: torch.Tensor | None,
    fold: torch.Tensor | None,
    fold_count: torch.Tensor | None,
    leaf_tokens: int,
    deposit_weight: bool,
    deposit_bias: bool,
) -> torch.Tensor:
    """The ``det_train::linear`` op: ``y = x @ weight.T + bias`` (``linear`` after its checks).

    ``ticket``, ``fold``, ``fold_count``, ``leaf_tokens`` and the ``deposit_*`` flags are
    ``fixed_plan``'s, for the backward.
    """
    return affine_rows(x, weight.shape[0], bias, lambda x2d, y: launch_linear(x2d, weight, y, bias))


def affine_rows(x: torch.Tensor, n: int, bias: torch.Tensor | None, launch) -> torch.Tensor:
    """``(..., n)`` output of an affine map of ``x``'s rows: ``launch(x2d, y)`` fills it (x2d: x as
    explicit rows ``(M, K)``, so K = 0 is allowed); with K = 0 it is the bias (or zeros). The forward
    of ``linear`` and ``conv1d``, which differ only in the weight's layout."""
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if y.numel() and x2d.shape[1]:
        launch(x2d, y)
    elif y.numel():
        y.copy_(bias.expand_as(y) if bias is not None else torch.zeros_like(y))
    return y


@linear_op.register_fake
def _(x, weight, bias, ticket, fold, fold_count, leaf_tokens, deposit_weight, deposit_bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, ticket, fold, fold_count, leaf_tokens, deposit_weight, deposit_bias = inputs
    ctx.save_for_backward(x, weight, bias)  # a saved leaf unpacks as the Parameter itself
    ctx.has_bias = bias is not None
    # the ticket and the fold are mutated by the backward: not saved (saving checks their versions)
    if fold is None:
        ctx.plan = grad_plan(leaf_tokens, deposit_weight, deposit_bias, ticket)
    else:
        ctx.plan = GradPlan(leaf_tokens, deposit_weight, deposit_bias, ticket, fold, fold_count)


def _linear_backward(ctx, dy):
    runtime.check_first_order("det_train.linear")
    x, weight, bias = ctx.saved_tensors
    n, k = weight.shape
    x2d = x.reshape(math.prod(x.shape[:-1]), k)
    dy2d = dy.reshape(x2d.shape[0], n)  # explicit rows: N = 0 is allowed
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = matmul_rows(dy2d, weight).view(x.shape)  # the rows of dy2d @ W
    want_b = ctx.has_bias and ctx.needs_input_grad[2]
    grad_w, grad_b = param_grads(dy2d, x2d, weight, bias, ctx.needs_input_grad[1], want_b, ctx.plan)
    return grad_x, grad_w, grad_b, None, None, None, None, None, None


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


@Op("linear_weight_grad")
def weight_grad_op(dy: torch.Tensor, x: torch.Tensor, leaf_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``det_train::linear_weight_grad`` op: dW = dY^T X ``(N, K)`` in ``dtype``, the canonical
    tree over this call's leaves of ``leaf_tokens`` (zeros for no tokens)."""
    if dy.shape[0] == 0:
        return torch.zeros((dy.shape[1], x.shape[1]), dtype=dtype, device=dy.device)
    return weight_grad_partial(dy, x, leaf_tokens=leaf_tokens, finish_dtype=dtype)


@weight_grad_op.register_fake
def _(dy, x, leaf_tokens, dtype):
    return dy.new_empty((dy.shape[1], x.shape[1]), dtype=dtype)


@Op("linear_bias_grad")
def bias_grad_op(dy: torch.Tensor, leaf_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``det_train::linear_bias_grad`` op: db = the canonical sum of ``dy (T, N)`` over tokens
    (leaves of ``leaf_tokens``) in ``dtype`` (zeros for no tokens)."""
    tokens = dy.shape[0]
    if tokens == 0:
        return torch.zeros((dy.shape[1],), dtype=dtype, device=dy.device)
    return bias_grad_partial(dy, leaf_tokens=leaf_tokens).result(num_leaves(tokens, leaf_tokens)).to(dtype)


@bias_grad_op.register_fake
def _(dy, leaf_tokens, dtype):
    return dy.new_empty((dy.shape[1],), dtype=dtype)


@Op("linear_deposit_weight", ("ticket",))
def deposit_weight_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, ticket: torch.Tensor) -> None:
    """The ``det_train::linear_deposit_weight`` op: deposit dW = dY^T X of this micro-batch's rows
    into the active accumulator (with the resumable fold), at run time."""
    step = weight_grad_config(dy.dtype, dy.shape[1], x.shape[1]).block_t
    # whole leaves: the dW kernel's leaf sums; an open leaf: its fp32 fold, continued by the next micro-batch
    deposit.rows("det_train.linear", weight, (dy, x), _weight_leaves, fold=(step, _weight_fold))
    ticket.add_(1)


@deposit_weight_op.register_fake
def _(dy, x, weight, ticket):
    return None


@Op("linear_fold_weight", ("fold", "fold_count"))
def fold_weight_op(dy: torch.Tensor, x: torch.Tensor, fold: torch.Tensor, fold_count: torch.Tensor) -> None:
    """The ``det_train::linear_fold_weight`` op: ``fold`` += dW = dY^T X of this micro-batch's rows,
    continued in place (a fixed fold, ``CanonicalGradAccumulator.fixed_folds``), and 1 added to
    ``fold_count``: no host bookkeeping, so a CUDA graph may hold it (not tagged ``cudagraph_unsafe``)."""
    deposit.fold_checked("det_train.linear", fold_count)
    weight_grad_fold(dy, x, fold, out=fold)
    fold_count.add_(1)


@fold_weight_op.register_fake
def _(dy, x, fold, fold_count):
    return None


@Op("linear_deposit_bias", ("ticket",))
def deposit_bias_op(dy: torch.Tensor, bias: torch.Tensor, ticket: torch.Tensor) -> None:
    """The ``det_train::linear_deposit_bias`` op: deposit db = the sum of ``dy``'s rows into the
    active accumulator, at run time."""
    deposit.rows("det_train.linear", bias, (dy,), _bias_leaves)
    ticket.add_(1)


@deposit_bias_op.register_fake
def _(dy, bias, ticket):
    return None


def param_grads(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    want_w: bool,
    want_b: bool,
    plan: GradPlan,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dW = dY^T X and db of ``y = x W^T + b`` in the canonical token order (the backward of ``linear``).

    What ``plan`` (the forward's ``plan_grads``) marks deposited goes to the accumulator through
    the deposit ops, and its autograd gradient is None; the rest is returned, finished in the
    parameter's dtype over ``plan.leaf_tokens`` leaves. Operands are given as rows (``dy2d (T, N)``,
    ``x2d (T, K)``), so ``Conv1D``'s ``X^T dY`` is the same call with the two exchanged.

    Returns ``(grad_w (N, K) or None, grad_b (N,) or None)`` in the parameters' dtypes. Raises what
    the accumulator raises for a deposit (``RuntimeError`` outside the forward's micro-batch,
    ``ValueError`` for an untracked parameter or mismatched token counts).

    **Determinism:** dW and db in the canonical token order (fp32 leaf folds of ``block_t``
    tokens, the fixed tree over global leaf indices), the bits of ``linear``'s gradients.
    Method: canonical pairwise tree (Higham, SISC 1993), as ``linear``.
    """
    grad_w = grad_b = None
    if want_w:
        if plan.fold is not None:
            if deposit.fold_wanted("det_train.linear", weight, dy2d):
                fold_weight_op(dy2d, x2d, plan.fold, plan.fold_count)
        elif plan.weight:
            deposit_weight_op(dy2d, x2d, weight, plan.ticket)
        else:
            grad_w = weight_grad_op(dy2d, x2d, plan.leaf_tokens, weight.dtype)
    if want_b:
        if plan.bias:
            deposit_bias_op(dy2d, bias, plan.ticket)
        else:
            grad_b = bias_grad_op(dy2d, plan.leaf_tokens, bias.dtype)
    return grad_w, grad_b


def _weight_leaves(leaf_tokens: int, first_leaf: int, rows: tuple) -> TreePartial:
    """The accumulator's leaf-sum function of a Linear weight: rows ``(dY, X)`` of whole leaves."""
    return weight_grad_partial(rows[0], rows[1], leaf_tokens=leaf_tokens, first_leaf=first_leaf)


def _weight_fold(rows: tuple, acc: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The accumulator's resumable fold of a Linear weight: ``acc`` continued over rows ``(dY, X)``,
    into ``out`` (``acc`` itself under ``recoverable=False``) or a new tensor."""
    return weight_grad_fold(rows[0], rows[1], acc, out=out)


def _bias_leaves(leaf_tokens: int, first_leaf: int, rows: tuple) -> TreePartial:
    """The accumulator's leaf-sum function of a Linear bias: rows ``(dY,)`` of whole leaves."""
    return bias_grad_partial(rows[0], leaf_tokens=leaf_tokens, first_leaf=first_leaf)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# argument signatures that passed ``check_linear`` (the check reads nothing else)
_CHECKED = PlanCache()


def _signature(x, weight, bias) -> tuple | None:
    """What ``check_linear`` reads of plain eager tensors on a kernel device, or None (then it
    checks in full: traced calls, other types, CPU without the interpreter, whose error is raised)."""
    if torch.compiler.is_compiling() or type(x) not in _PLAIN or type(weight) not in _PLAIN:
        return None
    if bias is not None and type(bias) not in _PLAIN:
        return None
    device = x.device
    if device.type != "cuda" and not runtime.interpreter_active():
        return None
    b = None if bias is None else (bias.shape, bias.dtype, bias.device)
    return (x.dtype, device, x.dim(), x.shape[-1:], weight.dtype, weight.device, weight.shape, b)


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Check ``linear``'s arguments (also the tensor-parallel linears' local shards).

    Args:
        x: ``(*, in_features)``; bfloat16, float16 or float32.
        weight: ``(out_features, in_features)``, x's dtype and device.
        bias: None or ``(out_features,)``, weight's dtype and device.

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes.
        ValueError: shape mismatches, devices differ.
        RuntimeError: CPU tensors without the Triton interpreter.

    A signature of plain eager tensors that passed once (dtypes, devices, the shapes the check
    reads) is remembered and not checked again.

    **Determinism:** a check; it computes nothing.
    """
    key = _signature(x, weight, bias)
    if key is not None and key in _CHECKED:
        return
    _check_linear_args(x, weight, bias)
    if key is not None:
        _CHECKED.put(key, True)


def _check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    op = "det_train.linear"
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D (out_features, in_features), got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{op}: x's last dim must equal in_features={weight.shape[1]}, got x of shape {tuple(x.shape)}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"{op}: x ({x.dtype}) and weight ({weight.dtype}) must have one dtype; cast x first")
    runtime.check_kernel_device(x, weight, op=op)
    if bias is not None:
        check_bias(bias, weight.shape[0], weight, op)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic, batch-invariant ``y = x @ weight.T + bias`` with autograd.

    Args:
        x: ``(*, in_features)``; bfloat16, float16 or float32; any strides (rows are flattened
            with ``reshape``, a view whenever the strides allow).
        weight: ``(out_features, in_features)``, same dtype and device (read transposed in place).
        bias: optional ``(out_features,)``, same dtype; added in fp32 before the single rounding.

    Returns:
        ``(*, out_features)`` in ``x``'s dtype.

    Gradients: dX = dY W (a ``matmul``); dW = dY^T X and db = sum of dY over the flattened tokens
    in the canonical order: leaves of ``leaf_tokens`` tokens (the active accumulator's, else
    ``grad_accum.DEFAULT_LEAF_TOKENS`` = 8192) summed in fp32 by a fixed fold, combined by the fixed
    tree over leaf indices. Inside ``CanonicalGradAccumulator.micro_batch`` the leaf sums of a leaf
    Parameter are deposited there (the rows of a leaf the micro-batch leaves open are carried to
    the micro-batch that completes it) and its ``.grad`` is written by ``reduce``.

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes.
        ValueError: shape mismatches (x's last dim vs in_features, bias length), devices differ.
        RuntimeError: CPU tensors without the Triton interpreter.

    **Determinism:** run to run bitwise. y and dX: row invariant (a token's row does not depend
    on the number of tokens or its position). dW and db: equal bits for any split of the tokens
    into micro-batches (any sizes) and leaf-aligned data-parallel ranks when combined by the
    accumulator, and the plain backward of a whole batch equals the accumulator's result with the
    default ``leaf_tokens``.
    Row-parallel tensor parallelism: see ``matmul_partial``. Not guaranteed: equality with
    torch.nn.functional.linear, across GPU models or Triton versions.

    Method: tiled GEMM with fixed K order (Triton tutorial 03; He et al., "Defeating
    Nondeterminism in LLM Inference", 2025); canonical pairwise tree (Higham, SISC 1993).
    """
    check_linear(x, weight, bias)
    tokens = math.prod(x.shape[:-1])
    plan = fixed_plan(plan_grads(tokens, weight, bias), weight, tokens)
    return linear_op(
        x, weight, bias, plan.ticket, plan.fold, plan.fold_count, plan.leaf_tokens, plan.weight, plan.bias
    )


class Linear(torch.nn.Linear):
    """Drop-in ``torch.nn.Linear`` computing ``y = x @ weight.T + bias`` with ``det_train.linear``
    (same constructor, parameters, init and state_dict; ``Linear.from_torch(m)`` shares an existing
    module's parameters).

    Args:
        in_features, out_features: sizes of the input and output rows; ``weight`` is
            ``(out_features, in_features)``, ``bias`` ``(out_features,)``.
        bias: learn an additive bias (default True).
        device, dtype: of the parameters: bfloat16, float16 or float32 (float32 by default, as
            torch), on CUDA (or CPU under ``TRITON_INTERPRET=1``).

    Forward: ``input (*, in_features)`` in the parameters' dtype gives ``(*, out_features)`` in that
    dtype; fp32 accumulation, one rounding.

    Raises:
        TypeError: at forward, a dtype outside bfloat16 / float16 / float32 or ``input`` of another
            dtype than ``weight`` (cast one of them first); from ``from_torch``, a module that is not
            a ``torch.nn.Linear``.
        ValueError: at forward, ``input``'s last dim other than ``in_features``, or tensors on
            different devices. RuntimeError: CPU tensors without the Triton interpreter.

    **Determinism:** bitwise run to run; each output row and its input gradient are row invariant
    (independent of the number of tokens, the row's position and the other rows). ``weight`` and
    ``bias`` gradients are sums over tokens in the canonical order: equal bits for any leaf-aligned
    split into micro-batches / data-parallel ranks under a ``CanonicalGradAccumulator``. Not equal
    to ``torch.nn.Linear``'s bits, nor guaranteed across GPU models or Triton versions; details in
    ``linear``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # a Module attribute lookup each time it is read
        if isinstance(input, torch.Tensor) and input.dtype != weight.dtype:
            hint = (
                f"move the module with .to({input.dtype}) or cast the input with .to({self.weight.dtype})"
                if input.dtype in _DTYPES
                else f"cast the input with .to({self.weight.dtype}) (bf16, fp16 and fp32 are supported)"
            )
            raise TypeError(
                f"det_train.Linear: input dtype {input.dtype} differs from the module's weight dtype "
                f"{weight.dtype}; {hint}"
            )
        return linear(input, weight, self.bias)

    @classmethod
    def from_torch(cls, module: torch.nn.Linear) -> Linear:
        """A ``Linear`` sharing ``module``'s weight and bias Parameters (no copy)."""
        if not isinstance(module, torch.nn.Linear):
            raise TypeError(f"expected a torch.nn.Linear, got {type(module).__name__}")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = module.in_features, module.out_features
        new.weight = module.weight
        new.bias = module.bias
        return new
