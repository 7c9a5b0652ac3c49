"""Property tests (hypothesis) of det_train's public ops over random shapes, dtypes and layouts.

matmul, linear, rms_norm, embedding and cross_entropy, each called on random small shapes
(0, 1, primes and tile edges), dtypes and operand layouts (column-major, strided views padded with
NaN so that a misread shows, broadcast rows with stride 0, broadcast batch dims). Every call either

- returns the documented shape and dtype, torch's result to the tolerance the op's own tests use,
  the bits of the same call on contiguous copies (no view is read as if it were contiguous) and
  the bits of each anchor row computed alone (row invariance; first, middle and last row), or
- raises a TypeError / ValueError whose message names the problem.

CPU through the Triton interpreter: shapes stay tiny and every test runs a few derandomized
examples (``derandomize=True``: the same examples on every run; no example database).
"""

from __future__ import annotations

import math

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal
from det_train.reference import matmul_fp64
from det_train.reference_norms import (
    cross_entropy_reference,
    embedding_weight_grad_reference,
    rms_norm_reference,
)
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = (torch.bfloat16, torch.float16)
DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])
# 0, 1, small primes and the interpreter's tile edges (matmul tiles 64 x 64, K steps of 64 / 32)
SIZES = st.sampled_from([0, 1, 2, 3, 5, 7, 13, 15, 16, 17, 31, 32, 33, 40])
K_SIZES = st.sampled_from([0, 1, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65])
SEEDS = st.integers(0, 2**16)
# operand layouts: the same values read through other strides (see _layout)
LAYOUTS = st.sampled_from(["contiguous", "col_major", "strided", "broadcast_rows"])


def _settings(examples: int):
    """Derandomized (the same examples every run, also in CI), no deadline (the interpreter is
    slow and its speed varies by host), no example database written to the repository, and no
    shrinking (a failing example is already tiny; shrinking it under the interpreter can take
    minutes, which would unbound the suite's time)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
    )


def _randn(shape, dtype, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen)).to(dtype=dtype, device=DEVICE)


def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (at least 2-D) through other strides. ``col_major``: the last two dims transposed in
    memory; ``strided``: every other row of a wider NaN-filled buffer, 3 columns in (any element
    read outside the view is NaN); ``broadcast_rows`` / ``broadcast_batch``: row / batch element 0
    repeated with stride 0 (the values change: compare against ``.contiguous()`` of the result)."""
    if kind == "contiguous":
        return t
    if kind == "col_major":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "strided":
        *lead, rows, cols = t.shape
        buf = torch.full((*lead, 2 * rows, cols + 3), float("nan"), dtype=t.dtype, device=t.device)
        view = buf[..., ::2, 3:]
        view.copy_(t)
        return view
    if kind == "broadcast_rows":
        return t[..., :1, :].expand(t.shape) if t.shape[-2] else t
    if kind == "broadcast_batch":  # batch element 0 repeated with batch stride 0
        return t[:1].expand(t.shape) if t.dim() > 2 and t.shape[0] else t
    raise AssertionError(kind)


def _anchors(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1}) if n else []


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def _check_close_to_fp64(name, ours, theirs, ref, dtype):
    """matmul / linear's tolerance (test_matmul.py, test_linear.py): bf16 / fp16 relative error
    (Frobenius) against fp64 at most twice torch's (fp32 math rounded once) and below 4e-3 / 6e-4;
    fp32 below 1e-6 (IEEE, no TF32). An all-zero reference must be met exactly."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    if float(ref.norm()) == 0.0:
        assert bool((ours == 0).all()), f"{name}: the exact result is 0"
        return
    err = _rel_err(ours, ref)
    if dtype == torch.float32:
        assert err < 1e-6, f"{name}: fp32 relative error {err:.3g}"
        return
    torch_err = _rel_err(theirs, ref)
    assert err <= 2 * torch_err, f"{name}: relative error {err:.3g} > 2 x torch's {torch_err:.3g}"
    assert err < {torch.bfloat16: 4e-3, torch.float16: 6e-4}[dtype], f"{name}: relative error {err:.3g}"


def _check_max_rel(name, ours, ref, tol):
    """max |ours - ref| / max |ref| <= tol (rms_norm's and cross_entropy's measure); an all-zero
    reference must be met exactly."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    scale = float(ref.abs().max())
    if scale == 0.0:
        assert bool((ours == 0).all()), f"{name}: the exact result is 0"
        return
    err = float((ours.double() - ref).abs().max()) / scale
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


