"""Argument checks shared by ``AdamWSR`` and ``adamw_sr_step``: the supported dtypes, the
hyperparameter ranges, AMP's device scalars, a param group's device flags, repeated params, and
the per-parameter and per-gradient checks.

Every check raises before anything is written, with a message that says what was wrong and what
to do; none changes a value.
"""

from __future__ import annotations

import numbers

import torch
from det_core import runtime

from .indices import PLAIN_TENSOR_TYPES, local_tensor

__all__ = [
    "SUPPORTED_GRAD_DTYPES",
    "SUPPORTED_PARAM_DTYPES",
    "amp_scalar",
    "check_grad",
    "check_device_flags",
    "check_base_index",
    "check_flags",
    "check_grads",
    "check_hyperparameters",
    "first_repeat",
    "param_problem",
]

SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_GRAD_DTYPES = (torch.float32, torch.bfloat16)


def check_hyperparameters(lr, betas, eps, weight_decay, op: str) -> None:
    """``torch.optim.AdamW``'s ranges: ``lr >= 0``, ``0 <= beta < 1``, ``eps >= 0``,
    ``weight_decay >= 0`` (NaN fails every one). Each may be a real number or, as in torch, a
    1-element tensor, whose value is checked only where reading it needs no device sync (a CPU
    tensor, outside torch.compile). ``op`` names the caller in the messages.

    Raises:
        ValueError: a value out of range, ``betas`` not a pair, a tensor of other than 1 element.
        TypeError: a value that is neither a real number (bools excluded) nor a tensor.

    **Determinism:** a check only; no value changes.
    """
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"{op}: betas must be a pair (beta1, beta2), got {betas!r}")
    checks = (
        ("lr", lr, lambda x: 0.0 <= x, "Invalid learning rate: {}; it must be >= 0"),
        ("betas[0]", betas[0], lambda x: 0.0 <= x < 1.0, "Invalid betas {}: each must be in [0, 1)"),
        ("betas[1]", betas[1], lambda x: 0.0 <= x < 1.0, "Invalid betas {}: each must be in [0, 1)"),
        ("eps", eps, lambda x: 0.0 <= x, "Invalid epsilon value: {}; it must be >= 0"),
        ("weight_decay", weight_decay, lambda x: 0.0 <= x, "Invalid weight_decay value: {}; it must be >= 0"),
    )
    for name, value, ok, message in checks:
        shown = tuple(betas) if name.startswith("betas") else value
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"{op}: {name} as a tensor must have 1 element, got shape {tuple(value.shape)}"
                )
            if value.device.type == "cpu" and not torch.compiler.is_compiling() and not ok(float(value)):
                raise ValueError(f"{op}: " + message.format(shown))
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__} {value!r}")
        if not ok(value):
            raise ValueError(f"{op}: " + message.format(shown))


def amp_scalar(value, name: str, device: torch.device, op: str) -> torch.Tensor | None:
    """``grad_scale`` / ``found_inf`` (``torch.amp.GradScaler``'s 1-element fp32 tensors) on ``device``.

    Returns ``None`` for ``None``, else the tensor itself or its copy on ``device`` (non-blocking).

    Raises:
        TypeError: not a tensor, or not float32. ValueError: not exactly 1 element.

    **Determinism:** the value unchanged (a copy at most): what ``GradScaler`` set.
    """
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(
            f"{op}: {name} must be a float32 tensor (as torch.amp.GradScaler sets it), got {kind}"
        )
    if value.numel() != 1:
        raise ValueError(f"{op}: {name} must have 1 element, got shape {tuple(value.shape)}")
    return value if value.device == device else value.to(device, non_blocking=True)


def check_device_flags(group: dict) -> None:
    """The device flags of a param group against its params' device, as torch checks them:
    ``fused=True`` needs a device the fused step runs on (CUDA, or CPU with the Triton
    interpreter), and ``capturable=True`` (step counts on the device, for CUDA-graph capture) needs
    CUDA params.

    Raises:
        RuntimeError: ``fused=True`` where the fused step cannot run.
        ValueError: ``capturable=True`` with non-CUDA params.
    """
    if not group["params"]:
        return
    device = local_tensor(group["params"][0]).device
    if group.get("fused"):
        runtime.check_kernel_device(*(local_tensor(p) for p in group["params"]), op="AdamWSR(fused=True)")
    if group.get("capturable") and device.type != "cuda":
        raise ValueError(
            f"AdamWSR: capturable=True keeps the step counts on the device for CUDA-graph capture, "
            f"which needs CUDA params; these are on {device.type} (torch.optim.AdamW refuses "
            "capturable=True there too): pass capturable=False"
        )


def first_repeat(keys) -> tuple[int, int] | None:
    """The positions ``(i, j)``, ``i < j``, of the first key that ``keys`` (hashables, in order)
    gives twice, or None: a param listed twice (by identity, or by address for
    ``adamw_sr_step``) would be updated twice in one fused step."""
    first_at: dict = {}
    for j, key in enumerate(keys):
        i = first_at.setdefault(key, j)
        if i != j:
            return i, j
    return None


