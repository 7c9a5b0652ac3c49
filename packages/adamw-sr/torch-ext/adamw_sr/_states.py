"""The optimizer-state formats of ``AdamWSR`` (``state_dtype``): names, storage layout and checks.

| ``state_dtype`` (param group value) | ``exp_avg``, ``exp_avg_sq`` | extra state |
|---|---|---|
| ``torch.float32`` (``"float32"``, the default) | fp32, unrounded | |
| ``torch.bfloat16`` (``"bfloat16"``) | bf16, rounded per ``state_rounding`` | |
| ``"8bit"`` | uint8 codes (``_state_codes``) | ``exp_avg_scale``, ``exp_avg_sq_scale``: uint8 per block |

A param group stores the name as a string (``torch.distributed.checkpoint`` and
``torch.load(weights_only=True)`` take plain values); ``torch.float32`` and ``"float32"`` are the same.

The moments are always updated in fp32 (decoded first when stored in bf16 or 8 bits); the step uses
those fp32 values, and only the stored copies are rounded. See ``_state_codes`` for the 8-bit format
and docs/adamw-sr.md for bytes per parameter.
"""

from __future__ import annotations

import math

import torch
from det_core import runtime

from . import _kernel, _state_codes

FLOAT32, BFLOAT16, EIGHT_BIT = "float32", "bfloat16", "8bit"
# the supported values (as stored in a param group), in the order error messages list them
STATE_DTYPES = (FLOAT32, BFLOAT16, EIGHT_BIT)
STATE_ROUNDINGS = ("stochastic", "nearest")
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
SCALE_KEYS = ("exp_avg_scale", "exp_avg_sq_scale")
_MOMENT_DTYPES = {FLOAT32: torch.float32, BFLOAT16: torch.bfloat16, EIGHT_BIT: torch.uint8}
_FORMATS = {FLOAT32: _kernel.FORMAT_FP32, BFLOAT16: _kernel.FORMAT_BF16, EIGHT_BIT: _kernel.FORMAT_8BIT}
_ALIASES = {torch.float32: FLOAT32, torch.bfloat16: BFLOAT16}
_SUPPORTED_TEXT = (
    "torch.float32 (the default; or 'float32'), torch.bfloat16 (or 'bfloat16') or '8bit' "
    "(block-quantized, see docs/adamw-sr.md)"
)


def canonical_state_dtype(value, op: str):
    """``value`` as the name a param group stores: ``"float32"`` (for ``torch.float32`` too),
    ``"bfloat16"`` (for ``torch.bfloat16`` too) or ``"8bit"``.

    Raises:
        ValueError: anything else (another dtype, another spelling), naming the supported values.

    **Determinism:** a pure function of ``value``.
    """
    if isinstance(value, torch.dtype) and value in _ALIASES:
        return _ALIASES[value]
    if isinstance(value, str) and value in STATE_DTYPES:
        return value
    raise ValueError(f"{op}: state_dtype must be {_SUPPORTED_TEXT}; got {value!r}")


def check_state_rounding(value, op: str) -> str:
    """``value`` if it is ``"stochastic"`` or ``"nearest"``.

    Raises:
        ValueError: anything else.

    **Determinism:** a pure function of ``value``.
    """
    if isinstance(value, str) and value in STATE_ROUNDINGS:
        return value
    raise ValueError(
        f"{op}: state_rounding must be 'stochastic' (unbiased, the default) or 'nearest', got {value!r}"
    )


def check_combination(state_dtype, amsgrad: bool, op: str) -> None:
    """Raise ``ValueError`` for the combinations the step does not support (amsgrad with 8 bits).

    **Determinism:** a pure function of its arguments.
    """
    if amsgrad and state_dtype == EIGHT_BIT:
        raise ValueError(
            f"{op}: amsgrad is not supported with state_dtype='8bit' (its running maximum would need "
            "its own quantized state); use state_dtype=torch.bfloat16 or torch.float32 with amsgrad=True"
        )


def state_format(state_dtype) -> int:
    """The kernels' number of a canonical ``state_dtype`` (``_kernel.FORMAT_*``). **Determinism:** a table."""
    return _FORMATS[state_dtype]


def format_of_moments(dtype: torch.dtype) -> int:
    """The kernels' number of the format whose moments have ``dtype`` (fp32, bf16 or uint8).
    **Determinism:** a table."""
    return {torch.float32: _kernel.FORMAT_FP32, torch.bfloat16: _kernel.FORMAT_BF16}.get(
        dtype, _kernel.FORMAT_8BIT
    )


def moment_dtype(state_dtype) -> torch.dtype:
    """The storage dtype of ``exp_avg`` / ``exp_avg_sq`` under a canonical ``state_dtype``.
    **Determinism:** a table."""
    return _MOMENT_DTYPES[state_dtype]


