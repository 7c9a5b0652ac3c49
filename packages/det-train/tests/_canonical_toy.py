"""A tiny canonical-order-aware op for accumulator tests: y = x * w (w of shape (D,)).

dW = sum over tokens of dy * x, with per-leaf sums by det_core's reference left fold. It follows
the ops' deposit contract (grad_accum.py), so the accumulator is tested independently of kernels.
"""

import functools

import torch
from det_core.reduce import TreePartial, canonical_sum, leaf_sums_reference
from det_train.accum.grad_accum import DEFAULT_LEAF_TOKENS, current_accumulator


class ToyScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        contrib = (dy.float() * x.float()).reshape(-1, w.numel())
        acc = current_accumulator()
        if acc is None:
            return dy * w, canonical_sum(contrib, DEFAULT_LEAF_TOKENS).to(w.dtype)
        first_leaf, n_leaves = acc.leaf_span(contrib.shape[0])
        sums = leaf_sums_reference(contrib, acc.leaf_tokens)
        assert sums.shape[0] == n_leaves
        acc.deposit(w, first_leaf, sums)
        return dy * w, None


def toy_scale(x, w):
    return ToyScale.apply(x, w)


class ToyScaleRows(ToyScale):
    """``ToyScale`` depositing through ``deposit_rows``: micro-batches of any size."""

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        acc = current_accumulator()
        if acc is None:
            return ToyScale.backward(ctx, dy)
        rows = (x.reshape(-1, w.numel()), dy.reshape(-1, w.numel()))
        acc.deposit_rows(w, rows, functools.partial(_toy_leaves, acc.leaf_tokens))
        return dy * w, None


def _toy_leaves(leaf_tokens, first_leaf, rows):
    x, dy = rows
    return TreePartial().add_leaves(first_leaf, leaf_sums_reference(dy.float() * x.float(), leaf_tokens))


def toy_scale_rows(x, w):
    return ToyScaleRows.apply(x, w)
