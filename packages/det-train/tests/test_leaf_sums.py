"""det_train._leaf_sums.tree_in_place (the GPU tree behind rms_norm / cross_entropy / linear-free
weight gradients) gives TreePartial's nodes and root bit for bit, for any leaf count and offset."""

import pytest
import torch
from det_core.reduce import TreePartial
from det_core.sr import round_nearest_bf16_torch
from det_core.testing import assert_bitwise_equal
from det_train._leaf_sums import dyadic_nodes, tree_in_place


def _leaves(n, width=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over 6 decades, so a different pairing would change the bits
    return torch.randn(n, width, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 11, 16, 19])
def test_root_equals_tree_partial(n):
    x = _leaves(n, seed=n)
    ref = TreePartial().add_leaves(0, x).result(n)
    assert_bitwise_equal(tree_in_place(x.clone(), 0, torch.float32), ref, f"root of {n} leaves")
    assert_bitwise_equal(
        tree_in_place(x.clone(), 0, torch.bfloat16), round_nearest_bf16_torch(ref), "bf16 root (nearest)"
    )


@pytest.mark.parametrize("n", [1, 3, 6, 9, 13])
@pytest.mark.parametrize("lo", [0, 1, 3, 8, 13])
def test_subtrees_equal_tree_partial(n, lo):
    x = _leaves(n, seed=100 + n)
    partial = TreePartial().add_leaves(lo, x)
    nodes = tree_in_place(x.clone(), lo)
    assert sorted(nodes) == sorted(partial.nodes) == sorted(dyadic_nodes(lo, lo + n))
    for key, value in nodes.items():
        assert_bitwise_equal(value, partial.nodes[key], f"node {key} of leaves [{lo}, {lo + n})")


def test_root_needs_leaves_from_zero():
    with pytest.raises(ValueError, match="starting at 0"):
        tree_in_place(_leaves(3), 2, torch.float32)


# ---------------------------------------------------------------- GPU (the compiled kernel)
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "lo"), [(8, 0), (13, 0), (13, 3), (6, 8)])
def test_gpu_tree_equals_tree_partial(n, lo):
    x = _leaves(n, width=4096 + 3, seed=n).cuda()
    partial = TreePartial().add_leaves(lo, x)
    for key, value in tree_in_place(x.clone(), lo).items():
        assert_bitwise_equal(value, partial.nodes[key], f"GPU node {key} of leaves [{lo}, {lo + n})")
    if lo == 0:
        ref = TreePartial().add_leaves(0, x).result(n)
        assert_bitwise_equal(tree_in_place(x.clone(), 0, torch.float32), ref, "GPU root")
        assert_bitwise_equal(tree_in_place(x.clone(), 0, torch.bfloat16), ref.bfloat16(), "GPU bf16 root")
