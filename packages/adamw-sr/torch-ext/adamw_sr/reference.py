"""Plain-torch reference of the fused AdamW-SR step, bit-identical to the Triton kernel.

Every operation is one IEEE-rounded fp32 operation (separate multiplies and adds, no ``lerp`` or
``addcmul`` that a backend may contract into an FMA), scalars are computed in Python floats (IEEE
fp64) by the same sequence as the kernel and rounded once to fp32, and the stochastic-rounding bits
come from det-core's Philox reference. So a step run on the GPU can be checked on a CPU, bit for bit.

Method: AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019) as
``torch.optim.AdamW`` computes it; stochastic rounding (Gupta et al., ICML 2015).
"""

from __future__ import annotations

import math

import torch
from det_core import rng, sr

from . import _state_codes


def pow_by_squaring(base: float, exponent: int) -> float:
    """``base ** exponent`` in fp64 by binary exponentiation over 32 bits (multiplications only).

    The kernel computes the same 64 multiplications in the same order, so the two agree bit for bit
    (``math.pow`` and CUDA's ``pow`` may differ in the last bit).

    **Determinism:** IEEE fp64 multiplications only: the same bits on every platform.
    """
    result = 1.0
    for i in range(32):
        if (exponent >> i) & 1:
            result = result * base
        base = base * base
    return result


