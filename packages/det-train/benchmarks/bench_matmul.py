"""Benchmark: det_train linear forward, dX and dW against cuBLAS (torch.matmul) and batch_invariant_ops.

For each (M, K, N) of issue 4, in one process, median time of ``triton.testing.do_bench``:

- forward ``Y = X W^T`` (W an nn.Linear weight (N, K), read transposed in place);
- dX ``dY W``;
- dW ``dY^T X`` — ours in the canonical token order (leaves of 8192 tokens, the default of the
  plain backward and of ``CanonicalGradAccumulator``; fp32 subtree workspace + tree), which is what
  every guarantee costs; ``dW 8mb``, the same gradient through the accumulator in 8 micro-batches
  of M / 8 tokens (each leaf's rows carried until the micro-batch that completes it, the tree
  finished by ``reduce``: the cost of micro-batches finer than a leaf; its cuBLAS column is the
  same 8 GEMMs of M / 8 tokens accumulated into a bf16 ``p.grad`` as autograd does, target 0.90x);
  and ``dW@1024``, the plain backward with 1024-token leaves (other bits), the leaf size's speed
  trade-off;

side by side with ``torch.matmul`` (cuBLAS) and ``batch_invariant_ops.matmul_persistent`` (the
published batch-invariant Triton matmul; "not installed" when missing). Prints a markdown table
with TFLOP/s and ratios, writes ``OUT/det-train_matmul.md`` and ``.json``. Targets: forward >= 0.85x
cuBLAS, dX and dW >= 0.80x, dW 8mb >= 0.90x. ``--sweep`` also times candidate configs (for the
fixed table; never used at run time). A config that fails to compile is reported and skipped.

    python packages/det-train/benchmarks/bench_matmul.py --out bench-results [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch

SHAPES = [
    (8192, 4096, 4096),
    (8192, 4096, 14336),
    (8192, 14336, 4096),
    (4096, 8192, 4096),
    (8192, 8192, 8192),
    (1024, 4096, 4096),
]
TARGETS = {"fwd": 0.85, "dX": 0.80, "dW": 0.80, "dW 8mb": 0.90, "dW@1024": None}
LEAF_TOKENS = 8192  # grad_accum.DEFAULT_LEAF_TOKENS
MICRO_BATCHES = 8
# the trade-off row: a finer canonical leaf (CanonicalGradAccumulator(leaf_tokens=1024); other bits)
# closes and merges eight times as many leaves
FINE_LEAF_TOKENS = 1024


def _peer_matmul():
    try:
        from batch_invariant_ops import matmul_persistent
    except ImportError:
        try:
            from batch_invariant_ops.batch_invariant_ops import matmul_persistent
        except ImportError:
            return None
    return matmul_persistent


def _bench(fn) -> float | str:
    """Median milliseconds, or the error text if the call fails (compile errors included)."""
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except Exception as exc:  # keep going: one failing config must not stop the table
        traceback.print_exc(limit=2)
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def _target(target) -> str:
    return f"{target:.2f}x" if target else "—"


def _tflops(flops: float, ms) -> float | None:
    return flops / (ms * 1e-3) / 1e12 if isinstance(ms, float) else None


def _workspace_bytes(m: int, k: int, n: int) -> dict:
    """Extra memory of the canonical dW order for one layer (plain backward, default leaves):
    the kernel's fp32 scratch stack and the fp32 (N, K) nodes it leaves for the torch tree."""
    from det_train.ops.configs import weight_grad_config
    from det_train.ops.weight_grad import _aligned_runs, dw_scratch_shape

    cfg = weight_grad_config(torch.bfloat16, n, k)
    runs = _aligned_runs(0, -(-m // LEAF_TOKENS), cfg.leaves_per_program)
    tiles = -(-n // cfg.block_n) * -(-k // cfg.block_k)
    scratch = 0
    for level, _, count in runs:
        shape = dw_scratch_shape(cfg, level, tiles * count, torch.device("cuda"))
        if shape is not None:
            scratch = max(scratch, shape[0] * shape[1] * shape[2] * 4)
    nodes = 0 if len(runs) == 1 and runs[0][2] == 1 else sum(c for _, _, c in runs) * n * k * 4
    return {"scratch": scratch, "nodes": nodes}


def _cases(m, k, n):
    """name -> {impl -> callable} for one shape, inputs built once (random normal bf16)."""
    from det_train.ops.matmul import launch_matmul
    from det_train.ops.weight_grad import weight_grad_partial

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    peer = _peer_matmul()
    cases = {
        "fwd": {
            "det_train": lambda: launch_matmul(x, w.t(), y),
            "cuBLAS": lambda: torch.matmul(x, w.t()),
        },
        "dX": {
            "det_train": lambda: launch_matmul(dy, w, dx),
            "cuBLAS": lambda: torch.matmul(dy, w),
        },
        "dW": {
            "det_train": lambda: weight_grad_partial(
                dy, x, leaf_tokens=LEAF_TOKENS, finish_dtype=torch.bfloat16
            ),
            "cuBLAS": lambda: torch.matmul(dy.t(), x),
        },
        "dW 8mb": {
            "det_train": _micro_batched_dw(dy, x, n, k),
            "cuBLAS": _micro_batched_cublas(dy, x),
        },
        "dW@1024": {
            "det_train": lambda: weight_grad_partial(
                dy, x, leaf_tokens=FINE_LEAF_TOKENS, finish_dtype=torch.bfloat16
            ),
            "cuBLAS": lambda: torch.matmul(dy.t(), x),
        },
    }
    if peer is not None:
        cases["fwd"]["batch_invariant_ops"] = lambda: peer(x, w.t())
        cases["dX"]["batch_invariant_ops"] = lambda: peer(dy, w)
        cases["dW"]["batch_invariant_ops"] = lambda: peer(dy.t(), x)
        cases["dW 8mb"]["batch_invariant_ops"] = cases["dW"]["batch_invariant_ops"]
        cases["dW@1024"]["batch_invariant_ops"] = cases["dW"]["batch_invariant_ops"]
    return cases, (x, w, dy, y, dx)


def _micro_batched_dw(dy, x, n, k):
    """dW of a Linear weight through ``CanonicalGradAccumulator`` in ``MICRO_BATCHES`` contiguous
    micro-batches (the linear backward's deposit, then ``reduce``): what finer micro-batches cost."""
    import functools

    from det_train.accum.grad_accum import CanonicalGradAccumulator
    from det_train.ops.linear import _weight_leaves

    m = dy.shape[0]
    weight = torch.nn.Parameter(torch.empty(n, k, device="cuda", dtype=torch.bfloat16))
    acc = CanonicalGradAccumulator([weight], leaf_tokens=LEAF_TOKENS)
    leaves = functools.partial(_weight_leaves, LEAF_TOKENS)
    cuts = [(i * m // MICRO_BATCHES, (i + 1) * m // MICRO_BATCHES) for i in range(MICRO_BATCHES)]

    def run():
        weight.grad = None
        for s, e in cuts:
            with acc.micro_batch(token_offset=s):
                acc.deposit_rows(weight, (dy[s:e], x[s:e]), leaves)
        acc.reduce(total_tokens=m)
        return weight.grad

    return run


def _micro_batched_cublas(dy, x):
    """The fair peer of ``dW 8mb``: the same ``MICRO_BATCHES`` dW GEMMs by cuBLAS, accumulated into
    a bf16 ``p.grad`` the way autograd's AccumulateGrad does (the first assigned, the others added)."""
    m = dy.shape[0]
    cuts = [(i * m // MICRO_BATCHES, (i + 1) * m // MICRO_BATCHES) for i in range(MICRO_BATCHES)]

    def run():
        (s, e), rest = cuts[0], cuts[1:]
        grad = torch.matmul(dy[s:e].t(), x[s:e])
        for s, e in rest:
            grad.add_(torch.matmul(dy[s:e].t(), x[s:e]))
        return grad

    return run


def _sweep(m, k, n, tensors) -> list[dict]:
    """Time candidate configs (forward "nt", dX "nn", dW leaves per program) for the table."""
    from det_train.ops import configs
    from det_train.ops.matmul import launch_matmul
    from det_train.ops.weight_grad import weight_grad_partial

    x, w, dy, y, dx = tensors
    flops = 2.0 * m * n * k
    rows = []
    tiles = [
        (128, 256, 8, 3),
        (128, 256, 8, 4),
        (256, 128, 8, 3),
        (128, 128, 4, 4),
        (128, 128, 8, 4),
        (64, 256, 4, 4),
    ]
    for op, a, b, out in (("fwd", x, w.t(), y), ("dX", dy, w, dx)):
        base = configs.matmul_config(torch.bfloat16, configs.layout_of(a, b), b.shape[1], a.shape[1])
        for bm, bn, warps, stages in tiles:
            for group, nk in ((8, False), (16, False), (8, True)):
                if nk and op != "fwd":
                    continue
                cfg = dataclasses.replace(
                    base,
                    block_m=bm,
                    block_n=bn,
                    num_warps=warps,
                    num_stages=stages,
                    group_m=group,
                    b_nk_tiles=nk,
                )
                ms = _bench(lambda cfg=cfg, a=a, b=b, out=out: launch_matmul(a, b, out, config=cfg))
                rows.append(
                    {"op": op, "config": dataclasses.asdict(cfg), "ms": ms, "tflops": _tflops(flops, ms)}
                )
    base = configs.weight_grad_config(torch.bfloat16, n, k)
    for lpp in (1, 2):
        for bn, bk, warps, stages in [(128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 3), (128, 128, 8, 4)]:
            # the leaves-in-registers kernel; benchmarks/ablate_matmul.py compares the lean ones
            cfg = dataclasses.replace(
                base, leaves_per_program=lpp, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                lean=False, tma=False, pairs=False, quads=False, flat=False, programs_per_sm=2,
            )  # fmt: skip
            ms = _bench(
                lambda cfg=cfg: weight_grad_partial(
                    dy, x, leaf_tokens=LEAF_TOKENS, config=cfg, finish_dtype=torch.bfloat16
                )
            )
            rows.append(
                {"op": "dW", "config": dataclasses.asdict(cfg), "ms": ms, "tflops": _tflops(flops, ms)}
            )
    return rows


def _fmt(v) -> str:
    return f"{v:.0f}" if isinstance(v, float) else "—"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs (for the table)")
    parser.add_argument("--shapes", default="", help="subset, e.g. 8192x4096x4096,1024x4096x4096 (M x K x N)")
    parser.add_argument("--ops", default="", help=f"subset of {', '.join(TARGETS)} (comma-separated)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_matmul: needs a CUDA GPU")
        return 1
    shapes = (
        SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    )
    peer_name = "batch_invariant_ops" if _peer_matmul() is not None else None
    results, sweeps = [], {}
    for m, k, n in shapes:
        cases, tensors = _cases(m, k, n)
        flops = 2.0 * m * n * k
        for op, impls in cases.items():
            if args.ops and op not in args.ops.split(","):
                continue
            row = {"M": m, "K": k, "N": n, "op": op}
            for impl, fn in impls.items():
                ms = _bench(fn)
                row[impl] = {"ms": ms, "tflops": _tflops(flops, ms)}
            ours, cublas = row["det_train"]["tflops"], row["cuBLAS"]["tflops"]
            row["ratio_cublas"] = ours / cublas if ours and cublas else None
            if peer_name and row.get(peer_name, {}).get("tflops"):
                row["ratio_peer"] = ours / row[peer_name]["tflops"] if ours else None
            row["target"] = TARGETS[op]  # None: a trade-off row, no target
            if op == "dW":
                row["workspace_bytes"] = _workspace_bytes(m, k, n)
            results.append(row)
            print(
                f"{m}x{k}x{n} {op}: det_train {_fmt(ours)} cuBLAS {_fmt(cublas)} "
                f"ratio {row['ratio_cublas'] or 0:.2f} (target {TARGETS[op] or '-'})",
                flush=True,
            )
        if args.sweep:
            sweeps[f"{m}x{k}x{n}"] = _sweep(m, k, n, tensors)
            for r in sweeps[f"{m}x{k}x{n}"]:
                print(f"  sweep {r['op']} {r['config']}: {_fmt(r['tflops'])} TFLOP/s", flush=True)
        del cases, tensors
        torch.cuda.empty_cache()

    peer_col = peer_name or "batch_invariant_ops"
    lines = [
        "## det-train: matmul / linear (bf16, TFLOP/s, median)",
        "",
        f"dW in the canonical order with leaves of {LEAF_TOKENS} tokens (the default); all guarantees "
        f"on. dW {MICRO_BATCHES}mb: the same bits through CanonicalGradAccumulator in {MICRO_BATCHES} "
        f"micro-batches of M / {MICRO_BATCHES} tokens (open leaves carried), against cuBLAS's same "
        f"{MICRO_BATCHES} GEMMs accumulated into a bf16 p.grad (AccumulateGrad's way). "
        f"dW@{FINE_LEAF_TOKENS}: "
        f"leaves of {FINE_LEAF_TOKENS} tokens (other bits; the leaf size's trade-off, no target). "
        f"{peer_col}: {'matmul_persistent' if peer_name else 'not installed'}.",
        "",
        f"| M x K x N | op | det_train | cuBLAS | {peer_col} | vs cuBLAS | target | vs {peer_col} "
        "| dW workspace |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        peer = _fmt(r[peer_name]["tflops"]) if peer_name else "not installed"
        ratio = f"{r['ratio_cublas']:.2f}x" if r["ratio_cublas"] else "—"
        ok = (
            ""
            if not (r["ratio_cublas"] and r["target"])
            else (" ✓" if r["ratio_cublas"] >= r["target"] else " ✗")
        )
        rp = f"{r['ratio_peer']:.2f}x" if r.get("ratio_peer") else "—"
        ws = ""
        if "workspace_bytes" in r:
            w = r["workspace_bytes"]
            ws = f"{(w['scratch'] + w['nodes']) / 2**20:.1f} MiB (scratch {w['scratch'] / 2**20:.1f})"
        lines.append(
            f"| {r['M']}x{r['K']}x{r['N']} | {r['op']} | {_fmt(r['det_train']['tflops'])} | "
            f"{_fmt(r['cuBLAS']['tflops'])} | {peer} | {ratio}{ok} | {_target(r['target'])} | {rp} | {ws} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "det-train_matmul.md").write_text(table)
    payload = {"shapes": results, "leaf_tokens": LEAF_TOKENS, "peer": peer_name or "not installed"}
    if sweeps:
        payload["sweep"] = sweeps
    (args.out / "det-train_matmul.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
