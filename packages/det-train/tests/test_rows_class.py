"""The config table's rows class and the dW fold's tiles choose tilings and kernels, never bits.

M (the rows of a matmul) selects the rows class through the count of output tiles only
(``configs.wave_fill``); the open leaf's fold takes smaller tiles for layers with few of them
(``configs.weight_grad_fold_config``). Every entry of a dtype has one ``block_k`` / ``block_t``,
so each switch must leave every bit as it was: checked here on CPU (Triton interpreter, tiny
shapes with the thresholds moved) and with ``gpu`` tests at the main job's widths.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from det_core.testing import assert_bitwise_equal, assert_row_invariant
from det_train.ops import configs
from det_train.ops._leaf_fold import weight_grad_fold
from det_train.ops.weight_grad import weight_grad_partial

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
mm = importlib.import_module("det_train.ops.matmul")  # the module (det_train.matmul is also a function)


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=torch.bfloat16, device=DEVICE)


def test_rows_class_depends_on_m_only_through_the_tile_count():
    """The main job's layers (d_model 768) on 132 SMs: results of micro-batches of 1024 rows are
    "low" (except the 5120-wide gate|up, "mid"), 768-wide results of 2048-8192 rows "mid", wide
    ones and the issue's 1024 x 4096 x 4096 (128 tiles, 97% of one wave) "many"."""
    assert configs.WAVE_SMS == 132 and configs.MID_MAX_FILL == 0.75 and configs.LOW_MAX_FILL == 0.62
    assert configs.wave_fill(2048, 768) == 48 / 132
    assert configs.wave_fill(2048, 2304) == 144 / 264
    assert configs.wave_fill(1024, 2560, 128, 128) == 160 / 264  # 0.606: the down projection's dX
    assert configs.wave_fill(0, 768) == 0.0
    for rows, n, cls in [
        (1023, 768, "few"), (1024, 768, "low"), (1024, 2304, "low"), (1024, 2560, "low"),
        (1024, 5120, "mid"), (4096, 256, "low"), (8192, 256, "mid"), (2047, 768, "mid"),
        (2048, 768, "mid"), (4096, 768, "mid"), (8192, 768, "mid"),
        (16384, 768, "many"), (2048, 2304, "mid"), (2048, 5120, "many"), (1024, 4096, "many"),
        (8192, 14336, "many"), (None, 768, "many"),
    ]:  # fmt: skip
        assert configs.rows_class(rows, n) == cls, (rows, n)
    for n in (256, 768, 2304, 2560, 5120):  # every row count of one tile count has its class
        for m in range(1025, 20000, 7):
            assert configs.rows_class(m, n) == configs.rows_class(-(-m // 128) * 128, n), (m, n)
    # the entries the classes select; block_k is the dtype's in every one (the K order)
    b16 = torch.bfloat16
    for layout in ("nt", "nn"):
        low = configs.matmul_config(b16, layout, 768, 768, rows=1024)
        mid = configs.matmul_config(b16, layout, 768, 768, rows=2048)
        big = configs.matmul_config(b16, layout, 768, 768, rows=16384)
        assert low == configs._MATMUL_TABLE[("half", layout, "large", "low")]
        assert mid == configs._MATMUL_TABLE[("half", layout, "large", "mid")]
        assert low.block_m * low.block_n < mid.block_m * mid.block_n < big.block_m * big.block_n
        assert low.block_k == mid.block_k == big.block_k == 64
    for layout in ("tn", "tt"):  # no "mid" entry: the layout's "any" entry
        assert configs.matmul_config(b16, layout, 768, 768, rows=2048) == configs.matmul_config(
            b16, layout, 768, 768, rows=16384
        )
    assert (
        configs.matmul_config(b16, "nn", 768, 768, rows=100)
        == configs._MATMUL_TABLE[("half", "nn", "large", "any")]
    )


def test_low_and_mid_rows_classes_switch_tiles_not_bits(monkeypatch):
    """One call signature under the "low" class (LOW_MAX_FILL above every fill), "mid"
    (MID_MAX_FILL above every fill) and "many" (both 0): the forward x @ W.T (TMA kernel: 64 x 128,
    128 x 128 and 128 x 256 tiles, with and without bias) and dX = dY @ W (TMA 64 x 128, pointer
    128 x 128 and 128 x 256) give the same bits; the configs that ran differ."""
    monkeypatch.setattr(configs, "TMA_MIN_ROWS", 64)  # 64 rows take the TMA forward
    ran = []
    real_config = mm.matmul_config
    monkeypatch.setattr(mm, "matmul_config", lambda *a, **kw: ran.append(real_config(*a, **kw)) or ran[-1])
    x, w, bias, dy = (
        _randn(64, 256, seed=1),
        _randn(320, 256, seed=2),
        _randn(320, seed=3),
        _randn(64, 320, seed=4),
    )
    results = {}
    for cls, low_fill, mid_fill in (("low", 1.01, 1.01), ("mid", 0.0, 1.01), ("many", 0.0, 0.0)):
        monkeypatch.setattr(configs, "LOW_MAX_FILL", low_fill)
        monkeypatch.setattr(configs, "MID_MAX_FILL", mid_fill)
        ran.clear()
        fwd = [mm.launch_linear(x, w, _empty(64, 320), b) for b in (None, bias)]
        dx = mm.launch_matmul(dy, w, _empty(64, 256))
        expected = [("nt", cls), ("nt", cls), ("nn", cls if cls != "many" else "any")]
        assert ran == [configs._MATMUL_TABLE[("half", layout, "large", c)] for layout, c in expected], cls
        results[cls] = (*fwd, dx)
    for name, low, mid, many in zip(("y", "y + bias", "dx"), *results.values(), strict=True):
        assert_bitwise_equal(low, many, f"{name}: low vs many tiles")
        assert_bitwise_equal(mid, many, f"{name}: mid vs many tiles")


def _empty(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16, device=DEVICE)


def test_fold_tiles_do_not_change_bits():
    """The fold's table entries (mid 64 x 128, large 128 x 128 in 3 stages, the dW entries' 128 x
    128 and 128 x 256; TMA loads) resumed at the token step give the leaf node of
    weight_grad_partial; the mid entry serves the main job's 768 x 768 and 256 x 768 weights, the
    large one its qkv, gate|up and down and the wide layers (4096 x 4096 and up), the small class
    folds in its dW entry's tiles; block_t is the dW entry's everywhere."""
    b16 = torch.bfloat16
    shapes = [(768, 768, "mid"), (256, 768, "mid"), (2304, 768, "large"), (768, 2560, "large")]
    shapes += [(5120, 768, "large"), (4096, 4096, "large"), (14336, 4096, "large"), (64, 768, "dW")]
    for n, k, cls in shapes:
        fold, dw = configs.weight_grad_fold_config(b16, n, k), configs.weight_grad_config(b16, n, k)
        assert fold.block_t == dw.block_t == configs.BLOCK_T[b16]
        assert fold == (configs._WEIGHT_GRAD_FOLD_TABLE[("half", cls)] if cls != "dW" else dw), (n, k)
    fp32 = torch.float32
    assert configs.weight_grad_fold_config(fp32, 768, 768) == configs.weight_grad_config(fp32, 768, 768)
    gen = torch.Generator().manual_seed(5)
    dy = (torch.randint(-64, 64, (160, 136), generator=gen).float() / 32).to(b16).to(DEVICE)
    x = (torch.randint(-64, 64, (160, 200), generator=gen).float() / 32).to(b16).to(DEVICE)
    leaf = weight_grad_partial(dy, x, leaf_tokens=160).nodes[(0, 0)]
    entries = [
        configs._WEIGHT_GRAD_FOLD_TABLE[("half", "mid")],
        configs._WEIGHT_GRAD_FOLD_TABLE[("half", "large")],
        configs.weight_grad_config(b16, 2304, 768),
        configs.weight_grad_config(b16, 4096, 4096),
    ]
    for cfg in entries:
        acc = weight_grad_fold(dy[:64], x[:64], config=cfg)
        acc = weight_grad_fold(dy[64:], x[64:], acc, config=cfg)  # the last step masked (96 = 64 + 32)
        assert_bitwise_equal(acc, leaf, f"fold in {cfg.block_n} x {cfg.block_k} tiles")


# ----------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("n", [768, 2304])
def test_gpu_row_invariance_across_the_rows_classes(n):
    """Rows of x @ W.T (+ bias) and of dY @ W at the main job's widths (K = 768) from M = 1 to
    16384: "few", "low" (1024 rows), "mid" (2048-8192 rows at N = 768) and "many" — anchor first /
    middle / last."""
    from det_train.ops.linear import linear

    k = 768
    w, bias = _randn(n, k, seed=60), _randn(n, seed=61)
    rows = [1, 3, 1023, 1024, 2047, 2048, 4096, 8192, 16384]
    classes = {configs.rows_class(m, n) for m in rows}
    assert classes == {"few", "low", "mid", "many"}, classes
    assert_row_invariant(
        lambda x: linear(x, w, bias), lambda m: _randn(m, k, seed=m), rows, _randn(1, k, seed=62), "y"
    )
    w_rows = _randn(n, k, seed=63)  # dX = dY @ W: W (N, K) row-major, the result K = 768 wide
    assert_row_invariant(
        lambda d: mm.matmul(d, w_rows), lambda m: _randn(m, n, seed=m + 1), rows, _randn(1, n, seed=64), "dx"
    )
