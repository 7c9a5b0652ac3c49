"""examples/bench_memory.py on CPU: its rows with a meter that sums the live tensors' bytes.

The GPU run reads the CUDA caching allocator; here ``live_bytes`` stands in for
``torch.cuda.memory_allocated`` (every tensor reachable from Python, parameters' ``.grad`` included),
so the readings at ``make_step``'s probe points can be checked against what must be live there.
"""

from __future__ import annotations

import gc

import pytest
import torch

from examples import bench_memory

bench_step = bench_memory.bench_step


def live_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach (and of parameters' grads)."""
    storages = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):
            continue
        tensors = [obj] + ([obj.grad] if isinstance(obj, torch.nn.Parameter) and obj.grad is not None else [])
        for t in tensors:
            if t.device.type == "meta":
                continue
            try:
                storage = t.untyped_storage()
                key = (storage.data_ptr(), t.device)
            except RuntimeError:  # a FakeTensor / FunctionalTensor another test's compilation left: no data
                continue
            storages[key] = storage.nbytes()
    return sum(storages.values())


class LiveMeter:
    """``bench_memory.Meter``'s counters over ``live_bytes``: the peak is the most read since a reset."""

    def __init__(self):
        self.top = 0

    def allocated(self) -> int:
        now = live_bytes()
        self.top = max(self.top, now)
        return now

    def peak(self) -> int:
        return max(self.top, self.allocated())

    def reset_peak(self) -> None:
        self.top = self.allocated()

    def meter(self) -> bench_memory.Meter:
        return bench_memory.Meter(self.allocated, self.peak, self.reset_peak, lambda: None, lambda: None)


def _tiny_configs():
    # 4 sequences of 8 tokens, leaves of 8 tokens: 4 leaves per step
    shape = dict(batch_seqs=4, seq_len=8, leaf_tokens=8, d_model=64, n_head=1, d_ff=64, n_layer=1)
    return bench_memory.model_configs("100m", preset="tiny", **shape)


def test_probe_points_and_state_dtype_of_make_step():
    """torch kernels (no interpreter): the probe's points in order, with the gradients each must see."""
    _, ref = _tiny_configs()
    seen, steps = [], []
    probe = lambda point: seen.append((point, _with_grad(steps[0].model)))  # noqa: E731
    steps.append(bench_step.make_step(ref, 2, "cpu", probe=probe))
    steps[0].run()
    n = len(list(steps[0].model.parameters()))
    assert seen == [("start", 0), ("backward", n), ("end", 0)]
    steps.clear()  # the probe refers to the step: a cycle that only gc would free
    with pytest.raises(ValueError, match="state_dtype is AdamWSR's option"):
        bench_step.make_step(ref, 2, "cpu", state_dtype=torch.bfloat16)


def _with_grad(model) -> int:
    return sum(p.grad is not None for p in model.parameters())


@pytest.mark.slow  # ~30 s on 2 cores: two steps per setup, det's through the interpreter
def test_memory_rows_read_what_each_point_holds():
    det, ref = _tiny_configs()
    counter = LiveMeter()
    rows = bench_memory.model_rows("tiny", det, ref, [2, 3], "cpu", counter.meter())  # 3 does not divide 4

    assert [(r["micro_batches"], r["optimizer"]) for r in rows] == [
        (2, bench_memory.TORCH),
        (2, bench_memory.TORCH_MAIN_GRAD),
        (2, bench_memory.DET_FP32),
        (2, bench_memory.DET_BF16),
        (2, bench_memory.DET_BF16_NOUNDO),
        (2, bench_memory.DET_BF16_ONE_LEAF),
    ]
    torch_row, main_grad, fp32, bf16, noundo, one_leaf = rows
    n = torch_row["n_params"]
    # torch with fp32 main grads: one fp32 buffer per parameter, as det with one leaf per step
    assert main_grad["grad_bytes_per_param"] == 4.0
    assert main_grad["peak_over_torch"] == main_grad["peak_gib"] / torch_row["peak_gib"] > 1
    assert main_grad["peak_over_torch_main_grad"] is None is torch_row["peak_over_torch_main_grad"]
    assert one_leaf["peak_over_torch_main_grad"] == one_leaf["peak_gib"] / main_grad["peak_gib"]
    # torch: the bf16 p.grad; det: after 4 leaves the canonical tree holds one fp32 node per element
    assert torch_row["grad_bytes_per_param"] == 2.0
    assert fp32["grad_bytes_per_param"] == bf16["grad_bytes_per_param"] == 4.0
    # recoverable=False: the same state at the end of the backward (micro-batches of whole leaves; this
    # meter samples at the probe points only, so the peaks, which differ inside the backward, are not
    # compared)
    assert noundo["grad_bytes_per_param"] == 4.0
    assert noundo["state_bytes_per_param"] == bf16["state_bytes_per_param"]
    # one leaf of the step's 32 tokens: one fp32 fold per element, the least any leaf size allows
    assert (noundo["leaf_tokens"], one_leaf["leaf_tokens"]) == (8, 32)
    assert one_leaf["grad_bytes_per_param"] == 4.0
    assert torch_row["reduce_peak_bytes_per_param"] is None
    assert fp32["reduce_peak_bytes_per_param"] >= fp32["grad_bytes_per_param"]
    # moments: 2 x fp32, 2 x bf16 (AdamWSR state_dtype=torch.bfloat16), torch's 2 x the bf16 params'
    # dtype; plus a few bytes of step counts per tensor
    assert int(fp32["state_bytes_per_param"]) == 8
    assert int(bf16["state_bytes_per_param"]) == int(torch_row["state_bytes_per_param"]) == 4
    assert torch_row["peak_over_torch"] is None
    assert fp32["peak_over_torch"] == fp32["peak_gib"] / torch_row["peak_gib"]
    assert fp32["peak_gib"] > bf16["peak_gib"] > torch_row["peak_gib"]
    # each row starts with the previous rows freed: less than one model's bf16 weights left over
    assert all(r["allocated_before_gib"] * bench_memory.GIB < 2 * n for r in rows)

    table = bench_memory.format_table(rows, "tiny")
    assert "| tiny | 2 | torch (fused AdamW) | 0.00 | - | - | 2.00 | - | 4.00 |" in table
    ratios = f"{bf16['peak_over_torch']:.2f}x | {bf16['peak_over_torch_main_grad']:.2f}x"
    assert f"| tiny | 2 | det, bf16 states | 0.00 | {ratios} | 4.00 |" in table


