"""Ablation: launch variants of the fused AdamW-SR kernel side by side on the GPU (same bits, other speed).

Every candidate is a ``_kernel.LAUNCH_CONFIGS``-style dict (``BLOCK``, ``SUB``, ``num_warps``,
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
``LAUNCH_CONFIGS["cuda"]`` in ``torch-ext/adamw_sr/_kernel.py`` to adopt it.
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
# The bf16- and 8-bit-moment kernel (``--states``): S0 is the config it shipped with (the fp32
# kernel's, masked tiles at SUB: reference for the bits); the others vary what sets its speed, warps
# per SM (registers: EDGE_SUB, maxnreg, SUB per thread) and the window.
_S = dict(BLOCK=2048, SUB=512, num_warps=4, TILE_2D=True, PRECOMPUTED=True)
STATE_CANDIDATES = {
    "S0": ("shipped: fp32 kernel's config, masked tiles of 512", dict(_S)),
    "S1": ("S0 + masked sub-tiles of 128 (1/thread)", dict(_S, EDGE_SUB=128)),
    "S2": ("S0 + masked sub-tiles of 256", dict(_S, EDGE_SUB=256)),
    "S3": ("S1 + maxnreg 40", dict(_S, EDGE_SUB=128, maxnreg=40)),
    "S4": ("S1 + maxnreg 64", dict(_S, EDGE_SUB=128, maxnreg=64)),
    "S5": ("tiles of 1024 x 8 warps, masked 256", dict(_S, SUB=1024, num_warps=8, EDGE_SUB=256)),
    "S6": ("tiles of 256 x 2 warps, masked 64", dict(_S, SUB=256, num_warps=2, EDGE_SUB=64)),
    "S7": ("tiles of 1024 x 4 warps (8/thread), masked 128", dict(_S, SUB=1024, EDGE_SUB=128)),
}
STATE_BYTES = {"bfloat16": 14, "8bit": 4 + 2 + 4 + 4 / 32}  # as bench_adamw.STATE_BYTES_MOVED
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
    from adamw_sr import _launch

    v = fs.views
    plan = _launch.LaunchPlan(v["p"], v["g"], v["m"], v["v"], [], fs.segments, fs.flat["p"].device, config)
    roles = (v["p"], v["g"], v["m"], v["v"], v["v"])

    def run():
        return _launch.launch_fused_step(
            plan, roles, fs.steps, fs.hyper, seed=SEED, amsgrad=False, maximize=False,
            param_bf16=True, stochastic=True,
        )  # fmt: skip

    return run


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1:  # 8-bit codes and scale bytes
        return t
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


def _state_tensors(opt, params):
    states = [opt.state[p] for p in params]
    out = {"p": params, "m": [s["exp_avg"] for s in states], "v": [s["exp_avg_sq"] for s in states]}
    if "exp_avg_scale" in states[0]:
        out["ms"] = [s["exp_avg_scale"] for s in states]
        out["vs"] = [s["exp_avg_sq_scale"] for s in states]
    return out


def _default_bases(params, state_dtype) -> list[int]:
    from adamw_sr import default_base_indices

    align = 32 if state_dtype == "8bit" else 8  # 8-bit params start on a block
    return default_base_indices([p.numel() for p in params], [align] * len(params))


def _check_states_reference(params, saved, out, state_dtype) -> str:
    """S0's step on up to 3 small tensors (and the first) against reference.py (from the saved state)."""
    from adamw_sr import adamw_sr_step_reference

    bases = _default_bases(params, state_dtype)
    picked = [0] + [i for i, p in enumerate(params) if p.numel() <= 1 << 16][:3]
    for i in picked:
        ref = {k: ts[i].cpu().clone() for k, ts in saved.items()}
        adamw_sr_step_reference(
            ref["p"], params[i].grad.cpu(), ref["m"], ref["v"], step=STEP, lr=LR, beta1=BETAS[0],
            beta2=BETAS[1], eps=EPS, weight_decay=WD, seed=SEED, base_index=bases[i],
            exp_avg_scale=ref.get("ms"), exp_avg_sq_scale=ref.get("vs"),
        )  # fmt: skip
        for k, t in ref.items():
            if not torch.equal(_bits(t), out[k][i].cpu()):
                return f"S0 != CPU reference ({k}, tensor {i})"
    return "ok"


