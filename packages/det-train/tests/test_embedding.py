"""det_train.embedding: the weight gradient equals its canonical-order definition bit for bit, is
invariant to micro-batching, handles repeated ids without atomics; forward is an exact gather."""

import det_train
import pytest
import torch
from det_core.testing import (
    assert_bitwise_equal,
    assert_run_to_run,
    contiguous_splits,
    digest,
    run_in_fresh_process,
)
from det_train.accum._leaf_sums import sub_leaf_tokens
from det_train.accum.grad_accum import DEFAULT_LEAF_TOKENS, CanonicalGradAccumulator
from det_train.reference_norms import embedding_weight_grad_reference


def _inputs(tokens, v, d, seed=0, dtype=torch.bfloat16, device="cpu", hot=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (tokens,), generator=g)
    if hot is not None:  # many repeats of a few ids, like frequent tokens
        ids[torch.rand(tokens, generator=g) < 0.5] = hot
    w = torch.randn(v, d, generator=g).to(dtype)
    dy = torch.randn(tokens, d, generator=g).to(dtype)
    return ids.to(device), w.to(device), dy.to(device)


def _grad(ids, w, dy):
    w = w.detach().clone().requires_grad_()
    det_train.embedding(ids, w).backward(dy)
    return w.grad


def test_forward_is_exact_gather():
    ids, w, _ = _inputs(40, 30, 8)
    ids2 = ids.view(4, 10)
    assert_bitwise_equal(det_train.embedding(ids2, w), w[ids2], "embedding forward")


@pytest.mark.parametrize("hot", [None, 7])
def test_grad_equals_canonical_definition(hot, monkeypatch):
    # the plain backward's leaf, small here so that 3 leaves stay cheap under the interpreter
    monkeypatch.setattr(det_train.accum._leaf_sums, "DEFAULT_LEAF_TOKENS", 256)
    ids, w, dy = _inputs(2 * 256 + 5, 50, 12, hot=hot)  # 3 leaves, last short
    grad = _grad(ids, w, dy)
    ref = embedding_weight_grad_reference(ids, dy, 50, 256).to(w.dtype)
    assert_bitwise_equal(grad, ref, "dW vs definition")
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[ids] = False
    assert bool((grad[untouched] == 0).all())
    exact = torch.zeros(50, 12, dtype=torch.float64).index_add_(0, ids, dy.double())
    torch.testing.assert_close(grad.double(), exact, rtol=1e-2, atol=1e-2)


def test_run_to_run():
    ids, w, dy = _inputs(300, 20, 16, hot=3)
    assert_run_to_run(lambda: _grad(ids, w, dy), repeats=3, name="embedding dW")


def test_fresh_process_cold_cache():
    code = (
        "import torch, det_train\n"
        "from det_core.testing import digest\n"
        "g = torch.Generator().manual_seed(0)\n"
        "ids = torch.randint(0, 9, (70,), generator=g)\n"
        "w = torch.randn(9, 8, generator=g).bfloat16().requires_grad_()\n"
        "dy = torch.randn(70, 8, generator=g).bfloat16()\n"
        "det_train.embedding(ids, w).backward(dy)\n"
        "print(digest(w.grad))\n"
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 9, (70,), generator=g)
    w = torch.randn(9, 8, generator=g).bfloat16()
    dy = torch.randn(70, 8, generator=g).bfloat16()
    assert run_in_fresh_process(code, env={"TRITON_INTERPRET": "1"}) == digest(_grad(ids, w, dy))


