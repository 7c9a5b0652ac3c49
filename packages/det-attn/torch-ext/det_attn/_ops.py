"""det_attn's ``torch.library`` operators: the one path of every call, eager or under torch.compile.

Four operators in this package's namespace (``det_attn`` from source; a Hub build's module id, such
as ``_det_attn_cuda_<hash>``, so that several builds can live in one process):

``attention_forward(q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset)
-> (out, lse2)`` and ``attention_backward(grad_out, q, k, v, out, lse2, <the same options>) ->
(grad_q, grad_k, grad_v)``; ``attention_varlen_forward`` / ``attention_varlen_backward`` add
``cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k`` after ``v``, and a ``validate`` flag
(the forward's after ``head_offset``; the backward's last, default True): set, the operator checks
the ``cu_seqlens`` values on a host copy; unset, it trusts them (the public function checked them,
or, in the backward, the forward did), and values out of range would index out of bounds.
Tensors in, fresh tensors out, nothing mutated; the options are plain schema types
(``bool``, ``float?``, ``float``, ``SymInt``). ``out`` and the gradients come in the kernels'
``(tokens, H, D)`` layout (a padded batch's ``(B * T, H, D)``; ``attention`` views ``out`` back),
``lse2`` is the base-2 log-sum-exp ``(H_q, tokens)`` fp32. ``seed`` is the Philox seed as a signed
64-bit word (``seed_word``; 0 without dropout). Every operator takes ``int? window=None, float?
softcap=None`` after its options (sliding window and logit soft-cap, as the public functions take
them; after ``validate`` in the varlen forward, before it in the varlen backward), defaulted, so
calls written before they existed keep their meaning.

Each operator has a CPU and a CUDA kernel (the launches of ``_plans``; the launch plan is looked up
from the arguments, never passed), a fake kernel (output shapes, strides and dtypes from the input
metadata, for torch.compile and FakeTensor), and the forward ones an ``Autograd`` kernel: the
autograd Function below, whose backward is the backward operator. Inductor treats the operators as
extern calls, so it cannot reorder what they sum.

Why ``torch.library.Library`` and not ``torch.library.custom_op``: custom_op's autograd wrapper
spends tens of microseconds of host time per call (it rebinds the schema's defaults, reading each
argument's schema entry per argument), at short sequences more than the rest of the call; the
registrations here are what custom_op makes (a schema, backend kernels, a fake kernel registered
with ``torch.library.register_fake``, an ``Autograd`` kernel around an autograd Function that
redispatches below autograd), without that per-call work. ``torch.library.opcheck`` checks them.
"""

from __future__ import annotations

import torch
from det_core import runtime

from . import _checks, _plans

NAMESPACE = __name__.split(".")[0]
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # held for the process: dropping it deregisters

_OPTIONS = (
    "bool causal, float? softmax_scale, float dropout_p, SymInt seed, SymInt sequence_offset, "
    "SymInt head_offset"
)
_CU = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k"
# window and softcap are compile-time constants of the kernels: plain int / float (a traced value
# is specialized), last and defaulted
_MASKING = "int? window=None, float? softcap=None"
SCHEMAS = {
    "attention_forward": (
        f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, {_MASKING}) -> (Tensor out, Tensor lse2)"
    ),
    "attention_backward": (
        f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse2, {_OPTIONS}, {_MASKING}) "
        "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)"
    ),
    "attention_varlen_forward": (
        f"(Tensor q, Tensor k, Tensor v, {_CU}, {_OPTIONS}, bool validate, {_MASKING}) "
        "-> (Tensor out, Tensor lse2)"
    ),
    # validate last and defaulted True: a direct call checks the cu_seqlens values (a host read),
    # the autograd formula passes False (its forward checked the same tensors)
    "attention_varlen_backward": (
        f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse2, {_CU}, {_OPTIONS}, "
        f"{_MASKING}, bool validate=True) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)"
    ),
}
_PADDED_OP = "det_attn.attention"
_PACKED_OP = "det_attn.attention_varlen"


