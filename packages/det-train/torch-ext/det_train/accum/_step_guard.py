"""An optimizer step over gradients still waiting in an accumulator raises instead of doing nothing.

Forgetting ``acc.reduce(...)`` used to cost a whole step silently: every tracked ``p.grad`` is still
None, so ``optimizer.step()`` skips those parameters without a word (torch's optimizers skip a param
whose grad is None). While any accumulator holds deposits not yet reduced, a torch global optimizer
step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) refuses a step over one of
its parameters; the hook is registered only then, so optimizers (compiled ones included) see nothing
of it otherwise.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["mark_pending", "mark_reduced", "supersede"]

_PENDING: weakref.WeakSet = weakref.WeakSet()  # accumulators holding deposits not yet reduced
_HOOK: list = []  # the registered hook's handle, while _PENDING is not empty


def mark_pending(acc) -> None:
    """``acc`` holds deposits that ``reduce`` has not turned into ``p.grad`` yet."""
    _PENDING.add(acc)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_unreduced_step))


def mark_reduced(acc) -> None:
    """``acc`` holds nothing (reduced or reset); the hook goes when no accumulator is pending."""
    _PENDING.discard(acc)
    if _HOOK and not _PENDING:
        _HOOK.pop().remove()


def supersede(acc) -> None:
    """A new accumulator ``acc`` over parameters a pending one tracks replaces it ("build a new
    accumulator to start over"): the old one's deposits no longer hold back an optimizer step."""
    mine = {id(p) for p in acc._params}  # ids of live tensors: a pending accumulator holds its own
    for old in list(_PENDING):
        if old is not acc and not mine.isdisjoint(old._index):
            mark_reduced(old)


def _tracked_names(acc, optimizer) -> list[str]:
    tracked = acc._index
    return [
        acc._names[tracked[id(p)]] for g in optimizer.param_groups for p in g["params"] if id(p) in tracked
    ]


def _refuse_unreduced_step(optimizer, args, kwargs) -> None:
    if torch.compiler.is_compiling():  # a traced step: the eager call before it was checked
        return None
    if any(_tracked_names(acc, optimizer) for acc in list(_PENDING)):
        gc.collect()  # an accumulator dropped by the program but not yet collected (a cycle) goes
    for acc in list(_PENDING):
        names = _tracked_names(acc, optimizer)
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() while a CanonicalGradAccumulator holds micro-batches "
                f"not reduced ({shown}): call acc.reduce(total_tokens=...) after the last micro-batch and "
                "before the optimizer step (until then the tracked parameters' .grad are not set, and "
                "this step would skip them); nothing was updated"
            )
    return None
