"""Shared by rms_norm, embedding and cross_entropy: fold fixed-size row chunks into leaf sums,
and hand a parameter gradient's leaves to the accumulator or finish the canonical tree.

Reduction order (det_core.reduce): a kernel first sums each chunk of ``rows_per_chunk`` consecutive
tokens sequentially in fp32 (``chunk_partials``, one row per chunk); ``fold_chunks`` then adds the
chunks of one leaf sequentially in chunk order; leaves are combined by ``TreePartial``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._vendor.det_core.reduce import TreePartial, num_leaves
from .grad_accum import DEFAULT_LEAF_TOKENS, current_accumulator

__all__ = ["finish_param_grad", "fold_chunks", "leaf_layout"]

_FOLD_BLOCK = 1024  # columns per program; does not change bits (the fold is elementwise)


@triton.jit
def _fold_chunks_kernel(
    partial_ptr,
    out_ptr,
    n_chunks,
    N,
    CHUNKS_PER_LEAF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    leaf = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, CHUNKS_PER_LEAF):
        chunk = leaf * CHUNKS_PER_LEAF + c
        acc += tl.load(
            partial_ptr + chunk.to(tl.int64) * N + cols,
            mask=mask & ((chunk + cols * 0) < n_chunks),
            other=0.0,
        )
    tl.store(out_ptr + leaf.to(tl.int64) * N + cols, acc, mask=mask)


def fold_chunks(partials: torch.Tensor, chunks_per_leaf: int) -> torch.Tensor:
    """Leaf sums ``(ceil(n_chunks / chunks_per_leaf), N)`` fp32 of chunk partials ``(n_chunks, N)`` fp32.

    Each leaf is ``0 + chunk_0 + chunk_1 + ...`` in chunk order (a short last leaf adds zeros).
    """
    partials = partials.contiguous()
    n_chunks, n = partials.shape
    n_leaves = num_leaves(n_chunks, chunks_per_leaf)
    out = torch.empty((n_leaves, n), dtype=torch.float32, device=partials.device)
    block = min(_FOLD_BLOCK, max(16, triton.next_power_of_2(n)))
    grid = (n_leaves, triton.cdiv(n, block))
    _fold_chunks_kernel[grid](partials, out, n_chunks, n, CHUNKS_PER_LEAF=chunks_per_leaf, BLOCK=block)
    return out


def leaf_layout(num_tokens: int, max_rows_per_chunk: int, op: str):
    """``(accumulator or None, leaf_tokens, first_leaf, rows_per_chunk)`` for an op's token axis.

    ``rows_per_chunk`` is the largest power of two <= ``max_rows_per_chunk`` dividing the leaf size:
    a function of the leaf size alone (it is part of the op's reduction order), never of M.
    """
    acc = current_accumulator()
    if acc is None:
        leaf, first = DEFAULT_LEAF_TOKENS, 0
    else:
        leaf = acc.leaf_tokens
        first, _ = acc.leaf_span(num_tokens)
    rows = max_rows_per_chunk
    while leaf % rows:
        rows //= 2
    return acc, leaf, first, rows


def finish_param_grad(acc, param: torch.Tensor, first_leaf: int, leaf_sums: torch.Tensor):
    """Deposit ``leaf_sums`` (n_leaves, *param.shape) into ``acc``, or finish the tree over them.

    Returns None when deposited (the autograd gradient of ``param``), else the gradient in
    ``param.dtype``.
    """
    leaf_sums = leaf_sums.view(leaf_sums.shape[0], *param.shape)
    if acc is not None:
        acc.deposit(param, first_leaf, leaf_sums)
        return None
    return TreePartial().add_leaves(0, leaf_sums).result(leaf_sums.shape[0]).to(param.dtype)
