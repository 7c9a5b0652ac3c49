"""Counter-based Philox4x32-10 random bits, in Triton and in plain torch.

Method: Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC'11);
the round constants and known-answer vectors are Random123's.

RNG contract, version 1 (``RNG_CONTRACT_VERSION``). Changing anything here is a major version.

For an element with 64-bit global index ``i`` drawn under ``(seed, step, stream)``:

* key     ``k0 = seed & 0xFFFFFFFF``, ``k1 = seed >> 32``           (``0 <= seed < 2**64``)
* counter ``c0 = (i >> 2) & 0xFFFFFFFF``, ``c1 = i >> 34``, ``c2 = step``, ``c3 = stream``
  (``0 <= i < 2**63``, ``0 <= step < 2**32``, ``0 <= stream < 2**32``)
* bits    word ``i & 3`` of ``philox4x32_10(counter, key)``, a uint32.

So four neighbouring elements share one Philox call, and an element's bits depend only on
``(seed, step, stream, i)``: never on program id, block size, launch order or world size.
``stream`` separates independent users (see the ``STREAM_*`` constants).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import as_index

RNG_CONTRACT_VERSION = 1

# Registered streams. A new user takes a new number; an existing number never changes meaning.
STREAM_PARAM_SR = 0  # stochastic rounding of optimizer parameter write-back
STREAM_STATE_SR = 1  # retired: adamw-sr's moment rounding, now STREAM_PARAM_SR's high halves; not drawn
STREAM_ATTN_DROPOUT = 2  # attention dropout mask
STREAM_EXP_AVG_SR = 3  # retired: adamw-sr's exp_avg rounding before it moved to STREAM_STATE_SR; not drawn
STREAM_EXP_AVG_SQ_SR = 4  # retired: as 3, for exp_avg_sq; not drawn
STREAM_USER = 1 << 16  # first stream number free for users

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

_MASK32 = 0xFFFFFFFF


def as_seed(value, op: str, name: str = "seed", hint: str = "; pass an int such as 0") -> int:
    """A user's Philox seed as an int in ``[0, 2**64)``: any integer type (int, numpy integers, 0-dim
    integer tensors; ``runtime.as_index``), never a bool, a float or a string.

    Raises:
        TypeError: not an integer.
        ValueError: outside ``[0, 2**64)``.

    **Determinism:** a pure function of ``value`` (no device read, no global state).
    """
    seed = as_index(value, name, op, hint)
    if not 0 <= seed < 2**64:
        raise ValueError(f"{op}: {name} must be in [0, 2**64), got {seed}")
    return seed


def check_key(seed: int, step: int, stream: int) -> None:
    """Raise unless ``(seed, step, stream)`` are integers that fit the contract's word sizes:
    ``TypeError`` for a bool, float or string (``as_index``: never truncated), ``ValueError`` for
    a value out of range."""
    for name, value, bits in (("seed", seed, 64), ("step", step, 32), ("stream", stream, 32)):
        if not 0 <= as_index(value, name, "det_core.rng") < 2**bits:
            raise ValueError(f"{name} must be in [0, 2**{bits}), got {value}")


def split_seed(seed: int) -> tuple[int, int]:
    """Return the Philox key words ``(k0, k1)`` of a 64-bit seed."""
    seed = int(seed)
    return seed & _MASK32, seed >> 32


# --------------------------------------------------------------------------- Triton


@triton.jit
def _broadcast_u32(value, like):
    """``value`` (an int scalar tensor of any width, or a Python int that Triton may have turned
    into a constexpr, e.g. 1) as uint32 in the shape of ``like``: its low 32 bits."""
    return (tl.zeros(like.shape, tl.int64) + value).to(tl.uint32)


@triton.jit
def _mulhilo32(a, b):
    # b is a uint32 constant; a uint32 tensor. hi via umulhi, lo by wrapping multiply.
    return tl.umulhi(a, b), a * b


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 tensors of one shape; returns the four uint32 output words."""
    c0 = c0.to(tl.uint32)
    c1 = c1.to(tl.uint32)
    c2 = c2.to(tl.uint32)
    c3 = c3.to(tl.uint32)
    k0 = k0.to(tl.uint32)
    k1 = k1.to(tl.uint32)
    for _ in tl.static_range(10):
        hi0, lo0 = _mulhilo32(c0, tl.full(c0.shape, 0xD2511F53, tl.uint32))
        hi1, lo1 = _mulhilo32(c2, tl.full(c2.shape, 0xCD9E8D57, tl.uint32))
        c0 = hi1 ^ c1 ^ k0
        c1 = lo1
        c2 = hi0 ^ c3 ^ k1
        c3 = lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def random_bits(seed_lo, seed_hi, step, stream, index):
    """uint32 random bits for int64 global ``index`` (any shape), per the RNG contract.

    ``seed_lo``/``seed_hi`` are the key words (``split_seed``); ``step`` and ``stream`` are
    uint32-range integer scalars. Computes one Philox call per element and selects word
    ``index & 3``; ``random_bits_x4`` is the faster form for 4-aligned contiguous blocks.
    """
    index = index.to(tl.int64)
    q = index >> 2
    zero = tl.zeros(index.shape, tl.uint32)
    c0 = (q & 0xFFFFFFFF).to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    c2 = _broadcast_u32(step, zero)
    c3 = _broadcast_u32(stream, zero)
    k0 = _broadcast_u32(seed_lo, zero)
    k1 = _broadcast_u32(seed_hi, zero)
    r0, r1, r2, r3 = philox4x32_10(c0, c1, c2, c3, k0, k1)
    w = index & 3
    return tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))


