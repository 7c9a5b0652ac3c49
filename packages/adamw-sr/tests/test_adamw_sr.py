"""CPU tests of adamw_sr: the Triton kernel through the interpreter at small sizes, and the plain-torch
reference for the long runs (the kernel equals the reference bit for bit, which is tested first).

Issue 3's tests a-g (a: tracks torch.optim.AdamW; b: SR unbiased and the quarter-ULP test; c: the
headline run at reduced size; d: weight decay alone; e: seeds, shards; f: resume in a fresh process;
g: a bf16-only network) and torch.compile. Bad input: test_adamw_sr_bad_input.py; FSDP2:
test_adamw_sr_fsdp.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from adamw_sr import AdamWSR, adamw_sr_step, adamw_sr_step_reference, default_base_indices
from adamw_sr.reference import pow_by_squaring, sqrt_rn_torch
from det_core.testing import assert_bitwise_equal, digest, run_in_fresh_process

BF16_ULP_AT_1 = 2.0**-7  # spacing of bf16 in [1, 2)


def _grads(shapes, step, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _run_reference(params, grads_per_step, *, amsgrad=False, lr=1e-2, seed=0, **kw):
    """Reference steps over params in order, at the optimizer's default base indices."""
    states = [
        dict(m=torch.zeros(p.shape), v=torch.zeros(p.shape), vm=torch.zeros(p.shape) if amsgrad else None)
        for p in params
    ]
    bases = default_base_indices(p.numel() for p in params)
    for step, grads in enumerate(grads_per_step, start=1):
        for p, g, s, base in zip(params, grads, states, bases, strict=True):
            kw_all = dict(step=step, lr=lr, amsgrad=amsgrad, seed=seed, base_index=base, **kw)
            adamw_sr_step_reference(p, g, s["m"], s["v"], s["vm"], **kw_all)
    return states


# --------------------------------------------------------------------------- kernel == reference


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "amsgrad,maximize,stochastic", [(False, False, None), (True, True, None), (False, False, False)]
)
def test_kernel_equals_reference_bitwise(param_dtype, amsgrad, maximize, stochastic):
    # odd sizes: masked windows; default bases 0, 8, 176, 184 (multiples of 8); (2, 8192) adds full
    # (unmasked) windows with the interpreter's BLOCK of 8192
    shapes = [(7,), (33, 5), (3,), (2, 8192)]
    params = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)).to(param_dtype)
        for i, s in enumerate(shapes)
    ]
    refs = [p.clone() for p in params]
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    opt = AdamWSR(params, seed=2**40 + 7, stochastic_rounding=stochastic, **kw)
    grads_per_step = [_grads(shapes, s, param_dtype) for s in range(3)]
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    states = _run_reference(
        refs, grads_per_step, lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, amsgrad=amsgrad,
        maximize=maximize, seed=2**40 + 7, stochastic_rounding=stochastic,
    )  # fmt: skip
    for i, (p, r, s) in enumerate(zip(params, refs, states, strict=True)):
        assert_bitwise_equal(p, r, f"param {i}")
        assert_bitwise_equal(opt.state[p]["exp_avg"], s["m"], f"exp_avg {i}")
        assert_bitwise_equal(opt.state[p]["exp_avg_sq"], s["v"], f"exp_avg_sq {i}")
        if amsgrad:
            assert_bitwise_equal(opt.state[p]["max_exp_avg_sq"], s["vm"], f"max_exp_avg_sq {i}")
        assert opt.state[p]["step"].item() == 3.0


