"""det_train.cross_entropy: row invariance of loss and dlogits, canonical-order mean, micro-batch
invariance of dlogits with num_global_tokens, accuracy against fp64, ignore_index, bad input."""

import det_train
import numpy as np
import pytest
import torch
from det_core.reduce import TreePartial, leaf_sums_reference
from det_core.testing import (
    assert_bitwise_equal,
    assert_row_invariant,
    assert_run_to_run,
    contiguous_splits,
    digest,
    run_in_fresh_process,
)
from det_train.accum.grad_accum import CanonicalGradAccumulator
from det_train.reference_norms import cross_entropy_reference


def _inputs(n, v, seed=0, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, v, generator=g)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return logits.to(device), targets.to(device)


def _loss_and_grad(logits, targets, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = det_train.cross_entropy(x, targets, **kw)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), x.grad


def _check_row_invariance(v, sizes, device, dtype=torch.bfloat16):
    # a row = its logits plus its target stored in one extra column
    def make(m, seed):
        logits, targets = _inputs(m, v, seed=seed, dtype=torch.float32, device=device)
        return torch.cat([logits, targets.unsqueeze(1).float()], dim=1)

    def fn(batch):
        logits, targets = batch[:, :v].to(dtype), batch[:, v].long()
        losses, grad = _loss_and_grad(logits, targets, reduction="none")  # upstream gradient 1 per row
        return torch.cat([losses.unsqueeze(1), grad.float()], dim=1)

    assert_row_invariant(fn, lambda m: make(m, m), sizes, make(1, 999), "cross_entropy loss/dlogits")


def test_row_invariance_multi_chunk_vocab():
    _check_row_invariance(4096 + 300, [1, 2, 3, 17], "cpu")  # two BLOCK_V chunks


