"""Benchmark: AdamWSR step time against the bandwidth floor and the peers, side by side in one process (GPU).

Cases (DESIGN.md): the 602 M-param Llama-like tensor set (hidden 2048, ffn 8192, 8 layers, vocab
32000: 74 tensors) and 2,000 tensors of 4K-64K elements. For each: the device copy bandwidth measured
in this run, the floor ``22 B/param / bandwidth`` (bf16 param read+write, bf16 grad read, fp32
exp_avg and exp_avg_sq read+write); ours three ways: ``AdamWSR.step()``, the kernel alone with
prepared launch tables, and ``step()`` with ``capturable=True`` replayed from a CUDA graph;
torch.optim.AdamW fused on fp32 params; torch AdamW fused on bf16 params and states; optimi's AdamW
(bf16, Kahan summation) if installed. Times are medians of triton.testing.do_bench.

    python packages/adamw-sr/benchmarks/bench_adamw.py --out docs/benchmarks

Writes ``<out>/adamw-sr_adamw.md`` (the table), ``.json`` and, if matplotlib is installed, ``.png``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "torch-ext"))

BYTES_PER_PARAM_OURS = 22  # bf16 p r+w (4) + bf16 g (2) + fp32 m r+w (8) + fp32 v r+w (8)
BYTES_PER_PARAM_TORCH_FP32 = 28  # fp32 p r+w (8) + fp32 g (4) + m (8) + v (8)
BYTES_PER_PARAM_TORCH_BF16 = 14  # everything bf16


def llama_shapes(hidden=2048, ffn=8192, layers=8, vocab=32000) -> list[tuple[int, ...]]:
    """The 74 tensors of a Llama-like model (tied embedding): 602.9 M params at the defaults."""
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(ffn, hidden), (ffn, hidden), (hidden, ffn)] + [(hidden,)] * 2
    return shapes + [(hidden,)]


def many_small_shapes(count=2000, low=4096, high=65536, seed=0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [(rng.randint(low, high),) for _ in range(count)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + write counted), measured now."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def _params(shapes, dtype, grad_dtype):
    params = []
    for s in shapes:
        p = torch.randn(s, device="cuda", dtype=torch.float32).mul_(0.02).to(dtype)
        p.grad = torch.randn(s, device="cuda", dtype=torch.float32).mul_(1e-3).to(grad_dtype)
        params.append(p)
    return params


def _release():
    gc.collect()
    torch.cuda.empty_cache()


def time_ours(shapes) -> dict:
    from adamw_sr import AdamWSR
    from adamw_sr import kernel as asr_kernel
    from adamw_sr.optimizer import _PLAN_CACHE

    params = _params(shapes, torch.bfloat16, torch.bfloat16)
    opt = AdamWSR(params, lr=1e-4, weight_decay=0.01, seed=0)
    opt.step()  # state, compile, launch tables
    step_ms = bench(opt.step)
    plan = next(reversed(_PLAN_CACHE.values()))
    states = [opt.state[p] for p in params]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    roles = (params, [p.grad for p in params], [s["exp_avg"] for s in states], exp_avg_sqs, exp_avg_sqs)
    steps = torch.ones(len(params), device="cuda")
    hyper = torch.tensor([1e-4, 0.9, 0.999, 1e-8, 0.01], dtype=torch.float64, device="cuda")

    def kernel_only():
        asr_kernel.launch_fused_step(
            plan, roles, steps, hyper, seed=0, amsgrad=False, maximize=False, param_bf16=True, stochastic=True
        )

    kernel_ms = bench(kernel_only)
    _PLAN_CACHE.clear()
    return {"step": step_ms, "kernel": kernel_ms}


def time_ours_graphed(shapes) -> float:
    """``AdamWSR(capturable=True).step()`` captured in a CUDA graph: the step without host overhead."""
    from adamw_sr import AdamWSR

    params = _params(shapes, torch.bfloat16, torch.bfloat16)
    lr = torch.tensor(1e-4, device="cuda")
    opt = AdamWSR(params, lr=lr, weight_decay=0.01, seed=0, capturable=True)
    opt.step()  # warm-up: state, compile, launch tables
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    return bench(graph.replay)


def time_torch(shapes, dtype) -> float:
    params = _params(shapes, dtype, dtype)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    opt.step()
    return bench(opt.step)


def time_optimi(shapes) -> float | str:
    try:
        import optimi
    except ImportError:
        return "not installed"
    params = _params(shapes, torch.bfloat16, torch.bfloat16)
    try:
        opt = optimi.AdamW(params, lr=1e-4, weight_decay=0.01, kahan_sum=True)
        opt.step()
        ms = bench(opt.step)
    except Exception as e:  # a peer's failure is reported, not fatal
        ms = f"failed: {type(e).__name__}: {e}"[:120]
    return ms


def run_case(name: str, shapes, bandwidth: float, with_optimi: bool = True) -> dict:
    n = sum(torch.Size(s).numel() for s in shapes)
    floor_ms = BYTES_PER_PARAM_OURS * n / bandwidth * 1e3
    ours = time_ours(shapes)
    _release()
    try:
        ours_graphed = time_ours_graphed(shapes)
    except Exception as e:  # reported, not fatal: the other columns still mean something
        ours_graphed = f"failed: {type(e).__name__}: {e}"[:120]
    _release()
    torch_fp32 = time_torch(shapes, torch.float32)
    _release()
    torch_bf16 = time_torch(shapes, torch.bfloat16)
    _release()
    optimi_ms = time_optimi(shapes) if with_optimi else "not run"
    _release()
    row = {
        "case": name,
        "tensors": len(shapes),
        "params": n,
        "floor_ms": floor_ms,
        "ours_step_ms": ours["step"],
        "ours_kernel_ms": ours["kernel"],
        "ours_graphed_ms": ours_graphed,
        "torch_fp32_fused_ms": torch_fp32,
        "torch_bf16_fused_ms": torch_bf16,
        "optimi_bf16_kahan_ms": optimi_ms,
    }
    return row


def _fmt(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"


def table(rows: list[dict], bandwidth: float) -> str:
    header = [
        "case", "params", "floor", "ours step()", "ours kernel", "ours step() in CUDA graph",
        "torch AdamW fp32 fused",
        "torch AdamW bf16 fused", "optimi bf16 Kahan", "ours step / floor", "ours kernel / floor",
        "ours graph / floor",
        "torch fp32 / ours", "optimi / ours",
    ]  # fmt: skip
    lines = [
        f"Device copy bandwidth (this run): {bandwidth / 1e12:.2f} TB/s. "
        "Floor = 22 B/param / bandwidth. Times: median ms of triton.testing.do_bench.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in rows:
        ours = r["ours_step_ms"]
        cells = [
            f"{r['case']} ({r['tensors']} tensors)",
            f"{r['params'] / 1e6:.1f} M",
            _fmt(r["floor_ms"]),
            _fmt(ours),
            _fmt(r["ours_kernel_ms"]),
            _fmt(r["ours_graphed_ms"]),
            _fmt(r["torch_fp32_fused_ms"]),
            _fmt(r["torch_bf16_fused_ms"]),
            _fmt(r["optimi_bf16_kahan_ms"]),
            _ratio(ours, r["floor_ms"]),
            _ratio(r["ours_kernel_ms"], r["floor_ms"]),
            _ratio(r["ours_graphed_ms"], r["floor_ms"]),
            _ratio(r["torch_fp32_fused_ms"], ours),
            _ratio(r["optimi_bf16_kahan_ms"], ours),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Memory per parameter (weights + optimizer states): AdamWSR bf16 weights + fp32 moments = 10 B; "
        "AdamW with an fp32 master copy (bf16 weights + fp32 master + fp32 moments) = 14 B; "
        "AdamW on fp32 weights = 12 B. Bytes moved per step: ours 22 B/param, torch fp32 28, torch bf16 14.",
    ]
    return "\n".join(lines)


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = [
        ("floor_ms", "floor (22 B/param)"),
        ("ours_kernel_ms", "ours (kernel)"),
        ("ours_step_ms", "ours step()"),
        ("ours_graphed_ms", "ours step(), CUDA graph"),
        ("optimi_bf16_kahan_ms", "optimi bf16 Kahan"),
        ("torch_bf16_fused_ms", "torch bf16 fused"),
        ("torch_fp32_fused_ms", "torch fp32 fused"),
    ]
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 3.5))
    for ax, r in zip(axes if len(rows) > 1 else [axes], rows, strict=True):
        labels = [lab for k, lab in keys if isinstance(r[k], float)]
        values = [r[k] for k, _ in keys if isinstance(r[k], float)]
        ax.barh(labels, values, color=["#999999"] + ["#1f77b4"] * (len(values) - 1))
        ax.set_xlabel("ms per optimizer step")
        ax.set_title(f"{r['case']}: {r['params'] / 1e6:.0f} M params, {r['tensors']} tensors")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for adamw-sr_adamw.{md,json,png}")
    parser.add_argument("--quick", action="store_true", help="the 2,000-tensor case only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_adamw needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    _release()
    rows = []
    if not args.quick:
        rows.append(run_case("Llama-like 602M", llama_shapes(), bandwidth))
    rows.append(run_case("2,000 small", many_small_shapes(), bandwidth))
    text = table(rows, bandwidth)
    print(text)
    base = os.path.join(args.out, "adamw-sr_adamw")
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    with open(base + ".json", "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bandwidth, "rows": rows},
            f,
            indent=2,
        )
    plot(rows, base + ".png")


if __name__ == "__main__":
    main()
