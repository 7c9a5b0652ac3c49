"""RMSNorm's argument checks (``rms_norm``'s, ``RMSNorm``'s at construction; ``positive_shape`` also
``LayerNorm``'s): what each argument must be, and the message that says what to do. They read
dtypes, shapes, devices and Python values only, and change nothing."""

from __future__ import annotations

import math
import numbers

import torch
from det_core.runtime import check_kernel_device

from ._rms_norm_kernels import MAX_D

__all__ = ["positive_shape"]


def _check_eps(eps, op: str) -> float | None:
    """``eps`` as a float, finite and ``>= 0`` (or None): a negative eps can make
    ``mean(x**2) + eps`` negative (NaN rows), a NaN or infinite one makes every row NaN or zero."""
    if eps is None:
        return None
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number or None, got {type(eps).__name__} {eps!r}")
    value = float(eps)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(
            f"{op}: eps must be a finite number >= 0, got {eps!r}; pass e.g. 1e-6, or None for "
            "torch.finfo(x.dtype).eps"
        )
    return value


def _check_offset(offset, weight, op: str) -> float:
    """``offset`` as a finite float (it is a compile-time constant of the kernels), 0.0 without weight."""
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"{op}: offset must be a real number, got {type(offset).__name__}")
    value = float(offset)
    if not value - value == 0.0:  # inf and nan; unlike math.isfinite, Dynamo traces it (dynamic=True)
        raise ValueError(f"{op}: offset must be finite, got {offset!r}")
    if value != 0.0 and weight is None:
        raise ValueError(f"{op}: offset={value} scales a weight, but there is none (pass a weight)")
    return value + 0.0  # -0.0 -> 0.0: one kernel for both


def _check(x: torch.Tensor, weight: torch.Tensor | None, d: int) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"rms_norm: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"rms_norm: x dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    if weight is not None:
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"rms_norm: weight dtype {weight.dtype} is not supported")
        if weight.numel() != d:
            raise ValueError(f"rms_norm: weight has {weight.numel()} elements but the normalized size is {d}")
        check_kernel_device(x, weight, op="rms_norm")
    else:
        check_kernel_device(x, op="rms_norm")
    if d > MAX_D:
        raise ValueError(f"rms_norm: normalized size {d} exceeds {MAX_D} (one row per program)")


def _check_args(x, weight, eps, normalized_shape, offset, rows_per_token=1) -> tuple[int, float, float]:
    """``rms_norm``'s argument checks; returns ``(d, eps, offset)`` as the op takes them."""
    for name, t in (("x", x), ("weight", weight)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"rms_norm: {name} must be a torch.Tensor, got {type(t).__name__}; "
                "convert it with torch.as_tensor(...)"
            )
    if x.dim() == 0:  # torch refuses it too: no dim to normalize over
        raise ValueError(
            "rms_norm: x is 0-dimensional; it needs at least one dim to normalize over (as "
            "torch.nn.functional.rms_norm): give it one, e.g. x.reshape(1)"
        )
    from_weight = normalized_shape is None and weight is not None
    if normalized_shape is None:
        normalized_shape = tuple(weight.shape) if weight is not None else tuple(x.shape[-1:])
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        normalized_shape = (int(normalized_shape),)
    elif not (
        isinstance(normalized_shape, (tuple, list, torch.Size))
        and all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in normalized_shape)
    ):
        raise TypeError(
            f"rms_norm: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        )
    normalized_shape = tuple(int(s) for s in normalized_shape)
    if not normalized_shape:
        what = "weight is 0-dimensional" if from_weight else "normalized_shape is ()"
        raise ValueError(
            f"rms_norm: {what}: the normalized dims must be at least one (torch: 'Expected normalized_shape "
            "to be at least 1-dimensional'); normalize over the last dim, e.g. normalized_shape=x.shape[-1:]"
        )
    trailing = tuple(x.shape[max(x.dim() - len(normalized_shape), 0) :])
    if x.dim() < len(normalized_shape) or trailing != normalized_shape:
        if from_weight:  # the normalized shape was taken from the weight: name the weight
            raise ValueError(
                f"rms_norm: weight of shape {normalized_shape} does not match x's trailing dims {trailing} "
                f"(x has shape {tuple(x.shape)}); the weight must have the shape of the normalized dims"
            )
        raise ValueError(f"rms_norm: x of shape {tuple(x.shape)} does not end with {normalized_shape}")
    d = 1
    for s in normalized_shape:
        d *= s
    if d == 0:
        raise ValueError(
            f"rms_norm: normalized size must be >= 1, got normalized_shape {normalized_shape} "
            f"(x of shape {tuple(x.shape)}): an empty row has no mean square; normalize non-empty dims"
        )
    _check(x, weight, d)
    eps = _check_eps(eps, "rms_norm")
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if weight is not None and not weight.is_contiguous():
        raise ValueError("rms_norm: weight must be contiguous (it is read as a flat vector of D elements)")
    offset = _check_offset(offset, weight, "rms_norm")
    _check_rows_per_token(rows_per_token, x.numel() // d, x.shape)
    return d, float(eps), offset


def positive_shape(normalized_shape, op: str) -> tuple[int, ...]:
    """``normalized_shape`` (an int or a sequence of ints) as a tuple of one or more dims >= 1."""
    shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else normalized_shape
    if not isinstance(shape, (tuple, list, torch.Size)) or any(
        isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in shape
    ):
        raise TypeError(
            f"{op}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        )
    shape = tuple(int(s) for s in shape)
    if not shape or min(shape) < 1:
        raise ValueError(
            f"{op}: normalized_shape {shape} must have at least one dim, each >= 1 (an empty row has no "
            "mean square): pass the sizes of the trailing dims to normalize, e.g. hidden_size"
        )
    return shape


def _check_rows_per_token(group, rows: int, shape) -> None:
    """``rows_per_token`` a positive int dividing the ``rows`` of ``x`` (of ``shape``)."""
    if isinstance(group, bool) or not isinstance(group, numbers.Integral):
        raise TypeError(f"rms_norm: rows_per_token must be an int, got {type(group).__name__} {group!r}")
    if group < 1 or rows % group:
        raise ValueError(
            f"rms_norm: rows_per_token={group} must be a positive int dividing the rows of x ({rows} rows "
            f"of x's shape {tuple(shape)}): a per-head norm over (B, T, H, D) has H rows per token"
        )
