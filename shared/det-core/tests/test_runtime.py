"""det_core.runtime: the integer-argument check every package uses (as_index)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from det_core import runtime


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


# ----------------------------------------------------------------------------- launch
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _axpb_kernel(x_ptr, out_ptr, n, a, b, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    y = x * a + b
    if SQUARE:
        y = y * y
    tl.store(out_ptr + offs, y, mask=offs < n)


def _launch_cases(device):
    base = torch.randn(4096 + 8, device=device)
    for offset in (0, 1, 4):  # 16-byte aligned and not
        for n in (1, 16, 17, 1000):  # Triton specializes ints equal to 1 and divisible by 16
            for square in (False, True):
                yield base[offset : offset + n], n, square


def test_launch_equals_the_jit_path_on_cpu():
    # under the interpreter launch() is kernel[grid](...) itself
    for x, n, square in _launch_cases("cpu"):
        want, got = torch.empty_like(x), torch.empty_like(x)
        grid = (triton.cdiv(n, 64),)
        _axpb_kernel[grid](x, want, n, 1.5, 2, BLOCK=64, SQUARE=square)
        runtime.launch(_axpb_kernel, grid, x, got, n, 1.5, 2, BLOCK=64, SQUARE=square)
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_direct_launch_equals_the_jit_path():
    """Second and later launches of a key go through the compiled kernel's run (Triton 3.6): same
    outputs as kernel[grid] for aligned and unaligned pointers, specialized and plain ints,
    defaulted and passed constexprs."""
    for _ in range(2):  # the first round fills the cache, the second launches directly
        for x, n, square in _launch_cases("cuda"):
            want, got = torch.empty_like(x), torch.empty_like(x)
            grid = (triton.cdiv(n, 64),)
            _axpb_kernel[grid](x, want, n, 1.5, 2, BLOCK=64, SQUARE=square)
            if square:
                runtime.launch(_axpb_kernel, grid, x, got, n, 1.5, 2, BLOCK=64, SQUARE=True)
            else:  # the constexpr default fills the tail
                runtime.launch(_axpb_kernel, grid, x, got, n, 1.5, 2, BLOCK=64)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (x.data_ptr() % 16, n, square)
    if runtime._direct_launch_enabled():
        assert any(key[0] is _axpb_kernel for key in runtime._LAUNCHES)
