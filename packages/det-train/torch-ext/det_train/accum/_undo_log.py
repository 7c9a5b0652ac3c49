"""The undo log of ``CanonicalGradAccumulator``'s active micro-batch, and the tree adds it allows in place.

A micro-batch that raises leaves the accumulator as before it. ``UndoLog`` saves, before the
micro-batch's first change, what its deposits replace: a slot's tree nodes (a shallow copy: trees
replace nodes, never write the ones the log holds), a carry entry (an open leaf's state; the open
fold is immutable) and an open leaf's fill. ``undo`` puts them back; a micro-batch that succeeds
drops the log, and with it the old nodes and folds (the memory of one micro-batch, not two).

``combine`` is the tree add of this micro-batch's deposits. A parent node is ``left + right`` in fp32,
and fp32 addition is commutative, so adding into a child gives the bits of a new tensor; a child
may be written only when nothing else can read it: the sums this log's own micro-batch made (never a
node the log holds, an op's leaf sum, a fold an open leaf carries or a caller's tensor). So a leaf
that completes carries its sum up the tree in one buffer, and a micro-batch holds, besides the
nodes and fold it started with, one new node per aligned subtree it completes.

``NoUndoLog`` is the log of an accumulator built with ``recoverable=False``: it saves nothing, and
every sum the accumulator made (in any micro-batch) may be written by ``combine``, so a completed
leaf's sum is carried up into the nodes it consumes and they are freed at once. A micro-batch that
raises then leaves partial sums: the accumulator refuses every later call (``poisoned``).

Method: copy-on-write of the replaced state (a shadow copy of the partial trees' node maps), the
exception-safety of a transaction log.
"""

from __future__ import annotations

import weakref

import torch
from det_core.reduce import TreePartial

__all__ = ["ABSENT", "NoUndoLog", "UndoLog"]

ABSENT = object()  # an undo-log entry: the key was not there


class UndoLog:
    """What the active micro-batch changed, saved before its first change, for ``undo``.

    ``trees``: slot -> its node map before the micro-batch (None: the slot had no tree);
    ``carry``: carry key -> its open leaf before (``ABSENT``: none); ``fills``: id of an
    ``OpenLeaf`` -> ``(open_leaf, filled, buffers)`` before rows were appended. Host work is O(1)
    per deposit, nothing per untouched parameter.
    """

    __slots__ = ("trees", "carry", "fills", "_made")

    def __init__(self) -> None:
        self.trees: dict[tuple[int, int], dict | None] = {}
        self.carry: dict[tuple[int, int, int], object] = {}
        self.fills: dict[int, tuple] = {}
        self._made: dict[int, weakref.ref] = {}  # id -> the tensors ``combine`` may write (``own``)

    def tree(self, partials: dict, slot: tuple[int, int]) -> TreePartial:
        """``partials[slot]`` (a new tree if none), its nodes logged before the micro-batch's first change."""
        tree = partials.get(slot)
        if slot not in self.trees:
            self.trees[slot] = None if tree is None else dict(tree.nodes)
        if tree is None:
            tree = partials[slot] = TreePartial()
        return tree

    def log_carry(self, carry: dict, key: tuple[int, int, int]) -> None:
        """Save ``carry[key]`` (``ABSENT``: none) before its first change in this micro-batch."""
        if key not in self.carry:
            self.carry[key] = carry.get(key, ABSENT)

    def log_fill(self, open_leaf) -> None:
        """Save an ``OpenLeaf``'s fill before rows are appended (rows appended since are ignored)."""
        if id(open_leaf) not in self.fills:
            self.fills[id(open_leaf)] = (open_leaf, open_leaf.filled, open_leaf.buffers)

    def undo(self, partials: dict, carry: dict, set_carry) -> None:
        """Put back what the micro-batch changed: trees, ``carry``'s entries (through ``set_carry(key,
        value or None)``, which keeps the slots' open-leaf sets) and open leaves' fills."""
        for slot, nodes in self.trees.items():
            if nodes is None:
                del partials[slot]
            else:
                partials[slot].nodes = nodes
        log, self.carry = self.carry, {}
        for key, value in log.items():
            if value is not ABSENT or key in carry:
                set_carry(key, None if value is ABSENT else value)
        for open_leaf, filled, buffers in self.fills.values():
            open_leaf.filled, open_leaf.buffers = filled, buffers

    def _own(self, t: torch.Tensor) -> bool:
        ref = self._made.get(id(t))
        return ref is not None and ref() is t

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """Let ``combine`` add into ``t``: a tensor made in this micro-batch that nothing else reads
        (a fold's new result). Returns ``t``."""
        self._made[id(t)] = weakref.ref(t)
        return t

    def combine(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """``left + right`` (a tree parent), added into a child this micro-batch made when there is one.

        **Determinism:** the bits of ``left + right``: fp32 addition is commutative, and the
        operands keep their order (``left.add_(right)``, ``torch.add(left, right, out=right)``)."""
        if self._own(left):
            return left.add_(right)
        if self._own(right):
            return torch.add(left, right, out=right)
        return self.own(left + right)

    def compact(self, tree: TreePartial) -> None:
        """Copy each node of ``tree`` that is a view into a larger buffer (an op's leaf sums of several
        leaves, one tensor) into its own, so the buffer is freed once the tree has combined the rest."""
        for key, value in tree.nodes.items():
            if value.untyped_storage().nbytes() > value.numel() * value.element_size():
                tree.nodes[key] = self.own(value.clone())


class NoUndoLog(UndoLog):
    """The log of ``recoverable=False``: keeps nothing to undo, and lets ``combine`` write every tensor
    the accumulator made (``own``), in this micro-batch or an earlier one: a tree node is read by the
    add that consumes it and by nothing else, so it may become the parent. Lives as long as the
    accumulator's state (one step); ``_made`` holds weak references only (a freed sum drops out)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__()
        self._made = weakref.WeakValueDictionary()  # id -> a tensor ``combine`` may write

    def tree(self, partials: dict, slot: tuple[int, int]) -> TreePartial:
        tree = partials.get(slot)
        if tree is None:
            tree = partials[slot] = TreePartial()
        return tree

    def log_carry(self, carry: dict, key: tuple[int, int, int]) -> None:
        pass

    def log_fill(self, open_leaf) -> None:
        pass

    def undo(self, partials: dict, carry: dict, set_carry) -> None:
        """Nothing to put back: called only for a micro-batch that raised before any deposit (one
        that deposited poisons the accumulator instead)."""

    def _own(self, t: torch.Tensor) -> bool:
        return self._made.get(id(t)) is t

    def own(self, t: torch.Tensor) -> torch.Tensor:
        self._made[id(t)] = t
        return t