# ============================================================================ matmul

# (a's batch dims, b's batch dims): none, one side, both, broadcast over size-1 and missing dims,
# and an empty batch
BATCHES = st.sampled_from(
    [((), ()), ((3,), ()), ((), (2,)), ((2,), (2,)), ((2, 1), (3,)), ((1,), (3,)), ((0,), ())]
)


MATMUL_LAYOUTS = st.sampled_from(["contiguous", "col_major", "strided", "broadcast_rows", "broadcast_batch"])


@_settings(40)
@given(
    dtype=DTYPES,
    m=SIZES,
    k=K_SIZES,
    n=SIZES,
    batch=BATCHES,
    a_layout=MATMUL_LAYOUTS,
    b_layout=MATMUL_LAYOUTS,
    seed=SEEDS,
)
@example(torch.bfloat16, 65, 65, 17, ((), ()), "strided", "col_major", 1)  # tile edges in M and K
@example(torch.float32, 33, 33, 63, ((2,), (2,)), "col_major", "strided", 2)  # fp32 K step 32
@example(torch.float16, 0, 5, 3, ((), ()), "contiguous", "contiguous", 3)  # M = 0
# an operand of 0 elements with batch dims (K = 0: zeros; an empty batch): reshape(-1, ...) raised
# torch's "cannot reshape tensor of 0 elements" RuntimeError (fixed in matmul._broadcast)
@example(torch.bfloat16, 4, 0, 3, ((3,), ()), "strided", "contiguous", 4)
@example(torch.float32, 4, 0, 3, ((2,), (2,)), "contiguous", "broadcast_batch", 5)
@example(torch.float32, 4, 3, 5, ((0,), ()), "contiguous", "contiguous", 6)
@example(torch.float16, 7, 17, 5, ((3,), (3,)), "broadcast_batch", "broadcast_rows", 7)
def test_matmul_matches_torch_bits_of_contiguous_and_row_invariant(
    dtype, m, k, n, batch, a_layout, b_layout, seed
):
    g = torch.Generator().manual_seed(seed)
    a = _layout(_randn((*batch[0], m, k), dtype, g), a_layout)
    b = _layout(_randn((*batch[1], k, n), dtype, g), b_layout)
    out = det_train.matmul(a, b)
    shape = (*torch.broadcast_shapes(batch[0], batch[1]), m, n)
    assert out.shape == shape and out.dtype == dtype, (tuple(out.shape), out.dtype)
    if out.numel() == 0:
        return
    ac, bc = a.contiguous(), b.contiguous()
    assert_bitwise_equal(out, det_train.matmul(ac, bc), f"{a_layout} @ {b_layout} vs contiguous")
    torch_out = torch.matmul(ac.float(), bc.float()).to(dtype)
    _check_close_to_fp64("matmul", out, torch_out, matmul_fp64(ac, bc), dtype)
    for i in _anchors(m):  # a row alone: the same bits as in the batch of M rows
        assert_bitwise_equal(
            det_train.matmul(a[..., i : i + 1, :], b), out[..., i : i + 1, :], f"row {i} of {m}"
        )
    for j in _anchors(n):  # a column alone (the result does not depend on N either)
        assert_bitwise_equal(
            det_train.matmul(a, b[..., j : j + 1]), out[..., j : j + 1], f"column {j} of {n}"
        )
    if len(shape) > 2:  # the last batch element alone
        z = math.prod(shape[:-2])
        a_last = a.expand(*shape[:-2], m, k).reshape(z, m, k)[-1]
        last = det_train.matmul(a_last, b.expand(*shape[:-2], k, n).reshape(z, k, n)[-1])
        assert_bitwise_equal(last, out.reshape(z, m, n)[-1], "last batch element alone")


