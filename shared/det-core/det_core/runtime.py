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

__all__ = ["as_index", "check_kernel_device", "interpreter_active", "launch"]


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


# ----------------------------------------------------------------------------- kernel launches
# Triton versions whose launch path ``launch`` replays directly (checked on an H200 with 3.6:
# bitwise-equal outputs, ~11 us instead of ~38 us of host time per launch). Elsewhere ``launch``
# is ``kernel[grid](...)`` itself.
_DIRECT_LAUNCH_TRITON = ("3.6.",)
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 4096
_direct_launch: bool | None = None


class _NoKey(Exception):
    pass


def _arg_key(value):
    # everything Triton specializes a kernel on is a function of this key: tensors by dtype and
    # 16-byte alignment, scalars by type and exact value, descriptors by all their fields
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if value is None or type(value) in (int, float, bool, str):
        return type(value), value
    if type(value).__name__ == "TensorDescriptor":
        base = value.base
        return (
            "desc", base.dtype, base.data_ptr() % 16 == 0, tuple(value.shape), tuple(value.strides),
            tuple(value.block_shape), getattr(value, "padding", None),
        )  # fmt: skip
    raise _NoKey


def _hook_set(hook) -> bool:
    # Triton 3.6 keeps launch hooks in a HookChain (never None): set when it holds a callable
    return hook is not None and bool(getattr(hook, "calls", True))


def _direct_launch_enabled() -> bool:
    global _direct_launch
    if _direct_launch is None:
        import triton

        _direct_launch = (
            not interpreter_active()
            and os.environ.get("DET_DIRECT_LAUNCH", "1") != "0"
            and triton.__version__.startswith(_DIRECT_LAUNCH_TRITON)
        )
    return _direct_launch


def launch(kernel, grid: tuple, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with less host time per launch on known Triton versions.

    Triton's ``JITFunction.run`` binds and specializes every argument on every launch (~38 us of
    host time per launch on the H200 machine with Triton 3.6; a training step launches ~700).
    Here the compiled kernel is looked up by a key holding every argument's specialization input
    exactly (tensor dtype and 16-byte alignment, scalar type and value, constexprs and launch
    options by name and value) and launched through its own ``run``, as ``JITFunction.run`` does.
    The first launch of each key, any argument of another kind, launch hooks, the interpreter,
    ``DET_DIRECT_LAUNCH=0`` and Triton versions other than those in ``_DIRECT_LAUNCH_TRITON`` take
    Triton's own path.

    Args:
        kernel: a ``triton.jit`` function.
        grid: launch grid, a tuple of 1 to 3 ints (programs per axis).
        *args: the kernel's leading arguments, positionally (tensors, scalars, tensor descriptors).
        **kwargs: the remaining arguments by name (constexprs) and launch options (``num_warps``,
            ``num_stages``, ...), as for ``kernel[grid]``.

    Returns:
        The compiled kernel (``triton.compiler.CompiledKernel``), as ``kernel[grid](...)`` does.

    Raises:
        Exception: whatever ``kernel[grid](...)`` raises for these arguments (compile errors,
            missing arguments); the first launch of every key goes through it.

    **Determinism:** the same compiled kernel with the same arguments as ``kernel[grid]``: the
    same bits (a GPU test compares both paths).
    """
    if not _direct_launch_enabled():
        return kernel[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    try:
        key = (kernel, device, len(grid), tuple(map(_arg_key, args)), tuple(kwargs.items()))
        entry = _LAUNCHES.get(key)
    except (_NoKey, TypeError):  # an argument of another kind, or an unhashable keyword value
        return kernel[grid](*args, **kwargs)
    from triton import knobs

    hooks = _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook)
    if entry is None or hooks:
        compiled = kernel[grid](*args, **kwargs)  # compiles or finds the kernel: Triton's path
        if entry is None and not hooks and hasattr(compiled, "run"):
            names = list(kernel.signature.parameters.values())[len(args) :]
            tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in names)
            if len(_LAUNCHES) >= _MAX_LAUNCHES:
                _LAUNCHES.clear()
            _LAUNCHES[key] = (compiled, tail)
        return compiled
    compiled, tail = entry
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    compiled.run(
        grid[0], grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *args, *tail,
    )  # fmt: skip
    return compiled
