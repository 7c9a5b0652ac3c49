"""det_train.convert: what becomes what, parameters kept (identity, names, state_dict, tied weights,
an optimizer built before), every unconvertible module named in one error with nothing changed,
strict=False / allow, transformers' norm classes recognised by structure (Llama's and Gemma's
``1 + weight`` form) and Conv1D, the causal-LM loss drop-in against transformers' own, the kernels
layers. The multi-step training invariances of converted transformers models are in
tests/test_transformers_e2e.py."""

import functools
import types

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal
from det_train.accum.grad_accum import CanonicalGradAccumulator
from torch import nn


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8, padding_idx=1)
        self.norm = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8, eps=1e-6)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        return self.head(self.proj(self.rms(self.norm(self.emb(ids)))))


def test_plain_torch_modules_become_det_train_ones_keeping_their_parameters():
    model = _Block()
    model.shared = model.proj  # one module at two places
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3, 1], [4, 5, 6, 7]])
    with torch.no_grad():
        want = model(ids)
    assert det_train.convert(model) is model
    assert type(model.emb) is det_train.Embedding and model.emb.padding_idx == 1
    assert type(model.norm) is det_train.LayerNorm and type(model.rms) is det_train.RMSNorm
    assert type(model.proj) is det_train.Linear and model.shared is model.proj
    assert all(p is params[n] for n, p in model.named_parameters()) and list(model.state_dict()) == keys
    assert model.head.weight is model.emb.weight  # the tie survives
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    got = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=4)
    for start in (0, 4):  # every parameter's gradient is canonical: reduce finds no plain p.grad
        with acc.micro_batch(token_offset=start):
            model(ids.view(-1)[start : start + 4]).sum().backward()
    acc.reduce(total_tokens=8)
    assert all(p.grad is not None for p in model.parameters())
    assert det_train.convert(model) is model  # converting twice changes nothing


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def _unsupported():
    return nn.Sequential(
        nn.Linear(4, 4),
        nn.Conv1d(4, 4, 3),
        nn.Sequential(nn.GroupNorm(2, 4), nn.BatchNorm1d(4)),
        nn.Dropout(0.1),
        _Custom(),
        nn.Dropout(0.0),
    )


def test_every_unconvertible_module_is_named_and_nothing_changes():
    model = _unsupported()
    before = list(model.modules())
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(model)
    message = str(info.value)
    for name, cls in (
        ("1", "Conv1d"),
        ("2.0", "GroupNorm"),
        ("2.1", "BatchNorm1d"),
        ("3", "Dropout"),
        ("4", "_Custom"),
    ):
        assert f"  {name} ({cls}): " in message, message
    assert "5 (Dropout)" not in message  # p = 0 is the identity
    assert [n for n, _, _ in info.value.problems] == ["1", "2.0", "2.1", "3", "4"]
    assert "dropout with p=0.1" in message and "parameters: scale" in message
    assert list(model.modules()) == before and type(model[0]) is nn.Linear  # left unchanged


def test_strict_false_warns_and_allow_accepts_named_modules():
    model = _unsupported()
    with pytest.warns(UserWarning, match=r"kept 5 module\(s\).*1 \(Conv1d\)"):
        det_train.convert(model, strict=False)
    assert type(model[0]) is det_train.Linear and type(model[1]) is nn.Conv1d
    model = _unsupported()
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(model, allow=["1", nn.GroupNorm, "BatchNorm1d", "4"])
    assert [n for n, _, _ in info.value.problems] == ["3"]
    det_train.convert(
        model, allow=["1", nn.GroupNorm, "BatchNorm1d", "4", "torch.nn.modules.dropout.Dropout"]
    )
    assert type(model[0]) is det_train.Linear
    model = _unsupported()
    with pytest.raises(det_train.ConversionError) as info:  # one name is one name, not its letters
        det_train.convert(model, allow="BatchNorm1d")
    assert "BatchNorm1d" not in [c for _, c, _ in info.value.problems]


def test_root_module_and_bad_arguments():
    lin = nn.Linear(4, 3)
    weight = lin.weight
    assert det_train.convert(lin) is lin and type(lin) is det_train.Linear and lin.weight is weight
    with pytest.raises(TypeError, match="must be an nn.Module"):
        det_train.convert(torch.ones(3))
    with pytest.raises(det_train.ConversionError, match="float64"):
        det_train.convert(nn.Linear(4, 4).double())
    with pytest.raises(det_train.ConversionError, match="max_norm"):
        det_train.convert(nn.Embedding(4, 4, max_norm=1.0))
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    for strict in ("no", 0, None):  # "no" is truthy: it was taken as strict=True
        with pytest.raises(
            TypeError, match=f"det_train.convert: strict must be True or False, got {strict!r}"
        ):
            det_train.convert(model, strict=strict)
        assert type(model[0]) is nn.Linear  # left unchanged


