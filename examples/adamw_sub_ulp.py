"""Sub-ULP moment updates: a tiny steady gradient under each AdamWSR state format.

    python examples/adamw_sub_ulp.py                                        # CPU (interpreter): ~40 s CPU
    python examples/adamw_sub_ulp.py --steps 1000 --betas 0.99 0.999 --out docs/img   # the docs figure
    python examples/adamw_sub_ulp.py --steps 20000 --betas 0.999 0.9999 --out DIR     # GPU: a longer memory

One tensor of ``--numel`` bf16 weights at 1.0 gets the same small gradient ``g`` at every step. The
moments then follow the closed form ``m_t = g (1 - beta1^t)``, ``v_t = g^2 (1 - beta2^t)``: each step
adds ``(1 - beta) (g - m)`` to ``m`` (``(1 - beta2) (g^2 - v)`` to ``v``), an increment that shrinks
with the distance to the limit. Once it falls below half the spacing of the stored format at the
moment's value (half a bf16 ULP; half an 8-bit code step), round-to-nearest writes back the old value
every step: the stored moment stalls below the limit for good. Stochastic rounding keeps the expected
stored value on the fp32 recursion, so the mean over elements tracks the fp32-state run.

The same AdamWSR step runs once per config below (same weights, gradient, seed and hyperparameters;
only ``state_dtype`` / ``state_rounding`` change), through the Triton interpreter on a CPU, natively
on CUDA:

    fp32      state_dtype=torch.float32                                 (unrounded)
    bf16-sr   state_dtype=torch.bfloat16, state_rounding="stochastic"
    bf16-rn   state_dtype=torch.bfloat16, state_rounding="nearest"
    8bit-sr   state_dtype="8bit",         state_rounding="stochastic"
    8bit-rn   state_dtype="8bit",         state_rounding="nearest"

Recorded (every ``--record-every`` steps): the mean and standard deviation over elements of the stored
``exp_avg`` and ``exp_avg_sq`` (8 bits: decoded with their block scales), the mean weight displacement
``1 - p``, and for each moment the last step at which any stored element changed (nearest: where it
stalled). Writes ``<out>/adamw_sub_ulp.json`` (with the float64 closed form: the moments above and the
displacement ``t * lr * g / (g + eps)``) and ``<out>/adamw_sub_ulp.png``, and prints the final ratios
to the fp32-state run. Deterministic: a repeat prints the same numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the kernels run through the Triton interpreter, chosen before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

# name -> (state_dtype, state_rounding)
CONFIGS = {
    "fp32": (torch.float32, "stochastic"),
    "bf16-sr": (torch.bfloat16, "stochastic"),
    "bf16-rn": (torch.bfloat16, "nearest"),
    "8bit-sr": ("8bit", "stochastic"),
    "8bit-rn": ("8bit", "nearest"),
}
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SERIES = ("exp_avg_mean", "exp_avg_std", "exp_avg_sq_mean", "exp_avg_sq_std", "displacement")


def stored_moments(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored ``exp_avg`` and ``exp_avg_sq`` of an AdamWSR param state as fp32 (8 bits: decoded)."""
    from adamw_sr import _state_codes

    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype != torch.uint8:
        return m.float(), v.float()
    out = []
    for code, scale, bits, signed in (
        (m, state["exp_avg_scale"], _state_codes.EXP_AVG_MANTISSA_BITS, True),
        (v, state["exp_avg_sq_scale"], _state_codes.EXP_AVG_SQ_MANTISSA_BITS, False),
    ):
        per_element = scale.flatten().to(torch.int64).repeat_interleave(_state_codes.QUANT_BLOCK)
        out.append(_state_codes.decode_torch(code.flatten(), per_element[: code.numel()], bits, signed))
    return out[0], out[1]


