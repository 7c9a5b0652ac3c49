"""The canonical reduction order: one summation order that depends only on the global problem.

A sum over an axis whose split varies (tokens for dW, ranks in data parallelism, micro-batches)
is defined as:

1. **Leaves.** The axis is cut into leaves of ``leaf_size`` consecutive elements aligned to the
   *global* index (leaf ``j`` covers ``[j * leaf_size, (j + 1) * leaf_size)``; the last may be
   short). A leaf's sum is computed in fp32 in an order fixed by the op alone (the reference
   here: a left fold; a kernel: its fixed tile loop). ``leaf_size`` belongs to the op's contract.
2. **Tree.** Leaf sums are combined by the perfect binary tree over leaf indices: node
   ``(level, i)`` covers leaves ``[i * 2**level, (i + 1) * 2**level)`` and equals
   ``node(level-1, 2i) + node(level-1, 2i+1)`` in fp32; a node whose right child covers no leaf
   (past the global leaf count) equals its left child. The root is the sum.

Any worker holding a contiguous run of leaves (a micro-batch, a rank, a shard) computes the
*maximal aligned subtrees* inside its run (``TreePartial``); merging the partials of all
workers, in any order, and finishing with the global leaf count gives the same bits as one
worker doing everything. fp32 addition is IEEE round-to-nearest-even on every device, so the
tree combine may run in torch on CPU or GPU with identical results.

Reference: pairwise summation (Higham, "The accuracy of floating point summation", SISC 1993)
with the tree fixed by global index, as in DESIGN.md's suggested order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["TreePartial", "canonical_sum", "leaf_sums_reference", "num_leaves"]

# How a tree node is made from its two children: (left, right) -> the bits of left + right.
Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def num_leaves(length: int, leaf_size: int) -> int:
    """Number of leaves of an axis of ``length`` elements (``ceil(length / leaf_size)``)."""
    if leaf_size <= 0:
        raise ValueError(f"leaf_size must be positive, got {leaf_size}")
    return -(-int(length) // int(leaf_size))


def leaf_sums_reference(x: torch.Tensor, leaf_size: int, dim: int = 0) -> torch.Tensor:
    """Per-leaf sums of ``x`` along ``dim`` by a sequential fp32 left fold (the reference order).

    Args:
        x: tensor of any float dtype; leaves are cut along ``dim`` from its index 0.
        leaf_size: elements per leaf.
        dim: the reduced axis.

    Returns:
        fp32 tensor with ``dim`` replaced by a leaf axis of ``num_leaves(x.shape[dim])`` at position 0.
    """
    x = x.movedim(dim, 0).to(torch.float32)
    n = x.shape[0]
    out = []
    for start in range(0, n, leaf_size):
        acc = x[start].clone()
        for i in range(start + 1, min(start + leaf_size, n)):
            acc = acc + x[i]
        out.append(acc)
    if not out:
        return x.new_zeros((0, *x.shape[1:]))
    return torch.stack(out)


class TreePartial:
    """The maximal aligned subtrees of the canonical tree that one worker has computed.

    Nodes are kept as ``{(level, index): fp32 tensor}``. ``add_leaves`` takes leaf sums for a
    contiguous run of global leaf indices and combines siblings as soon as both are present, so a
    worker feeding its leaves in order holds at most ``log2(leaves) + 1`` tensors.

    Determinism: the value of every node is fixed by the global tree, so ``merge``/``add_leaves``
    in any order and ``result(n)`` give identical bits for any contiguous split of the leaves.
    Raises ``ValueError`` when two workers supply the same leaf.
    """

    def __init__(self) -> None:
        self.nodes: dict[tuple[int, int], torch.Tensor] = {}

    def add_leaves(self, first_leaf: int, leaf_sums: torch.Tensor | Iterable[torch.Tensor]) -> TreePartial:
        """Insert leaves ``first_leaf, first_leaf + 1, ...`` (fp32 tensors of one shape)."""
        first = int(first_leaf)
        for offset, value in enumerate(leaf_sums):
            if value.dtype != torch.float32:
                value = value.to(torch.float32)
            self._insert(0, first + offset, value)
        return self

    def add_node(
        self, level: int, index: int, value: torch.Tensor, combine: Combine | None = None
    ) -> TreePartial:
        """Insert node ``(level, index)`` (the fp32 sum of leaves ``[index * 2**level, (index + 1) *
        2**level)``), combined with its sibling at once when present: ``merge`` of a one-node partial,
        without the device move (``value`` must be on this partial's device).

        ``combine(left, right)``: how a parent is made from its children (default ``left + right``, a
        new tensor); it must return the bits of ``left + right`` (a caller that owns one child may
        add into it: fp32 addition is commutative, so ``left.add_(right)`` and
        ``torch.add(left, right, out=right)`` give them)."""
        self._insert(level, index, value, combine)
        return self

    def merge(self, other: TreePartial, combine: Combine | None = None) -> TreePartial:
        """Absorb another worker's nodes (its tensors are moved to this partial's device);
        ``combine`` as in ``add_node``."""
        device = next(iter(self.nodes.values())).device if self.nodes else None
        for (level, index), value in sorted(other.nodes.items()):
            if device is not None and value.device != device:
                value = value.to(device)
            self._insert(level, index, value, combine)
        return self

    def _insert(self, level: int, index: int, value: torch.Tensor, combine: Combine | None = None) -> None:
        nodes = self.nodes
        if (level, index) in nodes or self._covered(level, index):
            first, stop = index << level, (index + 1) << level
            raise ValueError(
                f"tree node {(level, index)} supplied twice: leaves [{first}, {stop}) (leaf i holds tokens "
                "[i * leaf_tokens, (i + 1) * leaf_tokens) of the step) are covered by two partials: "
                "overlapping micro-batches or ranks (token_offset ranges that overlap), or a new step's "
                "deposits before the last step's reduce()"
            )
        # combine with the sibling while it is present (a right child is added to its left sibling);
        # the parent is new: an ancestor present would have covered this node
        while (sibling := (level, index ^ 1)) in nodes:
            other = nodes.pop(sibling)
            left, right = (value, other) if index % 2 == 0 else (other, value)
            value = left + right if combine is None else combine(left, right)
            level, index = level + 1, index >> 1
        nodes[(level, index)] = value

    def _covered(self, level: int, index: int) -> bool:
        # an ancestor already present means these leaves were counted (a partial holds few nodes:
        # scanning them is cheaper than probing every level above)
        return any(lv > level and i == index >> (lv - level) for lv, i in self.nodes)

    def result(self, total_leaves: int, consume: bool = False) -> torch.Tensor:
        """Finish the tree for a global axis of ``total_leaves`` leaves and return the root.

        ``consume``: take the nodes out of this partial as they are combined (it is empty after a
        successful call), so each pair's tensors can be freed as soon as their parent exists: one
        parent at a time besides the nodes, not every node until the root is done.

        Raises ``ValueError`` if leaves are missing (a worker's partial was not merged); with
        ``consume``, the partial is then left partly combined (check before, e.g. on a partial of the
        same keys).
        """
        if total_leaves <= 0:
            raise ValueError("the canonical sum of an empty axis is not defined; handle T = 0 before")
        keys = sorted(self.nodes)
        nodes = self.nodes if consume else dict(self.nodes)
        level = 0
        width = total_leaves  # nodes at this level that cover at least one leaf
        while width > 1:
            # left children present at this level, in index order (a partial holds few nodes: scanning
            # them beats probing every index of the level)
            for i in sorted(i for lv, i in nodes if lv == level and i % 2 == 0 and i < width):
                left = nodes.pop((level, i))
                if i + 1 < width:
                    right = nodes.pop((level, i + 1), None)
                    if right is None:
                        nodes[(level, i)] = left
                        continue
                    nodes[(level + 1, i // 2)] = left + right
                    del left, right  # (consume: the children go now, not when the root is done)
                else:  # no right child in the global tree: promote
                    nodes[(level + 1, i // 2)] = left
            level += 1
            width = (width + 1) // 2
        root = nodes.pop((level, 0), None)
        if root is None or nodes:
            raise ValueError(
                f"canonical tree over {total_leaves} leaves is incomplete: partials cover "
                f"{keys}: some leaves have no partial (one of the workers' partials not merged before "
                "result(), or a micro-batch that deposited nothing)"
            )
        return root


def canonical_sum(x: torch.Tensor, leaf_size: int, dim: int = 0) -> torch.Tensor:
    """Reference canonical sum of ``x`` along ``dim``: fp32 left fold per leaf, then the tree.

    Args:
        x: float tensor, ``x.shape[dim] >= 1``.
        leaf_size: the op's leaf size (elements of ``dim`` per leaf).
        dim: reduced axis.

    Returns:
        fp32 tensor of ``x``'s shape without ``dim``.

    Determinism: the result depends only on ``x`` and ``leaf_size``; splitting ``x`` along ``dim``
    at leaf boundaries and merging ``TreePartial``s gives identical bits.
    """
    leaves = leaf_sums_reference(x, leaf_size, dim)
    return TreePartial().add_leaves(0, leaves).result(leaves.shape[0])
