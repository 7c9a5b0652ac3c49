"""Embedding lookup with a deterministic, atomic-free weight gradient in the canonical order.

Forward: a gather (``weight[ids]``, an exact copy). Backward: the gradient of row ``v`` is the sum of
``dy[t]`` over the tokens ``t`` with ``ids[t] == v``, defined in the canonical order: within a
sub-leaf (``_leaf_sums.sub_leaf_tokens`` of the leaf: 1024 tokens of an 8192-token leaf, aligned to
the global token index), a fp32 fold starting at +0.0 in token order; sub-leaves combined by the
fixed pairwise tree of det_core.reduce (inside a leaf, then across leaves: one tree).

Method (sparse, no (n_leaves, V, D) tensor, no host sync in the backward):
1. stable sort of the ids (``torch.sort(stable=True)``): equal ids keep token order; segments =
   runs of equal (id, leaf), located on the device (``cumsum`` + ``searchsorted``);
2. ``_segment_fold_kernel``: one program per segment and column block folds the segment's dy rows
   in token order from +0.0 (no atomics); programs past the last segment return at once;
3. ``_id_tree_kernel``: one program per id and column block walks the canonical tree over the id's
   segments (at most one per leaf) level by level in place (``_leaf_sums.tree_combine``): siblings
   that are both present are added (left + right), a lone child is promoted (its sum with the absent
   sibling's +0.0 is itself, as no leaf sum is -0.0 after the +0.0 start), nodes whose parent
   reaches outside the call's leaves stay as maximal subtrees;
4. the same program writes the id's row of a zero (V, D) table (one dense table per maximal subtree
   when an accumulator is active, usually 1 to log2(n_leaves) + 1 of them).
Workspace: the sorted ids and segment sums, ``M * D * 4`` bytes, plus the dense outputs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import launch
from det_core.reduce import TreePartial, num_leaves
from det_core.runtime import as_index, check_kernel_device

from ..accum import deposit
from ..accum._leaf_sums import cast_out, coarsen, dyadic_nodes, sub_leaf_tokens, tree_combine
from ._library import Op

__all__ = ["Embedding", "embedding"]

_BLOCK_D = 256  # columns per program; does not change bits (the fold and the tree are per column)


@triton.jit
def _segment_fold_kernel(dy_ptr, perm_ptr, seg_first_ptr, sums_ptr, M, D, stride_dy, BLOCK_D: tl.constexpr):
    # program s folds segment s (a run of equal (id, leaf) in the stable sort) in token order from +0.0;
    # programs past the last segment (seg_first == M) do nothing, so the grid needs no host count
    seg = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    start = tl.load(seg_first_ptr + seg)
    end = tl.load(seg_first_ptr + seg + 1)
    if start < end:
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for i32 in range(start, end, 4):
            # four independent row loads in flight, added strictly in token order
            i = tl.full((), 0, tl.int64) + i32
            last = end - 1  # clamped addresses: rows past the segment are loaded but not added
            t0 = tl.load(perm_ptr + i)
            t1 = tl.load(perm_ptr + tl.minimum(i + 1, last))
            t2 = tl.load(perm_ptr + tl.minimum(i + 2, last))
            t3 = tl.load(perm_ptr + tl.minimum(i + 3, last))
            r0 = tl.load(dy_ptr + t0 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            r1 = tl.load(dy_ptr + t1 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            r2 = tl.load(dy_ptr + t2 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            r3 = tl.load(dy_ptr + t3 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            v1, v2, v3 = i + 1 < end, i + 2 < end, i + 3 < end
            acc = acc + r0
            acc = tl.where(v1, acc + r1, acc)
            acc = tl.where(v2, acc + r2, acc)
            acc = tl.where(v3, acc + r3, acc)
        tl.store(sums_ptr + seg * D + cols, acc, mask=mask)


@triton.jit
def _id_tree_kernel(
    sums_ptr,
    seg_first_ptr,
    seg_leaf_ptr,
    sorted_ids_ptr,
    node_of_leaf_ptr,
    out_ptr,
    M,
    V,
    D,
    max_segments,
    lo,
    hi,
    first_leaf,
    LEVELS: tl.constexpr,
    NODE_TABLES: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # program s: if segment s is its id's first, combine the id's segments (one per leaf, leaves
    # increasing) by the canonical tree in place, then write the maximal subtrees to the output rows
    seg = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    start = tl.load(seg_first_ptr + seg)
    if start < M:
        row_id = tl.load(sorted_ids_ptr + start)
        prev_start = tl.load(seg_first_ptr + tl.maximum(seg - 1, 0))
        prev_id = tl.load(sorted_ids_ptr + prev_start)
        if (seg == 0) | (prev_id != row_id):
            k = tl.full((), 1, tl.int64)
            going = k == 1
            for j in range(1, max_segments):
                nxt = tl.load(seg_first_ptr + tl.minimum(seg + j, M))
                same = going & (nxt < M)
                same = same & (tl.load(sorted_ids_ptr + tl.minimum(nxt, M - 1)) == row_id)
                k += same.to(tl.int64)
                going = same
            rows = sums_ptr + seg * D
            tree_combine(rows, D, cols, mask, seg_leaf_ptr + seg, k, lo, hi, LEVELS, False)
            if NODE_TABLES:
                prev_q = tl.full((), -1, tl.int64)
                for i in range(0, k):
                    q = tl.load(node_of_leaf_ptr + tl.load(seg_leaf_ptr + seg + i) - first_leaf).to(tl.int64)
                    if q != prev_q:
                        value = tl.load(rows + i * D + cols, mask=mask, other=0.0)
                        tl.store(out_ptr + (q * V + row_id) * D + cols, value, mask=mask)
                    prev_q = q
            else:
                root = tl.load(rows + cols, mask=mask, other=0.0)
                tl.store(out_ptr + row_id * D + cols, cast_out(root, out_ptr), mask=mask)


def _segments(ids: torch.Tensor, leaf: int, first_leaf: int):
    """Stable sort of the ids and its (id, leaf) runs, all on the device (no host sync).

    Returns ``(sorted_ids, perm, seg_first (M + 1,), seg_leaf (M + 1,))``: segment ``s`` covers sorted
    positions ``[seg_first[s], seg_first[s + 1])`` (``M`` past the last segment) of global leaf
    ``seg_leaf[s]``.
    """
    m = ids.shape[0]
    sorted_ids, perm = torch.sort(ids, stable=True)
    leaf_of = torch.div(perm, leaf, rounding_mode="floor")
    new_seg = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_seg[1:] = (sorted_ids[1:] != sorted_ids[:-1]) | (leaf_of[1:] != leaf_of[:-1])
    seg_rank = torch.cumsum(new_seg, 0) - 1
    seg_first = torch.searchsorted(seg_rank, torch.arange(m + 1, device=ids.device))
    seg_leaf = leaf_of[seg_first.clamp(max=m - 1)] + first_leaf
    return sorted_ids, perm, seg_first, seg_leaf


def _node_of_leaf(nodes: list[tuple[int, int]], lo: int, device: torch.device) -> torch.Tensor:
    """int32 ``(n_leaves,)``: the position in ``nodes`` of the subtree holding leaf ``lo + i``.

    Filled on the device, one fill per subtree (few: at most ``2 log2(n_leaves)``), never copied
    from host memory: a host-to-device copy cannot be captured in a CUDA graph.
    """
    n = sum(1 << level for level, _ in nodes)
    if len(nodes) == 1:
        return torch.zeros((n,), dtype=torch.int32, device=device)
    out = torch.empty((n,), dtype=torch.int32, device=device)
    for q, (level, index) in enumerate(nodes):
        start = (index << level) - lo
        out[start : start + (1 << level)].fill_(q)
    return out


def _weight_grad(ids, dy, v: int, leaf: int, first_leaf: int, out_dtype, node_tables: bool):
    """Canonical-order weight gradient: ``(V, D)`` in ``out_dtype`` (the whole tree over the call's
    leaves, numbered from 0), or with ``node_tables`` a ``TreePartial`` of dense fp32 tables, one per
    maximal aligned subtree of global leaves ``[first_leaf, first_leaf + n_leaves)``."""
    m, d = dy.shape
    n_leaves = num_leaves(m, leaf)
    sorted_ids, perm, seg_first, seg_leaf = _segments(ids, leaf, first_leaf)
    sums = torch.empty((m, d), dtype=torch.float32, device=dy.device)
    grid = (m, runtime.cdiv(d, _BLOCK_D))
    launch(_segment_fold_kernel, grid, dy, perm, seg_first, sums, m, d, dy.stride(0), BLOCK_D=_BLOCK_D)
    if node_tables:
        lo, hi = first_leaf, first_leaf + n_leaves
        nodes = dyadic_nodes(lo, hi)
        levels = max(level for level, _ in nodes)
        node_of_leaf = _node_of_leaf(nodes, lo, dy.device)
        out = torch.zeros((len(nodes), v, d), dtype=torch.float32, device=dy.device)
    else:
        lo, levels = 0, max(n_leaves - 1, 0).bit_length()
        hi = 1 << levels  # the whole tree: lone children promote
        node_of_leaf = seg_first  # unused
        out = torch.zeros((v, d), dtype=out_dtype, device=dy.device)  # untouched rows: exact zeros
    launch(
        _id_tree_kernel,
        grid,
        sums,
        seg_first,
        seg_leaf,
        sorted_ids,
        node_of_leaf,
        out,
        m,
        v,
        d,
        n_leaves,
        lo,
        hi,
        first_leaf,
        LEVELS=levels,
        NODE_TABLES=node_tables,
        BLOCK_D=_BLOCK_D,
    )
    if not node_tables:
        return out
    partial = TreePartial()
    partial.nodes = {key: out[q] for q, key in enumerate(nodes)}
    return partial


def _grad_rows(ids: torch.Tensor, dy: torch.Tensor, d: int, padding_idx: int | None):
    """The backward's rows: token ids ``(M,)`` and ``dy (M, D)`` (unit last stride), the padded
    tokens' rows replaced by exact zeros (their row's gradient is +0.0)."""
    flat = ids.reshape(-1)
    dy2 = dy.reshape(flat.shape[0], d)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    if padding_idx is not None:
        dy2 = torch.where((flat == padding_idx).unsqueeze(1), 0.0, dy2)
    return flat, dy2


# ----------------------------------------------------------------------------- torch.library ops
@Op("embedding")
def embedding_op(
    ids: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None,
    ticket: torch.Tensor | None,
    leaf_tokens: int,
    deposit: bool,
    fold_ids: torch.Tensor | None = None,
    fold_rows: torch.Tensor | None = None,
    fold_pos: torch.Tensor | None = None,
    fold_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``det_train::embedding`` op: ``weight[ids]`` after the id range check (``embedding``'s
    ValueError; one host sync, skipped during CUDA graph capture), ``ids`` int64. ``ticket`` /
    ``leaf_tokens`` / ``deposit``: what the forward decided for the weight gradient; ``fold_ids`` /
    ``fold_rows`` / ``fold_pos`` / ``fold_count``: the table's fixed fold
    (``CanonicalGradAccumulator.fixed_folds``: its open leaf's rows, the micro-batch's first token in
    the leaf and the fold's counter), which the backward fills instead of depositing, or None."""
    # no device value can be read during CUDA graph capture: the range check is skipped there
    capturing = ids.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if ids.numel() and not capturing:
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"embedding: ids must lie in [0, {weight.shape[0]}), got min {lo}, max {hi}")
    return weight[ids]