# bad matmul input: (a, b) makers and the error they must raise
def _bad_matmul(kind: str, m: int, k: int, n: int):
    r = torch.ones
    if kind == "inner":
        return (
            r(m, k, dtype=torch.bfloat16),
            r(k + 1, n, dtype=torch.bfloat16),
            ValueError,
            "inner dims differ",
        )
    if kind == "dtype_mix":
        return r(m, k, dtype=torch.bfloat16), r(k, n, dtype=torch.float16), TypeError, "one dtype"
    if kind == "float64":
        return r(m, k, dtype=torch.float64), r(k, n, dtype=torch.float64), TypeError, "float64; supported"
    if kind == "int32":
        return r(m, k, dtype=torch.int32), r(k, n, dtype=torch.int32), TypeError, "int32; supported"
    if kind == "vector":
        return r(k, dtype=torch.float32), r(k, n, dtype=torch.float32), ValueError, "at least 2 dims"
    if kind == "batch":
        return (
            r(2, m, k, dtype=torch.float32),
            r(3, k, n, dtype=torch.float32),
            ValueError,
            r"batch dims do not broadcast",
        )
    if kind == "not_a_tensor":
        return [[1.0] * k] * m, r(k, n), TypeError, "a must be a torch.Tensor, got list"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["inner", "dtype_mix", "float64", "int32", "vector", "batch", "not_a_tensor"]
)
@_settings(3)
@given(
    m=SIZES,
    k=SIZES,
    n=SIZES,
)
def test_matmul_bad_input_raises_a_clear_error(kind, m, k, n):
    a, b, error, match = _bad_matmul(kind, m, k, n)
    with pytest.raises(error, match=match):
        det_train.matmul(a, b)


# ============================================================================ linear

# leading dims of x: none (a single row), tokens, (batch, tokens)
LEADS = st.sampled_from([(), (1,), (3,), (7,), (17,), (33,), (0,), (2, 5), (3, 0)])


def _leaf_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``_layout(t, kind)`` as a leaf of autograd (or a view of one) whose ``.grad`` is kept."""
    if t.dim() < 2:
        return t.clone().requires_grad_()
    base = _layout(t, kind)
    if base._base is not None:  # a view (of a NaN-padded buffer): the buffer is the leaf
        buf = base._base.detach().requires_grad_()
        view = buf.as_strided(base.shape, base.stride(), base.storage_offset())
    else:
        view = base.detach().requires_grad_()
    view.retain_grad()
    return view


def _leaf(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A new autograd leaf holding ``t`` in ``dtype`` (None stays None)."""
    return None if t is None else t.detach().to(dtype).clone().requires_grad_()


def _linear_grads(x, w, bias, dy):
    """``(y, dx, dw, db)`` of ``det_train.ops.linear`` on leaves made from x, w, bias."""
    y = det_train.linear(x, w, bias)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, None if bias is None else bias.grad


