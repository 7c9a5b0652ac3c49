"""det_train.linear / Linear: forward + backward accuracy, row invariance of Y and dX, canonical
dW / db under micro-batching (with the CanonicalGradAccumulator), run-to-run and bad input."""

import dataclasses
import math

import pytest
import torch
from det_core.testing import (
    assert_bitwise_equal,
    assert_decomposition_invariant,
    assert_row_invariant,
    assert_run_to_run,
    contiguous_splits,
    digest,
    run_in_fresh_process,
)
from det_train import CanonicalGradAccumulator, Linear, linear
from det_train.ops import configs
from det_train.ops._leaf_fold import dw_tma_operands
from det_train.ops.configs import WeightGradConfig, check_weight_grad_config, weight_grad_config
from det_train.ops.weight_grad import _aligned_runs, bias_grad_partial, weight_grad_partial
from det_train.reference import linear_fp64, weight_grad_canonical, weight_grad_fp64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_ROWS = [1, 2, 3, 17, 64, 65, 129]
# 1023 / 1024 straddle configs.TMA_MIN_ROWS: the forward switches kernel there (same bits)
GPU_ROWS = [1, 2, 3, 17, 64, 65, 127, 128, 129, 1000, 1023, 1024, 4095, 4096, 8192]


def _randn(*shape, dtype=torch.bfloat16, seed=0, device=DEVICE, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device).requires_grad_(requires_grad)


def _rel_err(x, ref):
    return float((x.detach().double() - ref).norm() / ref.norm())