@embedding_op.register_fake
def _(ids, weight, padding_idx, ticket, leaf_tokens, deposit, *fold):
    return weight.new_empty((*ids.shape, weight.shape[1]))


def _embedding_setup(ctx, inputs, output):
    ids, weight, padding_idx, ticket, leaf_tokens, deposit, *fold = inputs  # the fold's may be left out
    ctx.save_for_backward(ids, weight)  # a saved leaf unpacks as the Parameter itself
    ctx.padding_idx, ctx.leaf_tokens, ctx.deposit = padding_idx, leaf_tokens, deposit
    ctx.ticket = ticket  # mutated by the deposit op: not saved (saving checks its version)
    ctx.fold = tuple(fold) if len(fold) == 4 and fold[0] is not None else None  # mutated: not saved
    ctx.n_inputs = len(inputs)


def _embedding_backward(ctx, dy):
    runtime.check_first_order("det_train.embedding")
    ids, weight = ctx.saved_tensors
    none = (None,) * ctx.n_inputs
    if not ctx.needs_input_grad[1]:
        return none
    if ctx.fold is not None:
        if deposit.fold_wanted("det_train.embedding", weight, dy):
            embedding_fold_rows_op(ids, dy, ctx.padding_idx, *ctx.fold)
        return none
    if ctx.deposit:
        embedding_deposit_op(ids, dy, weight, ctx.padding_idx, ctx.ticket)
        return none
    grad = embedding_backward_op(ids, dy, weight.shape[0], ctx.padding_idx, ctx.leaf_tokens, weight.dtype)
    return None, grad, *none[2:]


