"""A mixture-of-experts load-balancing auxiliary loss per sequence: the Switch Transformer's
``E * sum_i f_i P_i`` of each sequence alone, weighted by the sequence's share of the global batch's
tokens, with a gradient that is a per-token constant.

``moe_balance_loss(probs, indices, sequence, position, tokens, total_tokens)`` takes, for each of the
``L`` MoE layers, the router's fp32 probabilities ``(N, E)`` over the call's ``N`` tokens
(``moe_router(..., return_probs=True)``) and its chosen experts ``(N, k)``, each token's sequence
(``-1``: not counted) and position in it, and returns the ``(S,)`` terms
``aux_s * tokens_s / total_tokens``, where for sequence ``s`` with ``N_s`` counted tokens

    f_i = C_i / (L N_s),  C_i = sum over layers and counted tokens of [i among the token's k experts]
    P_i = S_i / (L N_s),  S_i = sum over layers and counted tokens of p_{l,t,i}
    aux_s = E * sum_i f_i P_i

which is transformers' ``load_balancing_loss_func`` applied to that sequence alone.

Why per sequence: transformers' loss takes ``f`` and ``P`` over the whole (micro-)batch, so every
token's gradient depends on which other sequences share its micro-batch. Per sequence, the counts
``C`` are integers (exact in any order, a stop-gradient as in the Switch Transformer), so
``d aux_s / d p_{l,t,i} = E C_i / (L N_s)^2`` is the same constant for all of the sequence's counted
tokens and layers: a token's gradient depends only on its own sequence, whatever the split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["moe_balance_loss"]


def _pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` summed over ``dim`` by the perfect binary tree over its indices, zero-padded to a power
    of two. Each level is one elementwise add (IEEE, exact per element on every device), so a row's
    sum depends on its own elements and positions only: not on the other rows or their number, as
    ``torch.sum`` would (it picks its reduction order from the whole tensor's shape and alignment).
    Trailing zeros (padding) add +0.0: the same bits for any padded length."""
    n = x.shape[dim]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        pad = list(x.shape)
        pad[dim] = size - n
        x = torch.cat((x, x.new_zeros(pad)), dim)
    while x.shape[dim] > 1:
        x = x.unflatten(dim, (-1, 2))
        x = x.select(dim + 1, 0) + x.select(dim + 1, 1)
    return x.squeeze(dim)


class _BalanceLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sequence, position, counts, scale, length: int, *probs: torch.Tensor):
        counted = sequence >= 0
        at = (sequence[counted], position[counted])
        sums = None
        for p in probs:  # layer order; fp64: the terms are exact products of fp32 values
            # each sequence's tokens at their own positions (one destination per token): its sum
            # does not depend on where the sequence sits in the call
            dense = p.new_zeros((counts.shape[0], length, p.shape[1]), dtype=torch.float64)
            dense[at] = p[counted].double()
            part = _pairwise_sum(dense, 1)
            sums = part if sums is None else sums + part
        ctx.save_for_backward(sequence, counts, scale)
        ctx.layers = len(probs)
        return (_pairwise_sum(counts.double() * sums, 1) * scale).float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sequence, counts, scale = ctx.saved_tensors
        # d term_s / d p_{l,t,i} = scale_s C_i for every counted token of s and every layer: one
        # fp64 product per (sequence, expert), rounded once to fp32, then gathered per token
        per_expert = ((grad.double() * scale)[:, None] * counts.double()).float()
        d_probs = torch.where((sequence >= 0)[:, None], per_expert[sequence.clamp(min=0)], 0.0)
        return (None, None, None, None, None, *([d_probs] * ctx.layers))


