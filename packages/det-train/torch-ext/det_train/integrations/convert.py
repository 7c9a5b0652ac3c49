"""``det_train.convert(model)``: make a model's layers deterministic in one call.

Replaces, in place, every module whose computation has a deterministic det_train counterpart with
that counterpart, keeping the very same ``nn.Parameter`` objects (so optimizer state, parameter
names, ``state_dict`` keys and tied weights are untouched), and refuses, naming them all, the
modules it cannot convert that would break the invariances (unless allowed):

- ``nn.Linear`` (and subclasses that keep its ``forward``) -> ``det_train.Linear``;
- ``nn.Embedding`` (``padding_idx`` included) -> ``det_train.Embedding``; Gemma's scaled word
  embedding (an ``nn.Embedding`` times its ``embed_scale``) -> ``ScaledEmbedding``;
- ``nn.LayerNorm`` -> ``det_train.LayerNorm``;
- ``nn.RMSNorm`` and transformers' RMSNorm classes (Llama, Qwen2/3, Mistral, ...: a ``weight`` and
  an ``eps`` / ``variance_epsilon``, forward ``x * rsqrt(mean(x**2) + eps) * weight``) ->
  ``det_train.RMSNorm``; Gemma-style ones (``x_hat * (1 + weight.float())``) ->
  ``det_train.RMSNorm(offset=1.0)``; a norm applied per attention head (Qwen3's and Gemma 3's
  ``q_norm`` / ``k_norm`` over ``head_dim``, rows tokens x heads) -> ``det_train.RMSNorm(heads=H)``,
  ``H`` the heads of its sibling ``q_proj`` / ``k_proj`` (its weight gradient sums over the tokens
  in the canonical order, each token's heads in order);
- transformers' ``Conv1D`` (GPT-2) -> ``det_train.Conv1D``;
- a transformers causal LM's ``loss_function`` -> ``det_train.causal_lm_loss``;
- Qwen3-MoE's experts and router -> ``integrations/moe.py``'s ``MoeExperts`` / ``MoeTopKRouter`` (other
  families' MoE layers are refused there), and its load-balancing auxiliary loss -> det_train's
  sequence-wise one (``integrations/moe_aux_loss.py``);
- a model with a learned position embedding ``wpe`` (GPT-2) gets a forward pre-hook that passes
  ``position_ids`` of the batch's shape when the caller passes none (``_batch_position_ids``).

RMSNorm-like classes are recognised by structure and confirmed by a probe (their own forward on a
small fp32 input with a probe weight, through ``torch.func.functional_call``, compared with both
forms); ``register_conversion`` adds a class of one's own.

Per-head norms are recognised as a norm child of a module with a ``head_dim`` whose weight has
``head_dim`` elements. Refused up front: a per-head norm whose head count cannot be found (no
sibling projection) or that is not an RMSNorm; a transformers model on det_attn whose config asks
for what det_attn lacks (a bidirectional sliding window, Gemma 3's ``use_bidirectional_attention``
with sliding layers; chunked attention layers; a head dim without kernels) or whose parameters are
not bf16 / fp16, which det_attn would refuse at the first forward; attention dropout
(``config.attention_dropout > 0``), whose masks under transformers would follow the split.
Sliding-window layers (Mistral, Gemma 2/3 local layers, Qwen2/3 with ``use_sliding_window``) and
attention logit soft-capping (Gemma 2) are det_attn's ``window`` and ``softcap``: converted.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..ops.conv1d import Conv1D
from ..ops.embedding import Embedding, embedding
from ..ops.layer_norm import LayerNorm
from ..ops.linear import Linear
from ..ops.rms_norm import RMSNorm
from . import moe
from ._config_checks import attention_problem, config_dropout_fields, config_dropout_problem
from .hf_loss import causal_lm_loss

__all__ = ["ConversionError", "ScaledEmbedding", "convert", "register_conversion"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = {str(d).removeprefix("torch.") for d in _DTYPES}
# modules without parameters that still break the invariances (their forward depends on the batch
# or on a global random generator): named, never silently kept
_BATCH_DEPENDENT = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.SyncBatchNorm,
)
_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# modules that are deterministic and row-invariant already (det_train's own)
_DETERMINISTIC = (Linear, Embedding, LayerNorm, RMSNorm, Conv1D)
# attention implementations that are det_attn (transformers' ``config._attn_implementation``)
# transformers' loss types whose loss is ``ForCausalLMLoss``, replaced by ``causal_lm_loss``
_CAUSAL_LM_LOSS = ("ForCausalLM",)

_REGISTRY: dict[type, Callable[[nn.Module], nn.Module]] = {}


class ConversionError(ValueError):
    """``convert`` found modules it cannot convert; ``problems`` lists
    ``(qualified name, class name, reason)`` for each (``""`` is the model itself), in
    ``named_modules()`` order; the message shows them one per line.

    Raises: nothing itself; ``convert`` raises it (``strict=True``, the default) when one or more
    modules cannot be made deterministic and none of them is in ``allow``. A ``ValueError``, so
    ``except ValueError`` catches it too.

    **Determinism:** raised before anything is changed: the model is as it was (no module
    replaced, no loss installed), so it can be fixed and converted again.
    """

    def __init__(self, problems: list[tuple[str, str, str]]) -> None:
        self.problems = problems
        lines = [f"  {name or '<model>'} ({cls}): {reason}" for name, cls, reason in problems]
        super().__init__(
            f"det_train.convert: {len(problems)} module(s) cannot be converted to det_train's deterministic "
            "layers, so the model was left unchanged:\n"
            + "\n".join(lines)
            + "\nReplace or fix them, register a conversion "
            "(det_train.register_conversion), or keep them as they are, knowingly, with "
            "convert(model, allow=[qualified names, class names or classes]) or strict=False."
        )


class ScaledEmbedding(Embedding):
    """``det_train.Embedding`` times a constant: Gemma's scaled word embedding
    (``embedding(ids) * embed_scale.to(weight.dtype)``, transformers' ``Gemma*ScaledWordEmbedding``).

    Built by ``convert`` from such a module (its ``weight``, ``padding_idx`` and non-persistent
    ``embed_scale`` buffer are kept), or directly: ``det_train.Embedding``'s arguments plus the
    keyword ``embed_scale`` (a finite real number, default 1.0; stored as a non-persistent fp32
    0-dim buffer, as transformers does). Forward: ``ids (...)`` int32 / int64 gives ``(..., D)`` in
    ``weight.dtype``.

    Raises:
        TypeError: at construction, ``embed_scale`` not a real number (a bool, a string, a tensor);
            at forward, as ``det_train.embedding`` (ids not int32 / int64, weight not floating point).
        ValueError: at construction, ``embed_scale`` not finite, or what ``det_train.Embedding``
            refuses (``max_norm``, ``scale_grad_by_freq``, ``sparse=True``); at forward, an id outside
            ``[0, V)`` (as ``det_train.embedding``). RuntimeError: device problems, as
            ``det_train.embedding``.

    **Determinism:** the lookup and the elementwise scale are exact and row invariant; the weight
    gradient is ``det_train.embedding``'s canonical-order sum of the scaled ``dy``.

    Method: Gemma's input scaling by ``sqrt(hidden_size)`` (Gemma Team, "Gemma: Open Models Based
    on Gemini Research and Technology", 2024), as transformers' ``GemmaTextScaledWordEmbedding``.
    """

    def __init__(self, *args, embed_scale: float = 1.0, **kwargs) -> None:
        if isinstance(embed_scale, bool) or not isinstance(embed_scale, numbers.Real):
            raise TypeError(
                f"det_train.ScaledEmbedding: embed_scale must be a real number (e.g. hidden_size ** 0.5), "
                f"got {type(embed_scale).__name__} {embed_scale!r}"
            )
        if not math.isfinite(embed_scale):
            raise ValueError(f"det_train.ScaledEmbedding: embed_scale must be finite, got {embed_scale!r}")
        super().__init__(*args, **kwargs)
        # not in the state_dict, as transformers' Gemma*ScaledWordEmbedding
        self.register_buffer("embed_scale", torch.tensor(float(embed_scale)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight, self.padding_idx) * self.embed_scale.to(self.weight.dtype)


def register_conversion(cls: type, factory: Callable[[nn.Module], nn.Module]) -> None:
    """Make ``convert`` replace modules of exactly ``cls`` by ``factory(module)``.

    ``factory`` must return a module that reuses ``module``'s Parameter objects (``convert``
    checks it) and computes its forward with det_train ops. A registration takes precedence over
    the built-in recognition. Raises TypeError if ``cls`` is not an ``nn.Module`` subclass or
    ``factory`` is not callable.

    **Determinism:** registration only; the converted module is as deterministic as its forward.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_conversion: cls must be an nn.Module subclass, got {cls!r}")
    if not callable(factory):
        raise TypeError(f"register_conversion: factory must be callable, got {type(factory).__name__}")
    _REGISTRY[cls] = factory


