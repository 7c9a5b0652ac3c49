"""The 8-bit optimizer-state format of adamw-sr (``state_dtype="8bit"``), in Triton and in plain torch.

Both implementations are integer bit arithmetic on the fp32 pattern plus exact scalings by powers of
two, so they give the same bits on the GPU, in the Triton interpreter and in torch.

Format (block floating point, as the OCP Microscaling (MX) formats: a block of elements shares one
8-bit power-of-two scale, each element keeps its own small exponent):

* Blocks of ``QUANT_BLOCK`` (32) consecutive **global** element indices, ``[32 b, 32 b + 32)``; the
  part of a block that lies in one parameter shares one scale byte ``S``, the biased fp32 exponent of
  the block's largest finite magnitude plus one, ``1 <= S <= 253`` (0: a block never written, all
  zeros). With ``2**(S - 127)`` above every magnitude of the block, each element is stored as
  ``y = |x| * 2**(127 - S)`` in ``[0, 1)`` (an exact scaling).
* ``y`` is coded as a small float with a 4-bit exponent field ``f`` (bias 15) and ``M`` mantissa
  bits: ``f = 1..14`` normal, ``2**(f - 15) * (1 + mant / 2**M)``, so ``[2**-14, 1)``; ``f = 0``
  subnormal, ``mant * 2**(-14 - M)``; ``f = 15``: ``mant = 0`` is exactly 1.0 (where a value just
  below 1 rounds up to), ``mant = 2**M - 1`` is NaN. The first moment (signed) adds a sign bit:
  sign + E4M3 (``M = 3``); the second moment (non-negative) uses all 8 bits: E4M4 (``M = 4``).
* Rounding into the code is stochastic or to nearest-even. Stochastic: 16 random bits are added at
  the top of the ``23 - M`` discarded pattern bits and the pattern truncated, so the value rounds up
  with probability equal to the discarded fraction truncated to 16 bits (unbiased to below ``2**-16``
  of a code step; the bf16 rounding's 16 bits cover its 16 discarded bits exactly).
  For ``y >= 2**-14`` the fp32 pattern of ``y`` is rounded to ``M`` mantissa bits (the bf16 rounding
  with a shorter mantissa); below, the pattern of ``y + 2**-14`` is, which puts the subnormal codes
  on the same fixed-point grid (this sum's own fp32 rounding is below 2**-21 of a code step).
* Non-finite values and magnitudes ``>= 2**126`` are stored as NaN and left out of the block's scale.
  A positive second moment is never stored as zero: a value below the smallest code
  (``2**-18`` of the block's scale) is stored as that smallest code, so a decoded denominator
  ``sqrt(v) + eps`` never falls to ``eps`` when the gradient was not zero (a bias towards smaller
  updates, only for such values).

Method: block-wise quantization of optimizer states (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", ICLR 2022); shared power-of-two block scales with per-element exponents (OCP
Microscaling Formats (MX) v1.0, 2023); stochastic rounding (Gupta et al., ICML 2015).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QUANT_BLOCK = 32  # elements per block (global index), one scale byte per block and moment
_QUANT_BLOCK: tl.constexpr = tl.constexpr(QUANT_BLOCK)
EXP_AVG_MANTISSA_BITS = 3  # exp_avg: sign + E4M3
EXP_AVG_SQ_MANTISSA_BITS = 4  # exp_avg_sq: E4M4 (non-negative)

# Stochastic rounding of the moments (bf16 and 8-bit): 8 random bits per rounding, both moments' from
# the high half of the Philox word whose low half rounds the param (det-core's STREAM_PARAM_SR at the
# element's global index): bits 16-23 exp_avg, 24-31 exp_avg_sq. Bump with any change of the rule.
STATE_SR_BITS = 8
STATE_SR_RULE_VERSION = 2  # 1: 16 bits per moment from a STREAM_STATE_SR word (low half exp_avg)
EXP_AVG_SR_SHIFT = 8  # word >> 8 puts bits 16-23 at 8-15
EXP_AVG_SQ_SR_SHIFT = 16  # word >> 16 puts bits 24-31 at 8-15

_OVERFLOW_EXPONENT = 253  # fp32 exponent field from which a magnitude (>= 2**126) is stored as NaN
_TWO_POW_M14 = 2.0**-14  # the smallest normal code value (relative to the block scale)


# --------------------------------------------------------------------------- Triton


@triton.jit
def state_rounding_bits(word, SHIFT: tl.constexpr):
    """The 16-bit rounding operand of one moment from the element's uint32 Philox ``word``.

    ``((word >> SHIFT) & 0xFF00) | 0x80``: 8 random bits (``word`` bits ``SHIFT + 8 .. SHIFT + 15``)
    over a constant half of their last place. Added to the 16 discarded bits (bf16; 8 bits: the top 16
    of them, see ``encode``) and truncated, it rounds up with probability ``round(256 f) / 256`` for a
    discarded fraction ``f`` of a step: within ``2**-9`` of a step of ``f``, zero on average over ``f``
    (the constant half removes the ``2**-9`` downward bias of truncating the fraction to 8 bits).

    **Determinism:** integer bit arithmetic: bit-identical to ``state_rounding_bits_torch``.
    """
    return ((word >> SHIFT) & 0xFF00) | 0x80


@triton.jit
def magnitude_bits(x):
    """int32 pattern of ``|x|`` for the block maximum: 0 for non-finite or ``>= 2**126`` values.

    For non-negative floats the pattern order is the value order, so an integer maximum of these
    is the block's largest magnitude (no NaN rules involved). ``x``: fp32 tensor, any shape.

    **Determinism:** one comparison and bit operations: the same bits on the GPU and in the interpreter.
    """
    ax = tl.abs(x)
    return tl.where(ax < 8.507059173023462e37, ax.to(tl.int32, bitcast=True), 0)  # 2**126


@triton.jit
def block_scale(max_bits):
    """The scale byte (int32, ``1..253``) of a block whose largest ``magnitude_bits`` is ``max_bits``.

    **Determinism:** an integer shift: the same bits everywhere (``block_scales_torch``).
    """
    return (max_bits >> 23) + 1


@triton.jit
def encode(x, scale, rbits, M: tl.constexpr, SIGNED: tl.constexpr, STOCHASTIC: tl.constexpr):
    """fp32 ``x`` -> uint8 codes under the int32 block scale ``scale`` (same shape; see the module).

    ``rbits``: uint32 words whose low 16 bits are the random bits when ``STOCHASTIC``, else unused
    (round to nearest-even). ``M``: mantissa bits; ``SIGNED``: a sign bit (``exp_avg``).

    ``y = |x| 2**(127 - S)`` is in ``[0, 1)``, and the fp32 pattern of ``y 2**-112`` is the code shifted
    left by ``23 - M``: the exponent field is the code's ``f`` for ``y >= 2**-14``, and below, where
    ``y 2**-112`` is an fp32 subnormal, the pattern is the fixed-point value on the subnormal codes' grid.
    So rounding the pattern to ``M`` mantissa bits rounds ``y`` to its code, normal or subnormal, with
    one carry rule (``encode_torch`` computes the same bits through ``y + 2**-14``).

    **Determinism:** integer bit arithmetic and two IEEE fp32 multiplications by powers of two (the
    second rounds only below ``2**-21`` of a subnormal code step): bit-identical to ``encode_torch``.
    """
    ax = tl.abs(x)
    finite = ax < 8.507059173023462e37  # |x| < 2**126 (not Inf, not NaN)
    factor = ((254 - scale) << 23).to(tl.float32, bitcast=True)  # 2**(127 - S), a normal fp32
    pattern = ((ax * factor) * 1.925929944387236e-34).to(tl.int32, bitcast=True)  # y * 2**-112
    # (powers written 2**M: Triton's constexpr has no reflected shifts)
    if STOCHASTIC:  # 16 random bits at the top of the 23 - M discarded ones
        pattern = pattern + ((rbits.to(tl.int32, bitcast=True) & 0xFFFF) << (7 - M))
    else:
        pattern = pattern + (2 ** (22 - M) - 1) + ((pattern >> (23 - M)) & 1)
    code = pattern >> (23 - M)
    if SIGNED:
        code = code | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)
    else:
        code = tl.maximum(code, tl.minimum(x.to(tl.int32, bitcast=True), 1))  # a positive v never codes 0
    code = tl.where(finite, code, 16 * 2**M - 1)  # non-finite and >= 2**126: NaN
    return code.to(tl.uint8)


@triton.jit
def decode(code, scale, M: tl.constexpr, SIGNED: tl.constexpr):
    """uint8 codes and their int32 block scales (same shape) -> fp32 values (see the module).

    The code shifted left by ``23 - M`` is the fp32 pattern of ``2**-112`` times its value (subnormal
    codes: fp32 subnormals), so one exact multiplication by ``2**112`` decodes every code.

    **Determinism:** integer bit arithmetic and exact fp32 multiplications: bit-identical to
    ``decode_torch``.
    """
    c = code.to(tl.int32)
    mag = c
    if SIGNED:
        mag = c & 0x7F
    value = (mag << (23 - M)).to(tl.float32, bitcast=True) * 5.192296858534828e33  # 2**112
    nan = (tl.zeros_like(c) + 0x7FC00000).to(tl.float32, bitcast=True)
    value = tl.where(mag > 15 * 2**M, nan, value)  # f = 15 with a nonzero mantissa
    value = value * (scale << 23).to(tl.float32, bitcast=True)  # 2**(S - 127): exact
    if SIGNED:
        value = (value.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
    return value


# the kernel's tiles (_kernel._step_tile): per-block scales in a tile's layout


@triton.jit
def expand_blocks(values, SUB: tl.constexpr, TILE_2D: tl.constexpr):
    """Per-block values ``[SUB // _QUANT_BLOCK]`` -> the tile's layout, each repeated over its block."""
    wide = tl.broadcast_to(values[:, None], [SUB // _QUANT_BLOCK, _QUANT_BLOCK])
    if TILE_2D:
        return tl.reshape(wide, [SUB // 4, 4])
    else:
        return tl.reshape(wide, [SUB])


@triton.jit
def tile_block_scales(x, mask, SUB: tl.constexpr, MASKED: tl.constexpr):
    """The scale byte (int32) of each block of the tile from its fp32 values (``MASKED``: lanes off
    ``mask`` count as zeros)."""
    bits = magnitude_bits(x)
    if MASKED:
        bits = tl.where(mask, bits, 0)
    return block_scale(tl.max(tl.reshape(bits, [SUB // _QUANT_BLOCK, _QUANT_BLOCK]), axis=1))


@triton.jit
def store_block_scales(scale_ptr, first_block, tile_local, segment_end, scales, SUB: tl.constexpr,
                        TILE_2D: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Store the tile's block scales (int32 ``[SUB // _QUANT_BLOCK]``) as bytes from ``first_block`` on.

    With ``TILE_2D`` each row of 4 elements has its block's scale, and the row holding a block's first
    element writes it: a store in the tile's own layout, so no exchange between threads (a store of the
    ``[SUB // _QUANT_BLOCK]`` vector would redistribute it through shared memory).
    """
    if TILE_2D:
        rows = tl.arange(0, SUB // 4)
        row_scales = tl.max(expand_blocks(scales, SUB, TILE_2D), axis=1)  # 4 equal values per row
        first = (rows % (_QUANT_BLOCK // 4)) == 0
        if MASKED:
            first = first & (tile_local + rows.to(tl.int64) * 4 < segment_end)
        tl.store(scale_ptr + first_block + rows // (_QUANT_BLOCK // 4), row_scales.to(tl.uint8), mask=first)
    else:
        blocks = tl.arange(0, SUB // _QUANT_BLOCK)
        block_mask = tile_local + blocks.to(tl.int64) * _QUANT_BLOCK < segment_end
        if MASKED:
            tl.store(scale_ptr + first_block + blocks, scales.to(tl.uint8), mask=block_mask)
        else:
            tl.store(scale_ptr + first_block + blocks, scales.to(tl.uint8))


# --------------------------------------------------------------------------- torch reference


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64)


def _from_int32(bits: torch.Tensor) -> torch.Tensor:
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def state_rounding_bits_torch(word: torch.Tensor, shift: int) -> torch.Tensor:
    """Reference of ``state_rounding_bits``: int64 ``word`` (uint32 values) -> int64 operands ``0..0xFF80``.

    ``shift``: ``EXP_AVG_SR_SHIFT`` or ``EXP_AVG_SQ_SR_SHIFT``.

    **Determinism:** integer arithmetic: the same bits on every platform.
    """
    return ((word.to(torch.int64) >> shift) & 0xFF00) | 0x80


def block_scales_torch(x: torch.Tensor, block: int = QUANT_BLOCK) -> torch.Tensor:
    """The scale bytes of ``x``'s blocks of ``block`` consecutive elements (flat order).

    Args:
        x: fp32 tensor, any shape; its flat element ``l`` is in block ``l // block`` (the last block
            may be partial). Returns: int64 tensor ``[ceil(numel / block)]`` with values ``1..253``.

    **Determinism:** integer arithmetic on the fp32 patterns: the same bits on every platform.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"block_scales_torch takes fp32 input, got {x.dtype}")
    xb = _as_int32(x).flatten()
    overflow = (xb & 0x7F800000) >= (_OVERFLOW_EXPONENT << 23)
    mag = torch.where(overflow, 0, xb & 0x7FFFFFFF)
    n_blocks = -(-mag.numel() // block)
    padded = torch.zeros(n_blocks * block, dtype=torch.int64)
    padded[: mag.numel()] = mag
    return (padded.view(n_blocks, block).amax(dim=1) >> 23) + 1


def encode_torch(
    x: torch.Tensor, scale: torch.Tensor, rbits: torch.Tensor | None, mantissa_bits: int, signed: bool
) -> torch.Tensor:
    """Reference of ``encode``: fp32 ``x`` -> uint8 codes, bit-identical to the Triton function.

    Args:
        x: fp32 tensor. scale: integer tensor of ``x``'s shape, the block scale of each element
            (``1..253``). rbits: integer tensor of ``x``'s shape whose low 16 bits are the random
            bits (stochastic rounding), or ``None`` (nearest-even). mantissa_bits: ``M`` (3 for
            ``exp_avg``, 4 for ``exp_avg_sq``). signed: a sign bit (``exp_avg``) or not.

    Returns: uint8 tensor of ``x``'s shape.

    Raises:
        TypeError: ``x`` is not fp32. ValueError: shapes differ.

    **Determinism:** integer bit arithmetic and IEEE fp32 multiplications and one addition: the same
    bits on every platform.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"encode_torch takes fp32 input, got {x.dtype}")
    if scale.shape != x.shape or (rbits is not None and rbits.shape != x.shape):
        raise ValueError("encode_torch: x, scale and rbits must have one shape")
    m = mantissa_bits
    xb = _as_int32(x)
    overflow = (xb & 0x7F800000) >= (_OVERFLOW_EXPONENT << 23)
    factor = _from_int32((254 - scale.to(torch.int64)) << 23)
    y = _from_int32(torch.where(overflow, 0, xb & 0x7FFFFFFF)) * factor
    small = y < _TWO_POW_M14
    pattern = _as_int32(torch.where(small, y + _TWO_POW_M14, y))
    low = (1 << (23 - m)) - 1
    if rbits is not None:
        pattern = (pattern + ((rbits.to(torch.int64) & 0xFFFF) << (7 - m))) & ~low
    else:
        pattern = (pattern + (low >> 1) + ((pattern >> (23 - m)) & 1)) & ~low
    code = (pattern >> (23 - m)) - torch.where(small, 113 << m, 112 << m)
    if not signed:
        code = torch.where((code == 0) & (x > 0), 1, code)
    else:
        code = code | ((xb >> 24) & 0x80)
    code = torch.where(overflow, (15 << m) | ((1 << m) - 1), code)
    return code.to(torch.uint8)


def decode_torch(code: torch.Tensor, scale: torch.Tensor, mantissa_bits: int, signed: bool) -> torch.Tensor:
    """Reference of ``decode``: uint8 codes and their block scales -> fp32, bit-identical to Triton.

    Args:
        code: uint8 tensor. scale: integer tensor of ``code``'s shape (``0..253``; 0 decodes to 0).
        mantissa_bits, signed: as ``encode_torch``.

    Returns: fp32 tensor of ``code``'s shape.

    Raises:
        TypeError: ``code`` is not uint8. ValueError: shapes differ.

    **Determinism:** integer bit arithmetic and exact fp32 operations: the same bits on every platform.
    """
    if code.dtype != torch.uint8:
        raise TypeError(f"decode_torch takes uint8 codes, got {code.dtype}")
    if scale.shape != code.shape:
        raise ValueError("decode_torch: code and scale must have one shape")
    m = mantissa_bits
    c = code.to(torch.int64)
    sign = torch.zeros_like(c)
    if signed:
        sign = (c & 0x80) << 24
        c = c & 0x7F
    f = c >> m
    mant = c & ((1 << m) - 1)
    normal = _from_int32((c + (112 << m)) << (23 - m))
    sub = _from_int32((113 << 23) | (mant << (23 - m))) - _TWO_POW_M14
    value = torch.where(f == 0, sub, normal)
    value = torch.where((f == 15) & (mant != 0), torch.nan, value)
    value = value * _from_int32(scale.to(torch.int64) << 23)
    return _from_int32(_as_int32(value) | sign)
