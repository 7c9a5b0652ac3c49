"""Shared by rms_norm, embedding and cross_entropy: fold fixed-size row chunks into leaf sums,
and hand a parameter gradient's leaves to the accumulator or finish the canonical tree.

Reduction order (det_core.reduce): a kernel first sums each chunk of ``rows_per_chunk`` consecutive
tokens sequentially in fp32 (``chunk_partials``, one row per chunk); ``fold_chunks`` then adds the
chunks of one leaf sequentially in chunk order; leaves are combined by the canonical pairwise tree.
The tree runs on the GPU (``tree_in_place``, one Triton kernel, no host round-trip): every output
element walks the tree's levels in order, so its bits are those of ``TreePartial`` (fp32 adds of
the same operands in the same pairs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import BoundLaunch, PlanCache
from det_core.reduce import TreePartial, num_leaves
from det_core.sr import round_nearest_bf16

from .grad_accum import DEFAULT_LEAF_TOKENS, current_accumulator

__all__ = [
    "SUB_LEAF_TOKENS",
    "SubLeafFold",
    "cast_out",
    "chunk_subtrees",
    "coarsen",
    "dyadic_nodes",
    "finish_param_grad",
    "fold_chunks",
    "fold_chunks_resume",
    "fold_into_sub_leaves",
    "leaf_layout",
    "leaf_subtrees",
    "sub_leaves_node",
    "sub_leaf_tokens",
    "tree_in_place",
]

_TREE_BLOCK = 512  # columns per program of the tree kernel; does not change bits (elementwise)


def _fold_plan(n: int) -> tuple[int, int, int]:
    """``(BLOCK, UNROLL, num_warps)`` of the chunk folds over ``n`` columns. None of them changes bits
    (the fold is elementwise, each column's adds in chunk order): latency only. Narrow rows get small
    column blocks (many programs for a few hundred KB); ``UNROLL`` chunk rows are loaded before they
    are added in order, so that many loads are in flight. ``(1024, 1, 4)`` is the former plan. The
    interpreter runs programs and their loads one after another in Python: it gets the widest block
    (fewest programs) and no grouping (``tests/test_latency_settings.py`` runs the grouped plans)."""
    if runtime.interpreter_active():
        return min(1024, max(16, runtime.next_power_of_2(n))), 1, 4
    block = min(1024, max(64, runtime.next_power_of_2(runtime.cdiv(n, 128))))
    return block, 16 if block <= 256 else 8, max(1, min(4, block // 128))


@triton.jit
def _fold_rows(acc, partial_ptr, first, n_chunks, N, cols, mask, COUNT: tl.constexpr):
    """``acc + row_first + ... + row_(first + COUNT - 1)`` in that order (rows outside
    ``[0, n_chunks)`` read as +0.0): all ``COUNT`` loads are issued before the first add."""
    rows = ()
    for u in tl.static_range(COUNT):
        chunk = first + u
        inside = (chunk + cols * 0 >= 0) & ((chunk + cols * 0) < n_chunks)
        rows = rows + (tl.load(partial_ptr + chunk.to(tl.int64) * N + cols, mask=mask & inside, other=0.0),)
    for u in tl.static_range(COUNT):
        acc += rows[u]
    return acc


@triton.jit
def _fold_chunks_kernel(
    partial_ptr,
    out_ptr,
    n_chunks,
    N,
    CHUNKS_PER_LEAF: tl.constexpr,
    BLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    leaf = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    first = leaf * CHUNKS_PER_LEAF
    for g in range(0, CHUNKS_PER_LEAF // UNROLL):  # whole groups, then the rest: no padding adds
        acc = _fold_rows(acc, partial_ptr, first + g * UNROLL, n_chunks, N, cols, mask, UNROLL)
    tail = first + CHUNKS_PER_LEAF // UNROLL * UNROLL
    acc = _fold_rows(acc, partial_ptr, tail, n_chunks, N, cols, mask, CHUNKS_PER_LEAF % UNROLL)
    tl.store(out_ptr + leaf.to(tl.int64) * N + cols, acc, mask=mask)


@triton.jit
def _fold_chunks_resume_kernel(
    partial_ptr,
    init_ptr,
    out_ptr,
    n_chunks,
    N,
    skip,
    CHUNKS_PER_LEAF: tl.constexpr,
    RESUME: tl.constexpr,
    BLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """``_fold_chunks_kernel`` for chunks that start ``skip`` chunks into their first leaf: that
    leaf's fold continues from ``init`` (its earlier chunks' fold, ``RESUME``) and adds +0.0 for the
    chunks before ``skip`` (exact: a fold from +0.0 is never -0.0), so the bits of one fold."""
    leaf = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    if RESUME:
        acc = tl.load(init_ptr + cols, mask=mask & ((leaf + cols * 0) == 0), other=0.0)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
    first = leaf * CHUNKS_PER_LEAF - skip
    for g in range(0, CHUNKS_PER_LEAF // UNROLL):
        acc = _fold_rows(acc, partial_ptr, first + g * UNROLL, n_chunks, N, cols, mask, UNROLL)
    tail = first + CHUNKS_PER_LEAF // UNROLL * UNROLL
    acc = _fold_rows(acc, partial_ptr, tail, n_chunks, N, cols, mask, CHUNKS_PER_LEAF % UNROLL)
    tl.store(out_ptr + leaf.to(tl.int64) * N + cols, acc, mask=mask)


@triton.jit
def cast_out(x, out_ptr):
    # fp32 -> output dtype, nearest-even on every device (the interpreter's bf16 cast truncates)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        return round_nearest_bf16(x)
    else:
        return x.to(out_ptr.dtype.element_ty)


@triton.jit
def tree_combine(
    rows_ptr, row_stride, cols, mask, leaf_ptr, k, lo, hi, LEVELS: tl.constexpr, DENSE: tl.constexpr
):
    """Combine ``k`` fp32 rows (entries) holding sums of global leaves ``g_0 < g_1 < ...`` in place.

    Entry ``i`` is leaf ``lo + i`` (``DENSE``) or ``leaf_ptr[i]``. Level by level, the node ``u`` of
    a level is held in the row of its first entry; a right child is added to its left sibling
    (``left + right``) when both exist and their parent lies inside ``[lo, hi)``; a lone child keeps
    its value (the canonical promotion). Afterwards the first entry of every maximal aligned subtree
    inside ``[lo, hi)`` holds that subtree's sum (``TreePartial``'s nodes, same bits).
    """
    for level in range(0, LEVELS):
        prev_u = tl.full((), -1, tl.int64)
        left = tl.full((), -1, tl.int64)
        left_u = tl.full((), -2, tl.int64)
        for i32 in range(0, k):
            i = tl.full((), 0, tl.int64) + i32
            if DENSE:
                g = i + lo
            else:
                g = tl.load(leaf_ptr + i).to(tl.int64)
            u = g >> level
            is_slot = u != prev_u
            parent = u >> 1
            inside = ((parent << (level + 1)) >= lo) & (((parent + 1) << (level + 1)) <= hi)
            if is_slot & ((u & 1) == 1) & (left_u == u - 1) & inside:
                a = tl.load(rows_ptr + left * row_stride + cols, mask=mask, other=0.0)
                b = tl.load(rows_ptr + i * row_stride + cols, mask=mask, other=0.0)
                tl.store(rows_ptr + left * row_stride + cols, a + b, mask=mask)
            new_left = is_slot & ((u & 1) == 0)
            left = tl.where(new_left, i, left)
            left_u = tl.where(new_left, u, left_u)
            prev_u = u


@triton.jit
def _dense_tree_kernel(
    rows_ptr,
    out_ptr,
    n_leaves,
    N,
    lo,
    hi,
    LEVELS: tl.constexpr,
    WRITE_ROOT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    tree_combine(rows_ptr, N, cols, mask, rows_ptr, n_leaves, lo, hi, LEVELS, True)
    if WRITE_ROOT:
        root = tl.load(rows_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + cols, cast_out(root, out_ptr), mask=mask)


def dyadic_nodes(lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal aligned subtrees ``(level, index)`` covering leaves ``[lo, hi)``, left to right."""
    nodes = []
    while lo < hi:
        level = 0
        while lo % (2 << level) == 0 and lo + (2 << level) <= hi:
            level += 1
        nodes.append((level, lo >> level))
        lo += 1 << level
    return nodes


