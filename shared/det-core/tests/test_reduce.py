"""Canonical reduction order: any contiguous split at leaf boundaries gives the same bits."""

import pytest
import torch
from det_core.reduce import TreePartial, canonical_sum, leaf_sums_reference, num_leaves
from det_core.testing import assert_bitwise_equal, assert_decomposition_invariant, contiguous_splits


def _data(n=96, width=33, seed=0):
    g = torch.Generator().manual_seed(seed)
    # wide dynamic range so that a different summation order really changes the bits
    return torch.randn(n, width, generator=g) * 10.0 ** torch.randint(-4, 5, (n, 1), generator=g)


def _split_sum(x, leaf_size, parts):
    n_leaves = num_leaves(x.shape[0], leaf_size)
    partials = []
    for lo, hi in contiguous_splits(n_leaves, parts):
        chunk = x[lo * leaf_size : hi * leaf_size]
        partials.append(TreePartial().add_leaves(lo, leaf_sums_reference(chunk, leaf_size)))
    merged = TreePartial()
    for p in reversed(partials):  # merge order must not matter
        merged.merge(p)
    return merged.result(n_leaves)


@pytest.mark.parametrize("n,leaf_size", [(96, 8), (91, 8), (13, 1), (64, 64)])
def test_contiguous_splits_give_identical_bits(n, leaf_size):
    x = _data(n)
    leaves = num_leaves(n, leaf_size)
    parts = [p for p in (1, 2, 3, 4, 7) if p <= leaves]
    assert_decomposition_invariant(
        lambda: canonical_sum(x, leaf_size), lambda p: _split_sum(x, leaf_size, p), parts=parts, name="sum"
    )


def test_order_actually_matters_for_this_data():
    # guard: the test above would prove nothing if every order gave the same bits
    x = _data()
    assert not torch.equal(canonical_sum(x, 8), x.sum(0)) or not torch.equal(
        canonical_sum(x, 8), x.flip(0).sum(0)
    )
    assert not torch.equal(canonical_sum(x, 8), canonical_sum(x, 4))


def test_tree_shape_for_non_power_of_two_leaf_count():
    # 5 leaves: ((l0 + l1) + (l2 + l3)) + l4
    leaves = [torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0, 3.0)]
    got = TreePartial().add_leaves(0, leaves).result(5)
    expected = ((leaves[0] + leaves[1]) + (leaves[2] + leaves[3])) + leaves[4]
    assert_bitwise_equal(got, expected, "5-leaf tree")


def test_leaf_sum_is_left_fold_in_fp32():
    x = torch.tensor([1e8, 1.0, -1e8, 1.0], dtype=torch.bfloat16)
    got = leaf_sums_reference(x, 4)[0]
    expected = ((x[0].float() + x[1].float()) + x[2].float()) + x[3].float()
    assert_bitwise_equal(got, expected, "leaf fold")


def test_incremental_micro_batches_keep_few_nodes():
    x = _data(128)
    acc = TreePartial()
    for start in range(0, 128, 8):  # 16 leaves fed in order
        acc.add_leaves(start // 8, leaf_sums_reference(x[start : start + 8], 8))
        assert len(acc.nodes) <= 5
    assert_bitwise_equal(acc.result(16), canonical_sum(x, 8), "incremental")


def test_overlapping_and_missing_leaves_are_errors():
    leaves = leaf_sums_reference(_data(32), 8)
    with pytest.raises(ValueError, match="twice"):
        TreePartial().add_leaves(0, leaves).add_leaves(1, leaves[1:2])
    with pytest.raises(ValueError, match="incomplete"):
        TreePartial().add_leaves(0, leaves[:2]).result(4)
    with pytest.raises(ValueError, match="empty"):
        TreePartial().result(0)
    with pytest.raises(ValueError):
        num_leaves(10, 0)
