"""Quality of AdamWSR's optimizer-state formats on the main job: held-out loss per ``state_dtype``.

    python examples/adamw_states_quality.py                        # gpu preset (CUDA): 600 steps each
    python examples/adamw_states_quality.py --steps 2000 --eval-every 100 --out docs/img
    python examples/adamw_states_quality.py --preset tiny --steps 2  # CPU smoke run (Triton interpreter)
    python examples/adamw_states_quality.py --configs 8bit-sr,8bit-rn --merge --out DIR  # add to DIR's run

Trains the main job's model (``examples/train_gpt.py``: bf16 weights, no fp32 master, stochastic
rounding of the weights, deterministic kernels) once per config below, with the same seeds, the same
data order and the same hyperparameters; only how AdamWSR stores its moments changes:

    fp32      state_dtype=torch.float32                                  (the default; moments 8 B/param)
    bf16-sr   state_dtype=torch.bfloat16, state_rounding="stochastic"    (moments 4 B/param)
    bf16-rn   state_dtype=torch.bfloat16, state_rounding="nearest"
    8bit-sr   state_dtype="8bit",         state_rounding="stochastic"    (moments 2.0625 B/param)
    8bit-rn   state_dtype="8bit",         state_rounding="nearest"

Prints the held-out loss (nats/byte, the main job's ``evaluate``) of each config at the end, and writes
``<out>/adamw_states_quality.json`` (per config: train loss per step, held-out loss every
``--eval-every`` steps; the config, device and versions) and ``<out>/adamw_states_quality.png``.
With ``--merge`` the curves already in ``<out>/adamw_states_quality.json`` (from a run with the same
training config) are kept and the new configs added, so the five configs can run in separate,
shorter invocations. Every run is deterministic: a repeat prints the same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the kernels run through the Triton interpreter, chosen before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # imported as examples.adamw_states_quality (tests), or run as a script (examples/ on sys.path)
    from examples import train_gpt
except ModuleNotFoundError:
    import train_gpt

# name -> (state_dtype, state_rounding)
CONFIGS = {
    "fp32": (torch.float32, "stochastic"),
    "bf16-sr": (torch.bfloat16, "stochastic"),
    "bf16-rn": (torch.bfloat16, "nearest"),
    "8bit-sr": ("8bit", "stochastic"),
    "8bit-rn": ("8bit", "nearest"),
}


def train_one(cfg: train_gpt.TrainConfig, state_dtype, state_rounding: str, eval_every: int, device) -> dict:
    """Train ``cfg.steps`` steps with AdamWSR(state_dtype, state_rounding); returns the curves.

    The training loop is the main job's (``train_gpt.train_step``: canonical-order gradients over
    micro-batches, learning-rate schedule), on one rank; only the optimizer is built here.
    """
    import adamw_sr
    import det_train

    train_data, val_data = train_gpt.load_corpus()
    model = train_gpt.build_model(cfg, device)
    opt = adamw_sr.AdamWSR(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
        seed=cfg.seed, stochastic_rounding=cfg.rounding == "stochastic", state_dtype=state_dtype,
        state_rounding=state_rounding,
    )  # fmt: skip
    acc = det_train.CanonicalGradAccumulator(list(model.named_parameters()), leaf_tokens=cfg.leaf_tokens)
    train_loss, val_steps, val_loss = [], [], []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        train_loss.append(train_gpt.train_step(model, opt, acc, cfg, train_data, step, 0, 1, device))
        if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
            val_steps.append(step + 1)
            val_loss.append(train_gpt.evaluate(model, cfg, val_data, device))
            print(
                f"  step {step + 1:>5}/{cfg.steps}: train {train_loss[-1]:.4f}, held-out {val_loss[-1]:.4f} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    return {"train_loss": train_loss, "val_steps": val_steps, "val_loss": val_loss}


def save_plot(curves: dict, path: Path, title: str) -> None:
    """Train loss (per step) and held-out loss (per evaluation) of every config, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for name, c in curves.items():
        style = "--" if name.endswith("-rn") else "-"
        ax_train.plot(range(1, len(c["train_loss"]) + 1), c["train_loss"], style, label=name, linewidth=1.0)
        ax_val.plot(c["val_steps"], c["val_loss"], style, marker="o", markersize=3, label=name)
    for ax, what in ((ax_train, "train loss"), (ax_val, "held-out loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(f"{what} (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(train_gpt.PRESETS), help="default: gpu with CUDA, else cpu")
    p.add_argument("--steps", type=int, help="training steps per config (default: the preset's)")
    p.add_argument(
        "--eval-every", type=int, default=50, help="held-out evaluation every N steps (and at the end)"
    )
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}"
    )
    p.add_argument("--seed", type=int, help="weights, data order and rounding seed (default: the preset's)")
    p.add_argument("--out", default="out", help="folder for adamw_states_quality.{json,png} (default: out/)")
    p.add_argument(
        "--merge", action="store_true", help="keep the configs already in <out>'s JSON (same setup)"
    )
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the comparison; returns ``{config name: curves}`` (also written as JSON)."""
    import triton

    args = parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise SystemExit(f"unknown --configs {unknown or names}; choose from {', '.join(CONFIGS)}")
    if args.eval_every < 1:
        raise SystemExit(f"--eval-every must be >= 1, got {args.eval_every}")
    overrides = {k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v is not None}
    cfg = train_gpt.make_config(args.preset, **overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    run = {
        "device": where,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),  # as the JSON holds it
        "eval_every": args.eval_every,
    }
    out = Path(args.out)
    path = out / "adamw_states_quality.json"
    kept = {}
    if args.merge and path.exists():  # checked before training: a mismatch wastes no run
        old = json.loads(path.read_text())
        setup = {k: old["run"][k] for k in ("config", "eval_every", "device")}
        if setup != {k: run[k] for k in setup}:
            raise SystemExit(f"--merge: {path} was made with another setup ({setup}); use another --out")
        kept = {k: v for k, v in old["curves"].items() if k not in names}
    print(f"{where}: {cfg.steps} steps per config, seed {cfg.seed}, configs {', '.join(names)}", flush=True)
    curves = {}
    for name in names:
        state_dtype, state_rounding = CONFIGS[name]
        print(f"{name}: state_dtype={state_dtype}, state_rounding={state_rounding}", flush=True)
        curves[name] = train_one(cfg, state_dtype, state_rounding, args.eval_every, device)
    curves = {**kept, **curves}
    print(f"{'config':<10} {'held-out loss':>14} {'final train loss':>17}")
    for name, c in curves.items():
        print(f"{name:<10} {c['val_loss'][-1]:>14.4f} {c['train_loss'][-1]:>17.4f}")
    out.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"run": run, "curves": curves}, f, indent=1)
    title = f"AdamWSR state_dtype on the main job ({where}, {run['date']})"
    save_plot(curves, out / "adamw_states_quality.png", title)
    print(f"curves: {path}, {out / 'adamw_states_quality.png'}")
    if not all(math.isfinite(x) for c in curves.values() for x in c["val_loss"]):
        print("some held-out losses are not finite", file=sys.stderr)
    return curves


if __name__ == "__main__":
    main()
