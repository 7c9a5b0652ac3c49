"""A leaf that a micro-batch leaves open is carried as its fp32 fold, not as its rows.

The Linear weight's dW of a leaf is a sequential fp32 fold in steps of ``block_t`` tokens
(``weight_grad_fold``); a micro-batch that ends inside a leaf keeps that fold (plus a copy of the
rows past its last whole step, fewer than ``block_t``) and the next micro-batch's kernel continues
it. These tests check the bits of one batch for 1 to 32 micro-batches of uneven sizes, on and off
the token step, the state kept, and that a micro-batch that raises can be run again.
"""

from __future__ import annotations

import gc
import weakref

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal
from det_train.accum._open_leaf import OpenFold
from det_train.ops._leaf_fold import weight_grad_fold
from det_train.ops.weight_grad import weight_grad_partial

T = 512


def _values(gen, *shape):
    return (torch.randint(-64, 64, shape, generator=gen).float() / 32).to(torch.bfloat16)


def _layer_and_input(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    layer = det_train.Linear(48, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(_values(gen, 40, 48))
        layer.bias.copy_(_values(gen, 40))
    return layer, _values(gen, T, 48)


def _grads(bounds: list[int], leaf_tokens: int = 256, seed: int = 0):
    layer, x = _layer_and_input(seed)
    acc = det_train.CanonicalGradAccumulator(layer.named_parameters(), leaf_tokens=leaf_tokens)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        with acc.micro_batch(token_offset=lo):
            layer(x[lo:hi]).float().square().sum().backward()
    acc.reduce(total_tokens=T)
    return layer.weight.grad, layer.bias.grad


def test_fold_resumed_at_steps_equals_one_fold():
    gen = torch.Generator().manual_seed(3)
    dy, x = _values(gen, 300, 40), _values(gen, 300, 72)
    leaf = weight_grad_partial(dy, x, leaf_tokens=300).nodes[(0, 0)]
    assert_bitwise_equal(weight_grad_fold(dy, x), leaf, "one fold == the leaf's node")
    acc = None
    for lo, hi in ((0, 64), (64, 192), (192, 256), (256, 300)):  # the last call masks a short step
        before = None if acc is None else acc.clone()
        acc = weight_grad_fold(dy[lo:hi], x[lo:hi], acc)
        if before is not None:  # the fold so far is an input, never written
            assert before.ne(acc).any()
    assert_bitwise_equal(acc, leaf, "resumed at multiples of block_t")


# uneven micro-batches whose cuts fall on the 64-token step and split the two 256-token leaves
@pytest.mark.parametrize(
    "bounds",
    [
        [0, T],
        [0, 192, T],
        [0, 64, 320, T],
        [0, 128, 192, 384, 448, T],
        [0, 64, 192, 256, 320, 384, 448, T],
    ],
)
def test_micro_batches_on_the_step_give_one_batch(bounds):
    whole = _grads([0, T])
    got = _grads(bounds)
    assert_bitwise_equal(got[0], whole[0], f"dW, micro-batches {bounds}")
    assert_bitwise_equal(got[1], whole[1], f"db, micro-batches {bounds}")


def test_thirty_two_micro_batches_and_cuts_off_the_step():
    whole = _grads([0, T])
    sixteen = [0, *range(16, T, 16), T]  # 32 micro-batches of 16 tokens: every cut off the 64-token step
    uneven = [0, 1, 2, 65, 66, 130, 255, 256, 257, 400, 511, T]  # remainders of 1 to 63 rows
    for bounds in (sixteen, uneven):
        got = _grads(bounds)
        assert_bitwise_equal(got[0], whole[0], f"dW {len(bounds) - 1} micro-batches")
        assert_bitwise_equal(got[1], whole[1], f"db {len(bounds) - 1} micro-batches")


def test_open_leaf_keeps_the_fold_and_at_most_a_partial_step_of_rows():
    layer, x = _layer_and_input()
    acc = det_train.CanonicalGradAccumulator(layer.named_parameters(), leaf_tokens=256)
    with acc.micro_batch(token_offset=0):
        layer(x[:128]).float().square().sum().backward()  # ends inside leaf 0, on the step
    (state,) = [s for s in acc._carry.values() if isinstance(s, OpenFold)]
    assert state.acc.dtype == torch.float32 and state.acc.shape == layer.weight.shape
    assert state.rest == () and state.end == 128
    with acc.micro_batch(token_offset=128):
        layer(x[128:200]).float().square().sum().backward()  # 72 rows: one step folded, 8 kept
    (state,) = [s for s in acc._carry.values() if isinstance(s, OpenFold)]
    assert state.folded_end == 192 and [r.shape[0] for r in state.rest] == [8, 8] and state.end == 200


def test_micro_batch_that_raises_leaves_the_fold_as_it_was():
    whole = _grads([0, T])
    layer, x = _layer_and_input()
    acc = det_train.CanonicalGradAccumulator(layer.named_parameters(), leaf_tokens=256)
    with acc.micro_batch(token_offset=0):
        layer(x[:100]).float().square().sum().backward()
    for _ in range(2):  # the continuing micro-batch deposits, then fails; it is run again
        with pytest.raises(RuntimeError, match="after the deposits"):
            with acc.micro_batch(token_offset=100):
                layer(x[100:300]).float().square().sum().backward()
                raise RuntimeError("after the deposits")
    for lo, hi in ((100, 300), (300, T)):
        with acc.micro_batch(token_offset=lo):
            layer(x[lo:hi]).float().square().sum().backward()
    acc.reduce(total_tokens=T)
    assert_bitwise_equal(layer.weight.grad, whole[0], "dW after a failed micro-batch")
    assert_bitwise_equal(layer.bias.grad, whole[1], "db after a failed micro-batch")


def test_a_continued_fold_lets_the_replaced_one_go():
    """After a micro-batch the accumulator holds the new fold only: the one it replaced (kept while
    the micro-batch ran, to undo it if it raised) is freed, so an open leaf costs one fp32 copy."""
    layer, x = _layer_and_input()
    acc = det_train.CanonicalGradAccumulator(layer.named_parameters(), leaf_tokens=256)
    with acc.micro_batch(token_offset=0):
        layer(x[:64]).float().square().sum().backward()
    (state,) = [s for s in acc._carry.values() if isinstance(s, OpenFold)]
    first = weakref.ref(state.acc)
    del state
    with acc.micro_batch(token_offset=64):
        layer(x[64:128]).float().square().sum().backward()
    gc.collect()
    assert first() is None, "the fold of micro-batch [0, 64) is still held"