@pytest.mark.parametrize("int32", [False, True])
def test_micro_batch_invariance(int32):
    leaf, tokens, v, d = 4, 8 * 4 + 2, 9, 6  # tiny vocab: every id repeats within and across leaves
    ids, w0, dy = _inputs(tokens, v, d, seed=4)
    ids = ids.to(torch.int32) if int32 else ids

    def run(parts):
        w = w0.clone().requires_grad_()
        acc = CanonicalGradAccumulator([w], leaf_tokens=leaf)
        splits = contiguous_splits(tokens - 2, parts, leaf)
        splits[-1] = (splits[-1][0], tokens)
        for start, end in splits:
            with acc.micro_batch(token_offset=start):
                det_train.embedding(ids[start:end].view(1, -1), w).backward(dy[start:end].view(1, -1, d))
        acc.reduce(total_tokens=tokens)
        return w.grad

    whole = run(1)
    assert_bitwise_equal(
        whole, embedding_weight_grad_reference(ids, dy, v, leaf).bfloat16(), "dW vs definition"
    )
    for parts in (2, 3, 4, 8):
        assert_bitwise_equal(run(parts), whole, f"embedding dW, {parts} micro-batches")


def test_micro_batches_of_any_size_give_the_bits_of_one_batch():
    """Boundaries inside leaves: the open leaf's (ids, dy) rows are carried to the next micro-batch."""
    leaf, tokens, v, d = 8, 5 * 8 + 3, 9, 6
    ids, w0, dy = _inputs(tokens, v, d, seed=4)
    want = embedding_weight_grad_reference(ids, dy, v, leaf).bfloat16()
    for parts in (2, 3, 7, tokens):
        w = w0.clone().requires_grad_()
        acc = CanonicalGradAccumulator([w], leaf_tokens=leaf)
        for start, end in contiguous_splits(tokens, parts):
            with acc.micro_batch(token_offset=start):
                det_train.embedding(ids[start:end], w).backward(dy[start:end])
        acc.reduce(total_tokens=tokens)
        assert_bitwise_equal(w.grad, want, f"embedding dW, {parts} unaligned micro-batches")


def test_tied_embedding_and_head():
    """One table used by the embedding and a (toy) head: two deposits per micro-batch."""
    leaf, tokens, v, d = 4, 16, 7, 5
    ids, w0, dy = _inputs(tokens, v, d, seed=2, dtype=torch.float32)
    ids_b = (ids * 3 + 1) % v  # the second use's ids (e.g. the head's targets)

    def run(parts, granule=leaf):
        w = w0.clone().requires_grad_()
        acc = CanonicalGradAccumulator([w], leaf_tokens=leaf)
        for start, end in contiguous_splits(tokens, parts, granule):
            with acc.micro_batch(token_offset=start):
                h = det_train.embedding(ids[start:end], w)
                det_train.embedding(ids_b[start:end], w).mul(h).backward(dy[start:end])
        acc.reduce(total_tokens=tokens)
        return w.grad

    whole = run(1)
    for parts in (2, 3, 4):
        assert_bitwise_equal(run(parts), whole, f"tied dW, {parts} micro-batches")
    for parts in (3, 5, 7):  # cuts inside leaves: each use carries its own open leaf
        assert_bitwise_equal(run(parts, 1), whole, f"tied dW, {parts} unaligned micro-batches")


def test_module_drop_in():
    ref = torch.nn.Embedding(11, 4)
    mod = det_train.Embedding(11, 4)
    mod.load_state_dict(ref.state_dict())
    ids = torch.tensor([[1, 2, 2], [10, 0, 1]])
    assert_bitwise_equal(mod(ids), ref(ids), "Embedding module")
    with pytest.raises(ValueError, match="max_norm"):
        det_train.Embedding(11, 4, max_norm=1.0)