def sqrt_rn_torch(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded (IEEE round-to-nearest) fp32 square root, in plain torch.

    ``torch.sqrt`` on CPU is not correctly rounded for fp32 in every build (an AVX512 build of torch
    2.13 differs from IEEE ``sqrt`` in ~20% of random inputs by one ULP), while the kernel's
    ``sqrt_rn`` is. So: an fp64 estimate rounded to fp32, then corrected to the nearest fp32 by
    exact fp64 tests against the midpoints to its neighbours (a midpoint has 25 significant bits,
    its square 50, so the test is exact; a square root is never exactly a midpoint).

    Args:
        x: fp32 tensor, any shape. Returns: fp32 tensor of ``x``'s shape.

    **Determinism:** correctly rounded, so equal to IEEE ``sqrt`` (GPU ``sqrt.rn``) for every
    input except the sign/payload of NaN.
    """
    s = torch.sqrt(x.double()).float()
    xd = x.double()
    sd = s.double()
    up = torch.nextafter(s, torch.full_like(s, math.inf)).double()
    down = torch.nextafter(s, torch.zeros_like(s)).double()
    mid_up = (sd + up) * 0.5
    mid_down = (sd + down) * 0.5
    s = torch.where(mid_up * mid_up < xd, up.float(), s)
    s = torch.where((mid_down > 0) & (mid_down * mid_down > xd), down.float(), s)
    return s


def round_nearest_bf16_torch(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 round-to-nearest-even by bit arithmetic, bit-identical to the kernel.

    Equals ``x.to(torch.bfloat16)`` for every non-NaN input; NaN -> quiet NaN with the input's sign.

    Args:
        x: fp32 tensor, any shape. Returns: bf16 tensor of ``x``'s shape.

    **Determinism:** integer bit arithmetic: the same bits on every platform.
    """
    xb = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = ((xb & 0x7F800000) == 0x7F800000) & ((xb & 0x007FFFFF) != 0)
    rounded = (xb + 0x7FFF + ((xb >> 16) & 1)) & 0xFFFF0000
    out = torch.where(is_nan, (xb & 0x80000000) | 0x7FC00000, rounded)
    top = (out >> 16).to(torch.int32)
    top = torch.where(top >= 0x8000, top - 0x10000, top)
    return top.to(torch.int16).view(torch.bfloat16)


def step_scalars(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> dict:
    """The per-step fp32 scalars of the update, computed in fp64 and rounded once (as the kernel does).

    Returns a dict of 0-dim fp32 tensors: step_size, bias_correction2_sqrt, lr_decay (lr * weight_decay),
    beta1, one_minus_beta1, beta2, one_minus_beta2, eps.

    **Determinism:** IEEE fp64 operations in the kernel's order, then one fp64 -> fp32 rounding.
    """
    bias_correction1 = 1.0 - pow_by_squaring(beta1, step)
    bias_correction2 = 1.0 - pow_by_squaring(beta2, step)
    values = {
        "step_size": lr / bias_correction1,
        "bias_correction2_sqrt": math.sqrt(bias_correction2),
        "lr_decay": lr * weight_decay,
        "beta1": beta1,
        "one_minus_beta1": 1.0 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1.0 - beta2,
        "eps": eps,
    }
    return {k: torch.tensor(v, dtype=torch.float64).to(torch.float32) for k, v in values.items()}


@torch.no_grad()
def adamw_sr_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None = None,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    amsgrad: bool = False,
    maximize: bool = False,
    stochastic_rounding: bool | None = None,
    seed: int = 0,
    base_index: int = 0,
    global_index: torch.Tensor | None = None,
    grad_scale: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | float | None = None,
    state_rounding: str = "stochastic",
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
) -> None:
    """One AdamW-SR step on one tensor, in place, in plain torch (any device; CPU for checking).

    Args:
        param: fp32 or bf16 tensor, any shape; updated in place.
        grad: fp32 or bf16 tensor of ``param``'s shape.
        exp_avg, exp_avg_sq: the moments, of ``param``'s shape, updated in place; their dtype is the
            state format (``AdamWSR``'s ``state_dtype``): fp32 (stored unrounded), bf16 (rounded per
            ``state_rounding``) or uint8 (8-bit codes, ``_state_codes``; then ``exp_avg_scale`` and
            ``exp_avg_sq_scale`` are required).
        max_exp_avg_sq: the ``exp_avg_sq`` dtype (fp32 or bf16) when ``amsgrad``; updated in place.
            With bf16 moments it is the running maximum of the stored (rounded) ``exp_avg_sq``.
        step: the step number after incrementing (1 on the first step), ``1 <= step < 2**24``.
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW`` (floats).
        amsgrad, maximize: as ``torch.optim.AdamW``.
        stochastic_rounding: for bf16 ``param``: ``None``/``True`` rounds stochastically, ``False``
            to nearest. fp32 params are written back unrounded.
        seed: Philox seed, ``0 <= seed < 2**64``.
        base_index: global index of ``param``'s first element (its elements are consecutive).
        global_index: int64 tensor of ``param``'s shape giving each element's global index; overrides
            ``base_index`` (e.g. for a column shard).
        grad_scale: AMP: the loss scale ``grad`` carries (``torch.amp.GradScaler``'s fp32 scale; a
            float is taken as fp32). ``grad`` is multiplied by the fp32 reciprocal of it, computed
            in fp64 and rounded once, and a bf16 ``grad`` is rounded back to bf16 (nearest even):
            what ``GradScaler.unscale_`` (``torch._amp_foreach_non_finite_check_and_unscale_``)
            stores. ``grad`` itself is not changed (the kernel also writes the unscaled gradient
            back, as torch's fused AdamW does).
        found_inf: AMP: when nonzero the step is skipped: nothing is written (the caller keeps
            its step count where it was).
        state_rounding: bf16 / 8-bit moments: ``"stochastic"`` (8 bits each of the high
            half of the ``STREAM_PARAM_SR`` word at the element's global index, as
            ``_state_codes.state_rounding_bits_torch``) or
            ``"nearest"`` (nearest-even).
        exp_avg_scale, exp_avg_sq_scale: 8-bit moments: uint8 tensors of
            ``_state_codes.QUANT_BLOCK``-element block scales, one per block of ``param``'s flat
            elements (``ceil(numel / 32)`` of them, any shape); updated in place. ``base_index`` must
            be a multiple of 32 (blocks follow the global index); ``global_index`` is not accepted.

    Raises:
        TypeError: a tensor has an unsupported dtype.
        ValueError: an unknown ``state_rounding``; 8-bit moments without scales, with scales of the
            wrong size, with ``amsgrad``, ``global_index`` or a ``base_index`` off the block grid.

    **Determinism:** a pure function of its inputs; bit-identical to the Triton kernel (GPU or
    interpreter) for the same inputs, because both run the same IEEE operations in the same order.
    """
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"param must be float32 or bfloat16, got {param.dtype}")
    state_dtype = exp_avg.dtype
    if state_dtype not in (torch.float32, torch.bfloat16, torch.uint8):
        raise TypeError(f"exp_avg must be float32, bfloat16 or uint8 (8-bit codes), got {state_dtype}")
    for name, state in (("exp_avg_sq", exp_avg_sq), ("max_exp_avg_sq", max_exp_avg_sq)):
        if state is not None and state.dtype != state_dtype:
            raise TypeError(f"{name} must have exp_avg's dtype {state_dtype}, got {state.dtype}")
    if state_rounding not in ("stochastic", "nearest"):
        raise ValueError(f"state_rounding must be 'stochastic' or 'nearest', got {state_rounding!r}")
    quantized = state_dtype == torch.uint8
    if quantized:
        _check_quantized(param, exp_avg_scale, exp_avg_sq_scale, amsgrad, base_index, global_index)
    if found_inf is not None and float(found_inf) != 0.0:
        return  # GradScaler found inf/NaN gradients: the step is skipped
    if global_index is None:
        global_index = base_index + torch.arange(param.numel(), dtype=torch.int64).reshape(param.shape)
    global_index = global_index.to(param.device)
    stochastic_states = state_rounding == "stochastic"
    s = step_scalars(step, lr, beta1, beta2, eps, weight_decay)
    g = grad.to(torch.float32)
    if grad_scale is not None:
        inv_scale = torch.as_tensor(grad_scale, dtype=torch.float32).double().reciprocal().float()
        g = g * inv_scale
        if grad.dtype == torch.bfloat16:
            g = round_nearest_bf16_torch(g).to(torch.float32)
    if maximize:
        g = -g
    p = param.to(torch.float32)
    p = p - p * s["lr_decay"]  # not p * (1 - lr * wd): see the kernel
    if quantized:
        m_old = _decode(exp_avg, exp_avg_scale, _state_codes.EXP_AVG_MANTISSA_BITS, True)
        v_old = _decode(exp_avg_sq, exp_avg_sq_scale, _state_codes.EXP_AVG_SQ_MANTISSA_BITS, False)
    else:
        m_old, v_old = exp_avg.to(torch.float32), exp_avg_sq.to(torch.float32)
    m = s["beta1"] * m_old + s["one_minus_beta1"] * g
    v = s["beta2"] * v_old + s["one_minus_beta2"] * (g * g)
    # the moments' random bits: 8 each from the high half of the param's word (its low half rounds the
    # param), as _state_codes.state_rounding_bits_torch
    m_bits = v_bits = None
    if stochastic_states and state_dtype != torch.float32:
        word = rng.random_bits_torch(seed, step, rng.STREAM_PARAM_SR, global_index)
        m_bits = _state_codes.state_rounding_bits_torch(word, _state_codes.EXP_AVG_SR_SHIFT)
        v_bits = _state_codes.state_rounding_bits_torch(word, _state_codes.EXP_AVG_SQ_SR_SHIFT)
    if state_dtype == torch.bfloat16:
        # each moment's one rounding; the step itself uses the fp32 values
        m_out = _round_bf16(m, m_bits)
        v_out = _round_bf16(v, v_bits)
    if amsgrad:
        if state_dtype == torch.bfloat16:  # the maximum of the stored v: a bf16 value, kept exactly
            v_hat = torch.maximum(max_exp_avg_sq.to(torch.float32), v_out.to(torch.float32))
        else:
            v_hat = torch.maximum(max_exp_avg_sq, v)
        max_exp_avg_sq.copy_(v_hat)
    else:
        v_hat = v
    denom = sqrt_rn_torch(v_hat) / s["bias_correction2_sqrt"] + s["eps"]
    p = p - s["step_size"] * (m / denom)
    if quantized:
        for x, code, scale, rbits, bits, signed in (
            (m, exp_avg, exp_avg_scale, m_bits, _state_codes.EXP_AVG_MANTISSA_BITS, True),
            (v, exp_avg_sq, exp_avg_sq_scale, v_bits, _state_codes.EXP_AVG_SQ_MANTISSA_BITS, False),
        ):
            _encode(x, code, scale, rbits, bits, signed)
    elif state_dtype == torch.bfloat16:
        exp_avg.copy_(m_out)
        exp_avg_sq.copy_(v_out)
    else:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if param.dtype == torch.bfloat16:
        if stochastic_rounding is False:
            param.copy_(round_nearest_bf16_torch(p))
        else:
            rbits = rng.random_bits_torch(seed, step, rng.STREAM_PARAM_SR, global_index)
            param.copy_(sr.stochastic_round_bf16_torch(p, rbits))
    else:
        param.copy_(p)


