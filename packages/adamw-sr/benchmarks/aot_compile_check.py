"""Compile adamw_sr's step kernel for sm_90a on a machine without a GPU; report PTX digests and registers.

Uses Triton's ahead-of-time path (``triton.compile`` of an ``ASTSource`` for ``GPUTarget("cuda", 90,
32)``, as tests/test_adamw_sr_ptx.py does) over the variants the optimizer launches (param and grad
dtypes, amsgrad, maximize, rounding, aligned or not, the committed CUDA launch config; with and
without AMP unscaling / skipping; then the bf16- and 8-bit-moment kernel's variants, named
``states...``), and, when Triton bundles ``ptxas``, its ``-v`` report (registers, spills).
Last, the per-tensor scalar kernel (``scalars``). ``--dump DIR`` writes each variant's PTX
instructions, so that a host-code or kernel edit that must keep the bits can be checked by diffing
them before and after it. Digests and dumps leave out the ``.param`` declarations, source-line
records and comments, and name the kernel ``KERNEL`` (see ``ptx_code``): a moved line, a renamed
kernel or an argument appended after the existing ones changes neither. Depends on Triton
internals (checked with Triton 3.9); not a test.

    python packages/adamw-sr/benchmarks/aot_compile_check.py [--dump DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "packages/adamw-sr/torch-ext"), str(ROOT / "shared/det-core")]

import triton  # noqa: E402
from adamw_sr import _kernel, _launch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = dict(
    exp_avg_ptr="*fp32", exp_avg_sq_ptr="*fp32", max_exp_avg_sq_ptr="*fp32", tensor_table_ptr="*i64",
    chunk_table_ptr="*i64", steps_ptr="*fp32", hyper_ptr="*fp64", scalars_ptr="*fp32",
    grad_scale_ptr="*fp32", found_inf_ptr="*fp32",
)  # fmt: skip
SCALAR_TYPES = dict(seed_lo="i64", seed_hi="i64", rng_stream="i32")


def _ptxas() -> Path | None:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):  # Triton 3.9's plain ptxas predates its PTX version
        if (bin_dir / name).exists():
            return bin_dir / name
    return None


def compile_variant(param: str, grad: str, meta: dict) -> str:
    """The PTX of ``adamw_sr_kernel`` for ``param``/``grad`` dtypes (``"bf16"``/``"fp32"``) and ``meta``;
    with a ``STATE`` in ``meta``, of ``adamw_sr_states_kernel`` (bf16 or 8-bit moments)."""
    fn = _kernel.adamw_sr_kernel
    types = dict(POINTER_TYPES, param_ptr="*" + param, grad_ptr="*" + grad, **SCALAR_TYPES)
    if "STATE" in meta:
        fn = _kernel.adamw_sr_states_kernel
        moment = "*bf16" if meta["STATE"] == _kernel.FORMAT_BF16 else "*u8"
        types.update(
            exp_avg_ptr=moment, exp_avg_sq_ptr=moment, max_exp_avg_sq_ptr=moment, exp_avg_scale_ptr="*u8",
            exp_avg_sq_scale_ptr="*u8",
        )  # fmt: skip
    sig = {n: "constexpr" if n.isupper() else types[n] for n in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in meta.items() if k in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
    options = dict(num_warps=meta.get("num_warps", _kernel.LAUNCH_CONFIGS["cuda"]["num_warps"]),
                   **_launch.exactness_options())  # fmt: skip
    if meta.get("maxnreg"):
        options["maxnreg"] = meta["maxnreg"]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options).asm["ptx"]


def state_config(state: int) -> dict:
    """The committed CUDA launch config of the bf16- or 8-bit-moment kernel."""
    return _kernel.LAUNCH_CONFIGS[{_kernel.FORMAT_BF16: "cuda-bf16", _kernel.FORMAT_8BIT: "cuda-8bit"}[state]]


def compile_scalars() -> str:
    """The PTX of ``step_scalars_kernel`` as ``_launch.launch_fused_step`` launches it."""
    sig = dict(
        steps_ptr="*fp32", hyper_ptr="*fp64", scalars_ptr="*fp32", num_tensors="i32", BLOCK_T="constexpr"
    )
    src = ASTSource(fn=_kernel.step_scalars_kernel, signature=sig, constexprs={(4,): _kernel.SCALARS_BLOCK})
    options = dict(num_warps=4, **_launch.exactness_options())
    return triton.compile(src, target=TARGET, options=options).asm["ptx"]


def ptx_code(ptx: str) -> str:
    """The PTX's instructions: without ``.param`` declarations, source-line records (``.loc``, the
    debug sections and their ``$L__tmpN`` labels) and comments, and with the kernel's name (in its
    ``.entry`` line and its parameter names) replaced by ``KERNEL``, so that a line moved in
    _kernel.py, a body moved into an inlined helper, a renamed kernel or an appended argument does
    not show as a change."""
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    entry = re.search(r"\.entry\s+(\w+)\s*\(", ptx)
    if entry:
        ptx = re.sub(rf"\b{entry.group(1)}(?=\b|_param_)", "KERNEL", ptx)
    lines = []
    for ln in ptx.splitlines():
        ln = ln.split("//")[0].rstrip()
        # $L__tmpN: labels mark source lines for the debug sections (a function inlined from a
        # helper adds some); no instruction branches to them
        if ln and not re.match(r"\s*\.(param|loc|file)\s", ln) and not re.fullmatch(r"\$L__tmp\d+:", ln):
            lines.append(ln)
    return "\n".join(lines) + "\n"


def ptx_body_digest(ptx: str) -> str:
    """sha256 (16 hex digits) of ``ptx_code(ptx)``."""
    return hashlib.sha256(ptx_code(ptx).encode()).hexdigest()[:16]


def registers(ptx: str) -> str:
    ptxas = _ptxas()
    if ptxas is None:
        return "no ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        out = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True,
        )  # fmt: skip
    report = (out.stdout + out.stderr).splitlines()
    picked = [ln.split("info    : ")[-1].strip() for ln in report if "registers" in ln or "spill" in ln]
    return " | ".join(picked) or f"ptxas failed: {report[-1:]}"


def variants():
    config = _kernel.LAUNCH_CONFIGS["cuda"]
    base = dict(
        BLOCK=config["BLOCK"], SUB=config["SUB"], TILE_2D=config["TILE_2D"], PRECOMPUTED=config["PRECOMPUTED"]
    )
    for (param, grad), amsgrad, maximize, stochastic, aligned, amp in itertools.product(
        (("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")),
        (False, True),
        (False, True),
        (True, False),
        (True, False),
        ((False, False), (True, True), (False, True)),
    ):
        if param == "fp32" and not stochastic:
            continue  # STOCHASTIC only matters for bf16 params
        meta = dict(
            base, AMSGRAD=amsgrad, MAXIMIZE=maximize, PARAM_BF16=param == "bf16", STOCHASTIC=stochastic,
            ALIGNED=aligned, UNSCALE=amp[0], SKIP_ON_INF=amp[1],
        )  # fmt: skip
        name = (
            f"p{param}-g{grad}-ams{int(amsgrad)}-max{int(maximize)}-sr{int(stochastic)}-al{int(aligned)}"
            f"-unscale{int(amp[0])}-skip{int(amp[1])}"
        )
        yield name, param, grad, meta


def state_variants():
    """The bf16- and 8-bit-moment kernels (``adamw_sr_states_kernel``, each with its committed CUDA
    config), without AMP; AMP variants ``unscale1-skip1`` of the stochastic ones."""
    for (state, label), param, amsgrad, state_sr, aligned, amp in itertools.product(
        ((_kernel.FORMAT_BF16, "bf16"), (_kernel.FORMAT_8BIT, "8bit")),
        ("bf16", "fp32"),
        (False, True),
        (True, False),
        (True, False),
        (False, True),
    ):
        if (amsgrad and state == _kernel.FORMAT_8BIT) or (amp and not state_sr):
            continue  # no amsgrad with 8 bits
        config = state_config(state)
        base = dict(
            BLOCK=config["BLOCK"], SUB=config["SUB"], TILE_2D=config["TILE_2D"],
            PRECOMPUTED=config["PRECOMPUTED"], MAXIMIZE=False, STOCHASTIC=True,
            EDGE_SUB=config.get("EDGE_SUB", config["SUB"]), num_warps=config["num_warps"],
            maxnreg=config.get("maxnreg"),
        )  # fmt: skip
        meta = dict(
            base, AMSGRAD=amsgrad, PARAM_BF16=param == "bf16", ALIGNED=aligned, UNSCALE=amp, SKIP_ON_INF=amp,
            STATE=state, STATE_STOCHASTIC=state_sr,
        )  # fmt: skip
        name = (
            f"states{label}-p{param}-g{param}-ams{int(amsgrad)}-statesr{int(state_sr)}-al{int(aligned)}"
            f"-unscale{int(amp)}-skip{int(amp)}"
        )
        yield name, param, param, meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, help="write each variant's PTX into this folder")
    parser.add_argument("--no-amp", action="store_true", help="only the variants without AMP")
    parser.add_argument("--no-states", action="store_true", help="only the fp32-moment kernel's variants")
    args = parser.parse_args()
    has_amp = "UNSCALE" in _kernel.adamw_sr_kernel.arg_names
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    has_states = hasattr(_kernel, "adamw_sr_states_kernel")
    todo = itertools.chain(variants(), () if args.no_states or not has_states else state_variants())
    for name, param, grad, meta in todo:
        if (meta["UNSCALE"] or meta["SKIP_ON_INF"]) and (args.no_amp or not has_amp):
            continue
        ptx = compile_variant(param, grad, meta)
        if args.dump:
            (args.dump / f"{name}.ptx").write_text(ptx_code(ptx))
        print(f"{name}: ptx {ptx_body_digest(ptx)} | {registers(ptx)}", flush=True)
    ptx = compile_scalars()
    if args.dump:
        (args.dump / "scalars.ptx").write_text(ptx_code(ptx))
    print(f"scalars: ptx {ptx_body_digest(ptx)} | {registers(ptx)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
