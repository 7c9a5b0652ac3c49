"""det_attn on a CUDA GPU at real sizes (H200: 132 SMs). No GPU work at import.

Run: python -m pytest packages/det-attn/tests/test_attention_gpu.py -m gpu -q
"""

from __future__ import annotations

import math

import pytest
import torch
from det_attn import attention, attention_varlen
from det_attn.reference import attention_reference, dropout_keep_mask
from det_core.testing import assert_bitwise_equal, contiguous_splits, digest, run_in_fresh_process

pytestmark = pytest.mark.gpu

NAMES = ("o", "lse", "dq", "dk", "dv")


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _qkv(batch, t_q, t_k, h_q, h_kv, d, dtype=torch.bfloat16, seed=0):
    return (
        _randn(batch, t_q, h_q, d, dtype=dtype, seed=seed),
        _randn(batch, t_k, h_kv, d, dtype=dtype, seed=seed + 1),
        _randn(batch, t_k, h_kv, d, dtype=dtype, seed=seed + 2),
    )


def _fwd_bwd(fn, q, k, v, do, *args, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v, *args, return_lse=True, **kwargs)
    o.backward(do)
    return o.detach(), lse, q.grad, k.grad, v.grad


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    int_dtype = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(int_dtype), b.contiguous().view(int_dtype))


# (B, T, H_q, H_kv, D, causal, dropout): B*H*tiles well above 132 SMs in every kernel
RUN_TO_RUN_CASES = [
    (2, 2048, 16, 8, 128, True, 0.0),
    (4, 1024, 8, 8, 64, False, 0.1),
    (2, 1537, 32, 4, 128, True, 0.0),
]


@pytest.mark.parametrize(
    "case",
    RUN_TO_RUN_CASES,
    ids=lambda c: "B{}T{}H{}/{}D{}{}{}".format(
        c[0], c[1], c[2], c[3], c[4], "-causal" if c[5] else "", "-drop" if c[6] else ""
    ),
)
def test_run_to_run_100_repeats(case):
    batch, t, h_q, h_kv, d, causal, p = case
    q, k, v = _qkv(batch, t, t, h_q, h_kv, d, seed=1)
    do = _randn(batch, t, h_q, d, seed=2)
    kw = {"causal": causal, "dropout_p": p, "seed": 7 if p else None}
    first = _fwd_bwd(attention, q, k, v, do, **kw)
    for r in range(100):
        got = _fwd_bwd(attention, q, k, v, do, **kw)
        for name, g, f in zip(NAMES, got, first, strict=True):
            if not _same_bits(g, f):
                assert_bitwise_equal(g, f, f"{name} repeat {r}")


def test_fresh_process_cold_cache_same_digest():
    code = """
import torch
from det_core.testing import digest
from det_attn import attention
g = torch.Generator(device="cuda").manual_seed(0)
shape = (2, 1000, 8, 128)
q, k, v = (torch.randn(shape, generator=g, device="cuda").bfloat16().requires_grad_() for _ in range(3))
o, lse = attention(q, k, v, causal=True, return_lse=True)
o.backward(torch.ones_like(o))
print(digest([o, lse, q.grad, k.grad, v.grad]))
"""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 1000, 8, 128, generator=g, device="cuda").bfloat16().requires_grad_() for _ in range(3)
    )
    o, lse = attention(q, k, v, causal=True, return_lse=True)
    o.backward(torch.ones_like(o))
    assert run_in_fresh_process(code) == digest([o, lse, q.grad, k.grad, v.grad])


# The launch paths' cases: host descriptors (D128, D64), the pointer loads (inputs not 16-byte
# aligned), packed sequences, dropout (its launches unbound: launch), all with backward.
_LAUNCH_PATH_CASES = """
import torch
from det_core.testing import digest
from det_attn import attention, attention_varlen


def grads(fn, q, k, v, *args, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # detach: keeps the address
    o, lse = fn(q, k, v, *args, return_lse=True, **kw)
    o.backward(torch.ones_like(o))
    return [o, lse, q.grad, k.grad, v.grad]


def run_cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for d in (64, 128):
        q, k, v = (torch.randn(2, 1000, 8, d, generator=g, device="cuda").bfloat16() for _ in range(3))
        out += grads(attention, q, k, v, causal=True)
        out += grads(attention, q, k, v, dropout_p=0.1, seed=3)
        buf = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
        out += grads(attention, buf[1:].view(q.shape).copy_(q), k, v, causal=True)
        cu = torch.tensor([0, 700, 2000], dtype=torch.int32, device="cuda")
        flat = (t.flatten(0, 1) for t in (q, k, v))
        out += grads(attention_varlen, *flat, cu, cu, 1300, 1300, causal=True)
    return out
"""


