"""Ablation: det_attn kernel configs side by side with SDPA cuDNN / flash / efficient (H200, < 2 min).

Shapes: B4 H32 causal bf16 at T1024 and T4096 with D128, and T4096 with D64. For each shape:

- the SDPA peers (full calls, as in ``bench_attention.py``): forward and forward+backward ms;
- ``table``: det_attn's fixed table through the public ``attention`` (full call: autograd, host
  code, launches) -- the number the targets are judged on;
- every candidate config through the launchers directly (``_plans.launch_forward`` /
  ``launch_backward`` on the candidate's plan, no checks or autograd): forward ms, backward ms
  (preprocess + dK/dV + dQ), their sum as forward+backward, and the ratios to cuDNN and
  efficient. A candidate is the table with one kernel's config changed, so each compile is shared;
- at T1024 for the table: the same direct calls replayed from a CUDA graph (``graph`` rows), which
  removes host overhead (and the L2 flush): a large gap to the direct rows means host-bound calls;
- bits: each candidate's O, LSE, dQ, dK, dV against the table's, at the first shape of its head
  dim (T1024 for D128, T4096 for D64): ``same`` or the tensors that differ; and against the
  first earlier candidate with the same order-defining fields, if any (e.g. two forward configs
  with the same BN but other BM/warps: ``same`` there shows BM/warps are bit-neutral). The column "order
  fields changed" lists the fields the candidate changes that ``_configs.Config`` names
  as bit-changing; ``same`` with ``-`` confirms the changed fields are bit-neutral; a difference
  with ``-`` means a field not named changes bits too (then name it so in the table).

Finally a per-kernel device-time profile of the table at T1024 (torch.profiler).

Reading: pick, per head dim, the candidate with the best ``fwd+bwd`` at both T whose forward is the
best (forward and backward kernels are independent), then set those fields in
``_configs.GPU_CONFIGS``. Printed and written to ``OUT/det-attn_ablation.md``.

``--forward``: the forward kernel's variants only (``FWD_VARIANTS``: block shapes, stages,
register caps, pointer loads instead of host TMA descriptors; ``_fwd_kernel``),
at B4 H32 bf16: D128 causal T1024 / T4096 / T8192, D128 non-causal T4096, D64 causal T4096, side
by side with SDPA cuDNN, each timed twice: eager ``triton.testing.do_bench`` (L2 flushed, host
launch cost included) and ``do_bench_cudagraph`` (device time of a CUDA-graph replay, no host
cost). Per variant and shape: ``det`` (two runs give the same O and LSE bits) and ``bits`` against
the table's O and LSE (``same`` is expected unless a field named as bits-changing in
``_configs.Config`` changed; then against the first variant with the same such fields).
The table itself is timed through ``attention()`` too (the public call under ``no_grad``, with its
host microseconds per call). A failing variant is reported and the rest go on; past the time
budget (``--budget``, 135 s) the remaining variants are listed as skipped. Written to
``OUT/det-attn_ablation_forward.md`` and ``.json``; ``--variants a,b`` keeps the variants whose
names contain one of the words.

    python packages/det-attn/benchmarks/ablate_attention.py --out bench-results
    python packages/det-attn/benchmarks/ablate_attention.py --forward --out bench-results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

SHAPES = [(4, 32, 1024, 128), (4, 32, 4096, 128), (4, 32, 4096, 64)]  # (B, H, T, D), causal
GRAPH_T = 1024  # CUDA-graph rows (host overhead) at this length
PEERS = {"cuDNN": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
# Candidates: (name, {field: value}) applied on top of the table's row for that head dim.
FWD = ("fwd_block_m", "fwd_block_n", "fwd_warps", "fwd_stages")
DKDV = ("dkdv_block_m", "dkdv_block_n", "dkdv_warps", "dkdv_stages")
DQ = ("dq_block_m", "dq_block_n", "dq_warps", "dq_stages")
ORDER_FIELDS = ("fwd_block_n", "dkdv_block_m", "dq_block_n")


def _c(fields, values):
    return dict(zip(fields, values, strict=True))


CANDIDATES = {  # most informative first: the time budget may cut the tail of a list
    128: [
        ("fwd 64,64,4,3", _c(FWD, (64, 64, 4, 3))),  # two programs per SM: short sequences
        ("fwd 128,64,8,3", _c(FWD, (128, 64, 8, 3))),
        ("dkdv 32,128,8,3", _c(DKDV, (32, 128, 8, 3))),
        ("dq 128,32,8,3", _c(DQ, (128, 32, 8, 3))),
        ("dq 64,64,8,3", _c(DQ, (64, 64, 8, 3))),
        ("fwd 128,128,8,3 (old table)", {**_c(FWD, (128, 128, 8, 3)), "fwd_maxnreg": 0}),
        ("dkdv 64,64,8,3", _c(DKDV, (64, 64, 8, 3))),
        ("dq 64,32,8,3", _c(DQ, (64, 32, 8, 3))),
    ],
    64: [
        ("fwd 128,64,4,3", _c(FWD, (128, 64, 4, 3))),
        ("dkdv 32,64,4,3", _c(DKDV, (32, 64, 4, 3))),
        ("fwd 64,64,4,3", _c(FWD, (64, 64, 4, 3))),
        ("dkdv 64,128,8,3", _c(DKDV, (64, 128, 8, 3))),
        ("dq 128,64,8,3", _c(DQ, (128, 64, 8, 3))),
    ],
}
BUDGET_S = 95.0  # stop adding candidates past this (the table and peers always run)


def _bench(fn) -> float | str:
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    except Exception as exc:  # one failing variant must not stop the table
        traceback.print_exc(limit=1)
        return f"error: {type(exc).__name__}"


def _bench_graph(fn, rep=40) -> float | str:
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    except Exception as exc:
        traceback.print_exc(limit=1)
        return f"error: {type(exc).__name__}"


def _inputs(b, h, t, d, layout, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (b, t, h, d) if layout == "bthd" else (b, h, t, d)
    return [torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def _peer_times(b, h, t, d) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = _inputs(b, h, t, d, "bhtd")
    out = {}
    for name, backend in PEERS.items():
        backend = getattr(SDPBackend, backend)

        def call(q=q, k=k, v=v, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        with torch.no_grad():
            fwd = _bench(call)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

        def both(qg=qg, kg=kg, vg=vg, call=call):
            for x in (qg, kg, vg):
                x.grad = None
            call(qg, kg, vg).backward(do)

        out[name] = (fwd, _bench(both))
    return out


def _table_call_times(b, h, t, d) -> tuple:
    from det_attn import attention

    q, k, v, do = _inputs(b, h, t, d, "bthd")
    with torch.no_grad():
        fwd = _bench(lambda: attention(q, k, v, causal=True))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def both():
        for x in (qg, kg, vg):
            x.grad = None
        attention(qg, kg, vg, causal=True).backward(do)

    return fwd, _bench(both)


def _direct_forward(q, k, v, causal: bool, scale: float):
    """``(o, lse2)`` of the plan's launch alone (no checks, no autograd; the plan of the table's
    current row, which the ablation swaps): q, k, v ``(B, T, H, D)``, no dropout."""
    from det_attn import _plans

    plan = _plans.padded_plan(q, k, v, None, causal, scale, False)
    return _plans.launch_forward(plan, *_plans.kernel_inputs(q, k, v, plan.dense), None, None, None)


class _Direct:
    """The launchers without autograd or argument checks, on one shape's inputs (causal)."""

    def __init__(self, b, h, t, d):
        self.q, self.k, self.v, do = _inputs(b, h, t, d, "bthd")
        self.do, self.scale = do.view(b * t, h, d), 1.0 / math.sqrt(d)

    def fwd(self):
        return _direct_forward(self.q, self.k, self.v, True, self.scale)

    def bwd(self, o, lse2):
        from det_attn import _plans

        plan = _plans.padded_plan(self.q, self.k, self.v, None, True, self.scale, False)
        q, k, v = _plans.kernel_inputs(self.q, self.k, self.v, plan.dense)
        return _plans.launch_backward(plan, self.do, q, k, v, o, lse2, None, None, None)

    def all(self):
        o, lse2 = self.fwd()
        return (o, lse2, *self.bwd(o, lse2))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


