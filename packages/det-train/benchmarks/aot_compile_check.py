"""Compile det_train's matmul / dW / norm-backward kernels for sm_90a without a GPU; report spills.

Uses Triton's ahead-of-time path (``triton.compile`` of an ``ASTSource`` for ``GPUTarget("cuda",
90, 32)``) and, when present, the ``ptxas`` bundled with Triton (``-v``) for registers and spills.
A CPU-side check of the fixed config table: every table entry must compile, use wgmma, pipeline its
loads, and not spill (the TMA forward and the lean dW kernel of the table included). Depends on
Triton internals (checked
with Triton 3.9); not a test.

    python packages/det-train/benchmarks/aot_compile_check.py [--ptx-digest] [--norms]

``--norms`` compiles only the RMSNorm and LayerNorm forward and backward and the chunk-fold
kernels (the shipped prefetch / unroll settings and the former ones: registers before and after a
latency change).

``--ptx-digest`` compiles without line info (``TRITON_DISABLE_LINE_INFO=1``) and prints each entry's
PTX sha256: a refactor that must keep the kernels shows the same digests before and after.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
DIGEST = "--ptx-digest" in sys.argv[1:]
NORMS_ONLY = "--norms" in sys.argv[1:]
if DIGEST:  # read at compile time: source line numbers would otherwise be part of the PTX
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "packages/det-train/torch-ext"), str(ROOT / "shared/det-core")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

importlib.import_module("det_train.ops.matmul")
importlib.import_module("det_train.ops.weight_grad")
fold_mod = importlib.import_module("det_train.ops._leaf_fold")
mm = sys.modules["det_train.ops.matmul"]
lin = sys.modules["det_train.ops.weight_grad"]
cfgs = (
    sys.modules["det_train.ops.configs"]
    if "det_train.ops.configs" in sys.modules
    else importlib.import_module("det_train.ops.configs")
)

TARGET = GPUTarget("cuda", 90, 32)
# arguments the kernels do not specialize (do_not_specialize) or that need not be multiples of 16;
# batch strides are 0 for 2-D operands, so divisible like the other strides
NOT_DIVISIBLE = {"M", "T", "run_start", "leaves", "blocks", "num_programs", "n_chunks", "skip"}


def _ptxas() -> Path | None:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return bin_dir / name
    return None


def compile_one(name, fn, types, constexprs, num_warps, num_stages) -> bool:
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if sig[n] != "constexpr" and n not in NOT_DIVISIBLE
    }
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    try:
        kernel = triton.compile(
            src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
        )
    except Exception as exc:  # report every entry
        print(f"{name}: COMPILE FAILED: {type(exc).__name__}: {str(exc)[-1500:]}")
        return False
    ptx = kernel.asm.get("ptx", "")
    info = f"shared={kernel.metadata.shared} wgmma={'wgmma' in ptx}"
    if DIGEST:
        info += f" ptx_sha256={hashlib.sha256(ptx.encode()).hexdigest()[:16]}"
    ptxas = _ptxas()
    ok = True
    if ptxas is not None:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.ptx").write_text(ptx)
            cmd = [
                str(ptxas),
                "-arch=sm_90a",
                "-v",
                str(Path(tmp) / "k.ptx"),
                "-o",
                str(Path(tmp) / "k.cubin"),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln.strip() for ln in out.stderr.splitlines() if "registers" in ln or "spill" in ln]
        info += " | " + " | ".join(lines)
        ok = not any(
            "spill stores" in ln and not ln.startswith("0 bytes stack frame, 0 bytes spill") for ln in lines
        )
    print(f"{name}: {info}")
    return ok


def norm_entries() -> int:
    """The RMSNorm forward (bf16 / fp32 rows of D 768 and 4096, one row per program as on the GPU) and
    backward (the same rows, with and without weight, without prefetch and at the shipped depth,
    row by row as on the GPU) and the chunk folds (the former plan and ``_fold_plan``'s);
    returns the failures."""
    rms = importlib.import_module("det_train.ops.rms_norm")
    sums = importlib.import_module("det_train.accum._leaf_sums")
    bad = 0

    def known(fn, meta):  # an older kernel without a new constexpr compiles as it was
        return {k: v for k, v in meta.items() if k in fn.arg_names}

    fn = rms._rms_norm_fwd_kernel
    for tname in ("*bf16", "*fp32"):
        types = {n: tname for n in ("x_ptr", "w_ptr", "y_ptr")}
        types.update(rstd_ptr="*fp32", eps="fp32")
        for d in (768, 4096):
            block_d = triton.next_power_of_2(d)
            meta = dict(HAS_WEIGHT=True, OFFSET=0.0, BLOCK_D=block_d, ROWS=1)
            bad += not compile_one(
                f"rms fwd {tname[1:]} D={d}", fn, types, known(fn, meta), rms.num_warps_for(block_d), 3
            )
    fn = rms._rms_norm_bwd_kernel
    for tname in ("*bf16", "*fp32"):
        types = {n: tname for n in ("dy_ptr", "x_ptr", "w_ptr", "dx_ptr")}
        types.update(rstd_ptr="*fp32", dw_partial_ptr="*fp32")
        for d in (768, 4096):
            block_d = triton.next_power_of_2(d)
            for has_w in (True, False):
                for prefetch in sorted({0, getattr(rms, "BWD_PREFETCH", 0)}):  # the former, the shipped
                    meta = dict(HAS_WEIGHT=has_w, OFFSET=0.0, ROWS_PER_CHUNK=rms.MAX_ROWS_PER_CHUNK,
                                BLOCK_D=block_d, PREFETCH=prefetch, TILE=0)  # fmt: skip
                    if "PREFETCH" not in fn.arg_names and prefetch:
                        continue
                    bad += not compile_one(
                        f"rms bwd {tname[1:]} D={d} weight={has_w} prefetch={prefetch}", fn, types,
                        known(fn, meta), rms.num_warps_for(block_d), 3,
                    )  # fmt: skip
    ln = importlib.import_module("det_train.ops.layer_norm")
    for tname in ("*bf16", "*fp32"):  # LayerNorm: the same row programs, one row at a time
        for d in (768, 4096):
            block_d = triton.next_power_of_2(d)
            types = {n: tname for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
            types.update(mean_ptr="*fp32", rstd_ptr="*fp32", eps="fp32")
            meta = dict(HAS_WEIGHT=True, HAS_BIAS=True, BLOCK_D=block_d, ROWS=1)
            fn = ln._layer_norm_fwd_kernel
            bad += not compile_one(
                f"ln fwd {tname[1:]} D={d}", fn, types, known(fn, meta), ln.num_warps_for(block_d), 3
            )
            types = {n: tname for n in ("dy_ptr", "x_ptr", "w_ptr", "dx_ptr")}
            types.update(mean_ptr="*fp32", rstd_ptr="*fp32", dw_partial_ptr="*fp32")
            meta = dict(HAS_WEIGHT=True, ROWS_PER_CHUNK=ln.MAX_ROWS_PER_CHUNK, BLOCK_D=block_d, TILE=0)
            fn = ln._layer_norm_bwd_kernel
            bad += not compile_one(
                f"ln bwd {tname[1:]} D={d}", fn, types, known(fn, meta), ln.num_warps_for(block_d), 3
            )
    plan = getattr(sums, "_fold_plan", None)
    plans = {(1024, 1, 4)} | ({plan(768), plan(4096)} if plan else set())
    for block, unroll, warps in sorted(plans):
        for name, fn, extra in (
            ("fold", sums._fold_chunks_kernel, {}),
            ("fold resume", sums._fold_chunks_resume_kernel, dict(RESUME=True)),
        ):
            if "UNROLL" not in fn.arg_names and unroll != 1:
                continue
            types = dict(partial_ptr="*fp32", init_ptr="*fp32", out_ptr="*fp32")
            meta = dict(CHUNKS_PER_LEAF=64, BLOCK=block, UNROLL=unroll, **extra)
            bad += not compile_one(
                f"{name} BLOCK={block} UNROLL={unroll} warps={warps}", fn, types, known(fn, meta), warps, 3
            )
    return bad


def main() -> int:
    if NORMS_ONLY:
        bad = norm_entries()
        print("all entries compile without spills" if not bad else f"{bad} entries failed or spill")
        return 1 if bad else 0
    bad = norm_entries()
    for dtype, tname in ((torch.bfloat16, "*bf16"), (torch.float16, "*fp16")):
        types = {"a_ptr": tname, "b_ptr": tname, "c_ptr": tname, "carry_ptr": "*fp32", "bias_ptr": tname}
        for layout, unit in (("nn", dict(stride_ak=1, stride_bn=1)), ("nt", dict(stride_ak=1, stride_bk=1))):
            for cls, (n, k) in (("large", (4096, 4096)), ("small", (64, 64))):
                c = cfgs.matmul_config(dtype, layout, n, k)  # many rows (the TMA entry where there is one)
                p = cfgs.matmul_config(dtype, layout, n, k, rows=1)  # few rows: the pointer kernel's entry
                for bias, nk in ((False, False), (True, False), (False, layout == "nt")):
                    const = dict(
                        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
                        EVEN_K=True, HAS_CARRY=False, HAS_BIAS=bias, UPCAST=False, DOT_PRECISION=None,
                        BF16_BY_BITS=False, B_NK_TILES=nk, stride_cn=1, **unit,
                    )  # fmt: skip
                    bad += not compile_one(
                        f"matmul {dtype} {layout} {cls} bias={bias} nk={nk}", mm._matmul_kernel, types, const,
                        p.num_warps, p.num_stages,
                    )  # fmt: skip
                mid = cfgs.matmul_config(dtype, layout, 768, 768, rows=2048)  # the "mid" rows class
                if cls == "large" and not mid.tma:
                    const = dict(
                        BLOCK_M=mid.block_m, BLOCK_N=mid.block_n, BLOCK_K=mid.block_k, GROUP_M=mid.group_m,
                        EVEN_K=True, HAS_CARRY=False, HAS_BIAS=False, UPCAST=False, DOT_PRECISION=None,
                        BF16_BY_BITS=False, B_NK_TILES=False, stride_cn=1, **unit,
                    )  # fmt: skip
                    bad += not compile_one(
                        f"matmul {dtype} {layout} mid rows", mm._matmul_kernel, types, const,
                        mid.num_warps, mid.num_stages,
                    )  # fmt: skip
                tma_entries = [("", c)] if c.tma else []
                if cls == "large" and mid.tma:
                    tma_entries.append((" mid rows", mid))
                for label, c in tma_entries:  # the TMA kernels the entries select (host descriptors)
                    kmajor = layout == "nt"
                    b_block = [c.block_n, c.block_k] if kmajor else [c.block_k, c.block_n]
                    ttypes = {
                        "a_desc": f"tensordesc<{tname[1:]}[{c.block_m}, {c.block_k}]>",
                        "b_desc": f"tensordesc<{tname[1:]}[{b_block[0]}, {b_block[1]}]>",
                        "c_ptr": tname, "bias_ptr": tname,
                    }  # fmt: skip
                    for bias in (False, True):
                        const = dict(
                            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                            B_KMAJOR=kmajor, PERSISTENT=c.persistent, HAS_BIAS=bias, UPCAST=False,
                            DOT_PRECISION=None, BF16_BY_BITS=False, stride_cn=1,
                        )  # fmt: skip
                        bad += not compile_one(
                            f"matmul TMA {dtype} {layout} {cls}{label} bias={bias}", mm._matmul_tma_kernel,
                            ttypes, const, c.num_warps, c.num_stages,
                        )  # fmt: skip
        for n, k, cls in ((4096, 4096, "wide"), (2304, 768, "large"), (768, 768, "mid")):
            w = cfgs.weight_grad_config(dtype, n, k)  # the half dtypes' two dW entries (and the fold's)
            f = cfgs.weight_grad_fold_config(dtype, n, k)
            wtypes = {"dy_ptr": tname, "x_ptr": tname, "out_ptr": tname, "scratch_ptr": "*fp32"}
            common = dict(
                BLOCK_N=w.block_n, BLOCK_K=w.block_k, BLOCK_T=w.block_t, GROUP_N=w.group_n, EVEN_T=True,
                UPCAST=False, DOT_PRECISION=None, BF16_BY_BITS=False, stride_dyn=1, stride_xk=1, stride_ok=1,
            )  # fmt: skip
            levels = w.leaves_per_program.bit_length() - 1
            if cls != "mid" and w.lean:  # the table's dW kernel
                ltypes = dict(wtypes)
                if w.tma:
                    ltypes["dy_ptr"] = f"tensordesc<{tname[1:]}[{w.block_t}, {w.block_n}]>"
                    ltypes["x_ptr"] = f"tensordesc<{tname[1:]}[{w.block_t}, {w.block_k}]>"
                quads = w.quads and w.tma and levels >= 2
                lean = dict(
                    common, MAX_LEVELS=levels - (2 if quads else 1 if w.pairs else 0), PAIRS=w.pairs,
                    TMA=w.tma, MERGE_ROWS=min(32, w.block_n), QUADS=quads, FLAT=quads and w.flat,
                )  # fmt: skip
                bad += not compile_one(
                    f"dW {dtype} {cls} lean tma={w.tma} quads={quads} flat={w.flat} maxnreg=None",
                    lin._weight_grad_lean_kernel, ltypes, lean, w.num_warps, w.num_stages,
                )  # fmt: skip
            if cls != "mid" and w.lean and w.pairs:  # the entry when TMA does not apply (pointer, pairs)
                fallback = dict(
                    common, MAX_LEVELS=levels - 1, PAIRS=True, TMA=False, MERGE_ROWS=min(32, w.block_n),
                    QUADS=False, FLAT=False,
                )  # fmt: skip
                bad += not compile_one(
                    f"dW {dtype} {cls} lean pointer loads (no TMA)", lin._weight_grad_lean_kernel, wtypes,
                    fallback, w.num_warps, w.num_stages,
                )  # fmt: skip
            for tma in (True, False):  # the open leaf's resumable fold (gradient accumulation)
                ftypes = {"dy_ptr": tname, "x_ptr": tname, "acc_ptr": "*fp32", "out_ptr": "*fp32"}
                if tma:
                    ftypes["dy_ptr"] = f"tensordesc<{tname[1:]}[{f.block_t}, {f.block_n}]>"
                    ftypes["x_ptr"] = f"tensordesc<{tname[1:]}[{f.block_t}, {f.block_k}]>"
                block_k = f.block_k if tma else min(f.block_k, 128)  # weight_grad_fold's pointer tile
                fold = dict(
                    BLOCK_N=f.block_n, BLOCK_K=block_k, BLOCK_T=f.block_t, GROUP_N=f.group_n, RESUME=True,
                    TMA=tma, EVEN_T=True, UPCAST=False, DOT_PRECISION=None, stride_dyn=1, stride_xk=1,
                )  # fmt: skip
                bad += not compile_one(
                    f"dW {dtype} {cls} fold tma={tma}", fold_mod._weight_grad_fold_kernel, ftypes, fold,
                    f.num_warps, f.num_stages,
                )  # fmt: skip
            if cls == "mid":
                continue
            bad += not compile_one(
                f"dW {dtype} {cls} one leaf",
                lin._weight_grad_kernel,
                wtypes,
                dict(common, LEAVES=1),
                w.num_warps,
                w.num_stages,
            )
    print("all entries compile without spills" if not bad else f"{bad} entries failed or spill")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
