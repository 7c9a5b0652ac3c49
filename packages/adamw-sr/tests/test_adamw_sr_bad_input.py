"""CPU tests of adamw_sr's bad-input contract: every bad param, gradient, hyperparameter, seed, step
or index gets a clear error (what was wrong, what to do), and a rejected step leaves params and
state untouched (checked by digest); NaN/Inf gradients and params without grad behave like torch.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from adamw_sr import AdamWSR, adamw_sr_step, adamw_sr_step_reference
from det_core.testing import assert_bitwise_equal, digest

# --------------------------------------------------------------------------- bad input


def _bad_step_leaves_everything_untouched(opt, params):
    before = digest({"params": [p.detach() for p in params], "state": opt.state_dict()})
    return lambda: digest({"params": [p.detach() for p in params], "state": opt.state_dict()}) == before


def test_bad_params_rejected_at_construction():
    with pytest.raises(TypeError, match="float16"):
        AdamWSR([torch.zeros(3, dtype=torch.float16)])
    with pytest.raises(TypeError, match="complex"):
        AdamWSR([torch.zeros(3, dtype=torch.complex64)])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        AdamWSR([torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="not contiguous"):
        AdamWSR([torch.zeros(4, 3).t()])
    with pytest.raises(ValueError, match="one device"):
        AdamWSR([torch.zeros(3), torch.zeros(3, device="meta")])
    with pytest.raises(ValueError, match="base_index"):
        AdamWSR([{"params": [torch.zeros(3), torch.zeros(2)], "base_index": [0]}])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "learning rate"),
        (dict(betas=(1.0, 0.9)), "betas"),
        (dict(eps=-1e-8), "epsilon"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(fused=False), "fused"),
        (dict(foreach=False), "foreach"),
        (dict(differentiable=True), "differentiable"),
        (dict(stochastic_rounding="yes"), "stochastic_rounding"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), "1 element"),
        (dict(lr=torch.tensor(math.nan)), "learning rate"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(eps=math.nan), "epsilon"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamWSR([torch.zeros(3)], **kwargs)


@pytest.mark.parametrize(
    "make_grad,error,match",
    [
        (lambda p: torch.zeros(p.shape, dtype=p.dtype).to_sparse(), RuntimeError, "sparse"),
        (lambda p: torch.zeros(p.shape, dtype=torch.float64), TypeError, "float32 or bfloat16"),
        (lambda p: torch.zeros(p.shape[1], p.shape[0], dtype=p.dtype).t(), ValueError, "contiguous"),
    ],
)
def test_bad_grad_rejected_and_step_leaves_params_and_state_untouched(make_grad, error, match):
    good, bad = torch.randn(4, 3).to(torch.bfloat16), torch.randn(4, 3).to(torch.bfloat16)
    opt = AdamWSR([good, bad], lr=1e-2)
    good.grad, bad.grad = torch.randn(4, 3).to(torch.bfloat16), torch.randn(4, 3).to(torch.bfloat16)
    opt.step()  # states exist
    unchanged = _bad_step_leaves_everything_untouched(opt, [good, bad])
    good.grad = torch.randn(4, 3).to(torch.bfloat16)  # the good param comes first: still untouched
    bad.grad_dtype = None  # let torch accept a gradient of another dtype, so that AdamWSR sees it
    bad.grad = make_grad(bad)
    with pytest.raises(error, match=match):
        opt.step()
    assert unchanged()


def test_param_without_grad_is_skipped_like_torch():
    a, b = torch.ones(3), torch.ones(3)
    opt = AdamWSR([a, b], lr=1e-2)
    a.grad = torch.ones(3)
    opt.step()
    assert b.tolist() == [1.0, 1.0, 1.0] and len(opt.state[b]) == 0 and opt.state[a]["step"].item() == 1


def test_nan_and_inf_gradients_propagate_like_torch():
    init = torch.randn(6)
    grad = torch.tensor([math.nan, math.inf, -math.inf, 1.0, 0.0, -2.0])
    ours, theirs = init.clone(), init.clone()
    oa, ob = AdamWSR([ours], lr=1e-2, amsgrad=True), torch.optim.AdamW([theirs], lr=1e-2, amsgrad=True)
    for _ in range(2):
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
    assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.isinf(), theirs.isinf())
    finite = ours.isfinite()
    assert torch.allclose(ours[finite], theirs[finite], rtol=0, atol=1e-6)
    assert ours.isnan()[:3].all()  # NaN / Inf gradients make NaN weights, as in torch


def test_mixed_dtypes_one_optimizer_and_add_param_group():
    a = torch.randn(5)
    b = torch.randn(6).to(torch.bfloat16)
    opt = AdamWSR([a], lr=1e-2, seed=4)
    opt.add_param_group({"params": [b], "weight_decay": 0.0})
    ra, rb = a.clone(), b.clone()
    a.grad, b.grad = torch.randn(5), torch.randn(6).to(torch.bfloat16)
    opt.step()
    adamw_sr_step_reference(ra, a.grad, torch.zeros(5), torch.zeros(5), step=1, lr=1e-2, seed=4)
    adamw_sr_step_reference(
        rb, b.grad, torch.zeros(6), torch.zeros(6), step=1, lr=1e-2, weight_decay=0.0, seed=4, base_index=8
    )
    assert_bitwise_equal(a, ra)
    assert_bitwise_equal(b, rb)


def test_param_replaced_after_construction_is_rejected_and_untouched():
    # found by a new-user check: p.data swapped for a transposed view or an fp16 tensor after the
    # optimizer was built must be rejected at step(), not updated through the wrong layout
    for replacement, error in (
        (torch.zeros(4, 4).t(), ValueError),
        (torch.zeros(4, 4, dtype=torch.float16), TypeError),
    ):
        p = torch.nn.Parameter(torch.zeros(4, 4))
        opt = AdamWSR([p], lr=0.1, weight_decay=0.0)
        p.data = replacement
        p.grad = torch.ones(
            4, 4, dtype=torch.float32 if replacement.dtype == torch.float32 else torch.float16
        )
        before = p.detach().clone()
        with pytest.raises(error):
            opt.step()
        assert torch.equal(p.detach(), before) and len(opt.state[p]) == 0


def test_cpu_step_without_interpreter_is_rejected_before_state(monkeypatch):
    p = torch.nn.Parameter(torch.ones(8))
    opt = AdamWSR([p], lr=0.1)
    p.grad = torch.ones(8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(8)) and len(opt.state[p]) == 0


@pytest.mark.parametrize(
    "seed,error,match",
    [
        (-1, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        (2**64, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        (True, TypeError, "seed must be an integer, got the bool"),
        (1.5, TypeError, "seed must be an integer"),
    ],
)
def test_functional_step_rejects_a_seed_outside_the_contract(seed, error, match):
    p, g = torch.ones(8), torch.ones(8)
    m, v = torch.zeros(8), torch.zeros(8)
    with pytest.raises(error, match=match):
        adamw_sr_step([p], [g], [m], [v], None, torch.ones(1), lr=0.1, seed=seed)
    assert torch.equal(p, torch.ones(8)) and torch.equal(m, torch.zeros(8))


# found by a new-user check: step 0 gave NaN (bias correction 1 - beta**0 = 0), a step past fp32's
# exact integers was accepted, and out-of-range hyperparameters ran silently in the functional step
@pytest.mark.parametrize(
    "step,kwargs,match",
    [
        (0.0, {}, r"steps must be integers in \[1, 2\*\*24 - 1\]"),
        (-3.0, {}, r"steps must be integers in \[1, 2\*\*24 - 1\]"),
        (2.0**24, {}, r"steps must be integers in \[1, 2\*\*24 - 1\]"),
        (2.0**30, {}, r"steps must be integers in \[1, 2\*\*24 - 1\]"),
        (1.5, {}, r"steps must be integers"),
        (math.nan, {}, r"steps must be integers"),
        (1.0, dict(lr=-1e-3), "Invalid learning rate"),
        (1.0, dict(lr=math.nan), "Invalid learning rate"),
        (1.0, dict(lr=torch.tensor([-1e-3])), "Invalid learning rate"),
        (1.0, dict(lr=torch.tensor([1e-3, 1e-3])), "1 element"),
        (1.0, dict(beta1=1.0), r"betas .* each must be in \[0, 1\)"),
        (1.0, dict(beta1=-0.1), r"betas .* each must be in \[0, 1\)"),
        (1.0, dict(beta2=1.0), r"betas .* each must be in \[0, 1\)"),
        (1.0, dict(beta2=math.nan), r"betas .* each must be in \[0, 1\)"),
        (1.0, dict(eps=-1e-8), "Invalid epsilon value"),
        (1.0, dict(weight_decay=-0.01), "Invalid weight_decay value"),
    ],
)
def test_functional_step_rejects_bad_steps_and_hyperparameters_untouched(step, kwargs, match):
    p = torch.randn(2, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    g = torch.randn(2, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    m = torch.randn(2, 6, generator=torch.Generator().manual_seed(2))
    v = torch.rand(2, 6, generator=torch.Generator().manual_seed(3))
    # a second, valid tensor of the launch, listed first
    q, mq, vq = torch.ones(5, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(5)
    before = digest([p, m, v, q, mq, vq])
    steps = torch.tensor([1.0, step])  # the bad step, if any, is the second tensor's
    call = {"lr": 1e-2, **kwargs}
    with pytest.raises(ValueError, match=match):
        adamw_sr_step([q, p], [torch.ones(5, dtype=torch.bfloat16), g], [mq, m], [vq, v], None, steps, **call)
    assert digest([p, m, v, q, mq, vq]) == before


def test_functional_step_at_the_largest_step_equals_reference():
    # 2**24 - 1 is the last accepted step: fp32 holds it exactly and the kernel's Philox counter and
    # bias-correction exponent take it as is
    p = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    g = torch.randn(300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    m = torch.randn(300, generator=torch.Generator().manual_seed(2)) * 1e-2
    v = torch.rand(300, generator=torch.Generator().manual_seed(3)) * 1e-4
    r, rm, rv = p.clone(), m.clone(), v.clone()
    step = 2**24 - 1
    adamw_sr_step([p], [g], [m], [v], None, torch.tensor([float(step)]), lr=1e-2, seed=8)
    adamw_sr_step_reference(r, g, rm, rv, step=step, lr=1e-2, seed=8)
    assert_bitwise_equal(p, r)
    assert_bitwise_equal(m, rm)
    # a different step gives other rounding bits: the step reached the kernel unchanged
    other = p.clone()
    adamw_sr_step_reference(other, g, m.clone(), v.clone(), step=step - 1, lr=1e-2, seed=8)
    assert not torch.equal(other, p)


def test_numpy_integer_seeds_are_accepted_and_equal_int_seeds():
    def functional(seed):
        p = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        adamw_sr_step([p], [torch.ones(64)], [torch.zeros(64)], [torch.zeros(64)], None, torch.ones(1),
                      lr=1e-3, seed=seed)  # fmt: skip
        return p

    assert_bitwise_equal(functional(np.int64(2**40 + 3)), functional(2**40 + 3))
    assert_bitwise_equal(functional(np.uint64(2**63 + 5)), functional(2**63 + 5))

    def optimizer(seed):
        p = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        opt = AdamWSR([p], lr=1e-3, seed=seed)
        p.grad = torch.ones(64, dtype=torch.bfloat16)
        opt.step()
        return p, opt

    (a, opt), (b, _) = optimizer(np.int64(7)), optimizer(7)
    assert_bitwise_equal(a, b)
    assert type(opt.param_groups[0]["seed"]) is int  # stored as a plain int: state_dicts stay portable


@pytest.mark.parametrize(
    "seed,error,match",
    [
        (True, TypeError, "AdamWSR: seed must be an integer, got the bool"),
        (np.True_, TypeError, "AdamWSR: seed must be an integer"),
        (1.5, TypeError, "AdamWSR: seed must be an integer"),
        ("7", TypeError, "AdamWSR: seed must be an integer"),
        (np.int64(-1), ValueError, r"AdamWSR: seed must be in \[0, 2\*\*64\)"),
    ],
)
def test_optimizer_rejects_non_integer_seeds(seed, error, match):
    with pytest.raises(error, match=match):
        AdamWSR([torch.zeros(3)], seed=seed)
    # a group's own seed too; the rejected group is not added
    opt = AdamWSR([torch.zeros(3)])
    with pytest.raises(error, match=match):
        opt.add_param_group({"params": [torch.zeros(2)], "seed": seed})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    "key, value, error, match",
    [
        ("seed", True, TypeError, "seed must be an integer"),
        ("seed", -3, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        ("seed", 1.5, TypeError, "seed must be an integer"),
        ("lr", -1.0, ValueError, "Invalid learning rate"),
        ("lr", math.nan, ValueError, "Invalid learning rate"),
        ("lr", "1e-3", TypeError, "lr must be a real number"),
        ("betas", (1.0, 0.9), ValueError, r"each must be in \[0, 1\)"),
        ("betas", (0.9,), ValueError, r"betas must be a pair"),
        ("eps", -1.0, ValueError, "Invalid epsilon value"),
        ("weight_decay", -1.0, ValueError, "Invalid weight_decay value"),
    ],
)
def test_group_values_edited_after_construction_are_rejected_before_the_step_counter_moves(
    key, value, error, match
):
    # param_groups are user-editable (LR schedulers write "lr"): step() re-checks them first
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40).to(torch.bfloat16)) for _ in range(2)]
    opt = AdamWSR(params, lr=1e-3, seed=5)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    # params and per-param state (the groups hold the bad value on purpose)
    before = digest({"params": [p.detach() for p in params], "state": opt.state_dict()["state"]})
    good = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    with pytest.raises(error, match=match):
        opt.step()
    assert digest({"params": [p.detach() for p in params], "state": opt.state_dict()["state"]}) == before
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)
    opt.param_groups[0][key] = good  # fixed: the next step runs as step 2
    opt.step()
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)


def test_numpy_seed_written_into_a_group_is_stored_as_an_int():
    p = torch.nn.Parameter(torch.randn(16).to(torch.bfloat16))
    opt = AdamWSR([p], lr=1e-3)
    p.grad = torch.ones_like(p)
    opt.param_groups[0]["seed"] = np.uint64(7)
    opt.step()
    assert type(opt.param_groups[0]["seed"]) is int and opt.param_groups[0]["seed"] == 7


@pytest.mark.parametrize(
    "base_indices, match",
    [([0, 8], "base_indices has 2 entries but params has 1"), ([-8], r"must be an int in \[0, 2\*\*62\)"),
     ([2**70], r"must be an int in \[0, 2\*\*62\)")],
)  # fmt: skip
def test_functional_step_rejects_bad_base_indices_untouched(base_indices, match):
    p = torch.randn(8).to(torch.bfloat16)
    m, v = torch.zeros(8), torch.zeros(8)
    before = digest([p, m, v])
    with pytest.raises(ValueError, match=match):
        adamw_sr_step([p], [torch.ones(8)], [m], [v], None, torch.ones(1), lr=1e-3, base_indices=base_indices)
    assert digest([p, m, v]) == before


def test_functional_step_names_a_sparse_gradient():
    p = torch.randn(8).to(torch.bfloat16)
    g = torch.ones(8).to_sparse()
    with pytest.raises(RuntimeError, match="SparseAdam"):
        adamw_sr_step([p], [g], [torch.zeros(8)], [torch.zeros(8)], None, torch.ones(1), lr=1e-3)


def test_functional_step_base_indices_must_be_integers_any_integer_type_works():
    p = torch.randn(8).to(torch.bfloat16)
    m, v = torch.zeros(8), torch.zeros(8)
    with pytest.raises(TypeError, match=r"base_indices\[0\] must be an integer"):
        adamw_sr_step([p], [torch.ones(8)], [m], [v], None, torch.ones(1), lr=1e-3, base_indices=[1.5])
    want = p.clone()
    adamw_sr_step(
        [want], [torch.ones(8)], [m.clone()], [v.clone()], None, torch.ones(1), lr=1e-3, base_indices=[64]
    )
    for index in (np.int64(64), torch.tensor(64)):
        got = p.clone()
        adamw_sr_step([got], [torch.ones(8)], [m.clone()], [v.clone()], None, torch.ones(1), lr=1e-3,
                      base_indices=[index])  # fmt: skip
        assert_bitwise_equal(got, want)


def test_tensor_hyperparameters_are_accepted_like_torch_adamw():
    # torch.optim.AdamW takes tensor betas / eps / weight_decay; so does AdamWSR, with the same bits
    def run(**kw):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(32).to(torch.bfloat16))
        opt = AdamWSR([p], lr=1e-3, seed=2, **kw)
        for _ in range(2):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.detach()

    want = run(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    got = run(
        betas=(torch.tensor(0.9), torch.tensor(0.99)), eps=torch.tensor(1e-8), weight_decay=torch.tensor(0.01)
    )
    assert_bitwise_equal(got, want)
    with pytest.raises(ValueError, match=r"Invalid betas"):
        AdamWSR([torch.nn.Parameter(torch.ones(4))], betas=(torch.tensor(1.0), 0.9))
    with pytest.raises(ValueError, match="eps as a tensor must have 1 element"):
        AdamWSR([torch.nn.Parameter(torch.ones(4))], eps=torch.ones(2))


# --------------------------------------------------------------------------- torch's flags, as torch decides


def test_foreach_true_is_refused_like_torch_refuses_foreach_with_fused():
    # the step is always one fused launch; torch.optim.AdamW(fused=True, foreach=True) raises too
    with pytest.raises(ValueError, match="foreach=True asks for torch's multi-tensor implementation"):
        AdamWSR([torch.zeros(3)], foreach=True)
    opt = AdamWSR([torch.zeros(3)])
    for flags in ({"foreach": True}, {"foreach": False}, {"fused": False}):
        with pytest.raises(ValueError, match="foreach must be None and fused None or True"):
            opt.add_param_group({"params": [torch.zeros(2)], **flags})
    assert len(opt.param_groups) == 1


def test_fused_true_runs_where_the_fused_step_runs_and_raises_elsewhere(monkeypatch):
    # under the interpreter fused=True is what the step is: the same bits as the default
    def run(**kw):
        p = torch.nn.Parameter(torch.randn(40, generator=torch.Generator().manual_seed(0)).bfloat16())
        opt = AdamWSR([p], lr=1e-2, seed=3, **kw)
        p.grad = torch.ones_like(p)
        opt.step()
        return p.detach(), opt

    (got, opt), (want, _) = run(fused=True), run()
    assert_bitwise_equal(got, want)
    assert opt.param_groups[0]["fused"] is True
    # elsewhere, at construction (torch checks fused=True's devices before any step as well)
    with pytest.raises(RuntimeError, match=r"AdamWSR\(fused=True\).*meta"):
        AdamWSR([torch.zeros(3, device="meta")], fused=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"AdamWSR\(fused=True\).*TRITON_INTERPRET"):
        AdamWSR([torch.zeros(3)], fused=True)
    with pytest.raises(ValueError, match="fused must be None or True"):
        AdamWSR([torch.zeros(3)], fused="yes")


def test_capturable_true_with_cpu_params_is_refused_like_torch():
    # torch.optim.AdamW's step asserts capturable params are on a capturable device; ours says so
    # at construction, for an added group, and at a step of a loaded group, before any state moves
    with pytest.raises(ValueError, match="capturable=True .* needs CUDA params; these are on cpu"):
        AdamWSR([torch.zeros(3)], capturable=True)
    p = torch.nn.Parameter(torch.randn(16).bfloat16())
    opt = AdamWSR([p], lr=1e-2)
    with pytest.raises(ValueError, match="capturable=True"):
        opt.add_param_group({"params": [torch.zeros(2)], "capturable": True})
    assert len(opt.param_groups) == 1
    p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state_dict()
    state["param_groups"][0]["capturable"] = True  # e.g. a GPU run's state_dict loaded on a CPU
    opt.load_state_dict(state)
    unchanged = _bad_step_leaves_everything_untouched(opt, [p])
    with pytest.raises(ValueError, match="capturable=True"):
        opt.step()
    assert unchanged() and float(opt.state[p]["step"]) == 1.0


def test_a_module_instead_of_its_parameters_names_the_fix():
    with pytest.raises(TypeError, match=r"got the module Linear; pass model.parameters\(\)"):
        AdamWSR(torch.nn.Linear(3, 2))


# --------------------------------------------------------------------------- overlapping base_index


def test_overlapping_base_index_in_one_group_is_refused():
    # two params with one base_index would draw the same rounding bits at every shared index
    a, b = torch.zeros(16, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"param 0 of param group 0 \(base_index=4, 16 elements: global indices \[4, 20\)\) and "
        r"param 1 of param group 0 \(base_index=12, 8 elements: global indices \[12, 20\)\) overlap.*"
        r"disjoint range.*omit base_index",
    ):
        AdamWSR([{"params": [a, b], "base_index": [4, 12]}])
    with pytest.raises(ValueError, match=r"param 0 .* and param 1 .* overlap"):
        AdamWSR([{"params": [a, b], "base_index": [3, 3]}])
    # adjacent ranges share no index, and None keeps a param's default index
    opt = AdamWSR([{"params": [a, b], "base_index": [4, 20]}])
    assert opt._base_indices() == {id(a): 4, id(b): 20}
    c = torch.zeros(8)
    match = (
        r"param 0 of param group 0 \(default index 0, 8 elements.* param 1 of param group 0 \(base_index=7"
    )
    with pytest.raises(ValueError, match=match):
        AdamWSR([{"params": [c, a], "base_index": [None, 7]}])


def test_one_param_listed_twice_in_a_group_is_refused_and_nothing_is_touched():
    # torch's Optimizer only warns; the fused step would apply two moment updates with one step count
    p, q = torch.nn.Parameter(torch.randn(64).bfloat16()), torch.nn.Parameter(torch.randn(32).bfloat16())
    match = r"AdamWSR: the param group lists one Parameter twice \(positions 0 and 2, shape \(64,\)\)"
    with pytest.warns(UserWarning, match="duplicate parameters"), pytest.raises(ValueError, match=match):
        AdamWSR([{"params": [p, q, p]}], lr=1e-2)
    opt = AdamWSR([p], lr=1e-2, seed=2)
    p.grad = torch.ones_like(p)
    opt.step()
    unchanged = _bad_step_leaves_everything_untouched(opt, [p, q])
    groups = list(opt.param_groups)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"positions 0 and 1, shape \(32,\)"):
        opt.add_param_group({"params": [q, q]})
    assert opt.param_groups == groups and unchanged()
    opt.add_param_group({"params": [q]})  # listed once: accepted
    assert opt._base_indices()[id(q)] == 64


def test_overlapping_base_index_across_groups_is_refused_and_nothing_is_touched():
    p, q = torch.nn.Parameter(torch.randn(64).bfloat16()), torch.nn.Parameter(torch.randn(32).bfloat16())
    opt = AdamWSR([p], lr=1e-2, seed=2)  # p at its default index 0: [0, 64)
    p.grad = torch.ones_like(p)
    opt.step()
    unchanged = _bad_step_leaves_everything_untouched(opt, [p, q])
    groups = list(opt.param_groups)
    with pytest.raises(
        ValueError,
        match=r"AdamWSR: param 0 of param group 0 \(default index 0, 64 elements: global indices \[0, 64\)\) "
        r"and param 0 of param group 1 \(base_index=40, 32 elements: global indices \[40, 72\)\) overlap",
    ):
        opt.add_param_group({"params": [q], "base_index": [40]})
    assert opt.param_groups == groups and unchanged()
    q.grad = torch.ones_like(q)  # q is not the optimizer's: the next step moves p only, from step 1
    opt.step()
    assert float(opt.state[p]["step"]) == 2.0 and q not in opt.state
    opt.add_param_group({"params": [q], "base_index": [64]})  # right after p: accepted
    assert opt._base_indices()[id(q)] == 64


def test_a_checkpoint_with_overlapping_base_index_is_refused_untouched():
    p, q = torch.nn.Parameter(torch.randn(40).bfloat16()), torch.nn.Parameter(torch.randn(24).bfloat16())
    opt = AdamWSR([{"params": [p, q], "base_index": [0, 40]}], lr=1e-2)
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0]["base_index"] = [0, 39]  # edited by hand: q's first index is p's last
    unchanged = _bad_step_leaves_everything_untouched(opt, [p, q])
    match = r"AdamWSR.load_state_dict \(the checkpoint's base_index\): param 0 .* param 1 .*\(base_index=39"
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert unchanged() and opt.param_groups[0]["base_index"] == [0, 40]


def test_first_overlap_finds_nested_and_touching_ranges():
    from adamw_sr.indices import first_overlap

    assert first_overlap([(0, 100), (200, 5), (50, 5)]) == (0, 2)  # inside a longer range, not adjacent
    assert first_overlap([(10, 5), (0, 10), (15, 1)]) is None  # touching ends share no index
    assert first_overlap([(0, 10), (5, 0)]) is None  # an empty range overlaps nothing
    assert first_overlap([(2**40, 8), (2**40 + 7, 1)]) == (0, 1)


def test_functional_step_refuses_overlapping_base_indices_untouched():
    params = [torch.randn(16).bfloat16(), torch.randn(8).bfloat16()]
    before = [p.clone() for p in params]
    ms, vs = [torch.zeros(16), torch.zeros(8)], [torch.zeros(16), torch.zeros(8)]
    match = r"params\[0\] \(global indices \[0, 16\)\) and params\[1\] \(global indices \[15, 23\)\) overlap"
    with pytest.raises(ValueError, match=match):
        adamw_sr_step(params, [torch.ones(16), torch.ones(8)], ms, vs, None, torch.ones(2), lr=1e-2,
                      base_indices=[0, 15])  # fmt: skip
    for p, q in zip(params, before, strict=True):
        assert_bitwise_equal(p, q)
    assert all(not t.any() for t in ms + vs)


def test_functional_step_refuses_one_tensor_given_twice_untouched():
    p = torch.randn(16).bfloat16()
    before = p.clone()
    ms, vs = [torch.zeros(16), torch.zeros(16)], [torch.zeros(16), torch.zeros(16)]
    with pytest.raises(ValueError, match=r"params\[0\] and params\[1\] are the same tensor"):
        adamw_sr_step([p, p], [torch.ones(16), torch.ones(16)], ms, vs, None, torch.ones(2), lr=1e-2)
    assert_bitwise_equal(p, before)
    assert all(not t.any() for t in ms + vs)


def _stepped(shape=(2, 8), **kw):
    p = torch.nn.Parameter(torch.randn(*shape).bfloat16())
    opt = AdamWSR([p], lr=1e-2, **kw)
    p.grad = torch.ones_like(p)
    opt.step()
    return p, opt


def _other_param_state():
    return _stepped((4, 4))[1].state_dict()


def _edit_group(key, value):
    def edit(sd):
        sd["param_groups"][0][key] = value

    return edit


def _edit_state(key, value):
    def edit(sd):
        sd["state"][0][key] = value(sd["state"][0]) if callable(value) else value

    return edit


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda sd: sd.update(_other_param_state()), ValueError, r"must have shape \(2, 8\).*got \(4, 4\)"),
        (_edit_group("lr", -1.0), ValueError, "param group 0 of the checkpoint: .*Invalid learning rate"),
        (_edit_group("seed", -5), ValueError, "param group 0 of the checkpoint: .*seed"),
        (_edit_group("amsgrad", "no"), TypeError, "amsgrad must be True or False"),
        (_edit_group("base_index", [3.0]), TypeError, "base_index entries must be ints"),
        (lambda sd: sd["state"][0].pop("exp_avg_sq"), ValueError, "lacks 'exp_avg_sq'"),
        (_edit_state("step", torch.tensor(-3.0)), ValueError, "step count .* not an integer in"),
        (_edit_state("step", torch.tensor(2.5)), ValueError, "step count .* not an integer in"),
        (_edit_state("step", torch.tensor(2.0**24 - 1)), ValueError, r"step count .* \[0, 2\*\*24 - 2\]"),
        (_edit_state("exp_avg_sq", lambda st: -st["exp_avg_sq"] - 1), ValueError, "'exp_avg_sq' .* negative"),
    ],
)
def test_a_bad_checkpoint_is_refused_at_load_and_the_optimizer_is_left_as_it_was(edit, error, match):
    """load_state_dict checks what add_param_group and the step check (options, the states' shapes
    and keys) and the values sqrt and the step count need, and a refused load leaves the optimizer's
    params, states and groups as they were (it used to load, then fail at the step with the moments gone)."""
    p, opt = _stepped()
    saved = copy.deepcopy(opt.state_dict())  # state_dict() holds the live state dicts
    edit(saved)
    unchanged = _bad_step_leaves_everything_untouched(opt, [p])
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(error, match=match):
        opt.load_state_dict(saved)
    assert unchanged() and opt.param_groups == groups
    p.grad = torch.ones_like(p)
    opt.step()  # still steps from its own state
    assert int(opt.state[p]["step"]) == 2


@pytest.mark.parametrize(
    "group, error, match",
    [
        ({"lr": -5.0}, ValueError, "Invalid learning rate"),
        ({"betas": (0.9, 1.5)}, ValueError, "Invalid betas"),
        ({"amsgrad": "no"}, TypeError, "amsgrad must be True or False"),
        ({"maximize": 1}, TypeError, "maximize must be True or False"),
        ({"base_index": [2**63]}, ValueError, r"must lie in \[0, 2\*\*63\)"),
        ({"base_index": 3.0}, TypeError, "base_index must be None, an int"),
        ({"base_index": [True]}, TypeError, "base_index entries must be ints"),
    ],
)
def test_add_param_group_checks_the_groups_own_options(group, error, match):
    """A group's own lr, betas, flags and base_index are checked where the group is added (also the
    groups given at construction), not first at the next step."""
    p, opt = _stepped()
    q = torch.nn.Parameter(torch.randn(8).bfloat16())
    with pytest.raises(error, match=match):
        opt.add_param_group({"params": [q], **group})
    assert len(opt.param_groups) == 1
    with pytest.raises(error, match=match):
        AdamWSR([{"params": [q], **group}])


def test_params_whose_memory_overlaps_are_refused():
    """Two params that are overlapping views of one buffer would have their shared elements updated
    twice in one fused step, by programs whose order is not fixed on a GPU (they were accepted);
    views that do not overlap are fine."""
    buffer = torch.randn(16).bfloat16()
    a, b = torch.nn.Parameter(buffer[:10]), torch.nn.Parameter(buffer[6:])
    with pytest.raises(ValueError, match=r"two params share memory \(shapes \(10,\) and \(10,\)"):
        AdamWSR([a, b])
    p, opt = _stepped()
    with pytest.raises(ValueError, match="two params share memory"):
        opt.add_param_group({"params": [torch.nn.Parameter(p.data.view(-1)[3:5])]})
    assert len(opt.param_groups) == 1
    halves = [torch.nn.Parameter(buffer[:8]), torch.nn.Parameter(buffer[8:])]
    AdamWSR(halves)  # disjoint views of one buffer


def test_numpy_integer_base_index_is_accepted_as_an_int():
    p = torch.nn.Parameter(torch.randn(8).bfloat16())
    opt = AdamWSR([{"params": [p], "base_index": [np.int64(16)]}])
    assert opt.param_groups[0]["base_index"] == [16] and type(opt.param_groups[0]["base_index"][0]) is int


@pytest.mark.parametrize(
    "args,error,match",
    [
        (([-3, 5],), ValueError, r"numels\[0\] = -3 must be >= 0: an element count is non-negative"),
        (([-8, -8],), ValueError, r"numels\[0\] = -8 must be >= 0"),
        (([3.5, 5],), TypeError, r"numels\[0\] must be an integer .*got float 3.5; pass element counts"),
        (([True, 5],), TypeError, r"numels\[0\] must be an integer, got the bool True"),
        (([np.bool_(True)],), TypeError, r"numels\[0\] must be an integer"),
        (([3, 5], [0, 0]), ValueError, r"alignments\[0\] = 0 must be >= 1: an alignment is positive"),
        (([3, 5], [8, -8]), ValueError, r"alignments\[1\] = -8 must be >= 1"),
        (([3, 5], [8, 8.0]), TypeError, r"alignments\[1\] must be an integer .*got float 8.0"),
        (([3, 5], [8]), ValueError, "alignments has 1 entries but numels has 2; give one alignment"),
    ],
)
def test_default_base_indices_refuses_bad_counts_and_alignments(args, error, match):
    from adamw_sr import default_base_indices

    with pytest.raises(error, match="adamw_sr.default_base_indices: " + match):
        default_base_indices(*args)


def test_default_base_indices_takes_numpy_and_tensor_integer_counts():
    from adamw_sr import default_base_indices

    counts = [np.int64(7), torch.tensor(165), np.uint8(3), 8, 0, 1]
    assert default_base_indices(counts) == [0, 8, 176, 184, 192, 192]
    assert default_base_indices(counts, [np.int32(32)] * 6) == [0, 32, 224, 256, 288, 288]