# Launch variants (tile shape, tiles per window, scalars precomputed or per program, warps) change only
# which thread computes what: each must give the reference's bits. Sizes give full tiles, masked tails,
# tiles wholly past a tensor's end (skipped) and, at unaligned explicit bases, masked leading lanes.
@pytest.mark.parametrize(
    "config,amsgrad",
    [
        (dict(BLOCK=64, SUB=16, num_warps=2, TILE_2D=True, PRECOMPUTED=True), False),
        (dict(BLOCK=64, SUB=16, num_warps=2, TILE_2D=False, PRECOMPUTED=False), True),
        (dict(BLOCK=32, SUB=32, num_warps=1, TILE_2D=True, PRECOMPUTED=False), False),
        (dict(BLOCK=48, SUB=8, num_warps=1, TILE_2D=False, PRECOMPUTED=True), False),
    ],
)
def test_kernel_variants_equal_reference(config, amsgrad, monkeypatch):
    from adamw_sr import _kernel
    from adamw_sr.functional import PLAN_CACHE

    monkeypatch.setitem(_kernel.LAUNCH_CONFIGS, "interpreter", config)
    PLAN_CACHE.clear()
    shapes = [(7,), (100,), (3, 33), (130,)]
    bases = [0, 8, 2**33 + 1, 10**12 + 7]  # last two unaligned: leading lanes masked
    params = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16() for i, s in enumerate(shapes)
    ]
    refs = [p.clone() for p in params]
    opt = AdamWSR(
        [{"params": params, "base_index": bases}], lr=3e-2, weight_decay=0.1, amsgrad=amsgrad, seed=5
    )
    states = [(torch.zeros(s), torch.zeros(s), torch.zeros(s) if amsgrad else None) for s in shapes]
    for step in range(1, 3):
        grads = _grads(shapes, step, torch.bfloat16)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for r, g, (m, v, vm), b in zip(refs, grads, states, bases, strict=True):
            adamw_sr_step_reference(
                r, g, m, v, vm, step=step, lr=3e-2, weight_decay=0.1, amsgrad=amsgrad, seed=5, base_index=b
            )
    PLAN_CACHE.clear()
    for i, (p, r, (m, v, _)) in enumerate(zip(params, refs, states, strict=True)):
        assert_bitwise_equal(p, r, f"param {i}")
        assert_bitwise_equal(opt.state[p]["exp_avg"], m, f"exp_avg {i}")
        assert_bitwise_equal(opt.state[p]["exp_avg_sq"], v, f"exp_avg_sq {i}")


def test_reference_sqrt_is_correctly_rounded():
    # torch.sqrt on CPU is not correctly rounded in every build; the reference's sqrt_rn is
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 200_000)
    s = sqrt_rn_torch(x)
    sd, xd = s.double(), x.double()
    up = torch.nextafter(s, torch.full_like(s, math.inf)).double()
    down = torch.nextafter(s, torch.zeros_like(s)).double()
    # s is the nearest fp32: sqrt(x) lies between the midpoints to its neighbours (exact fp64 squares)
    assert bool((((sd + down) / 2) ** 2 <= xd).all()) and bool((((sd + up) / 2) ** 2 >= xd).all())
    assert_bitwise_equal(
        sqrt_rn_torch(torch.tensor([0.0, -0.0, math.inf, 4.0])), torch.tensor([0.0, -0.0, math.inf, 2.0])
    )


def test_default_base_indices_are_running_offsets_aligned_to_8():
    assert default_base_indices([7, 165, 3, 8, 0, 1]) == [0, 8, 176, 184, 192, 192]


def test_pow_by_squaring_close_to_pow():
    for step in (1, 2, 3, 10, 1000, 2**20 + 5):
        assert pow_by_squaring(0.999, step) == pytest.approx(0.999**step, rel=1e-12)


# --------------------------------------------------------------------------- a. tracks torch AdamW


