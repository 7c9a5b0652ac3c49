"""Weight and bias gradients of ``linear`` in the canonical token order: dW = dY^T X, db = sum of dY.

The token axis is cut into leaves of ``leaf_tokens`` tokens aligned to the global token index; a leaf
is a sequential fp32 fold in steps of ``block_t`` tokens (the only field of ``WeightGradConfig``
that changes bits); leaves are combined by det_core's fixed tree (``TreePartial``). The kernels
compute whole aligned subtrees of up to ``leaves_per_program`` leaves:

- ``_weight_grad_lean_kernel`` (the table's entry for large layers): the four leaves of each
  level-2 node summed in registers (``quads``; ``pairs``: two leaves), higher levels merged
  through a per-program fp32 scratch stack that stays in L2, TMA loads, one program per SM;
- ``_weight_grad_kernel``: up to 4 leaves in registers (the table's entry for small layers).

What a launch leaves unfinished (subtrees of several runs) is merged by ``TreePartial`` in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import BoundLaunch, DescriptorTemplate, PlanCache
from det_core.reduce import TreePartial, num_leaves

from ..accum._leaf_sums import coarsen, sub_leaf_tokens
from ._leaf_fold import dw_tma_operands, leaf_sum, leaf_sum_tma, tma_step
from ._tiles import (
    INTERPRET,
    bf16_by_bits,
    dot_precision,
    grouped_tile,
    runtime_programs,
    store_rounded,
)
from .configs import BIAS_GRAD_BLOCK_T, WeightGradConfig, check_weight_grad_config, weight_grad_config

__all__ = [
    "bias_grad_leaves",
    "bias_grad_partial",
    "dw_scratch_shape",
    "weight_grad_partial",
]


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _pair_node_tma(
    dy_desc, x_desc, start, T, LEAF_TOKENS, off_n, off_k,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """node(1) = leaf + next leaf, one leaf after the other."""
    start1 = start + LEAF_TOKENS
    node = leaf_sum_tma(
        dy_desc, x_desc, start, tl.minimum(start1, T), off_n, off_k, BLOCK_N, BLOCK_K, BLOCK_T, UPCAST,
        DOT_PRECISION,
    )  # fmt: skip
    node = node + leaf_sum_tma(
        dy_desc, x_desc, start1, tl.minimum(start1 + LEAF_TOKENS, T), off_n, off_k, BLOCK_N, BLOCK_K,
        BLOCK_T, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    return node


@triton.jit
def _quad_node_flat_tma(
    dy_desc, x_desc, start, LEAF_TOKENS, off_n, off_k,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """node(2) of four full leaves as one loop nest that Triton flattens (``tl.range(flatten=True)``)
    and pipelines as one loop: the loads of leaf j + 1 are in flight while leaf j closes. Each leaf
    is its own fold from zero in token order, ``pair = leaf + leaf``, ``node = pair + pair``: the
    bits of ``_pair_node_tma`` twice (the selects below copy, they do not add)."""
    pair = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    left = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for leaf in tl.range(0, 4, flatten=True):
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        leaf_start = start + leaf * LEAF_TOKENS
        for t in range(0, LEAF_TOKENS, BLOCK_T):
            a, b = tma_step(dy_desc, x_desc, leaf_start + t, off_n, off_k, BLOCK_N, BLOCK_T, UPCAST)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        pair = tl.where(leaf % 2 == 0, acc, pair + acc)  # leaf 2i: the pair's left; 2i + 1: the pair
        left = tl.where(leaf == 1, pair, left)  # the quad's left pair waits here
    return left + pair


@triton.jit
def _quad_node_tma(
    dy_desc, x_desc, start, T, LEAF_TOKENS, off_n, off_k,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FLAT: tl.constexpr,
):  # fmt: skip
    """node(2) = node(1) + node(1): with ``FLAT`` one flattened loop nest when all four leaves are
    full, else two ``_pair_node_tma`` (same bits either way)."""
    flat = False  # FLAT: a runtime test (full leaves); else no flattened loop is compiled at all
    if FLAT:
        flat = start + 4 * LEAF_TOKENS <= T
    if flat:
        node = _quad_node_flat_tma(
            dy_desc, x_desc, start, LEAF_TOKENS, off_n, off_k, BLOCK_N, BLOCK_K, BLOCK_T, UPCAST,
            DOT_PRECISION,
        )  # fmt: skip
    else:
        node = _pair_node_tma(
            dy_desc, x_desc, start, T, LEAF_TOKENS, off_n, off_k, BLOCK_N, BLOCK_K, BLOCK_T, UPCAST,
            DOT_PRECISION,
        ) + _pair_node_tma(
            dy_desc, x_desc, start + 2 * LEAF_TOKENS, T, LEAF_TOKENS, off_n, off_k, BLOCK_N, BLOCK_K,
            BLOCK_T, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    return node


@triton.jit(do_not_specialize=["T", "run_start"])
def _weight_grad_kernel(
    # pointers: dY (T, N), X (T, K), out (blocks, N, K)
    dy_ptr, x_ptr, out_ptr,
    # sizes: tokens, out rows, out cols, first token of the run, tokens per leaf
    T, N, K, run_start, LEAF_TOKENS,
    stride_dyt, stride_dyn, stride_xt, stride_xk, stride_ob, stride_on, stride_ok,
    dy_t_step, x_t_step,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr,
    LEAVES: tl.constexpr, EVEN_T: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BF16_BY_BITS: tl.constexpr,
):  # fmt: skip
    """One aligned subtree of LEAVES leaves (1, 2 or 4) of one dW tile: the node of the canonical tree."""
    pid = tl.program_id(0)
    block = tl.program_id(1)
    pid_n, pid_k = grouped_tile(pid, tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K), GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = (rows % N).to(tl.int64)
    offs_k = (cols % K).to(tl.int64)

    s0 = run_start + block * (LEAVES * LEAF_TOKENS)
    e0 = tl.minimum(s0 + LEAF_TOKENS, T)
    node = leaf_sum(
        dy_ptr, x_ptr, s0, e0, offs_n, offs_k, stride_dyt, stride_dyn, stride_xt, stride_xk,
        dy_t_step, x_t_step, BLOCK_N, BLOCK_K, BLOCK_T, EVEN_T, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    if LEAVES >= 2:  # node(1) = leaf 0 + leaf 1
        s1 = s0 + LEAF_TOKENS
        e1 = tl.minimum(s1 + LEAF_TOKENS, T)
        node = node + leaf_sum(
            dy_ptr, x_ptr, s1, e1, offs_n, offs_k, stride_dyt, stride_dyn, stride_xt, stride_xk,
            dy_t_step, x_t_step, BLOCK_N, BLOCK_K, BLOCK_T, EVEN_T, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    if LEAVES == 4:  # node(2) = node(1, left) + (leaf 2 + leaf 3)
        s2 = s0 + 2 * LEAF_TOKENS
        e2 = tl.minimum(s2 + LEAF_TOKENS, T)
        s3 = s0 + 3 * LEAF_TOKENS
        e3 = tl.minimum(s3 + LEAF_TOKENS, T)
        right = leaf_sum(
            dy_ptr, x_ptr, s2, e2, offs_n, offs_k, stride_dyt, stride_dyn, stride_xt, stride_xk,
            dy_t_step, x_t_step, BLOCK_N, BLOCK_K, BLOCK_T, EVEN_T, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        right = right + leaf_sum(
            dy_ptr, x_ptr, s3, e3, offs_n, offs_k, stride_dyt, stride_dyn, stride_xt, stride_xk,
            dy_t_step, x_t_step, BLOCK_N, BLOCK_K, BLOCK_T, EVEN_T, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        node = node + right
    out_ptrs = (
        out_ptr + block.to(tl.int64) * stride_ob + rows.to(tl.int64)[:, None] * stride_on
        + cols.to(tl.int64)[None, :] * stride_ok
    )  # fmt: skip
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    store_rounded(out_ptrs, node, mask, BF16_BY_BITS)


@triton.jit
def _push_node(
    node, j, nodes, slot, out_ptr, block, pid_n, pid_k, N, K, stride_ob, stride_on, stride_ok,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAX_LEVELS: tl.constexpr, MERGE_ROWS: tl.constexpr,
    BF16_BY_BITS: tl.constexpr,
):  # fmt: skip
    """Node ``j`` (of ``nodes``) of one program's tile into the canonical tree: a left sibling waits
    in its scratch ``slot`` level; a right sibling is added to the waiting left ones, level by level,
    on chunks of ``MERGE_ROWS`` rows in memory, and the result waits one level up or, at the root,
    is rounded into ``out``."""
    # the tree merge runs in memory on row chunks: few registers live beside the token loop
    closing = 0  # levels this node closes; the node it makes waits in slot `closing`
    for lv in tl.static_range(MAX_LEVELS):
        closing += tl.where((j + 1) % (2 << lv) == 0, 1, 0)
    zero = j >> 30  # 0, but depends on j: keeps the offsets below out of LICM's reach
    tile = (zero + tl.arange(0, BLOCK_N))[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    if (closing == 0) & (j + 1 < nodes):  # a left sibling: straight to its slot
        tl.debug_barrier()  # every thread is done reading the slot being overwritten
        tl.store(slot + tile, node)
        tl.debug_barrier()
    else:  # node -> slot MAX_LEVELS, then (left + node) level by level, chunk by chunk
        tl.store(slot + MAX_LEVELS * (BLOCK_N * BLOCK_K) + tile, node)
        tl.debug_barrier()
        for c in tl.static_range(BLOCK_N // MERGE_ROWS):
            part = (c * MERGE_ROWS + zero + tl.arange(0, MERGE_ROWS))[:, None] * BLOCK_K
            part += tl.arange(0, BLOCK_K)[None, :]
            value = tl.load(slot + MAX_LEVELS * (BLOCK_N * BLOCK_K) + part)
            for lv in tl.static_range(MAX_LEVELS):
                if lv < closing:
                    value = tl.load(slot + lv * (BLOCK_N * BLOCK_K) + part) + value
            if j + 1 < nodes:
                tl.store(slot + closing * (BLOCK_N * BLOCK_K) + part, value)
            else:  # the root: rounded into the output
                rows = pid_n * BLOCK_N + c * MERGE_ROWS + zero + tl.arange(0, MERGE_ROWS)
                cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
                out_ptrs = (
                    out_ptr + block.to(tl.int64) * stride_ob
                    + rows.to(tl.int64)[:, None] * stride_on + cols.to(tl.int64)[None, :] * stride_ok
                )  # fmt: skip
                mask = (rows[:, None] < N) & (cols[None, :] < K)
                store_rounded(out_ptrs, value, mask, BF16_BY_BITS)
        tl.debug_barrier()


@triton.jit(do_not_specialize=["T", "run_start", "leaves", "num_programs"])
def _weight_grad_lean_kernel(
    dy_ptr, x_ptr, out_ptr, scratch_ptr, stride_scratch,
    T, N, K, run_start, LEAF_TOKENS, leaves, blocks, num_programs,
    stride_dyt, stride_dyn, stride_xt, stride_xk, stride_ob, stride_on, stride_ok,
    dy_t_step, x_t_step,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr,
    MAX_LEVELS: tl.constexpr, PAIRS: tl.constexpr, MERGE_ROWS: tl.constexpr, TMA: tl.constexpr,
    EVEN_T: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BF16_BY_BITS: tl.constexpr,
    QUADS: tl.constexpr = False, FLAT: tl.constexpr = False,
):  # fmt: skip
    """Aligned subtrees of ``leaves`` (a power of 2) leaves of dW tiles, persistent, one accumulator
    tile live during the token loop.

    Each program walks tiles ``program, program + num_programs, ...`` (tile = one output tile of one
    subtree). Leaves are summed in order; finished left siblings wait in the program's fp32 scratch
    stack (one tile per level, written and read back by the same program, so it stays in L2) and
    are combined as ``left + right`` the moment the right sibling is done: exactly the canonical tree.

    The root is stored inside the leaf loop and the scratch / output addresses are rebuilt after
    each leaf (from a value the compiler cannot prove loop invariant), so no node and no 128x128
    pointer tensor stays in registers across the token loop: ~half the registers, two programs per
    SM, and one program's tree merge overlaps the other's tensor-core work. With ``PAIRS`` the two
    leaves of each level-1 node are summed in registers (two tiles live, one program per SM, half
    the scratch traffic); the stack then holds levels >= 1 (``MAX_LEVELS`` counts those levels).
    With ``QUADS`` (and ``TMA``) the four leaves of each level-2 node are summed in registers
    (three tiles live) and the stack holds levels >= 2 (``MAX_LEVELS = level - 2``); with ``FLAT``
    a full quad is one flattened, software-pipelined loop nest (``_quad_node_flat_tma``, same bits).
    With ``TMA`` ``dy_ptr`` / ``x_ptr`` are host tensor descriptors of dY and X (tiles by TMA).
    The tree merge runs on row chunks of ``MERGE_ROWS`` in memory.
    """
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    tiles_per_block = num_pid_n * num_pid_k
    program = tl.program_id(0)
    group_leaves: tl.constexpr = 4 if QUADS else (2 if PAIRS else 1)
    nodes = leaves // group_leaves
    for tile_id in range(program, blocks * tiles_per_block, num_programs):
        block = tile_id // tiles_per_block
        pid_n, pid_k = grouped_tile(tile_id % tiles_per_block, num_pid_n, num_pid_k, GROUP_N)
        offs_n = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        offs_k = ((pid_k * BLOCK_K + tl.arange(0, BLOCK_K)) % K).to(tl.int64)
        s0 = run_start + block * (leaves * LEAF_TOKENS)
        for j in range(0, nodes):
            start = s0 + j * (group_leaves * LEAF_TOKENS)
            if QUADS:  # TMA: node(2) = node(1) + node(1), all in registers (three tiles live)
                node = _quad_node_tma(
                    dy_ptr, x_ptr, start, T, LEAF_TOKENS, pid_n * BLOCK_N, pid_k * BLOCK_K,
                    BLOCK_N, BLOCK_K, BLOCK_T, UPCAST, DOT_PRECISION, FLAT,
                )  # fmt: skip
            elif PAIRS and TMA:  # node(1) = leaf 2j + leaf 2j + 1, in registers
                node = _pair_node_tma(
                    dy_ptr, x_ptr, start, T, LEAF_TOKENS, pid_n * BLOCK_N, pid_k * BLOCK_K,
                    BLOCK_N, BLOCK_K, BLOCK_T, UPCAST, DOT_PRECISION,
                )  # fmt: skip
            elif TMA:
                node = leaf_sum_tma(
                    dy_ptr, x_ptr, start, tl.minimum(start + LEAF_TOKENS, T), pid_n * BLOCK_N,
                    pid_k * BLOCK_K, BLOCK_N, BLOCK_K, BLOCK_T, UPCAST, DOT_PRECISION,
                )  # fmt: skip
            else:
                node = leaf_sum(
                    dy_ptr, x_ptr, start, tl.minimum(start + LEAF_TOKENS, T), offs_n, offs_k,
                    stride_dyt, stride_dyn, stride_xt, stride_xk, dy_t_step, x_t_step,
                    BLOCK_N, BLOCK_K, BLOCK_T, EVEN_T, UPCAST, DOT_PRECISION,
                )  # fmt: skip
                if PAIRS:  # node(1) = leaf 2j + leaf 2j + 1, in registers
                    start1 = start + LEAF_TOKENS
                    node = node + leaf_sum(
                        dy_ptr, x_ptr, start1, tl.minimum(start1 + LEAF_TOKENS, T), offs_n, offs_k,
                        stride_dyt, stride_dyn, stride_xt, stride_xk, dy_t_step, x_t_step,
                        BLOCK_N, BLOCK_K, BLOCK_T, EVEN_T, UPCAST, DOT_PRECISION,
                    )  # fmt: skip
            _push_node(
                node, j, nodes, scratch_ptr + program.to(tl.int64) * stride_scratch, out_ptr, block,
                pid_n, pid_k, N, K, stride_ob, stride_on, stride_ok, BLOCK_N, BLOCK_K, MAX_LEVELS,
                MERGE_ROWS, BF16_BY_BITS,
            )  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def _bias_grad_kernel(
    dy_ptr, out_ptr, T, N, LEAF_TOKENS, stride_dyt, stride_dyn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Leaf sums of dY over tokens: out[leaf, n], each a fold of BLOCK_T-token column sums."""
    pid_n = tl.program_id(0)
    leaf = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    start = leaf * LEAF_TOKENS
    end = tl.minimum(start + LEAF_TOKENS, T)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in range(start, end, BLOCK_T):
        tok = (t + offs_t).to(tl.int64)
        mask = (tok[:, None] < end) & (cols[None, :] < N)
        tile = tl.load(dy_ptr + tok[:, None] * stride_dyt + cols[None, :] * stride_dyn, mask=mask, other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=0)
    tl.store(out_ptr + leaf.to(tl.int64) * N + cols, acc, mask=cols < N)


