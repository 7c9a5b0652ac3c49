"""The host path of ``det_attn.attention`` / ``attention_varlen`` on CPU (Triton interpreter).

Per call signature the launcher keeps a plan in one cache (``_plans.PLANS``: grids, sizes,
strides, constexprs, ``BoundLaunch`` objects and the signature-only checks' outcome).
Under the interpreter a bound launch is ``kernel[grid]``
with the same arguments, so these tests check the plumbing: plans and checks reused, the bound
launches holding exactly the arguments ``launch`` gets, dropout still through
``launch`` with its per-call seed, the dropout arguments a launch without dropout fixes
ignored by the kernels, other argument kinds checked on every call, and the gradients of
reshaped inputs (errors with warm caches: ``test_attention.py``). Bits of the bound path on the
GPU: ``tests/test_attention_gpu.py``.
"""

from __future__ import annotations

import fractions

import pytest
import torch
from det_attn import _bwd_kernels, _checks, _fwd_kernel, _plans, attention
from det_core.testing import assert_bitwise_equal

D = 64
NAMES = ("o", "lse", "dq", "dk", "dv")


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


def _fwd_bwd(q, k, v, do, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = attention(q, k, v, return_lse=True, **kwargs)
    o.backward(do)
    return o.detach(), lse, q.grad, k.grad, v.grad


@pytest.fixture
def fresh_caches(monkeypatch):
    monkeypatch.setattr(_plans, "PLANS", _plans.PlanCache())


@pytest.fixture
def counts(monkeypatch):
    """Calls of ``_checks.check_qkv`` and of ``launch`` (the unbound launches) by det_attn."""
    seen = {"checks": 0, "launches": 0}
    check, launch = _checks.check_qkv, _plans.launch

    def counted_check(*args, **kwargs):
        seen["checks"] += 1
        return check(*args, **kwargs)

    def counted_launch(*args, **kwargs):
        seen["launches"] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(_checks, "check_qkv", counted_check)
    monkeypatch.setattr(_plans, "launch", counted_launch)
    return seen


def test_second_call_reuses_plan_and_checks_and_binds_every_launch(fresh_caches, counts):
    # GQA, T_q != T_k, keys across a tile edge: the plumbing is the same at any size
    q, k, v = _randn(2, 19, 2, D, seed=1), _randn(2, 23, 1, D, seed=2), _randn(2, 23, 1, D, seed=3)
    do = _randn(2, 19, 2, D, seed=4)
    first = _fwd_bwd(q, k, v, do, causal=True)
    assert counts == {"checks": 1, "launches": 0}  # no dropout: forward and backward all bound
    (plan,) = _plans.PLANS.values()
    second = _fwd_bwd(q, k, v, do, causal=True)
    with torch.no_grad():
        third = attention(q, k, v, causal=True, return_lse=True)
    assert counts == {"checks": 1, "launches": 0}  # the signature's checks passed once
    assert list(_plans.PLANS.values()) == [plan]
    for name, a, b in zip(NAMES, second, first, strict=True):
        assert_bitwise_equal(a, b, name)
    assert_bitwise_equal(third[0], first[0], "o: no_grad")
    # another signature (causal off) is checked and planned anew
    attention(q, k, v)
    assert counts["checks"] == 2 and len(_plans.PLANS) == 2


def test_bound_launches_hold_the_arguments_launch_gets(fresh_caches):
    q, k, v = _randn(1, 45, 2, D), _randn(1, 45, 1, D), _randn(1, 45, 1, D)
    attention(q, k, v, causal=True)
    (plan,) = _plans.PLANS.values()
    no_dropout = (0, 0, 0, 0, 0, 1.0)
    launches = (
        (plan.fwd.bound, _fwd_kernel.attn_fwd_kernel, 7, plan.fwd.sizes, plan.fwd_strides, plan.fwd.meta),
        (
            plan.fwd_pointers.bound, _fwd_kernel.attn_fwd_kernel, 7, plan.fwd_pointers.sizes,
            plan.fwd_strides, plan.fwd_pointers.meta,
        ),
        (
            plan.dkdv_launch, _bwd_kernels.attn_bwd_dkdv_kernel, 10, plan.dkdv_sizes, plan.dkdv_strides,
            plan.dkdv_meta,
        ),
        (plan.dq_launch, _bwd_kernels.attn_bwd_dq_kernel, 9, plan.dq_sizes, plan.dq_strides, plan.dq_meta),
    )  # fmt: skip
    for bound, kernel, n_leading, sizes, strides, meta in launches:
        assert bound.kernel is kernel and bound.n_leading == n_leading
        assert bound.trailing == (*sizes, *no_dropout, *strides)
        assert bound.kwargs == meta
    pre = plan.pre_launch
    assert pre.kernel is _bwd_kernels.attn_bwd_preprocess_kernel and pre.n_leading == 3
    assert pre.trailing == plan.pre_args and pre.kwargs == plan.pre_meta
    assert _plans.dropout_args(0.0, None, 5, 7) == no_dropout


def test_dropout_goes_through_launch_with_its_seed(fresh_caches, counts):
    # dropout's Philox tiles are slow in the interpreter: 17 tokens (one past a 16-key tile) are enough
    q, k, v = _randn(2, 17, 2, D, seed=5), _randn(2, 17, 2, D, seed=6), _randn(2, 17, 2, D, seed=7)
    do = _randn(2, 17, 2, D, seed=8)
    a = _fwd_bwd(q, k, v, do, causal=True, dropout_p=0.3, seed=11)
    assert counts["launches"] == 3  # forward, dK/dV, dQ (the preprocess kernel is bound)
    b = _fwd_bwd(q, k, v, do, causal=True, dropout_p=0.3, seed=11)
    c = _fwd_bwd(q, k, v, do, causal=True, dropout_p=0.3, seed=12)
    (plan,) = _plans.PLANS.values()  # one plan for every seed
    assert plan.fwd.bound is None and plan.dkdv_launch is None and plan.dq_launch is None
    assert counts == {"checks": 1, "launches": 9}
    for name, x, y, z in zip(NAMES, a, b, c, strict=True):
        assert_bitwise_equal(x, y, f"{name}: same seed")
        if name != "lse":  # the LSE is taken before dropout
            assert not torch.equal(x, z), f"{name}: another seed gave the same bits"


def test_kernels_ignore_dropout_arguments_without_dropout(fresh_caches):
    # a launch without dropout binds fixed dropout arguments (offsets included): the kernels
    # must not read them unless DROPOUT is set. Pass others through launch: same bits.
    for dense in (True, False):
        q, k, v = _randn(2, 29, 4, D, seed=20), _randn(2, 35, 2, D, seed=21), _randn(2, 35, 2, D, seed=22)
        do = _randn(58, 4, D, seed=23)
        if dense:
            cu_q = cu_k = None
            plan = _plans.padded_plan(q, k, v, None, True, 0.125, False)
        else:
            cu_q = torch.tensor([0, 12, 58], dtype=torch.int32)
            cu_k = torch.tensor([0, 20, 70], dtype=torch.int32)  # causal: keys >= queries
            q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
            plan = _plans.packed_plan(q, k, v, None, 2, 46, 50, True, 0.125, False)
        assert not plan.dropout and plan.dense == ((2, 29, 35) if dense else None)
        q, k, v = _plans.kernel_inputs(q, k, v, plan.dense)
        want = _plans.launch_forward(plan, q, k, v, cu_q, cu_k, None)
        want += _plans.launch_backward(plan, do, q, k, v, *want, cu_q, cu_k, None)
        other = (123, 456, 7, 3, 2**31, 0.5)  # seed words, offsets, threshold, scale
        got = _plans.launch_forward(plan, q, k, v, cu_q, cu_k, other)
        got += _plans.launch_backward(plan, do, q, k, v, *got, cu_q, cu_k, other)
        for name, a, b in zip(("o", "lse2", "dq", "dk", "dv"), got, want, strict=True):
            assert_bitwise_equal(a, b, f"{name}: dense={dense}")


def test_other_argument_kinds_are_checked_every_call(fresh_caches, counts):
    q, k, v = _randn(1, 8, 2, D), _randn(1, 8, 2, D), _randn(1, 8, 2, D)
    want = attention(q, k, v, causal=True, softmax_scale=0.5)
    # a real number of another type than float / int (numpy's, a Fraction) is never cached
    for kwargs in ({"causal": True, "softmax_scale": fractions.Fraction(1, 2)},) * 2:
        before = counts["checks"]
        assert_bitwise_equal(attention(q, k, v, **kwargs), want, str(kwargs))
        assert counts["checks"] == before + 1
    before = counts["checks"]
    assert_bitwise_equal(attention(torch.nn.Parameter(q), k, v, causal=True, softmax_scale=0.5), want)
    assert counts["checks"] == before + 1 and len(_plans.PLANS) == 1


@pytest.mark.parametrize("layout", ["contiguous", "packed qkv", "transposed", "transposed B1"])
def test_input_layouts_give_the_same_bits_and_gradient_shapes(layout):
    # the padded batch's (B, T, H, D) -> (B * T, H, D) reshape happens inside the operators (a
    # view, or a copy where none exists: in the forward and again in the backward) and the
    # gradients are viewed back
    batch = 1 if layout == "transposed B1" else 2
    q, k, v = (_randn(batch, 27, 4, D, seed=30 + i) for i in range(3))
    do = _randn(batch, 27, 4, D, seed=33)
    want = _fwd_bwd(q, k, v, do, causal=True)
    if layout == "packed qkv":  # as a transformer block's fused projection: one (B, T, 3, H, D) buffer
        qkv = torch.stack([q, k, v], 2).requires_grad_()
        leaves, inputs = (qkv,), qkv.unbind(2)
    elif layout.startswith("transposed"):  # (B, H, T, D) storage seen as (B, T, H, D)
        leaves = tuple(t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        inputs = tuple(t.transpose(1, 2) for t in leaves)
    else:
        leaves = inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    o, lse = attention(*inputs, causal=True, return_lse=True)
    o.backward(do)
    if layout == "packed qkv":
        grads = qkv.grad.unbind(2)
    elif layout.startswith("transposed"):
        grads = tuple(t.grad.transpose(1, 2) for t in leaves)
    else:
        grads = tuple(t.grad for t in leaves)
    for name, a, b in zip(NAMES, (o.detach(), lse, *grads), want, strict=True):
        assert_bitwise_equal(a, b, f"{name}: {layout}")
    o.mul_(2.0)  # the output stays a plain view of the function's output: in place is allowed