def _track_torch(opt_kwargs_ours, opt_kwargs_torch, group_kw, steps=100, schedule=True):
    """Run ours and torch.optim.AdamW (fp32) side by side, plus torch's AdamW in fp64 as ground truth.

    Returns (max |ours - torch| over all steps, ours' and torch's final max |error| vs fp64)."""
    shapes = [(6, 5), (9,)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(10 + i)) for i, s in enumerate(shapes)]
    runs = [[x.clone() for x in init], [x.clone() for x in init], [x.double() for x in init]]
    opts = [AdamWSR, torch.optim.AdamW, torch.optim.AdamW]
    opts = [
        make([{"params": ps[:1], **group_kw}, {"params": ps[1:]}], **kw)
        for make, ps, kw in zip(
            opts, runs, (opt_kwargs_ours, opt_kwargs_torch, opt_kwargs_torch), strict=True
        )
    ]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=30, gamma=0.5) for o in opts] if schedule else []
    worst = 0.0
    for step in range(steps):
        for *ps, g in zip(*runs, _grads(shapes, step, torch.float32), strict=True):
            for p in ps:
                p.grad = g.to(p.dtype, copy=True)
        for o in (*opts, *scheds):
            o.step()
        worst = max(worst, max(float((p - q).abs().max()) for p, q in zip(runs[0], runs[1], strict=True)))
    errors = [
        max(float((p.double() - e).abs().max()) for p, e in zip(r, runs[2], strict=True)) for r in runs[:2]
    ]
    return worst, *errors


def test_a_fp32_tracks_torch_adamw_with_schedule_amsgrad_maximize():
    kw = dict(lr=1e-2, weight_decay=0.05)
    worst, ours_err, torch_err = _track_torch(kw, kw, {"amsgrad": True, "maximize": True})
    # the issue asks < 1e-4 vs torch; our decay p - p * (lr * wd) differs from torch's p * (1 - lr * wd)
    # (fp32-rounded factor) by ~1 ULP per few steps, hence no longer < 1e-6 (measured 1.7e-6)
    assert worst < 1e-5, worst
    # accuracy vs fp64: torch's CPU loop rounds fewer times (lerp, addcmul, addcdiv) than our separate
    # IEEE ops, ours has no decay-factor bias: measured 0.40x here, 1.41x in the tensor-lr test
    assert ours_err <= 1.5 * torch_err, (ours_err, torch_err)


def test_a_fp32_tracks_torch_adamw_tensor_lr():
    worst, ours_err, torch_err = _track_torch(
        dict(lr=torch.tensor(5e-3), weight_decay=0.01),
        dict(lr=torch.tensor(5e-3), weight_decay=0.01),
        {},
        schedule=False,
    )
    assert worst < 1e-5, worst
    assert ours_err <= 1.5 * torch_err, (ours_err, torch_err)


# --------------------------------------------------------------------------- b. SR is unbiased


def _one_step_from_one(n, lr, dtype, stochastic=None, seed=0):
    """Weights 1.0, gradient -1, no decay: one step moves each weight up by ~lr (Adam's first step)."""
    p = torch.ones(n, dtype=dtype)
    opt = AdamWSR([p], lr=lr, weight_decay=0.0, eps=1e-30, seed=seed, stochastic_rounding=stochastic)
    p.grad = -torch.ones(n, dtype=dtype)
    opt.step()
    return p


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.9])
def test_b_sr_is_unbiased(fraction):
    n = 1 << 14
    lr = fraction * BF16_ULP_AT_1
    exact = _one_step_from_one(4, lr, torch.float32)[0].item()  # the fp32 value SR rounds
    p = _one_step_from_one(n, lr, torch.bfloat16)
    values = set(p.float().unique().tolist())
    assert values == {1.0, 1.0 + BF16_ULP_AT_1}, values  # only the two neighbours
    f = (exact - 1.0) / BF16_ULP_AT_1
    sigma = BF16_ULP_AT_1 * math.sqrt(f * (1 - f) / n)
    assert abs(p.double().mean().item() - exact) < 4 * sigma
    nearest = _one_step_from_one(16, lr, torch.bfloat16, stochastic=False)
    expected_nearest = 1.0 + BF16_ULP_AT_1 if f > 0.5 else 1.0
    assert set(nearest.float().tolist()) == {expected_nearest}


