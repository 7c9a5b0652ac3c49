"""CPU tests of ``AdamWSR(state_dtype=...)``: bf16 and 8-bit moments (issue 20).

The kernel runs through the Triton interpreter at small sizes; the long runs use the plain-torch
reference, which the first tests show bit-identical to the kernel for every format. FSDP2 over
1-4 gloo ranks: fsdp_states_worker.py. GPU: test_adamw_sr_states_gpu.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from adamw_sr import AdamWSR, _states, adamw_sr_step_reference, default_base_indices
from adamw_sr import _state_codes as codes
from adamw_sr.reference import _decode
from det_core import rng
from det_core import sr as det_sr
from det_core.testing import assert_bitwise_equal, digest, run_in_fresh_process, run_ranks

BLOCK = codes.QUANT_BLOCK
FORMATS = [torch.bfloat16, "8bit"]


def _ref_state(p: torch.Tensor, state_dtype, amsgrad: bool = False) -> dict:
    """Zero reference moments (and 8-bit scales) for ``p`` in the format of ``state_dtype``."""
    dtype = _states.moment_dtype(_states.canonical_state_dtype(state_dtype, "test"))
    out = {"m": torch.zeros(p.shape, dtype=dtype), "v": torch.zeros(p.shape, dtype=dtype), "vm": None}
    if amsgrad:
        out["vm"] = torch.zeros(p.shape, dtype=dtype)
    if state_dtype == "8bit":
        shape = _states.scale_shape(tuple(p.shape))
        out["ms"], out["vs"] = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    return out


def _ref_step(p, g, st, **kw) -> None:
    adamw_sr_step_reference(
        p, g, st["m"], st["v"], st["vm"], exp_avg_scale=st.get("ms"), exp_avg_sq_scale=st.get("vs"), **kw
    )


def _assert_state_equal(opt_state: dict, st: dict, name: str) -> None:
    assert_bitwise_equal(opt_state["exp_avg"], st["m"], f"{name} exp_avg")
    assert_bitwise_equal(opt_state["exp_avg_sq"], st["v"], f"{name} exp_avg_sq")
    if "ms" in st:
        assert_bitwise_equal(opt_state["exp_avg_scale"], st["ms"], f"{name} exp_avg_scale")
        assert_bitwise_equal(opt_state["exp_avg_sq_scale"], st["vs"], f"{name} exp_avg_sq_scale")
    if st["vm"] is not None:
        assert_bitwise_equal(opt_state["max_exp_avg_sq"], st["vm"], f"{name} max_exp_avg_sq")


def _grads(shapes, step, dtype):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


# --------------------------------------------------------------------------- kernel == reference


@pytest.mark.parametrize(
    "state_dtype,rounding,param_dtype,amsgrad,maximize",
    [
        (torch.bfloat16, "stochastic", torch.bfloat16, False, False),
        (torch.bfloat16, "nearest", torch.float32, True, True),
        ("8bit", "stochastic", torch.bfloat16, False, True),
        ("8bit", "nearest", torch.float32, False, False),
    ],
)
def test_kernel_equals_reference_bitwise(state_dtype, rounding, param_dtype, amsgrad, maximize):
    # odd sizes: masked tails and partial 8-bit blocks; (3, 64): 2-D scales; (2, 8192): full
    # (unmasked) windows at the interpreter's BLOCK of 8192; values over many orders of magnitude
    # put 8-bit codes in the subnormal range of their blocks
    shapes = [(7,), (33, 5), (3, 64), (2, 8192)]
    params = [
        (torch.randn(s, generator=torch.Generator().manual_seed(i)) * 3).to(param_dtype)
        for i, s in enumerate(shapes)
    ]
    refs = [p.clone() for p in params]
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    opt = AdamWSR(params, seed=2**40 + 7, state_dtype=state_dtype, state_rounding=rounding, **kw)
    align = BLOCK if state_dtype == "8bit" else 8
    bases = default_base_indices([p.numel() for p in params], [align] * len(params))
    ref_states = [_ref_state(p, state_dtype, amsgrad) for p in refs]
    scale = torch.logspace(-6, 2, 8192 * 2).reshape(2, 8192)
    for step in range(1, 4):
        grads = _grads(shapes, step, param_dtype)
        grads[3] = (grads[3].float() * scale).to(param_dtype)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for r, g, st, base in zip(refs, grads, ref_states, bases, strict=True):
            _ref_step(
                r, g, st, step=step, lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1,
                amsgrad=amsgrad, maximize=maximize, seed=2**40 + 7, base_index=base, state_rounding=rounding,
            )  # fmt: skip
    for i, (p, r, st) in enumerate(zip(params, refs, ref_states, strict=True)):
        assert_bitwise_equal(p, r, f"param {i}")
        _assert_state_equal(opt.state[p], st, f"param {i}")
    big = opt.state[params[3]]
    assert big["exp_avg"].dtype == _states.moment_dtype(_states.canonical_state_dtype(state_dtype, "t"))
    assert len(big["exp_avg"].unique()) > 100 and len(big["exp_avg_sq"].unique()) > 100  # real codes
    if state_dtype == "8bit":
        assert len(big["exp_avg_sq_scale"].unique()) > 10  # scales follow the blocks' magnitudes


# Launch variants (tile shape, tiles per window, masked sub-tiles, scalars precomputed or per program,
# warps) only change which thread computes what: each must give the reference's bits, also with bf16
# and 8-bit moments.
def _config_equals_reference(config, state_dtype, shapes, bases, seed, monkeypatch, wide=None) -> None:
    """Two AdamWSR steps through the interpreter under launch ``config`` equal the reference, bitwise
    (params and every state tensor); ``wide``: the index of a param whose gradients span 1e-8..1e2."""
    from adamw_sr import _kernel
    from adamw_sr.functional import PLAN_CACHE

    monkeypatch.setitem(_kernel.LAUNCH_CONFIGS, "interpreter", config)
    PLAN_CACHE.clear()
    params = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16() for i, s in enumerate(shapes)
    ]
    refs = [p.clone() for p in params]
    group = {"params": params, "base_index": bases}
    opt = AdamWSR([group], lr=3e-2, weight_decay=0.1, seed=seed, state_dtype=state_dtype)
    ref_states = [_ref_state(p, state_dtype) for p in refs]
    for step in range(1, 3):
        grads = _grads(shapes, step, torch.bfloat16)
        if wide is not None:
            grads[wide] = (grads[wide].float() * torch.logspace(-8, 2, grads[wide].numel())).bfloat16()
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for r, g, st, b in zip(refs, grads, ref_states, bases, strict=True):
            _ref_step(r, g, st, step=step, lr=3e-2, weight_decay=0.1, seed=seed, base_index=b)
    PLAN_CACHE.clear()
    for i, (p, r, st) in enumerate(zip(params, refs, ref_states, strict=True)):
        assert_bitwise_equal(p, r, f"param {i}")
        _assert_state_equal(opt.state[p], st, f"param {i}")


@pytest.mark.parametrize(
    "config,state_dtype",
    [
        (dict(BLOCK=64, SUB=32, num_warps=2, TILE_2D=False, PRECOMPUTED=False, EDGE_SUB=16), torch.bfloat16),
        (dict(BLOCK=64, SUB=32, num_warps=1, TILE_2D=False, PRECOMPUTED=False), "8bit"),
        (dict(BLOCK=128, SUB=64, num_warps=2, TILE_2D=True, PRECOMPUTED=True, EDGE_SUB=32), "8bit"),
    ],
)
def test_kernel_variants_equal_reference(config, state_dtype, monkeypatch):
    shapes = [(7,), (100,), (3, 33), (130,)]
    # bf16: unaligned bases (masked leading lanes); 8-bit: bases on blocks, beyond 2**32
    bases = [0, 8, 2**33 + 1, 10**12 + 7] if state_dtype == torch.bfloat16 else [0, 32, 2**33, 10**12]
    _config_equals_reference(config, state_dtype, shapes, bases, 5, monkeypatch)


# The GPU's own table entries through the interpreter: the tails of these sizes cut a quantisation
# block and a masked sub-tile (a full and a partial EDGE_SUB sub-tile in one masked tile), so an entry
# whose tiling logic is wrong fails here on CPU. A GPU miscompile of a right entry shows only on the
# GPU (test_adamw_sr_states_gpu.py, benchmarks/check_state_configs.py).
@pytest.mark.parametrize("entry", ["cuda-8bit", "cuda-bf16"])
def test_gpu_table_entries_through_the_interpreter_equal_reference(entry, monkeypatch):
    from adamw_sr import _kernel

    config = _kernel.LAUNCH_CONFIGS[entry]
    state_dtype = "8bit" if entry == "cuda-8bit" else torch.bfloat16
    edge, sub, window = config["EDGE_SUB"], config["SUB"], config["BLOCK"]
    # tails after a full window and tile: one full masked sub-tile, then one cut inside a block
    tails = [edge + 3, edge + BLOCK + 5, sub - 1]
    shapes = [(window + sub + t,) for t in tails] + [(7, 13)]
    for n in (s[0] for s in shapes[:3]):
        tail = n % sub
        assert tail > edge and tail % BLOCK and tail % edge  # a full and a cut sub-tile, a cut block
    bases = [0, 2**33, 10**12, 2**40] if state_dtype == "8bit" else [0, 2**33 + 1, 10**12 + 7, 2**40 + 3]
    _config_equals_reference(config, state_dtype, shapes, bases, 11, monkeypatch, wide=1)


# --------------------------------------------------------------------------- the 8-bit codes


@triton.jit
def _codec_kernel(x_ptr, scale_ptr, bits_ptr, code_ptr, out_ptr, n, M: tl.constexpr, SIGNED: tl.constexpr,
                  STOCHASTIC: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    i = tl.arange(0, BLOCK_N)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + i, mask=mask, other=1)
    code = codes.encode(x, scale, tl.load(bits_ptr + i, mask=mask, other=0), M, SIGNED, STOCHASTIC)
    tl.store(code_ptr + i, code, mask=mask)
    tl.store(out_ptr + i, codes.decode(code, scale, M, SIGNED), mask=mask)


def _special_and_random_values(n: int = 3000) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, n)
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 2.0**126, -(2.0**127), 1e-40, -1e-44, 2.0**-126]
    return torch.cat([x, torch.tensor(special)])


@pytest.mark.parametrize("signed,mantissa_bits", [(True, 3), (False, 4)])
def test_codes_triton_equal_torch_and_decode_to_the_table(signed, mantissa_bits):
    x = _special_and_random_values()
    x = x if signed else x.abs()
    scale = codes.block_scales_torch(x).repeat_interleave(BLOCK)[: x.numel()]
    bits = rng.random_bits_torch(1, 2, 3, torch.arange(x.numel()))
    for stochastic in (True, False):
        code, out = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(x.numel())
        as_int32 = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
        _codec_kernel[(1,)](
            x, scale.to(torch.int32), as_int32, code, out, x.numel(), mantissa_bits, signed, stochastic,
            BLOCK_N=4096,
        )  # fmt: skip
        ref = codes.encode_torch(x, scale, bits if stochastic else None, mantissa_bits, signed)
        assert_bitwise_equal(code, ref, f"codes, stochastic={stochastic}")
        assert_bitwise_equal(out, codes.decode_torch(ref, scale, mantissa_bits, signed), "decoded values")
        finite = x.abs() < 2.0**126
        assert out[~finite].isnan().all() and not out[finite].isnan().any()  # NaN, Inf, >= 2**126 -> NaN
        step = (scale[finite].double() - 127).exp2() * 2.0 ** -(mantissa_bits + 1)  # the top binade's step
        error = (out[finite].double() - x[finite].double()).abs()
        assert (error < step).all() if stochastic else (error <= step / 2).all()
    # the code table: exponent field f (bias 15) and mantissa; f = 15: 1.0 and NaN; f = 0: subnormal
    m, top = mantissa_bits, 15 << mantissa_bits
    table = {
        0: 0.0,
        1: 2.0 ** (-14 - m),
        1 << m: 2.0**-14,
        top - (1 << m): 0.5,
        top: 1.0,
        top - 1: 1 - 2.0 ** (-1 - m),
    }
    code = torch.tensor(list(table), dtype=torch.uint8)
    one = torch.full(code.shape, 127)  # scale 2**0
    assert codes.decode_torch(code, one, m, signed).tolist() == list(table.values())
    nan = torch.tensor([top | ((1 << m) - 1)], dtype=torch.uint8)
    assert codes.decode_torch(nan, one[:1], m, signed).isnan().all()
    if signed:
        assert codes.decode_torch(code | 0x80, one, m, signed).tolist() == [-v for v in table.values()]
    # a positive second moment never stores as 0; its smallest code is 2**-18 of the block scale
    tiny = codes.encode_torch(torch.tensor([1e-30, 0.0]), torch.tensor([127, 127]), None, m, signed)
    assert tiny.tolist() == ([0, 0] if signed else [1, 0])


# --------------------------------------------------------------------------- SR of the write-back


def _one_step(state_dtype, grads: torch.Tensor, rounding="stochastic", seed=0) -> dict:
    """One step from zero state on fp32 weights: the stored moments (8 bits: decoded)."""
    p = torch.zeros(grads.shape)
    opt = AdamWSR([p], lr=1e-3, state_dtype=state_dtype, state_rounding=rounding, seed=seed)
    p.grad = grads.clone()
    opt.step()
    s = opt.state[p]
    if state_dtype == "8bit":
        return {
            "exp_avg": _decode(s["exp_avg"], s["exp_avg_scale"], codes.EXP_AVG_MANTISSA_BITS, True),
            "exp_avg_sq": _decode(s["exp_avg_sq"], s["exp_avg_sq_scale"], codes.EXP_AVG_SQ_MANTISSA_BITS, 0),
        }  # fmt: skip
    return {k: s[k].float() for k in ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize(
    "state_dtype,big,keys",
    [
        # every element 1.2345: m = 0.12345, v = 0.001524, each between two bf16 neighbours
        (torch.bfloat16, 1.0, ("exp_avg", "exp_avg_sq")),
        ("8bit", 1.0, ("exp_avg", "exp_avg_sq")),  # equal blocks: each value in its block's top binade
        ("8bit", 3e4, ("exp_avg",)),  # element 0 of each block 3e4x the others: their m in subnormal codes
        ("8bit", 300.0, ("exp_avg_sq",)),  # ... 300x: their v (90,000x smaller) in subnormal codes
    ],
)
def test_sr_write_back_of_the_moments_is_unbiased(state_dtype, big, keys):
    n = 1 << 14
    grads = torch.full((n,), 1.2345)
    grads[::BLOCK] *= big
    exact = _one_step(torch.float32, grads)  # the fp32 moments SR rounds
    sr, nearest = _one_step(state_dtype, grads), _one_step(state_dtype, grads, rounding="nearest")
    small = torch.ones(n, dtype=torch.bool)
    small[::BLOCK] = big == 1.0
    for key in keys:
        want = exact[key][small][0].item()
        got = sr[key][small].double()
        values = sorted(set(got.tolist()))
        assert len(values) == 2 and values[0] < want < values[1], (key, values, want)  # the two neighbours
        f = (want - values[0]) / (values[1] - values[0])
        sigma = (values[1] - values[0]) * math.sqrt(f * (1 - f) / got.numel())
        assert abs(got.mean().item() - want) < 4 * sigma, (key, got.mean().item(), want, sigma)
        assert len(set(nearest[key][small].tolist())) == 1  # round-to-nearest: one value


@pytest.mark.parametrize("state_dtype", FORMATS)
def test_sr_bits_of_the_moments_come_from_the_high_half_of_the_param_word(state_dtype):
    # one step from zero state: both moments are rounded with 8 random bits each from the high half of
    # the param stream's Philox word at the global index (det-core's STREAM_PARAM_SR, whose low half
    # rounds a bf16 param): exp_avg bits 16-23, exp_avg_sq bits 24-31, each over a constant half of
    # its last place; not the retired STREAM_STATE_SR word, not with the bytes swapped
    n = 4096
    grads = torch.full((n,), 1.2345)
    grads[::BLOCK] *= 3.0  # 8 bits: each block's scale from its first element, the others in a lower binade
    p = torch.zeros(n)
    opt = AdamWSR([p], lr=1e-3, state_dtype=state_dtype, seed=11)
    p.grad = grads.clone()
    opt.step()
    got = opt.state[p]
    exact = _one_step(torch.float32, grads)  # the fp32 moments the step rounds
    idx = torch.arange(n)
    assert codes.STATE_SR_BITS == 8 and codes.STATE_SR_RULE_VERSION == 2

    def stored(stream, swap=False):
        word = rng.random_bits_torch(11, 1, stream, idx)
        operands = {"exp_avg": ((word >> 16) & 0xFF) << 8 | 0x80, "exp_avg_sq": (word >> 24) << 8 | 0x80}
        for key, shift in (("exp_avg", codes.EXP_AVG_SR_SHIFT), ("exp_avg_sq", codes.EXP_AVG_SQ_SR_SHIFT)):
            assert torch.equal(codes.state_rounding_bits_torch(word, shift), operands[key])
        if swap:
            operands = {"exp_avg": operands["exp_avg_sq"], "exp_avg_sq": operands["exp_avg"]}
        if state_dtype != "8bit":
            return {k: det_sr.stochastic_round_bf16_torch(exact[k], operands[k]) for k in operands}
        out = {}
        for key, bits, signed in (("exp_avg", 3, True), ("exp_avg_sq", 4, False)):
            scale = codes.block_scales_torch(exact[key])
            per_element = scale.repeat_interleave(BLOCK)[:n]
            out[key] = codes.encode_torch(exact[key], per_element, operands[key], bits, signed)
            out[key + "_scale"] = scale.to(torch.uint8)
        return out

    want = stored(rng.STREAM_PARAM_SR)
    for key, value in want.items():
        assert_bitwise_equal(got[key].flatten(), value, key)
    for other in (stored(rng.STREAM_STATE_SR), stored(rng.STREAM_PARAM_SR, swap=True)):
        for key in ("exp_avg", "exp_avg_sq"):
            assert not torch.equal(got[key].flatten(), other[key]), key


# --------------------------------------------------------------------------- the sub-ULP experiment


def _steady_run(state_dtype, rounding: str, steps: int, n: int = 256) -> tuple[torch.Tensor, ...]:
    """``steps`` reference steps (bit-identical to the kernel) of a tiny constant gradient 1e-3 on fp32
    weights at 1.0: returns the stored second moment (decoded) half-way and at the end, and the weights."""
    p = torch.ones(n)
    st = _ref_state(p, state_dtype)
    grad = torch.full((n,), 1e-3)
    vs = []
    for step in range(1, steps + 1):
        _ref_step(p, grad, st, step=step, lr=1e-3, weight_decay=0.0, state_rounding=rounding)
        if step in (steps // 2, steps):
            v = st["v"] if state_dtype != "8bit" else _decode(st["v"], st["vs"], 4, False)
            vs.append(v.double())
    return *vs, p.double()


@pytest.mark.parametrize("state_dtype", FORMATS)
def test_sub_ulp_second_moment_nearest_stalls_sr_tracks_fp32(state_dtype):
    # v_t = g^2 (1 - beta2^t) grows by (1 - beta2) beta2^(t-1) g^2 a step: after a few hundred steps
    # that is below half a bf16 ULP of v (and far below an 8-bit code step). Nearest stops there;
    # SR keeps the expected value on the fp32 run (measured: v mean 1.0015x / 1.0014x fp32, param
    # displacement 0.9995x / 1.0062x fp32; nearest: v 0.38x / 0.09x, displacement 1.25x / 1.81x)
    steps = 1000
    _, v32, p32 = _steady_run(torch.float32, "stochastic", steps)
    increment = 1e-3 * 0.999 ** (steps - 1) * 1e-6
    bf16_ulp = 2.0 ** (math.floor(math.log2(v32[0].item())) - 7)
    assert increment < 0.1 * bf16_ulp  # the last updates are a tenth of a bf16 ULP
    _, v_sr, p_sr = _steady_run(state_dtype, "stochastic", steps)
    v_rn_early, v_rn, p_rn = _steady_run(state_dtype, "nearest", steps)
    assert torch.equal(v_rn, v_rn_early) and v_rn[0] < 0.5 * v32[0]  # stalled half-way, far below
    sigma = v_sr.std().item() / math.sqrt(v_sr.numel())
    assert abs(v_sr.mean().item() - v32[0].item()) < 4 * sigma, (v_sr.mean().item(), v32[0].item(), sigma)
    moved = [(1 - p.mean().item()) / (1 - p32[0].item()) for p in (p_sr, p_rn)]
    assert abs(moved[0] - 1) < 0.02 and abs(moved[1] - 1) > 0.2, moved


@pytest.mark.parametrize("state_dtype", FORMATS)
def test_sub_ulp_run_kernel_equals_reference(state_dtype):
    n, steps = 300, 12
    a, b = torch.ones(n), torch.ones(n)
    opt = AdamWSR([a], lr=1e-3, weight_decay=0.0, state_dtype=state_dtype)
    st = _ref_state(b, state_dtype)
    for step in range(1, steps + 1):
        a.grad = torch.full((n,), 1e-3)
        opt.step()
        _ref_step(b, torch.full((n,), 1e-3), st, step=step, lr=1e-3, weight_decay=0.0)
    assert_bitwise_equal(a, b)
    _assert_state_equal(opt.state[a], st, "state")


# --------------------------------------------------------------------------- shards


@pytest.mark.parametrize(
    "state_dtype,numel,base,splits",
    [
        # bf16: arbitrary boundaries, nothing 4-aligned
        (torch.bfloat16, 143, 5, [[0, 47, 95, 143], [0, 36, 71, 107, 143]]),
        # 8-bit: boundaries on blocks of 32 (uneven shards, a partial last block)
        ("8bit", 350, 64, [[0, 96, 224, 350], [0, 64, 160, 256, 350]]),
    ],
)
def test_shards_with_base_index_equal_whole(state_dtype, numel, base, splits):
    full = torch.randn(numel, generator=torch.Generator().manual_seed(0)).bfloat16()
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(s)).bfloat16() for s in range(3)]
    whole = full.clone()
    opt = AdamWSR([{"params": [whole], "base_index": [base]}], lr=1e-2, seed=9, state_dtype=state_dtype)
    for g in grads:
        whole.grad = g
        opt.step()
    keys = ["exp_avg", "exp_avg_sq"] + (list(_states.SCALE_KEYS) if state_dtype == "8bit" else [])
    for bounds in splits:
        shards = [full[a:b].clone() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        group = {"params": shards, "base_index": [base + a for a in bounds[:-1]]}
        sharded = AdamWSR([group], lr=1e-2, seed=9, state_dtype=state_dtype)
        for g in grads:
            for s, a, b in zip(shards, bounds[:-1], bounds[1:], strict=True):
                s.grad = g[a:b].clone()
            sharded.step()
        assert_bitwise_equal(torch.cat(shards), whole, f"{len(shards)} shards")
        for key in keys:
            joined = torch.cat([sharded.state[s][key].flatten() for s in shards])
            assert_bitwise_equal(joined, opt.state[whole][key].flatten(), f"{len(shards)} shards: {key}")


def test_8bit_shard_off_the_block_grid_is_refused_untouched():
    shards = [torch.zeros(40).bfloat16(), torch.zeros(60).bfloat16()]
    opt = AdamWSR([{"params": shards, "base_index": [0, 40]}], lr=1e-2, state_dtype="8bit")
    for s in shards:
        s.grad = torch.ones_like(s)
    with pytest.raises(ValueError, match=r"blocks of 32 .*global index 40"):
        opt.step()
    assert all(len(opt.state[s]) == 0 for s in shards) and all(not s.any() for s in shards)


WORKER = Path(__file__).with_name("fsdp_states_worker.py")


def _launch_fsdp(nprocs: int, sizes: list[int], out_dir: Path, env_extra: dict) -> None:
    run_ranks(WORKER, nprocs, [out_dir, ",".join(map(str, sizes))], env=env_extra)


def fsdp_unsharded_digest(device) -> str:
    """The digest the FSDP2 workers must reproduce: the same steps on the unsharded model."""
    sys.path.insert(0, str(WORKER.parent))
    import fsdp_states_worker as w

    model = w.build_model(device)
    opt = AdamWSR(w.param_groups(model), lr=1e-2, weight_decay=0.1, seed=w.SEED)
    for step in range(w.STEPS):
        for i, p in enumerate(model.parameters()):
            p.grad = w.full_grad(i, p.shape, step, device)
        opt.step()
    return digest(w.state_tensors(model, opt, lambda t: t.cpu()))


def test_fsdp2_gloo_1_2_3_4_ranks_equal_unsharded_and_misaligned_shards_refused(tmp_path):
    _launch_fsdp(4, [1, 2, 3, 4], tmp_path, {"DET_FSDP_BACKEND": "gloo", "TRITON_INTERPRET": "1"})
    expected = fsdp_unsharded_digest(torch.device("cpu"))
    got = {w: (tmp_path / f"ws{w}.txt").read_text() for w in (1, 2, 3, 4)}
    assert all(d == expected for d in got.values()), got
    # every rank refuses with the same message, rank 0 too (whose own shard starts at 0): the check
    # covers every rank's shard
    texts = {(tmp_path / f"misaligned{rank}.txt").read_text() for rank in range(3)}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert text.startswith("untouched=True\n") and "blocks of 32" in text and "global index 11" in text, text


# --------------------------------------------------------------------------- compiled PTX


_COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adamw_sr import _kernel, _launch
fn = _kernel.adamw_sr_states_kernel
config = _kernel.LAUNCH_CONFIGS["cuda"]
types = dict(param_ptr="*bf16", grad_ptr="*bf16", steps_ptr="*fp32", hyper_ptr="*fp64", scalars_ptr="*fp32",
             tensor_table_ptr="*i64", chunk_table_ptr="*i64", grad_scale_ptr="*fp32", found_inf_ptr="*fp32",
             seed_lo="i64", seed_hi="i64", rng_stream="i32")
out = {{}}
for state, moment, scale in ((_kernel.FORMAT_BF16, "*bf16", "*bf16"), (_kernel.FORMAT_8BIT, "*u8", "*u8")):
    t = dict(types, exp_avg_ptr=moment, exp_avg_sq_ptr=moment, max_exp_avg_sq_ptr=moment,
             exp_avg_scale_ptr=scale, exp_avg_sq_scale_ptr=scale)
    sig = {{n: "constexpr" if n.isupper() else t[n] for n in fn.arg_names}}
    meta = dict(AMSGRAD=False, MAXIMIZE=False, PARAM_BF16=True, STOCHASTIC=True, ALIGNED=True,
                BLOCK=config["BLOCK"], SUB=config["SUB"], TILE_2D=True, PRECOMPUTED=True, UNSCALE=False,
                SKIP_ON_INF=False, STATE=state, STATE_STOCHASTIC=True,
                EDGE_SUB=_kernel.LAUNCH_CONFIGS["cuda-bf16"]["EDGE_SUB"])
    attrs = {{(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}}
    src = ASTSource(fn=fn, signature=sig, constexprs={{(fn.arg_names.index(k),): v for k, v in meta.items()}},
                    attrs=attrs)
    options = dict(num_warps=config["num_warps"], **_launch.exactness_options())
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    out[state] = {{k: ptx.count(k) for k in ("fma.rn.f32", ".ftz", ".approx", "div.full", "div.rn.f32",
                                            "sqrt.rn.f32")}}
print(json.dumps(out))
"""


