"""Stochastic rounding fp32 -> bf16: exact (bits) and statistical properties, Triton == torch."""

import pytest
import torch
import triton
import triton.language as tl
from det_core import rng, sr
from det_core.testing import assert_bitwise_equal, bits


@triton.jit
def _sr_kernel(x_ptr, out_ptr, N, seed_lo, seed_hi, step, stream, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    r = rng.random_bits(seed_lo, seed_hi, step, stream, offs.to(tl.int64))
    tl.store(out_ptr + offs, sr.stochastic_round_bf16(x, r), mask=m)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def sr_triton(x, seed=0, step=0, stream=rng.STREAM_PARAM_SR):
    x = x.to(_device())
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    lo, hi = rng.split_seed(seed)
    n = x.numel()
    _sr_kernel[(triton.cdiv(n, 256),)](x, out, n, lo, hi, step, stream, BLOCK=256)
    return out.cpu()


def sr_torch(x, seed=0, step=0, stream=rng.STREAM_PARAM_SR):
    r = rng.random_bits_torch(seed, step, stream, torch.arange(x.numel()).reshape(x.shape))
    return sr.stochastic_round_bf16_torch(x, r)


SPECIALS = torch.tensor(
    [
        0.0,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        -float("nan"),
        3.3895313892515355e38,  # largest finite bf16
        3.4028234663852886e38,  # largest finite fp32 (above the largest bf16)
        -3.4028234663852886e38,
        1e-40,
        -1e-40,  # fp32 subnormals
        1.0,
        -1.0,
        1.00390625,
        1.0 + 2**-10,
    ],
    dtype=torch.float32,
)
# NaN with its payload only in the low 16 bits: truncation alone would make it Inf
LOW_PAYLOAD_NAN = torch.tensor([0x7F800001, -0x007FFFFF], dtype=torch.int32).view(torch.float32)


def test_triton_equals_torch_reference_bitwise():
    x = torch.cat([torch.randn(2000) * 10.0 ** torch.randint(-30, 30, (2000,)), SPECIALS, LOW_PAYLOAD_NAN])
    for seed, step in [(0, 0), (7, 3), (2**40, 2**31)]:
        assert_bitwise_equal(sr_triton(x, seed, step), sr_torch(x, seed, step), f"sr seed={seed} step={step}")


def test_special_values():
    x = torch.cat([SPECIALS, LOW_PAYLOAD_NAN]).repeat(64)
    for out in (sr_torch(x), sr_triton(x)):
        f = out.float()
        assert torch.isnan(f[torch.isnan(x)]).all(), "NaN must stay NaN"
        inf = torch.isinf(x)
        assert torch.equal(f[inf], x[inf]), "+-Inf must stay +-Inf"
        zero = x == 0
        assert torch.equal(bits(out)[zero], bits(x.to(torch.bfloat16))[zero]), "sign of zero is kept"
        # NaN keeps its sign and becomes the quiet NaN pattern
        nan_bits = bits(out)[torch.isnan(x)].to(torch.int32) & 0xFFFF
        assert set(nan_bits.tolist()) <= {0x7FC0, 0xFFC0}
    # above the largest finite bf16: finite max or Inf with the sign kept, never NaN
    top = sr_torch(torch.full((4096,), 3.4028234663852886e38)).float()
    assert set(top.tolist()) <= {3.3895313892515355e38, float("inf")}
    assert 0 < int(torch.isinf(top).sum()) < 4096


def test_exactly_representable_values_are_unchanged():
    x = torch.randn(4096).to(torch.bfloat16).float()
    assert_bitwise_equal(sr_torch(x), x.to(torch.bfloat16), "bf16-representable input")


def test_result_is_one_of_the_two_neighbours():
    x = torch.randn(8192)
    out = sr_torch(x).float()
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncation toward zero
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)  # next magnitude up
    assert bool(((out == down) | (out == up)).all())


def test_unbiased_mean_of_many_draws():
    # 1 + 0.3 ULP drawn 20000 times: mean within 5 sigma of the value
    ulp = 2.0**-7
    value = 1.0 + 0.3 * ulp
    n = 20000
    x = torch.full((n,), value)
    out = sr_torch(x, seed=11).double()
    sigma = ulp * (0.3 * 0.7 / n) ** 0.5
    assert abs(float(out.mean()) - value) < 5 * sigma
    assert abs(float((out > 1.0).double().mean()) - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5


def test_quarter_ulp_update_4096_times_moves_1024_ulp_with_sr_and_0_with_nearest():
    ulp = 2.0**-7  # bf16 ULP in [1, 2)
    n_weights, steps = 64, 4096
    w_sr = torch.ones(n_weights, dtype=torch.bfloat16)
    w_rn = torch.ones(n_weights, dtype=torch.bfloat16)
    index = torch.arange(n_weights)
    for step in range(steps):
        r = rng.random_bits_torch(5, step, rng.STREAM_PARAM_SR, index)
        w_sr = sr.stochastic_round_bf16_torch(w_sr.float() + 0.25 * ulp, r)
        w_rn = (w_rn.float() + 0.25 * ulp).to(torch.bfloat16)
    moved_ulps = (w_sr.double() - 1.0) / ulp
    # expected 1024 ULP each; sum of 4096 Bernoulli(1/4) has sigma sqrt(768) ~ 27.7; ULP doubles at 2.0
    assert abs(float(moved_ulps.mean()) - 1024) < 5 * 27.7 / n_weights**0.5
    assert bool((w_rn == 1.0).all())


def test_same_key_same_bits_other_key_other_bits():
    x = torch.randn(4096) * 3
    base = sr_torch(x, seed=1, step=1)
    assert_bitwise_equal(sr_torch(x, seed=1, step=1), base, "same key")
    for other in (sr_torch(x, seed=2, step=1), sr_torch(x, seed=1, step=2)):
        assert (bits(other) != bits(base)).any()


def test_rejects_non_fp32_and_shape_mismatch():
    with pytest.raises(TypeError, match="fp32"):
        sr.stochastic_round_bf16_torch(torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        sr.stochastic_round_bf16_torch(torch.ones(4), torch.zeros(5, dtype=torch.int64))


@pytest.mark.gpu
def test_gpu_sr_equals_cpu_reference_at_size():
    x = torch.randn(1 << 22) * 100
    assert_bitwise_equal(sr_triton(x, 3, 9), sr_torch(x, 3, 9), "gpu sr")


@triton.jit
def _rn_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    tl.store(out_ptr + offs, sr.round_nearest_bf16(tl.load(x_ptr + offs, mask=m, other=0.0)), mask=m)


def test_round_nearest_equals_torch_cast_and_reference():
    # ties (low half exactly 0x8000) in both parities, specials and random values
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F8000], dtype=torch.int64).to(torch.int32)
    x = torch.cat([torch.randn(3000) * 1e3, SPECIALS, ties.view(torch.float32)])
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=_device())
    _rn_kernel[(triton.cdiv(x.numel(), 256),)](x.to(_device()), out, x.numel(), BLOCK=256)
    ref = sr.round_nearest_bf16_torch(x)
    assert_bitwise_equal(out.cpu(), ref, "round nearest: triton vs reference")
    finite = ~torch.isnan(x)
    assert_bitwise_equal(ref[finite], x[finite].to(torch.bfloat16), "round nearest vs torch cast")
