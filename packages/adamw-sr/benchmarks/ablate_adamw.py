"""Ablation: launch variants of the fused AdamW-SR kernel side by side on the GPU (same bits, other speed).

Every candidate is a ``kernel.LAUNCH_CONFIGS``-style dict (``BLOCK``, ``SUB``, ``num_warps``,
``TILE_2D``, ``PRECOMPUTED``); none may change a result bit, and this script checks it: each
candidate runs one step from the same saved state and its params, ``exp_avg`` and ``exp_avg_sq``
must equal candidate A's (the original kernel's layout) bit for bit; A itself is checked against the
plain-torch CPU reference on a few small tensors. Then each is timed (median of
triton.testing.do_bench; the kernel alone on prepared launch tables, the scalar launch included when
``PRECOMPUTED``) on the 602 M-param Llama-like set and on 2,000 tensors of 4K-64K elements (bf16
params and grads, fp32 states), against the floor ``22 B/param / copy bandwidth`` measured in the
same run. Last, ``AdamWSR.step()`` (the committed default, host overhead included) on both sets.

    python packages/adamw-sr/benchmarks/ablate_adamw.py --out /tmp/ablate

Reading the table: ``x floor`` is time / floor (target <= 1.10 on the 602 M set, <= 1.5 on the small
set); ``regs`` is registers per thread (65536 / (regs * 32 * warps) programs fit on an SM);
``bits`` must say ``same`` for every row (anything else is a bug: report it). The line ``best`` names
the fastest candidate on the 602 M set among those with the same bits; paste its config into
``LAUNCH_CONFIGS["cuda"]`` in ``torch-ext/adamw_sr/kernel.py`` to adopt it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "torch-ext"))
sys.path.insert(0, HERE)

# name -> (what it isolates, config). A is the kernel as first benchmarked (reference for the bits).
CANDIDATES = {
    "A": ("original: 1-D 4096 x 8 warps, fp64 scalars per program",
          dict(BLOCK=4096, SUB=4096, num_warps=8, TILE_2D=False, PRECOMPUTED=False)),
    "B": ("A + scalars precomputed per tensor",
          dict(BLOCK=4096, SUB=4096, num_warps=8, TILE_2D=False, PRECOMPUTED=True)),
    "C": ("B + [SUB/4, 4] tiles (no layout shuffle)",
          dict(BLOCK=4096, SUB=4096, num_warps=8, TILE_2D=True, PRECOMPUTED=True)),
    "D": ("C as 1024 x 8 warps (4 elements/thread, no loop)",
          dict(BLOCK=1024, SUB=1024, num_warps=8, TILE_2D=True, PRECOMPUTED=True)),
    "E": ("window 8192 in tiles of 512 x 4 warps (4/thread)",
          dict(BLOCK=8192, SUB=512, num_warps=4, TILE_2D=True, PRECOMPUTED=True)),
    "F": ("E with tiles of 1024 x 4 warps (8/thread)",
          dict(BLOCK=8192, SUB=1024, num_warps=4, TILE_2D=True, PRECOMPUTED=True)),
    "G": ("E with tiles of 2048 x 8 warps (8/thread)",
          dict(BLOCK=8192, SUB=2048, num_warps=8, TILE_2D=True, PRECOMPUTED=True)),
    "H": ("E with window 2048",
          dict(BLOCK=2048, SUB=512, num_warps=4, TILE_2D=True, PRECOMPUTED=True)),
    "I": ("E with window 32768",
          dict(BLOCK=32768, SUB=512, num_warps=4, TILE_2D=True, PRECOMPUTED=True)),
    "J": ("E with fp64 scalars per program",
          dict(BLOCK=8192, SUB=512, num_warps=4, TILE_2D=True, PRECOMPUTED=False)),
}  # fmt: skip
BYTES_PER_PARAM = 22  # bf16 p r+w (4) + bf16 g (2) + fp32 m r+w (8) + fp32 v r+w (8)
STEP, LR, BETAS, EPS, WD, SEED = 7, 1e-3, (0.9, 0.999), 1e-8, 0.01, 2**40 + 3
DEVICE = "cuda"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


class FlatSet:
    """bf16 params/grads and fp32 moments of ``shapes`` as views of one buffer per role, at the
    optimizer's default (8-aligned) offsets, so a step can be reset and compared with a few big ops."""

    def __init__(self, shapes, device):
        from adamw_sr import default_base_indices

        numels = [torch.Size(s).numel() for s in shapes]
        self.bases = default_base_indices(numels)
        total = self.bases[-1] + numels[-1]
        self.numel = sum(numels)
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(scale, dtype):
            out = torch.empty(total, dtype=dtype, device=device)
            for start in range(0, total, 1 << 26):  # bounded fp32 temporaries
                stop = min(total, start + (1 << 26))
                x = torch.randn(stop - start, generator=gen, device=device).mul_(scale)
                out[start:stop] = x.to(dtype)
            return out

        self.flat = {
            "p": randn(0.02, torch.bfloat16),
            "g": randn(1e-3, torch.bfloat16),
            "m": randn(1e-4, torch.float32),
            "v": randn(1e-3, torch.float32).square_(),
        }
        self.views = {
            k: [buf[b : b + n].view(s) for b, n, s in zip(self.bases, numels, shapes, strict=True)]
            for k, buf in self.flat.items()
        }
        self.saved = {k: self.flat[k].clone() for k in ("p", "m", "v")}
        rows = [(i, 0, n, b) for i, (n, b) in enumerate(zip(numels, self.bases, strict=True))]
        self.segments = torch.tensor(rows, dtype=torch.int64)
        self.steps = torch.full((len(shapes),), float(STEP), device=device)
        self.hyper = torch.tensor([LR, *BETAS, EPS, WD], dtype=torch.float64, device=device)

    def reset(self):
        for k, saved in self.saved.items():
            self.flat[k].copy_(saved)

    def outputs(self):
        return {k: self.flat[k].clone() for k in ("p", "m", "v")}