def _check(probs, indices, sequence, position, tokens) -> tuple[int, int]:
    if not isinstance(probs, Sequence) or not isinstance(indices, Sequence) or not probs:
        raise TypeError("moe_balance_loss: probs and indices must be non-empty sequences (one per MoE layer)")
    if len(probs) != len(indices):
        raise ValueError(
            f"moe_balance_loss: {len(probs)} probability tensors but {len(indices)} index tensors "
            "(one of each per MoE layer)"
        )
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise TypeError("moe_balance_loss: tokens must be an (S,) integer tensor (a weight per sequence)")
    n, e = probs[0].shape if probs[0].dim() == 2 else (-1, -1)
    for p, i in zip(probs, indices, strict=True):
        if p.dtype != torch.float32 or tuple(p.shape) != (n, e):
            raise ValueError(
                f"moe_balance_loss: every probs tensor must be float32 ({n}, {e}), got {p.dtype} "
                f"{tuple(p.shape)}: pass moe_router(..., return_probs=True)'s probabilities"
            )
        if i.dtype != torch.int64 or i.dim() != 2 or i.shape[0] != n:
            raise ValueError(f"moe_balance_loss: every indices tensor must be int64 ({n}, k)")
    for name, t in (("sequence", sequence), ("position", position)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (n,):
            raise ValueError(f"moe_balance_loss: {name} must be an int64 tensor of the {n} tokens")
    return n, e


def moe_balance_loss(
    probs: Sequence[torch.Tensor],
    indices: Sequence[torch.Tensor],
    sequence: torch.Tensor,
    position: torch.Tensor,
    tokens: torch.Tensor,
    total_tokens: int | torch.Tensor,
) -> torch.Tensor:
    """Each sequence's load-balancing loss (transformers' definition on that sequence alone),
    weighted by its share of the global batch.

    Args:
        probs: one ``(N, E)`` float32 tensor per MoE layer, in layer order: the router's
            probabilities over the call's ``N`` tokens (``moe_router(..., return_probs=True)``);
            differentiable.
        indices: one ``(N, k)`` int64 tensor per layer: the experts each token was routed to.
        sequence: ``(N,)`` int64, each token's sequence in ``[0, S)``, or ``-1`` for a token that
            is not counted (transformers' ``attention_mask`` 0).
        position: ``(N,)`` int64, each counted token's position in its sequence (distinct within
            a sequence; it orders the probability sums).
        tokens: ``(S,)`` integer tensor, each sequence's weight numerator (``convert``'s hook
            passes its counted labels, the tokens ``num_items_in_batch`` counts).
        total_tokens: the weights' denominator (``num_items_in_batch``), a positive int or a
            one-element integer tensor.

    Returns:
        ``(S,)`` float32: ``aux_s * tokens_s / total_tokens`` (0 for a sequence without counted
        tokens), ``aux_s = E * sum_i f_i P_i`` as the module docstring defines it. Differentiable
        in ``probs``: ``d / d p_{l,t,i} = E C_i tokens_s / (total_tokens (L N_s)^2)`` for a counted
        token (0 for the others), ``C`` a stop-gradient integer count.

    Raises:
        TypeError: ``probs`` / ``indices`` not non-empty sequences, ``tokens`` not an integer
            vector.
        ValueError: mismatched layer counts, shapes or dtypes (each named).

    **Determinism:** a sequence's term and its tokens' gradient depend only on that sequence's
    probabilities, routing and positions and on ``tokens_s`` / ``total_tokens``: not on the other
    sequences in the call, their number or where the sequence sits, so any micro-batch split
    (whole sequences per micro-batch), packing and data-parallel layout gives the same bits. The
    counts are integer sums (exact in any order); the probability sums are fp64 pairwise trees
    over each sequence's positions, summed over layers in layer order; the gradient is one fp64
    product per (sequence, expert), ``grad_s * scale_s * C_i``, rounded once to fp32. The
    probabilities' gradient enters ``moe_router``'s row kernel (its ``dP`` input). One host sync
    (the longest sequence's length).

    Method: the Switch Transformer's auxiliary load-balancing loss (Fedus et al., "Switch
    Transformers", 2021, eq. 4-6, as transformers' ``load_balancing_loss_func`` with top-k counts)
    taken per sequence, as DeepSeek-V2 / V3's sequence-wise balance loss.
    """
    n, e = _check(probs, indices, sequence, position, tokens)
    device = probs[0].device
    layers, count = len(probs), tokens.shape[0]
    sequence, position = sequence.to(device), position.to(device)
    counted = sequence >= 0
    slot = sequence.clamp(min=0)
    counts = torch.zeros(count * e, dtype=torch.int64, device=device)
    for index in indices:  # integer sums: exact in any order
        at = (slot[:, None] * e + index.to(device)).reshape(-1)
        counts.scatter_add_(0, at, counted[:, None].expand_as(index).reshape(-1).long())
    counts = counts.view(count, e)
    lengths = torch.zeros(count, dtype=torch.int64, device=device).scatter_add_(0, slot, counted.long())
    total = torch.as_tensor(total_tokens, device=device).reshape(()).double()
    # scale_s = E tokens_s / (total (L N_s)^2): a fixed fp64 formula of exact integers; 0 without tokens
    size = (lengths * layers).double()
    scale = tokens.to(device).double() * e / total / (size * size)
    scale = torch.where(lengths > 0, scale, 0.0)
    length = int(torch.where(counted, position, 0).max()) + 1 if n else 1
    return _BalanceLoss.apply(sequence, position, counts, scale, length, *probs)