def _levels(lo: int, hi: int) -> int:
    return max((level for level, _ in dyadic_nodes(lo, hi)), default=0)


def tree_in_place(leaf_sums: torch.Tensor, lo: int = 0, out_dtype: torch.dtype | None = None):
    """Canonical tree over contiguous fp32 leaf sums ``(n, N)`` (global leaves ``lo .. lo + n - 1``).

    Overwrites ``leaf_sums``. With ``out_dtype`` (``lo`` must be 0): returns the root ``(N,)`` in
    ``out_dtype`` (``TreePartial().add_leaves(0, leaves).result(n)``, same bits). Without: returns
    ``{(level, index): (N,) fp32 view}``, the maximal aligned subtrees inside ``[lo, lo + n)``.
    """
    n, width = leaf_sums.shape
    hi = lo + n
    if out_dtype is not None:
        if lo != 0:
            raise ValueError("tree_in_place: the root is defined for leaves starting at 0")
        levels = max(n - 1, 0).bit_length()
        hi = 1 << levels  # the whole tree: absent right children promote their sibling
    else:
        levels = _levels(lo, hi)
    # without the root the kernel never touches out_ptr: any fp32 pointer will do
    out = leaf_sums if out_dtype is None else torch.empty((width,), dtype=out_dtype, device=leaf_sums.device)
    if n and width:
        key = ("tree", n, width, lo, hi, levels, out_dtype is not None)
        bound = _BOUND.get(key)
        if bound is None:
            block = min(_TREE_BLOCK, max(16, runtime.next_power_of_2(width)))
            grid = (runtime.cdiv(width, block),)
            meta = dict(LEVELS=levels, WRITE_ROOT=out_dtype is not None, BLOCK=block)
            bound = _bind(key, grid, _dense_tree_kernel, 2, (n, width, lo, hi), **meta)
        bound[1](bound[0], leaf_sums, out)
    if out_dtype is not None:
        return out
    return {(level, index): leaf_sums[(index << level) - lo] for level, index in dyadic_nodes(lo, lo + n)}


