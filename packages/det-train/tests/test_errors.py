"""Errors a new user hit, each now saying what was wrong and what to do: per-head q/k norms (Qwen3,
Gemma 3) converted with their heads, refused only where the head count is unknown (OLMo 2's
whole-projection norms and one-head models converted as plain norms; a frozen per-head norm
converted and split-invariant, unfrozen too), the accumulator's token-count error naming both
parameters and ops (a per-head norm not told its heads), GPT-2 without ``position_ids`` (convert
passes the batch's positions), the dropout refusal in the model's own terms (config fields or the module's
``p``), and an fp64 layer reported as an unsupported dtype. Tiny transformers models from config
objects (no download), CPU through the Triton interpreter."""

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal
from torch import nn

transformers = pytest.importorskip("transformers")


def _decoder(model_cls, config_cls, heads, kv_heads, head_dim=64, attn="sdpa", **extra):
    """A one-layer fp32 decoder (seed 0) with ``heads`` query and ``kv_heads`` key/value heads."""
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8,
        attn_implementation=attn,
        **extra,
    )
    return getattr(transformers, model_cls)(config)


def _problems(model):
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(model, allow=[""])  # the attention check is not what this is about
    return info.value.problems


def test_per_head_q_k_norms_convert_with_their_heads_or_are_refused_naming_why():
    attn = "model.layers.0.self_attn"
    # Qwen3, 2 query heads, 1 KV head: q_norm sees tokens x 2 rows, k_norm one row per token
    model = _decoder("Qwen3ForCausalLM", "Qwen3Config", heads=2, kv_heads=1)
    det_train.convert(model, allow=[""])  # the attention check is not what this is about
    layer = model.model.layers[0].self_attn
    assert type(layer.q_norm) is det_train.RMSNorm and layer.q_norm.heads == 2
    assert type(layer.k_norm) is det_train.RMSNorm and layer.k_norm.heads is None
    # Qwen3 with 2 KV heads, Gemma 3 (its norms in the 1 + weight form): both norms per head
    for model_cls, config_cls in (
        ("Qwen3ForCausalLM", "Qwen3Config"),
        ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    ):
        layer = det_train.convert(_decoder(model_cls, config_cls, heads=2, kv_heads=2), allow=[""])
        layer = layer.model.layers[0].self_attn
        assert (layer.q_norm.heads, layer.k_norm.heads) == (2, 2), model_cls
        assert (layer.q_norm.offset, layer.k_norm.offset) == (
            (1.0, 1.0) if "Gemma" in model_cls else (0.0, 0.0)
        )
    # no projection to count the heads by: refused, naming the remedy, and nothing converted
    model = _decoder("Qwen3ForCausalLM", "Qwen3Config", heads=2, kv_heads=1)
    model.model.layers[0].self_attn.q_proj = nn.Identity()
    problems = _problems(model)
    assert [(name, cls) for name, cls, _ in problems] == [(f"{attn}.q_norm", "Qwen3RMSNorm")]
    reason = problems[0][2]
    assert "a norm over head_dim=64 applied per attention head, whose head count is unknown" in reason, reason
    assert f"({attn}.q_norm.weight.requires_grad_(False))" in reason
    assert type(model.model.layers[0].self_attn.k_proj) is nn.Linear  # nothing was converted
    # one head: one row per token, converted; OLMo 2's norms cover the whole q / k projections
    model = _decoder("Qwen3ForCausalLM", "Qwen3Config", heads=1, kv_heads=1, head_dim=128)
    det_train.convert(model, allow=[""])
    assert type(model.model.layers[0].self_attn.q_norm) is det_train.RMSNorm
    model = _decoder("Olmo2ForCausalLM", "Olmo2Config", heads=2, kv_heads=1, eos_token_id=0, pad_token_id=0)
    det_train.convert(model, allow=[""])
    attn_module = model.model.layers[0].self_attn
    assert type(attn_module.q_norm) is det_train.RMSNorm and attn_module.q_norm.weight.numel() == 128
    assert type(attn_module.k_norm) is det_train.RMSNorm and attn_module.k_norm.weight.numel() == 64


