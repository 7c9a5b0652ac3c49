"""The norm kernels' row tiles (RMSNorm, LayerNorm): one row at a time on the GPU, many rows per
program in the Triton interpreter.

The interpreter runs a program's operations one numpy call each, so a tile of many rows costs it
about what one row does; the GPU keeps its one-row programs (the helpers below reduce to the
former code there: the sm_90a PTX is unchanged, ``benchmarks/aot_compile_check.py --norms
--ptx-digest``). A tile gives the row-by-row kernels' bits for every non-NaN result:

- a row's ``tl.sum`` becomes numpy's sum along axis 1 of a C-contiguous ``(rows, BLOCK_D)`` tile,
  which sums each row as the 1-D row's sum does (checked for BLOCK_D 1-131072, 1-64 rows, under
  numpy's AVX512, AVX2 and SSE dispatch);
- a chunk's sum over its rows (``dw_acc +=`` row by row from +0.0) becomes numpy's sum along axis 0,
  which adds the rows in order for tiles of at least 2 columns (a 1-column tile's would be pairwise:
  D = 1 keeps the loop), plus ``+ 0.0`` for the loop's +0.0 where every term is -0.0;
- every other operation is elementwise on the same values.

A NaN result's sign and payload may differ (numpy broadcasts a row's scalars in another inner loop,
which keeps the other operand of a NaN-and-NaN operation), as they already differ with numpy's SIMD
dispatch level; the GPU's NaNs are canonical. Tests: ``test_latency_settings.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from det_core import runtime

# Rows per forward program in the interpreter, at most (the largest power of two dividing M).
INTERPRETER_ROWS = 64


def forward_rows(m: int) -> int:
    """Rows per forward program for ``m`` rows: 1 on the GPU; in the interpreter the largest power of
    two <= ``INTERPRETER_ROWS`` dividing ``m`` (so the tile needs no row mask). Raises nothing.

    **Determinism:** a launch shape only: every row gets the same bits (module docstring).
    """
    return min(INTERPRETER_ROWS, m & -m) if runtime.interpreter_active() else 1


def chunk_tile(block_d: int) -> int:
    """1 where a backward computes a chunk's rows as one tile (the interpreter, BLOCK_D >= 2), else 0
    (the row loop). Raises nothing.

    **Determinism:** the same bits either way (module docstring).
    """
    return int(runtime.interpreter_active() and block_d >= 2)


@triton.jit
def row_block(D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This forward program's rows, columns and column mask: a scalar row and 1-D columns for
    ``ROWS == 1``, ``(ROWS, 1)`` rows and ``(1, BLOCK_D)`` columns otherwise."""
    if ROWS == 1:
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
    else:
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
    return row, cols, cols < D


@triton.jit
def row_sum(v, ROWS: tl.constexpr):
    """Each row's sum of ``v`` from ``row_block``'s layout: a scalar, or ``(ROWS, 1)``."""
    if ROWS == 1:
        return tl.sum(v, axis=0)
    else:
        return tl.sum(v, axis=1, keep_dims=True)


@triton.jit
def chunk_grads(
    dy_ptr,
    x_ptr,
    mean_ptr,
    rstd_ptr,
    w,
    first,
    M,
    D,
    cols,
    mask,
    stride_dy,
    stride_x,
    HAS_WEIGHT: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    ROWS_PER_CHUNK: tl.constexpr,
):
    """A backward chunk's rows as one tile: ``(row, cols, dx, store mask, dw_acc)``, dX in fp32 for
    the caller to round and store at ``row * stride_dx + cols``, and the chunk's fp32 sum of
    ``dy * x_hat`` (rows past M: ``dy`` is 0, as in the row loop).

    RMSNorm (``HAS_MEAN`` False): ``x_hat = x * rstd``, ``dx = (w dy - x_hat c1) rstd``; LayerNorm:
    ``x_hat = (x - mean) * rstd`` (0 past D), ``dx = (w dy - (x_hat c1 + c2)) rstd``, with
    ``c1 = mean(x_hat w dy)`` and ``c2 = mean(w dy)`` per row: the row loops' operations."""
    r = tl.arange(0, ROWS_PER_CHUNK)[:, None]
    row = tl.minimum(first + r, M - 1)
    cols2, mask2 = cols[None, :], mask[None, :]
    lmask = mask2 & ((first + r + cols2 * 0) < M)
    dy = tl.load(dy_ptr + row * stride_dy + cols2, mask=lmask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols2, mask=mask2, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    if HAS_MEAN:
        x_hat = tl.where(mask2, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
    else:
        x_hat = x * rstd
    if HAS_WEIGHT:
        wdy = dy * w[None, :]
        dw_acc = tl.sum(dy * x_hat, axis=0) + 0.0
    else:
        wdy = dy
        dw_acc = tl.zeros(cols.shape, dtype=tl.float32)
    c1 = tl.sum(x_hat * wdy, axis=1, keep_dims=True) / D
    if HAS_MEAN:
        dx = (wdy - (x_hat * c1 + tl.sum(wdy, axis=1, keep_dims=True) / D)) * rstd
    else:
        dx = (wdy - x_hat * c1) * rstd
    return row, cols2, dx, lmask, dw_acc
