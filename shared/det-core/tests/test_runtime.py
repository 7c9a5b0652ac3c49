"""det_core.runtime: the integer-argument check every package uses (as_index), the host int helpers,
and the launch names it still resolves after their move to det_core.launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
from det_core import runtime
from det_core.testing import run_in_fresh_process


@pytest.mark.parametrize("value", [7, np.int64(7), np.uint8(7), torch.tensor(7)])
def test_as_index_accepts_every_integer_type(value):
    assert runtime.as_index(value, "n", "op") == 7


@pytest.mark.parametrize(
    "value", [True, np.True_, torch.tensor(True), 7.0, 1.5, "7", None, torch.tensor(7.0)]
)
def test_as_index_rejects_bools_floats_and_strings_with_the_name_and_hint(value):
    with pytest.raises(TypeError, match=r"op: n must be an integer.*; pass 7"):
        runtime.as_index(value, "n", "op", "; pass 7")


def test_as_seed_checks_type_and_the_64_bit_range():
    from det_core import rng

    assert rng.as_seed(np.uint64(2**64 - 1), "op") == 2**64 - 1
    with pytest.raises(ValueError, match=r"op: seed must be in \[0, 2\*\*64\)"):
        rng.as_seed(-1, "op")
    with pytest.raises(TypeError, match="op: seed must be an integer"):
        rng.as_seed(True, "op")


def test_host_int_helpers_equal_tritons():
    """``cdiv`` / ``next_power_of_2`` are triton.cdiv / triton.next_power_of_2 on host ints (those
    are constexpr functions, slow to call from the host)."""
    for n in [*range(-3, 4100), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3, 2**63 - 1]:
        assert runtime.next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in range(1, 70):
            assert runtime.cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_launch_names_still_resolve_from_runtime_to_the_same_objects():
    """``launch``, ``BoundLaunch``, ``DescriptorTemplate`` and ``PlanCache`` moved to det_core.launch;
    every import path of before still gives the very same objects."""
    import det_core
    import det_core.launch as det_launch
    from det_core.runtime import BoundLaunch, DescriptorTemplate, PlanCache, launch

    moved = {"BoundLaunch": BoundLaunch, "DescriptorTemplate": DescriptorTemplate, "PlanCache": PlanCache,
             "launch": launch}  # fmt: skip
    for name, obj in moved.items():
        assert obj is getattr(det_launch, name) is getattr(runtime, name), name
        assert obj.__module__ == "det_core.launch", name
        assert name in det_launch.__all__ and name not in runtime.__all__, name  # documented once
    assert det_core.launch is det_launch
    from det_core import interpreter_mode

    assert runtime.interpreter_active is interpreter_mode.interpreter_active  # both stand on it
    with pytest.raises(AttributeError, match="det_core.runtime.*no_such_name"):
        runtime.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "first",
    ["import det_core.launch", "from det_core.runtime import BoundLaunch", "from det_core import runtime"],
)
def test_either_module_imports_first_in_a_fresh_process(first):
    """det_core.runtime imports det_core.launch (the moved names), both import
    det_core.interpreter_mode: no import cycle, whichever module a process imports first."""
    code = (
        f"{first}\nimport det_core.launch as l, det_core.runtime as r\n"
        "assert r.launch is l.launch and r.BoundLaunch is l.BoundLaunch\nprint('ok')"
    )
    assert run_in_fresh_process(code, cold_triton_cache=False, timeout=120) == "ok"


@pytest.mark.parametrize(
    ("value", "active"), [("1", True), ("true", True), ("0", False), ("", False), (None, False)]
)
def test_interpreter_active_reads_the_environment_at_each_call(monkeypatch, value, active):
    """``interpreter_active`` reads ``TRITON_INTERPRET`` (through the environment's own dict, not a
    cached copy): a test that sets, clears or deletes it sees the change at once."""
    from det_core import interpreter_mode

    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_mode.interpreter_active() is active
    monkeypatch.setenv("TRITON_INTERPRET", "0" if active else "1")
    assert interpreter_mode.interpreter_active() is not active