def _reference_run(w, steps, grad_fn, **kw):
    """Long runs on the reference (bit-identical to the kernel: see *_kernel_equals_reference tests)."""
    m, v = torch.zeros(w.shape), torch.zeros(w.shape)
    means = []
    for step in range(1, steps + 1):
        adamw_sr_step_reference(w, grad_fn(w), m, v, step=step, **kw)
        means.append(w.double().mean().item())
    return means


def _kernel_run(w, steps, grad_fn, *, stochastic_rounding=None, seed=0, **kw):
    opt = AdamWSR([w], stochastic_rounding=stochastic_rounding, seed=seed, **kw)
    for _ in range(steps):
        w.grad = grad_fn(w)
        opt.step()


def _constant_push(w):
    return -torch.ones(w.shape, dtype=w.dtype)  # constant gradient: every Adam update is ~lr


def test_b_quarter_ulp_moves_with_sr_not_with_nearest():
    # the same quarter-ULP update 256 times: SR moves each weight ~64 ULP, nearest 0
    n, steps, kw = 512, 256, dict(lr=0.25 * BF16_ULP_AT_1, weight_decay=0.0, eps=1e-30)
    moved = {}
    for sr in (None, False):
        w = torch.ones(n, dtype=torch.bfloat16)
        means = _reference_run(w, steps, _constant_push, stochastic_rounding=sr, **kw)
        moved[sr] = (means[-1] - 1.0) / BF16_ULP_AT_1
    assert moved[False] == 0.0
    assert abs(moved[None] - steps / 4) < 3.0, moved  # 64 ULP; sd of the mean ~0.2 ULP


def test_b_quarter_ulp_kernel_equals_reference():
    kw = dict(lr=0.25 * BF16_ULP_AT_1, weight_decay=0.0, eps=1e-30)
    for sr in (None, False):
        a, b = torch.ones(300, dtype=torch.bfloat16), torch.ones(300, dtype=torch.bfloat16)
        _kernel_run(a, 12, _constant_push, stochastic_rounding=sr, **kw)
        _reference_run(b, 12, _constant_push, stochastic_rounding=sr, **kw)
        assert_bitwise_equal(a, b, f"stochastic_rounding={sr}")


# --------------------------------------------------------------------------- c. headline, reduced


def _toward_target(w):
    return (w.float() - 1.5).to(torch.bfloat16)  # gradient of 0.5 * (w - 1.5)^2


