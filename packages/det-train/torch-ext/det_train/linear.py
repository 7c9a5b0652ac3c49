"""Deterministic linear layer: ``Y = X W^T + b`` with a batch-invariant forward and dX, and dW / db
summed over tokens in the canonical order (fp32 leaf sums combined by det_core's fixed tree).

- Forward and dX are ``matmul`` (fixed K order, no split-K): row invariant.
- dW = dY^T X and db = sum of dY over tokens, in the canonical order (``weight_grad.py``: fp32
  leaf sums of ``leaf_tokens`` tokens combined by det_core's fixed tree, whole aligned subtrees
  finished in-kernel).
- With an active ``CanonicalGradAccumulator`` the leaf sums are deposited there (``grad_accum.py``)
  and the autograd gradient of the weight / bias is None.
"""

from __future__ import annotations

import functools
import math

import torch
from det_core import runtime
from det_core.reduce import TreePartial, num_leaves

from ._leaf_fold import weight_grad_fold
from .configs import weight_grad_config
from .grad_accum import DEFAULT_LEAF_TOKENS, current_accumulator
from .matmul import check_bias, launch_linear, launch_matmul
from .weight_grad import bias_grad_partial, weight_grad_partial

__all__ = ["Linear", "bias_grad_partial", "linear", "weight_grad_partial"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- autograd
class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # explicit rows: K = 0 is allowed
        n = weight.shape[0]
        y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)  # the rows of x2d @ W.T
        if y.numel() and x2d.shape[1]:
            launch_linear(x2d, weight, y, bias)
        elif y.numel():
            y.copy_(bias.expand_as(y) if bias is not None else torch.zeros_like(y))
        ctx.save_for_backward(x2d, weight)
        ctx.weight = weight  # the Parameter itself: the accumulator keys deposits by identity
        ctx.bias = bias
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        runtime.check_first_order("det_train.linear")
        x2d, weight = ctx.saved_tensors
        bias = ctx.bias
        n, k = weight.shape
        dy2d = dy.reshape(x2d.shape[0], n)  # explicit rows: N = 0 is allowed
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty(ctx.x_shape, dtype=dy.dtype, device=dy.device)  # the rows of dy2d @ W
            if grad_x.numel() and n:
                launch_matmul(dy2d, weight, grad_x)
            else:
                grad_x.zero_()
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_w, grad_b = param_grads(dy2d, x2d, ctx.weight, bias, want_w, want_b)
        return grad_x, grad_w, grad_b


def param_grads(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    want_w: bool,
    want_b: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dW and db of ``y = x W^T + b`` in the canonical token order (the backward of ``linear``).

    With an active accumulator, leaf Parameters get their partial trees deposited and None is
    returned for them; otherwise the finished gradients (leaves of ``DEFAULT_LEAF_TOKENS``).
    """
    grad_w = grad_b = None
    if not (want_w or want_b):
        return grad_w, grad_b
    acc = current_accumulator()
    tokens = dy2d.shape[0]
    if acc is not None and tokens:
        leaf = acc.leaf_tokens
        if want_w:
            if weight.is_leaf:  # an open leaf's fp32 fold is carried to the micro-batch completing it
                step = weight_grad_config(dy2d.dtype, dy2d.shape[1], x2d.shape[1]).block_t
                fold = (step, _weight_fold)
                acc.deposit_rows(weight, (dy2d, x2d), functools.partial(_weight_leaves, leaf), fold)
            else:
                grad_w = weight_grad_partial(dy2d, x2d, leaf_tokens=leaf, finish_dtype=weight.dtype)
        if want_b:
            if bias.is_leaf:
                acc.deposit_rows(bias, (dy2d,), functools.partial(_bias_leaves, leaf))
            else:
                grad_b = bias_grad_partial(dy2d, leaf_tokens=leaf).result(num_leaves(tokens, leaf))
                grad_b = grad_b.to(bias.dtype)
        return grad_w, grad_b
    leaf = DEFAULT_LEAF_TOKENS
    if want_w:
        if tokens == 0:
            grad_w = torch.zeros_like(weight)
        else:
            grad_w = weight_grad_partial(dy2d, x2d, leaf_tokens=leaf, finish_dtype=weight.dtype)
    if want_b:
        if tokens == 0:
            grad_b = torch.zeros_like(bias)
        else:
            grad_b = bias_grad_partial(dy2d, leaf_tokens=leaf).result(num_leaves(tokens, leaf)).to(bias.dtype)
    return grad_w, grad_b


def _weight_leaves(leaf_tokens: int, first_leaf: int, rows: tuple) -> TreePartial:
    """The accumulator's leaf-sum function of a Linear weight: rows ``(dY, X)`` of whole leaves."""
    return weight_grad_partial(rows[0], rows[1], leaf_tokens=leaf_tokens, first_leaf=first_leaf)


def _weight_fold(rows: tuple, acc: torch.Tensor | None) -> torch.Tensor:
    """The accumulator's resumable fold of a Linear weight: ``acc`` continued over rows ``(dY, X)``."""
    return weight_grad_fold(rows[0], rows[1], acc)


def _bias_leaves(leaf_tokens: int, first_leaf: int, rows: tuple) -> TreePartial:
    """The accumulator's leaf-sum function of a Linear bias: rows ``(dY,)`` of whole leaves."""
    return bias_grad_partial(rows[0], leaf_tokens=leaf_tokens, first_leaf=first_leaf)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
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
    _check_linear(x, weight, bias)
    return _LinearFunction.apply(x, weight, bias)


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
        if isinstance(input, torch.Tensor) and input.dtype != self.weight.dtype:
            hint = (
                f"move the module with .to({input.dtype}) or cast the input with .to({self.weight.dtype})"
                if input.dtype in _DTYPES
                else f"cast the input with .to({self.weight.dtype}) (bf16, fp16 and fp32 are supported)"
            )
            raise TypeError(
                f"det_train.Linear: input dtype {input.dtype} differs from the module's weight dtype "
                f"{self.weight.dtype}; {hint}"
            )
        return linear(input, self.weight, self.bias)

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
