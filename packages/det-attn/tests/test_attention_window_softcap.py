"""det_attn's sliding window (``window``) and logit soft-capping (``softcap``) on CPU through the
Triton interpreter, at tiny sizes: forward and backward against the fp64 reference (tails that cut
tiles, GQA, cross lengths, a window below a tile and one beyond the sequence, varlen with several
sequences); a window covering the whole sequence gives the causal path's bits; run to run bitwise;
a sequence's outputs and gradients are the same bits alone, in a batch and packed; the errors.

The interpreter's blocks (fwd 32x16, dK/dV 16x32, dQ 32x16) make windows of a few tokens skip whole
key and query blocks, and sequences of a few dozen tokens cross many tile boundaries. Real sizes
are in test_attention_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from det_attn import attention, attention_varlen
from det_attn.reference import attention_reference, attention_varlen_reference
from det_attn.transformers_integration import det_attn_transformers_forward
from det_core.testing import assert_bitwise_equal, assert_run_to_run

D = 64
NAMES = ("o", "lse", "dq", "dk", "dv")


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


def _qkv(batch, t_q, t_k, h_q, h_kv, seed=0, scale=1.0):
    # scale > 1: scores of several units, so a soft-cap of a few units bends them
    return (
        (_randn(batch, t_q, h_q, D, seed=seed).float() * scale).bfloat16(),
        _randn(batch, t_k, h_kv, D, seed=seed + 1),
        _randn(batch, t_k, h_kv, D, seed=seed + 2),
    )


def _fwd_bwd(fn, q, k, v, do, *args, **kwargs):
    """(o, lse, dq, dk, dv) of ``fn`` with ``return_lse``, gradients of ``(o * do).sum()``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v, *args, return_lse=True, **kwargs)
    o.backward(do)
    return o.detach(), lse, q.grad, k.grad, v.grad


def _assert_close_to_reference(got, ref, where):
    for name, a, r in zip(NAMES, got, ref, strict=True):
        if name == "lse":
            assert (a.double() - r).abs().max().item() < 1e-5, f"lse: {where}"
            continue
        scale = r.abs().max().item()
        assert scale > 0, f"{name}: {where}: the reference is zero (a case that tests nothing)"
        assert (a.double() - r).abs().max().item() <= 2**-6 * scale, f"{name}: {where}"


def _reference(q, k, v, do, fn=attention_reference, *args, **kwargs):
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    o, lse = fn(qr, kr, vr, *args, **kwargs)
    o.backward(do.double())
    return o.detach(), lse, qr.grad, kr.grad, vr.grad


# (t_q, t_k, (H_q, H_kv), causal, window, softcap): tails that cut tiles, GQA, T_q < T_k
# (bottom-right), a window under one block, one across blocks, one beyond T, soft-cap alone
CASES = [
    (45, 45, (4, 2), True, 5, None),
    (45, 45, (2, 1), True, 20, 3.0),
    (21, 50, (2, 1), True, 7, 2.0),
    (37, 37, (2, 2), True, 100, None),
    (45, 45, (2, 1), False, None, 2.0),
]


@pytest.mark.parametrize(("t_q", "t_k", "heads", "causal", "window", "softcap"), CASES)
def test_window_and_softcap_match_reference(t_q, t_k, heads, causal, window, softcap):
    q, k, v = _qkv(2, t_q, t_k, *heads, scale=3.0)
    do = _randn(2, t_q, heads[0], D, seed=9)
    kw = dict(causal=causal, window=window, softcap=softcap, softmax_scale=0.2)
    got = _fwd_bwd(attention, q, k, v, do, **kw)
    _assert_close_to_reference(got, _reference(q, k, v, do, **kw), str(kw))