def seed_word(seed) -> int:
    """A Philox seed in ``[0, 2**64)`` (or None: 0) as the operators' signed 64-bit ``seed``
    (``seed - 2**64`` from ``2**63`` on); a ``torch.SymInt`` (a per-step seed under torch.compile)
    as it is."""
    if seed is None:
        return 0
    if isinstance(seed, torch.SymInt):
        return seed
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _dropout(plan, dropout_p, seed, sequence_offset, head_offset, heads, batch, op) -> tuple | None:
    """The kernels' dropout arguments of one call (None without dropout), checked: the operators
    can be called directly."""
    seed = seed % (1 << 64) if dropout_p > 0.0 else None
    dropout_p, seed, sequence_offset, head_offset = _checks.check_dropout(
        dropout_p, seed, sequence_offset, head_offset, heads, batch, op
    )
    return _plans.dropout_args(dropout_p, seed, sequence_offset, head_offset) if plan.dropout else None


# --------------------------------------------------------------------------- padded batch


def _padded_plan(
    q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, window, softcap
):
    """The plan of a padded call; a signature's first call runs every check of ``attention`` (a
    cached plan is a signature that passed them)."""
    key = _plans.padded_signature(q, k, v, causal, softmax_scale, dropout_p != 0.0, window, softcap)
    plan = _plans.cached(key)
    if plan is None:
        seed = seed % (1 << 64) if dropout_p > 0.0 else None
        scale = _checks.check_padded(
            q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, _PADDED_OP
        )[0]
        win, cap = _checks.check_window_softcap(window, softcap, causal, _PADDED_OP)
        plan = _plans.padded_plan(q, k, v, key, causal, scale, dropout_p != 0.0, win, cap)
    return plan


def _forward(
    q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, window=None, softcap=None
):
    plan = _padded_plan(
        q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, window, softcap
    )
    drop = _dropout(plan, dropout_p, seed, sequence_offset, head_offset, q.shape[2], q.shape[0], _PADDED_OP)
    q, k, v = _plans.kernel_inputs(q, k, v, plan.dense)
    return _plans.launch_forward(plan, q, k, v, None, None, drop)


def _backward(
    grad_out, q, k, v, out, lse2, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset,
    window=None, softcap=None,
):  # fmt: skip
    plan = _padded_plan(
        q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, window, softcap
    )
    drop = _dropout(plan, dropout_p, seed, sequence_offset, head_offset, q.shape[2], q.shape[0], _PADDED_OP)
    q, k, v = _plans.kernel_inputs(q, k, v, plan.dense)
    out, lse2 = _saved_outputs(plan, grad_out, q, out, lse2, _PADDED_OP)
    return _plans.launch_backward(plan, grad_out, q, k, v, out, lse2, None, None, drop)


def _forward_fake(q, k, v, *options):
    batch, t_q, heads = q.shape[:3]
    q, k, v = _plans.kernel_inputs(q, k, v, (batch, t_q, k.shape[1]))
    return torch.empty_like(q), q.new_empty((heads, batch * t_q), dtype=torch.float32)