def test_c_headline_reduced():
    # the card's run (6,000 steps of 1e-4) reduced to 300 steps of 2.5e-3, a third of a bf16 ULP at 1.0
    kw = dict(lr=2.5e-3, weight_decay=0.0)
    means_sr = _reference_run(torch.ones(64, dtype=torch.bfloat16), 300, _toward_target, **kw)
    means_rn = _reference_run(
        torch.ones(64, dtype=torch.bfloat16), 300, _toward_target, stochastic_rounding=False, **kw
    )
    assert set(means_rn) == {1.0}  # nearest drops every update
    assert means_sr[59] > 1.1 and means_sr[-1] > 1.4, (means_sr[59], means_sr[-1])
    w1, w2 = torch.ones(64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    _kernel_run(w1, 15, _toward_target, **kw)
    _kernel_run(w2, 15, _toward_target, **kw)
    assert_bitwise_equal(w1, w2, "repeat of the headline run")
    w3 = torch.ones(64, dtype=torch.bfloat16)
    _reference_run(w3, 15, _toward_target, **kw)
    assert_bitwise_equal(w1, w3, "kernel vs reference")


# --------------------------------------------------------------------------- d. weight decay alone


def _weight_decay_alone(n, steps, lr, wd, checkpoints):
    """Zero gradient, decay by (1 - lr * wd) per step: SR follows the fp32 curve, nearest never moves."""
    p_sr, p_rn, p32 = torch.ones(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16), torch.ones(n)
    zeros = torch.zeros(n)
    states = [(torch.zeros(n), torch.zeros(n)) for _ in range(3)]
    ulp_below_1 = 2.0**-8
    for step in range(1, steps + 1):
        for p, (m, v), sr in ((p_sr, states[0], None), (p_rn, states[1], False), (p32, states[2], None)):
            adamw_sr_step_reference(p, zeros, m, v, step=step, lr=lr, weight_decay=wd, stochastic_rounding=sr)
        if step in checkpoints:
            assert abs(p32[0].item() - (1 - lr * wd) ** step) < 1e-4  # fp32 itself drifts ~1 ULP per 10 steps
            # SR noise is a random walk of +-1 ULP moves with probability lr * wd / ULP per step
            sigma = ulp_below_1 * math.sqrt(step * lr * wd / ulp_below_1 / n)
            assert abs(p_sr.double().mean().item() - p32[0].item()) < 5 * sigma, step
    assert set(p_rn.float().tolist()) == {1.0}  # nearest never decays
    return p_sr.double().mean().item(), p32[0].item()


def test_d_weight_decay_alone_follows_fp32_curve_reduced():
    # the run compressed 10x: 1,000 steps of decay 1e-5 (still 400x below one ULP)
    mean_sr, w32 = _weight_decay_alone(1024, 1000, lr=1e-3, wd=0.01, checkpoints={250, 500, 1000})
    assert mean_sr < 0.9915 and abs(w32 - 0.99005) < 1e-4


@pytest.mark.slow
def test_d_weight_decay_alone_follows_fp32_curve_full():
    # the run: lr 1e-4, wd 0.01, 10,000 steps (reference; the kernel version is a gpu test)
    mean_sr, w32 = _weight_decay_alone(4096, 10_000, lr=1e-4, wd=0.01, checkpoints={2500, 5000, 10_000})
    assert mean_sr < 0.9915


def test_d_weight_decay_kernel_equals_reference():
    n, steps = 300, 20
    p = torch.ones(n, dtype=torch.bfloat16)
    r = p.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    opt = AdamWSR([p], lr=0.5, weight_decay=0.01)  # decay 0.995 per step, ~1 ULP: many rounding choices
    for step in range(1, steps + 1):
        p.grad = torch.zeros(n, dtype=torch.bfloat16)
        opt.step()
        adamw_sr_step_reference(r, torch.zeros(n), m, v, step=step, lr=0.5, weight_decay=0.01)
    assert_bitwise_equal(p, r)
    assert len(set(p.float().tolist())) > 3


# --------------------------------------------------------------------------- e. keys and shards


def _one_bf16_step(seed, step_count=1, n=1000):
    p = torch.full((n,), 1.0, dtype=torch.bfloat16)
    opt = AdamWSR([p], lr=1e-3, weight_decay=0.0, seed=seed)
    for _ in range(step_count):
        p.grad = -torch.ones(n, dtype=torch.bfloat16)
        opt.step()
    return p


def test_e_same_seed_same_bits_other_seed_other_bits():
    a, b = _one_bf16_step(seed=3), _one_bf16_step(seed=3)
    assert_bitwise_equal(a, b)
    c = _one_bf16_step(seed=4)
    assert int((c != a).sum()) > 100  # ~1/8 of 1000 elements round up under each seed


def test_e_three_shards_with_base_index_equal_whole():
    rows, cols = 11, 13  # 143 elements, base 5: nothing is 4-aligned
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    grads = [
        torch.randn(rows, cols, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
        for s in range(3)
    ]
    whole = full.clone()
    opt = AdamWSR([{"params": [whole], "base_index": [5]}], lr=1e-2, seed=9)
    for g in grads:
        whole.grad = g
        opt.step()
    for parts in (3, 4):
        bounds = torch.linspace(0, rows * cols, parts + 1).long().tolist()
        flat = full.flatten()
        shards = [flat[a:b].clone() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        opt = AdamWSR([{"params": shards, "base_index": [5 + a for a in bounds[:-1]]}], lr=1e-2, seed=9)
        for g in grads:
            for s, a, b in zip(shards, bounds[:-1], bounds[1:], strict=True):
                s.grad = g.flatten()[a:b].clone()
            opt.step()
        assert_bitwise_equal(torch.cat(shards).view(rows, cols), whole, f"{parts} shards")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "8bit"])
def test_e_zero_size_params_step_like_torch_and_change_no_other_bit(state_dtype):
    """A zero-size param (a model's empty bias, a shard of nothing) is accepted, as torch.optim.AdamW
    accepts it: its state is zero-size, its step counts, and the other params' bits (their keys are
    the running element offsets, an empty param adds none) equal a run without it."""
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i, s in
            enumerate([(8, 40), (33,)])]  # fmt: skip
    plain, padded = [p.clone() for p in init], [p.clone() for p in init]
    empties = [torch.zeros(0, dtype=torch.bfloat16), torch.zeros(3, 0, dtype=torch.bfloat16)]
    padded = [empties[0], padded[0], empties[1], padded[1]]
    opts = [AdamWSR(ps, lr=1e-2, weight_decay=0.1, seed=5, state_dtype=state_dtype) for ps in (plain, padded)]
    for step in range(3):
        for i, (p, q) in enumerate(zip(plain, padded[1::2], strict=True)):
            p.grad = q.grad = _grads([p.shape], step, torch.bfloat16, seed=i)[0]
        for e in empties:
            e.grad = torch.zeros_like(e)
        for opt in opts:
            opt.step()
    for p, q in zip(plain, padded[1::2], strict=True):
        assert_bitwise_equal(q, p)
        assert digest(opts[1].state[q]) == digest(opts[0].state[p])
    for e in empties:
        state = opts[1].state[e]
        assert float(state["step"]) == 3.0
        assert all(v.numel() == 0 for k, v in state.items() if k != "step")
    reloaded = AdamWSR(padded, lr=1e-2, seed=5, state_dtype=state_dtype)
    reloaded.load_state_dict(opts[1].state_dict())
    assert digest(reloaded.state_dict()) == digest(opts[1].state_dict())


