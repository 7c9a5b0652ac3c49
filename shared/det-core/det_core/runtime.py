"""Where kernels run, and the checks every op makes before it launches them.

``interpreter_active()`` (from ``det_core.interpreter_mode``): kernels run on a CUDA GPU, or on
CPU through the Triton interpreter under ``TRITON_INTERPRET=1``; importing this module with the
interpreter active installs ``det_core.interpreter``, whose dot and transcendentals give the same
bits on every x86-64 host. The checks: the device (``check_kernel_device``), integer arguments
(``as_index``), functorch transforms (``check_no_functorch_autodiff``), first-order backward
(``check_first_order``) and plain eager execution (``plain_eager``); host-side ``cdiv`` /
``next_power_of_2``. The launch path (``launch``, ``BoundLaunch``, ``DescriptorTemplate``,
``PlanCache``) lives in ``det_core.launch``; those names still resolve here, to the same objects.
"""

from __future__ import annotations

import operator

import torch

from .interpreter_mode import check_triton_interprets, interpreter_active

# moved to det_core.launch; imported here so that every import path of before keeps working
from .launch import BoundLaunch, DescriptorTemplate, PlanCache, launch  # noqa: F401

__all__ = [
    "as_index",
    "cdiv",
    "check_first_order",
    "check_kernel_device",
    "check_no_functorch_autodiff",
    "interpreter_active",
    "next_power_of_2",
    "plain_eager",
]


_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
# Argument types that are never tensors: the exact-type test skips isinstance (a metaclass check,
# and plain_eager runs on every op call).
_SCALARS = frozenset((int, float, bool, str, type(None), tuple, torch.dtype, torch.device))
_is_compiling = torch.compiler.is_compiling
_dispatch_depth = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


_VMAP = torch._C._functorch.TransformType.Vmap
_forward_ad = torch.autograd.forward_ad


def check_no_functorch_autodiff(op: str, tensors: tuple = ()) -> None:
    """Raise ``RuntimeError`` under a ``torch.func`` transform other than vmap (grad, vjp, jvp,
    jacrev, jacfwd, hessian) at the innermost level, or when one of ``tensors`` is a forward-mode
    dual tensor (``torch.autograd.forward_ad``).

    Our ops have no forward-mode formula, and functorch's grad cannot run the autograd Function of
    an operator's ``Autograd`` kernel; without this check a ``jvp`` (or a dual tensor that does not
    require grad) would pass through the kernel below autograd and lose its tangent. ``vmap`` is
    fine (functorch loops over the batch).

    Args:
        op: the public name of the op, for the message.
        tensors: the op's tensor arguments, checked for tangents inside a ``dual_level``.

    Raises:
        RuntimeError: a functorch autodiff transform is active, or a dual tensor was passed; use
            ``torch.autograd`` instead.

    **Determinism:** a check only.
    """
    if _functorch_active():
        level = torch._C._functorch.peek_interpreter_stack()
        if level is not None and level.key() != _VMAP:
            raise RuntimeError(
                f"{op}: torch.func transforms other than vmap (grad, vjp, jvp, jacrev, jacfwd, hessian) are "
                "not supported by our ops; use torch.autograd (loss.backward() or torch.autograd.grad), and "
                "torch.func.vmap over it"
            )
    if _forward_ad._current_level >= 0:  # inside a dual_level (no cost outside one)
        for t in tensors:
            if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
                raise RuntimeError(
                    f"{op}: forward-mode AD (torch.autograd.forward_ad dual tensors) is not supported by our "
                    "ops; use reverse mode (loss.backward() or torch.autograd.grad)"
                )


def plain_eager(args: tuple) -> bool:
    """True in plain eager execution: not traced by Dynamo, no torch dispatch mode or functorch
    transform active (AOTAutograd, fake tensors, opcheck, vmap), every tensor in ``args`` (not
    nested) a plain Tensor or Parameter (no subclass, no functorch wrapper).

    An op may then call its implementation directly instead of through the dispatcher, whose
    Python-kernel round trip is host time on every call (measured in docs/det-attn.md). Raises
    nothing.

    **Determinism:** a check only: the op runs the same function on the same arguments either way,
    so the same launches and bits.
    """
    if _is_compiling() or _dispatch_depth() or _functorch_active():
        return False
    for a in args:
        kind = type(a)
        if kind in _PLAIN_TENSORS:
            if _functorch_wrapped(a):
                return False
        elif kind not in _SCALARS and isinstance(a, torch.Tensor):  # a subclass (DTensor, ...)
            return False
    return True


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints on the host (grids, block counts).

    ``triton.cdiv`` is a ``constexpr_function``: called from host code it unwraps its arguments
    and imports on every call, host time that a training step pays hundreds of times.
    """
    return (a + (b - 1)) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ``>= n`` for ``n >= 1`` (0 for ``n <= 0``), as ``triton.next_power_of_2``
    computes it, on the host (see ``cdiv``)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def check_first_order(op: str) -> None:
    """Raise ``RuntimeError`` when called from a backward that builds a graph of its own
    (``torch.autograd.grad(..., create_graph=True)`` or ``backward(create_graph=True)``).

    The kernels' backward passes are first-order: their gradients would carry no graph back to the
    inputs, so a loss built from them (a gradient penalty, a Hessian-vector product) would lose
    those terms without a word. Autograd runs a custom Function's backward in grad mode exactly
    when ``create_graph`` is set, which is what this checks.

    Args:
        op: the public name of the operation, for the message.

    Raises:
        RuntimeError: grad mode is on (a backward with ``create_graph=True``).

    **Determinism:** a check only: it reads grad mode and changes no value.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op}: a backward with create_graph=True (gradients of gradients: a gradient penalty, a "
            "Hessian-vector product) is not supported; its gradients are first-order only. Compute "
            "the second-order term with the plain torch op, or without create_graph."
        )


def check_kernel_device(*tensors: torch.Tensor, op: str = "kernel") -> torch.device:
    """Return the one device all ``tensors`` live on, or raise a clear error.

    Raises:
        ValueError: tensors are on different devices.
        RuntimeError: tensors are on CPU but the Triton interpreter is off (``TRITON_INTERPRET``
            unset, or set after triton was imported), or on a device that is neither CUDA nor CPU.
    """
    device = tensors[0].device if tensors else None
    for t in tensors:
        if t.device != device:
            device = None
            break
    if device is None:
        devices = {t.device for t in tensors}
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if device.type == "cuda":
        return device
    if device.type == "cpu":
        if not interpreter_active():
            raise RuntimeError(
                f"{op}: tensors are on CPU, where the Triton kernels run only through the interpreter. "
                "Move them to a CUDA device, or set TRITON_INTERPRET=1 before importing triton."
            )
        check_triton_interprets()  # set in the environment, but after triton was imported
        return device
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
            f"{op}: {name} must be an integer (int, numpy integer or 0-dim integer tensor), "
            f"got {kind} {value!r}{hint}"
        ) from None
