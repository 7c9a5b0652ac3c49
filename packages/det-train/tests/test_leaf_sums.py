"""det_train.accum._leaf_sums.tree_in_place (the GPU tree behind rms_norm / cross_entropy / linear-free
weight gradients) gives TreePartial's nodes and root bit for bit, for any leaf count and offset."""

import pytest
import torch
from det_core.reduce import TreePartial
from det_core.sr import round_nearest_bf16_torch
from det_core.testing import assert_bitwise_equal
from det_train.accum._leaf_sums import dyadic_nodes, tree_in_place


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


# ---------------------------------------------------------------- sub-leaves of the vector reductions
def test_sub_leaf_is_a_power_of_two_part_of_the_leaf():
    from det_train.accum._leaf_sums import SUB_LEAF_TOKENS, sub_leaf_tokens

    assert SUB_LEAF_TOKENS == 1024
    assert [sub_leaf_tokens(n) for n in (8192, 4096, 1024, 3072, 1000, 32, 7)] == [1024] * 3 + [
        768,
        1000,
        32,
        7,
    ]


@pytest.mark.parametrize("n_sub", [8, 12, 13, 15])
def test_coarsen_keeps_the_tree_over_sub_leaves(n_sub):
    """Subtrees over sub-leaves (4 per leaf) read as subtrees over leaves, the short last leaf's
    pieces combined right to left: the root is the canonical tree over the sub-leaves."""
    from det_train.accum._leaf_sums import coarsen

    x = _leaves(n_sub, seed=n_sub)
    want = TreePartial().add_leaves(0, x).result(n_sub)
    for cut in (4, 8):  # two deposits: leaves [0, cut / 4) and the rest
        tree = TreePartial()
        tree.merge(coarsen(TreePartial().add_leaves(0, x[:cut]), 4))
        tree.merge(coarsen(TreePartial().add_leaves(cut, x[cut:]), 4))
        assert_bitwise_equal(tree.result(-(-n_sub // 4)), want, f"{n_sub} sub-leaves, cut {cut}")


def test_ops_sum_each_leaf_as_the_tree_over_its_sub_leaves(monkeypatch):
    """RMSNorm weight, Linear bias and embedding table with leaves of 16 tokens made of 4 sub-leaves
    of 4 (SUB_LEAF_TOKENS patched), through the accumulator in unaligned micro-batches and without
    it: the bits of leaves of 4 tokens (sub-leaf = leaf), whose tree is the same tree."""
    import det_train
    import det_train.accum._leaf_sums as leaf_sums
    from det_core.testing import contiguous_splits
    from det_train.accum.grad_accum import CanonicalGradAccumulator

    monkeypatch.setattr(leaf_sums, "SUB_LEAF_TOKENS", 4)
    # 4 leaves, the last short (2 sub-leaves, one short); the cuts below fall inside sub-leaves, on
    # sub-leaf boundaries inside leaves and on leaf boundaries
    tokens, d, v = 3 * 16 + 6, 16, 7
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, d, generator=g).bfloat16()
    dy = torch.randn(tokens, d, generator=g).bfloat16()
    ids = torch.randint(0, v, (tokens,), generator=g)
    norm_w0, emb_w0 = (
        (1 + 0.1 * torch.randn(d, generator=g)).bfloat16(),
        torch.randn(v, d, generator=g).bfloat16(),
    )
    lin_w0, lin_b0 = torch.randn(d, d, generator=g).bfloat16(), torch.randn(d, generator=g).bfloat16()

    def grads(leaf, cuts):
        params = [t.clone().requires_grad_() for t in (norm_w0, emb_w0, lin_w0, lin_b0)]
        norm_w, emb_w, lin_w, lin_b = params
        acc = CanonicalGradAccumulator(params, leaf_tokens=leaf)
        for s, e in cuts:
            with acc.micro_batch(token_offset=s):
                h = det_train.rms_norm(x[s:e], norm_w) + det_train.embedding(ids[s:e], emb_w)
                det_train.linear(h, lin_w, lin_b).backward(dy[s:e])
        acc.reduce(total_tokens=tokens)
        return [p.grad for p in (norm_w, emb_w, lin_b)]  # lin_w: a fold over the whole leaf

    want = grads(4, [(0, tokens)])
    for cuts in ([(0, tokens)], contiguous_splits(tokens, 3), contiguous_splits(tokens, 7)):
        for name, got, ref in zip(
            ("rms_norm weight", "embedding", "bias"), grads(16, cuts), want, strict=True
        ):
            assert_bitwise_equal(got, ref, f"{name}, {len(cuts)} micro-batches")
    monkeypatch.setattr(leaf_sums, "DEFAULT_LEAF_TOKENS", 16)  # the plain backward: the same tree
    norm_w, emb_w = norm_w0.clone().requires_grad_(), emb_w0.clone().requires_grad_()
    h = det_train.rms_norm(x, norm_w) + det_train.embedding(ids, emb_w)
    det_train.linear(h, lin_w0, lin_b0).backward(dy)
    assert_bitwise_equal(norm_w.grad, want[0], "rms_norm weight without accumulator")
    assert_bitwise_equal(emb_w.grad, want[1], "embedding without accumulator")