@triton.jit
def random_bits_x4(seed_lo, seed_hi, step, stream, base, BLOCK: tl.constexpr):
    """uint32 bits for the ``BLOCK`` contiguous indices ``base + arange(BLOCK)``.

    ``base`` must be a multiple of 4 (int64 scalar) and ``BLOCK`` a multiple of 4. One Philox
    call serves four elements, so this costs a quarter of ``random_bits``; the bits are the same.
    """
    q = (base >> 2).to(tl.int64) + tl.arange(0, BLOCK // 4).to(tl.int64)
    zero = tl.zeros([BLOCK // 4], tl.uint32)
    c0 = (q & 0xFFFFFFFF).to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    c2 = _broadcast_u32(step, zero)
    c3 = _broadcast_u32(stream, zero)
    k0 = _broadcast_u32(seed_lo, zero)
    k1 = _broadcast_u32(seed_hi, zero)
    r0, r1, r2, r3 = philox4x32_10(c0, c1, c2, c3, k0, k1)
    # interleave to element order: [q0w0, q0w1, q0w2, q0w3, q1w0, ...]
    r01 = tl.join(r0, r1)  # [BLOCK/4, 2]
    r23 = tl.join(r2, r3)  # [BLOCK/4, 2]
    r = tl.join(r01, r23)  # [BLOCK/4, 2, 2]: r[q, a, b] = word 2*b + a
    r = tl.permute(r, (0, 2, 1))  # r[q, b, a] = word 2*b + a
    return tl.reshape(r, [BLOCK])


# --------------------------------------------------------------------------- torch reference


def _mulhilo32_torch(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    # exact 32x32 -> 64 product in int64 without overflow: split a into 16-bit halves
    a_lo = a & 0xFFFF
    a_hi = a >> 16
    p_lo = a_lo * b  # < 2**48
    t = a_hi * b + (p_lo >> 16)  # < 2**49
    hi = t >> 16
    lo = ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)
    return hi & _MASK32, lo & _MASK32


def philox4x32_10_torch(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference Philox4x32-10: int64 tensors holding uint32 values in, same out."""
    c0, c1, c2, c3 = (c.to(torch.int64) & _MASK32 for c in (c0, c1, c2, c3))
    k0 = int(k0) & _MASK32
    k1 = int(k1) & _MASK32
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo32_torch(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32_torch(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def random_bits_torch(seed: int, step: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Reference of ``random_bits``: uint32 values (as int64) for int64 global ``index``.

    Raises ``TypeError`` when seed, step or stream is not an integer or ``index`` is not an integer
    tensor (a float or bool index would be truncated), ``ValueError`` when seed, step or stream is
    out of range or an index is negative.
    """
    check_key(seed, step, stream)
    if not isinstance(index, torch.Tensor) or index.dtype == torch.bool or index.is_floating_point():
        kind = index.dtype if isinstance(index, torch.Tensor) else type(index).__name__
        raise TypeError(f"det_core.rng: index must be an integer tensor (global element indices), got {kind}")
    index = index.to(torch.int64)
    if index.numel() and int(index.min()) < 0:
        raise ValueError("global indices must be non-negative")
    k0, k1 = split_seed(seed)
    q = index >> 2
    c2 = torch.full_like(index, int(step))
    c3 = torch.full_like(index, int(stream))
    words = philox4x32_10_torch(q & _MASK32, q >> 32, c2, c3, k0, k1)
    stacked = torch.stack(words, dim=-1)
    return torch.gather(stacked, -1, (index & 3).unsqueeze(-1)).squeeze(-1)
