"""The fixed kernel-config table of det_train's matmul and linear kernels (no timing-based autotune).

A config is looked up by **dtype, operand layout and the shape class of N and K** — never by M
(rows / tokens), so a row's result cannot depend on the batch size. Layouts name which operand
is stored K-contiguous: for ``C = A @ B`` with ``A (M, K)`` and ``B (K, N)``,

- ``"nn"``: A row-major (K contiguous), B row-major (N contiguous) — ``dY @ W`` (dX);
- ``"nt"``: B read through a transposed view (K contiguous) — ``X @ W.T`` (the nn.Linear forward);
- ``"tn"`` / ``"tt"``: A read through a transposed view (M contiguous).

**Which fields change bits.** The reduction order of ``matmul`` is a sequential fp32 fold over K in
steps of ``block_k`` (each step one ``tl.dot``, i.e. a fixed tensor-core instruction sequence), so
``block_k`` (and the dot instruction, fixed per dtype by Triton) changes bits. ``block_m``,
``block_n``, ``group_m``, ``num_warps``, ``num_stages``, ``b_nk_tiles``, ``tma`` and ``persistent``
only tile the output, load the tiles and schedule the work: every entry of one dtype uses the same
``block_k``, so every entry gives the same bits (checked by a ``gpu`` test). For the weight gradient
the token step ``block_t`` changes bits (it is the fold step inside a leaf); ``leaves_per_program``,
``scratch_tree``, ``flat_loop``, ``lean``, ``pairs``, ``merge_in_registers``, ``tma``,
``programs_per_sm`` and ``maxnreg`` do not (they choose how much of the fixed leaf tree one program
computes, where it keeps waiting nodes, how it loads tiles and how many programs share an SM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BIAS_GRAD_BLOCK_T",
    "MatmulConfig",
    "WeightGradConfig",
    "layout_of",
    "matmul_config",
    "shape_class",
    "weight_grad_config",
]


@dataclass(frozen=True)
class MatmulConfig:
    """Tiles and schedule of the forward / dX kernel (``block_k`` changes bits, the rest do not)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    b_nk_tiles: bool = False  # load B = W.T as (block_n, block_k) tiles of W and transpose (a view)
    tma: bool = False  # 2-D calls with 16-byte aligned rows: tiles loaded by TMA (host descriptors)
    persistent: bool = False  # with tma: one program per SM walks the output tiles


@dataclass(frozen=True)
class WeightGradConfig:
    """Tiles of the dW kernel: output tile ``block_n x block_k``, token step ``block_t`` (changes bits)."""

    block_n: int
    block_k: int
    block_t: int
    group_n: int
    num_warps: int
    num_stages: int
    leaves_per_program: int  # leaves of the canonical tree one program combines (a power of 2)
    scratch_tree: bool = False  # combine them through a per-program fp32 scratch stack (any power
    # of 2) instead of registers (1, 2 or 4 leaves); neither choice changes bits
    flat_loop: bool = False  # with scratch_tree: one pipelined loop over all token steps of the subtree
    lean: bool = False  # the scratch-stack tree kernel with one tile live in the token loop (merges
    # in memory, row chunk by row chunk); with maxnreg=128 two programs fit on an SM
    pairs: bool = False  # with lean: the two leaves of each level-1 node summed in registers
    programs_per_sm: int = 2  # resident programs of the persistent tree kernels (sizes the scratch)
    maxnreg: int | None = None  # register cap per thread (ptxas .maxnreg), None: the compiler's choice
    tma: bool = False  # with lean: dY / X tiles loaded by TMA (when leaves are block_t-aligned)
    merge_in_registers: bool = False  # with lean: add whole left-sibling tiles in registers


# The K step of each dtype: part of the reduction order (changing it changes bits).
BLOCK_K = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}

# Token step inside a leaf for dW and db: part of the reduction order.
BLOCK_T = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
BIAS_GRAD_BLOCK_T = 64

_HALF = (torch.bfloat16, torch.float16)

