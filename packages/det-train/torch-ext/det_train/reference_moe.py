"""Plain-torch references for det_train's mixture-of-experts ops (tests import them).

They define the math, not the bits: each computes in ``compute_dtype`` (fp64 for accuracy tests),
differentiable by torch's autograd; ``router_topk_reference`` also defines the tie order.
"""

from __future__ import annotations

import torch

__all__ = ["moe_experts_reference", "router_topk_reference"]


def router_topk_reference(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, compute_dtype=torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights (T, k) in compute_dtype, indices (T, k) int64)``: ``p = softmax(logits)``, the experts
    of the k largest ``p`` by a stable descending sort (equal probabilities: the lower index first),
    their probabilities divided by their sum when ``norm_topk_prob``. Differentiable in ``logits``."""
    p = torch.softmax(logits.to(compute_dtype), dim=-1)
    indices = torch.sort(p.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(p, 1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, indices


def moe_experts_reference(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    compute_dtype=torch.float64,
) -> torch.Tensor:
    """``sum_j weights[t, j] * down_proj[e] @ (silu(g) * u)`` with ``[g | u] = gate_up_proj[e] @ x_t`` and
    ``e = indices[t, j]``, every token and slot in ``compute_dtype`` (a per-slot gather of the expert
    weights). Differentiable in ``x``, ``weights`` and both expert weights."""
    xc, wc = x.to(compute_dtype), weights.to(compute_dtype)
    gate_up, down = gate_up_proj.to(compute_dtype), down_proj.to(compute_dtype)
    half = gate_up.shape[1] // 2
    out = torch.zeros_like(xc)
    for j in range(indices.shape[1]):
        e = indices[:, j]
        h = torch.einsum("tnh,th->tn", gate_up[e], xc)
        a = torch.nn.functional.silu(h[:, :half]) * h[:, half:]
        out = out + wc[:, j : j + 1] * torch.einsum("thi,ti->th", down[e], a)
    return out
