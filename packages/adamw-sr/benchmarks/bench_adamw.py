"""Benchmark: AdamWSR step time against the bandwidth floor and the peers, side by side in one process (GPU).

Cases (DESIGN.md): the 602 M-param Llama-like tensor set (hidden 2048, ffn 8192, 8 layers, vocab
32000: 74 tensors) and 2,000 tensors of 4K-64K elements. For each: the device copy bandwidth measured
in this run, the floor ``22 B/param / bandwidth`` (bf16 param read+write, bf16 grad read, fp32
exp_avg and exp_avg_sq read+write); ours three ways: ``AdamWSR.step()``, the kernel alone with
prepared launch tables, and ``step()`` with ``capturable=True`` replayed from a CUDA graph;
torch.optim.AdamW fused on fp32 params; torch AdamW fused on bf16 params and states; optimi's AdamW
(bf16, Kahan summation) if installed. Times are medians of triton.testing.do_bench.

The ``state_dtype`` table (602 M set): ``AdamWSR`` with fp32, bf16 and 8-bit moments (stochastic
rounding), each against its own bytes-moved floor (``STATE_BYTES_MOVED``: bf16 param read + write,
bf16 gradient read, the moments read + written, 8-bit scales included), with ms, GB/s (those bytes
over the step time) and the ratio to the floor; next to torch AdamW bf16 fused, optimi bf16 Kahan,
bitsandbytes ``AdamW8bit`` and torchao ``AdamW8bit`` where installed (a printed note where not; their
bytes per param are our count of what they store, see ``PEER_BYTES_MOVED``).

    python packages/adamw-sr/benchmarks/bench_adamw.py --out docs/benchmarks
    python packages/adamw-sr/benchmarks/bench_adamw.py --states-only --out docs/benchmarks

Writes ``<out>/adamw-sr_adamw.md`` (the table), ``.json`` and, if matplotlib is installed, ``.png``;
and ``<out>/adamw-sr_states.md`` / ``.json`` (the state_dtype table).
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
# AdamWSR per state_dtype, bf16 params and grads: p r+w (4) + g (2) + the moments read and written
STATE_BYTES_MOVED = {
    "float32": 4 + 2 + 16,  # fp32 m, v r+w
    "bfloat16": 4 + 2 + 8,  # bf16 m, v r+w
    "8bit": 4 + 2 + 4 + 4 / 32,  # 1-byte m, v r+w, one scale byte per 32 elements and moment r+w
}
# peers with bf16 params and grads, from what each stores per param (our count, not measured traffic)
PEER_BYTES_MOVED = {
    "torch AdamW bf16 fused": 14,  # bf16 m, v
    "optimi AdamW bf16 Kahan": 18,  # bf16 m, v and a bf16 Kahan buffer, each r+w
    "bitsandbytes AdamW8bit": 4 + 2 + 4 + 2 * 2 * 4 / 256,  # 8-bit m, v, fp32 absmax per 256 and moment
    "torchao AdamW8bit": 4 + 2 + 4 + 2 * 2 * 4 / 256,  # 8-bit m, v, fp32 scale per 256 and moment
}


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


def time_ours(shapes, state_dtype="float32") -> dict:
    from adamw_sr import AdamWSR
    from adamw_sr import _launch as asr_launch
    from adamw_sr.functional import PLAN_CACHE

    params = _params(shapes, torch.bfloat16, torch.bfloat16)
    opt = AdamWSR(params, lr=1e-4, weight_decay=0.01, seed=0, state_dtype=state_dtype)
    opt.step()  # state, compile, launch tables
    step_ms = bench(opt.step)
    plan = next(reversed(PLAN_CACHE.values()))
    states = [opt.state[p] for p in params]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    roles = (params, [p.grad for p in params], [s["exp_avg"] for s in states], exp_avg_sqs, exp_avg_sqs)
    scales = ((), ())
    if state_dtype == "8bit":
        scales = tuple([s[key] for s in states] for key in ("exp_avg_scale", "exp_avg_sq_scale"))
    steps = torch.ones(len(params), device="cuda")
    hyper = torch.tensor([1e-4, 0.9, 0.999, 1e-8, 0.01], dtype=torch.float64, device="cuda")

    def kernel_only():
        asr_launch.launch_fused_step(
            plan, roles, steps, hyper, seed=0, amsgrad=False, maximize=False, param_bf16=True,
            stochastic=True, scales=scales,
        )  # fmt: skip

    kernel_ms = bench(kernel_only)
    PLAN_CACHE.clear()
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


PEER_KERNELS: dict[str, str] = {}  # label -> what one step launched (kernels_per_step), for the notes


def _time_peer(make_optimizer, shapes, label: str = "") -> float | str:
    """Median step time of a peer optimizer on bf16 params and grads, or why it did not run; what
    one warm step launched goes to ``PEER_KERNELS[label]`` (is the peer on its fast path?)."""
    params = _params(shapes, torch.bfloat16, torch.bfloat16)
    try:
        opt = make_optimizer(params)
        opt.step()
        ms = bench(opt.step)
    except Exception as e:  # a peer's failure is reported, not fatal
        return f"failed: {type(e).__name__}: {e}"[:120]
    PEER_KERNELS[label] = kernels_per_step(opt.step)
    return ms


def _device_us(event) -> float:
    """A profiler average's device time in us (``self_cuda_time_total`` in older torch)."""
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)


