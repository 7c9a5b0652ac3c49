"""Errors a new user hit: torch SDPA's ``(B, H, T, D)`` tensors given to ``det_attn.attention``
(whose layout is ``(B, T, H, D)``) get the layout and the fix in the errors such a mix-up can trip;
the transformers function names transformers' layout; ``det_attn_seed`` does what its docstring
says. CPU through the Triton interpreter, tiny sizes."""

import pytest
import torch
import torch.nn.functional as F
from det_attn import attention, scaled_dot_product_attention
from det_attn.transformers_integration import det_attn_transformers_forward
from det_core.testing import assert_bitwise_equal

D = 64
LAYOUT = r"q, k, v are read as \(B, T, H, D\): torch SDPA's \(B, H, T, D\) tensors need \.transpose\(1, 2\)"


def _randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def test_sdpa_layout_given_to_attention_names_the_layout_and_the_fix():
    # (B, H, T, D) with H_q = 2, H_kv = 2, T_q = 3, T_k = 2: read as (B, T, H, D), H_q = 3, H_kv = 2
    q, k, v = _randn(1, 2, 3, D, seed=1), _randn(1, 2, 2, D, seed=2), _randn(1, 2, 2, D, seed=3)
    heads = r"query heads \(3\) must be a positive multiple of key/value heads \(2\) \(GQA/MQA\); "
    with pytest.raises(ValueError, match=heads + LAYOUT):
        attention(q, k, v)
    # the fix: the transposed views give torch SDPA's attention (fp32, to bf16 rounding), transposed
    got = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert got.shape == (1, 3, 2, D)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7)
    assert_bitwise_equal(got, scaled_dot_product_attention(q, k, v).transpose(1, 2), "det SDPA")
    # causal GQA in SDPA's layout (3 query heads, 1 KV head, T = 4): read as T_q = 3 > T_k = 1
    q, k, v = _randn(1, 3, 4, D, seed=4), _randn(1, 1, 4, D, seed=5), _randn(1, 1, 4, D, seed=6)
    with pytest.raises(ValueError, match=r"causal attention needs T_k >= T_q .*got 1 < 3; " + LAYOUT):
        attention(q, k, v, causal=True)
    got = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), rtol=2**-7, atol=2**-7)


def test_transformers_function_names_its_layout():
    module = torch.nn.Module()
    q = _randn(1, 2, 4, D, seed=7)  # transformers' (B, H, T, D)
    with pytest.raises(
        ValueError, match=r"query must be 4-D, transformers' \(B, H, T, D\) layout; got shape \(2, 4, 64\)"
    ):
        det_attn_transformers_forward(module, q[0], q, q, None)
    with pytest.raises(ValueError, match=r"value must be 4-D, transformers' \(B, H, T, D\) layout"):
        det_attn_transformers_forward(module, q, q, q.flatten(0, 1), None)
    out, weights = det_attn_transformers_forward(module, q, q, q, None)
    assert weights is None and out.shape == (1, 4, 2, D)  # returned in (B, T, H, D)
    assert_bitwise_equal(out, attention(*(q.transpose(1, 2),) * 3, causal=True), "transformers layout")


def test_det_attn_seed_is_the_dropout_seed_of_the_transformers_function():
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (_randn(2, 2, 8, D, seed=s) for s in (8, 9, 10))  # (B, H, T, D)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out, _ = det_attn_transformers_forward(module, q, k, v, None, dropout=0.25, det_attn_seed=7)
    # the call's sequences numbered from 0, heads from 0: attention's mask with that seed
    want = attention(qt, kt, vt, causal=True, dropout_p=0.25, seed=7, sequence_offset=0, head_offset=0)
    assert_bitwise_equal(out, want, "det_attn_seed=7")
    other, _ = det_attn_transformers_forward(module, q, k, v, None, dropout=0.25, det_attn_seed=8)
    assert not torch.equal(other, out)  # the seed keys the mask
    # without dropout (eval mode) a given seed is checked but not used
    plain, _ = det_attn_transformers_forward(module, q, k, v, None, dropout=0.0, det_attn_seed=7)
    assert_bitwise_equal(plain, attention(qt, kt, vt, causal=True), "no dropout")
    with pytest.raises(TypeError, match="det_attn_seed must be an integer"):
        det_attn_transformers_forward(module, q, k, v, None, dropout=0.0, det_attn_seed=7.0)


def test_sdpa_dropout_errors_name_scaled_dot_product_attention():
    # found by a new-user trial: they named det_attn.attention, which the user had not called
    q, k, v = (_randn(1, 2, 8, D, seed=s) for s in (11, 12, 13))  # (B, H, T, D)
    op = "det_attn.scaled_dot_product_attention: "
    with pytest.raises(
        ValueError, match=op + "dropout_p > 0 needs an explicit integer seed, the keyword seed="
    ):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=op + r"dropout_p must be in \[0, 1\), got 1.5"):
        scaled_dot_product_attention(q, k, v, dropout_p=1.5, seed=0)
    with pytest.raises(ValueError, match=op + r"seed must be in \[0, 2\*\*64\)"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1, seed=-1)
    # with its seed, attention's dropout on the transposed views
    got = scaled_dot_product_attention(q, k, v, dropout_p=0.25, seed=3)
    want = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.25, seed=3)
    assert_bitwise_equal(got, want.transpose(1, 2), "sdpa dropout, seed 3")


def test_register_transformers_attention_needs_a_non_empty_str_name():
    from det_attn import register_transformers_attention

    transformers = pytest.importorskip("transformers")
    for name, error in ((5, TypeError), (None, TypeError), ("", ValueError), ("  ", ValueError)):
        with pytest.raises(
            error, match=r"det_attn.register_transformers_attention: name must be a (non-empty )?str"
        ):
            register_transformers_attention(name)
        assert name not in transformers.AttentionInterface()  # nothing registered (5 was, returning True)
    assert register_transformers_attention() and "det_attn" in transformers.AttentionInterface()