# (dtype group, layout, shape class) -> config. Shape class "large": N >= 256 and K >= 256.
# Large tiles: BLOCK 128x256x64, 8 warps, 4 stages, grouped ordering (0.85-0.89x cuBLAS on H200 for
# row-major B, DESIGN.md). For B read transposed ("nt", the forward) the pointer kernel reached only
# 0.71-0.80x (H200, 2026-11-29): its tiles are loaded by TMA instead (W's (N, K) tiles, wgmma's native
# K-major B); benchmarks/ablate_matmul.py compares the candidates.
_MATMUL_TABLE: dict[tuple[str, str, str], MatmulConfig] = {
    ("half", "nn", "large"): MatmulConfig(128, 256, 64, 8, 8, 4),
    ("half", "nt", "large"): MatmulConfig(128, 256, 64, 8, 8, 4, tma=True),
    ("half", "tn", "large"): MatmulConfig(128, 256, 64, 8, 8, 3),
    ("half", "tt", "large"): MatmulConfig(128, 256, 64, 8, 8, 3),
    ("half", "nn", "small"): MatmulConfig(64, 64, 64, 8, 4, 4),
    ("half", "nt", "small"): MatmulConfig(64, 64, 64, 8, 4, 4),
    ("half", "tn", "small"): MatmulConfig(64, 64, 64, 8, 4, 4),
    ("half", "tt", "small"): MatmulConfig(64, 64, 64, 8, 4, 4),
    # fp32: IEEE fp32 dot (no TF32), CUDA cores; correct, not fast.
    ("fp32", "any", "any"): MatmulConfig(64, 64, 32, 8, 4, 3),
}

# dW = dY^T X: A = dY read transposed (tokens contiguous per column), B = X row-major.
# Large: 128x128 output tile (64 fp32 registers / thread per tile at 8 warps); up to 8 leaves per
# program through the scratch stack, so a micro-batch of <= 8 leaves (8192 tokens at 1024 per leaf)
# is finished in-kernel with no fp32 node written to HBM. The lean kernel (one tile live, TMA loads,
# 128 registers) runs two programs per SM so tree merges overlap tensor-core work; the first
# scratch_tree kernel (232 registers, one program per SM) reached 0.50-0.53x cuBLAS at 4096-8192 tokens.
_WEIGHT_GRAD_TABLE: dict[tuple[str, str], WeightGradConfig] = {
    ("half", "large"): WeightGradConfig(128, 128, 64, 8, 8, 3, 8, lean=True, tma=True, maxnreg=128),
    ("half", "small"): WeightGradConfig(64, 64, 64, 8, 4, 3, 1),
    ("fp32", "any"): WeightGradConfig(64, 64, 32, 8, 4, 3, 1),
}


def _dtype_group(dtype: torch.dtype) -> str:
    if dtype in _HALF:
        return "half"
    if dtype == torch.float32:
        return "fp32"
    raise TypeError(f"no det_train kernel config for dtype {dtype}; use bfloat16, float16 or float32")


def shape_class(n: int, k: int) -> str:
    """``"large"`` when both ``n >= 256`` and ``k >= 256``, else ``"small"`` (never depends on M)."""
    return "large" if n >= 256 and k >= 256 else "small"


def layout_of(a: torch.Tensor, b: torch.Tensor) -> str:
    """Layout key of ``a @ b`` from the strides of the last two dims (``"n"``: K contiguous in A /
    N contiguous in B; ``"t"``: the other dim contiguous)."""
    a_t = "t" if a.stride(-1) != 1 and a.stride(-2) == 1 else "n"
    b_t = "t" if b.stride(-1) != 1 and b.stride(-2) == 1 else "n"
    return a_t + b_t


def matmul_config(dtype: torch.dtype, layout: str, n: int, k: int) -> MatmulConfig:
    """The config of ``C (M, N) = A (M, K) @ B (K, N)`` for ``dtype`` and ``layout`` (M plays no part)."""
    group = _dtype_group(dtype)
    if group == "fp32":
        return _MATMUL_TABLE[("fp32", "any", "any")]
    return _MATMUL_TABLE[(group, layout, shape_class(n, k))]


def weight_grad_config(dtype: torch.dtype, n: int, k: int) -> WeightGradConfig:
    """The config of ``dW (N, K) = dY^T X`` (the token count plays no part)."""
    group = _dtype_group(dtype)
    if group == "fp32":
        return _WEIGHT_GRAD_TABLE[("fp32", "any")]
    return _WEIGHT_GRAD_TABLE[(group, shape_class(n, k))]
