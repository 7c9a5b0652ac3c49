"""The reduce half of ``CanonicalGradAccumulator``: the checks at reduce time and the cross-rank path.

``CanonicalGradAccumulator.reduce`` hands its state over explicitly (its parameters and their
names, ``leaf_tokens``, its partial trees, open leaves and token spans); nothing here keeps state.

- ``local_partials``: this rank's checks (deposits past ``total_tokens``, a short micro-batch that
  does not end the batch, an open leaf not completed, a stale non-zero ``p.grad``) and its partial
  trees with the open short last leaf summed in, on copies (a reduce that raises keeps every deposit).
- ``checked_roots``: the checks of the finished trees (past the last leaf, uncovered tokens,
  parameters without deposits) and their roots; run on one process's trees and on the merged node
  keys of all ranks, so both paths raise the same errors.
- ``reduce_across_ranks``: the fixed-order owner reduction of ``dp_reduce`` over a process group.

Method: pairwise summation with the tree fixed by global index (Higham, SISC 1993), as in
det_core.reduce; across ranks an owner-computes reduction (``dp_reduce``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from det_core.reduce import TreePartial, num_leaves

from . import dp_reduce
from ._messages import slot_name
from ._open_leaf import OpenFold, OpenLeaf

__all__ = [
    "checked_roots",
    "finish_one_process",
    "local_checks",
    "local_partials",
    "reduce_across_ranks",
    "reduce_one_process",
    "write_grad",
]

Slot = tuple[int, int]  # (parameter index, use)
_KEY_ONLY = torch.empty(0)  # the value of a node whose key alone is checked


def local_partials(
    total_tokens: int,
    *,
    leaf_tokens: int,
    names: list[str],
    params: list[torch.Tensor],
    partials: dict[Slot, TreePartial],
    carry: dict[tuple[int, int, int], OpenLeaf | OpenFold],
    spans: list[tuple[int, int]],
    max_end: int,
) -> dict[Slot, TreePartial]:
    """This rank's checks before a reduce and its partial trees, the open short last leaf
    summed in (on copies: a reduce that raises keeps every deposit).

    ``names[i]`` names ``params[i]``; ``partials``: ``{(param index, use): TreePartial}``;
    ``carry``: ``{(param index, use, leaf): open leaf}``; ``spans``: the ``(token_offset, tokens)``
    of the ops that used ``leaf_span``; ``max_end``: the last token + 1 any deposit covered.
    """
    local_checks(
        total_tokens,
        leaf_tokens=leaf_tokens,
        names=names,
        params=params,
        carry=carry,
        spans=spans,
        max_end=max_end,
    )
    # the node tensors are shared, merges make new ones
    local = {slot: _copy(tree) for slot, tree in partials.items()}
    for (index, use, leaf), open_leaf in carry.items():  # the short last leaf
        tree = local.setdefault((index, use), TreePartial())
        try:
            tree.merge(_closed(open_leaf, leaf))
        except ValueError as err:
            raise ValueError(f"{slot_name(names[index], use)}: {err}") from None
    return local


def local_checks(
    total_tokens: int,
    *,
    leaf_tokens: int,
    names: list[str],
    params: list[torch.Tensor],
    carry: dict[tuple[int, int, int], OpenLeaf | OpenFold],
    spans: list[tuple[int, int]],
    max_end: int,
) -> None:
    """This rank's checks before a reduce (``local_partials``'s arguments); they read no tree."""
    if max_end > total_tokens:
        raise ValueError(
            f"micro-batches on this rank cover tokens up to {max_end}, beyond "
            f"total_tokens={total_tokens}: pass the global batch's token count"
        )
    for offset, n in spans:  # (a span past total_tokens raised above, with max_end)
        if n % leaf_tokens and offset + n != total_tokens:
            raise ValueError(
                f"a micro-batch at token {offset} has {n} tokens, not a multiple of leaf_tokens "
                f"{leaf_tokens}, and its ops use leaf_span / deposit: only the micro-batch ending "
                "the global batch may end mid-leaf there (ops using deposit_rows carry the open leaf)"
            )
    for (index, use, _), open_leaf in carry.items():
        start, end = open_leaf.start, open_leaf.end
        if end != total_tokens:
            raise ValueError(
                f"{slot_name(names[index], use)}: leaf {start // leaf_tokens} (tokens "
                f"[{start}, {start + leaf_tokens})) is open, this rank's micro-batches end at "
                f"token {end} inside it, and total_tokens={total_tokens}: a leaf must be completed "
                "on one rank (data-parallel shards are multiples of leaf_tokens), micro-batches "
                "must cover the batch, and the parameter must be used in each of them"
            )
    held = [
        (name, g.to_local() if hasattr(g, "to_local") else g)
        for name, p in zip(names, params, strict=True)
        if (g := p.grad) is not None
    ]
    if _any_nonzero([g for _, g in held]):  # one device read for all, not one per parameter
        for name, grad in held:
            if bool(grad.ne(0).any()):
                raise RuntimeError(
                    f"{name}: p.grad already holds a non-zero gradient "
                    "(from an op that is not canonical-order aware, a det_train op that received a "
                    "cast or view of the parameter (p.to(...), p * 1: autograd then carries its "
                    "gradient), a forward that ran outside `with acc.micro_batch(...)` (its backward "
                    "returns plain gradients, even inside one), or a previous step): call zero_grad() "
                    "before the micro-batches, run each forward and its backward inside the same "
                    "micro_batch, and give det_train ops the Parameter itself for every use"
                )


def _closed(open_leaf: OpenLeaf | OpenFold, leaf: int) -> TreePartial:
    """The partial of an open short last leaf (its fold finished, or the leaf sum of its rows)."""
    if isinstance(open_leaf, OpenFold):
        return TreePartial().add_node(0, leaf, open_leaf.advance((), True))
    return open_leaf.leaf_partial(leaf, open_leaf.rows())


def reduce_one_process(acc, total_tokens: int, checks: dict, state: dict) -> None:
    """``CanonicalGradAccumulator.reduce`` in one process: ``local_checks(total_tokens, **checks)``,
    then ``finish_one_process`` with ``state``, writing each ``p.grad``; ``acc`` is emptied after.
    Raises RuntimeError when nothing was deposited, and what the checks raise (nothing written)."""
    local_checks(total_tokens, **checks)  # (a stale p.grad first: it names its cause)
    if acc._params and not acc._partials and not acc._carry:
        raise RuntimeError(
            "reduce: nothing was deposited since this accumulator was built, reset or last "
            "reduced: run the step's micro-batches first (each forward and its backward inside "
            "`with acc.micro_batch(...)`), then reduce once per step"
        )
    write = functools.partial(write_grad, acc)  # p.grad of each finished gradient
    finish_one_process(total_tokens, partials=acc._partials, write=write, **state)
    acc._clear()


def finish_one_process(
    total_tokens: int,
    *,
    leaf_tokens: int,
    names: list[str],
    partials: dict[Slot, TreePartial],
    carry: dict[tuple[int, int, int], OpenLeaf | OpenFold],
    write: Callable[[int, torch.Tensor], None],
) -> None:
    """One process's reduce after ``local_checks``: check every tree's keys (with the open short last
    leaves), then finish one parameter at a time, ``write(index, fp32 gradient)`` it and drop its
    nodes and open leaves from ``partials`` / ``carry`` before the next parameter.

    Memory: besides the nodes held, one parameter's tree combine at a time (``TreePartial.result``
    with ``consume``: each pair's tensors go once their parent exists), never a second full-size
    copy of every gradient. Raises what ``checked_roots`` raises, before anything is written or
    dropped (a reduce that fails its checks keeps every deposit).

    **Determinism:** the trees ``local_partials`` and ``checked_roots`` finish, the same adds in the
    same order (uses of a parameter added in use order): the same bits.
    """
    keys: dict[Slot, TreePartial] = {}
    for slot, tree in partials.items():
        keys[slot] = TreePartial()
        keys[slot].nodes = dict.fromkeys(tree.nodes, _KEY_ONLY)
    for index, use, leaf in carry:  # the short last leaf: one node, (0, leaf)
        try:
            keys.setdefault((index, use), TreePartial()).add_node(0, leaf, _KEY_ONLY)
        except ValueError as err:
            raise ValueError(f"{slot_name(names[index], use)}: {err}") from None
    checked_roots(dict(sorted(keys.items())), total_tokens, leaf_tokens=leaf_tokens, names=names)
    total_leaves = num_leaves(total_tokens, leaf_tokens)
    leaves_of: dict[Slot, list] = {}
    for key in carry:
        leaves_of.setdefault(key[:2], []).append(key)
    slots = sorted(keys)
    grad = None
    for n, (index, use) in enumerate(slots):
        tree = partials.pop((index, use), None) or TreePartial()
        for key in leaves_of.get((index, use), ()):
            tree.merge(_closed(carry.pop(key), key[2]))
        root = tree.result(total_leaves, consume=True)
        grad = root if grad is None else grad + root
        del root
        if n + 1 == len(slots) or slots[n + 1][0] != index:  # the parameter's last use
            write(index, grad)
            grad = None


def checked_roots(trees: dict, total_tokens: int, *, leaf_tokens: int, names: list[str]) -> dict:
    """``{slot: root}`` of each parameter use's tree over ``total_tokens``, in ``trees``' order;
    raises when a tree reaches past the last leaf or leaves tokens uncovered, or a parameter has
    no tree (the checks of one process and of the merged node keys of all ranks).

    ``names[i]`` names tracked parameter ``i`` (every tracked parameter, deposited or not)."""
    total_leaves = num_leaves(total_tokens, leaf_tokens)
    roots = {}
    for (index, use), tree in trees.items():
        name = names[index]
        if any((i << level) >= total_leaves for level, i in tree.nodes):  # first leaf of a node
            raise ValueError(
                f"{name}: deposits reach past leaf {total_leaves - 1} "
                f"(total_tokens={total_tokens}, leaf_tokens={leaf_tokens})"
            )
        try:
            roots[index, use] = tree.result(total_leaves)
        except ValueError as err:
            raise ValueError(
                f"{slot_name(name, use)}: {_uncovered_tokens(tree, total_tokens, leaf_tokens)} "
                f"of total_tokens={total_tokens} received no deposit for it on any rank: check "
                f"total_tokens, that every micro-batch ran its backward and used this parameter, and "
                f"that each forward and backward over other tokens ran in its own "
                f"micro_batch(token_offset=...) (two passes in one micro-batch are taken as two uses of "
                f"the parameter on the same tokens, as a tied weight's) ({err})"
            ) from None
    used = {index for index, _ in trees}
    missing = [names[i] for i in range(len(names)) if i not in used]
    if missing:
        raise RuntimeError(
            f"no canonical-order gradient was deposited for {missing}: their gradients come from "
            "ops that are not canonical-order aware (use det_train ops), or they were not used; "
            "leave unused parameters out of the accumulator"
        )
    return roots


def reduce_across_ranks(
    group,
    partials: dict,
    refusal: Exception | None,
    total_tokens: int,
    *,
    leaf_tokens: int,
    names: list[str],
    params: list[torch.Tensor],
    fsdp: dict[int, object],
) -> dict[int, torch.Tensor]:
    """Data parallel: every parameter's gradient by the fixed-order owner reduction (``dp_reduce``).

    The checks of the one-process path run on the merged node keys of all ranks before any
    data moves (the same on every rank, so every rank raises alike).

    ``fsdp``: ``{param index: FSDP2 FSDPParam}`` of the sharded parameters. Returns
    ``dp_reduce.owner_reduce``'s ``{param index: gradient}`` (an FSDP2 parameter's: this rank's
    shard, for ``dp_reduce.fsdp_shard``).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    specs = []
    for index, (name, p) in enumerate(zip(names, params, strict=True)):
        fsdp_param = fsdp.get(index)
        if fsdp_param is not None and refusal is None:
            refusal = dp_reduce.fsdp_layout_error(name, fsdp_param, world, rank)
        specs.append(
            dp_reduce.GradSpec(name, tuple(p.shape), p.dtype, p.device, sharded=fsdp_param is not None)
        )
    agree = (("total_tokens", total_tokens), ("leaf_tokens", leaf_tokens))
    keys = dp_reduce.exchange_node_keys(partials, specs, group, refusal, agree)
    total_leaves = num_leaves(total_tokens, leaf_tokens)
    checked_roots(dp_reduce.merge_node_keys(keys, names), total_tokens, leaf_tokens=leaf_tokens, names=names)
    return dp_reduce.owner_reduce(specs, partials, keys, total_leaves, group)