def _grads(x, w, b, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = linear(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, None if b is None else b.grad


# ----------------------------------------------------------------------------- accuracy
def test_forward_backward_accuracy_vs_fp64_no_worse_than_2x_torch():
    x, w, b = _randn(2, 150, 96, seed=1), _randn(80, 96, seed=2), _randn(80, seed=3)
    dy = _randn(2, 150, 80, seed=4)
    y, dx, dw, db = _grads(x, w, b, dy)
    # torch's own bf16 results (CPU: fp32 math rounded once, as cuBLAS does)
    xt, wt, bt = (t.detach().float().requires_grad_() for t in (x, w, b))
    yt = torch.nn.functional.linear(xt, wt, bt)
    yt.backward(dy.float())
    dy64 = dy.double().reshape(-1, 80)
    refs = {
        "y": (y, yt.to(y.dtype), linear_fp64(x, w, b)),
        "dx": (dx, xt.grad.to(dx.dtype), (dy64 @ w.double()).reshape(x.shape)),
        "dw": (dw, wt.grad.to(dw.dtype), weight_grad_fp64(dy, x)),
        "db": (db, bt.grad.to(db.dtype), dy64.sum(0)),
    }
    for name, (ours, theirs, ref) in refs.items():
        assert _rel_err(ours, ref) <= 2 * _rel_err(theirs, ref), name
    assert y.shape == (2, 150, 80) and dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape


def test_weight_grad_kernel_matches_canonical_reference_order():
    dy, x = _randn(300, 40, seed=5), _randn(300, 72, seed=6)
    got = weight_grad_partial(dy, x, leaf_tokens=64, finish_dtype=torch.float32)
    ref = weight_grad_canonical(dy, x, 64)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- run to run
def test_run_to_run_forward_and_grads():
    x, w, b, dy = (
        _randn(130, 96, seed=7),
        _randn(80, 96, seed=8),
        _randn(80, seed=9),
        _randn(130, 80, seed=10),
    )
    assert_run_to_run(lambda: _grads(x, w, b, dy), repeats=3)


def test_run_to_run_fresh_process_cold_cache():
    code = (
        "import torch\n"
        "from det_core.testing import digest\n"
        "from det_train import linear\n"
        "g = torch.Generator().manual_seed(11)\n"
        f"x = torch.randn(70, 96, generator=g).to(torch.bfloat16).to('{DEVICE}').requires_grad_()\n"
        f"w = torch.randn(48, 96, generator=g).to(torch.bfloat16).to('{DEVICE}').requires_grad_()\n"
        "y = linear(x, w)\n"
        "y.backward(torch.ones_like(y))\n"
        "print(digest([y, x.grad, w.grad]))\n"
    )
    g = torch.Generator().manual_seed(11)
    x = torch.randn(70, 96, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
    w = torch.randn(48, 96, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
    y = linear(x, w)
    y.backward(torch.ones_like(y))
    assert run_in_fresh_process(code) == digest([y, x.grad, w.grad])


# ----------------------------------------------------------------------------- row invariance
def _dx_of(w):
    def fn(dy):
        x = torch.zeros(dy.shape[0], w.shape[1], dtype=dy.dtype, device=dy.device, requires_grad=True)
        linear(x, w.detach()).backward(dy)
        return x.grad

    return fn


@pytest.mark.parametrize("bias", [False, True])
def test_row_invariance_of_y_and_dx(bias):
    w, b = _randn(72, 100, seed=12), _randn(72, seed=13) if bias else None
    assert_row_invariant(
        lambda x: linear(x, w, b), lambda m: _randn(m, 100, seed=m), CPU_ROWS, _randn(1, 100, seed=14), "y"
    )
    assert_row_invariant(
        _dx_of(w), lambda m: _randn(m, 72, seed=m + 1), CPU_ROWS, _randn(1, 72, seed=15), "dx"
    )


# ----------------------------------------------------------------------------- canonical dW / db
@pytest.mark.parametrize(
    "leaves_per_program, kernel",
    [
        (1, {}),
        (2, {}),
        (4, {}),
        (8, dict(lean=True)),
        (4, dict(lean=True, pairs=True)),
        (8, dict(lean=True, pairs=True)),
        (8, dict(lean=True, tma=True)),
        (4, dict(lean=True, pairs=True, tma=True)),
        (4, dict(lean=True, pairs=True, tma=True, quads=True)),
        (8, dict(lean=True, pairs=True, tma=True, quads=True)),
        (4, dict(lean=True, pairs=True, tma=True, quads=True, flat=True)),
        (8, dict(lean=True, pairs=True, tma=True, quads=True, flat=True)),
        (8, dict(lean=True, tma=True, block_k=256, num_stages=3, programs_per_sm=1)),  # the wide entry
    ],
)
def test_leaves_per_program_does_not_change_bits(leaves_per_program, kernel):
    dy, x = _randn(7 * 32 + 5, 40, seed=16), _randn(7 * 32 + 5, 72, seed=17)  # 8 leaves, the last short
    base = weight_grad_config(dy.dtype, 40, 72)
    if kernel.get("tma"):  # TMA needs leaf ends on token steps: step 32 (in reference and candidate)
        base = dataclasses.replace(base, block_t=32)
    ref = weight_grad_partial(dy, x, leaf_tokens=32, config=dataclasses.replace(base, leaves_per_program=1))
    cfg = dataclasses.replace(base, leaves_per_program=leaves_per_program, **kernel)
    if kernel.get("tma"):
        assert dw_tma_operands(dy, x, cfg, 32) is not None  # the TMA path is the one tested
    for first_leaf, lo, hi in [(0, 0, 229), (3, 96, 229), (1, 32, 160)]:  # odd starts: mixed levels
        part = weight_grad_partial(dy[lo:hi], x[lo:hi], leaf_tokens=32, first_leaf=first_leaf, config=cfg)
        ref_part = weight_grad_partial(
            dy[lo:hi],
            x[lo:hi],
            leaf_tokens=32,
            first_leaf=first_leaf,
            config=dataclasses.replace(base, leaves_per_program=1),
        )
        # merged partials hold the maximal aligned subtrees whatever the kernel computed in registers
        assert sorted(part.nodes) == sorted(ref_part.nodes)
        for key in part.nodes:
            assert_bitwise_equal(part.nodes[key], ref_part.nodes[key], f"lpp={leaves_per_program} node {key}")
        total = first_leaf + -(-(hi - lo) // 32)
        if first_leaf == 0:
            assert_bitwise_equal(part.result(total), ref.result(8), f"lpp={leaves_per_program}")
    fused = weight_grad_partial(dy[:128], x[:128], leaf_tokens=32, config=cfg, finish_dtype=torch.bfloat16)
    plain = weight_grad_partial(
        dy[:128], x[:128], leaf_tokens=32, config=dataclasses.replace(base, leaves_per_program=1)
    )
    assert_bitwise_equal(fused, plain.result(4).to(torch.bfloat16), "in-kernel finish")


@pytest.mark.parametrize(
    "kernel",
    [dict(), dict(quads=True), dict(quads=True, flat=True)],
)
def test_register_subtrees_keep_each_leaf_fold(kernel):
    # three token steps per leaf: a leaf closes after its last step only, in every loop shape
    dy, x = _randn(8 * 96 + 40, 40, seed=18), _randn(8 * 96 + 40, 72, seed=19)  # 9 leaves, last short
    base = dataclasses.replace(weight_grad_config(dy.dtype, 40, 72), block_t=32)
    ref = weight_grad_partial(dy, x, leaf_tokens=96, config=dataclasses.replace(base, leaves_per_program=1))
    variant = {"quads": False, "flat": False, **kernel}
    cfg = dataclasses.replace(base, leaves_per_program=8, lean=True, pairs=True, tma=True, **variant)
    assert dw_tma_operands(dy, x, cfg, 96) is not None
    got = weight_grad_partial(dy, x, leaf_tokens=96, config=cfg)
    assert sorted(got.nodes) == sorted(ref.nodes)
    for key in got.nodes:
        assert_bitwise_equal(got.nodes[key], ref.nodes[key], f"{kernel} node {key}")


# dW variants of the large shape class that compile on Triton 3.6 (H200) and must give the table's bits.
_LEAN = dict(lean=True, tma=True, quads=False, flat=False)
_OLD = dict(lean=False, tma=False, pairs=False, quads=False, flat=False, programs_per_sm=2)  # pre-lean
SUPPORTED_DW_VARIANTS = [  # each ran bit-exact against the table on an H200, Triton 3.6
    dict(_OLD, leaves_per_program=1, num_stages=3),
    dict(_OLD, leaves_per_program=2, num_stages=3),
    dict(_LEAN, leaves_per_program=8, pairs=False, programs_per_sm=1, num_stages=4),
    dict(_LEAN, leaves_per_program=8, pairs=False, programs_per_sm=1, num_stages=3, tma=False),
    dict(_LEAN, leaves_per_program=8, pairs=True, programs_per_sm=1, num_stages=4),
    dict(_LEAN, leaves_per_program=4, pairs=True, programs_per_sm=1, num_stages=4),
    dict(_LEAN, leaves_per_program=8, pairs=True, programs_per_sm=1, num_stages=3, tma=False),
    dict(_LEAN, leaves_per_program=8, pairs=False, programs_per_sm=1, num_stages=3, block_k=256),
    dict(_LEAN, leaves_per_program=8, pairs=True, programs_per_sm=1, num_stages=3, quads=True),
    dict(_LEAN, leaves_per_program=8, pairs=True, programs_per_sm=1, num_stages=4, quads=True),
    dict(_LEAN, leaves_per_program=8, pairs=True, programs_per_sm=1, num_stages=4, quads=True, flat=True),
]  # fmt: skip


def test_dw_table_picks_wide_tiles_only_where_they_fill_the_gpu():
    wide = weight_grad_config(torch.bfloat16, 4096, 4096)
    assert (wide.block_n, wide.block_k, wide.lean, wide.pairs, wide.tma) == (128, 256, True, False, True)
    assert weight_grad_config(torch.float16, 2048, 2048) is wide  # n * k = WIDE_MIN_ELEMENTS
    for n, k in [(2304, 768), (768, 3072), (2048, 2047)]:  # the main job's layers: 128x128 quads
        large = weight_grad_config(torch.bfloat16, n, k)
        assert (large.block_n, large.block_k, large.quads) == (128, 128, True)
    assert weight_grad_config(torch.bfloat16, 128, 1 << 20).block_n == 64  # small class: N < 256
    assert {
        c.block_t
        for c in configs._WEIGHT_GRAD_TABLE.values()
        if c is not configs._WEIGHT_GRAD_TABLE[("fp32", "any")]
    } == {64}  # the one bits-changing field is the same in every half entry


def test_dw_config_check_rejects_unimplemented_variants():
    base = configs._WEIGHT_GRAD_TABLE[("half", "large")]
    for cfg in configs._WEIGHT_GRAD_TABLE.values():
        check_weight_grad_config(cfg)  # every table entry is a supported variant
    for change in SUPPORTED_DW_VARIANTS:
        check_weight_grad_config(dataclasses.replace(base, **change))
    with pytest.raises(ValueError, match="needs lean, pairs and tma"):
        check_weight_grad_config(dataclasses.replace(base, tma=False))
    with pytest.raises(ValueError, match="set quads=True"):
        check_weight_grad_config(dataclasses.replace(base, quads=False, flat=True))
    with pytest.raises(ValueError, match="leaves_per_program"):
        check_weight_grad_config(WeightGradConfig(64, 64, 64, 8, 4, 3, 3))
    # weight_grad_partial checks before compiling
    dy, x = _randn(64, 256, seed=30), _randn(64, 256, seed=31)
    with pytest.raises(ValueError, match="needs lean, pairs and tma"):
        weight_grad_partial(dy, x, leaf_tokens=32, config=dataclasses.replace(base, tma=False))


def test_aligned_runs_are_maximal_aligned_subtrees():
    assert _aligned_runs(0, 8, 4) == [(2, 0, 2)]
    assert _aligned_runs(1, 7, 4) == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]
    assert _aligned_runs(3, 3, 2) == [(0, 3, 1), (1, 2, 1)]
    assert _aligned_runs(0, 3, 4) == [(1, 0, 1), (0, 2, 1)]


def _accumulated_grads(x, w, b, dy, leaf_tokens, parts, aligned=True):
    """Gradients through the accumulator with the tokens split into `parts` micro-batches: at leaf
    boundaries (``aligned``), else as evenly as possible wherever that falls (open leaves carried)."""
    w = w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_()
    acc = CanonicalGradAccumulator([("w", w), ("b", b)], leaf_tokens=leaf_tokens)
    t = x.shape[0]
    if aligned:
        cuts = contiguous_splits((t // leaf_tokens) * leaf_tokens, parts, granule=leaf_tokens)
        cuts[-1] = (cuts[-1][0], t)  # the last micro-batch also takes the short last leaf
    else:
        cuts = contiguous_splits(t, parts)
    for s, e in cuts:
        with acc.micro_batch(token_offset=s):
            linear(x[s:e], w, b).backward(dy[s:e])
    acc.reduce(total_tokens=t)
    return w.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_micro_batch_invariance_of_dw_and_db(dtype):
    leaf = 32
    t = 8 * leaf + 13  # 9 leaves, the last short
    x, w, b = (
        _randn(t, 72, dtype=dtype, seed=18),
        _randn(40, 72, dtype=dtype, seed=19),
        _randn(40, dtype=dtype, seed=20),
    )
    dy = _randn(t, 40, dtype=dtype, seed=21)
    assert_decomposition_invariant(
        lambda: _accumulated_grads(x, w, b, dy, leaf, 1),
        lambda p: _accumulated_grads(x, w, b, dy, leaf, p),
        parts=(2, 3, 4, 8),
        name="dW, db",
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_micro_batches_of_any_size_give_the_bits_of_one_batch(dtype):
    """Micro-batch boundaries inside leaves (2, 3, 5, 7 even cuts of 269 tokens over leaves of 32):
    the accumulator carries each open leaf's rows of dY and X to the micro-batch completing it."""
    leaf, t = 32, 8 * 32 + 13
    x, w, b = (
        _randn(t, 72, dtype=dtype, seed=18),
        _randn(40, 72, dtype=dtype, seed=19),
        _randn(40, dtype=dtype, seed=20),
    )
    dy = _randn(t, 40, dtype=dtype, seed=21)
    whole = _accumulated_grads(x, w, b, dy, leaf, 1)
    for parts in (2, 3, 5, 7, 13):
        assert any(s % leaf for s, _ in contiguous_splits(t, parts))  # the cuts do split leaves
        got = _accumulated_grads(x, w, b, dy, leaf, parts, aligned=False)
        assert_bitwise_equal(got[0], whole[0], f"dW, {parts} unaligned micro-batches")
        assert_bitwise_equal(got[1], whole[1], f"db, {parts} unaligned micro-batches")


def test_plain_backward_equals_accumulator_with_default_leaf():
    """Without an accumulator the op uses leaf_tokens = DEFAULT_LEAF_TOKENS: same bits as the
    accumulator's tree with its default leaf, whole or in unaligned micro-batches."""
    from det_train.accum.grad_accum import DEFAULT_LEAF_TOKENS

    assert DEFAULT_LEAF_TOKENS == 8192
    t = 300  # one short leaf: the accumulator sums it at reduce, from the carried rows
    x, w, b = _randn(t, 16, seed=22), _randn(24, 16, seed=23), _randn(24, seed=24)
    dy = _randn(t, 24, seed=25)
    _, _, dw, db = _grads(x, w, b, dy)
    for parts in (1, 3):
        dw_acc, db_acc = _accumulated_grads(x, w, b, dy, DEFAULT_LEAF_TOKENS, parts, aligned=False)
        assert_bitwise_equal(dw_acc, dw, f"dW, {parts} micro-batches")
        assert_bitwise_equal(db_acc, db, f"db, {parts} micro-batches")


def test_bias_grad_partial_is_canonical():
    dy = _randn(200, 24, seed=26)
    part = bias_grad_partial(dy, leaf_tokens=64)
    leaves = [dy[s : s + 64].float() for s in range(0, 200, 64)]
    ref = torch.stack([leaf.sum(0) for leaf in leaves])
    torch.testing.assert_close(part.result(4), ref.sum(0), rtol=1e-6, atol=1e-5)
    assert sorted(part.nodes) == [(2, 0)]


# ----------------------------------------------------------------------------- module
def test_linear_module_is_a_drop_in_for_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(96, 40, dtype=torch.bfloat16, device=DEVICE)
    ours = Linear(96, 40, dtype=torch.bfloat16, device=DEVICE)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    x = _randn(5, 96, seed=27)
    assert_bitwise_equal(ours(x), linear(x, ref.weight, ref.bias), "module forward")
    shared = Linear.from_torch(ref)
    assert shared.weight is ref.weight and shared.bias is ref.bias
    assert_bitwise_equal(shared(x), ours(x), "from_torch")
    assert Linear(8, 4, bias=False).bias is None
    with pytest.raises(TypeError, match=r"move the module with \.to\(torch\.bfloat16\)"):
        Linear(96, 40)(x)  # fp32 weights, bf16 input
    with pytest.raises(TypeError, match=r"cast the input with \.to\(torch\.float32\) \(bf16, fp16 and fp32"):
        Linear(96, 40)(x.long())  # an integer input cannot be met by moving the module


# ----------------------------------------------------------------------------- edge cases / bad input
def test_empty_tokens_and_non_contiguous_input():
    w = _randn(24, 16, seed=28, requires_grad=True)
    x = _randn(0, 16, requires_grad=True)
    y = linear(x, w)
    y.backward(torch.ones_like(y))
    assert y.shape == (0, 24) and bool((w.grad == 0).all())
    big = _randn(40, 64, seed=29)
    view = big[::2, 8:24]  # rows stride 128, not contiguous
    assert_bitwise_equal(linear(view, w.detach()), linear(view.contiguous(), w.detach()), "strided x")


@pytest.mark.parametrize("x_shape, w_shape", [((2, 3, 0), (8, 0)), ((3, 5), (0, 5))], ids=["K=0", "N=0"])
def test_empty_features_like_torch(x_shape, w_shape):
    """No input features (y = bias, dW empty, db = sum of dY) or no output features: torch's values."""
    x = _randn(*x_shape, seed=40, requires_grad=True)
    w = _randn(*w_shape, seed=41, requires_grad=True)
    b = _randn(w_shape[0], seed=42, requires_grad=True)
    y = linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert_bitwise_equal(y.float(), want, "y")
    y.backward(torch.ones_like(y))
    tokens = math.prod(x.shape[:-1])
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and bool((x.grad == 0).all())
    assert torch.equal(b.grad.float(), torch.full((w_shape[0],), float(tokens)))  # db = sum of dY


def test_bad_input_raises_clearly():
    w = _randn(24, 16)
    with pytest.raises(ValueError, match="in_features"):
        linear(_randn(3, 15), w)
    with pytest.raises(TypeError, match="one dtype"):
        linear(_randn(3, 16, dtype=torch.float16), w)
    with pytest.raises(TypeError, match="supported"):
        linear(_randn(3, 16).double(), w.double())
    with pytest.raises(ValueError, match="bias"):
        linear(_randn(3, 16), w, _randn(23))
    with pytest.raises(ValueError, match="2-D"):
        linear(_randn(3, 16), w[None])
    with pytest.raises(ValueError, match="one device"):
        linear(torch.empty(3, 16, dtype=torch.bfloat16, device="meta"), w)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter check is a CPU one")
def test_a_checked_signature_still_raises_for_what_it_does_not_cover(monkeypatch):
    """The checks are cached by argument signature: after a good call, a bias of another length and
    CPU tensors with the interpreter switched off still raise."""
    x, w = _randn(3, 16), _randn(24, 16)
    linear(x, w, _randn(24))
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, _randn(23))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="interpreter"):
        linear(x, w, _randn(24))


# ----------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
def test_gpu_row_invariance_of_y_and_dx_real_sizes():
    w, b = _randn(4096, 4096, seed=40), _randn(4096, seed=41)
    assert_row_invariant(
        lambda x: linear(x, w, b), lambda m: _randn(m, 4096, seed=m), GPU_ROWS, _randn(1, 4096, seed=42), "y"
    )
    assert_row_invariant(
        _dx_of(w), lambda m: _randn(m, 4096, seed=m + 1), GPU_ROWS, _randn(1, 4096, seed=43), "dx"
    )


@pytest.mark.gpu
def test_gpu_micro_batch_invariance_real_sizes():
    t = 8192
    x, w, b = _randn(t, 4096, seed=44), _randn(4096, 4096, seed=45), _randn(4096, seed=46)
    dy = _randn(t, 4096, seed=47)
    assert_decomposition_invariant(
        lambda: _accumulated_grads(x, w, b, dy, 1024, 1),
        lambda p: _accumulated_grads(x, w, b, dy, 1024, p),
        parts=(2, 3, 4, 8),
        name="dW, db",
    )
    _, _, dw, db = _grads(x, w, b, dy)
    whole = _accumulated_grads(x, w, b, dy, 8192, 1)  # the default leaf: one leaf
    assert_bitwise_equal(whole[0], dw, "plain dW == accumulator dW")
    assert_bitwise_equal(whole[1], db, "plain db == accumulator db")
    for parts in (2, 3, 7, 8, 16):  # cuts inside the leaf: dW's fp32 fold carried (3, 7: off the step)
        got = _accumulated_grads(x, w, b, dy, 8192, parts, aligned=False)
        assert_bitwise_equal(got[0], whole[0], f"dW, {parts} cuts inside the leaf")
        assert_bitwise_equal(got[1], whole[1], f"db, {parts} cuts inside the leaf")
    x2, w2, dy2 = x[:, :768], _randn(2304, 768, seed=48), _randn(t, 2304, seed=49)  # the 128x128 entry
    b2 = _randn(2304, seed=50)
    whole2 = _accumulated_grads(x2, w2, b2, dy2, 8192, 1)
    for parts in (4, 8, 16):
        got = _accumulated_grads(x2, w2, b2, dy2, 8192, parts, aligned=False)
        assert_bitwise_equal(got[0], whole2[0], f"dW 2304x768, {parts} micro-batches inside the leaf")


@pytest.mark.gpu
def test_gpu_accuracy_vs_cublas_forward_and_backward():
    x, w, dy = _randn(4096, 4096, seed=48), _randn(4096, 4096, seed=49), _randn(4096, 4096, seed=50)
    y, dx, dw, _ = _grads(x, w, None, dy)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    yt = torch.nn.functional.linear(xt, wt)
    yt.backward(dy)
    assert _rel_err(y, linear_fp64(x, w)) <= 2 * _rel_err(yt, linear_fp64(x, w))
    ref_dx = dy.double() @ w.double()
    assert _rel_err(dx, ref_dx) <= 2 * _rel_err(xt.grad, ref_dx)
    ref_dw = weight_grad_fp64(dy, x)
    assert _rel_err(dw, ref_dw) <= 2 * _rel_err(wt.grad, ref_dw)


@pytest.mark.gpu
def test_gpu_leaves_per_program_and_configs_same_bits():
    """Every supported dW variant (SUPPORTED_DW_VARIANTS: pre-lean, lean with and without TMA / pairs /
    quads, other tiles) gives the table config's bits at 8192 tokens."""
    dy, x = _randn(8192, 4096, seed=51), _randn(8192, 4096, seed=52)
    base = configs._WEIGHT_GRAD_TABLE[("half", "large")]  # the variants are of the 128x128 entry
    ref = weight_grad_partial(dy, x, leaf_tokens=1024, finish_dtype=torch.float32)  # the wide entry
    assert weight_grad_config(dy.dtype, 4096, 4096).block_k == 256
    for change in SUPPORTED_DW_VARIANTS:
        cfg = dataclasses.replace(base, **change)
        assert cfg.block_t == base.block_t  # the only field that changes bits stays fixed
        got = weight_grad_partial(dy, x, leaf_tokens=1024, config=cfg, finish_dtype=torch.float32)
        assert_bitwise_equal(got, ref, f"dW config {change}")


@pytest.mark.gpu
def test_gpu_fresh_process_cold_cache_real_size():
    code = (
        "import torch\n"
        "from det_core.testing import digest\n"
        "from det_train import linear\n"
        "g = torch.Generator().manual_seed(60)\n"
        "x = torch.randn(4096, 4096, generator=g).to(torch.bfloat16).cuda().requires_grad_()\n"
        "w = torch.randn(4096, 4096, generator=g).to(torch.bfloat16).cuda().requires_grad_()\n"
        "b = torch.randn(4096, generator=g).to(torch.bfloat16).cuda().requires_grad_()\n"
        "y = linear(x, w, b)\n"
        "y.backward(torch.ones_like(y))\n"
        "print(digest([y, x.grad, w.grad, b.grad]))\n"
    )
    first = run_in_fresh_process(code)  # cold Triton cache: every kernel compiled from scratch
    g = torch.Generator().manual_seed(60)
    x = torch.randn(4096, 4096, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    w = torch.randn(4096, 4096, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    b = torch.randn(4096, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    y = linear(x, w, b)
    y.backward(torch.ones_like(y))
    assert digest([y, x.grad, w.grad, b.grad]) == first  # and the same as this (warm) process


def test_dw_scratch_holds_the_levels_the_kernel_stacks():
    from det_train.ops.weight_grad import dw_scratch_shape

    table = configs._WEIGHT_GRAD_TABLE[("half", "large")]  # lean, quads, 1 merge slot
    cpu = torch.device("cpu")  # 4 resident programs under the interpreter
    assert dw_scratch_shape(table, 3, 100, cpu) == (4, 2, 128 * 128)  # level 2 in registers, 3 stacked
    assert dw_scratch_shape(table, 3, 100, cpu, tma=False) == (4, 3, 128 * 128)  # pairs without TMA
    assert dw_scratch_shape(dataclasses.replace(table, quads=False), 4, 100, cpu) == (4, 4, 128 * 128)
    assert dw_scratch_shape(table, 1, 100, cpu) == (4, 1, 128 * 128)  # quads need level >= 2
    assert dw_scratch_shape(table, 0, 100, cpu) is None


def test_dw_launch_plans_never_serve_another_call_signature(monkeypatch):
    """weight_grad_partial keeps one launch plan per call signature: the same shapes with another
    first leaf, a dY 2 bytes off 16-byte alignment (pointer loads instead of TMA), another config
    or a finished result each get their own plan; every result equals the cold-cache one."""
    import importlib

    wg = importlib.import_module("det_train.ops.weight_grad")
    base = dataclasses.replace(weight_grad_config(torch.bfloat16, 40, 72), block_t=32)
    quads = dataclasses.replace(base, leaves_per_program=8, lean=True, pairs=True, tma=True, quads=True)
    buf, x = _randn(256 * 40 + 8, seed=30), _randn(256, 72, seed=31)
    aligned, unaligned = buf[: 256 * 40].view(256, 40), buf[1 : 1 + 256 * 40].view(256, 40)
    assert dw_tma_operands(aligned, x, quads, 32) is not None
    assert dw_tma_operands(unaligned, x, quads, 32) is None
    calls = [
        (dy, first_leaf, cfg, finish)
        for dy in (aligned, unaligned)
        for first_leaf in (0, 8)
        for cfg in (quads, base)
        for finish in (None, torch.bfloat16)
        if not (finish is not None and first_leaf)  # a finished result is defined from leaf 0
    ]

    def run(dy, first_leaf, cfg, finish):
        got = weight_grad_partial(
            dy, x, leaf_tokens=32, first_leaf=first_leaf, config=cfg, finish_dtype=finish
        )
        return got if finish is not None else {key: got.nodes[key] for key in sorted(got.nodes)}

    cold = []
    for call in calls:
        monkeypatch.setattr(wg, "_PLANS", type(wg._PLANS)())
        cold.append(run(*call))
    monkeypatch.setattr(wg, "_PLANS", type(wg._PLANS)())
    for _ in range(2):  # the second round runs on cached plans
        for call, want in zip(calls, cold, strict=True):
            got = run(*call)
            what = f"first_leaf={call[1]} quads={call[2].quads} finish={call[3]} aligned={call[0] is aligned}"
            if isinstance(want, dict):
                assert list(got) == list(want), what
                for key in want:
                    assert_bitwise_equal(got[key], want[key], f"{what} node {key}")
            else:
                assert_bitwise_equal(got, want, what)


def test_double_backward_raises_instead_of_dropping_terms():
    # found by a new-user check: create_graph=True gave a dX without grad_fn, so a gradient
    # penalty silently contributed nothing; the kernels' backward passes refuse it
    from det_train import cross_entropy, rms_norm

    x = _randn(8, 64, seed=1, requires_grad=True)
    w = _randn(32, 64, seed=2, requires_grad=True)
    g = _randn(64, seed=3, requires_grad=True)
    targets = torch.arange(8, device=DEVICE) % 32
    for name, out in (
        ("linear", lambda: linear(x, w).float().sum()),
        ("rms_norm", lambda: rms_norm(x, g).float().sum()),
        ("cross_entropy", lambda: cross_entropy(linear(x, w), targets, reduction="sum")),
    ):
        with pytest.raises(RuntimeError, match=f"det_train.{name}: a backward with create_graph=True"):
            torch.autograd.grad(out(), x, create_graph=True)
        torch.autograd.grad(out(), x)  # first order: as before