def test_scaled_embedding_built_directly_takes_embed_scale():
    emb = det_train.ScaledEmbedding(3, 2, padding_idx=0, embed_scale=2.5)
    with torch.no_grad():
        emb.weight.copy_(torch.tensor([[0.0, 0.0], [1.0, -2.0], [0.5, 4.0]]))
    out = emb(torch.tensor([[2, 1, 0]]))
    assert_bitwise_equal(out, torch.tensor([[[1.25, 10.0], [2.5, -5.0], [0.0, 0.0]]]), "weight[ids] * 2.5")
    assert list(emb.state_dict()) == ["weight"]  # embed_scale is not persistent, as in transformers
    assert_bitwise_equal(det_train.ScaledEmbedding(3, 2).embed_scale, torch.tensor(1.0), "default scale")
    with pytest.raises(TypeError, match="embed_scale must be a real number .*got str '2'"):
        det_train.ScaledEmbedding(3, 2, embed_scale="2")
    with pytest.raises(ValueError, match="embed_scale must be finite, got inf"):
        det_train.ScaledEmbedding(3, 2, embed_scale=float("inf"))


def test_register_conversion_takes_a_class_of_ones_own_and_checks_parameter_identity():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    class DetScale(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    det_train.register_conversion(Scale, lambda m: DetScale(m.weight))
    model = nn.Sequential(Scale())
    det_train.convert(model)
    assert type(model[0]) is DetScale
    det_train.register_conversion(Scale, lambda m: DetScale(nn.Parameter(m.weight.detach().clone())))
    with pytest.raises(RuntimeError, match="does not reuse its Parameter objects"):
        det_train.convert(nn.Sequential(Scale()))
    with pytest.raises(TypeError, match="nn.Module subclass"):
        det_train.register_conversion(int, lambda m: m)


class _EpsOutside(nn.Module):
    """Looks like an RMSNorm (weight, eps) but adds eps outside the square root."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon)


def test_rms_norm_probe_tells_the_forms_apart():
    with pytest.raises(det_train.ConversionError, match=r"0 \(_EpsOutside\): looks like an RMSNorm"):
        det_train.convert(nn.Sequential(_EpsOutside()))


# ---------------------------------------------------------------- transformers
transformers = pytest.importorskip("transformers")


def _llama_config(cls_name="LlamaConfig", **extra):
    cfg = getattr(transformers, cls_name)(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=16,
        attn_implementation="sdpa",
        **extra,
    )
    return cfg


@pytest.mark.parametrize(
    ("model_cls", "config_cls", "norm_offset", "embedding_cls"),
    [
        ("LlamaForCausalLM", "LlamaConfig", 0.0, det_train.Embedding),
        ("GemmaForCausalLM", "GemmaConfig", 1.0, det_train.ScaledEmbedding),
    ],
)
def test_transformers_norms_embeddings_and_loss_are_converted(
    model_cls, config_cls, norm_offset, embedding_cls
):
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(_llama_config(config_cls))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1).add_(1.0 - norm_offset)  # non-trivial scales, in each class's form
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids)
    with pytest.raises(
        det_train.ConversionError, match=r"<model> \(" + model_cls + r"\): attention implementation 'sdpa'"
    ):
        det_train.convert(model)
    det_train.convert(model, allow=[""])  # keep sdpa here (det_attn: tests/test_transformers_e2e.py)
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    assert norms and all(type(m) is det_train.RMSNorm and m.offset == norm_offset for m in norms)
    assert all(m.eps == model.config.rms_norm_eps for m in norms)
    assert type(model.model.embed_tokens) is embedding_cls
    assert model.loss_function is det_train.causal_lm_loss
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)  # fp32 model
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformers.BloomForCausalLM(
            transformers.BloomConfig(
                vocab_size=64, hidden_size=64, n_layer=1, n_head=1, attn_implementation="det_attn"
            )
        ),
        lambda: transformers.MptForCausalLM(
            transformers.MptConfig(
                vocab_size=64, d_model=64, n_layers=1, n_heads=1, attn_implementation="det_attn"
            )
        ),
    ],
    ids=["bloom", "mpt"],
)
def test_a_model_whose_attention_ignores_attn_implementation_is_refused(make):
    """Bloom and MPT run attention code of their own whatever config._attn_implementation says
    (_supports_attention_backend=False, no ALL_ATTENTION_FUNCTIONS lookup): det_attn would never be
    called, so convert refuses them (it used to accept them: Bloom then trained on torch's baddbmm,
    MPT failed inside transformers at its first forward). "<model>", as the error prints it, allows it."""
    import det_attn  # noqa: F401  (registers attn_implementation="det_attn")

    model = make().to(torch.bfloat16)
    with pytest.raises(
        det_train.ConversionError, match=r"<model> \(\w+\): \w+'s attention does not dispatch"
    ):
        det_train.convert(model)
    det_train.convert(model, allow=["<model>"])


def test_a_function_registered_as_det_attn_that_is_not_det_attns_is_named():
    """A wrapper registered under 'det_attn' without functools.wraps is refused with what it is and
    how to fix it (the message used to say: load the model with attn_implementation='det_attn')."""
    import det_attn
    from det_attn.transformers_integration import det_attn_transformers_forward as original

    model = transformers.LlamaForCausalLM(_llama_config("LlamaConfig")).to(torch.bfloat16)
    model.config._attn_implementation = "det_attn"

    def profiled(*args, **kwargs):
        return original(*args, **kwargs)

    transformers.AttentionInterface.register("det_attn", profiled)
    try:
        with pytest.raises(
            det_train.ConversionError, match=r"registered as attn_implementation 'det_attn' is .*profiled"
        ):
            det_train.convert(model)
        transformers.AttentionInterface.register("det_attn", functools.wraps(original)(profiled))
        det_train.convert(model)  # a functools.wraps wrapper is det_attn's
    finally:
        det_attn.register_transformers_attention()


def test_gpt2_conv1d_and_layer_norm_are_converted():
    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=64, n_layer=1, n_head=1, n_positions=16, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(det_train.ConversionError, match=r"transformer.drop \(Dropout\): dropout with p=0.1"):
        det_train.convert(model, allow=[""])
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**{**cfg.to_dict(), "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    det_train.convert(model, allow=[""])
    # GPT2LMHeadModel's loss_type is None (no "ForCausalLM" in its name): transformers' loss_function
    # falls back to ForCausalLMLoss, a mean over each micro-batch; converted like every causal LM's
    assert model.loss_function is det_train.causal_lm_loss
    assert type(model.transformer.h[0].attn.c_attn) is det_train.Conv1D
    assert type(model.transformer.h[0].ln_1) is det_train.LayerNorm
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


def test_causal_lm_loss_matches_transformers_and_honours_num_items_in_batch():
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, 2:4] = -100
    for n_items in (None, 23, torch.tensor(17.0)):  # Trainer passes a float tensor
        a = logits.clone().requires_grad_()
        b = logits.clone().requires_grad_()
        ours = det_train.causal_lm_loss(a, labels, 50, num_items_in_batch=n_items)
        ref = ForCausalLMLoss(b, labels, 50, num_items_in_batch=n_items)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
        ours.backward()
        ref.backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    assert_bitwise_equal(
        det_train.causal_lm_loss(logits, None, shift_labels=shifted, num_items_in_batch=19),
        det_train.causal_lm_loss(logits, labels, num_items_in_batch=19),
        "shift_labels",
    )
    with pytest.raises(ValueError, match="positive whole number"):
        det_train.causal_lm_loss(logits, labels, num_items_in_batch=2.5)
    # the 16 counted shifted labels of this call are part of any global count (transformers divides by
    # whatever it is given)
    with pytest.raises(ValueError, match="num_global_tokens=15 is smaller than the 16 non-ignored tokens"):
        det_train.causal_lm_loss(logits, labels, num_items_in_batch=15)
    with pytest.raises(ValueError, match="vocab_size=49"):
        det_train.causal_lm_loss(logits, labels, 49)
    acc = CanonicalGradAccumulator([nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="needs num_items_in_batch"), acc.micro_batch(token_offset=0):
        det_train.causal_lm_loss(logits, labels)


def test_kernels_layers_validate_against_transformers_rms_norm_classes():
    kernels_layer = pytest.importorskip("kernels.layer.layer")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    layers = det_train.layers
    for check_cls, cls, offset in (
        (LlamaRMSNorm, layers.RMSNorm, 0.0),
        (Qwen3_5RMSNorm, layers.RMSNormZeroCentered, 1.0),
    ):
        kernels_layer._validate_layer(check_cls=check_cls, cls=cls, repo="phanerozoic/det-train")
        module = check_cls(16, eps=1e-5)
        with torch.no_grad():
            module.weight.normal_()
        x = torch.randn(5, 16)
        want = det_train.rms_norm(x, module.weight, 1e-5, offset=offset)
        module.forward = types.MethodType(cls.forward, module)  # what kernels.kernelize does
        assert_bitwise_equal(module(x), want, f"kernelized {check_cls.__name__}")
