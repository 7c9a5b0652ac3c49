"""An open leaf of the canonical order: a leaf that a micro-batch ended inside, kept by
``CanonicalGradAccumulator`` until the micro-batch that completes it (or ``reduce``).

Two forms: ``OpenFold``, an op's fp32 fold of the leaf so far (the Linear weight's dW; the RMSNorm
weight's sub-leaf folds), continued by the next micro-batch's kernel; ``OpenLeaf``, copies of the
leaf's rows, summed by the op's leaf-sum function once the leaf is complete (the ops without a
resumable fold: embedding, bias, LayerNorm).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from det_core.reduce import TreePartial

from ._messages import check_not_open, leaf_gap

__all__ = ["LeafFold", "LeafPartial", "OpenFold", "OpenLeaf", "foreach_copy", "place_rows", "token_rows"]

# A leaf-sum function of an op: (global index of the first leaf, rows of whole leaves) -> partial tree.
LeafPartial = Callable[[int, tuple], TreePartial]
# An op's resumable leaf fold: (token step, fold(rows, acc or None) -> new fp32 fold of the param's
# shape; with out=acc, recoverable=False, written into acc), or (step, fold, close) whose fold state
# is any immutable object and close(state) -> the leaf's fp32 node (the vector reductions: sub-leaf
# folds, _leaf_sums.SubLeafFold).
LeafFold = tuple  # (int, Callable[[tuple, object], object]) or (..., Callable[[object], torch.Tensor])


class OpenFold:
    """An unfinished leaf as its op's fp32 fold: ``acc`` covers tokens ``[start, folded_end)`` (a
    multiple of ``step`` tokens), ``rest`` holds copies of the rows after it (fewer than ``step``).
    Immutable: ``advance`` returns a new state, so a micro-batch that raises leaves the old one."""

    __slots__ = ("start", "folded_end", "acc", "rest", "fold")

    def __init__(self, start: int, fold: LeafFold, folded_end=None, acc=None, rest=()) -> None:
        self.start, self.fold, self.acc, self.rest = start, fold, acc, rest
        self.folded_end = start if folded_end is None else folded_end

    @property
    def end(self) -> int:
        return self.folded_end + (int(self.rest[0].shape[0]) if self.rest else 0)

    def advance(self, rows: tuple, finish: bool, fold: LeafFold | None = None, in_place: bool = False):
        """The state after the next ``rows`` of the leaf, or (``finish``: they end the leaf or the
        batch) the leaf's fp32 sum. ``fold``: the op's fold of this call (the same order as the
        stored one; an op may bind what it computed for these rows), kept for the next call.
        ``in_place`` (``recoverable=False``): a tensor fold (``(step, fold_fn)``) is continued in its
        own buffer, ``fold_fn(rows, acc, out=acc)``, and the old state is no longer valid."""
        fold = self.fold if fold is None else fold
        step, fold_fn = fold[0], fold[1]
        if in_place and len(fold) == 2:
            fold_fn = _in_place(fold_fn)
        n = rows[0].shape[0] if rows else 0
        acc, done = self.acc, self.folded_end
        if self.rest:  # complete the waiting partial step first (a copy of fewer than `step` rows)
            need = min(step - int(self.rest[0].shape[0]), n)
            if need:
                rows_in = tuple(torch.cat([a, b[:need]]) for a, b in zip(self.rest, rows, strict=True))
                rows = tuple(r[need:] for r in rows)
                n -= need
            else:
                rows_in = self.rest
            if int(rows_in[0].shape[0]) < step and not finish:
                return OpenFold(self.start, fold, done, acc, rows_in)
            acc, done = fold_fn(rows_in, acc), done + int(rows_in[0].shape[0])
        whole = n if finish else n - n % step
        if whole:
            acc = fold_fn(rows if whole == n else tuple(r[:whole] for r in rows), acc)
            done += whole
        if finish:
            return fold[2](acc) if len(fold) > 2 else acc
        rest = tuple(r[whole:].clone() for r in rows) if whole < n else ()
        return OpenFold(self.start, fold, done, acc, rest)


class OpenLeaf:
    """The rows a parameter's unfinished leaf has received so far, copied into buffers that grow by
    doubling up to one leaf (each row is copied at most twice, however many micro-batches the leaf
    is split into; the buffers hold at most 2x the rows received, and never more than a leaf).
    The copies are queued on the accumulator (``pending_copies``) and run together."""

    __slots__ = ("start", "filled", "buffers", "leaf_tokens", "leaf_partial")

    def __init__(self, start: int, rows: tuple, leaf_tokens: int, leaf_partial: LeafPartial, acc) -> None:
        self.start, self.filled, self.leaf_tokens = start, 0, leaf_tokens
        self.buffers = tuple(r.new_empty((int(r.shape[0]), *r.shape[1:])) for r in rows)
        self.append(rows, leaf_partial, acc)

    @property
    def end(self) -> int:
        return self.start + self.filled

    def append(self, rows: tuple, leaf_partial: LeafPartial, acc) -> None:
        n = int(rows[0].shape[0])
        if self.filled + n > self.buffers[0].shape[0]:
            acc.flush()  # the old buffers' rows are complete before they are copied on
            size = min(self.leaf_tokens, max(2 * self.buffers[0].shape[0], self.filled + n))
            grown = tuple(b.new_empty((size, *b.shape[1:])) for b in self.buffers)
            acc.pending_copies.extend(
                (new[: self.filled], old[: self.filled]) for new, old in zip(grown, self.buffers, strict=True)
            )
            self.buffers = grown
        acc.pending_copies.extend(
            (buffer[self.filled : self.filled + n], r) for buffer, r in zip(self.buffers, rows, strict=True)
        )
        self.filled += n
        self.leaf_partial = leaf_partial  # the latest call's function sums the leaf

    def rows(self) -> tuple:
        return tuple(b[: self.filled] for b in self.buffers)


def _in_place(fold_fn: Callable) -> Callable:
    """``fold_fn`` writing into the fold it continues (a new tensor only for a leaf's first rows)."""

    def fold_into(rows: tuple, acc):
        return fold_fn(rows, acc) if acc is None else fold_fn(rows, acc, out=acc)

    return fold_into


def _copy_each(dst: list, src: list) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


# torch._foreach_copy_ (torch >= 2.1) copies a list of tensors in a few launches
foreach_copy = getattr(torch, "_foreach_copy_", None) or _copy_each


def token_rows(leaf_partial: LeafPartial, fold: LeafFold | None, group: int) -> tuple:
    """An op's leaf-sum and fold functions over rows of ``group`` rows per token, as functions of the
    accumulator's token-grouped rows ``(tokens, group, ...)``: the rows are flattened back (views) and
    the fold's step becomes ``lcm(step, group) / group`` tokens, a multiple of the op's row step."""

    def flat(rows: tuple) -> tuple:
        return tuple(r.flatten(0, 1) for r in rows)

    def partial(first_leaf: int, rows: tuple) -> TreePartial:
        return leaf_partial(first_leaf, flat(rows))

    if fold is None:
        return partial, None
    step, fold_fn = fold[0], fold[1]

    def fold_tokens(rows: tuple, state, **out):  # out=: a tensor fold continued in place
        return fold_fn(flat(rows), state, **out)

    return partial, (step // math.gcd(step, group), fold_tokens, *fold[2:])


def place_rows(acc, slot: tuple[int, int], rows: tuple, n: int, leaf_partial: LeafPartial, fold) -> None:
    """``CanonicalGradAccumulator.deposit_rows``' placement of ``n`` token rows of ``slot`` (checked, the
    use counted): the leaf an earlier micro-batch left open is continued (its fold advanced, or its
    rows appended) and, once complete, added to the tree; whole leaves are summed by ``leaf_partial``
    and merged; a leaf this micro-batch leaves open is carried (its fold, or a copy of its rows).

    Raises ValueError: the open leaf does not end where this micro-batch starts (``leaf_gap``), or a
    leaf this call starts is open already (overlapping micro-batches)."""
    offset = acc._token_offset
    leaf = acc.leaf_tokens
    pos = 0  # own rows consumed so far
    if offset % leaf:  # continue the open leaf an earlier micro-batch left
        key = (*slot, offset // leaf)
        open_leaf = acc._carry.get(key)
        if open_leaf is None or open_leaf.end != offset:
            raise ValueError(leaf_gap(acc._names[slot[0]], slot[1], offset, leaf, open_leaf))
        pos = min(n, open_leaf.start + leaf - offset)  # own rows that belong to the open leaf
        head = rows if pos == n else tuple(r[:pos] for r in rows)
        done = open_leaf.start + leaf == offset + pos
        if isinstance(open_leaf, OpenFold):  # recoverable=False: continued in its buffer
            advanced = open_leaf.advance(head, done, fold, in_place=not acc.recoverable)
            if not done:  # the leaf stays open: its new state replaces the old (logged) one
                acc._log.log_carry(acc._carry, key)
                acc._carry[key] = advanced
                return
            if len(fold or open_leaf.fold) == 2 and not (acc.recoverable and advanced is open_leaf.acc):
                acc._log.own(advanced)  # no undo log keeps it: the leaf's sum may carry up in it
            acc._add_node(slot, offset // leaf, advanced)
            del advanced  # the tree holds its sum (the leaf's fold is free once added up)
        else:
            acc._log.log_fill(open_leaf)
            open_leaf.append(head, leaf_partial, acc)
            if not done:  # still open: this micro-batch ended inside it
                return
            acc.flush()
            leaf_rows = open_leaf.rows()
            acc._merge(slot, leaf_partial(offset // leaf, leaf_rows), leaf_rows)
        acc._set_carry(key, None)
        open_leaf = None  # its fold is free (unless the tree holds it) before a new leaf opens
        if pos == n:  # this micro-batch ended with the leaf it continued
            return
    full = (n - pos) // leaf * leaf
    start = offset + pos  # the first token of the leaves this call starts
    if acc._open_leaves.get(slot):  # none of them may be open already (overlapping micro-batches)
        check_not_open(acc, slot, start, offset + n)
    if full:
        whole = rows if full == n else tuple(r[pos : pos + full] for r in rows)
        acc._merge(slot, leaf_partial(start // leaf, whole), whole)
    if pos + full < n:
        start += full
        tail = rows if pos + full == 0 else tuple(r[pos + full :] for r in rows)
        if fold is not None:
            state = OpenFold(start, fold).advance(tail, False)
        else:
            state = OpenLeaf(start, tail, leaf, leaf_partial, acc)
        acc._set_carry((*slot, start // leaf), state)
