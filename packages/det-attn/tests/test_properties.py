"""Property tests (hypothesis) of det_attn's public API over random shapes, dtypes and layouts.

``attention`` (with ``scaled_dot_product_attention`` on torch's layout) and ``attention_varlen``
on random tiny problems: sequence lengths 1, primes and the interpreter's tile edges (15/16/17,
31/32/33), empty packed sequences, GQA / MQA head groups, causal or not, a custom scale, dropout,
and q / k / v read through other strides (torch's ``(B, H, T, D)`` transposed, NaN-padded strided
views, a batch broadcast with stride 0, v with other strides than k). Every call either

- returns the documented shapes and dtypes, the fp64 reference to the tolerance of
  test_attention.py (O, dQ, dK, dV within ``2**-6`` of the reference's largest magnitude, LSE within
  ``1e-5``), the bits of the same call on contiguous copies (no view read as if it were
  contiguous) and the bits of one sequence computed alone (batch / packing invariance), or
- raises a TypeError / ValueError whose message names the problem (empty inputs included:
  ``T = 0`` in a padded batch and no tokens at all in a packed one are errors; an empty sequence
  inside a pack is allowed).

Only the public API is used: ``det_attn.attention``, ``attention_varlen``,
``scaled_dot_product_attention`` and the ``det_attn.reference`` module. CPU through the Triton
interpreter: tiny shapes, few derandomized examples, no example database, no shrinking.
"""

from __future__ import annotations

import det_attn
import pytest
import torch
from det_core.testing import assert_bitwise_equal
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("o", "lse", "dq", "dk", "dv")
LENGTHS = st.sampled_from([1, 2, 3, 5, 15, 16, 17, 31, 32, 33, 40])
# (query heads, key/value heads): MHA, GQA and MQA
HEADS = st.sampled_from([(1, 1), (2, 2), (2, 1), (3, 1), (4, 2)])
DTYPES = st.sampled_from([torch.bfloat16, torch.float16])
SCALES = st.sampled_from([None, 0.3])
# dropout's Philox tiles take seconds per call in the interpreter: dropout runs in the explicit
# examples (and in test_attention.py), the generated examples run without it
DROPOUT = st.just(0.0)
SEEDS = st.integers(0, 2**16)


def _settings(examples: int):
    """Derandomized (the same examples every run, also in CI), no deadline (the interpreter's
    speed varies by host), no example database, no shrinking (a failing example is already tiny;
    shrinking under the interpreter can take minutes)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
    )


def _randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (``(B, T, H, D)`` or packed ``(T, H, D)``) through other strides. ``heads_major``: the
    token and head dims swapped in memory (torch's ``(B, H, T, D)``, transposed); ``strided``:
    every other token and head of a NaN-filled buffer, 3 elements into a head (any element read
    outside the view is NaN; the view is not 16-byte aligned); ``dim_strided``: every other
    element of a head; ``broadcast_batch`` / ``broadcast_heads``: sequence / head 0 repeated with
    stride 0 (the values change: compare against ``.contiguous()``)."""
    if kind == "contiguous":
        return t
    if kind == "heads_major":
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    if kind == "strided":
        *lead, tokens, heads, dim = t.shape
        buf = torch.full(
            (*lead, 2 * tokens, 2 * heads, dim + 3), float("nan"), dtype=t.dtype, device=t.device
        )
        view = buf[..., ::2, 1::2, 3:]
        view.copy_(t)
        return view
    if kind == "dim_strided":  # every other element of a head: a non-unit last stride
        buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype, device=t.device)
        view = buf[..., ::2]
        view.copy_(t)
        return view
    if kind == "broadcast_batch":
        return t[:1].expand(t.shape) if t.dim() == 4 else t
    if kind == "broadcast_heads":
        return t[..., :1, :].expand(t.shape)
    raise AssertionError(kind)


def _fused_leaf_views(q0, k0, v0):
    """q, k, v as views of one leaf ``(..., T, H_q + 2 H_kv, D)`` buffer (a fused QKV projection's
    output split by heads), each keeping its ``.grad``."""
    buf = torch.cat([q0, k0, v0], dim=-2).detach().requires_grad_()
    h_q, h_kv = q0.shape[-2], k0.shape[-2]
    views = buf[..., :h_q, :], buf[..., h_q : h_q + h_kv, :], buf[..., h_q + h_kv :, :]
    for t in views:
        t.retain_grad()
    return views