def _backward_fake(grad_out, q, k, v, out, lse2, *options):
    q, k, v = _plans.kernel_inputs(q, k, v, (q.shape[0], q.shape[1], k.shape[1]))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _saved_outputs(plan, grad_out, q, out, lse2, op):
    """``out`` and ``lse2`` as the backward kernels read them: with the layout the forward gave
    them (a relayout copy where a direct caller of the backward operator passes another)."""
    shape = (*plan.lse_shape[::-1], plan.head_dim)  # (tokens, heads, head dim)
    for name, t, want in (("grad_out", grad_out, shape), ("out", out, shape)):
        if tuple(t.shape) != want or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{op}: {name} must be {want} {q.dtype} on {q.device} (the forward's out), got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            )
    if tuple(lse2.shape) != plan.lse_shape or lse2.dtype != torch.float32 or lse2.device != q.device:
        raise ValueError(
            f"{op}: lse2 must be the forward's {plan.lse_shape} float32 on {q.device}, got "
            f"{tuple(lse2.shape)} {str(lse2.dtype).removeprefix('torch.')} on {lse2.device}"
        )
    if out.stride()[:2] != plan.fwd_strides[4:6] or out.stride(2) != 1:
        out = torch.empty_like(q).copy_(out)
    if not lse2.is_contiguous():
        lse2 = lse2.contiguous()
    return out, lse2


# --------------------------------------------------------------------------- packed (varlen)


def _packed_plan(
    q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, dropout_p, seed, seq_off, head_off, window,
    softcap,
):  # fmt: skip
    """The plan of a packed call; a signature's first call runs the checks of ``attention_varlen``
    that read no ``cu_seqlens`` values (those run where ``validate`` is set, or in the caller)."""
    key = _plans.packed_signature(
        q, k, v, cu_q.shape[0], max_q, max_k, causal, softmax_scale, dropout_p != 0.0, window, softcap
    )
    plan = _plans.cached(key)
    if plan is None:
        seed = seed % (1 << 64) if dropout_p > 0.0 else None
        _checks.check_packed_qkv(q, k, v, _PACKED_OP)
        batch, max_q, max_k, scale = _checks.check_packed_traced(
            q,
            k,
            cu_q,
            cu_k,
            max_q,
            max_k,
            causal,
            softmax_scale,
            dropout_p,
            seed,
            seq_off,
            head_off,
            _PACKED_OP,
        )[:4]
        win, cap = _checks.check_window_softcap(window, softcap, causal, _PACKED_OP)
        plan = _plans.packed_plan(
            q, k, v, key, batch, max_q, max_k, causal, scale, dropout_p != 0.0, win, cap
        )
    return plan


def _varlen_forward(
    q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset,
    validate, window=None, softcap=None,
):  # fmt: skip
    plan = _packed_plan(
        q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, dropout_p, seed, sequence_offset,
        head_offset, window, softcap,
    )  # fmt: skip
    if validate:  # under torch.compile: the checks that read cu_seqlens run here, at run time
        _checks.check_packed_values(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, causal, _PACKED_OP)
    drop = _dropout(
        plan, dropout_p, seed, sequence_offset, head_offset, q.shape[1], cu_q.shape[0] - 1, _PACKED_OP
    )
    q, k, v = _plans.kernel_inputs(q, k, v, None)
    # the kernels read cu_seqlens with unit stride
    return _plans.launch_forward(plan, q, k, v, cu_q.contiguous(), cu_k.contiguous(), drop)


def _varlen_backward(
    grad_out, q, k, v, out, lse2, cu_q, cu_k, max_q, max_k, causal, softmax_scale, dropout_p, seed,
    sequence_offset, head_offset, window=None, softcap=None, validate=True,
):  # fmt: skip
    plan = _packed_plan(
        q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, dropout_p, seed, sequence_offset,
        head_offset, window, softcap,
    )  # fmt: skip
    if validate:  # a direct call: the kernels would index q, k, v and the gradients by these values
        _checks.check_packed_values(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, causal, _PACKED_OP)
    drop = _dropout(
        plan, dropout_p, seed, sequence_offset, head_offset, q.shape[1], cu_q.shape[0] - 1, _PACKED_OP
    )
    q, k, v = _plans.kernel_inputs(q, k, v, None)
    out, lse2 = _saved_outputs(plan, grad_out, q, out, lse2, _PACKED_OP)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
    return _plans.launch_backward(plan, grad_out, q, k, v, out, lse2, cu_q, cu_k, drop)


def _varlen_forward_fake(q, k, v, cu_q, cu_k, *options):
    q, k, v = _plans.kernel_inputs(q, k, v, None)
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_backward_fake(grad_out, q, k, v, out, lse2, *options):
    q, k, v = _plans.kernel_inputs(q, k, v, None)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# --------------------------------------------------------------------------- autograd


_VALIDATE = 8  # index of ``validate`` in the varlen forward's options (after max_seqlen_q / _k)


class _AttentionFunction(torch.autograd.Function):
    """The autograd formula of both forward operators: the forward operator below autograd, then the
    backward operator. ``cu_q``, ``cu_k``: None for a padded batch; ``options``: the forward
    operator's arguments after the tensors (the varlen ``validate`` after ``head_offset``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, options):
        # plain eager: the operator's CPU / CUDA kernel called directly (no dispatcher round trip)
        direct = runtime.plain_eager((q, k, v, cu_q, cu_k))
        with torch._C._AutoDispatchBelowAutograd():
            if cu_q is None:
                out, lse2 = (_forward if direct else attention_forward)(q, k, v, *options)
            else:
                out, lse2 = (_varlen_forward if direct else attention_varlen_forward)(
                    q, k, v, cu_q, cu_k, *options
                )
                options = (*options[:_VALIDATE], *options[_VALIDATE + 1 :])  # validated once, in the forward
        ctx.save_for_backward(q, k, v, out, lse2, cu_q, cu_k)
        ctx.options = options
        ctx.mark_non_differentiable(lse2)
        # lse2 never gets a gradient: do not let autograd allocate and zero-fill one per backward
        ctx.set_materialize_grads(False)
        return out, lse2

    @staticmethod
    def backward(ctx, grad_out, _grad_lse2):
        runtime.check_first_order("det_attn.attention")
        q, k, v, out, lse2, cu_q, cu_k = ctx.saved_tensors
        direct = runtime.plain_eager((grad_out, q, k, v, out, lse2, cu_q, cu_k))  # as in forward
        with torch._C._AutoDispatchBelowAutograd():
            if cu_q is None:
                backward = _backward if direct else attention_backward
                dq, dk, dv = backward(grad_out, q, k, v, out, lse2, *ctx.options)
                # (B * T, H, D) gradients viewed as (B, T, H, D): splitting the token dim is always
                # a view (the layout the reshape's backward gives)
                dq, dk, dv = dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
            else:
                backward = _varlen_backward if direct else attention_varlen_backward
                # validated once, in the forward (the same saved cu_seqlens)
                dq, dk, dv = backward(grad_out, q, k, v, out, lse2, cu_q, cu_k, *ctx.options, validate=False)
        return dq, dk, dv, None, None, None


# ``_AttentionFunction.apply`` below its Python wrapper (which, outside functorch transforms, only
# unwraps dead functorch wrappers; under a transform the wrapper's path): less host time per call.
_C_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _AttentionFunction)


def _apply(*args):
    return _C_APPLY(*args) if runtime.plain_eager(args[:3]) else _AttentionFunction.apply(*args)


# Eager only (under torch.compile the public functions call the operators): never traced. Where
# Dynamo runs a caller eagerly (a frame it gave up on) it would otherwise trace down into the
# launches; ``disable`` costs about a microsecond per call.
@torch.compiler.disable
def padded_autograd(q, k, v, *options):
    """The ``Autograd`` kernel of ``attention_forward`` (eager ``attention`` calls it directly: one
    dispatcher round trip less; torch.compile sees the operator)."""
    runtime.check_no_functorch_autodiff(_PADDED_OP, (q, k, v))  # a jvp would otherwise lose its tangents
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _apply(q, k, v, None, None, options)
    if runtime.plain_eager((q, k, v)):  # the operator's kernel, as in _AttentionFunction.forward
        return _forward(q, k, v, *options)
    with torch._C._AutoDispatchBelowAutograd():
        return attention_forward(q, k, v, *options)


@torch.compiler.disable  # as padded_autograd
def packed_autograd(q, k, v, cu_q, cu_k, *options):
    """The ``Autograd`` kernel of ``attention_varlen_forward`` (see ``padded_autograd``)."""
    runtime.check_no_functorch_autodiff(_PACKED_OP, (q, k, v))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _apply(q, k, v, cu_q, cu_k, options)
    if runtime.plain_eager((q, k, v, cu_q, cu_k)):
        return _varlen_forward(q, k, v, cu_q, cu_k, *options)
    with torch._C._AutoDispatchBelowAutograd():
        return attention_varlen_forward(q, k, v, cu_q, cu_k, *options)


def _first_order(backward):
    """The ``Autograd`` kernel of a backward operator: it has no derivative of its own."""

    def kernel(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            runtime.check_first_order("det_attn.attention")
        with torch._C._AutoDispatchBelowAutograd():
            return backward(*args)

    return kernel


def _op(name: str, impl, fake):
    _LIB.define(name + SCHEMAS[name])
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, impl, key)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


attention_forward = _op("attention_forward", _forward, _forward_fake)
attention_backward = _op("attention_backward", _backward, _backward_fake)
attention_varlen_forward = _op("attention_varlen_forward", _varlen_forward, _varlen_forward_fake)
attention_varlen_backward = _op("attention_varlen_backward", _varlen_backward, _varlen_backward_fake)
_LIB.impl("attention_forward", padded_autograd, "Autograd")
_LIB.impl("attention_varlen_forward", packed_autograd, "Autograd")
_LIB.impl("attention_backward", _first_order(attention_backward), "Autograd")
_LIB.impl("attention_varlen_backward", _first_order(attention_varlen_backward), "Autograd")