# ----------------------------------------------------------------------------- host launchers
def _aligned_runs(first_leaf: int, n_leaves: int, max_leaves: int) -> list[tuple[int, int, int]]:
    """Cut global leaves ``[first_leaf, first_leaf + n_leaves)`` into runs of aligned subtrees.

    Returns ``(level, first_node_index, node_count)`` runs: greedily the largest subtree of at most
    ``max_leaves`` leaves that starts at the current leaf, is aligned (start divisible by its size)
    and lies inside the range; equal consecutive levels form one run (one kernel launch).
    """
    runs: list[tuple[int, int, int]] = []
    pos, end = first_leaf, first_leaf + n_leaves
    while pos < end:
        size = max_leaves
        while size > 1 and (pos % size or pos + size > end):
            size //= 2
        level = size.bit_length() - 1
        if runs and runs[-1][0] == level and (runs[-1][1] + runs[-1][2]) * size == pos:
            runs[-1] = (level, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((level, pos // size, 1))
        pos += size
    return runs


def weight_grad_partial(
    dy: torch.Tensor,
    x: torch.Tensor,
    *,
    leaf_tokens: int,
    first_leaf: int = 0,
    config: WeightGradConfig | None = None,
    finish_dtype: torch.dtype | None = None,
) -> TreePartial | torch.Tensor:
    """The canonical-order dW = dY^T X of one contiguous run of tokens, as a ``TreePartial``.

    Args:
        dy: ``(T, N)`` output gradient, any strides; bf16 / fp16 / fp32.
        x: ``(T, K)`` layer input, same dtype and device.
        leaf_tokens: tokens per leaf; local token ``t`` belongs to global leaf
            ``first_leaf + t // leaf_tokens`` (the run starts on a leaf boundary).
        first_leaf: global index of the run's first leaf.
        config: override of the config table (benchmarks / tests of configs).
        finish_dtype: when given (and ``first_leaf == 0``, the run being the whole token axis),
            return the finished gradient ``(N, K)`` in this dtype instead of the partial.

    Returns:
        ``TreePartial`` with fp32 ``(N, K)`` nodes (the maximal aligned subtrees of at most
        ``leaves_per_program`` leaves, merged), or the finished tensor.

    Workspace: one fp32 ``(N, K)`` tile per aligned subtree left unfinished by the kernel (none when the
    run is one subtree, finished and rounded in-kernel), plus, with ``lean``, a stack of fp32 tiles per
    resident program (``dw_scratch_shape``): with the default table (lean, quads, one program per SM) at
    8 leaves per program 132 programs x (1 level + 1 merge slot) x 64 KiB = 16.5 MiB on a 132-SM H200,
    whatever the layer's size.

    Raises:
        ValueError: an unsupported ``config`` (``configs.check_weight_grad_config``).

    **Determinism:** leaf sums are fixed by ``block_t`` (config table) and the leaf's tokens; the
    tree by global leaf indices: any leaf-aligned split of the tokens merges to the same bits, and
    ``leaves_per_program`` does not change them.
    """
    key = (
        dy.shape, dy.stride(), x.shape, x.stride(), dy.dtype, x.dtype, dy.device, dy.data_ptr() % 16 == 0,
        x.data_ptr() % 16 == 0, leaf_tokens, first_leaf, config, finish_dtype,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(key, dy, x, leaf_tokens, first_leaf, config, finish_dtype)
    partial = TreePartial()
    for run in plan.runs:
        out = torch.empty(run.out_shape, dtype=run.out_dtype, device=dy.device)
        if run.scratch_shape is not None:
            scratch = torch.empty(run.scratch_shape, dtype=torch.float32, device=dy.device)
            operands = (dy, x) if run.descs is None else (run.descs[0](dy), run.descs[1](x))
            run.launch(run.grid, *operands, out, scratch)
        else:
            run.launch(run.grid, dy, x, out)
        if plan.fused:
            return out[0]
        # a few fp32 adds in torch (a micro-batch of 16 leaves: one); a tree_in_place launch
        # instead cost more host time per call than it saved (H200 machine, Triton 3.6). In place:
        # every node is this call's (a slice of its outputs), so no buffer beyond them
        for i, (level, index) in enumerate(run.nodes):
            partial.add_node(level, index, out[i], _add_into_left)
    if finish_dtype is not None:
        return partial.result(plan.total_leaves).to(finish_dtype)
    return partial


def _add_into_left(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """A tree parent ``left + right`` written into ``left`` (the bits of ``left + right``)."""
    return left.add_(right)


class _Run:
    """One launch of a dW plan: its output and scratch shapes, the kernel with its sizes, strides
    and constexprs bound (the calls pass dY, X, out and scratch) and the tree nodes it makes."""

    __slots__ = ("grid", "out_shape", "out_dtype", "scratch_shape", "launch", "descs", "nodes")

    def __init__(self, grid, out_shape, out_dtype, scratch_shape, kernel, scalars, meta, descs, nodes):
        self.grid, self.out_shape, self.out_dtype = grid, out_shape, out_dtype
        self.scratch_shape, self.nodes = scratch_shape, nodes
        self.launch = BoundLaunch(kernel, 3 if scratch_shape is None else 4, scalars, **meta)
        self.descs = None if descs is None else tuple(map(DescriptorTemplate, descs))


class _Plan:
    __slots__ = ("config", "runs", "fused", "total_leaves")

    def __init__(self, config, runs, fused, total_leaves) -> None:
        self.config, self.runs, self.fused, self.total_leaves = config, runs, fused, total_leaves


# Launch plans by call signature (shapes, strides, dtypes, alignment, leaves, config): the host side
# of a dW call is then a dict lookup, the allocations and the launches (its config lookup, runs,
# descriptors, strides and constexprs were tens of microseconds per call, ~100 calls per step).
_PLANS = PlanCache()


def _make_plan(key, dy, x, leaf_tokens, first_leaf, config, finish_dtype) -> _Plan:
    T, N = dy.shape
    K = x.shape[1]
    leaves = num_leaves(T, leaf_tokens)
    if config is None:
        config = weight_grad_config(dy.dtype, N, K)
    check_weight_grad_config(config)  # unsupported variants fail here, not inside ptxas
    runs = _aligned_runs(first_leaf, leaves, config.leaves_per_program)
    fused = finish_dtype is not None and first_leaf == 0 and len(runs) == 1 and runs[0][2] == 1
    plan_runs = []
    token = 0
    for level, first_node, count in runs:
        size = 1 << level
        out_dtype = finish_dtype if fused else torch.float32
        out_shape = (count, N, K)
        out_strides = torch.empty(out_shape, device="meta").stride()  # of the new contiguous output
        run_tokens = min(count * size * leaf_tokens, T - token)
        grid = (runtime.cdiv(N, config.block_n) * runtime.cdiv(K, config.block_k), count)
        even_t = leaf_tokens % config.block_t == 0 and run_tokens == count * size * leaf_tokens
        common = dict(
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_T=config.block_t, GROUP_N=config.group_n,
            EVEN_T=even_t, UPCAST=INTERPRET and dy.dtype != torch.float32,
            DOT_PRECISION=dot_precision(dy.dtype), BF16_BY_BITS=bf16_by_bits(out_dtype),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        args = (
            T, N, K, token, leaf_tokens,
        )  # fmt: skip
        strides = (
            dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), *out_strides,
            config.block_t * dy.stride(0), config.block_t * x.stride(0),
        )  # fmt: skip
        nodes = tuple((level, first_node + i) for i in range(count))
        if config.lean and size > 1:
            descs = dw_tma_operands(dy, x, config, leaf_tokens) if config.tma else None
            quads = config.quads and descs is not None and level >= 2
            levels = level - (2 if quads else 1 if config.pairs else 0)  # levels that wait in the stack
            tma = descs is not None
            scratch_shape = dw_scratch_shape(config, level, grid[0] * grid[1], dy.device, tma=tma)
            programs = scratch_shape[0]
            scratch_stride = torch.empty(scratch_shape, device="meta").stride(0)
            plan_runs.append(
                _Run(
                    (programs,), out_shape, out_dtype, scratch_shape, _weight_grad_lean_kernel,
                    (scratch_stride, *args, size, count, programs, *strides),
                    dict(
                        MAX_LEVELS=levels, PAIRS=config.pairs, TMA=descs is not None, QUADS=quads,
                        FLAT=quads and config.flat, MERGE_ROWS=min(32, config.block_n), **common,
                    ),
                    descs, nodes,
                )
            )  # fmt: skip
        else:
            meta = dict(LEAVES=size, **common)
            run = _Run(
                grid, out_shape, out_dtype, None, _weight_grad_kernel, (*args, *strides), meta, None, nodes
            )
            plan_runs.append(run)
        token += run_tokens
    plan = _Plan(config, tuple(plan_runs), fused, first_leaf + leaves)
    return _PLANS.put(key, plan)


def dw_scratch_shape(
    config: WeightGradConfig, level: int, programs_needed: int, device: torch.device, tma: bool = True
) -> tuple[int, int, int] | None:
    """Shape of the fp32 scratch stack of the dW tree kernels for subtrees of ``2**level`` leaves:
    (programs, slots, block_n * block_k), or None when the config uses no scratch. ``tma``: whether
    the launch gets TMA descriptors (``quads`` needs them; without, the kernel runs ``pairs``)."""
    if level == 0 or not config.lean:
        return None
    programs = min(programs_needed, _resident_programs(device, config.programs_per_sm))
    in_registers = 2 if config.quads and tma and level >= 2 else 1 if config.pairs else 0
    slots = (level - in_registers) + 1  # the waiting levels and the merge slot
    return programs, max(slots, 1), config.block_n * config.block_k


def _resident_programs(device: torch.device, per_sm: int = 2) -> int:
    """Programs of the persistent dW tree kernels: ``per_sm`` per SM (their scratch is sized by this)."""
    return per_sm * runtime_programs(device)


def bias_grad_leaves(dy: torch.Tensor, leaf_tokens: int) -> torch.Tensor:
    """fp32 leaf sums ``(n_leaves, N)`` of ``dy (T, N)`` over tokens (folds of 64-token column sums)."""
    T, N = dy.shape
    leaves = num_leaves(T, leaf_tokens)
    out = torch.empty((leaves, N), dtype=torch.float32, device=dy.device)
    block_n = 128
    _bias_grad_kernel[(runtime.cdiv(N, block_n), leaves)](
        dy, out, T, N, leaf_tokens, dy.stride(0), dy.stride(1), BLOCK_T=BIAS_GRAD_BLOCK_T, BLOCK_N=block_n
    )
    return out


def bias_grad_partial(dy: torch.Tensor, *, leaf_tokens: int, first_leaf: int = 0) -> TreePartial:
    """The canonical-order db = sum of dY over tokens of one run, as a ``TreePartial`` of (N,) nodes
    over global leaves ``first_leaf ...``: each leaf the canonical tree over its sub-leaves
    (``_leaf_sums.sub_leaf_tokens``, 1024 tokens of an 8192-token leaf), each sub-leaf a fold of
    64-token column sums (one program per sub-leaf and column block: a long leaf stays parallel).

    ``dy``: ``(T, N)`` bf16 / fp16 / fp32, any strides; the nodes are fp32. The run starts on a leaf
    boundary. **Determinism:** the nodes depend only on the run's tokens and global leaf indices,
    so leaf-aligned runs merge to the bits of one run (the tree over sub-leaves, whatever
    ``leaf_tokens`` above them)."""
    sub = sub_leaf_tokens(leaf_tokens)
    ratio = leaf_tokens // sub
    return coarsen(TreePartial().add_leaves(first_leaf * ratio, bias_grad_leaves(dy, sub)), ratio)