def test_e_functional_step_groups_any_way():
    # one launch over 3 tensors == 3 launches of one tensor each, with the same base indices
    shapes = [(5,), (17,), (2, 3)]
    params = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    bases = [0, 5, 22]
    a = [p.clone() for p in params]
    sa = [(torch.zeros(s), torch.zeros(s)) for s in shapes]
    ms, vs = [m for m, _ in sa], [v for _, v in sa]
    adamw_sr_step(a, grads, ms, vs, None, torch.ones(3), lr=1e-2, seed=1, base_indices=bases)
    for i, s in enumerate(shapes):
        b = params[i].clone()
        m, v = torch.zeros(s), torch.zeros(s)
        adamw_sr_step(
            [b], [grads[i]], [m], [v], None, torch.ones(1), lr=1e-2, seed=1, base_indices=[bases[i]]
        )
        assert_bitwise_equal(b, a[i])


# --------------------------------------------------------------------------- f. resume


_RESUME_CODE = """
import torch
from adamw_sr import AdamWSR
from det_core.testing import digest
params = [torch.zeros(s, dtype=torch.bfloat16) for s in [(9, 7), (5,)]]
opt = AdamWSR(params, lr=1e-2, weight_decay=0.1, amsgrad=True, seed=11)
saved = torch.load({path!r})
for p, x in zip(params, saved["params"]):
    p.copy_(x)
opt.load_state_dict(saved["opt"])
keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
assert all(opt.state[p][k].dtype == torch.float32 for p in params for k in keys)
for step in range(8, 16):
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
    opt.step()
print(digest({{"params": params, "state": opt.state_dict()}}))
"""


