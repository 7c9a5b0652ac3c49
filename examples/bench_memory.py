"""Benchmark (GPU): memory of one training step of the main job's GPT, deterministic vs torch.

    python examples/bench_memory.py --out docs/benchmarks
    python examples/bench_memory.py --models 100m --counts 2,32
    python examples/bench_memory.py --models 0.4b --counts 16 --setups det_bf16,det_bf16_noundo

The step is examples/bench_step.py's eager step (``make_step``: the same models, batch, micro-batch
loop and optimizers), for each model (``100m``: the gpu preset at batch 32; ``0.4b``: bench_step.py's
0.4 B width at batch 16), each micro-batch count of ``--counts`` that divides the batch, and the
setups of ``--setups`` (default all six): **torch** (``torch``: fused ``torch.optim.AdamW``, its
moments take the bf16 params' dtype, micro-batches summed into bf16 ``p.grad`` by autograd), **torch,
fp32 main grads** (``torch_main_grad``: the same optimizer, micro-batches summed into one fp32 buffer
per parameter, Megatron-LM's "main grad", cast into bf16 ``p.grad`` before the step: what a torch user
who accumulates in fp32 holds), **det, fp32 states** (``det_fp32``: AdamWSR's default
moments), **det, bf16 states** (``det_bf16``: AdamWSR with ``state_dtype=torch.bfloat16``, torch's
optimizer-state bytes) and **det, bf16 states, recoverable=False** (``det_bf16_noundo``: the same,
with ``CanonicalGradAccumulator(..., recoverable=False)``, no undo log: open folds continued in
place, the canonical tree's least gradient memory, the same bits) and **det, bf16 states, one leaf per
step** (``det_bf16_one_leaf``: the same with ``leaf_tokens`` equal to the step's tokens, so ``L = 1``
and the gradient path holds one fp32 buffer per parameter, Megatron's "main grad": the least any
leaf size allows, for a process that is not data parallel; its bits differ from the other det rows',
since ``leaf_tokens`` is part of the order). Each row runs one warm-up step, then
one measured step, reading the CUDA caching allocator (``torch.cuda.memory_allocated`` and
``max_memory_allocated``) at the step's points (``make_step``'s ``probe``):

* **peak GiB**: the most allocated at any time in the measured step (weights, optimizer state,
  gradients, activations, the accumulator's state);
* **peak / torch's**: a det setup's peak over torch's at the same model and count;
* **gradient path B/param**: allocated right after the last micro-batch's backward minus allocated
  before the first micro-batch (weights, optimizer state and batch; ``p.grad`` None), per parameter:
  torch's bf16 ``p.grad``; det's accumulator state carried to ``reduce`` (fp32 partial sums);
* **reduce peak B/param** (det; torch with main grads): the peak during ``acc.reduce`` (the main
  grads' cast into ``p.grad``; peak counter reset right before it) minus the same pre-step baseline,
  per parameter;
* **optimizer state B/param**: the optimizer's state tensors after the step, per parameter.

No timing: each row is two steps. Writes ``DIR/main-job_memory.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402
import train_gpt as tg  # noqa: E402  (the package sources come from PYTHONPATH: nox -s bench)

TORCH, DET_FP32, DET_BF16 = "torch (fused AdamW)", "det, fp32 states", "det, bf16 states"
TORCH_MAIN_GRAD = "torch (fused AdamW), fp32 main grads"
DET_BF16_NOUNDO = "det, bf16 states, recoverable=False"
DET_BF16_ONE_LEAF = "det, bf16 states, recoverable=False, one leaf per step"
# --setups key -> (row name, kernels, AdamWSR state_dtype, the accumulator's recoverable,
# leaf_tokens: None keeps the config's, "step" is the step's tokens, one leaf; torch's fp32 main grads)
SETUPS = {
    "torch": (TORCH, "torch", None, True, None, False),
    "torch_main_grad": (TORCH_MAIN_GRAD, "torch", None, True, None, True),
    "det_fp32": (DET_FP32, "det", None, True, None, False),
    "det_bf16": (DET_BF16, "det", torch.bfloat16, True, None, False),
    "det_bf16_noundo": (DET_BF16_NOUNDO, "det", torch.bfloat16, False, None, False),
    "det_bf16_one_leaf": (DET_BF16_ONE_LEAF, "det", torch.bfloat16, False, "step", False),
}
BATCH = {"100m": 32, "0.4b": 16}  # global batch in sequences of 1024 tokens, per --models entry
GIB = 2**30


@dataclasses.dataclass
class Meter:
    """The allocator counters a row reads, in bytes: ``cuda_meter()``; the CPU tests pass stand-ins."""

    allocated: Callable[[], int]
    peak: Callable[[], int]
    reset_peak: Callable[[], None]
    synchronize: Callable[[], None]
    empty_cache: Callable[[], None]


def cuda_meter() -> Meter:
    """The CUDA caching allocator's counters of the current device."""
    return Meter(
        torch.cuda.memory_allocated,
        torch.cuda.max_memory_allocated,
        torch.cuda.reset_peak_memory_stats,
        torch.cuda.synchronize,
        torch.cuda.empty_cache,
    )


