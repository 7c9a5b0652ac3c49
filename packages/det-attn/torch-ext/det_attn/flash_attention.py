"""Deterministic flash attention: the public ``attention`` functions.

Reading order: ``attention`` (padded batch) and ``attention_varlen`` (packed), each "check ->
operator". The parts live beside this module, by role: the ``torch.library`` operators that every
call goes through (eager or under torch.compile) and their autograd formula in ``_ops``; the fixed
config table in ``_configs``, the argument checks in ``_checks``, the launch plans, their cache and
the launchers in ``_plans``; the forward kernel in ``_fwd_kernel``, the backward kernels in
``_bwd_kernels``, the helpers both use in ``_tiles``; a plain-torch reference in ``reference.py``.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _ops, _plans
from ._checks import MAX_SEQLEN, SUPPORTED_HEAD_DIMS

__all__ = ["MAX_SEQLEN", "SUPPORTED_HEAD_DIMS", "attention", "attention_varlen"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    return_lse: bool = False,
    sequence_offset: int = 0,
    head_offset: int = 0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Deterministic scaled dot-product attention over a padded batch, with autograd.

    Computes ``softmax(cap(q k^T * softmax_scale) [+ causal / sliding-window mask]) v`` per
    sequence and head (``cap``: the optional logit soft-cap), with optional dropout on the
    attention probabilities. The backward pass gives dq, dk, dv.

    **Layout: (B, T, H, D)** (flash-attn's, sequence before heads), not torch SDPA's
    ``(B, H, T, D)``. For SDPA-layout tensors pass ``q.transpose(1, 2)`` (likewise k and v; views,
    no copy) or call ``det_attn.scaled_dot_product_attention``. Where the shapes allow both
    readings no check can tell them apart, not even the strides (the ``transpose(1, 2)`` of a
    contiguous SDPA tensor has the strides of an SDPA-layout view of a contiguous ``(B, T, H, D)``
    one): a head-count error mentions the layout, other mix-ups compute another attention.

    Args:
        q: ``(B, T_q, H_q, D)`` (see Layout) bf16 or fp16, on CUDA (or CPU under
            ``TRITON_INTERPRET=1``); any strides (transposed and strided views are read in place).
        k: ``(B, T_k, H_kv, D)``, same dtype and device; ``H_q`` a multiple of ``H_kv`` (GQA/MQA:
            query head ``h`` uses key/value head ``h // (H_q // H_kv)``).
        v: ``(B, T_k, H_kv, D)``.
        causal: causal mask aligned to the bottom-right corner (flash-attn convention): query
            ``i`` sees keys ``j <= i + T_k - T_q``; needs ``T_k >= T_q``.
        softmax_scale: multiplier of ``q k^T``; default ``1 / sqrt(D)``; in ``[2**-126, 2**127]``.
            The scaled scores (base 2, ``q k^T * softmax_scale * log2(e)``) must stay below
            ``2**31`` in magnitude: the softmax step's ``exp2(fma(s, scale, -m))`` differs from 0
            by up to half an fp32 ULP of the row maximum, which overflows from there (NaN rows).
        dropout_p: probability of zeroing an attention probability (kept ones scale by
            ``1 / (1 - dropout_p)``); a real number (int, float, numpy scalar; not a bool, str or
            tensor) in ``[0, 1)``.
        seed: Philox seed, an integer (int or numpy integer; not a bool, float or str) with
            ``0 <= seed < 2**64``; required when ``dropout_p > 0``, checked whenever given. Use a
            new seed per training step.
        return_lse: also return the natural log-sum-exp of the scaled scores, ``(B, H_q, T_q)``
            fp32 (no gradient flows through it).
        sequence_offset: global index of this batch's first sequence in the dropout key (data
            parallelism: give each rank its global offset to draw the undivided batch's mask); an
            integer (int or numpy integer; a float is rejected, never truncated).
        head_offset: global index of the first query head in the dropout key (tensor
            parallelism); an integer, as ``sequence_offset``.
        window: sliding window (Mistral, Gemma 2/3 local layers, Qwen2/3 ``use_sliding_window``),
            causal only: query ``i`` sees key ``j`` iff ``i + T_k - T_q - window < j <= i + T_k -
            T_q``, i.e. the ``window`` most recent keys, itself included. This is transformers'
            ``sliding_window=window`` (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx -
            sliding_window``) and flash-attn's ``window_size=(window - 1, 0)``. An integer >= 1
            (int or numpy integer), None for no window; key blocks outside every query's window
            are skipped, so the cost scales with the window. Each window size compiles its own
            kernels (a constexpr).
        softcap: logit soft-capping (Gemma 2): the scaled score ``x = q k^T * softmax_scale``
            becomes ``softcap * tanh(x / softcap)`` before the mask and the softmax, in the order
            of transformers' Gemma 2 ``eager_attention_forward`` (and flash-attn's ``softcap``); the
            backward includes its derivative. A real number in ``[2**-126, 2**127]``, None for none. Each
            value compiles its own kernels (a constexpr).

    Returns:
        ``o`` of shape ``(B, T_q, H_q, D)`` in q's dtype; with ``return_lse``, ``(o, lse)`` (the
        LSE of the capped, masked scores).

    Raises:
        TypeError: a non-tensor input, dtype other than bf16/fp16, or mixed dtypes; ``causal``
            not a bool; ``softmax_scale`` or ``dropout_p`` not a real number (a bool, str or
            tensor); ``seed``, ``sequence_offset``, ``head_offset`` or ``window`` not an integer (a
            bool, float or str); ``softcap`` not a real number.
        ValueError: wrong ranks or shapes, head dim not 64 or 128, ``T = 0``, ``T > MAX_SEQLEN``
            (``2**22``), ``H_q`` not a multiple of ``H_kv``, causal with ``T_k < T_q``, a
            ``softmax_scale`` outside ``[2**-126, 2**127]`` (the normal fp32 range: the kernels take it
            as fp32),
            ``dropout_p`` outside ``[0, 1)``, a seed outside ``[0, 2**64)`` or missing with
            dropout, offsets out of range, tensors on different devices, a ``window`` below 1 or
            without ``causal``, a ``softcap`` outside ``[2**-126, 2**127]``.
        RuntimeError: CPU tensors without the Triton interpreter.

    **Determinism:** bitwise identical run to run (O, LSE, dq, dk, dv; no atomics: each gradient
    element is written once, summed in a fixed order). A sequence's outputs and gradients are the
    same bits whatever its batch size, position in the batch or neighbours, and equal to the same
    sequence given to ``attention_varlen`` beside any neighbours. Heads are independent, so
    splitting heads across ranks (keeping GQA groups together, with ``head_offset`` for dropout)
    reproduces the unsplit bits. Under causal context parallelism (a rank holds a chunk of queries
    and the keys up to the chunk's end) O, LSE and dq keep their bits when every chunk starts at
    a multiple of 128 tokens (then each row keeps its place in its tiles; other starts are checked
    on the GPU but not guaranteed); dk and dv do not (the ranks' partial sums are added outside
    the kernel, in another order). Dropout masks are a pure
    function of (seed, sequence index, head, query position, key position). Not guaranteed across
    GPU models, Triton versions, or between the GPU and the CPU interpreter (other block sizes).
    Under ``torch.compile`` (``fullgraph=True`` traces it) the same bits as eager: the call is the
    ``det_attn::attention_forward`` / ``attention_backward`` operators, which Inductor calls as
    extern kernels; the argument checks run at trace time (errors as eager's). ``window`` and
    ``softcap`` keep all of this: the key blocks a query tile visits are fixed by its position in
    its sequence (ascending, the ones outside the window skipped), every dK/dV and dQ tile is
    summed over them in that one order, and without them the kernels are the causal path's own
    code (constexpr switches; their PTX is unchanged, ``benchmarks/aot_compile_check.py``).

    Method: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) after the Triton fused-attention
    tutorial, with atomics-free backward (separate dK/dV and dQ kernels).
    """
    op = "det_attn.attention"
    # eager: a signature with a plan has passed every check but dropout's (see _plans), and the
    # operator gets softmax_scale as given (its plan key is the same); otherwise every check runs,
    # in order: under torch.compile at trace time, on shapes, dtypes and devices alone
    compiling = torch.compiler.is_compiling()
    key = None if compiling else _plans.padded_key(q, k, v, causal, softmax_scale, dropout_p, window, softcap)
    if key is None or _plans.cached(key) is None:
        scale, dropout_p, seed, sequence_offset, head_offset = _checks.check_padded(
            q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, op
        )
        win, cap = _checks.check_window_softcap(window, softcap, causal, op)
        if key is None:
            softmax_scale, window, softcap = scale, win or None, cap or None
        if not compiling:  # the plan the operator will look up: checks passed
            _plans.padded_plan(q, k, v, key, causal, scale, dropout_p > 0.0, win, cap)
    else:
        dropout_p, seed, sequence_offset, head_offset = _checks.check_dropout(
            dropout_p, seed, sequence_offset, head_offset, q.shape[2], q.shape[0], op
        )
    # the operator; eager calls its Autograd kernel directly (the same path, one dispatch less)
    forward = _ops.attention_forward if compiling else _ops.padded_autograd
    o, lse2 = forward(
        q, k, v, causal, softmax_scale, dropout_p, _ops.seed_word(seed), sequence_offset, head_offset,
        window, softcap,
    )  # fmt: skip
    batch, t_q, heads, head_dim = q.shape
    o = o.view(batch, t_q, heads, head_dim)
    if not return_lse:
        return o
    return o, (lse2 * math.log(2.0)).view(heads, batch, t_q).permute(1, 0, 2)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    return_lse: bool = False,
    sequence_offset: int = 0,
    head_offset: int = 0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Deterministic attention over packed variable-length sequences, with autograd.

    Sequence ``b`` holds query tokens ``cu_seqlens_q[b] : cu_seqlens_q[b+1]`` and key tokens
    ``cu_seqlens_k[b] : cu_seqlens_k[b+1]``; tokens attend only inside their own sequence.

    Args:
        q: ``(total_q, H_q, D)`` bf16 or fp16.
        k: ``(total_k, H_kv, D)``; ``H_q`` a multiple of ``H_kv``.
        v: ``(total_k, H_kv, D)``.
        cu_seqlens_q: ``(B + 1,)`` int32, non-decreasing, from 0 to ``total_q``.
        cu_seqlens_k: ``(B + 1,)`` int32, non-decreasing, from 0 to ``total_k``.
        max_seqlen_q: an integer (int, numpy integer; not bool or float) >= the longest query
            sequence (sets the launch grid).
        max_seqlen_k: an integer >= the longest key sequence.
        causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, window, softcap: as in
            ``attention``; the dropout key's sequence index is ``sequence_offset + b``, query/key
            positions count from the start of the sequence (the window too: it never crosses
            into a neighbouring sequence).
        return_lse: also return the natural LSE as ``(H_q, total_q)`` fp32.

    Returns:
        ``o`` of shape ``(total_q, H_q, D)``; with ``return_lse``, ``(o, lse)``.

    Raises:
        TypeError: as in ``attention``; cu_seqlens not int32 tensors; a max_seqlen that is a bool
            or not an integer.
        ValueError: as in ``attention``; cu_seqlens not 1-D, of different lengths, not monotone,
            not from 0 to the token count, on another device; a max_seqlen below the longest
            sequence or above ``MAX_SEQLEN``; a sequence with queries but no keys; causal with a
            sequence whose key length is below its query length.

    **Determinism:** as ``attention``: tiles start at each sequence's first token, so a
    sequence's O, LSE, dq, dk, dv are the same bits whatever is packed beside it, and equal to
    ``attention`` on that sequence alone (with the same sequence index for dropout). Validating
    ``cu_seqlens`` reads them on the host (one small copy, a synchronisation); under
    ``torch.compile`` (eager's bits, the ``det_attn::attention_varlen_*`` operators) that check runs
    inside the operator when the graph runs, the others at trace time.

    Method: as ``attention`` (FlashAttention-2 varlen layout, Dao 2023).
    """
    op = "det_attn.attention_varlen"
    # eager: a signature with a plan has passed the checks of q, k, v (see _plans); the checks of
    # the other arguments run on every call, in order, those of cu_seqlens on a host copy of their
    # values. Under torch.compile every check that reads no values runs at trace time, and the
    # operator checks the values (validate) when it runs.
    compiling = torch.compiler.is_compiling()
    key = None if compiling else _plans.packed_key(
        q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout_p, window, softcap
    )  # fmt: skip
    plan = None if key is None else _plans.cached(key)
    if plan is None:
        _checks.check_packed_qkv(q, k, v, op)
    check = _checks.check_packed_traced if compiling else _checks.check_packed
    checked = check(
        q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        softmax_scale, dropout_p, seed, sequence_offset, head_offset, op,
    )  # fmt: skip
    batch, max_seqlen_q, max_seqlen_k, scale, dropout_p, seed, sequence_offset, head_offset = checked
    win, cap = _checks.check_window_softcap(window, softcap, causal, op)
    if plan is None and not compiling:  # the plan the operator will look up: checks passed
        _plans.packed_plan(
            q, k, v, key, batch, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p > 0.0, win, cap
        )
    if key is None:  # the operator gets the checked values (see attention)
        softmax_scale, window, softcap = scale, win or None, cap or None
    forward = _ops.attention_varlen_forward if compiling else _ops.packed_autograd  # see attention
    o, lse2 = forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout_p,
        _ops.seed_word(seed), sequence_offset, head_offset, compiling, window, softcap,
    )  # fmt: skip
    if not return_lse:
        return o
    return o, lse2 * math.log(2.0)