def run_config(state_dtype, state_rounding: str, args: argparse.Namespace, device: torch.device) -> dict:
    """``args.steps`` AdamWSR steps of the constant gradient on ``args.numel`` weights; the series."""
    import adamw_sr

    p = torch.ones(args.numel, dtype=PARAM_DTYPES[args.param_dtype], device=device)
    opt = adamw_sr.AdamWSR(
        [p], lr=args.lr, betas=tuple(args.betas), eps=args.eps, weight_decay=0.0, seed=args.seed,
        state_dtype=state_dtype, state_rounding=state_rounding,
    )  # fmt: skip
    p.grad = torch.full_like(p, args.grad)
    out = {"steps": [], **{k: [] for k in SERIES}, "exp_avg_last_change": 0, "exp_avg_sq_last_change": 0}
    previous = None
    for step in range(1, args.steps + 1):
        opt.step()
        state = opt.state[p]
        raw = {
            k: state[k].clone()
            for k in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
            if k in state
        }
        if previous is not None:  # the last step that changed a stored bit of each moment
            for key in ("exp_avg", "exp_avg_sq"):
                scale = key + "_scale"
                same = torch.equal(raw[key], previous[key]) and (
                    scale not in raw or torch.equal(raw[scale], previous[scale])
                )
                if not same:
                    out[key + "_last_change"] = step
        previous = raw
        if step % args.record_every == 0 or step in (1, args.steps):
            m, v = stored_moments(state)
            out["steps"].append(step)
            for key, x in (("exp_avg", m), ("exp_avg_sq", v)):
                x = x.double()
                out[key + "_mean"].append(x.mean().item())
                out[key + "_std"].append(x.std().item())
            out["displacement"].append((1.0 - p.double()).mean().item())
    return out


def closed_form(args: argparse.Namespace, steps: list[int]) -> dict:
    """The exact (float64) moments and weight displacement of a constant gradient from a zero state."""
    b1, b2, g = args.betas[0], args.betas[1], args.grad
    return {
        "steps": steps,
        "exp_avg": [g * (1.0 - b1**t) for t in steps],
        "exp_avg_sq": [g * g * (1.0 - b2**t) for t in steps],
        # bias-corrected moments are exactly g and g^2: every step moves the weight lr * g / (g + eps)
        "displacement": [t * args.lr * g / (g + args.eps) for t in steps],
    }


def summary(results: dict) -> dict:
    """Per config: the final mean of each moment and the displacement over the fp32-state run's, the
    spread (std / mean) of each stored moment, and the last step at which each moment changed."""
    ref = results.get("fp32")
    rows = {}
    for name, r in results.items():
        row = {}
        for key in ("exp_avg", "exp_avg_sq"):
            mean = r[key + "_mean"][-1]
            row[key + "_spread"] = r[key + "_std"][-1] / mean if mean else math.nan
            row[key + "_last_change"] = r[key + "_last_change"]
            if ref is not None:
                row[key + "_vs_fp32"] = mean / ref[key + "_mean"][-1]
        if ref is not None:
            row["displacement_vs_fp32"] = r["displacement"][-1] / ref["displacement"][-1]
        rows[name] = row
    return rows


