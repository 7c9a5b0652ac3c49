"""det_train.swiglu: ``silu(gate) * up`` of a packed (..., 2F) tensor, forward and packed backward.

Accuracy: fp32 math rounded once, so bf16 results are the fp64 reference rounded to bf16 except
where the fp32 arithmetic lands next to a rounding boundary (at most 1 ULP off); fp32 results within
a few fp32 ULPs. Determinism: row invariance (batch size, position) and run to run, forward and
gradient.
"""

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal, assert_row_invariant, assert_run_to_run
from det_train.reference import swiglu_fp64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype=dtype, device=DEVICE)


def _forward_and_grad(x: torch.Tensor) -> torch.Tensor:
    """``[y | dx]`` per row, with the output gradient ``dy = up / 2`` (a function of the row itself)."""
    x = x.detach().requires_grad_()
    y = det_train.swiglu(x)
    (dx,) = torch.autograd.grad(y, x, x.detach()[..., x.shape[-1] // 2 :] * 0.5)
    return torch.cat([y.detach(), dx], dim=-1)


def _ulps_from_rounded(got: torch.Tensor, exact: torch.Tensor) -> int:
    """Largest distance, in bf16 ULPs (bit-pattern steps of same-signed values), from ``exact`` rounded."""
    a = got.view(torch.int16).to(torch.int32)
    b = exact.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return int((a - b).abs().max())


def test_forward_and_packed_gradient_match_the_fp64_reference():
    x = _randn(4, 5, 2 * 40, seed=1)
    got = _forward_and_grad(x)
    xd = x.double().requires_grad_()
    y = swiglu_fp64(xd)
    (dx,) = torch.autograd.grad(y, xd, x.double()[..., 40:] * 0.5)
    want = torch.cat([y.detach(), dx], dim=-1)
    assert got.shape == (4, 5, 40 + 80) and got.dtype == torch.bfloat16
    assert _ulps_from_rounded(got.cpu(), want.cpu()) <= 1
    xf = x.float()
    got32 = _forward_and_grad(xf).double()
    torch.testing.assert_close(got32, want, rtol=4e-6, atol=1e-30)  # a few fp32 ULPs of fp32 math


def test_row_invariant_and_run_to_run():
    # 70 rows: two of the interpreter's 64-row programs, the second part-masked
    anchor = _randn(1, 2 * 24, seed=2)
    assert_row_invariant(
        _forward_and_grad, lambda m: _randn(m, 2 * 24, seed=3 + m), [1, 3, 17, 70], anchor, "swiglu"
    )
    assert_run_to_run(lambda: _forward_and_grad(_randn(9, 2 * 24, seed=4)), repeats=3)


def test_strided_input_gives_the_contiguous_bits():
    x = _randn(6, 4 * 8, seed=5)
    rows = x[::2]  # strided rows, unit last stride: used in place
    cols = x[:, ::2]  # non-unit last stride: copied
    assert_bitwise_equal(_forward_and_grad(rows), _forward_and_grad(rows.contiguous()), "strided rows")
    assert_bitwise_equal(_forward_and_grad(cols), _forward_and_grad(cols.contiguous()), "strided cols")
    assert det_train.swiglu(x[:0]).shape == (0, 16)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (torch.ones(3, 5), ValueError, "odd or empty|\\(\\.\\.\\., 2F\\)"),
        (torch.ones(3, 0), ValueError, "F >= 1"),
        (torch.ones(()), ValueError, "\\(\\.\\.\\., 2F\\)"),
        (torch.ones(3, 4, dtype=torch.int32), TypeError, "int32"),
        ([1.0, 2.0], TypeError, "torch.Tensor"),
    ],
)
def test_bad_input_raises_a_clear_error(bad, error, match):
    with pytest.raises(error, match=match):
        det_train.swiglu(bad.to(DEVICE) if isinstance(bad, torch.Tensor) else bad)


def test_direct_op_calls_check_the_layout():
    import importlib

    importlib.import_module("det_train.ops.swiglu")
    ops = torch.ops.det_train
    x = _randn(3, 8, seed=6)
    with pytest.raises(ValueError, match="unit last stride"):
        ops.swiglu.default(_randn(3, 16, seed=7)[:, ::2])
    with pytest.raises(ValueError, match="2-D"):
        ops.swiglu.default(_randn(2, 3, 8, seed=8))
    with pytest.raises(ValueError, match="dy must be"):
        ops.swiglu_backward.default(_randn(1, 2, seed=9), x)
