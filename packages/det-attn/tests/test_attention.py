"""det_attn on CPU through the Triton interpreter, at tiny sizes.

The interpreter uses small unequal blocks (fwd 32x16, dK/dV 16x32, dQ 32x16), so sequences of
a few dozen tokens cross many tile and causal-diagonal boundaries. Real sizes are in
test_attention_gpu.py.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from det_attn import _plans, attention, attention_varlen, scaled_dot_product_attention
from det_attn.reference import attention_reference, attention_varlen_reference, dropout_keep_mask
from det_core.testing import (
    assert_bitwise_equal,
    assert_decomposition_invariant,
    assert_run_to_run,
    contiguous_splits,
    run_in_fresh_process,
)

D = 64


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def _qkv(batch, t_q, t_k, h_q, h_kv, dtype=torch.bfloat16, seed=0):
    return (
        _randn(batch, t_q, h_q, D, dtype=dtype, seed=seed),
        _randn(batch, t_k, h_kv, D, dtype=dtype, seed=seed + 1),
        _randn(batch, t_k, h_kv, D, dtype=dtype, seed=seed + 2),
    )


def _fwd_bwd(fn, q, k, v, do, *args, **kwargs):
    """(o, lse, dq, dk, dv) of ``fn`` with ``return_lse``, gradients of ``(o * do).sum()``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v, *args, return_lse=True, **kwargs)
    o.backward(do)
    return o.detach(), lse, q.grad, k.grad, v.grad


NAMES = ("o", "lse", "dq", "dk", "dv")


# --------------------------------------------------------------------------- accuracy


def _sdpa_math(q, k, v, do, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
        )
    o.backward(do.transpose(1, 2))
    return [t.transpose(1, 2) for t in (o.detach(), q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)])
def test_error_vs_fp64_at_most_twice_sdpa(dtype, causal, heads):
    h_q, h_kv = heads
    q, k, v = _qkv(2, 45, 45, h_q, h_kv, dtype=dtype)
    do = _randn(2, 45, h_q, D, dtype=dtype, seed=9)
    ours = _fwd_bwd(attention, q, k, v, do, causal=causal)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = attention_reference(qr, kr, vr, causal=causal)
    ref_o.backward(do.double())
    ref = (ref_o.detach(), qr.grad, kr.grad, vr.grad)
    sdpa = _sdpa_math(q, k, v, do, causal)
    for name, a, s, r in zip(("o", "dq", "dk", "dv"), (ours[0], *ours[2:]), sdpa, ref, strict=True):
        err = (a.double() - r).abs().max().item()
        sdpa_err = (s.double() - r).abs().max().item()
        assert err <= 2 * sdpa_err, f"{name}: error {err:.3g} > 2 x SDPA math error {sdpa_err:.3g}"
    # LSE is fp32 in both: within a few fp32 ulps of the scores' magnitude
    assert (ours[1].double() - ref_lse).abs().max().item() < 1e-5