def base_index_alignment(state_dtype) -> int:
    """The alignment of a param's default global start index: a block (32) for 8 bits, else 8.
    **Determinism:** a table (``optimizer.default_base_indices`` uses it)."""
    return _state_codes.QUANT_BLOCK if state_dtype == EIGHT_BIT else 8


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of an 8-bit param's block scales: its blocks of 32 flat elements, laid out so that a
    sharding of the param along a dimension shards the scales along the same dimension.

    ``(*shape[:-1], shape[-1] // 32)`` when the last dimension is a multiple of 32 (a block never
    crosses a row), else ``(ceil(numel / 32),)``.

    **Determinism:** a pure function of the (global) shape: every rank derives the same.
    """
    block = _state_codes.QUANT_BLOCK
    if len(shape) >= 2 and shape[-1] % block == 0:
        return (*shape[:-1], shape[-1] // block)
    return (runtime.cdiv(math.prod(shape), block),)


def new_state(p: torch.Tensor, state_dtype, *, dtensor: bool) -> dict:
    """Zero moments (and 8-bit block scales) for param ``p``; ``dtensor``: ``p`` is a DTensor.

    A DTensor param gets DTensor states with its mesh and placements; its scales are sharded like
    it (``scale_shape``; the optimizer has checked that the shards of both agree).

    **Determinism:** zeros (code 0 and scale 0 decode to 0): no randomness.
    """
    state = {key: zero_moment(p, state_dtype) for key in MOMENT_KEYS}
    if state_dtype == EIGHT_BIT:
        shape = scale_shape(tuple(p.shape))
        for key in SCALE_KEYS:
            if dtensor:
                from torch.distributed.tensor import zeros as dtensor_zeros

                state[key] = dtensor_zeros(
                    shape, dtype=torch.uint8, device_mesh=p.device_mesh, placements=p.placements
                )
            else:
                state[key] = torch.zeros(shape, dtype=torch.uint8, device=p.device)
    return state


def zero_moment(p: torch.Tensor, state_dtype) -> torch.Tensor:
    """A zero moment of ``p``'s shape (and placement) in the format's storage dtype (0 codes decode to 0).
    **Determinism:** zeros."""
    return torch.zeros_like(p, dtype=moment_dtype(state_dtype), memory_format=torch.preserve_format)


def check_state(p: torch.Tensor, state: dict, state_dtype, amsgrad: bool) -> None:
    """A loaded or existing state must hold the format's tensors at the param's shape and a step.

    Raises:
        RuntimeError: a missing key, or a tensor of another dtype or shape.

    **Determinism:** reads dtypes and shapes only.
    """
    if not isinstance(state.get("step"), torch.Tensor):
        raise RuntimeError(f"AdamWSR: state of a param of shape {tuple(p.shape)} lacks a 'step' tensor")
    dtype = moment_dtype(state_dtype)
    expected = {key: (dtype, tuple(p.shape)) for key in MOMENT_KEYS}
    if amsgrad:
        expected["max_exp_avg_sq"] = (dtype, tuple(p.shape))
    if state_dtype == EIGHT_BIT:
        expected.update({key: (torch.uint8, scale_shape(tuple(p.shape))) for key in SCALE_KEYS})
    for key, (want_dtype, want_shape) in expected.items():
        value = state.get(key)
        if value is None:
            if key == "max_exp_avg_sq":
                continue  # amsgrad switched on later: created at zero, as torch does
            raise RuntimeError(
                f"AdamWSR: state of a param of shape {tuple(p.shape)} lacks '{key}' "
                f"(state_dtype={state_dtype!r})"
            )
        if value.dtype != want_dtype:
            raise RuntimeError(
                f"AdamWSR: state '{key}' must be {want_dtype} of shape {want_shape} for "
                f"state_dtype={state_dtype!r}, got {value.dtype} {tuple(value.shape)}: a group's "
                "state_dtype was changed after its states were made, or a state tensor was replaced; "
                "moments are not converted between formats: set state_dtype before the first step "
                "(or start a new optimizer for this group)"
            )
        if tuple(value.shape) != want_shape:
            raise RuntimeError(
                f"AdamWSR: state '{key}' must have shape {want_shape} for a param of shape "
                f"{tuple(p.shape)}, got {tuple(value.shape)}: the param's shape changed after its "
                "states were made (p.data replaced, e.g. a resized embedding), the state was loaded "
                "from a checkpoint of other parameter shapes, or a state tensor was replaced; the "
                "moments cannot be carried over: drop this param's state (del opt.state[p]) to start "
                "it afresh, or load a checkpoint of this model"
            )


def check_8bit_segments(segments, shape: tuple[int, ...], op: str) -> None:
    """Every run of a param's local elements must start on a block in the global and the local index.

    ``segments``: ``(local_start, length, global_start)`` rows (``optimizer.local_segments``). A
    block of 32 global indices shares one scale, computed from all its elements in one program, so
    a block split between two shards (or two params) cannot be computed by either: such a split is
    refused rather than computed differently from the unsharded run.

    Raises:
        ValueError: a run starting off the block grid, naming the block size.

    **Determinism:** a pure function of the runs: every rank checking the same runs decides the same.
    """
    block = _state_codes.QUANT_BLOCK
    for local_start, length, global_start in segments:
        if global_start % block or local_start % block:
            raise ValueError(
                f"{op}: state_dtype='8bit' quantizes blocks of {block} consecutive global indices, so every "
                f"parameter, and every shard of one, must start on a block: a param of shape {shape} has "
                f"{length} local elements starting at local element {local_start}, global index "
                f"{global_start} (not multiples of {block}). Shard so that each shard starts on a "
                f"multiple of {block} elements (FSDP2: dim-0 shards of a 2-D param whose last dimension is "
                f"a multiple of {block}), give base_index values that are multiples of {block}, or put this "
                "parameter in a param group with state_dtype=torch.bfloat16"
            )
