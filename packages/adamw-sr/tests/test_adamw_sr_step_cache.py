"""CPU tests of the eager step's recorded launches (``adamw_sr._step_cache``): a steady-state step
skips the full checks and gives the reference's bits; anything that changed (gradients elsewhere in
memory, a param without gradient, a param's storage, a replaced state tensor or step counter, a
loaded state) is noticed and stepped correctly; bad input met after recorded steps still raises and
leaves params and state untouched; the step counters are one buffer; a deep copy steps like the
original.
"""

from __future__ import annotations

import copy

import pytest
import torch
from adamw_sr import AdamWSR, adamw_sr_step_reference, default_base_indices
from adamw_sr import optimizer as optimizer_module
from det_core.testing import assert_bitwise_equal, digest

SHAPES = [(5,), (7,), (3, 4)]
HYPER = dict(lr=1e-2, weight_decay=0.1, seed=7)


def _params():
    return [
        torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16() for i, s in enumerate(SHAPES)
    ]


def _grad(i: int, step: int) -> torch.Tensor:
    return torch.randn(SHAPES[i], generator=torch.Generator().manual_seed(100 * step + i)).bfloat16()


class _Reference:
    """The plain-torch reference of each param, with its own step count."""

    def __init__(self, params):
        self.params = [p.clone() for p in params]
        self.moments = [(torch.zeros(p.shape), torch.zeros(p.shape)) for p in params]
        self.steps = [0] * len(params)
        self.bases = default_base_indices(p.numel() for p in params)

    def step(self, grads):
        for i, g in enumerate(grads):
            if g is None:
                continue
            self.steps[i] += 1
            m, v = self.moments[i]
            adamw_sr_step_reference(
                self.params[i], g, m, v, step=self.steps[i], base_index=self.bases[i], **HYPER
            )

    def check(self, params, opt):
        for i, p in enumerate(params):
            assert_bitwise_equal(p, self.params[i], f"param {i}")
            if self.steps[i]:
                assert_bitwise_equal(opt.state[p]["exp_avg"], self.moments[i][0], f"exp_avg {i}")
                assert float(opt.state[p]["step"]) == self.steps[i], i


@pytest.mark.parametrize("grads_in", ["fresh", "in_place", "alternate"])
def test_steady_state_steps_skip_the_full_checks_and_equal_the_reference(grads_in, monkeypatch):
    params = _params()
    ref = _Reference(params)
    opt = AdamWSR(params, **HYPER)
    # fresh: every step's gradients are new tensors, all kept alive, so each step's are elsewhere in
    # memory (a new launch plan for the gradients); in_place: the same tensors, overwritten;
    # alternate: two sets of tensors in turn (their plans found again)
    kept = []
    buffers = [[torch.empty(s, dtype=torch.bfloat16) for s in SHAPES] for _ in range(2)]
    for step in range(1, 6):
        grads = [_grad(i, step) for i in range(len(params))]
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if grads_in == "alternate":
                p.grad = buffers[step % 2][i].copy_(g)
            elif grads_in == "fresh" or p.grad is None:
                p.grad = g.clone()
                kept.append(p.grad)
            else:
                p.grad.copy_(g)
        if step == 2:  # from the second step on the recorded launches serve: no full check runs

            def full_check(ps):
                raise AssertionError("the full gradient check ran in a steady-state step")

            monkeypatch.setattr(optimizer_module, "check_grads", full_check)
        opt.step()
        ref.step(grads)
    ref.check(params, opt)
    steps = [opt.state[p]["step"] for p in params]
    assert steps[0]._base is not None and all(s._base is steps[0]._base for s in steps)  # one buffer


def _replace_step_counter(params, opt, ref):
    opt.state[params[2]]["step"] = torch.tensor(10.0)
    ref.steps[2] = 10


@pytest.mark.parametrize(
    "change",
    [
        "grad_none",  # a param without gradient at one step: skipped, its count stays
        "param_storage",  # p.data replaced by a copy elsewhere in memory
        "step_counter",  # a state's step counter replaced by the user
        "moment",  # a state's moment replaced by a copy
        "load_state_dict",  # the optimizer's own state loaded back
    ],
)
def test_a_change_between_steps_is_noticed_and_stepped_like_the_reference(change):
    params = _params()
    ref = _Reference(params)
    opt = AdamWSR(params, **HYPER)
    for step in range(1, 5):
        grads = [_grad(i, step) for i in range(len(params))]
        if step == 3:
            if change == "grad_none":
                grads[1] = None
            elif change == "param_storage":
                params[0].data = params[0].data.clone()
            elif change == "step_counter":
                _replace_step_counter(params, opt, ref)
            elif change == "moment":
                state = opt.state[params[1]]
                state["exp_avg"] = state["exp_avg"].clone()
            else:
                opt.load_state_dict(opt.state_dict())
        for p, g in zip(params, grads, strict=True):
            # the same gradient tensors, overwritten (no new plan for gradients elsewhere in memory)
            if g is None or p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
        opt.step()
        ref.step(grads)
        ref.check(params, opt)


