"""The fixed launch-config table of det_attn's kernels (no autotune): one row per head dim, bf16 and
fp16 alike, causal or not, and one small row for the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

from det_core import runtime


@dataclass(frozen=True)
class Config:
    """Launch parameters of the three main kernels.

    Reduction-order-defining (changing one changes bits, so they depend only on head dim and the
    interpreter switch, never on batch, sequence length or packing): ``fwd_block_n`` (keys per
    online-softmax step), ``dkdv_block_m`` (queries per dK/dV step), ``dq_block_n`` (keys per dQ
    step). ``fwd_block_m`` and ``fwd_warps`` set the register layout of the softmax row sums,
    which could fix another fp32 order within a row; on the H200 they did not (run 8: forward
    tiles of 64 x 64 at 4 warps and 128 x 64 at 8 warps gave the same bits;
    ``benchmarks/ablate_attention.py`` checks it). The others (stages, the backward kernels'
    owned-block sizes and warps, the forward's load path ``fwd_tma`` and register cap
    ``fwd_maxnreg``) only change which rows a program owns, when loads are issued and how
    registers are allocated (same bits; ``ablate_attention.py --forward`` checks it on the GPU).
    """

    fwd_block_m: int
    fwd_block_n: int
    fwd_warps: int
    fwd_stages: int
    dkdv_block_m: int
    dkdv_block_n: int
    dkdv_warps: int
    dkdv_stages: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int
    dq_stages: int
    # forward pipeline depth with dropout on (its Philox tiles need shared memory for layout
    # changes: 128 KiB for the D128 row at 2 stages; 128 x 128 tiles at 3 stages would exceed the
    # H200's 227 KiB); 0 = fwd_stages. No effect on bits.
    fwd_dropout_stages: int = 0
    # Forward load path: host TMA descriptors over (B, T, H * D) for padded batches (packed calls,
    # inputs not 16-byte aligned and Triton without host descriptors take the pointer loads: the
    # same bits); False: pointer loads always. See _fwd_kernel.
    fwd_tma: bool = False
    # Forward register cap (ptxas maxnreg; 0: none) of the descriptor path, without dropout only:
    # the Philox tiles need more registers (sm_90a, Triton 3.6, D128 row: 126 used under a cap of
    # 128; 220 with dropout, which would spill 348 bytes under 128). No effect on bits.
    fwd_maxnreg: int = 0
    # Forward tiles of the pointer loads (packed input, inputs not 16-byte aligned, Triton without
    # host descriptors, fwd_tma=False): (block_m, warps, stages, maxnreg or 0; the cap without
    # dropout only); None: fwd_block_m, fwd_warps, fwd_stages and no cap. block_m and warps are
    # bit-neutral on the H200 (runs 8, 9: 64 x 64 tiles at 4 warps give the bits of 128 x 64 at 8
    # warps), so a packed sequence keeps the bits of the same sequence in a padded batch (tested
    # on the GPU). D128: 128 x 64 under a cap of 128 like the descriptor path (182 registers
    # uncapped; under the cap ptxas spills 76 bytes, and it still ran 1.2-1.5x faster, two
    # programs per SM). No effect on bits.
    fwd_pointers: tuple | None = None


# Fixed table (no autotune), bf16 and fp16 alike, causal or not. Each row is the fastest measured
# on an H200 (benchmarks/bench_attention.py --sweep at B4 H32 T4096 causal, and
# benchmarks/ablate_attention.py at T1024/T4096); the fields marked * set a summation order, so
# changing one changes bits (for every input alike: never chosen per shape).
#                 fwd: BM  BN* warps stages | dK/dV: BM* BN warps stages | dQ: BM BN* warps stages
# Forward rows from run 8's ablation, confirmed by run 9's (ablate_attention.py --forward; H200,
# torch 2.11, Triton 3.6, 2026-11-30; B4 H32 bf16; eager / CUDA-graph ratio to SDPA cuDNN, run 9).
# D128: 128 x 64 tiles, 8 warps, 2 stages, host TMA descriptors, a cap of 128 registers (sm_90a:
# 126 used, 96 KiB shared memory, so two programs per SM): causal T1024 0.84 / 0.87, T4096
# 0.81 / 0.87, T8192 0.84 / 0.86, non-causal T4096 0.71 / 0.79. The row before (128, 128, 8, 3,
# host descriptors; BN* other bits): 0.76 / 0.79, 0.87 / 0.86, 0.84 / 0.85, 0.72 / 0.80. Pointer
# loads (packed input; a second ablation, where the row measured 0.85 / 0.87, 0.81 / 0.88,
# 0.84 / 0.86, 0.74 / 0.79): the same tiles under the same cap (two programs per SM; ptxas spills
# 76 bytes, measured faster than without): 0.78 / 0.80, 0.78 / 0.82, 0.80 / 0.80, 0.74 / 0.74; without
# the cap (one program per SM) 0.64 / 0.67, 0.58 / 0.64, 0.60 / 0.61, 0.50 / 0.54; 64 x 64 at 4
# warps, 3 stages 0.79 / 0.79, 0.72 / 0.74, 0.71 / 0.71, 0.72 / 0.68 (every one the table's bits).
# D64 (128, 64, 8, 3, host descriptors): T4096 0.89 / 0.93 (pointer loads 0.92 / 0.92). Tried in
# run 8 and slower, so no longer in the kernel: FlashAttention-3-style overlap of P V with the
# next softmax (0.55-0.74), descriptors made in the kernel (0.61-0.81), one masked key loop (at
# most the row's speed). Not kept either: O * (1/l) instead of O / l (0-4% in graph time).
GPU_CONFIGS = {
    64: Config(128, 64, 8, 3, 64, 64, 4, 3, 64, 64, 4, 3, fwd_tma=True),
    128: Config(
        128,
        64,
        8,
        2,
        64,
        128,
        8,
        3,
        128,
        64,
        8,
        3,
        fwd_dropout_stages=2,
        fwd_tma=True,
        fwd_maxnreg=128,
        fwd_pointers=(128, 8, 2, 128),
    ),
}
# Interpreter: small, unequal blocks so tiny CPU tests cross many tile and diagonal boundaries.
INTERPRETER_CONFIG = Config(32, 16, 1, 1, 16, 32, 1, 1, 32, 16, 1, 1)

# Triton reads TRITON_INTERPRET when the kernels are decorated (at import), so read it once too.
INTERPRET = runtime.interpreter_active()


def config(head_dim: int) -> Config | None:
    """The table's row for ``head_dim`` (the interpreter's row under ``TRITON_INTERPRET``; None for
    a head dim the table lacks). Read on every plan lookup: benchmarks swap rows in and out."""
    return INTERPRETER_CONFIG if INTERPRET else GPU_CONFIGS.get(head_dim)