def _leaf_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``_layout(t, kind)`` as a leaf of autograd (or a view of one) whose ``.grad`` is kept."""
    base = _layout(t, kind)
    if base._base is not None:  # a view: its buffer is the leaf
        buf = base._base.detach().requires_grad_()
        view = buf.as_strided(base.shape, base.stride(), base.storage_offset())
    else:
        view = base.detach().requires_grad_()
    view.retain_grad()
    return view


def _leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def _fwd_bwd(fn, q, k, v, do, *args, **kw):
    """``(o, lse, dq, dk, dv)`` of ``fn`` on leaves (or retained views) q, k, v; gradients of
    ``(o * do).sum()``."""
    o, lse = fn(q, k, v, *args, return_lse=True, **kw)
    o.backward(do)
    return o.detach(), lse, q.grad, k.grad, v.grad


def _check_reference(got, ref, max_keys: int):
    """test_attention.py's tolerance: O, dQ, dK, dV within 2**-6 of the reference's largest
    magnitude; LSE (fp32 in both) within 1e-5. ``max_keys``: the most keys a query sees; with 2
    or fewer, dq and dk miss the tolerance (a known bug: test_few_keys_dq_dk_accuracy, xfail)."""
    for name, ours, want in zip(NAMES, got, ref, strict=True):
        assert ours.shape == want.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(want.shape)}"
        if not want.numel() or (name in ("dq", "dk") and max_keys <= 2):
            continue
        err = (ours.double() - want).abs().max().item()
        if name == "lse":
            assert err < 1e-5, f"lse: error {err:.3g}"
        else:
            assert err <= 2**-6 * want.abs().max().item(), f"{name}: error {err:.3g}"


# ============================================================================ attention (padded batch)

LAYOUTS = st.sampled_from(
    ["contiguous", "heads_major", "strided", "dim_strided", "broadcast_batch", "broadcast_heads"]
)


@_settings(5)
@given(
    dtype=DTYPES,
    batch=st.sampled_from([1, 2, 3]),
    t_q=LENGTHS,
    t_k=LENGTHS,
    heads=HEADS,
    causal=st.booleans(),
    scale=SCALES,
    dropout_p=DROPOUT,
    layouts=st.one_of(st.tuples(LAYOUTS, LAYOUTS, LAYOUTS), st.just(("fused",) * 3)),
    anchor=st.integers(0, 2),
    seed=SEEDS,
)
@example(  # tile edges, GQA groups of 2, causal, each operand in another layout
    dtype=torch.bfloat16,
    batch=1,
    t_q=17,
    t_k=33,
    heads=(4, 2),
    causal=True,
    scale=None,
    dropout_p=0.0,
    layouts=("strided", "heads_major", "dim_strided"),
    anchor=0,
    seed=1,
)
@example(  # dropout, a custom scale, v with other strides than k
    dtype=torch.float16,
    batch=2,
    t_q=33,
    t_k=31,
    heads=(1, 1),
    causal=False,
    scale=0.3,
    dropout_p=0.25,
    layouts=("heads_major", "strided", "contiguous"),
    anchor=1,
    seed=2,
)
@example(  # q, k, v split from one fused QKV buffer (self-attention)
    dtype=torch.bfloat16,
    batch=2,
    t_q=32,
    t_k=32,
    heads=(2, 1),
    causal=True,
    scale=None,
    dropout_p=0.0,
    layouts=("fused",) * 3,
    anchor=1,
    seed=3,
)
@example(  # stride-0 broadcast q (sequence 0 repeated) and v (head 0 repeated), MQA, a custom scale
    dtype=torch.float16,
    batch=2,
    t_q=5,
    t_k=16,
    heads=(2, 1),
    causal=False,
    scale=0.3,
    dropout_p=0.0,
    layouts=("broadcast_batch", "contiguous", "broadcast_heads"),
    anchor=1,
    seed=5,
)
@example(  # one token
    dtype=torch.bfloat16,
    batch=1,
    t_q=1,
    t_k=1,
    heads=(1, 1),
    causal=True,
    scale=None,
    dropout_p=0.0,
    layouts=("contiguous",) * 3,
    anchor=0,
    seed=4,
)
def test_attention_matches_reference_bits_of_contiguous_and_batch_invariant(
    dtype, batch, t_q, t_k, heads, causal, scale, dropout_p, layouts, anchor, seed
):
    if causal and t_k < t_q:  # causal needs T_k >= T_q (bottom-right alignment): tested as an error below
        t_q, t_k = t_k, t_q
    if layouts[0] == "fused":  # one buffer for q, k and v: self-attention
        t_q = t_k
    h_q, h_kv = heads
    while batch > 1 and batch * h_q > 4:  # the interpreter's time grows with sequences x heads
        batch -= 1
    g = torch.Generator().manual_seed(seed)
    q0, k0, v0 = (_randn((batch, t, h, 64), dtype, g) for t, h in ((t_q, h_q), (t_k, h_kv), (t_k, h_kv)))
    do = _randn((batch, t_q, h_q, 64), dtype, g)
    kw = dict(causal=causal, softmax_scale=scale, dropout_p=dropout_p, seed=seed if dropout_p else None)
    if layouts[0] == "fused":
        q, k, v = _fused_leaf_views(q0, k0, v0)
    else:
        q, k, v = (_leaf_view(t, kind) for t, kind in zip((q0, k0, v0), layouts, strict=True))
    got = _fwd_bwd(det_attn.attention, q, k, v, do, **kw)
    o, lse, dq, dk, dv = got
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (batch, h_q, t_q) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    qc, kc, vc = (t.detach().contiguous() for t in (q, k, v))
    if layouts != ("contiguous",) * 3:
        contiguous = _fwd_bwd(det_attn.attention, _leaf(qc), _leaf(kc), _leaf(vc), do, **kw)
        for name, a, b in zip(NAMES, got, contiguous, strict=True):
            assert_bitwise_equal(a, b, f"{name}: {layouts} vs contiguous")
    q64, k64, v64 = (_leaf(t, torch.float64) for t in (qc, kc, vc))
    ref_o, ref_lse = det_attn.reference.attention_reference(q64, k64, v64, **kw)
    ref_o.backward(do.double())
    _check_reference(got, (ref_o.detach(), ref_lse.detach(), q64.grad, k64.grad, v64.grad), t_k)
    # one sequence alone (keyed as the same sequence for dropout) gives the batch's bits
    b = anchor % batch
    one = (_leaf(t[b : b + 1]) for t in (qc, kc, vc))
    alone = _fwd_bwd(det_attn.attention, *one, do[b : b + 1], sequence_offset=b, **kw)
    for name, a, full in zip(NAMES, alone, got, strict=True):
        assert_bitwise_equal(a, full[b : b + 1], f"{name}: sequence {b} alone vs in a batch of {batch}")
    # torch's entry point on torch's (B, H, T, D) layout: the same call (torch aligns causal
    # top-left, so it takes causal only with T_q == T_k)
    if not causal or t_q == t_k:
        with torch.no_grad():
            o_sdpa = det_attn.scaled_dot_product_attention(
                *(t.detach().transpose(1, 2) for t in (q, k, v)),
                dropout_p=dropout_p,
                is_causal=causal,
                scale=scale,
                enable_gqa=h_q != h_kv,
                seed=kw["seed"],
            )
        assert_bitwise_equal(o_sdpa, o.transpose(1, 2), "scaled_dot_product_attention vs attention")


@pytest.mark.xfail(
    strict=True,
    reason=(
        "det_attn bug: with few keys per query dq and dk miss the documented accuracy (docs/det-attn.md: "
        "max error against fp64 <= 2x torch SDPA's math backend on CPU). B=1, T_q=T_k=2, H_q=3, H_kv=1, "
        "D=64, bf16, softmax_scale=0.3: dq error 0.0200 (4.0% of max|dq|) vs SDPA math 0.00091, dk 0.031 "
        "(5.0%) vs 0.0018; test_attention.py's 2**-6 bound is 0.0078. Cause: the backward's "
        "D = rowsum(dO * O) is taken from the bf16-rounded O, and dP - D cancels when a row has few keys "
        "(the fp64 gradient with D from the rounded O errs by 0.0198 too; torch's CPU flash backend, same "
        "form, by 0.0176)"
    ),
)
def test_few_keys_dq_dk_accuracy():
    g = torch.Generator().manual_seed(413)
    q, k, v = (torch.randn(1, 2, h, 64, generator=g).bfloat16() for h in (3, 1, 1))
    do = torch.randn(1, 2, 3, 64, generator=g).bfloat16()
    got = _fwd_bwd(det_attn.attention, _leaf(q), _leaf(k), _leaf(v), do, softmax_scale=0.3)
    q64, k64, v64 = (_leaf(t, torch.float64) for t in (q, k, v))
    det_attn.reference.attention_reference(q64, k64, v64, softmax_scale=0.3)[0].backward(do.double())
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (_leaf(t.transpose(1, 2)) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=0.3, enable_gqa=True)
    o.backward(do.transpose(1, 2))
    for name, ours, math_grad, ref in (("dq", got[2], qt.grad, q64.grad), ("dk", got[3], kt.grad, k64.grad)):
        err = (ours.double() - ref).abs().max().item()
        math_err = (math_grad.transpose(1, 2).double() - ref).abs().max().item()
        assert err <= 2 * math_err, f"{name}: error {err:.3g} > 2 x SDPA math's {math_err:.3g}"
        assert err <= 2**-6 * ref.abs().max().item(), f"{name}: error {err:.3g} above 2**-6 of max|ref|"


def _bad_attention(kind: str, t: int, h: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, t, h, 64, generator=g).bfloat16() for _ in range(3))
    a = det_attn.attention
    cases = {
        "empty_t": (lambda: a(q[:, :0], k, v), ValueError, "empty input"),
        "empty_batch": (lambda: a(q[:0], k[:0], v[:0]), ValueError, "empty input"),
        "head_dim": (
            lambda: a(q[..., :32], k[..., :32], v[..., :32]),
            ValueError,
            "head dim 32 is not supported",
        ),
        "float32": (lambda: a(q.float(), k.float(), v.float()), TypeError, "supported are torch.bfloat16"),
        "dtype_mix": (lambda: a(q, k.half(), v.half()), TypeError, "share one dtype"),
        "rank": (lambda: a(q[0], k[0], v[0]), ValueError, r"must be 4-D \(B, T, H, D\)"),
        "groups": (
            lambda: a(q.repeat(1, 1, 3, 1), k.repeat(1, 1, 2, 1), v.repeat(1, 1, 2, 1)),
            ValueError,
            r"query heads \(\d+\) must be a positive multiple of key/value heads",
        ),
        "batch": (lambda: a(q, k[:1], v[:1]), ValueError, "share the batch size"),
        "kv_shape": (lambda: a(q, k, torch.cat([v, v], 1)), ValueError, "k and v must have one shape"),
        "causal_short_keys": (
            lambda: a(torch.cat([q, q], 1), k, v, causal=True),
            ValueError,
            "causal attention needs T_k >= T_q",
        ),
        "dropout_without_seed": (lambda: a(q, k, v, dropout_p=0.1), ValueError, "explicit integer seed"),
        "sdpa_mask": (
            lambda: det_attn.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.ones(t, t, dtype=torch.bool)
            ),
            ValueError,
            "attn_mask is not supported",
        ),
        "sdpa_causal_l_ne_s": (
            lambda: det_attn.scaled_dot_product_attention(
                q.transpose(1, 2),
                torch.cat([k, k], 1).transpose(1, 2),
                torch.cat([v, v], 1).transpose(1, 2),
                is_causal=True,
            ),
            ValueError,
            "is_causal with L=",
        ),
    }
    return cases[kind]


@pytest.mark.parametrize(
    "kind",
    [
        "empty_t",
        "empty_batch",
        "head_dim",
        "float32",
        "dtype_mix",
        "rank",
        "groups",
        "batch",
        "kv_shape",
        "causal_short_keys",
        "dropout_without_seed",
        "sdpa_mask",
        "sdpa_causal_l_ne_s",
    ],
)
@_settings(3)
@given(
    t=st.sampled_from([1, 2, 17]),
    h=st.sampled_from([1, 2]),
)
def test_attention_bad_input_raises_a_clear_error(kind, t, h):
    call, error, match = _bad_attention(kind, t, h)
    with pytest.raises(error, match=match):
        call()


# ============================================================================ attention_varlen (packed)

PACKED_LAYOUTS = st.sampled_from(["contiguous", "heads_major", "strided", "dim_strided", "broadcast_heads"])
# per sequence (query tokens, key tokens); 0 makes an empty sequence (or one with keys only)
SEQ_LENGTHS = st.sampled_from([0, 1, 2, 3, 5, 15, 16, 17, 31, 33])


def _cu(lengths: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


@_settings(5)
@given(
    dtype=DTYPES,
    seqs=st.lists(st.tuples(SEQ_LENGTHS, SEQ_LENGTHS), min_size=1, max_size=4),
    heads=HEADS,
    causal=st.booleans(),
    scale=SCALES,
    dropout_p=DROPOUT,
    extra_max=st.sampled_from([0, 0, 7]),
    layouts=st.tuples(PACKED_LAYOUTS, PACKED_LAYOUTS, PACKED_LAYOUTS),
    anchor=st.integers(0, 3),
    seed=SEEDS,
)
@example(  # tile edges beside an empty sequence, GQA, causal, max_seqlen above the longest
    dtype=torch.bfloat16,
    seqs=[(15, 17), (0, 0), (33, 33), (16, 31)],
    heads=(2, 1),
    causal=True,
    scale=None,
    dropout_p=0.0,
    extra_max=7,
    layouts=("strided",) * 3,
    anchor=2,
    seed=1,
)
@example(  # stride-0 broadcast heads of q and v, a one-key sequence, non-unit last stride
    dtype=torch.bfloat16,
    seqs=[(3, 16), (5, 1)],
    heads=(2, 2),
    causal=False,
    scale=None,
    dropout_p=0.0,
    extra_max=0,
    layouts=("broadcast_heads", "dim_strided", "broadcast_heads"),
    anchor=0,
    seed=3,
)
@example(  # keys without queries, dropout, a custom scale
    dtype=torch.float16,
    seqs=[(0, 5), (17, 2), (1, 1)],
    heads=(2, 2),
    causal=False,
    scale=0.3,
    dropout_p=0.25,
    extra_max=0,
    layouts=("heads_major", "contiguous", "strided"),
    anchor=1,
    seed=2,
)
def test_attention_varlen_matches_reference_bits_of_contiguous_and_packing_invariant(
    dtype, seqs, heads, causal, scale, dropout_p, extra_max, layouts, anchor, seed
):
    # valid packs only (the invalid ones are tested as errors below): a sequence with queries has
    # keys, causal needs as many keys as queries, and the pack holds a query
    seqs = [(n_q, n_k or n_q) for n_q, n_k in seqs]
    if causal:
        seqs = [(min(n_q, n_k), max(n_q, n_k)) for n_q, n_k in seqs]
    if not any(n_q for n_q, _ in seqs):
        seqs[0] = (1, max(seqs[0][1], 1))
    h_q, h_kv = heads
    len_q, len_k = [n for n, _ in seqs], [n for _, n in seqs]
    cu_q, cu_k = _cu(len_q), _cu(len_k)
    max_q, max_k = max(len_q) + extra_max, max(len_k) + extra_max
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(len_q), sum(len_k)
    q0, k0, v0 = (_randn((t, h, 64), dtype, g) for t, h in ((total_q, h_q), (total_k, h_kv), (total_k, h_kv)))
    do = _randn((total_q, h_q, 64), dtype, g)
    kw = dict(causal=causal, softmax_scale=scale, dropout_p=dropout_p, seed=seed if dropout_p else None)
    q, k, v = (_leaf_view(t, kind) for t, kind in zip((q0, k0, v0), layouts, strict=True))
    args = (cu_q, cu_k, max_q, max_k)
    got = _fwd_bwd(det_attn.attention_varlen, q, k, v, do, *args, **kw)
    o, lse, dq, dk, dv = got
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (h_q, total_q) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    with torch.no_grad():  # no autograd: another host path to the same forward launch
        o_ng = det_attn.attention_varlen(q.detach(), k.detach(), v.detach(), *args, **kw)
    assert_bitwise_equal(o_ng, o, "o without autograd vs with")
    qc, kc, vc = (t.detach().contiguous() for t in (q, k, v))
    if layouts != ("contiguous",) * 3:
        contiguous = _fwd_bwd(det_attn.attention_varlen, _leaf(qc), _leaf(kc), _leaf(vc), do, *args, **kw)
        for name, a, b in zip(NAMES, got, contiguous, strict=True):
            assert_bitwise_equal(a, b, f"{name}: {layouts} vs contiguous")
    q64, k64, v64 = (_leaf(t, torch.float64) for t in (qc, kc, vc))
    ref_o, ref_lse = det_attn.reference.attention_varlen_reference(q64, k64, v64, cu_q, cu_k, **kw)
    ref_o.backward(do.double())
    max_keys = max(n_k for n_q, n_k in seqs if n_q)
    _check_reference(got, (ref_o.detach(), ref_lse.detach(), q64.grad, k64.grad, v64.grad), max_keys)
    keys_only = [b for b, (n_q, n_k) in enumerate(seqs) if n_q == 0 and n_k]
    for b in keys_only:  # keys no query sees: zero gradients
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        assert bool((dk[sk] == 0).all() and (dv[sk] == 0).all()), f"keys of query-less sequence {b}"
    # one sequence alone (``attention`` on it, keyed as the same sequence for dropout) gives the
    # bits it has in the pack, whatever is packed beside it
    with_queries = [b for b, (n_q, _) in enumerate(seqs) if n_q]
    b = with_queries[anchor % len(with_queries)]
    sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
    one = (_leaf(t[s][None]) for t, s in ((qc, sq), (kc, sk), (vc, sk)))
    alone = _fwd_bwd(det_attn.attention, *one, do[sq][None], sequence_offset=b, **kw)
    for name, a, full in zip(NAMES, alone, got, strict=True):
        part = full[:, sq] if name == "lse" else full[sk] if name in ("dk", "dv") else full[sq]
        assert_bitwise_equal(a[0], part, f"{name}: sequence {b} of {len(seqs)} alone vs packed")


def _bad_varlen(kind: str, n: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2 * n, 2, 64, generator=g).bfloat16() for _ in range(3))
    cu = torch.tensor([0, n, 2 * n], dtype=torch.int32)
    a = det_attn.attention_varlen
    cases = {
        "cu_int64": (lambda: a(q, k, v, cu.long(), cu, n, n), TypeError, "must have dtype torch.int32"),
        "cu_not_monotone": (
            lambda: a(q, k, v, torch.tensor([0, 2 * n, n, 2 * n], dtype=torch.int32), cu, 2 * n, n),
            ValueError,
            "non-decreasing",
        ),
        "cu_end": (
            lambda: a(q, k, v, torch.tensor([0, n, 2 * n - 1], dtype=torch.int32), cu, n, n),
            ValueError,
            f"end at the token count {2 * n}",
        ),
        "cu_2d": (lambda: a(q, k, v, cu[None], cu, n, n), ValueError, "must be 1-D"),
        "sequence_counts": (
            lambda: a(q, k, v, cu, torch.tensor([0, 2 * n], dtype=torch.int32), n, 2 * n),
            ValueError,
            "they must match",
        ),
        "max_seqlen_small": (lambda: a(q, k, v, cu, cu, n - 1, n), ValueError, "is below the longest"),
        "max_seqlen_float": (
            lambda: a(q, k, v, cu, cu, float(n), n),
            TypeError,
            "max_seqlen_q must be an integer",
        ),
        "queries_without_keys": (
            lambda: a(q, k, v, cu, torch.tensor([0, 0, 2 * n], dtype=torch.int32), n, 2 * n),
            ValueError,
            "queries but no keys",
        ),
        "causal_short_keys": (
            lambda: a(  # n keys for n + 1 queries in sequence 0
                torch.cat([q, q[:2]]),
                k,
                v,
                torch.tensor([0, n + 1, 2 * n + 2], dtype=torch.int32),
                cu,
                n + 1,
                n,
                causal=True,
            ),
            ValueError,
            "causal attention needs every key length >= its query length",
        ),
        "no_tokens": (
            lambda: a(q[:0], k, v, torch.zeros(3, dtype=torch.int32), cu, 0, n),
            ValueError,
            "empty input",
        ),
        "rank": (
            lambda: a(q[None], k[None], v[None], cu, cu, n, n),
            ValueError,
            r"must be 3-D \(total_tokens, H, D\)",
        ),
    }
    return cases[kind]


@pytest.mark.parametrize(
    "kind",
    [
        "cu_int64",
        "cu_not_monotone",
        "cu_end",
        "cu_2d",
        "sequence_counts",
        "max_seqlen_small",
        "max_seqlen_float",
        "queries_without_keys",
        "causal_short_keys",
        "no_tokens",
        "rank",
    ],
)
@_settings(3)
@given(
    n=st.sampled_from([1, 2, 17]),
)
def test_attention_varlen_bad_input_raises_a_clear_error(kind, n):
    call, error, match = _bad_varlen(kind, n)
    with pytest.raises(error, match=match):
        call()