def _grads(model, ids, splits, leaf):
    """Parameter gradients of the causal-LM loss over ``ids`` cut into ``splits`` (first sequence,
    sequences) micro-batches, through the accumulator."""
    batch, seq = ids.shape
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=leaf)
    for first, n in splits:
        x = ids[first : first + n]
        with acc.micro_batch(token_offset=first * seq):
            model(input_ids=x, labels=x, num_items_in_batch=batch * (seq - 1)).loss.backward()
    acc.reduce(total_tokens=batch * seq)
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def test_frozen_per_head_norms_convert_and_split_bitwise():
    det_attn = pytest.importorskip("det_attn")
    det_attn.register_transformers_attention()
    model = _decoder("Qwen3ForCausalLM", "Qwen3Config", heads=2, kv_heads=1, attn="det_attn")
    model = model.to(torch.bfloat16)
    q_norm = model.model.layers[0].self_attn.q_norm
    q_norm.weight.requires_grad_(False)  # the documented remedy
    det_train.convert(model)
    converted = model.model.layers[0].self_attn.q_norm
    assert type(converted) is det_train.RMSNorm and converted.weight is q_norm.weight
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(1))
    whole = _grads(model, ids, [(0, 2)], leaf=8)
    split = _grads(model, ids, [(0, 1), (1, 1)], leaf=8)  # cut in the middle of the one leaf
    assert len(whole) == len(list(model.parameters())) - 1  # every parameter but the frozen one
    for name, grad in whole.items():
        assert_bitwise_equal(split[name], grad, f"{name}: 1 vs 2 micro-batches")
    assert converted.heads == 2  # unfrozen after convert, its gradient is canonical too
    converted.weight.requires_grad_(True)
    whole = _grads(model, ids, [(0, 2)], leaf=8)
    split = _grads(model, ids, [(0, 1), (1, 1)], leaf=8)
    assert whole["model.layers.0.self_attn.q_norm.weight"].abs().sum() > 0
    for name, grad in whole.items():
        assert_bitwise_equal(split[name], grad, f"{name}: unfrozen, 1 vs 2 micro-batches")
    # a per-head norm not told its heads: the first backward names the parameter, its op and the other one
    converted.heads = None
    with pytest.raises(ValueError) as info:
        _grads(model, ids, [(0, 2)], leaf=8)
    message = str(info.value)
    assert message.startswith(
        "model.layers.0.self_attn.q_norm.weight (det_train.rms_norm) saw 16 tokens (rows) in this "
        "micro-batch, but "
    ), message
    assert "saw 8: every canonical-order op" in message and "runs per attention head" in message


def _gpt2_grads(micro_batches, *, explicit_positions: bool) -> dict[str, torch.Tensor]:
    """Gradients of a converted tiny GPT-2 over 3 sequences of 4 tokens (leaves of 8 tokens), the
    micro-batches given as (first sequence, sequences); positions passed or left to convert."""
    det_attn = pytest.importorskip("det_attn")
    det_attn.register_transformers_attention()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=64, n_layer=1, n_head=1, n_positions=8, n_inner=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="det_attn",
    )  # fmt: skip
    model = det_train.convert(transformers.GPT2LMHeadModel(config).to(torch.bfloat16))
    ids = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(1))
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=8)
    for first, n in micro_batches:
        x = ids[first : first + n]
        extra = {"position_ids": torch.arange(4).expand(n, 4)} if explicit_positions else {}
        with acc.micro_batch(token_offset=4 * first):
            model(input_ids=x, labels=x, num_items_in_batch=9, **extra).loss.backward()
    acc.reduce(total_tokens=12)
    return {name: p.grad for name, p in model.named_parameters()}


