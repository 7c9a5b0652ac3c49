"""Shared by the transformers model tests (per-head norms, sliding windows, MoE): a causal LM's
parameter gradients over a batch cut into micro-batches, through ``CanonicalGradAccumulator``."""

from __future__ import annotations

import torch
from det_train.accum.grad_accum import CanonicalGradAccumulator


def split_grads(
    model, ids: torch.Tensor, splits, leaf: int, outputs: list | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the causal-LM loss over ``ids`` ``(batch, seq)`` int64 cut into
    ``splits`` (``(first sequence, sequences)`` micro-batches), leaves of ``leaf`` tokens; the loss
    normalised by the global count of predicted tokens, so any split sums to one batch's loss.
    ``p.grad`` is cleared afterwards; each call's output is appended to ``outputs`` if given. Raises
    what the accumulator raises.

    **Determinism:** the accumulator's: the same bits for any split of the same batch."""
    batch, seq = ids.shape
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=leaf)
    for first, n in splits:
        x = ids[first : first + n]
        with acc.micro_batch(token_offset=first * seq):
            out = model(input_ids=x, labels=x, num_items_in_batch=batch * (seq - 1))
            out.loss.backward()
            if outputs is not None:
                outputs.append(out)
    acc.reduce(total_tokens=batch * seq)
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads
