"""Where kernels run: on a CUDA GPU, or on CPU through the Triton interpreter.

The interpreter is chosen by ``TRITON_INTERPRET=1`` *before* Triton is imported (Triton reads it
when a kernel is decorated). Under the interpreter bf16 ``tl.dot`` is not supported
(triton-lang/triton#11584), so kernels upcast bf16 tiles to fp32 before a dot when
``interpreter_active()`` (exact: a bf16 product is exact in fp32).
"""

from __future__ import annotations

import operator
import os

import torch

__all__ = ["as_index", "check_kernel_device", "interpreter_active"]


def interpreter_active() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_kernel_device(*tensors: torch.Tensor, op: str = "kernel") -> torch.device:
    """Return the one device all ``tensors`` live on, or raise a clear error.

    Raises:
        ValueError: tensors are on different devices.
        RuntimeError: tensors are on CPU but the Triton interpreter is off, or on a device that is
            neither CUDA nor CPU.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            f"{op}: tensors are on CPU, where the Triton kernels run only through the interpreter. "
            "Move them to a CUDA device, or set TRITON_INTERPRET=1 before importing triton."
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{op}: device {device} is not supported (CUDA, or CPU with TRITON_INTERPRET=1)")
    return device


def as_index(value, name: str, op: str, hint: str = ""):
    """``value`` as an integer: any integral type (``operator.index``: int, numpy integers, 0-dim
    integer tensors), never a bool, a float or a string (no silent truncation).

    A plain ``int`` (and a ``torch.SymInt`` while torch.compile traces a value that changes from
    call to call, such as a per-step seed) is returned as it is, before any other test: dynamo
    cannot trace ``hasattr`` on a SymInt. ``hint`` (what to pass instead) ends the message.

    Raises:
        TypeError: a bool (Python, numpy or torch), a float, a string or another non-integral value.

    **Determinism:** a pure function of ``value`` (no device read, no global state).
    """
    if type(value) is int or isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{op}: {name} must be an integer, got the bool {value!r}{hint}")
    try:
        return operator.index(value)
    except TypeError:
        kind = type(value).__name__
        raise TypeError(
            f"{op}: {name} must be an integer (int or numpy integer), got {kind} {value!r}{hint}"
        ) from None