def kernels_per_step(step, top: int = 4) -> str:
    """The GPU kernels one call of ``step`` launches (torch.profiler): how many, and the ``top``
    names by device time with their count and ms; or why the profile failed (never fatal)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        device = [  # the GPU-side ranges of record_function annotations (Optimizer.step#...) are not launches
            e
            for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        device.sort(key=lambda e: -_device_us(e))
        launches = sum(e.count for e in device)
        names = "; ".join(f"{e.key[:60]} x{e.count} {_device_us(e) / 1e3:.2f} ms" for e in device[:top])
        return f"{launches} device launches per step: {names}"
    except Exception as e:  # a diagnostic: report, do not stop the benchmark
        return f"profile failed: {type(e).__name__}: {e}"[:200]


def _bnb_adamw8bit():
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    return lambda params: bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.01)


def _torchao_adamw8bit():
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        try:  # torchao before 0.11
            from torchao.prototype.low_bit_optim import AdamW8bit
        except ImportError:
            return None
    return lambda params: AdamW8bit(params, lr=1e-4, weight_decay=0.01)


def _optimi_kahan():
    try:
        import optimi
    except ImportError:
        return None
    return lambda params: optimi.AdamW(params, lr=1e-4, weight_decay=0.01, kahan_sum=True)


def run_states_case(name: str, shapes, bandwidth: float) -> list[dict]:
    """The state_dtype rows: ours per state_dtype and the peers, each against its bytes-moved floor."""
    n = sum(torch.Size(s).numel() for s in shapes)
    rows = []

    def row(label, bytes_per_param, step_ms, kernel_ms="-"):
        floor_ms = bytes_per_param * n / bandwidth * 1e3
        rate = bytes_per_param * n / (step_ms * 1e-3) / 1e9 if isinstance(step_ms, float) else "-"
        rows.append(
            {"case": name, "optimizer": label, "bytes_per_param": bytes_per_param, "params": n,
             "step_ms": step_ms, "kernel_ms": kernel_ms, "GBps": rate, "floor_ms": floor_ms}
        )  # fmt: skip

    for state_dtype, label in (("float32", "fp32"), ("bfloat16", "bf16 (SR)"), ("8bit", "8-bit (SR)")):
        ours = time_ours(shapes, state_dtype)
        row(f"AdamWSR state_dtype {label}", STATE_BYTES_MOVED[state_dtype], ours["step"], ours["kernel"])
        _release()
    row(
        "torch AdamW bf16 fused",
        PEER_BYTES_MOVED["torch AdamW bf16 fused"],
        time_torch(shapes, torch.bfloat16),
    )
    _release()
    for label, make in (
        ("optimi AdamW bf16 Kahan", _optimi_kahan()),
        ("bitsandbytes AdamW8bit", _bnb_adamw8bit()),
        ("torchao AdamW8bit", _torchao_adamw8bit()),
    ):
        if make is None:
            print(f"note: {label} skipped: its package is not installed")
            row(label, PEER_BYTES_MOVED[label], "not installed")
        else:
            row(label, PEER_BYTES_MOVED[label], _time_peer(make, shapes, label))
            print(f"note: {label}: {PEER_KERNELS.get(label, 'no profile')}")
        _release()
    for r in rows:
        r["kernels"] = PEER_KERNELS.get(r["optimizer"], "")
    return rows


def states_table(rows: list[dict], bandwidth: float) -> str:
    header = ["case", "optimizer", "bytes moved / param", "floor", "step()", "kernel", "GB/s", "step / floor"]
    lines = [
        f"Device copy bandwidth (this run): {bandwidth / 1e12:.2f} TB/s. Floor = bytes moved per param x "
        "params / bandwidth (peers: our count of what they store). Times: median ms of "
        "triton.testing.do_bench.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in rows:
        rate = f"{r['GBps']:.0f}" if isinstance(r["GBps"], float) else "-"
        cells = [
            f"{r['case']}", r["optimizer"], f"{r['bytes_per_param']:g}", _fmt(r["floor_ms"]),
            _fmt(r["step_ms"]), _fmt(r["kernel_ms"]), rate, _ratio(r["step_ms"], r["floor_ms"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Bytes stored per param (weights + optimizer states), bf16 weights: AdamWSR fp32 states 10, bf16 "
        "states 6, 8-bit states 4.0625 (1 + 1 + 2/32 scale bytes); AdamW with an fp32 master copy 14.",
    ]
    lines += [f"{r['optimizer']}: {r['kernels']}" for r in rows if r.get("kernels")]
    return "\n".join(lines)


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
    parser.add_argument(
        "--quick", action="store_true", help="the 2,000-tensor case only (no state_dtype table)"
    )
    parser.add_argument("--states-only", action="store_true", help="only the state_dtype table (602 M set)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_adamw needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    _release()
    if not args.quick:
        state_rows = run_states_case("Llama-like 602M", llama_shapes(), bandwidth)
        text = states_table(state_rows, bandwidth)
        print(text)
        base = os.path.join(args.out, "adamw-sr_states")
        with open(base + ".md", "w") as f:
            f.write(text + "\n")
        with open(base + ".json", "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "copy_bandwidth_Bps": bandwidth, "rows": state_rows},
                f, indent=2,
            )  # fmt: skip
        if args.states_only:
            return
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
