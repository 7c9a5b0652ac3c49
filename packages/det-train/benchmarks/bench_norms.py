"""Benchmark: det_train RMSNorm (fwd+bwd), cross-entropy (fwd+bwd) and embedding backward on the GPU.

Side by side in one process, median of ``triton.testing.do_bench``: ours (every guarantee on: the
canonical-order weight gradients with leaves of 1024 tokens), torch eager and ``torch.compile`` of the
same torch code, and Liger-Kernel where installed ("not installed" otherwise). Real random data.
Prints a markdown table with ratios (peer time / our time: > 1 means we are faster) and writes
``OUT/det-train_norms.md`` and ``OUT/det-train_norms.json``.

    python packages/det-train/benchmarks/bench_norms.py --out bench-results
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]
for _p in (_ROOT / "packages/det-train/torch-ext", _ROOT / "shared/det-core"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

TOKENS = 8192
HIDDEN = 4096
VOCABS = (32000, 50257)
DEVICE = "cuda"  # a CPU dry run of the logic (TRITON_INTERPRET=1, tiny sizes) may override it


def _bench(fn) -> float | str:
    """Median milliseconds, or the error text if the call fails."""
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except Exception as exc:  # one failing peer must not stop the table
        traceback.print_exc(limit=2)
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"


def _liger():
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy, liger_rms_norm

        return liger_rms_norm, liger_cross_entropy
    except Exception:
        return None


def _rms_cases():
    import det_train
    import torch.nn.functional as F

    x = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).bfloat16().requires_grad_()
    dy = torch.randn_like(x)
    eps = 1e-6

    def run(f):
        return lambda: torch.autograd.grad(f(x, w), (x, w), dy)

    torch_fn = lambda a, b: F.rms_norm(a, (HIDDEN,), b, eps)
    peers = {
        "torch": run(torch_fn),
        "torch.compile": run(torch.compile(torch_fn)),
    }
    liger = _liger()
    peers["liger"] = run(lambda a, b: liger[0](a, b, eps)) if liger else "not installed"
    return f"RMSNorm fwd+bwd ({TOKENS}x{HIDDEN} bf16)", run(lambda a, b: det_train.rms_norm(a, b, eps)), peers


def _ce_cases(v):
    import det_train
    import torch.nn.functional as F

    logits = (3 * torch.randn(TOKENS, v, device=DEVICE)).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (TOKENS,), device=DEVICE)

    def run(f):
        return lambda: torch.autograd.grad(f(logits, targets), (logits,))

    torch_fn = lambda a, t: F.cross_entropy(a.float(), t)
    peers = {"torch (fp32 upcast)": run(torch_fn), "torch.compile": run(torch.compile(torch_fn))}
    liger = _liger()
    peers["liger"] = run(lambda a, t: liger[1](a, t)) if liger else "not installed"
    return f"cross-entropy fwd+bwd ({TOKENS}x{v} bf16)", run(det_train.cross_entropy), peers


def _embedding_cases(v):
    import det_train
    import torch.nn.functional as F

    ids = torch.randint(0, v, (TOKENS,), device=DEVICE)
    ids[torch.rand(TOKENS, device=DEVICE) < 0.1] = 13  # a frequent token, as in text
    w = torch.randn(v, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    ours_out = det_train.embedding(ids, w)
    torch_out = F.embedding(ids, w)

    def bwd(out):
        return lambda: torch.autograd.grad(out, (w,), dy, retain_graph=True)

    def with_accumulator():
        acc = det_train.CanonicalGradAccumulator([w], leaf_tokens=1024)
        w.grad = None
        with acc.micro_batch(token_offset=0):
            det_train.embedding(ids, w).backward(dy)
        acc.reduce(total_tokens=TOKENS)

    compiled = torch.compile(lambda i, weight: F.embedding(i, weight))
    peers = {
        "torch": bwd(torch_out),
        "torch.compile": bwd(compiled(ids, w)),
        "ours via accumulator (fwd+bwd+reduce)": with_accumulator,
    }
    return f"embedding bwd ({TOKENS} tokens, V={v}, D={HIDDEN} bf16)", bwd(ours_out), peers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_norms: needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    rows = []
    builders = (
        [_rms_cases]
        + [lambda v=v: _ce_cases(v) for v in VOCABS]
        + [lambda v=v: _embedding_cases(v) for v in VOCABS]
    )
    for build in builders:
        try:
            name, ours, peers = build()
        except Exception:
            traceback.print_exc()
            continue
        ours_ms = _bench(ours)
        row = {"op": name, "ours_ms": ours_ms, "peers": {}}
        for peer, fn in peers.items():
            ms = fn if isinstance(fn, str) else _bench(fn)
            ratio = ms / ours_ms if isinstance(ms, float) and isinstance(ours_ms, float) else None
            row["peers"][peer] = {"ms": ms, "peer_over_ours": ratio}
        rows.append(row)
        print(f"{name}: ours {ours_ms}", {k: v["ms"] for k, v in row["peers"].items()}, flush=True)
        torch.cuda.empty_cache()

    def fmt(ms):
        return f"{ms:.3f}" if isinstance(ms, float) else str(ms)

    lines = [
        "| op | ours (ms) | peer | peer (ms) | peer / ours |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        for peer, res in row["peers"].items():
            ratio = f"{res['peer_over_ours']:.2f}x" if res["peer_over_ours"] is not None else "-"
            lines.append(f"| {row['op']} | {fmt(row['ours_ms'])} | {peer} | {fmt(res['ms'])} | {ratio} |")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "det-train_norms.md").write_text(table)
    payload = {"device": torch.cuda.get_device_name(), "tokens": TOKENS, "hidden": HIDDEN, "rows": rows}
    (args.out / "det-train_norms.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