@_settings(25)
@given(
    dtype=DTYPES,
    lead=LEADS,
    k=K_SIZES,
    n=SIZES,
    has_bias=st.booleans(),
    x_layout=LAYOUTS,
    w_layout=st.sampled_from(["contiguous", "col_major", "strided"]),
    frozen=st.sampled_from([None, "x", "weight", "bias"]),  # an input that requires no gradient
    seed=SEEDS,
)
@example(torch.bfloat16, (2, 5), 65, 33, True, "strided", "col_major", None, 5)
@example(torch.float32, (33,), 33, 17, True, "col_major", "strided", "x", 6)
@example(torch.bfloat16, (3,), 0, 5, True, "contiguous", "contiguous", None, 7)  # K = 0: y = bias
@example(torch.float16, (3, 0), 5, 4, True, "contiguous", "contiguous", None, 8)  # no tokens
@example(torch.bfloat16, (4,), 5, 0, False, "contiguous", "contiguous", "weight", 9)  # N = 0
def test_linear_forward_backward_match_torch_and_are_row_invariant(
    dtype, lead, k, n, has_bias, x_layout, w_layout, frozen, seed
):
    g = torch.Generator().manual_seed(seed)
    x0, w0 = _randn((*lead, k), dtype, g), _randn((n, k), dtype, g)
    b0 = _randn((n,), dtype, g) if has_bias else None
    dy = _randn((*lead, n), dtype, g)
    x, w = _leaf_view(x0, x_layout), _leaf_view(w0, w_layout)
    bias = _leaf(b0, dtype)
    if frozen == "x":
        x = x.detach()
    elif frozen == "weight":
        w = w.detach()
    elif frozen == "bias" and bias is not None:
        bias = bias.detach()
    y, dx, dw, db = _linear_grads(x, w, bias, dy)
    assert y.shape == (*lead, n) and y.dtype == dtype
    assert (dx is None) == (frozen == "x") and (dw is None) == (frozen == "weight")
    assert (db is None) == (b0 is None or frozen == "bias")
    assert (dx is None or dx.shape == x.shape) and (dw is None or dw.shape == w.shape)
    assert db is None or db.shape == (n,)
    # the same call on contiguous copies gives the same bits (x may hold broadcast rows)
    xc, wc = x.detach().contiguous(), w.detach().contiguous()
    contiguous = _linear_grads(*(_leaf(t, dtype) for t in (xc, wc, b0)), dy)
    for name, got, want in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), contiguous, strict=True):
        if got is not None:
            assert_bitwise_equal(got, want, f"linear {name}: {x_layout} x, {w_layout} w vs contiguous")
    # torch (fp32 math rounded once) and fp64
    xt, wt, bt = (_leaf(t, torch.float32) for t in (xc, wc, b0))
    yt = torch.nn.functional.linear(xt, wt, bt)
    yt.backward(dy.float())
    x64, w64, b64 = (_leaf(t, torch.float64) for t in (xc, wc, b0))
    y64 = torch.nn.functional.linear(x64, w64, b64)
    y64.backward(dy.double())
    pairs = [("y", y, yt, y64), ("dx", dx, xt.grad, x64.grad), ("dw", dw, wt.grad, w64.grad)]
    if b0 is not None:
        pairs.append(("db", db, bt.grad, b64.grad))
    for name, ours, theirs, ref in pairs:
        if ours is not None:
            _check_close_to_fp64(f"linear {name}", ours, theirs.detach().to(dtype), ref.detach(), dtype)
    # a token alone: its y and dx rows are the bits of the batch's
    rows = math.prod(lead)
    x2, dy2, y2, dx2 = (
        xc.reshape(rows, k),
        dy.reshape(rows, n),
        y.reshape(rows, n),
        contiguous[1].reshape(rows, k),
    )
    for i in _anchors(rows):
        xi = x2[i : i + 1].clone().requires_grad_()
        yi = det_train.linear(xi, wc, None if b0 is None else b0)
        yi.backward(dy2[i : i + 1])
        assert_bitwise_equal(yi.detach(), y2[i : i + 1], f"y row {i} of {rows}")
        assert_bitwise_equal(xi.grad, dx2[i : i + 1], f"dx row {i} of {rows}")


