"""The route of a parameter gradient from an op's backward into the active ``CanonicalGradAccumulator``.

A deposit op (``det_train::linear_deposit_weight``, ``rms_norm_backward_deposit``, ...) hands its
per-token inputs to the gradient to ``rows``, in one call at the place where the gradient leaves the op:
``rows`` finds the active accumulator, maps the op's tensor to the parameter it tracks, deposits the rows
(``CanonicalGradAccumulator.deposit_rows``, or ``deposit_partial`` of the op's own subtrees for a call
of whole leaves) and copies an open leaf's rows before the op returns.

The forward's half: whether a backward deposits or returns an autograd gradient is a property of the
traced graph, so it is decided when the forward runs (``accumulation()``: Dynamo guards the active
accumulator's presence and ``leaf_tokens``, not the micro-batch's token offset, so micro-batches do
not recompile). The deposit itself is an opaque op whose implementation runs at every call of the
compiled backward and does the accumulator's bookkeeping there (it reads the micro-batch's token
offset then); it declares the deposit ticket (``ticket()``, one int64 counter) mutated, which keeps it
in the graph (functionalization drops an op that returns nothing and mutates nothing) and orders all
deposits of a graph in autograd's order (each reads the ticket the previous one wrote), the order in
which uses of a tied parameter are numbered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from det_core.reduce import TreePartial
from det_core.runtime import plain_eager

from ._fixed_folds import fold_for, fold_once
from ._open_leaf import LeafFold
from .grad_accum import DEFAULT_LEAF_TOKENS, current_accumulator

__all__ = [
    "LeafSums",
    "accumulation",
    "fixed_fold",
    "fixed_fold_pos",
    "fold_checked",
    "fold_wanted",
    "leaf_tokens",
    "rows",
    "ticket",
]

# An op's leaf-sum function: (leaf_tokens, global index of the first leaf, rows of whole leaves) ->
# partial tree of the leaf sums over those rows (only the last leaf of the global batch may be short).
LeafSums = Callable[[int, int, tuple], TreePartial]

# One tensor for every deposit op: what matters is that each deposit op declares it mutated (each
# "adds 1" to it); it carries no value. It is empty: a forward op that may deposit takes it, so under
# torch.compile(mode="reduce-overhead") it is an input of a CUDA-graph partition, which also returns
# it (an input the partition does not free), and CUDA-graph trees refuse a partition input or output
# that is not CUDA memory ("These storage data ptrs are not allocated in pool ... but should be",
# "Expected all cuda outputs") unless its storage is empty. Static: they then pass it as it is,
# instead of copying it into their pool before each replay.
_TICKET = torch.zeros((0,), dtype=torch.int64)
torch._dynamo.mark_static_address(_TICKET)


def ticket() -> torch.Tensor:
    """The tensor the deposit ops declare mutated (an empty CPU int64 tensor).

    Returns:
        The process-wide ticket, empty (no memory: CUDA-graph trees accept it as a graph's input
        and output) and a static input for ``torch.compile``. Passed to a forward op, it reaches that
        op's backward, whose deposit op "adds 1" to it (writes no element). Raises nothing.

    **Determinism:** the ticket carries no value into any result; it only makes the deposits of a
    compiled graph one chain (each deposit op reads what the previous one wrote), so Inductor keeps
    them, in the order autograd traced them.
    """
    return _TICKET


def accumulation() -> tuple[int, bool]:
    """``(leaf_tokens, active)`` of the current micro-batch, read when the forward runs (or is traced).

    Returns:
        The active ``CanonicalGradAccumulator``'s ``leaf_tokens`` and True inside its
        ``micro_batch``; ``(DEFAULT_LEAF_TOKENS, False)`` outside every micro-batch. Raises nothing.

    Under ``torch.compile`` Dynamo guards on what this reads (whether an accumulator is active and
    its ``leaf_tokens``), so entering another micro-batch of the same accumulator reuses the graph,
    and a graph traced outside a micro-batch is not reused inside one (or the other way round).

    **Determinism:** a lookup; it selects between the deposit and the plain gradient, which is
    what makes the weight gradients micro-batch invariant under an accumulator.
    """
    acc = current_accumulator()
    if acc is None:
        return DEFAULT_LEAF_TOKENS, False
    return acc.leaf_tokens, True


def fixed_fold(op: str, weight: torch.Tensor, tokens: int) -> tuple | None:
    """``(fold, count)`` of ``weight`` in the active accumulator (``CanonicalGradAccumulator.fixed_folds``:
    its fold buffer, or buffers, and the device counter its fold op adds 1 to), read when the forward
    runs (or is traced); None without an active accumulator, a fixed fold for ``weight``, or autograd
    recording (a forward under ``no_grad`` has no backward to fold).

    Args:
        op: the public name of the op, for the message.
        weight: the parameter as the forward received it.
        tokens: the rows of the forward's call (the micro-batch's tokens).

    Raises:
        ValueError: ``tokens`` differs from the micro-batch's ``num_tokens``.

    **Determinism:** a lookup; it chooses where the weight's open leaf is folded, not the order.
    """
    acc = current_accumulator()
    return None if acc is None else fold_for(acc, weight, tokens, op)


def fixed_fold_pos() -> torch.Tensor:
    """The active accumulator's int64 0-d device tensor holding the micro-batch's first token within
    its leaf (``fixed_folds``; written at ``micro_batch`` entry), for kernels that place rows in a
    fixed fold by it. Call only after ``fixed_fold`` returned a fold. Raises nothing.

    **Determinism:** a position, read by the kernel from device memory so that one captured launch
    places every micro-batch's rows.
    """
    return current_accumulator()._fixed.pos


def fold_wanted(op: str, weight: torch.Tensor, dy: torch.Tensor) -> bool:
    """Whether the backward continues ``weight``'s fixed fold: under a trace (``torch.compile``)
    always; in eager execution only when the running backward accumulates into ``weight`` (not
    ``torch.autograd.grad`` of other tensors), as a deposit. Raises nothing (``fold_checked``, in the
    fold op, raises outside a micro-batch).

    **Determinism:** a yes / no from the engine's graph, no value read.
    """
    if not plain_eager((dy,)):
        return True
    acc = current_accumulator()
    return acc is None or acc._backward_wants(weight)


def fold_checked(op: str, count: torch.Tensor) -> None:
    """A fold op's checks where its body runs (eager, and compiled graphs outside CUDA graphs, whose
    replays run no Python): an accumulator is active, and the fold (identified by its ``count``) is
    continued once in this micro-batch.

    Raises:
        RuntimeError: the backward runs outside every micro-batch.
        ValueError: the fold was already continued in this micro-batch (the weight used twice, or a
            second backward).

    **Determinism:** checks only.
    """
    acc = current_accumulator()
    if acc is None:
        raise _outside(op)
    fold_once(acc, count, op)


def _outside(op: str) -> RuntimeError:
    """The error of a deposit op whose backward runs outside every micro-batch."""
    return RuntimeError(
        f"{op}: the forward ran inside a CanonicalGradAccumulator micro_batch (its weight gradients "
        "go to the accumulator) but the backward runs outside every micro_batch: run forward and "
        "backward inside the same `with acc.micro_batch(...)`"
    )


def leaf_tokens(op: str) -> int:
    """The active accumulator's ``leaf_tokens``, for a deposit op whose kernel layout depends on the
    leaf (the norms' sub-leaves) and which must choose it before it calls ``rows``.

    Args:
        op: the public name of the op (``"det_train.rms_norm"``), for the message.

    Raises:
        RuntimeError: no micro-batch is active: the forward ran inside ``acc.micro_batch(...)`` (so
            its backward deposits) but the backward runs outside it. Run both inside.

    **Determinism:** a lookup; the leaf size is part of the canonical order the op sums in.
    """
    acc = current_accumulator()
    if acc is None:
        raise _outside(op)
    return acc.leaf_tokens


def rows(
    op: str,
    tensor: torch.Tensor,
    rows: tuple,
    leaves: LeafSums,
    fold: LeafFold | None = None,
    whole: Callable[[int], TreePartial] | None = None,
    rows_per_token: int = 1,
) -> None:
    """Deposit the gradient of the parameter ``tensor`` is, over this micro-batch's rows, into the
    active accumulator: the one call through which a deposit op's gradient reaches it.

    Args:
        op: the public name of the op (``"det_train.linear"``), for errors.
        tensor: the parameter as the op received it: the tracked Parameter, FSDP2's unsharded
            parameter, or (in a compiled backward) a tensor aliasing one exactly (same storage,
            offset, shape, strides, dtype and device).
        rows: the op's per-token inputs to the gradient, tensors whose dim 0 is this micro-batch's
            tokens in order (e.g. ``(dy, x)`` of a Linear weight), all of one length.
        leaves: ``leaves(leaf_tokens, first_leaf, leaf_rows)`` -> ``TreePartial`` of the leaf sums
            over rows of whole leaves starting at global leaf ``first_leaf`` (only the last leaf
            of the global batch may be short); called now for this call's whole leaves, later
            (next micro-batch or ``reduce``) for a leaf it leaves open when ``fold`` is None.
        fold: the op's resumable leaf fold (``CanonicalGradAccumulator.deposit_rows``): a leaf
            this call leaves open is carried as its fp32 fold instead of its rows.
        whole: ``whole(first_leaf)`` -> ``TreePartial`` of this call's rows that the op already
            computed (the norms' chunk sums of the dX pass), used instead of ``leaves`` when the
            call is whole leaves that start on a leaf boundary.

    Returns None: the op returns no autograd gradient for the parameter.

    Raises:
        RuntimeError: no micro-batch is active (the backward runs outside the forward's
            ``micro_batch``); the backward is ``torch.autograd.grad`` with the parameter among its
            inputs (autograd would return None for it). A backward that does not accumulate into
            the parameter (``autograd.grad`` of other tensors, ``backward(inputs=...)`` without it)
            deposits nothing.
        ValueError: what ``deposit_rows`` raises (an untracked parameter, rows of another length
            than another op of this micro-batch saw, an open leaf the parameter did not continue).

    **Determinism:** the rows land in the leaves of their global token indices, summed by the op's
    fixed leaf order (whole leaves now, an open leaf once complete, from all its rows or its
    carried fold), so ``p.grad`` after ``reduce`` has the bits of one unsplit batch. The open
    leaf's rows are copied before the op returns: a compiled graph may reuse an input's memory as
    soon as the op that read it returns (Inductor's buffer reuse).
    """
    acc = current_accumulator()  # a deposit op's one lookup of it
    if acc is None:
        raise _outside(op)
    param = acc.tracked(tensor)
    leaf = acc.leaf_tokens
    if whole is not None:
        n = rows[0].shape[0]
        # whole leaves: the op's own subtrees (deposit_rows, below, asks itself; leaf_span must not
        # count the tokens of a backward that leaves this parameter's gradient alone)
        if acc.token_offset % leaf == 0 and n % (leaf * rows_per_token) == 0:
            if not acc._backward_wants(param):
                return
            first_leaf, _ = acc.leaf_span(n // rows_per_token, param, op)
            acc.deposit_partial(param, whole(first_leaf))
            return
    leaves = functools.partial(leaves, leaf * rows_per_token)
    acc.deposit_rows(param, rows, leaves, fold, op, rows_per_token)
    if acc.pending_copies:  # flush's own test, without its frame on every deposit
        acc.flush()
