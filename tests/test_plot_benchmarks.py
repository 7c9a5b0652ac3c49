"""tools/plot_benchmarks.py turns the committed run's JSON into the docs' figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plots_of_the_committed_results(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "plot_benchmarks_under_test", ROOT / "tools/plot_benchmarks.py"
    )
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    results = ROOT / "docs/benchmarks/benchmarks.json"
    step = ROOT / "docs/benchmarks/main-job_train_step.json"
    assert plot.main([str(results), "--step", str(step), "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["bench_adamw.png", "bench_attention.png", "bench_matmul.png", "bench_step.png"]
    for p in tmp_path.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p
