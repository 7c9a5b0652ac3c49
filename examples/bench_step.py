"""Benchmark (GPU): one training step of the main job's GPT, deterministic vs torch's fastest parts.

    python examples/bench_step.py --out docs/benchmarks
    python examples/bench_step.py --no-graph        # eager rows only
    python examples/bench_step.py --compile --out docs/benchmarks   # torch.compile table

Both models have the same architecture, shapes and bf16 weights (train_gpt.py's "gpu" preset, ~100 M
params, sequence 1024). **det**: det_train's layers, det_attn attention, the canonical-order
gradient accumulator, AdamWSR with stochastic rounding (bitwise reproducible under any batch
decomposition). **torch**: ``nn.Linear`` (cuBLAS), SDPA (cuDNN, else flash), ``nn.RMSNorm``,
``nn.Embedding``, ``F.cross_entropy``, fused ``torch.optim.AdamW`` (not deterministic).

A step is forward + backward over the global batch (in ``--micro-batches`` micro-batches) plus the
optimizer step, timed three ways: **eager** (the step's Python every time: host-bound at many
micro-batches); **eager, backward on the calling thread** (every ``backward()`` under
``torch.autograd.set_multithreading_enabled(False)``: a Python backward's host time differs between
autograd's device thread and the caller's, and which is faster moved between runs); **CUDA graph**
(``--graph``, the default: the whole step, ``acc.reduce``, ``opt.step`` and ``zero_grad`` included,
captured once and replayed, PyTorch's "whole-network capture" recipe: static inputs copied in
before each replay, warm-up on a side stream, ``capturable=True`` optimizers, a constant learning
rate; the det graph also copies ``acc.reduce``'s gradients into static buffers before
``AdamWSR.step``, whose launch tables are keyed by the gradients' addresses).

``--counts 2,4,8,16,32`` times the eager and CUDA-graph rows at each micro-batch count of the same
global batch, with each step's peak memory (``--model 0.4b --batch 16`` for the 0.4 B width), and
the eager step's host time and kernel launches (examples/step_costs.py; measured on new steps once
every timed row is done, so that nothing is timed or captured after the profiler ran).
``--compile`` times the det step with its model under ``torch.compile`` (Inductor, fullgraph; the
det ops are opaque custom ops; ``acc.micro_batch``, ``backward``, ``acc.reduce`` and the optimizer
stay eager), the eager det step and torch's compiled step at each of ``--compile-micro-batches``,
then checks that the compiled det model gives the eager det model's bits (2 steps, every weight);
its rows also give host time and launches per step. examples/bench_memory.py: the step's memory.

Timed with ``triton.testing.do_bench`` (median, side by side in this process). A graph whose capture
fails is reported in its row and the other rows are still measured. Writes
``DIR/main-job_train_step.md`` and ``.json``; targets and numbers are on the benchmarks page.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt as tg  # noqa: E402  (the package sources come from PYTHONPATH: nox -s bench)
from step_costs import HOST_NOTE, host_ms, kernel_launches, profile_step  # noqa: E402
from step_graph import GraphStepError, _describe, graphed  # noqa: E402

EAGER, EAGER_1T, GRAPH = "eager", "eager, backward on the calling thread", "CUDA graph"
# --model: shape overrides of the gpu preset (0.4b: 411 M params, SwiGLU width 2.75 x d_model)
MODELS = {"100m": {}, "0.4b": dict(d_model=2048, n_head=16, d_ff=5632, n_layer=8)}
COMPILED = "torch.compile"


@dataclasses.dataclass
class Step:
    """One training step of a model (``run``) and what the benchmark needs around it."""

    run: Callable[[], None]
    n_tokens: int
    x: torch.Tensor  # the batch the step reads (static inputs of a captured step)
    y: torch.Tensor
    model: torch.nn.Module
    opt: torch.optim.Optimizer


def make_step(
    cfg: tg.TrainConfig,
    micro_batches: int,
    device,
    *,
    graph: bool = False,
    compile_options: dict | None = None,
    state_dtype: torch.dtype | None = None,
    probe: Callable[[str], None] | None = None,
    recoverable: bool = True,
    mark: str = "step",
    main_grad: bool = False,
    fixed_folds: bool = False,
) -> Step:
    """A closure running one full training step of ``cfg`` (det or torch), and its tokens per step.

    ``graph`` prepares the step for CUDA-graph capture: capturable optimizers, and (det) static
    gradient buffers that ``AdamWSR.step`` reads, so its launch tables built in the warm-up
    (keyed by tensor addresses) are valid during capture. Gradient values are unchanged.
    ``compile_options`` (``torch.compile`` keyword arguments) runs the model's forward (and so its
    backward) compiled; the accumulator's micro-batches, ``reduce`` and the optimizer stay eager.
    ``state_dtype`` stores AdamWSR's moments in that dtype (its param groups' ``state_dtype``;
    default: the optimizer's fp32). ``recoverable``: the det accumulator's (False: no undo log, the
    least gradient memory, same bits). ``probe`` is called on the host at the step's points (memory
    readings, examples/bench_memory.py): ``"start"`` (``p.grad`` None), ``"backward"`` (after the last
    micro-batch's backward), ``"reduced"`` (det: after ``acc.reduce``; ``main_grad``: after the
    cast into ``p.grad``), ``"end"`` (after ``zero_grad``).
    ``mark``: where CUDA-graph trees (compile mode ``reduce-overhead`` / ``max-autotune``) start a
    generation, ``torch.compiler.cudagraph_mark_step_begin()``: before each ``"step"`` or each
    ``"micro-batch"``.
    ``main_grad`` (torch kernels only): accumulate the micro-batches' gradients in one fp32 buffer
    per parameter, as Megatron-LM's fp32 "main grad" (a post-accumulate-grad hook adds each bf16
    ``p.grad`` into it and drops ``p.grad``), cast into bf16 ``p.grad`` one parameter at a time
    before the optimizer step: the gradient memory of a torch user who accumulates in fp32.
    ``fixed_folds`` (det only): the accumulator built with ``recoverable=False`` and
    ``fixed_folds(model)`` (every Linear weight's open leaf in a fixed fp32 buffer, its deposits one
    kernel each), micro-batches given their ``num_tokens``.

    Raises:
        ValueError: ``state_dtype`` with the torch optimizer (its states take the params' dtype);
            ``main_grad`` with det kernels (the accumulator already sums in fp32).
    """
    if state_dtype is not None and cfg.optimizer != "adamw_sr":
        raise ValueError(f"state_dtype is AdamWSR's option; cfg.optimizer is {cfg.optimizer!r}")
    if main_grad and cfg.kernels == "det":
        raise ValueError("main_grad is for torch kernels: det's accumulator sums in fp32 already")
    model = tg.build_model(cfg, device)
    run = model if compile_options is None else torch.compile(model, **compile_options)
    # CUDA-graph trees: marked per micro-batch, torch's model fails (its first micro-batch's gradients,
    # graph outputs that became p.grad, are freed by the next generation); the det model runs both ways
    if mark not in ("step", "micro-batch"):
        raise ValueError(f"mark must be 'step' or 'micro-batch', got {mark!r}")
    trees = (compile_options or {}).get("mode") in ("reduce-overhead", "max-autotune")
    mark_step, mark_micro_batch = trees and mark == "step", trees and mark == "micro-batch"
    # capturable (step counts on the device) is for CUDA: both optimizers refuse it for CPU params
    opt = tg.build_optimizer(cfg, model, capturable=graph and torch.device(device).type == "cuda")
    if state_dtype is not None:  # AdamWSR reads its groups' values at each step
        for group in opt.param_groups:
            group["state_dtype"] = state_dtype
    acc = None
    if cfg.kernels == "det":
        from det_train import CanonicalGradAccumulator as Acc

        acc = Acc(
            model.named_parameters(), leaf_tokens=cfg.leaf_tokens, recoverable=recoverable and not fixed_folds
        )
        if fixed_folds:
            acc.fixed_folds(model)
    train, _ = tg.load_corpus()
    starts = tg.batch_starts(len(train), cfg.seq_len, cfg.batch_seqs, cfg.seed, 0)
    x, y = tg.get_batch(train, starts, cfg.seq_len, device)
    per = cfg.batch_seqs // micro_batches
    n_tokens = cfg.batch_seqs * cfg.seq_len
    params = list(model.parameters())
    grad_buffers = [torch.empty_like(p) for p in params] if graph and acc is not None else None
    note = probe or (lambda point: None)
    main_grads: list[torch.Tensor | None] = [None] * len(params)
    if main_grad:
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(functools.partial(_add_to_main_grad, main_grads, i))

    def step():
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        note("start")
        for m in range(micro_batches):
            if mark_micro_batch:
                torch.compiler.cudagraph_mark_step_begin()
            xs, ys = x[m * per : (m + 1) * per], y[m * per : (m + 1) * per]
            if acc is None:
                run(xs, ys, num_global_tokens=n_tokens)[1].backward()
            else:
                with acc.micro_batch(m * per * cfg.seq_len, per * cfg.seq_len if fixed_folds else None):
                    run(xs, ys, num_global_tokens=n_tokens)[1].backward()
        note("backward")
        if main_grad:  # one parameter at a time, each fp32 buffer freed once its bf16 p.grad exists
            for i, p in enumerate(params):
                p.grad, main_grads[i] = main_grads[i].to(p.dtype), None
            note("reduced")
        if acc is not None:
            acc.reduce(total_tokens=n_tokens)
            note("reduced")
            if grad_buffers is not None:
                torch._foreach_copy_(grad_buffers, [p.grad for p in params])
                for p, g in zip(params, grad_buffers, strict=True):
                    p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        note("end")

    return Step(step, n_tokens, x, y, model, opt)


def _add_to_main_grad(main_grads: list, i: int, p: torch.Tensor) -> None:
    """``make_step``'s ``main_grad`` hook: add ``p.grad`` into parameter ``i``'s fp32 buffer, drop it."""
    if main_grads[i] is None:
        main_grads[i] = p.grad.float()
    else:
        main_grads[i].add_(p.grad)
    p.grad = None


def _sdpa_backend():
    """The fastest SDPA backend this GPU accepts for the model's shapes: cuDNN, else flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the model's layout: (B, T, H, D) views transposed to (B, H, T, D)
    q = torch.randn(2, 1024, 12, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            return backend
        except RuntimeError:
            continue
    raise RuntimeError("neither the cuDNN nor the flash SDPA backend runs on this GPU")


def _cost_or_none(cost: Callable, fn: Callable[[], None], where: str):
    """``cost(fn)``, or None when it fails (printed: a missing cost must not lose the timed row)."""
    try:
        return cost(fn)
    except Exception as exc:  # a benchmark: report the failure, keep the other numbers
        print(f"## {cost.__name__}, {where}: {_describe(exc)}", flush=True)
        return None


def eager_cost(cfg: tg.TrainConfig, micro_batches: int, backend, cost: Callable, warmup: int = 3):
    """``cost(step)`` (``host_ms`` or ``kernel_launches``) of a new eager step of ``cfg`` after
    ``warmup`` steps, or None when it fails (printed: a missing cost must not lose the timed rows)."""
    from torch.nn.attention import sdpa_kernel

    where = f"{cfg.kernels}, {micro_batches} micro-batches"
    try:
        with sdpa_kernel([backend]) if cfg.kernels == "torch" else contextlib.nullcontext():
            s = make_step(cfg, micro_batches, torch.device("cuda"))
            for _ in range(warmup):
                s.run()
            return cost(s.run)
    except Exception as exc:  # a benchmark: report the failure, keep the other numbers
        print(f"## {cost.__name__}, {where}: {_describe(exc)}", flush=True)
        return None


def measure(name: str, cfg: tg.TrainConfig, mode: str, args, backend) -> dict:
    """One row: the median step time of ``cfg`` in ``mode`` (eager or CUDA graph), or the error.

    An eager step that fails raises; a graph that fails gives a row with ``error`` set.
    """
    row = {"impl": name, "mode": mode, "ms_per_step": None, "tokens_per_s": None, "error": None}
    try:
        row.update(_time_step(name, cfg, mode, args, backend))
    except Exception as exc:  # a benchmark: report the failure in its row, measure the others
        if mode != GRAPH:
            raise
        row["error"] = str(exc) if isinstance(exc, GraphStepError) else f"failed: {_describe(exc)}"
        print(f"\n## {name}, {mode}: {row['error']}\n{traceback.format_exc()}", flush=True)
    # the step, its graph and the graph's memory pool are gone with _time_step's frame
    with contextlib.suppress(Exception):  # after a failed capture the device may refuse work
        torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


def _time_step(name: str, cfg: tg.TrainConfig, mode: str, args, backend) -> dict:
    import triton.testing
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]) if cfg.kernels == "torch" else contextlib.nullcontext():
        fixed = args.fixed_folds and cfg.kernels == "det"
        s = make_step(cfg, args.micro_batches, torch.device("cuda"), graph=mode == GRAPH, fixed_folds=fixed)
        fn = graphed(s) if mode == GRAPH else s.run
        if mode == EAGER_1T:  # autograd's CUDA device thread adds host time to Python backward nodes
            fn = _on_calling_thread(s.run)
        ms = triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
        peak = None
        if mode == EAGER:  # one more step alone: do_bench's cache-flush buffer is not the step's
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
        if args.profile:
            print(f"\n## profile: {name}, {mode}\n{profile_step(fn)}\n", flush=True)
    return {"ms_per_step": ms, "tokens_per_s": s.n_tokens / ms * 1e3, "peak_gib": peak}


