"""The model families people train today (examples/model_families.py: Llama 3, SmolLM, Phi-3, OLMo 2,
Qwen2, Qwen3, GPT-2, Mistral, Gemma 2, Gemma 3, Qwen3-MoE), each built from its config object, converted by
``det_train.convert`` on det_attn: every parameter's gradient is bitwise the same for one
micro-batch, for three whose cuts fall inside canonical leaves, and in a second run; the converted
model's loss matches the unconverted one's (SDPA, torch layers) to bf16 rounding.

Tiny sizes through the Triton interpreter on CPU, whose cost grows with the kernel launches: one
decoder layer (every kind of module a family has), 2 query heads sharing 1 KV head of 64. Qwen2,
Qwen3, GPT-2, Mistral, Gemma 2, Gemma 3 and Qwen3-MoE are ``slow`` here (``--run-slow``): their CPU
proofs of the same invariances are tests/test_transformers_e2e.py (Qwen2, GPT-2),
packages/det-train/tests/test_per_head_norm.py (Qwen3), packages/det-train/tests/test_moe.py
(Qwen3-MoE) and
packages/det-train/tests/test_sliding_window_models.py (the sliding-window families). A ``gpu``
test checks every family at a realistic size (4 layers, 16 / 4 heads, 4 x 1024 tokens). Plain
Llama: tests/test_transformers_e2e.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import det_attn  # noqa: E402
import det_train  # noqa: E402
from det_core.testing import assert_bitwise_equal  # noqa: E402
from det_train.integrations.convert import ScaledEmbedding  # noqa: E402
from det_train.integrations.moe import MoeExperts, MoeTopKRouter  # noqa: E402

from examples import model_families  # noqa: E402

det_attn.register_transformers_attention()

FAMILIES = tuple(f for f in model_families.FAMILIES if f != "llama")  # Llama: test_transformers_e2e.py
# tested on CPU elsewhere already (see the module docstring): run here with --run-slow
ELSEWHERE_ON_CPU = ("qwen2", "qwen3", "gpt2", "mistral", "gemma2", "gemma3", "qwen3_moe")
DET_LAYERS = (
    det_train.Linear, det_train.Embedding, det_train.RMSNorm, det_train.LayerNorm, det_train.Conv1D,
    ScaledEmbedding,  # Gemma's embedding scaled by sqrt(hidden_size)
    MoeExperts, MoeTopKRouter,  # Qwen3-MoE's experts and router
)  # fmt: skip


class Size:
    """A model size and its batch: ``batch`` sequences of ``seq`` tokens, leaves of ``leaf``
    tokens, ``splits``: the micro-batches ((first sequence, sequences)) compared with one."""

    def __init__(self, *, hidden, layers, heads, kv_heads, ffn, vocab, seq, batch, leaf, splits, device):
        self.model = dict(
            hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=64, ffn=ffn, vocab=vocab
        )
        self.seq, self.batch, self.leaf, self.splits, self.device = seq, batch, leaf, splits, device


# 4 sequences of 6 tokens, leaves of 8: the cuts at tokens 6 and 18 are inside leaves 0 and 2
CPU = Size(
    hidden=64,
    layers=1,
    heads=2,
    kv_heads=1,
    ffn=64,
    vocab=128,
    seq=6,
    batch=4,
    leaf=8,
    splits=[(0, 1), (1, 2), (3, 1)],
    device="cpu",
)


def make_model(family: str, size: Size, *, convert: bool = True):
    """A bf16 model of ``family`` (seed 0): converted on det_attn, or as it is on SDPA (Gemma 2:
    eager attention, ``model_families.peer_attention``)."""
    shape = dict(size.model)
    if family == "gpt2":  # no GQA, head_dim = hidden / heads: one head of 64 at the CPU size
        shape.update(heads=shape["hidden"] // 64, kv_heads=shape["hidden"] // 64)
    torch.manual_seed(0)
    with torch.device(size.device):  # initialised where it runs (on a GPU: no host-side init)
        attn = "det_attn" if convert else model_families.peer_attention(family)
        model = model_families.build(family, seq=size.seq, attn=attn, **shape)
    model = model.to(dtype=torch.bfloat16)
    return det_train.convert(model) if convert else model


def batch_ids(size: Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, size.model["vocab"], (size.batch, size.seq), generator=g).to(size.device)


def grads(model, ids, splits, leaf):
    """Every parameter's gradient of the causal-LM loss over ``ids`` in micro-batches ``splits``
    ((first sequence, sequences)) through the accumulator, and the loss summed over them."""
    batch, seq = ids.shape
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=leaf)
    loss = 0.0
    for first, n in splits:
        x = ids[first : first + n]
        with acc.micro_batch(token_offset=first * seq):
            out = model(input_ids=x, labels=x, num_items_in_batch=batch * (seq - 1))
            out.loss.backward()
        loss += float(out.loss.detach())
    acc.reduce(total_tokens=batch * seq)
    out = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, loss


def _assert_family_structure(family: str, model) -> None:
    """What makes the family itself became det_train's (not only 'convert raised nothing')."""
    kinds = {type(m) for m in model.modules() if any(True for _ in m.parameters(recurse=False))}
    assert kinds <= set(DET_LAYERS), f"{family}: modules with parameters left as they were: {kinds}"
    if family == "gpt2":  # Conv1D and LayerNorm, tied head
        assert type(model.transformer.h[0].attn.c_attn) is det_train.Conv1D
        assert model.lm_head.weight is model.transformer.wte.weight
        return
    layer = model.model.layers[0]
    attn = layer.self_attn
    if family == "llama3":
        assert model.model.rotary_emb.rope_type == "llama3"
    if family == "smollm":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if family == "phi3":  # the fused projections are single det_train Linears
        assert type(attn.qkv_proj) is det_train.Linear and type(layer.mlp.gate_up_proj) is det_train.Linear
    if family == "olmo2":  # norms over heads x head_dim: one row per token (heads=None)
        assert attn.q_norm.weight.numel() == 2 * 64 and attn.q_norm.heads is None
        assert type(layer.post_attention_layernorm) is det_train.RMSNorm
    if family == "qwen3":  # per-head: rows of tokens x heads
        assert attn.q_norm.heads == 2
    if family == "qwen2":
        assert attn.q_proj.bias is not None


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in ELSEWHERE_ON_CPU else f for f in FAMILIES]
)
def test_family_converts_and_its_gradients_are_split_and_run_invariant(family):
    model = make_model(family, CPU)
    _assert_family_structure(family, model)
    ids = batch_ids(CPU)
    whole, loss = grads(model, ids, [(0, CPU.batch)], CPU.leaf)
    split, _ = grads(model, ids, CPU.splits, CPU.leaf)
    again, _ = grads(make_model(family, CPU), ids, [(0, CPU.batch)], CPU.leaf)  # a second run
    assert set(whole) == {name for name, _ in model.named_parameters()}
    for name, grad in whole.items():
        assert grad is not None and grad.abs().sum() > 0, f"{family} {name}: no gradient"
        assert_bitwise_equal(split[name], grad, f"{family} {name}: 1 vs 3 micro-batches (cuts inside leaves)")
        assert_bitwise_equal(again[name], grad, f"{family} {name}: run to run")
    plain = make_model(family, CPU, convert=False)
    with torch.no_grad():
        ref = float(plain(input_ids=ids, labels=ids).loss)
    # the same weights through torch's layers and SDPA: the loss to the bf16 unit roundoff 2^-8
    assert abs(loss - ref) <= 2**-8 * abs(ref), f"{family}: loss {loss} vs unconverted {ref}"


