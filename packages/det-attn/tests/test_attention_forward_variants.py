"""The forward kernel's switches (``_configs.Config`` fields ``fwd_tma``, host TMA
descriptors, and ``fwd_maxnreg``, a register cap; kernel in ``_fwd_kernel``) on CPU through the
Triton interpreter, applied to the interpreter's config row (blocks of 32 queries x 16 keys).

Both must give the pointer loads' O and LSE bits on every input (padded and packed, causal and
not, GQA, ragged tiles, dropout), which carries every invariance the pointer path is tested for
over to them; the row invariances (packing, position inside a tile) are also checked on the
descriptor path directly. The interpreter ignores ``maxnreg`` (a ptxas option): here it checks the
plumbing (the cap reaches the launch, and is dropped with dropout); the GPU side (same bits there,
speed) is ``tests/test_attention_gpu.py`` and ``benchmarks/ablate_attention.py --forward``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from det_attn import _configs, _descriptors, _plans, attention, attention_varlen
from det_core.testing import assert_bitwise_equal, contiguous_splits

D = 64
BIT_NEUTRAL = {  # on the interpreter row, which has pointer loads and no register cap
    "tma-host": {"fwd_tma": True},
    "tma-host r128": {"fwd_tma": True, "fwd_maxnreg": 128},
    "pointers r128": {"fwd_maxnreg": 128},  # the cap is not applied to pointer loads
    # the pointer loads' own tiles: 16 query rows per program (the row: 32), 2 warps, a cap
    "pointer tiles": {"fwd_pointers": (16, 2, 1, 96)},
    "tma-host + pointer tiles": {"fwd_tma": True, "fwd_maxnreg": 128, "fwd_pointers": (16, 2, 1, 96)},
}


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


def _qkv(batch, t_q, t_k, h_q, h_kv, seed=0):
    return (
        _randn(batch, t_q, h_q, D, seed=seed),
        _randn(batch, t_k, h_kv, D, seed=seed + 1),
        _randn(batch, t_k, h_kv, D, seed=seed + 2),
    )


def _use(monkeypatch, **change):
    """Run the interpreter's row with ``change`` applied, with an empty plan cache (so
    ``_plans.PLANS`` then holds this config's plans only)."""
    cfg = dataclasses.replace(_configs.INTERPRETER_CONFIG, **change)
    monkeypatch.setattr(_configs, "INTERPRETER_CONFIG", cfg)
    monkeypatch.setattr(_plans, "PLANS", type(_plans.PLANS)())


