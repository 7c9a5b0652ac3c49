"""``convert``'s load-balancing auxiliary loss for a converted Qwen3-MoE causal LM: transformers'
``load_balancing_loss_func`` replaced by det_train's sequence-wise loss (``ops.moe_balance_loss``).

When a call asks for router logits (``output_router_logits=True``, or ``config.output_router_logits``),
a forward pre-hook on the causal LM turns transformers' own aux loss off (it passes
``output_router_logits=False``), and every converted router (``MoeTopKRouter``) records its logits,
fp32 probabilities and chosen experts for that call; a forward hook then computes

    aux_loss = sum over the call's sequences s, in order, of aux_s * tokens_s / num_items_in_batch

(``aux_s``: transformers' loss on sequence ``s`` alone over all MoE layers, honouring the 2-D
``attention_mask``; ``tokens_s``: the sequence's counted shifted labels, the tokens
``num_items_in_batch`` counts), sets ``output.aux_loss`` and ``output.router_logits`` (the recorded
logits, one ``(B*T, E)`` tensor per MoE layer, as transformers returns them) and, with ``labels``,
adds ``router_aux_loss_coef * aux_loss`` to ``output.loss``, as transformers does.

A sequence is a batch row of the call, or, in a packed row, each document (``cu_seq_lens_q``, else
``position_ids`` restarting at 0, as transformers' ``DataCollatorWithFlattening`` passes them). A
causal LM's micro-batches hold whole rows (a row cannot be continued in another call without a cache
of past keys), so each sequence's term, and its tokens' gradient, is the same whatever the
micro-batch split, and a document's whether it is packed with others or not.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..accum.grad_accum import current_accumulator
from ..ops.moe_balance_loss import moe_balance_loss
from .hf_loss import _token_count

__all__ = ["install"]

_STATE = "_det_train_aux_loss_call"


def _routers(model: nn.Module, router_cls: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, router_cls)]


def _arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (positional ones too), ``**kwargs`` flattened in."""
    bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    extra = {}
    for name, param in inspect.signature(module.forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = bound.pop(name, {})
    return {**bound, **extra}


def _before(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: a call that asks for router logits records them for det_train's aux loss."""
    router_cls = module._det_train_aux_router_cls
    routers = _routers(module, router_cls)
    call = _arguments(module, args, kwargs)
    asked = call.get("output_router_logits")
    if asked is None:
        asked = getattr(module.config, "output_router_logits", False)
    record = [] if asked else None
    for router in routers:  # a call that raised may have left the last call's record: reset it
        router._det_train_aux_record = record
    if not asked:
        module.__dict__.pop(_STATE, None)
        return None
    module.__dict__[_STATE] = (record, routers, call, call.get("return_dict"))
    call["output_router_logits"] = False  # transformers' batch-level aux loss: not computed
    call["return_dict"] = True
    return (), call


def _mask(call: dict, batch: int, seq: int) -> torch.Tensor | None:
    """The call's 2-D attention mask over its ``seq`` new tokens (a generation step's mask also
    covers the cached ones: its last ``seq`` columns), or None."""
    mask = call.get("attention_mask")
    if mask is None:
        return None
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < seq:
        raise ValueError(
            f"det_train's load-balancing loss (output_router_logits=True) takes a 2-D (batch, tokens) "
            f"attention_mask, as transformers' does, got shape {tuple(mask.shape)} for {batch} x {seq} "
            "tokens"
        )
    return mask[:, mask.shape[1] - seq :]


def _starts(call: dict, batch: int, seq: int, device) -> torch.Tensor:
    """``(B, T)`` bool: where a sequence starts. A row's first token, and in a packed row each
    document's first token: ``cu_seq_lens_q``'s offsets, else ``position_ids`` restarting at the row's
    smallest position (what transformers' ``DataCollatorWithFlattening`` passes)."""
    starts = torch.zeros((batch, seq), dtype=torch.bool, device=device)
    starts[:, 0] = True
    cu = call.get("cu_seq_lens_q")
    positions = call.get("position_ids")
    if cu is not None and batch == 1:
        starts[0, cu.to(device)[:-1].clamp(max=seq - 1)] = True
    elif positions is not None:
        if positions.dim() != 2 or positions.shape[-1] != seq or positions.shape[0] not in (1, batch):
            raise ValueError(
                "det_train's load-balancing loss (output_router_logits=True) reads documents from "
                f"position_ids of shape (batch, tokens) = ({batch}, {seq}), got {tuple(positions.shape)}"
            )
        # transformers' flash-attention rule, which det_attn follows: a document starts where a row's
        # position equals the row's smallest (0, or padding_idx + 1 for RoBERTa-like positions)
        positions = positions.to(device).expand(batch, seq)
        starts |= positions == positions.min(dim=-1, keepdim=True).values
    return starts


def _sequences(call: dict, batch: int, seq: int, device) -> tuple:
    """``(sequence (N,), position (N,), tokens (S,), total)``: each token's sequence (-1: masked
    out) and position in it, each sequence's weight numerator (its counted shifted labels; without
    labels, its counted tokens) and ``num_items_in_batch`` (without it, outside an accumulator:
    the call's sum of ``tokens``). Index arithmetic in int64: exact."""
    flat = _starts(call, batch, seq, device).reshape(-1)
    index = torch.arange(flat.numel(), device=device)
    sequence = torch.cumsum(flat.long(), 0) - 1
    position = index - torch.cummax(torch.where(flat, index, 0), 0).values
    count = int(sequence[-1]) + 1
    mask = _mask(call, batch, seq)
    if mask is not None:
        counted = mask.to(device).reshape(-1) != 0
    else:
        counted = torch.ones_like(flat)
    labels, shift = call.get("labels"), call.get("shift_labels")
    ignore = call.get("ignore_index", -100)
    if shift is None and labels is not None:
        shift = torch.nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
    weight = (shift.to(device).reshape(-1) != ignore) if shift is not None else counted
    tokens = torch.zeros(count, dtype=torch.int64, device=device).scatter_add_(0, sequence, weight.long())
    sequence = torch.where(counted, sequence, -1)
    total = call.get("num_items_in_batch")
    if total is None:
        if current_accumulator() is not None:
            raise ValueError(
                "det_train's load-balancing loss (output_router_logits=True): inside a "
                "CanonicalGradAccumulator micro-batch the call needs num_items_in_batch (the counted "
                "tokens of the whole global batch; transformers' Trainer passes it, or call "
                "model(..., num_items_in_batch=N)): weights over each micro-batch alone would make the "
                "gradients depend on the split"
            )
        return sequence, position, tokens, tokens.sum()
    return sequence, position, tokens, _token_count(total)


def _after(module: nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook: det_train's aux loss from the routers' records, into the output."""
    state = module.__dict__.pop(_STATE, None)
    if state is None:
        return None
    record, routers, call, return_dict = state
    for router in routers:
        router._det_train_aux_record = None
    if not record:
        return None  # no MoE layer ran (all dense): no aux loss, as no router logits
    rows = record[0][1].shape[0]
    reference = call.get("input_ids")
    reference = reference if reference is not None else call.get("inputs_embeds")
    batch = reference.shape[0] if reference is not None and reference.dim() >= 2 else 1
    seq = rows // batch
    for router, _, probs, _ in record:
        if torch.is_grad_enabled() and router.weight.requires_grad and not probs.requires_grad:
            raise RuntimeError(
                "det_train's load-balancing loss: the router probabilities carry no gradient although "
                "the router weight requires one (reentrant gradient checkpointing runs the layers without "
                "autograd): use gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False})"
            )
    sequence, position, tokens, total = _sequences(call, batch, seq, record[0][2].device)
    terms = moe_balance_loss(
        [r[2] for r in record], [r[3] for r in record], sequence, position, tokens, total
    )
    # the call's value: its sequences' terms added in order, so each term is split-invariant and
    # one-sequence micro-batches add up to the whole batch's bits
    aux = terms[0]
    for s in range(1, terms.shape[0]):
        aux = aux + terms[s]
    fields = {name: getattr(output, name, None) for name in output.__dataclass_fields__}
    fields["aux_loss"], fields["router_logits"] = aux, tuple(r[1] for r in record)
    if fields.get("loss") is not None and call.get("labels") is not None:
        fields["loss"] = fields["loss"] + module.router_aux_loss_coef * aux.to(fields["loss"].device)
    new = type(output)(**fields)
    return new if return_dict is not False else new.to_tuple()


def install(model: nn.Module, router_cls: type) -> None:
    """Give every transformers MoE causal LM in ``model`` (a module with ``router_aux_loss_coef``)
    the hooks that compute det_train's sequence-wise load-balancing loss from its ``router_cls``
    routers (once per module). Raises nothing.

    **Determinism:** as ``det_train.ops.moe_balance_loss``: each sequence's term and gradient do not
    depend on the micro-batch split; the call's ``aux_loss`` adds its terms in sequence order.
    """
    for module in model.modules():
        if hasattr(module, "router_aux_loss_coef") and not getattr(module, "_det_train_aux_loss", False):
            module._det_train_aux_router_cls = router_cls
            module.register_forward_pre_hook(_before, with_kwargs=True)
            module.register_forward_hook(_after, with_kwargs=True)
            module._det_train_aux_loss = True