# ---------------------------------------------------------------- GPU, a realistic size
# hidden 1024, 4 layers, 16 query heads of 64 sharing 4 KV heads, vocabulary 32000; 4 sequences of
# 1024 tokens, leaves of 2048: the 4 micro-batches' cuts at 1024 and 3072 are inside leaves
GPU = Size(
    hidden=1024,
    layers=4,
    heads=16,
    kv_heads=4,
    ffn=2816,
    vocab=32000,
    seq=1024,
    batch=4,
    leaf=2048,
    splits=[(0, 1), (1, 1), (2, 1), (3, 1)],
    device="cuda",
)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_family_gradients_are_split_and_run_invariant_at_a_realistic_size(family):
    """One micro-batch, four (cuts inside leaves) and one micro-batch again: the same bits for
    every parameter's gradient (compared on the GPU: a digest would copy every gradient to the host)."""
    model = make_model(family, GPU)
    ids = batch_ids(GPU)
    whole, _ = grads(model, ids, [(0, GPU.batch)], GPU.leaf)
    for what, splits in (("4 micro-batches", GPU.splits), ("run to run", [(0, GPU.batch)])):
        got, _ = grads(model, ids, splits, GPU.leaf)
        for name, grad in whole.items():
            assert grad is not None and got[name] is not None, f"{family} {name}: no gradient"
            assert_bitwise_equal(got[name], grad, f"{family} {name}: {what}")
