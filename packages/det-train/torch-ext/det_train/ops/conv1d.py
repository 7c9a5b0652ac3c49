"""transformers' ``Conv1D`` (GPT-2, GPT): ``y = x @ W + b`` with ``W`` stored ``(in_features, out_features)``.

Not a convolution: a linear layer whose weight is the transpose of ``nn.Linear``'s (Radford et al.,
"Improving Language Understanding by Generative Pre-Training", 2018). The same kernels as
``linear``, with the operand roles swapped where the layout differs:

- forward ``x @ W`` and dX ``= dY @ W^T`` are ``matmul`` (fixed K order, no split-K: row invariant);
- dW ``= X^T dY`` (``(in, out)``) is ``weight_grad_partial(x, dy)``: the canonical token order of a
  Linear's dW with the two per-token operands exchanged (its ``dY^T X`` of ``(x, dy)``), so the
  same leaves, folds and tree; db is a Linear's bias gradient. With an active
  ``CanonicalGradAccumulator`` both are deposited there (``linear.param_grads``).
"""

from __future__ import annotations

import math

import torch
from det_core import runtime

from ._library import Op
from .linear import GradPlan, affine_rows, param_grads, plan_grads
from .matmul import launch_matmul, matmul_op

__all__ = ["Conv1D", "conv1d"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- torch.library ops
@Op("conv1d")
def conv1d_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ticket: torch.Tensor | None,
    leaf_tokens: int,
    deposit_weight: bool,
    deposit_bias: bool,
) -> torch.Tensor:
    """The ``det_train::conv1d`` op: ``y = x @ weight + bias`` (``conv1d`` after its checks).

    ``ticket``, ``leaf_tokens`` and the ``deposit_*`` flags are ``linear.plan_grads``'s, for the backward.
    """
    return affine_rows(x, weight.shape[1], bias, lambda x2d, y: launch_matmul(x2d, weight, y, bias=bias))


@conv1d_op.register_fake
def _(x, weight, bias, ticket, leaf_tokens, deposit_weight, deposit_bias):
    return x.new_empty((*x.shape[:-1], weight.shape[1]))


def _conv1d_setup(ctx, inputs, output):
    x, weight, bias, ticket, leaf_tokens, deposit_weight, deposit_bias = inputs
    ctx.save_for_backward(x, weight, bias)  # saved leaves unpack as the Parameters: deposits key by identity
    ctx.has_bias = bias is not None
    ctx.plan = GradPlan(leaf_tokens, deposit_weight, deposit_bias, ticket)  # the ticket: not saved


def _conv1d_backward(ctx, dy):
    runtime.check_first_order("det_train.conv1d")
    x, weight, bias = ctx.saved_tensors
    k, n = weight.shape
    x2d = x.reshape(math.prod(x.shape[:-1]), k)
    dy2d = dy.reshape(x2d.shape[0], n)
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = matmul_op(dy2d, weight.t()).view(x.shape)
    want_w, want_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    # dW (in, out) = X^T dY: a Linear's dW with the per-token operands exchanged
    grad_w, _ = param_grads(x2d, dy2d, weight, None, want_w, False, ctx.plan)
    _, grad_b = param_grads(dy2d, x2d, weight, bias, False, want_b, ctx.plan)
    return grad_x, grad_w, grad_b, None, None, None, None


conv1d_op.register_autograd(_conv1d_backward, setup_context=_conv1d_setup)


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic ``y = x @ weight + bias`` with ``weight (in_features, out_features)`` (transformers'
    ``Conv1D``), with autograd.

    Args:
        x: ``(*, in_features)`` bfloat16 / float16 / float32.
        weight: ``(in_features, out_features)``, same dtype and device.
        bias: optional ``(out_features,)``, same dtype; added in fp32 before the single rounding.

    Returns:
        ``(*, out_features)`` in ``x``'s dtype.

    Gradients: dX = dY W^T (``matmul``); dW = X^T dY and db = the sum of dY over the flattened
    tokens, in the canonical order of ``linear`` (deposited into the active
    ``CanonicalGradAccumulator`` if any; their autograd gradients are None then).

    **Determinism:** as ``linear``: run to run bitwise; y and dX row invariant; dW and db equal
    bits for any split into micro-batches (any sizes) and leaf-aligned data-parallel ranks under
    the accumulator. Not equal to ``torch.addmm``'s bits, nor across GPU models or Triton versions.

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes.
        ValueError: shapes (x's last dim vs ``in_features``, bias length), devices differ.
        RuntimeError: CPU tensors without the Triton interpreter.

    Method: transformers ``pytorch_utils.Conv1D`` (Radford et al., 2018) on ``linear``'s kernels.
    """
    op = "det_train.conv1d"
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != x.dtype or t.dtype not in _DTYPES:
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype}; x, weight and bias need one dtype of bfloat16, "
                f"float16, float32 (x is {x.dtype})"
            )
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D (in_features, out_features), got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"{op}: x's last dim must equal in_features={weight.shape[0]} (weight rows), got x of "
            f"shape {tuple(x.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[1],):
        raise ValueError(f"{op}: bias must have shape ({weight.shape[1]},), got {tuple(bias.shape)}")
    runtime.check_kernel_device(x, weight, *(() if bias is None else (bias,)), op=op)
    plan = plan_grads(math.prod(x.shape[:-1]), weight, bias)
    return conv1d_op(x, weight, bias, plan.ticket, plan.leaf_tokens, plan.weight, plan.bias)


class Conv1D(torch.nn.Module):
    """Drop-in for transformers' ``Conv1D`` (``pytorch_utils.Conv1D``): same constructor ``(nf, nx)``,
    parameters (``weight (nx, nf)``, ``bias (nf,)``), init and state_dict; forward is ``conv1d``.

    Args:
        nf: output features (``out_features``); nx: input features (``in_features``).
        device, dtype: of the parameters (bfloat16 / float16 / float32).

    Forward: ``x (*, nx)`` in the parameters' dtype gives ``(*, nf)``.

    Raises: as ``conv1d`` (at forward).

    **Determinism:** as ``conv1d``: row-invariant output and input gradient; canonical-order weight
    and bias gradients (accumulator-aware).
    """

    def __init__(self, nf: int, nx: int, device=None, dtype=None) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=0.02)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv1d(x, self.weight, self.bias)