def _bad_linear(kind: str, k: int, n: int):
    x, w = torch.ones(3, k), torch.ones(n, k)
    if kind == "in_features":
        return torch.ones(3, k + 1), w, None, ValueError, f"last dim must equal in_features={k}"
    if kind == "weight_1d":
        return x, torch.ones(k), None, ValueError, "weight must be 2-D"
    if kind == "dtype_mix":
        return x.bfloat16(), w, None, TypeError, "must have one dtype"
    if kind == "float64":
        return x.double(), w.double(), None, TypeError, "float64; supported"
    if kind == "bias_len":
        return x, w, torch.ones(n + 1), ValueError, f"bias must be a 1-D tensor of {n} elements"
    if kind == "bias_list":  # found by these tests: a ValueError, where linear documents a TypeError
        return x, w, [0.0] * n, TypeError, f"bias must be a 1-D tensor of {n} elements, got list"
    if kind == "bias_dtype":
        return x, w, torch.ones(n, dtype=torch.float16), TypeError, "bias dtype"
    if kind == "x_0d":
        return torch.tensor(1.0), w, None, ValueError, "last dim must equal in_features"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["in_features", "weight_1d", "dtype_mix", "float64", "bias_len", "bias_list", "bias_dtype", "x_0d"],
)
@_settings(3)
@given(
    k=SIZES,
    n=SIZES,
)
def test_linear_bad_input_raises_a_clear_error(kind, k, n):
    x, w, bias, error, match = _bad_linear(kind, k, n)
    with pytest.raises(error, match=match):
        det_train.linear(x, w, bias)


# ============================================================================ rms_norm

# max |err| / max |ref| against fp64 per output dtype (test_rms_norm.py's TOL)
RMS_TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
D_SIZES = st.sampled_from([1, 2, 3, 5, 15, 16, 17, 31, 32, 33, 40, 63, 64, 65])


def _rms_grads(x, w, dy, **kw):
    y = det_train.rms_norm(x, w, **kw)
    y.backward(dy)
    return y.detach(), x.grad, None if w is None else w.grad


@_settings(20)
@given(
    dtype=DTYPES,
    lead=LEADS,
    d=D_SIZES,
    two_dims=st.booleans(),  # normalized_shape (3, D): a row is (3, D), read through x's strides
    weight=st.sampled_from(["same", "none", "float32"]),
    offset=st.sampled_from([0.0, 1.0]),
    eps=st.sampled_from([None, 1e-5]),
    x_layout=LAYOUTS,
    seed=SEEDS,
)
@example(torch.bfloat16, (2, 5), 65, False, "same", 0.0, None, "strided", 10)
@example(torch.float32, (17,), 33, False, "same", 1.0, 1e-5, "col_major", 11)
@example(torch.float16, (0,), 16, False, "same", 0.0, None, "contiguous", 12)  # no rows
@example(torch.bfloat16, (7,), 17, True, "float32", 0.0, None, "col_major", 13)  # (3, D) transposed
def test_rms_norm_matches_fp64_bits_of_contiguous_and_row_invariant(
    dtype, lead, d, two_dims, weight, offset, eps, x_layout, seed
):
    g = torch.Generator().manual_seed(seed)
    feat = (3, d) if two_dims else (d,)
    size = math.prod(feat)
    w_dtype = {"same": dtype, "none": None, "float32": torch.float32}[weight]
    offset = offset if w_dtype is not None else 0.0
    x0 = _randn((*lead, *feat), dtype, g)
    w0 = None if w_dtype is None else _randn(feat, w_dtype, g, 0.1) + (1.0 - offset)
    out_dtype = dtype if w_dtype is None else torch.promote_types(dtype, w_dtype)
    dy = _randn((*lead, *feat), out_dtype, g)
    kw = dict(eps=eps, normalized_shape=feat, offset=offset)
    x, w = _leaf_view(x0, x_layout), _leaf(w0, w_dtype)
    y, dx, dw = _rms_grads(x, w, dy, **kw)
    assert y.shape == x.shape and y.dtype == out_dtype and dx.shape == x.shape
    assert dw is None or (dw.shape == feat and dw.dtype == w_dtype)
    xc = x.detach().contiguous()
    contiguous = _rms_grads(_leaf(xc, dtype), _leaf(w0, w_dtype), dy, **kw)
    for name, got, want in zip(("y", "dx", "dw"), (y, dx, dw), contiguous, strict=True):
        if got is not None:
            assert_bitwise_equal(got, want, f"rms_norm {name}: {x_layout} x vs contiguous")
    # the reference normalizes the last dim: rows flattened to (..., 3 D)
    x64 = _leaf(xc.reshape(*lead, size), torch.float64)
    w64 = None if w0 is None else _leaf(w0.reshape(size), torch.float64)
    ref = rms_norm_reference(x64, w64, eps=torch.finfo(dtype).eps if eps is None else eps, offset=offset)
    ref.backward(dy.reshape(*lead, size).double())
    refs = [("y", y, ref.detach(), out_dtype)]
    if size > 1 or dtype != torch.float32:  # fp32, D = 1: dx = w dy eps / (x^2 + eps)^1.5 is what a
        # cancellation leaves, below the fp32 resolution of its terms (torch's own fp32 backward is
        # off by O(1) there too); its bits are still checked above and below
        refs.append(("dx", dx, x64.grad, dtype))
    if w is not None:
        refs.append(("dw", dw, w64.grad, w_dtype))
    for name, got, want, want_dtype in refs:
        assert got.dtype == want_dtype, f"{name}: dtype {got.dtype} != {want_dtype}"
        _check_max_rel(f"rms_norm {name}", got.reshape(want.shape), want, RMS_TOL[want_dtype])
    rows = math.prod(lead)
    for i in _anchors(rows):  # a row alone: its y and dx are the batch's bits
        xi = _leaf(xc.reshape(rows, *feat)[i : i + 1], dtype)
        yi = det_train.rms_norm(xi, w0, **kw)
        yi.backward(dy.reshape(rows, *feat)[i : i + 1])
        assert_bitwise_equal(yi.detach(), y.reshape(rows, *feat)[i : i + 1], f"y row {i} of {rows}")
        assert_bitwise_equal(xi.grad, dx.reshape(rows, *feat)[i : i + 1], f"dx row {i} of {rows}")