def test_setups_choose_the_rows():
    """``setups`` picks rows by key (no torch row: no peak ratio); an unknown key is refused."""
    det, ref = _tiny_configs()
    with pytest.raises(ValueError, match=r"setups \['det_bf16_undo'\] unknown"):
        bench_memory.model_rows("tiny", det, ref, [2], "cpu", LiveMeter().meter(), setups=["det_bf16_undo"])
    ref = bench_memory.dataclasses.replace(ref, micro_batch_seqs=2)
    row = bench_memory.measure_row(ref, 2, None, "cpu", LiveMeter().meter())
    assert row["grad_bytes_per_param"] == 2.0  # torch's bf16 p.grad
    assert list(bench_memory.SETUPS) == [
        "torch",
        "torch_main_grad",
        "det_fp32",
        "det_bf16",
        "det_bf16_noundo",
        "det_bf16_one_leaf",
    ]
    assert bench_memory.SETUPS["torch_main_grad"][1:] == ("torch", None, True, None, True)
    assert bench_memory.SETUPS["det_bf16_noundo"][1:] == ("det", torch.bfloat16, False, None, False)
    assert bench_memory.SETUPS["det_bf16_one_leaf"][1:] == ("det", torch.bfloat16, False, "step", False)


def test_torch_main_grad_sums_micro_batches_in_fp32():
    """``main_grad``: the torch step holds one fp32 buffer per parameter after the backward (4 B/param,
    ``p.grad`` None), its bf16 cast reaches the optimizer, and that gradient is the fp32 sum of the
    micro-batches' bf16 gradients rounded once (not autograd's bf16 running sum)."""
    det, ref = _tiny_configs()
    ref = bench_memory.dataclasses.replace(ref, micro_batch_seqs=1)
    row = bench_memory.measure_row(ref, 4, None, "cpu", LiveMeter().meter(), main_grad=True)
    assert row["grad_bytes_per_param"] == 4.0
    with pytest.raises(ValueError, match="main_grad is for torch kernels"):
        bench_step.make_step(det, 2, "cpu", main_grad=True)

    seen = {}
    step = bench_step.make_step(ref, 4, "cpu", main_grad=True)
    params = list(step.model.parameters())
    before = [p.detach().clone() for p in params]
    step.opt.step = lambda: seen.update(grads=[p.grad.clone() for p in params])  # the gradient it gets
    step.run()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))  # the optimizer never ran
    # the same micro-batches on a model without the hooks (same seed, same weights), each gradient
    # taken alone, summed in fp32 and rounded once
    plain = bench_step.make_step(ref, 4, "cpu").model
    assert all(torch.equal(p, b) for p, b in zip(plain.parameters(), before, strict=True))
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in plain.parameters()]
    for m in range(4):
        plain.zero_grad(set_to_none=True)
        plain(step.x[m : m + 1], step.y[m : m + 1], num_global_tokens=4 * ref.seq_len)[1].backward()
        for e, p in zip(expected, plain.parameters(), strict=True):
            e.add_(p.grad)
    for got, e in zip(seen["grads"], expected, strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, e.to(torch.bfloat16))
