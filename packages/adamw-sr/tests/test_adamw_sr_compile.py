"""``torch.compile(opt.step)`` on CPU (the kernel through the Triton interpreter): one graph
(``fullgraph=True``), bitwise equal to eager steps, from step 0, after eager steps and after a
resume (``load_state_dict``), for fp32, bf16 and 8-bit states.

Under torch.compile dynamo reads every param group's ``capturable`` as ``True`` (torch's note
"torch.compile x capturable"); the step's capturable checks are eager-only, as in torch's optimizers,
so a CPU optimizer built with ``capturable=False`` compiles (the eager refusal of ``capturable=True``
on CPU is tested in test_adamw_sr_bad_input.py). Small sizes: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from adamw_sr import AdamWSR
from det_core.testing import assert_bitwise_equal


def _model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(16, 8).to(torch.bfloat16)  # a 128-element weight, an 8-element bias


def _set_grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _assert_same(m1, o1, m2, o2) -> None:
    """Params and every state tensor bitwise equal (step counts included)."""
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert_bitwise_equal(a, b, "param")
        assert o1.state[a].keys() == o2.state[b].keys()
        for key, value in o1.state[a].items():
            assert_bitwise_equal(o2.state[b][key], value, key)


def _compiled(opt):
    """``opt.step`` compiled in one graph, and the counter of the frames dynamo compiled."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    return torch.compile(opt.step, backend=counter, fullgraph=True), counter


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "8bit"])
def test_compiled_step_from_step_zero_equals_eager(state_dtype):
    torch._dynamo.reset()
    m1, m2 = _model(), _model()
    kw = dict(lr=1e-2, weight_decay=0.1, seed=77, state_dtype=state_dtype)
    o1, o2 = AdamWSR(m1.parameters(), **kw), AdamWSR(m2.parameters(), **kw)
    step, counter = _compiled(o2)
    initial = [p.detach().clone() for p in m2.parameters()]
    for i in range(3):
        _set_grads(m1, i)
        _set_grads(m2, i)
        o1.step()
        step()
        _assert_same(m1, o1, m2, o2)
    # compiled twice (the first step creates the state, then the steady step) and run from then on
    assert counter.frame_count == 2
    assert all(float(o2.state[p]["step"]) == 3.0 for p in m2.parameters())
    assert not any(torch.equal(a, b) for a, b in zip(initial, m2.parameters(), strict=True))
    assert all(not g["capturable"] for g in o2.param_groups)  # the user's flag is left as given


def test_compiled_step_with_default_backend_equals_eager():
    # the repro: torch.compile's default backend (inductor), fp32 states, fullgraph
    torch._dynamo.reset()
    m1, m2 = _model(1), _model(1)
    o1 = AdamWSR(m1.parameters(), lr=1e-2, weight_decay=0.1, seed=77)
    o2 = AdamWSR(m2.parameters(), lr=1e-2, weight_decay=0.1, seed=77)
    step = torch.compile(o2.step, fullgraph=True)
    for i in range(2):
        _set_grads(m1, i)
        _set_grads(m2, i)
        o1.step()
        step()
        _assert_same(m1, o1, m2, o2)


@pytest.mark.parametrize("state_dtype", [torch.float32, "8bit"])
def test_compiled_step_after_eager_steps_and_after_resume_equals_eager(state_dtype):
    # an optimizer that took eager steps (its step counts packed into one buffer), and one resumed
    # from its state_dict, continue compiled with the eager optimizer's bits
    torch._dynamo.reset()
    kw = dict(lr=1e-2, weight_decay=0.1, seed=5, state_dtype=state_dtype)
    m1, m2 = _model(2), _model(2)
    o1, o2 = AdamWSR(m1.parameters(), **kw), AdamWSR(m2.parameters(), **kw)
    for i in range(2):
        for m, o in ((m1, o1), (m2, o2)):
            _set_grads(m, i)
            o.step()
    m3 = _model(3)
    with torch.no_grad():
        for p, q in zip(m3.parameters(), m1.parameters(), strict=True):
            p.copy_(q)
    o3 = AdamWSR(m3.parameters(), **kw)
    o3.load_state_dict(o1.state_dict())
    step2, counter2 = _compiled(o2)
    step3, counter3 = _compiled(o3)
    for i in range(2, 4):
        for m in (m1, m2, m3):
            _set_grads(m, i)
        o1.step()
        step2()
        step3()
        _assert_same(m1, o1, m2, o2)
        _assert_same(m1, o1, m3, o3)
    # compiled once after eager steps; the resumed one again after its first step filled its
    # caches (as from step 0): no recompilation at every step
    assert counter2.frame_count == 1 and counter3.frame_count == 2
    assert all(float(o3.state[p]["step"]) == 4.0 for p in m3.parameters())


def test_compiled_step_of_two_groups_is_one_graph_and_equals_eager():
    # groups of different formats (8-bit weights, bf16 biases) trace as one graph too
    torch._dynamo.reset()

    def make():
        model = torch.nn.Sequential(_model(4), torch.nn.GELU(), torch.nn.Linear(8, 4).bfloat16())
        groups = [
            {"params": [model[0].weight, model[2].weight], "state_dtype": "8bit"},
            {"params": [model[0].bias, model[2].bias], "state_dtype": torch.bfloat16},
        ]
        return model, AdamWSR(groups, lr=1e-2, seed=9)

    (m1, o1), (m2, o2) = make(), make()
    step, counter = _compiled(o2)
    for i in range(2):
        _set_grads(m1, i)
        _set_grads(m2, i)
        o1.step()
        step()
        _assert_same(m1, o1, m2, o2)
    assert counter.frame_count == 2
    explained = torch._dynamo.explain(o2.step)()
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
