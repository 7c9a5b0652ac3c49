"""Plot the benchmark results (the JSON written by ``tools/run_benchmarks.py``) for the docs.

    python tools/plot_benchmarks.py docs/benchmarks/benchmarks.json \
        --step docs/benchmarks/main-job_train_step.json --out docs/benchmarks

Writes ``bench_adamw.png`` (optimizer step time over the bandwidth floor, ours and peers),
``bench_matmul.png`` (det_train TFLOP/s over cuBLAS for fwd / dX / dW per shape),
``bench_attention.png`` (det_attn time ratio to SDPA cuDNN, forward and forward+backward) and,
with ``--step``, ``bench_step.png`` (composed GPT step, ms per step, eager and CUDA graph). Every
bar is a ratio to a peer measured in the same run; dashed lines are the issue targets. Sections
missing from the JSON are skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _bars(ax, labels, series: dict[str, list[float]], ylabel: str, targets=()):
    """Grouped bars: one group per label, one bar per series; dashed target lines."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    for value, text in targets:
        ax.axhline(value, color="black", linestyle="--", linewidth=1)
        ax.annotate(text, (len(labels) - 0.5, value), ha="right", va="bottom", fontsize=8)
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


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="benchmarks.json from tools/run_benchmarks.py")
    parser.add_argument("--step", type=Path, default=None, help="main-job_train_step.json (bench_step.py)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    data = json.loads(args.results.read_text())
    env = data.get("environment", "")
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, plot in (
        ("adamw-sr_adamw", plot_adamw),
        ("det-train_matmul", plot_matmul),
        ("det-attn_attention", plot_attention),
    ):
        if key in data:
            written.append(plot(data[key], env, args.out))
    step = json.loads(args.step.read_text()) if args.step else data.get("main-job_train_step")
    if step:
        written.append(plot_step(step, args.out))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