def test_varlen_window_and_softcap_match_reference():
    # four sequences: shorter than the window, across blocks, T_q < T_k, one query
    lens_q, lens_k = [3, 40, 20, 1], [3, 40, 33, 9]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = (_randn(sum(lens_q), 2, D, seed=20).float() * 3).bfloat16()
    k, v = _randn(sum(lens_k), 1, D, seed=21), _randn(sum(lens_k), 1, D, seed=22)
    do = _randn(sum(lens_q), 2, D, seed=23)
    kw = dict(causal=True, window=6, softcap=2.5)
    got = _fwd_bwd(attention_varlen, q, k, v, do, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    ref = _reference(q, k, v, do, attention_varlen_reference, cu_q, cu_k, **kw)
    _assert_close_to_reference(got, ref, "varlen")


def test_window_covering_the_sequence_gives_the_causal_bits():
    # every masked step of the window path does the causal path's arithmetic on a visible score
    q, k, v = _qkv(1, 45, 45, 2, 1, seed=30)
    do = _randn(1, 45, 2, D, seed=31)
    want = _fwd_bwd(attention, q, k, v, do, causal=True)
    for window in (45, 1000):
        got = _fwd_bwd(attention, q, k, v, do, causal=True, window=window)
        for name, a, b in zip(NAMES, got, want, strict=True):
            assert_bitwise_equal(a, b, f"{name}: window {window}")


def test_run_to_run_bitwise():
    q, k, v = _qkv(1, 40, 40, 2, 1, seed=40, scale=3.0)
    do = _randn(1, 40, 2, D, seed=41)
    assert_run_to_run(
        lambda: _fwd_bwd(attention, q, k, v, do, causal=True, window=9, softcap=2.0, dropout_p=0.2, seed=5),
        repeats=2,
        name="window 9, softcap 2, dropout",
    )


def test_sequence_alone_equals_sequence_in_batch_and_packed():
    kw = dict(causal=True, window=7, softcap=2.0)
    t = 37
    anchor = (*_qkv(1, t, t, 2, 1, seed=100, scale=3.0), _randn(1, t, 2, D, seed=101))
    alone = _fwd_bwd(attention, *anchor, **kw)
    # in a batch of 3, at position 1
    q, k, v = _qkv(3, t, t, 2, 1, seed=102, scale=3.0)
    do = _randn(3, t, 2, D, seed=103)
    for full, one in zip((q, k, v, do), anchor, strict=True):
        full[1] = one[0]
    got = _fwd_bwd(attention, q, k, v, do, **kw)
    for name, g, a in zip(NAMES, got, alone, strict=True):
        assert_bitwise_equal(g[1:2], a, f"{name}: batch of 3")
    # packed after a neighbour of 17 tokens (its tiles cross the anchor's first block) and before one
    seqs = [(17, 20), (t, t), (5, 5)]
    parts = [_qkv(1, a, b, 2, 1, seed=110 + i, scale=3.0) for i, (a, b) in enumerate(seqs)]
    parts[1] = anchor[:3]
    dos = [_randn(1, a, 2, D, seed=120 + i) for i, (a, _) in enumerate(seqs)]
    dos[1] = anchor[3]
    cu_q = torch.tensor([0, 17, 17 + t, 22 + t], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 20 + t, 25 + t], dtype=torch.int32)
    q, k, v = (torch.cat([p[i][0] for p in parts]) for i in range(3))
    do = torch.cat([d[0] for d in dos])
    o, lse, dq, dk, dv = _fwd_bwd(attention_varlen, q, k, v, do, cu_q, cu_k, t, t, **kw)
    sq, sk = slice(17, 17 + t), slice(20, 20 + t)
    for name, g, a in zip(NAMES, (o[sq], lse[:, sq], dq[sq], dk[sk], dv[sk]), alone, strict=True):
        assert_bitwise_equal(g, a[0], f"{name}: packed")


def test_transformers_forward_passes_window_softcap_and_scaling():
    q, k, v = _qkv(1, 20, 20, 2, 1, seed=50, scale=3.0)
    module = torch.nn.Module()
    module.is_causal = True
    got, _ = det_attn_transformers_forward(
        module, *(t.transpose(1, 2) for t in (q, k, v)), None, scaling=0.0625, sliding_window=4, softcap=5.0
    )
    want = attention(q, k, v, causal=True, softmax_scale=0.0625, window=4, softcap=5.0)
    assert_bitwise_equal(got, want, "transformers forward")
    module.is_causal = False
    with pytest.raises(ValueError, match="a sliding window on a non-causal layer"):
        det_attn_transformers_forward(module, *(t.transpose(1, 2) for t in (q, k, v)), None, sliding_window=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(causal=False, window=4), ValueError, "window needs causal=True"),
        (dict(causal=True, window=0), ValueError, "window must be >= 1"),
        (dict(causal=True, window=4.0), TypeError, "window must be an integer"),
        (dict(causal=True, window=True), TypeError, "window must be an integer, got the bool"),
        (dict(softcap=0.0), ValueError, "softcap must be a finite positive number"),
        (dict(softcap=float("nan")), ValueError, "softcap must be a finite positive number"),
        (dict(softcap=3e38), ValueError, r"softcap must lie in \[2\*\*-126, 2\*\*127\]"),
        (dict(softcap=1e-39), ValueError, r"softcap must lie in \[2\*\*-126, 2\*\*127\]"),
        (dict(softcap=True), TypeError, "softcap must be a real number or None"),
        (dict(softcap="50"), TypeError, "softcap must be a real number or None"),
    ],
)
def test_bad_window_and_softcap_raise_clear_errors(kwargs, error, match):
    q, k, v = _qkv(1, 8, 8, 1, 1)
    with pytest.raises(error, match=match):
        attention(q, k, v, **kwargs)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(error, match=match):
        attention_varlen(q[0], k[0], v[0], cu, cu, 8, 8, **kwargs)
