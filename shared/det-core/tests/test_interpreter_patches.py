"""det_core.interpreter's launch-scoped language patch: nested jit calls inside a launch do not re-patch
triton.language (Triton's interpreter did at every call), and the kernels compute the same values."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from det_core.interpreter_mode import interpreter_active

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="the Triton interpreter's own patching")


@triton.jit
def _add_one(x):
    return x + tl.zeros(x.shape, dtype=x.dtype) + 1.0  # tl.zeros: a jit function of triton.language itself


@triton.jit
def _three_nested_calls_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, FAIL: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    y = _add_one(_add_one(_add_one(x)))
    tl.static_assert(not FAIL, "FAIL set")
    tl.store(out_ptr + offs, y)


def _patches_per_launch(monkeypatch, programs: int) -> int:
    from triton.runtime import interpreter

    calls = []
    scan = interpreter._patch_builtin  # Triton's scan of one module's members (the costly part)
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: calls.append(a[0]) or scan(*a))
    x = torch.arange(programs * 16, dtype=torch.float32)
    out = torch.empty_like(x)
    _three_nested_calls_kernel[(programs,)](x, out, BLOCK=16)
    assert torch.equal(out, x + 3.0)
    return len(calls)


def test_nested_calls_patch_the_language_once_per_launch(monkeypatch):
    _patches_per_launch(monkeypatch, 1)  # the first launch rewrites the functions (adds tl to their globals)
    one = _patches_per_launch(monkeypatch, 1)
    assert _patches_per_launch(monkeypatch, 8) == one  # 8 programs x 6 nested calls: no repeat
    # the launch's own patch (tl, tl.tensor, tl.math, tensor descriptors: 4 scans) and one by the
    # first nested call that names tl.core (tl.zeros: tl.core and tl, 6 scans); Triton's interpreter
    # alone scans 6 more per nested call (40 for one program)
    assert one <= 10


def test_the_language_is_restored_after_a_launch_also_one_that_raised():
    from triton.runtime import interpreter

    add = tl.tensor.__add__
    assert tl.core.is_builtin(add)
    x = torch.zeros(16)
    _three_nested_calls_kernel[(1,)](x, torch.empty_like(x), BLOCK=16)
    assert tl.tensor.__add__ is add
    with pytest.raises(interpreter.InterpreterError):
        _three_nested_calls_kernel[(1,)](x, torch.empty_like(x), BLOCK=16, FAIL=True)
    assert tl.tensor.__add__ is add
    out = torch.empty_like(x)
    _three_nested_calls_kernel[(1,)](x, out, BLOCK=16)  # a launch after the failed one patches afresh
    assert torch.equal(out, x + 3.0)


@triton.jit
def _to_bf16_kernel(x_ptr, cast_ptr, stored_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(cast_ptr + offs, x.to(tl.bfloat16))  # an explicit cast
    tl.store(stored_ptr + offs, x)  # fp32 values stored into bf16 memory


def test_the_fp32_to_bf16_cast_rounds_to_nearest_even_as_torch_does():
    """The interpreter's own cast truncates; the GPU's cvt.rn.bf16.f32 and torch round to nearest-even
    (ties to even, overflow to infinity, NaN stays NaN)."""
    g = torch.Generator().manual_seed(0)
    tie_even = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000], dtype=torch.int64).to(torch.int32)
    special = torch.tensor(
        [1.0, -1.0, 0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.3895314e38, -3.3895314e38, 1e-40]
    )
    x = torch.cat([torch.randn(1000, generator=g) * 100.0, tie_even.view(torch.float32), special])
    x = torch.cat([x, torch.zeros(2048 - x.numel())])
    cast, stored = torch.empty(2048, dtype=torch.bfloat16), torch.empty(2048, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](x, cast, stored, BLOCK=2048)
    want = x.to(torch.bfloat16).view(torch.int16)
    nan = x.isnan()  # torch's NaN pattern differs by CPU path; det-core's is 0x7FC0 (as its SR's)
    want[nan] = 0x7FC0
    assert torch.equal(cast.view(torch.int16), want) and torch.equal(stored.view(torch.int16), want)
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16).view(torch.int16)
    assert (truncated != want)[~nan].sum() > 300  # what the interpreter's own cast gives differs


def _said_with_interpreter_off(script: str) -> str:
    """The last line ``script`` prints in a fresh process started with TRITON_INTERPRET=0."""
    from det_core.testing import run_in_fresh_process

    return run_in_fresh_process(script, cold_triton_cache=False, env={"TRITON_INTERPRET": "0"})


def test_triton_imported_before_the_interpreter_was_set_is_named():
    """Triton reads TRITON_INTERPRET at its import: set later (after transformers imported triton,
    say), every kernel would fail inside the interpreter with Triton's own message. det_core says
    what happened and what to do instead."""
    script = (
        "import os, triton\n"  # Triton reads TRITON_INTERPRET=0 here
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "try:\n"
        "    import det_core.launch\n"
        "except RuntimeError as e:\n"
        "    print(str(e).replace(chr(10), ' '))\n"
    )
    said = _said_with_interpreter_off(script)
    assert "TRITON_INTERPRET=1 was set after triton was imported" in said
    assert "before anything imports triton" in said


def test_interpreter_set_after_a_first_cpu_kernel_call_is_named():
    """A kernel called on CPU without TRITON_INTERPRET says to set it; a user who then sets it in
    the same process gets det_core's message at the next call, not Triton's "0 active drivers"."""
    script = (
        "import os, torch, triton\n"  # Triton reads TRITON_INTERPRET=0 here
        "from det_core.runtime import check_kernel_device\n"  # imported with the interpreter off
        "x, said = torch.zeros(4), []\n"
        "for attempt in range(2):\n"
        "    try:\n"
        "        check_kernel_device(x, op='op')\n"
        "    except RuntimeError as e:\n"
        "        said.append(f'{attempt} {e}')\n"
        "    os.environ['TRITON_INTERPRET'] = '1'\n"
        "print(' | '.join(said).replace(chr(10), ' '))\n"
    )
    said = _said_with_interpreter_off(script)
    assert "0 op: tensors are on CPU, where the Triton kernels run only through the interpreter" in said
    assert "1 det_core: TRITON_INTERPRET=1 was set after triton was imported" in said


@triton.jit
def _inf_minus_inf_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, (x * 1e30) * 1e30 - x * 1e38 * 1e38)  # overflow, then inf - inf


def test_ieee_specials_in_a_kernel_raise_no_numpy_warning():
    """Infinities and NaNs are IEEE arithmetic the kernels make on purpose (masks, overflow the step
    propagates); the GPU computes them silently, and so does the interpreter now (numpy warned)."""
    import warnings

    x = torch.full((16,), 3.0)
    out = torch.empty_like(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _inf_minus_inf_kernel[(1,)](x, out, BLOCK=16)
    assert out.isnan().all()  # the IEEE result
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
