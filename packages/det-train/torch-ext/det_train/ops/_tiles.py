"""Kernel helpers shared by det_train's matmul and weight-gradient kernels: output-tile order,
rounded stores, the interpreter's row-major copies, the dot precision and program counts.

None of them changes a reduction order: they decide where a tile goes and how a result is stored.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from det_core import runtime

__all__ = [
    "INTERPRET",
    "bf16_by_bits",
    "dot_precision",
    "grouped_tile",
    "row_major",
    "runtime_programs",
    "store_rounded",
]

# Triton reads TRITON_INTERPRET when it decorates the kernels (at import): read it once too, not
# per launch (an environment lookup each time, several per launch)
INTERPRET = runtime.interpreter_active()


@triton.jit
def store_rounded(ptrs, acc, mask, BF16_BY_BITS: tl.constexpr):
    """Store fp32 ``acc`` rounded to nearest-even in the pointee dtype.

    With ``BF16_BY_BITS`` (Triton interpreter, bf16 output) the rounding is done on the bit pattern:
    the interpreter's own fp32 -> bf16 cast truncates, unlike the GPU's ``cvt.rn.bf16.f32``.
    """
    if BF16_BY_BITS:
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(acc != acc, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
        tl.store(ptrs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, acc.to(ptrs.dtype.element_ty), mask=mask)


def bf16_by_bits(dtype: torch.dtype) -> bool:
    """Whether kernels must round fp32 -> bf16 by bit operations (under the Triton interpreter)."""
    return dtype == torch.bfloat16 and INTERPRET


@triton.jit
def grouped_tile(tile, num_pid_a, num_pid_b, GROUP: tl.constexpr):
    """``(pid_a, pid_b)`` of output tile number ``tile`` in grouped order (Triton tutorial 03):
    ``GROUP`` consecutive tiles along ``a`` share a ``b`` column, for L2 reuse. Only the schedule,
    never the values."""
    num_pid_in_group = GROUP * num_pid_b
    first_pid_a = (tile // num_pid_in_group) * GROUP
    group_size_a = tl.minimum(num_pid_a - first_pid_a, GROUP)
    pid_a = first_pid_a + ((tile % num_pid_in_group) % group_size_a)
    pid_b = (tile % num_pid_in_group) // group_size_a
    return pid_a, pid_b


@triton.jit
def row_major(t, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``t`` itself; under the interpreter a row-major copy of a transposed view (through a reshape)."""
    return tl.reshape(tl.reshape(t, (ROWS * COLS,)), (ROWS, COLS))


def runtime_programs(device: torch.device) -> int:
    """Programs of a persistent matmul: one per SM (4 under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    # cached: a property lookup per launch is measurable host time at ~600 launches per step
    return torch.cuda.get_device_properties(index).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot`` input precision: IEEE for fp32 (Triton's default there is TF32); Triton's
    default (None) for bf16 / fp16, whose products are exact in the fp32 accumulator."""
    return "ieee" if dtype == torch.float32 or INTERPRET else None