def _round_bf16(x, rbits) -> torch.Tensor:
    """fp32 -> bf16: stochastic with the low 16 bits of ``rbits``, or nearest-even (``rbits=None``)."""
    if rbits is None:
        return round_nearest_bf16_torch(x)
    return sr.stochastic_round_bf16_torch(x, rbits & 0xFFFF)


def _check_quantized(param, exp_avg_scale, exp_avg_sq_scale, amsgrad, base_index, global_index) -> None:
    block = _state_codes.QUANT_BLOCK
    if amsgrad:
        raise ValueError("amsgrad is not supported with 8-bit (uint8) moments")
    if global_index is not None:
        raise ValueError(
            "8-bit moments: blocks follow the flat global index from base_index; global_index is for "
            "fp32 and bf16 moments"
        )
    if int(base_index) % block:
        raise ValueError(
            f"8-bit moments: base_index {base_index} must be a multiple of the block size {block}"
        )
    n_blocks = -(-param.numel() // block)
    for name, scale in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
        if scale is None or scale.dtype != torch.uint8 or scale.numel() != n_blocks:
            got = "None" if scale is None else f"{scale.dtype} with {scale.numel()} elements"
            raise ValueError(
                f"8-bit moments need {name}: a uint8 tensor of {n_blocks} block scales (one per "
                f"{block} elements), got {got}"
            )


def _decode(code: torch.Tensor, scale: torch.Tensor, mantissa_bits: int, signed: bool) -> torch.Tensor:
    """fp32 moments from uint8 codes and their per-block scales (flat blocks of QUANT_BLOCK)."""
    n = code.numel()
    per_element = scale.flatten().to(torch.int64).repeat_interleave(_state_codes.QUANT_BLOCK)[:n]
    return _state_codes.decode_torch(code.flatten(), per_element, mantissa_bits, signed).view(code.shape)


def _encode(x, code, scale, rbits, mantissa_bits: int, signed: bool) -> None:
    """Write ``x``'s codes and block scales into ``code`` and ``scale`` (in place)."""
    scales = _state_codes.block_scales_torch(x)
    per_element = scales.repeat_interleave(_state_codes.QUANT_BLOCK)[: x.numel()]
    flat_bits = None if rbits is None else rbits.flatten()
    codes = _state_codes.encode_torch(x.flatten(), per_element, flat_bits, mantissa_bits, signed)
    code.copy_(codes.view(code.shape))
    scale.copy_(scales.to(torch.uint8).view(scale.shape))
