"""Triton helpers shared by the forward kernel (``_fwd_kernel``) and the backward kernels
(``_bwd_kernels``): which (sequence, head, tile) a program owns, where a sequence lies, K/V tile
loads, dropout keep masks, and the rounding of fp32 results to the output dtype.

Layout: every tensor is handled in packed ("varlen") form ``(total_tokens, H, D)`` with
``cu_seqlens`` (a padded batch passes its sequence length instead, ``DENSE``); a program works on
one (sequence, head, tile) and its tiles start at the sequence's own first token, so a sequence's
bits never depend on its batch or packing neighbours.

Softmax bookkeeping is in base 2: ``qk2 = (q . k) * scale * log2(e)``; the saved ``lse2`` is
``log2(sum_j 2**qk2_j)`` per row, so the natural LSE is ``lse2 * ln(2)``.

Two constexpr switches of every kernel (off: 0, today's code): ``WINDOW`` (sliding window, causal
only: query ``i`` sees key ``j`` iff ``i + diag - WINDOW < j <= i + diag``; key blocks wholly
outside every row's window are skipped, not masked) and ``SOFTCAP`` (logit soft-capping: the
score ``x = (q . k) * scale`` becomes ``SOFTCAP * tanh(x / SOFTCAP)``; the kernels then get
``qk_scale = scale / SOFTCAP``, the argument of the tanh, and use ``SOFTCAP * log2(e)`` as the
base-2 scale of ``t = tanh(...)``: ``qk2 = t * SOFTCAP * log2(e)``, and the backward multiplies
``dS`` by ``1 - t**2``).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from det_core import rng

DROPOUT_STREAM: tl.constexpr = tl.constexpr(rng.STREAM_ATTN_DROPOUT)  # the Philox stream word
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))


@triton.jit
def program_tile(n_tiles, n_heads, HEAVY_LAST: tl.constexpr):
    # Grid axis 0 is tile-rank-major over heads (rank * n_heads + head) so that every head's
    # heaviest causal tile is dispatched before any lighter one (longest job first); axis 1 is
    # the sequence. Which program owns a tile never changes what the tile computes (no effect on bits).
    pid = tl.program_id(0)
    rank = pid // n_heads
    head = pid % n_heads
    if HEAVY_LAST:
        tile = n_tiles - 1 - rank
    else:
        tile = rank
    return tile, tl.program_id(1), head


@triton.jit
def seq_span(cu_ptr, seq, seqlen, DENSE: tl.constexpr):
    # (first token, length) of sequence `seq`: from cu_seqlens, or, for a padded batch (DENSE),
    # seq * seqlen and seqlen (the same numbers, with no dependent load before the first tile).
    if DENSE:
        start = seq.to(tl.int64) * seqlen
        length = tl.zeros([], tl.int32) + seqlen
    else:
        start = tl.load(cu_ptr + seq).to(tl.int64)
        length = (tl.load(cu_ptr + seq + 1) - start).to(tl.int32)
    return start, length


@triton.jit
def kv_tile(
    src,
    stride_t,
    start,
    offs_n0,
    offs_d,
    k_len,
    seq,
    col,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
    TRANS: tl.constexpr,
):
    # Key block `start .. start + BLOCK_N - 1` of K or V: [BLOCK_N, HEAD_DIM], or with TRANS
    # [HEAD_DIM, BLOCK_N] (K^T for the scores); keys past k_len are 0. TMA: `src` is a host
    # descriptor over (B, T, H_kv * D), read at (sequence `seq`, column `col` of the head).
    if TMA:
        tile = tl.reshape(src.load([seq, start, col]), [BLOCK_N, HEAD_DIM])
        if TRANS:
            tile = tl.trans(tile)
    else:
        offs_n = start + offs_n0
        if TRANS:
            ptrs = src + offs_n[None, :].to(tl.int64) * stride_t + offs_d[:, None]
            in_seq = offs_n[None, :] < k_len
        else:
            ptrs = src + offs_n[:, None].to(tl.int64) * stride_t + offs_d[None, :]
            in_seq = offs_n[:, None] < k_len
        if MASKED:
            tile = tl.load(ptrs, mask=in_seq, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def dropout_keep(
    seed_lo, seed_hi, seq, head, offs_q, start_k, threshold, BLOCK_K: tl.constexpr, QK_T: tl.constexpr
):
    # Keep mask of a tile of queries `offs_q` and keys start_k .. start_k + BLOCK_K - 1. Philox key
    # (seed_lo, seed_hi); counter per det-core's RNG contract with step word = sequence id, stream =
    # attention dropout, index = head << 44 | query << 22 | key (positions inside the sequence).
    # Four neighbouring keys 4j .. 4j+3 share one Philox call (counter index >> 2); start_k % 4 == 0.
    offs_j = start_k // 4 + tl.arange(0, BLOCK_K // 4)
    if QK_T:  # tile laid out [key, query]
        ctr = (head.to(tl.int64) << 42) + (offs_q[None, :].to(tl.int64) << 20) + offs_j[:, None].to(tl.int64)
    else:  # tile laid out [query, key]
        ctr = (head.to(tl.int64) << 42) + (offs_q[:, None].to(tl.int64) << 20) + offs_j[None, :].to(tl.int64)
    zero = tl.zeros(ctr.shape, tl.uint32)
    r0, r1, r2, r3 = rng.philox4x32_10(
        (ctr & 0xFFFFFFFF).to(tl.uint32),
        (ctr >> 32).to(tl.uint32),
        zero + seq,
        zero + DROPOUT_STREAM,
        zero + seed_lo,
        zero + seed_hi,
    )
    words = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [..., a, b] holds word 2b + a
    if QK_T:
        bits = tl.reshape(tl.permute(words, (0, 3, 2, 1)), [BLOCK_K, offs_q.shape[0]])  # key 4j + 2b + a
    else:
        bits = tl.reshape(tl.permute(words, (0, 1, 3, 2)), [offs_q.shape[0], BLOCK_K])
    return bits.to(tl.int64) >= threshold


@triton.jit
def to_out(x, OUT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    # fp32 -> output dtype, round to nearest even. The Triton interpreter truncates fp32 -> bf16
    # (fp_downcast_rounding is ignored there, seen in 3.9), so under it round with integer ops
    # (finite values only, which is all attention produces).
    y = x.to(OUT_DTYPE)
    if UPCAST:
        if OUT_DTYPE == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = b + 0x7FFF + ((b >> 16) & 1)
            y = (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y


@triton.jit
def tanh(x):
    # tanh of fp32 `x` from exp2 (the interpreter has no libdevice), elementwise, so a score's
    # bits never depend on its neighbours. |x| >= 1/8: (1 - e) / (1 + e) with e = exp(-2|x|), the
    # sign restored; below, where 1 - e would cancel, the odd Taylor polynomial to x^7 (the next
    # term is under 2e-9 of x there). Error: a few fp32 ULP.
    ax = tl.abs(x)
    e = tl.math.exp2(ax * -2.8853900817779268)  # -2 * log2(e)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    return tl.where(ax < 0.125, small, tl.where(x < 0.0, -big, big))
