"""The latency settings of the RMSNorm backward (rows prefetched) and of the chunk folds (column
block, rows loaded per group, warps) never change bits: every setting gives the bits of the
sequential fp32 fold (and of the shipped setting)."""

import importlib
from unittest import mock

import pytest
import torch
import triton
from det_core.testing import assert_bitwise_equal
from det_train.accum import _leaf_sums as sums

rms = importlib.import_module("det_train.ops.rms_norm")  # the package's rms_norm is the function


def _gpu_plan(n: int) -> tuple[int, int, int]:
    """The plan ``_fold_plan`` ships for the GPU at ``n`` columns (the interpreter gets the former)."""
    with mock.patch.object(sums.runtime, "interpreter_active", lambda: False):
        return sums._fold_plan(n)


# (BLOCK, UNROLL, num_warps): the former plan (the interpreter's), the GPU's for the main job's
# 768-wide and for 4096-wide rows, others (a block wider than N, an UNROLL that divides nothing)
PLANS = [(1024, 1, 4), _gpu_plan(768), _gpu_plan(4096), (32, 5, 1), (128, 8, 2)]


def _sequential_fold(partials, cpl, skip, init):
    """Leaf sums of chunk rows starting ``skip`` chunks into leaf 0 (which continues from ``init``),
    one fp32 add at a time in chunk order; chunks before ``skip`` add +0.0."""
    n_chunks, n = partials.shape
    rows = torch.cat([torch.zeros(skip, n), partials])
    out = []
    for leaf in range(triton.cdiv(skip + n_chunks, cpl)):
        acc = init.clone() if leaf == 0 and init is not None else torch.zeros(n)
        for c in range(leaf * cpl, (leaf + 1) * cpl):
            acc = acc + (rows[c] if c < rows.shape[0] else torch.zeros(n))
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("plan", PLANS)
def test_fold_plans_give_the_sequential_fold(plan):
    block, unroll, warps = plan
    g = torch.Generator().manual_seed(1)
    n_chunks, n, cpl = 13, 100, 7  # N not a multiple of BLOCK, chunks per leaf not a multiple of UNROLL
    partials = torch.randn(n_chunks, n, generator=g) * torch.logspace(-3, 3, n_chunks).unsqueeze(1)
    init = torch.randn(n, generator=g)
    for skip, resume in ((0, False), (0, True), (3, True)):
        want = _sequential_fold(partials, cpl, skip, init if resume else None)
        out = torch.empty_like(want)
        grid = (want.shape[0], triton.cdiv(n, block))
        sums._fold_chunks_resume_kernel[grid](
            partials, init if resume else partials, out, n_chunks, n, skip,
            CHUNKS_PER_LEAF=cpl, RESUME=resume, BLOCK=block, UNROLL=unroll, num_warps=warps,
        )  # fmt: skip
        assert_bitwise_equal(out, want, f"fold_chunks_resume plan {plan}, skip {skip}, resume {resume}")
    want = _sequential_fold(partials, cpl, 0, None)
    out = torch.empty_like(want)
    sums._fold_chunks_kernel[(want.shape[0], triton.cdiv(n, block))](
        partials, out, n_chunks, n, CHUNKS_PER_LEAF=cpl, BLOCK=block, UNROLL=unroll, num_warps=warps
    )
    assert_bitwise_equal(out, want, f"fold_chunks plan {plan}")
    assert_bitwise_equal(sums.fold_chunks(partials, cpl), want, "fold_chunks (shipped plan)")


