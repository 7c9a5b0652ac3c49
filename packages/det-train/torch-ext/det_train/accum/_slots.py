"""Which tracked parameter, and which of its uses, a deposit is for (``CanonicalGradAccumulator``'s
``tracked`` and the checks and use numbering of every deposit); plain functions of its state."""

from __future__ import annotations

import functools

import torch

from ._backward import graph_task_id, in_compiled_autograd, queue_callback
from ._messages import gradient_hooks

__all__ = ["storage_key", "take_slot", "tracked_param"]


def storage_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's memory as a parameter's: address, shape, strides, dtype, device."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def tracked_param(acc, t: torch.Tensor) -> torch.Tensor:
    """``acc.tracked(t)`` for a tensor that is not a tracked Parameter object: the tracked parameter
    (or FSDP2 unsharded parameter) with ``t``'s exact memory, else ``t`` (the lookup table is rebuilt
    when it misses: a parameter's storage may have moved)."""
    key = storage_key(t)
    hit = acc._by_storage.get(key)
    if hit is not None and storage_key(hit) == key:
        return hit
    fsdp = (getattr(fp, "_unsharded_param", None) for fp in acc._fsdp.values())
    acc._by_storage = {storage_key(p): p for p in (*acc._params, *(u for u in fsdp if u is not None))}
    return acc._by_storage.get(key, t)


def take_slot(acc, param: torch.Tensor) -> tuple[int, int]:
    """The slot ``(index, use)`` of a deposit for ``param`` in the active micro-batch: its tracked
    index and use number (deposits for one parameter in one micro-batch, numbered in the order they
    come), counted; the running backward registered so a failed one is caught at the micro-batch's
    end.

    Raises:
        RuntimeError: the accumulator is poisoned; no micro-batch is active; a hook was registered on
            the parameter inside the micro-batch (it would see ``None``).
        ValueError: ``param`` is not tracked (nor FSDP2's unsharded form of a tracked one).
    """
    acc._check_poisoned()
    if acc._token_offset is None:
        raise RuntimeError("deposit outside micro_batch(): wrap forward and backward in acc.micro_batch(...)")
    index = acc._index.get(id(param))
    if index is None:  # FSDP2: the unsharded parameter of a tracked sharded one
        index = next(
            (i for i, fp in acc._fsdp.items() if getattr(fp, "_unsharded_param", None) is param), None
        )
    if index is None:
        empty = (  # a generator read before (by the optimizer, say) gives an accumulator of nothing
            "; it tracks no parameter at all: model.named_parameters() is a generator that reads once, "
            "make a new one (or a list) for each consumer"
            if not acc._params
            else ""
        )
        raise ValueError(
            f"deposit for a parameter of shape {tuple(param.shape)} that this accumulator does not "
            "track: pass it in CanonicalGradAccumulator(params) (parameters with requires_grad=False "
            f"when the accumulator was built are left out: build it after unfreezing them){empty}"
        )
    tracked = acc._params[index]
    if tracked._backward_hooks or tracked._post_accumulate_grad_hooks:  # registered inside the context
        raise RuntimeError(gradient_hooks([acc._names[index]]))
    task = graph_task_id()
    if task >= 0 and task not in acc._unfinished and not in_compiled_autograd():
        acc._unfinished.add(task)
        queue_callback(functools.partial(acc._unfinished.discard, task))
    use = acc._uses.get(index, 0)
    acc._uses[index] = use + 1
    return index, use