def launcher(fs: FlatSet, config: dict):
    from adamw_sr import launch

    v = fs.views
    plan = launch.LaunchPlan(v["p"], v["g"], v["m"], v["v"], [], fs.segments, fs.flat["p"].device, config)
    roles = (v["p"], v["g"], v["m"], v["v"], v["v"])

    def run():
        return launch.launch_fused_step(
            plan, roles, fs.steps, fs.hyper, seed=SEED, amsgrad=False, maximize=False,
            param_bf16=True, stochastic=True,
        )  # fmt: skip

    return run


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_against_cpu_reference(fs: FlatSet, slots) -> str:
    """Candidate A's result (current flat contents after one step from the saved state) vs reference.py."""
    from adamw_sr import adamw_sr_step_reference

    for i in slots:
        b, n = fs.bases[i], fs.views["p"][i].numel()
        p, m, v = (fs.saved[k][b : b + n].cpu().clone() for k in ("p", "m", "v"))
        g = fs.flat["g"][b : b + n].cpu()
        adamw_sr_step_reference(
            p, g, m, v, step=STEP, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
            seed=SEED, base_index=b,
        )  # fmt: skip
        for k, ref in (("p", p), ("m", m), ("v", v)):
            if not torch.equal(_bits(fs.flat[k][b : b + n].cpu()), _bits(ref)):
                return f"A != CPU reference ({k}, tensor {i})"
    return "ok"


def run_case(name, shapes, floor_ms_per_param, candidates) -> dict:
    fs = FlatSet(shapes, DEVICE)
    floor_ms = floor_ms_per_param * fs.numel
    rows, ref_out, cpu_check = {}, None, "not run"
    for key, (_, config) in candidates.items():
        run = launcher(fs, config)
        fs.reset()
        handle = run()  # compiles on first use
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        if ref_out is None:
            ref_out = fs.outputs()
            small = [i for i, s in enumerate(shapes) if torch.Size(s).numel() <= 1 << 16][:3]
            cpu_check = check_against_cpu_reference(fs, small)
            bits = "reference"
        else:
            same = all(torch.equal(_bits(fs.flat[k]), _bits(ref_out[k])) for k in ref_out)
            bits = "same" if same else "DIFFERENT"
        ms = bench(run)
        rows[key] = {
            "ms": ms,
            "x_floor": ms / floor_ms,
            "bits": bits,
            "regs": getattr(handle, "n_regs", None),
            "spills": getattr(handle, "n_spills", None),
        }
        regs = rows[key]["regs"]
        print(f"  {name} {key}: {ms:.3f} ms ({ms / floor_ms:.2f}x floor) bits {bits} regs {regs}", flush=True)
    del fs, ref_out
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "case": name,
        "tensors": len(shapes),
        "floor_ms": floor_ms,
        "cpu_reference": cpu_check,
        "rows": rows,
    }