def _cases():
    """(name, thunk) pairs: each thunk runs one forward call and returns (o, lse)."""
    dense_causal = _qkv(2, 45, 51, 2, 1, seed=10)  # cross lengths: bottom-right diagonal, GQA
    dense_full = _qkv(1, 37, 53, 2, 1, seed=20)  # ragged last tiles
    lengths = [(1, 1), (40, 47), (17, 17), (33, 40)]  # a one-token sequence, tails across tiles
    seqs = [_qkv(1, tq, tk, 2, 2, seed=30 + i) for i, (tq, tk) in enumerate(lengths)]
    packed = [torch.cat([s[j][0] for s in seqs]) for j in range(3)]
    cu_q = torch.tensor([0, *torch.tensor([tq for tq, _ in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([tk for _, tk in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    max_q, max_k = max(tq for tq, _ in lengths), max(tk for _, tk in lengths)
    return [
        ("dense causal", lambda: attention(*dense_causal, causal=True, return_lse=True)),
        ("dense non-causal", lambda: attention(*dense_full, return_lse=True)),
        (
            "dense causal dropout",
            lambda: attention(*dense_causal, causal=True, dropout_p=0.2, seed=9, return_lse=True),
        ),
        (
            "packed causal",
            lambda: attention_varlen(*packed, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True),
        ),
    ]


@pytest.fixture(scope="module")
def table_outputs():
    """The cases and the table's (o, lse) for each (computed once for every variant)."""
    cases = _cases()
    return cases, {name: run() for name, run in cases}


@pytest.mark.parametrize("variant", list(BIT_NEUTRAL))
def test_bit_neutral_forward_variant_gives_table_bits(variant, table_outputs, monkeypatch):
    cases, want = table_outputs
    _use(monkeypatch, **BIT_NEUTRAL[variant])
    for name, run in cases:
        o, lse = run()
        assert_bitwise_equal(o, want[name][0], f"o: {variant}, {name}")
        assert_bitwise_equal(lse, want[name][1], f"lse: {variant}, {name}")
    # the variant ran (not a fallback): its plans carry its switches
    plans = list(_plans.PLANS.values())
    change = BIT_NEUTRAL[variant]
    assert plans
    # host descriptors serve the padded calls, packed ones take the pointer loads
    assert {plan.fwd_tma for plan in plans} == ({True, False} if change.get("fwd_tma") else {False})
    # the register caps reach their launches without dropout, and only them; the pointer loads
    # take their own tiles where the config gives them
    cap = change.get("fwd_maxnreg")
    block_m, warps, _, pointer_cap = change.get("fwd_pointers") or (32, 1, 1, None)
    for plan in plans:
        dropout = plan.fwd.meta["DROPOUT"]
        if plan.fwd_tma:
            assert plan.fwd.meta.get("maxnreg") == (None if dropout else cap)
            assert (plan.fwd.meta["BLOCK_M"], plan.fwd.meta["num_warps"]) == (32, 1)
        else:
            assert plan.fwd is plan.fwd_pointers
        pointers = plan.fwd_pointers.meta
        assert pointers.get("maxnreg") == (None if dropout else pointer_cap)
        assert (pointers["BLOCK_M"], pointers["num_warps"]) == (block_m, warps)
        tiles, heads = plan.fwd_pointers.sizes[:2]
        assert plan.fwd_pointers.grid[0] == tiles * heads


def test_host_descriptor_path_keeps_packing_and_tile_position_invariance(monkeypatch):
    # directly on the descriptor path: a sequence packed beside neighbours that grow across tile
    # boundaries (pointer loads) equals it alone in a padded batch (descriptors); causal query
    # chunks starting off the tile grid (context parallelism: a row sits elsewhere in its tile)
    # keep the rows' bits
    _use(monkeypatch, fwd_tma=True)
    anchor = _qkv(1, 29, 35, 2, 1, seed=300)
    alone = attention(*anchor, causal=True, return_lse=True)
    for before in (15, 16, 17, 31, 32, 33):
        seqs = [_qkv(1, before, before + 3, 2, 1, seed=before), anchor]
        q, k, v = (torch.cat([s[j][0] for s in seqs]) for j in range(3))
        cu_q = torch.tensor([0, before, before + 29], dtype=torch.int32)
        cu_k = torch.tensor([0, before + 3, before + 3 + 35], dtype=torch.int32)
        o, lse = attention_varlen(
            q, k, v, cu_q, cu_k, max(before, 29), max(before + 3, 35), causal=True, return_lse=True
        )
        assert_bitwise_equal(o[before:], alone[0][0], f"o: neighbour of {before}")
        assert_bitwise_equal(lse[:, before:], alone[1][0], f"lse: neighbour of {before}")
    t = 61
    q, k, v = _qkv(1, t, t, 2, 1, seed=500)
    o, lse = attention(q, k, v, causal=True, return_lse=True)
    for parts in (2, 3, 4):
        for i, (lo, hi) in enumerate(contiguous_splits(t - 1, parts)):
            lo, hi = lo + (i > 0), hi + 1  # chunk edges off the tile grid
            co, clse = attention(q[:, lo:hi], k[:, :hi], v[:, :hi], causal=True, return_lse=True)
            assert_bitwise_equal(co, o[:, lo:hi], f"o: {parts} chunks, {lo}:{hi}")
            assert_bitwise_equal(clse, lse[:, :, lo:hi], f"lse: {parts} chunks, {lo}:{hi}")
    assert any(plan.fwd_tma for plan in _plans.PLANS.values())


def test_host_descriptors_fall_back_to_pointers_with_the_same_bits(monkeypatch):
    # where descriptors cannot serve a call, the pointer loads do, with the same bits: inputs not
    # 16-byte aligned (checked per call), and a Triton without host descriptors (checked per plan)
    q, k, v = _qkv(2, 45, 51, 2, 1, seed=10)
    want = attention(q, k, v, causal=True, return_lse=True)
    _use(monkeypatch, fwd_tma=True)

    def unaligned(t):  # the same values, 2 bytes past a 16-byte boundary
        buf = torch.empty(t.numel() + 1, dtype=t.dtype)
        return buf[1:].view(t.shape).copy_(t)

    with monkeypatch.context() as m:
        m.setattr(_descriptors.DescriptorTemplate, "__call__", None)  # a descriptor built would fail
        got = attention(unaligned(q), k, v, causal=True, return_lse=True)
    for name, a, b in zip(("o", "lse"), got, want, strict=True):
        assert_bitwise_equal(a, b, f"{name}: unaligned q")
    assert [plan.fwd_tma for plan in _plans.PLANS.values()] == [True]  # the plan would take descriptors
    monkeypatch.setattr(_descriptors, "_HAS_HOST_DESCRIPTORS", False)
    _use(monkeypatch)  # plans made anew
    got = attention(q, k, v, causal=True, return_lse=True)
    for name, a, b in zip(("o", "lse"), got, want, strict=True):
        assert_bitwise_equal(a, b, f"{name}: no host descriptors")
    assert [plan.fwd_tma for plan in _plans.PLANS.values()] == [False]


def test_forward_without_autograd_equals_autograd_forward():
    # attention() skips autograd when no gradient can flow (no_grad, or no input requires one):
    # the same launch, the same bits as the forward inside autograd
    q, k, v = _qkv(2, 45, 51, 4, 2, seed=10)
    with torch.no_grad():
        o_ng, lse_ng = attention(q, k, v, causal=True, return_lse=True)
    o_plain, lse_plain = attention(q, k, v, causal=True, return_lse=True)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o_ag, lse_ag = attention(qg, kg, vg, causal=True, return_lse=True)
    assert o_ag.requires_grad and not o_ng.requires_grad and not o_plain.requires_grad
    for o, lse, name in ((o_ng, lse_ng, "no_grad"), (o_plain, lse_plain, "no input requires grad")):
        assert_bitwise_equal(o, o_ag.detach(), f"o: {name}")
        assert_bitwise_equal(lse, lse_ag, f"lse: {name}")


def test_scaled_scores_below_2_31_stay_finite_and_far_beyond_can_turn_nan():
    """The documented limit of ``softmax_scale`` (attention's docstring): scores times the scale in
    base 2 below ``2**31`` in magnitude give finite rows; at ``2**34`` the exp2 of the fma's rounding
    error (half an fp32 ULP of the row maximum) overflows and a row turns NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1, 64, generator=g).bfloat16() for _ in range(3))
    peak = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()).abs().max().item() * math.log2(math.e)
    for exponent in (20, 30):
        assert torch.isfinite(attention(q, k, v, softmax_scale=2.0**exponent / peak)).all(), exponent
    assert not torch.isfinite(attention(q, k, v, softmax_scale=2.0**34 * 1.0001 / peak)).all()
