"""The RMSNorm weight's open leaf is carried as its fp32 sub-leaf folds, not as its rows.

dweight = sum over tokens of ``dy * x_hat``: 16-token chunks folded by the backward kernel, the
chunks of a sub-leaf folded in order (``fold_chunks``), the tree over sub-leaves. A micro-batch that
ends inside a leaf keeps ``SubLeafFold`` (finished sub-leaves' sums + the open sub-leaf's chunk
fold, plus a copy of the rows of a partial chunk when it ends off the chunk step); the next
micro-batch resumes the fold (``fold_chunks_resume``). These tests check the bits of one batch for 1
to 32 micro-batches of uneven sizes, on and off the step, the state kept, and a micro-batch that
raises. Tiny (the interpreter runs a program per row): leaves of 32 tokens made of sub-leaves of 16
in chunks of 4 rows (``SUB_LEAF_TOKENS`` and ``MAX_ROWS_PER_CHUNK`` patched).
"""

from __future__ import annotations

import importlib

import det_train
import pytest
import torch
from det_core.reduce import TreePartial
from det_core.testing import assert_bitwise_equal, contiguous_splits
from det_train.accum import _leaf_sums
from det_train.accum._leaf_sums import SubLeafFold, fold_chunks, fold_chunks_resume
from det_train.accum._open_leaf import OpenFold, OpenLeaf

LEAF, STEP, D = 32, 4, 16
T = 2 * LEAF + 11  # a short last leaf of 11 tokens: a partial sub-leaf and a partial chunk
_WHOLE = {}


@pytest.fixture(autouse=True)
def _small_order(monkeypatch):
    monkeypatch.setattr(_leaf_sums, "SUB_LEAF_TOKENS", 16)
    monkeypatch.setattr(importlib.import_module("det_train.ops.rms_norm"), "MAX_ROWS_PER_CHUNK", STEP)
    assert _leaf_sums.sub_leaf_tokens(LEAF) == 16


def _whole():
    if "w" not in _WHOLE:
        _WHOLE["w"] = _dweight([0, T])[0]
    return _WHOLE["w"]


def _inputs(seed=5):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(T, 2, D, generator=g)  # fp32 throughout: the gradient keeps every bit of the tree
    return b[:, 0], b[:, 1], torch.randn(D, generator=g)


def _dweight(bounds, seed=5, fail_at=None):
    x, dy, w0 = _inputs(seed)
    w = w0.clone().requires_grad_()
    acc = det_train.CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if lo == fail_at:  # the micro-batch deposits, then raises; it is run again
            with pytest.raises(RuntimeError, match="after the deposit"):
                with acc.micro_batch(token_offset=lo):
                    det_train.rms_norm(x[lo:hi], w).backward(dy[lo:hi])
                    raise RuntimeError("after the deposit")
        with acc.micro_batch(token_offset=lo):
            det_train.rms_norm(x[lo:hi], w).backward(dy[lo:hi])
    acc.reduce(total_tokens=T)
    return w.grad, acc


def _on_step(parts):
    cuts = contiguous_splits(T - 11, parts, granule=STEP)
    return [0, *(end for _, end in cuts[:-1]), T]


def test_fold_chunks_resumed_at_any_chunk_equals_one_fold():
    g = torch.Generator().manual_seed(1)
    chunks = torch.randn(11, 40, generator=g)  # 11 chunks, 4 per leaf: leaves of 4, 4, 3
    ref = fold_chunks(chunks, 4)
    for cut in (1, 3, 4, 6, 9):
        head = fold_chunks_resume(chunks[:cut], 4, 0, None)
        tail = fold_chunks_resume(chunks[cut:], 4, cut % 4, head[-1] if cut % 4 else None)
        got = torch.cat([head[: cut // 4], tail])
        assert_bitwise_equal(got, ref, f"resumed after chunk {cut}")
    with pytest.raises(ValueError, match="needs its accumulator"):
        fold_chunks_resume(chunks, 4, 2, None)


def test_micro_batches_on_the_step_give_one_batch():
    whole = _whole()
    for parts in (3, 16):  # cuts on the 4-token chunk step, inside sub-leaves and leaves
        got, _ = _dweight(_on_step(parts))
        assert_bitwise_equal(got, whole, f"dweight, {parts} micro-batches on the chunk step")


def test_thirty_two_micro_batches_and_cuts_off_the_step():
    whole = _whole()
    uneven = [0, 1, 2, 5, 7, 9, 13, 15, 16, 17, 21, 22, 27, 30, 31, 32, 33, 35, 38, 41, 44, 47, 48, 51]
    uneven += [55, 58, 62, 64, 66, 69, 70, 73, T]  # 32 micro-batches, most ending off the step
    assert len(uneven) == 33
    for bounds in (uneven, [0, 3, 18, 33, 50, 70, T]):
        got, _ = _dweight(bounds)
        assert_bitwise_equal(got, whole, f"dweight, {len(bounds) - 1} micro-batches off the step")


def test_open_leaf_keeps_sub_leaf_folds_not_rows():
    x, dy, w0 = _inputs()
    w = w0.clone().requires_grad_()
    acc = det_train.CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        det_train.rms_norm(x[:24], w).backward(dy[:24])  # one whole sub-leaf and two chunks of the next
    (state,) = acc._carry.values()
    assert isinstance(state, OpenFold) and not isinstance(state, OpenLeaf) and state.rest == ()
    fold = state.acc
    assert isinstance(fold, SubLeafFold) and fold.tokens == 24
    assert [tuple(b.shape) for b in fold.done] == [(1, D)]  # sub-leaf 0's sum
    assert fold.open.shape == (D,) and fold.open.dtype == torch.float32
    with acc.micro_batch(token_offset=24):
        det_train.rms_norm(x[24:27], w).backward(dy[24:27])  # off the step: 3 rows wait as copies
    (state,) = acc._carry.values()
    assert state.acc.tokens == 24 and [r.shape[0] for r in state.rest] == [3, 3, 3]


def test_micro_batch_that_raises_leaves_the_folds_as_they_were():
    whole = _whole()
    got, _ = _dweight([0, 10, 24, 44, T], fail_at=24)
    assert_bitwise_equal(got, whole, "dweight after a failed micro-batch")


def test_close_runs_the_tree_over_any_count_of_sub_leaves():
    """The sub-leaf sums a split leaf collects are combined once, when it closes, by the tree kernel:
    the bits of ``TreePartial``'s pairwise tree and ``coarsen`` for 1 to 8 of 8 sub-leaves (the short
    last leaf keeps fewer), held in 1 to 3 blocks with and without an open sub-leaf."""
    sums = torch.randn(8, D, generator=torch.Generator().manual_seed(3))
    for k in range(1, 9):
        (want,) = _leaf_sums.coarsen(TreePartial().add_leaves(0, sums[:k]), 8).nodes.values()
        cuts = sorted({0, k // 3, (2 * k) // 3, k})
        blocks = tuple(sums[lo:hi] for lo, hi in zip(cuts[:-1], cuts[1:], strict=True))
        got = SubLeafFold(16 * k, blocks).close(16, 8, torch.Size([D]))
        assert_bitwise_equal(got, want, f"{k} of 8 sub-leaves in {len(blocks)} blocks")
        opened = SubLeafFold(16 * k - 4, (sums[: k - 1],) if k > 1 else (), sums[k - 1]).close(16, 8, (D,))
        assert_bitwise_equal(opened, want, f"{k} of 8 sub-leaves, the last one open")
