"""Forward kernel of deterministic flash attention, with the variants the config table picks from.

Method: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) as in the Triton tutorial "06 fused
attention": online softmax in base 2, fp32 accumulators, the causal key blocks of a tile split
into a loop without a mask and a masked loop (diagonal, ragged tail). See ``_kernels`` for the
layout (packed ``(total_tokens, H, D)``, tiles aligned to each sequence's first token) and the
softmax bookkeeping (``qk2 = (q . k) * scale * log2(e)``, saved ``lse2``).

Variants (constexprs; ``flash_attention._Config`` names them, and which change bits):

* ``TMA``: 0 pointer loads; 1 tensor descriptors made in the kernel per (sequence, head), with the
  sequence's own length as the bound (rows past it read as zeros, stores past it dropped: what the
  masked pointer loads and stores do), any packing; 2 host tensor descriptors over
  ``(B, T, H * D)`` (padded batches only: rows past ``T`` read as zeros). The tiles fed to the
  dots hold the same values as with pointer loads, so the same bits are expected.
* ``PIPELINE_PV``: FlashAttention-3's intra-warpgroup overlap (Shah et al., 2024,
  arXiv:2407.08608, Algorithm 2) by software pipelining: step j issues ``S_j = Q K_j^T``, then
  ``O += P_{j-1} V_{j-1}``, and computes the softmax of ``S_j`` while the second MMA runs (the
  rescale that reads its result is in step j + 1). Every accumulator sees the same operations in
  the same order as the plain loop (block 0 is peeled, the last P V product follows the loops).
  P is carried in fp32 and converted where the MMA reads it: a loop-carried bf16 P went through
  shared memory and Triton 3.6 then waited for that MMA at once (no overlap).
* ``ONE_LOOP``: every key block in the masked loop (the mask is the identity on a fully visible
  block, and both loops do the same arithmetic on a visible score): one loop prologue per tile.
* ``LOOP_STAGES``: ``tl.range(num_stages=...)`` on the key loops (None: the kernel's num_stages).
* ``RECIP_L``: the final normalisation as ``O * (1 / l)`` instead of ``O / l`` (other bits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernels import _dropout_keep, _program_tile, _seq_span, _to_out


@triton.jit
def _k_tile(
    k_src,
    stride_kt,
    start,
    offs_n0,
    offs_d,
    k_len,
    seq,
    kv_col,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
):
    # K block `start .. start + BLOCK_N - 1`, transposed ([HEAD_DIM, BLOCK_N]); keys past k_len are 0
    if TMA == 1:
        kT = tl.trans(k_src.load([start, 0]))
    elif TMA == 2:
        kT = tl.trans(tl.reshape(k_src.load([seq, start, kv_col]), [BLOCK_N, HEAD_DIM]))
    else:
        offs_n = start + offs_n0
        kT_ptrs = k_src + offs_n[None, :].to(tl.int64) * stride_kt + offs_d[:, None]
        if MASKED:
            kT = tl.load(kT_ptrs, mask=offs_n[None, :] < k_len, other=0.0)
        else:
            kT = tl.load(kT_ptrs)
    return kT


@triton.jit
def _v_tile(
    v_src,
    stride_kt,
    start,
    offs_n0,
    offs_d,
    k_len,
    seq,
    kv_col,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
):
    # V block `start .. start + BLOCK_N - 1` ([BLOCK_N, HEAD_DIM]); keys past k_len are 0
    if TMA == 1:
        v = v_src.load([start, 0])
    elif TMA == 2:
        v = tl.reshape(v_src.load([seq, start, kv_col]), [BLOCK_N, HEAD_DIM])
    else:
        offs_n = start + offs_n0
        v_ptrs = v_src + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
        if MASKED:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < k_len, other=0.0)
        else:
            v = tl.load(v_ptrs)
    return v


@triton.jit
def _softmax_step(
    s, m_i, l_i, offs_m, offs_n, k_len, diag, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr
):
    # One online-softmax step on raw scores `s` (the scale is folded into the exp2 argument).
    if MASKED:
        visible = offs_n[None, :] < k_len
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
        s = tl.where(visible, s, float("-inf"))  # exact: a visible score keeps its bits
    # Masked and unmasked blocks do the same arithmetic on a visible score (no contraction
    # left to the compiler): max(s) * scale == max(s * scale) (rounding is monotone, scale > 0),
    # and the exponent is one explicit fma. So a row's bits do not depend on whether a block
    # was masked for its tile, i.e. not on where the row sits in its tile. A masked score
    # gives fma(-inf, scale, -m) = -inf and exp2 = 0 (m is finite: every row sees key 0).
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    alpha = tl.math.exp2(m_i - m_new)
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
    return p, m_new, l_i, alpha


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_src,
    v_src,
    stride_kt,
    offs_m,
    offs_d,
    start_n,
    end_n,
    k_len,
    diag,
    qk_scale,
    seed_lo,
    seed_hi,
    seq,
    head,
    kv_col,
    seq_id,
    head_id,
    drop_threshold,
    drop_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DTYPE: tl.constexpr,
    TMA: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    # Key blocks start_n, start_n + BLOCK_N, ... < end_n, ascending: S = Q K^T, softmax step, O += P V.
    offs_n0 = tl.arange(0, BLOCK_N)
    for start in tl.range(start_n, end_n, BLOCK_N, num_stages=LOOP_STAGES):
        kT = _k_tile(
            k_src, stride_kt, start, offs_n0, offs_d, k_len, seq, kv_col, BLOCK_N, HEAD_DIM, MASKED, TMA
        )
        v = _v_tile(
            v_src, stride_kt, start, offs_n0, offs_d, k_len, seq, kv_col, BLOCK_N, HEAD_DIM, MASKED, TMA
        )
        if UPCAST:
            kT = kT.to(tl.float32)
        s = tl.dot(q, kT)  # raw scores; the scale is folded into the exp2 argument
        p, m_i, l_i, alpha = _softmax_step(
            s, m_i, l_i, offs_m, start + offs_n0, k_len, diag, qk_scale, MASKED, CAUSAL
        )
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = _dropout_keep(
                seed_lo, seed_hi, seq_id, head_id, offs_m, start, drop_threshold, BLOCK_N, False
            )
            p = tl.where(keep, p * drop_scale, 0.0)
        if UPCAST:
            acc = tl.dot(p, v.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(DTYPE), v, acc)
    return acc, l_i, m_i


@triton.jit
def _probabilities(
    s,
    m_i,
    l_i,
    offs_m,
    start,
    offs_n0,
    k_len,
    diag,
    qk_scale,
    seed_lo,
    seed_hi,
    seq_id,
    head_id,
    drop_threshold,
    drop_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DTYPE: tl.constexpr,
):
    # softmax step of key block `start`, then dropout (P stays fp32: converted where the P V MMA
    # reads it, so Triton feeds that MMA from registers and leaves it in flight)
    p, m_i, l_i, alpha = _softmax_step(
        s, m_i, l_i, offs_m, start + offs_n0, k_len, diag, qk_scale, MASKED, CAUSAL
    )
    if DROPOUT:
        keep = _dropout_keep(seed_lo, seed_hi, seq_id, head_id, offs_m, start, drop_threshold, BLOCK_N, False)
        p = tl.where(keep, p * drop_scale, 0.0)
    return p, m_i, l_i, alpha


@triton.jit
def _fwd_inner_pipelined(
    acc,
    l_i,
    m_i,
    p_prev,
    alpha_prev,
    q,
    k_src,
    v_src,
    stride_kt,
    offs_m,
    offs_d,
    start_n,
    end_n,
    k_len,
    diag,
    qk_scale,
    seed_lo,
    seed_hi,
    seq,
    head,
    kv_col,
    seq_id,
    head_id,
    drop_threshold,
    drop_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DTYPE: tl.constexpr,
    TMA: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    # Key blocks start_n .. < end_n (start_n >= BLOCK_N). Step j issues S_j = Q K_j^T, rescales O
    # by alpha_{j-1}, issues O += P_{j-1} V_{j-1}, then computes the softmax of S_j while that MMA
    # runs (its result is next read by the rescale of step j + 1, so Triton leaves it in flight).
    # O sees the operations of _fwd_inner in the same order, one step late.
    offs_n0 = tl.arange(0, BLOCK_N)
    for start in tl.range(start_n, end_n, BLOCK_N, num_stages=LOOP_STAGES):
        kT = _k_tile(
            k_src, stride_kt, start, offs_n0, offs_d, k_len, seq, kv_col, BLOCK_N, HEAD_DIM, MASKED, TMA
        )
        # the previous block is fully visible when this one is unmasked (it lies before full_end)
        v = _v_tile(
            v_src,
            stride_kt,
            start - BLOCK_N,
            offs_n0,
            offs_d,
            k_len,
            seq,
            kv_col,
            BLOCK_N,
            HEAD_DIM,
            MASKED,
            TMA,
        )
        if UPCAST:
            kT = kT.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kT)
        acc = acc * alpha_prev[:, None]
        if UPCAST:
            acc = tl.dot(p_prev, v, acc)
        else:
            acc = tl.dot(p_prev.to(DTYPE), v, acc)
        p_prev, m_i, l_i, alpha_prev = _probabilities(
            s,
            m_i,
            l_i,
            offs_m,
            start,
            offs_n0,
            k_len,
            diag,
            qk_scale,
            seed_lo,
            seed_hi,
            seq_id,
            head_id,
            drop_threshold,
            drop_scale,
            BLOCK_N,
            MASKED,
            CAUSAL,
            DROPOUT,
            UPCAST,
            DTYPE,
        )
    return acc, l_i, m_i, p_prev, alpha_prev


@triton.jit(do_not_specialize=["n_tiles"])  # one binary for every sequence length
def attn_fwd_kernel(
    # pointers (TMA == 2: host tensor descriptors of q, k, v, o over (B, T, H * D))
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse2_ptr,
    cu_q_ptr,
    cu_k_ptr,
    # sizes and scalars
    n_tiles,
    n_heads,
    seqlen_q,
    seqlen_k,
    group,
    qk_scale,
    seed_lo,
    seed_hi,
    seq_offset,
    head_offset,
    drop_threshold,
    drop_scale,
    # strides (last dim contiguous; LSE is (H, total_q))
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_lh,
    # meta
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DENSE: tl.constexpr,
    TMA: tl.constexpr = 0,
    PIPELINE_PV: tl.constexpr = False,
    ONE_LOOP: tl.constexpr = False,
    LOOP_STAGES: tl.constexpr = None,
    RECIP_L: tl.constexpr = False,
):
    tile, seq, head = _program_tile(n_tiles, n_heads, True)  # causal: later query tiles are heavier
    q_start, q_len = _seq_span(cu_q_ptr, seq, seqlen_q, DENSE)
    start_m = tile * BLOCK_M
    if start_m >= q_len:
        return
    k_start, k_len = _seq_span(cu_k_ptr, seq, seqlen_k, DENSE)
    diag = k_len - q_len  # bottom-right causal alignment: query i sees keys j <= i + diag
    kv_head = head // group

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_col = 0  # TMA == 2: column of this KV head in (B, T, H_kv * D)
    if TMA == 2:
        tl.static_assert(DENSE, "host tensor descriptors describe a padded batch")
        DTYPE = q_ptr.dtype
        k_src = k_ptr
        v_src = v_ptr
        kv_col = kv_head * HEAD_DIM
        row_ok = offs_m < q_len
        q = tl.reshape(q_ptr.load([seq, start_m, head * HEAD_DIM]), [BLOCK_M, HEAD_DIM])
    else:
        DTYPE = q_ptr.dtype.element_ty
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        k_src = k_ptr + k_start * stride_kt + kv_head * stride_kh
        v_src = v_ptr + k_start * stride_kt + kv_head * stride_kh
        row_ok = offs_m < q_len
        if TMA == 1:
            # descriptors bounded by this sequence: rows past its end read as 0, stores dropped
            k_src = tl.make_tensor_descriptor(k_src, [k_len, HEAD_DIM], [stride_kt, 1], [BLOCK_N, HEAD_DIM])
            v_src = tl.make_tensor_descriptor(v_src, [k_len, HEAD_DIM], [stride_kt, 1], [BLOCK_N, HEAD_DIM])
            q_desc = tl.make_tensor_descriptor(q_base, [q_len, HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM])
            q = q_desc.load([start_m, 0])
        else:
            q = tl.load(
                q_base + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # keys every row of this tile sees entirely, then the rest (diagonal and ragged tail) masked
    full_end = (k_len // BLOCK_N) * BLOCK_N
    end = k_len
    if CAUSAL:
        full_end = tl.minimum(full_end, ((start_m + diag + 1) // BLOCK_N) * BLOCK_N)
        end = tl.minimum(k_len, start_m + BLOCK_M + diag)
    if ONE_LOOP:
        full_end = 0
    seq_id = seq + seq_offset
    head_id = head + head_offset
    if PIPELINE_PV:
        # block 0 peeled (masked: the identity on a fully visible block)
        offs_n0 = tl.arange(0, BLOCK_N)
        kT = _k_tile(k_src, stride_kt, 0, offs_n0, offs_d, k_len, seq, kv_col, BLOCK_N, HEAD_DIM, True, TMA)
        if UPCAST:
            kT = kT.to(tl.float32)
        p, m_i, l_i, alpha = _probabilities(
            tl.dot(q, kT),
            m_i,
            l_i,
            offs_m,
            0,
            offs_n0,
            k_len,
            diag,
            qk_scale,
            seed_lo,
            seed_hi,
            seq_id,
            head_id,
            drop_threshold,
            drop_scale,
            BLOCK_N,
            True,
            CAUSAL,
            DROPOUT,
            UPCAST,
            DTYPE,
        )
        acc, l_i, m_i, p, alpha = _fwd_inner_pipelined(
            acc,
            l_i,
            m_i,
            p,
            alpha,
            q,
            k_src,
            v_src,
            stride_kt,
            offs_m,
            offs_d,
            BLOCK_N,
            full_end,
            k_len,
            diag,
            qk_scale,
            seed_lo,
            seed_hi,
            seq,
            head,
            kv_col,
            seq_id,
            head_id,
            drop_threshold,
            drop_scale,
            BLOCK_N,
            HEAD_DIM,
            False,
            CAUSAL,
            DROPOUT,
            UPCAST,
            DTYPE,
            TMA,
            LOOP_STAGES,
        )
        acc, l_i, m_i, p, alpha = _fwd_inner_pipelined(
            acc,
            l_i,
            m_i,
            p,
            alpha,
            q,
            k_src,
            v_src,
            stride_kt,
            offs_m,
            offs_d,
            tl.maximum(full_end, BLOCK_N),
            end,
            k_len,
            diag,
            qk_scale,
            seed_lo,
            seed_hi,
            seq,
            head,
            kv_col,
            seq_id,
            head_id,
            drop_threshold,
            drop_scale,
            BLOCK_N,
            HEAD_DIM,
            True,
            CAUSAL,
            DROPOUT,
            UPCAST,
            DTYPE,
            TMA,
            LOOP_STAGES,
        )
        last = ((end - 1) // BLOCK_N) * BLOCK_N
        v = _v_tile(v_src, stride_kt, last, offs_n0, offs_d, k_len, seq, kv_col, BLOCK_N, HEAD_DIM, True, TMA)
        if UPCAST:
            v = v.to(tl.float32)
        if UPCAST:
            acc = tl.dot(p, v, acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(DTYPE), v, acc * alpha[:, None])
    else:
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_src,
            v_src,
            stride_kt,
            offs_m,
            offs_d,
            0,
            full_end,
            k_len,
            diag,
            qk_scale,
            seed_lo,
            seed_hi,
            seq,
            head,
            kv_col,
            seq_id,
            head_id,
            drop_threshold,
            drop_scale,
            BLOCK_N,
            HEAD_DIM,
            False,
            CAUSAL,
            DROPOUT,
            UPCAST,
            DTYPE,
            TMA,
            LOOP_STAGES,
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_src,
            v_src,
            stride_kt,
            offs_m,
            offs_d,
            full_end,
            end,
            k_len,
            diag,
            qk_scale,
            seed_lo,
            seed_hi,
            seq,
            head,
            kv_col,
            seq_id,
            head_id,
            drop_threshold,
            drop_scale,
            BLOCK_N,
            HEAD_DIM,
            True,
            CAUSAL,
            DROPOUT,
            UPCAST,
            DTYPE,
            TMA,
            LOOP_STAGES,
        )
    if RECIP_L:
        acc = acc * (1.0 / l_i)[:, None]
    else:
        acc = acc / l_i[:, None]
    lse2 = m_i + tl.math.log2(l_i)
    out = _to_out(acc, DTYPE, UPCAST)
    if TMA == 2:
        o_ptr.store([seq, start_m, head * HEAD_DIM], tl.reshape(out, [1, BLOCK_M, HEAD_DIM]))
    elif TMA == 1:
        o_base = o_ptr + q_start * stride_ot + head * stride_oh
        o_desc = tl.make_tensor_descriptor(o_base, [q_len, HEAD_DIM], [stride_ot, 1], [BLOCK_M, HEAD_DIM])
        o_desc.store([start_m, 0], out)
    else:
        o_ptrs = (
            o_ptr + (q_start + offs_m[:, None].to(tl.int64)) * stride_ot + head * stride_oh + offs_d[None, :]
        )
        tl.store(o_ptrs, out, mask=row_ok[:, None])
    tl.store(lse2_ptr + head * stride_lh + q_start + offs_m, lse2, mask=row_ok)
