"""The accumulator's error messages that name a parameter and its op, and the checks that raise
them (kept out of grad_accum.py, which holds the bookkeeping); plain functions of its state."""

from __future__ import annotations

import contextlib

import torch
from det_core.runtime import as_index

__all__ = [
    "check_micro_batch",
    "check_not_open",
    "failed_backward",
    "frozen_hint",
    "poisoned",
    "several_graphs",
    "slot_name",
    "token_mismatch",
    "who",
]


def _listed(names: list[str]) -> str:
    """Up to 8 names, then how many more."""
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def slot_name(name: str, use: int) -> str:
    """``"<name> (use <u>)"`` of a parameter's use, or ``"<name> (fixed fold)"`` (``fixed_folds``' slot)."""
    return f"{name} (fixed fold)" if use < 0 else f"{name} (use {use})"


def who(acc, param: torch.Tensor | None, op: str | None) -> str:
    """``"<parameter name> (<op>)"`` of a deposit: the tracked name of ``param`` (FSDP2's unsharded
    parameter named as its sharded one), else "an untracked parameter" / "a parameter"."""
    index = None if param is None else acc._index.get(id(param))
    if index is None and param is not None:  # FSDP2: the unsharded parameter of a tracked one
        index = next((i for i, f in acc._fsdp.items() if getattr(f, "_unsharded_param", None) is param), None)
    if param is None:  # the token count micro_batch(num_tokens=...) was given, or an op's
        return op if op and op.startswith("micro_batch") else f"a parameter ({op or 'an op'})"
    name = "an untracked parameter" if index is None else acc._names[index]
    return f"{name} ({op or 'an op'})"


def token_mismatch(acc, n: int, param: torch.Tensor | None, op: str | None) -> str:
    """The error of an op that saw ``n`` tokens where the micro-batch's first op saw others."""
    return (
        f"{who(acc, param, op)} saw {n} tokens (rows) in this micro-batch, but "
        f"{who(acc, *acc._tokens_by)} saw {acc._tokens}: every canonical-order op of a micro-batch "
        "must see all its tokens, one row per token (or rows_per_token rows). An op that sees more "
        "rows than tokens runs per attention head (a q/k norm over (B, T, H, D) not told its heads: "
        "det_train.convert makes q/k norms per-head, det_train.RMSNorm(..., heads=H); "
        "det_train.rms_norm takes rows_per_token=H); one that sees fewer is given indices broadcast "
        "over the batch (a learned position embedding looked up with (1, T) position ids: pass "
        "position_ids of the batch's shape, position_ids=torch.arange(T).expand(B, T); "
        "det_train.convert does it for GPT-2-style models) or sees pooled or selected rows by design "
        "(a classification head on each sequence's last token): the canonical order is per token, so "
        "keep such a head a torch module and leave its parameters out of the accumulator (autograd then "
        "sums its gradient in micro-batch order, which is not invariant to the split). If both ops are "
        "the same parameter's, a second forward and backward over other tokens ran in this micro-batch: "
        "give each token range its own micro_batch(token_offset=...)"
    )


def leaf_gap(name: str, use: int, offset: int, leaf: int, open_leaf) -> str:
    """Why a micro-batch starting at ``offset`` inside a leaf cannot continue ``name``'s rows there."""
    end = open_leaf.end if open_leaf else "the leaf start (none deposited)"
    text = (
        f"{name} (use {use}): this micro-batch starts at token {offset} inside leaf {offset // leaf}, whose "
        f"rows for this parameter end at {end}: the parameter was not used in every micro-batch that "
        "split the leaf"
    )
    if use > 0:  # a tied parameter's later use, or the same use again: a second backward
        text += (
            f", or a second backward ran in this micro-batch (use {use} of the parameter: one backward "
            "per micro-batch; after a failed backward leave the `with` block and run the micro-batch again)"
        )
    return text


