"""The fixed kernel-config table of det_train's matmul and linear kernels (no timing-based autotune).

A config is looked up by **dtype, operand layout and the shape class of N and K**. The number of
rows M (tokens) takes part in the **rows class**, and never in the reduction order: in the large
class **M selects between tilings and kernels whose bits are identical** —

- ``"few"`` (``"nt"`` only): ``M < TMA_MIN_ROWS`` (1024), the pointer kernel;
- ``"low"`` (``"nt"`` and ``"nn"``): even the "mid" entry's 128 x 128 output tiles would fill their
  waves on ``WAVE_SMS`` SMs to less than ``LOW_MAX_FILL`` (e.g. 48 tiles at M = 1024, N = 768: one
  micro-batch of 1024 tokens), so 64 x 128 tiles run;
- ``"mid"`` (``"nt"`` and ``"nn"``): the large entry's 128 x 256 output tiles would fill their
  waves on ``WAVE_SMS`` SMs to less than ``MID_MAX_FILL`` (``wave_fill``: e.g. 48 tiles at
  M = 2048, N = 768 fill 36% of one wave), so smaller tiles run (128 x 128);
- ``"many"``: the rest (``"nt"``: the TMA kernel, tiles loaded through host tensor descriptors).

M enters the choice only through the count of output tiles (``wave_fill``). Every entry folds K
in steps of the same ``block_k`` with the same ``tl.dot``, so a row's bits do not depend on which
entry ran (checked on the GPU by ``test_gpu_tma_and_pointer_kernels_agree_across_the_row_threshold``,
``test_gpu_row_invariance_real_sizes`` — M from 1 to 8192 across the thresholds — and
``test_gpu_every_config_of_a_dtype_gives_the_same_bits``; on CPU by
``test_row_threshold_switches_kernel_not_bits`` and ``test_mid_rows_class_switches_tiles_not_bits``).
**M never selects ``block_k``.**
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
kernels do not implement, with a ValueError, before anything compiles. The open leaf's resumable
dW fold (``weight_grad_fold``, one program per output tile over a micro-batch's tokens of one
leaf) has its own tiles (``weight_grad_fold_config``: smaller ones for layers with few tiles);
its token step is the dW entry's ``block_t``, so it continues the same fold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "BIAS_GRAD_BLOCK_T",
    "FOLD_MID_MAX_ELEMENTS",
    "LOW_MAX_FILL",
    "MID_MAX_FILL",
    "TMA_MIN_ROWS",
    "WAVE_SMS",
    "WIDE_MIN_ELEMENTS",
    "MatmulConfig",
    "WeightGradConfig",
    "check_weight_grad_config",
    "layout_of",
    "matmul_config",
    "rows_class",
    "shape_class",
    "wave_fill",
    "weight_grad_config",
    "weight_grad_fold_config",
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

# The rows class "mid": a large-class call whose 128 x 256 output tiles would fill their waves on
# WAVE_SMS SMs (an H200's 132) to less than MID_MAX_FILL takes the "mid" entry's smaller tiles (the
# main job's 768-wide layers at micro-batches of 2048 to 8192 tokens). Tiles never change bits.
WAVE_SMS = 132
MID_MAX_FILL = 0.75
_WAVE_TILE = (128, 256)  # the output tile of the large entries, which the wave fill is computed for
# The rows class "low": a call whose "mid" tiles (128 x 128) would still fill their waves to less than
# LOW_MAX_FILL takes 64 x 128 tiles (the main job's layers at micro-batches of 1024 tokens, where they
# were faster than 128 x 128 in sweep_micro_batches: see docs/benchmarks.md).
LOW_MAX_FILL = 0.62
_MID_TILE = (128, 128)

# (dtype group, layout, shape class of N and K, rows class) -> config. Shape class "large": N >= 256
# and K >= 256. Rows class (rows_class): "few" (M < TMA_MIN_ROWS), "low" (very low wave fill), "mid"
# (low wave fill), "many"; a layout without an entry for the class takes its "any" entry. Every
# entry has one block_k per dtype, so the same bits (module docstring).
# Chosen from benchmarks/ablate_matmul.py and benchmarks/sweep_micro_batches.py on an H200 (the
# numbers: docs/benchmarks).
_MATMUL_TABLE: dict[tuple[str, str, str, str], MatmulConfig] = {
    ("half", "nn", "large", "low"): MatmulConfig(64, 128, 64, 8, 4, 4, tma=True),
    ("half", "nn", "large", "mid"): MatmulConfig(128, 128, 64, 8, 4, 4),
    ("half", "nn", "large", "any"): MatmulConfig(128, 256, 64, 8, 8, 4),
    ("half", "nt", "large", "many"): MatmulConfig(128, 256, 64, 8, 8, 4, tma=True),
    ("half", "nt", "large", "low"): MatmulConfig(64, 128, 64, 8, 4, 4, tma=True),
    ("half", "nt", "large", "mid"): MatmulConfig(128, 128, 64, 8, 4, 3, tma=True),
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

# The open leaf's fold (one program per output tile, all of a micro-batch's tokens of the leaf in
# sequence): large-class layers below FOLD_MID_MAX_ELEMENTS (the main job's 768 x 768 and 256 x 768:
# 36 and 12 tiles of 128 x 128 for 132 SMs) fold in smaller tiles, the other large-class layers
# (wide ones too: their dW entry's 128 x 256 tiles were slower or even, ablate_fold.py) in the "large" entry.
# The token step is the dW entry's (block_t 64), so the fold's bits are unchanged.
FOLD_MID_MAX_ELEMENTS = 1 << 20
_WEIGHT_GRAD_FOLD_TABLE: dict[tuple[str, str], WeightGradConfig] = {
    ("half", "mid"): WeightGradConfig(64, 128, 64, 8, 4, 4, 1),
    # the large dW entry's 128 x 128 tiles with 3 stages (its 4 are for the tree kernel's loop):
    # the main job's qkv, gate|up and down folds over 1024-4096 tokens (chosen by sweep_micro_batches:
    # see docs/benchmarks.md)
    ("half", "large"): WeightGradConfig(128, 128, 64, 8, 8, 3, 1),
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


def wave_fill(rows: int, n: int, block_m: int = _WAVE_TILE[0], block_n: int = _WAVE_TILE[1]) -> float:
    """How full the waves of ``block_m x block_n`` output tiles of an ``(rows, n)`` result are on
    ``WAVE_SMS`` SMs: tiles / (waves * WAVE_SMS), in (0, 1] (0 for an empty result).

    One program per tile and SM: 48 tiles fill 36% of one wave, 144 tiles 55% of two, 128 tiles
    97% of one. Depends on M only through the tile count; never part of a reduction order.
    """
    tiles = -(-rows // block_m) * -(-n // block_n)
    if tiles <= 0:
        return 0.0
    waves = -(-tiles // WAVE_SMS)
    return tiles / (waves * WAVE_SMS)


def rows_class(rows: int | None, n: int | None = None) -> str:
    """The rows class of an ``(rows, n)`` result: ``"few"`` when ``rows < TMA_MIN_ROWS``, else
    (``n`` given) ``"low"`` when 128 x 128 tiles fill their waves to less than ``LOW_MAX_FILL``,
    ``"mid"`` when 128 x 256 tiles fill them to less than ``MID_MAX_FILL``, else ``"many"`` (also
    for ``rows`` None). Selects only between tilings and kernels of one ``block_k`` (the same
    bits), never the reduction order."""
    if rows is None:
        return "many"
    if rows < TMA_MIN_ROWS:
        return "few"
    if n is not None and wave_fill(rows, n, *_MID_TILE) < LOW_MAX_FILL:
        return "low"
    if n is not None and wave_fill(rows, n) < MID_MAX_FILL:
        return "mid"
    return "many"


def matmul_config(dtype: torch.dtype, layout: str, n: int, k: int, rows: int | None = None) -> MatmulConfig:
    """The config of ``C (M, N) = A (M, K) @ B (K, N)`` for ``dtype`` and ``layout``.

    ``rows`` (M of the 2-D problem; None: many rows) gives the rows class (``rows_class(rows,
    n)``): the large ``"nt"`` entry's TMA or pointer kernel, and the ``"mid"`` entries' smaller
    tiles where the large tiles would leave SMs idle — all with the same ``block_k``, so the same
    bits; it never changes ``block_k`` (see the module docstring). A layout without an entry for
    the rows class takes its ``"any"`` entry.
    """
    group = _dtype_group(dtype)
    if group == "fp32":
        return _MATMUL_TABLE[("fp32", "any", "any", "any")]
    key = (group, layout, shape_class(n, k))
    return _MATMUL_TABLE.get((*key, rows_class(rows, n))) or _MATMUL_TABLE[(*key, "any")]


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


def weight_grad_fold_config(dtype: torch.dtype, n: int, k: int) -> WeightGradConfig:
    """The tiles of the open leaf's dW fold (``weight_grad_fold``) for ``dW (N, K)``: the
    ``("half", "mid")`` fold entry for large-class layers with ``n * k < FOLD_MID_MAX_ELEMENTS``
    (few output tiles: smaller ones keep more SMs busy), the ``("half", "large")`` one for the
    other large-class layers (wide ones included), else ``weight_grad_config``'s entry.
    ``block_t`` is always ``weight_grad_config``'s, so the fold has the bits of the dW kernels."""
    base = weight_grad_config(dtype, n, k)
    if _dtype_group(dtype) == "half" and shape_class(n, k) == "large":
        return _WEIGHT_GRAD_FOLD_TABLE[("half", "mid" if n * k < FOLD_MID_MAX_ELEMENTS else "large")]
    return base


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
