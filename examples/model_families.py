"""The transformers model families that ``det_train.convert`` is tested on, built from config objects.

``build(family, ...)`` gives a randomly initialised, unconverted causal LM of one family at any
size (no download): the tests (tests/test_model_families.py) build them tiny on CPU and at a
realistic size on a GPU, and examples/bench_transformers.py times a converted one against the
unconverted one (``--family``). What each family brings to the conversion:

* ``llama``: Llama (RMSNorm, SwiGLU MLP, GQA, untied head);
* ``llama3``: Llama 3's frequency-dependent RoPE scaling (``rope_type="llama3"``);
* ``smollm``: SmolLM, a Llama with a tied embedding and head;
* ``phi3``: Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` (one Linear each, split by slicing);
* ``olmo2``: OLMo 2's ``q_norm`` / ``k_norm`` over the whole projection width (heads x head_dim,
  one row per token) and norms after the attention and the MLP (no pre-norms);
* ``qwen2``: Qwen2's q/k/v biases;
* ``qwen3``: Qwen3's per-head ``q_norm`` / ``k_norm`` (over head_dim, rows tokens x heads);
* ``gpt2``: GPT-2's Conv1D, LayerNorm, learned positions and tied head (dropout off);
* ``mistral``: Mistral's sliding-window attention in every layer (a window of a quarter of ``seq``);
* ``gemma2``: Gemma 2's alternating sliding-window and full layers, attention and final logit
  soft-capping, ``query_pre_attn_scalar`` scale, ``1 + weight`` norms and scaled embedding;
* ``gemma3``: Gemma 3's per-head ``q_norm`` / ``k_norm`` and its sliding-window layers (5 of 6);
* ``qwen3_moe``: Qwen3-MoE's routed experts (8 experts of width ``ffn // 2``, 2 per token, every
  layer sparse) behind Qwen3's attention.
"""

from __future__ import annotations

FAMILIES = (
    "llama",
    "llama3",
    "smollm",
    "phi3",
    "olmo2",
    "qwen2",
    "qwen3",
    "gpt2",
    "mistral",
    "gemma2",
    "gemma3",
    "qwen3_moe",
)


def build(
    family: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    vocab: int,
    seq: int,
    attn: str = "det_attn",
):
    """A randomly initialised, unconverted fp32 causal LM of ``family`` (one of ``FAMILIES``).

    ``hidden``: model width; ``heads`` query heads of ``head_dim`` (det_attn takes 64 and 128);
    ``kv_heads``: key/value heads (GQA; GPT-2 has none of its own: it needs ``kv_heads == heads``
    and ``hidden == heads * head_dim``); ``ffn``: MLP width; ``vocab``: vocabulary size; ``seq``:
    the longest sequence; ``attn``: transformers' ``attn_implementation`` (``"det_attn"`` after
    ``det_attn.register_transformers_attention()``, or ``"sdpa"`` for the unconverted model).
    The caller seeds torch's generator first (the weights come from it). Special token ids are
    inside the vocabulary (Phi-3's and OLMo 2's padding id, the last, is their embedding's
    ``padding_idx``); dropout is 0.

    Raises ValueError for an unknown family or a GPT-2 shape it cannot take.

    **Determinism:** the weights are a function of torch's global seed and the arguments.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: choose one of {', '.join(FAMILIES)}")
    # Phi-3 and OLMo 2 have a padding token (their embedding's padding_idx), the others none
    pad = vocab - 1 if family in ("phi3", "olmo2") else None
    special = dict(bos_token_id=1, eos_token_id=vocab - 1, pad_token_id=pad)
    decoder = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,  # every family here reads config.head_dim (else hidden // heads)
        max_position_embeddings=seq,
        attn_implementation=attn,
        **special,
    )
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder))
    if family == "llama3":  # Llama 3.1's scaling: factor 8 over an original context of seq tokens
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=seq,
        )
        config = dict(decoder, max_position_embeddings=8 * seq, rope_parameters=rope)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    if family == "smollm":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=True, **decoder))
    if family == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**decoder))
    if family == "olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**decoder))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder))
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**decoder))
    if family == "qwen3_moe":
        experts = dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=ffn // 2, norm_topk_prob=True
        )
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**experts, **decoder))
    window = max(2, seq // 4)  # shorter than the sequences: the window masks keys
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=window, **decoder))
    if family == "gemma2":  # scale query_pre_attn_scalar**-0.5 with 4 * head_dim: not head_dim**-0.5
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        config = transformers.Gemma2Config(
            sliding_window=window, layer_types=types, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, query_pre_attn_scalar=4 * head_dim, **decoder,
        )  # fmt: skip
        return transformers.Gemma2ForCausalLM(config)
    if family == "gemma3":
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(sliding_window=window, **decoder))
    if kv_heads != heads or hidden != heads * head_dim:
        raise ValueError(
            f"gpt2 has no GQA and head_dim = hidden / heads: got hidden {hidden}, {heads} heads of "
            f"{head_dim}, {kv_heads} KV heads; pass kv_heads=heads and hidden=heads*head_dim"
        )
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        n_inner=ffn,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation=attn,
        bos_token_id=1,
        eos_token_id=vocab - 1,
    )
    return transformers.GPT2LMHeadModel(config)


def peer_attention(family: str) -> str:
    """The attention an unconverted ``family`` model is compared with: ``"sdpa"``, except Gemma 2,
    which transformers runs on ``"eager"`` only (its SDPA path refuses attention soft-capping)."""
    return "eager" if family == "gemma2" else "sdpa"
