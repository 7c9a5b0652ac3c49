"""det_train.rms_norm: run-to-run, row invariance of y and dX, micro-batch invariance of dweight,
accuracy against an fp64 reference, bad input. CPU through the Triton interpreter; `gpu` at real sizes."""

import det_train
import pytest
import torch
from det_core.testing import (
    assert_bitwise_equal,
    assert_row_invariant,
    assert_run_to_run,
    contiguous_splits,
    digest,
    run_in_fresh_process,
)
from det_train.accum.grad_accum import DEFAULT_LEAF_TOKENS, CanonicalGradAccumulator
from det_train.reference_norms import rms_norm_reference

# max |err| / max |ref| against fp64, per output dtype (the rounding of the output dominates)
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _fwd_bwd(x, w, dy):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = det_train.rms_norm(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _rows(m, d, dtype, seed, device="cpu"):
    """(M, 2, D): x in [:, 0] and dy in [:, 1], so a row carries its own upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, 2, d, generator=g).to(device=device, dtype=dtype)


def _check_row_invariance(dtype, d, sizes, device):
    w = torch.randn(d, generator=torch.Generator().manual_seed(9)).to(device=device, dtype=dtype)

    def fn(batch):
        y, dx, _ = _fwd_bwd(batch[:, 0], w, batch[:, 1])
        return torch.stack([y, dx], dim=1)

    anchor = _rows(1, d, dtype, seed=123, device=device)
    assert_row_invariant(
        fn, lambda m: _rows(m, d, dtype, seed=m, device=device), sizes, anchor, "rms_norm y/dX"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariance(dtype):
    _check_row_invariance(dtype, 48, [1, 2, 3, 17, 64, 65], "cpu")


def test_run_to_run():
    b = _rows(33, 40, torch.bfloat16, 0)
    w = torch.randn(40, dtype=torch.bfloat16)
    assert_run_to_run(lambda: _fwd_bwd(b[:, 0], w, b[:, 1]), repeats=3, name="rms_norm")


def test_fresh_process_cold_cache():
    code = (
        "import torch, det_train\n"
        "from det_core.testing import digest\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(33, 40, generator=g).bfloat16().requires_grad_()\n"
        "w = torch.randn(40, generator=g).bfloat16().requires_grad_()\n"
        "dy = torch.randn(33, 40, generator=g).bfloat16()\n"
        "y = det_train.rms_norm(x, w); y.backward(dy)\n"
        "print(digest([y, x.grad, w.grad]))\n"
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 40, generator=g).bfloat16()
    w = torch.randn(40, generator=g).bfloat16()
    dy = torch.randn(33, 40, generator=g).bfloat16()
    assert run_in_fresh_process(code, env={"TRITON_INTERPRET": "1"}) == digest(list(_fwd_bwd(x, w, dy)))


def _accumulated_dweight(x, dy, w0, leaf, cuts):
    """RMSNorm dweight through the accumulator, the tokens cut into micro-batches ``cuts``."""
    w = w0.clone().requires_grad_()
    acc = CanonicalGradAccumulator([w], leaf_tokens=leaf)
    for start, end in cuts:
        with acc.micro_batch(token_offset=start):
            det_train.rms_norm(x[start:end], w).backward(dy[start:end])
    acc.reduce(total_tokens=x.shape[0])
    return w.grad


@pytest.mark.parametrize(("leaf", "n_leaves", "all_parts"), [(4, 8, (2, 3, 4, 8)), (32, 4, (3, 4))])
def test_micro_batch_invariance_of_dweight(leaf, n_leaves, all_parts):
    # leaf 4: one chunk per leaf; leaf 32: two chunks of 16 rows per leaf
    tokens, d = n_leaves * leaf + 3, 24  # short last leaf
    b = _rows(tokens, d, torch.bfloat16, 5)
    x, dy = b[:, 0], b[:, 1]
    w0 = torch.randn(d).bfloat16()
    whole = _accumulated_dweight(x, dy, w0, leaf, [(0, tokens)])
    assert whole.dtype == torch.bfloat16
    for parts in all_parts:
        cuts = contiguous_splits(tokens - 3, parts, leaf)
        cuts[-1] = (cuts[-1][0], tokens)  # the last micro-batch also takes the short leaf
        got = _accumulated_dweight(x, dy, w0, leaf, cuts)
        assert_bitwise_equal(got, whole, f"dweight, {parts} micro-batches, leaf {leaf}")


@pytest.mark.parametrize("leaf", [4, 32])
def test_micro_batches_of_any_size_give_the_bits_of_one_batch(leaf):
    """Boundaries inside leaves and inside 16-row chunks: the open leaf's rows (dy, x, rstd) are
    carried and its chunk sums computed from all its rows by the backward kernel."""
    tokens, d = 4 * 32 + 3, 24
    b = _rows(tokens, d, torch.bfloat16, 5)
    x, dy = b[:, 0], b[:, 1]
    w0 = torch.randn(d).bfloat16()
    whole = _accumulated_dweight(x, dy, w0, leaf, [(0, tokens)])
    for parts in (2, 3, 7):
        got = _accumulated_dweight(x, dy, w0, leaf, contiguous_splits(tokens, parts))
        assert_bitwise_equal(got, whole, f"dweight, {parts} cuts, leaf {leaf}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accuracy_vs_fp64(dtype):
    b = _rows(70, 96, dtype, 3)
    x, dy = b[:, 0], b[:, 1]
    w = (1 + 0.1 * torch.randn(96)).to(dtype)
    y, dx, dw = _fwd_bwd(x, w, dy)
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    ref = rms_norm_reference(xd, wd, eps=torch.finfo(dtype).eps)
    ref.backward(dy.double())
    for name, got, exp in (("y", y, ref.detach()), ("dx", dx, xd.grad), ("dw", dw, wd.grad)):
        assert got.dtype == dtype
        err = (got.double() - exp).abs().max() / exp.abs().max()
        assert err <= TOL[dtype], f"{name}: relative error {err:.3g} > {TOL[dtype]}"


def test_bf16_outputs_round_to_nearest():
    """y and dX in bf16 are the fp32 results rounded to nearest (the fp64 reference's rounding, but
    for results within fp32 error of a tie), not toward zero (the interpreter's own cast, before
    det_core.interpreter's): 100.0 normalizes to 0.9999996, which rounds to 1.0."""
    one = det_train.rms_norm(torch.full((1, 1), 100.0, dtype=torch.bfloat16).to(_device()))
    assert one.item() == 1.0
    b = _rows(64, 256, torch.bfloat16, 5, _device())
    w = torch.ones(256, dtype=torch.bfloat16, device=_device())
    y, dx, _ = _fwd_bwd(b[:, 0], w, b[:, 1])
    xd = b[:, 0].double().requires_grad_()
    ref = rms_norm_reference(xd, w.double(), eps=torch.finfo(torch.bfloat16).eps)
    ref.backward(b[:, 1].double())
    for name, got, exp in (("y", y, ref.detach()), ("dx", dx, xd.grad)):
        same = (got.cpu() == exp.to(torch.bfloat16)).double().mean().item()
        assert same > 0.99, f"{name}: {same:.1%} equal to the rounded fp64 reference"


def test_module_drop_in_and_no_weight():
    ref = torch.nn.RMSNorm(16, eps=1e-5)
    mod = det_train.RMSNorm(16, eps=1e-5)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="weight dtype torch.float64 is not supported"):
        det_train.RMSNorm(16, dtype=torch.float64)  # at construction, not at the first forward
    plain = det_train.RMSNorm([4, 4], elementwise_affine=False)
    y = plain(x.view(2, 5, 4, 4))
    assert y.shape == (2, 5, 4, 4)
    torch.testing.assert_close(
        y, rms_norm_reference(x, eps=torch.finfo(torch.float32).eps).float().view_as(y)
    )


def test_strided_rows_and_empty():
    base = torch.randn(10, 64)
    x = base[:, :32]  # row stride 64
    w = torch.randn(32)
    torch.testing.assert_close(
        det_train.rms_norm(x, w), det_train.rms_norm(x.contiguous(), w), rtol=0, atol=0
    )
    empty = torch.randn(0, 32, requires_grad=True)
    wr = w.clone().requires_grad_()
    y = det_train.rms_norm(empty, wr)
    y.sum().backward()
    assert y.shape == (0, 32) and torch.equal(wr.grad, torch.zeros(32))


def test_bad_input():
    with pytest.raises(ValueError, match="does not end with"):
        det_train.rms_norm(torch.randn(4, 8), None, None, (7,))
    with pytest.raises(TypeError, match="floating-point"):
        det_train.rms_norm(torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match="not supported"):
        det_train.rms_norm(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        det_train.rms_norm(torch.randn(4, 8), torch.randn(8, 2)[:, 0])
    with pytest.raises(ValueError, match="exceeds"):
        det_train.rms_norm(torch.randn(1, 65537))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check is a CPU one")
def test_a_checked_signature_still_raises_for_what_it_does_not_cover(monkeypatch):
    """The checks are cached by argument signature: after a good call, another eps, offset or
    shape and CPU tensors with the interpreter switched off still raise."""
    x, w = torch.randn(4, 8), torch.ones(8)
    det_train.rms_norm(x, w, 1e-6, (8,))
    with pytest.raises(ValueError, match="eps"):
        det_train.rms_norm(x, w, -1e-6, (8,))
    with pytest.raises(ValueError, match="offset"):
        det_train.rms_norm(x, w, 1e-6, (8,), offset=float("nan"))
    with pytest.raises(ValueError, match="does not end with"):
        det_train.rms_norm(x, w, 1e-6, (4, 2))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="interpreter"):
        det_train.rms_norm(x, w, 1e-6, (8,))


def test_weight_shape_mismatch_names_the_weight():
    # found by a new-user check: the message said "x ... does not end with (7,)", not naming the weight
    with pytest.raises(ValueError, match=r"weight of shape \(7,\) does not match x's trailing dims \(8,\)"):
        det_train.rms_norm(torch.randn(3, 8), torch.ones(7))
    with pytest.raises(
        ValueError, match=r"weight of shape \(2, 4\) does not match x's trailing dims \(3, 8\)"
    ):
        det_train.rms_norm(torch.randn(3, 8), torch.ones(2, 4))


def test_empty_normalized_size_raises():
    # found by a new-user check: D == 0 gave torch's raw "cannot reshape tensor of 0 elements"
    for x, w in ((torch.randn(3, 0), None), (torch.randn(3, 0), torch.ones(0)), (torch.randn(0, 0), None)):
        with pytest.raises(
            ValueError, match=r"rms_norm: normalized size must be >= 1, got normalized_shape \(0,\)"
        ):
            det_train.rms_norm(x, w)
    # the module refuses such a shape at construction (it built, then every forward failed)
    for shape in (0, (4, 0), (-2,), ()):
        with pytest.raises(
            ValueError, match=r"det_train.RMSNorm: normalized_shape .* at least one dim, each >= 1"
        ):
            det_train.RMSNorm(shape, elementwise_affine=False)
    for shape in (3.5, True, "8", (8, 2.0)):
        with pytest.raises(
            TypeError, match="det_train.RMSNorm: normalized_shape must be an int or a sequence"
        ):
            det_train.RMSNorm(shape)
    norm = det_train.RMSNorm([2, 1], eps=0.0)  # a list, as torch takes it
    assert norm.normalized_shape == (2, 1)
    x = torch.tensor([[[4.0], [-4.0]], [[1.0], [1.0]]])  # rows' mean squares 16 and 1: exact
    assert_bitwise_equal(norm(x), torch.tensor([[[1.0], [-1.0]], [[1.0], [1.0]]]))


def test_0d_x_and_empty_normalized_shape_are_refused_like_torch():
    # found by a new-user trial: both ran, normalizing over nothing (torch raises)
    with pytest.raises(ValueError, match=r"rms_norm: x is 0-dimensional; .* e.g. x.reshape\(1\)"):
        det_train.rms_norm(torch.tensor(2.0))
    with pytest.raises(ValueError, match="rms_norm: x is 0-dimensional"):
        det_train.rms_norm(torch.tensor(2.0), torch.tensor(1.0), normalized_shape=())
    with pytest.raises(ValueError, match=r"rms_norm: normalized_shape is \(\): .* at least 1-dimensional"):
        det_train.rms_norm(torch.randn(2, 3), normalized_shape=())
    with pytest.raises(ValueError, match="rms_norm: weight is 0-dimensional: the normalized dims must be"):
        det_train.rms_norm(torch.randn(2, 3), torch.tensor(1.0))
    # one trailing dim of size 1 is fine: x / sqrt(x**2) = sign(x) with eps = 0
    assert_bitwise_equal(det_train.rms_norm(torch.tensor([-2.0]), eps=0.0), torch.tensor([-1.0]))


def test_non_tensor_input_raises_type_error():
    # found by a new-user check: a list gave AttributeError ('list' object has no attribute 'shape')
    with pytest.raises(TypeError, match=r"rms_norm: x must be a torch.Tensor, got list"):
        det_train.rms_norm([[1.0, 2.0]])
    with pytest.raises(TypeError, match=r"rms_norm: weight must be a torch.Tensor, got list"):
        det_train.rms_norm(torch.randn(3, 2), [1.0, 1.0])


# found by a new-user check: a negative, NaN or infinite eps gave NaN (or zero) rows silently
@pytest.mark.parametrize("eps", [-1e-6, -1.0, float("nan"), float("inf"), float("-inf")])
def test_bad_eps_raises(eps):
    x = torch.randn(3, 8, dtype=torch.float32)
    x[0] = 0.0  # mean square 0: a negative eps would give sqrt(-eps) = NaN
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0"):
        det_train.rms_norm(x, torch.ones(8), eps)
    with pytest.raises(ValueError, match=r"det_train.RMSNorm: eps must be a finite number >= 0"):
        det_train.RMSNorm(8, eps=eps)


def test_zero_and_default_eps_accepted():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    y0 = det_train.rms_norm(x, None, 0.0)
    torch.testing.assert_close(y0, x / x.square().mean(-1, keepdim=True).sqrt(), rtol=2e-6, atol=0)
    assert det_train.RMSNorm(8, eps=0).eps == 0.0 and det_train.RMSNorm(8).eps is None


# ---------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_row_invariance_real_sizes(dtype):
    _check_row_invariance(dtype, 4096, [1, 2, 3, 17, 64, 65, 127, 128, 129, 1000, 4096], "cuda")


@pytest.mark.gpu
def test_gpu_micro_batch_invariance_and_accuracy():
    tokens, d, leaf = 8192, 4096, 1024
    b = _rows(tokens, d, torch.bfloat16, 1, "cuda")
    x, dy = b[:, 0], b[:, 1]
    w0 = (1 + 0.1 * torch.randn(d, device="cuda")).bfloat16()

    def run(parts, leaf_tokens=leaf, granule=leaf):
        w = w0.clone().requires_grad_()
        acc = CanonicalGradAccumulator([w], leaf_tokens=leaf_tokens)
        for start, end in contiguous_splits(tokens, parts, granule):
            with acc.micro_batch(token_offset=start):
                det_train.rms_norm(x[start:end], w).backward(dy[start:end])
        acc.reduce(total_tokens=tokens)
        return w.grad

    whole = assert_run_to_run(lambda: run(1), repeats=2, name="dweight")
    for parts in (2, 3, 4, 8):
        assert_bitwise_equal(run(parts), whole, f"dweight, {parts} micro-batches")
    whole = run(1, DEFAULT_LEAF_TOKENS)  # one leaf of 8192 tokens
    for parts in (3, 7):  # cuts inside the leaf: its rows carried from micro-batch to micro-batch
        assert_bitwise_equal(run(parts, DEFAULT_LEAF_TOKENS, 1), whole, f"dweight, {parts} cuts")
    y, dx, dw = _fwd_bwd(x, w0, dy)
    assert_bitwise_equal(dw, whole, "dweight without accumulator (same default leaf)")
    xd, wd = x.double().requires_grad_(), w0.double().requires_grad_()
    ref = rms_norm_reference(xd, wd, eps=torch.finfo(torch.bfloat16).eps)
    ref.backward(dy.double())
    for name, got, exp in (("y", y, ref.detach()), ("dx", dx, xd.grad), ("dw", dw, wd.grad)):
        err = (got.double() - exp).abs().max() / exp.abs().max()
        assert err <= TOL[torch.bfloat16], f"{name}: relative error {err:.3g}"


def test_cast_weight_under_the_accumulator_gets_an_autograd_gradient_and_reduce_names_it(monkeypatch):
    """A weight that is not the Parameter itself (a cast, e.g. bf16 compute from fp32 weights) gets
    an ordinary autograd gradient (the canonical sum of this call's tokens); reduce then finds it in
    p.grad and says why, instead of an op failing mid-backward."""
    x, dy = _rows(40, 24, torch.bfloat16, 7).unbind(1)
    w = torch.nn.Parameter(torch.randn(24))  # fp32 master weight, cast per use
    acc = CanonicalGradAccumulator([("norm.weight", w)], leaf_tokens=8)
    with acc.micro_batch(token_offset=0):
        det_train.rms_norm(x, w.bfloat16()).backward(dy)
    w2 = w.detach().bfloat16().requires_grad_()
    monkeypatch.setattr(det_train.accum._leaf_sums, "DEFAULT_LEAF_TOKENS", 8)  # the accumulator's leaves
    det_train.rms_norm(x, w2).backward(dy)  # the plain backward of the same call
    assert_bitwise_equal(w.grad, w2.grad.float(), "autograd gradient through the cast")
    with pytest.raises(RuntimeError, match=r"norm.weight: p.grad already holds .* cast or view"):
        acc.reduce(total_tokens=40)


def test_offset_is_gemmas_fp32_one_plus_weight():
    """offset=1.0 scales by ``1.0 + weight.float()`` in fp32 (Gemma's form): the bits of offset 0 with
    that fp32 scale as the weight (y and dX), the weight gradient unchanged (``dy * x_hat``), and
    within bf16 rounding of the fp64 reference."""
    x, dy = _rows(33, 40, torch.bfloat16, 4).unbind(1)
    w = (0.1 * torch.randn(40, generator=torch.Generator().manual_seed(2))).bfloat16()

    def run(weight, offset):
        xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = det_train.rms_norm(xr, wr, 1e-6, offset=offset)
        y.backward(dy)
        return y.detach(), xr.grad, wr.grad

    y, dx, dw = run(w, 1.0)
    _, _, dw_plain = run(w, 0.0)
    assert_bitwise_equal(dw, dw_plain, "dweight does not depend on the offset")
    x, dy = x.float(), dy.float()  # fp32 outputs on both sides: no output rounding in the comparison
    y32, dx32, _ = run(w.float(), 1.0)
    y0, dx0, _ = run(1.0 + w.float(), 0.0)
    assert_bitwise_equal(y32, y0, "y: offset 1 vs fp32 (1 + w) as the weight")
    assert_bitwise_equal(dx32, dx0, "dx: offset 1 vs fp32 (1 + w) as the weight")
    x, dy = x.bfloat16(), dy.bfloat16()
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref = rms_norm_reference(xd, wd, eps=1e-6, offset=1.0)
    ref.backward(dy.double())
    for name, got, exp in (("y", y, ref.detach()), ("dx", dx, xd.grad), ("dw", dw, wd.grad)):
        err = (got.double() - exp).abs().max() / exp.abs().max()
        assert err <= TOL[torch.bfloat16], f"{name}: relative error {err:.3g}"
    norm = det_train.RMSNorm(40, eps=1e-6, offset=1.0)
    assert torch.equal(norm.weight, torch.zeros(40)) and "offset=1.0" in repr(norm)  # a scale of one
    with pytest.raises(ValueError, match="offset must be finite"):
        det_train.rms_norm(x, w, offset=float("inf"))
    with pytest.raises(ValueError, match="there is none"):
        det_train.rms_norm(x, None, offset=1.0)
    with pytest.raises(TypeError, match="offset must be a real number"):
        det_train.RMSNorm(40, offset="1")
