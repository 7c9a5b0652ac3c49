"""The benchmark figures and the benchmarks page's summary, from the recorded runs.

Two uses:

    python tools/plot_benchmarks.py --docs            # regenerate the docs from docs/benchmarks/
    python tools/plot_benchmarks.py --docs --check    # exit 1 if a committed generated part is stale

With ``--docs`` every target is read from the **latest** run that measured it (the run folders
``docs/benchmarks/runNN/`` and run 5's ``docs/benchmarks/benchmarks.json``; the targets and the
tables are in ``tools/benchmark_records.py``). The script writes the "Summary of targets" and the
"Ratios without a target" tables and the figure list between the ``<!-- BEGIN GENERATED: ... -->``
markers of ``docs/benchmarks.md``, each package page's headline table between its markers, and
``docs/benchmarks/bench_{adamw,matmul,attention,step}.png``. The output depends only on the
recorded files (no dates, no environment): a rerun writes the same text and, with the same
matplotlib, the same PNG bytes.

    python tools/plot_benchmarks.py RESULTS.json [--step STEP.json] --out DIR

plots one run's JSON (what ``tools/run_benchmarks.py`` writes; ``nox -s bench`` calls this).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded from a file path
from benchmark_records import (  # noqa: E402
    BENCH,
    ROOT,
    Run,
    generated_pages,
    newest_run,
    recorded_runs,
    states_table,
    step_count_ratios,
)

# PNG metadata would otherwise carry matplotlib's version string: keep the files byte-stable
PNG_METADATA = {"Software": None}


# --------------------------------------------------------------------------------------------------
# figures


def _target_lines(ax, n_groups: int, targets) -> None:
    """Dashed lines at the targets, labels alternating right / left so that close ones do not overlap."""
    for i, (value, text) in enumerate(targets):
        ax.axhline(value, color="black", linestyle="--", linewidth=1)
        x, ha = (n_groups - 0.5, "right") if i % 2 == 0 else (-0.5, "left")
        ax.annotate(text, (x, value), ha=ha, va="bottom", fontsize=8)


def _bars(ax, labels, series: dict[str, list[float]], ylabel: str, targets=()):
    """Grouped bars: one group per label, one bar per series; dashed target lines."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    _target_lines(ax, len(labels), targets)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(series), 3))
    ax.grid(axis="y", alpha=0.3)


def plot_adamw(section: dict, env: str, out: Path) -> Path:
    rows = section["rows"]
    peers = {
        "ours step()": "ours_step_ms",
        "ours in CUDA graph": "ours_graphed_ms",
        "torch AdamW fp32 fused": "torch_fp32_fused_ms",
        "torch AdamW bf16 fused": "torch_bf16_fused_ms",
        "optimi bf16 Kahan": "optimi_bf16_kahan_ms",
    }
    series = {
        name: [r[key] / r["floor_ms"] if isinstance(r.get(key), (int, float)) else 0.0 for r in rows]
        for name, key in peers.items()
    }
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, [f"{r['case']}\n({r['tensors']} tensors)" for r in rows], series, "time / bandwidth floor",
          targets=[(1.10, "target 1.10x (602M)"), (1.5, "target 1.5x (small)")])  # fmt: skip
    ax.set_yscale("log")
    ax.set_title(f"AdamW step, bf16 params (floor = 22 B/param / copy bandwidth)\n{env}", fontsize=9)
    return _save(fig, out / "bench_adamw.png")