def save_plot(results: dict, exact: dict, args: argparse.Namespace, path: Path, title: str) -> None:
    """Mean stored moments (normalised by their limits g and g^2) and the weight displacement per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = args.grad
    panels = (
        ("exp_avg", g, "mean stored exp_avg / g", f"first moment (beta1 = {args.betas[0]:g})"),
        ("exp_avg_sq", g * g, "mean stored exp_avg_sq / g²", f"second moment (beta2 = {args.betas[1]:g})"),
        ("displacement", args.lr, "mean weight displacement / lr", "weights (1 - p)"),
    )
    colors = {"fp32": "black", "bf16": "tab:blue", "8bit": "tab:red"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=100)
    for ax, (key, unit, ylabel, what) in zip(axes, panels, strict=True):
        ax.plot(
            exact["steps"], [x / unit for x in exact[key]], ":", color="gray", lw=2, label="exact (float64)"
        )
        for name, r in results.items():
            series = r[key + "_mean"] if key != "displacement" else r[key]
            style = "--" if name.endswith("-rn") else "-"
            ax.plot(r["steps"], [x / unit for x in series], style, color=colors[name[:4]], lw=1.2, label=name)
            if key != "displacement" and name.endswith("-sr"):  # the per-element spread of SR
                lo = [(mu - sd) / unit for mu, sd in zip(series, r[key + "_std"], strict=True)]
                hi = [(mu + sd) / unit for mu, sd in zip(series, r[key + "_std"], strict=True)]
                ax.fill_between(r["steps"], lo, hi, color=colors[name[:4]], alpha=0.12, lw=0)
        ax.set_title(what)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per config (default 100)")
    p.add_argument("--numel", type=int, default=4096, help="elements of the tensor (default 4096)")
    p.add_argument("--grad", type=float, default=2.0**-10, help="the constant gradient g (default 2^-10)")
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95), help="beta1 beta2 (default 0.9 0.95)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW eps (default 1e-8)")
    p.add_argument("--seed", type=int, default=0, help="the rounding seed (default 0)")
    p.add_argument("--param-dtype", choices=sorted(PARAM_DTYPES), default="bf16", help="default bf16")
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}"
    )
    p.add_argument("--record-every", type=int, help="record every N steps (default: about 300 points)")
    p.add_argument("--out", default="out", help="folder for adamw_sub_ulp.{json,png} (default: out/)")
    args = p.parse_args(argv)
    args.configs = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in args.configs if n not in CONFIGS]
    if unknown or not args.configs:
        raise SystemExit(f"unknown --configs {unknown or args.configs}; choose from {', '.join(CONFIGS)}")
    if len(set(args.configs)) != len(args.configs):
        raise SystemExit(f"--configs names a config twice: {args.configs}")
    if "fp32" not in args.configs:
        raise SystemExit(
            "--configs must include fp32: the other formats are reported against the fp32-state run"
        )
    if not args.lr > 0.0 or not args.eps > 0.0:
        raise SystemExit(f"--lr and --eps must be > 0, got {args.lr} and {args.eps}")
    for name, value, low in (
        ("--steps", args.steps, 1),
        ("--numel", args.numel, 1),
        ("--seed", args.seed, 0),
    ):
        if value < low:
            raise SystemExit(f"{name} must be >= {low}, got {value}")
    if not all(0.0 <= b < 1.0 for b in args.betas) or not args.grad > 0.0:
        raise SystemExit(f"--betas must lie in [0, 1) and --grad be > 0, got {args.betas} and {args.grad}")
    if args.record_every is None:
        args.record_every = max(1, args.steps // 300)
    elif args.record_every < 1:
        raise SystemExit(f"--record-every must be >= 1, got {args.record_every}")
    return args


def main(argv=None) -> dict:
    """Run every config; returns the JSON's content (also written to ``<out>/adamw_sub_ulp.json``)."""
    import triton

    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    setup = {k: v for k, v in vars(args).items() if k not in ("out", "configs")}
    run = {
        "device": where, "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "setup": setup,
    }  # fmt: skip
    b1, b2 = args.betas
    print(f"{where}: {args.steps} steps, {args.numel} {args.param_dtype} weights, g = {args.grad:g}, "
          f"betas ({b1:g}, {b2:g}), lr {args.lr:g}", flush=True)  # fmt: skip
    results = {}
    for name in args.configs:
        results[name] = run_config(*CONFIGS[name], args, device)
        print(f"  {name} done", flush=True)
    exact = closed_form(args, results[args.configs[0]]["steps"])
    rows = summary(results)
    t = args.steps
    print(f"after {t} steps: exact m = {exact['exp_avg'][-1]:.6g}, v = {exact['exp_avg_sq'][-1]:.6g}")
    print(f"{'config':<9} {'m/fp32':>8} {'v/fp32':>8} {'m spread':>9} {'v spread':>9} {'disp/fp32':>10} "
          f"{'m last change':>14} {'v last change':>14}")  # fmt: skip
    for name, row in rows.items():
        print(
            f"{name:<9} {row.get('exp_avg_vs_fp32', math.nan):>8.4f} "
            f"{row.get('exp_avg_sq_vs_fp32', math.nan):>8.4f} "
            f"{row['exp_avg_spread']:>9.4f} {row['exp_avg_sq_spread']:>9.4f} "
            f"{row.get('displacement_vs_fp32', math.nan):>10.4f} {row['exp_avg_last_change']:>14} "
            f"{row['exp_avg_sq_last_change']:>14}"
        )
    content = {"run": run, "exact": exact, "summary": rows, "configs": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "adamw_sub_ulp.json", "w") as f:
        json.dump(content, f, indent=1)
    title = (
        f"constant gradient g = {args.grad:g}, {args.numel} {args.param_dtype} weights, lr {args.lr:g} "
        f"({where}, torch {torch.__version__}, Triton {triton.__version__}, {run['date']})"
    )
    save_plot(results, exact, args, out / "adamw_sub_ulp.png", title)
    print(f"wrote {out / 'adamw_sub_ulp.json'}, {out / 'adamw_sub_ulp.png'}")
    return content


if __name__ == "__main__":
    main()
