"""det_train.layer_norm: run-to-run, row invariance of y and dX, micro-batch invariance of dweight and
dbias (3+ parts, cuts inside leaves), accuracy against an fp64 reference, the module drop-in, bad
input. CPU through the Triton interpreter; `gpu` at real sizes."""

import det_train
import pytest
import torch
from det_core.testing import (
    assert_bitwise_equal,
    assert_row_invariant,
    assert_run_to_run,
    contiguous_splits,
)
from det_train.accum.grad_accum import DEFAULT_LEAF_TOKENS, CanonicalGradAccumulator
from det_train.reference_norms import layer_norm_reference

# max |err| / max |ref| against fp64, per output dtype (the rounding of the output dominates)
TOL = {torch.float32: 5e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _fwd_bwd(x, w, b, dy, eps=1e-5):
    x = x.detach().requires_grad_()
    w = None if w is None else w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = det_train.layer_norm(x, x.shape[-1:], w, b, eps)
    y.backward(dy)
    return y.detach(), x.grad, None if w is None else w.grad, None if b is None else b.grad


def _rows(m, d, dtype, seed, device="cpu"):
    """(M, 2, D): x in [:, 0] (with a per-row offset, so the mean matters) and dy in [:, 1]."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(m, 2, d, generator=g)
    r[:, 0] += 3 * torch.randn(m, 1, generator=g)
    return r.to(device=device, dtype=dtype)


def _params(d, dtype, device="cpu"):
    g = torch.Generator().manual_seed(9)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
    b = (0.1 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
    return w, b


def _check_row_invariance(dtype, d, sizes, device):
    w, b = _params(d, dtype, device)

    def fn(batch):
        y, dx, _, _ = _fwd_bwd(batch[:, 0], w, b, batch[:, 1])
        return torch.stack([y, dx], dim=1)

    anchor = _rows(1, d, dtype, seed=123, device=device)
    make = lambda m: _rows(m, d, dtype, seed=m, device=device)  # noqa: E731
    assert_row_invariant(fn, make, sizes, anchor, "layer_norm y/dX")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariance(dtype):
    _check_row_invariance(dtype, 40, [1, 3, 17, 65], "cpu")


def test_run_to_run():
    rows = _rows(33, 40, torch.bfloat16, 0)
    w, b = _params(40, torch.bfloat16)
    assert_run_to_run(lambda: _fwd_bwd(rows[:, 0], w, b, rows[:, 1]), repeats=3, name="layer_norm")


def _accumulated(x, dy, w0, b0, leaf, cuts):
    """LayerNorm (dweight, dbias) through the accumulator, the tokens cut into micro-batches ``cuts``."""
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    acc = CanonicalGradAccumulator([("w", w), ("b", b)], leaf_tokens=leaf)
    for start, end in cuts:
        with acc.micro_batch(token_offset=start):
            det_train.layer_norm(x[start:end], x.shape[-1:], w, b).backward(dy[start:end])
    acc.reduce(total_tokens=x.shape[0])
    return w.grad, b.grad


def test_micro_batch_invariance_of_dweight_and_dbias():
    """Leaf-aligned splits (3 parts) and splits of any size (3, 5 cuts inside leaves and
    inside 16-row chunks: the open leaf's rows are carried) give the bits of one batch; the plain
    backward of the whole batch equals the accumulator's result at the default leaf size."""
    leaf, tokens, d = 32, 3 * 32 + 3, 24  # two 16-row chunks per leaf, a short last leaf
    rows = _rows(tokens, d, torch.bfloat16, 5)
    x, dy = rows[:, 0], rows[:, 1]
    w0, b0 = _params(d, torch.bfloat16)
    whole = _accumulated(x, dy, w0, b0, leaf, [(0, tokens)])
    assert whole[0].dtype == whole[1].dtype == torch.bfloat16
    for parts in (3,):
        cuts = contiguous_splits(tokens - 3, parts, leaf)
        cuts[-1] = (cuts[-1][0], tokens)  # the last micro-batch also takes the short leaf
        got = _accumulated(x, dy, w0, b0, leaf, cuts)
        for name, g, e in zip(("dweight", "dbias"), got, whole, strict=True):
            assert_bitwise_equal(g, e, f"{name}, {parts} leaf-aligned micro-batches")
    for parts in (3, 5):
        got = _accumulated(x, dy, w0, b0, leaf, contiguous_splits(tokens, parts))
        for name, g, e in zip(("dweight", "dbias"), got, whole, strict=True):
            assert_bitwise_equal(g, e, f"{name}, {parts} cuts inside leaves")
    big = _accumulated(x, dy, w0, b0, DEFAULT_LEAF_TOKENS, [(0, tokens)])
    plain = _fwd_bwd(x, w0, b0, dy)
    assert_bitwise_equal(plain[2], big[0], "dweight: plain backward vs accumulator (default leaf)")
    assert_bitwise_equal(plain[3], big[1], "dbias: plain backward vs accumulator (default leaf)")


def test_bias_gradient_has_the_bits_of_a_linear_bias():
    """dbias is the canonical sum of dy over tokens, the order of a Linear's bias gradient."""
    rows = _rows(70, 24, torch.bfloat16, 2)
    x, dy = rows[:, 0], rows[:, 1]
    w, b = _params(24, torch.bfloat16)
    _, _, _, db = _fwd_bwd(x, w, b, dy)
    lin_w = torch.zeros(24, 24, dtype=torch.bfloat16)
    lin_b = b.clone().requires_grad_()
    det_train.linear(x.detach(), lin_w, lin_b).backward(dy)
    assert_bitwise_equal(db, lin_b.grad, "layer_norm dbias vs linear db")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accuracy_vs_fp64(dtype):
    rows = _rows(70, 96, dtype, 3)
    x, dy = rows[:, 0], rows[:, 1]
    w, b = _params(96, dtype)
    y, dx, dw, db = _fwd_bwd(x, w, b, dy)
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    ref = layer_norm_reference(xd, wd, bd, eps=1e-5)
    ref.backward(dy.double())
    expected = (("y", y, ref.detach()), ("dx", dx, xd.grad), ("dw", dw, wd.grad), ("db", db, bd.grad))
    for name, got, exp in expected:
        assert got.dtype == dtype
        err = (got.double() - exp).abs().max() / exp.abs().max()
        assert err <= TOL[dtype], f"{name}: relative error {err:.3g} > {TOL[dtype]}"


def test_module_drop_in_without_affine_and_without_bias():
    ref = torch.nn.LayerNorm(16, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = det_train.LayerNorm(16, eps=1e-6)
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    x = _rows(5, 16, torch.float32, 1)[:, 0]
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    plain = det_train.LayerNorm(16, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None
    torch.testing.assert_close(plain(x), torch.nn.functional.layer_norm(x, (16,)), rtol=1e-5, atol=1e-5)
    no_bias = det_train.LayerNorm(16, bias=False)
    y, dx, dw, _ = _fwd_bwd(x, no_bias.weight, None, torch.ones_like(x))
    assert no_bias.bias is None and dw.shape == (16,)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,)), rtol=1e-5, atol=1e-5)


def test_bad_input():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        det_train.layer_norm(x, (6,))
    with pytest.raises(ValueError, match="weight of shape"):
        det_train.layer_norm(x, (8,), torch.ones(7))
    with pytest.raises(ValueError, match="normalized size 0"):
        det_train.layer_norm(torch.randn(3, 0), (0,))
    with pytest.raises(TypeError, match="float64"):
        det_train.layer_norm(x.double(), (8,))
    with pytest.raises(ValueError, match="eps must be a finite number"):
        det_train.layer_norm(x, (8,), eps=-1.0)
    with pytest.raises(ValueError, match="contiguous"):
        det_train.layer_norm(x, (8,), torch.ones(16)[::2])
    with pytest.raises(TypeError, match="float64"):
        det_train.LayerNorm(8, dtype=torch.float64)
    # found by a new-user trial: an empty normalized_shape normalized nothing and returned zeros, as
    # for a 0-d x; LayerNorm(0) built and every forward failed
    with pytest.raises(ValueError, match=r"normalized_shape is \(\)"):
        det_train.layer_norm(x, ())
    with pytest.raises(ValueError, match=r"normalized_shape is \(\)"):
        det_train.layer_norm(torch.tensor(1.0), ())
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        det_train.layer_norm(torch.tensor(1.0), (1,))
    with pytest.raises(ValueError, match=r"det_train.LayerNorm: normalized_shape \(0,\) must have"):
        det_train.LayerNorm(0)


# ---------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_row_invariance_real_sizes(dtype):
    _check_row_invariance(dtype, 4096, [1, 2, 3, 17, 64, 65, 127, 128, 129, 1000, 4096], "cuda")


@pytest.mark.gpu
def test_gpu_micro_batch_invariance_and_accuracy():
    tokens, d = 8192, 4096
    rows = _rows(tokens, d, torch.bfloat16, 1, "cuda")
    x, dy = rows[:, 0], rows[:, 1]
    w0, b0 = _params(d, torch.bfloat16, "cuda")
    whole = _accumulated(x, dy, w0, b0, 1024, [(0, tokens)])
    for parts in (2, 3, 4, 8):
        got = _accumulated(x, dy, w0, b0, 1024, contiguous_splits(tokens, parts, 1024))
        for name, g, e in zip(("dweight", "dbias"), got, whole, strict=True):
            assert_bitwise_equal(g, e, f"{name}, {parts} micro-batches")
    whole = _accumulated(x, dy, w0, b0, DEFAULT_LEAF_TOKENS, [(0, tokens)])  # one leaf of 8192 tokens
    for parts in (3, 7):  # cuts inside the leaf
        got = _accumulated(x, dy, w0, b0, DEFAULT_LEAF_TOKENS, contiguous_splits(tokens, parts))
        for name, g, e in zip(("dweight", "dbias"), got, whole, strict=True):
            assert_bitwise_equal(g, e, f"{name}, {parts} cuts")
    y, dx, dw, db = _fwd_bwd(x, w0, b0, dy)
    assert_bitwise_equal(dw, whole[0], "dweight without accumulator (same default leaf)")
    assert_bitwise_equal(db, whole[1], "dbias without accumulator (same default leaf)")
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w0, b0))
    ref = layer_norm_reference(xd, wd, bd)
    ref.backward(dy.double())
    for name, got, exp in (
        ("y", y, ref.detach()),
        ("dx", dx, xd.grad),
        ("dw", dw, wd.grad),
        ("db", db, bd.grad),
    ):
        err = (got.double() - exp).abs().max() / exp.abs().max()
        assert err <= TOL[torch.bfloat16], f"{name}: relative error {err:.3g}"