def failed_backward(acc, token_offset: int) -> str:
    """The error of a micro-batch (at ``token_offset``) whose context exits normally although a
    backward in it raised after its first deposit (the error caught inside the ``with`` block)."""
    shown = _listed(sorted(acc._names[i] for i in acc._uses))
    return (
        f"the micro-batch at token_offset {token_offset}: a backward in it raised after it began "
        f"depositing (for {shown}), and the error was caught inside `with acc.micro_batch(...)`. Its "
        "deposits are partial, and a forward and backward run again in the same context would deposit "
        "a second time (counted as a second use of each parameter, as a tied weight's). Let the "
        "exception leave the `with` block, then run the micro-batch again in a new one "
        "(recoverable=True undoes this micro-batch's deposits; with recoverable=False call acc.reset() "
        "and run the step again)"
    )


def several_graphs(error: BaseException, token_offset: int, undone: bool = True) -> str | None:
    """The message for autograd's version error on the deposit ticket (a 0-element int64 tensor):
    the forward ran as several compiled graphs, each saving the one ticket that every deposit
    mutates, so a later graph's backward changed what an earlier one saved. None for other errors.
    ``undone``: the micro-batch's deposits were undone (else the accumulator is poisoned)."""
    text = str(error)
    if not (isinstance(error, RuntimeError) and "modified by an inplace operation" in text):
        return None
    if "[torch.LongTensor [0]]" not in text and "[torch.cuda.LongTensor [0]]" not in text:
        return None
    return (
        f"CanonicalGradAccumulator: the micro-batch at token {token_offset} ran the model as several "
        "torch.compile graphs (a graph break, or modules compiled one by one): every plain deposit of the "
        "accumulator mutates one ticket tensor that each graph saves, so the graphs' backwards cannot all "
        "run. Compile the model as one graph (torch.compile(model, fullgraph=True)), or use fixed folds "
        "(CanonicalGradAccumulator(..., recoverable=False) and acc.fixed_folds(model)): the Linear, "
        "RMSNorm and Embedding weights then fold into buffers of their own in any graph, and the deposits "
        "left (biases, other ops) must sit in one graph. "
        + (
            "The micro-batch's deposits were undone: run it again."
            if undone
            else "Its deposits had begun (recoverable=False): the accumulator refuses further use; build a "
            "new one and run the step again."
        )
    )


def gradient_hooks(names: list[str]) -> str:
    """The error of a micro-batch entered while tracked parameters have tensor hooks (``register_hook``)
    or post-accumulate-grad hooks (``register_post_accumulate_grad_hook``)."""
    shown = _listed(names)
    return (
        f"tracked parameters have gradient hooks (register_hook or register_post_accumulate_grad_hook): "
        f"{shown}. The det_train ops send their gradients to this accumulator, not through autograd, so "
        "such a hook would see None (p.grad is written by acc.reduce(), after the last micro-batch): a "
        "hook that masks, scales, clips or steps with the gradient would silently do nothing. Remove the "
        "hook and apply it to p.grad after acc.reduce(), or leave the parameter out of the accumulator"
    )


def grad_of_tracked(name: str) -> str:
    """The error of ``torch.autograd.grad`` asking for a tracked parameter's gradient in a micro-batch."""
    return (
        f"torch.autograd.grad(..., inputs=[...]) asks for {name}'s gradient, but det_train ops send a "
        "tracked parameter's gradient to the active CanonicalGradAccumulator, not to autograd (it would "
        "return None here, and the deposit would count the gradient again at the next backward). Inside "
        "a micro-batch take gradients with respect to activations or inputs only, or compute this one "
        "outside acc.micro_batch(...) (no accumulator active: the ops then return ordinary autograd "
        "gradients)"
    )


def poisoned(acc, token_offset: int, error: BaseException) -> str:
    """The error of a call to an accumulator built with ``recoverable=False`` after a micro-batch
    (starting at ``token_offset``) raised ``error`` once its deposits had begun (with fixed folds: at
    any point inside it, their buffers being written by the backward without a host step)."""
    fixed = acc._fixed.folds if acc._fixed is not None else {}
    shown = _listed(sorted(acc._names[i] for i in {*acc._uses, *fixed}))
    when = "inside it (its fixed folds are written in place by the backward, with no host step to tell when)"
    retry = (
        "build it without fixed_folds and with recoverable=True (the default; one or two more fp32 buffers "
        "per parameter, docs/det-train.md, 'Gradient memory')"
        if fixed
        else "build the accumulator with recoverable=True (the default; one or two more fp32 buffers per "
        "parameter, docs/det-train.md, 'Gradient memory')"
    )
    return (
        f"this CanonicalGradAccumulator (recoverable=False) is poisoned: the micro-batch at token_offset "
        f"{token_offset} raised {type(error).__name__}: {error} "
        + (when if fixed else "after its deposits began")
        + ", and without an undo log its folds and tree nodes were written in place, so these parameters "
        f"may hold partial sums: {shown}. Nothing is reduced or deposited until acc.reset() (drops every "
        "deposit of the step) or a new accumulator; then run the whole step's micro-batches again. To "
        f"retry a single micro-batch instead, {retry}"
    )


