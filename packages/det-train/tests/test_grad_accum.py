"""CanonicalGradAccumulator: canonical-order gradients across micro-batches (single process).

Data-parallel invariance (gloo, DP degree 1-4) is in test_distributed.py.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from det_core.reduce import TreePartial, canonical_sum
from det_core.testing import assert_bitwise_equal, contiguous_splits
from det_train.accum.grad_accum import DEFAULT_LEAF_TOKENS, CanonicalGradAccumulator, current_accumulator

sys.path.insert(0, str(Path(__file__).parent))
from _canonical_toy import toy_scale, toy_scale_rows  # noqa: E402

LEAF = 4
D = 5


def _data(tokens=37, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=g).to(dtype)
    dy = torch.randn(tokens, D, generator=g).to(dtype)
    return x, dy


def _accumulate(x, dy, w, splits, leaf=LEAF, order=None, op=toy_scale):
    acc = CanonicalGradAccumulator([w], leaf_tokens=leaf)
    order = order if order is not None else range(len(splits))
    for i in order:
        start, end = splits[i]
        with acc.micro_batch(token_offset=start):
            op(x[start:end], w).backward(dy[start:end])
    acc.reduce(total_tokens=x.shape[0])
    return w.grad.clone()


def test_single_micro_batch_equals_canonical_sum():
    x, dy = _data()
    w = torch.randn(D, requires_grad=True)
    grad = _accumulate(x, dy, w, [(0, x.shape[0])])
    assert_bitwise_equal(grad, canonical_sum(x * dy, LEAF), "dW")
    # and the fp32 tree is close to the fp64 sum
    torch.testing.assert_close(grad.double(), (x.double() * dy.double()).sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_micro_batch_invariance(parts):
    x, dy = _data(tokens=40)  # 10 leaves of 4
    w = torch.randn(D, requires_grad=True)
    whole = _accumulate(x, dy, w, [(0, 40)])
    w.grad = None
    split = _accumulate(x, dy, w, contiguous_splits(40, parts, LEAF))
    assert_bitwise_equal(split, whole, f"dW with {parts} micro-batches")


def test_short_last_leaf_and_out_of_order_micro_batches():
    x, dy = _data(tokens=37)  # last leaf has 1 token
    w = torch.randn(D, requires_grad=True)
    whole = _accumulate(x, dy, w, [(0, 37)])
    w.grad = None
    splits = [(0, 12), (12, 16), (16, 28), (28, 37)]
    got = _accumulate(x, dy, w, splits, order=[2, 0, 3, 1])
    assert_bitwise_equal(got, whole, "dW, shuffled micro-batches")


# ---------------------------------------------------------------- open leaves (deposit_rows)
def _cuts(tokens, sizes):
    """Contiguous micro-batches of the given sizes (the last one takes the rest)."""
    splits, pos = [], 0
    for size in sizes:
        if pos >= tokens:
            break
        splits.append((pos, min(pos + size, tokens)))
        pos += size
    if pos < tokens:
        splits.append((pos, tokens))
    return splits


@pytest.mark.parametrize(
    "sizes",
    [[1] * 37, [3] * 13, [5, 2, 9, 1, 7, 6, 3], [6, 6, 6, 6, 6, 6], [2, 35], [13, 24], [37]],
    ids=["ones", "threes", "ragged", "sixes", "two-then-rest", "13-24", "whole"],
)
def test_micro_batches_of_any_size_give_the_bits_of_one_batch(sizes):
    x, dy = _data(tokens=37)  # 10 leaves of 4, the last one short
    w = torch.randn(D, requires_grad=True)
    want = canonical_sum(x * dy, LEAF)
    got = _accumulate(x, dy, w, _cuts(37, sizes), op=toy_scale_rows)
    assert_bitwise_equal(got, want, f"dW with micro-batches {sizes}")


def test_open_leaves_continue_out_of_order():
    # micro-batches in any order, as long as each piece of a split leaf follows the piece before it
    x, dy = _data(tokens=37)
    w = torch.randn(D, requires_grad=True)
    splits = [(0, 6), (6, 16), (16, 23), (23, 37)]  # leaves 1 and 5 split
    got = _accumulate(x, dy, w, splits, order=[2, 0, 3, 1], op=toy_scale_rows)
    assert_bitwise_equal(got, canonical_sum(x * dy, LEAF), "dW, shuffled micro-batches with open leaves")


def test_open_leaf_keeps_copies_not_the_micro_batch():
    x, dy = _data(tokens=8)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    xs, dys = x[:6].clone(), dy[:6].clone()
    with acc.micro_batch(token_offset=0):
        toy_scale_rows(xs, w).backward(dys)
    (carried,) = acc._carry.values()
    assert (carried.start, carried.end) == (4, 6) and carried.rows()[0].shape == (2, D)  # rows 4, 5: leaf 1
    assert carried.rows()[0].untyped_storage().data_ptr() != xs.untyped_storage().data_ptr()
    xs.zero_()  # the caller may reuse its buffers
    dys.zero_()
    with acc.micro_batch(token_offset=6):
        toy_scale_rows(x[6:], w).backward(dy[6:])
    acc.reduce(total_tokens=8)
    assert_bitwise_equal(w.grad, canonical_sum(x * dy, LEAF), "dW after the caller reused its buffers")


def test_overlapping_micro_batches_inside_a_leaf_raise():
    x, dy = _data(tokens=12)
    w = torch.randn(D, requires_grad=True)
    for first, second in (((0, 3), (0, 2)), ((0, 3), (0, 8)), ((4, 6), (4, 12))):
        acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
        with acc.micro_batch(token_offset=first[0]):
            toy_scale_rows(x[first[0] : first[1]], w).backward(dy[first[0] : first[1]])
        with pytest.raises(
            ValueError, match=r"w \(use 0\): leaf \d already holds tokens .* micro-batches overlap"
        ):
            with acc.micro_batch(token_offset=second[0]):
                toy_scale_rows(x[second[0] : second[1]], w).backward(dy[second[0] : second[1]])


def test_a_micro_batch_that_raises_leaves_no_trace():
    """An error inside a micro-batch (after some deposits, e.g. a data or logging error) undoes
    its deposits and open-leaf rows: running it again gives the bits of an undisturbed run."""
    x, dy = _data(tokens=12)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    cuts = [(0, 5), (5, 7), (7, 12)]
    for i, (start, end) in enumerate(cuts):
        with pytest.raises(KeyError):
            with acc.micro_batch(token_offset=start):
                toy_scale_rows(x[start:end], w).backward(dy[start:end])
                raise KeyError(f"failure after the deposits of micro-batch {i}")
        with acc.micro_batch(token_offset=start):  # the retry
            toy_scale_rows(x[start:end], w).backward(dy[start:end])
    acc.reduce(total_tokens=12)
    assert_bitwise_equal(w.grad, canonical_sum(x * dy, LEAF), "dW after failed and retried micro-batches")


def test_open_leaf_buffers_hold_about_the_rows_received():
    x, dy = _data(tokens=37)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([w], leaf_tokens=32)
    sizes = []
    for start in range(0, 31, 3):  # 3-token micro-batches inside leaf 0
        with acc.micro_batch(token_offset=start):
            toy_scale_rows(x[start : start + 3], w).backward(dy[start : start + 3])
        (open_leaf,) = acc._carry.values()
        sizes.append((open_leaf.filled, open_leaf.buffers[0].shape[0]))
    assert sizes[0] == (3, 3)  # the first micro-batch: exactly its rows
    assert all(filled <= size <= max(2 * filled, 3) for filled, size in sizes[1:])  # doubling
    assert sizes[-1][1] <= 32  # never more than one leaf


def test_reduce_refuses_a_total_below_the_deposited_tokens():
    x, dy = _data(tokens=16)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        toy_scale_rows(x, w).backward(dy)
    with pytest.raises(ValueError, match=r"cover tokens up to 16, beyond total_tokens=13"):
        acc.reduce(total_tokens=13)
    acc.reduce(total_tokens=16)  # the refused reduce kept the deposits
    assert_bitwise_equal(w.grad, canonical_sum(x * dy, LEAF), "dW after the refused total")


def test_micro_batch_without_deposits_keeps_the_open_leaf():
    x, dy = _data(tokens=12)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        toy_scale_rows(x[:6], w).backward(dy[:6])
    with acc.micro_batch(token_offset=6), torch.no_grad():  # e.g. a forward-only look at the data
        toy_scale_rows(x[6:], w)
    with acc.micro_batch(token_offset=6):
        toy_scale_rows(x[6:], w).backward(dy[6:])
    acc.reduce(total_tokens=12)
    assert_bitwise_equal(w.grad, canonical_sum(x * dy, LEAF), "dW after a micro-batch without backward")


def test_open_leaf_errors_are_clear_and_lose_nothing():
    x, dy = _data(tokens=12)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    with pytest.raises(ValueError, match=r"token_offset 6 .* no earlier micro-batch on this rank ended"):
        with acc.micro_batch(token_offset=6):
            pass
    with acc.micro_batch(token_offset=0):
        toy_scale_rows(x[:6], w).backward(dy[:6])
    with pytest.raises(ValueError, match=r"token_offset 5 .*open leaves end at \[6\]"):
        with acc.micro_batch(token_offset=5):
            pass
    # a DP shard that ends inside a leaf: reduce names the open leaf; the state is kept
    with pytest.raises(ValueError, match=r"w \(use 0\): leaf 1 \(tokens \[4, 8\)\) is open.* end at token 6"):
        acc.reduce(total_tokens=12)
    with acc.micro_batch(token_offset=6):
        toy_scale_rows(x[6:], w).backward(dy[6:])
    acc.reduce(total_tokens=12)
    assert_bitwise_equal(w.grad, canonical_sum(x * dy, LEAF), "dW after the refused reduce")
    # a parameter that skips the micro-batch continuing its open leaf
    other = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([("w", w), ("other", other)], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        (toy_scale_rows(x[:6], w) + toy_scale_rows(x[:6], other)).backward(dy[:6])
    with acc.micro_batch(token_offset=6):
        toy_scale_rows(x[6:9], w).backward(dy[6:9])
    with pytest.raises(ValueError, match=r"other \(use 0\): this micro-batch starts at token 9 .* rows for"):
        with acc.micro_batch(token_offset=9):
            toy_scale_rows(x[9:], other).backward(dy[9:])
    # a second backward in the micro-batch that continues an open leaf: the message says so
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        toy_scale_rows(x[:6], w).backward(dy[:6])
    with pytest.raises(ValueError, match=r"w \(use 1\): .*or a second backward ran in this micro-batch"):
        with acc.micro_batch(token_offset=6):
            toy_scale_rows(x[6:], w).backward(dy[6:])
            toy_scale_rows(x[6:], w).backward(dy[6:])
    # two ops of one micro-batch that saw different token counts
    acc = CanonicalGradAccumulator([("w", w), ("other", other)], leaf_tokens=LEAF)
    with pytest.raises(
        ValueError,
        match=r"(w|other) \(an op\) saw [36] tokens \(rows\) .* but (w|other) \(an op\) saw [36]: every",
    ):
        with acc.micro_batch(token_offset=0):
            (toy_scale_rows(x[:6], w).sum() + toy_scale_rows(x[:3], other).sum()).backward()
    # leaf_span ops cannot continue an open leaf
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        toy_scale_rows(x[:6], w).backward(dy[:6])
    with pytest.raises(ValueError, match="use deposit_rows"):
        with acc.micro_batch(token_offset=6):
            toy_scale(x[6:], w).backward(dy[6:])


def test_bf16_param_gets_bf16_grad_and_differs_from_naive_order():
    x, dy = _data(tokens=64)
    w = torch.randn(D, dtype=torch.bfloat16, requires_grad=True)
    grad = _accumulate(x.bfloat16(), dy.bfloat16(), w, [(0, 32), (32, 64)])
    assert grad.dtype == torch.bfloat16
    ref = canonical_sum(x.bfloat16().float() * dy.bfloat16().float(), LEAF).bfloat16()
    assert_bitwise_equal(grad, ref, "bf16 dW")


def test_reusable_after_reduce_and_zero_grad_allowed():
    x, dy = _data(tokens=16)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    results = []
    for _ in range(2):
        if w.grad is not None:
            w.grad.zero_()  # zero_grad(set_to_none=False)
        with acc.micro_batch(token_offset=0):
            toy_scale(x, w).backward(dy)
        acc.reduce(total_tokens=16)
        results.append(w.grad.clone())
    assert_bitwise_equal(results[1], results[0], "second step")


def test_tied_parameter_two_uses():
    x, dy = _data(tokens=24)
    w = torch.randn(D, requires_grad=True)

    def run(splits):
        acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
        for start, end in splits:
            with acc.micro_batch(token_offset=start):
                y = toy_scale(toy_scale(x[start:end], w), w)
                y.backward(dy[start:end])
        acc.reduce(total_tokens=24)
        out = w.grad.clone()
        w.grad = None
        return out

    whole = run([(0, 24)])
    for parts in (2, 3, 6):
        assert_bitwise_equal(run(contiguous_splits(24, parts, LEAF)), whole, f"tied w, {parts} parts")
    torch.testing.assert_close(
        whole, (dy * w.detach() * x + dy * x * w.detach()).sum(0), rtol=1e-5, atol=1e-5
    )


def test_current_accumulator_scope():
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    assert current_accumulator() is None
    with acc.micro_batch(token_offset=8):
        assert current_accumulator() is acc
        assert acc.token_offset == 8
        assert acc.leaf_span(9) == (2, 3)
    assert current_accumulator() is None
    with pytest.raises(RuntimeError, match="no micro_batch"):
        acc.token_offset  # noqa: B018


def test_without_accumulator_op_returns_ordinary_gradient():
    x, dy = _data(tokens=2 * DEFAULT_LEAF_TOKENS + 3)
    w = torch.randn(D, requires_grad=True)
    toy_scale(x, w).backward(dy)
    assert_bitwise_equal(w.grad, canonical_sum(x * dy, DEFAULT_LEAF_TOKENS), "dW without accumulator")


# ---------------------------------------------------------------- bad input
def test_a_non_leaf_tensor_is_refused_at_construction():
    """A tensor made by an op (``weight * 2``) never gets a .grad from autograd: tracking it was
    accepted and its deposits went nowhere (found by a new-user trial)."""
    w = torch.nn.Parameter(torch.randn(D))
    with pytest.raises(ValueError, match=r"scaled: a non-leaf tensor \(made by MulBackward0"):
        CanonicalGradAccumulator([("w", w), ("scaled", w * 2)])
    CanonicalGradAccumulator([("w", w), ("frozen", (w * 2).detach())])  # no grad: not tracked, as before


def test_bad_construction_and_offsets():
    w = torch.randn(D, requires_grad=True)
    with pytest.raises(ValueError, match="leaf_tokens"):
        CanonicalGradAccumulator([w], leaf_tokens=0)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        CanonicalGradAccumulator([3.0])
    acc = CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    with pytest.raises(ValueError, match="not a multiple of leaf_tokens"):
        with acc.micro_batch(token_offset=6):
            pass
    with pytest.raises(ValueError, match="non-negative"):
        with acc.micro_batch(token_offset=-4):
            pass
    with acc.micro_batch(token_offset=0):
        with pytest.raises(RuntimeError, match="nested"):
            with acc.micro_batch(token_offset=4):
                pass
        with pytest.raises(RuntimeError, match="inside a micro_batch"):
            acc.reduce(total_tokens=4)


def test_missing_leaves_duplicates_and_overrun():
    x, dy = _data(tokens=16)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        toy_scale(x[:8], w).backward(dy[:8])
    with pytest.raises(ValueError, match=r"w .*tokens \[8, 16\) of total_tokens=16 received no deposit"):
        acc.reduce(total_tokens=16)  # leaves 2, 3 never deposited
    with acc.micro_batch(token_offset=8):  # the refused reduce kept the deposits: the rest can come
        toy_scale(x[8:], w).backward(dy[8:])
    acc.reduce(total_tokens=16)
    assert_bitwise_equal(w.grad, canonical_sum(x * dy, LEAF), "dW after a refused reduce")
    w.grad = None
    acc13 = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    with acc13.micro_batch(token_offset=0):
        toy_scale(x[:8], w).backward(dy[:8])
    with pytest.raises(ValueError, match=r"tokens \[8, 13\) of total_tokens=13 received no"):
        acc13.reduce(total_tokens=13)  # a wrong total: the gap it leaves is named
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        toy_scale(x[:8], w).backward(dy[:8])
    overlap = r"w \(use 0\): tree node \(0, 1\) supplied twice: leaves \[1, 2\).*token_offset.*reduce\(\)"
    with pytest.raises(ValueError, match=overlap):
        with acc.micro_batch(token_offset=4):  # overlaps leaf 1 of the first micro-batch
            toy_scale(x[4:12], w).backward(dy[4:12])
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=8):
        toy_scale(x[:8], w).backward(dy[:8])
    with pytest.raises(ValueError, match="beyond total_tokens"):
        acc.reduce(total_tokens=12)


def test_mid_leaf_micro_batch_must_end_the_batch():
    x, dy = _data(tokens=16)
    w = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        toy_scale(x[:6], w).backward(dy[:6])
    with acc.micro_batch(token_offset=8):
        toy_scale(x[8:16], w).backward(dy[8:16])
    with pytest.raises(ValueError, match="not a multiple of leaf_tokens"):
        acc.reduce(total_tokens=16)


def test_param_without_deposit_and_stale_grad():
    x, dy = _data(tokens=8)
    w = torch.randn(D, requires_grad=True)
    other = torch.nn.Parameter(torch.randn(3))
    acc = CanonicalGradAccumulator([("w", w), ("other", other)], leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        toy_scale(x, w).backward(dy)
    with pytest.raises(RuntimeError, match=r"no canonical-order gradient was deposited for \['other'\]"):
        acc.reduce(total_tokens=8)
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    w.grad = torch.ones(D)
    with acc.micro_batch(token_offset=0):
        toy_scale(x, w).backward(dy)
    with pytest.raises(RuntimeError, match="w: p.grad already holds a non-zero gradient"):
        acc.reduce(total_tokens=8)


def test_reduce_names_the_one_stale_gradient_among_zeroed_ones():
    """The stale-gradient check reads all of them at once, then names the one at fault (a NaN counts)."""
    x, dy = _data(tokens=8)
    ws = [torch.randn(D, requires_grad=True) for _ in range(3)]
    acc = CanonicalGradAccumulator([(f"w{i}", w) for i, w in enumerate(ws)], leaf_tokens=LEAF)
    for w in ws:
        w.grad = torch.zeros(D)  # zero_grad(set_to_none=False)
    ws[1].grad[3] = float("nan")
    with acc.micro_batch(token_offset=0):
        for w in ws:
            toy_scale(x, w).backward(dy)
    with pytest.raises(RuntimeError, match=r"^w1: p.grad already holds a non-zero gradient"):
        acc.reduce(total_tokens=8)
    ws[1].grad.zero_()
    acc.reduce(total_tokens=8)  # the refused reduce kept every deposit
    for w in ws:
        assert_bitwise_equal(w.grad, canonical_sum(x * dy, LEAF), "dW after zeroing the stale gradient")


def test_a_forward_outside_the_micro_batch_is_named_at_reduce():
    import det_train

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 8))
    x = torch.randn(16, 8)
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=8)
    y = det_train.linear(x[:8], w)  # outside: its backward returns a plain gradient
    with acc.micro_batch(token_offset=0):
        y.sum().backward()
    with acc.micro_batch(token_offset=8):
        det_train.linear(x[8:], w).sum().backward()
    with pytest.raises(RuntimeError, match=r"w: p.grad already holds .*a forward that ran outside"):
        acc.reduce(total_tokens=16)


def test_bad_deposits():
    w = torch.randn(D, requires_grad=True)
    stranger = torch.randn(D, requires_grad=True)
    acc = CanonicalGradAccumulator([w], leaf_tokens=LEAF)
    with pytest.raises(RuntimeError, match="outside micro_batch"):
        acc.deposit(w, 0, torch.zeros(1, D))
    with acc.micro_batch(token_offset=0):
        with pytest.raises(ValueError, match="does not track") as refused:
            acc.deposit(stranger, 0, torch.zeros(1, D))
        assert "tracks no parameter" not in str(refused.value)  # it tracks w
        with pytest.raises(ValueError, match="float32"):
            acc.deposit(w, 0, torch.zeros(1, D, dtype=torch.float64))
        with pytest.raises(ValueError, match="shape"):
            acc.deposit(w, 0, torch.zeros(1, D + 1))
        with pytest.raises(ValueError, match="float32 of shape"):
            acc.deposit_partial(w, TreePartial().add_leaves(0, torch.zeros(1, D + 1)))
    with pytest.raises(ValueError, match="total_tokens"):
        acc.reduce(total_tokens=0)
    with pytest.raises(TypeError, match="total_tokens must be an integer"):
        acc.reduce(total_tokens=8.0)
    with pytest.raises(TypeError, match="leaf_tokens must be an integer"):
        CanonicalGradAccumulator([w], leaf_tokens=True)
    assert CanonicalGradAccumulator([w], leaf_tokens=np.int64(LEAF)).leaf_tokens == LEAF  # any integer type
