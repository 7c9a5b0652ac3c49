"""A micro-batch's lifecycle: what entering and leaving ``CanonicalGradAccumulator.micro_batch``
does to the accumulator, and the stack of active accumulators the ops look up (``ACTIVE``). Kept out
of grad_accum.py, whose method keeps the interface and its docstring; a plain function of its state.

On entry: the micro-batch's checks (``check_micro_batch``; with fixed folds, ``FixedFolds.begin``),
its per-micro-batch state reset and the accumulator made active. On a normal exit: the open-leaf row
copies run, the rows-per-token groups and fixed folds committed and where it ended recorded (an
open leaf the next micro-batch continues). On an exception: its deposits undone (``acc._undo``, the
undo log), or under ``recoverable=False`` once they began, the accumulator poisoned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ._messages import check_micro_batch, failed_backward, poisoned, several_graphs
from ._step_guard import mark_pending
from ._undo_log import UndoLog

__all__ = ["ACTIVE", "micro_batch"]

# The active accumulator. A plain module global, not thread-local: autograd runs CUDA backward
# functions on its own device threads, which must still see the accumulator of `micro_batch`.
ACTIVE: list = []


@contextlib.contextmanager
def micro_batch(acc, token_offset: int, num_tokens: int | None) -> Iterator:
    """``CanonicalGradAccumulator.micro_batch(token_offset, num_tokens)`` of ``acc`` (its docstring
    says what it checks, raises and guarantees): ``acc`` active for one micro-batch, yielded."""
    token_offset, num_tokens = check_micro_batch(acc, token_offset, num_tokens, nested=bool(ACTIVE))
    fixed = acc._fixed
    if fixed is not None:
        fixed.begin(acc, token_offset, num_tokens)  # checks; zeroes the folds at a leaf's start
    acc._token_offset = token_offset
    acc._tokens = None
    acc._uses = {}  # (the undo log is new: each micro-batch's ``finally`` and ``_clear`` make it)
    acc._new_groups = {}
    acc._unfinished = set()  # graph tasks that deposited and have not finished without an error
    spans, max_end = len(acc._spans), acc._max_end
    if num_tokens is not None:  # every depositing op must see these tokens
        acc._note_tokens(num_tokens, None, "micro_batch(num_tokens=...)")
    ACTIVE.append(acc)
    try:
        yield acc
        if acc._unfinished:  # a backward raised after it deposited, and the error was caught inside
            raise RuntimeError(failed_backward(acc, token_offset))
    except BaseException as err:
        acc.pending_copies = []
        if acc.recoverable or not (acc._uses or fixed):  # nothing was written in place
            acc._undo(spans, max_end)  # a micro-batch that raises leaves no deposit: run it again
            message = several_graphs(err, token_offset)
            if message is not None:  # autograd's own words name an int64 tensor of 0 elements
                raise RuntimeError(message) from err
        else:  # its folds and nodes were written in place: refuse every later call (no silent sum)
            message = several_graphs(err, token_offset, undone=False)
            acc._poisoned = poisoned(acc, token_offset, RuntimeError(message) if message else err)
            if message is not None:
                raise RuntimeError(message) from err
        raise
    else:
        acc.flush()  # the micro-batch's tensors can go: their open-leaf rows are copied
        acc._groups.update(acc._new_groups)
        if fixed is not None:  # a completed leaf's folds join the trees, an open one is carried
            fixed.end(acc, token_offset, num_tokens)
        if acc._tokens is not None:  # ops deposited: the leaf it continued is no longer open here
            acc._open_ends.discard(token_offset)
            if (token_offset + acc._tokens) % acc.leaf_tokens:
                acc._open_ends.add(token_offset + acc._tokens)
        if acc._holds_deposits() or (fixed is not None and fixed.micro_batches):
            mark_pending(acc)  # deposits wait for reduce: an optimizer step now would skip them
    finally:
        ACTIVE.pop()
        acc._token_offset = None
        acc._wanted.forget()  # no AccumulateGrad node outlives the micro-batch (see WantedGradients)
        # the log holds the replaced trees and folds: let them go (memory of one step, not two)
        if acc.recoverable:
            acc._log = UndoLog()
        acc._new_groups = {}