def check_not_open(acc, slot: tuple[int, int], start: int, end: int) -> None:
    """Raise ValueError if a leaf that tokens ``[start, end)`` touch holds an open leaf of ``slot``
    (an earlier micro-batch ended inside it): a look at the slot's open leaves (usually none or one),
    whatever the number of leaves of the call."""
    first, last = start // acc.leaf_tokens, (end - 1) // acc.leaf_tokens
    for j in acc._open_leaves.get(slot, ()):
        if first <= j <= last:
            held = acc._carry[(*slot, j)]
            raise ValueError(
                f"{acc._names[slot[0]]} (use {slot[1]}): leaf {j} already holds tokens "
                f"[{held.start}, {held.end}) of an earlier micro-batch: micro-batches overlap"
            )


@contextlib.contextmanager
def frozen_hint(names: list[str], params: list[torch.Tensor]):
    """Re-raise a ``reduce`` check's error with its likely cause when tracked parameters were frozen
    (``requires_grad=False``) after the accumulator was built: their ops deposit nothing from then on,
    so the checks see missing leaves or no deposit and would name other causes."""
    try:
        yield
    except (ValueError, RuntimeError) as err:
        frozen = [name for name, p in zip(names, params, strict=True) if not p.requires_grad]
        if not frozen:
            raise
        raise type(err)(
            f"{err}. Likely cause: requires_grad=False on {_listed(frozen)}, set after this "
            "accumulator was built (their ops deposit nothing since): build the accumulator from the "
            "parameters that train (acc.reset() drops this step's deposits)"
        ) from err


def check_micro_batch(acc, token_offset, num_tokens, nested: bool) -> tuple[int, int | None]:
    """``CanonicalGradAccumulator.micro_batch``'s checks of its arguments and of the accumulator
    (``nested``: another micro-batch is active), in the order its Raises lists them; returns
    ``(token_offset, num_tokens)`` as ints."""
    token_offset = as_index(token_offset, "token_offset", "micro_batch")  # TypeError
    if num_tokens is not None:
        num_tokens = as_index(num_tokens, "num_tokens", "micro_batch")
    acc._check_poisoned()  # before any other error: the step must be run again
    if token_offset < 0:
        raise ValueError(f"token_offset must be a non-negative int, got {token_offset!r}")
    if num_tokens is not None and num_tokens <= 0:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    if acc._fixed is not None and num_tokens is None:
        raise ValueError(
            "this accumulator has fixed folds (fixed_folds): pass the micro-batch's token count, "
            "acc.micro_batch(token_offset, num_tokens=...)"
        )
    if token_offset % acc.leaf_tokens and token_offset not in acc._open_ends:
        ends = sorted(acc._open_ends)
        raise ValueError(
            f"token_offset {token_offset} is not a multiple of leaf_tokens {acc.leaf_tokens} and no "
            f"earlier micro-batch on this rank ended there (open leaves end at {ends}): a micro-batch "
            "starts on a leaf boundary unless it continues one that ended inside a leaf "
            "(data-parallel shards are multiples of leaf_tokens)"
        )
    if nested:
        raise RuntimeError("a micro_batch context is already active; micro-batches cannot be nested")
    hooked = [
        name
        for name, p in zip(acc._names, acc._params, strict=True)
        if p._backward_hooks or p._post_accumulate_grad_hooks
    ]
    if hooked:
        raise RuntimeError(gradient_hooks(hooked))
    return token_offset, num_tokens
