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


def _dense_result(nodes: dict, total_leaves: int) -> torch.Tensor:
    # the tree level by level over every index (result's definition, no shortcut): left + right,
    # a missing right child past the leaf count promotes the left one
    nodes, level, width = dict(nodes), 0, total_leaves
    while width > 1:
        for i in range(0, width, 2):
            left = nodes.pop((level, i), None)
            if left is not None:
                right = nodes.pop((level, i + 1), None) if i + 1 < width else None
                nodes[(level + 1, i // 2)] = left if right is None else left + right
        level, width = level + 1, (width + 1) // 2
    return nodes.pop((level, 0))


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("n_leaves", [1, 5, 16, 21, 37])
def test_result_equals_the_level_by_level_tree(parts, n_leaves):
    """``result`` visits only the nodes a partial holds: the same adds as walking every index of
    every level, for partials merged from 1 to 7 contiguous runs of any length."""
    leaves = leaf_sums_reference(_data(n_leaves * 4, seed=n_leaves), 4)
    merged = TreePartial()
    for lo, hi in contiguous_splits(n_leaves, min(parts, n_leaves)):
        merged.merge(TreePartial().add_leaves(lo, leaves[lo:hi]))
    assert_bitwise_equal(merged.result(n_leaves), _dense_result(merged.nodes, n_leaves), "sparse walk")
    assert_bitwise_equal(merged.result(n_leaves), canonical_sum(_data(n_leaves * 4, seed=n_leaves), 4), "sum")


@pytest.mark.parametrize("n_leaves", [1, 2, 5, 7, 8, 13])
def test_in_place_combine_and_consuming_result_keep_the_bits(n_leaves):
    """A ``combine`` that adds into a child (fp32 addition is commutative) and ``result(consume=True)``
    give the bits of the default new-tensor adds; the consumed partial is empty afterwards."""
    g = torch.Generator().manual_seed(n_leaves)
    leaves = torch.randn(n_leaves, 33, generator=g) * torch.logspace(-3, 3, 33)
    reference = TreePartial().add_leaves(0, leaves).result(n_leaves)
    seen = []

    def into_right(left, right):
        seen.append((left, right))
        return torch.add(left, right, out=right)

    tree = TreePartial()
    for i in range(n_leaves):
        tree.add_node(0, i, leaves[i].clone(), into_right)
    assert len(seen) == n_leaves - bin(n_leaves).count("1")  # one add per combined pair
    before = sorted(tree.nodes)
    root = tree.result(n_leaves, consume=True)
    assert_bitwise_equal(root, reference, "in-place adds, consumed result")
    assert tree.nodes == {} and len(before) == bin(n_leaves).count("1")
    with pytest.raises(ValueError, match="incomplete"):
        TreePartial().add_node(0, 0, leaves[0]).result(max(2, n_leaves), consume=True)