def test_sm90_ptx_of_the_states_kernel_is_ieee():
    import json

    counts = json.loads(run_in_fresh_process(_COMPILE.format(), env={"TRITON_INTERPRET": "0"}))
    assert set(counts) == {"1", "2"}
    for state, c in counts.items():
        assert c["fma.rn.f32"] == 0 and c[".ftz"] == 0, (state, c)  # no contraction, subnormals kept
        assert c[".approx"] == 0 and c["div.full"] == 0, (state, c)  # IEEE division and square root
        assert c["div.rn.f32"] > 0 and c["sqrt.rn.f32"] > 0, (state, c)


# --------------------------------------------------------------------------- AMP and torch.compile


@pytest.mark.parametrize("state_dtype", FORMATS)
def test_amp_unscale_and_skip_with_states_equal_explicit_unscale(state_dtype):
    # the states kernel unscales like the fp32 one (the bits of an explicit unscale, then the step)
    # and a found_inf step writes nothing, codes and scales included
    shapes = [(3, 64), (70,)]
    init = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16() for i, s in enumerate(shapes)
    ]
    fused, explicit = [x.clone() for x in init], [x.clone() for x in init]
    opt_f = AdamWSR(fused, lr=1e-2, seed=3, state_dtype=state_dtype)
    opt_e = AdamWSR(explicit, lr=1e-2, seed=3, state_dtype=state_dtype)
    scale = torch.tensor([3.0])  # not a power of two: the unscale rounds
    for step in range(2):
        grads = _grads(shapes, step, torch.float32)
        for p, q, g in zip(fused, explicit, grads, strict=True):
            p.grad = (g * 3.0).bfloat16()
            q.grad = p.grad.clone()
        found_inf = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_([q.grad for q in explicit], found_inf, 1 / scale)
        opt_f.grad_scale, opt_f.found_inf = scale, torch.zeros(1)
        opt_f.step()
        opt_e.step()
    for p, q in zip(fused, explicit, strict=True):
        assert_bitwise_equal(p, q)
        assert_bitwise_equal(p.grad, q.grad, "unscaled gradient written back")
        for key, value in opt_e.state[q].items():
            assert_bitwise_equal(opt_f.state[p][key].cpu(), value.cpu(), key)
    before = digest({"params": fused, "state": opt_f.state_dict()})
    opt_f.found_inf = torch.ones(1)
    opt_f.step()
    assert digest({"params": fused, "state": opt_f.state_dict()}) == before