@pytest.mark.parametrize(
    "swap,error",
    [
        (lambda t: t.t(), ValueError),  # a transposed view of a square param: same address, not contiguous
        (lambda t: t.view(torch.float16), TypeError),  # the same bytes as fp16: same address, other dtype
    ],
)
def test_a_param_changed_in_place_after_recorded_steps_is_rejected_untouched(swap, error):
    p = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
    opt = AdamWSR([p], lr=0.1)
    for _ in range(2):
        p.grad = torch.ones(4, 4, dtype=torch.bfloat16)
        opt.step()
    p.data = swap(p.data)
    p.grad = torch.ones(4, 4, dtype=p.dtype)
    before = digest({"params": [p.detach()], "state": opt.state_dict()})
    with pytest.raises(error):
        opt.step()
    assert digest({"params": [p.detach()], "state": opt.state_dict()}) == before


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "8bit"])
@pytest.mark.parametrize("change", ["param resized", "moment replaced"])
def test_moments_of_another_shape_than_the_param_are_rejected_untouched(change, state_dtype):
    """After recorded steps, a param grown in place (``p.data`` replaced by a larger tensor, as a
    resized vocabulary) or a moment replaced by a tensor of another size would make the kernel read
    and write the moments out of bounds: the step refuses, naming both shapes, before anything is
    written (the moments cannot be carried over; ``torch.optim.AdamW`` raises too)."""
    p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    opt = AdamWSR([p], lr=0.1, state_dtype=state_dtype)
    for _ in range(2):
        p.grad = torch.ones_like(p)
        opt.step()
    if change == "param resized":
        p.data = torch.randn(256, 64).bfloat16()
        want = r"state 'exp_avg' must have shape \(256, 64\) for a param of shape \(256, 64\), got \(64, 64\)"
    else:
        opt.state[p]["exp_avg"] = torch.zeros(3, dtype=opt.state[p]["exp_avg"].dtype)
        want = r"state 'exp_avg' must have shape \(64, 64\) for a param of shape \(64, 64\), got \(3,\)"
    p.grad = torch.ones_like(p)
    before = digest({"params": [p.detach()], "state": opt.state_dict()})
    with pytest.raises(RuntimeError, match=want + r": the param's shape changed .*del opt.state\[p\]"):
        opt.step()
    assert digest({"params": [p.detach()], "state": opt.state_dict()}) == before


def test_a_deep_copy_steps_like_the_original():
    params = _params()
    opt = AdamWSR(params, **HYPER)
    for p, i in zip(params, range(len(params)), strict=True):
        p.grad = _grad(i, 1)
    opt.step()
    twin = copy.deepcopy(opt)  # torch's __getstate__ leaves the caches behind: rebuilt on the copy
    twins = twin.param_groups[0]["params"]
    for step in (2, 3):
        for i, (p, q) in enumerate(zip(params, twins, strict=True)):
            p.grad, q.grad = _grad(i, step), _grad(i, step)
        opt.step()
        twin.step()
    for p, q in zip(params, twins, strict=True):
        assert_bitwise_equal(q, p)
        for key, value in opt.state[p].items():
            assert_bitwise_equal(twin.state[q][key], value, key)


def test_a_step_off_the_record_advances_the_packed_counters_once(monkeypatch):
    """A step that cannot use the record (here under a dispatch mode, as a CUDA-graph capture or a
    tensor-subclass mode) after recorded steps advances the packed counter buffer with one add (no
    multi-tensor add, no stack of the counters) and keeps the counters its views: the
    reference's bits and counts, then recorded steps again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    params = _params()
    ref = _Reference(params)
    opt = AdamWSR(params, **HYPER)
    step = 0
    for _ in range(2):
        grads = [_grad(i, step) for i in range(len(params))]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        ref.step(grads)
        step += 1
    counts = opt.state[params[0]]["step"]._base
    grads = [_grad(i, step) for i in range(len(params))]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    with Ops() as ops:
        opt.step()
    ref.step(grads)
    step += 1
    assert not any(n.startswith(("stack", "_foreach_add")) for n in ops.names), ops.names
    assert all(opt.state[p]["step"]._base is counts for p in params)
    ref.check(params, opt)
    grads = [_grad(i, step) for i in range(len(params))]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    ref.step(grads)
    ref.check(params, opt)
