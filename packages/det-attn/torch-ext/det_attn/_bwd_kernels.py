"""Backward kernels of deterministic flash attention: preprocess (``delta = rowsum(dO * O)``), dK/dV
and dQ; no atomics (the forward kernel is in ``_fwd_kernel``, the helpers both use in ``_tiles``).

Method: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) as laid out in the Triton tutorial
"06 fused attention" (fp32 accumulators, causal blocks split into masked diagonal and ragged-tail
parts and an unmasked part), with the layout of ``_tiles`` (packed ``(total_tokens, H, D)``, tiles
aligned to each sequence's first token, base-2 softmax bookkeeping with the saved ``lse2``). The
backward pass uses no atomics: one kernel owns a KV block and loops over the query blocks (and,
for GQA, over the query heads of its KV head) in a fixed ascending order to form dK and dV; a
second kernel owns a query block and loops over the KV blocks in ascending order to form dQ. Each
gradient element is written once, by one program. Dropout bits come from det-core's Philox, keyed
by (seed, sequence, head, query, key) with query/key positions counted inside the sequence.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import LOG2E, dropout_keep, program_tile, seq_span, tanh, to_out


@triton.jit
def attn_bwd_preprocess_kernel(
    o_ptr,
    do_ptr,
    delta_ptr,
    total_q,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # delta = rowsum(dO * O) in fp32, one row per (token, head); a row's sum order is fixed.
    head = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    ok = offs_m[:, None] < total_q
    o = tl.load(o_ptr + rows * stride_ot + head * stride_oh + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(do_ptr + rows * stride_dot + head * stride_doh + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + head * stride_dh + offs_m, delta, mask=offs_m < total_q)


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse2_base,
    delta_base,
    stride_qt,
    stride_dot,
    offs_n,
    start_n,
    offs_d,
    start_m,
    end_m,
    q_len,
    diag,
    qk_scale,
    seed_lo,
    seed_hi,
    seq,
    head,
    drop_threshold,
    drop_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DTYPE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    offs_m0 = tl.arange(0, BLOCK_M)
    for start in range(start_m, end_m, BLOCK_M):
        offs_m = start + offs_m0
        qT_ptrs = q_base + offs_m[None, :].to(tl.int64) * stride_qt + offs_d[:, None]
        do_ptrs = do_base + offs_m[:, None].to(tl.int64) * stride_dot + offs_d[None, :]
        if MASKED:
            row_ok = offs_m < q_len
            qT = tl.load(qT_ptrs, mask=row_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(lse2_base + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            qT = tl.load(qT_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(lse2_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        if UPCAST:
            qT = qT.to(tl.float32)
            do = do.to(tl.float32)
        if SOFTCAP > 0:  # as the forward: t = tanh(x / softcap), qk_scale = scale / softcap
            tT = tanh(tl.dot(k, qT) * qk_scale)
            pT = tl.math.exp2(tl.fma(tT, SOFTCAP * LOG2E, -lse2[None, :]))
        else:
            pT = tl.math.exp2(tl.fma(tl.dot(k, qT), qk_scale, -lse2[None, :]))  # [BLOCK_N, BLOCK_M]
        if MASKED:
            visible = offs_m[None, :] < q_len
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + diag)
            if WINDOW > 0:
                visible = visible & (offs_n[:, None] > offs_m[None, :] + diag - WINDOW)
            pT = tl.where(visible, pT, 0.0)
        dpT = tl.dot(v, tl.trans(do))
        if DROPOUT:
            keep = dropout_keep(seed_lo, seed_hi, seq, head, offs_m, start_n, drop_threshold, BLOCK_N, True)
            pdT = tl.where(keep, pT * drop_scale, 0.0)
            dpT = tl.where(keep, dpT * drop_scale, 0.0)
        else:
            pdT = pT
        if UPCAST:
            dv = tl.dot(pdT, do, dv)
        else:
            dv = tl.dot(pdT.to(DTYPE), do, dv)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP > 0:  # d(softcap * tanh(x / softcap)) / dx
            dsT = dsT * (1.0 - tT * tT)
        if UPCAST:
            dk = tl.dot(dsT, tl.trans(qT), dk)
        else:
            dk = tl.dot(dsT.to(DTYPE), tl.trans(qT), dk)
    return dk, dv


@triton.jit(do_not_specialize=["n_tiles"])  # one binary for every sequence length
def attn_bwd_dkdv_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse2_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    cu_q_ptr,
    cu_k_ptr,
    # sizes and scalars
    n_tiles,
    n_heads,
    seqlen_q,
    seqlen_k,
    group,
    sm_scale,
    qk_scale,
    seed_lo,
    seed_hi,
    seq_offset,
    head_offset,
    drop_threshold,
    drop_scale,
    # strides (LSE and delta share one layout)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_lh,
    # meta
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DENSE: tl.constexpr,
    WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
):
    # One program owns KV block `tile` of KV head `kv_head`: it sums over the query heads of the
    # group (ascending) and, for each, over the query blocks (ascending). No atomics.
    tile, seq, kv_head = program_tile(n_tiles, n_heads, False)  # causal: early KV tiles are heavier
    k_start, k_len = seq_span(cu_k_ptr, seq, seqlen_k, DENSE)
    start_n = tile * BLOCK_N
    if start_n >= k_len:
        return
    q_start, q_len = seq_span(cu_q_ptr, seq, seqlen_q, DENSE)
    diag = k_len - q_len
    DTYPE = q_ptr.dtype.element_ty

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < k_len
    kv_off = (k_start + offs_n[:, None].to(tl.int64)) * stride_kt + kv_head * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + kv_off, mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off, mask=col_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    # query blocks (aligned to the sequence start) that see any key of this block, split into
    # those needing a mask (causal diagonal, ragged tail) and those that do not; all ascending
    begin = 0
    full_begin = 0
    if CAUSAL:
        begin = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        full_begin = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
    diag_end = tl.minimum(full_begin, q_len)
    full_end = (q_len // BLOCK_M) * BLOCK_M
    tail_begin = tl.maximum(full_begin, full_end)
    end = q_len
    if WINDOW > 0:
        # queries from start_n + BLOCK_N - 1 - diag + WINDOW on see no key of this block (skipped);
        # a query block sees every key of it only if its last query sees key start_n
        end = tl.minimum(q_len, tl.maximum(start_n + BLOCK_N - 1 - diag + WINDOW, 0))
        diag_end = tl.minimum(diag_end, end)
        full_end = tl.minimum(full_end, (tl.maximum(start_n - diag + WINDOW, 0) // BLOCK_M) * BLOCK_M)
        tail_begin = tl.maximum(full_begin, full_end)

    for g in range(0, group):
        head = kv_head * group + g
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        do_base = do_ptr + q_start * stride_dot + head * stride_doh
        lse2_base = lse2_ptr + head * stride_lh + q_start
        delta_base = delta_ptr + head * stride_lh + q_start
        seq_id = seq + seq_offset
        head_id = head + head_offset
        # the diagonal (masked), the fully visible blocks (unmasked), the ragged tail (masked):
        # one call, unrolled into three loops that differ only in the range and MASKED
        for part in tl.static_range(3):
            if part == 0:
                lo, hi = begin, diag_end
            elif part == 1:
                lo, hi = full_begin, full_end
            else:
                lo, hi = tail_begin, end
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse2_base, delta_base, stride_qt, stride_dot, offs_n, start_n,
                offs_d, lo, hi, q_len, diag, qk_scale, seed_lo, seed_hi, seq_id, head_id, drop_threshold,
                drop_scale, BLOCK_M, BLOCK_N, part != 1, CAUSAL, DROPOUT, UPCAST, DTYPE, WINDOW, SOFTCAP,
            )  # fmt: skip
    dk = dk * sm_scale
    out_off = (k_start + offs_n[:, None].to(tl.int64)) * stride_dkt + kv_head * stride_dkh + offs_d[None, :]
    tl.store(dk_ptr + out_off, to_out(dk, dk_ptr.dtype.element_ty, UPCAST), mask=col_ok[:, None])
    tl.store(dv_ptr + out_off, to_out(dv, dv_ptr.dtype.element_ty, UPCAST), mask=col_ok[:, None])


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
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
    drop_threshold,
    drop_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DTYPE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + offs_n0
        kT_ptrs = k_base + offs_n[None, :].to(tl.int64) * stride_kt + offs_d[:, None]
        vT_ptrs = v_base + offs_n[None, :].to(tl.int64) * stride_kt + offs_d[:, None]
        if MASKED:
            kT = tl.load(kT_ptrs, mask=offs_n[None, :] < k_len, other=0.0)
            vT = tl.load(vT_ptrs, mask=offs_n[None, :] < k_len, other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            vT = tl.load(vT_ptrs)
        if UPCAST:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)
        if SOFTCAP > 0:  # as the forward: t = tanh(x / softcap), qk_scale = scale / softcap
            t = tanh(tl.dot(q, kT) * qk_scale)
            p = tl.math.exp2(tl.fma(t, SOFTCAP * LOG2E, -lse2[:, None]))
        else:
            p = tl.math.exp2(tl.fma(tl.dot(q, kT), qk_scale, -lse2[:, None]))  # explicit fma, as forward
        if MASKED:
            visible = offs_n[None, :] < k_len
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > offs_m[:, None] + diag - WINDOW)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, vT)
        if DROPOUT:
            keep = dropout_keep(seed_lo, seed_hi, seq, head, offs_m, start, drop_threshold, BLOCK_N, False)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP > 0:  # d(softcap * tanh(x / softcap)) / dx
            ds = ds * (1.0 - t * t)
        if UPCAST:
            dq = tl.dot(ds, tl.trans(kT), dq)
        else:
            dq = tl.dot(ds.to(DTYPE), tl.trans(kT), dq)
    return dq


@triton.jit(do_not_specialize=["n_tiles"])  # one binary for every sequence length
def attn_bwd_dq_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse2_ptr,
    delta_ptr,
    dq_ptr,
    cu_q_ptr,
    cu_k_ptr,
    # sizes and scalars
    n_tiles,
    n_heads,
    seqlen_q,
    seqlen_k,
    group,
    sm_scale,
    qk_scale,
    seed_lo,
    seed_hi,
    seq_offset,
    head_offset,
    drop_threshold,
    drop_scale,
    # strides
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lh,
    # meta
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DENSE: tl.constexpr,
    WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
):
    # One program owns query block `tile` of one head and loops over KV blocks in ascending order.
    tile, seq, head = program_tile(n_tiles, n_heads, True)
    q_start, q_len = seq_span(cu_q_ptr, seq, seqlen_q, DENSE)
    start_m = tile * BLOCK_M
    if start_m >= q_len:
        return
    k_start, k_len = seq_span(cu_k_ptr, seq, seqlen_k, DENSE)
    diag = k_len - q_len
    kv_head = head // group
    DTYPE = q_ptr.dtype.element_ty

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    rows = q_start + offs_m[:, None].to(tl.int64)
    q = tl.load(
        q_ptr + rows * stride_qt + head * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    do = tl.load(
        do_ptr + rows * stride_dot + head * stride_doh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    lse2 = tl.load(lse2_ptr + head * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + head * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    k_base = k_ptr + k_start * stride_kt + kv_head * stride_kh
    v_base = v_ptr + k_start * stride_kt + kv_head * stride_kh
    full_end = (k_len // BLOCK_N) * BLOCK_N
    end = k_len
    if CAUSAL:
        full_end = tl.minimum(full_end, ((start_m + diag + 1) // BLOCK_N) * BLOCK_N)
        end = tl.minimum(k_len, start_m + BLOCK_M + diag)
    seq_id = seq + seq_offset
    head_id = head + head_offset
    first = 0
    if WINDOW > 0:  # as the forward: the window's masked left edge first; earlier blocks skipped
        lo_w = (tl.maximum(start_m + diag - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        first = tl.cdiv(tl.maximum(start_m + BLOCK_M + diag - WINDOW, 0), BLOCK_N) * BLOCK_N
        first = tl.minimum(first, full_end)
        dq = _dq_inner(
            dq, q, do, lse2, delta, k_base, v_base, stride_kt, offs_m, offs_d, lo_w, first, k_len, diag,
            qk_scale, seed_lo, seed_hi, seq_id, head_id, drop_threshold, drop_scale, BLOCK_N, True, CAUSAL,
            DROPOUT, UPCAST, DTYPE, WINDOW, SOFTCAP,
        )  # fmt: skip
    # the key blocks every row of this tile sees entirely (unmasked), then the rest (diagonal,
    # ragged tail; masked): one call, unrolled into two loops that differ in the range and MASKED
    for part in tl.static_range(2):
        if part == 0:
            lo, hi = first, full_end
        else:
            lo, hi = full_end, end
        dq = _dq_inner(
            dq, q, do, lse2, delta, k_base, v_base, stride_kt, offs_m, offs_d, lo, hi, k_len, diag, qk_scale,
            seed_lo, seed_hi, seq_id, head_id, drop_threshold, drop_scale, BLOCK_N, part == 1, CAUSAL,
            DROPOUT, UPCAST, DTYPE, WINDOW, SOFTCAP,
        )  # fmt: skip
    dq = dq * sm_scale
    tl.store(
        dq_ptr + rows * stride_dqt + head * stride_dqh + offs_d[None, :],
        to_out(dq, dq_ptr.dtype.element_ty, UPCAST),
        mask=row_ok[:, None],
    )
