"""examples/step_costs.py and the host-time / launch columns of examples/bench_step.py's tables, on CPU.

The GPU runs these tables once: here their code runs with the GPU measurements replaced by stand-ins
(``measure``, ``eager_cost``, ``_time_compiled``), and the helpers run on the host."""

from __future__ import annotations

import argparse
import json
import sys
import types

import torch

from examples import bench_step

step_costs = sys.modules[bench_step.host_ms.__module__]  # the module bench_step uses (examples/ on sys.path)


def test_count_kernels_counts_kernel_events_only():
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "triton_poi_fused_add_0"},
            {"cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16"},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)"},
            {"cat": "gpu_memset", "name": "Memset (Device)"},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel"},
            {"cat": "cuda_driver", "name": "cuLaunchKernel"},
            {"cat": "gpu_user_annotation", "name": "ProfilerStep#1"},
            {"cat": "cpu_op", "name": "aten::mm"},
            {"ph": "M", "name": "process_name"},
            {"cat": "kernel", "name": "adamw_sr_kernel"},
        ]
    }
    assert step_costs.count_kernels(trace) == 3
    assert step_costs.count_kernels({}) == 0


def test_host_ms_is_the_median_of_the_calls_each_after_a_synchronize(monkeypatch):
    clock = iter([0.0, 0.004, 1.0, 1.001, 2.0, 2.009, 3.0, 3.002, 4.0, 4.003])  # 4, 1, 9, 2, 3 ms
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: next(clock))
    events = []
    got = step_costs.host_ms(
        lambda: events.append("step"), steps=5, synchronize=lambda: events.append("sync")
    )
    assert abs(got - 3.0) < 1e-9
    # every timed call starts on an idle device, and the device is idle again on return
    assert events == ["sync", "step"] * 5 + ["sync"]


def test_kernel_launches_profiles_one_call_on_the_host():
    calls = []
    x = torch.ones(8)
    assert step_costs.kernel_launches(lambda: calls.append(x.add(1)), device_type="cpu") == 0
    assert len(calls) == 1


def _args(tmp_path, **extra):
    return argparse.Namespace(
        **{"out": str(tmp_path), "warmup_ms": 1.0, "rep_ms": 1.0, "fixed_folds": False, **extra}
    )


def test_counts_table_has_host_and_launch_columns_measured_after_every_timed_row(tmp_path, monkeypatch):
    cfg = bench_step.tg.make_config("tiny", batch_seqs=4, micro_batch_seqs=2, seq_len=8, leaf_tokens=8)
    ref = bench_step.tg.make_config(
        "tiny", batch_seqs=4, micro_batch_seqs=2, seq_len=8, kernels="torch", optimizer="torch_adamw"
    )
    calls = []

    def measure(name, cfg, mode, args, backend):
        calls.append("measure")
        det = cfg.kernels == "det"
        if mode == bench_step.GRAPH and det and cfg.micro_batch_seqs == 1:
            return {"impl": name, "mode": mode, "ms_per_step": None, "tokens_per_s": None, "error": "boom"}
        ms = (12.0 if det else 10.0) if mode == bench_step.EAGER else (11.0 if det else 10.0)
        row = {"impl": name, "mode": mode, "ms_per_step": ms, "tokens_per_s": 1.0, "error": None}
        return row | ({"peak_gib": 3.0 if det else 2.0} if mode == bench_step.EAGER else {})

    def eager_cost(cfg, micro_batches, backend, cost):
        calls.append(cost.__name__)
        det = cfg.kernels == "det"
        if cost is step_costs.host_ms:
            return (3.5 if det else 2.5) * micro_batches
        return None if det and micro_batches == 4 else (1234 if det else 567) * micro_batches

    monkeypatch.setattr(bench_step, "measure", measure)
    monkeypatch.setattr(bench_step, "eager_cost", eager_cost)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    args = _args(
        tmp_path, counts="2,4", batch=4, graph=True, target_eager=1.15, target_graph=1.1, model_suffix=""
    )
    backend = types.SimpleNamespace(name="FLASH_ATTENTION")
    assert bench_step.counts_main(args, cfg, ref, 1000, backend) == 0

    # the costs after every timed row (nothing timed after the profiler), host times first
    assert calls == ["measure"] * 8 + ["host_ms"] * 4 + ["kernel_launches"] * 4
    md = (tmp_path / "main-job_train_step_counts.md").read_text()
    assert (
        "| det peak GiB | torch peak GiB | det host ms | torch host ms | det launches | torch launches |"
        in md
    )
    assert "| 2 | 12.0 | 10.0 | 1.20x | 11.0 | 10.0 | 1.10x | 3.00 | 2.00 | 7.0 | 5.0 | 2,468 | 1,134 |" in md
    assert "| 4 | 12.0 | 10.0 | 1.20x | - | 10.0 | - | 3.00 | 2.00 | 14.0 | 10.0 | - | 2,268 |" in md
    assert "Host ms: time.perf_counter" in md
    rows = json.loads((tmp_path / "main-job_train_step_counts.json").read_text())["rows"]
    eager = [
        (r["micro_batches"], r["impl"][:3], r["host_ms"], r["launches"]) for r in rows if r["mode"] == "eager"
    ]
    assert eager == [
        (2, "tor", 5.0, 1134),
        (2, "det", 7.0, 2468),
        (4, "tor", 10.0, 2268),
        (4, "det", 14.0, None),
    ]
    assert all("host_ms" not in r for r in rows if r["mode"] == bench_step.GRAPH)


