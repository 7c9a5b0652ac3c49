"""RMSNorm's Triton kernels and their fixed config table (the op, its checks and autograd:
``rms_norm.py``; the interpreter's many-row tiles: ``_norm_tiles.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._norm_tiles import chunk_grads, row_block, row_sum

# Fixed config table (never timed). Every entry changes bits: BLOCK_D and num_warps fix tl.sum's
# reduction tree over a row; MAX_ROWS_PER_CHUNK fixes the fold step inside a leaf (the step used is
# the largest power of two <= it that divides leaf_tokens).
MAX_D = 65536
MAX_ROWS_PER_CHUNK = 16
# Rows the backward loads ahead of the one it computes (0 or 1): latency only, never bits. Run 14's
# ablation also timed 2 rows: no faster than 1, more registers.
BWD_PREFETCH = 1


def num_warps_for(block_d: int) -> int:
    """Warps per row program of the RMSNorm and LayerNorm kernels, a function of BLOCK_D only.

    Args:
        block_d: the row block, ``next_pow2(D)`` (at most ``MAX_D``).

    Returns:
        1, 4, 8 or 16. Raises nothing.

    **Determinism:** part of the fixed config table: num_warps fixes ``tl.sum``'s reduction tree
    over a row, so it changes bits; it depends on D alone, never on the number of rows.
    """
    return 1 if block_d <= 256 else 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    D,
    stride_x,
    stride_y,
    eps,
    HAS_WEIGHT: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr = 1,
):
    # ROWS rows per program (a divisor of M): 1 on the GPU, a tile in the interpreter (_norm_tiles)
    row, cols, mask = row_block(D, ROWS, BLOCK_D)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = row_sum(x * x, ROWS) / D
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    y = x * rstd
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if OFFSET != 0.0:  # the (offset + weight) scale, e.g. Gemma's fp32 (1 + w)
            w = w + OFFSET
        y = y * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _load_row(
    dy_ptr, x_ptr, rstd_ptr, first, r, M, cols, mask, stride_dy, stride_x, ROWS_PER_CHUNK: tl.constexpr
):
    """Row ``r`` of the chunk starting at row ``first``, as stored (``dy``, ``x``, ``rstd``): ``dy`` is
    0 past M; ``r`` past the chunk (a prefetch the loop never uses) loads nothing."""
    row = tl.minimum(first + r, M - 1)  # past M: x of row M - 1, as an in-chunk row past M has always read
    in_chunk = r < ROWS_PER_CHUNK
    lmask = mask & ((first + r + cols * 0) < M) & in_chunk
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=lmask, other=0.0)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask & in_chunk, other=0.0)
    rstd = tl.load(rstd_ptr + row)
    return dy, x, rstd


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    M,
    D,
    stride_dy,
    stride_x,
    stride_dx,
    HAS_WEIGHT: tl.constexpr,
    OFFSET: tl.constexpr,
    ROWS_PER_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREFETCH: tl.constexpr,
    TILE: tl.constexpr = 0,
):
    # TILE (the interpreter, BLOCK_D >= 2): the chunk's rows as one tile (_norm_tiles.chunk_grads);
    # the GPU computes them one after another (the same values and operations: the same non-NaN bits).
    # PREFETCH (0 or 1): the next row is loaded before this one is computed, so a row's load latency
    # overlaps the row before it (with 0 each row waits on its own loads: the former kernel). The
    # loaded values and every operation on them are the same for both: it never changes bits.
    chunk = tl.program_id(0)
    first = chunk.to(tl.int64) * ROWS_PER_CHUNK
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if OFFSET != 0.0:
            w = w + OFFSET
    dw_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if TILE:  # the interpreter: the chunk as one (ROWS_PER_CHUNK, BLOCK_D) tile
        row, cols2, dx, lmask, dw_acc = chunk_grads(
            dy_ptr, x_ptr, rstd_ptr, rstd_ptr, w if HAS_WEIGHT else cols, first, M, D, cols, mask,
            stride_dy, stride_x, HAS_WEIGHT, False, ROWS_PER_CHUNK,
        )  # fmt: skip
        tl.store(dx_ptr + row * stride_dx + cols2, dx.to(dx_ptr.dtype.element_ty), mask=lmask)
    else:
        if PREFETCH:
            dy_next, x_next, rstd_next = _load_row(
                dy_ptr, x_ptr, rstd_ptr, first, 0, M, cols, mask, stride_dy, stride_x, ROWS_PER_CHUNK
            )
        for r in range(0, ROWS_PER_CHUNK):
            # rows past M (short last chunk): dy = 0 adds exact zeros to dw_acc and dx is not stored
            row = tl.minimum(first + r, M - 1)
            lmask = mask & ((first + r + cols * 0) < M)
            if PREFETCH == 0:  # the loads of _load_row without its prefetch mask (r is in the chunk)
                dy_raw = tl.load(dy_ptr + row * stride_dy + cols, mask=lmask, other=0.0)
                x_raw = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
                rstd = tl.load(rstd_ptr + row)
            else:
                dy_raw, x_raw, rstd = dy_next, x_next, rstd_next
                dy_next, x_next, rstd_next = _load_row(
                    dy_ptr, x_ptr, rstd_ptr, first, r + 1, M, cols, mask, stride_dy, stride_x,
                    ROWS_PER_CHUNK,
                )  # fmt: skip
            dy = dy_raw.to(tl.float32)
            x_hat = x_raw.to(tl.float32) * rstd
            if HAS_WEIGHT:
                wdy = dy * w
                dw_acc += dy * x_hat
            else:
                wdy = dy
            c1 = tl.sum(x_hat * wdy, axis=0) / D
            dx = (wdy - x_hat * c1) * rstd
            tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=lmask)
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + chunk.to(tl.int64) * D + cols, dw_acc, mask=mask)
