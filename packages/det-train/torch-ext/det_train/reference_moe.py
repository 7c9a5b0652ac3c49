"""Plain-torch references for det_train's mixture-of-experts ops (tests import them).

They define the math, not the bits: each computes in ``compute_dtype`` (fp64 for accuracy tests),
differentiable by torch's autograd; ``router_topk_reference`` also defines the tie order;
``moe_balance_loss_reference`` defines det_train's sequence-wise load-balancing loss.
"""

from __future__ import annotations

import torch

__all__ = ["moe_balance_loss_reference", "moe_experts_reference", "router_topk_reference"]


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


def moe_balance_loss_reference(
    router_logits,
    indices,
    sequence: torch.Tensor,
    tokens: torch.Tensor,
    total_tokens: int,
    compute_dtype=torch.float64,
) -> torch.Tensor:
    """``(S,)`` in ``compute_dtype``: for each sequence ``s`` alone (the tokens with
    ``sequence == s``; ``-1``: not counted), transformers' ``load_balancing_loss_func`` over the ``L``
    layers' ``router_logits`` (each ``(N, E)``) with the routing ``indices`` (each ``(N, k)``):
    ``E * sum_i f_i P_i``, ``f_i`` the fraction of the sequence's (token, layer) pairs routed to
    expert ``i`` (k per token), ``P_i`` its mean ``softmax`` probability, times
    ``tokens[s] / total_tokens`` (0 for a sequence without tokens). A loop over sequences and plain
    sums; differentiable in ``router_logits`` (``f`` is a count: no gradient)."""
    layers, e = len(router_logits), router_logits[0].shape[1]
    out = []
    for s in range(tokens.shape[0]):
        rows = sequence == s
        n = int(rows.sum()) * layers
        if n == 0:
            out.append(torch.zeros((), dtype=compute_dtype))
            continue
        counts = torch.zeros(e, dtype=compute_dtype)
        probs = torch.zeros(e, dtype=compute_dtype)
        for logits, index in zip(router_logits, indices, strict=True):
            p = torch.softmax(logits[rows].to(compute_dtype), dim=-1)
            counts = counts + torch.nn.functional.one_hot(index[rows], e).to(compute_dtype).sum((0, 1))
            probs = probs + p.sum(0)
        aux = e * ((counts / n) * (probs / n)).sum()
        out.append(aux * float(tokens[s]) / float(total_tokens))
    return torch.stack(out)