def run_states_case(name, shapes, state_dtype, bandwidth, candidates) -> dict:
    """The bf16- or 8-bit-moment kernel under each candidate config: one step from the same state
    (bits compared with S0's; S0's compared with reference.py on a few small tensors), then timed."""
    from adamw_sr import AdamWSR, _kernel, _launch
    from bench_adamw import _params

    params = _params(shapes, torch.bfloat16, torch.bfloat16)
    opt = AdamWSR(params, lr=LR, weight_decay=WD, seed=SEED, state_dtype=state_dtype)
    opt.step()  # states with real values
    tensors = _state_tensors(opt, params)
    saved = {k: [t.clone() for t in ts] for k, ts in tensors.items()}
    grads = [p.grad for p in params]
    roles = (params, grads, tensors["m"], tensors["v"], tensors["v"])
    scales = (tensors.get("ms", ()), tensors.get("vs", ()))
    steps = torch.full((len(params),), float(STEP), device=DEVICE)
    hyper = torch.tensor([LR, *BETAS, EPS, WD], dtype=torch.float64, device=DEVICE)
    n = sum(p.numel() for p in params)
    floor_ms = STATE_BYTES[state_dtype] * n / bandwidth * 1e3
    state_format = {"bfloat16": _kernel.FORMAT_BF16, "8bit": _kernel.FORMAT_8BIT}[state_dtype]
    bases = _default_bases(params, state_dtype)  # the optimizer's global indices
    segments = torch.tensor(
        [(i, 0, p.numel(), b) for i, (p, b) in enumerate(zip(params, bases, strict=True))]
    )

    def reset():
        for k, ts in tensors.items():
            for t, s0 in zip(ts, saved[k], strict=True):
                t.copy_(s0)

    rows, ref_out, cpu_check = {}, None, "not run"
    for cand, (_, config) in candidates.items():
        plan = _launch.LaunchPlan(
            params, grads, tensors["m"], tensors["v"], [], segments, params[0].device, config,
            state_format=state_format, exp_avg_scales=scales[0], exp_avg_sq_scales=scales[1],
        )  # fmt: skip

        def run(plan=plan):
            return _launch.launch_fused_step(
                plan, roles, steps, hyper, seed=SEED, amsgrad=False, maximize=False, param_bf16=True,
                stochastic=True, scales=scales,
            )  # fmt: skip

        reset()
        handle = run()
        torch.cuda.synchronize()
        out = {k: [_bits(t).clone() for t in ts] for k, ts in tensors.items()}
        if ref_out is None:
            ref_out, bits = out, "reference"
            cpu_check = _check_states_reference(params, saved, out, state_dtype)
        else:
            same = all(torch.equal(a, b) for k in out for a, b in zip(out[k], ref_out[k], strict=True))
            bits = "same" if same else "DIFFERENT"
        ms = bench(run)
        regs, spills = getattr(handle, "n_regs", None), getattr(handle, "n_spills", None)
        rows[cand] = {"ms": ms, "x_floor": ms / floor_ms, "bits": bits, "regs": regs, "spills": spills}
        print(
            f"  {name} {state_dtype} {cand}: {ms:.3f} ms ({ms / floor_ms:.2f}x floor) bits {bits} "
            f"regs {regs}/{spills}",
            flush=True,
        )
    return {"case": name, "state_dtype": state_dtype, "floor_ms": floor_ms, "cpu_reference": cpu_check,
            "rows": rows}  # fmt: skip


def states_main(args) -> None:
    """``--states``: the bf16 and 8-bit moment kernels' candidates side by side (602M set and,
    unless ``--no-small``, the 2,000 small tensors)."""
    from adamw_sr import _kernel
    from bench_adamw import copy_bandwidth, llama_shapes, many_small_shapes

    start = time.time()
    keys = [k for k in args.only.split(",") if k] or list(STATE_CANDIDATES)
    candidates = {k: STATE_CANDIDATES[k] for k in (["S0"] + [k for k in keys if k != "S0"])}
    bandwidth = copy_bandwidth()
    gc.collect()
    torch.cuda.empty_cache()
    sets = [("602M", llama_shapes())] + ([] if args.no_small else [("2000small", many_small_shapes())])
    cases = []
    for dt in ("bfloat16", "8bit"):
        for n, s in sets:
            cases.append(run_states_case(n, s, dt, bandwidth, candidates))
            gc.collect()
            torch.cuda.empty_cache()
    lines = [
        f"Copy bandwidth {bandwidth / 1e12:.2f} TB/s; floors: bf16 states 14 B/param, 8-bit 10.125 B/param. "
        + "CPU reference check of S0: "
        + ", ".join(f"{c['case']}/{c['state_dtype']} {c['cpu_reference']}" for c in cases),
        "",
        "| cand | what | "
        + " | ".join(f"{c['case']} {c['state_dtype']} ms (x floor)" for c in cases)
        + " | regs | bits |",
        "|---|---|" + "---|" * len(cases) + "---|---|",
    ]
    for key, (what, _) in candidates.items():
        cells = [f"{c['rows'][key]['ms']:.3f} ({c['rows'][key]['x_floor']:.2f})" for c in cases]
        regs = "/".join(str(c["rows"][key]["regs"]) for c in cases if c["case"] == "602M")
        bits = ",".join(sorted({c["rows"][key]["bits"] for c in cases}))
        lines.append(f"| {key} | {what} | " + " | ".join(cells) + f" | {regs} | {bits} |")
    for c in cases:
        if c["case"] != "602M":
            continue
        valid = [k for k in candidates if all(x["rows"][k]["bits"] in ("same", "reference") for x in cases)]
        best = min(valid, key=lambda k: c["rows"][k]["ms"])
        key = {"bfloat16": "cuda-bf16", "8bit": "cuda-8bit"}[c["state_dtype"]]
        lines.append(f"best on 602M {c['state_dtype']}: {best} {STATE_CANDIDATES[best][1]} "
                     f"(committed {key}: {_kernel.LAUNCH_CONFIGS[key]})")  # fmt: skip
    lines.append(f"runtime {time.time() - start:.0f} s")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "adamw-sr_states_ablation.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "adamw-sr_states_ablation.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "copy_bandwidth_Bps": bandwidth,
                   "candidates": {k: {"what": w, "config": c} for k, (w, c) in candidates.items()},
                   "cases": cases}, f, indent=2)  # fmt: skip


def main(argv=None) -> None:
    from adamw_sr import _kernel
    from bench_adamw import copy_bandwidth, llama_shapes, many_small_shapes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for adamw-sr_ablation.{md,json}")
    parser.add_argument("--only", default="", help="comma-separated candidate keys (default: all)")
    parser.add_argument("--no-step", action="store_true", help="skip the AdamWSR.step() timings")
    parser.add_argument(
        "--states", action="store_true", help="the bf16 / 8-bit moment kernel's candidates (STATE_CANDIDATES)"
    )
    parser.add_argument("--no-small", action="store_true", help="with --states: the 602M set only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ablate_adamw needs a CUDA GPU")
    if args.states:
        states_main(args)
        return
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
        f"Committed default: {_kernel.LAUNCH_CONFIGS['cuda']}",
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