def test_cross_attention_and_custom_scale_match_reference():
    # T_q != T_k (bottom-right causal) and a softmax scale other than 1/sqrt(D)
    q, k, v = _qkv(2, 21, 50, 2, 1)
    do = _randn(2, 21, 2, D, seed=5)
    for causal in (False, True):
        o, lse, dq, dk, dv = _fwd_bwd(attention, q, k, v, do, causal=causal, softmax_scale=0.3)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ro, rlse = attention_reference(qr, kr, vr, causal=causal, softmax_scale=0.3)
        ro.backward(do.double())
        for name, a, r in (("o", o, ro), ("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
            scale = r.abs().max().item()
            assert (a.double() - r).abs().max().item() <= 2**-6 * scale, name
        assert (lse.double() - rlse).abs().max().item() < 1e-5


# --------------------------------------------------------------------------- run to run


def test_run_to_run_bitwise():
    q, k, v = _qkv(1, 40, 40, 4, 2)
    do = _randn(1, 40, 4, D, seed=7)
    for kwargs in ({"causal": True}, {"causal": False, "dropout_p": 0.2, "seed": 11}):
        assert_run_to_run(
            lambda kw=kwargs: _fwd_bwd(attention, q, k, v, do, **kw), repeats=3, name=str(kwargs)
        )


def test_fresh_process_same_digest():
    code = """
import torch
from det_core.testing import digest
from det_attn import attention
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 33, 2, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
o, lse = attention(q, k, v, causal=True, return_lse=True)
o.backward(torch.ones_like(o))
print(digest([o, lse, q.grad, k.grad, v.grad]))
"""
    from det_core.testing import digest

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 33, 2, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
    o, lse = attention(q, k, v, causal=True, return_lse=True)
    o.backward(torch.ones_like(o))
    here = digest([o, lse, q.grad, k.grad, v.grad])
    assert run_in_fresh_process(code, env={"TRITON_INTERPRET": "1"}) == here


# --------------------------------------------------------------------------- batch and packing invariance


def _check_anchor_in_batches(batch_sizes, causal, **kw):
    # the anchor sits at positions 0, B // 2 and B - 1 of one batch (random neighbours elsewhere);
    # each copy must equal the anchor alone, keyed (for dropout) as the same sequence index
    t, h = 37, 1
    anchor = (*_qkv(1, t, t, h, h, seed=100), _randn(1, t, h, D, seed=200))
    alone = {}
    for batch in batch_sizes:
        positions = sorted({0, batch // 2, batch - 1})
        q, k, v = _qkv(batch, t, t, h, h, seed=batch)
        do = _randn(batch, t, h, D, seed=50 + batch)
        for pos in positions:
            for full, one in zip((q, k, v, do), anchor, strict=True):
                full[pos] = one[0]
        got = _fwd_bwd(attention, q, k, v, do, causal=causal, **kw)
        for pos in positions:
            offset = pos if kw.get("dropout_p") else 0
            if offset not in alone:
                alone[offset] = _fwd_bwd(attention, *anchor, causal=causal, sequence_offset=offset, **kw)
            for name, g, a in zip(NAMES, got, alone[offset], strict=True):
                assert_bitwise_equal(g[pos : pos + 1], a, f"{name}: B={batch}, pos={pos}")


@pytest.mark.parametrize("causal", [False, True])
def test_sequence_alone_equals_sequence_in_batch(causal):
    _check_anchor_in_batches(range(1, 9), causal)


def test_sequence_alone_equals_sequence_in_batch_with_dropout():
    _check_anchor_in_batches((3, 8), True, dropout_p=0.25, seed=3)


def _pack(seqs):
    """Pack [(q, k, v, do) each (1, T, H, D)] into varlen tensors and int32 cu_seqlens."""
    qs, ks, vs, dos = zip(*[(q[0], k[0], v[0], do[0]) for q, k, v, do in seqs], strict=True)
    cu_q = torch.tensor(
        [0] + [int(x) for x in torch.tensor([t.shape[0] for t in qs]).cumsum(0)], dtype=torch.int32
    )
    cu_k = torch.tensor(
        [0] + [int(x) for x in torch.tensor([t.shape[0] for t in ks]).cumsum(0)], dtype=torch.int32
    )
    max_q = max(t.shape[0] for t in qs)
    max_k = max(t.shape[0] for t in ks)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(dos), cu_q, cu_k, max_q, max_k


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequence_equals_sequence_alone(causal):
    # neighbours before the anchor grow across tile boundaries (15, 16, 17, 31, 32, 33 tokens)
    h_q, h_kv, t_q, t_k = 2, 1, 29, 35
    anchor = (*_qkv(1, t_q, t_k, h_q, h_kv, seed=300), _randn(1, t_q, h_q, D, seed=301))
    kw = {"causal": causal, "dropout_p": 0.2, "seed": 17}
    alone = _fwd_bwd(attention, *anchor[:3], anchor[3], sequence_offset=1, **kw)
    for before, after in ((15, 0), (16, 5), (17, 0), (31, 5), (32, 0), (33, 5)):
        seqs = [
            (*_qkv(1, before, before + 3, h_q, h_kv, seed=before), _randn(1, before, h_q, D, seed=7)),
            anchor,
        ]
        if after:
            seqs.append(
                (*_qkv(1, after, after, h_q, h_kv, seed=after + 1000), _randn(1, after, h_q, D, seed=8))
            )
        q, k, v, do, cu_q, cu_k, max_q, max_k = _pack(seqs)
        o, lse, dq, dk, dv = _fwd_bwd(attention_varlen, q, k, v, do, cu_q, cu_k, max_q, max_k, **kw)
        sq, sk = slice(int(cu_q[1]), int(cu_q[2])), slice(int(cu_k[1]), int(cu_k[2]))
        where = f"neighbours {before}, {after}"
        assert_bitwise_equal(o[sq], alone[0][0], f"o: {where}")
        assert_bitwise_equal(lse[:, sq], alone[1][0], f"lse: {where}")
        assert_bitwise_equal(dq[sq], alone[2][0], f"dq: {where}")
        assert_bitwise_equal(dk[sk], alone[3][0], f"dk: {where}")
        assert_bitwise_equal(dv[sk], alone[4][0], f"dv: {where}")


def test_value_strides_other_than_key_strides_give_same_bits():
    # the kernels read v with k's strides, so the launcher copies k and v when their strides differ
    # (here v is a column slice of a wider buffer, k contiguous); the result must be unchanged
    h, t = 2, 29
    q, k, v = (x[0] for x in _qkv(1, t, t, h, h, seed=900))
    do = _randn(t, h, D, seed=901)
    cu = torch.tensor([0, 11, t], dtype=torch.int32)
    got = []
    for sliced in (False, True):
        wide = torch.zeros(t, h, 2 * D, dtype=v.dtype)
        wide[..., :D] = v
        wide.requires_grad_()
        value = wide[..., :D] if sliced else wide[..., :D].contiguous()  # no clone: keeps the slice
        assert (value.stride() != k.stride()) == sliced
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        o, lse = attention_varlen(qg, kg, value, cu, cu, 18, 18, causal=True, return_lse=True)
        o.backward(do)
        got.append((o.detach(), lse, qg.grad, kg.grad, wide.grad[..., :D]))
    for name, a, b in zip(NAMES, got[1], got[0], strict=True):
        assert_bitwise_equal(a, b, name)


def test_varlen_matches_reference_with_empty_sequence():
    # an empty sequence (0 queries, 0 keys) in the middle is allowed and changes nothing
    h_q, h_kv = 2, 2
    seqs = [(*_qkv(1, n, n, h_q, h_kv, seed=n), _randn(1, n, h_q, D, seed=n + 1)) for n in (20, 33)]
    empty = (torch.empty(1, 0, h_q, D, dtype=torch.bfloat16),) * 4
    q, k, v, do, cu_q, cu_k, max_q, max_k = _pack([seqs[0], empty, seqs[1]])
    o, lse, dq, dk, dv = _fwd_bwd(attention_varlen, q, k, v, do, cu_q, cu_k, max_q, max_k, causal=True)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, rlse = attention_varlen_reference(qr, kr, vr, cu_q, cu_k, causal=True)
    ro.backward(do.double())
    for name, a, r in (("o", o, ro), ("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert (a.double() - r).abs().max().item() <= 2**-6 * r.abs().max().item(), name
    assert (lse.double() - rlse).abs().max().item() < 1e-5


# --------------------------------------------------------------------------- decompositions


def test_heads_split_across_ranks_reproduce_unsplit():
    # 6 query heads over 3 KV heads (GQA groups of 2) split by KV head into 1, 2 and 3 ranks
    h_q, h_kv = 6, 3
    group = h_q // h_kv
    q, k, v = _qkv(1, 24, 24, h_q, h_kv, seed=400)
    do = _randn(1, 24, h_q, D, seed=401)
    kw = {"causal": True, "dropout_p": 0.1, "seed": 5}

    def whole():
        return _fwd_bwd(attention, q, k, v, do, **kw)

    def split(parts):
        pieces = []
        for lo, hi in contiguous_splits(h_kv, parts):
            hq = slice(lo * group, hi * group)
            pieces.append(
                _fwd_bwd(
                    attention,
                    q[:, :, hq],
                    k[:, :, lo:hi],
                    v[:, :, lo:hi],
                    do[:, :, hq],
                    head_offset=lo * group,
                    **kw,
                )
            )
        o, lse, dq, dk, dv = zip(*pieces, strict=True)
        return torch.cat(o, 2), torch.cat(lse, 1), torch.cat(dq, 2), torch.cat(dk, 2), torch.cat(dv, 2)

    assert_decomposition_invariant(whole, split, parts=(1, 2, 3), name="heads split")


def test_context_parallel_queries_keep_o_lse_dq_bits():
    # Causal context parallelism: rank r holds queries [a, b) and keys [0, b). O, LSE and dQ keep
    # their bits for 2, 3 and 4 ranks (chunk edges off the tile grid); dK/dV, summed over ranks
    # outside the kernel, only agree to rounding (documented: not bitwise).
    t = 61
    q, k, v = _qkv(1, t, t, 2, 1, seed=500)
    do = _randn(1, t, 2, D, seed=501)
    o, lse, dq, dk, dv = _fwd_bwd(attention, q, k, v, do, causal=True)
    for parts in (2, 3, 4):
        edges = [(lo, hi) for lo, hi in contiguous_splits(t - 1, parts)]
        edges = [(lo + (i > 0), hi + 1) for i, (lo, hi) in enumerate(edges)]  # odd chunk edges
        dk_sum = torch.zeros_like(dk, dtype=torch.float64)
        dv_sum = torch.zeros_like(dv, dtype=torch.float64)
        for lo, hi in edges:
            co, clse, cdq, cdk, cdv = _fwd_bwd(
                attention, q[:, lo:hi], k[:, :hi], v[:, :hi], do[:, lo:hi], causal=True
            )
            assert_bitwise_equal(co, o[:, lo:hi], f"o: {parts} ranks, chunk {lo}:{hi}")
            assert_bitwise_equal(clse, lse[:, :, lo:hi], f"lse: {parts} ranks, chunk {lo}:{hi}")
            assert_bitwise_equal(cdq, dq[:, lo:hi], f"dq: {parts} ranks, chunk {lo}:{hi}")
            dk_sum[:, :hi] += cdk.double()
            dv_sum[:, :hi] += cdv.double()
        assert edges[-1][1] == t and edges[0][0] == 0
        for name, s, w in (("dk", dk_sum, dk), ("dv", dv_sum, dv)):
            assert (s - w.double()).abs().max().item() <= 2**-6 * w.double().abs().max().item(), name


# --------------------------------------------------------------------------- dropout


def _kernel_keep_mask(batch, t_q, t_k, heads, p, seed, causal=False):
    # q = 0 makes every visible probability 1/n; v = one-hot rows makes o[i, j] = kept(i, j) * ...
    q = torch.zeros(batch, t_q, heads, D, dtype=torch.bfloat16)
    v = torch.zeros(batch, t_k, heads, D, dtype=torch.bfloat16)
    v[:, :, :, :t_k] = torch.eye(t_k, dtype=torch.bfloat16)[None, :, None, :]
    o = attention(q, torch.zeros_like(v), v, causal=causal, dropout_p=p, seed=seed)
    return o[..., :t_k].permute(0, 2, 1, 3) != 0  # (B, H, T_q, T_k)


def test_dropout_mask_equals_reference_and_keep_rate():
    batch, t, heads, p, seed = 2, 48, 3, 0.3, 2**40 + 7
    got = _kernel_keep_mask(batch, t, t, heads, p, seed)
    ref = torch.stack(
        [torch.stack([dropout_keep_mask(seed, b, h, t, t, p) for h in range(heads)]) for b in range(batch)]
    )
    assert torch.equal(got, ref)
    n = got.numel()
    rate = got.double().mean().item()
    assert abs(rate - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n), rate
    # causal: the same bits on the visible triangle, nothing above it
    got_causal = _kernel_keep_mask(batch, t, t, heads, p, seed, causal=True)
    tri = torch.ones(t, t, dtype=torch.bool).tril()
    assert torch.equal(got_causal, ref & tri)


def test_dropout_keep_mask_refuses_what_the_kernels_refuse():
    """The reference mask took a dropout_p outside [0, 1) (an all-drop or all-keep mask) and a t_q
    past 2**22, whose queries spilled into the next head's index field (a new-user trial)."""
    for args, match in (
        ((1, 0, 0, 4, 4, 1.5), r"dropout_p must be in \[0, 1\), got 1.5"),
        ((1, 0, 0, 4, 4, -0.5), r"dropout_p must be in \[0, 1\)"),
        ((1, 0, 0, 2**22 + 1, 1, 0.5), r"t_q must be in \[0, 4194305\), got 4194305"),
        ((1, 0, 0, -1, 4, 0.5), r"t_q must be in \[0, 4194305\), got -1"),
        ((1, 0, 2**20, 4, 4, 0.5), r"head must be in \[0, 524288\), got 1048576"),
    ):
        with pytest.raises(ValueError, match=match):
            dropout_keep_mask(*args)
    with pytest.raises(TypeError, match="t_k"):
        dropout_keep_mask(1, 0, 0, 4, 4.0, 0.5)


def test_dropout_keep_rate_statistics_reference():
    # many draws through the reference mask (bit-identical to the kernel, tested above)
    for p in (0.1, 0.5, 0.9):
        mask = torch.cat([dropout_keep_mask(1, s, h, 128, 128, p) for s in range(4) for h in range(4)])
        n = mask.numel()
        assert abs(mask.double().mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n), p
    a = dropout_keep_mask(1, 0, 0, 64, 64, 0.5)
    for other in (
        dropout_keep_mask(2, 0, 0, 64, 64, 0.5),
        dropout_keep_mask(1, 1, 0, 64, 64, 0.5),
        dropout_keep_mask(1, 0, 1, 64, 64, 0.5),
    ):
        assert not torch.equal(a, other)  # seed, sequence and head each change the mask


def test_dropout_gradients_match_reference():
    q, k, v = _qkv(1, 35, 35, 4, 2, seed=600)
    do = _randn(1, 35, 4, D, seed=601)
    for causal in (False, True):
        o, _, dq, dk, dv = _fwd_bwd(attention, q, k, v, do, causal=causal, dropout_p=0.3, seed=99)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ro, _ = attention_reference(qr, kr, vr, causal=causal, dropout_p=0.3, seed=99)
        ro.backward(do.double())
        for name, a, r in (("o", o, ro), ("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
            assert (a.double() - r).abs().max().item() <= 2**-6 * r.abs().max().item(), name


# --------------------------------------------------------------------------- SDPA-style entry point


def test_sdpa_entry_point_equals_attention():
    q, k, v = _qkv(2, 30, 30, 4, 2, seed=700)
    o = attention(q, k, v, causal=True)
    o2 = scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    assert_bitwise_equal(o2.transpose(1, 2), o, "sdpa")
    with pytest.raises(ValueError, match="attn_mask"):
        scaled_dot_product_attention(
            q.transpose(1, 2),
            q.transpose(1, 2),
            q.transpose(1, 2),
            attn_mask=torch.ones(30, 30, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    with pytest.raises(ValueError, match="is_causal"):
        scaled_dot_product_attention(
            q[:, :10].transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), is_causal=True
        )
    with pytest.raises(TypeError, match="query must be a torch.Tensor, got list"):  # as attention()
        scaled_dot_product_attention([1], k.transpose(1, 2), v.transpose(1, 2))
    with pytest.raises(ValueError, match=r"key must be a 4-D \(B, H, T, E\) tensor, got shape \(30, 2, 64\)"):
        scaled_dot_product_attention(q.transpose(1, 2), k[0], v.transpose(1, 2))
    # messages that name this function's arguments (they named attention's, with a layout hint)
    with pytest.raises(TypeError, match=r"scaled_dot_product_attention: is_causal must be a bool, got int 1"):
        scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=1)
    q3 = _qkv(2, 30, 30, 3, 2, seed=701)[0]
    with pytest.raises(
        ValueError, match=r"scaled_dot_product_attention: query's 3 heads must be a multiple of key's 2"
    ):
        scaled_dot_product_attention(
            q3.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
        )


def test_fp32_inputs_under_autocast_are_told_to_cast():
    """torch SDPA is cast by autocast, det_attn (a custom op) is not: the dtype error says so there."""
    q = torch.randn(1, 8, 2, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="torch.autocast does not cast det_attn's inputs: cast q, k, v"):
            attention(q, q, q)
    with pytest.raises(TypeError, match=r"supported are torch.bfloat16 and torch.float16$"):
        attention(q, q, q)


def test_layer_equals_function():
    from det_attn.layers import DetAttention

    q, k, v = _qkv(1, 20, 20, 2, 2, seed=800)
    assert_bitwise_equal(DetAttention()(q, k, v, causal=True), attention(q, k, v, causal=True), "layer")


def test_transformers_forward_without_transformers():
    # the attention function itself needs no transformers: dense, packed (cu_seq_lens) and errors
    from det_attn.transformers_integration import det_attn_transformers_forward

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = _qkv(1, 24, 24, 4, 2, seed=900)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # transformers' (B, H, T, D)
    out, weights = det_attn_transformers_forward(module, qt, kt, vt, None, scaling=0.125)
    assert weights is None
    assert_bitwise_equal(out, attention(q, k, v, causal=True, softmax_scale=0.125), "dense")
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    out, _ = det_attn_transformers_forward(
        module, qt, kt, vt, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14
    )
    want = attention_varlen(q[0], k[0], v[0], cu, cu, 14, 14, causal=True)
    assert_bitwise_equal(out[0], want, "packed")
    # a packed row given by position_ids alone (DataCollatorWithFlattening's default): the same
    # documents, as transformers' flash attention reads them; plain positions: one sequence
    restart = torch.cat((torch.arange(10), torch.arange(14)))[None]
    out, _ = det_attn_transformers_forward(module, qt, kt, vt, None, position_ids=restart)
    assert_bitwise_equal(out[0], want, "packed by position_ids")
    out, _ = det_attn_transformers_forward(module, qt, kt, vt, None, position_ids=torch.arange(24)[None])
    assert_bitwise_equal(out, attention(q, k, v, causal=True), "position_ids of one sequence")
    padding = torch.ones(1, 24, dtype=torch.bool)
    padding[0, :3] = False
    with pytest.raises(ValueError, match="padding"):
        det_attn_transformers_forward(module, qt, kt, vt, padding)
    with pytest.raises(ValueError, match="seed"):
        det_attn_transformers_forward(module, qt, kt, vt, None, dropout=0.1)
    # one half of the pair used to be ignored: the documents attended to each other, silently
    for half in ("cu_seq_lens_q", "cu_seq_lens_k"):
        with pytest.raises(
            ValueError, match=f"{half} given without cu_seq_lens_[qk]: packed sequences need both"
        ):
            det_attn_transformers_forward(module, qt, kt, vt, None, **{half: cu})


def test_transformers_forward_reads_packed_rows_at_any_batch_size():
    """Rows whose position_ids restart (packed documents) give each row the bits it has alone,
    whatever rows share its call: batch 1 and batch 3 (a micro-batch of 3 rows or 3 of one row
    give the same bits), a row that is not packed beside packed ones, a row starting mid-document,
    and (1, T) positions shared by every row."""
    from det_attn.transformers_integration import det_attn_transformers_forward

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = _qkv(3, 24, 24, 4, 2, seed=910)
    positions = torch.stack(
        (
            torch.cat((torch.arange(10), torch.arange(14))),  # two documents
            torch.arange(5, 29),  # one sequence, not starting at 0
            torch.cat((torch.arange(3, 9), torch.arange(11), torch.arange(7))),  # starts mid-document
        )
    )

    def run(rows, position_ids):
        qt, kt, vt = (t[rows].transpose(1, 2) for t in (q, k, v))
        return det_attn_transformers_forward(module, qt, kt, vt, None, position_ids=position_ids)[0]

    documents = ([0, 10, 24], [0, 24], [0, 6, 17, 24])
    for row, cu in enumerate(documents):
        cu = torch.tensor(cu, dtype=torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        want = attention_varlen(q[row], k[row], v[row], cu, cu, longest, longest, causal=True)
        assert_bitwise_equal(run([row], positions[row : row + 1])[0], want, f"row {row} alone")
    together = run([0, 1, 2], positions)
    for row in range(3):
        assert_bitwise_equal(together[row], run([row], positions[row : row + 1])[0], f"row {row} of 3")
    # the same (1, T) positions for every row: each row is split as row 0 is
    shared = run([0, 1, 2], positions[:1])
    for row in range(3):
        cu = torch.tensor(documents[0], dtype=torch.int32)
        want = attention_varlen(q[row], k[row], v[row], cu, cu, 14, 14, causal=True)
        assert_bitwise_equal(shared[row], want, f"row {row}, shared positions")
    # rows that are not packed: one sequence each, the padded kernel
    plain = torch.arange(24).expand(3, 24)
    assert_bitwise_equal(run([0, 1, 2], plain), attention(q, k, v, causal=True), "plain rows")


# --------------------------------------------------------------------------- bad input


def _bad_cases():
    q, k, v = _qkv(1, 8, 8, 2, 2)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    flat = (q[0], k[0], v[0])
    return [
        (TypeError, "dtype", lambda: attention(q.float(), k.float(), v.float())),
        (TypeError, "share one dtype", lambda: attention(q, k.half(), v)),
        (ValueError, "4-D", lambda: attention(q[0], k, v)),
        (ValueError, "head dim 32", lambda: attention(q[..., :32], k[..., :32], v[..., :32])),
        (ValueError, "head dim 256", lambda: attention(*(torch.cat([t] * 4, -1) for t in (q, k, v)))),
        (ValueError, "multiple", lambda: attention(_qkv(1, 8, 8, 3, 2)[0], k, v)),
        (ValueError, "batch", lambda: attention(torch.cat([q, q]), k, v)),
        (ValueError, "one shape", lambda: attention(q, k, v[:, :4])),
        (ValueError, "empty", lambda: attention(q[:, :0], k, v)),
        (ValueError, "causal", lambda: attention(q, k[:, :4], v[:, :4], causal=True)),
        (ValueError, "seed", lambda: attention(q, k, v, dropout_p=0.1)),
        (ValueError, "dropout_p", lambda: attention(q, k, v, dropout_p=1.0, seed=0)),
        (ValueError, "softmax_scale", lambda: attention(q, k, v, softmax_scale=-1.0)),
        # found by a new-user check: these were converted silently (causal="no" ran causal)
        (TypeError, "causal must be a bool", lambda: attention(q, k, v, causal="no")),
        (TypeError, "causal must be a bool", lambda: attention(q, k, v, causal=1)),
        (TypeError, "causal must be a bool", lambda: attention_varlen(*flat, cu, cu, 8, 8, causal=None)),
        (TypeError, "softmax_scale must be a real number", lambda: attention(q, k, v, softmax_scale="0.5")),
        (TypeError, "softmax_scale must be a real number", lambda: attention(q, k, v, softmax_scale=True)),
        (
            TypeError,
            "softmax_scale must be a real number",
            lambda: attention(q, k, v, softmax_scale=torch.tensor(0.5)),
        ),
        (ValueError, "finite positive", lambda: attention(q, k, v, softmax_scale=10**400)),
        # beyond the normal fp32 range: an fp64-typed kernel argument (a dtype error) or inf
        (
            ValueError,
            r"softmax_scale must lie in \[2\*\*-126, 2\*\*127\]",
            lambda: attention(q, k, v, softmax_scale=1e-40),
        ),
        (
            ValueError,
            r"softmax_scale must lie in \[2\*\*-126",
            lambda: attention(q, k, v, softmax_scale=1e39),
        ),
        (ValueError, "sequence_offset", lambda: attention(q, k, v, sequence_offset=2**32)),
        (ValueError, "head_offset", lambda: attention(q, k, v, head_offset=2**19)),
        (ValueError, "device", lambda: attention(q, k.to("meta"), v.to("meta"))),
        (TypeError, "int32", lambda: attention_varlen(*flat, cu.long(), cu, 8, 8)),
        (
            TypeError,
            "max_seqlen_q must be an integer, got the bool",
            lambda: attention_varlen(*flat, cu, cu, True, 8),
        ),
        (TypeError, "max_seqlen_k must be an integer", lambda: attention_varlen(*flat, cu, cu, 8, 8.0)),
        (
            TypeError,
            "max_seqlen_q must be an integer",
            lambda: attention_varlen(*flat, cu, cu, np.float64(8), 8),
        ),
        (ValueError, "below the longest", lambda: attention_varlen(*flat, cu, cu, np.int64(4), 8)),
        (
            ValueError,
            "monotone",
            lambda: attention_varlen(
                *flat,
                torch.tensor([0, 6, 3, 8], dtype=torch.int32),
                torch.tensor([0, 2, 4, 8], dtype=torch.int32),
                8,
                8,
            ),
        ),
        (
            ValueError,
            "start at 0",
            lambda: attention_varlen(*flat, torch.tensor([1, 8], dtype=torch.int32), cu, 8, 8),
        ),
        (ValueError, "below the longest", lambda: attention_varlen(*flat, cu, cu, 4, 8)),
        (ValueError, "exceeds", lambda: attention_varlen(*flat, cu, cu, 2**22 + 1, 8)),
        (
            ValueError,
            "no keys",
            lambda: attention_varlen(
                *flat,
                torch.tensor([0, 4, 8], dtype=torch.int32),
                torch.tensor([0, 0, 8], dtype=torch.int32),
                4,
                8,
            ),
        ),
        (
            ValueError,
            "sequences",
            lambda: attention_varlen(*flat, cu, torch.tensor([0, 4, 8], dtype=torch.int32), 8, 8),
        ),
        (
            ValueError,
            "empty",
            lambda: attention_varlen(q[0, :0], k[0], v[0], torch.zeros(2, dtype=torch.int32), cu, 8, 8),
        ),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_clear_error(case):
    error, match, call = _bad_cases()[case]
    with pytest.raises(error, match=match):
        call()


def _bad_dropout_cases():
    # found by a new-user check: seed=True / 3.0 were accepted (int()), offsets of 1.5 truncated,
    # dropout_p="0.1" gave a raw comparison error
    q, k, v = _qkv(1, 8, 8, 2, 2)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    flat = (q[0], k[0], v[0])
    calls = {
        "attention": lambda **kw: attention(q, k, v, **kw),
        "attention_varlen": lambda **kw: attention_varlen(*flat, cu, cu, 8, 8, **kw),
    }
    cases = [
        ({"dropout_p": 0.1, "seed": True}, TypeError, "seed must be an integer, got the bool True"),
        (
            {"dropout_p": 0.1, "seed": 3.0},
            TypeError,
            r"seed must be an integer \(int, numpy integer or 0-dim integer tensor\), got float 3.0",
        ),
        ({"dropout_p": 0.1, "seed": "3"}, TypeError, "seed must be an integer .*got str '3'"),
        ({"seed": 2.5}, TypeError, "seed must be an integer .*got float 2.5"),  # checked even without dropout
        ({"dropout_p": 0.1, "seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
        ({"dropout_p": 0.1, "seed": 2**64}, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        ({"sequence_offset": 1.5}, TypeError, "sequence_offset must be an integer .*got float 1.5"),
        ({"sequence_offset": True}, TypeError, "sequence_offset must be an integer, got the bool"),
        ({"head_offset": 1.5}, TypeError, "head_offset must be an integer .*got float 1.5"),
        ({"head_offset": "1"}, TypeError, "head_offset must be an integer .*got str '1'"),
        ({"head_offset": -1}, ValueError, r"head_offset \+ heads must be in"),
        (
            {"dropout_p": "0.1", "seed": 0},
            TypeError,
            r"dropout_p must be a real number in \[0, 1\), got str '0.1'",
        ),
        ({"dropout_p": True, "seed": 0}, TypeError, "dropout_p must be a real number .*got bool True"),
        (
            {"dropout_p": torch.tensor(0.1), "seed": 0},
            TypeError,
            "dropout_p must be a real number .*got Tensor",
        ),
        ({"dropout_p": float("nan"), "seed": 0}, ValueError, r"dropout_p must be in \[0, 1\), got nan"),
    ]
    return [(name, call, *case) for name, call in calls.items() for case in cases]


@pytest.mark.parametrize("case", range(len(_bad_dropout_cases())))
def test_bad_dropout_arguments_raise_clear_errors(case):
    name, call, kwargs, error, match = _bad_dropout_cases()[case]
    with pytest.raises(error, match=f"det_attn.{name}: {match}"):
        call(**kwargs)


def _error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
        return type(exc), str(exc)
    return None


def test_errors_are_the_same_with_warm_caches(monkeypatch):
    # a signature seen before skips the checks that depend on it alone: every bad input must
    # still raise what it raises with the caches empty (the bad cases share the good calls' shapes)
    calls = [call for _, _, call in _bad_cases()]
    calls += [functools.partial(call, **kw) for _, call, kw, _, _ in _bad_dropout_cases()]
    cold = []
    for call in calls:
        monkeypatch.setattr(_plans, "PLANS", _plans.PlanCache())
        cold.append(_error(call))
    q, k, v = _qkv(1, 8, 8, 2, 2)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    attention(q, k, v)
    attention(q, k, v, dropout_p=0.1, seed=0)
    attention_varlen(q[0], k[0], v[0], cu, cu, 8, 8)
    assert len(_plans.PLANS) == 3  # without and with dropout, packed
    assert all(cold) and [_error(call) for call in calls] == cold
    # a cached CPU signature still needs the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for call in (lambda: attention(q, k, v), lambda: attention_varlen(q[0], k[0], v[0], cu, cu, 8, 8)):
        with pytest.raises(RuntimeError, match="only through the interpreter"):
            call()


def test_sdpa_and_transformers_reject_bad_dropout_arguments():
    from det_attn.transformers_integration import det_attn_transformers_forward

    q, k, v = (t.transpose(1, 2) for t in _qkv(1, 8, 8, 2, 2))  # (B, H, T, D)
    with pytest.raises(TypeError, match="seed must be an integer, got the bool True"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1, seed=True)
    with pytest.raises(TypeError, match="dropout_p must be a real number .*got str '0.1'"):
        scaled_dot_product_attention(q, k, v, dropout_p="0.1", seed=0)
    module = torch.nn.Module()
    with pytest.raises(
        TypeError, match=r"det_attn \(transformers\): dropout must be a real number .*got str"
    ):
        det_attn_transformers_forward(module, q, k, v, None, dropout="0.1", det_attn_seed=0)
    with pytest.raises(
        TypeError, match=r"det_attn \(transformers\): det_attn_seed must be an integer .*float 3.0"
    ):
        det_attn_transformers_forward(module, q, k, v, None, dropout=0.1, det_attn_seed=3.0)
    with pytest.raises(ValueError, match=r"det_attn \(transformers\): dropout must be in \[0, 1\)"):
        det_attn_transformers_forward(module, q, k, v, None, dropout=1.5, det_attn_seed=0)


def test_dropout_arguments_accept_numpy_integers_and_floats():
    # numpy integer seeds / offsets and numpy float probabilities give the Python values' bits
    q, k, v = _qkv(2, 16, 16, 2, 2)
    kw = {"causal": True, "dropout_p": 0.25, "seed": 2**40 + 3, "sequence_offset": 5, "head_offset": 4}
    expected = attention(q, k, v, **kw)
    given = {"dropout_p": np.float64(0.25), "seed": np.uint64(2**40 + 3), "sequence_offset": np.int32(5)}
    assert_bitwise_equal(attention(q, k, v, **{**kw, **given, "head_offset": np.int64(4)}), expected)
    assert_bitwise_equal(attention(q, k, v, **{**kw, "dropout_p": np.float32(0.25)}), expected)


def test_varlen_accepts_numpy_and_tensor_integer_max_seqlen():
    # found by a new-user check: max_seqlen from numpy (np.int64, e.g. np.diff(cu).max()) was
    # rejected; any integral type is accepted and gives the same bits as a Python int
    q, k, v = _qkv(1, 8, 8, 2, 2)
    flat = (q[0], k[0], v[0])
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    expected = attention_varlen(*flat, cu, cu, 5, 5, causal=True)
    for max_q, max_k in ((np.int64(5), np.int32(5)), (np.uint16(6), torch.tensor(5))):
        assert_bitwise_equal(attention_varlen(*flat, cu, cu, max_q, max_k, causal=True), expected)


def test_too_long_sequence_raises():
    # 2**22 + 1 tokens would not fit the dropout index: checked before any allocation or launch
    q = torch.zeros(1, 1, 1, D, dtype=torch.bfloat16).expand(1, 2**22 + 1, 1, D)
    with pytest.raises(ValueError, match="exceeds"):
        attention(q, q, q)


def test_strided_cu_seqlens_give_the_contiguous_bits():
    # found by a new-user check: a strided cu_seqlens view passed the value checks (made on the
    # host) but the kernels read it with unit stride (NaN there); it is made contiguous now
    lengths = [10, 20, 20]
    q, k, v = (_randn(50, 2, 64, seed=s) for s in (1, 2, 3))
    cu = torch.tensor([0, 10, 30, 50], dtype=torch.int32)
    strided = torch.tensor([0, 99, 10, 99, 30, 99, 50, 99], dtype=torch.int32)[::2]
    assert not strided.is_contiguous() and strided.tolist() == cu.tolist() and max(lengths) == 20
    want = attention_varlen(q, k, v, cu, cu, 20, 20, causal=True, return_lse=True)
    got = attention_varlen(q, k, v, strided, strided, 20, 20, causal=True, return_lse=True)
    for name, a, b in zip(("o", "lse"), got, want, strict=True):
        assert_bitwise_equal(a, b, f"{name}: strided cu_seqlens")


def test_double_backward_raises_instead_of_dropping_terms():
    # found by a new-user check: create_graph=True gave a dq without grad_fn, so a gradient
    # penalty silently contributed nothing; such a backward raises now
    q, k, v = (_randn(1, 16, 1, 64, seed=s).requires_grad_() for s in (4, 5, 6))
    o = attention(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match="det_attn.attention: a backward with create_graph=True"):
        torch.autograd.grad(o.float().sum(), q, create_graph=True)
    (dq,) = torch.autograd.grad(attention(q, k, v, causal=True).float().sum(), q)  # first order
    assert dq.shape == q.shape and not dq.requires_grad
