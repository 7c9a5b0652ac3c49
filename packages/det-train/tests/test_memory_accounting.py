"""The peak memory of CanonicalGradAccumulator per parameter element, measured exactly (CPU).

A Linear weight's deposits (the op its backward calls, ``det_train::linear_deposit_weight``: whole
leaves by the dW kernel, an open leaf carried as its fp32 fold) at 1, 2, 8 and 32 micro-batches and
L = 1..8 leaves per step; ``_memory_accounting.AccumulatorMemory`` measures the peak bytes the
accumulator holds or allocates, in fp32 buffers of the weight's size (4 bytes per element). The
formulas asserted are docs/det-train.md's ("Gradient memory"):

- micro-batches that cut leaves (each holding no whole leaf): ``2 + ceil(log2 L)`` buffers, the
  ``popcount(i)`` tree nodes, the open fold and, until the micro-batch succeeds, what its undo log
  keeps (the old fold and the nodes its leaf's sum consumed);
- one micro-batch of W whole leaves: ``W + popcount(W)`` (the dW kernel's W leaf sums in one buffer,
  combined in it, then each surviving node copied out so that buffer is freed), 1 when W = 1;
- ``reduce``: ``popcount(L)`` nodes plus one parent while the tree is finished (none when one node).

Micro-batch boundaries are multiples of the fold's 64-token step, so no rows wait between them (rows
past the last whole step would be copied: a few rows, not a parameter-sized buffer).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal
from det_train.accum.deposit import ticket
from det_train.ops.linear import deposit_weight_op

sys.path.insert(0, str(Path(__file__).parent))
from _memory_accounting import AccumulatorMemory  # noqa: E402

D = 32  # the weight is D x D
STEP = 64  # the fold's token step (the interpreter's weight_grad config: block_t)


def _popcount(i: int) -> int:
    return bin(i).count("1")


def _nodes(end: int) -> set[tuple[int, int]]:
    """The maximal aligned subtrees of leaves [0, end): the tree nodes after ``end`` complete leaves."""
    out, start = set(), 0
    for level in reversed(range(end.bit_length())):
        if end >> level & 1:
            out.add((level, start >> level))
            start += 1 << level
    return out


def _covers(node: tuple[int, int], lo: int, hi: int) -> bool:
    level, index = node
    return index << level < hi and (index + 1) << level > lo


def expected_peak(bounds: list[int], leaf: int, recoverable: bool = True) -> int:
    """The peak fp32 buffers during the micro-batches ``bounds`` (token offsets) of ``leaf`` tokens:
    the accumulator's memory rule, one micro-batch at a time. A micro-batch starting after ``c``
    complete leaves holds the ``popcount(c)`` nodes before it (its undo log keeps the ones it
    consumes) and the open fold it continues (kept too); then the completed leaf's sum (one buffer
    its tree adds carry up in); then W whole leaves' sums (one buffer) and a copy of each node that
    is a view of it; then the new open fold.

    ``recoverable=False`` (no undo log): the fold is continued in its own buffer, which becomes the
    completed leaf's sum, and the nodes it consumes are freed at once (the sum is added into one):
    ``popcount(c) + cont`` while it is carried up, ``popcount(c + 1)`` nodes after it; whole leaves'
    sums are added into the earlier nodes they complete (only a node of new leaves alone is a view)."""
    peak = 0
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        c, cont = lo // leaf, lo % leaf != 0
        done = cont and hi >= (c + 1) * leaf
        first_whole = c + cont
        end = hi // leaf  # complete leaves after it
        whole, tail = max(0, end - first_whole), hi % leaf != 0
        base = _popcount(c) + cont + done
        if not recoverable:
            base = _popcount(c) + cont
            after = _popcount(c + 1) if done else base
            if whole:
                # a node that also covers earlier leaves is added into their (own) node: no view
                views = [
                    n for n in _nodes(end) if _covers(n, first_whole, end) and not _covers(n, 0, first_whole)
                ]
                peak = max(peak, after + whole + (len(views) if whole > 1 else 0))
            peak = max(peak, base, after, _popcount(end) + tail)
            continue
        if whole:
            views = [
                n for n in _nodes(end) if _covers(n, first_whole, end) and not (done and _covers(n, c, c + 1))
            ]
            peak = max(peak, base + whole + (len(views) if whole > 1 else 0))
        new = len(_nodes(end) - _nodes(c))
        peak = max(peak, base, _popcount(c) + cont + new + tail)
    return peak


def _split(micro_batches: int, leaves: int) -> tuple[list[int], int]:
    """``(bounds, leaf)``: micro-batch boundaries (token offsets) on the fold's steps and the leaf size.

    Fewer micro-batches than leaves + 1: equal micro-batches. Otherwise every leaf boundary lies inside
    a micro-batch and none holds a whole leaf (each leaf is cut just after its first step, the
    micro-batch before that cut straddles the boundary), with the fewest steps per leaf that allow it."""
    if micro_batches <= leaves:
        leaf = STEP * micro_batches // math.gcd(micro_batches, leaves)
        return [leaf * leaves * j // micro_batches for j in range(micro_batches + 1)], leaf
    steps = max(2, -(-(micro_batches + leaves - 1) // leaves))  # per leaf
    total = steps * leaves
    cuts = {k * steps + 1 for k in range(leaves)}
    free = [c for c in range(1, total) if c % steps and c not in cuts]
    extra = micro_batches - 1 - len(cuts)
    cuts |= {free[i * len(free) // extra] for i in range(extra)} if extra else set()
    return [0, *(STEP * c for c in sorted(cuts)), STEP * total], STEP * steps


def _step(micro_batches: int, leaves: int, recoverable: bool = True) -> tuple[dict, list[int], int]:
    bounds, leaf = _split(micro_batches, leaves)
    tokens = bounds[-1]
    gen = torch.Generator().manual_seed(leaves)
    weight = torch.nn.Parameter(torch.zeros(D, D, dtype=torch.bfloat16))
    x = (torch.randint(-64, 64, (tokens, D), generator=gen).float() / 32).to(torch.bfloat16)
    dy = (torch.randint(-64, 64, (tokens, D), generator=gen).float() / 32).to(torch.bfloat16)
    acc = det_train.CanonicalGradAccumulator([weight], leaf_tokens=leaf, recoverable=recoverable)
    with AccumulatorMemory(acc) as mem:
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            with acc.micro_batch(token_offset=lo):
                deposit_weight_op(dy[lo:hi], x[lo:hi], weight, ticket())
        acc.reduce(total_tokens=tokens)
    buffers = {phase: nbytes / (4 * weight.numel()) for phase, nbytes in mem.peak.items()}
    if micro_batches > 1:  # the in-place tree adds keep the bits of one batch
        got, weight.grad = weight.grad, None
        one = det_train.CanonicalGradAccumulator([weight], leaf_tokens=leaf)
        with one.micro_batch(token_offset=0):
            deposit_weight_op(dy, x, weight, ticket())
        one.reduce(total_tokens=tokens)
        assert_bitwise_equal(got, weight.grad, f"{micro_batches} micro-batches vs one batch")
    return buffers, bounds, leaf


@pytest.mark.parametrize("leaves", range(1, 9))
def test_peak_buffers_per_parameter(leaves):
    for micro_batches in (1, 2, 8, 32):
        buffers, bounds, leaf = _step(micro_batches, leaves)
        rule = expected_peak(bounds, leaf)
        assert buffers["micro"] == rule, (micro_batches, buffers)
        pc = _popcount(leaves)
        assert buffers["reduce"] == pc + (pc > 1), (micro_batches, buffers)
        if micro_batches == 1:  # W = L whole leaves at once
            assert rule == (leaves + pc if leaves > 1 else 1)
        elif micro_batches > leaves:  # micro-batches that cut leaves, none holding a whole one
            assert rule == 2 + math.ceil(math.log2(leaves)), (micro_batches, bounds, leaf)


def test_bound_without_undo():
    """Micro-batches of one whole leaf each carry no open fold: ``1 + floor(log2 L)`` buffers, the
    least the canonical tree allows, undo log included (a whole leaf's sum consumes nodes that stay
    until the micro-batch succeeds, but it is written in place of them)."""
    for leaves in (3, 8):
        buffers, bounds, leaf = _step(leaves, leaves)
        assert buffers["micro"] == expected_peak(bounds, leaf) == 1 + int(math.log2(leaves))


def test_raising_micro_batch_keeps_state_and_memory():
    """A micro-batch that raises after its deposit leaves the accumulator as before it: its bytes
    and its bits (the nodes its tree adds consumed were kept, never written)."""
    leaf, tokens = 2 * STEP, 6 * STEP
    weight = torch.nn.Parameter(torch.zeros(D, D, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(5)
    x = (torch.randint(-64, 64, (tokens, D), generator=gen).float() / 32).to(torch.bfloat16)
    acc = det_train.CanonicalGradAccumulator([weight], leaf_tokens=leaf)
    bounds = [0, 64, 192, 320, 384]
    with AccumulatorMemory(acc) as mem:
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            held = mem.held()
            nodes = {k: v.clone() for t in acc._partials.values() for k, v in t.nodes.items()}
            with pytest.raises(RuntimeError, match="after the deposit"):
                with acc.micro_batch(token_offset=lo):
                    deposit_weight_op(x[lo:hi], x[lo:hi], weight, ticket())
                    raise RuntimeError("after the deposit")
            assert mem.held() == held
            for t in acc._partials.values():
                for k, v in t.nodes.items():
                    assert_bitwise_equal(v, nodes[k], f"node {k} after an undo")
            with acc.micro_batch(token_offset=lo):
                deposit_weight_op(x[lo:hi], x[lo:hi], weight, ticket())
        acc.reduce(total_tokens=tokens)
    one = det_train.CanonicalGradAccumulator([weight], leaf_tokens=leaf)
    got, weight.grad = weight.grad, None
    with one.micro_batch(token_offset=0):
        deposit_weight_op(x, x, weight, ticket())
    one.reduce(total_tokens=tokens)
    assert_bitwise_equal(got, weight.grad, "after undone micro-batches vs one batch")


@pytest.mark.parametrize("leaves", [1, 2, 3, 4, 8])
def test_peak_without_undo_log(leaves):
    """``recoverable=False``: the fold continued in place and the consumed nodes freed at once, so
    micro-batches that cut leaves peak at ``1 + floor(log2 L)`` buffers, the canonical tree's least
    (1 at ``L = 1``: one fp32 main grad); one micro-batch of W whole leaves keeps the dW kernel's
    ``W + popcount(W)``. The bits are those of one batch (``_step`` checks)."""
    for micro_batches in (1, 2, 8, 32):
        buffers, bounds, leaf = _step(micro_batches, leaves, recoverable=False)
        rule = expected_peak(bounds, leaf, recoverable=False)
        assert buffers["micro"] == rule, (micro_batches, buffers)
        pc = _popcount(leaves)
        assert buffers["reduce"] == pc + (pc > 1), (micro_batches, buffers)
        if micro_batches == 1:
            assert rule == (leaves + pc if leaves > 1 else 1)
        elif micro_batches > leaves:  # micro-batches that cut leaves: no undo copy, the tree's least
            assert rule == 1 + int(math.log2(leaves)), (micro_batches, bounds, leaf)
    if leaves > 1:  # one whole leaf per micro-batch: the same least
        buffers, bounds, leaf = _step(leaves, leaves, recoverable=False)
        assert buffers["micro"] == expected_peak(bounds, leaf, False) == 1 + int(math.log2(leaves))