def _bad_rms_norm(kind: str, d: int):
    x = torch.ones(3, d)
    if kind == "weight_size":
        return (x, torch.ones(d + 1)), {}, ValueError, "does not match x's trailing dims"
    if kind == "empty_row":
        return (torch.ones(3, 0),), {}, ValueError, "normalized size must be >= 1"
    if kind == "eps":
        return (x,), {"eps": -1.0}, ValueError, "eps must be a finite number >= 0"
    if kind == "float64":
        return (x.double(),), {}, TypeError, "float64 is not supported"
    if kind == "int":
        return (x.long(),), {}, TypeError, "must be a floating-point tensor"
    if kind == "weight_strided":
        return (x, torch.ones(d, 2)[:, 0]), {}, ValueError, "weight must be contiguous"
    if kind == "offset_without_weight":
        return (x,), {"offset": 1.0}, ValueError, "there is none"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["weight_size", "empty_row", "eps", "float64", "int", "weight_strided", "offset_without_weight"]
)
@_settings(3)
@given(
    d=st.sampled_from([2, 3, 16, 17]),
)
def test_rms_norm_bad_input_raises_a_clear_error(kind, d):
    args, kw, error, match = _bad_rms_norm(kind, d)
    with pytest.raises(error, match=match):
        det_train.rms_norm(*args, **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        pytest.param(
            {"eps": True},
            "rms_norm: eps",
            id="eps_bool",
        ),
        pytest.param(
            {"eps": "1e-5"},
            "rms_norm: eps",
            id="eps_str",
        ),
        pytest.param(
            {"eps": [1e-5]},
            "rms_norm: eps",
            id="eps_list",
        ),
        pytest.param(
            {"normalized_shape": 4.0},
            "rms_norm: normalized_shape",
            id="normalized_shape_float",
        ),
    ],
)
def test_rms_norm_non_numeric_arguments_raise_a_type_error_naming_them(kw, match):
    with pytest.raises(TypeError, match=match):
        det_train.rms_norm(torch.randn(2, 4, device=DEVICE), **kw)


