"""Sweep (GPU): config-table candidates at the main job's micro-batch shapes, device time vs cuBLAS.

The main job's GPT (d_model 768, d_ff 2560, byte vocab 256: layers qkv 2304 x 768, attention out
768 x 768, gate/up 5120 x 768, down 768 x 2560, LM head 256 x 768) at micro-batches of
M in {1024, 2048, 4096, 8192} tokens, and the issue's 1024 x 4096 x 4096 as a guard:

- forward ``Y = X W^T`` (layout "nt") and dX ``dY W`` ("nn"): every candidate ``MatmulConfig``
  against ``torch.matmul``; bits compared with the table's entry for the shape (only ``block_k``
  changes bits, so every candidate must give them);
- the open leaf's dW fold (``weight_grad_fold``, resumed from a stored fp32 accumulator, the form
  a micro-batch inside an 8192-token leaf takes) over T in {1024, 2048, 4096} tokens (and the
  guard shape, printed only): every candidate tile against ``torch.matmul(dY.T, X)``; bits
  against the table's fold.

Device time: each call captured ``n`` times in one CUDA graph (``n`` sized to ~2 ms of work),
replayed 5 times, the median per call: no host launch time (the step runs in a CUDA graph, and
eager launches overlap the GPU's work). Prints a row per (op, layer, M, candidate): microseconds,
TFLOP/s, the ratio to cuBLAS and ``bits`` (``same`` / ``DIFF`` / ``error``); then per op the best
candidate of each rows class (by the step-weighted sum of device times: each layer counts 12x,
the LM head 1x), the ``MID_MAX_FILL`` that minimizes that sum given the entries, and the
``configs.py`` lines. ``*`` marks the entry the table selects today. Under 3 minutes on an H200
with a cold Triton cache (about 30 kernels to compile). Writes ``OUT/det-train_sweep_micro_batches.json``
with ``--out``.

    python packages/det-train/benchmarks/sweep_micro_batches.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]
for _p in (_ROOT / "packages/det-train/torch-ext", _ROOT / "shared/det-core"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from det_train.ops import configs  # noqa: E402
from det_train.ops._leaf_fold import weight_grad_fold  # noqa: E402
from det_train.ops.configs import MatmulConfig, WeightGradConfig  # noqa: E402
from det_train.ops.matmul import launch_matmul  # noqa: E402

# (name, N = out_features, K = in_features, uses per step): the main job's gpu preset
LAYERS = [("qkv", 2304, 768, 12), ("attn_out", 768, 768, 12), ("gate_up", 5120, 768, 12)]
LAYERS += [("down", 768, 2560, 12), ("lm_head", 256, 768, 1)]
GUARD = ("guard 4096x4096", 4096, 4096, 0)  # the 1024 x 4096 x 4096 (weight 0: printed only)
ROWS = [1024, 2048, 4096, 8192]
FOLD_TOKENS = [1024, 2048, 4096]

_M = MatmulConfig
FWD_CANDIDATES = {
    "tma 128x256 w8 s4": _M(128, 256, 64, 8, 8, 4, tma=True),
    "tma 128x128 w8 s4": _M(128, 128, 64, 8, 8, 4, tma=True),
    "tma 128x128 w4 s4": _M(128, 128, 64, 8, 4, 4, tma=True),
    "tma 128x128 w4 s3": _M(128, 128, 64, 8, 4, 3, tma=True),
    "tma 64x128 w4 s4": _M(64, 128, 64, 8, 4, 4, tma=True),
    "tma 128x64 w4 s4": _M(128, 64, 64, 8, 4, 4, tma=True),
    "tma 64x256 w4 s4": _M(64, 256, 64, 8, 4, 4, tma=True),
    "tma persistent 128x128 w8 s4": _M(128, 128, 64, 8, 8, 4, tma=True, persistent=True),
    "ptr 128x128 w8 s4": _M(128, 128, 64, 8, 8, 4),
    "ptr 64x128 w4 s4": _M(64, 128, 64, 8, 4, 4),
}
DX_CANDIDATES = {
    "ptr 128x256 w8 s4": _M(128, 256, 64, 8, 8, 4),
    "ptr 128x128 w8 s4": _M(128, 128, 64, 8, 8, 4),
    "ptr 128x128 w4 s4": _M(128, 128, 64, 8, 4, 4),
    "ptr 128x128 w4 s3": _M(128, 128, 64, 8, 4, 3),
    "ptr 64x128 w4 s4": _M(64, 128, 64, 8, 4, 4),
    "ptr 128x64 w4 s4": _M(128, 64, 64, 8, 4, 4),
    "ptr 64x256 w4 s4": _M(64, 256, 64, 8, 4, 4),
    "tma 128x256 w8 s4": _M(128, 256, 64, 8, 8, 4, tma=True),
    "tma 128x128 w8 s4": _M(128, 128, 64, 8, 8, 4, tma=True),
    "tma 64x128 w4 s4": _M(64, 128, 64, 8, 4, 4, tma=True),
}
_W = WeightGradConfig
FOLD_CANDIDATES = {  # block_t 64 (the table's token step) in every one; TMA loads where aligned
    "128x256 w8 s3": _W(128, 256, 64, 8, 8, 3, 1),
    "128x128 w8 s4": _W(128, 128, 64, 8, 8, 4, 1),
    "128x128 w4 s4": _W(128, 128, 64, 8, 4, 4, 1),
    "128x128 w8 s3": _W(128, 128, 64, 8, 8, 3, 1),
    "64x128 w4 s4": _W(64, 128, 64, 8, 4, 4, 1),
    "128x64 w4 s4": _W(128, 64, 64, 8, 4, 4, 1),
    "64x64 w4 s4": _W(64, 64, 64, 8, 4, 4, 1),
    "64x64 w4 s3": _W(64, 64, 64, 8, 4, 3, 1),
    "64x256 w4 s3": _W(64, 256, 64, 8, 4, 3, 1),
}
DEVICE = "cuda"


def _device_us(fn) -> float | str:
    """Median device microseconds of one ``fn()`` call, from CUDA-graph replays (no host time)."""
    try:
        fn()  # compile and allocate outside the graph
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm the allocator on the capture stream
            one = torch.cuda.CUDAGraph()
            with torch.cuda.graph(one, stream=stream):
                fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            one.replay()
        end.record()
        torch.cuda.synchronize()
        n = max(1, min(400, int(2.0 / max(start.elapsed_time(end) / 3, 1e-3))))  # ~2 ms per replay
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(n):
                    fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / n)
        del graph, one
        return statistics.median(times)
    except Exception as exc:  # one failing candidate must not stop the sweep
        traceback.print_exc(limit=1)
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"


def _same(fn, ref: torch.Tensor) -> str:
    try:
        return "same" if torch.equal(fn(), ref) else "DIFF"
    except Exception as exc:
        return f"error: {type(exc).__name__}"


def _randn(*shape, gen):
    return torch.randn(*shape, device=DEVICE, generator=gen).to(torch.bfloat16)


def _sweep_matmul(rows: list[dict], time_fn) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for name, n, k, uses in [*LAYERS, GUARD]:
        w = _randn(n, k, gen=gen)
        for m in ROWS if uses else [1024]:
            x, dy = _randn(m, k, gen=gen), _randn(m, n, gen=gen)
            y, dx = torch.empty(m, n, device=DEVICE, dtype=torch.bfloat16), torch.empty_like(x)
            for op, a, b, out, out_n, cands in (
                ("fwd", x, w.t(), y, n, FWD_CANDIDATES),
                ("dX", dy, w, dx, k, DX_CANDIDATES),
            ):
                layout = configs.layout_of(a, b)
                table = configs.matmul_config(torch.bfloat16, layout, out_n, a.shape[1], rows=m)
                cls = configs.rows_class(m, out_n)
                ref = launch_matmul(a, b, torch.empty_like(out)).clone()  # the table's bits
                cublas = time_fn(lambda a=a, b=b: torch.matmul(a, b))
                common = dict(op=op, layer=name, m=m, n=out_n, k=a.shape[1], uses=uses, cls=cls)
                common["fill"] = configs.wave_fill(m, out_n)
                flops = 2.0 * m * out_n * a.shape[1]
                _row(rows, common, "cuBLAS", cublas, "—", cublas, flops, "")
                for cand, cfg in cands.items():
                    us = time_fn(lambda a=a, b=b, out=out, cfg=cfg: launch_matmul(a, b, out, config=cfg))
                    bits = _same(lambda a=a, b=b, out=out, cfg=cfg: launch_matmul(a, b, out, config=cfg), ref)
                    _row(rows, common, cand, us, bits, cublas, flops, "*" if cfg == table else "")
            torch.cuda.empty_cache()


def _sweep_fold(rows: list[dict], time_fn) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for name, n, k, uses in [*LAYERS, GUARD]:
        table = configs.weight_grad_fold_config(torch.bfloat16, n, k)
        acc = torch.randn(n, k, device=DEVICE, generator=gen)  # the leaf's fold so far
        for t in FOLD_TOKENS:
            dy, x = _randn(t, n, gen=gen), _randn(t, k, gen=gen)
            ref = weight_grad_fold(dy, x, acc)  # the table's bits
            cublas = time_fn(lambda dy=dy, x=x: torch.matmul(dy.t(), x))
            common = dict(op="fold", layer=name, m=t, n=n, k=k, uses=uses, cls=_fold_class(n, k))
            common["fill"] = None
            flops = 2.0 * t * n * k
            _row(rows, common, "cuBLAS", cublas, "—", cublas, flops, "")
            for cand, cfg in FOLD_CANDIDATES.items():
                us = time_fn(lambda dy=dy, x=x, acc=acc, cfg=cfg: weight_grad_fold(dy, x, acc, config=cfg))
                bits = _same(
                    lambda dy=dy, x=x, acc=acc, cfg=cfg: weight_grad_fold(dy, x, acc, config=cfg), ref
                )
                _row(
                    rows,
                    common,
                    cand,
                    us,
                    bits,
                    cublas,
                    flops,
                    "*" if _fold_fields(cfg) == _fold_fields(table) else "",
                )


def _fold_fields(cfg: WeightGradConfig) -> tuple:
    """The fields the fold kernel reads (its tile, token step, order and schedule)."""
    return cfg.block_n, cfg.block_k, cfg.block_t, cfg.group_n, cfg.num_warps, cfg.num_stages


def _fold_class(n: int, k: int) -> str:
    if configs.shape_class(n, k) != "large":
        return "small"
    if n * k >= configs.WIDE_MIN_ELEMENTS:
        return "wide"
    return "mid" if n * k < configs.FOLD_MID_MAX_ELEMENTS else "large"


def _row(rows, common, cand, us, bits, cublas, flops, mark) -> None:
    ok = isinstance(us, float)
    tf = flops / (us * 1e-6) / 1e12 if ok else None
    ratio = cublas / us if ok and isinstance(cublas, float) else None
    rows.append(dict(common, name=cand, us=us, tflops=tf, ratio=ratio, bits=bits, mark=mark))
    shape = f"{common['layer']} M={common['m']}"
    rs = f"{ratio:.2f}x" if ratio else "—"
    us_s = f"{us:8.1f}" if ok else str(us)[:40]
    print(
        f"{common['op']:4} {shape:24} {common['cls']:5} {mark:1} {cand:30} {us_s} us {tf or 0:6.0f} TFLOP/s "
        f"{rs:>6}  bits {bits}",
        flush=True,
    )


def _step_time(rows, op, pick) -> float:
    """Step-weighted device microseconds of ``op`` when shape ``r`` runs candidate ``pick(r)``."""
    total = 0.0
    for key in {(r["layer"], r["m"]) for r in rows if r["op"] == op and r["uses"]}:
        mine = {r["name"]: r for r in rows if r["op"] == op and (r["layer"], r["m"]) == key}
        first = next(iter(mine.values()))
        chosen = mine.get(pick(first))
        if chosen is None or not isinstance(chosen["us"], float):
            return float("inf")
        total += first["uses"] * chosen["us"]
    return total


def _table_choice(rows, r) -> str | None:
    """The candidate the table selects today for ``r``'s (op, layer, M), or None if it is not one."""
    key = (r["op"], r["layer"], r["m"])
    return next((x["name"] for x in rows if (x["op"], x["layer"], x["m"]) == key and x["mark"] == "*"), None)


