"""Embedding lookup with a deterministic, atomic-free weight gradient in the canonical order.

Forward: a gather (``weight[ids]``, an exact copy). Backward: the gradient of row ``v`` is the sum of
``dy[t]`` over the tokens ``t`` with ``ids[t] == v``, defined in the canonical order: within a leaf of
``leaf_tokens`` tokens (aligned to the global token index), a fp32 fold starting at +0.0 in token
order; leaves combined by the fixed pairwise tree of det_core.reduce.

Method (sparse, no (n_leaves, V, D) tensor):
1. stable sort of the ids (``torch.sort(stable=True)``): equal ids keep token order;
2. segments = runs of equal (id, leaf); a Triton kernel folds each segment's dy rows in token
   order (one program per segment and column block; no atomics);
3. the tree over leaves is walked level by level on the sparse (id, node) entries: siblings that
   are both present are added (left + right), a lone child is promoted (its sum with the absent
   sibling's +0.0 is itself, as no leaf sum is -0.0 after the +0.0 start), nodes whose parent
   reaches outside the call's leaves stay as maximal subtrees;
4. the result is scattered into a zero (V, D) table (one dense table per maximal subtree when an
   accumulator is active, usually 1 to log2(n_leaves) + 1 of them).
Workspace: the sorted ids and segment sums, ``M * D * 4`` bytes at most, plus the dense outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._leaf_sums import leaf_layout
from ._vendor.det_core.reduce import TreePartial, num_leaves
from ._vendor.det_core.runtime import check_kernel_device

__all__ = ["Embedding", "embedding"]

_BLOCK_D = 256  # columns per program; does not change bits (the fold is per column)


@triton.jit
def _segment_sum_kernel(
    dy_ptr,
    perm_ptr,
    seg_start_ptr,
    out_ptr,
    D,
    stride_dy,
    BLOCK_D: tl.constexpr,
):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(start, end):
        tok = tl.load(perm_ptr + i)
        acc += tl.load(dy_ptr + tok * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + seg.to(tl.int64) * D + cols, acc, mask=mask)


def _segment_sums(ids: torch.Tensor, dy: torch.Tensor, leaf: int):
    """(entry ids, entry leaf indices, fp32 sums (S, D)) for each run of equal (id, local leaf)."""
    sorted_ids, perm = torch.sort(ids, stable=True)
    leaf_of = torch.div(perm, leaf, rounding_mode="floor")
    new_seg = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_seg[1:] = (sorted_ids[1:] != sorted_ids[:-1]) | (leaf_of[1:] != leaf_of[:-1])
    starts = new_seg.nonzero().flatten()
    seg_start = torch.cat([starts, starts.new_tensor([ids.shape[0]])])
    n_seg, d = starts.shape[0], dy.shape[1]
    sums = torch.empty((n_seg, d), dtype=torch.float32, device=dy.device)
    _segment_sum_kernel[(n_seg, triton.cdiv(d, _BLOCK_D))](
        dy, perm, seg_start, sums, d, dy.stride(0), BLOCK_D=_BLOCK_D
    )
    return sorted_ids[starts], leaf_of[starts], sums


def _sparse_tree(ids, nodes, values, lo: int, hi: int):
    """Walk the canonical tree over leaves on sparse (id, node) entries sorted by (id, node).

    Leaves ``[lo, hi)`` are this call's (global indices). Returns ``{(level, index): (ids, values)}``
    for the maximal aligned subtrees inside ``[lo, hi)``.
    """
    out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    level = 0
    while ids.numel():
        parent = torch.div(nodes, 2, rounding_mode="floor")
        span = 1 << (level + 1)
        inside = (parent * span >= lo) & ((parent + 1) * span <= hi)
        # entries whose parent reaches outside the call's leaves are finished maximal subtrees
        done = ~inside
        if bool(done.any()):
            for node in torch.unique(nodes[done]).tolist():
                sel = done & (nodes == node)
                out[(level, int(node))] = (ids[sel], values[sel])
            keep = inside
            ids, nodes, values, parent = ids[keep], nodes[keep], values[keep], parent[keep]
            if not ids.numel():
                break
        pair = torch.zeros_like(ids, dtype=torch.bool)  # entry i is a left child whose sibling i+1 exists
        pair[:-1] = (ids[1:] == ids[:-1]) & (parent[1:] == parent[:-1])
        is_right = torch.zeros_like(pair)
        is_right[1:] = pair[:-1]
        summed = values.clone()
        left = pair.nonzero().flatten()
        summed[left] = values[left] + values[left + 1]
        keep = ~is_right
        ids, nodes, values = ids[keep], parent[keep], summed[keep]
        level += 1
    return out


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return weight[ids]

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if not ctx.needs_input_grad[1]:
            return None, None
        v, d = weight.shape
        flat = ids.reshape(-1)
        m = flat.shape[0]
        if m == 0:
            return None, torch.zeros_like(weight)
        dy2 = dy.reshape(m, d)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        acc, leaf, first_leaf, _ = leaf_layout(m, 1, "embedding")
        n_leaves = num_leaves(m, leaf)
        seg_ids, seg_leaf, sums = _segment_sums(flat, dy2, leaf)
        if acc is None:
            hi = 1 << max(n_leaves - 1, 0).bit_length()  # the whole tree: lone children promote
            (((_level, _index), (rows, vals)),) = _sparse_tree(seg_ids, seg_leaf, sums, 0, hi).items()
            # rows no token touched are exact zeros: round only the touched rows to weight.dtype
            grad = torch.zeros((v, d), dtype=weight.dtype, device=dy.device)
            grad[rows] = vals.to(weight.dtype)
            return None, grad
        nodes = _sparse_tree(seg_ids, seg_leaf + first_leaf, sums, first_leaf, first_leaf + n_leaves)
        partial = TreePartial()
        for key, (rows, vals) in sorted(nodes.items()):
            dense = torch.zeros((v, d), dtype=torch.float32, device=dy.device)
            dense[rows] = vals
            partial.nodes[key] = dense
        acc.deposit_partial(weight, partial)
        return None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Look up rows of ``weight``: ``out[..., :] = weight[ids[...], :]``.

    Args:
        ids: integer tensor (int32 / int64) of any shape ``(...)`` with values in ``[0, V)``;
            flattened row-major it gives the local token index.
        weight: ``(V, D)`` float tensor on the same device (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    Returns:
        ``(..., D)`` in ``weight.dtype``.

    Gradient of ``weight`` (no atomics): row ``v`` sums ``dy`` over the tokens with id ``v`` in the
    canonical order (module docstring); with an active ``CanonicalGradAccumulator`` its maximal
    subtrees are deposited there (dense ``(V, D)`` fp32 each) and the autograd gradient is None.
    No gradient flows to ``ids``.

    **Determinism:** forward is an exact copy (row-invariant). The weight gradient is bitwise
    run to run and equals ``reference_norms.embedding_weight_grad_reference`` (the definition) bit
    for bit; with the accumulator it is invariant to leaf-aligned micro-batch and data-parallel
    splits. It uses fp32 additions only, so its bits are the same on every device (GPU, CPU
    interpreter). It depends on which tokens share a leaf (as every canonical-order sum does).

    Raises:
        TypeError: ids not integer or weight not floating point. ValueError: weight not 2-D, an id
        out of range (checked on the host: one device sync). RuntimeError: device problems.
    """
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding: ids must be int32 or int64, got {ids.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"embedding: weight must be floating point, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"embedding: weight must be (V, D), got shape {tuple(weight.shape)}")
    check_kernel_device(ids, weight, op="embedding")
    if ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"embedding: ids must lie in [0, {weight.shape[0]}), got min {lo}, max {hi}")
    return _EmbeddingFunction.apply(ids.to(torch.int64), weight)


class Embedding(torch.nn.Embedding):
    """Drop-in for ``torch.nn.Embedding`` (plain lookups) running ``det_train.embedding``.

    ``padding_idx`` (its row gets no gradient), ``max_norm`` and ``sparse=True`` are not supported
    and raise ``ValueError``. **Determinism:** as ``embedding``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.padding_idx is not None or self.max_norm is not None or self.sparse:
            raise ValueError(
                "det_train.Embedding supports plain lookups only: padding_idx, max_norm and sparse=True "
                "are not supported (mask padded tokens in the loss instead)"
            )
        if self.scale_grad_by_freq:
            raise ValueError("det_train.Embedding: scale_grad_by_freq is not supported")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight)