def test_rms_backward_prefetch_depths_give_the_same_bits():
    g = torch.Generator().manual_seed(2)
    m, d, rows = 37, 40, rms.MAX_ROWS_PER_CHUNK  # a short last chunk (rows past M)
    x = (3 * torch.randn(m, d, generator=g)).bfloat16()
    dy = torch.randn(m, d, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    n_chunks, block_d = triton.cdiv(m, rows), triton.next_power_of_2(d)
    outs = []
    for prefetch in (0, 1):
        dx, partial = torch.empty_like(x), torch.empty(n_chunks, d)
        rms._rms_norm_bwd_kernel[(n_chunks,)](
            dy, x, w, rstd, dx, partial, m, d, d, d, d, HAS_WEIGHT=True, OFFSET=0.0, ROWS_PER_CHUNK=rows,
            BLOCK_D=block_d, PREFETCH=prefetch, num_warps=rms.num_warps_for(block_d),
        )  # fmt: skip
        outs.append((prefetch, dx, partial))
    # the chunk sums: dy * x_hat folded one row at a time in row order, from 0.0
    x_hat = x.float() * rstd.unsqueeze(1)
    want = torch.zeros(n_chunks, d)
    for r in range(m):
        want[r // rows] = want[r // rows] + dy[r].float() * x_hat[r]
    for prefetch, dx, partial in outs:
        assert_bitwise_equal(partial, want, f"dweight chunk sums, prefetch {prefetch}")
        assert_bitwise_equal(dx, outs[0][1], f"dX, prefetch {prefetch} vs 0")


@pytest.mark.parametrize("d", [2, 40, 768])
@pytest.mark.parametrize("has_w", [True, False])
def test_rms_interpreter_tiles_give_the_row_by_row_bits(d, has_w):
    """The interpreter's many-row tiles (the forward's ROWS rows per program, the backward's chunk as
    one tile) give the one-row-at-a-time kernels' bits: y, rstd, dX and the chunk sums, with a short
    last chunk and whole chunks of zero dy against negative x (every product -0.0)."""
    g = torch.Generator().manual_seed(3)
    m, rows = 64 + 37, rms.MAX_ROWS_PER_CHUNK
    x = (3 * torch.randn(m, d, generator=g)).bfloat16()
    dy = torch.randn(m, d, generator=g).bfloat16()
    dy[:rows], x[:rows] = 0, -x[:rows].abs()
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16() if has_w else None
    block_d, n_chunks = triton.next_power_of_2(d), triton.cdiv(m, rows)
    fwd = []
    for per in (1, 32):  # 32 rows divide 64, not 101: the tile's rows are checked on 64
        y, rstd = torch.empty_like(x[:64]), torch.empty(64)
        rms._rms_norm_fwd_kernel[(64 // per,)](
            x, w if has_w else x, y, rstd, d, d, d, 1e-6, HAS_WEIGHT=has_w, OFFSET=0.0, BLOCK_D=block_d,
            ROWS=per,
        )  # fmt: skip
        fwd.append((y, rstd))
    assert_bitwise_equal(fwd[1][0], fwd[0][0], f"y, D {d}: 32-row tiles vs rows")
    assert_bitwise_equal(fwd[1][1], fwd[0][1], f"rstd, D {d}: 32-row tiles vs rows")
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    bwd = []
    for tile in (0, 1):
        dx, partial = torch.empty_like(x), torch.full((n_chunks, d), float("nan"))
        rms._rms_norm_bwd_kernel[(n_chunks,)](
            dy, x, w if has_w else x, rstd, dx, partial, m, d, d, d, d, HAS_WEIGHT=has_w, OFFSET=0.0,
            ROWS_PER_CHUNK=rows, BLOCK_D=block_d, PREFETCH=0, TILE=tile,
        )  # fmt: skip
        bwd.append((dx, partial))
    assert_bitwise_equal(bwd[1][0], bwd[0][0], f"dX, D {d}: chunk tile vs rows")
    if has_w:
        assert_bitwise_equal(bwd[1][1], bwd[0][1], f"chunk sums, D {d}: chunk tile vs rows")
        assert not torch.signbit(bwd[1][1][0]).any()  # the zero chunk's sums are +0.0, as the loop's
    assert rms.chunk_tile(block_d) == 1 and rms.chunk_tile(1) == 0  # interpreter tiles; D = 1: the loop


@pytest.mark.parametrize("d", [2, 40, 768])
@pytest.mark.parametrize("has_w", [True, False])
def test_layer_norm_interpreter_tiles_give_the_row_by_row_bits(d, has_w):
    """LayerNorm's interpreter tiles (RMSNorm's rule) give the one-row-at-a-time kernels' bits: y,
    mean, rstd, dX and the chunk sums, with a short last chunk and a chunk of zero dy."""
    ln = importlib.import_module("det_train.ops.layer_norm")
    g = torch.Generator().manual_seed(4)
    m, rows = 64 + 37, ln.MAX_ROWS_PER_CHUNK
    x = (3 * torch.randn(m, d, generator=g) + 1).bfloat16()
    dy = torch.randn(m, d, generator=g).bfloat16()
    dy[:rows] = 0
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16() if has_w else x
    b = (0.1 * torch.randn(d, generator=g)).bfloat16() if has_w else x
    block_d, n_chunks = triton.next_power_of_2(d), triton.cdiv(m, rows)
    fwd = []
    for per in (1, 32):
        y, mean, rstd = torch.empty_like(x[:64]), torch.empty(64), torch.empty(64)
        ln._layer_norm_fwd_kernel[(64 // per,)](
            x, w, b, y, mean, rstd, d, d, d, 1e-5, HAS_WEIGHT=has_w, HAS_BIAS=has_w, BLOCK_D=block_d, ROWS=per
        )
        fwd.append((y, mean, rstd))
    for name, tiled, row in zip(("y", "mean", "rstd"), fwd[1], fwd[0], strict=True):
        assert_bitwise_equal(tiled, row, f"{name}, D {d}: 32-row tiles vs rows")
    mean = x.float().mean(-1)
    rstd = torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-5)
    bwd = []
    for tile in (0, 1):
        dx, partial = torch.empty_like(x), torch.full((n_chunks, d), float("nan"))
        ln._layer_norm_bwd_kernel[(n_chunks,)](
            dy, x, w, mean, rstd, dx, partial, m, d, d, d, d, HAS_WEIGHT=has_w, ROWS_PER_CHUNK=rows,
            BLOCK_D=block_d, TILE=tile,
        )  # fmt: skip
        bwd.append((dx, partial))
    assert_bitwise_equal(bwd[1][0], bwd[0][0], f"dX, D {d}: chunk tile vs rows")
    if has_w:
        assert_bitwise_equal(bwd[1][1], bwd[0][1], f"chunk sums, D {d}: chunk tile vs rows")


def test_norm_interpreter_tiles_keep_nan_positions_and_every_other_bit():
    """With NaN and inf in the data, tiles and rows agree on where the NaNs are and on every other
    bit; only a NaN's sign and payload may differ (numpy's broadcast inner loop keeps the other
    operand of a NaN-and-NaN operation), which numpy's SIMD dispatch already varies."""
    ln = importlib.import_module("det_train.ops.layer_norm")
    m, d = 3, 32
    x = torch.ones(m, d)
    x[0, 0], x[1, 3] = float("inf"), float("nan")  # row 0: rstd 0, inf * 0; row 1: NaN throughout
    dy = torch.randn(m, d, generator=torch.Generator().manual_seed(5))
    dy[0, 1], dy[2, 5] = float("nan"), float("-nan")
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    mean = x.mean(-1)
    for rows in (1, 2):
        outs = []
        for tile in (0, 1):
            dx_r, dx_l, part = torch.empty(m, d), torch.empty(m, d), torch.empty(m, d)
            rms._rms_norm_bwd_kernel[(triton.cdiv(m, rows),)](
                dy, x, x, rstd, dx_r, part, m, d, d, d, d, HAS_WEIGHT=False, OFFSET=0.0, ROWS_PER_CHUNK=rows,
                BLOCK_D=d, PREFETCH=0, TILE=tile,
            )  # fmt: skip
            ln._layer_norm_bwd_kernel[(triton.cdiv(m, rows),)](
                dy, x, x, mean, rstd, dx_l, part, m, d, d, d, d, HAS_WEIGHT=False, ROWS_PER_CHUNK=rows,
                BLOCK_D=d, TILE=tile,
            )  # fmt: skip
            outs.append((dx_r, dx_l))
        for (row_dx, tile_dx), name in zip(zip(outs[0], outs[1], strict=True), ("rms", "ln"), strict=True):
            nan = torch.isnan(row_dx)
            assert nan.any() and torch.equal(nan, torch.isnan(tile_dx)), f"{name}, {rows} rows: NaN positions"
            assert_bitwise_equal(tile_dx[~nan], row_dx[~nan], f"{name}, {rows} rows: non-NaN bits")