def test_bound_launches_give_the_bits_of_tritons_launch():
    # a warm call launches through the plans' BoundLaunch objects (dropout: launch)
    # on their direct path; DET_DIRECT_LAUNCH=0 makes a fresh process launch with kernel[grid]
    namespace = {}
    exec(_LAUNCH_PATH_CASES, namespace)  # noqa: S102 - the same code as the child's
    namespace["run_cases"]()  # compiles: the first launch of each key goes through kernel[grid]
    warm = digest(namespace["run_cases"]())
    code = _LAUNCH_PATH_CASES + "\nprint(digest(run_cases()))\n"
    assert run_in_fresh_process(code, cold_triton_cache=False, env={"DET_DIRECT_LAUNCH": "0"}) == warm


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_alone_equals_sequence_in_batch(d, causal):
    t, h_q, h_kv = 1000, 8, 2  # 1000: not a multiple of any block size
    anchor = (*_qkv(1, t, t, h_q, h_kv, d, seed=100), _randn(1, t, h_q, d, seed=101))
    alone = _fwd_bwd(attention, *anchor, causal=causal)
    for batch in range(1, 9):
        positions = sorted({0, batch // 2, batch - 1})
        q, k, v = _qkv(batch, t, t, h_q, h_kv, d, seed=batch)
        do = _randn(batch, t, h_q, d, seed=50 + batch)
        for pos in positions:
            for full, one in zip((q, k, v, do), anchor, strict=True):
                full[pos] = one[0]
        got = _fwd_bwd(attention, q, k, v, do, causal=causal)
        for pos in positions:
            for name, g_, a in zip(NAMES, got, alone, strict=True):
                assert_bitwise_equal(g_[pos : pos + 1], a, f"{name}: B={batch}, pos={pos}")


@pytest.mark.parametrize("d", [64, 128])
def test_packed_sequence_equals_sequence_alone(d):
    # neighbours of many lengths before and after, growing across 32/64/128-token tile edges
    h_q, h_kv, t_q, t_k = 8, 2, 1500, 1700
    anchor = (*_qkv(1, t_q, t_k, h_q, h_kv, d, seed=300), _randn(1, t_q, h_q, d, seed=301))
    for causal in (False, True):
        kw = (
            {"causal": causal, "dropout_p": 0.1, "seed": 5} if causal else {"causal": False}
        )  # fewer compiles
        alone = _fwd_bwd(attention, *anchor[:3], anchor[3], sequence_offset=1, **kw)
        for before, after in (
            (1, 0),
            (31, 127),
            (32, 128),
            (33, 129),
            (127, 1),
            (128, 4097),
            (129, 64),
            (4000, 3),
        ):
            lens_q = [before, t_q, after]
            lens_k = [before + 7, t_k, after]
            parts = [_qkv(1, lq, lk, h_q, h_kv, d, seed=lq) for lq, lk in zip(lens_q, lens_k, strict=True)]
            parts[1] = anchor[:3]
            q = torch.cat([p_[0][0] for p_ in parts])
            k = torch.cat([p_[1][0] for p_ in parts])
            v = torch.cat([p_[2][0] for p_ in parts])
            do = torch.cat([_randn(before, h_q, d, seed=9), anchor[3][0], _randn(after, h_q, d, seed=10)])
            cu_q = torch.tensor([0, before, before + t_q, sum(lens_q)], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor(
                [0, lens_k[0], lens_k[0] + t_k, sum(lens_k)], dtype=torch.int32, device="cuda"
            )
            got = _fwd_bwd(attention_varlen, q, k, v, do, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
            sq, sk = slice(before, before + t_q), slice(lens_k[0], lens_k[0] + t_k)
            where = f"causal={causal}, neighbours {before}, {after}"
            assert_bitwise_equal(got[0][sq], alone[0][0], f"o: {where}")
            assert_bitwise_equal(got[1][:, sq], alone[1][0], f"lse: {where}")
            assert_bitwise_equal(got[2][sq], alone[2][0], f"dq: {where}")
            assert_bitwise_equal(got[3][sk], alone[3][0], f"dk: {where}")
            assert_bitwise_equal(got[4][sk], alone[4][0], f"dv: {where}")


def test_heads_split_across_ranks_reproduce_unsplit():
    h_q, h_kv, d = 16, 4, 128
    group = h_q // h_kv
    q, k, v = _qkv(2, 2048, 2048, h_q, h_kv, d, seed=400)
    do = _randn(2, 2048, h_q, d, seed=401)
    kw = {"causal": True, "dropout_p": 0.1, "seed": 3}
    whole = _fwd_bwd(attention, q, k, v, do, **kw)
    for parts in (2, 3, 4):
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
        got = (torch.cat(o, 2), torch.cat(lse, 1), torch.cat(dq, 2), torch.cat(dk, 2), torch.cat(dv, 2))
        for name, g_, w in zip(NAMES, got, whole, strict=True):
            assert_bitwise_equal(g_, w, f"{name}: {parts} ranks")


# Forward BLOCK_M is 128 at D=64 and D=128, dQ BLOCK_M 64 and 128: chunk starts on multiples of
# 128 put every query row at the same place in the same tiles as the undivided run.
CP_TILE = 128


def _check_context_parallel(t, d, edges_of):
    q, k, v = _qkv(1, t, t, 16, 4, d, seed=500)
    do = _randn(1, t, 16, d, seed=501)
    o, lse, dq, dk, dv = _fwd_bwd(attention, q, k, v, do, causal=True)
    for parts in (2, 3, 4):
        edges = edges_of(t, parts)
        assert edges[0][0] == 0 and edges[-1][1] == t
        dk_sum = torch.zeros_like(dk, dtype=torch.float32)
        for lo, hi in edges:
            co, clse, cdq, cdk, _ = _fwd_bwd(
                attention, q[:, lo:hi], k[:, :hi], v[:, :hi], do[:, lo:hi], causal=True
            )
            assert_bitwise_equal(co, o[:, lo:hi], f"o: {parts} ranks, chunk {lo}:{hi}")
            assert_bitwise_equal(clse, lse[:, :, lo:hi], f"lse: {parts} ranks, chunk {lo}:{hi}")
            assert_bitwise_equal(cdq, dq[:, lo:hi], f"dq: {parts} ranks, chunk {lo}:{hi}")
            dk_sum[:, :hi] += cdk.float()
        assert (dk_sum - dk.float()).abs().max().item() <= 2**-6 * dk.float().abs().max().item()


@pytest.mark.parametrize("d", [64, 128])
def test_context_parallel_aligned_chunks_keep_o_lse_dq_bits(d):
    # chunk starts on multiples of 128 (the documented condition); 3 parts give unequal chunks
    def edges(t, parts):
        return [(lo * CP_TILE, hi * CP_TILE) for lo, hi in contiguous_splits(t // CP_TILE, parts)]

    _check_context_parallel(4096, d, edges)


def test_context_parallel_unaligned_chunks_keep_o_lse_dq_bits():
    # chunk starts off the tile grid (2061 = 16 * 128 + 13): a row sits elsewhere in its tile and
    # some of its key blocks switch between the masked and the unmasked loop. Holds only because
    # both loops do the same arithmetic on a visible score (explicit fma, see _fwd_kernel._softmax_step).
    def edges(t, parts):
        return [
            (lo + 13 * (i > 0), hi + 13 * (i < parts - 1))
            for i, (lo, hi) in enumerate(contiguous_splits(t, parts))
        ]

    _check_context_parallel(4096, 128, edges)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_error_vs_fp64_at_most_twice_sdpa_flash(d, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(2, 1024, 1024, 8, 8, d, seed=600)
    do = _randn(2, 1024, 8, d, seed=601)
    ours = _fwd_bwd(attention, q, k, v, do, causal=causal)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, rlse = attention_reference(qr, kr, vr, causal=causal)
    ro.backward(do.double())
    ref = (ro.detach(), qr.grad, kr.grad, vr.grad)
    qs, ks, vs = (t.detach().transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        so = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    so.backward(do.transpose(1, 2))
    sdpa = [t.transpose(1, 2) for t in (so.detach(), qs.grad, ks.grad, vs.grad)]
    for name, a, s, r in zip(("o", "dq", "dk", "dv"), (ours[0], *ours[2:]), sdpa, ref, strict=True):
        err = (a.double() - r).abs().max().item()
        sdpa_err = (s.double() - r).abs().max().item()
        assert err <= 2 * sdpa_err, f"{name}: error {err:.3g} > 2 x SDPA flash error {sdpa_err:.3g}"
    assert (ours[1].double() - rlse).abs().max().item() < 1e-4


# forward switches of _configs.Config expected to keep the table's bits (the ablation,
# benchmarks/ablate_attention.py --forward, times them; CPU tests check them on the interpreter)
FWD_VARIANTS = {
    "pointers": {"fwd_tma": False},  # instead of host TMA descriptors (and no register cap)
    "no register cap": {"fwd_maxnreg": 0},  # D128's cap of 128 off (D64 has none)
}


@pytest.mark.parametrize("variant", list(FWD_VARIANTS))
def test_bit_neutral_forward_variants_give_table_bits(variant, monkeypatch):
    # padded (D128 causal GQA with cross lengths, D64 non-causal) and packed (ragged neighbours)
    import dataclasses

    from det_attn import _configs

    dense128 = _qkv(2, 1537, 1600, 32, 4, 128, seed=800)
    dense64 = _qkv(2, 1000, 1000, 16, 16, 64, seed=801)
    lens = [1, 700, 129, 1537]
    parts = [_qkv(1, n, n, 8, 2, 128, seed=802 + n) for n in lens]
    packed = [torch.cat([p_[j][0] for p_ in parts]) for j in range(3)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    calls = {
        "dense D128 causal": lambda: attention(*dense128, causal=True, return_lse=True),
        "dense D64": lambda: attention(*dense64, return_lse=True),
        "packed D128 causal": lambda: attention_varlen(
            *packed, cu, cu, max(lens), max(lens), causal=True, return_lse=True
        ),
        "dense D128 causal dropout": lambda: attention(
            *dense128, causal=True, dropout_p=0.1, seed=3, return_lse=True
        ),
    }
    want = {name: call() for name, call in calls.items()}
    for d in (64, 128):
        monkeypatch.setitem(
            _configs.GPU_CONFIGS, d, dataclasses.replace(_configs.GPU_CONFIGS[d], **FWD_VARIANTS[variant])
        )
    for name, call in calls.items():
        for repeat in range(2):
            o, lse = call()
            assert_bitwise_equal(o, want[name][0], f"o: {variant}, {name}, run {repeat}")
            assert_bitwise_equal(lse, want[name][1], f"lse: {variant}, {name}, run {repeat}")


def test_gqa_fp16_and_cross_attention_match_reference():
    for dtype, tol in ((torch.float16, 2**-8), (torch.bfloat16, 2**-5)):
        q, k, v = _qkv(2, 700, 1300, 16, 2, 128, dtype=dtype, seed=700)
        do = _randn(2, 700, 16, 128, dtype=dtype, seed=701)
        for causal in (False, True):
            o, lse, dq, dk, dv = _fwd_bwd(attention, q, k, v, do, causal=causal)
            qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
            ro, rlse = attention_reference(qr, kr, vr, causal=causal)
            ro.backward(do.double())
            for name, a, r in (("o", o, ro), ("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
                assert (a.double() - r).abs().max().item() <= tol * r.abs().max().item(), f"{dtype} {name}"


# (B, T_q, T_k, H_q, H_kv, D, causal, window, softcap): a window under one tile, one across many,
# cross lengths (bottom-right), soft-cap alone (not causal), both (Gemma 2's 4096 window scaled
# down, its soft-cap 50)
WINDOW_CASES = [
    (2, 1537, 1537, 16, 4, 128, True, 64, None),
    (2, 2048, 2048, 8, 8, 64, True, 1000, 50.0),
    (1, 700, 1300, 16, 2, 128, True, 300, 30.0),
    (2, 1024, 1024, 8, 2, 128, False, None, 20.0),
]


@pytest.mark.parametrize(
    "case", WINDOW_CASES, ids=lambda c: "T{}/{}D{}w{}cap{}".format(c[1], c[2], c[5], *c[7:])
)
def test_window_and_softcap_match_reference_and_repeat_bitwise(case):
    batch, t_q, t_k, h_q, h_kv, d, causal, window, softcap = case
    q, k, v = _qkv(batch, t_q, t_k, h_q, h_kv, d, seed=900)
    q = (q.float() * 4).to(q.dtype)  # scores of tens of units: the soft-cap bends them
    do = _randn(batch, t_q, h_q, d, seed=901)
    kw = dict(causal=causal, window=window, softcap=softcap)
    got = _fwd_bwd(attention, q, k, v, do, **kw)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, rlse = attention_reference(qr, kr, vr, **kw)
    ro.backward(do.double())
    for name, a, r in zip(
        ("o", "dq", "dk", "dv"), (got[0], *got[2:]), (ro, qr.grad, kr.grad, vr.grad), strict=True
    ):
        assert (a.double() - r).abs().max().item() <= 2**-5 * r.abs().max().item(), f"{case} {name}"
    assert (got[1].double() - rlse).abs().max().item() < 1e-4
    for r in range(10):
        again = _fwd_bwd(attention, q, k, v, do, **kw)
        for name, g, f in zip(NAMES, again, got, strict=True):
            if not _same_bits(g, f):
                assert_bitwise_equal(g, f, f"{name} repeat {r}")


@pytest.mark.parametrize("d", [64, 128])
def test_window_softcap_sequence_alone_equals_batched_and_packed(d):
    kw = dict(causal=True, window=257, softcap=50.0)
    lens = [1, 700, 129, 1537]
    parts = [(*_qkv(1, n, n, 8, 2, d, seed=910 + n), _randn(1, n, 8, d, seed=920 + n)) for n in lens]
    alone = [_fwd_bwd(attention, *p, **kw) for p in parts]
    packed = [torch.cat([p[j][0] for p in parts]) for j in range(4)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    o, lse, dq, dk, dv = _fwd_bwd(
        attention_varlen, *packed[:3], packed[3], cu, cu, max(lens), max(lens), **kw
    )
    for i, n in enumerate(lens):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        for name, g, a in zip(
            NAMES, (o[rows], lse[:, rows], dq[rows], dk[rows], dv[rows]), alone[i], strict=True
        ):
            assert_bitwise_equal(g, a[0], f"{name}: packed sequence {i} (T={n})")
    # the 1537-token sequence at position 2 of a batch of 4
    q, k, v = _qkv(4, 1537, 1537, 8, 2, d, seed=930)
    do = _randn(4, 1537, 8, d, seed=931)
    for full, one in zip((q, k, v, do), parts[3], strict=True):
        full[2] = one[0]
    got = _fwd_bwd(attention, q, k, v, do, **kw)
    for name, g, a in zip(NAMES, got, alone[3], strict=True):
        assert_bitwise_equal(g[2:3], a, f"{name}: batch of 4, position 2")


def test_window_covering_the_sequence_gives_the_causal_bits():
    q, k, v = _qkv(2, 1537, 1537, 16, 4, 128, seed=940)
    do = _randn(2, 1537, 16, 128, seed=941)
    want = _fwd_bwd(attention, q, k, v, do, causal=True)
    got = _fwd_bwd(attention, q, k, v, do, causal=True, window=4096)
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert_bitwise_equal(g, w, f"{name}: window 4096 vs causal")


def test_dropout_mask_equals_reference_and_keep_rate():
    batch, t, heads, d, p, seed = 2, 128, 4, 128, 0.15, 1  # seed 1: Triton specialises ints equal to 1
    q = torch.zeros(batch, t, heads, d, dtype=torch.bfloat16, device="cuda")
    v = (
        torch.eye(t, dtype=torch.bfloat16, device="cuda")[None, :, None, :]
        .expand(batch, t, heads, d)
        .contiguous()
    )
    o = attention(q, torch.zeros_like(v), v, dropout_p=p, seed=seed)
    got = (o != 0).permute(0, 2, 1, 3)
    ref = torch.stack(
        [
            torch.stack([dropout_keep_mask(seed, b, h, t, t, p, "cuda") for h in range(heads)])
            for b in range(batch)
        ]
    )
    assert torch.equal(got, ref)
    rate = got.double().mean().item()
    assert abs(rate - (1 - p)) < 4 * math.sqrt(p * (1 - p) / got.numel())


def test_transformers_attn_implementation():
    transformers = pytest.importorskip("transformers")
    import det_attn.transformers_integration as integ

    assert integ.register_transformers_attention()
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    logits = {}
    for impl in ("sdpa", "det_attn"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
        model.set_attn_implementation(impl)  # transformers >= 4.56 (the GPU machine has 5.x)
        out = model(ids, labels=ids)
        out.loss.backward()
        logits[impl] = out.logits.float()
    assert (logits["det_attn"] - logits["sdpa"]).abs().max().item() < 0.1


def test_transformers_forward_under_cuda_graph_capture_reads_no_positions():
    """Captured in a CUDA graph, the transformers function reads no position_ids from the device
    (a read is illegal while capturing): plain rows replay with eager's bits; a packed row would
    trip the device-side assertion instead of attending across its documents."""
    from det_attn.transformers_integration import det_attn_transformers_forward

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (t.transpose(1, 2) for t in _qkv(2, 64, 64, 4, 2, 64, seed=70))
    positions = torch.arange(64, device="cuda").expand(2, 64)

    def forward(position_ids):
        return det_attn_transformers_forward(module, q, k, v, None, position_ids=position_ids)[0]

    want = forward(positions)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(positions)  # warm-up outside the capture (launch plans)
    torch.cuda.current_stream().wait_stream(stream)
    unread = positions.clone()  # a tensor the eager calls never read: the capture must not either
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(unread)
    graph.replay()
    torch.cuda.synchronize()
    assert _same_bits(out, want)