def _compile_options(args) -> dict:
    options = dict(fullgraph=not args.allow_graph_breaks, dynamic=False)
    if args.compile_mode != "default":
        options["mode"] = args.compile_mode
    return options


def _graph_trees(args) -> bool:
    """Whether ``--compile-mode`` runs the compiled steps as CUDA-graph trees."""
    return args.compile_mode in ("reduce-overhead", "max-autotune")


def _inductor_casts(args, cfg: tg.TrainConfig):
    """Inductor rounds the bf16 intermediates of the det model's torch ops (residual adds, SiLU,
    products) as eager does (``emulate_precision_casts``), unless ``--no-emulate-precision-casts``;
    torch's compiled model keeps Inductor's defaults (its fastest form)."""
    if cfg.kernels != "det" or not args.emulate_precision_casts:
        return contextlib.nullcontext()
    return torch._inductor.config.patch(emulate_precision_casts=True)


def _time_compiled(name: str, cfg: tg.TrainConfig, micro_batches: int, compiled: bool, args, backend) -> dict:
    """One row of the ``--compile`` table: the median step time (compilation in the warm-up steps
    before), or the error that stopped the compilation or the step."""
    import triton.testing
    from torch.nn.attention import sdpa_kernel

    mode = f"{COMPILED if compiled else EAGER}, {micro_batches} micro-batches"
    row = {"impl": name, "mode": mode, "micro_batches": micro_batches, "compiled": compiled}
    row.update(
        ms_per_step=None, tokens_per_s=None, error=None, graph_breaks=None, host_ms=None, launches=None
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        with sdpa_kernel([backend]) if cfg.kernels == "torch" else contextlib.nullcontext():
            options = _compile_options(args) if compiled else None
            s = make_step(
                cfg,
                micro_batches,
                torch.device("cuda"),
                compile_options=options,
                mark=args.cudagraph_mark,
                fixed_folds=args.fixed_folds and cfg.kernels == "det",
            )
            with _inductor_casts(args, cfg):
                for _ in range(args.compile_warmup):  # compiles (forward and backward graphs) here
                    s.run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(
                    s.run, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"
                )
                row["host_ms"] = _cost_or_none(host_ms, s.run, f"{name}, {mode}")
                if not _graph_trees(args):  # CUDA-graph trees: a profiled replay of an earlier capture
                    row["launches"] = _cost_or_none(kernel_launches, s.run, f"{name}, {mode}")
        row.update(ms_per_step=ms, tokens_per_s=s.n_tokens / ms * 1e3)
        if compiled:
            row["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    except Exception as exc:  # a benchmark: report the failure in its row, measure the others
        row["error"] = f"failed: {_describe(exc)}"
        print(f"\n## {name}, {mode}: {row['error']}\n{traceback.format_exc()}", flush=True)
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


def compiled_matches_eager(
    cfg: tg.TrainConfig,
    micro_batches: int,
    device,
    compile_options: dict,
    steps: int = 2,
    mark: str = "step",
    fixed_folds: bool = False,
) -> str | None:
    """None when ``steps`` steps of the det step with its model compiled leave every weight bitwise
    equal to the eager det step's (same initial weights and batch), else the first differing one.
    ``mark``: ``make_step``'s (CUDA-graph trees' generations per step or per micro-batch);
    ``fixed_folds``: the compiled step's accumulator has fixed folds (the eager one does not)."""
    torch._dynamo.reset()
    eager = make_step(cfg, micro_batches, device)
    compiled = make_step(
        cfg, micro_batches, device, compile_options=compile_options, mark=mark, fixed_folds=fixed_folds
    )
    for _ in range(steps):
        eager.run()
        compiled.run()
    for (name, p), q in zip(compiled.model.named_parameters(), eager.model.parameters(), strict=True):
        if not torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16)):
            return name
    return None


