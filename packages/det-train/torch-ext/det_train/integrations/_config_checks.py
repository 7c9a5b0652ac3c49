"""What a transformers model's config asks for that ``convert`` refuses up front: an attention
implementation other than det_attn, what det_attn lacks (a bidirectional window, chunked attention,
a head dim without kernels, fp32 weights), and dropout in the config. Each returns the reason, in
the words ``ConversionError`` shows, or None; they read the config and the parameters' dtypes only."""

from __future__ import annotations

import numbers
import sys

import torch
from torch import nn

__all__ = ["attention_problem", "config_dropout_fields", "config_dropout_problem"]

_DET_ATTENTION = "det_attn_transformers_forward"


def config_dropout_fields(config) -> list[tuple[str, float]]:
    """A transformers ``config``'s dropout fields above 0 (``*dropout*``, ``*pdrop*``), as (name,
    value); none for anything else."""
    if config is None or not hasattr(config, "__dict__"):
        return []
    return [
        (key, value)
        for key, value in vars(config).items()
        if ("dropout" in key or "pdrop" in key)
        and isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and value > 0
    ]


# dropout fields of task heads a causal LM does not build (GPT-2's summary_first_dropout, say)
_HEAD_DROPOUT = ("classifier", "summary")


def config_dropout_problem(module: nn.Module, seen: set) -> str | None:
    """A reason the transformers model ``module``'s config asks for dropout: any dropout field above 0
    (``*dropout*``, ``*pdrop*``; not a task head's, ``_HEAD_DROPOUT``). Some models apply it with
    ``nn.functional.dropout`` (SeedOss' and Starcoder2's ``residual_dropout``), where no module shows
    it; its masks come from torch's global generator. Each config checked once."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "loss_type") or id(config) in seen:
        return None
    seen.add(id(config))
    fields = [
        f"{key}={value}"
        for key, value in config_dropout_fields(config)
        if key != "attention_dropout"  # its own reason (_det_attn_lacks, _attention_problem)
        and not any(head in key for head in _HEAD_DROPOUT)
    ]
    if not fields:
        return None
    return (
        f"dropout in the config ({', '.join(fields)}): its masks come from torch's global generator (some "
        "models apply it with nn.functional.dropout, where no module shows it), so they depend on the "
        "batch's split: build the model with these fields at 0.0"
    )


def attention_problem(module: nn.Module, seen: set) -> str | None:
    """A reason the transformers model ``module``'s attention implementation is not det_attn (each
    config checked once: a causal LM and its base model share one)."""
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or not hasattr(module, "loss_type") or id(config) in seen:
        return None
    seen.add(id(config))
    interface = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
    fn = interface.get(impl) if interface is not None and hasattr(interface, "get") else None
    if getattr(fn, "__name__", None) == _DET_ATTENTION:
        return (
            _attention_not_dispatched(module)
            or _det_attn_lacks(config, _det_attn_head_dims(fn))
            or _det_attn_dtype_problem(module)
        )
    if impl == "det_attn" and fn is not None:
        return (
            f"the function registered as attn_implementation 'det_attn' is {fn!r}, not det_attn's "
            f"{_DET_ATTENTION} (a replacement, or a wrapper without functools.wraps): register det_attn's "
            "again with det_attn.register_transformers_attention(), or wrap it with functools.wraps"
        )
    return (
        f"attention implementation {impl!r} (config._attn_implementation) is not deterministic (its "
        "backward accumulates with atomics, its rows depend on the batch): load the model with "
        "attn_implementation='det_attn' after `import det_attn` (det_attn.register_transformers_attention())"
    )


def _attention_not_dispatched(module: nn.Module) -> str | None:
    """A reason ``attn_implementation`` does not reach the model's attention: its classes neither
    declare transformers' attention interface (``_supports_attention_backend``) nor look it up
    (``ALL_ATTENTION_FUNCTIONS`` in a modeling module of its class or a base; Qwen3.5 does, without
    the flag). Bloom, MPT, Falcon and CodeGen run attention code of their own whatever the config
    says: det_attn would never be called."""
    cls = type(module)
    if getattr(cls, "_supports_attention_backend", False):
        return None
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", object)
    models = [base for base in cls.__mro__ if issubclass(base, pretrained) and base is not pretrained]
    if any(hasattr(sys.modules.get(base.__module__), "ALL_ATTENTION_FUNCTIONS") for base in models):
        return None
    return (
        f"{cls.__name__}'s attention does not dispatch through transformers' attention interface "
        "(_supports_attention_backend=False): attn_implementation='det_attn' is never called and the "
        "model's own attention runs, whose backward and row results are not deterministic; use a model "
        "family whose attention does (docs/models.md), or allow it knowingly"
    )


def _det_attn_lacks(config, supported: tuple[int, ...] = ()) -> str | None:
    """What a transformers ``config`` asks of attention that det_attn has not: a sliding window
    over future keys too (sliding layers with ``use_bidirectional_attention``, Gemma 3's encoder
    use) or chunked attention layers (Llama 4's ``attention_chunk_size``). Causal sliding-window
    layers (``layer_types`` with ``"sliding_attention"``, Mistral's ``sliding_window``) and
    attention logit soft-capping (Gemma 2) are det_attn's ``window`` and ``softcap``; a head dim
    det_attn has no kernels for (Gemma 2 / 3's default 256) is refused here too."""
    layer_types = tuple(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    sliding = window is not None and ("sliding_attention" in layer_types or not layer_types)
    if sliding and getattr(config, "use_bidirectional_attention", False):
        return (
            f"bidirectional sliding-window attention (config.use_bidirectional_attention=True with "
            f"sliding_window={window}) is not supported by det_attn (its window covers past keys only): "
            "build the model with use_bidirectional_attention=False, or with full attention in every layer "
            "(layer_types=['full_attention'] * num_hidden_layers)"
        )
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None
    )
    if isinstance(head_dim, int) and supported and head_dim not in supported:
        return (
            f"head_dim={head_dim} (config.head_dim, or hidden_size / num_attention_heads) is not supported "
            f"by det_attn (head dims {sorted(supported)}; Gemma 2 / 3 configs default to 256): build the "
            f"model with head_dim in {sorted(supported)}"
        )
    dropout = getattr(config, "attention_dropout", 0.0)
    if isinstance(dropout, numbers.Real) and not isinstance(dropout, bool) and dropout > 0:
        return (
            f"attention dropout (config.attention_dropout={dropout}): under transformers every layer draws "
            "the same det_attn mask, numbered by the sequence's index in its micro-batch, so the masks (and "
            "the gradients) depend on the micro-batch split and the data-parallel degree: build the model "
            "with attention_dropout=0.0 (for split-invariant attention dropout, call det_attn.attention "
            "with a global sequence_offset in your own attention module)"
        )
    chunked = "chunked_attention" in layer_types or getattr(config, "attention_chunk_size", None)
    if chunked:
        return (
            "chunked attention (config.layer_types has 'chunked_attention' layers or attention_chunk_size "
            f"is set: {getattr(config, 'attention_chunk_size', None)}) is not supported by det_attn: build "
            "the model with full attention in those layers (attention_chunk_size=None)"
        )
    return None


def _det_attn_dtype_problem(model: nn.Module) -> str | None:
    """A reason a transformers ``model`` on det_attn would fail at its first forward: no floating
    parameter in bfloat16 or float16 (det_attn's kernels take those two; an fp32 model hands its
    attention fp32 query / key / value)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes or dtypes & {torch.bfloat16, torch.float16}:
        return None
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return (
        f"its parameters are {names}, but det_attn (attn_implementation='det_attn') computes in bfloat16 "
        "or float16 only: cast the model before converting, model.to(torch.bfloat16) (AdamWSR then "
        "trains the bf16 weights with stochastic rounding, no fp32 master copy)"
    )


def _det_attn_head_dims(fn) -> tuple[int, ...]:
    """The head dims of the det_attn that registered ``fn`` (its transformers attention function),
    read from the module that defines it: det_train imports no other package (a Hub kernel may
    not), and a Hub build of det_attn has its own package name."""
    return tuple(getattr(sys.modules.get(getattr(fn, "__module__", "")), "SUPPORTED_HEAD_DIMS", ()))
