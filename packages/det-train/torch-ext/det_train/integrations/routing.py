"""``deterministic_mode()``: route aten's matmul family through det_train's kernels.

Inside the context, torch.library kernels registered for the ``CUDA`` dispatch key (and ``CPU``
when the Triton interpreter is active) replace ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``,
``mv``, ``addmv`` and ``dot`` (so ``torch.matmul`` / ``@``, which decompose into them, follow),
kernels that raise replace their ``out=`` overloads and ``addbmm``, and a kernel
at the ``AutogradCUDA`` (/ ``AutogradCPU``) key replaces ``aten::linear`` with ``det_train.linear``
(so ``nn.Linear`` / ``F.linear`` get the canonical-order weight gradient and the accumulator). On
exit the registrations are destroyed and torch's own kernels are back.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator

import torch
from det_core import runtime

from ..ops.linear import linear
from ..ops.matmul import check_operands, forward_matmul, launch_matmul

__all__ = ["deterministic_mode", "routed_ops"]

_state = {"depth": 0, "library": None}


def _acc32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The unrounded fp32 accumulator of ``a @ b`` (2-D or 3-D), for the scaled variants."""
    check_operands(a, b, "deterministic_mode")
    shape = (*a.shape[:-1], b.shape[-1]) if a.dim() >= b.dim() else (b.shape[0], a.shape[0], b.shape[-1])
    out = torch.empty(shape, dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    if a.shape[-1] == 0:
        return out.zero_()
    return launch_matmul(a, b, out)


def _scaled(inp: torch.Tensor, acc: torch.Tensor, beta, alpha, dtype: torch.dtype) -> torch.Tensor:
    # elementwise on the fp32 accumulator, rounded once: stays row invariant
    out = acc if alpha == 1 else acc * alpha
    if beta != 0:
        out = out + (inp.float() if beta == 1 else beta * inp.float())
    return out.to(dtype)


def _mm(a, b):
    return forward_matmul(a, b)


def _addmm(inp, mat1, mat2, *, beta=1, alpha=1):
    if (
        beta == 1
        and alpha == 1
        and inp.dim() == 1
        and inp.dtype == mat1.dtype
        and inp.shape[0] == mat2.shape[1]
    ):
        check_operands(mat1, mat2, "deterministic_mode: addmm")
        out = torch.empty((mat1.shape[0], mat2.shape[1]), dtype=mat1.dtype, device=mat1.device)
        if out.numel() == 0 or mat1.shape[1] == 0:
            return out.copy_(inp.expand_as(out))
        return launch_matmul(mat1, mat2, out, bias=inp)  # same bits as det_train.linear's forward
    return _scaled(inp, _acc32(mat1, mat2), beta, alpha, mat1.dtype)


def _bmm(a, b):
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"bmm: expected 3-D tensors, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"bmm: batch sizes differ: {a.shape[0]} and {b.shape[0]}")
    return forward_matmul(a, b)


def _baddbmm(inp, batch1, batch2, *, beta=1, alpha=1):
    return _scaled(inp, _acc32(batch1, batch2), beta, alpha, batch1.dtype)


def _mv(mat, vec):
    return forward_matmul(mat, vec.unsqueeze(1)).squeeze(1)


def _addmv(inp, mat, vec, *, beta=1, alpha=1):
    if mat.dim() != 2 or vec.dim() != 1:
        raise ValueError(
            f"addmv: expected a 2-D matrix and a 1-D vector, got {tuple(mat.shape)} and {tuple(vec.shape)}"
        )
    return _scaled(inp, _acc32(mat, vec.unsqueeze(1)).squeeze(1), beta, alpha, mat.dtype)


def _refused(name: str, instead: str):
    """A kernel for an op the mode does not route: it raises rather than run torch's own kernel
    (batch-variant) silently inside the context."""

    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"deterministic_mode: aten::{name} is not routed to det_train's kernels, and torch's own "
            f"kernel is not batch invariant: {instead}, or run it outside the context"
        )

    return refuse


def _dot(a, b):
    if a.dim() != 1 or b.dim() != 1:
        raise ValueError(f"dot: expected 1-D tensors, got {tuple(a.shape)} and {tuple(b.shape)}")
    return forward_matmul(a.unsqueeze(0), b.unsqueeze(1)).reshape(())