embedding_op.register_autograd(_embedding_backward, setup_context=_embedding_setup)


@Op("embedding_backward")
def embedding_backward_op(
    ids: torch.Tensor,
    dy: torch.Tensor,
    num_embeddings: int,
    padding_idx: int | None,
    leaf_tokens: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``det_train::embedding_backward`` op: the weight gradient ``(V, D)`` in ``dtype``, the
    canonical tree over this call's sub-leaves (of leaves of ``leaf_tokens``); zeros for no tokens."""
    d = dy.shape[-1]
    if ids.numel() == 0:
        return torch.zeros((num_embeddings, d), dtype=dtype, device=dy.device)
    flat, dy2 = _grad_rows(ids, dy, d, padding_idx)
    return _weight_grad(flat, dy2, num_embeddings, sub_leaf_tokens(leaf_tokens), 0, dtype, node_tables=False)


@embedding_backward_op.register_fake
def _(ids, dy, num_embeddings, padding_idx, leaf_tokens, dtype):
    return dy.new_empty((num_embeddings, dy.shape[-1]), dtype=dtype)


@Op("embedding_deposit", ("ticket",))
def embedding_deposit_op(
    ids: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, ticket: torch.Tensor
) -> None:
    """The ``det_train::embedding_deposit`` op: deposit the weight gradient of this micro-batch's
    rows into the active accumulator at run time (rows of a leaf split between micro-batches are
    carried to the one completing it)."""
    v, d = weight.shape
    flat, dy2 = _grad_rows(ids, dy, d, padding_idx)
    deposit.rows("det_train.embedding", weight, (flat, dy2), functools.partial(_leaf_tables, v))
    ticket.add_(1)


@embedding_deposit_op.register_fake
def _(ids, dy, weight, padding_idx, ticket):
    return None


@Op("embedding_fold_rows", ("fold_ids", "fold_rows", "fold_count"))
def embedding_fold_rows_op(
    ids: torch.Tensor,
    dy: torch.Tensor,
    padding_idx: int | None,
    fold_ids: torch.Tensor,
    fold_rows: torch.Tensor,
    fold_pos: torch.Tensor,
    fold_count: torch.Tensor,
) -> None:
    """The ``det_train::embedding_fold_rows`` op: this micro-batch's gradient rows (ids and ``dy``,
    padded tokens' rows zeroed) copied into the table's fixed fold at its leaf position ``fold_pos``
    (a device scalar: one captured launch serves every micro-batch), and 1 added to ``fold_count``;
    the leaf is summed from the rows when it completes (``fixed_folds``). No host bookkeeping: not
    tagged ``cudagraph_unsafe``."""
    deposit.fold_checked("det_train.embedding", fold_count)
    flat, dy2 = _grad_rows(ids, dy, fold_rows.shape[1], padding_idx)
    at = torch.arange(flat.shape[0], device=flat.device) + fold_pos  # distinct rows: a plain copy
    fold_ids.index_copy_(0, at, flat)
    fold_rows.index_copy_(0, at, dy2.to(fold_rows.dtype))
    fold_count.add_(1)


@embedding_fold_rows_op.register_fake
def _(ids, dy, padding_idx, fold_ids, fold_rows, fold_pos, fold_count):
    return None


def takes_fixed_fold(module: torch.nn.Module) -> bool:
    """Whether ``CanonicalGradAccumulator.fixed_folds`` gives ``module``'s table a fixed fold here: a
    ``det_train.Embedding``."""
    return isinstance(module, Embedding)


def fixed_fold_spec(weight: torch.Tensor, leaf_tokens: int) -> tuple:
    """``(make, step, close)`` of an embedding table's fixed fold: its open leaf's rows, ids int64
    ``(leaf_tokens,)`` and ``dy (leaf_tokens, D)`` in the table's dtype (made by ``make(weight)``),
    continued at any token, closed by the leaf sum of the rows present (``_leaf_tables``: the bits of
    the plain path, which sums an open leaf from its copied rows)."""
    v, d = weight.shape

    def make(param: torch.Tensor) -> tuple:
        ids = torch.zeros((leaf_tokens,), dtype=torch.int64, device=param.device)
        return ids, torch.zeros((leaf_tokens, d), dtype=param.dtype, device=param.device)

    return make, 1, functools.partial(_rows_node, v=v, leaf=leaf_tokens)


def _rows_node(fold: tuple, tokens: int, v: int, leaf: int) -> torch.Tensor:
    """The leaf's fp32 node from the first ``tokens`` rows of a fixed fold (a new tensor)."""
    (node,) = _leaf_tables(v, leaf, 0, (fold[0][:tokens], fold[1][:tokens])).nodes.values()
    return node


def _leaf_tables(v: int, leaf: int, first_leaf: int, rows: tuple) -> TreePartial:
    """The accumulator's leaf-sum function of the embedding table: rows ``(ids, dy)`` of whole leaves
    of ``leaf`` tokens (each ``ratio`` sub-leaves of ``sub`` tokens), as subtrees over leaves."""
    sub = sub_leaf_tokens(leaf)
    ratio = leaf // sub
    return coarsen(_weight_grad(rows[0], rows[1], v, sub, first_leaf * ratio, None, node_tables=True), ratio)


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """Look up rows of ``weight``: ``out[..., :] = weight[ids[...], :]``.

    Args:
        ids: integer tensor (int32 / int64) of any shape ``(...)`` with values in ``[0, V)``;
            flattened row-major it gives the local token index.
        weight: ``(V, D)`` float tensor on the same device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        padding_idx: as ``torch.nn.functional.embedding``: tokens with this id get their row in the
            forward but contribute nothing to the gradient (row ``padding_idx`` of the gradient is
            +0.0); negative values count from ``V``. None (default): no padding id.

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
        TypeError: ids or weight not a tensor, ids not integer or weight not floating point;
            ``padding_idx`` not an int.
        ValueError: weight not 2-D, ``padding_idx`` outside ``[-V, V)``, an id out of range
            (checked on the host: one device sync).
            The id range check is skipped while a CUDA graph is being captured
            (``torch.cuda.is_current_stream_capturing()``): no device value can be read then, as
            for torch's own ops that cannot check device values during capture; keeping ids in
            ``[0, V)`` is then the caller's job (an id outside gives a device-side assert in the
            row lookup or, for a negative id, a wrapped-around row and an undefined gradient).
        RuntimeError: device problems.

    Reference: ``torch.nn.functional.embedding`` (the lookup and its ``padding_idx``); the
    atomic-free gradient is a sort-then-segment-sum (the method of PyTorch's CUDA
    ``embedding_dense_backward``: sorted ids, one sum per run of equal ids), folded in det_core's
    canonical token order (module docstring).
    """
    for name, value in (("ids", ids), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"embedding: {name} must be a torch.Tensor, got {type(value).__module__}."
                f"{type(value).__qualname__} (convert it with torch.as_tensor / torch.from_numpy)"
            )
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding: ids must be int32 or int64, got {ids.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"embedding: weight must be floating point, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"embedding: weight must be (V, D), got shape {tuple(weight.shape)}")
    check_kernel_device(ids, weight, op="embedding")
    if padding_idx is not None:
        padding_idx = as_index(padding_idx, "padding_idx", "embedding")
        if not -weight.shape[0] <= padding_idx < weight.shape[0]:
            raise ValueError(
                f"embedding: padding_idx {padding_idx} must lie in [-{weight.shape[0]}, {weight.shape[0]})"
            )
        padding_idx %= weight.shape[0]
    leaf, active = deposit.accumulation()
    deposits = active and weight.is_leaf and ids.numel() > 0
    fixed = deposit.fixed_fold("det_train.embedding", weight, ids.numel()) if deposits else None
    ticket = deposit.ticket() if deposits and fixed is None else None
    fold_args = (None,) * 4 if fixed is None else (*fixed[0], deposit.fixed_fold_pos(), fixed[1])
    # the id range check runs in the op (a device value: read when the op runs, also compiled)
    return embedding_op(ids.to(torch.int64), weight, padding_idx, ticket, leaf, deposits, *fold_args)


class Embedding(torch.nn.Embedding):
    """Drop-in for ``torch.nn.Embedding`` (plain lookups) running ``det_train.embedding`` (same
    constructor, init and state_dict).

    Args:
        num_embeddings: ``V``, the number of rows of ``weight`` ``(V, D)``.
        embedding_dim: ``D``, the size of each row.
        padding_idx: as ``torch.nn.Embedding``: that row is initialised to zeros and gets a +0.0
            gradient (padded tokens contribute nothing).
        max_norm, scale_grad_by_freq, sparse: must keep their defaults (None, False, False); see
            Raises.
        norm_type, _weight, _freeze, device, dtype: as ``torch.nn.Embedding``; ``weight`` is floating point
            (float32 by default), on CUDA (or CPU under ``TRITON_INTERPRET=1``).

    Forward: ``ids`` int32 / int64 of any shape ``(...)`` with values in ``[0, V)`` gives
    ``(..., D)`` in ``weight.dtype``.

    Raises:
        ValueError: at construction, ``max_norm``, ``scale_grad_by_freq`` or ``sparse=True``. At
            forward, as ``embedding``: an id outside ``[0, V)`` (checked on the host: one device
            sync; skipped during CUDA graph capture). TypeError: ids not int32 / int64, weight not
            floating point. RuntimeError: device problems.

    **Determinism:** the forward is an exact copy of rows (row invariant, the same bits on every
    device). The weight gradient sums ``dy`` over the tokens of each id in the canonical order:
    bitwise run to run, equal to ``reference_norms.embedding_weight_grad_reference``, and invariant
    to leaf-aligned micro-batch and data-parallel splits under a ``CanonicalGradAccumulator``;
    details in ``embedding``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.max_norm is not None or self.sparse:
            raise ValueError(
                "det_train.Embedding supports plain lookups (and padding_idx) only: max_norm and "
                "sparse=True are not supported"
            )
        if self.scale_grad_by_freq:
            raise ValueError("det_train.Embedding: scale_grad_by_freq is not supported")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight, self.padding_idx)
