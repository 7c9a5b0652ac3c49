"""The fixed launch-config table of det_attn's kernels (no autotune): one row per head dim, bf16 and
fp16 alike, causal or not, and one small row for the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

from det_core import runtime


@dataclass(frozen=True)
class Config:
    """Launch parameters of the three main kernels: one row of the table.

    Reduction-order-defining (changing one changes bits, so they depend only on head dim and the
    interpreter switch, never on batch, sequence length or packing): ``fwd_block_n`` (keys per
    online-softmax step), ``dkdv_block_m`` (queries per dK/dV step), ``dq_block_n`` (keys per dQ
    step). The others only change which rows a program owns, when loads are issued and how
    registers are allocated: the same bits. ``fwd_block_m`` and ``fwd_warps`` set the register
    layout of the softmax row sums, which could fix another fp32 order within a row; measured
    bit-neutral on the H200 (``benchmarks/ablate_attention.py`` checks every field on the GPU).
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
    # forward pipeline depth with dropout (0: fwd_stages): the Philox tiles take shared memory
    fwd_dropout_stages: int = 0
    # forward through host TMA descriptors for padded batches (other calls take the pointer loads,
    # with the same bits; see _fwd_kernel); False: pointer loads always
    fwd_tma: bool = False
    # register cap (ptxas maxnreg, 0: none) of the descriptor path without dropout (the Philox
    # tiles need more): it lets two programs share an SM
    fwd_maxnreg: int = 0
    # the pointer loads' own tiles, (block_m, warps, stages, maxnreg or 0; the cap without dropout
    # only); None: fwd_block_m, fwd_warps, fwd_stages and no cap. Bit-neutral like block_m and
    # warps, so a packed sequence keeps the bits it has in a padded batch
    fwd_pointers: tuple | None = None


# Fixed table, no autotune (bf16 and fp16 alike, causal or not): the fastest rows measured on an
# H200; the measurements are on the benchmarks page (docs/benchmarks/benchmarks.md) and in
# docs/det-attn.md. Fields marked * set a summation order: changing one changes bits, for every
# input alike (never chosen per shape).
#            fwd: BM  BN* warps stages | dK/dV: BM* BN warps stages | dQ: BM BN* warps stages
GPU_CONFIGS = {
    64: Config(128, 64, 8, 3,    64, 64, 4, 3,    64, 64, 4, 3, fwd_tma=True),
    128: Config(
        128, 64, 8, 2,    64, 128, 8, 3,    128, 64, 8, 3,
        fwd_dropout_stages=2, fwd_tma=True, fwd_maxnreg=128, fwd_pointers=(128, 8, 2, 128),
    ),
}  # fmt: skip
# Interpreter: small, unequal blocks so tiny CPU tests cross many tile and diagonal boundaries.
INTERPRETER_CONFIG = Config(32, 16, 1, 1, 16, 32, 1, 1, 32, 16, 1, 1)

# Triton reads TRITON_INTERPRET when the kernels are decorated (at import), so read it once too.
INTERPRET = runtime.interpreter_active()


def config(head_dim: int) -> Config | None:
    """The table's row for ``head_dim`` (the interpreter's row under ``TRITON_INTERPRET``; None for
    a head dim the table lacks). Read on every plan lookup: benchmarks swap rows in and out."""
    return INTERPRETER_CONFIG if INTERPRET else GPU_CONFIGS.get(head_dim)