def _linear(x, weight, bias=None):
    return linear(x, weight, bias)


# op name -> (kernel, dispatch key family: "backend" = CUDA/CPU, "autograd" = AutogradCUDA/AutogradCPU)
_ROUTES = {
    "mm": (_mm, "backend"),
    "addmm": (_addmm, "backend"),
    "bmm": (_bmm, "backend"),
    "baddbmm": (_baddbmm, "backend"),
    "mv": (_mv, "backend"),
    "addmv": (_addmv, "backend"),
    "dot": (_dot, "backend"),
    "linear": (_linear, "autograd"),
}
_OUT = "call it without out= (the result is a new tensor; copy it where it should go)"
# ops the mode refuses inside the context (never a silent fallback): the out= overloads of the
# routed ops (a separate aten kernel each) and addbmm (a sum over the batch in torch's order)
_REFUSED = {
    **{f"{name}.out": _OUT for name in ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot")},
    "addbmm": "sum torch.bmm's result over the batch in the order you need (bmm is routed)",
    "addbmm.out": "sum torch.bmm's result over the batch in the order you need (bmm is routed)",
}


def routed_ops() -> list[str]:
    """Names of the aten ops ``deterministic_mode`` replaces."""
    return sorted(_ROUTES)


def _register() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    kwargs = {"allow_override": True} if "allow_override" in inspect.signature(lib.impl).parameters else {}
    devices = ["CUDA"] + (["CPU"] if runtime.interpreter_active() else [])
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended here
        warnings.simplefilter("ignore", UserWarning)
        for name, (fn, family) in _ROUTES.items():
            for dev in devices:
                key = dev if family == "backend" else f"Autograd{dev}"
                lib.impl(name, fn, key, **kwargs)
        for name, instead in _REFUSED.items():
            for dev in devices:
                lib.impl(name, _refused(name, instead), dev, **kwargs)
    return lib


@contextlib.contextmanager
def deterministic_mode() -> Iterator[None]:
    """Route aten mm / addmm / bmm / baddbmm / mv / addmv / dot and linear through det_train's kernels.

    Usage::

        with det_train.deterministic_mode():
            loss = model(batch)          # every nn.Linear, x @ w, torch.bmm ... is batch invariant
            loss.backward()              # nn.Linear weights: canonical-order dW (accumulator-aware)

    Covers CUDA tensors, and CPU tensors when the Triton interpreter is active (CPU tensors
    otherwise keep torch's kernels). Re-entrant: nested contexts share one registration.

    Raises (inside the context, from the routed op): TypeError for dtypes other than bfloat16,
    float16 and float32 (e.g. float64 or integer matmuls), ValueError for bad shapes, RuntimeError
    for the ``out=`` overloads of the routed ops and ``addbmm`` — never a silent fallback to the
    non-deterministic kernel. (``a @ b`` shows a TypeError as Python's "unsupported operand type(s)
    for @": ``Tensor.__matmul__`` turns it into NotImplemented; ``torch.matmul(a, b)`` keeps the
    message.)

    **Determinism:** inside the context the routed ops have det_train's guarantees (run to run,
    row invariant; ``aten::linear`` also canonical-order dW / db). ``addmm`` with a 1-D bias gives
    the same bits as ``det_train.linear``; other ``beta`` / ``alpha`` (and ``addmv``'s) are
    applied to the fp32 accumulator elementwise, rounded once. Not covered: ops outside the list
    (e.g. ``_scaled_mm``, ``einsum`` paths that do not reach mm/bmm, attention kernels) and
    torch.compile'd graphs (compiled code calls its own kernels). The
    gradients of ``mm`` / ``bmm`` outside ``linear`` come from autograd's formulas (routed mm:
    batch invariant, but summed over all rows in one fold rather than the canonical leaf tree).

    Method: torch.library kernel overrides (``torch.library.Library("aten", "IMPL")``), destroyed
    on exit so torch's registrations return.
    """
    if _state["depth"] == 0:
        _state["library"] = _register()
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            lib, _state["library"] = _state["library"], None
            lib._destroy()
