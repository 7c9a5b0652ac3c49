"""det_train.matmul: run-to-run, row/batch invariance, layouts, accuracy, chaining and bad input.

CPU (Triton interpreter) at small sizes; `gpu` tests at real sizes on a CUDA device.
"""

import dataclasses
import importlib

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
from det_train.ops import configs
from det_train.ops.matmul import launch_matmul, matmul, matmul_partial
from det_train.reference import matmul_fp64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = [torch.bfloat16, torch.float16]
CPU_ROWS = [1, 2, 3, 17, 64, 65, 129]
# 1023 / 1024 straddle configs.TMA_MIN_ROWS: the forward ("nt") switches kernel there
GPU_ROWS = [1, 2, 3, 17, 64, 65, 127, 128, 129, 1000, 1023, 1024, 4095, 4096, 8192]


def _randn(*shape, dtype=torch.bfloat16, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


# ----------------------------------------------------------------------------- run to run
def test_run_to_run_in_process():
    a, b = _randn(65, 96, seed=1), _randn(96, 80, seed=2)
    assert_run_to_run(lambda: matmul(a, b), repeats=3)


def test_run_to_run_fresh_process_cold_cache():
    code = (
        "import torch\n"
        "from det_core.testing import digest\n"
        "from det_train.ops.matmul import matmul\n"
        "g = torch.Generator().manual_seed(7)\n"
        f"a = torch.randn(33, 96, generator=g).to(torch.bfloat16).to('{DEVICE}')\n"
        f"b = torch.randn(80, 96, generator=g).to(torch.bfloat16).to('{DEVICE}')\n"
        "print(digest(matmul(a, b.t())))\n"
    )
    g = torch.Generator().manual_seed(7)
    a = torch.randn(33, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(80, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    assert run_in_fresh_process(code) == digest(matmul(a, b.t()))


# ----------------------------------------------------------------------------- row invariance
@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("transposed_b", [False, True])
def test_row_invariance_small(dtype, transposed_b):
    k, n = 100, 72  # K tail (100 = 64 + 36), N narrower than nothing in particular
    b = _randn(n, k, dtype=dtype, seed=3).t() if transposed_b else _randn(k, n, dtype=dtype, seed=3)
    anchor = _randn(1, k, dtype=dtype, seed=4)
    assert_row_invariant(
        lambda x: matmul(x, b), lambda m: _randn(m, k, dtype=dtype, seed=m), CPU_ROWS, anchor, "matmul"
    )


def test_row_invariance_large_config():
    k, n = 256, 320  # "large" shape class: 128x256 tiles, two N tiles (the second partial)
    b = _randn(n, k, seed=5).t()
    anchor = _randn(1, k, seed=6)
    assert_row_invariant(
        lambda x: matmul(x, b), lambda m: _randn(m, k, seed=m), [1, 3, 129], anchor, "matmul"
    )


def test_batch_index_and_3d_rows_match_2d():
    a, b = _randn(3, 17, 96, seed=8), _randn(96, 40, seed=9)
    out = matmul(a, b)
    assert out.shape == (3, 17, 40)
    for i in range(3):
        assert_bitwise_equal(out[i], matmul(a[i], b), f"batch {i}")
    b3 = _randn(3, 96, 40, seed=10)
    out3 = matmul(a, b3)
    for i in range(3):
        assert_bitwise_equal(out3[i], matmul(a[i], b3[i]), f"bmm batch {i}")
    # broadcast: (2, 1, M, K) @ (3, K, N) -> (2, 3, M, N)
    a4 = _randn(2, 1, 5, 96, seed=11)
    out4 = matmul(a4, b3)
    assert out4.shape == (2, 3, 5, 40)
    assert_bitwise_equal(out4[1, 2], matmul(a4[1, 0], b3[2]), "broadcast")


@pytest.mark.parametrize("dtype", HALF)
def test_tma_kernel_gives_the_pointer_kernel_bits(dtype):
    """The TMA kernel (host descriptors; plain and persistent; B = W.T as W's K-major tiles, and a
    row-major B as its own tiles) equals the pointer kernel bit for bit: K tail zero-filled, rows
    past M and columns past N never stored, bias added."""
    from det_train.ops.matmul import _tma_operands

    for m, k, n in [(5, 72, 40), (33, 136, 24), (70, 200, 36)]:
        x, w, bias = (
            _randn(m, k, dtype=dtype, seed=m),
            _randn(n, k, dtype=dtype, seed=k),
            _randn(n, dtype=dtype),
        )
        base = dataclasses.replace(configs.matmul_config(dtype, "nt", n, k), block_m=16, block_n=16)
        w_rows = w.t().contiguous()  # the same B row-major ("nn")
        for bb in (None, bias):
            ref = launch_matmul(x, w.t(), torch.empty(m, n, dtype=dtype, device=DEVICE), bias=bb, config=base)
            cases = [(w.t(), True, False), (w.t(), True, True)] + (
                [(w_rows, False, False)] if bb is None else []
            )
            for b, kmajor, persistent in cases:  # (B, K-major, persistent); bias: as for B = W.T
                cfg = dataclasses.replace(base, tma=True, persistent=persistent)
                descs = _tma_operands(x, b, cfg, None)
                if not kmajor and n % 8:  # rows of 36 bf16: not 16-byte aligned, pointer kernel
                    assert descs is None
                else:  # the TMA path is the one tested
                    assert descs is not None and descs[2] == kmajor
                got = launch_matmul(x, b, torch.empty(m, n, dtype=dtype, device=DEVICE), bias=bb, config=cfg)
                what = f"{m}x{k}x{n} bias={bb is not None} persistent={persistent} kmajor={kmajor}"
                assert_bitwise_equal(got, ref, what)
    # not eligible (misaligned rows, B strided both ways): the pointer kernel, same bits
    x, w = _randn(9, 68, dtype=dtype, seed=1), _randn(20, 68, dtype=dtype, seed=2)
    cfg = dataclasses.replace(configs.matmul_config(dtype, "nt", 20, 68), tma=True)
    assert _tma_operands(x, w.t(), cfg, None) is None  # 68 * 2 bytes is not a multiple of 16
    b_strided = _randn(64, 48, dtype=dtype, seed=3)[:, ::2]
    assert _tma_operands(_randn(9, 64, dtype=dtype, seed=4), b_strided, cfg, None) is None
    assert_bitwise_equal(
        launch_matmul(x, w.t(), torch.empty(9, 20, dtype=dtype, device=DEVICE), config=cfg), matmul(x, w.t())
    )


def test_table_entries_of_a_dtype_share_block_k_and_rows_pick_only_the_kernel():
    """M (rows) may select the kernel of the large forward, never block_k (the reduction order)."""
    for key, cfg in configs._MATMUL_TABLE.items():
        dtype = torch.float32 if key[0] == "fp32" else torch.bfloat16
        assert cfg.block_k == configs.BLOCK_K[dtype], key
    few = configs.matmul_config(torch.bfloat16, "nt", 4096, 4096, rows=configs.TMA_MIN_ROWS - 1)
    many = configs.matmul_config(torch.bfloat16, "nt", 4096, 4096, rows=configs.TMA_MIN_ROWS)
    assert not few.tma and many.tma
    assert many == dataclasses.replace(few, tma=True, num_stages=many.num_stages)  # K order fields equal
    for layout in ("nn", "tn", "tt"):  # every other entry ignores M
        assert configs.matmul_config(torch.bfloat16, layout, 4096, 4096, rows=1) == configs.matmul_config(
            torch.bfloat16, layout, 4096, 4096, rows=1 << 20
        )
    assert configs.matmul_config(torch.bfloat16, "nt", 64, 64, rows=1) == configs.matmul_config(
        torch.bfloat16, "nt", 64, 64, rows=1 << 20
    )


def test_row_threshold_switches_kernel_not_bits(monkeypatch):
    """With the threshold lowered to 64 rows, 64 rows take the TMA kernel and 63 the pointer kernel
    (the table's own large "nt" entries): every shared row is bitwise equal, with and without bias."""
    mm = importlib.import_module("det_train.ops.matmul")  # the module (det_train.matmul is also a function)
    monkeypatch.setattr(configs, "TMA_MIN_ROWS", 64)
    monkeypatch.setattr(configs, "MID_MAX_FILL", 0.0)  # 64 rows in the "many" class, not "mid"
    monkeypatch.setattr(configs, "LOW_MAX_FILL", 0.0)  # nor "low"
    used = []
    real_launch_tma = mm._launch_tma
    monkeypatch.setattr(mm, "_launch_tma", lambda *a, **kw: used.append("tma") or real_launch_tma(*a, **kw))
    k, n = 256, 320  # large class: the 128 x 256 entries, a partial second N tile
    x, w, bias = _randn(64, k, seed=40), _randn(n, k, seed=41), _randn(n, seed=42)
    for bb in (None, bias):
        used.clear()
        many = torch.empty(64, n, dtype=torch.bfloat16, device=DEVICE)
        launch_matmul(x, w.t(), many, bias=bb)
        assert used == ["tma"]  # the TMA kernel ran for M = 64
        few = torch.empty(63, n, dtype=torch.bfloat16, device=DEVICE)
        launch_matmul(x[:63], w.t(), few, bias=bb)
        assert used == ["tma"]  # ... and the pointer kernel for M = 63
        assert_bitwise_equal(few, many[:63], f"M=63 (pointer) vs M=64 (TMA), bias={bb is not None}")


def test_layouts_and_views_read_in_place_give_same_bits():
    a, b = _randn(40, 96, seed=12), _randn(96, 56, seed=13)
    ref = matmul(a, b)
    assert_bitwise_equal(matmul(a.t().contiguous().t(), b), ref, "A column-major")
    assert_bitwise_equal(matmul(a, b.t().contiguous().t()), ref, "B column-major")
    big = _randn(80, 200, seed=14)
    big[::2, 5:101] = a
    assert_bitwise_equal(matmul(big[::2, 5:101], b), ref, "strided slice of A")


# ----------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("dtype", HALF)
def test_accuracy_vs_fp64_no_worse_than_2x_torch(dtype):
    a, b = _randn(96, 320, dtype=dtype, seed=15), _randn(320, 80, dtype=dtype, seed=16)
    ref = matmul_fp64(a, b)
    ours = _rel_err(matmul(a, b), ref)
    torch_err = _rel_err(torch.matmul(a, b) if DEVICE == "cuda" else (a.float() @ b.float()).to(dtype), ref)
    assert ours <= 2 * torch_err, (ours, torch_err)
    assert ours < {torch.bfloat16: 4e-3, torch.float16: 6e-4}[dtype]


def test_fp32_is_ieee_accurate():
    a, b = _randn(33, 130, dtype=torch.float32, seed=17), _randn(130, 20, dtype=torch.float32, seed=18)
    assert _rel_err(matmul(a, b), matmul_fp64(a, b)) < 1e-6  # TF32 would give ~1e-3


# ----------------------------------------------------------------------------- chaining (row-parallel)
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_k_chain_reproduces_unsplit(parts):
    k = 64 * 5 + 20  # a short last block
    a, b = _randn(37, k, seed=19), _randn(k, 48, seed=20)
    bias = _randn(48, seed=21)
    whole = matmul(a, b)
    cuts = contiguous_splits(64 * 5, parts, granule=64)
    cuts[-1] = (cuts[-1][0], k)
    carry = None
    for i, (s, e) in enumerate(cuts):
        last = i == len(cuts) - 1
        carry = matmul_partial(a[:, s:e], b[s:e], carry, finish=last)
    assert_bitwise_equal(carry, whole, f"chain of {parts}")
    # with a bias: the last part adds it, like linear's forward
    carry = None
    for i, (s, e) in enumerate(cuts):
        last = i == len(cuts) - 1
        carry = matmul_partial(a[:, s:e], b[s:e], carry, bias=bias if last else None, finish=last)
    out = torch.empty_like(whole)
    launch_matmul(a, b, out, bias=bias)
    assert_bitwise_equal(carry, out, f"chain of {parts} with bias")


# ----------------------------------------------------------------------------- edge cases / bad input
def test_empty_dims():
    assert matmul(_randn(0, 8), _randn(8, 5)).shape == (0, 5)
    assert matmul(_randn(4, 8), _randn(8, 0)).shape == (4, 0)
    z = matmul(_randn(4, 0), _randn(0, 5))
    assert z.shape == (4, 5) and bool((z == 0).all())


def test_bad_input_raises_clearly():
    a = _randn(4, 8)
    with pytest.raises(ValueError, match="inner dims"):
        matmul(a, _randn(7, 5))
    with pytest.raises(TypeError, match="one dtype"):
        matmul(a, _randn(8, 5, dtype=torch.float16))
    with pytest.raises(TypeError, match="supported"):
        matmul(a.double(), _randn(8, 5).double())
    with pytest.raises(TypeError, match="supported"):
        matmul(a.to(torch.int32), _randn(8, 5).to(torch.int32))
    with pytest.raises(ValueError, match="at least 2 dims"):
        matmul(_randn(8), _randn(8, 5))
    with pytest.raises(ValueError, match="one device"):
        matmul(a, torch.empty(8, 5, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="carry"):
        matmul_partial(a, _randn(8, 5), torch.zeros(4, 5, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="finish=True"):
        matmul_partial(a, _randn(8, 5), bias=_randn(5))


@pytest.mark.parametrize("which", ["a", "b", "both"])
def test_operand_requiring_grad_raises_instead_of_dropping_the_graph(which):
    # found by a new-user check: there is no backward, yet the result silently had grad_fn=None
    a, b = _randn(4, 8), _randn(8, 5)
    a_g = a.clone().requires_grad_(which in ("a", "both"))
    b_g = b.clone().requires_grad_(which in ("b", "both"))
    with pytest.raises(RuntimeError, match=r"det_train.matmul has no backward: use det_train.linear"):
        matmul(a_g, b_g)
    with pytest.raises(RuntimeError, match=r"or call it under torch.no_grad\(\)"):
        matmul(a_g[None], b_g)  # batched too
    # forward-only use is unchanged: under no_grad / inference_mode, or with grad mode on and
    # no operand requiring grad, the bits are those of the plain call
    expected = matmul(a, b)
    with torch.no_grad():
        assert_bitwise_equal(matmul(a_g, b_g), expected, "no_grad")
    with torch.inference_mode():
        assert_bitwise_equal(matmul(a_g, b_g), expected, "inference_mode")
    assert_bitwise_equal(matmul(a_g.detach(), b_g.detach()), expected, "detached")


def test_batch_dims_that_do_not_broadcast_raise_the_documented_value_error():
    # found by a new-user check: torch.broadcast_shapes' RuntimeError leaked out
    with pytest.raises(ValueError, match=r"batch dims do not broadcast: a is \(2, 4, 8\), b is \(3, 8, 5\)"):
        matmul(_randn(2, 4, 8), _randn(3, 8, 5))
    with pytest.raises(ValueError, match=r"batch \(2, 3\) vs \(4, 1\)"):
        matmul(_randn(2, 3, 4, 8), _randn(4, 1, 8, 5))
    # sizes of 1 and missing dims still broadcast, as in torch.matmul
    out = matmul(_randn(2, 1, 4, 8), _randn(3, 8, 5))
    assert out.shape == (2, 3, 4, 5)


# ----------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("transposed_b", [False, True])
def test_gpu_row_invariance_real_sizes(transposed_b):
    k, n = 4096, 4096
    b = _randn(n, k, seed=30).t() if transposed_b else _randn(k, n, seed=30)
    anchor = _randn(1, k, seed=31)
    assert_row_invariant(lambda x: matmul(x, b), lambda m: _randn(m, k, seed=m), GPU_ROWS, anchor, "matmul")


@pytest.mark.gpu
def test_gpu_every_config_of_a_dtype_gives_the_same_bits():
    """The table's claim: only block_k orders the sum, so all half-precision entries agree."""
    a, b = _randn(1000, 1024, seed=32), _randn(1024, 768, seed=33)
    ref = matmul(a, b)
    b_t = b.t().contiguous().t()  # B = W.T (K-major): the "nt" entries' TMA kernel applies
    for key, cfg in configs._MATMUL_TABLE.items():
        if key[0] != "half":
            continue
        for operand, name in ((b, "B row-major"), (b_t, "B = W.T")):
            out = torch.empty_like(ref)
            launch_matmul(a, operand, out, config=cfg)
            assert_bitwise_equal(out, ref, f"config {key}, {name}")
    # operand layouts (each its own table entry) read in place: same bits
    assert_bitwise_equal(matmul(a, b.t().contiguous().t()), ref, "B column-major (nt)")
    assert_bitwise_equal(matmul(a.t().contiguous().t(), b), ref, "A column-major (tn)")
    assert_bitwise_equal(matmul(a[:, None, :].expand(-1, 2, -1)[:, 1], b), ref, "strided A rows")
    base = configs.matmul_config(torch.bfloat16, "nn", 768, 1024)
    for bm, bn, warps, stages in [(64, 128, 4, 4), (128, 128, 8, 3), (256, 128, 8, 3)]:
        out = torch.empty_like(ref)
        cfg = dataclasses.replace(base, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        launch_matmul(a, b, out, config=cfg)
        assert_bitwise_equal(out, ref, f"tile {bm}x{bn}")
    for nk in (False, True):
        out = torch.empty_like(ref)
        launch_matmul(a, b_t, out, config=dataclasses.replace(base, b_nk_tiles=nk))
        assert_bitwise_equal(out, ref, f"B read transposed, b_nk_tiles={nk}")
    for change in (dict(tma=True), dict(tma=True, persistent=True), dict(tma=True, block_m=256, block_n=128)):
        out = torch.empty_like(ref)  # TMA loads of A and of W's (N, K) tiles: same bits
        launch_matmul(a, b_t, out, config=dataclasses.replace(base, **change))
        assert_bitwise_equal(out, ref, f"B read transposed, {change}")


@pytest.mark.gpu
def test_gpu_tma_and_pointer_kernels_agree_across_the_row_threshold():
    """The forward x @ W.T takes the TMA kernel from configs.TMA_MIN_ROWS rows and the pointer kernel
    below: the same rows from M = TMA_MIN_ROWS - 1 (pointer) and M = TMA_MIN_ROWS (TMA) are bitwise
    equal, whole matrices, with and without bias, for N = 4096 and 14336, and for a K with a tail
    with a partial last N tile (K = 4136 = 64 x 64 + 40, N = 4000 = 15 x 256 + 160)."""
    from det_train.ops.linear import linear
    from det_train.ops.matmul import _tma_operands

    threshold = configs.TMA_MIN_ROWS
    for k, n in [(4096, 4096), (4096, 14336), (4136, 4000)]:
        x, w, bias = _randn(threshold, k, seed=k + 1), _randn(n, k, seed=n + 2), _randn(n, seed=3)
        many = configs.matmul_config(x.dtype, "nt", n, k, rows=threshold)
        few = configs.matmul_config(x.dtype, "nt", n, k, rows=threshold - 1)
        assert many.tma and not few.tma
        assert _tma_operands(x, w.t(), many, None) is not None  # M = threshold really runs the TMA kernel
        assert_bitwise_equal(matmul(x[:-1], w.t()), matmul(x, w.t())[:-1], f"matmul K={k} N={n}")
        assert_bitwise_equal(linear(x[:-1], w, bias), linear(x, w, bias)[:-1], f"linear+bias K={k} N={n}")
        # and a single row (the pointer kernel at M = 1) equals the last row of the TMA result
        assert_bitwise_equal(matmul(x[-1:], w.t())[0], matmul(x, w.t())[-1], f"last row K={k} N={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 4096, 4096), (1024, 4096, 14336)])
def test_gpu_accuracy_vs_cublas(shape):
    m, k, n = shape
    a, w = _randn(m, k, seed=34), _randn(n, k, seed=35)
    ref = matmul_fp64(a, w.t())
    assert _rel_err(matmul(a, w.t()), ref) <= 2 * _rel_err(torch.matmul(a, w.t()), ref)


@pytest.mark.gpu
def test_gpu_run_to_run_real_size():
    a, b = _randn(4096, 4096, seed=36), _randn(4096, 4096, seed=37)
    assert_run_to_run(lambda: matmul(a, b), repeats=3)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    m, k, n = (1 << 31) // 4096 + 64, 4096, 64  # A has 2^31 + 262144 elements
    torch.manual_seed(0)
    a = torch.empty((m, k), dtype=torch.bfloat16, device="cuda").normal_()
    b = _randn(k, n, seed=38)
    out = matmul(a, b)
    for row in (0, m // 2, m - 1):
        assert_bitwise_equal(out[row], matmul(a[row : row + 1], b)[0], f"row {row}")
    assert torch.allclose(out[-64:].float(), (a[-64:].float() @ b.float()), rtol=2e-2, atol=2e-1)


def test_launch_plans_never_serve_another_call_signature(monkeypatch):
    """Launch plans are cached per call signature: an operand 2 bytes off 16-byte alignment with a
    cached shape takes the pointer kernel (TMA needs aligned bases), bias and carry are part of the
    key, launch_linear(x, W) is launch_matmul(x, W.t()) with the same plan; every result equals the
    cold-cache one."""
    mm = importlib.import_module("det_train.ops.matmul")
    used = []
    real_launch_tma = mm._launch_tma
    monkeypatch.setattr(mm, "_launch_tma", lambda *a, **kw: used.append("tma") or real_launch_tma(*a, **kw))
    monkeypatch.setattr(configs, "TMA_MIN_ROWS", 64)  # the large "nt" entry's TMA kernel at 64 rows
    k, n = 256, 320
    buf, w, bias = _randn(64 * k + 8, seed=50), _randn(n, k, seed=51), _randn(n, seed=52)
    aligned, unaligned = buf[: 64 * k].view(64, k), buf[1 : 1 + 64 * k].view(64, k)

    def run(x, bb, linear_entry):
        out = torch.empty(64, n, dtype=torch.bfloat16, device=DEVICE)
        if linear_entry:
            return mm.launch_linear(x, w, out, bb)
        return launch_matmul(x, w.t(), out, bias=bb)

    cold = {}
    for key in [(x, bb) for x in ("aligned", "unaligned") for bb in (None, "bias")]:
        monkeypatch.setattr(mm, "_PLANS", type(mm._PLANS)())
        cold[key] = run(aligned if key[0] == "aligned" else unaligned, bias if key[1] else None, False)
    monkeypatch.setattr(mm, "_PLANS", type(mm._PLANS)())
    for _ in range(2):  # the second round runs on cached plans
        for (which, bb), want in cold.items():
            for linear_entry in (False, True):
                used.clear()
                x = aligned if which == "aligned" else unaligned
                got = run(x, bias if bb else None, linear_entry)
                assert used == (["tma"] if which == "aligned" else []), (which, bb, linear_entry)
                assert_bitwise_equal(got, want, f"{which} bias={bb} linear_entry={linear_entry}")
    a, b = _randn(40, 96, seed=53), _randn(96, 56, seed=54)
    carry = launch_matmul(a, b, torch.empty(40, 56, dtype=torch.float32, device=DEVICE))
    chained = launch_matmul(a, b, torch.empty(40, 56, dtype=torch.float32, device=DEVICE), carry=carry)
    plain = launch_matmul(a, b, torch.empty(40, 56, dtype=torch.float32, device=DEVICE))
    assert_bitwise_equal(plain, carry, "no carry after a carry call of the same shapes")
    assert not torch.equal(chained, plain)
