"""``convert``'s mixture-of-experts handling: Qwen3-MoE's experts and router become det_train's, every
other MoE layer is refused up front with its reason.

What converts (transformers' ``Qwen3MoeForCausalLM``): ``Qwen3MoeExperts`` (3-D ``gate_up_proj
(E, 2I, H)`` / ``down_proj (E, H, I)``, SiLU) -> ``MoeExperts`` (``det_train.ops.moe_experts``) and
``Qwen3MoeTopKRouter`` (a router weight ``(E, H)``) -> ``MoeTopKRouter`` (``det_train.linear`` for the
bf16 logits, ``moe_router`` for the fp32 softmax, top-k and renormalisation). The sparse block around
them (``Qwen3MoeSparseMoeBlock``: a reshape, the router, the experts) has no parameters and stays; so do
the dense ``Qwen3MoeMLP`` layers (``mlp_only_layers``, ``decoder_sparse_step``), whose Linears convert.

The load-balancing auxiliary loss (``output_router_logits=True``, ``router_aux_loss_coef``) is
det_train's sequence-wise one (``moe_aux_loss``, ``det_train.ops.moe_balance_loss``): transformers'
batch-level product of means (Switch Transformer's) would make the gradients depend on the
micro-batch split, so each sequence's loss is taken on its own and weighted by its share of
``num_items_in_batch``.

Refused (``ConversionError``, naming the module): experts that are not the concatenated, bias-free,
SiLU-gated layout; other families' experts and routers (Mixtral, OLMoE, Qwen2-MoE's shared experts,
...), named as such.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.linear import linear
from ..ops.moe_experts import moe_experts
from ..ops.moe_router import moe_router
from . import moe_aux_loss

__all__ = ["DETERMINISTIC", "MoeExperts", "MoeTopKRouter", "install_hooks", "replacement"]

_QWEN3_MOE = "transformers.models.qwen3_moe.modeling_qwen3_moe"
_SILU = ("silu", "swish")
_SUPPORTED = "det_train converts Qwen3-MoE's experts and router (Qwen3MoeExperts, Qwen3MoeTopKRouter) only"


class MoeExperts(nn.Module):
    """Qwen3-MoE's experts on det_train: ``forward(hidden_states (T, H), top_k_index (T, k) int64,
    top_k_weights (T, k)) -> (T, H)`` in ``hidden_states``' dtype, with ``gate_up_proj (E, 2I, H)`` and
    ``down_proj (E, H, I)`` the very Parameters of the converted ``Qwen3MoeExperts``.

    Built by ``convert`` (the module's state kept). Raises what ``det_train.ops.moe_experts`` raises
    (dtypes, shapes, devices).

    **Determinism:** ``moe_experts``'s: a token's output and input gradient are batch invariant; the
    expert weights' gradients are in the canonical token order, equal for any micro-batch split under a
    ``CanonicalGradAccumulator`` (computed over all the micro-batch's tokens, E / k times the routed
    FLOPs). transformers' ``config._experts_implementation`` plays no part.

    Method: transformers' ``Qwen3MoeExperts`` (SwiGLU experts, Shazeer 2020) with det_train's kernels.
    """

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


class MoeTopKRouter(nn.Module):
    """Qwen3-MoE's router on det_train: ``forward(hidden_states (..., H)) -> (router_logits (T, E),
    routing_weights (T, k), expert_indices (T, k) int64)``, ``T`` the tokens, as
    ``Qwen3MoeTopKRouter`` returns them.

    The logits are ``det_train.linear(hidden_states, weight)`` in the model's dtype (the GEMM HF's router
    runs in bf16, here batch invariant, fp32 accumulation rounded once); softmax, top-k and the
    renormalisation (``norm_topk_prob``) are fp32 in ``moe_router``, the weights rounded once to the
    logits' dtype. While its causal LM's call asks for the load-balancing loss (``moe_aux_loss``), it
    also records its logits, fp32 probabilities (``moe_router(..., return_probs=True)``) and experts
    for that loss. Raises what ``linear`` and ``moe_router`` raise.

    **Determinism:** row invariant (a token's routing depends only on its own hidden state); ties among
    equal probabilities go to the lower expert index; the router weight's gradient is ``linear``'s,
    canonical over the tokens.

    Method: top-k softmax gating (Shazeer et al., 2017), Qwen3-MoE's renormalised variant.
    """

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = linear(hidden_states, self.weight)
        record = getattr(self, "_det_train_aux_record", None)  # a list while the aux loss is asked for
        if record is None:
            weights, indices = moe_router(logits, self.top_k, self.norm_topk_prob)
        else:
            weights, indices, probs = moe_router(logits, self.top_k, self.norm_topk_prob, return_probs=True)
            record.append((self, logits, probs, indices))
        return logits, weights, indices


DETERMINISTIC = (MoeExperts, MoeTopKRouter)


def _is(module: nn.Module, name: str) -> bool:
    cls = type(module)
    return cls.__name__ == name and cls.__module__ == _QWEN3_MOE


def _experts_problem(module: nn.Module) -> str | None:
    """Why a ``Qwen3MoeExperts`` is not the layout ``moe_experts`` computes (None: it is)."""
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
    flags["has_post_expert_norm"] = False
    odd = [f"{k}={getattr(module, k)!r}" for k, v in flags.items() if getattr(module, k, v) != v]
    if odd:
        return (
            f"experts with {', '.join(odd)}: moe_experts computes the concatenated, bias-free, gated layout "
            "(transformers' default for Qwen3-MoE)"
        )
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    if act not in _SILU:
        return f"experts with hidden_act={act!r}: moe_experts computes SwiGLU (hidden_act='silu') only"
    return None


def _moe_like(module: nn.Module) -> bool:
    """A mixture-of-experts part of another family: 3-D expert weights, or a router / gate class."""
    name = type(module).__name__
    own = [p for p in module._parameters.values() if p is not None]
    if any(p.dim() == 3 for p in own) and "expert" in name.lower():
        return True
    return bool(own) and (name.endswith("Router") or name.endswith("TopKRouter") or name.endswith("MoeGate"))


def replacement(module: nn.Module, rebuilt) -> nn.Module | str | None:
    """``convert``'s MoE rule: the det_train replacement of ``module``, a reason it cannot be converted,
    or None when it is no MoE part (``convert``'s other rules then apply).

    Args:
        module: any module of the model being converted.
        rebuilt: ``convert``'s ``_rebuilt(module, cls, **attrs)`` (the module's state in a new class).

    Returns a ``MoeExperts`` / ``MoeTopKRouter`` sharing the Parameters, a reason (str), or None.
    Raises nothing.

    **Determinism:** a decision only; what it builds is as deterministic as the modules' docstrings say.
    """
    if _is(module, "Qwen3MoeExperts"):
        if any(p.is_meta for p in module.parameters(recurse=False)):
            return "experts on the meta device: convert after the weights are materialised"
        return _experts_problem(module) or rebuilt(module, MoeExperts)
    if _is(module, "Qwen3MoeTopKRouter"):
        return rebuilt(module, MoeTopKRouter)
    if _moe_like(module):
        return (
            f"a mixture-of-experts layer of a family det_train does not convert ({type(module).__module__}): "
            f"{_SUPPORTED}; register_conversion(...) a det_train equivalent"
        )
    return None


def install_hooks(model: nn.Module) -> None:
    """Give every converted MoE causal LM in ``model`` det_train's sequence-wise load-balancing loss
    in place of transformers' (``moe_aux_loss``: hooks that take effect when a call asks for router
    logits), once per module. Raises nothing.

    **Determinism:** as ``det_train.ops.moe_balance_loss``: split-invariant per sequence.
    """
    if any(isinstance(m, DETERMINISTIC) for m in model.modules()):
        moe_aux_loss.install(model, MoeTopKRouter)
