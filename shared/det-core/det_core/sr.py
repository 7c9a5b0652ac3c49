"""Stochastic rounding fp32 -> bf16, in Triton and in plain torch (bit-identical).

Method: Gupta, Agrawal, Gopalakrishnan, Narayanan, "Deep Learning with Limited Numerical
Precision" (ICML 2015). A bf16 value is the top 16 bits of an fp32 pattern, so adding 16
uniform random bits to the low half of the pattern and truncating rounds the magnitude up
with probability (discarded bits) / 2**16: E[sr(x)] = x exactly.

Special values (contract):

* NaN -> a quiet NaN with the input's sign (``0x7FC0``/``0xFFC0``); truncation alone could
  turn a NaN whose payload sits in the low bits into Inf.
* +-Inf -> +-Inf (the low half of Inf is zero, so the carry never reaches the sign).
* +-0 -> +-0, subnormals round stochastically between neighbouring bf16 subnormals.
* Top of the range: a finite x above the largest finite bf16 (0x7F7F) rounds to that value or to
  Inf, Inf with probability (|x| - 0x7F7F0000 pattern distance) / 2**16: still unbiased in the
  pattern sense, and never NaN.

Only the low 16 bits of the random word are used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_EXP_MASK = 0x7F800000
_MAN_MASK = 0x007FFFFF


@triton.jit
def stochastic_round_bf16(x, rbits):
    """Round fp32 tensor ``x`` to bf16 using uint32 ``rbits`` (same shape; low 16 bits used)."""
    xb = x.to(tl.uint32, bitcast=True)
    is_nan = ((xb & 0x7F800000) == 0x7F800000) & ((xb & 0x007FFFFF) != 0)
    rounded = (xb + (rbits & 0xFFFF)) & 0xFFFF0000
    qnan = (xb & 0x80000000) | 0x7FC00000
    out = tl.where(is_nan, qnan, rounded)
    # bitcast the top half: a float conversion could flush subnormals to zero
    return (out >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_nearest_bf16(x):
    """Round-to-nearest-even fp32 -> bf16 by bit arithmetic, for the non-SR path.

    Equals the hardware conversion for every non-NaN input (NaN -> quiet NaN with its sign, as
    ``stochastic_round_bf16``). Written out because the Triton interpreter's fp32 -> bf16 cast
    truncates, which would make CPU and GPU bits differ.
    """
    xb = x.to(tl.uint32, bitcast=True)
    is_nan = ((xb & 0x7F800000) == 0x7F800000) & ((xb & 0x007FFFFF) != 0)
    rounded = (xb + 0x7FFF + ((xb >> 16) & 1)) & 0xFFFF0000
    out = tl.where(is_nan, (xb & 0x80000000) | 0x7FC00000, rounded)
    return (out >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def round_nearest_bf16_torch(x: torch.Tensor) -> torch.Tensor:
    """Reference of ``round_nearest_bf16``: fp32 -> bf16, nearest-even, NaN -> quiet NaN with sign.

    Raises ``TypeError`` unless ``x`` is fp32.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_nearest_bf16_torch takes fp32 input, got {x.dtype}")
    xb = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = ((xb & _EXP_MASK) == _EXP_MASK) & ((xb & _MAN_MASK) != 0)
    rounded = ((xb + 0x7FFF + ((xb >> 16) & 1)) & 0xFFFF0000) & 0xFFFFFFFF
    out = torch.where(is_nan, (xb & 0x80000000) | 0x7FC00000, rounded)
    top = (out >> 16).to(torch.int32)
    return torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16).view(torch.bfloat16)


def stochastic_round_bf16_torch(x: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """Reference of ``stochastic_round_bf16``.

    Args:
        x: fp32 tensor, any shape.
        rbits: integer tensor of ``x``'s shape holding uint32 values (e.g. ``random_bits_torch``).

    Returns:
        bf16 tensor of ``x``'s shape, bit-identical to the Triton kernel.

    Raises:
        TypeError: ``x`` is not fp32.
        ValueError: shapes differ.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes fp32 input, got {x.dtype}")
    if x.shape != rbits.shape:
        raise ValueError(f"x {tuple(x.shape)} and rbits {tuple(rbits.shape)} must have one shape")
    xb = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = ((xb & _EXP_MASK) == _EXP_MASK) & ((xb & _MAN_MASK) != 0)
    rounded = ((xb + (rbits.to(torch.int64) & 0xFFFF)) & 0xFFFF0000) & 0xFFFFFFFF
    qnan = (xb & 0x80000000) | 0x7FC00000
    out = torch.where(is_nan, qnan, rounded)
    top = (out >> 16).to(torch.int32)
    top = torch.where(top >= 0x8000, top - 0x10000, top)  # to signed int16 range
    return top.to(torch.int16).view(torch.bfloat16)
