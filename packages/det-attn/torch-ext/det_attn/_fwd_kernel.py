"""Forward kernel of deterministic flash attention: pointer loads, or host TMA descriptors.

Method: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) as in the Triton tutorial "06 fused
attention": online softmax in base 2, fp32 accumulators, the causal key blocks of a tile split
into a loop without a mask and a masked loop (diagonal, ragged tail). See ``_tiles`` for the
layout (packed ``(total_tokens, H, D)``, tiles aligned to each sequence's first token) and the
softmax bookkeeping (``qk2 = (q . k) * scale * log2(e)``, saved ``lse2``).

Load path (constexpr ``TMA``, ``_configs.Config.fwd_tma``): ``False`` pointer loads and
stores (masked on the ragged tiles), any packing; ``True`` host TMA tensor descriptors over
``(B, T, H * D)`` (padded batches only: rows past ``T`` read as zeros, stores past it dropped,
what the masked pointer loads and stores do). The tiles fed to the dots hold the same values
either way, so both give the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import LOG2E, dropout_keep, kv_tile, program_tile, seq_span, tanh, to_out


@triton.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    offs_m,
    offs_n,
    k_len,
    diag,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    # One online-softmax step on raw scores `s` (the scale is folded into the exp2 argument).
    if MASKED:
        visible = offs_n[None, :] < k_len
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > offs_m[:, None] + diag - WINDOW)
        s = tl.where(visible, s, float("-inf"))  # exact: a visible score keeps its bits
    # Masked and unmasked blocks do the same arithmetic on a visible score (no contraction
    # left to the compiler): max(s) * scale == max(s * scale) (rounding is monotone, scale > 0),
    # and the exponent is one explicit fma. So a row's bits do not depend on whether a block
    # was masked for its tile, i.e. not on where the row sits in its tile. A masked score
    # gives fma(-inf, scale, -m) = -inf and exp2 = 0 (m is finite: every row sees key 0).
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if WINDOW > 0 and MASKED:
        # With a window a row may not have seen any key yet (its window starts past this block):
        # m = -inf. Subtract 0 then, so that exp2 gives 0 and not NaN; a finite m is unchanged,
        # so a row's bits still do not depend on whether a block was masked for its tile.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(tl.fma(s, qk_scale, -m_sub[:, None]))
        alpha = tl.math.exp2(m_i - m_sub)
    else:
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
    step_scale,
    seed_lo,
    seed_hi,
    seq,
    col,
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
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # Key blocks start_n, start_n + BLOCK_N, ... < end_n, ascending: S = Q K^T, softmax step, O += P V.
    offs_n0 = tl.arange(0, BLOCK_N)
    for start in tl.range(start_n, end_n, BLOCK_N):
        kT = kv_tile(
            k_src, stride_kt, start, offs_n0, offs_d, k_len, seq, col, BLOCK_N, HEAD_DIM, MASKED, TMA, True
        )
        v = kv_tile(
            v_src, stride_kt, start, offs_n0, offs_d, k_len, seq, col, BLOCK_N, HEAD_DIM, MASKED, TMA, False
        )
        if UPCAST:
            kT = kT.to(tl.float32)
        s = tl.dot(q, kT)  # raw scores; the scale is folded into the exp2 argument
        if SOFTCAP > 0:  # t = tanh(x / softcap) (qk_scale = scale / softcap), scaled in the exp2
            s = tanh(s * qk_scale)
        p, m_i, l_i, alpha = _softmax_step(
            s, m_i, l_i, offs_m, start + offs_n0, k_len, diag, step_scale, MASKED, CAUSAL, WINDOW
        )
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = dropout_keep(
                seed_lo, seed_hi, seq_id, head_id, offs_m, start, drop_threshold, BLOCK_N, False
            )
            p = tl.where(keep, p * drop_scale, 0.0)
        if UPCAST:
            acc = tl.dot(p, v.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(DTYPE), v, acc)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["n_tiles"])  # one binary for every sequence length
def attn_fwd_kernel(
    # pointers (TMA: host tensor descriptors of q, k, v, o over (B, T, H * D))
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
    TMA: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
):
    tile, seq, head = program_tile(n_tiles, n_heads, True)  # causal: later query tiles are heavier
    q_start, q_len = seq_span(cu_q_ptr, seq, seqlen_q, DENSE)
    start_m = tile * BLOCK_M
    if start_m >= q_len:
        return
    k_start, k_len = seq_span(cu_k_ptr, seq, seqlen_k, DENSE)
    diag = k_len - q_len  # bottom-right causal alignment: query i sees keys j <= i + diag
    kv_head = head // group

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_col = 0  # TMA: column of this KV head in (B, T, H_kv * D)
    if TMA:
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
    seq_id = seq + seq_offset
    head_id = head + head_offset
    step_scale = qk_scale  # the base-2 scale of the (capped) scores in the softmax step
    if SOFTCAP > 0:
        step_scale = tl.full([], SOFTCAP * LOG2E, tl.float32)
    first = 0
    if WINDOW > 0:
        # the key blocks from the first row's window start to the first block every row of the
        # tile sees entirely (masked), ascending; the blocks before them are outside every
        # row's window: skipped. `first` and what follows as without a window.
        lo_w = (tl.maximum(start_m + diag - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        first = tl.cdiv(tl.maximum(start_m + BLOCK_M + diag - WINDOW, 0), BLOCK_N) * BLOCK_N
        first = tl.minimum(first, full_end)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kt, offs_m, offs_d, lo_w, first, k_len, diag, qk_scale,
            step_scale, seed_lo, seed_hi, seq, kv_col, seq_id, head_id, drop_threshold, drop_scale,
            BLOCK_N, HEAD_DIM, True, CAUSAL, DROPOUT, UPCAST, DTYPE, TMA, WINDOW, SOFTCAP,
        )  # fmt: skip
    # the unmasked key blocks [first, full_end), then the masked ones [full_end, end): one call,
    # unrolled into two loops that differ only in the range and MASKED
    for part in tl.static_range(2):
        if part == 0:
            lo, hi = first, full_end
        else:
            lo, hi = full_end, end
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kt, offs_m, offs_d, lo, hi, k_len, diag, qk_scale,
            step_scale, seed_lo, seed_hi, seq, kv_col, seq_id, head_id, drop_threshold, drop_scale,
            BLOCK_N, HEAD_DIM, part == 1, CAUSAL, DROPOUT, UPCAST, DTYPE, TMA, WINDOW, SOFTCAP,
        )  # fmt: skip
    if WINDOW > 0:  # rows past the sequence end may see no key: keep their (unstored) sums finite
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    lse2 = m_i + tl.math.log2(l_i)
    out = to_out(acc, DTYPE, UPCAST)
    if TMA:
        o_ptr.store([seq, start_m, head * HEAD_DIM], tl.reshape(out, [1, BLOCK_M, HEAD_DIM]))
    else:
        o_ptrs = (
            o_ptr + (q_start + offs_m[:, None].to(tl.int64)) * stride_ot + head * stride_oh + offs_d[None, :]
        )
        tl.store(o_ptrs, out, mask=row_ok[:, None])
    tl.store(lse2_ptr + head * stride_lh + q_start + offs_m, lse2, mask=row_ok)
