"""The recorded benchmark runs, the speed targets, and the docs' generated tables.

A target's numbers are read from the **latest** run that measured it: the run folders
``docs/benchmarks/runNN/`` (raw JSON written by the benchmark scripts on the GPU) and run 5's
``docs/benchmarks/benchmarks.json`` (one section per benchmark) and ``main-job_train_step.json``.
``tools/plot_benchmarks.py --docs`` writes the tables made here into the pages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks"
SUMMARY_PAGE = ROOT / "docs" / "benchmarks.md"
PACKAGE_PAGES = {
    "adamw-sr": ROOT / "docs" / "adamw-sr.md",
    "det-train": ROOT / "docs" / "det-train.md",
    "det-attn": ROOT / "docs" / "det-attn.md",
    "main job": ROOT / "docs" / "main-job.md",
}
# run 5 predates the run folders
RUN5 = 5
# the launch config of the bf16 / 8-bit state kernels that shipped when the states ablation ran (run 13:
# tiles of 256 on 2 warps, masked sub-tiles of 64); a run without an ablation reads its state table
STATES_DEFAULT_CANDIDATE = "S6"


# --------------------------------------------------------------------------------------------------
# recorded runs


class Run:
    """One recorded run: ``number`` and its JSON files by name (run 5: benchmarks.json's sections)."""

    def __init__(self, number: int, files: dict[str, Path], sections: dict[str, dict] | None = None):
        self.number = number
        self._files = files
        self._sections = sections or {}

    def has(self, name: str) -> bool:
        return name in self._files or name in self._sections

    def load(self, name: str) -> dict:
        if name in self._sections:
            return self._sections[name]
        return json.loads(self._files[name].read_text())

    def source(self, name: str) -> str:
        """The repository path of ``name`` in this run."""
        if name in self._sections:
            return f"docs/benchmarks/benchmarks.json[{name.removesuffix('.json')}]"
        return self._files[name].relative_to(ROOT).as_posix()


def recorded_runs(bench: Path = BENCH) -> list[Run]:
    """Every run under ``bench``, newest first."""
    runs = []
    for folder in bench.glob("run*"):
        match = re.fullmatch(r"run(\d+)", folder.name)
        if match and folder.is_dir():
            runs.append(Run(int(match.group(1)), {p.name: p for p in folder.glob("*.json")}))
    combined = bench / "benchmarks.json"
    if combined.is_file():
        data = json.loads(combined.read_text())
        sections = {f"{k}.json": v for k, v in data.items() if isinstance(v, dict)}
        files = {p.name: p for p in [bench / "main-job_train_step.json"] if p.is_file()}
        runs.append(Run(RUN5, files, sections))
    return sorted(runs, key=lambda r: -r.number)


# --------------------------------------------------------------------------------------------------
# targets: what each is, where its numbers are, how they are read

Values = list[tuple[str, float]]  # (what was measured, ratio), in the order shown


@dataclass(frozen=True)
class Target:
    """A speed target and how to read it from a run.

    ``read(run)`` returns the measured ratios and the files they came from, or None when the run
    did not measure it; the latest run for which it does not return None is the one reported.
    A ratio passes when it is >= ``at_least`` or <= ``at_most``; neither: a ratio without a target.
    """

    package: str
    text: str
    read: Callable[[Run], tuple[Values, list[str]] | None]
    at_least: float | None = None
    at_most: float | None = None
    headline: bool = True  # shown on the package page
    cases: str = "shapes"  # what the measured values are, when there are many

    def passes(self, value: float) -> bool | None:
        if self.at_least is not None:
            return value >= self.at_least
        if self.at_most is not None:
            return value <= self.at_most
        return None


def _rows(run: Run, name: str, key: str = "rows") -> list[dict] | None:
    return run.load(name).get(key) if run.has(name) else None


def _shape(row: dict) -> str:
    return f"{row['M']}x{row['K']}x{row['N']}"


def _matmul(op: str, names: tuple[str, ...] = ("det-train_matmul.json",)):
    def read(run: Run):
        for name in names:
            rows = [r for r in (_rows(run, name, "shapes") or []) if r["op"] == op]
            if rows:
                return [(_shape(r), r["ratio_cublas"]) for r in rows], [run.source(name)]
        return None

    return read


def _attention(peer: str, column: str):
    def read(run: Run):
        rows = _rows(run, "det-attn_attention.json")
        if not rows:
            return None
        by = {(r["shape"], r["method"]): r for r in rows}
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        values = [
            (s.replace("B4 H32 ", ""), by[(s, peer)][column] / by[(s, "det_attn")][column])
            for s in shapes
            if (s, peer) in by and (s, "det_attn") in by
        ]
        return values, [run.source("det-attn_attention.json")]

    return read


def _adamw_case(case: str, value: Callable[[dict], Values]):
    """A row of bench_adamw.py's table (``adamw-sr_adamw.json``) whose case name contains ``case``."""

    def read(run: Run):
        rows = [r for r in (_rows(run, "adamw-sr_adamw.json") or []) if case in r["case"]]
        return (value(rows[0]), [run.source("adamw-sr_adamw.json")]) if rows else None

    return read


def states_table(run: Run) -> tuple[dict[str, dict], dict[str, dict]] | None:
    """The state-format table's rows by optimizer, and the shipped candidate's ablation rows."""
    rows = _rows(run, "adamw-sr_states.json")
    if not rows:
        return None
    by_optimizer = {r["optimizer"]: r for r in rows}
    shipped = {}
    if run.has("adamw-sr_states_ablation.json"):
        for case in run.load("adamw-sr_states_ablation.json")["cases"]:
            row = case["rows"].get(STATES_DEFAULT_CANDIDATE)
            if row:
                shipped[case["state_dtype"]] = {**row, "floor_ms": case["floor_ms"]}
    else:  # no ablation in this run: its state table's rows are the shipped config
        for dtype, label in (("bfloat16", "bf16 (SR)"), ("8bit", "8-bit (SR)")):
            row = by_optimizer.get(f"AdamWSR state_dtype {label}")
            if row and isinstance(row["step_ms"], float):
                shipped[dtype] = {"ms": row["step_ms"], "floor_ms": row["floor_ms"]}
    return by_optimizer, shipped


def _states_read(value: Callable[[dict[str, dict], dict[str, dict]], Values | None], ablation: bool):
    def read(run: Run):
        states = states_table(run)
        if states is None or (ablation and not states[1]):
            return None
        values = value(*states)
        sources = [run.source("adamw-sr_states.json")]
        if ablation and run.has("adamw-sr_states_ablation.json"):
            sources.append(run.source("adamw-sr_states_ablation.json"))
        return (values, sources) if values else None

    return read


def step_count_ratios(mode: str, with_two_only: bool = False):
    """det / torch step time per micro-batch count (bench_step.py --counts), both model widths."""

    def read(run: Run):
        values, sources = [], []
        for name, label in (
            ("main-job_train_step_counts.json", "{n} micro-batches"),
            ("main-job_train_step_counts_0.4b.json", "0.4 B model, {n} micro-batches"),
        ):
            rows = _rows(run, name)
            if not rows or (with_two_only and name.endswith("0.4b.json")):
                continue
            ms = {
                (r["impl"].split(" ")[0], r["micro_batches"]): r["ms_per_step"]
                for r in rows
                if r["mode"] == mode
            }
            counts = sorted({n for _, n in ms})
            for n in counts:
                if (with_two_only and n != 2) or ("det", n) not in ms or ("torch", n) not in ms:
                    continue
                values.append((label.format(n=n), ms[("det", n)] / ms[("torch", n)]))
            sources.append(run.source(name))
        return (values, sources) if values else None

    return read


def _composed_step(run: Run):
    """The main job's step at its default 2 micro-batches: det / torch, eager and CUDA graph."""
    counts = step_count_ratios("eager", with_two_only=True)(run)
    graph = step_count_ratios("CUDA graph", with_two_only=True)(run)
    if counts and graph:
        return [("eager", counts[0][0][1]), ("CUDA graph", graph[0][0][1])], counts[1]
    rows = _rows(run, "main-job_train_step.json")
    if not rows:
        return None
    ms = {(r["impl"].split(" ")[0], r["mode"]): r["ms_per_step"] for r in rows if r.get("ms_per_step")}
    modes = list(dict.fromkeys(mode for _, mode in ms))
    values = [
        (m, ms[("det", m)] / ms[("torch", m)]) for m in modes if ("det", m) in ms and ("torch", m) in ms
    ]
    return values, [run.source("main-job_train_step.json")]


def _norms(op: str, peer: str):
    def read(run: Run):
        rows = [r for r in (_rows(run, "det-train_norms.json") or []) if r["op"].startswith(op)]
        values = [
            (r["op"].split("(", 1)[1].rstrip(")").replace(" bf16", ""), r["peers"][peer]["peer_over_ours"])
            for r in rows
            if isinstance(r["peers"].get(peer, {}).get("peer_over_ours"), (int, float))
        ]
        return (values, [run.source("det-train_norms.json")]) if values else None

    return read


def _torch_fp32_over_ours(row: dict) -> Values:
    return [("torch / ours", row["torch_fp32_fused_ms"] / row["ours_step_ms"])]


OPTIMI = "optimi AdamW bf16 Kahan"
FP32_STATES = "AdamWSR state_dtype fp32"


def _fp32_over_floor(table: dict, shipped: dict) -> Values | None:
    row = table.get(FP32_STATES)
    return [("step()", row["step_ms"] / row["floor_ms"])] if row else None


def _optimi_over_fp32(table: dict, shipped: dict) -> Values | None:
    ok = OPTIMI in table and FP32_STATES in table
    return [("optimi / ours", table[OPTIMI]["step_ms"] / table[FP32_STATES]["step_ms"])] if ok else None


def _shipped_over_floor(dtype: str):
    def value(table: dict, shipped: dict) -> Values | None:
        row = shipped.get(dtype)
        return [("step()", row["ms"] / row["floor_ms"])] if row else None

    return value


def _optimi_over_bf16(table: dict, shipped: dict) -> Values | None:
    ok = OPTIMI in table and "bfloat16" in shipped
    return [("optimi / ours", table[OPTIMI]["step_ms"] / shipped["bfloat16"]["ms"])] if ok else None


def _int8_over_fp32(table: dict, shipped: dict) -> Values | None:
    ok = "8bit" in shipped and FP32_STATES in table
    return [("8-bit / fp32", shipped["8bit"]["ms"] / table[FP32_STATES]["step_ms"])] if ok else None


def _int8_peers_over_ours(table: dict, shipped: dict) -> Values | None:
    if "8bit" not in shipped:
        return None
    peers = ("bitsandbytes AdamW8bit", "torchao AdamW8bit")
    return [
        (f"{k.split()[0]} / ours", table[k]["step_ms"] / shipped["8bit"]["ms"]) for k in peers if k in table
    ]


def peak_memory_ratios(optimizer: str, peer: str = "torch (fused AdamW)"):
    """det / ``peer`` peak memory per model and micro-batch count (examples/bench_memory.py; the
    peer's exact setup name: torch with bf16 ``p.grad``, or ``"torch (fused AdamW), fp32 main
    grads"``)."""

    def read(run: Run):
        rows = _rows(run, "main-job_memory.json")
        if not rows:
            return None
        torch_peak = {(r["model"], r["micro_batches"]): r["peak_gib"] for r in rows if r["optimizer"] == peer}
        values = [
            (
                f"{r['model']}, {r['micro_batches']} micro-batches",
                r["peak_gib"] / torch_peak[(r["model"], r["micro_batches"])],
            )
            for r in rows
            if r["optimizer"] == optimizer and (r["model"], r["micro_batches"]) in torch_peak
        ]
        return (values, [run.source("main-job_memory.json")]) if values else None

    return read


# fmt: off
_ONE_LEAF = "det, bf16 states, recoverable=False, one leaf per step"
_MAIN_GRAD = "torch (fused AdamW), fp32 main grads"

TARGETS: list[Target] = [
    Target("adamw-sr", "602 M params, fp32 states: step <= 1.10x the 22 B/param floor",
           _states_read(_fp32_over_floor, ablation=False), at_most=1.10),
    Target("adamw-sr", "602 M params, fp32 states: faster than optimi's bf16 Kahan AdamW",
           _states_read(_optimi_over_fp32, ablation=False), at_least=1.0),
    Target("adamw-sr", "602 M params: >= 1.5x faster than torch's fused AdamW on fp32 params",
           _adamw_case("602M", _torch_fp32_over_ours), at_least=1.5),
    Target("adamw-sr", "2,000 small tensors: step <= 1.5x the floor",
           _adamw_case("2,000 small", lambda r: [
               ("kernel", r["ours_kernel_ms"] / r["floor_ms"]),
               ("`step()` in a CUDA graph", r["ours_graphed_ms"] / r["floor_ms"]),
               ("eager `step()`", r["ours_step_ms"] / r["floor_ms"]),
           ]), at_most=1.5),
    Target("adamw-sr", "2,000 small tensors: eager `step()` no slower than torch's fused AdamW",
           _adamw_case("2,000 small", _torch_fp32_over_ours), at_least=1.0),
    Target("adamw-sr", "bf16 states: step <= 1.10x their 14 B/param floor",
           _states_read(_shipped_over_floor("bfloat16"), ablation=True), at_most=1.10),
    Target("adamw-sr", "bf16 states: >= 1.25x faster than optimi's bf16 Kahan AdamW",
           _states_read(_optimi_over_bf16, ablation=True), at_least=1.25),
    Target("adamw-sr", "8-bit states: step <= 1.20x their 10.125 B/param floor",
           _states_read(_shipped_over_floor("8bit"), ablation=True), at_most=1.20),
    Target("adamw-sr", "8-bit states: faster than bitsandbytes' and torchao's AdamW8bit",
           _states_read(_int8_peers_over_ours, ablation=True), at_least=1.0),
    Target("adamw-sr", "8-bit states: step <= 0.85x the fp32-state step",
           _states_read(_int8_over_fp32, ablation=True), at_most=0.85),
    Target("det-train", "matmul forward >= 0.85x cuBLAS", _matmul("fwd"), at_least=0.85),
    Target("det-train", "matmul dX >= 0.80x cuBLAS", _matmul("dX"), at_least=0.80),
    Target("det-train", "matmul dW >= 0.80x cuBLAS (default 8192-token leaves)", _matmul("dW"),
           at_least=0.80),
    Target("det-train", "dW through the accumulator in 8 micro-batches >= 0.90x cuBLAS",
           _matmul("dW 8mb", ("det-train_matmul_dW8mb_after.json", "det-train_matmul_dW8mb.json")),
           at_least=0.90),
    Target("det-attn", "forward >= 0.80x SDPA cuDNN", _attention("sdpa cuDNN", "fwd_ms"), at_least=0.80),
    Target("det-attn", "forward+backward >= 0.60x SDPA cuDNN", _attention("sdpa cuDNN", "fwdbwd_ms"),
           at_least=0.60),
    Target("det-attn", "forward+backward >= 2x SDPA efficient (torch's deterministic-capable backend)",
           _attention("sdpa efficient", "fwdbwd_ms"), at_least=2.0),
    Target("main job", "train step at 2 micro-batches <= 1.2x torch's (time ratio)", _composed_step,
           at_most=1.2),
    Target("main job", "train step in a CUDA graph <= 1.10x torch's at every micro-batch count",
           step_count_ratios("CUDA graph"), at_most=1.10, cases="counts and widths"),
    Target("main job", "eager train step <= 1.15x torch's at every micro-batch count",
           step_count_ratios("eager"), at_most=1.15, cases="counts and widths"),
    Target("main job", "peak memory, det with bf16 states / torch (bf16 fused AdamW) <= 1.15x",
           peak_memory_ratios("det, bf16 states"), at_most=1.15, cases="counts and widths"),
    Target("main job",
           "peak memory, det at one fp32 buffer per parameter (one leaf per step) / torch <= 1.15x",
           peak_memory_ratios(_ONE_LEAF), at_most=1.15, cases="counts and widths"),
    Target("main job",
           "peak memory, det at one fp32 buffer per parameter / torch with fp32 main grads <= 1.15x",
           peak_memory_ratios(_ONE_LEAF, _MAIN_GRAD), at_most=1.15, cases="counts and widths"),
]
# fmt: on

# ratios without a target, shown under the summary (peer time / ours: above 1, ours is faster)
OTHER_RATIOS: list[Target] = [
    Target("det-train", "RMSNorm forward+backward, torch / ours", _norms("RMSNorm", "torch")),
    Target(
        "det-train",
        "cross-entropy forward+backward, torch (fp32 upcast) / ours",
        _norms("cross-entropy", "torch (fp32 upcast)"),
    ),
    Target("det-train", "embedding backward, torch / ours", _norms("embedding", "torch")),
    Target("det-attn", "forward+backward, SDPA flash / ours", _attention("sdpa flash", "fwdbwd_ms")),
]


@dataclass(frozen=True)
class Measured:
    target: Target
    run: int
    values: Values
    sources: list[str]

    def measured_text(self) -> str:
        """One value as is, up to three by name, more as their range (the misses are in the status)."""
        if len(self.values) == 1:
            return f"{self.values[0][1]:.2f}x"
        if len(self.values) <= 3:
            return "; ".join(f"{label} {value:.2f}x" for label, value in self.values)
        ratios = [value for _, value in self.values]
        return f"{min(ratios):.2f}-{max(ratios):.2f}x ({len(ratios)} {self.target.cases})"

    def status(self) -> str:
        verdicts = [self.target.passes(v) for _, v in self.values]
        if verdicts[0] is None:
            return "(no target)"
        if all(verdicts):
            return "**met**" if len(verdicts) == 1 else f"**met** ({len(verdicts)} of {len(verdicts)})"
        missed = [
            f"{label} ({value:.2f}x)"
            for (label, value), ok in zip(self.values, verdicts, strict=True)
            if not ok
        ]
        if not any(verdicts):
            return "**NOT met**"
        return f"met at {sum(verdicts)} of {len(verdicts)}; **NOT met**: {', '.join(missed)}"


def latest(target: Target, runs: list[Run]) -> Measured | None:
    """``target`` as measured by the newest run that has it."""
    for run in runs:
        found = target.read(run)
        if found:
            return Measured(target, run.number, *found)
    return None


def newest_run(runs: list[Run], name: str, case: str | None = None) -> Run:
    """The newest run with the file ``name`` (and, given ``case``, a row whose case contains it)."""
    for run in runs:
        if run.has(name) and (case is None or any(case in r["case"] for r in run.load(name)["rows"])):
            return run
    raise FileNotFoundError(f"no recorded run has {name}")


# --------------------------------------------------------------------------------------------------
# generated markdown


def figure_runs(runs: list[Run]) -> list[tuple[str, str, list[int]]]:
    """(file, caption, runs drawn) of each docs figure, each from the newest run with its data."""
    states = newest_run(runs, "adamw-sr_states.json").number
    small = newest_run(runs, "adamw-sr_adamw.json", "2,000").number
    return [
        ("bench_adamw.png", "AdamWSR step over its bytes-moved floor: state formats on 602 M params, "
         "and 2,000 small tensors", [states, small]),
        ("bench_matmul.png", "det_train matmul TFLOP/s over cuBLAS, forward / dX / dW",
         [newest_run(runs, "det-train_matmul.json").number]),
        ("bench_attention.png", "det_attn speed over SDPA cuDNN, forward and forward+backward",
         [newest_run(runs, "det-attn_attention.json").number]),
        ("bench_step.png", "Main job step time over torch's, eager and in a CUDA graph, by micro-batch count",
         [newest_run(runs, "main-job_train_step_counts.json").number]),
    ]  # fmt: skip


def _run_link(number: int, page: str = "") -> str:
    return f"[{number}]({page}#run-{number})"


def summary_markdown(runs: list[Run]) -> str:
    """The benchmarks page's summary: every target at its latest run, and the untargeted ratios."""
    lines = [
        "| package | target | latest measured | status | run | source |",
        "|---|---|---|---|---|---|",
    ]
    for target in TARGETS:
        m = latest(target, runs)
        if m is None:
            lines.append(f"| {target.package} | {target.text} | not measured | — | — | — |")
            continue
        sources = "<br>".join(f"`{s}`" for s in m.sources)
        lines.append(
            f"| {target.package} | {target.text} | {m.measured_text()} | {m.status()} | "
            f"{_run_link(m.run)} | {sources} |"
        )
    lines += ["", "Ratios without a target (peer time / ours: above 1, ours is faster):", ""]
    lines += ["| package | ratio | latest measured | run | source |", "|---|---|---|---|---|"]
    for target in OTHER_RATIOS:
        m = latest(target, runs)
        if m is not None:
            sources = "<br>".join(f"`{s}`" for s in m.sources)
            lines.append(
                f"| {target.package} | {target.text} | {m.measured_text()} | {_run_link(m.run)} | {sources} |"
            )
    return "\n".join(lines) + "\n"


def package_markdown(package: str, runs: list[Run]) -> str:
    """A package page's headline table: its targets at their latest runs, one link to the details."""
    lines = ["| target | latest measured | status |", "|---|---|---|"]
    for target in TARGETS:
        if target.package != package or not target.headline:
            continue
        m = latest(target, runs)
        if m is not None:
            lines.append(f"| {target.text} | {m.measured_text()} | {m.status()} |")
    others = [t for t in OTHER_RATIOS if t.package == package]
    if others:
        lines += ["", "| ratio without a target (peer time / ours) | latest measured |", "|---|---|"]
        for target in others:
            m = latest(target, runs)
            if m is not None:
                lines.append(f"| {target.text} | {m.measured_text()} |")
    lines += [
        "",
        "Ratios to the peer measured side by side in the same process (an NVIDIA H200 unless the run "
        "says otherwise); which run, its GPU, the raw files and every earlier measurement: "
        "[Benchmarks](benchmarks.md#summary-of-targets).",
    ]
    return "\n".join(lines) + "\n"


def figures_markdown(runs: list[Run]) -> str:
    """The figure block of the benchmarks page, each caption naming the run it draws."""
    lines = []
    for name, caption, numbers in figure_runs(runs):
        which = " and ".join(f"run {_run_link(n)}" for n in numbers)
        lines += [f"![{caption}](benchmarks/{name})", "", f"*{caption}: {which}.*", ""]
    return "\n".join(lines)


BEGIN = "<!-- BEGIN GENERATED: {name} (tools/plot_benchmarks.py --docs; do not edit by hand) -->"
END = "<!-- END GENERATED: {name} -->"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the generated block ``name`` replaced by ``body``; the markers must exist."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"the page has no generated block {name!r}: add the lines\n{begin}\n{end}")
    return text[: start + len(begin)] + "\n" + body + text[stop:]


def generated_pages(runs: list[Run]) -> dict[Path, str]:
    """Every page with a generated block, as the script would write it."""
    pages = {}
    text = SUMMARY_PAGE.read_text()
    text = replace_block(text, "summary", summary_markdown(runs))
    text = replace_block(text, "figures", figures_markdown(runs))
    pages[SUMMARY_PAGE] = text
    for package, page in PACKAGE_PAGES.items():
        pages[page] = replace_block(page.read_text(), "targets", package_markdown(package, runs))
    return pages