def _differs(a, b) -> str:
    names = ("O", "LSE", "dQ", "dK", "dV")
    bad = [n for n, x, y in zip(names, a, b, strict=True) if not torch.equal(_bits(x), _bits(y))]
    return "same" if not bad else "differ: " + ",".join(bad)


def _fmt(x, digits=3):
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x[:24]
    return f"{x:.{digits}f}"


def _ratio(a, b):
    return a / b if isinstance(a, float) and isinstance(b, float) and a > 0 else None


def _profile_table(b, h, t, d) -> str:
    from det_attn import attention

    q, k, v, do = _inputs(b, h, t, d, "bthd")
    qg, kg, vg = (x.requires_grad_() for x in (q, k, v))
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for _ in range(3):
        attention(qg, kg, vg, causal=True).backward(do)
    torch.cuda.synchronize()
    n = 10
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        for _ in range(n):
            for x in (qg, kg, vg):
                x.grad = None
            attention(qg, kg, vg, causal=True).backward(do)
        host = (time.perf_counter() - start) / n * 1e3
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev and dev > 0 and not e.key.startswith(("aten::", "autograd", "cuda")):
            rows.append((dev / n / 1e3, e.count // n, e.key[:60]))
    rows.sort(reverse=True)
    lines = [
        f"Profile: table, B{b} H{h} T{t} D{d} causal, fwd+bwd via attention(); host time per call "
        f"(launch-bound when close to the device total) {host:.3f} ms",
        "",
        "| kernel | calls/iter | device ms/iter |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {calls} | {ms:.3f} |" for ms, calls, name in rows[:8]]
    lines.append(f"| total | | {sum(r[0] for r in rows):.3f} |")
    return "\n".join(lines)


def run() -> str:
    from det_attn import _configs

    began = time.perf_counter()
    saved = dict(_configs.GPU_CONFIGS)
    head = (
        "| shape | variant | order fields changed | fwd ms | bwd ms | fwd+bwd ms | fwd/cuDNN "
        "| fwd+bwd/cuDNN | fwd+bwd/eff | bits |"
    )
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    reference_bits = {}  # head dim -> table outputs; (head dim, order fields) -> first candidate's
    bits_t = {}
    skipped = []
    try:
        for b, h, t, d in SHAPES:
            shape = f"T{t} D{d}"
            peers = _peer_times(b, h, t, d)
            cud_f, cud_b = peers["cuDNN"]
            eff_b = peers["efficient"][1]
            for name, (f, fb) in peers.items():
                lines.append(f"| {shape} | sdpa {name} | | {_fmt(f)} | | {_fmt(fb)} | | | | |")
            f, fb = _table_call_times(b, h, t, d)
            lines.append(
                f"| {shape} | **table (attention())** | - | {_fmt(f)} | | {_fmt(fb)} | "
                f"{_fmt(_ratio(cud_f, f), 2)} | {_fmt(_ratio(cud_b, fb), 2)} | "
                f"{_fmt(_ratio(eff_b, fb), 2)} | |"
            )
            direct = _Direct(b, h, t, d)
            base = saved[d]
            for name, change in [("table (direct)", {}), *CANDIDATES[d]]:
                if change and time.perf_counter() - began > BUDGET_S:
                    skipped.append(f"{shape} {name}")
                    continue
                _configs.GPU_CONFIGS[d] = dataclasses.replace(base, **change)
                order = ",".join(
                    k for k, val in change.items() if k in ORDER_FIELDS and getattr(base, k) != val
                )
                try:
                    o, lse2 = direct.fwd()
                    f = _bench(direct.fwd)
                    bw = _bench(lambda o=o, lse2=lse2, direct=direct: direct.bwd(o, lse2))
                    bits = ""
                    if t == bits_t.setdefault(d, t):  # bits at the first shape of this head dim
                        outs = direct.all()
                        bits = _differs(outs, reference_bits[d][1]) + " vs table" if change else "(table)"
                        # candidates with equal order fields should agree with the first of their class
                        key = (d, *(getattr(_configs.GPU_CONFIGS[d], fld) for fld in ORDER_FIELDS))
                        if key in reference_bits and change and reference_bits[key][0] != "table (direct)":
                            first, ref = reference_bits[key]
                            bits += f"; {_differs(outs, ref)} vs {first}"
                        reference_bits.setdefault(key, (name, outs))
                        if not change:
                            reference_bits[d] = (name, outs)
                    fb = f + bw if isinstance(f, float) and isinstance(bw, float) else None
                    lines.append(
                        f"| {shape} | {name} | {order or '-'} | {_fmt(f)} | {_fmt(bw)} | {_fmt(fb)} | "
                        f"{_fmt(_ratio(cud_f, f), 2)} | {_fmt(_ratio(cud_b, fb), 2)} | "
                        f"{_fmt(_ratio(eff_b, fb), 2)} | {bits} |"
                    )
                    if not change and t == GRAPH_T:

                        def graph_both(direct=direct):
                            o, lse2 = direct.fwd()
                            direct.bwd(o, lse2)

                        gf, gb = _bench_graph(direct.fwd), _bench_graph(graph_both)
                        lines.append(
                            f"| {shape} | table (direct, CUDA graph) | - | {_fmt(gf)} | | {_fmt(gb)} | "
                            f"{_fmt(_ratio(cud_f, gf), 2)} | {_fmt(_ratio(cud_b, gb), 2)} | "
                            f"{_fmt(_ratio(eff_b, gb), 2)} | |"
                        )
                except Exception as exc:  # e.g. out of shared memory for one candidate
                    traceback.print_exc(limit=1)
                    lines.append(
                        f"| {shape} | {name} | {order or '-'} | error: {type(exc).__name__} | | | | | | |"
                    )
                finally:
                    _configs.GPU_CONFIGS[d] = base
                torch.cuda.empty_cache()
            print(
                f"[ablate] {shape} done at {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True
            )
    finally:
        _configs.GPU_CONFIGS.clear()
        _configs.GPU_CONFIGS.update(saved)
    text = "\n".join(lines)
    if skipped:
        text += "\n\nSkipped (time budget): " + "; ".join(skipped)
    try:
        text += "\n\n" + _profile_table(4, 32, 1024, 128)
    except Exception as exc:
        text += f"\n\nProfile failed: {type(exc).__name__}: {exc}"
    table_rows = {d: saved[d] for d in sorted(saved)}
    text += "\n\nTable at this run: " + "; ".join(f"D{d}: {c}" for d, c in table_rows.items())
    text += f"\n\nTotal {time.perf_counter() - began:.0f} s."
    return text


# --------------------------------------------------------------------------- forward-only mode

FWD_SHAPES = [  # (B, H, T, D, causal)
    (4, 32, 1024, 128, True),
    (4, 32, 4096, 128, True),
    (4, 32, 8192, 128, True),
    (4, 32, 4096, 128, False),
    (4, 32, 4096, 64, True),
]
FWD_BITS_FIELDS = ("fwd_block_n",)  # named bits-changing in _configs.Config
FWD_BUDGET_S = 135.0


def _fwd(bm, bn, warps, stages, **more):
    return dict(fwd_block_m=bm, fwd_block_n=bn, fwd_warps=warps, fwd_stages=stages, **more)


# (name, fields changed on the table's row): "BM,BN,warps,stages", "rN" a cap of N registers (never
# with dropout), "pointers" pointer loads instead of host TMA descriptors (with the table's pointer
# tiles, fwd_pointers, unless named). aot_compile_check.py reports each one's registers, spills and
# shared memory for sm_90a; D64's r128 is a control (its row needs fewer than 128 registers:
# equal times expected). Most informative first: the budget may cut the tail.
FWD_VARIANTS = {
    128: [
        # BN 128: other bits than the table (every variant with BN 64 should keep the table's)
        ("128,128,8,3 (old table)", _fwd(128, 128, 8, 3, fwd_maxnreg=0)),
        ("128,64,8,3 r128", _fwd(128, 64, 8, 3)),
        ("128,64,8,2 (no cap)", {"fwd_maxnreg": 0}),
        # the pointer loads (packed input) with the table's pointer tiles (128, 8, 2, cap 128), and
        # other tiles for them: fwd_pointers = (BM, warps, stages, cap)
        ("pointers", {"fwd_tma": False}),
        ("pointers no cap", {"fwd_tma": False, "fwd_pointers": (128, 8, 2, 0)}),
        ("pointers 64,4,3", {"fwd_tma": False, "fwd_pointers": (64, 4, 3, 0)}),
        ("pointers 64,4,2", {"fwd_tma": False, "fwd_pointers": (64, 4, 2, 0)}),
    ],
    64: [
        ("tma-host 128,64,8,3 r128", {"fwd_maxnreg": 128}),
        ("pointers", {"fwd_tma": False}),
    ],
}


class _FwdCase:
    """One forward shape: (B, T, H, D) inputs, and (B, H, T, D) copies for SDPA."""

    def __init__(self, b, h, t, d, causal, device="cuda"):
        g = torch.Generator(device=device).manual_seed(t + d + causal)
        self.qkv = [
            torch.randn((b, t, h, d), generator=g, device=device, dtype=torch.bfloat16) for _ in range(3)
        ]
        self.sdpa = [x.transpose(1, 2).contiguous() for x in self.qkv]
        self.b, self.h, self.t, self.d, self.causal = b, h, t, d, causal
        self.scale = 1.0 / math.sqrt(d)
        self.name = f"T{t} D{d}" + ("" if causal else " non-causal")
        self.flops = 4 * b * h * t * t * d / (2 if causal else 1)

    def direct(self):
        return _direct_forward(*self.qkv, self.causal, self.scale)

    def public(self):
        from det_attn import attention

        return attention(*self.qkv, causal=self.causal)

    def cudnn(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*self.sdpa, is_causal=self.causal)


def _host_us(fn, n=30) -> float | str:
    """Host microseconds per call of ``fn`` (launches queue up; the device is not waited on)."""
    try:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - start) / n * 1e6
        torch.cuda.synchronize()
        return host
    except Exception as exc:
        return f"error: {type(exc).__name__}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _out_bits(outs) -> str:
    """'same' or the names (O, LSE) whose bits differ."""
    bad = [n for n, x, y in zip(("O", "LSE"), *outs, strict=True) if not _same(x, y)]
    return "same" if not bad else "differ: " + ",".join(bad)


def _cuda_ok() -> bool:
    """False once the CUDA context is broken (a sticky error: later calls cannot be trusted)."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def _forward_rows(case, name, fields, fn, cud, ref, budget_left) -> tuple:
    """(row, outputs): ``fn`` timed eager and as a graph replay, its determinism, its bits against
    ``ref`` (None: it is the reference)."""
    row = {"shape": case.name, "variant": name, "bits_fields": fields}
    first = fn()
    second = fn()
    torch.cuda.synchronize()
    row["det"] = "yes" if _out_bits((first, second)) == "same" else "NO: " + _out_bits((first, second))
    row["bits"] = "(reference)" if ref is None else _out_bits((first, ref))
    del second
    row["eager_ms"] = _bench(fn)
    row["graph_ms"] = _bench_graph(fn, rep=20) if budget_left() > 0 else "skipped"
    row["eager_vs_cudnn"] = _ratio(cud["eager_ms"], row["eager_ms"])
    row["graph_vs_cudnn"] = _ratio(cud["graph_ms"], row["graph_ms"])
    if isinstance(row["graph_ms"], float):
        row["graph_tflops"] = case.flops / row["graph_ms"] / 1e9
    return row, first


def run_forward(variants: dict, budget_s: float, out: Path | None = None, shapes=FWD_SHAPES) -> tuple:
    """The forward-only ablation; returns (markdown text, rows for the JSON)."""
    from det_attn import _configs

    began = time.perf_counter()

    def budget_left():
        return budget_s - (time.perf_counter() - began)

    saved = dict(_configs.GPU_CONFIGS)
    rows, skipped, notes = [], [], []
    cases = [_FwdCase(*shape) for shape in shapes]
    cudnn, refs, class_refs = {}, {}, {}

    def log(msg):
        print(f"[ablate --forward {time.perf_counter() - began:5.0f} s] {msg}", file=sys.stderr, flush=True)

    def flush():
        if out is not None:  # partial results survive a crash or a timeout
            (out / "det-attn_ablation_forward.json").write_text(json.dumps(rows, indent=1, default=str))

    try:
        # peers and the table first, at every shape (the variants are compared with them)
        for case in cases:
            with torch.no_grad():
                cud = {"eager_ms": _bench(case.cudnn), "graph_ms": _bench_graph(case.cudnn, rep=20)}
            cudnn[case.name] = cud
            rows.append({"shape": case.name, "variant": "sdpa cuDNN", **cud})
            try:
                with torch.no_grad():
                    row = {"shape": case.name, "variant": "table via attention()", "bits_fields": ""}
                    row["eager_ms"] = _bench(case.public)
                    row["eager_vs_cudnn"] = _ratio(cud["eager_ms"], row["eager_ms"])
                    row["host_us"] = _host_us(case.public)
                    rows.append(row)
                row, refs[case.name] = _forward_rows(
                    case, "table (direct)", "", case.direct, cud, None, budget_left
                )
                row["host_us"] = _host_us(case.direct)
                rows.append(row)
            except Exception as exc:
                traceback.print_exc(limit=2)
                rows.append(
                    {"shape": case.name, "variant": "table", "error": f"{type(exc).__name__}: {exc}"[:200]}
                )
            log(f"{case.name}: cuDNN and table done")
            flush()
        for d in sorted({case.d for case in cases}, reverse=True):
            base = saved[d]
            for name, change in variants.get(d, []):
                cfg = dataclasses.replace(base, **change)
                fields = ",".join(f for f in FWD_BITS_FIELDS if getattr(cfg, f) != getattr(base, f))
                for case in (c for c in cases if c.d == d):
                    if budget_left() <= 0:
                        skipped.append(f"{name} @ {case.name}")
                        continue
                    _configs.GPU_CONFIGS[d] = cfg
                    try:
                        ref = refs.get(case.name)
                        key = (case.name, *(getattr(cfg, f) for f in FWD_BITS_FIELDS))
                        if fields and key in class_refs:  # bits-changing: compare within its class
                            ref_name, ref = class_refs[key]
                        row, outs = _forward_rows(
                            case, name, fields, case.direct, cudnn[case.name], ref, budget_left
                        )
                        if fields:
                            row["bits"] += " vs " + (ref_name if key in class_refs else "table")
                            class_refs.setdefault(key, (name, outs))
                        rows.append(row)
                        del outs
                    except Exception as exc:  # e.g. out of shared memory or registers for one variant
                        traceback.print_exc(limit=2)
                        first_line = str(exc).splitlines()[0] if str(exc) else ""
                        rows.append(
                            {"shape": case.name, "variant": name, "bits_fields": fields,
                             "error": f"{type(exc).__name__}: {first_line}"[:200]}
                        )  # fmt: skip
                        if not _cuda_ok():
                            notes.append(f"CUDA context broken after {name} @ {case.name}: stopped there.")
                            raise _Stop from exc
                    finally:
                        _configs.GPU_CONFIGS[d] = base
                log(f"{name} done")
                flush()
    except _Stop:
        pass
    finally:
        _configs.GPU_CONFIGS.clear()
        _configs.GPU_CONFIGS.update(saved)
    flush()
    text = _forward_markdown(rows, [c.name for c in cases])
    if skipped:
        text += "\n\nSkipped (time budget): " + "; ".join(skipped)
    if notes:
        text += "\n\n" + "\n".join(notes)
    text += "\n\nTable at this run: " + "; ".join(f"D{d}: {c}" for d, c in sorted(saved.items()))
    text += f"\n\nTotal {time.perf_counter() - began:.0f} s."
    return text, rows


class _Stop(Exception):
    pass


def _forward_markdown(rows, shape_names) -> str:
    lines = [
        "| shape | variant | bits fields | eager ms | graph ms | graph TFLOP/s | eager/cuDNN | graph/cuDNN "
        "| host us | det | bits |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['variant']} | {r.get('bits_fields', '')} | {r['error'][:60]} |"
                         " | | | | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r.get('bits_fields') or '-'} | {_fmt(r.get('eager_ms'))} | "
            f"{_fmt(r.get('graph_ms'))} | {_fmt(r.get('graph_tflops'), 0)} | "
            f"{_fmt(r.get('eager_vs_cudnn'), 2)} | {_fmt(r.get('graph_vs_cudnn'), 2)} | "
            f"{_fmt(r.get('host_us'), 0)} | {r.get('det', '')} | {r.get('bits', '')} |"
        )
    # one line per variant: eager/cuDNN (graph/cuDNN) at every shape
    order = list(dict.fromkeys(r["variant"] for r in rows if r["variant"] != "sdpa cuDNN"))
    summary = [
        "",
        "Ratio to cuDNN per shape, eager (graph); >= 0.80 is the target:",
        "",
        "| variant | " + " | ".join(shape_names) + " | bits vs table |",
        "|---|" + "---:|" * len(shape_names) + "---|",
    ]
    for variant in order:
        cells, bits = [], set()
        for shape in shape_names:
            hit = [r for r in rows if r["variant"] == variant and r["shape"] == shape and "error" not in r]
            if not hit:
                cells.append("")
                continue
            r = hit[0]
            cells.append(f"{_fmt(r.get('eager_vs_cudnn'), 2)} ({_fmt(r.get('graph_vs_cudnn'), 2)})")
            if r.get("bits"):
                bits.add(r["bits"])
        summary.append(f"| {variant} | " + " | ".join(cells) + f" | {'; '.join(sorted(bits))} |")
    return "\n".join(lines + summary)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--forward", action="store_true", help="forward variants only (FWD_VARIANTS)")
    parser.add_argument("--variants", default="", help="forward mode: comma-separated name fragments to keep")
    parser.add_argument("--budget", type=float, default=FWD_BUDGET_S, help="forward mode: seconds")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ablate_attention: needs a CUDA GPU", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    if args.forward:
        words = [w.strip() for w in args.variants.split(",") if w.strip()]
        variants = {
            d: [(n, c) for n, c in vs if not words or any(w in n for w in words)]
            for d, vs in FWD_VARIANTS.items()
        }
        text, _ = run_forward(variants, args.budget, args.out)
        text = "## det-attn forward ablation, bf16 B4 H32, " + torch.cuda.get_device_name() + "\n\n" + text
        print(text)
        (args.out / "det-attn_ablation_forward.md").write_text(text + "\n")
        return 0
    text = "## det-attn ablation, bf16 causal B4 H32, " + torch.cuda.get_device_name() + "\n\n" + run()
    print(text)
    (args.out / "det-attn_ablation.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
