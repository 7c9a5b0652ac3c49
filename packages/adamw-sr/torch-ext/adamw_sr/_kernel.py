"""The fused AdamW step in Triton: one launch over many tensors, fp32 math, one rounding at write-back.

This module holds the ``@triton.jit`` code and the tables it reads (launch configs, table
columns, moment formats); the host side that builds the tables and launches the kernels is
``_launch``.

Layout of a launch (all tensors on one device, one param dtype and one grad dtype):

* Every tensor role (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq) is addressed from one base
  pointer, the lowest-address tensor of that role, plus a per-tensor element offset from a small
  ``tensor_table`` (int64, ``[T, 5]``). So hundreds of tensors need one launch, not hundreds.
* A ``chunk_table`` (int64, ``[C, 5]``) lists BLOCK-element windows: ``(slot, window_local_start,
  segment_local_start, segment_local_end, window_global_start)``. Windows are aligned to 4 in the
  *global* index, so one Philox call serves 4 elements whatever the tensor's base index; elements of
  the window outside the segment are masked. A program walks its window in tiles of ``SUB`` elements
  (few registers per thread, so several programs share an SM and hide each other's latency).
* Per-tensor steps (``steps``, fp32 ``[T]``, torch's layout) and the hyperparameters (``hyper``,
  fp64 ``[5]``: lr, beta1, beta2, eps, weight_decay) are read from device memory, so the launch
  can be captured in a CUDA graph and replayed with a new lr and step. With ``PRECOMPUTED`` a tiny
  kernel first turns them into a per-tensor table of fp32 scalars (``scalars``, ``[T, 9]``), so the
  fp64 work runs once per tensor instead of once per program.
* Moments (``state_dtype``): fp32 in ``adamw_sr_kernel``; bf16, or 8-bit codes with a scale byte per
  block of 32 global indices (``_state_codes``), in ``adamw_sr_states_kernel``. Both run one program
  body (``_step_program``, the format a constexpr ``STATE``), so the fp32 kernel compiles as before.
  The moments are decoded to fp32, updated, used by the step, and rounded once into their format
  (stochastically, or to nearest): the param's Philox word (``STREAM_PARAM_SR``) serves all three
  roundings, its high half 8 bits per moment (``state_codes.state_rounding_bits``); 8-bit tiles start
  on a block, and the tensor table has two more columns (the scales).
* AMP (``torch.amp.GradScaler``): with ``UNSCALE`` the gradient is multiplied by the fp32 reciprocal
  of the loss scale (read from ``grad_scale``, computed in fp64 and rounded once, as
  ``GradScaler.unscale_`` does, and a bf16 gradient rounded back to bf16 as the in-place unscale
  stores it), so the bits equal an explicit unscale, and the unscaled gradient is written back (as
  torch's fused AdamW does); with ``SKIP_ON_INF`` a nonzero ``found_inf`` (read on the device)
  makes every program write nothing.

Bit-exactness with ``reference.py``: scalars are computed in fp64 from the same sequence of IEEE
operations (``beta ** step`` by binary exponentiation: multiplications only), rounded once to fp32;
elementwise math is fp32 with IEEE division and square root (``div_rn``/``sqrt_rn``), and every
launch passes ``enable_fp_fusion=False`` (no ``a * b + c`` contracted into an FMA) and
``enable_reflect_ftz=False`` (subnormals kept, as on the CPU). The variants below (tile shape,
``SUB``, ``PRECOMPUTED``, ``BLOCK``, ``num_warps``) only change which thread computes what: every
element runs the same operations on the same values, so all give the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl
from det_core import rng, sr

from . import _state_codes as state_codes  # the name the kernels' source reads

# Fixed launch configs, keyed by where the kernel runs. The step is elementwise and its random
# bits are keyed by global element index, so NO entry changes any result bit (the ablation
# benchmark and test_kernel_variants_equal_reference check it):
#   BLOCK        elements per program (one chunk-table row; a multiple of SUB)
#   SUB          elements per inner tile (BLOCK // SUB iterations per program; a multiple of 8)
#   num_warps    threads per program / 32 (SUB / (32 * num_warps) elements per thread and tile)
#   TILE_2D      tiles shaped [SUB // 4, 4]: a thread owns whole Philox groups of 4, and the four
#                words are picked by column, no layout shuffle; False: 1-D tiles, words interleaved
#                with det-core's random_bits_x4 (join/permute/reshape)
#   PRECOMPUTED  per-tensor fp32 scalars from a separate tiny launch (else fp64 work per program)
#   EDGE_SUB     (states kernel only; default SUB) elements per masked sub-tile of a tile that crosses
#                a segment's start or end (divides SUB; a multiple of 8, with 8 bits of QUANT_BLOCK)
#   maxnreg      (optional) Triton's register cap per thread
# fmt: off
LAUNCH_CONFIGS = {
    # the fp32-moment kernel is bandwidth-bound: the ablation's fastest entry (ablate_adamw.py; ratios
    # on docs/benchmarks.md); bits identical to every other candidate
    "cuda": {"BLOCK": 2048, "SUB": 512, "num_warps": 4, "TILE_2D": True, "PRECOMPUTED": True},
    # bf16 / 8-bit moments (adamw_sr_states_kernel): compute-bound (issue-bound: instructions per
    # element, tile_instruction_counts.py): 512-element tiles on 2 warps, 8 elements per thread, so a
    # tile's per-thread address and scale work is shared by 8 elements, not 4 (256 on 2 warps was the
    # ablation's fastest before the moments' rounding bits moved into the param's Philox word).
    # EDGE_SUB: a tile that straddles a segment end is walked in masked sub-tiles, so the masked code
    # needs no more registers than the full tiles' (a whole masked tile set the kernel's count).
    # 8-bit: sub-tiles of 128, not 64: Triton 3.6 gave wrong block scales for the second quantisation
    # block of a 64-element masked sub-tile on 1-2 warps (check_state_configs.py; the interpreter
    # computes it right), see docs/benchmarks.md
    "cuda-bf16": {"BLOCK": 2048, "SUB": 512, "num_warps": 2, "TILE_2D": True, "PRECOMPUTED": True,
                  "EDGE_SUB": 64},
    "cuda-8bit": {"BLOCK": 2048, "SUB": 512, "num_warps": 2, "TILE_2D": True, "PRECOMPUTED": True,
                  "EDGE_SUB": 128},
    # the interpreter pays per program and per op, not per element: few, wide programs
    "interpreter": {"BLOCK": 8192, "SUB": 8192, "num_warps": 4, "TILE_2D": True, "PRECOMPUTED": True},
}
# fmt: on

TENSOR_TABLE_COLUMNS = 5  # element offsets of param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq
CHUNK_TABLE_COLUMNS = (
    5  # slot, window local start, segment local start, segment local end, window global start
)
# step, step_size, bias_correction2_sqrt, lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, eps (fp32)
SCALAR_TABLE_COLUMNS = 9
SCALARS_BLOCK = 128  # tensors per program of the scalar kernel

# moment formats (``state_dtype``) by number, and as the kernels' STATE constexpr
FORMAT_FP32, FORMAT_BF16, FORMAT_8BIT = 0, 1, 2
STATE_FP32: tl.constexpr = tl.constexpr(FORMAT_FP32)  # fp32 moments, unrounded (adamw_sr_kernel)
STATE_BF16: tl.constexpr = tl.constexpr(FORMAT_BF16)  # bf16 moments (adamw_sr_states_kernel)
STATE_8BIT: tl.constexpr = tl.constexpr(FORMAT_8BIT)  # 8-bit codes + a scale byte per block (state_codes)
QUANT_BLOCK: tl.constexpr = tl.constexpr(state_codes.QUANT_BLOCK)
EXP_AVG_M: tl.constexpr = tl.constexpr(state_codes.EXP_AVG_MANTISSA_BITS)
EXP_AVG_SQ_M: tl.constexpr = tl.constexpr(state_codes.EXP_AVG_SQ_MANTISSA_BITS)
EXP_AVG_SR_SHIFT: tl.constexpr = tl.constexpr(state_codes.EXP_AVG_SR_SHIFT)
EXP_AVG_SQ_SR_SHIFT: tl.constexpr = tl.constexpr(state_codes.EXP_AVG_SQ_SR_SHIFT)
# with 8-bit moments the tensor table has two more columns: the element offsets of the two scales
TENSOR_TABLE_COLUMNS_8BIT = 7


@triton.jit
def _pow_by_squaring(base, exponent):
    """``base ** exponent`` in fp64 with multiplications only (reference: ``reference.pow_by_squaring``)."""
    result = base * 0.0 + 1.0
    for i in tl.static_range(32):
        bit = (exponent >> i) & 1
        result = tl.where(bit != 0, result * base, result)
        base = base * base
    return result


@triton.jit
def _step_scalars(steps_ptr, hyper_ptr, slot):
    """The fp32 scalars of tensor ``slot`` (scalar or tensor of slots), as ``reference.step_scalars``.

    Computed in fp64 and rounded once; fp64 ``/`` and ``sqrt`` lower to IEEE ``div.rn.f64`` /
    ``sqrt.rn.f64`` (fp32's would be approximate).
    """
    step_f = tl.load(steps_ptr + slot)
    step = step_f.to(tl.int64)
    lr = tl.load(hyper_ptr)
    beta1 = tl.load(hyper_ptr + 1)
    beta2 = tl.load(hyper_ptr + 2)
    eps = tl.load(hyper_ptr + 3)
    weight_decay = tl.load(hyper_ptr + 4)
    bias_correction1 = 1.0 - _pow_by_squaring(beta1, step)
    bias_correction2 = 1.0 - _pow_by_squaring(beta2, step)
    step_size = (lr / bias_correction1).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(bias_correction2).to(tl.float32)
    lr_decay = (lr * weight_decay).to(tl.float32)
    return (
        step_f,
        step_size,
        bias_correction2_sqrt,
        lr_decay,
        beta1.to(tl.float32),
        (1.0 - beta1).to(tl.float32),
        beta2.to(tl.float32),
        (1.0 - beta2).to(tl.float32),
        eps.to(tl.float32),
    )


@triton.jit
def step_scalars_kernel(steps_ptr, hyper_ptr, scalars_ptr, num_tensors, BLOCK_T: tl.constexpr):
    """Write each tensor's row of fp32 scalars for the ``PRECOMPUTED`` path; grid ``(cdiv(T, BLOCK_T),)``.

    Reads ``steps`` (fp32 ``[T]``) and ``hyper`` (fp64 ``[5]``: lr, beta1, beta2, eps,
    weight_decay); writes ``scalars`` (fp32 ``[T, SCALAR_TABLE_COLUMNS]``: step, step_size,
    bias_correction2_sqrt, lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, eps). Checks nothing.

    **Determinism:** each row is a pure function of its step and ``hyper``: computed in fp64 from the
    same IEEE operations as ``reference.step_scalars`` (``beta ** step`` by squaring), rounded once.

    Method: Adam's bias corrections (Kingma & Ba, ICLR 2015).
    """
    slots = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = slots < num_tensors
    slots = tl.where(inside, slots, 0)
    values = _step_scalars(steps_ptr, hyper_ptr, slots)
    (
        step_f,
        step_size,
        bias_correction2_sqrt,
        lr_decay,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
    ) = values
    row = scalars_ptr + slots * 9
    tl.store(row, step_f, mask=inside)
    tl.store(row + 1, step_size, mask=inside)
    tl.store(row + 2, bias_correction2_sqrt, mask=inside)
    tl.store(row + 3, lr_decay, mask=inside)
    tl.store(row + 4, beta1, mask=inside)
    tl.store(row + 5, one_minus_beta1, mask=inside)
    tl.store(row + 6, beta2, mask=inside)
    tl.store(row + 7, one_minus_beta2, mask=inside)
    tl.store(row + 8, eps, mask=inside)


@triton.jit
def _round_nearest_even_bf16(x):
    """fp32 -> bf16 round-to-nearest-even by bit arithmetic (reference: ``round_nearest_bf16_torch``).

    Equals the hardware conversion for every non-NaN input; written out because the Triton
    interpreter's fp32 -> bf16 cast truncates. NaN -> quiet NaN with the input's sign, as in det-core's SR.
    """
    xb = x.to(tl.uint32, bitcast=True)
    is_nan = ((xb & 0x7F800000) == 0x7F800000) & ((xb & 0x007FFFFF) != 0)
    rounded = (xb + 0x7FFF + ((xb >> 16) & 1)) & 0xFFFF0000
    out = tl.where(is_nan, (xb & 0x80000000) | 0x7FC00000, rounded)
    return out.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _random_bits_tile(seed_lo, seed_hi, step, stream, base, ROWS: tl.constexpr):
    """uint32 bits ``[ROWS, 4]`` for global indices ``base + 4 * row + column`` (``base % 4 == 0``).

    det-core's RNG contract (``rng`` module docstring): element ``i`` takes word ``i & 3`` of the
    Philox call with counter ``(i >> 2, step, stream)``. Here row ``r`` is one call and column ``c``
    its word ``c``, so a thread owning a row needs no exchange with other threads. Same bits as
    ``rng.random_bits_x4(...)`` reshaped to ``[ROWS, 4]``.
    """
    q = (base >> 2).to(tl.int64) + tl.arange(0, ROWS).to(tl.int64)
    zero = tl.zeros([ROWS], tl.uint32)
    c0 = (q & 0xFFFFFFFF).to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    c2 = zero + step.to(tl.uint32)
    c3 = zero + stream.to(tl.uint32)
    k0 = zero + seed_lo.to(tl.uint32)
    k1 = zero + seed_hi.to(tl.uint32)
    r0, r1, r2, r3 = rng.philox4x32_10(c0, c1, c2, c3, k0, k1)
    word = tl.arange(0, 4)[None, :]
    return tl.where(
        word == 0,
        r0[:, None],
        tl.where(word == 1, r1[:, None], tl.where(word == 2, r2[:, None], r3[:, None])),
    )


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "rng_stream"])
def adamw_sr_kernel(
    # base pointers, one per tensor role
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    max_exp_avg_sq_ptr,
    # tables and device scalars
    tensor_table_ptr,
    chunk_table_ptr,
    steps_ptr,
    hyper_ptr,
    scalars_ptr,
    # Philox key words
    seed_lo,
    seed_hi,
    rng_stream,
    # AMP (GradScaler) device scalars, fp32 [1]: the loss scale, and the inf/NaN flag
    grad_scale_ptr,
    found_inf_ptr,
    # meta-parameters
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    TILE_2D: tl.constexpr,
    PRECOMPUTED: tl.constexpr,
    UNSCALE: tl.constexpr,
    SKIP_ON_INF: tl.constexpr,
):
    """The fused step with fp32 moments (``state_dtype=torch.float32``), in place; grid ``(C,)``.

    Pointers: the lowest-address tensor of each role (param fp32 or bf16 per ``PARAM_BF16``, grad
    fp32 or bf16, moments fp32), each tensor reached by its element offsets in ``tensor_table``
    (int64 ``[T, TENSOR_TABLE_COLUMNS]``); ``chunk_table`` int64 ``[C, CHUNK_TABLE_COLUMNS]``, one
    row per program (module docstring); ``steps`` fp32 ``[T]``; ``hyper`` fp64 ``[5]`` (lr, beta1,
    beta2, eps, weight_decay); ``scalars`` fp32 ``[T, SCALAR_TABLE_COLUMNS]``, written by
    ``step_scalars_kernel`` when ``PRECOMPUTED``; ``grad_scale`` / ``found_inf`` fp32 ``[1]``, read
    only with ``UNSCALE`` / ``SKIP_ON_INF``. Checks nothing: launched by ``_launch.launch_fused_step``
    (with ``_launch.exactness_options``) after the host has validated every tensor.

    **Determinism:** each element's result is a pure function of its inputs, the hyperparameters,
    its tensor's step, the Philox key ``(seed, step, rng_stream)`` and its global index (never of
    ``program_id``, ``BLOCK``, ``SUB``, ``TILE_2D``, ``PRECOMPUTED`` or ``num_warps``): bitwise
    equal to ``reference.adamw_sr_step_reference``.

    Method: AdamW (Loshchilov & Hutter, ICLR 2019); stochastic rounding (Gupta et al., ICML 2015)
    with Philox4x32-10 bits (Salmon et al., SC'11).
    """
    _step_program(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
        exp_avg_ptr, exp_avg_sq_ptr,  # no scales: never read with fp32 moments
        tensor_table_ptr, chunk_table_ptr, steps_ptr, hyper_ptr, scalars_ptr,
        seed_lo, seed_hi, rng_stream,
        grad_scale_ptr, found_inf_ptr,
        AMSGRAD, MAXIMIZE, PARAM_BF16, STOCHASTIC, ALIGNED, BLOCK, SUB, TILE_2D, PRECOMPUTED, UNSCALE,
        SKIP_ON_INF, STATE_FP32, False, SUB,
    )  # fmt: skip


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "rng_stream"])
def adamw_sr_states_kernel(
    # base pointers, one per tensor role (scales: 8-bit states only)
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    max_exp_avg_sq_ptr,
    exp_avg_scale_ptr,
    exp_avg_sq_scale_ptr,
    # tables and device scalars
    tensor_table_ptr,
    chunk_table_ptr,
    steps_ptr,
    hyper_ptr,
    scalars_ptr,
    # Philox key words, and the stream of every rounding (the param's and the moments')
    seed_lo,
    seed_hi,
    rng_stream,
    # AMP (GradScaler) device scalars, fp32 [1]: the loss scale, and the inf/NaN flag
    grad_scale_ptr,
    found_inf_ptr,
    # meta-parameters
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    TILE_2D: tl.constexpr,
    PRECOMPUTED: tl.constexpr,
    UNSCALE: tl.constexpr,
    SKIP_ON_INF: tl.constexpr,
    STATE: tl.constexpr,
    STATE_STOCHASTIC: tl.constexpr,
    EDGE_SUB: tl.constexpr,
):
    """The fused step with bf16 (``STATE_BF16``) or 8-bit block-quantized (``STATE_8BIT``) moments.

    Arguments as ``adamw_sr_kernel``'s, with moments bf16 or uint8 codes, and for 8 bits the uint8
    block scales (``exp_avg_scale_ptr``, ``exp_avg_sq_scale_ptr``; one per ``QUANT_BLOCK`` global
    indices) whose element offsets are two more ``tensor_table`` columns
    (``TENSOR_TABLE_COLUMNS_8BIT``). ``STATE_STOCHASTIC``: the moments are rounded stochastically
    into their format with 8 bits each of the high half of the param's Philox word under
    ``rng_stream`` (``state_codes.state_rounding_bits``); else to nearest-even. ``EDGE_SUB``: a tile that
    crosses a segment's start or end is walked in masked sub-tiles of that many elements (a launch
    config entry: no bit depends on it). Checks nothing (see ``adamw_sr_kernel``).

    **Determinism:** as ``adamw_sr_kernel``, the moments' rounding bits keyed by ``(seed, step,
    rng_stream)`` at the element's global index, and an 8-bit block's scale a function of its whole block of
    ``QUANT_BLOCK`` global indices.

    Method: AdamW (Loshchilov & Hutter, ICLR 2019); 8-bit states: block-wise quantization
    (Dettmers et al., ICLR 2022) with power-of-two block scales (OCP Microscaling), see
    ``_state_codes``.
    """
    _step_program(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
        exp_avg_scale_ptr, exp_avg_sq_scale_ptr,
        tensor_table_ptr, chunk_table_ptr, steps_ptr, hyper_ptr, scalars_ptr,
        seed_lo, seed_hi, rng_stream,
        grad_scale_ptr, found_inf_ptr,
        AMSGRAD, MAXIMIZE, PARAM_BF16, STOCHASTIC, ALIGNED, BLOCK, SUB, TILE_2D, PRECOMPUTED, UNSCALE,
        SKIP_ON_INF, STATE, STATE_STOCHASTIC, EDGE_SUB,
    )  # fmt: skip


@triton.jit
def _step_program(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
    exp_avg_scale_ptr, exp_avg_sq_scale_ptr,
    tensor_table_ptr, chunk_table_ptr, steps_ptr, hyper_ptr, scalars_ptr,
    seed_lo, seed_hi, rng_stream,
    grad_scale_ptr, found_inf_ptr,
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, PARAM_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, TILE_2D: tl.constexpr,
    PRECOMPUTED: tl.constexpr, UNSCALE: tl.constexpr, SKIP_ON_INF: tl.constexpr, STATE: tl.constexpr,
    STATE_STOCHASTIC: tl.constexpr, EDGE_SUB: tl.constexpr,
):  # fmt: skip
    """One program: one chunk-table row (a window of ``BLOCK`` elements of one tensor), in tiles
    (a tile crossing a segment's start or end: masked, in sub-tiles of ``EDGE_SUB``)."""
    chunk = tl.program_id(0).to(tl.int64)
    row = chunk_table_ptr + chunk * 5
    slot = tl.load(row)
    window_local = tl.load(row + 1)
    segment_start = tl.load(row + 2)
    segment_end = tl.load(row + 3)
    window_global = tl.load(row + 4)

    if STATE == STATE_8BIT:  # two more columns: the element offsets of the scales
        trow = tensor_table_ptr + slot * 7
    else:
        trow = tensor_table_ptr + slot * 5
    param_off = tl.load(trow)
    grad_off = tl.load(trow + 1)
    exp_avg_off = tl.load(trow + 2)
    exp_avg_sq_off = tl.load(trow + 3)
    max_off = param_off
    if AMSGRAD:
        max_off = tl.load(trow + 4)
    exp_avg_scale_off = param_off
    exp_avg_sq_scale_off = param_off
    if STATE == STATE_8BIT:
        exp_avg_scale_off = tl.load(trow + 5)
        exp_avg_sq_scale_off = tl.load(trow + 6)

    if PRECOMPUTED:
        srow = scalars_ptr + slot * 9
        step = tl.load(srow).to(tl.int64)
        step_size = tl.load(srow + 1)
        bias_correction2_sqrt = tl.load(srow + 2)
        lr_decay = tl.load(srow + 3)
        beta1_f = tl.load(srow + 4)
        one_minus_beta1 = tl.load(srow + 5)
        beta2_f = tl.load(srow + 6)
        one_minus_beta2 = tl.load(srow + 7)
        eps_f = tl.load(srow + 8)
    else:
        (
            step_f,
            step_size,
            bias_correction2_sqrt,
            lr_decay,
            beta1_f,
            one_minus_beta1,
            beta2_f,
            one_minus_beta2,
            eps_f,
        ) = _step_scalars(steps_ptr, hyper_ptr, slot)
        step = step_f.to(tl.int64)

    # AMP: the gradient is multiplied by the fp32 reciprocal of the scale, computed in fp64 and rounded
    # once, as GradScaler.unscale_ computes it; a nonzero found_inf leaves the window unvisited (the
    # skip is read here, on the device: no host sync)
    inv_scale = 1.0
    if UNSCALE:
        inv_scale = (1.0 / tl.load(grad_scale_ptr).to(tl.float64)).to(tl.float32)
    window_end = BLOCK
    if SKIP_ON_INF:
        window_end = tl.where(tl.load(found_inf_ptr) == 0.0, BLOCK, 0)

    # Full tiles (nearly all) take the unmasked path: with ALIGNED, vector loads and stores. A loaded
    # segment end has unknown divisibility, so a masked tile cannot be vectorized. Tiles of the window
    # wholly outside the segment are skipped.
    for sub in range(0, window_end, SUB):
        tile_local = window_local + sub
        if (tile_local >= segment_start) & (tile_local + SUB <= segment_end):
            _step_tile(
                param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
                param_off, grad_off, exp_avg_off, exp_avg_sq_off, max_off,
                tile_local, segment_start, segment_end, window_global + sub,
                step, step_size, bias_correction2_sqrt, lr_decay,
                beta1_f, one_minus_beta1, beta2_f, one_minus_beta2, eps_f, inv_scale,
                seed_lo, seed_hi, rng_stream,
                exp_avg_scale_ptr, exp_avg_sq_scale_ptr, exp_avg_scale_off, exp_avg_sq_scale_off,
                AMSGRAD, MAXIMIZE, PARAM_BF16, STOCHASTIC, ALIGNED, False, SUB, TILE_2D, UNSCALE,
                STATE, STATE_STOCHASTIC,
            )  # fmt: skip
        elif (tile_local < segment_end) & (tile_local + SUB > segment_start):
            # masked sub-tiles of EDGE_SUB (SUB: one, the fp32 kernel's case): a masked tile is not
            # vectorized and its layout conversions hold values in registers; at SUB elements it
            # sets the whole kernel's register count
            for part in range(0, SUB, EDGE_SUB):
                part_local = tile_local + part
                if (part_local < segment_end) & (part_local + EDGE_SUB > segment_start):
                    _step_tile(
                        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
                        param_off, grad_off, exp_avg_off, exp_avg_sq_off, max_off,
                        part_local, segment_start, segment_end, window_global + sub + part,
                        step, step_size, bias_correction2_sqrt, lr_decay,
                        beta1_f, one_minus_beta1, beta2_f, one_minus_beta2, eps_f, inv_scale,
                        seed_lo, seed_hi, rng_stream,
                        exp_avg_scale_ptr, exp_avg_sq_scale_ptr, exp_avg_scale_off,
                        exp_avg_sq_scale_off,
                        AMSGRAD, MAXIMIZE, PARAM_BF16, STOCHASTIC, False, True, EDGE_SUB, TILE_2D,
                        UNSCALE, STATE, STATE_STOCHASTIC,
                    )  # fmt: skip


@triton.jit
def _load(ptr, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=mask)
    else:
        return tl.load(ptr)


@triton.jit
def _store(ptr, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, value, mask=mask)
    else:
        tl.store(ptr, value)


@triton.jit
def _index(offset, local, ALIGNED: tl.constexpr, SUB: tl.constexpr, TILE_2D: tl.constexpr):
    idx = offset + local
    if ALIGNED:
        if TILE_2D:  # rows of 4 contiguous elements, each row starting on a multiple of 4
            idx = tl.max_contiguous(tl.multiple_of(idx, [1, 4]), [1, 4])
        else:
            idx = tl.max_contiguous(tl.multiple_of(idx, 8), SUB)
    return idx


@triton.jit
def _tile_bits(seed_lo, seed_hi, step, stream, tile_global, SUB: tl.constexpr, TILE_2D: tl.constexpr):
    """The tile's uint32 Philox words under ``stream``, in the tile's layout."""
    if TILE_2D:
        return _random_bits_tile(seed_lo, seed_hi, step, stream, tile_global, SUB // 4)
    else:
        return rng.random_bits_x4(seed_lo, seed_hi, step, stream, tile_global, SUB)


@triton.jit
def _round_bf16(x, rbits, STOCHASTIC: tl.constexpr):
    """fp32 -> bf16: stochastic with the low 16 bits of ``rbits`` (uint32), or nearest-even."""
    if STOCHASTIC:
        return sr.stochastic_round_bf16(x, rbits)
    else:
        return _round_nearest_even_bf16(x)


@triton.jit
def _rounding_word(placeholder, seed_lo, seed_hi, step, stream, tile_global, PARAM_BF16: tl.constexpr,
                   STOCHASTIC: tl.constexpr, SUB: tl.constexpr, TILE_2D: tl.constexpr,
                   STATE_STOCHASTIC: tl.constexpr):  # fmt: skip
    """The states kernel's Philox word per element (the param's ``stream``; low half: the param's SR,
    high half: the moments'), or ``placeholder``'s bits (unread) when nothing rounds stochastically."""
    word = placeholder.to(tl.uint32, bitcast=True)
    if STATE_STOCHASTIC or (PARAM_BF16 and STOCHASTIC):
        word = _tile_bits(seed_lo, seed_hi, step, stream, tile_global, SUB, TILE_2D)
    return word


@triton.jit
def _round_moments_bf16(m, v, word, STATE_STOCHASTIC: tl.constexpr):
    """The bf16 moments' one rounding each (the step itself uses the fp32 values)."""
    m_out = _round_bf16(m, state_codes.state_rounding_bits(word, EXP_AVG_SR_SHIFT), STATE_STOCHASTIC)
    v_out = _round_bf16(v, state_codes.state_rounding_bits(word, EXP_AVG_SQ_SR_SHIFT), STATE_STOCHASTIC)
    return m_out, v_out


@triton.jit
def _bf16_of_exact(x):
    """fp32 holding a bf16 value -> that bf16 (the top half of the pattern; NaN stays NaN)."""
    return (x.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _step_tile(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
    param_off, grad_off, exp_avg_off, exp_avg_sq_off, max_off,
    tile_local, segment_start, segment_end, tile_global,
    step, step_size, bias_correction2_sqrt, lr_decay, beta1_f, one_minus_beta1, beta2_f, one_minus_beta2,
    eps_f, inv_scale,
    seed_lo, seed_hi, rng_stream,
    exp_avg_scale_ptr, exp_avg_sq_scale_ptr, exp_avg_scale_off, exp_avg_sq_scale_off,
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, PARAM_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr, MASKED: tl.constexpr, SUB: tl.constexpr, TILE_2D: tl.constexpr,
    UNSCALE: tl.constexpr, STATE: tl.constexpr, STATE_STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """The update of one tile of SUB elements (``MASKED``: some lie outside the segment)."""
    if TILE_2D:
        lanes = tl.arange(0, SUB // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    else:
        lanes = tl.arange(0, SUB)
    local = tile_local + lanes.to(tl.int64)
    mask = (local >= segment_start) & (local < segment_end)
    if MASKED:
        local = tl.where(mask, local, 0)  # never form an address before a tensor's start
    p_idx = _index(param_off, local, ALIGNED, SUB, TILE_2D)
    g_idx = _index(grad_off, local, ALIGNED, SUB, TILE_2D)
    m_idx = _index(exp_avg_off, local, ALIGNED, SUB, TILE_2D)
    v_idx = _index(exp_avg_sq_off, local, ALIGNED, SUB, TILE_2D)

    p = _load(param_ptr + p_idx, mask, MASKED).to(tl.float32)
    g = _load(grad_ptr + g_idx, mask, MASKED).to(tl.float32)
    if STATE == STATE_8BIT:
        # tiles start on a block (8-bit segments start on one, in the global and the local index),
        # so block b of the tile is the tensor's block tile_local // QUANT_BLOCK + b
        blocks = tl.arange(0, SUB // QUANT_BLOCK)
        block_mask = tile_local + blocks.to(tl.int64) * QUANT_BLOCK < segment_end
        m_scale_idx = exp_avg_scale_off + tile_local // QUANT_BLOCK + blocks
        v_scale_idx = exp_avg_sq_scale_off + tile_local // QUANT_BLOCK + blocks
        m_scale = state_codes.expand_blocks(
            _load(exp_avg_scale_ptr + m_scale_idx, block_mask, MASKED).to(tl.int32), SUB, TILE_2D
        )
        v_scale = state_codes.expand_blocks(
            _load(exp_avg_sq_scale_ptr + v_scale_idx, block_mask, MASKED).to(tl.int32), SUB, TILE_2D
        )
        m = state_codes.decode(_load(exp_avg_ptr + m_idx, mask, MASKED), m_scale, EXP_AVG_M, True)
        v = state_codes.decode(_load(exp_avg_sq_ptr + v_idx, mask, MASKED), v_scale, EXP_AVG_SQ_M, False)
    elif STATE == STATE_BF16:
        m = _load(exp_avg_ptr + m_idx, mask, MASKED).to(tl.float32)
        v = _load(exp_avg_sq_ptr + v_idx, mask, MASKED).to(tl.float32)
    else:
        m = _load(exp_avg_ptr + m_idx, mask, MASKED)
        v = _load(exp_avg_sq_ptr + v_idx, mask, MASKED)
    if UNSCALE:
        # the bits of an explicit unscale (torch._amp_foreach_non_finite_check_and_unscale_): one fp32
        # multiply, rounded to nearest-even into a bf16 gradient; stored back unscaled, as torch's
        # fused AdamW and GradScaler.unscale_ leave it (exact: the value has the gradient's dtype)
        g = g * inv_scale
        if grad_ptr.dtype.element_ty == tl.bfloat16:
            g = _round_nearest_even_bf16(g).to(tl.float32)
        _store(grad_ptr + g_idx, g.to(grad_ptr.dtype.element_ty), mask, MASKED)
    if MAXIMIZE:
        g = -g

    # decoupled weight decay (Loshchilov & Hutter) as p - p * (lr * wd), not p * (1 - lr * wd): the
    # fp32 rounding of 1 - lr * wd is up to 3% of lr * wd (a systematic bias per step at lr * wd ~ 1e-6);
    # that of lr * wd is 3e-8 of it, so the only error left is the subtraction's own rounding
    p = p - p * lr_decay
    m = beta1_f * m + one_minus_beta1 * g
    v = beta2_f * v + one_minus_beta2 * (g * g)
    if STATE != STATE_FP32:
        if AMSGRAD:  # (bf16 moments) the maximum takes the rounded v: round before the step
            word = _rounding_word(m, seed_lo, seed_hi, step, rng_stream, tile_global, PARAM_BF16, STOCHASTIC,
                                  SUB, TILE_2D, STATE_STOCHASTIC)  # fmt: skip
            m_out, v_out = _round_moments_bf16(m, v, word, STATE_STOCHASTIC)
    if AMSGRAD:
        vmax_idx = _index(max_off, local, ALIGNED, SUB, TILE_2D)
        if STATE == STATE_BF16:
            # the running maximum of the stored (rounded) v: a bf16 value, stored exactly
            vmax = _load(max_exp_avg_sq_ptr + vmax_idx, mask, MASKED).to(tl.float32)
            vmax = tl.maximum(vmax, v_out.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)
            _store(max_exp_avg_sq_ptr + vmax_idx, _bf16_of_exact(vmax), mask, MASKED)
        else:
            vmax = _load(max_exp_avg_sq_ptr + vmax_idx, mask, MASKED)
            vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
            _store(max_exp_avg_sq_ptr + vmax_idx, vmax, mask, MASKED)
        v_hat = vmax
    else:
        v_hat = v
    denom = tl.div_rn(tl.sqrt_rn(v_hat), bias_correction2_sqrt) + eps_f
    p = p - step_size * tl.div_rn(m, denom)

    if STATE != STATE_FP32:
        if not AMSGRAD:  # drawn after the division: its words then do not live across it
            word = _rounding_word(m, seed_lo, seed_hi, step, rng_stream, tile_global, PARAM_BF16, STOCHASTIC,
                                  SUB, TILE_2D, STATE_STOCHASTIC)  # fmt: skip
            if STATE == STATE_BF16:
                m_out, v_out = _round_moments_bf16(m, v, word, STATE_STOCHASTIC)
    if STATE == STATE_8BIT:
        m_bits = state_codes.state_rounding_bits(word, EXP_AVG_SR_SHIFT)
        v_bits = state_codes.state_rounding_bits(word, EXP_AVG_SQ_SR_SHIFT)
        # each block's new scale from its new values, then the codes (rounded with the state bits)
        m_scale = state_codes.tile_block_scales(m, mask, SUB, MASKED)
        v_scale = state_codes.tile_block_scales(v, mask, SUB, MASKED)
        m_code = state_codes.encode(
            m, state_codes.expand_blocks(m_scale, SUB, TILE_2D), m_bits, EXP_AVG_M, True, STATE_STOCHASTIC
        )
        v_code = state_codes.encode(
            v, state_codes.expand_blocks(v_scale, SUB, TILE_2D), v_bits, EXP_AVG_SQ_M, False, STATE_STOCHASTIC
        )
        _store(exp_avg_ptr + m_idx, m_code, mask, MASKED)
        _store(exp_avg_sq_ptr + v_idx, v_code, mask, MASKED)
        first_block = tile_local // QUANT_BLOCK
        m_scale_at = exp_avg_scale_off + first_block
        v_scale_at = exp_avg_sq_scale_off + first_block
        state_codes.store_block_scales(exp_avg_scale_ptr, m_scale_at, tile_local, segment_end, m_scale, SUB,
                                       TILE_2D, MASKED)  # fmt: skip
        state_codes.store_block_scales(exp_avg_sq_scale_ptr, v_scale_at, tile_local, segment_end, v_scale,
                                       SUB, TILE_2D, MASKED)  # fmt: skip
    elif STATE == STATE_BF16:
        _store(exp_avg_ptr + m_idx, m_out, mask, MASKED)
        _store(exp_avg_sq_ptr + v_idx, v_out, mask, MASKED)
    else:
        _store(exp_avg_ptr + m_idx, m, mask, MASKED)
        _store(exp_avg_sq_ptr + v_idx, v, mask, MASKED)
    if PARAM_BF16:
        if STOCHASTIC:
            # the one rounding of the step: unbiased, bits keyed by (seed, step, global index)
            if STATE != STATE_FP32:
                rbits = word  # drawn above for the moments too
            elif TILE_2D:
                rbits = _random_bits_tile(seed_lo, seed_hi, step, rng_stream, tile_global, SUB // 4)
            else:
                rbits = rng.random_bits_x4(seed_lo, seed_hi, step, rng_stream, tile_global, SUB)
            out = sr.stochastic_round_bf16(p, rbits)
        else:
            out = _round_nearest_even_bf16(p)
        _store(param_ptr + p_idx, out, mask, MASKED)
    else:
        _store(param_ptr + p_idx, p, mask, MASKED)
