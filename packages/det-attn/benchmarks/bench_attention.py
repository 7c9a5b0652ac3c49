"""Benchmark: det_attn forward and forward+backward against torch SDPA's flash, cuDNN and efficient backends.

For each shape (bf16, causal; B4 H32 T4096 D128 is the headline, also T 1024 / 8192 and D 64),
in one process, median time of ``triton.testing.do_bench`` (which flushes L2 between calls; the
inputs, 32-256 MiB each, are larger than L2 anyway) on real random data:

- forward: ``o = attn(q, k, v)`` without autograd;
- forward+backward: ``attn(q, k, v).backward(do)``; also with the backward on the calling thread
  (``torch.autograd.set_multithreading_enabled(False)``, every method alike: autograd's CUDA
  device thread adds host time to a backward written in Python);
- "bitwise repeat": whether dq, dk, dv come out with the same bits in 3 runs (only det_attn and
  SDPA's efficient backend are expected to).

TFLOP/s count 4*B*H*T*T*D forward (half for causal), 2.5x that for the backward (the
FlashAttention convention). Prints a markdown table with ratios to the peers, writes
``OUT/det-attn_attention.md`` and ``.json``. Targets: forward >= 0.80x cuDNN; forward+backward
>= 0.60x cuDNN and >= 2x efficient. ``--sweep`` also times candidate kernel configs at the
headline shapes (to choose the fixed table; never used at run time).

``--compile`` times instead det_attn eager against ``torch.compile(fullgraph=True)`` (Inductor;
``--compile-mode`` passes a mode such as ``max-autotune-no-cudagraphs``), forward+backward, two
ways per shape: ``attention`` alone on given q, k, v, and in a block (bias-free q/k/v and output
projections, causal attention, residual; width H*D). Target: compiled no slower than eager.
Also reports whether the compiled run gives the eager bits (attention: o, dq, dk, dv; block: y,
dx and the weight gradients; the block's matmuls are Inductor's choice). Writes
``OUT/det-attn_compile.md`` and ``.json``.

``--window`` times instead sliding-window attention (causal, B4 H32 T8192 D128; windows 1024 and
4096, and 4096 with Gemma 2's logit soft-cap 50) against torch SDPA given the sliding-window mask
explicitly (cuDNN and efficient backends, where they accept a mask; SDPA has no soft-cap, so that
row has det_attn alone), with det_attn's plain causal attention as the no-window cost. TFLOP/s
count the scores inside the window only (``4 * B * H * D * sum_i min(i + 1, window)`` forward).
Writes ``OUT/det-attn_window.md`` and ``.json``.

    python packages/det-attn/benchmarks/bench_attention.py --out bench-results [--sweep]
    python packages/det-attn/benchmarks/bench_attention.py --out bench-results --compile
    python packages/det-attn/benchmarks/bench_attention.py --out bench-results --window
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch

# (B, H, T, D, causal)
SHAPES = [
    (4, 32, 4096, 128, True),
    (4, 32, 1024, 128, True),
    (4, 32, 8192, 128, True),
    (4, 32, 4096, 64, True),
    (4, 32, 4096, 128, False),
]
TARGETS = {"fwd vs cuDNN": 0.80, "fwd+bwd vs cuDNN": 0.60, "fwd+bwd vs efficient": 2.0}
PEERS = {
    "sdpa flash": "FLASH_ATTENTION",
    "sdpa cuDNN": "CUDNN_ATTENTION",
    "sdpa efficient": "EFFICIENT_ATTENTION",
}


def _bench(fn, grad_to_none=None) -> float | str:
    """Median milliseconds, or the error text if the call fails."""
    import triton.testing

    try:
        return float(
            triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
        )
    except Exception as exc:  # one failing method must not stop the table
        traceback.print_exc(limit=2)
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def _tflops(flops: float, ms) -> float | None:
    return flops / (ms * 1e-3) / 1e12 if isinstance(ms, float) else None


def _methods(causal: bool):
    """name -> (layout, fn(q, k, v)); layout 'bthd' for det_attn, 'bhtd' for SDPA."""
    from det_attn import attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    methods = {"det_attn": ("bthd", lambda q, k, v: attention(q, k, v, causal=causal))}
    for name, backend in PEERS.items():
        backend = getattr(SDPBackend, backend)

        def run(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        methods[name] = ("bhtd", run)
    return methods


def _inputs(b, h, t, d, layout, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (b, t, h, d) if layout == "bthd" else (b, h, t, d)
    return [torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def _bitwise_repeat(fn, q, k, v, do) -> bool | str:
    try:
        grads = []
        for _ in range(3):
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v).backward(do)
            grads.append([t.grad.clone() for t in (q, k, v)])
        return all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for g in grads[1:]
            for a, b in zip(g, grads[0], strict=True)
        )
    except Exception as exc:
        return f"error: {type(exc).__name__}"


def _fwd_bwd_calling_thread(fn, q, k, v, do):
    # autograd runs a CUDA backward in its device thread by default; a backward written in Python
    # (ours: it launches Triton kernels) paid ~0.8 ms more host time per call there in one probe
    # (H200 machine, torch 2.11), not in later runs. Same setting for every method.
    with torch.autograd.set_multithreading_enabled(False):
        fn(q, k, v).backward(do)


def _measure_method(fn, layout, b, h, t, d) -> tuple:
    q, k, v, do = _inputs(b, h, t, d, layout)
    with torch.no_grad():
        fwd = _bench(lambda: fn(q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    both = _bench(lambda: fn(q, k, v).backward(do), grad_to_none=[q, k, v])
    one_thread = _bench(lambda: _fwd_bwd_calling_thread(fn, q, k, v, do), grad_to_none=[q, k, v])
    repeat = _bitwise_repeat(fn, q, k, v, do) if isinstance(both, float) else "n/a"
    return fwd, both, one_thread, repeat


def measure(shape) -> list[dict]:
    b, h, t, d, causal = shape
    fwd_flops = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
    return _measure_rows(
        f"B{b} H{h} T{t} D{d}{' causal' if causal else ''}", _methods(causal), shape, fwd_flops
    )


def _measure_rows(label: str, methods: dict, shape: tuple, fwd_flops: float) -> list[dict]:
    """One row per method of ``methods`` (name -> (layout, fn)) at ``shape`` ``(B, H, T, D, ...)``."""
    b, h, t, d = shape[:4]
    rows = []
    for name, (layout, fn) in methods.items():
        fwd, both, one_thread, repeat = _measure_method(fn, layout, b, h, t, d)
        torch.cuda.empty_cache()
        rows.append(
            {
                "shape": label,
                "method": name,
                "fwd_ms": fwd,
                "fwd_tflops": _tflops(fwd_flops, fwd),
                "fwdbwd_ms": both,
                "fwdbwd_tflops": _tflops(3.5 * fwd_flops, both),
                "fwdbwd_1t_ms": one_thread,
                "fwdbwd_1t_tflops": _tflops(3.5 * fwd_flops, one_thread),
                "bitwise_repeat": repeat,
            }
        )
    return rows


def _ratio(rows, method, peer, key):
    ours = next(r[key] for r in rows if r["method"] == method)
    theirs = next(r[key] for r in rows if r["method"] == peer)
    ok = isinstance(ours, float) and isinstance(theirs, float) and theirs  # not an error text
    return ours / theirs if ok else None


def _fmt(x, digits=1):
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x[:40]
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.{digits}f}"


def table(all_rows: list[dict]) -> str:
    lines = [
        "| shape (bf16) | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
        "| fwd+bwd ms, backward on the calling thread | grads bitwise on repeat |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in all_rows:
        lines.append(
            f"| {r['shape']} | {r['method']} | {_fmt(r['fwd_ms'], 3)} | {_fmt(r['fwd_tflops'])} | "
            f"{_fmt(r['fwdbwd_ms'], 3)} | {_fmt(r['fwdbwd_tflops'])} | {_fmt(r.get('fwdbwd_1t_ms'), 3)} | "
            f"{_fmt(r['bitwise_repeat'])} |"
        )
    lines += [
        "",
        "| shape | fwd / cuDNN (>= 0.80) | fwd+bwd / cuDNN (>= 0.60) | fwd+bwd / efficient (>= 2) "
        "| fwd / flash | fwd+bwd / flash | fwd+bwd / cuDNN, calling-thread backward "
        "| fwd+bwd / efficient, calling-thread backward |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in dict.fromkeys(r["shape"] for r in all_rows):
        rows = [r for r in all_rows if r["shape"] == shape]
        ratios = [
            _ratio(rows, "det_attn", "sdpa cuDNN", "fwd_tflops"),
            _ratio(rows, "det_attn", "sdpa cuDNN", "fwdbwd_tflops"),
            _ratio(rows, "det_attn", "sdpa efficient", "fwdbwd_tflops"),
            _ratio(rows, "det_attn", "sdpa flash", "fwd_tflops"),
            _ratio(rows, "det_attn", "sdpa flash", "fwdbwd_tflops"),
            _ratio(rows, "det_attn", "sdpa cuDNN", "fwdbwd_1t_tflops"),
            _ratio(rows, "det_attn", "sdpa efficient", "fwdbwd_1t_tflops"),
        ]
        lines.append(f"| {shape} | " + " | ".join(_fmt(x, 2) for x in ratios) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- sliding window

# (B, H, T, D, window, softcap), causal
WINDOW_SHAPES = [
    (4, 32, 8192, 128, 1024, None),
    (4, 32, 8192, 128, 4096, None),
    (4, 32, 8192, 128, 4096, 50.0),
]
MASK_PEERS = {"sdpa cuDNN, mask": "CUDNN_ATTENTION", "sdpa efficient, mask": "EFFICIENT_ATTENTION"}


def window_keys(t: int, window: int) -> int:
    """Scores inside a causal sliding window over ``t`` tokens: ``sum_i min(i + 1, window)``."""
    w = min(window, t)
    return w * (w + 1) // 2 + (t - w) * w


def sliding_window_mask(t: int, window: int, device="cuda") -> torch.Tensor:
    """The ``(t, t)`` boolean mask (True: attend) of det_attn's ``window`` with ``causal=True``:
    key ``j`` visible to query ``i`` iff ``i - window < j <= i`` (transformers' sliding window)."""
    i = torch.arange(t, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def _window_methods(t: int, window: int, softcap: float | None) -> dict:
    """name -> (layout, fn(q, k, v)) for one sliding-window row."""
    from det_attn import attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    methods = {
        "det_attn": ("bthd", lambda q, k, v: attention(q, k, v, causal=True, window=window, softcap=softcap)),
        "det_attn causal, no window": ("bthd", lambda q, k, v: attention(q, k, v, causal=True)),
    }
    if softcap is None:  # SDPA has no soft-cap
        mask = sliding_window_mask(t, window)
        for name, backend in MASK_PEERS.items():
            backend = getattr(SDPBackend, backend)

            def run(q, k, v, backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

            methods[name] = ("bhtd", run)
    return methods


def window_rows() -> list[dict]:
    rows = []
    for shape in WINDOW_SHAPES:
        b, h, t, d, window, softcap = shape
        label = f"B{b} H{h} T{t} D{d} causal window {window}" + (f" softcap {softcap:g}" if softcap else "")
        fwd_flops = 4.0 * b * h * d * window_keys(t, window)
        rows += _measure_rows(label, _window_methods(t, window, softcap), shape, fwd_flops)
    return rows


def window_table(all_rows: list[dict]) -> str:
    """The rows (TFLOP/s over the window's scores; the no-window row's too, so its TFLOP/s are not
    its own rate) and det_attn's time against each other method of its shape."""
    lines = [
        "| shape (bf16) | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
        "| grads bitwise on repeat |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in all_rows:
        lines.append(
            f"| {r['shape']} | {r['method']} | {_fmt(r['fwd_ms'], 3)} | {_fmt(r['fwd_tflops'])} | "
            f"{_fmt(r['fwdbwd_ms'], 3)} | {_fmt(r['fwdbwd_tflops'])} | {_fmt(r['bitwise_repeat'])} |"
        )
    lines += ["", "| shape | other method | fwd: its ms / det_attn's | fwd+bwd: its ms / det_attn's |"]
    lines.append("|---|---|---:|---:|")
    for shape in dict.fromkeys(r["shape"] for r in all_rows):
        rows = [r for r in all_rows if r["shape"] == shape]
        for r in rows:
            if r["method"] != "det_attn":
                fwd = _ratio(rows, r["method"], "det_attn", "fwd_ms")
                both = _ratio(rows, r["method"], "det_attn", "fwdbwd_ms")
                lines.append(f"| {shape} | {r['method']} | {_fmt(fwd, 2)} | {_fmt(both, 2)} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- config sweep

SWEEP_FWD = [
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 32, 4, 3),
]
SWEEP_DKDV = [
    (64, 64, 8, 3),
    (32, 128, 8, 3),
    (16, 128, 8, 3),
    (32, 64, 4, 3),
    (64, 128, 8, 2),
    (32, 128, 4, 5),
]
SWEEP_DQ = [(64, 32, 8, 3), (64, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 4, 5)]


def sweep() -> list[dict]:
    """Time candidate (BLOCK_M, BLOCK_N, warps, stages) configs at B4 H32 T4096 causal, D 64 and 128.

    One kernel's config varies at a time, the others stay at the table's (a forward tile other
    than the table's runs without its register cap); the backward rows give the TFLOP/s of the
    whole backward (preprocess + dK/dV + dQ).
    """
    from det_attn import _configs, attention

    results = []
    saved = dict(_configs.GPU_CONFIGS)
    fields = {
        "fwd": ("fwd_block_m", "fwd_block_n", "fwd_warps", "fwd_stages"),
        "dkdv": ("dkdv_block_m", "dkdv_block_n", "dkdv_warps", "dkdv_stages"),
        "dq": ("dq_block_m", "dq_block_n", "dq_warps", "dq_stages"),
    }
    try:
        for d in (64, 128):
            base = saved[d]
            b, h, t = 4, 32, 4096
            flops = 4.0 * b * h * t * t * d * 0.5
            q, k, v, do = _inputs(b, h, t, d, "bthd")
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            for kernel, candidates in (("fwd", SWEEP_FWD), ("dkdv", SWEEP_DKDV), ("dq", SWEEP_DQ)):
                for config in candidates:
                    change = dict(zip(fields[kernel], config, strict=True))
                    if kernel == "fwd" and config[:2] != (base.fwd_block_m, base.fwd_block_n):
                        change["fwd_maxnreg"] = 0  # the table's register cap fits its own tile only
                    _configs.GPU_CONFIGS[d] = dataclasses.replace(base, **change)
                    if kernel == "fwd":
                        with torch.no_grad():
                            ms = _bench(lambda q=q, k=k, v=v: attention(q, k, v, causal=True))
                        tflops = _tflops(flops, ms)
                    else:  # the backward launches with the forward's plan: a forward per candidate
                        o = attention(qg, kg, vg, causal=True)
                        ms = _bench(
                            lambda o=o, do=do: o.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg]
                        )
                        tflops = _tflops(2.5 * flops, ms)
                    results.append({"d": d, "kernel": kernel, "config": config, "tflops": tflops})
                _configs.GPU_CONFIGS[d] = base
    finally:
        _configs.GPU_CONFIGS.clear()
        _configs.GPU_CONFIGS.update(saved)
    return results


# --------------------------------------------------------------------------- eager vs torch.compile

# (B, H_q, H_kv, T, D), causal
COMPILE_SHAPES = [(4, 32, 8, 1024, 128), (4, 32, 8, 4096, 128), (8, 16, 16, 512, 64), (1, 16, 4, 128, 128)]


class _Block(torch.nn.Module):
    """Bias-free fused q/k/v projection, causal det_attn attention, output projection, residual."""

    def __init__(self, heads: int, kv_heads: int, d: int) -> None:
        super().__init__()
        width = heads * d
        self.d, self.split = d, (heads, kv_heads, kv_heads)
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * d, bias=False, dtype=torch.bfloat16)
        self.out = torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        from det_attn import attention

        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, -1, self.d).split(self.split, dim=2)
        return x + self.out(attention(q, k, v, causal=True).reshape(b, t, -1))


def _same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _eager_vs_compiled(eager, inputs, grad_out, params, mode) -> dict:
    """fwd+bwd ms of ``eager`` and of its torch.compile, and whether the outputs and the gradients
    of ``inputs`` and ``params`` have the same bits."""
    compiled = torch.compile(eager, fullgraph=True, mode=mode)
    leaves = [*inputs, *params]

    def step(fn):
        for t in leaves:
            t.grad = None
        out = fn(*inputs)
        out.backward(grad_out)
        return [out.detach(), *(t.grad.clone() for t in leaves)]

    bits = all(_same(a, b) for a, b in zip(step(compiled), step(eager), strict=True))
    row = {"bitwise": bits}
    for name, fn in (("eager", eager), ("compiled", compiled)):
        row[f"{name}_ms"] = _bench(lambda fn=fn: fn(*inputs).backward(grad_out), grad_to_none=leaves)
    return row


def compile_rows(mode: str | None) -> list[dict]:
    from det_attn import attention

    rows = []
    for b, h, h_kv, t, d in COMPILE_SHAPES:
        shape = f"B{b} H{h}/{h_kv} T{t} D{d} causal"
        g = torch.Generator(device="cuda").manual_seed(0)

        def randn(*size, g=g):
            return torch.randn(size, generator=g, device="cuda", dtype=torch.bfloat16)

        q, k, v = (randn(b, t, n, d).requires_grad_() for n in (h, h_kv, h_kv))
        row = _eager_vs_compiled(
            lambda q, k, v: attention(q, k, v, causal=True), (q, k, v), randn(b, t, h, d), [], mode
        )
        rows.append({"shape": shape, "what": "attention", **row})
        torch.manual_seed(0)
        block = _Block(h, h_kv, d).cuda()
        x = randn(b, t, h * d).requires_grad_()
        row = _eager_vs_compiled(block, (x,), randn(b, t, h * d), list(block.parameters()), mode)
        rows.append({"shape": shape, "what": "block", **row})
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def compile_table(rows: list[dict], mode: str | None) -> str:
    lines = [
        f"det_attn forward+backward, eager vs torch.compile(fullgraph=True, mode={mode!r}), Inductor, bf16",
        "",
        "| shape | what | eager ms | compiled ms | compiled / eager (<= 1) | compiled bits == eager |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = isinstance(r["eager_ms"], float) and isinstance(r["compiled_ms"], float)
        ratio = r["compiled_ms"] / r["eager_ms"] if ok else None
        lines.append(
            f"| {r['shape']} | {r['what']} | {_fmt(r['eager_ms'], 3)} | {_fmt(r['compiled_ms'], 3)} | "
            f"{_fmt(ratio, 3)} | {_fmt(r['bitwise'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--sweep", action="store_true", help="also time candidate kernel configs")
    parser.add_argument("--compile", action="store_true", help="only: eager vs torch.compile (Inductor)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode for --compile")
    parser.add_argument(
        "--window", action="store_true", help="only: sliding window (and soft-cap) vs SDPA with a mask"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    if args.window:
        rows = window_rows()
        text = "## det-attn: sliding window, bf16, " + torch.cuda.get_device_name() + "\n\n"
        text += window_table(rows)
        text += f"\n\ntorch {torch.__version__}, triton {__import__('triton').__version__}"
        print(text)
        (args.out / "det-attn_window.md").write_text(text + "\n")
        (args.out / "det-attn_window.json").write_text(json.dumps({"rows": rows}, indent=2, default=str))
        return 0
    if args.compile:
        rows = compile_rows(args.compile_mode)
        text = "## det-attn under torch.compile, " + torch.cuda.get_device_name() + "\n\n"
        text += compile_table(rows, args.compile_mode)
        text += f"\n\ntorch {torch.__version__}, triton {__import__('triton').__version__}"
        print(text)
        (args.out / "det-attn_compile.md").write_text(text + "\n")
        (args.out / "det-attn_compile.json").write_text(
            json.dumps({"mode": args.compile_mode, "rows": rows}, indent=2)
        )
        return 0
    rows = []
    for shape in SHAPES:
        rows += measure(shape)
    text = "## det-attn: attention, bf16, " + torch.cuda.get_device_name() + "\n\n" + table(rows)
    result = {"rows": rows, "targets": TARGETS}
    if args.sweep:
        swept = sweep()
        result["sweep"] = swept
        text += (
            "\n\nConfig sweep (B4 H32 T4096 causal; (BLOCK_M, BLOCK_N, warps, stages); fwd rows: forward "
            "TFLOP/s; dkdv/dq rows: whole-backward TFLOP/s with that kernel's config):\n\n"
        )
        text += "| D | kernel | config | TFLOP/s |\n|---|---|---|---:|\n"
        text += "\n".join(
            f"| {r['d']} | {r['kernel']} | {r['config']} | {_fmt(r['tflops'])} |" for r in swept
        )
    print(text)
    (args.out / "det-attn_attention.md").write_text(text + "\n")
    (args.out / "det-attn_attention.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