def time_step(shapes) -> float:
    """``AdamWSR.step()`` with the committed default config (host overhead included)."""
    from adamw_sr import AdamWSR
    from adamw_sr.functional import PLAN_CACHE

    params = []
    for s in shapes:
        p = torch.randn(s, device="cuda").mul_(0.02).to(torch.bfloat16)
        p.grad = torch.randn(s, device="cuda").mul_(1e-3).to(torch.bfloat16)
        params.append(p)
    opt = AdamWSR(params, lr=LR, weight_decay=WD, seed=SEED)
    opt.step()
    ms = bench(opt.step)
    del opt, params
    PLAN_CACHE.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def main(argv=None) -> None:
    from adamw_sr import kernel
    from bench_adamw import copy_bandwidth, llama_shapes, many_small_shapes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for adamw-sr_ablation.{md,json}")
    parser.add_argument("--only", default="", help="comma-separated candidate keys (default: all)")
    parser.add_argument("--no-step", action="store_true", help="skip the AdamWSR.step() timings")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ablate_adamw needs a CUDA GPU")
    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    keys = [k for k in args.only.split(",") if k] or list(CANDIDATES)
    candidates = {k: CANDIDATES[k] for k in (["A"] + [k for k in keys if k != "A"])}
    bandwidth = copy_bandwidth()
    gc.collect()
    torch.cuda.empty_cache()
    per_param = BYTES_PER_PARAM / bandwidth * 1e3
    cases = [
        run_case("602M", llama_shapes(), per_param, candidates),
        run_case("2000small", many_small_shapes(), per_param, candidates),
    ]
    steps = {}
    if not args.no_step:
        steps = {"602M": time_step(llama_shapes()), "2000small": time_step(many_small_shapes())}

    lines = [
        f"Copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor = 22 B/param / bandwidth: "
        + ", ".join(f"{c['case']} {c['floor_ms']:.3f} ms" for c in cases)
        + f". CPU reference check of A: {', '.join(c['cpu_reference'] for c in cases)}. "
        f"Committed default: {kernel.LAUNCH_CONFIGS['cuda']}",
        "",
        "| cand | what | 602M ms | x floor | 2000small ms | x floor | regs | bits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, (what, _) in candidates.items():
        big, small = (c["rows"][key] for c in cases)
        bits = big["bits"] if big["bits"] == small["bits"] else f"{big['bits']}/{small['bits']}"
        lines.append(
            f"| {key} | {what} | {big['ms']:.3f} | {big['x_floor']:.2f} | {small['ms']:.3f} | "
            f"{small['x_floor']:.2f} | {big['regs']}/{big['spills']} | {bits} |"
        )
    valid = [k for k in candidates if all(c["rows"][k]["bits"] in ("same", "reference") for c in cases)]
    best = min(valid, key=lambda k: cases[0]["rows"][k]["ms"])
    best_small = min(valid, key=lambda k: cases[1]["rows"][k]["ms"])
    lines += [
        "",
        f"best on 602M: {best} {CANDIDATES[best][1]}",
        f"best on 2000small: {best_small} {CANDIDATES[best_small][1]}",
    ]
    if steps:
        lines.append(
            "AdamWSR.step() (default config, host included): "
            + ", ".join(f"{k} {v:.3f} ms" for k, v in steps.items())
        )
    lines.append(f"runtime {time.time() - start:.0f} s")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "adamw-sr_ablation.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "adamw-sr_ablation.json"), "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "copy_bandwidth_Bps": bandwidth,
                "candidates": {k: {"what": w, "config": c} for k, (w, c) in candidates.items()},
                "cases": cases,
                "step_ms": steps,
                "best_602M": best,
                "best_2000small": best_small,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
