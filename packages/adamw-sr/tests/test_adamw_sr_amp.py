"""CPU tests of AdamWSR under AMP (``torch.amp.GradScaler``): the fused step unscales in the kernel.

(a) a step given ``grad_scale`` equals an explicit unscale
(``torch._amp_foreach_non_finite_check_and_unscale_``, what ``GradScaler.unscale_`` runs) followed by
a plain step, bit for bit, and equals the reference;
(b) a step with a nonzero ``found_inf`` leaves params, moments and step counts bitwise untouched, and
the run goes on as if it had not happened; (c) a real ``torch.amp.GradScaler`` loop on CPU takes the
fused path (no ``unscale_``, no host-synced ``_maybe_opt_step``) and equals the loop that unscales
explicitly, including a step skipped for an inf gradient. As torch's fused AdamW, a step leaves
``p.grad`` unscaled, and a skipped step leaves it as it was. The same bits on the GPU:
test_adamw_sr_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from adamw_sr import AdamWSR, adamw_sr_step, adamw_sr_step_reference, default_base_indices
from det_core.testing import assert_bitwise_equal, digest

SHAPES = [(7,), (3, 11), (40,)]  # odd sizes: masked tails; 3 tensors in one launch


def _init(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _scaled_grads(step, dtype, scale):
    # gradients as a scaled backward leaves them: the true gradient times the loss scale, in the
    # gradient dtype
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in SHAPES]


def _explicit_unscale(grads, scale: torch.Tensor) -> torch.Tensor:
    """What ``GradScaler.unscale_`` does to the gradients: in place, by the fp32 reciprocal."""
    found_inf = torch.zeros(())
    inv_scale = scale.double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return found_inf


def _state(params, opt):
    return {"params": [p.detach() for p in params], "state": opt.state_dict()["state"]}


@pytest.mark.parametrize(
    "param_dtype,grad_dtype,amsgrad,scale",
    [
        (torch.bfloat16, torch.bfloat16, False, 3.0),  # 1/3: the bf16 gradient's rounding back matters
        (torch.bfloat16, torch.float32, True, 65536.0),  # GradScaler's default scale
        (torch.float32, torch.float32, False, 1000.0),
        (torch.float32, torch.bfloat16, False, 0.7),  # a scale below 1 after many back-offs
    ],
)
def test_a_fused_unscale_equals_explicit_unscale_and_the_reference(param_dtype, grad_dtype, amsgrad, scale):
    fused, explicit, refs = _init(param_dtype), _init(param_dtype), _init(param_dtype)
    for p in fused + explicit:
        p.grad_dtype = None  # let torch accept a gradient of another dtype than the param's
    kw = dict(lr=3e-2, weight_decay=0.1, amsgrad=amsgrad, seed=11)
    opt_fused, opt_explicit = AdamWSR(fused, **kw), AdamWSR(explicit, **kw)
    states = [(torch.zeros(s), torch.zeros(s), torch.zeros(s) if amsgrad else None) for s in SHAPES]
    bases = default_base_indices(r.numel() for r in refs)
    scale_t = torch.tensor(scale)
    for step in range(1, 3):
        grads = _scaled_grads(step, grad_dtype, scale)
        for p, q, g in zip(fused, explicit, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt_fused.grad_scale, opt_fused.found_inf = scale_t, torch.zeros(())  # as GradScaler.step sets them
        opt_fused.step()
        found = _explicit_unscale([q.grad for q in explicit], scale_t)
        assert float(found) == 0.0
        opt_explicit.step()
        for r, g, (m, v, vm), b in zip(refs, grads, states, bases, strict=True):
            adamw_sr_step_reference(
                r, g, m, v, vm, step=step, lr=3e-2, weight_decay=0.1, amsgrad=amsgrad, seed=11, base_index=b,
                grad_scale=scale_t, found_inf=torch.zeros(()),
            )  # fmt: skip
        # the kernel writes the gradients back unscaled, as unscale_ (and torch's fused AdamW) leave them
        for i, (p, q) in enumerate(zip(fused, explicit, strict=True)):
            assert_bitwise_equal(p.grad, q.grad, f"gradient {i} after the step")
    for i, (p, q, r, (m, _, _)) in enumerate(zip(fused, explicit, refs, states, strict=True)):
        assert_bitwise_equal(p, q, f"param {i}: fused vs explicit unscale")
        assert_bitwise_equal(p, r, f"param {i}: fused vs reference")
        assert_bitwise_equal(opt_fused.state[p]["exp_avg"], opt_explicit.state[q]["exp_avg"], f"exp_avg {i}")
        assert_bitwise_equal(opt_fused.state[p]["exp_avg"], m, f"exp_avg {i} vs reference")
    assert digest(_state(fused, opt_fused)["state"]) == digest(_state(explicit, opt_explicit)["state"])
    # the scale reached the kernel: without it the step differs
    plain = _init(param_dtype)
    opt_plain = AdamWSR(plain, **kw)
    for step in range(1, 3):
        for p, g in zip(plain, _scaled_grads(step, grad_dtype, scale), strict=True):
            p.grad_dtype = None
            p.grad = g
        opt_plain.step()
    # (Adam's update is nearly scale-invariant; its moments are not)
    for a, b in zip(plain, fused, strict=True):
        assert not torch.equal(opt_plain.state[a]["exp_avg"], opt_fused.state[b]["exp_avg"])


@pytest.mark.parametrize("amsgrad", [False, True])
def test_b_found_inf_step_leaves_everything_bitwise_untouched(amsgrad):
    params = _init(torch.bfloat16)
    opt = AdamWSR(params, lr=1e-2, amsgrad=amsgrad, seed=3)
    scale = torch.tensor(1024.0)

    def step(n, found):
        for p, g in zip(params, _scaled_grads(n, torch.bfloat16, 1024.0), strict=True):
            p.grad = g
        opt.grad_scale, opt.found_inf = scale, torch.tensor(found)
        opt.step()

    step(1, 0.0)
    before = digest(_state(params, opt))
    step(2, 1.0)  # inf found: nothing moves, the gradients included
    assert digest(_state(params, opt)) == before
    assert digest([p.grad for p in params]) == digest(_scaled_grads(2, torch.bfloat16, 1024.0))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)
    step(2, 2.0)  # found_inf is a sum over devices: any nonzero value skips
    assert digest(_state(params, opt)) == before
    step(3, 0.0)
    # the run goes on as if the skipped steps had not happened
    ref = _init(torch.bfloat16)
    opt_ref = AdamWSR(ref, lr=1e-2, amsgrad=amsgrad, seed=3)
    for n in (1, 3):
        for p, g in zip(ref, _scaled_grads(n, torch.bfloat16, 1024.0), strict=True):
            p.grad = g
        opt_ref.grad_scale, opt_ref.found_inf = scale, torch.zeros(())
        opt_ref.step()
    assert digest(_state(params, opt)) == digest(_state(ref, opt_ref))
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)


def test_b_a_skipped_first_step_creates_zero_state_at_step_zero():
    # as torch's fused AdamW: the state exists after a skipped first step, all zero, step 0
    p = torch.nn.Parameter(torch.randn(9).bfloat16())
    before = p.detach().clone()
    opt = AdamWSR([p], lr=1e-2)
    p.grad = torch.full_like(p, float("inf"))
    opt.grad_scale, opt.found_inf = torch.tensor(8.0), torch.ones(())
    opt.step()
    assert_bitwise_equal(p.detach(), before)
    state = opt.state[p]
    assert float(state["step"]) == 0.0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_b_functional_step_skips_and_unscales_like_the_optimizer():
    p = torch.randn(30, generator=torch.Generator().manual_seed(0)).bfloat16()
    g = (torch.randn(30, generator=torch.Generator().manual_seed(1)) * 3.0).bfloat16()
    m, v = torch.zeros(30), torch.zeros(30)
    before = digest([p, m, v])
    adamw_sr_step([p], [g], [m], [v], None, torch.ones(1), lr=1e-2, grad_scale=torch.tensor(3.0),
                  found_inf=torch.ones(()))  # fmt: skip
    assert digest([p, m, v]) == before
    r, rm, rv = p.clone(), m.clone(), v.clone()
    g_kernel = g.clone()
    adamw_sr_step([p], [g_kernel], [m], [v], None, torch.ones(1), lr=1e-2, grad_scale=torch.tensor(3.0))
    adamw_sr_step_reference(r, g, rm, rv, step=1, lr=1e-2, grad_scale=3.0)
    assert_bitwise_equal(p, r)
    assert_bitwise_equal(m, rm)
    _explicit_unscale([g], torch.tensor(3.0))
    assert_bitwise_equal(g_kernel, g, "the gradient written back unscaled")


@pytest.mark.parametrize(
    "attr,value,error,match",
    [
        (
            "grad_scale",
            torch.tensor(2.0, dtype=torch.float64),
            TypeError,
            "grad_scale must be a float32 tensor",
        ),
        ("found_inf", 0.0, TypeError, "found_inf must be a float32 tensor"),
        ("grad_scale", torch.ones(2), ValueError, "grad_scale must have 1 element"),
    ],
)
def test_bad_amp_tensors_are_rejected_before_anything_moves(attr, value, error, match):
    p = torch.nn.Parameter(torch.randn(9).bfloat16())
    opt = AdamWSR([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.step()
    before = digest(_state([p], opt))
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.zeros(())
    setattr(opt, attr, value)
    with pytest.raises(error, match=match):
        opt.step()
    assert digest(_state([p], opt)) == before


def _train(explicit_unscale: bool, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    opt = AdamWSR(model.parameters(), lr=1e-2, weight_decay=0.1, seed=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    data = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randn(4, 6, generator=data).to(torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(x).float().square().mean()).backward()
        if i == 1:  # an overflow: this step is skipped and the scale backs off
            model[0].weight.grad[0, 0] = float("inf")
        if explicit_unscale:
            scaler.unscale_(opt)  # e.g. before clipping: GradScaler.step then passes found_inf only
        scaler.step(opt)
        scaler.update()
    return model, opt, scaler


def test_c_grad_scaler_loop_takes_the_fused_path_and_equals_explicit_unscale(monkeypatch):
    calls = []
    original_step = AdamWSR.step

    def watched_step(self, *args, **kwargs):
        calls.append((getattr(self, "grad_scale", None), getattr(self, "found_inf", None)))
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(AdamWSR, "step", watched_step)
    with monkeypatch.context() as fused_only:

        def refused(*args, **kwargs):
            raise AssertionError("GradScaler took its unscale-and-sync path")

        fused_only.setattr(torch.amp.GradScaler, "unscale_", refused)
        fused_only.setattr(torch.amp.GradScaler, "_maybe_opt_step", refused)
        fused = _train(explicit_unscale=False, monkeypatch=fused_only)
    assert [float(s) for s, _ in calls] == [1024.0, 1024.0, 512.0, 512.0]
    assert [float(f) for _, f in calls] == [0.0, 1.0, 0.0, 0.0]
    explicit = _train(explicit_unscale=True, monkeypatch=monkeypatch)
    assert all(s is None for s, _ in calls[4:])  # unscaled already: the kernel only reads found_inf
    (m1, o1, s1), (m2, o2, s2) = fused, explicit
    assert digest([p.detach() for p in m1.parameters()]) == digest([p.detach() for p in m2.parameters()])
    assert digest(o1.state_dict()["state"]) == digest(o2.state_dict()["state"])
    assert all(float(o1.state[p]["step"]) == 3.0 for p in m1.parameters())  # 4 steps, 1 skipped
    assert s1.get_scale() == s2.get_scale() == 1024.0  # backed off to 512, grew back after 2 good steps