def test_mean_is_canonical_sum_over_count_and_accurate():
    leaf = 4  # the active accumulator's leaf size is the loss's leaf size
    logits, targets = _inputs(8 * leaf + 3, 33, dtype=torch.float32)
    targets[::5] = -100
    count = int((targets != -100).sum())
    acc = CanonicalGradAccumulator([], leaf_tokens=leaf)
    with acc.micro_batch(token_offset=0):
        loss, grad = _loss_and_grad(logits, targets, num_global_tokens=count)
        # a micro-batch's own count would make the gradients depend on the split: refused
        with pytest.raises(ValueError, match="needs num_global_tokens"):
            det_train.cross_entropy(logits, targets)
    per_token, _ = _loss_and_grad(logits, targets, reduction="none")
    leaves = leaf_sums_reference(per_token, leaf)
    expected = TreePartial().add_leaves(0, leaves).result(leaves.shape[0]) / count
    # leaf sums of 4 tokens: lane order == token order, so the bits match the reference fold
    assert_bitwise_equal(loss, expected, "canonical mean")
    ref = cross_entropy_reference(logits, targets)
    assert abs(loss.double() - ref) / ref < 1e-6
    xd = logits.double().requires_grad_()
    cross_entropy_reference(xd, targets).backward()
    torch.testing.assert_close(grad.double(), xd.grad, rtol=1e-5, atol=1e-9)
    assert bool((grad[::5] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accuracy_half(dtype):
    logits, targets = _inputs(50, 300, dtype=dtype)
    loss, grad = _loss_and_grad(logits, targets)
    ref = cross_entropy_reference(logits, targets)
    assert abs(loss.double() - ref) / ref < 1e-6  # fp32 math on the exact half inputs
    xd = logits.double().requires_grad_()
    cross_entropy_reference(xd, targets).backward()
    err = (grad.double() - xd.grad).abs().max() / xd.grad.abs().max()
    assert err < 1e-2 if dtype == torch.bfloat16 else err < 2e-3


def test_bf16_gradient_rounds_to_nearest():
    """dlogits in bf16 is the fp32 gradient rounded to nearest (the fp64 reference's rounding, but
    for values within fp32 error of a tie), not toward zero (the interpreter's own cast, before
    det_core.interpreter's)."""
    logits, targets = _inputs(64, 300, seed=4)
    _, grad = _loss_and_grad(logits, targets)
    xd = logits.double().requires_grad_()
    cross_entropy_reference(xd, targets).backward()
    same = (grad == xd.grad.to(torch.bfloat16)).double().mean().item()
    assert same > 0.99, f"{same:.1%} equal to the rounded fp64 reference"


def test_run_to_run():
    logits, targets = _inputs(40, 500)
    assert_run_to_run(lambda: _loss_and_grad(logits, targets), repeats=3, name="cross_entropy")


def test_fresh_process_cold_cache():
    code = (
        "import torch, det_train\n"
        "from det_core.testing import digest\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = (3 * torch.randn(20, 300, generator=g)).bfloat16().requires_grad_()\n"
        "t = torch.randint(0, 300, (20,), generator=g)\n"
        "loss = det_train.cross_entropy(x, t); loss.backward()\n"
        "print(digest([loss, x.grad]))\n"
    )
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(20, 300, generator=g)).bfloat16()
    t = torch.randint(0, 300, (20,), generator=g)
    assert run_in_fresh_process(code, env={"TRITON_INTERPRET": "1"}) == digest(list(_loss_and_grad(x, t)))


@pytest.mark.parametrize("ignore", [False, True])
def test_counted_and_given_denominators_take_two_ops_with_the_same_bits(ignore):
    """``reduction="mean"`` without ``num_global_tokens`` counts the tokens on the host (the counting
    op, a CPU denominator: CUDA-graph trees run it between graphs); with it, the fixed-scale op (no
    count, no CPU output: captured). Same kernels and arithmetic: the loss and dlogits of one are
    the other's, bit for bit, and each call runs the op its arguments say."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "det_train":
                self.names.append(func._opname)
            return func(*args, **(kwargs or {}))

    logits, targets = _inputs(37, 19, dtype=torch.float32)
    if ignore:
        targets[::3] = -100
    count = int((targets != -100).sum())
    with Ops() as counted_ops:
        counted = _loss_and_grad(logits, targets)
    with Ops() as given_ops:
        given = _loss_and_grad(logits, targets, num_global_tokens=count)
    assert "cross_entropy" in counted_ops.names and "cross_entropy_backward" in counted_ops.names
    assert "cross_entropy_fixed_scale" in given_ops.names
    assert "cross_entropy_fixed_scale_backward" in given_ops.names
    assert "cross_entropy" not in given_ops.names
    for got, want, what in zip(given, counted, ("loss", "dlogits"), strict=True):
        assert_bitwise_equal(got, want, f"num_global_tokens={count} against the counted mean: {what}")


def test_micro_batch_invariance_with_num_global_tokens():
    n, v = 24, 40
    logits, targets = _inputs(n, v, seed=3)
    targets[[2, 11, 17]] = -100
    _, whole = _loss_and_grad(logits, targets, num_global_tokens=n)
    for parts in (2, 3, 4, 8):
        grads = [
            _loss_and_grad(logits[a:b], targets[a:b], num_global_tokens=n)[1]
            for a, b in contiguous_splits(n, parts)
        ]
        assert_bitwise_equal(torch.cat(grads), whole, f"dlogits, {parts} micro-batches")


def test_3d_input_none_and_sum():
    logits, targets = _inputs(12, 20, dtype=torch.float32)
    none = det_train.cross_entropy(logits.view(3, 4, 20), targets.view(3, 4), reduction="none")
    assert none.shape == (3, 4) and none.dtype == torch.float32
    torch.testing.assert_close(
        none.double(), cross_entropy_reference(logits, targets, reduction="none").view(3, 4)
    )
    total = det_train.cross_entropy(logits, targets, reduction="sum")
    torch.testing.assert_close(total.double(), cross_entropy_reference(logits, targets, reduction="sum"))


def test_all_ignored_mean_is_nan_like_torch():
    logits, _ = _inputs(3, 5)
    loss = det_train.cross_entropy(logits, torch.full((3,), -100))
    assert torch.isnan(loss) and torch.isnan(
        torch.nn.functional.cross_entropy(logits.float(), torch.full((3,), -100))
    )


def test_bad_input():
    logits, targets = _inputs(4, 6)
    with pytest.raises(ValueError, match="target 6 is outside"):
        det_train.cross_entropy(logits, torch.tensor([0, 1, 6, 2]))
    with pytest.raises(ValueError, match="targets shape"):
        det_train.cross_entropy(logits, targets[:3])
    with pytest.raises(TypeError, match="int64 or int32"):
        det_train.cross_entropy(logits, targets.float())
    with pytest.raises(TypeError, match="not supported"):
        det_train.cross_entropy(logits.double(), targets)
    with pytest.raises(TypeError, match=r"logits must be a torch.Tensor, got numpy.ndarray .*from_numpy"):
        det_train.cross_entropy(logits.float().numpy(), targets)
    with pytest.raises(TypeError, match=r"targets must be a torch.Tensor, got builtins.list"):
        det_train.cross_entropy(logits, targets.tolist())
    with pytest.raises(ValueError, match="reduction"):
        det_train.cross_entropy(logits, targets, reduction="avg")
    with pytest.raises(ValueError, match="reduction='mean' only"):
        det_train.cross_entropy(logits, targets, reduction="sum", num_global_tokens=4)
    with pytest.raises(ValueError, match="positive"):
        det_train.cross_entropy(logits, targets, num_global_tokens=0)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (2.5, TypeError, "num_global_tokens must be an integer .*got float 2.5"),
        (4.0, TypeError, "num_global_tokens must be an integer .*got float 4.0"),
        ("8", TypeError, "num_global_tokens must be an integer .*got str '8'"),
        (True, TypeError, "num_global_tokens must be an integer, got the bool True"),
        (-3, ValueError, "num_global_tokens must be a positive int, got -3"),
        (np.int64(0), ValueError, "num_global_tokens must be a positive int, got 0"),
    ],
    ids=repr,
)
def test_num_global_tokens_must_be_a_positive_integer(bad, error, match):
    # found by a new-user check: 2.5 was truncated to 2 and "8" accepted (int() semantics)
    logits, targets = _inputs(4, 6)
    with pytest.raises(error, match=match):
        det_train.cross_entropy(logits, targets, num_global_tokens=bad)


def test_num_global_tokens_smaller_than_the_calls_own_tokens_is_refused():
    """The global count covers every micro-batch and rank: fewer than this call's own non-ignored
    tokens is a wrong count (read with the range check, no extra sync); ignored tokens do not count."""
    logits, targets = _inputs(4, 6)
    with pytest.raises(ValueError, match="num_global_tokens=3 is smaller than the 4 non-ignored tokens"):
        det_train.cross_entropy(logits, targets, num_global_tokens=3)
    targets[:2] = -100
    loss, _ = _loss_and_grad(logits, targets, num_global_tokens=2)  # two counted tokens: accepted
    assert torch.isfinite(loss)


def test_num_global_tokens_accepts_any_integer_type():
    logits, targets = _inputs(4, 6)
    expected = _loss_and_grad(logits, targets, num_global_tokens=8)
    for n in (np.int64(8), np.int32(8), torch.tensor(8)):
        for got, want in zip(_loss_and_grad(logits, targets, num_global_tokens=n), expected, strict=True):
            assert_bitwise_equal(got, want, f"num_global_tokens={n!r}")


def test_zero_dim_logits_name_the_class_dim():
    with pytest.raises(ValueError, match="logits must have at least 1 dim, the class dim"):
        det_train.cross_entropy(torch.tensor(1.0), torch.tensor(0))


@pytest.mark.parametrize(
    "kw", [{}, {"num_global_tokens": 8}, {"reduction": "sum"}, {"reduction": "none"}], ids=repr
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_target_range_checked_outside_graph_capture(kw, dtype):
    """The host-side range check (skipped only while a CUDA graph is captured) runs on every
    reduction path: a target of V or a negative one that is not ignore_index raises, an
    ignore_index target does not."""
    logits, _ = _inputs(4, 6)
    for bad, first in (([0, 1, 6, 2], 6), ([0, -1, 2, 7], -1)):
        with pytest.raises(ValueError, match=rf"target {first} is outside \[0, 6\)"):
            det_train.cross_entropy(logits, torch.tensor(bad, dtype=dtype), **kw)
    ok = det_train.cross_entropy(logits, torch.tensor([0, -100, 5, 2], dtype=dtype), **kw)
    assert torch.isfinite(ok).all()


# ---------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
def test_gpu_row_invariance_real_vocab():
    _check_row_invariance(32000, [1, 2, 3, 17, 64, 65, 127, 128, 129, 1000], "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("v", [32000, 50257])
def test_gpu_accuracy_and_micro_batches(v):
    n = 8192
    logits, targets = _inputs(n, v, seed=5, device="cuda")
    loss, grad = assert_run_to_run(lambda: _loss_and_grad(logits, targets, num_global_tokens=n), repeats=2)
    ref = cross_entropy_reference(logits, targets)
    assert abs(loss.double() - ref) / ref < 1e-5
    for parts in (2, 3, 4, 8):
        grads = [
            _loss_and_grad(logits[a:b], targets[a:b], num_global_tokens=n)[1]
            for a, b in contiguous_splits(n, parts)
        ]
        assert_bitwise_equal(torch.cat(grads), grad, f"dlogits, {parts} micro-batches")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_equals_eager():
    """Forward and backward captured in a CUDA graph (no host sync inside) replay with new targets
    to the eager bits; a mean without num_global_tokens (a host-side count) refuses capture."""
    n, v = 4096, 32000
    logits, _ = _inputs(n, v, seed=3, device="cuda")
    static_x = logits.detach().clone().requires_grad_()
    static_t = torch.zeros(n, dtype=torch.int64, device="cuda")

    def step():
        static_x.grad = None
        loss = det_train.cross_entropy(static_x, static_t, num_global_tokens=2 * n)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    static_grad = static_x.grad
    for seed in (4, 5):
        _, targets = _inputs(n, v, seed=seed, device="cuda")
        targets[::7] = -100  # ignored tokens
        static_t.copy_(targets)
        graph.replay()
        loss, grad = _loss_and_grad(logits, targets, num_global_tokens=2 * n)
        assert_bitwise_equal(static_loss, loss, f"loss, replay with targets {seed}")
        assert_bitwise_equal(static_grad, grad, f"dlogits, replay with targets {seed}")
    with pytest.raises(RuntimeError, match="num_global_tokens"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        det_train.cross_entropy(static_x, static_t.clone())  # (the clone: not an empty graph)
