"""transformers families with sliding-window layers and attention logit soft-capping on det_attn: Mistral (a
window in every layer), Gemma 2 (a local layer with soft-capping and Gemma's ``query_pre_attn_scalar``
scale), Gemma 3 text (a local layer via ``layer_types``) and Qwen2 with ``use_sliding_window`` (layers
from ``max_window_layers`` on), one layer each. Each converts with ``det_train.convert``; its logits match
transformers' eager attention on the same weights (so the window, the soft-cap and the scale reach the
kernels with transformers' meaning); one batch and three micro-batches cut inside leaves give bitwise the
same gradient for every parameter. What det_attn still lacks (a bidirectional sliding window) is refused
up front. Tiny models from config objects (no download), CPU through the Triton interpreter."""

import sys
from pathlib import Path

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal

sys.path.insert(0, str(Path(__file__).parent))
from _hf_micro_batches import split_grads  # noqa: E402

transformers = pytest.importorskip("transformers")
det_attn = pytest.importorskip("det_attn")

SEQ, WINDOW = 6, 3  # sequences longer than the window: the window masks keys


def _config(kind, attn, plain=False):
    """The tiny config of ``kind``; ``plain``: the same without sliding window and soft-cap."""
    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=SEQ,
        sliding_window=None if plain and kind == "mistral" else WINDOW,
        attn_implementation=attn,
    )
    layers = ["full_attention" if plain else "sliding_attention"]  # one layer, its type from layer_types
    if kind == "mistral":
        return transformers.MistralConfig(**common)
    if kind == "gemma2":  # scale query_pre_attn_scalar**-0.5 = 1/16, not head_dim**-0.5
        cap = None if plain else 5.0
        return transformers.Gemma2Config(layer_types=layers, attn_logit_softcapping=cap, **common)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(layer_types=layers, **common)
    # Qwen2: layers from max_window_layers on slide
    return transformers.Qwen2Config(use_sliding_window=not plain, max_window_layers=0, **common)


_CLASSES = {
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _model(kind, attn="det_attn", plain=False):
    """A bf16 model (seed 0: the same weights whatever ``attn`` and ``plain``) of ``kind`` on
    ``attn``, not converted."""
    det_attn.register_transformers_attention()
    torch.manual_seed(0)
    model = getattr(transformers, _CLASSES[kind])(_config(kind, attn, plain))
    with torch.no_grad():  # larger q/k weights: scores of a few units, so the soft-cap bends them
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model.to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3", "qwen2"])
def test_sliding_window_family_matches_eager_and_splits_bitwise(kind):
    ids = torch.randint(0, 64, (3, SEQ), generator=torch.Generator().manual_seed(1))  # 18 tokens
    model = _model(kind)
    with torch.no_grad():
        want = _model(kind, attn="eager")(input_ids=ids).logits.float()
        got = model(input_ids=ids).logits.float()
        full = _model(kind, attn="eager", plain=True)(input_ids=ids).logits.float()  # far from both
    err, change = (got - want).abs().max().item(), (full - want).abs().max().item()
    assert err < 0.1 * change, (
        f"{kind}: det_attn vs eager {err:.3g}, window/soft-cap changes logits by {change:.3g}"
    )

    det_train.convert(model)
    whole = split_grads(model, ids, [(0, 3)], leaf=4)
    split = split_grads(
        model, ids, [(0, 1), (1, 1), (2, 1)], leaf=4
    )  # cuts at tokens 6 and 12: inside leaves
    assert set(whole) == {name for name, _ in model.named_parameters()}
    for name, grad in whole.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert_bitwise_equal(split[name], grad, f"{kind} {name}: 1 vs 3 micro-batches")


def _refusal(model) -> str:
    """The one reason ``convert`` gives for refusing the whole transformers ``model``, after checking
    that it changed nothing (the MLP's Linear and the attention's norm are still torch's)."""
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(model)
    ((name, cls, reason),) = info.value.problems
    assert (name, cls) == ("", type(model).__name__)
    layer = model.model.layers[0]
    assert type(layer.mlp.down_proj) is torch.nn.Linear
    assert type(getattr(layer.self_attn, "q_norm", None)) is not det_train.RMSNorm
    return reason


def test_bidirectional_sliding_window_is_refused_up_front():
    det_attn.register_transformers_attention()
    config = _config("gemma3", "det_attn")
    config.use_bidirectional_attention = True
    reason = _refusal(transformers.Gemma3ForCausalLM(config))
    assert reason.startswith(
        "bidirectional sliding-window attention (config.use_bidirectional_attention=True"
    )
    assert "use_bidirectional_attention=False" in reason


def test_head_dim_det_attn_has_no_kernels_for_is_refused_up_front():
    """Gemma 2 / 3 configs default to head_dim 256: convert names the head dim and det_attn's
    supported ones before touching a module, not the first forward."""
    det_attn.register_transformers_attention()
    config = _config("gemma2", "det_attn")
    config.head_dim = 256
    reason = _refusal(transformers.Gemma2ForCausalLM(config))
    assert reason.startswith("head_dim=256 (config.head_dim, or hidden_size / num_attention_heads)")
    assert "head dims [64, 128]" in reason and "build the model with head_dim in [64, 128]" in reason


def test_attention_dropout_is_refused_up_front():
    """transformers hands det_attn one seed for every layer and numbers a call's sequences from 0: the
    masks would follow the micro-batch split. convert refuses the config field, as it refuses a
    dropout module."""
    det_attn.register_transformers_attention()
    config = _config("mistral", "det_attn", plain=True)
    config.attention_dropout = 0.1
    model = transformers.MistralForCausalLM(config).to(torch.bfloat16)
    reason = _refusal(model)
    assert reason.startswith("attention dropout (config.attention_dropout=0.1)")
    assert "build the model with attention_dropout=0.0" in reason
    config.attention_dropout = 0.0  # the remedy
    assert type(det_train.convert(model).model.layers[0].mlp.down_proj) is det_train.Linear


def test_fp32_model_on_det_attn_is_refused_up_front():
    """det_attn computes in bf16 / fp16: an fp32 model is refused by convert with the cast to make,
    not by det_attn at the first forward."""
    det_attn.register_transformers_attention()
    model = transformers.MistralForCausalLM(_config("mistral", "det_attn", plain=True))  # fp32
    reason = _refusal(model)
    assert reason.startswith("its parameters are float32, but det_attn (attn_implementation='det_attn')")
    assert "model.to(torch.bfloat16)" in reason
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    det_train.convert(model.to(torch.bfloat16))  # the remedy: converts and runs
    assert model(input_ids=ids).logits.dtype == torch.bfloat16
