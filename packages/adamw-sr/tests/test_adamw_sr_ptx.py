"""The kernels compiled for an H100/H200 (sm_90) without a GPU: the PTX must keep the arithmetic IEEE.

Compiles ``adamw_sr_kernel`` (with the committed CUDA launch config) and the per-tensor scalar kernel
ahead of time (``triton.compile`` with an explicit target, in a child process with the interpreter
off) and checks what makes the GPU bit-identical to the CPU reference: no fp32 FMA contraction, no
flush-to-zero, IEEE division and square root (fp32 in the step, fp64 in the scalars), and vector
loads and stores on the aligned full-tile path (the bandwidth target).
"""

from __future__ import annotations

import json

import pytest
from det_core.testing import run_in_fresh_process

_COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adamw_sr import _kernel, _launch
config = _kernel.LAUNCH_CONFIGS["cuda"]
options = dict(num_warps=config["num_warps"], **_launch.exactness_options())
target = GPUTarget("cuda", 90, 32)
pointers = dict(param="{param}", grad="bf16", exp_avg="fp32", exp_avg_sq="fp32", max_exp_avg_sq="fp32",
                tensor_table="i64", chunk_table="i64", steps="fp32", hyper="fp64", scalars="fp32")
sig = {{f"{{name}}_ptr": "*" + dtype for name, dtype in pointers.items()}}
sig.update(seed_lo="i64", seed_hi="i64", rng_stream="i32", grad_scale_ptr="*fp32", found_inf_ptr="*fp32")
META = ("AMSGRAD", "MAXIMIZE", "PARAM_BF16", "STOCHASTIC", "ALIGNED", "BLOCK", "SUB", "TILE_2D",
        "PRECOMPUTED", "UNSCALE", "SKIP_ON_INF")
sig.update({{k: "constexpr" for k in META}})
constexprs = {{"AMSGRAD": {amsgrad}, "MAXIMIZE": False, "PARAM_BF16": {bf16}, "STOCHASTIC": True,
              "ALIGNED": True, "BLOCK": config["BLOCK"], "SUB": config["SUB"], "TILE_2D": config["TILE_2D"],
              "PRECOMPUTED": {precomputed}, "UNSCALE": {amp}, "SKIP_ON_INF": {amp}}}
attrs = {{(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name.endswith("_ptr")}}
ptx = triton.compile(ASTSource(_kernel.adamw_sr_kernel, sig, constexprs=constexprs, attrs=attrs),
                     target=target, options=options).asm["ptx"]
ssig = dict(steps_ptr="*fp32", hyper_ptr="*fp64", scalars_ptr="*fp32", num_tensors="i32",
            BLOCK_T="constexpr")
sconst = {{"BLOCK_T": _kernel.SCALARS_BLOCK}}
soptions = dict(num_warps=4, **_launch.exactness_options())
sptx = triton.compile(ASTSource(_kernel.step_scalars_kernel, ssig, constexprs=sconst), target=target,
                      options=soptions).asm["ptx"]
count = lambda s, text=ptx: text.count(s)
print(json.dumps({{"fma32": count("fma.rn.f32"), "ftz": count(".ftz"), "div_rn": count("div.rn.f32"),
                  "sqrt_rn": count("sqrt.rn.f32"), "approx": count(".approx"), "div_full": count("div.full"),
                  "v4_loads": count("ld.global.v4") + count("ld.global.nc.v4"),
                  "vector_loads": count("ld.global.v2") + count("ld.global.v4") + count("ld.global.nc.v"),
                  "vector_stores": count("st.global.v2") + count("st.global.v4"),
                  "fp64_mul": count("mul.rn.f64") + count("mul.f64"), "div_rn64": count("div.rn.f64"),
                  "scalar_div_rn64": count("div.rn.f64", sptx),
                  "scalar_sqrt_rn64": count("sqrt.rn.f64", sptx),
                  "scalar_approx": count(".approx", sptx), "scalar_ftz": count(".ftz", sptx),
                  "scalar_fma": count("fma.rn.f", sptx)}}))
"""


@pytest.mark.parametrize(
    "param,amsgrad,precomputed,amp",
    [("bf16", False, True, False), ("fp32", True, False, False), ("bf16", False, True, True)],
)
def test_sm90_ptx_is_ieee_and_vectorized(param, amsgrad, precomputed, amp):
    # amp: GradScaler's unscale (the fp64 reciprocal of the scale, rounded once) and skip
    code = _COMPILE.format(
        param=param, amsgrad=amsgrad, bf16=param == "bf16", precomputed=precomputed, amp=amp
    )
    counts = json.loads(run_in_fresh_process(code, env={"TRITON_INTERPRET": "0"}))
    assert counts["fma32"] == 0, counts  # enable_fp_fusion=False: no a*b+c contraction
    assert counts["ftz"] == 0, counts  # enable_reflect_ftz=False: subnormals kept
    assert counts["approx"] == 0 and counts["div_full"] == 0, counts  # no approximate div/sqrt
    assert counts["div_rn"] > 0 and counts["sqrt_rn"] > 0, counts
    # fp32 states always as 128-bit loads; with fp32 params the param too (and max_exp_avg_sq)
    assert counts["v4_loads"] >= (4 if param == "fp32" else 2), counts
    assert counts["vector_loads"] >= 4 and counts["vector_stores"] >= 3, counts  # p, g, m, v
    # the fp64 scalar work (beta ** step by squaring) runs in the step kernel only without PRECOMPUTED
    assert (counts["fp64_mul"] == 0) == precomputed, counts
    # IEEE fp64 divisions in the step kernel: lr / (1 - beta1 ** step) without PRECOMPUTED, and with
    # amp the reciprocal of the loss scale
    assert counts["div_rn64"] == int(not precomputed) + int(amp), counts
    # the scalar kernel: IEEE fp64 division and square root, no contraction, no flush
    assert counts["scalar_div_rn64"] > 0 and counts["scalar_sqrt_rn64"] > 0, counts
    assert counts["scalar_approx"] == 0 and counts["scalar_ftz"] == 0 and counts["scalar_fma"] == 0, counts
