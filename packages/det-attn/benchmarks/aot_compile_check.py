"""Compile det_attn's kernels for sm_90a on a machine without a GPU: every table entry (forward,
backward preprocess, dK/dV and dQ; padded batch and packed, causal or not, dropout or not) and
every forward variant of ``ablate_attention.FWD_VARIANTS``; report registers, spills, shared memory.

Uses Triton's ahead-of-time path (``triton.compile`` of an ``ASTSource`` for ``GPUTarget("cuda",
90, 32)``) with the launch arguments the launcher would pass at B4 H32 T4096 bf16 (built by
``_plans.build`` on meta tensors, specialized as Triton 3.6 does: ints equal to 1 become
constants, multiples of 16 get the divisibility hint), then the ``ptxas`` bundled with Triton
(``-v``). Per entry: registers, spill bytes, shared memory (> 227 KiB cannot launch on an H200),
whether the dots became wgmma and the loads TMA, and programs per SM (registers and shared memory
alike). A CPU-side check, not a test; depends on Triton internals. To check what the H200 machine
runs, use Triton 3.6 (the wheel extracted at /tmp/tri36):

    PYTHONPATH=/tmp/tri36 python packages/det-attn/benchmarks/aot_compile_check.py [--only WORD]

``--ptx-digest`` compiles without line info (``TRITON_DISABLE_LINE_INFO=1``: source file names and
line numbers are not code, and they move whenever code moves between files) and adds per entry the
sha256 of its PTX and of its SASS (``cuobjdump -sass`` of the cubin, bundled with Triton): a
refactor that must keep the kernels' bits compares these before and after.

``--masking`` adds the sliding-window and soft-cap specializations (``WINDOW`` 4096 with
``SOFTCAP`` 50, and each alone; causal, forward, dK/dV and dQ, padded and packed, no dropout):
entries of their own, so the default entries (and their digests) are the switches' off state.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [
    str(ROOT / "packages/det-attn/torch-ext"),
    str(ROOT / "shared/det-core"),
    str(Path(__file__).parent),
]

import torch  # noqa: E402
import triton  # noqa: E402
from det_attn import _bwd_kernels, _configs, _fwd_kernel, _plans  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes a block may use on sm_90 (227 KiB)
SM_SMEM, SM_REGS = 233472, 65536  # per SM: 228 KiB shared memory (1 KiB reserved per block), registers
B, H, T = 4, 32, 4096


def _ptxas_v(ptx: str) -> str:
    """``ptxas -v`` output for sm_90a from the first bundled ptxas that accepts this PTX version
    (Triton 3.6: ``ptxas``; later Triton emits PTX only its ``ptxas-blackwell`` reads)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    err = "no bundled ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx_path.write_text(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            if not (bin_dir / name).exists():
                continue
            cmd = [str(bin_dir / name), "-arch=sm_90a", "-v", str(ptx_path), "-o", str(cubin)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode == 0:
                return out.stderr
            err = out.stderr.strip().splitlines()[0] if out.stderr.strip() else f"{name} failed"
    raise RuntimeError(err)


def _sass_digest(cubin: bytes) -> str:
    """sha256 of the SASS of ``cubin`` (the bundled ``cuobjdump -sass``), or why there is none."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return "n/a (no bundled cuobjdump)"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        return "n/a (cuobjdump failed)"
    # the dump names the temporary file; the rest is code
    sass = "\n".join(line for line in out.stdout.splitlines() if "k.cubin" not in line)
    return hashlib.sha256(sass.encode()).hexdigest()[:16]


def _plan(cfg, head_dim: int, causal: bool, dropout: bool, packed: bool, window=0, softcap=0.0):
    """The launcher's plan at B, H, T with ``cfg`` in the table (padded batch, or ``packed``)."""
    q = torch.empty((B * T, H, head_dim), dtype=torch.bfloat16, device="meta")
    dense = None if packed else (B, T, T)
    saved = _configs.GPU_CONFIGS[head_dim]
    _configs.GPU_CONFIGS[head_dim] = cfg
    try:
        scale = 1.0 / math.sqrt(head_dim)
        return _plans.build(q, q, dense, B, T, T, scale, causal, dropout, False, window, softcap)
    finally:
        _configs.GPU_CONFIGS[head_dim] = saved


def _drop(dropout: bool) -> tuple:
    return _plans.dropout_args(0.1 if dropout else 0.0, 1234 if dropout else None, 0, 0)


def _launch_args(kernel: str, plan, dropout: bool, packed: bool):
    """(kernel, positional values, constexprs and options, host descriptors) of one launch of
    ``plan``: pointers as Triton type strings, then the plan's sizes and strides."""
    cu = ["*i32"] * 2 if packed else ["*fp32"] * 2  # a padded batch passes an fp32 buffer
    drop = _drop(dropout)
    if kernel == "fwd":
        if plan.fwd_tma:
            tensors = [f"tensordesc<bf16{list(d.block_shape)}>" for d in plan.fwd_descs]
        else:
            tensors = ["*bf16"] * 4
        values = [*tensors, "*fp32", *cu, *plan.fwd.sizes, *drop, *plan.fwd_strides]
        return _fwd_kernel.attn_fwd_kernel, values, dict(plan.fwd.meta), plan.fwd_tma
    if kernel == "pre":
        values = ["*bf16", "*bf16", "*fp32", *plan.pre_args]
        return _bwd_kernels.attn_bwd_preprocess_kernel, values, dict(plan.pre_meta), False
    if kernel == "dkdv":
        values = [*["*bf16"] * 4, "*fp32", "*fp32", "*bf16", "*bf16", *cu]
        values += [*plan.dkdv_sizes, *drop, *plan.dkdv_strides]
        return _bwd_kernels.attn_bwd_dkdv_kernel, values, dict(plan.dkdv_meta), False
    values = [*["*bf16"] * 4, "*fp32", "*fp32", "*bf16", *cu, *plan.dq_sizes, *drop, *plan.dq_strides]
    return _bwd_kernels.attn_bwd_dq_kernel, values, dict(plan.dq_meta), False


def compile_entry(label: str, fn, values: list, meta: dict, tma: bool, digest: bool) -> str:
    """Compile one launch; print its line; return its status (OK, SPILL, SMEM, FAIL)."""
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
    options.setdefault("num_warps", 4)
    options.setdefault("num_stages", 3)
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr}
    constexprs.update(meta)
    signature, attrs = {}, {}
    for i, (param, value) in enumerate(zip(fn.params, values, strict=False)):
        if isinstance(value, str):  # pointer or tensor descriptor
            signature[param.name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif value == 1 and not param.do_not_specialize:
            signature[param.name] = "constexpr"
            constexprs[param.name] = 1
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for param in fn.params[len(values) :]:
        signature[param.name] = "constexpr"
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    try:
        kernel = triton.compile(src, target=TARGET, options=options)
    except Exception as exc:  # report every entry
        print(f"{label}: COMPILE FAILED: {type(exc).__name__}: {str(exc)[-800:]}")
        return "FAIL"
    ptx = kernel.asm.get("ptx", "")
    try:
        report = _ptxas_v(ptx)
    except RuntimeError as exc:
        print(f"{label}: PTXAS FAILED: {exc}")
        return "FAIL"
    regs = spills = 0
    for line in report.splitlines():
        if "Used" in line and "registers" in line:
            regs = int(line.split("Used")[1].split("registers")[0])
        if "spill stores" in line:
            spills = int(line.split("bytes spill stores")[0].split(",")[-1])
    smem = kernel.metadata.shared
    threads = 32 * options["num_warps"]
    per_sm = min(SM_REGS // (threads * (-(-regs // 8) * 8)) if regs else 0, SM_SMEM // (smem + 1024))
    status = "FAIL" if not regs else "SMEM" if smem > SMEM_LIMIT else "SPILL" if spills else "OK"
    line = (
        f"{label}: {status} regs={regs} spill_stores={spills}B smem={smem / 1024:.1f}KiB "
        f"programs/SM={per_sm} wgmma={'wgmma.mma_async' in ptx} tma={'cp.async.bulk.tensor' in ptx} "
        f"host_descriptors={tma} warps={options['num_warps']} stages={options['num_stages']}"
        + (f" maxnreg={options['maxnreg']}" if options.get("maxnreg") else "")
    )
    if digest:
        line += f" ptx_sha256={hashlib.sha256(ptx.encode()).hexdigest()[:16]}"
        line += f" sass_sha256={_sass_digest(kernel.asm['cubin'])}"
    print(line)
    return status


def _masking_entries() -> list:
    """(label, plan, kernel, dropout, packed) of the window / soft-cap specializations."""
    entries = []
    for head_dim, table in sorted(_configs.GPU_CONFIGS.items(), reverse=True):
        for window, softcap in ((4096, 50.0), (4096, 0.0), (0, 50.0)):
            for packed in (False, True):
                plan = _plan(table, head_dim, True, False, packed, window, softcap)
                for kernel in ("fwd", "dkdv", "dq"):
                    label = f"D{head_dim} causal window={window} softcap={softcap:g} {kernel}"
                    entries.append((label + (" packed" if packed else ""), plan, kernel, False, packed))
    return entries


def _entries() -> list:
    """(label, plan, kernel, dropout, packed) of every entry: per head dim, causal or not and
    dropout or not, the table's forward, preprocess, dK/dV and dQ on a padded batch, the same
    packed, then each forward variant (padded; with dropout for causal only)."""
    from ablate_attention import FWD_VARIANTS

    entries = []
    for head_dim, table in sorted(_configs.GPU_CONFIGS.items(), reverse=True):
        for causal in (True, False):
            kind = f"D{head_dim} {'causal' if causal else 'full'}"
            for dropout in (False, True):
                for packed in (False, True):
                    plan = _plan(table, head_dim, causal, dropout, packed)
                    for kernel in ("fwd", "pre", "dkdv", "dq"):
                        if kernel == "pre" and (dropout or causal or packed):
                            continue  # one preprocess launch per head dim: it reads none of these
                        name = "table" if kernel == "fwd" and not packed else f"table {kernel}"
                        name += " packed" if packed else ""
                        label = f"{kind}{' dropout' if dropout else ''} {name}"
                        entries.append((label, plan, kernel, dropout, packed))
            for name, change in FWD_VARIANTS.get(head_dim, []):
                cfg = dataclasses.replace(table, **change)
                for dropout in (False, True) if causal else (False,):  # dropout: no cap, own stages
                    plan = _plan(cfg, head_dim, causal, dropout, False)
                    label = f"{kind}{' dropout' if dropout else ''} {name}"
                    entries.append((label, plan, "fwd", dropout, False))
    return entries


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="compile the entries whose label contains this")
    parser.add_argument(
        "--ptx-digest", action="store_true", help="compile without line info; print PTX and SASS sha256"
    )
    parser.add_argument(
        "--masking", action="store_true", help="also the sliding-window and soft-cap specializations"
    )
    args = parser.parse_args(argv)
    if args.ptx_digest:
        os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # read at compile time; part of the cache key
    print(f"Triton {triton.__version__}, target sm_90a" + (", no line info" if args.ptx_digest else ""))
    bad = []
    for label, plan, kernel, dropout, packed in _entries() + (_masking_entries() if args.masking else []):
        if args.only and args.only not in label:
            continue
        fn, values, meta, tma = _launch_args(kernel, plan, dropout, packed)
        status = compile_entry(label, fn, values, meta, tma, args.ptx_digest)
        if status != "OK":
            bad.append(f"{label}: {status}")
    print("\n".join(["", "not OK:", *bad]) if bad else "\nall entries compile without spills")
    # spills are reported, not failed: a few bytes can be the faster choice (the D128 pointer
    # loads under the table's cap spill 76 bytes and run two programs per SM); a compile failure
    # or too much shared memory fails
    return 1 if any(not b.endswith("SPILL") for b in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