def param_problem(p: torch.Tensor) -> str | None:
    if p.is_complex():
        return f"complex params (dtype {p.dtype}) are not supported; view them as real (torch.view_as_real)"
    if p.dtype == torch.float16:
        return (
            "float16 params are not supported (dtype float16): train in bfloat16 (stochastic rounding) "
            "or float32"
        )
    if p.dtype not in SUPPORTED_PARAM_DTYPES:
        return f"params must be float32 or bfloat16, got dtype {p.dtype}"
    if not local_tensor(p).is_contiguous():
        return (
            f"param of shape {tuple(p.shape)} is not contiguous: make it contiguous before building "
            "the optimizer"
        )
    return None


def check_grads(ps: list[torch.Tensor]) -> None:
    """``check_grad`` for each param, with a fast test for the common plain-tensor case."""
    strided, dtypes, param_dtypes = torch.strided, SUPPORTED_GRAD_DTYPES, SUPPORTED_PARAM_DTYPES
    for p in ps:
        g = p.grad
        if (
            type(g) not in PLAIN_TENSOR_TYPES
            or type(p) not in PLAIN_TENSOR_TYPES
            or p.dtype not in param_dtypes
            or not p.is_contiguous()
            or g.layout != strided
            or g.dtype not in dtypes
            or g.shape != p.shape
            or g.device != p.device
            or not g.is_contiguous()
        ):
            check_grad(p)  # the full check, with its precise error


def check_grad(p: torch.Tensor) -> None:
    # the param itself again: ``p.data`` may have been replaced since the optimizer was built
    problem = param_problem(p)
    if problem:
        raise (TypeError if "dtype" in problem else ValueError)(f"AdamWSR: {problem}")
    g = p.grad
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError("AdamWSR does not support sparse gradients; use torch.optim.SparseAdam")
    if g.dtype not in SUPPORTED_GRAD_DTYPES:
        raise TypeError(f"AdamWSR: gradients must be float32 or bfloat16, got {g.dtype}")
    if g.shape != p.shape:
        raise ValueError(f"AdamWSR: gradient shape {tuple(g.shape)} != param shape {tuple(p.shape)}")
    lg, lp = local_tensor(g), local_tensor(p)
    if lg.device != lp.device:
        raise ValueError(f"AdamWSR: gradient on {lg.device}, param on {lp.device}")
    if lg.shape != lp.shape or not lg.is_contiguous():
        raise ValueError(
            f"AdamWSR: gradient of a param of shape {tuple(p.shape)} is not a contiguous tensor of the "
            "param's local shape; make it contiguous (e.g. in a post-accumulate-grad hook)"
        )


MAX_GLOBAL_INDEX = 2**63  # an element's global index is below this (det-core's Philox counter)


def check_base_index(base, params: list, op: str) -> list | None:
    """A param group's ``base_index`` as a list of one int (or None) per param, or None.

    ``base``: None, one integer (a group of one param), or a list / tuple of integers (int or numpy
    integers, not bools) or None, one per param of ``params``; each ``b`` must give the param a range
    of global indices ``[b, b + numel)`` inside ``[0, 2**63)``.

    Raises:
        TypeError: ``base`` or an entry is not an integer (a float, a bool, a string).
        ValueError: not one entry per param, a negative entry, or a range past ``2**63``.

    **Determinism:** a check and a conversion to int; no value changes.
    """
    if base is None:
        return None
    given = base
    if isinstance(base, numbers.Integral) and not isinstance(base, bool):
        base = [base]
    if not isinstance(base, (list, tuple)):
        raise TypeError(
            f"{op}: base_index must be None, an int (a group of one param) or a list of one int (or None) "
            f"per param, got {type(given).__name__} {given!r}"
        )
    bad = [b for b in base if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Integral))]
    if bad:
        raise TypeError(f"{op}: base_index entries must be ints (or None), got {bad[0]!r} in {given!r}")
    if len(base) != len(params):
        raise ValueError(
            f"{op}: base_index must list one non-negative int (or None) per param, "
            f"got {given!r} for {len(params)} params"
        )
    out = [None if b is None else int(b) for b in base]
    for b, p in zip(out, params, strict=True):
        if b is not None and not 0 <= b <= MAX_GLOBAL_INDEX - p.numel():
            raise ValueError(
                f"{op}: base_index {b} gives a param of {p.numel()} elements the global indices "
                f"[{b}, {b + p.numel()}); they must lie in [0, 2**63)"
            )
    return out


def check_flags(group: dict, op: str) -> None:
    """A param group's ``amsgrad`` and ``maximize`` must be bools (a string such as ``"no"`` is
    truthy: it would switch the option on).

    Raises:
        TypeError: either is not a bool.

    **Determinism:** a check only.
    """
    for name in ("amsgrad", "maximize"):
        if not isinstance(group.get(name, False), bool):
            raise TypeError(f"{op}: {name} must be True or False, got {group[name]!r}")