def _any_nonzero(tensors: list[torch.Tensor]) -> bool:
    """Whether any element of ``tensors`` is non-zero (NaN counts), with one host read per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.ne(0).any())
    return any(bool(torch.stack(flags).any()) for flags in by_device.values())


def _copy(tree: TreePartial) -> TreePartial:
    """A partial tree sharing ``tree``'s node tensors (a merge replaces nodes, never writes them)."""
    out = TreePartial()
    out.nodes = dict(tree.nodes)
    return out


def _uncovered_tokens(partial: TreePartial, total_tokens: int, leaf_tokens: int) -> str:
    """The global token ranges no node of ``partial`` covers, as ``tokens [a, b), ...``."""
    total_leaves = num_leaves(total_tokens, leaf_tokens)
    covered = sorted((i << level, (i + 1) << level) for level, i in partial.nodes)
    gaps, pos = [], 0
    for first, end in covered + [(total_leaves, total_leaves)]:
        if first > pos:
            gaps.append(f"[{pos * leaf_tokens}, {min(first * leaf_tokens, total_tokens)})")
        pos = max(pos, end)
    return "tokens " + ", ".join(gaps) if gaps else "some tokens"


def write_grad(acc, index: int, grad: torch.Tensor) -> None:
    """``p.grad`` of ``acc``'s tracked parameter ``index`` from its fp32 gradient (FSDP2: its shard)."""
    p = acc._params[index]
    if index in acc._fsdp:
        p.grad = dp_reduce.fsdp_shard(acc._fsdp[index], grad.to(dtype=p.dtype))
    else:
        grad = grad.to(device=p.device, dtype=p.dtype)
        p.grad = grad if grad.shape == p.shape else grad.view(p.shape)
