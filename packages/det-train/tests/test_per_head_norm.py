"""Per-head q/k norms (Qwen3's, Gemma 3's ``q_norm`` / ``k_norm``): an RMSNorm over ``head_dim``
whose rows are tokens x heads. The op's weight gradient against its documented order over such rows
(plain torch: chunk folds of rows, leaves of ``leaf_tokens * H`` rows, det_core's tree), micro-batch
cuts inside leaves, the module's head axis in both transformers layouts, the errors; converted
Qwen3 (GQA) and Gemma 3 (full attention) models: one batch and three micro-batches cut inside
leaves give bitwise the same gradient for every parameter. CPU through the Triton interpreter; a
``gpu`` test at a realistic Qwen3 size."""

import sys
from pathlib import Path

import det_train
import pytest
import torch
from det_core.reduce import TreePartial
from det_core.testing import assert_bitwise_equal
from det_train.accum._leaf_sums import sub_leaf_tokens
from det_train.accum.grad_accum import DEFAULT_LEAF_TOKENS, CanonicalGradAccumulator
from det_train.ops._rms_norm_kernels import MAX_ROWS_PER_CHUNK

sys.path.insert(0, str(Path(__file__).parent))
from _hf_micro_batches import split_grads  # noqa: E402


def _exact_rows(tokens, heads, d, seed):
    """x of +-2 (eps 0: x_hat = +-1 exactly, so dy * x_hat is exact and only the order of the sum
    decides its bits), dy random fp32; both ``(tokens, heads, d)``."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (tokens, heads, d), generator=g).float() * 2 - 1
    return 2.0 * sign, torch.randn(tokens, heads, d, generator=g), sign


def _reference_dweight(products, leaf_rows):
    """The documented order over rows ``products (M, D)`` (token-major, heads inner): leaves of
    ``leaf_rows`` rows; in a leaf, sub-leaves of ``sub_leaf_tokens(leaf_rows)`` rows, each the fold
    of its chunks (``rows_per_chunk`` rows folded in order) in chunk order; sub-leaves and leaves
    combined by the canonical tree (det_core.reduce.TreePartial; a short leaf, its present ones)."""
    sub = sub_leaf_tokens(leaf_rows)
    chunk = MAX_ROWS_PER_CHUNK
    while sub % chunk:
        chunk //= 2
    ratio = leaf_rows // sub
    subs = []
    for s in range(0, products.shape[0], sub):
        acc = torch.zeros(products.shape[1])
        for c in range(s, min(s + sub, products.shape[0]), chunk):
            part = torch.zeros(products.shape[1])
            for row in products[c : min(c + chunk, s + sub, products.shape[0])]:
                part = part + row
            acc = acc + part
        subs.append(acc)
    leaves = []
    for first in range(0, len(subs), ratio):
        group = subs[first : first + ratio]
        leaves.append(TreePartial().add_leaves(0, torch.stack(group)).result(len(group)))
    return TreePartial().add_leaves(0, torch.stack(leaves)).result(len(leaves))


def _deposited(x, dy, w0, heads, leaf, cuts):
    w = w0.clone().requires_grad_()
    acc = CanonicalGradAccumulator([("norm.weight", w)], leaf_tokens=leaf)
    for start, end in cuts:
        with acc.micro_batch(token_offset=start):
            det_train.rms_norm(x[start:end], w, 0.0, rows_per_token=heads).backward(dy[start:end])
    acc.reduce(total_tokens=x.shape[0])
    return w.grad


@pytest.mark.parametrize(("heads", "leaf"), [(3, 4), (4, 8), (2, 5)])
def test_rows_of_tokens_x_heads_deposit_the_canonical_token_order(heads, leaf):
    tokens, d = 4 * leaf + 3, 16  # a short last leaf
    x, dy, sign = _exact_rows(tokens, heads, d, seed=heads)
    w0 = torch.randn(d, generator=torch.Generator().manual_seed(7))
    want = _reference_dweight((dy * sign).reshape(-1, d), leaf * heads)
    whole = _deposited(x, dy, w0, heads, leaf, [(0, tokens)])
    assert_bitwise_equal(whole, want, f"dweight, {heads} heads, leaf {leaf}: the documented order")
    for cuts in (
        [(0, 1), (1, leaf + 2), (leaf + 2, tokens)],
        [(0, leaf - 1), (leaf - 1, 2 * leaf + 1), (2 * leaf + 1, tokens)],
    ):
        got = _deposited(x, dy, w0, heads, leaf, cuts)  # every cut inside a leaf
        assert_bitwise_equal(got, want, f"dweight, {heads} heads, leaf {leaf}, cuts {cuts}")
    # without an accumulator: one call, leaves of DEFAULT_LEAF_TOKENS tokens
    w = w0.clone().requires_grad_()
    det_train.rms_norm(x, w, 0.0, rows_per_token=heads).backward(dy)
    want = _reference_dweight((dy * sign).reshape(-1, d), DEFAULT_LEAF_TOKENS * heads)
    assert_bitwise_equal(w.grad, want, "dweight without accumulator")


def test_module_heads_take_both_transformers_layouts_bitwise():
    """(B, T, H, D) (Qwen3: the norm before the transpose) and its transposed view (B, H, T, D)
    (Gemma 3: after it) give the same y, dX and deposited dweight bits, one token's heads in order."""
    b, t, h, d = 2, 5, 3, 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, t, h, d, generator=g).bfloat16()
    dy = torch.randn(b, t, h, d, generator=g).bfloat16()
    norm = det_train.RMSNorm(d, eps=1e-6, heads=h, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g))
    results = []
    for transpose in (False, True):
        xi = x.clone().requires_grad_()
        acc = CanonicalGradAccumulator([norm.weight], leaf_tokens=4)
        with acc.micro_batch(token_offset=0):
            inp = xi.transpose(1, 2) if transpose else xi
            y = norm(inp)
            assert y.shape == inp.shape
            y.backward(dy.transpose(1, 2) if transpose else dy)
        acc.reduce(total_tokens=b * t)
        results.append((y.transpose(1, 2) if transpose else y, xi.grad, norm.weight.grad))
        norm.weight.grad = None
    for got, want, what in zip(results[1], results[0], ("y", "dX", "dweight"), strict=True):
        assert_bitwise_equal(got, want, f"transposed layout: {what}")
    plain = det_train.rms_norm(x, norm.weight, 1e-6)  # y is row-local: the plain norm's bits
    assert_bitwise_equal(results[0][0].detach(), plain.detach(), "y of the per-head norm")