# ============================================================================ embedding

ID_SHAPES = st.sampled_from([(), (1,), (5,), (17,), (33,), (0,), (3, 7), (2, 0)])


@_settings(20)
@given(
    dtype=DTYPES,
    ids_shape=ID_SHAPES,
    v=st.sampled_from([1, 2, 7, 16, 17, 40]),
    d=st.sampled_from([0, 1, 3, 16, 17, 33]),
    ids_dtype=st.sampled_from([torch.int64, torch.int32]),
    padding=st.sampled_from([None, 0, -1]),
    w_layout=st.sampled_from(["contiguous", "col_major", "strided"]),
    dy_layout=LAYOUTS,
    seed=SEEDS,
)
@example(torch.bfloat16, (3, 7), 7, 17, torch.int32, -1, "strided", "strided", 13)  # repeated ids
@example(torch.float32, (0,), 5, 3, torch.int64, None, "contiguous", "contiguous", 14)  # no tokens
@example(torch.float16, (5,), 4, 0, torch.int64, None, "contiguous", "contiguous", 15)  # D = 0
def test_embedding_forward_is_a_gather_and_grad_the_canonical_sum(
    dtype, ids_shape, v, d, ids_dtype, padding, w_layout, dy_layout, seed
):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, ids_shape, generator=g).to(dtype=ids_dtype, device=DEVICE)
    if ids.dim():  # ids through strides too: every other entry of a buffer holding out-of-range ids
        buf = torch.full((*ids_shape[:-1], 2 * ids_shape[-1]), v, dtype=ids_dtype, device=DEVICE)
        buf[..., ::2] = ids
        ids = buf[..., ::2]
    w = _leaf_view(_randn((v, d), dtype, g), w_layout)
    dy = _layout(_randn((max(math.prod(ids_shape), 1), d), dtype, g), dy_layout)
    dy = dy[: math.prod(ids_shape)].reshape(*ids_shape, d)  # may be a strided view
    out = det_train.embedding(ids, w, padding_idx=padding)
    assert out.shape == (*ids_shape, d) and out.dtype == dtype
    expected = torch.nn.functional.embedding(ids.long(), w.detach())
    assert_bitwise_equal(out.detach(), expected, "forward vs torch's gather")
    out.backward(dy)
    grad = w.grad
    assert grad is not None and grad.shape == (v, d) and grad.dtype == dtype
    # the definition: dy rows summed per id in token order from +0.0 (one leaf here), padded tokens
    # adding nothing
    flat = ids.reshape(-1).long()
    dy_used = dy.reshape(flat.shape[0], d).contiguous()
    if padding is not None:
        dy_used = torch.where((flat == padding % v).unsqueeze(1), 0.0, dy_used)
    if flat.numel():
        ref = embedding_weight_grad_reference(flat, dy_used, v, 1024).to(dtype)
    else:  # no tokens: an exact zero table (the reference's reshape cannot infer D from 0 rows)
        ref = torch.zeros(v, d, dtype=dtype, device=DEVICE)
    assert_bitwise_equal(grad, ref, "weight grad vs its canonical definition")
    exact = torch.zeros(v, d, dtype=torch.float64).index_add_(0, flat, dy_used.double())
    torch.testing.assert_close(grad.double(), exact, rtol=1e-2, atol=1e-2)


# ============================================================================ cross_entropy

# dlogits, max |err| / max |ref| against fp64 for half logits (test_cross_entropy.py); fp32 logits:
# assert_close(rtol=1e-5, atol=1e-9); the loss: relative 1e-6 (fp32 math on exact inputs)
CE_GRAD_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
V_SIZES = st.sampled_from([1, 2, 3, 5, 16, 17, 31, 32, 33, 40, 64, 65])


def _ce(logits, targets, **kw):
    loss = det_train.cross_entropy(logits, targets, **kw)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), logits.grad