def _rebuilt(module: nn.Module, cls: type, **attrs) -> nn.Module:
    """A ``cls`` instance with ``module``'s state (parameters, buffers, hooks, flags and plain
    attributes; containers copied, tensors shared) plus ``attrs``."""
    new = cls.__new__(cls)
    for key, value in module.__dict__.items():
        new.__dict__[key] = copy.copy(value) if isinstance(value, (dict, set, list)) else value
    for key, value in attrs.items():
        setattr(new, key, value)
    return new


def _own_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module._parameters.items() if v is not None}


def _dtype_problem(module: nn.Module) -> str | None:
    bad = sorted({str(p.dtype).removeprefix("torch.") for p in _own_params(module).values()} - _DTYPE_NAMES)
    if not bad:
        return None
    return (
        f"unsupported dtype {', '.join(bad)}: det_train's kernels take bfloat16, float16 and float32; "
        "cast the model first: model.to(torch.bfloat16) (what det_attn and AdamWSR train), or "
        "model.to(torch.float32)"
    )


def _uses_forward(module: nn.Module, base: type) -> bool:
    return isinstance(module, base) and type(module).forward is base.forward


def _is_transformers_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def _probe_rms_norm(module: nn.Module, eps: float) -> float | None:
    """The ``offset`` (0.0 or 1.0) whose form ``x_hat * (offset + weight)`` ``module``'s forward
    computes, or None. Two probes: ordinary rows, and rows whose mean square is about ``eps`` (so
    where eps is added matters)."""
    weight = module.weight
    d = weight.numel()
    g = torch.Generator().manual_seed(0)
    w = (0.5 * torch.randn(weight.shape, generator=g)).to(device=weight.device)
    rows = [torch.randn(3, d, generator=g)]
    if eps > 0:
        rows.append(rows[0] * math.sqrt(eps))
    found = None
    for offset in (0.0, 1.0):
        ok = True
        for x in rows:
            x = x.to(weight.device)
            with torch.no_grad():
                out = torch.func.functional_call(module, {"weight": w}, (x,))
            xd = x.double()
            ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())
            if out.shape != ref.shape or not torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6):
                ok = False
                break
        if ok:
            found = offset
    return found