class StepReadings:
    """``make_step``'s probe: the meter's readings at a step's points, in ``values`` (bytes).

    ``base`` (allocated at ``"start"``), ``after_backward`` and ``peak_to_backward`` (at
    ``"backward"``, where the peak counter is then reset), ``peak_reduce`` (det, at ``"reduced"``).
    """

    def __init__(self, meter: Meter):
        self.meter = meter
        self.values: dict[str, int] = {}

    def __call__(self, point: str) -> None:
        meter = self.meter
        if point == "start":
            self.values["base"] = meter.allocated()
        elif point == "backward":
            self.values.update(after_backward=meter.allocated(), peak_to_backward=meter.peak())
            meter.reset_peak()  # from here: the peak of the reduce (det) and of the optimizer
        elif point == "reduced":
            self.values["peak_reduce"] = meter.peak()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt.state`` (moments, step counts, any extra state)."""
    return sum(
        t.nbytes for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    )


def measure_row(
    cfg: tg.TrainConfig,
    micro_batches: int,
    state_dtype,
    device,
    meter: Meter,
    recoverable: bool = True,
    main_grad: bool = False,
) -> dict:
    """One warm-up step, then the readings of one step of ``cfg`` in ``micro_batches`` micro-batches
    (``recoverable``: the det accumulator's; ``main_grad``: torch's fp32 main grads; ``make_step``'s).

    Returns ``peak_gib``, ``grad_bytes_per_param``, ``reduce_peak_bytes_per_param`` (None without
    an accumulator), ``state_bytes_per_param``, ``baseline_gib`` and ``n_params``.
    """
    readings = StepReadings(meter)
    s = bench_step.make_step(
        cfg,
        micro_batches,
        device,
        state_dtype=state_dtype,
        probe=readings,
        recoverable=recoverable,
        main_grad=main_grad,
    )
    s.run()  # optimizer states, kernel compilation, launch caches
    meter.synchronize()
    meter.reset_peak()
    readings.values.clear()
    s.run()
    meter.synchronize()
    v = readings.values
    n = sum(p.numel() for p in s.model.parameters())
    reduce_peak = v.get("peak_reduce")  # det's reduce, or the main grads' cast into p.grad
    return {
        "peak_gib": max(v["peak_to_backward"], meter.peak()) / GIB,
        "grad_bytes_per_param": (v["after_backward"] - v["base"]) / n,
        "reduce_peak_bytes_per_param": None if reduce_peak is None else (reduce_peak - v["base"]) / n,
        "state_bytes_per_param": state_bytes(s.opt) / n,
        "baseline_gib": v["base"] / GIB,
        "n_params": n,
    }


def model_configs(model: str, preset: str = "gpu", **overrides) -> tuple[tg.TrainConfig, tg.TrainConfig]:
    """(det, torch) configs of ``model`` (a bench_step.py ``--model``) at its batch of ``BATCH``."""
    shape = dict(batch_seqs=BATCH[model], micro_batch_seqs=BATCH[model], **bench_step.MODELS[model])
    shape.update(overrides)
    det = tg.make_config(preset, **shape)
    ref = tg.make_config(preset, kernels="torch", optimizer="torch_adamw", rounding="nearest", **shape)
    return det, ref


def model_rows(
    model: str, det_cfg, torch_cfg, counts: list[int], device, meter: Meter, torch_context=None, setups=None
) -> list[dict]:
    """The rows of one model: per micro-batch count dividing the batch, one per setup of ``setups``
    (``SETUPS`` keys, in that order; default all). ``peak_over_torch``: a row's peak over the
    torch row of its count (None without one); ``peak_over_torch_main_grad``: a det row's peak over
    the torch row with fp32 main grads (None without one).

    ``torch_context`` (a no-argument callable giving a context manager) surrounds torch's rows (the
    benchmark's SDPA backend). Each row starts after ``gc.collect()`` and ``empty_cache()``: the
    previous row's step is gone; ``allocated_before_gib`` shows what was still allocated then.
    """
    setups = list(SETUPS) if setups is None else setups
    unknown = [k for k in setups if k not in SETUPS]
    if unknown:
        raise ValueError(f"setups {unknown} unknown; choose among {', '.join(SETUPS)}")
    rows = []
    for mb in counts:
        if det_cfg.batch_seqs % mb:
            print(f"{model}: {mb} micro-batches skipped (batch of {det_cfg.batch_seqs})", flush=True)
            continue
        group = []
        for key in setups:
            name, kernels, state_dtype, recoverable, leaf_tokens, main_grad = SETUPS[key]
            cfg = torch_cfg if kernels == "torch" else det_cfg
            cfg = dataclasses.replace(cfg, micro_batch_seqs=cfg.batch_seqs // mb)
            if leaf_tokens == "step":
                cfg = dataclasses.replace(cfg, leaf_tokens=cfg.batch_seqs * cfg.seq_len)
            gc.collect()  # the previous row's step (model, optimizer, accumulator) went with its frame
            meter.empty_cache()
            row = {"model": model, "micro_batches": mb, "optimizer": name, "leaf_tokens": cfg.leaf_tokens}
            row["allocated_before_gib"] = meter.allocated() / GIB
            use_torch_context = torch_context is not None and cfg.kernels == "torch"
            with torch_context() if use_torch_context else contextlib.nullcontext():
                row.update(measure_row(cfg, mb, state_dtype, device, meter, recoverable, main_grad))
            print(f"{model}, {mb} micro-batches, {name}: {row}", flush=True)
            group.append(row)
        ref = next((r for r in group if r["optimizer"] == TORCH), None)
        ref_main = next((r for r in group if r["optimizer"] == TORCH_MAIN_GRAD), None)
        for row in group:
            row["peak_over_torch"] = None if ref is None or row is ref else row["peak_gib"] / ref["peak_gib"]
            det_row = row is not ref and row is not ref_main
            row["peak_over_torch_main_grad"] = (
                row["peak_gib"] / ref_main["peak_gib"] if ref_main is not None and det_row else None
            )
        rows += group
    return rows


def format_table(rows: list[dict], title: str) -> str:
    """The markdown table of ``rows`` (``model_rows``), with the title and the columns' definitions."""
    lines = [
        f"**{title}**",
        "",
        "| model | micro-batches | optimizer | peak GiB | peak / torch's | peak / torch fp32 main grads' "
        "| gradient path B/param | reduce peak B/param | optimizer state B/param |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r["peak_over_torch"] is None else f"{r['peak_over_torch']:.2f}x"
        main = r.get("peak_over_torch_main_grad")
        ratio_main = "-" if main is None else f"{main:.2f}x"
        reduce = r["reduce_peak_bytes_per_param"]
        lines.append(
            f"| {r['model']} | {r['micro_batches']} | {r['optimizer']} | {r['peak_gib']:.2f} "
            f"| {ratio} | {ratio_main} "
            f"| {r['grad_bytes_per_param']:.2f} | {'-' if reduce is None else f'{reduce:.2f}'} "
            f"| {r['state_bytes_per_param']:.2f} |"
        )
    lines += [
        "",
        "One eager step after one warm-up step, read from the CUDA caching allocator. Peak: "
        "max_memory_allocated over the step. Gradient path: memory_allocated after the last micro-batch's "
        "backward minus before the first (weights, optimizer state, batch; p.grad None), per parameter: "
        "torch's bf16 p.grad (fp32 main grads: the fp32 buffers), det's accumulator state carried to "
        "reduce. Reduce peak (det; torch with fp32 main grads: their cast into p.grad): "
        "max_memory_allocated during acc.reduce (reset right before it) minus the same baseline, per "
        "parameter. Optimizer state: the optimizer's state tensors per parameter (torch's AdamW moments "
        "take the bf16 params' dtype; det's bf16 states: AdamWSR state_dtype=torch.bfloat16; "
        "recoverable=False: CanonicalGradAccumulator without its undo log; one leaf per step: leaf_tokens "
        "equal to the step's tokens).",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for main-job_memory.md/.json")
    p.add_argument("--models", default="100m,0.4b", help="bench_step.py --model values (100m, 0.4b)")
    p.add_argument("--counts", default="2,8,16,32", help="micro-batch counts (those dividing the batch)")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"rows per count, of: {', '.join(SETUPS)}")
    args = p.parse_args(argv)
    models, setups = args.models.split(","), args.setups.split(",")
    if set(models) - set(BATCH):
        p.error(f"--models takes {', '.join(BATCH)}, got {args.models!r}")
    if set(setups) - set(SETUPS):
        p.error(f"--setups takes {', '.join(SETUPS)}, got {args.setups!r}")
    if not torch.cuda.is_available():
        print("bench_memory.py needs a CUDA GPU (the CPU tests run its parts)")
        return 1
    from torch.nn.attention import sdpa_kernel

    backend = bench_step._sdpa_backend()
    counts = [int(c) for c in args.counts.split(",")]
    rows, configs = [], {}
    for model in models:
        det_cfg, torch_cfg = model_configs(model)
        configs[model] = vars(det_cfg)
        torch_context = lambda: sdpa_kernel([backend])  # noqa: E731
        rows += model_rows(
            model, det_cfg, torch_cfg, counts, torch.device("cuda"), cuda_meter(), torch_context, setups
        )
    device = torch.cuda.get_device_name()
    batches = ", ".join(f"{m}: batch {BATCH[m]}" for m in models)
    title = (
        f"GPT train step memory, bf16 weights, sequences of {det_cfg.seq_len} tokens ({batches}), "
        f"{device}, torch {torch.__version__}"
    )
    table = format_table(rows, title)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "main-job_memory.md").write_text(table + "\n")
        meta = {"title": title, "rows": rows, "torch": torch.__version__, "device": device,
                "sdpa_backend": backend.name, "configs": configs}  # fmt: skip
        (out / "main-job_memory.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
