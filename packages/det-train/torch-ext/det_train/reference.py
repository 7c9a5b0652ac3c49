"""Plain-torch references for matmul / linear and SwiGLU (tests and benchmarks import these).

``*_fp64`` give the exact-as-possible answer (fp64 products and sums) used to measure accuracy;
``weight_grad_canonical`` spells out the canonical token order of dW with torch ops (fp32 leaf
sums, det_core's tree), which the kernels follow with their own fixed in-leaf fold.
"""

from __future__ import annotations

import torch
from det_core.reduce import TreePartial, num_leaves

__all__ = ["linear_fp64", "matmul_fp64", "swiglu_fp64", "weight_grad_canonical", "weight_grad_fp64"]


def matmul_fp64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64 (batched as torch.matmul)."""
    return torch.matmul(a.double(), b.double())


def linear_fp64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float64."""
    return torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())


def swiglu_fp64(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed ``(..., 2F)`` tensor in float64 (differentiable)."""
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def weight_grad_fp64(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dy^T x`` over flattened tokens in float64: ``(N, K)``."""
    return dy.reshape(-1, dy.shape[-1]).double().t() @ x.reshape(-1, x.shape[-1]).double()


def weight_grad_canonical(dy: torch.Tensor, x: torch.Tensor, leaf_tokens: int) -> torch.Tensor:
    """dW in the canonical order with torch ops: fp32 ``dy_leaf^T x_leaf`` per leaf, then the tree.

    Same tree as the kernel; the in-leaf order is torch's (so equal to the kernel's result up to
    fp32 rounding inside leaves, not bitwise). Returns fp32 ``(N, K)``.
    """
    dy2, x2 = dy.reshape(-1, dy.shape[-1]).float(), x.reshape(-1, x.shape[-1]).float()
    leaves = [
        dy2[s : s + leaf_tokens].t() @ x2[s : s + leaf_tokens] for s in range(0, dy2.shape[0], leaf_tokens)
    ]
    return TreePartial().add_leaves(0, leaves).result(num_leaves(dy2.shape[0], leaf_tokens))
