"""End to end (GPU): the main job's training step captured in one CUDA graph, as
examples/bench_step.py times it (forward and backward of every micro-batch, the accumulator's
reduce, the optimizer step and zero_grad in one graph). The det step's replays give the bits of
the same steps run eagerly (capturable AdamWSR keeps its step count, which keys the rounding bits,
on the device); the torch reference step captures and trains."""

from __future__ import annotations

import math

import pytest
import torch
from det_core.testing import assert_bitwise_equal

from examples import bench_step


def _cfg(**overrides):
    # 2 layers of the GPU preset, 4 sequences of 1024 tokens in 2 micro-batches
    return bench_step.tg.make_config("gpu", batch_seqs=4, micro_batch_seqs=2, n_layer=2, **overrides)


def test_graph_ready_det_step_run_eagerly_keeps_the_bits():
    """CPU (interpreter): the step prepared for capture (gradients copied into static buffers;
    capturable AdamWSR only on CUDA, which CPU params refuse) gives the plain step's bits, 2 steps."""
    cfg = bench_step.tg.make_config("tiny", batch_seqs=4, micro_batch_seqs=2, seq_len=8, leaf_tokens=8)
    device = torch.device("cpu")
    plain, ready = bench_step.make_step(cfg, 2, device), bench_step.make_step(cfg, 2, device, graph=True)
    initial = {k: v.clone() for k, v in plain.model.state_dict().items()}
    for _ in range(2):
        plain.run()
        ready.run()
    got, want = ready.model.state_dict(), plain.model.state_dict()
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{name}, graph-ready vs plain step")
        assert not torch.equal(want[name], initial[name]), f"{name} did not change"


@pytest.mark.gpu
def test_gpu_captured_det_step_replays_to_the_eager_bits():
    cfg = _cfg()
    device = torch.device("cuda")
    eager = bench_step.make_step(cfg, 2, device)
    for _ in range(6):
        eager.run()
    captured = bench_step.make_step(cfg, 2, device, graph=True)
    replay = bench_step.graphed(captured, warmup=3)  # 3 eager warm-up steps and 1 checking replay
    replay()
    replay()
    torch.cuda.synchronize()
    got, want = captured.model.state_dict(), eager.model.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{name} after 6 steps, captured vs eager")


@pytest.mark.gpu
def test_gpu_captured_torch_reference_step_trains():
    from torch.nn.attention import sdpa_kernel

    cfg = _cfg(kernels="torch", optimizer="torch_adamw", rounding="nearest")
    with sdpa_kernel([bench_step._sdpa_backend()]):
        captured = bench_step.make_step(cfg, 2, torch.device("cuda"), graph=True)
        initial = {k: v.clone() for k, v in captured.model.state_dict().items()}
        replay = bench_step.graphed(captured, warmup=3)  # raises if a replay leaves the weights as they were
        replay()
        torch.cuda.synchronize()
    for name, value in captured.model.state_dict().items():
        assert math.isfinite(float(value.float().abs().max())), name
        if name.endswith("norm.weight"):
            # bf16 weights at 1.0 with round-to-nearest: an update of ~lr = 1e-3 is below half a
            # bf16 ULP (2**-8) and rounds away, the very loss stochastic rounding fixes
            continue
        assert not torch.equal(value, initial[name]), f"{name} did not change"