def test_per_head_errors_say_what_was_wrong():
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(
        ValueError, match=r"rows_per_token=3 must be a positive int dividing the rows of x \(10 rows"
    ):
        det_train.rms_norm(torch.randn(10, 8), w, rows_per_token=3)
    with pytest.raises(TypeError, match="rows_per_token must be an int"):
        det_train.rms_norm(torch.randn(10, 8), w, rows_per_token=True)
    with pytest.raises(ValueError, match="heads must be None or a positive int"):
        det_train.RMSNorm(8, heads=0)
    norm = det_train.RMSNorm(8, heads=4)
    with pytest.raises(ValueError, match=r"no head axis of 4 elements innermost in memory"):
        norm(torch.randn(2, 4, 3, 8))  # (B, H, T, D) made contiguous: its innermost dim is T
    # a parameter's rows per token changes between micro-batches of a step
    acc = CanonicalGradAccumulator([("q_norm.weight", w)], leaf_tokens=4)
    with acc.micro_batch(token_offset=0):
        det_train.rms_norm(torch.randn(3, 2, 8), w, rows_per_token=2).sum().backward()
    with pytest.raises(
        ValueError, match=r"q_norm.weight \(det_train.rms_norm\) \(use 0\) gave 3 rows per token, but 2"
    ):
        with acc.micro_batch(token_offset=3):
            det_train.rms_norm(torch.randn(1, 3, 8), w, rows_per_token=3).sum().backward()
    with acc.micro_batch(token_offset=3):  # the refused micro-batch left nothing: run it again
        det_train.rms_norm(torch.randn(1, 2, 8), w, rows_per_token=2).sum().backward()
    acc.reduce(total_tokens=4)
    assert w.grad is not None and w.grad.abs().sum() > 0


# ---------------------------------------------------------------- converted transformers models
transformers = pytest.importorskip("transformers")


def _model(kind, heads, kv_heads, *, hidden=64, layers=1, seq=4, device="cpu", ffn=64):
    """A converted bf16 model (seed 0) on det_attn, head_dim 64."""
    det_attn = pytest.importorskip("det_attn")
    det_attn.register_transformers_attention()
    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=seq,
        attn_implementation="det_attn",
    )
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:  # Gemma 3 with full attention in every layer (sliding layers: test_sliding_window_models.py)
        config = transformers.Gemma3TextConfig(layer_types=["full_attention"] * layers, **common)
        model = transformers.Gemma3ForCausalLM(config)
    return det_train.convert(model.to(device=device, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_converted_per_head_norms_split_bitwise(kind):
    heads, kv_heads = (4, 2) if kind == "qwen3" else (2, 1)
    model = _model(kind, heads, kv_heads)
    attn = model.model.layers[0].self_attn
    assert type(attn.q_norm) is det_train.RMSNorm and attn.q_norm.heads == heads
    assert type(attn.k_norm) is det_train.RMSNorm and attn.k_norm.heads == (
        kv_heads if kv_heads > 1 else None
    )
    ids = torch.randint(0, 64, (6, 4), generator=torch.Generator().manual_seed(1))  # 24 tokens, 3 leaves
    whole = split_grads(model, ids, [(0, 6)], leaf=8)
    split = split_grads(
        model, ids, [(0, 1), (1, 2), (3, 3)], leaf=8
    )  # cuts at tokens 4 and 12: inside leaves
    assert set(whole) == {name for name, _ in model.named_parameters()}
    for name, grad in whole.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert_bitwise_equal(split[name], grad, f"{kind} {name}: 1 vs 3 micro-batches")


@pytest.mark.gpu
def test_gpu_qwen3_per_head_norms_split_bitwise_at_a_realistic_size():
    """Qwen3, hidden 1024, 4 layers, 16 query and 8 KV heads (head_dim 64): 4 sequences of 1024
    tokens in one micro-batch and in four cut inside leaves of 2048 tokens."""
    model = _model("qwen3", 16, 8, hidden=1024, layers=4, seq=1024, device="cuda", ffn=2048)
    ids = torch.randint(0, 64, (4, 1024), generator=torch.Generator().manual_seed(1)).cuda()
    whole = split_grads(model, ids, [(0, 4)], leaf=2048)
    split = split_grads(
        model, ids, [(0, 1), (1, 2), (3, 1)], leaf=2048
    )  # cuts at 1024 and 3072: inside leaves
    split4 = split_grads(model, ids, [(0, 1), (1, 1), (2, 1), (3, 1)], leaf=2048)
    for name, grad in whole.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert_bitwise_equal(split[name], grad, f"{name}: 1 vs 3 micro-batches")
        assert_bitwise_equal(split4[name], grad, f"{name}: 1 vs 4 micro-batches")
