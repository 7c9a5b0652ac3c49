"""tools/plot_benchmarks.py turns the recorded runs' JSON into the docs' figures and summary tables."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _load_plot():
    spec = importlib.util.spec_from_file_location(
        "plot_benchmarks_under_test", ROOT / "tools/plot_benchmarks.py"
    )
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    return plot, sys.modules["benchmark_records"]


def test_plots_of_one_run(tmp_path):
    plot, _ = _load_plot()
    results = ROOT / "docs/benchmarks/benchmarks.json"
    step = ROOT / "docs/benchmarks/main-job_train_step.json"
    assert plot.main([str(results), "--step", str(step), "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["bench_adamw.png", "bench_attention.png", "bench_matmul.png", "bench_step.png"]
    for p in tmp_path.glob("*.png"):
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000, p


def test_committed_summary_and_package_tables_are_what_the_script_writes():
    """The page cannot drift from the recorded runs: regenerate every block and compare."""
    _, records = _load_plot()
    runs = records.recorded_runs()
    for page, text in records.generated_pages(runs).items():
        assert page.read_text() == text, (
            f"{page.relative_to(ROOT)} is stale: python tools/plot_benchmarks.py --docs"
        )


def test_each_target_is_read_from_its_latest_run():
    _, records = _load_plot()
    runs = records.recorded_runs()
    assert [r.number for r in runs] == sorted((r.number for r in runs), reverse=True)
    summary = records.summary_markdown(runs)
    for target in records.TARGETS:
        m = records.latest(target, runs)
        assert m is not None, target.text
        # no newer run measured it
        assert all(target.read(r) is None for r in runs if r.number > m.run), target.text
        assert f"| {target.text} | {m.measured_text()} | {m.status()} | [{m.run}](#run-{m.run}) |" in summary
    # the matmul targets come from run 10's JSON, at its six shapes
    fwd = records.latest(next(t for t in records.TARGETS if t.text == "matmul forward >= 0.85x cuBLAS"), runs)
    assert (
        fwd.run == 10
        and len(fwd.values) == 6
        and fwd.sources == ["docs/benchmarks/run10/det-train_matmul.json"]
    )


def test_figures_come_from_the_latest_runs(tmp_path):
    plot, records = _load_plot()
    runs = records.recorded_runs()
    written = plot.plot_latest(runs, tmp_path)
    assert sorted(p.name for p in written) == [
        "bench_adamw.png",
        "bench_attention.png",
        "bench_matmul.png",
        "bench_step.png",
    ]
    for p in written:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000, p
    again = plot.plot_latest(runs, tmp_path / "again")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in written]  # deterministic
    page = (ROOT / "docs/benchmarks.md").read_text()
    for name, _, numbers in records.figure_runs(runs):
        assert f"(benchmarks/{name})" in page and all(f"(#run-{n})" in page for n in numbers)
