"""Instructions per element of adamw_sr's step, compiled for sm_90a on a machine without a GPU.

A proxy for the step's compute cost where it is compute-bound (bf16 and 8-bit moments): one full
(unmasked) tile of ``_step_tile``, the path nearly every tile takes, is compiled alone through a
wrapper kernel with the committed CUDA launch config (``SUB`` elements, ``num_warps``), and its
instructions are counted per element (``SUB / (32 * num_warps)`` elements per thread):

* ``ptx``: PTX instructions of the wrapper (no directives);
* ``sass``: SASS instructions of its main line (``ptxas`` and ``cuobjdump`` as Triton bundles them),
  up to ``EXIT``, the IEEE division / square-root slow-path subroutines after it left out;
* ``fast``: the SASS a thread executes when no division or square root takes its slow path (every
  forward branch over a ``CALL`` taken), the closest of the three to the executed count.

Variants as ``aot_compile_check.py`` names them (a regex selects). Static counts only: a GPU run
measures time (``bench_adamw.py``). Depends on Triton internals (checked with Triton 3.9); not a test.

    python packages/adamw-sr/benchmarks/tile_instruction_counts.py ["^states.*al1-unscale0"]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import aot_compile_check as aot  # sets up the paths and drops TRITON_INTERPRET
import triton
from adamw_sr import _kernel  # noqa: E402 (aot_compile_check set up the paths)
from triton.compiler import ASTSource

FP32_SCALARS = {
    "step_size", "bias_correction2_sqrt", "lr_decay", "beta1_f", "one_minus_beta1", "beta2_f",
    "one_minus_beta2", "eps_f", "inv_scale",
}  # fmt: skip


def _wrapper():
    """A jit kernel that calls ``_kernel._step_tile`` once, with all its arguments as its own."""
    names = list(inspect.signature(_kernel._step_tile.fn).parameters)
    params = [n + ": tl.constexpr" if n.isupper() else n for n in names]
    source = (
        "import triton\nimport triton.language as tl\nfrom adamw_sr import _kernel\n\n\n"
        f"@triton.jit\ndef tile_wrapper({', '.join(params)}):\n"
        f"    _kernel._step_tile({', '.join(names)})\n"
    )
    folder = tempfile.mkdtemp()
    Path(folder, "adamw_sr_tile_wrapper.py").write_text(source)
    sys.path.insert(0, folder)
    import adamw_sr_tile_wrapper

    return adamw_sr_tile_wrapper.tile_wrapper


def _types(fn, param: str, meta: dict) -> dict:
    moment = {_kernel.FORMAT_BF16: "*bf16", _kernel.FORMAT_8BIT: "*u8"}.get(meta["STATE"], "*fp32")
    pointers = dict(param_ptr="*" + param, grad_ptr="*" + param, exp_avg_ptr=moment, exp_avg_sq_ptr=moment,
                    max_exp_avg_sq_ptr=moment)  # fmt: skip
    types = {}
    for n in fn.arg_names:
        if n.isupper():
            types[n] = "constexpr"
        elif n.endswith("_ptr"):
            types[n] = pointers.get(n, "*u8")
        elif n in FP32_SCALARS:
            types[n] = "fp32"
        else:
            types[n] = "i32" if "stream" in n else "i64"
    return types


def compile_tile(fn, param: str, meta: dict) -> str:
    """The PTX of one unmasked tile of the variant ``meta``."""
    meta = dict({"STATE": _kernel.FORMAT_FP32, "STATE_STOCHASTIC": False}, **meta, MASKED=False)
    constexprs = {(fn.arg_names.index(k),): v for k, v in meta.items() if k in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
    options = dict(num_warps=meta.get("num_warps", _kernel.LAUNCH_CONFIGS["cuda"]["num_warps"]),
                   **aot._launch.exactness_options())  # fmt: skip
    src = ASTSource(fn=fn, signature=_types(fn, param, meta), constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=aot.TARGET, options=options).asm["ptx"]


def sass(ptx: str) -> list[tuple[int, str]]:
    """(address, instruction) of the compiled cubin's SASS."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        subprocess.run([str(aot._ptxas()), "-arch=sm_90a", str(path), "-o", f"{tmp}/k.cubin"], check=True)
        out = subprocess.run(
            [str(tools / "cuobjdump"), "-sass", f"{tmp}/k.cubin"], capture_output=True, text=True, check=True
        ).stdout
    found = (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln) for ln in out.splitlines())
    return [(int(m.group(1), 16), m.group(2).strip()) for m in found if m]


def fast_path(code: list[tuple[int, str]]) -> list[str]:
    """The main line from the start to ``EXIT``, taking every unconditional branch and every forward
    conditional branch that skips a ``CALL`` (the slow paths of IEEE division and square root)."""
    at = {a: i for i, (a, _) in enumerate(code)}
    out, i = [], 0
    while code[i][1] != "EXIT":
        ins = code[i][1]
        out.append(ins)
        branch = re.match(r"(@!?P\d+\s+)?BRA(\.U)?\s+(0x[0-9a-f]+)", ins)
        if branch:
            target = at[int(branch.group(3), 16)]
            unconditional = branch.group(1) is None
            if unconditional or (target > i and any("CALL" in x for _, x in code[i + 1 : target])):
                i = target
                continue
        i += 1
    return out + ["EXIT"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", nargs="?", default="", help="regex over the variant names (default: all)")
    args = parser.parse_args()
    fn = _wrapper()
    config = _kernel.LAUNCH_CONFIGS["cuda"]
    for name, param, _, meta in (*aot.variants(), *aot.state_variants()):
        if not re.search(args.pattern, name):
            continue
        per_thread = meta["SUB"] // (32 * meta.get("num_warps", config["num_warps"]))
        ptx = compile_tile(fn, param, meta)
        n_ptx = sum(
            1 for ln in aot.ptx_code(ptx).splitlines() if ln.strip()[:1] not in ("", ".", "{", "}", ")", "(")
        )
        code = sass(ptx)
        main_line = [x for _, x in code[: [x for _, x in code].index("EXIT") + 1] if not x.startswith("NOP")]
        fast = fast_path(code)
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in fast)
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
        print(
            f"{name}: per element ptx {n_ptx / per_thread:.1f}, sass {len(main_line) / per_thread:.1f}, "
            f"fast {len(fast) / per_thread:.1f} [{top}]",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