def test_f_resume_in_fresh_process(tmp_path):
    init = [
        torch.randn(s, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) for s in [(9, 7), (5,)]
    ]

    def run(steps, params, opt):
        for step in steps:
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()

    straight = [x.clone() for x in init]
    opt = AdamWSR(straight, lr=1e-2, weight_decay=0.1, amsgrad=True, seed=11)
    run(range(16), straight, opt)
    expected = digest({"params": straight, "state": opt.state_dict()})

    half = [x.clone() for x in init]
    opt = AdamWSR(half, lr=1e-2, weight_decay=0.1, amsgrad=True, seed=11)
    run(range(8), half, opt)
    path = str(tmp_path / "ckpt.pt")
    torch.save({"params": half, "opt": opt.state_dict()}, path)
    got = run_in_fresh_process(_RESUME_CODE.format(path=path))
    assert got == expected


def test_f_state_dict_layout_and_dtypes_like_torch():
    p = torch.randn(4, 3).to(torch.bfloat16)
    opt = AdamWSR([p], amsgrad=True)
    p.grad = torch.randn(4, 3).to(torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert sd["state"][0]["step"].dtype == torch.float32 and sd["state"][0]["step"].item() == 1.0
    assert sd["param_groups"][0]["seed"] == 0 and sd["param_groups"][0]["lr"] == 1e-3
    q = p.clone()
    opt2 = AdamWSR([q], amsgrad=True)
    opt2.load_state_dict(sd)
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert opt2.state[q][k].dtype == torch.float32  # torch's own load would cast them to bf16
        assert_bitwise_equal(opt2.state[q][k], opt.state[p][k], k)
        assert opt2.state[q][k].data_ptr() != sd["state"][0][k].data_ptr()  # not aliasing the dict


def test_f_loads_a_torch_adamw_state_dict():
    # drop-in: a torch.optim.AdamW checkpoint continues under AdamWSR with the same moments
    a, b = torch.randn(5, 3), None
    opt_t = torch.optim.AdamW([a], lr=1e-2, amsgrad=True)
    a.grad = torch.randn(5, 3)
    opt_t.step()
    b = a.detach().clone()
    opt = AdamWSR([b], lr=1e-3)
    opt.load_state_dict(opt_t.state_dict())
    assert opt.param_groups[0]["seed"] == 0 and opt.param_groups[0]["amsgrad"] is True
    assert_bitwise_equal(opt.state[b]["exp_avg"], opt_t.state[a]["exp_avg"])
    a.grad = torch.randn(5, 3)
    b.grad = a.grad.clone()
    opt_t.step()
    opt.step()
    assert opt.state[b]["step"].item() == 2.0
    assert float((a - b).abs().max()) < 1e-6


# --------------------------------------------------------------------------- g. bf16-only network


def _train_regression(kind, steps=40, lr=1e-3):
    # a linear layer 0.05 away from a solution; lr 1e-3 is below half a bf16 ULP for |w| > 0.25
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    w_true = torch.randn(16, 8, generator=g)
    y = x @ w_true
    w0 = w_true + 0.05 * torch.randn(16, 8, generator=g)
    if kind == "fp32_master":
        w = w0.clone().requires_grad_()
        opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
    else:
        w = w0.to(torch.bfloat16).requires_grad_()
        opt = AdamWSR([w], lr=lr, weight_decay=0.0, stochastic_rounding=(kind == "sr"))
    for _ in range(steps):
        opt.zero_grad()
        loss = ((x @ w.float() - y) ** 2).mean()
        loss.backward()
        opt.step()
    return ((x @ w.detach().float() - y) ** 2).mean().item()


def test_g_bf16_only_network_sr_beats_nearest_and_nears_fp32_master():
    loss_sr, loss_rn, loss_32 = (_train_regression(k) for k in ("sr", "nearest", "fp32_master"))
    assert loss_sr < 0.5 * loss_rn, (loss_sr, loss_rn, loss_32)
    # measured: SR 0.0139, nearest 0.0351, fp32 master 0.0123 (from 0.045)
    assert loss_sr < 1.25 * loss_32, (loss_sr, loss_32)


# --------------------------------------------------------------------------- torch.compile


def test_compiled_step_is_one_graph_and_bitwise_equal():
    shapes = [(5, 3), (4,)]
    params = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]

    def step(ps, gs, ms, vs, steps):
        adamw_sr_step(ps, gs, ms, vs, None, steps, lr=1e-2, seed=3, base_indices=[0, 15])

    def fresh():
        return [p.clone() for p in params], [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]

    eager, m1, v1 = fresh()
    step(eager, grads, m1, v1, torch.ones(2))
    compiled, m2, v2 = fresh()
    torch.compile(step, backend="aot_eager", fullgraph=True)(compiled, grads, m2, v2, torch.ones(2))
    for a, b in zip(compiled, eager, strict=True):
        assert_bitwise_equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(compiled, params, strict=True))  # it did update


