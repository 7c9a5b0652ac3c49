"""det_train.matmul: run-to-run, row/batch invariance, layouts, accuracy, chaining and bad input.

CPU (Triton interpreter) at small sizes; `gpu` tests at real sizes on a CUDA device.
"""

import dataclasses

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
from det_train import configs
from det_train.matmul import launch_matmul, matmul, matmul_partial
from det_train.reference import matmul_fp64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = [torch.bfloat16, torch.float16]
CPU_ROWS = [1, 2, 3, 17, 64, 65, 129]
GPU_ROWS = [1, 2, 3, 17, 64, 65, 127, 128, 129, 1000, 4096]


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
        "from det_train.matmul import matmul\n"
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
    """The forward's TMA kernel (host descriptors; plain and persistent) equals the pointer kernel
    bit for bit: K tail zero-filled, rows past M and columns past N never stored, bias added."""
    from det_train.matmul import _tma_operands

    for m, k, n in [(5, 72, 40), (33, 136, 24), (70, 200, 36)]:
        x, w, bias = (
            _randn(m, k, dtype=dtype, seed=m),
            _randn(n, k, dtype=dtype, seed=k),
            _randn(n, dtype=dtype),
        )
        base = dataclasses.replace(configs.matmul_config(dtype, "nt", n, k), block_m=16, block_n=16)
        for bb in (None, bias):
            ref = launch_matmul(x, w.t(), torch.empty(m, n, dtype=dtype, device=DEVICE), bias=bb, config=base)
            for persistent in (False, True):
                cfg = dataclasses.replace(base, tma=True, persistent=persistent)
                assert _tma_operands(x, w.t(), cfg, None) is not None  # the TMA path is the one tested
                got = launch_matmul(
                    x, w.t(), torch.empty(m, n, dtype=dtype, device=DEVICE), bias=bb, config=cfg
                )
                assert_bitwise_equal(got, ref, f"{m}x{k}x{n} bias={bb is not None} persistent={persistent}")
    # not eligible (row-major B, misaligned rows): the pointer kernel, same bits
    x, w = _randn(9, 68, dtype=dtype, seed=1), _randn(20, 68, dtype=dtype, seed=2)
    cfg = dataclasses.replace(configs.matmul_config(dtype, "nt", 20, 68), tma=True)
    assert _tma_operands(x, w.t(), cfg, None) is None  # 68 * 2 bytes is not a multiple of 16
    b_row_major = _randn(64, 24, dtype=dtype, seed=3)
    assert _tma_operands(_randn(9, 64, dtype=dtype, seed=4), b_row_major, cfg, None) is None  # "nn"
    assert_bitwise_equal(
        launch_matmul(x, w.t(), torch.empty(9, 20, dtype=dtype, device=DEVICE), config=cfg), matmul(x, w.t())
    )


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
    for key, cfg in configs._MATMUL_TABLE.items():
        if key[0] != "half":
            continue
        out = torch.empty_like(ref)
        launch_matmul(a, b, out, config=cfg)
        assert_bitwise_equal(out, ref, f"config {key}")
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
    b_t = b.t().contiguous().t()  # B = W.T: also the variant that loads W tiles and transposes them
    for nk in (False, True):
        out = torch.empty_like(ref)
        launch_matmul(a, b_t, out, config=dataclasses.replace(base, b_nk_tiles=nk))
        assert_bitwise_equal(out, ref, f"B read transposed, b_nk_tiles={nk}")
    for change in (dict(tma=True), dict(tma=True, persistent=True), dict(tma=True, block_m=256, block_n=128)):
        out = torch.empty_like(ref)  # TMA loads of A and of W's (N, K) tiles: same bits
        launch_matmul(a, b_t, out, config=dataclasses.replace(base, **change))
        assert_bitwise_equal(out, ref, f"B read transposed, {change}")


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
