"""The kernel compiled for an H100/H200 (sm_90) without a GPU: the PTX must keep the arithmetic IEEE.

Compiles ``_adamw_sr_kernel`` ahead of time (``triton.compile`` with an explicit target, in a child
process with the interpreter off) and checks what makes the GPU bit-identical to the CPU reference:
no fp32 FMA contraction, no flush-to-zero, IEEE division and square root, and 128-bit vector loads
on the aligned full-window path (the bandwidth target).
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
from adamw_sr import kernel
pointers = dict(param="{param}", grad="bf16", exp_avg="fp32", exp_avg_sq="fp32", max_exp_avg_sq="fp32",
                tensor_table="i64", chunk_table="i64", steps="fp32", hyper="fp64")
sig = {{f"{{name}}_ptr": "*" + dtype for name, dtype in pointers.items()}}
sig.update(seed_lo="i64", seed_hi="i64", rng_stream="i32")
META = ("AMSGRAD", "MAXIMIZE", "PARAM_BF16", "STOCHASTIC", "ALIGNED", "BLOCK")
sig.update({{k: "constexpr" for k in META}})
constexprs = {{"AMSGRAD": {amsgrad}, "MAXIMIZE": False, "PARAM_BF16": {bf16}, "STOCHASTIC": True,
              "ALIGNED": True, "BLOCK": kernel.LAUNCH_CONFIGS["cuda"]["BLOCK"]}}
attrs = {{(i,): [["tt.divisibility", 16]] for i in range(9)}}
options = dict(num_warps=kernel.LAUNCH_CONFIGS["cuda"]["num_warps"], **kernel.exactness_options())
compiled = triton.compile(ASTSource(kernel._adamw_sr_kernel, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)
ptx = compiled.asm["ptx"]
count = lambda s: ptx.count(s)
print(json.dumps({{"fma32": count("fma.rn.f32"), "ftz": count(".ftz"), "div_rn": count("div.rn.f32"),
                  "sqrt_rn": count("sqrt.rn.f32"), "approx": count(".approx"), "div_full": count("div.full"),
                  "v4_loads": count("ld.global.v4") + count("ld.global.nc.v4")}}))
"""


@pytest.mark.parametrize("param,amsgrad", [("bf16", False), ("fp32", True)])
def test_sm90_ptx_is_ieee_and_vectorized(param, amsgrad):
    code = _COMPILE.format(param=param, amsgrad=amsgrad, bf16=param == "bf16")
    counts = json.loads(run_in_fresh_process(code, env={"TRITON_INTERPRET": "0"}))
    assert counts["fma32"] == 0, counts  # enable_fp_fusion=False: no a*b+c contraction
    assert counts["ftz"] == 0, counts  # enable_reflect_ftz=False: subnormals kept
    assert counts["approx"] == 0 and counts["div_full"] == 0, counts  # no approximate div/sqrt
    assert counts["div_rn"] > 0 and counts["sqrt_rn"] > 0, counts
    assert counts["v4_loads"] >= 4, counts  # param, grad, exp_avg, exp_avg_sq as 128-bit loads