def fold_chunks(partials: torch.Tensor, chunks_per_leaf: int) -> torch.Tensor:
    """Leaf sums ``(ceil(n_chunks / chunks_per_leaf), N)`` fp32 of chunk partials ``(n_chunks, N)`` fp32.

    Each leaf is ``0 + chunk_0 + chunk_1 + ...`` in chunk order (a short last leaf adds zeros).
    """
    partials = partials.contiguous()
    n_chunks, n = partials.shape
    n_leaves = num_leaves(n_chunks, chunks_per_leaf)
    out = torch.empty((n_leaves, n), dtype=torch.float32, device=partials.device)
    key = ("fold", n_chunks, n, chunks_per_leaf)
    bound = _BOUND.get(key)
    if bound is None:
        block, unroll, warps = _fold_plan(n)
        grid = (n_leaves, runtime.cdiv(n, block))
        meta = dict(CHUNKS_PER_LEAF=chunks_per_leaf, BLOCK=block, UNROLL=unroll, num_warps=warps)
        bound = _bind(key, grid, _fold_chunks_kernel, 2, (n_chunks, n), **meta)
    bound[1](bound[0], partials, out)
    return out


def fold_chunks_resume(
    partials: torch.Tensor, chunks_per_leaf: int, skip: int, init: torch.Tensor | None
) -> torch.Tensor:
    """``fold_chunks`` of chunks whose first one is chunk ``skip`` of its leaf: ``(n_out, N)`` fp32
    leaf sums, ``n_out = ceil((skip + n_chunks) / chunks_per_leaf)``; leaf 0's fold continues from
    ``init`` (fp32 ``(N,)``, the fold of its first ``skip`` chunks; None only when ``skip`` is 0).
    Resumed at any chunk, the folds have the bits of ``fold_chunks`` over all the leaf's chunks."""
    if skip and init is None:
        raise ValueError("fold_chunks_resume: a fold resumed inside a leaf needs its accumulator")
    partials = partials.contiguous()
    n_chunks, n = partials.shape
    n_out = num_leaves(skip + n_chunks, chunks_per_leaf)
    out = torch.empty((n_out, n), dtype=torch.float32, device=partials.device)
    resume = init is not None
    key = ("fold_resume", n_chunks, n, chunks_per_leaf, skip, resume)
    bound = _BOUND.get(key)
    if bound is None:
        block, unroll, warps = _fold_plan(n)
        grid = (n_out, runtime.cdiv(n, block))
        meta = dict(
            CHUNKS_PER_LEAF=chunks_per_leaf, RESUME=resume, BLOCK=block, UNROLL=unroll, num_warps=warps
        )
        bound = _bind(key, grid, _fold_chunks_resume_kernel, 3, (n_chunks, n, skip), **meta)
    bound[1](bound[0], partials, init if resume else partials, out)
    return out