def test_padding_idx_row_gets_a_zero_gradient_and_the_others_their_definition():
    """As torch.nn.Embedding(padding_idx=...): the padded tokens' rows are looked up, but add nothing
    to the gradient; every other row is the canonical sum, bit for bit (the definition with the
    padded tokens' dy zeroed), also through the accumulator with a cut inside a leaf."""
    ids = torch.tensor([3, 0, 3, 5, 0, 0, 1, 3, 5, 0, 2, 3])
    dy = torch.randn(12, 4, generator=torch.Generator().manual_seed(3))
    ref = torch.nn.Embedding(6, 4, padding_idx=-6)
    mod = det_train.Embedding(6, 4, padding_idx=-6)
    assert mod.padding_idx == 0 and bool((mod.weight[0] == 0).all())  # torch's init of the row
    mod.load_state_dict(ref.state_dict())
    assert_bitwise_equal(mod(ids), ref(ids), "forward with padding_idx")
    mod(ids).backward(dy)
    masked = torch.where((ids == 0)[:, None], 0.0, dy)
    plain = embedding_weight_grad_reference(ids, masked, 6, sub_leaf_tokens(DEFAULT_LEAF_TOKENS))
    assert_bitwise_equal(mod.weight.grad, plain, "dW with padding_idx vs definition")
    assert bool((mod.weight.grad[0] == 0).all()) and not bool(mod.weight.grad[0].signbit().any())
    want = embedding_weight_grad_reference(ids, masked, 6, 8)
    w = mod.weight.detach().clone().requires_grad_()
    acc = CanonicalGradAccumulator([w], leaf_tokens=8)
    for start, end in ((0, 5), (5, 12)):
        with acc.micro_batch(token_offset=start):
            det_train.embedding(ids[start:end], w, padding_idx=0).backward(dy[start:end])
    acc.reduce(total_tokens=12)
    assert_bitwise_equal(w.grad, want, "dW with padding_idx through the accumulator")
    with pytest.raises(ValueError, match="padding_idx 6 must lie in"):
        det_train.embedding(ids, w, padding_idx=6)


def test_bad_input_and_empty():
    w = torch.randn(5, 3, requires_grad=True)
    with pytest.raises(TypeError, match="int32 or int64"):
        det_train.embedding(torch.tensor([1.0]), w)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\), got min 0, max 5"):
        det_train.embedding(torch.tensor([0, 5]), w)
    with pytest.raises(ValueError, match="got min -1"):
        det_train.embedding(torch.tensor([-1, 2]), w)
    with pytest.raises(ValueError, match=r"\(V, D\)"):
        det_train.embedding(torch.tensor([0]), torch.randn(5))
    with pytest.raises(TypeError, match="floating point"):
        det_train.embedding(torch.tensor([0]), torch.ones(5, 3, dtype=torch.int64))
    out = det_train.embedding(torch.zeros(0, dtype=torch.int64), w)
    out.sum().backward()
    assert out.shape == (0, 3) and torch.equal(w.grad, torch.zeros(5, 3))