def test_compile_table_has_host_and_launch_columns(tmp_path, monkeypatch):
    cfg = bench_step.tg.make_config("tiny", batch_seqs=4, micro_batch_seqs=2, seq_len=8, leaf_tokens=8)
    ref = bench_step.tg.make_config(
        "tiny", batch_seqs=4, micro_batch_seqs=2, seq_len=8, kernels="torch", optimizer="torch_adamw"
    )

    def time_compiled(name, cfg, micro_batches, compiled, args, backend):
        det = cfg.kernels == "det"
        mode = f"{bench_step.COMPILED if compiled else bench_step.EAGER}, {micro_batches} micro-batches"
        row = {"impl": name, "mode": mode, "micro_batches": micro_batches, "compiled": compiled}
        ms, host, launches = (
            (8.0, 4.0, 900) if det and compiled else (10.0, 6.0, 1500) if det else (5.0, 2.0, None)
        )
        return row | dict(
            ms_per_step=ms, tokens_per_s=1.0, error=None, graph_breaks=None, host_ms=host, launches=launches
        )

    monkeypatch.setattr(bench_step, "_time_compiled", time_compiled)
    monkeypatch.setattr(bench_step, "compiled_matches_eager", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    args = _args(
        tmp_path, compile_micro_batches="2", batch=4, compile_mode="default", allow_graph_breaks=False,
        bits_check=True, emulate_precision_casts=True, compile_warmup=3, cudagraph_mark="step",
    )  # fmt: skip
    assert bench_step.compile_main(args, cfg, ref, 1000, types.SimpleNamespace(name="FLASH_ATTENTION")) == 0

    md = (tmp_path / "main-job_train_step_compile.md").read_text()
    assert "| host ms / step | launches / step |\n|---|---|---|---|---|---|---|\n" in md
    assert "| det (ours) | torch.compile, 2 micro-batches | 8.0 | 1 | 1.60x | 4.0 | 900 |" in md
    assert "| det (ours) | eager, 2 micro-batches | 10.0 | 1 | 2.00x | 6.0 | 1,500 |" in md
    assert "| torch.compile, 2 micro-batches | 5.0 | 1 | 1.00x | 2.0 | - |" in md
    assert "every weight bitwise equal" in md
    assert "Both measured in each row after its timing." in md