def test_compiled_optimizer_step_with_8bit_and_bf16_states_equals_eager():
    import torch._dynamo

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        groups = lambda m: [  # noqa: E731
            {"params": [m[0].weight, m[2].weight], "state_dtype": "8bit"},
            {"params": [m[0].bias, m[2].bias], "state_dtype": torch.bfloat16},
        ]
        model = model.to(torch.bfloat16)
        return model, AdamWSR(groups(model), lr=1e-3, seed=1)

    (m1, o1), (m2, o2) = make(), make()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    compiled = torch.compile(o2.step, backend="aot_eager")
    for _ in range(2):
        for model, step in ((m1, o1.step), (m2, compiled)):
            model.zero_grad()
            model(x).float().square().mean().backward()
            step()
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert_bitwise_equal(a, b)
        for key, value in o1.state[a].items():
            assert_bitwise_equal(o2.state[b][key], value, key)
    # one group (of 8-bit states) traces as one graph (two groups too: test_adamw_sr_compile.py)
    single = AdamWSR([m1[0].weight], lr=1e-3, state_dtype="8bit")
    m1[0].weight.grad = torch.ones_like(m1[0].weight)
    single.step()
    explained = torch._dynamo.explain(single.step)()
    assert explained.graph_break_count == 0 and explained.graph_count == 1