@pytest.mark.parametrize("lo, hi", [(0, 1), (0, 8), (3, 4), (3, 11), (5, 21), (16, 48)])
def test_node_of_leaf_maps_each_leaf_to_its_subtree(lo, hi):
    """The leaf -> subtree table, filled on the device (no host copy, so capturable), is the
    subtree order of dyadic_nodes expanded leaf by leaf."""
    from det_train.accum._leaf_sums import dyadic_nodes
    from det_train.ops.embedding import _node_of_leaf

    nodes = dyadic_nodes(lo, hi)
    expected = [q for q, (level, _) in enumerate(nodes) for _ in range(1 << level)]
    got = _node_of_leaf(nodes, lo, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.tolist() == expected


# ---------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("v", [32000, 50257])
def test_gpu_real_vocab_micro_batch_invariance(v):
    tokens, d, leaf = 8192, 2048, 1024
    ids, w0, dy = _inputs(tokens, v, d, seed=1, device="cuda", hot=13)

    def run(parts, leaf_tokens=leaf, granule=leaf):
        w = w0.clone().requires_grad_()
        acc = CanonicalGradAccumulator([w], leaf_tokens=leaf_tokens)
        for start, end in contiguous_splits(tokens, parts, granule):
            with acc.micro_batch(token_offset=start):
                det_train.embedding(ids[start:end], w).backward(dy[start:end])
        acc.reduce(total_tokens=tokens)
        return w.grad

    whole = assert_run_to_run(lambda: run(1), repeats=2, name="embedding dW")
    for parts in (2, 3, 4, 8):
        assert_bitwise_equal(run(parts), whole, f"embedding dW, {parts} micro-batches")
    whole = run(1, DEFAULT_LEAF_TOKENS)  # one leaf of 8192
    for parts in (3, 7):  # cuts inside the leaf: its rows carried from micro-batch to micro-batch
        assert_bitwise_equal(run(parts, DEFAULT_LEAF_TOKENS, 1), whole, f"embedding dW, {parts} cuts")
    assert_bitwise_equal(_grad(ids, w0, dy), whole, "no accumulator, default leaf")
    exact = torch.zeros(v, d, dtype=torch.float64, device="cuda").index_add_(0, ids, dy.double())
    torch.testing.assert_close(whole.double(), exact, rtol=1e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("hot", [None, 13])
def test_gpu_grad_equals_canonical_definition(hot):
    """The compiled segment-fold and per-id tree kernels give the definition's bits: without an
    accumulator (17 sub-leaves of 1024 in 3 leaves of 8192, the last short) and through one with
    leaf 128 split in 3 parts (subtrees at unaligned offsets)."""
    tokens, v, d = 2 * DEFAULT_LEAF_TOKENS + 29, 300, 520
    ids, w, dy = _inputs(tokens, v, d, seed=6, device="cuda", hot=hot)
    # the plain backward: the canonical tree over sub-leaves of 1024 tokens (_leaf_sums.sub_leaf_tokens)
    ref = embedding_weight_grad_reference(ids, dy, v, sub_leaf_tokens(DEFAULT_LEAF_TOKENS)).to(w.dtype)
    assert_bitwise_equal(_grad(ids, w, dy), ref, "GPU dW vs definition")
    leaf = 128
    wa = w.clone().requires_grad_()
    acc = CanonicalGradAccumulator([wa], leaf_tokens=leaf)
    splits = contiguous_splits(tokens - 29, 3, leaf)
    splits[-1] = (splits[-1][0], tokens)
    for start, end in splits:
        with acc.micro_batch(token_offset=start):
            det_train.embedding(ids[start:end], wa).backward(dy[start:end])
    acc.reduce(total_tokens=tokens)
    ref = embedding_weight_grad_reference(ids, dy, v, leaf).to(w.dtype)
    assert_bitwise_equal(wa.grad, ref, "GPU dW through the accumulator vs definition")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_with_accumulator_equals_eager():
    """Lookup, backward in 3 micro-batches (subtrees at unaligned leaves) and reduce, captured in
    one CUDA graph (no host sync or host copy inside), replay with new ids to the eager bits."""
    tokens, v, d, leaf = 3 * 1024 + 512, 8192, 768, 256
    splits = [(0, 1280), (1280, 2560), (2560, tokens)]  # leaves 0-4, 5-9, 10-13: several subtrees each
    _, w0, dy = _inputs(tokens, v, d, seed=7, device="cuda")

    def make():
        w = w0.clone().requires_grad_()
        return w, CanonicalGradAccumulator([w], leaf_tokens=leaf)

    def step(w, acc, ids):
        w.grad = None
        for start, end in splits:
            with acc.micro_batch(token_offset=start):
                det_train.embedding(ids[start:end], w).backward(dy[start:end])
        acc.reduce(total_tokens=tokens)
        return w.grad

    w, acc = make()
    static_ids = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels
        step(w, acc, static_ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grad = step(w, acc, static_ids)
    for seed, hot in ((8, None), (9, 13)):
        ids, _, _ = _inputs(tokens, v, d, seed=seed, device="cuda", hot=hot)
        static_ids.copy_(ids)
        graph.replay()
        assert_bitwise_equal(static_grad, step(*make(), ids), f"replayed dW vs eager, ids {seed}")