def test_reference_round_nearest_equals_torch_cast():
    from adamw_sr.reference import round_nearest_bf16_torch

    x = torch.randn(100_000) * torch.logspace(-40, 38, 100_000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, math.inf, -math.inf, 3.3895e38, 1.00390625, 1.01171875])])
    assert_bitwise_equal(round_nearest_bf16_torch(x), x.to(torch.bfloat16))


def test_compiled_optimizer_step_has_no_graph_break_and_equals_eager():
    import torch._dynamo

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
        return model.to(torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)

    (m1, x), (m2, _) = make(), make()
    o1, o2 = AdamWSR(m1.parameters(), lr=1e-3, seed=1), AdamWSR(m2.parameters(), lr=1e-3, seed=1)
    compiled = torch.compile(o2.step, backend="aot_eager")
    for _ in range(2):
        for model, step in ((m1, o1.step), (m2, compiled)):
            model.zero_grad()
            model(x).float().square().mean().backward()
            step()
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert_bitwise_equal(a, b)
    explained = torch._dynamo.explain(o2.step)()
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_cached_launch_tables_do_not_keep_old_gradients_alive():
    # zero_grad(set_to_none=True) gives new gradient tensors each step: the cache must not pin the old
    import gc
    import weakref

    p = torch.zeros(64, dtype=torch.bfloat16)
    opt = AdamWSR([p], lr=1e-3)
    p.grad = torch.ones(64, dtype=torch.bfloat16)
    old = weakref.ref(p.grad)
    opt.step()
    p.grad = torch.ones(64, dtype=torch.bfloat16)
    opt.step()
    gc.collect()
    assert old() is None


@pytest.mark.parametrize(
    "param_dtype,grad_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_mixed_param_and_grad_dtypes_equal_reference(param_dtype, grad_dtype):
    p = torch.randn(300).to(param_dtype)
    g = torch.randn(300).to(grad_dtype)
    r = p.clone()
    m, v = torch.zeros(300), torch.zeros(300)
    adamw_sr_step([p], [g], [m.clone()], [v.clone()], None, torch.ones(1), lr=1e-2, seed=6)
    adamw_sr_step_reference(r, g, m, v, step=1, lr=1e-2, seed=6)
    assert_bitwise_equal(p, r)


def test_eager_step_bumps_version_counters_like_an_in_place_op():
    # eager steps skip the custom op's dispatch but must still tell autograd the tensors changed
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    opt = AdamWSR([p], lr=1e-2)
    before = p._version
    opt.step()
    m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
    versions = (p._version, m._version, v._version)
    assert p._version > before
    opt.step()
    assert all(t._version > old for t, old in zip((p, m, v), versions, strict=True))