def _rms_norm_like(module: nn.Module) -> tuple[float, float] | str | None:
    """``(eps, offset)`` of a transformers-style RMSNorm, a reason it is not convertible, or None
    when ``module`` does not look like one (a weight vector and an eps, nothing else)."""
    params = _own_params(module)
    if set(params) != {"weight"} or module._modules or params["weight"].dim() != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        return None
    eps = float(eps)
    if params["weight"].is_meta:
        return "an RMSNorm-like module on the meta device: convert after the weights are materialised"
    try:
        offset = _probe_rms_norm(module, eps)
    except Exception as err:  # any forward that cannot take one (rows, D) tensor is not an RMSNorm
        return f"looks like an RMSNorm (weight, eps) but its forward failed on a probe row: {err}"
    if offset is None:
        return (
            "looks like an RMSNorm (weight, eps) but its forward is neither x * rsqrt(mean(x**2) + eps) "
            "* weight nor ... * (1 + weight): register_conversion(...) a det_train equivalent"
        )
    return eps, offset


def _replacement(module: nn.Module, dropout_advice: str = "") -> nn.Module | str | None:
    """The deterministic replacement of ``module``, a reason it cannot be converted, or None when
    it needs none (deterministic already, or no parameters of its own and nothing batch-dependent).
    ``dropout_advice``: what to do about a dropout module (``_dropout_advice``)."""
    cls = type(module)
    if cls in _REGISTRY:
        return _REGISTRY[cls](module)
    if isinstance(module, (*_DETERMINISTIC, *moe.DETERMINISTIC)):  # det_train's own: converted already
        return None
    if "forward" in module.__dict__:
        return (
            "its forward was replaced on the instance (accelerate or kernels hooks?): call "
            "det_train.convert before dispatching, kernelizing or wrapping the model"
        )
    problem = _dtype_problem(module)
    moe_verdict = moe.replacement(module, _rebuilt)  # Qwen3-MoE's experts and router; other MoE refused
    if moe_verdict is not None:
        return problem if problem and not isinstance(moe_verdict, str) else moe_verdict
    if _uses_forward(module, nn.Linear):
        return problem or _rebuilt(module, Linear)
    if _uses_forward(module, nn.Embedding) or (
        isinstance(module, nn.Embedding)
        and hasattr(module, "embed_scale")
        and not isinstance(module, Embedding)
    ):
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            return "max_norm, sparse=True and scale_grad_by_freq are not supported by det_train.Embedding"
        if problem:
            return problem
        if _uses_forward(module, nn.Embedding):
            return _rebuilt(module, Embedding)
        return _scaled_embedding(module)
    if _uses_forward(module, nn.LayerNorm):
        return problem or _rebuilt(module, LayerNorm)
    if _uses_forward(module, nn.RMSNorm):
        return problem or _rebuilt(module, RMSNorm, offset=0.0, heads=None)
    if _is_transformers_conv1d(module):
        return problem or _rebuilt(module, Conv1D)
    if isinstance(module, _BATCH_DEPENDENT):
        return "normalises over the batch (or over groups by a torch reduction): no deterministic replacement"
    if isinstance(module, _DROPOUT) and module.p > 0:
        return (
            f"dropout with p={module.p} draws from torch's global generator (its mask depends on the "
            f"batch's shape and split): {dropout_advice or _dropout_advice(None)}"
        )
    norm = _rms_norm_like(module)
    if isinstance(norm, tuple):
        if problem:
            return problem
        eps, offset = norm
        weight = module.weight
        return _rebuilt(
            module,
            RMSNorm,
            normalized_shape=tuple(weight.shape),
            eps=eps,
            elementwise_affine=True,
            offset=offset,
            heads=None,
        )
    if isinstance(norm, str):
        return norm
    params = _own_params(module)
    if params:
        return f"no deterministic replacement (parameters: {', '.join(params)})"
    return None


