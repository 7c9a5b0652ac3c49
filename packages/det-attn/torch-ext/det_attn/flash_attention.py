"""Deterministic flash attention: the public ``attention`` functions and their autograd Function.

Reading order: ``attention`` (padded batch) and ``attention_varlen`` (packed), each "check ->
plan -> launch", then the ``torch.autograd.Function``. The parts live beside this module, by
role: the fixed config table in ``_configs``, the argument checks in ``_checks``, the launch
plans, their cache and the launchers in ``_plans``; the forward kernel in ``_fwd_kernel``, the
backward kernels in ``_bwd_kernels``, the helpers both use in ``_tiles``; a plain-torch
reference in ``reference.py``.
"""

from __future__ import annotations

import math

import torch
from det_core import runtime

from . import _checks, _plans
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Deterministic scaled dot-product attention over a padded batch, with autograd.

    Computes ``softmax(q k^T * softmax_scale [+ causal mask]) v`` per sequence and head, with
    optional dropout on the attention probabilities. The backward pass gives dq, dk, dv.

    Args:
        q: ``(B, T_q, H_q, D)`` bf16 or fp16, on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        k: ``(B, T_k, H_kv, D)``, same dtype and device; ``H_q`` a multiple of ``H_kv`` (GQA/MQA:
            query head ``h`` uses key/value head ``h // (H_q // H_kv)``).
        v: ``(B, T_k, H_kv, D)``.
        causal: causal mask aligned to the bottom-right corner (flash-attn convention): query
            ``i`` sees keys ``j <= i + T_k - T_q``; needs ``T_k >= T_q``.
        softmax_scale: multiplier of ``q k^T``; default ``1 / sqrt(D)``.
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

    Returns:
        ``o`` of shape ``(B, T_q, H_q, D)`` in q's dtype; with ``return_lse``, ``(o, lse)``.

    Raises:
        TypeError: a non-tensor input, dtype other than bf16/fp16, or mixed dtypes; ``causal``
            not a bool; ``softmax_scale`` or ``dropout_p`` not a real number (a bool, str or
            tensor); ``seed``, ``sequence_offset`` or ``head_offset`` not an integer (a bool,
            float or str).
        ValueError: wrong ranks or shapes, head dim not 64 or 128, ``T = 0``, ``T > MAX_SEQLEN``
            (``2**22``), ``H_q`` not a multiple of ``H_kv``, causal with ``T_k < T_q``, a
            ``softmax_scale`` that is not finite and positive,
            ``dropout_p`` outside ``[0, 1)``, a seed outside ``[0, 2**64)`` or missing with
            dropout, offsets out of range, tensors on different devices.
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

    Method: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) after the Triton fused-attention
    tutorial, with atomics-free backward (separate dK/dV and dQ kernels).
    """
    op = "det_attn.attention"
    # a signature with a plan has passed every check but dropout's (see _plans); otherwise every
    # check runs, in order
    key = _plans.padded_key(q, k, v, causal, softmax_scale, dropout_p)
    plan = _plans.cached(key)
    if plan is None:
        scale, dropout_p, seed, sequence_offset, head_offset = _checks.check_padded(
            q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, op
        )
        plan = _plans.padded_plan(q, k, v, key, causal, scale, dropout_p > 0.0)
    else:
        dropout_p, seed, sequence_offset, head_offset = _checks.check_dropout(
            dropout_p, seed, sequence_offset, head_offset, q.shape[2], q.shape[0], op
        )
    batch, t_q, heads, head_dim = q.shape
    drop = _plans.dropout_args(dropout_p, seed, sequence_offset, head_offset) if plan.dropout else None
    o, lse2 = _attend(q, k, v, None, None, plan, drop)
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
        causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset: as in ``attention``;
            the dropout key's sequence index is ``sequence_offset + b`` and query/key positions
            count from the start of the sequence.
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
    ``cu_seqlens`` reads them on the host (one small copy, a synchronisation).

    Method: as ``attention`` (FlashAttention-2 varlen layout, Dao 2023).
    """
    op = "det_attn.attention_varlen"
    # a signature with a plan has passed the checks of q, k, v (see _plans); the checks of the
    # other arguments run on every call, in order
    key = _plans.packed_key(
        q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout_p
    )
    plan = _plans.cached(key)
    if plan is None:
        _checks.check_packed_qkv(q, k, v, op)
    batch, max_seqlen_q, max_seqlen_k, scale, dropout_p, seed, sequence_offset, head_offset = (
        _checks.check_packed(
            q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout_p,
            seed, sequence_offset, head_offset, op,
        )
    )  # fmt: skip
    if plan is None:
        plan = _plans.packed_plan(
            q, k, v, key, batch, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p > 0.0
        )
    drop = _plans.dropout_args(dropout_p, seed, sequence_offset, head_offset) if plan.dropout else None
    # the kernels read cu_seqlens with unit stride (a strided view's values were checked above)
    o, lse2 = _attend(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), plan, drop)
    if not return_lse:
        return o
    return o, lse2 * math.log(2.0)


def _attend(q, k, v, cu_q, cu_k, plan: _plans.Plan, drop: tuple | None):
    """``(o, lse2)`` with o ``(tokens, H_q, D)``: ``_AttentionFunction.apply``, or, when no
    gradient can flow (grad mode off, or no input requires one), the same forward launch without
    autograd (whose per-call host time shows at short sequences). q, k, v as the caller got them
    (``(B, T, H, D)`` for a padded batch, ``plan.dense``); ``drop``: the per-call dropout
    arguments (``_plans.dropout_args``), None without dropout."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionFunction.apply(q, k, v, cu_q, cu_k, plan, drop)
    q, k, v = _plans.kernel_inputs(q, k, v, plan.dense)
    return _plans.launch_forward(plan, q, k, v, cu_q, cu_k, drop)


class _AttentionFunction(torch.autograd.Function):
    # A padded batch's (B, T, H, D) inputs are reshaped in here, not before: the reshapes then
    # add no autograd nodes (three view nodes per call, forward and backward, in host time); the
    # gradients are viewed back (splitting the token dim is always a view: the same layout the
    # reshapes' backward gives).
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, plan, drop):
        shapes = (q.shape, k.shape, v.shape) if plan.dense is not None else None
        q, k, v = _plans.kernel_inputs(q, k, v, plan.dense)
        o, lse2 = _plans.launch_forward(plan, q, k, v, cu_q, cu_k, drop)
        ctx.save_for_backward(q, k, v, o, lse2, cu_q, cu_k)
        ctx.plan, ctx.drop, ctx.shapes = plan, drop, shapes  # the backward's launches: the forward's plan
        ctx.mark_non_differentiable(lse2)
        # lse2 never gets a gradient: do not let autograd allocate and zero-fill one per backward
        ctx.set_materialize_grads(False)
        return o, lse2

    @staticmethod
    def backward(ctx, do, _dlse2):
        runtime.check_first_order("det_attn.attention")
        q, k, v, o, lse2, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _plans.launch_backward(ctx.plan, do, q, k, v, o, lse2, cu_q, cu_k, ctx.drop)
        if ctx.shapes is not None:
            q_shape, k_shape, v_shape = ctx.shapes
            dq, dk, dv = dq.view(q_shape), dk.view(k_shape), dv.view(v_shape)
        return dq, dk, dv, None, None, None, None