@triton.jit
def _fold_into_sub_leaves_kernel(
    partial_ptr, fold_ptr, pos_ptr, n_chunks, N, ROWS: tl.constexpr, CHUNKS_PER_SUB: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Add chunk sums ``partial (n_chunks, N)`` to the sub-leaf folds ``fold (ratio, N)`` in chunk
    order: chunk ``c`` is chunk ``pos // ROWS + c`` of the leaf (``pos``: the call's first token in
    its leaf, read from device memory, so one captured launch serves every micro-batch)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    first = tl.load(pos_ptr) // ROWS
    for s in range(first // CHUNKS_PER_SUB, (first + n_chunks - 1) // CHUNKS_PER_SUB + 1):
        acc = tl.load(fold_ptr + s * N + cols, mask=mask, other=0.0)
        lo = tl.maximum(s * CHUNKS_PER_SUB - first, 0)
        hi = tl.minimum((s + 1) * CHUNKS_PER_SUB - first, n_chunks)
        for c in range(lo, hi):
            acc += tl.load(partial_ptr + c * N + cols, mask=mask, other=0.0)
        tl.store(fold_ptr + s * N + cols, acc, mask=mask)


def fold_into_sub_leaves(
    partials: torch.Tensor, folds: torch.Tensor, pos: torch.Tensor, rows_per_chunk: int, chunks_per_sub: int
) -> None:
    """Continue a leaf's sub-leaf folds in place (a fixed fold, ``CanonicalGradAccumulator.fixed_folds``).

    Args:
        partials: fp32 ``(n_chunks, N)`` chunk sums of ``rows_per_chunk`` tokens each, the call's
            chunks in token order (the first aligned to a chunk of the leaf).
        folds: fp32 ``(leaf_tokens / sub, N)`` contiguous: sub-leaf ``s``'s fold so far (zeros at
            the leaf's start); written in place.
        pos: int64 0-d tensor on the device: the call's first token within its leaf.
        rows_per_chunk, chunks_per_sub: the op's chunk and sub-leaf sizes (``_layout``).

    Raises nothing (the callers' layout). **Determinism:** each sub-leaf's fold adds the chunk sums
    in chunk order to the stored value, from +0.0 at the leaf's start: the adds of
    ``fold_chunks_resume``, so the bits of ``SubLeafFold`` for any split at chunk boundaries.
    """
    partials = partials.contiguous()
    n_chunks, n = partials.shape
    if not n_chunks or not n:
        return
    key = ("fold_into", n_chunks, n, rows_per_chunk, chunks_per_sub)
    bound = _BOUND.get(key)
    if bound is None:
        block = min(1024, max(16, runtime.next_power_of_2(n)))
        grid = (runtime.cdiv(n, block),)
        meta = dict(ROWS=rows_per_chunk, CHUNKS_PER_SUB=chunks_per_sub, BLOCK=block)
        bound = _bind(key, grid, _fold_into_sub_leaves_kernel, 3, (n_chunks, n), **meta)
    bound[1](bound[0], partials, folds, pos)


def sub_leaves_node(folds: torch.Tensor, tokens: int, sub: int, shape: torch.Size) -> torch.Tensor:
    """A leaf's fp32 node from its fixed sub-leaf folds ``folds (ratio, N)`` over its first ``tokens``
    tokens: the canonical tree over the ``ceil(tokens / sub)`` sub-leaves present, as
    ``SubLeafFold.close`` (same bits); a new tensor (the folds hold the next leaf)."""
    k = num_leaves(tokens, sub)
    node = folds[0].clone() if k == 1 else tree_in_place(folds[:k].clone(), 0, torch.float32)
    return node if node.shape == shape else node.view(shape)


class SubLeafFold:
    """An open leaf of a vector reduction carried as its fp32 sub-leaf folds, not as its rows.

    ``tokens``: the leaf's tokens folded so far (a multiple of the op's chunk step); ``done``: the
    finished sub-leaves' fp32 sums in leaf order, as the row blocks ``(k, N)`` the calls produced
    (views, never written); ``open``: the fp32 chunk fold ``(N,)`` of the sub-leaf ``tokens`` ends
    inside, or None. Immutable (``advance`` makes a new one), so a micro-batch that raises leaves the
    old state. The tree over the sub-leaves runs once, when the leaf closes (one ``cat`` and one
    tree launch, not one add per sub-leaf per micro-batch). Memory: the leaf's sub-leaf sums, at
    most ``leaf_tokens / sub`` rows of the parameter's size, whatever the leaf's rows.
    """

    __slots__ = ("tokens", "done", "open")

    def __init__(self, tokens: int = 0, done: tuple = (), open: torch.Tensor | None = None) -> None:
        self.tokens, self.done, self.open = tokens, done, open

    def advance(self, chunk_sums: torch.Tensor, tokens: int, sub: int, rows_per_chunk: int) -> SubLeafFold:
        """The state after ``tokens`` more tokens whose chunk sums (fp32 ``(ceil(tokens /
        rows_per_chunk), N)``, chunks aligned to the leaf's start) are ``chunk_sums``."""
        skip = self.tokens % sub // rows_per_chunk
        sums = fold_chunks_resume(chunk_sums, sub // rows_per_chunk, skip, self.open if skip else None)
        end = self.tokens + tokens
        n_done = end // sub - self.tokens // sub  # sub-leaves this call completes
        n_out = sums.shape[0]
        done = self.done
        if n_done:
            done = (*done, sums if n_done == n_out else sums[:n_done])
        return SubLeafFold(end, done, sums[n_done] if n_done < n_out else None)

    def close(self, sub: int, ratio: int, shape: torch.Size) -> torch.Tensor:
        """The leaf's fp32 node (of ``shape``): the canonical tree over its ``ratio`` sub-leaves of
        ``sub`` tokens (a short last leaf's present ones, the open one included; absent ones
        promote their sibling), as ``coarsen`` of ``TreePartial`` makes it from the sub-leaf sums
        of one call: the bits of an unsplit batch (``tree_in_place`` walks the same pairs)."""
        blocks = self.done if self.open is None else (*self.done, self.open.unsqueeze(0))
        if len(blocks) == 1 and blocks[0].shape[0] == 1:
            node = blocks[0][0]  # one sub-leaf: its sum is the node
        else:  # the tree runs in place: on a copy (a reduce that raises may close the leaf again)
            node = tree_in_place(torch.cat(blocks), 0, torch.float32)
        return node if node.shape == shape else node.view(shape)


# (grid, launch with sizes and constexprs bound) by what they are computed from: a call keys only
# its tensors (BoundLaunch; host time per launch)
_BOUND = PlanCache()


def _bind(key: tuple, grid: tuple, kernel, n_tensors: int, scalars: tuple, **meta):
    return _BOUND.put(key, (grid, BoundLaunch(kernel, n_tensors, scalars, **meta)))


# The vector reductions (RMSNorm weight, bias, embedding table, loss sum) sum each leaf as the canonical
# pairwise tree over aligned sub-leaves of at most this many tokens (each sub-leaf a sequential fold):
# a long leaf (8192 tokens) then still spreads over many programs, and the bits are those of the tree
# over sub-leaves, whatever the leaf size above them (a power-of-two multiple).
SUB_LEAF_TOKENS = 1024


def sub_leaf_tokens(leaf_tokens: int) -> int:
    """``leaf_tokens`` halved while above ``SUB_LEAF_TOKENS`` and even: the sub-leaf of the vector
    reductions (a power-of-two part of the leaf: 8192 -> 1024, 3072 -> 768, 1000 -> 1000)."""
    sub = leaf_tokens
    while sub > SUB_LEAF_TOKENS and sub % 2 == 0:
        sub //= 2
    return sub


def leaf_layout(max_rows_per_chunk: int):
    """``(accumulator or None, leaf_tokens, sub_leaf_tokens, rows_per_chunk)`` for an op's token axis.

    ``rows_per_chunk`` is the largest power of two <= ``max_rows_per_chunk`` dividing the sub-leaf:
    a function of the leaf size alone (it is part of the op's reduction order), never of M.
    """
    acc = current_accumulator()
    leaf = DEFAULT_LEAF_TOKENS if acc is None else acc.leaf_tokens
    sub = sub_leaf_tokens(leaf)
    rows = max_rows_per_chunk
    while sub % rows:
        rows //= 2
    return acc, leaf, sub, rows


def coarsen(partial: TreePartial, ratio: int) -> TreePartial:
    """A partial tree over sub-leaves (``ratio`` per leaf, a power of two) as one over leaves.

    Nodes of whole leaves keep their value (level lowered by log2(ratio)); the nodes of a short last
    leaf (present only at the end of the batch) are combined right to left, ``a + (b + c)``: the
    canonical tree over that leaf's sub-leaves, absent ones promoted.
    """
    if ratio == 1:
        return partial
    shift = ratio.bit_length() - 1
    out, short = TreePartial(), {}
    for (level, index), value in sorted(partial.nodes.items(), key=lambda kv: kv[0][1] << kv[0][0]):
        if level >= shift:
            out.nodes[(level - shift, index)] = value
        else:
            short.setdefault((index << level) >> shift, []).append(value)
    for leaf, values in short.items():
        node = values[-1]
        for value in reversed(values[:-1]):
            node = value + node
        out.nodes[(0, leaf)] = node
    return out


def leaf_subtrees(sub_sums: torch.Tensor, first_leaf: int, shape: torch.Size, ratio: int = 1) -> TreePartial:
    """The maximal aligned subtrees over global leaves ``first_leaf ...`` of fp32 sub-leaf sums
    ``sub_sums`` (n_sub, ...; ``ratio`` sub-leaves per leaf, whole leaves except a short last one),
    as a ``TreePartial`` of nodes of ``shape``. Overwrites ``sub_sums`` (the tree runs in place)."""
    flat = sub_sums if sub_sums.dim() == 2 else sub_sums.reshape(sub_sums.shape[0], -1)
    partial = TreePartial()
    partial.nodes = {
        key: value if value.shape == shape else value.view(shape)
        for key, value in tree_in_place(flat, first_leaf * ratio).items()
    }
    return coarsen(partial, ratio)


def chunk_subtrees(
    chunk_sums: torch.Tensor, chunks_per_sub: int, ratio: int, shape: torch.Size, first_leaf: int
) -> TreePartial:
    """The maximal aligned subtrees over global leaves ``first_leaf ...`` of fp32 chunk sums
    ``chunk_sums`` (n_chunks, ...; ``chunks_per_sub`` chunks per sub-leaf, ``ratio`` sub-leaves per
    leaf), as a ``TreePartial`` of nodes of ``shape``: a norm weight's leaf sums (``fold_chunks``,
    then ``leaf_subtrees``), what its deposit of whole leaves hands the accumulator. Raises nothing.

    **Determinism:** chunks folded in order inside a sub-leaf, then the fixed tree by global leaf
    index: the bits of the same leaves summed by one batch."""
    return leaf_subtrees(fold_chunks(chunk_sums, chunks_per_sub), first_leaf, shape, ratio)


def finish_param_grad(param: torch.Tensor, sub_sums: torch.Tensor) -> torch.Tensor:
    """The gradient of ``param`` in ``param.dtype``: the canonical tree over the fp32 sub-leaf sums
    ``sub_sums`` (n_sub, *param.shape), which is the tree over the leaves of the trees inside them.
    ``sub_sums`` is overwritten (the tree runs in place on the GPU)."""
    flat = sub_sums if sub_sums.dim() == 2 else sub_sums.reshape(sub_sums.shape[0], -1)
    return tree_in_place(flat, 0, param.dtype).view(param.shape)