def _dropout_advice(model: nn.Module | None) -> str:
    """How to remove a dropout module's randomness, in ``model``'s terms: convert accepts only
    ``p == 0`` (eval mode is not enough: ``model.train()`` would draw masks again)."""
    own = "set its p to 0 (model.get_submodule(name).p = 0.0) or replace it by nn.Identity()"
    fields = [f"{key}={value}" for key, value in config_dropout_fields(getattr(model, "config", None))]
    if not fields:
        return own
    return (
        f"build the model with these config fields at 0.0 ({', '.join(fields)}; they set the modules' p "
        f"when the model is built), or {own}"
    )


def _is_norm(module: nn.Module) -> bool:
    """A normalisation layer with a 1-D weight (and maybe a bias) and no children."""
    params = _own_params(module)
    if "weight" not in params or not set(params) <= {"weight", "bias"} or module._modules:
        return False
    norm_classes = (nn.LayerNorm, nn.RMSNorm, LayerNorm, RMSNorm)
    return params["weight"].dim() == 1 and (
        isinstance(module, norm_classes) or "norm" in type(module).__name__.lower()
    )


def _per_head_norms(model: nn.Module) -> dict[int, int | str]:
    """id -> heads (or a reason it cannot be converted) for each trainable norm applied per attention
    head (Qwen3's, Gemma 3's ``q_norm`` / ``k_norm``): a norm child of a module with a ``head_dim``,
    its weight of ``head_dim`` elements, over more than one head (its sibling ``*_proj`` has more
    than ``head_dim`` outputs: ``out_features / head_dim`` heads; without one, the module's head
    count, unknown counting as several). Its rows are tokens x heads."""
    found = {}
    for parent_name, parent in model.named_modules():
        head_dim = getattr(parent, "head_dim", None)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            continue
        for child_name, child in parent._modules.items():
            if child is None or not _is_norm(child) or child.weight.numel() != head_dim:
                continue
            # one head: its q / k projection has head_dim outputs (else the module's head count)
            proj = parent._modules.get(child_name.replace("norm", "proj"))
            out = getattr(proj, "out_features", None)
            config = getattr(parent, "config", None)
            heads = getattr(parent, "num_heads", getattr(config, "num_attention_heads", None))
            if out == head_dim if isinstance(out, int) else heads == 1:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            counts = {getattr(config, k, None) for k in ("num_attention_heads", "num_key_value_heads")}
            counts = {c for c in counts if isinstance(c, int)}
            if isinstance(out, int) and out % head_dim == 0 and (not counts or out // head_dim in counts):
                found[id(child)] = out // head_dim
                continue
            if isinstance(out, int) and out % head_dim == 0:  # a gated projection (Qwen3.5): more outputs
                found[id(child)] = (
                    f"a norm over head_dim={head_dim} applied per attention head, whose sibling projection "
                    f"has {out} outputs ({out // head_dim} x head_dim) but the config {sorted(counts)} heads "
                    "(a gated projection?): register_conversion(...) a det_train.RMSNorm(head_dim, heads=H), "
                    f"or freeze it before converting ({name}.weight.requires_grad_(False))"
                )
                continue
            found[id(child)] = (
                f"a norm over head_dim={head_dim} applied per attention head, whose head count is unknown "
                f"(no sibling {child_name.replace('norm', 'proj')} Linear with a multiple of head_dim "
                "outputs): register_conversion(...) a det_train.RMSNorm(head_dim, heads=H), or freeze it "
                f"before converting ({name}.weight.requires_grad_(False))"
            )
    return found


def _per_head(module: nn.Module, heads: int | str, dropout_advice: str) -> nn.Module | str | None:
    """The replacement of a per-head norm: ``det_train.RMSNorm(heads=H)`` (a frozen one too: its
    forward is row-wise, and it stays right if unfrozen), or a reason."""
    if isinstance(heads, str):
        return heads if module.weight.requires_grad else _replacement(module, dropout_advice)
    new = _replacement(module, dropout_advice)
    if new is None and isinstance(module, RMSNorm) and getattr(module, "heads", None) != heads:
        new = _rebuilt(module, RMSNorm, heads=heads)  # det_train's own, not told its heads
    if isinstance(new, RMSNorm):
        new.heads = heads
    elif new is not None and not isinstance(new, str) and module.weight.requires_grad:  # a LayerNorm
        return (
            f"a norm over head_dim={module.weight.numel()} applied per attention head ({heads} heads) that "
            f"is not an RMSNorm ({type(new).__name__}): only RMSNorm takes rows of tokens x heads"
        )
    return new


def _scaled_embedding(module: nn.Module) -> nn.Module | str:
    """Gemma's ``embedding * embed_scale``, confirmed by comparing the module's own forward with
    ``ScaledEmbedding``'s on probe ids (exact: a gather and one elementwise product)."""
    new = _rebuilt(module, ScaledEmbedding)
    ids = torch.arange(min(module.num_embeddings, 8), device=module.weight.device)
    try:
        with torch.no_grad():
            same = torch.equal(
                module(ids),
                torch.nn.functional.embedding(ids, module.weight)
                * module.embed_scale.to(module.weight.dtype),
            )
    except Exception as err:
        return (
            f"an nn.Embedding with its own forward and an embed_scale; its forward failed on probe ids: {err}"
        )
    if not same:
        return (
            "an nn.Embedding with its own forward (not embedding * embed_scale): no deterministic replacement"
        )
    return new


def _position_ids_index(module: nn.Module) -> int | None:
    """Where ``module.forward`` takes ``position_ids`` positionally (None: it takes none)."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("position_ids") if "position_ids" in names else None


def _batch_position_ids(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a model with a learned position embedding (GPT-2's ``wpe``).

    Called without ``position_ids``, such a model looks its positions up with ids of shape (1, T)
    and broadcasts them over the batch, so autograd sums the position embedding's gradient over the
    sequences before det_train sees it and the embedding sees T tokens while every other op sees
    B x T. Ids of the batch's shape, ``cache_position`` (else ``arange(T)``) expanded to (B, T),
    are what the model computes anyway, and the embedding's gradient is then canonical over all
    B x T tokens. Left alone: a call that passes ``position_ids`` (by keyword or position) or a
    cache of past keys (generation: transformers' own positions).
    """
    index = _position_ids_index(module)
    if kwargs.get("position_ids") is not None or (index is not None and len(args) > index):
        return None
    past = kwargs.get("past_key_values")
    if past is not None and (past.get_seq_length() if hasattr(past, "get_seq_length") else len(past)):
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    reference = ids if ids is not None else kwargs.get("inputs_embeds")
    if reference is None or reference.dim() < 2:
        return None
    batch, tokens = reference.shape[:2]
    positions = kwargs.get("cache_position")
    if positions is None:
        positions = torch.arange(tokens, device=reference.device)
    return args, {**kwargs, "position_ids": positions.reshape(1, -1).expand(batch, tokens)}


def _wants_batch_positions(module: nn.Module) -> bool:
    """A module owning a learned position embedding ``wpe`` whose forward takes ``position_ids``."""
    return isinstance(getattr(module, "wpe", None), nn.Embedding) and _position_ids_index(module) is not None


def _loss_plan(module: nn.Module) -> str | None:
    """``"replace"`` if ``module`` is a transformers model with the causal-LM loss, a reason if its
    built-in loss is another plain-torch loss, None if it has none (or its loss was set by hand).

    transformers sets ``loss_type`` from the class name and its ``loss_function`` falls back to
    ``ForCausalLMLoss`` when that is None or unknown (``GPT2LMHeadModel``: no "ForCausalLM" in the
    name), so those take the causal-LM loss too."""
    if not hasattr(module, "loss_type") or "_loss_function" in module.__dict__:
        return None
    # transformers' table of loss types, loaded with the model's module (not imported here: a Hub
    # kernel imports only the standard library, torch and triton)
    known = getattr(sys.modules.get("transformers.loss.loss_utils"), "LOSS_MAPPING", None)
    loss_type = module.loss_type
    if loss_type is None or (known is not None and loss_type not in known):
        loss_type = "ForCausalLM"  # transformers' own default (PreTrainedModel.loss_function)
    if loss_type in _CAUSAL_LM_LOSS:
        return "replace"
    return (
        f"its built-in loss {loss_type!r} is plain torch (a mean over each micro-batch): compute the "
        "loss with det_train.cross_entropy(..., num_global_tokens=N), or set model.loss_function"
    )


def _allowed(name: str, module: nn.Module, allow: set) -> bool:
    cls = type(module)
    return (
        name in allow
        or (name == "" and "<model>" in allow)  # the label ConversionError prints for the model itself
        or cls in allow
        or cls.__name__ in allow
        or f"{cls.__module__}.{cls.__qualname__}" in allow
    )


def _check_params_kept(old: nn.Module, new: nn.Module, name: str) -> None:
    before = {k: id(v) for k, v in _own_params(old).items()}
    after = {k: id(v) for k, v in _own_params(new).items()}
    if before != after:
        raise RuntimeError(
            f"det_train.convert: the replacement of {name or '<model>'} ({type(old).__name__}) does not "
            f"reuse its Parameter objects ({sorted(before)} -> {sorted(after)}); a registered factory "
            "must keep them"
        )


def convert(model: nn.Module, *, strict: bool = True, allow: Iterable = ()) -> nn.Module:
    """Replace ``model``'s layers by det_train's deterministic ones, in place; return ``model``.

    See the module docstring for what becomes what. The replacements reuse the original
    ``nn.Parameter`` objects (and buffers, hooks and attributes), so an optimizer built before or
    after, ``named_parameters()``, ``state_dict()`` keys, checkpoints and tied weights are the
    same. A module shared by several parents is replaced everywhere. For a transformers model it
    also checks ``config._attn_implementation`` (must be det_attn's) and installs
    ``causal_lm_loss`` as the ``loss_function`` of causal LMs.

    Args:
        model: any ``nn.Module`` (a transformers ``PreTrainedModel`` or plain torch), with its
            weights materialised (not on the meta device). Convert before wrapping it (FSDP, DDP,
            ``torch.compile``, accelerate dispatch, ``kernels.kernelize``).
        strict: raise ``ConversionError`` (listing every problem) if a module cannot be made
            deterministic; ``False`` keeps such modules, with a ``UserWarning`` naming them.
        allow: qualified module names (as in ``named_modules()``; ``""``, or ``"<model>"`` as the
            error prints it, is the model itself), class names or classes whose problems are
            accepted: such a module that cannot be converted is kept as it is without an error
            (e.g. a frozen ``nn.Conv1d`` stem; for a transformers model's attention or loss check,
            its name). Convertible modules are converted whether listed or not.

    Returns:
        ``model`` itself, converted.

    **Determinism:** after conversion every converted layer has det_train's guarantees (run to
    run; row invariant forward and input gradients; parameter gradients in the canonical order,
    split-invariant under a ``CanonicalGradAccumulator``). What the conversion cannot see is not
    covered: functional calls in a ``forward`` (``F.scaled_dot_product_attention``, bare matmuls:
    use ``det_attn`` and ``deterministic_mode()``), parameter-free modules that reduce with torch
    ops, losses computed inline. A norm applied per attention head (Qwen3's and Gemma 3's
    ``q_norm`` / ``k_norm``: a norm of ``head_dim`` elements inside a module with a ``head_dim``)
    becomes ``det_train.RMSNorm(heads=H)``: its weight gradient is canonical over the tokens too.

    Raises:
        ConversionError (a ValueError): with ``strict``, one or more modules that cannot be made
            deterministic (each named, with its class and why), before anything is changed.
        TypeError: ``model`` is not an ``nn.Module``; ``strict`` is not a bool (a string such as
            ``"no"`` is truthy: it would be strict).
        RuntimeError: a registered factory that does not reuse the module's Parameters.

    Method: module replacement keeping parameter identity (as ``torch.ao.quantization`` swaps
    modules), with structural recognition of transformers' norm classes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"det_train.convert: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"det_train.convert: strict must be True or False, got {strict!r}")
    allow = {allow} if isinstance(allow, (str, type)) else set(allow)  # one name or class, or several
    replacements: dict[int, nn.Module] = {}
    loss_modules, problems, configs, dropout_configs = [], [], set(), set()
    per_head, dropout_advice = _per_head_norms(model), _dropout_advice(model)
    for name, module in model.named_modules():
        kept = _allowed(name, module, allow)  # its problems are accepted; what converts, converts
        for verdict in (
            attention_problem(module, configs),
            config_dropout_problem(module, dropout_configs),
            _loss_plan(module),
        ):
            if verdict == "replace":
                loss_modules.append(module)
            elif verdict is not None and not kept:
                problems.append((name, type(module).__name__, verdict))
        heads = per_head.get(id(module))
        if heads is None:
            new = _replacement(module, dropout_advice)
        else:
            new = _per_head(module, heads, dropout_advice)
        if isinstance(new, str):
            if not kept:
                problems.append((name, type(module).__name__, new))
        elif new is not None:
            _check_params_kept(module, new, name)
            replacements[id(module)] = new
    if problems:
        if strict:
            raise ConversionError(problems)
        lines = "; ".join(f"{n or '<model>'} ({c}): {r}" for n, c, r in problems)
        warnings.warn(
            f"det_train.convert(strict=False) kept {len(problems)} module(s): {lines}", stacklevel=2
        )
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in replacements:
                parent._modules[child_name] = replacements[id(child)]
    root = replacements.get(id(model))
    if root is not None:  # the caller holds this object: it takes the replacement's class and state
        model.__class__ = type(root)
        model.__dict__.update(root.__dict__)
    for module in loss_modules:
        module.loss_function = causal_lm_loss
    for module in model.modules():
        if _wants_batch_positions(module) and not getattr(module, "_det_train_batch_positions", False):
            module.register_forward_pre_hook(_batch_position_ids, with_kwargs=True)
            module._det_train_batch_positions = True  # a second convert adds no second hook
    moe.install_hooks(model)  # a converted MoE causal LM: det_train's sequence-wise aux loss
    return model
