"""The fixed kernel-config table of det_train's matmul and linear kernels (no timing-based autotune).

A config is looked up by **dtype, operand layout and the shape class of N and K**. The number of
rows M (tokens) takes part in exactly one place, and never in the reduction order: for the
forward layout ``"nt"`` in the large class, **M selects between two kernels whose bits are
identical** — the TMA kernel when ``M >= TMA_MIN_ROWS`` (1024; tiles loaded through host tensor
descriptors) and the pointer kernel below it (measurements: docs/benchmarks). Both entries
fold K in steps of the same ``block_k`` with the same ``tl.dot``, so a row's bits do not depend on
which kernel ran (checked on the GPU by
``test_gpu_tma_and_pointer_kernels_agree_across_the_row_threshold``,
``test_gpu_row_invariance_real_sizes`` — M from 1 to 8192 across the threshold — and
``test_gpu_every_config_of_a_dtype_gives_the_same_bits``; on CPU by
``test_row_threshold_switches_kernel_not_bits``). **M never selects ``block_k``.**
Layouts name which operand is stored K-contiguous: for ``C = A @ B`` with ``A (M, K)`` and ``B (K, N)``,

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
``lean``, ``pairs``, ``quads``, ``flat``, ``tma`` and ``programs_per_sm`` do not (they choose how
much of the fixed leaf tree one program computes, where it keeps waiting nodes, how it loads tiles
and how many programs share an SM). ``check_weight_grad_config`` rejects the combinations the
kernels do not implement, with a ValueError, before anything compiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "BIAS_GRAD_BLOCK_T",
    "WIDE_MIN_ELEMENTS",
    "TMA_MIN_ROWS",
    "MatmulConfig",
    "WeightGradConfig",
    "check_weight_grad_config",
    "layout_of",
    "matmul_config",
    "rows_class",
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
    leaves_per_program: int  # leaves of the canonical tree one program combines (a power of 2; 1, 2
    # or 4 in registers, any with lean)
    lean: bool = False  # the persistent tree kernel: waiting nodes in a per-program fp32 scratch
    # stack (in L2), one tile live in the token loop
    pairs: bool = False  # with lean: the two leaves of each level-1 node summed in registers
    programs_per_sm: int = 2  # resident programs of the persistent tree kernels (sizes the scratch)
    tma: bool = False  # with lean: dY / X tiles loaded by TMA (when leaves are block_t-aligned)
    quads: bool = False  # with lean, pairs, tma: four leaves (two pairs) summed in registers
    flat: bool = False  # with quads: a full quad's leaves in one flattened, pipelined loop nest


# The K step of each dtype: part of the reduction order (changing it changes bits).
BLOCK_K = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}

# Token step inside a leaf for dW and db: part of the reduction order.
BLOCK_T = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
BIAS_GRAD_BLOCK_T = 64

_HALF = (torch.bfloat16, torch.float16)

# Rows (M) from which the large "nt" forward uses the TMA kernel; below, the pointer kernel. Both have
# the same block_k and dot, hence the same bits: the threshold only picks the faster kernel.
TMA_MIN_ROWS = 1024

# (dtype group, layout, shape class of N and K, rows class) -> config. Shape class "large": N >= 256
# and K >= 256. Rows class "any" except for the large forward ("nt"): "many" (M >= TMA_MIN_ROWS) and
# "few" (M < TMA_MIN_ROWS) — two kernels with one block_k, so the same bits (module docstring).
# Chosen from benchmarks/ablate_matmul.py on an H200 (the numbers: docs/benchmarks, runs 4-10).
_MATMUL_TABLE: dict[tuple[str, str, str, str], MatmulConfig] = {
    ("half", "nn", "large", "any"): MatmulConfig(128, 256, 64, 8, 8, 4),
    ("half", "nt", "large", "many"): MatmulConfig(128, 256, 64, 8, 8, 4, tma=True),
    ("half", "nt", "large", "few"): MatmulConfig(128, 256, 64, 8, 8, 3),
    ("half", "tn", "large", "any"): MatmulConfig(128, 256, 64, 8, 8, 3),
    ("half", "tt", "large", "any"): MatmulConfig(128, 256, 64, 8, 8, 3),
    ("half", "nn", "small", "any"): MatmulConfig(64, 64, 64, 8, 4, 4),
    ("half", "nt", "small", "any"): MatmulConfig(64, 64, 64, 8, 4, 4),
    ("half", "tn", "small", "any"): MatmulConfig(64, 64, 64, 8, 4, 4),
    ("half", "tt", "small", "any"): MatmulConfig(64, 64, 64, 8, 4, 4),
    # fp32: IEEE fp32 dot (no TF32), CUDA cores; correct, not fast.
    ("fp32", "any", "any", "any"): MatmulConfig(64, 64, 32, 8, 4, 3),
}

# dW = dY^T X: A = dY read transposed (tokens contiguous per column), B = X row-major.
# Wide (N * K >= WIDE_MIN_ELEMENTS: at least ~2 waves of 128x256 tiles on an H200): 128x256 output
# tile, one fp32 tile live, TMA loads, persistent lean kernel (a finished leaf waits in the
# per-program L2 scratch stack). Large (both >= 256, fewer elements): 128x128 tiles with quads (the
# four leaves of a level-2 node summed in registers, levels >= 2 merged through the scratch stack)
# and flat (a full quad as one flattened, software-pipelined loop): twice the tiles, which these
# layers need to fill the SMs. Up to 8 leaves per program. Why these entries, and the variants
# measured against them: docs/det-train.md ("The table's two dW entries") and docs/benchmarks.
WIDE_MIN_ELEMENTS = 1 << 22
_WEIGHT_GRAD_TABLE: dict[tuple[str, str], WeightGradConfig] = {
    ("half", "wide"): WeightGradConfig(
        block_n=128,
        block_k=256,
        block_t=64,
        group_n=8,
        num_warps=8,
        num_stages=3,
        leaves_per_program=8,
        lean=True,
        programs_per_sm=1,
        tma=True,
    ),
    ("half", "large"): WeightGradConfig(
        block_n=128,
        block_k=128,
        block_t=64,
        group_n=8,
        num_warps=8,
        num_stages=4,
        leaves_per_program=8,
        lean=True,
        pairs=True,
        quads=True,
        flat=True,
        programs_per_sm=1,
        tma=True,
    ),
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


def rows_class(rows: int | None) -> str:
    """``"many"`` when ``rows >= TMA_MIN_ROWS`` (or ``rows`` is None), else ``"few"``; selects only
    between kernels of one ``block_k`` (the same bits), never the reduction order."""
    return "many" if rows is None or rows >= TMA_MIN_ROWS else "few"


def matmul_config(dtype: torch.dtype, layout: str, n: int, k: int, rows: int | None = None) -> MatmulConfig:
    """The config of ``C (M, N) = A (M, K) @ B (K, N)`` for ``dtype`` and ``layout``.

    ``rows`` (M of the 2-D problem; None: many rows) picks the TMA or the pointer kernel of the
    large ``"nt"`` entry — two kernels with the same ``block_k``, so the same bits; it never
    changes ``block_k`` (see the module docstring).
    """
    group = _dtype_group(dtype)
    if group == "fp32":
        return _MATMUL_TABLE[("fp32", "any", "any", "any")]
    key = (group, layout, shape_class(n, k))
    return _MATMUL_TABLE.get((*key, rows_class(rows))) or _MATMUL_TABLE[(*key, "any")]


def weight_grad_config(dtype: torch.dtype, n: int, k: int) -> WeightGradConfig:
    """The config of ``dW (N, K) = dY^T X`` (the token count plays no part): ``"wide"`` when the
    shape class is large and ``n * k >= WIDE_MIN_ELEMENTS``. Every entry has ``block_t`` 64 (bf16 /
    fp16), so the entries differ in speed only, not in bits."""
    group = _dtype_group(dtype)
    if group == "fp32":
        return _WEIGHT_GRAD_TABLE[("fp32", "any")]
    shape = shape_class(n, k)
    if shape == "large" and n * k >= WIDE_MIN_ELEMENTS:
        shape = "wide"
    return _WEIGHT_GRAD_TABLE[(group, shape)]


@functools.lru_cache(maxsize=256)  # configs are frozen (hashable); checked once each, not per launch
def check_weight_grad_config(config: WeightGradConfig) -> None:
    """Raise ValueError for a dW config outside the supported variants (before any compile).

    Rejected: ``leaves_per_program`` not a power of 2 (or above 4 without ``lean``); ``quads``
    without ``lean``, ``pairs`` and ``tma``; ``flat`` without ``quads``.
    """
    lpp = config.leaves_per_program
    if lpp < 1 or lpp & (lpp - 1) or (lpp > 4 and not config.lean):
        raise ValueError(f"leaves_per_program must be 1, 2 or 4 (any power of 2 with lean), got {lpp}")
    if config.quads and not (config.lean and config.pairs and config.tma):
        raise ValueError("quads is a TMA variant of the pairs kernel: it needs lean, pairs and tma")
    if config.flat and not config.quads:
        raise ValueError("flat is a variant of quads (a full quad in one flattened loop): set quads=True")
