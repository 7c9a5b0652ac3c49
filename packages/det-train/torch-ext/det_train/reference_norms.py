"""Plain-torch references for det_train's reduction ops (tests and benchmarks import them).

They define the math, not the bits: each computes in ``compute_dtype`` (fp64 for accuracy tests),
except ``embedding_weight_grad_reference``, which follows the kernel's canonical order exactly.
"""

from __future__ import annotations

import torch
from det_core.reduce import TreePartial, num_leaves

__all__ = [
    "cross_entropy_reference",
    "embedding_weight_grad_reference",
    "layer_norm_reference",
    "rms_norm_reference",
]


def rms_norm_reference(x, weight=None, eps=None, compute_dtype=torch.float64, offset=0.0):
    """``x * rsqrt(mean(x**2, -1) + eps) * (offset + weight)`` in ``compute_dtype`` (last dim
    normalised; ``offset=1.0`` is Gemma's ``1 + weight``)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    xc = x.to(compute_dtype)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return y * (offset + weight.to(compute_dtype)) if weight is not None else y


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5, compute_dtype=torch.float64):
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last dim in ``compute_dtype``
    (the biased variance, as ``torch.nn.LayerNorm``)."""
    xc = x.to(compute_dtype)
    centred = xc - xc.mean(-1, keepdim=True)
    y = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute_dtype)
    return y + bias.to(compute_dtype) if bias is not None else y


def cross_entropy_reference(
    logits, targets, ignore_index=-100, reduction="mean", num_global_tokens=None, compute_dtype=torch.float64
):
    """Token-level cross-entropy over the last dim of ``logits`` in ``compute_dtype``."""
    lg = logits.reshape(-1, logits.shape[-1]).to(compute_dtype)
    t = targets.reshape(-1)
    valid = t != ignore_index
    lse = torch.logsumexp(lg, dim=-1)
    picked = lg.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
    if reduction == "none":
        return loss.reshape(targets.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (num_global_tokens if num_global_tokens is not None else valid.sum())


def embedding_weight_grad_reference(ids, dy, num_embeddings, leaf_tokens):
    """The canonical-order embedding gradient, by its definition (slow; small sizes only).

    Leaf ``j`` (tokens ``[j * leaf_tokens, (j + 1) * leaf_tokens)``) is a dense ``(V, D)`` fp32 table
    starting at +0.0 to which each token's ``dy`` row is added at its id, in token order; leaves
    are combined by ``TreePartial``. Returns fp32 ``(V, D)``.
    """
    ids = ids.reshape(-1)
    dy = dy.reshape(ids.shape[0], -1).to(torch.float32)
    n = num_leaves(ids.shape[0], leaf_tokens)
    tree = TreePartial()
    for j in range(n):
        leaf = torch.zeros((num_embeddings, dy.shape[1]), dtype=torch.float32, device=dy.device)
        for t in range(j * leaf_tokens, min((j + 1) * leaf_tokens, ids.shape[0])):
            leaf[ids[t]] = leaf[ids[t]] + dy[t]
        tree.add_leaves(j, leaf.unsqueeze(0))
    return tree.result(n)