@_settings(20)
@given(
    dtype=DTYPES,
    lead=LEADS,
    v=V_SIZES,
    # "global": the mean over num_global_tokens (the tokens of every micro-batch), here 5 more
    reduction=st.sampled_from(["mean", "sum", "none", "global"]),
    ignore=st.sampled_from(["none", "some", "all"]),
    ignore_index=st.sampled_from([-100, 0]),  # 0: a class id as the ignored target
    targets_dtype=st.sampled_from([torch.int64, torch.int32]),
    layout=LAYOUTS,
    seed=SEEDS,
)
@example(torch.bfloat16, (2, 5), 65, "mean", "some", -100, torch.int32, "strided", 16)
@example(torch.float32, (17,), 33, "none", "some", 0, torch.int64, "col_major", 17)
@example(torch.float16, (0,), 5, "sum", "none", -100, torch.int64, "contiguous", 18)  # no tokens: 0
@example(torch.float32, (3,), 4, "mean", "all", -100, torch.int64, "contiguous", 19)  # none counted: NaN
@example(torch.bfloat16, (7,), 16, "global", "all", 0, torch.int64, "broadcast_rows", 20)
def test_cross_entropy_matches_fp64_bits_of_contiguous_and_row_invariant(
    dtype, lead, v, reduction, ignore, ignore_index, targets_dtype, layout, seed
):
    g = torch.Generator().manual_seed(seed)
    logits0 = _randn((*lead, v), dtype, g, 3.0)
    targets = torch.randint(0, v, lead, generator=g)
    if ignore != "none":
        drop = torch.rand(lead, generator=g) < (0.3 if ignore == "some" else 2.0)
        targets = torch.where(drop, ignore_index, targets)
    targets = targets.to(dtype=targets_dtype, device=DEVICE)
    counted = int((targets != ignore_index).sum())
    kw = dict(ignore_index=ignore_index, reduction="mean" if reduction == "global" else reduction)
    if reduction == "global":
        kw["num_global_tokens"] = counted + 5
    logits = _leaf_view(logits0, layout)
    loss, grad = _ce(logits, targets, **kw)
    assert loss.dtype == torch.float32 and loss.shape == (lead if reduction == "none" else ())
    assert grad.shape == logits.shape and grad.dtype == dtype
    lc = logits.detach().contiguous()
    contiguous = _ce(_leaf(lc, dtype), targets, **kw)
    assert_bitwise_equal(loss, contiguous[0], f"loss: {layout} logits vs contiguous")
    assert_bitwise_equal(grad, contiguous[1], f"dlogits: {layout} logits vs contiguous")
    l64 = _leaf(lc, torch.float64)
    ref = cross_entropy_reference(l64, targets.long(), **kw)
    ref.backward(torch.ones_like(ref))
    if reduction == "mean" and counted == 0:
        assert bool(loss.isnan()), "a mean over no counted tokens is NaN (as torch)"
    else:
        _check_max_rel("loss", loss, ref.detach(), 1e-6)
        if dtype == torch.float32:
            torch.testing.assert_close(grad.double(), l64.grad, rtol=1e-5, atol=1e-9)
        else:
            _check_max_rel("dlogits", grad, l64.grad, CE_GRAD_TOL[dtype])
    ignored = targets.reshape(-1) == ignore_index
    assert bool((grad.reshape(-1, v)[ignored] == 0).all()), "ignored tokens: gradient 0"
    if reduction != "none":
        return
    rows = math.prod(lead)
    for i in _anchors(rows):  # a token alone: its loss and dlogits row are the batch's bits
        row = _leaf(lc.reshape(rows, v)[i : i + 1], dtype)
        li, gi = _ce(row, targets.reshape(rows)[i : i + 1], **kw)
        assert_bitwise_equal(li, loss.reshape(rows)[i : i + 1], f"loss of token {i} of {rows}")
        assert_bitwise_equal(gi, grad.reshape(rows, v)[i : i + 1], f"dlogits of token {i} of {rows}")
