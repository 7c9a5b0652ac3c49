"""The card's headline figure: 6,000 AdamW steps of 1e-4 from weights 1.0 toward a 1.5 target, in bf16.

Round-to-nearest drops every update (1e-4 is ~40x below a bf16 ULP just under 1.0) and the mean weight
never leaves 1.0000; stochastic rounding accumulates the updates and converges toward 1.5, tracking
fp32 weights; a second SR run is checked to be bitwise identical. Runs on CPU through the plain-torch
reference (bit-identical to the kernel), in about a minute.

    python packages/adamw-sr/benchmarks/plot_headline.py --out docs/img/adamw_sr_headline.png
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "torch-ext"))


def run(n: int, steps: int, lr: float, dtype, stochastic_rounding, seed: int = 0):
    """Mean weight per step of ``n`` weights pulled from 1.0 toward 1.5 (loss 0.5 * (w - 1.5)^2)."""
    from adamw_sr import adamw_sr_step_reference

    w = torch.ones(n, dtype=dtype)
    m, v = torch.zeros(n), torch.zeros(n)
    means = []
    for step in range(1, steps + 1):
        grad = (w.float() - 1.5).to(dtype)
        kw = dict(lr=lr, weight_decay=0.0, stochastic_rounding=stochastic_rounding, seed=seed)
        adamw_sr_step_reference(w, grad, m, v, step=step, **kw)
        means.append(w.double().mean().item())
    return w, means


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/adamw_sr_headline.png")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--n", type=int, default=512, help="number of weights")
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w_sr, sr = run(args.n, args.steps, args.lr, torch.bfloat16, None)
    w_sr2, _ = run(args.n, args.steps, args.lr, torch.bfloat16, None)
    identical = torch.equal(w_sr.view(torch.int16), w_sr2.view(torch.int16))
    _, rn = run(args.n, args.steps, args.lr, torch.bfloat16, False)
    _, fp32 = run(args.n, args.steps, args.lr, torch.float32, None)
    print(f"final mean weight: SR {sr[-1]:.4f}, nearest {rn[-1]:.4f}, fp32 {fp32[-1]:.4f}")
    print(f"repeated SR run bitwise identical: {identical}")

    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(1, args.steps + 1)
    ax.axhline(1.5, color="#999999", linestyle=":", label="target 1.5")
    ax.plot(x, sr, color="#1f77b4", linewidth=3, label="bf16, stochastic rounding (AdamWSR)")
    ax.plot(x, fp32, color="black", linewidth=1, linestyle="--", label="fp32 weights (for comparison)")
    ax.plot(x, rn, color="#d62728", linewidth=2, label="bf16, round-to-nearest")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"mean weight ({args.n} weights)")
    ax.set_title(f"AdamW, lr {args.lr:g} (~40x below one bf16 ULP), no fp32 master copy")
    ax.legend(loc="center right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