def compile_main(args, det_cfg, torch_cfg, n_params: int, backend) -> int:
    """``--compile``: the table of compiled det / eager det / compiled torch steps per micro-batch count."""
    counts = [int(c) for c in args.compile_micro_batches.split(",")]
    det_name, torch_name = "det (ours)", f"torch ({backend.name}, cuBLAS, fused AdamW)"
    rows = []
    for mb in counts:
        if args.batch % mb:
            raise SystemExit(f"--batch {args.batch} is not a multiple of the micro-batch count {mb}")
        cfgs = [dataclasses.replace(c, micro_batch_seqs=args.batch // mb) for c in (det_cfg, torch_cfg)]
        for name, cfg, compiled in (
            (det_name, cfgs[0], True),
            (det_name, cfgs[0], False),
            (torch_name, cfgs[1], True),
        ):
            rows.append(row := _time_compiled(name, cfg, mb, compiled, args, backend))
            print(f"{name}, {row['mode']}: {row['ms_per_step']} ms ({row['error'] or 'ok'})", flush=True)
    title = (
        f"GPT train step under torch.compile, {n_params / 1e6:.0f} M params "
        f"({det_cfg.n_layer} layers, d_model {det_cfg.d_model}), bf16 weights, batch {args.batch} x "
        f"{det_cfg.seq_len} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}"
        + (f", mode={args.compile_mode!r}" if args.compile_mode != "default" else "")
    )
    lines = [
        f"**{title}**",
        "",
        "| implementation | mode | ms / step | tokens / s | time vs torch compiled (same micro-batches) "
        "| host ms / step | launches / step |",
        "|---|---|---|---|---|---|---|",
    ]
    ref = {r["micro_batches"]: r["ms_per_step"] for r in rows if r["impl"] == torch_name}
    for r in rows:
        if r["error"] is not None:
            lines.append(f"| {r['impl']} | {r['mode']} | {_cell(r['error'])} | - | - | - | - |")
            continue
        base = ref.get(r["micro_batches"])
        vs = f"{r['ms_per_step'] / base:.2f}x" if base else "-"
        mode = r["mode"] + (f" ({r['graph_breaks']} graph breaks)" if r["graph_breaks"] else "")
        host = "-" if r["host_ms"] is None else f"{r['host_ms']:.1f}"
        launches = "-" if r["launches"] is None else f"{r['launches']:,}"
        lines.append(
            f"| {r['impl']} | {mode} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {vs} "
            f"| {host} | {launches} |"
        )
    lines.append("")
    try:
        if not args.bits_check:
            raise RuntimeError("skipped (--no-bits-check; the gpu test checks it)")
        with _inductor_casts(args, det_cfg):
            differs = compiled_matches_eager(
                dataclasses.replace(det_cfg, micro_batch_seqs=args.batch // counts[0]),
                counts[0],
                "cuda",
                _compile_options(args),
                mark=args.cudagraph_mark,
                fixed_folds=args.fixed_folds,
            )
        bits = "every weight bitwise equal" if differs is None else f"**differ** (first: {differs})"
    except Exception as exc:
        bits = f"check failed: {_describe(exc)}"
    lines += [
        f"Compiled det vs eager det, weights after 2 steps at {counts[0]} micro-batches: {bits}.",
        "",
        "torch.compile: the model's forward and backward compiled (Inductor, "
        f"mode={args.compile_mode!r}, graph_partition={torch._inductor.config.graph_partition}, "
        + (f"cudagraph_mark_step_begin per {args.cudagraph_mark}, " if _graph_trees(args) else "")
        + f"fullgraph={not args.allow_graph_breaks}, dynamic=False, det with "
        f"emulate_precision_casts={args.emulate_precision_casts}"
        + (" and the accumulator's fixed folds (recoverable=False)" if args.fixed_folds else "")
        + "; compilation in "
        f"{args.compile_warmup} warm-up steps, not timed); micro-batch loop, backward() calls, "
        "gradient reduction and optimizer step eager.",
        "",
        HOST_NOTE.replace("one eager step", "one step")
        + " Both measured in each row after its timing"
        + (
            "; launches not counted under CUDA-graph trees (a profiled replay of graphs captured "
            "before the profiler ran)."
            if _graph_trees(args)
            else "."
        ),
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        mode = "" if args.compile_mode == "default" else f"_{args.compile_mode}"
        stem = f"main-job_train_step_compile{mode}"
        (out / f"{stem}.md").write_text(table + "\n")
        meta = {
            "title": title,
            "rows": rows,
            "bits": bits,
            "n_params": n_params,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "config": vars(det_cfg),
            "sdpa_backend": backend.name,
            "compile": _compile_options(args),
            "do_bench_ms": {"warmup": args.warmup_ms, "rep": args.rep_ms},
        }
        (out / f"{stem}.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return 0


def counts_main(args, det_cfg, torch_cfg, n_params: int, backend) -> int:
    """``--counts``: eager and CUDA-graph rows (and peak memory) at each micro-batch count, one table."""
    counts = [int(c) for c in args.counts.split(",")]
    det_name, torch_name = "det (ours)", f"torch ({backend.name}, cuBLAS, fused AdamW)"
    modes = [EAGER, GRAPH] if args.graph else [EAGER]
    table_rows = []
    for mb in counts:
        if args.batch % mb:
            raise SystemExit(f"--batch {args.batch} is not a multiple of the micro-batch count {mb}")
        args.micro_batches = mb
        cfgs = {n: dataclasses.replace(c, micro_batch_seqs=args.batch // mb) for n, c in
                ((det_name, det_cfg), (torch_name, torch_cfg))}  # fmt: skip
        got = {}
        for mode in modes:  # torch first in each mode: a det capture that fails cannot disturb it
            for name in (torch_name, det_name):
                got[(name, mode)] = row = measure(name, cfgs[name], mode, args, backend)
                where = f"{mb} micro-batches, {name}, {mode}"
                print(f"{where}: {row['ms_per_step']} ms, peak {row.get('peak_gib')} GiB", flush=True)
        table_rows.append((mb, got, cfgs))
    # host times, then launches, on new eager steps after every timed row and capture: nothing is
    # timed or captured after the profiler (CUPTI) has run in this process
    for key, cost in (("host_ms", host_ms), ("launches", kernel_launches)):
        for mb, got, cfgs in table_rows:
            for name in (torch_name, det_name):
                got[(name, EAGER)][key] = value = eager_cost(cfgs[name], mb, backend, cost)
                torch.cuda.empty_cache()
                print(f"{mb} micro-batches, {name}: {key} {value}", flush=True)
    names = (torch_name, det_name)
    raw = [
        {**got[(n, mode)], "micro_batches": mb} for mb, got, _ in table_rows for mode in modes for n in names
    ]

    def ms(row):
        return "-" if row["ms_per_step"] is None else f"{row['ms_per_step']:.1f}"

    def ratio(got, mode):
        det, ref = got[(det_name, mode)]["ms_per_step"], got[(torch_name, mode)]["ms_per_step"]
        return None if det is None or ref is None else det / ref

    title = (
        f"GPT train step, {n_params / 1e6:.0f} M params ({det_cfg.n_layer} layers, "
        f"d_model {det_cfg.d_model}, head dim {det_cfg.d_model // det_cfg.n_head}), bf16 weights, "
        f"batch {args.batch} x {det_cfg.seq_len} tokens, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}"
        + (", det with the accumulator's fixed folds" if args.fixed_folds else "")
    )
    head = "| micro-batches | det eager ms | torch eager ms | det / torch eager |"
    rule = "|---|---|---|---|"
    if args.graph:
        head += " det graph ms | torch graph ms | det / torch graph |"
        rule += "---|---|---|"
    head += " det peak GiB | torch peak GiB | det host ms | torch host ms | det launches | torch launches |"
    rule += "---|---|---|---|---|---|"
    lines = [f"**{title}**", "", head, rule]
    for mb, got, _ in table_rows:
        cells = [str(mb)]
        for mode in modes:
            r = ratio(got, mode)
            cells += [
                ms(got[(det_name, mode)]),
                ms(got[(torch_name, mode)]),
                "-" if r is None else f"{r:.2f}x",
            ]
        for key, form in (("peak_gib", "{:.2f}"), ("host_ms", "{:.1f}"), ("launches", "{:,}")):
            for name in (det_name, torch_name):
                value = got[(name, EAGER)].get(key)
                cells.append("-" if value is None else form.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Targets (gradient-accumulation issue): det / torch <= {args.target_eager}x eager and <= "
        f"{args.target_graph}x in a CUDA graph at every count. Peak: torch.cuda.max_memory_allocated over "
        "one eager step after the timing (weights, optimizer state, gradients and activations).",
        HOST_NOTE + " Both on new eager steps (after 3 warm-up steps) once every timed row is done.",
    ]
    failed = [f"{mb}: {mode}" for mb, got, _ in table_rows for mode in modes if ratio(got, mode) is None]
    met = [
        ratio(got, EAGER) <= args.target_eager for _, got, _ in table_rows if ratio(got, EAGER) is not None
    ]
    if args.graph:
        met += [
            ratio(got, GRAPH) <= args.target_graph
            for _, got, _ in table_rows
            if ratio(got, GRAPH) is not None
        ]
    lines.append(
        f"Targets met: {sum(met)} of {len(met)} ratios" + (f"; rows failed: {failed}" if failed else "")
    )
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"main-job_train_step_counts{args.model_suffix}"
        (out / f"{stem}.md").write_text(table + "\n")
        meta = {"title": title, "rows": raw, "n_params": n_params, "torch": torch.__version__,
                "device": torch.cuda.get_device_name(), "config": vars(det_cfg), "sdpa_backend": backend.name,
                "do_bench_ms": {"warmup": args.warmup_ms, "rep": args.rep_ms}}  # fmt: skip
        (out / f"{stem}.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return 0


def _on_calling_thread(run):
    def step():
        with torch.autograd.set_multithreading_enabled(False):
            run()

    return step


def _cell(text: str, limit: int = 300) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for main-job_train_step.md/.json")
    gpu = tg.PRESETS["gpu"]  # default: the main job's GPU preset (32 sequences in micro-batches of 16)
    p.add_argument(
        "--batch", type=int, default=gpu["batch_seqs"], help="global batch in sequences of 1024 tokens"
    )
    p.add_argument("--micro-batches", type=int, default=gpu["batch_seqs"] // gpu["micro_batch_seqs"])
    p.add_argument("--layers", type=int, default=None, help="override n_layer (default: the gpu preset's 12)")
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="100m",
        help="100m: the gpu preset; 0.4b: d_model 2048, head dim 128, 8 layers (use --batch 16)",
    )
    p.add_argument(
        "--counts", default=None, help="e.g. 2,4,8,16,32: eager and graph rows and peak memory at each count"
    )
    p.add_argument("--target-eager", type=float, default=1.15, help="--counts: det / torch eager target")
    p.add_argument("--target-graph", type=float, default=1.10, help="--counts: det / torch CUDA-graph target")
    p.add_argument(
        "--graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time both steps captured in one CUDA graph each (default: on)",
    )
    p.add_argument("--warmup-ms", type=float, default=300, help="do_bench warm-up time (ms)")
    p.add_argument("--rep-ms", type=float, default=1500, help="do_bench timed repetitions (ms of steps)")
    p.add_argument(
        "--profile", action="store_true", help="also print where each step spends device and host time"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="time the torch.compile table instead (compiled det, eager det, compiled torch per count)",
    )
    p.add_argument(
        "--compile-micro-batches", default="2,4,8,16,32", help="micro-batch counts of the --compile table"
    )
    p.add_argument("--compile-warmup", type=int, default=3, help="untimed steps before timing (compilation)")
    p.add_argument(
        "--compile-mode",
        default="default",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        help="--compile: torch.compile's mode for both models (reduce-overhead: CUDA-graph trees)",
    )
    p.add_argument(
        "--cudagraph-mark",
        default="step",
        choices=("step", "micro-batch"),
        help="--compile under CUDA-graph trees: cudagraph_mark_step_begin() before each step (default) or "
        "each micro-batch (torch's model then fails: its p.grad, a graph output, is freed by the next mark)",
    )
    p.add_argument(
        "--fixed-folds",
        action="store_true",
        help="det steps: the accumulator's fixed_folds (recoverable=False; Linear weight deposits one kernel "
        "each, graph-safe); the bits check compares with the plain eager det step",
    )
    p.add_argument(
        "--bits-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--compile: also check the compiled det weights against eager's after 2 steps (default: on)",
    )
    p.add_argument(
        "--allow-graph-breaks", action="store_true", help="--compile with fullgraph=False (breaks counted)"
    )
    p.add_argument(
        "--emulate-precision-casts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--compile: Inductor rounds the det model's bf16 intermediates as eager (default: on)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_step.py needs a CUDA GPU (the interpreter path is for correctness, not speed)")
        return 1

    overrides = dict(batch_seqs=args.batch, micro_batch_seqs=args.batch // args.micro_batches)
    overrides.update(MODELS[args.model])
    args.model_suffix = "" if args.model == "100m" else f"_{args.model}"
    if args.layers:
        overrides["n_layer"] = args.layers
    det_cfg = tg.make_config("gpu", **overrides)
    torch_cfg = tg.make_config(
        "gpu", kernels="torch", optimizer="torch_adamw", rounding="nearest", **overrides
    )
    n_params = sum(p.numel() for p in tg.GPT(det_cfg.model_config(), kernels="torch").parameters())

    backend = _sdpa_backend()
    if args.compile:
        return compile_main(args, det_cfg, torch_cfg, n_params, backend)
    if args.counts:
        return counts_main(args, det_cfg, torch_cfg, n_params, backend)
    det_name, torch_name = "det (ours)", f"torch ({backend.name}, cuBLAS, fused AdamW)"
    plan = [(det_name, det_cfg, EAGER), (torch_name, torch_cfg, EAGER)]
    plan += [(det_name, det_cfg, EAGER_1T), (torch_name, torch_cfg, EAGER_1T)]
    if args.graph:
        # torch's graph first: a det capture that fails cannot disturb its measurement
        plan += [(torch_name, torch_cfg, GRAPH), (det_name, det_cfg, GRAPH)]
    measured = {(name, mode): measure(name, cfg, mode, args, backend) for name, cfg, mode in plan}
    modes = [EAGER, EAGER_1T, GRAPH] if args.graph else [EAGER, EAGER_1T]
    rows = [measured[(name, mode)] for mode in modes for name in (det_name, torch_name)]

    def ratio(mode: str) -> float | None:
        det, ref = measured[(det_name, mode)]["ms_per_step"], measured[(torch_name, mode)]["ms_per_step"]
        return det / ref if det is not None and ref is not None else None

    title = (
        f"GPT train step, {n_params / 1e6:.0f} M params "
        f"({det_cfg.n_layer} layers, d_model {det_cfg.d_model}), "
        f"bf16 weights, batch {args.batch} x {det_cfg.seq_len} tokens in {args.micro_batches} micro-batches, "
        f"{torch.cuda.get_device_name()}"
    )
    lines = [
        f"**{title}**",
        "",
        "| implementation | mode | ms / step | tokens / s | time vs torch (same mode) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["error"] is not None:
            lines.append(f"| {r['impl']} | {r['mode']} | {_cell(r['error'])} | - | - |")
            continue
        ref = measured[(torch_name, r["mode"])]["ms_per_step"]
        vs = f"{r['ms_per_step'] / ref:.2f}x" if ref is not None else "-"
        lines.append(
            f"| {r['impl']} | {r['mode']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {vs} |"
        )
    lines.append("")
    labels = (
        (EAGER, "eager / eager"),
        (EAGER_1T, "eager / eager, backward on the calling thread"),
        (GRAPH, "CUDA graph / CUDA graph"),
    )
    for mode, label in labels:
        if mode not in modes:
            continue
        value = ratio(mode)
        if value is None:
            lines.append(f"det / torch step time, {label}: not available (a row failed)")
        else:
            met = "met" if value <= 1.2 else "NOT met"
            lines.append(f"det / torch step time, {label}: **{value:.2f}x** (target <= 1.2x: {met})")
    if args.graph:
        lines += [
            "",
            "CUDA graph: the whole step (forward + backward of every micro-batch, gradient reduction, "
            "optimizer step, zero_grad) in one captured graph, replayed after copying the batch into its "
            "static inputs; optimizers with capturable=True; det also copies its gradients into static "
            "buffers before AdamWSR (one multi-tensor copy, included).",
        ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "main-job_train_step.md").write_text(table + "\n")
        meta = {
            "title": title,
            "rows": rows,
            "ratio_det_over_torch": ratio(EAGER),
            "ratio_det_over_torch_calling_thread": ratio(EAGER_1T),
            "ratio_det_over_torch_graph": ratio(GRAPH) if args.graph else None,
            "graph": args.graph,
            "n_params": n_params,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "config": vars(det_cfg),
            "sdpa_backend": backend.name,
            "do_bench_ms": {"warmup": args.warmup_ms, "rep": args.rep_ms},
            "cwd": os.getcwd(),
        }
        (out / "main-job_train_step.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