def plot_adamw_latest(run_states: Run, run_small: Run, out: Path) -> Path:
    """Left: the state formats on the 602 M set against their floors; right: 2,000 small tensors."""
    by_optimizer, shipped = states_table(run_states)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    names, ratios = [], []
    fp32 = by_optimizer.get("AdamWSR state_dtype fp32")
    if fp32:
        names.append("AdamWSR\nfp32 states")
        ratios.append(fp32["step_ms"] / fp32["floor_ms"])
    for dtype, label in (("bfloat16", "AdamWSR\nbf16 states"), ("8bit", "AdamWSR\n8-bit states")):
        if dtype in shipped:
            names.append(label)
            ratios.append(shipped[dtype]["ms"] / shipped[dtype]["floor_ms"])
    for optimizer, row in by_optimizer.items():
        if not optimizer.startswith("AdamWSR"):
            names.append(
                optimizer.replace(" AdamW", "\nAdamW")
                .replace(" fused", "\nfused")
                .replace(" Kahan", "\nKahan")
            )
            ratios.append(row["step_ms"] / row["floor_ms"])
    colors = ["tab:blue" if n.startswith("AdamWSR") else "tab:gray" for n in names]
    left.bar(range(len(names)), ratios, color=colors)
    left.set_xticks(range(len(names)))
    left.set_xticklabels(names, fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("step time / own bytes-moved floor")
    left.grid(axis="y", alpha=0.3)
    _target_lines(left, len(names), [(1.10, "fp32, bf16 target 1.10x"), (1.20, "8-bit target 1.20x")])
    left.set_title(
        f"602 M params, each optimizer against its own floor (run {run_states.number})", fontsize=9
    )
    row = next(r for r in run_small.load("adamw-sr_adamw.json")["rows"] if "2,000" in r["case"])
    labels = [
        "ours kernel",
        "ours step()\nCUDA graph",
        "ours step()\neager",
        "torch fp32\nfused",
        "torch bf16\nfused",
    ]
    keys = ["ours_kernel_ms", "ours_graphed_ms", "ours_step_ms", "torch_fp32_fused_ms", "torch_bf16_fused_ms"]
    right.bar(range(len(keys)), [row[k] / row["floor_ms"] for k in keys],
              color=["tab:blue"] * 3 + ["tab:gray"] * 2)  # fmt: skip
    right.set_xticks(range(len(keys)))
    right.set_xticklabels(labels, fontsize=7)
    right.set_yscale("log")
    _target_lines(right, len(keys), [(1.5, "target 1.5x")])
    right.grid(axis="y", alpha=0.3)
    right.set_title(f"2,000 small tensors, time / 22 B floor (run {run_small.number})", fontsize=9)
    fig.suptitle("AdamWSR step on an NVIDIA H200 (log scale; lower is better)", fontsize=10)
    return _save(fig, out / "bench_adamw.png")


def plot_matmul(section: dict, env: str, out: Path) -> Path:
    shapes = section["shapes"]
    labels = sorted(
        {f"{s['M']}x{s['K']}x{s['N']}" for s in shapes}, key=lambda t: [int(v) for v in t.split("x")]
    )
    series = {}
    for op in ("fwd", "dX", "dW"):
        by_shape = {f"{s['M']}x{s['K']}x{s['N']}": s["ratio_cublas"] for s in shapes if s["op"] == op}
        series[op] = [by_shape.get(label, 0.0) for label in labels]
    fig, ax = plt.subplots(figsize=(9, 4))
    _bars(ax, labels, series, "det_train / cuBLAS (TFLOP/s)",
          targets=[(0.85, "fwd target 0.85x"), (0.80, "dX, dW target 0.80x")])  # fmt: skip
    ax.set_title(f"Batch-invariant matmul (M x K x N, bf16) against cuBLAS\n{env}", fontsize=9)
    return _save(fig, out / "bench_matmul.png")


def plot_attention(section: dict, env: str, out: Path) -> Path:
    rows = section["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    by = {(r["shape"], r["method"]): r for r in rows}
    series = {"forward": [], "forward+backward": []}
    for shape in shapes:
        ours, cudnn = by.get((shape, "det_attn")), by.get((shape, "sdpa cuDNN"))
        ok = ours is not None and cudnn is not None
        series["forward"].append(cudnn["fwd_ms"] / ours["fwd_ms"] if ok else 0.0)
        series["forward+backward"].append(cudnn["fwdbwd_ms"] / ours["fwdbwd_ms"] if ok else 0.0)
    fig, ax = plt.subplots(figsize=(9, 4))
    _bars(ax, [s.replace(" causal", "\ncausal") for s in shapes], series, "det_attn speed / SDPA cuDNN",
          targets=[(0.80, "fwd target 0.80x"), (0.60, "fwd+bwd target 0.60x")])  # fmt: skip
    ax.set_title(f"Deterministic attention against SDPA cuDNN (bf16)\n{env}", fontsize=9)
    return _save(fig, out / "bench_attention.png")


def plot_step(step: dict, out: Path) -> Path:
    rows = [r for r in step["rows"] if isinstance(r.get("ms_per_step"), (int, float))]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    series = {
        impl: [
            next((r["ms_per_step"] for r in rows if r["impl"] == impl and r["mode"] == m), 0.0) for m in modes
        ]
        for impl in impls
    }
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(ax, modes, series, "ms per step (lower is better)")
    ax.set_title(step.get("title", "GPT train step").replace("**", ""), fontsize=8, wrap=True)
    return _save(fig, out / "bench_step.png")


def plot_step_counts(run: Run, out: Path) -> Path:
    """det / torch step time per micro-batch count, eager and in a CUDA graph, with the targets."""
    eager = step_count_ratios("eager")(run)[0]
    graph = dict(step_count_ratios("CUDA graph")(run)[0])
    labels = [label for label, _ in eager if label in graph]
    series = {
        "eager": [dict(eager)[label] for label in labels],
        "CUDA graph": [graph[label] for label in labels],
    }
    short = [label.replace(" micro-batches", " mb").replace("0.4 B model, ", "0.4 B\n") for label in labels]
    fig, ax = plt.subplots(figsize=(9, 4))
    _bars(ax, short, series, "det / torch step time (lower is better)",
          targets=[(1.15, "eager target 1.15x"), (1.10, "graph target 1.10x")])  # fmt: skip
    ax.set_title(
        f"Main job train step against torch's fastest parts, run {run.number}, NVIDIA H200\n"
        "100 M GPT, 32 x 1024 tokens; 0.4 B: 16 x 1024 tokens",
        fontsize=9,
    )
    return _save(fig, out / "bench_step.png")


def plot_latest(runs: list[Run], out: Path) -> list[Path]:
    """The docs figures, each from the newest run that measured it."""
    out.mkdir(parents=True, exist_ok=True)
    matmul = newest_run(runs, "det-train_matmul.json")
    attention = newest_run(runs, "det-attn_attention.json")
    return [
        plot_adamw_latest(
            newest_run(runs, "adamw-sr_states.json"), newest_run(runs, "adamw-sr_adamw.json", "2,000"), out
        ),
        plot_matmul(matmul.load("det-train_matmul.json"), f"NVIDIA H200, run {matmul.number}", out),
        plot_attention(
            attention.load("det-attn_attention.json"), f"NVIDIA H200, run {attention.number}", out
        ),
        plot_step_counts(newest_run(runs, "main-job_train_step_counts.json"), out),
    ]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------


def docs(check: bool, out: Path | None = None) -> int:
    """Write (or with ``check``, compare) the generated page blocks; write the figures to ``out``."""
    runs = recorded_runs()
    stale = []
    for page, text in generated_pages(runs).items():
        if page.read_text() != text:
            stale.append(page.relative_to(ROOT).as_posix())
            if not check:
                page.write_text(text)
    if check:
        if stale:
            print("stale generated blocks (run python tools/plot_benchmarks.py --docs):", ", ".join(stale))
            return 1
        return 0
    for path in plot_latest(runs, out or BENCH):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    for page in stale:
        print(f"updated {page}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", help="benchmarks.json from tools/run_benchmarks.py")
    parser.add_argument("--step", type=Path, default=None, help="main-job_train_step.json (bench_step.py)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the figures")
    parser.add_argument("--docs", action="store_true", help="regenerate the docs from docs/benchmarks/run*")
    parser.add_argument("--check", action="store_true", help="with --docs: only check the pages are current")
    args = parser.parse_args(argv)
    if args.docs:
        return docs(args.check, args.out)
    if args.results is None:
        parser.error("give RESULTS.json, or --docs")
    out = args.out or Path("docs/benchmarks")
    data = json.loads(args.results.read_text())
    env = data.get("environment", "")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, plot in (
        ("adamw-sr_adamw", plot_adamw),
        ("det-train_matmul", plot_matmul),
        ("det-attn_attention", plot_attention),
    ):
        if key in data:
            written.append(plot(data[key], env, out))
    step = json.loads(args.step.read_text()) if args.step else data.get("main-job_train_step")
    if step:
        written.append(plot_step(step, out))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