def test_gpt2_without_position_ids_gets_the_batch_positions_from_convert():
    # GPT-2 looks positions up with (1, T) ids when none are passed: convert's pre-hook passes ids
    # of the batch's shape, so the position embedding's gradient is canonical over every token
    explicit = _gpt2_grads([(0, 3)], explicit_positions=True)
    whole = _gpt2_grads([(0, 3)], explicit_positions=False)
    split = _gpt2_grads([(0, 1), (1, 2)], explicit_positions=False)  # a cut at token 4, inside leaf 0
    assert explicit["transformer.wpe.weight"][:4].abs().sum() > 0  # positions 0..3 got gradients
    for name, grad in explicit.items():
        assert_bitwise_equal(whole[name], grad, name)
        assert_bitwise_equal(split[name], grad, name)


def test_dropout_refusal_says_what_fits_the_model():
    # plain torch: no config to point to; the module's p is what convert accepts
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))
    ((name, cls, reason),) = info.value.problems
    assert (name, cls) == ("1", "Dropout") and "config" not in reason, reason
    assert reason.endswith(
        "set its p to 0 (model.get_submodule(name).p = 0.0) or replace it by nn.Identity()"
    ), reason
    det_train.convert(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)))  # and p = 0 is accepted
    # a transformers model: its config's dropout fields that are not 0, then the module's p
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=64, n_layer=1, n_head=1, n_positions=8, embd_pdrop=0.0
    )
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(transformers.GPT2LMHeadModel(config), allow=[""])
    reasons = {n: r for n, _, r in info.value.problems}
    assert "transformer.drop" not in reasons  # embd_pdrop=0.0: p = 0
    reason = reasons["transformer.h.0.attn.attn_dropout"]
    assert "build the model with these config fields at 0.0 (resid_pdrop=0.1, attn_pdrop=0.1" in reason
    assert "or set its p to 0" in reason


def test_config_dropout_applied_functionally_is_refused():
    """Starcoder2 applies residual_dropout with nn.functional.dropout: no module shows it, and its
    masks would follow the batch's split (found by a new-user trial: convert accepted it silently).
    Any dropout field of the config above 0 is refused, naming it; a task head's field is not."""
    import det_attn  # noqa: F401  (registers attn_implementation="det_attn")

    kw = dict(
        vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, attention_dropout=0.0, embedding_dropout=0.0, attn_implementation="det_attn",
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    config = transformers.Starcoder2Config(residual_dropout=0.1, **kw)
    model = transformers.Starcoder2ForCausalLM(config).to(torch.bfloat16)
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(model)
    ((name, _, reason),) = info.value.problems
    assert name == "" and reason.startswith("dropout in the config (residual_dropout=0.1)"), reason
    assert "build the model with these fields at 0.0" in reason
    config = transformers.Starcoder2Config(residual_dropout=0.0, **kw)
    det_train.convert(transformers.Starcoder2ForCausalLM(config).to(torch.bfloat16))
    gpt2 = transformers.GPT2Config(
        vocab_size=64, n_embd=64, n_layer=1, n_head=1, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="det_attn",
    )  # fmt: skip
    assert gpt2.summary_first_dropout > 0  # a double-heads model's field: GPT2LMHeadModel builds no such head
    det_train.convert(transformers.GPT2LMHeadModel(gpt2).to(torch.bfloat16))


def test_fp64_layer_is_an_unsupported_dtype_not_a_determinism_problem():
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(nn.Sequential(nn.Linear(4, 4).double()))
    message = str(info.value)
    assert info.value.problems == [
        (
            "0",
            "Linear",
            "unsupported dtype float64: det_train's kernels take bfloat16, float16 and float32; cast "
            "the model first: model.to(torch.bfloat16) (what det_attn and AdamWSR train), or "
            "model.to(torch.float32)",
        )
    ]
    assert "cannot be made deterministic" not in message and "cannot be converted" in message
    model = nn.Sequential(nn.Linear(4, 4).double()).to(torch.float32)  # the remedy
    assert type(det_train.convert(model)[0]) is det_train.Linear
