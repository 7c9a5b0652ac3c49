"""Stochastic rounding vs round-to-nearest with bf16-only weights: both loss curves in one plot.

    python examples/plot_rounding.py                      # GPU: the main job's model and kernels
    python examples/plot_rounding.py --preset cpu --kernels torch --lr 3e-5 --steps 150   # CPU

Trains the same model from the same weights on the same batches twice; the only difference is how
AdamWSR rounds each fp32 update into the bf16 weight (``stochastic_rounding=True`` / ``False``).
With ``--kernels torch`` the forward/backward is the plain-torch reference model (fast on a CPU;
the optimizer, the subject here, is AdamWSR either way). Writes a PNG and a JSON of both curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt as tg  # noqa: E402


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(meta: dict, out: Path) -> None:
    """Both curves (raw, faint; moving mean, bold) as a PNG, and ``meta`` beside it as JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, steps_total = meta["runs"], meta["config"]["steps"]
    window = max(1, steps_total // 20)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for (rounding, run), color in zip(runs.items(), ("tab:blue", "tab:red"), strict=True):
        steps = range(1, len(run["losses"]) + 1)
        ax.plot(steps, run["losses"], color=color, alpha=0.25, linewidth=0.8)
        label = f"AdamWSR, {rounding} (held-out {run['val_loss']:.3f})"
        ax.plot(steps, moving_average(run["losses"], window), color=color, linewidth=1.6, label=label)
    ax.set_title(
        f"bf16 weights, no fp32 master: {meta['n_params'] / 1e6:.2g} M params, lr {meta['config']['lr']:g}"
    )
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss (nats/byte, {window}-step mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(tg.PRESETS))
    p.add_argument("--kernels", choices=["det", "torch"], default="det")
    p.add_argument("--steps", type=tg._at_least_one)
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    p.add_argument("--constant-lr", action="store_true", help="no cosine decay after warm-up")
    p.add_argument(
        "--out",
        default="docs/img/rounding.png",
        help="the figure (.png added if it has no suffix) and its JSON beside it; default: the docs' "
        "docs/img/rounding.png, which this replaces",
    )
    p.add_argument("--replot", metavar="JSON", help="only redraw from a JSON this script wrote")
    args = p.parse_args(argv)
    args.out = args.out if Path(args.out).suffix else f"{args.out}.png"  # what savefig writes
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.out))
        return 0
    overrides = {"kernels": args.kernels, "optimizer": "adamw_sr"}
    for key in ("steps", "lr"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.constant_lr:
        overrides["min_lr_ratio"] = 1.0
    cfg = tg.make_config(args.preset, **overrides)

    runs = {}
    for rounding in ("stochastic", "nearest"):
        result = tg.train(dataclasses.replace(cfg, rounding=rounding), progress=True, evaluate_end=True)
        runs[rounding] = {
            "losses": result["losses"],
            "val_loss": result["val_loss"],
            "digest": result["digest"],
        }
        print(
            f"{rounding:>10}: final train loss {result['losses'][-1]:.4f}, held-out {result['val_loss']:.4f}"
        )

    n_params = sum(p.numel() for p in tg.GPT(cfg.model_config(), kernels="torch").parameters())
    meta = {"config": dataclasses.asdict(cfg), "n_params": n_params, "runs": runs}
    plot(meta, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