def _best(rows, op, names, where) -> tuple[str | None, float]:
    """The candidate with identical bits everywhere whose step-weighted time over ``where`` rows is least."""
    best, best_t = None, float("inf")
    for name in names:
        mine = [r for r in rows if r["op"] == op and r["name"] == name and r["uses"] and where(r)]
        if not mine or any(r["bits"] != "same" or not isinstance(r["us"], float) for r in mine):
            continue
        t = sum(r["uses"] * r["us"] for r in mine)
        if t < best_t:
            best, best_t = name, t
    return best, best_t


def summarize(rows: list[dict]) -> dict:
    summary = {}
    table_key = {"fwd": "nt", "dX": "nn"}
    for op, cands in (("fwd", FWD_CANDIDATES), ("dX", DX_CANDIDATES)):
        bad = sorted({r["name"] for r in rows if r["op"] == op and r["bits"] not in ("same", "—")})
        if bad:
            print(f"{op}: candidates with other bits or errors (left out): {bad}")
        low, _ = _best(rows, op, cands, lambda r: r["cls"] == "low")
        mid, _ = _best(rows, op, cands, lambda r: r["cls"] == "mid")
        many, _ = _best(rows, op, cands, lambda r: r["cls"] == "many")
        now = _step_time(rows, op, lambda r: _table_choice(rows, r))
        cublas = _step_time(rows, op, lambda r: "cuBLAS")
        fills = sorted({r["fill"] for r in rows if r["op"] == op} | {0.0, 1.01})
        best_fill, best_t = None, float("inf")
        if mid and many:
            for f in fills:  # the class boundary that minimizes the step's time with these two entries
                t = _step_time(rows, op, lambda r, f=f, lo=mid, hi=many: lo if r["fill"] < f else hi)
                if t < best_t:
                    best_fill, best_t = f, t
        summary[op] = dict(
            low=low, mid=mid, many=many, mid_max_fill=best_fill, step_us=best_t, now_us=now, cublas_us=cublas
        )
        print(
            f"\n{op}: step-weighted device time now {now:.0f} us, cuBLAS {cublas:.0f} us; best mid entry "
            f"{mid!r}, best many entry {many!r}; with MID_MAX_FILL = {best_fill}: {best_t:.0f} us"
        )
        if low:
            print(f'  configs.py _MATMUL_TABLE[("half", "{table_key[op]}", "large", "low")] = {cands[low]!r}')
        if mid:
            print(f'  configs.py _MATMUL_TABLE[("half", "{table_key[op]}", "large", "mid")] = {cands[mid]!r}')
        if many:
            cls = "many" if op == "fwd" else "any"
            print(
                f'  configs.py _MATMUL_TABLE[("half", "{table_key[op]}", "large", "{cls}")] = {cands[many]!r}'
            )
        if best_fill is not None:
            print(f"  configs.py MID_MAX_FILL = {best_fill:.3f}  (shapes below it take the mid entry)")
        for r in sorted({(r["layer"], r["m"], r["fill"]) for r in rows if r["op"] == op}):
            mine = [
                x for x in rows if x["op"] == op and (x["layer"], x["m"]) == r[:2] and x["bits"] == "same"
            ]
            mine = [x for x in mine if isinstance(x["us"], float)]
            if mine:
                top = min(mine, key=lambda x: x["us"])
                print(
                    f"    {r[0]:16} M={r[1]:5} fill {r[2]:.2f}: best {top['name']} {top['ratio']:.2f}x cuBLAS"
                )
    bad = sorted({r["name"] for r in rows if r["op"] == "fold" and r["bits"] not in ("same", "—")})
    if bad:
        print(f"fold: candidates with other bits or errors (left out): {bad}")
    summary["fold"] = dict(
        now_us=_step_time(rows, "fold", lambda r: _table_choice(rows, r)),
        cublas_us=_step_time(rows, "fold", lambda r: "cuBLAS"),
    )
    print(f"\nfold: step-weighted device time now {summary['fold']['now_us']:.0f} us, cuBLAS "
          f"{summary['fold']['cublas_us']:.0f} us (one resumed call per layer and T)")  # fmt: skip
    for cls in ("mid", "large", "wide"):
        best, t = _best(rows, "fold", FOLD_CANDIDATES, lambda r, cls=cls: r["cls"] == cls)
        if best is None:
            continue
        summary["fold"][cls] = dict(best=best, step_us=t)
        where = '_WEIGHT_GRAD_FOLD_TABLE[("half", "mid")]' if cls == "mid" else f"fold entry for {cls!r}"
        print(f"fold {cls}: best {best!r} (step-weighted {t:.0f} us)")
        print(f"  configs.py {where} = {FOLD_CANDIDATES[best]!r}")
    for key in sorted({(r["layer"], r["m"]) for r in rows if r["op"] == "fold"}):
        mine = [x for x in rows if x["op"] == "fold" and (x["layer"], x["m"]) == key and x["bits"] == "same"]
        mine = [x for x in mine if isinstance(x["us"], float)]
        if mine:
            top = min(mine, key=lambda x: x["us"])
            print(f"    fold {key[0]:10} T={key[1]:5}: best {top['name']} {top['ratio']:.2f}x cuBLAS")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_micro_batches: needs a CUDA GPU")
        return 1
    import triton

    print(
        f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs) | "
        f"torch {torch.__version__} | triton {triton.__version__} | table: WAVE_SMS {configs.WAVE_SMS}, "
        f"MID_MAX_FILL {configs.MID_MAX_FILL}, FOLD_MID_MAX_ELEMENTS {configs.FOLD_MID_MAX_ELEMENTS}",
        flush=True,
    )
    t0 = time.time()
    rows: list[dict] = []
    _sweep_matmul(rows, _device_us)
    _sweep_fold(rows, _device_us)
    print(f"\nelapsed {time.time() - t0:.0f} s (compiles included)")
    summary = summarize(rows)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "det-train_sweep_micro_batches.json").write_text(
            json.dumps({"rows": rows, "summary": summary}, indent=1, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
