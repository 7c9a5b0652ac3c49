"""``AdamWSR``: a drop-in ``torch.optim.AdamW`` whose whole step is one fused Triton kernel per
(param dtype, grad dtype) group, with stochastic rounding of bf16 weights keyed by global element index.

Reading order: the global element index (plain tensors and DTensor shards), the functional step
``adamw_sr_step`` (a ``torch.library`` custom op, opaque to ``torch.compile``), the optimizer class.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch
from det_core import rng, runtime
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import kernel

__all__ = ["AdamWSR", "adamw_sr_step", "default_base_indices", "local_segments"]

_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_SUPPORTED_GRAD_DTYPES = (torch.float32, torch.bfloat16)
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# Steps travel as fp32 (torch's layout of ``state["step"]``), exact for integers up to 2**24; the
# next increment (2**24 + 1) rounds back to 2**24, so a step count at or past it would repeat its
# stochastic-rounding bits. The kernel's own counters (Philox word, 32-bit exponent) hold 2**32.
MAX_STEP = 2**24 - 1
# Default base indices start every parameter on a multiple of 8: its windows are then 4-aligned in the
# global index (one Philox call per 4 elements) and 8-aligned in memory (vectorized loads) at once.
BASE_INDEX_ALIGNMENT = 8


def default_base_indices(numels) -> list[int]:
    """The default global index of each parameter's first element: the running element offset over
    the parameters in order, each rounded up to a multiple of ``BASE_INDEX_ALIGNMENT`` (8).

    Args:
        numels: iterable of element counts (global counts for DTensors). Returns: list of ints.

    **Determinism:** a pure function of the counts and their order: a sharded run, which sees the
    global counts, assigns the same indices as the unsharded one.
    """
    out, offset = [], 0
    for n in numels:
        out.append(offset)
        offset = runtime.cdiv(offset + int(n), BASE_INDEX_ALIGNMENT) * BASE_INDEX_ALIGNMENT
    return out


def _check_hyperparameters(lr, betas, eps, weight_decay, op: str) -> None:
    """``torch.optim.AdamW``'s ranges: ``lr >= 0``, ``0 <= beta < 1``, ``eps >= 0``,
    ``weight_decay >= 0`` (NaN fails every one). Each may be a real number or, as in torch, a
    1-element tensor, whose value is checked only where reading it needs no device sync (a CPU
    tensor, outside torch.compile)."""
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


# --------------------------------------------------------------------------- global element index


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _is_dtensor(t: torch.Tensor) -> bool:
    kind = type(t)
    return kind not in _PLAIN_TENSOR_TYPES and kind.__name__ == "DTensor" and hasattr(t, "_local_tensor")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t if type(t) in _PLAIN_TENSOR_TYPES else (t._local_tensor if _is_dtensor(t) else t)


def local_segments(param: torch.Tensor, base_index: int) -> list[tuple[int, int, int]]:
    """The runs of ``param``'s local elements that are consecutive in the global element index.

    Args:
        param: a plain tensor, or a DTensor (e.g. an FSDP2 parameter) whose local shard is a
            box of the global tensor: placements ``Replicate``, ``Shard(d)`` (even, uneven or empty
            shards), on a mesh of any dimension.
        base_index: global index of the unsharded parameter's first element.

    Returns:
        ``[(local_start, length, global_start), ...]`` in local element order. One run for a plain
        tensor or a ``Shard(0)`` shard, one per leading-index row for ``Shard(d)``, ``d > 0``;
        empty for an empty shard.

    Raises:
        ValueError: the placement is not a box (e.g. ``_StridedShard``, ``Partial``).

    **Determinism:** a pure function of the global shape, the placements and the rank's mesh
    coordinate, so every rank maps its elements to the indices they have in the unsharded run.
    """
    if not _is_dtensor(param):
        return [(0, param.numel(), base_index)] if param.numel() else []
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"adamw_sr: DTensor placement {placement} is not supported; the global element index "
                "is derived for Replicate and Shard(d) placements only. Pass an explicit base_index "
                "per local tensor instead (param group key 'base_index')."
            )
    global_shape = tuple(param.shape)
    local_shape, offset = compute_local_shape_and_global_offset(
        global_shape, param.device_mesh, param.placements
    )
    if math.prod(local_shape) == 0:
        return []
    ndim = len(global_shape)
    differing = [d for d in range(ndim) if local_shape[d] != global_shape[d]]
    if not differing:
        return [(0, math.prod(local_shape), base_index)]
    j = differing[-1]
    inner = math.prod(local_shape[j:])  # contiguous run: dims j.. are whole beyond j
    global_strides = [math.prod(global_shape[d + 1 :]) for d in range(ndim)]
    segments = []
    outer_shape = local_shape[:j]
    for n in range(math.prod(outer_shape)):
        coords, rest = [], n
        for size in reversed(outer_shape):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        start = (
            sum((offset[d] + coords[d]) * global_strides[d] for d in range(j)) + offset[j] * global_strides[j]
        )
        segments.append((n * inner, inner, base_index + start))
    return segments


# --------------------------------------------------------------------------- functional step

# launch tables by addresses, dtypes and index segments (one per param list in use; rebuilt on a miss)
_PLAN_CACHE = runtime.PlanCache(limit=64)


@dataclasses.dataclass(frozen=True)
class _StepLaunch:
    """One fused launch: the tensors of each role and the options, as the kernel reads them.

    ``params``, ``grads``, ``exp_avgs``, ``exp_avg_sqs``: plain (local) tensors, one per param;
    ``max_exp_avg_sqs``: the same with ``amsgrad``, else ``[]``; ``steps``: fp32 ``[T]`` on the
    device, each tensor's step after incrementing; ``hyper``: fp64 ``[5]`` on the device (lr,
    beta1, beta2, eps, weight_decay); ``segments``: int64 CPU ``[S, 4]`` (slot, local start,
    length, global start); ``seed``: the Philox seed; ``stochastic``: round bf16 params
    stochastically; ``grad_scale``, ``found_inf``: AMP's 1-element fp32 device tensors or ``None``
    (unscale the gradients in the kernel and write them back unscaled; write nothing when
    ``found_inf`` is nonzero).
    """

    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    max_exp_avg_sqs: list
    steps: torch.Tensor
    hyper: torch.Tensor
    segments: torch.Tensor
    seed: int
    amsgrad: bool
    maximize: bool
    stochastic: bool
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None

    def op_args(self) -> tuple:
        """The custom ops' arguments in schema order (the schema spells each one out), AMP's aside."""
        # seed travels as a decimal string: the schema's int is 64-bit signed, a seed is unsigned
        return (
            self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs, self.steps,
            self.hyper, self.segments, str(self.seed), self.amsgrad, self.maximize, self.stochastic,
        )  # fmt: skip


def _get_plan(launch: _StepLaunch) -> kernel.LaunchPlan:
    roles = (launch.params, launch.grads, launch.exp_avgs, launch.exp_avg_sqs, launch.max_exp_avg_sqs)
    key = (
        launch.params[0].device,
        # element offsets depend on element size: the same addresses with other dtypes need another plan
        tuple(t.dtype for t in (launch.params[0], launch.grads[0], launch.exp_avgs[0])),
        tuple(t.dtype for t in launch.grads),
        *(tuple(t.data_ptr() for t in tensors) for tensors in roles),
        launch.segments.numpy().tobytes(),
    )
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        if launch.params[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "adamw_sr: the launch tables of this step are not built yet, and building them copies "
                "host memory, which CUDA graph capture forbids. Run one step (warm-up) before capturing."
            )
        plan = _PLAN_CACHE.put(key, kernel.LaunchPlan(*roles, launch.segments, launch.params[0].device))
    return plan


_MUTATED = ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")


@torch.library.custom_op("adamw_sr::fused_step", mutates_args=_MUTATED)
def _fused_step_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: torch.Tensor,
    hyper: torch.Tensor,
    segments: torch.Tensor,
    seed: str,
    amsgrad: bool,
    maximize: bool,
    stochastic: bool,
) -> None:
    _fused_step_impl(
        _StepLaunch(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            hyper,
            segments,
            int(seed),
            amsgrad,
            maximize,
            stochastic,
        )
    )


# the AMP step also writes the unscaled gradients back (as torch's fused AdamW does): its own schema
@torch.library.custom_op("adamw_sr::fused_step_amp", mutates_args=(*_MUTATED, "grads"))
def _fused_step_amp_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: torch.Tensor,
    hyper: torch.Tensor,
    segments: torch.Tensor,
    seed: str,
    amsgrad: bool,
    maximize: bool,
    stochastic: bool,
    grad_scale: Optional[torch.Tensor],  # noqa: UP045 (torch 2.11's schema inference knows Optional)
    found_inf: Optional[torch.Tensor],  # noqa: UP045
) -> None:
    _fused_step_impl(
        _StepLaunch(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            hyper,
            segments,
            int(seed),
            amsgrad,
            maximize,
            stochastic,
            grad_scale,
            found_inf,
        )
    )


def _fused_step_impl(launch: _StepLaunch) -> None:
    plan = _get_plan(launch)
    roles = (
        launch.params, launch.grads, launch.exp_avgs, launch.exp_avg_sqs,
        launch.max_exp_avg_sqs or launch.exp_avg_sqs,
    )  # fmt: skip
    kernel.launch_fused_step(
        plan, roles, launch.steps, launch.hyper, seed=launch.seed, amsgrad=launch.amsgrad,
        maximize=launch.maximize, param_bf16=launch.params[0].dtype == torch.bfloat16,
        stochastic=launch.stochastic, grad_scale=launch.grad_scale, found_inf=launch.found_inf,
    )  # fmt: skip


def _fused_step(launch: _StepLaunch) -> None:
    """The step through the custom op when a compiler or a dispatch mode (e.g. fake tensors) is
    watching; in plain eager mode straight to the launch, skipping the op's per-tensor dispatch
    checks (a third of ``step()``'s host time at 2,000 tensors), and bumping the version counters of
    the tensors written in place, as the op would."""
    amp = launch.grad_scale is not None or launch.found_inf is not None
    if (
        torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or type(launch.params[0]) not in (torch.Tensor, torch.nn.Parameter)
    ):
        if amp:
            _fused_step_amp_op(*launch.op_args(), launch.grad_scale, launch.found_inf)
        else:
            _fused_step_op(*launch.op_args())
        return
    _fused_step_impl(launch)
    written = [*launch.params, *launch.exp_avgs, *launch.exp_avg_sqs, *launch.max_exp_avg_sqs]
    _increment_versions(written + launch.grads if amp else written)


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    try:
        torch.autograd.graph.increment_version(tensors)
    except TypeError:  # a torch whose increment_version takes one tensor at a time
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def _no_output(*args) -> None:
    """The ops' fake (meta) kernel: they write in place and return nothing."""
    return None


_fused_step_op.register_fake(_no_output)
_fused_step_amp_op.register_fake(_no_output)


def adamw_sr_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor] | None,
    steps: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    amsgrad: bool = False,
    maximize: bool = False,
    stochastic_rounding: bool | None = None,
    seed: int = 0,
    base_indices: list[int] | None = None,
    segments: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One fused AdamW(-SR) step over many tensors of one dtype, in place, in one kernel launch.

    Args:
        params: contiguous tensors, all fp32 or all bf16, on one device (CUDA, or CPU with
            ``TRITON_INTERPRET=1``); updated in place.
        grads: contiguous tensors of the params' shapes, all fp32 or all bf16.
        exp_avgs, exp_avg_sqs: contiguous fp32 tensors of the params' shapes; updated in place.
        max_exp_avg_sqs: as above when ``amsgrad``, else ``None`` or ``[]``.
        steps: fp32 tensor ``[len(params)]`` on the params' device: each tensor's step number
            *after* incrementing (1 on the first step); integers in ``[1, 2**24 - 1]``
            (``MAX_STEP``): fp32 holds every integer up to ``2**24``, but ``2**24 + 1`` rounds back
            to ``2**24``, so a count past it would repeat a step and its rounding bits. Checked on
            the host (one device sync on CUDA), except during CUDA-graph capture or
            ``torch.compile`` tracing, where keeping them in range is the caller's job.
        lr: learning rate ``>= 0``, a float or a 1-element tensor (on the device for CUDA-graph
            capture; the value of a device tensor is not checked, reading it would sync).
        beta1, beta2: in ``[0, 1)``. eps, weight_decay: ``>= 0``. amsgrad, maximize: as
            ``torch.optim.AdamW`` (whose constructor checks the same ranges).
        stochastic_rounding: bf16 params: ``None``/``True`` stochastic, ``False`` nearest.
        seed: Philox seed, an integer (int or numpy integer, not bool) with ``0 <= seed < 2**64``.
        base_indices: global index of each param's first element (default: ``default_base_indices``,
            the running offset with each param starting on a multiple of 8).
        segments: advanced: int64 CPU ``[S, 4]`` rows ``(slot, local_start, length, global_start)``
            mapping local elements to global indices (overrides ``base_indices``; see ``local_segments``).
        grad_scale: AMP: a 1-element fp32 tensor, the loss scale the gradients carry
            (``torch.amp.GradScaler``'s scale); the kernel multiplies each gradient by its fp32
            reciprocal (computed in fp64, rounded once) as ``GradScaler.unscale_`` would, a bf16
            gradient rounded back to bf16 as the in-place unscale stores it, so the bits equal an
            explicit unscale followed by this step; the unscaled gradients are written back into
            ``grads`` (as ``GradScaler.unscale_`` and torch's fused AdamW leave them).
        found_inf: AMP: a 1-element fp32 tensor; when nonzero the kernel writes nothing (params
            and states bitwise untouched), read on the device, so no host sync. ``steps`` is only
            read: a caller keeping step counts advances them by ``found_inf == 0``. Both are
            moved to the params' device when they are elsewhere (as torch's fused AdamW does).

    Raises:
        TypeError: unsupported dtypes; a seed that is not an integer (a bool, a float);
            ``grad_scale`` or ``found_inf`` not an fp32 tensor.
        ValueError: mismatched lengths, shapes, devices or layouts; a seed outside ``[0, 2**64)``;
            a step outside ``[1, 2**24 - 1]`` or not an integer; ``lr < 0``, a beta outside
            ``[0, 1)``, ``eps < 0`` or ``weight_decay < 0`` (NaN included); ``grad_scale`` or
            ``found_inf`` with other than 1 element. Every check runs before anything is written:
            a rejected call leaves params and states untouched.

    **Determinism:** each element's result is a pure function of its inputs, the hyperparameters,
    ``(seed, step)``, ``grad_scale`` and its global index: identical run to run, for any grouping
    of tensors into launches, any split of a tensor into shards with matching indices, and bitwise
    equal to ``reference.adamw_sr_step_reference``. Not guaranteed across Triton versions or GPU
    models.
    """
    max_exp_avg_sqs = list(max_exp_avg_sqs or [])
    seed = rng.as_seed(seed, "adamw_sr_step")
    _check_hyperparameters(lr, (beta1, beta2), eps, weight_decay, "adamw_sr_step")
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    for name, values in lists.items():
        if len(values) != n:
            raise ValueError(
                f"adamw_sr_step: {name} has {len(values)} entries but params has {n}; give one per param"
            )
    if n == 0:
        return
    device = runtime.check_kernel_device(
        *params, *grads, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs, op="adamw_sr_step"
    )
    if {p.dtype for p in params} - {params[0].dtype} or params[0].dtype not in _SUPPORTED_PARAM_DTYPES:
        found = sorted({str(p.dtype) for p in params})
        raise TypeError(f"adamw_sr_step: params must be all float32 or all bfloat16, got {found}")
    if {g.dtype for g in grads} - {grads[0].dtype} or grads[0].dtype not in _SUPPORTED_GRAD_DTYPES:
        found = sorted({str(g.dtype) for g in grads})
        raise TypeError(f"adamw_sr_step: grads must be all float32 or all bfloat16, got {found}")
    for i, p in enumerate(params):
        for name, values in lists.items():
            t = values[i]
            if t.shape != p.shape:
                raise ValueError(
                    f"adamw_sr_step: {name}[{i}] has shape {tuple(t.shape)}, param {tuple(p.shape)}"
                )
            if name != "grads" and t.dtype != torch.float32:
                raise TypeError(f"adamw_sr_step: {name}[{i}] must be float32, got {t.dtype}")
            if t.layout != torch.strided:
                raise RuntimeError(
                    f"adamw_sr_step: {name}[{i}] has layout {t.layout}; only dense (strided) tensors are "
                    "supported (for sparse gradients use torch.optim.SparseAdam)"
                )
            if not t.is_contiguous():
                raise ValueError(
                    f"adamw_sr_step: {name}[{i}] is not contiguous; call .contiguous() on it first"
                )
        if not p.is_contiguous():
            raise ValueError(f"adamw_sr_step: params[{i}] is not contiguous")
    if steps.shape != (n,) or steps.dtype != torch.float32 or steps.device != device:
        raise ValueError(f"adamw_sr_step: steps must be float32 of shape ({n},) on {device}")
    _check_steps(steps)
    grad_scale = _amp_scalar(grad_scale, "grad_scale", device, "adamw_sr_step")
    found_inf = _amp_scalar(found_inf, "found_inf", device, "adamw_sr_step")
    if segments is None:
        if base_indices is None:
            base_indices = default_base_indices(p.numel() for p in params)
        base_indices = list(base_indices)
        if len(base_indices) != n:
            raise ValueError(
                f"adamw_sr_step: base_indices has {len(base_indices)} entries but params has {n}; "
                "give one global start index per param"
            )
        for i, b in enumerate(base_indices):
            b = base_indices[i] = runtime.as_index(b, f"base_indices[{i}]", "adamw_sr_step")
            if not 0 <= b < 2**62:
                raise ValueError(
                    f"adamw_sr_step: base_indices[{i}] = {b!r} must be an int in [0, 2**62) "
                    "(the global index of the param's first element)"
                )
        rows = [
            (i, 0, p.numel(), int(b))
            for i, (p, b) in enumerate(zip(params, base_indices, strict=True))
            if p.numel()
        ]
        segments = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
    hyper = _hyper_tensor(lr, (beta1, beta2), eps, weight_decay, device)
    _fused_step(
        _StepLaunch(
            params=params,
            grads=grads,
            exp_avgs=exp_avgs,
            exp_avg_sqs=exp_avg_sqs,
            max_exp_avg_sqs=max_exp_avg_sqs if amsgrad else [],
            steps=steps,
            hyper=hyper,
            segments=segments,
            seed=int(seed),
            amsgrad=amsgrad,
            maximize=maximize,
            stochastic=stochastic_rounding is not False,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
    )


def _amp_scalar(value, name: str, device: torch.device, op: str) -> torch.Tensor | None:
    """``grad_scale`` / ``found_inf`` (``torch.amp.GradScaler``'s 1-element fp32 tensors) on ``device``.

    Raises:
        TypeError: not a tensor, or not float32. ValueError: not exactly 1 element.
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


def _check_steps(steps: torch.Tensor) -> None:
    """Every step an integer in ``[1, MAX_STEP]``: step 0 divides by a zero bias correction (NaN),
    a fraction is truncated by the kernel, and fp32 holds consecutive integers only below 2**24.

    Reads the values on the host: free for CPU tensors, one device sync on CUDA; skipped while a
    CUDA graph is captured or torch.compile traces (no value exists then), where the caller keeps
    the steps in range.
    """
    if torch.compiler.is_compiling():
        return
    if steps.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    valid = (steps >= 1) & (steps <= MAX_STEP) & (steps == torch.trunc(steps))
    if not bool(valid.all()):
        bad = steps[~valid]
        raise ValueError(
            f"adamw_sr_step: steps must be integers in [1, 2**24 - 1] (the step number after "
            f"incrementing, 1 on the first step; fp32 counts exactly only below 2**24), got "
            f"{bad[:4].tolist()} at positions {torch.nonzero(~valid).flatten()[:4].tolist()}"
        )


def _hyper_tensor(
    lr, betas, eps, weight_decay, device, cache: runtime.PlanCache | None = None
) -> torch.Tensor:
    """fp64 ``[lr, beta1, beta2, eps, weight_decay]`` on ``device`` (lr may be a device tensor).

    With ``cache``, kept by value: a float lr's tensor whole, a tensor lr's constant tail (groups
    with equal hyperparameters share the read-only tensor; the key holds no ``id(group)``, which
    torch 2.11's dynamo cannot trace).
    """
    rest = (*betas, eps, weight_decay)
    if isinstance(lr, torch.Tensor):
        key = (device, rest, "tensor")
        const = None if cache is None else cache.get(key)
        if const is None:
            const = torch.tensor(rest, dtype=torch.float64).to(device)
            if cache is not None:
                cache.put(key, const)
        return torch.cat([lr.detach().reshape(1).to(device=device, dtype=torch.float64), const])
    key = (device, rest, float(lr))
    hyper = None if cache is None else cache.get(key)
    if hyper is None:
        hyper = kernel.to_device_async(torch.tensor([float(lr), *rest], dtype=torch.float64), device)
        if cache is not None:
            cache.put(key, hyper)
    return hyper


# --------------------------------------------------------------------------- the optimizer


class AdamWSR(torch.optim.Optimizer):
    """AdamW with the whole step fused in Triton and stochastic rounding of bf16 weights.

    A drop-in for ``torch.optim.AdamW``: same arguments, param groups, LR-scheduler support and
    ``state_dict`` layout (``step`` as an fp32 tensor, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``). Parameters may be fp32 (written back unrounded) or bf16 (written back with
    stochastic rounding by default, no fp32 master copy needed); gradients fp32 or bf16; states are
    always fp32.

    Args:
        params: iterable of tensors or param-group dicts. Tensors must be contiguous, non-empty
            (a DTensor's local shard may be empty), real, fp32 or bf16, all on one device (CUDA, or
            CPU with ``TRITON_INTERPRET=1``). A group may give ``base_index``: a list with one int
            (or ``None``) per param, the global index of its first element.
        lr: learning rate, float or 1-element tensor (a CUDA tensor for graph capture).
        betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW`` (decoupled decay
            ``p *= 1 - lr * weight_decay``).
        foreach: ``None`` only. The step is always one fused launch: ``False`` raises, and so does
            ``True`` (torch's multi-tensor implementation, which torch.optim.AdamW also refuses
            together with ``fused=True``).
        fused: ``None`` or ``True`` (the step is always fused); ``True`` is checked as torch checks
            it: the params must be on a device the fused step runs on (CUDA, or CPU with
            ``TRITON_INTERPRET=1``). ``False`` raises.
        capturable: keep ``step`` on the device so ``step()`` can be captured in a CUDA graph;
            CUDA params only (``True`` with CPU params raises, as in torch).
        differentiable: must be ``False``.
        seed: Philox seed of the rounding, an integer (int or numpy integer, not bool) with
            ``0 <= seed < 2**64``; saved in the param groups (a group may give its own).
        stochastic_rounding: ``None`` (default: on for bf16 params), ``True`` or ``False``
            (round to nearest). Has no effect on fp32 params.

    Raises:
        ValueError: an out-of-range hyperparameter (as ``torch.optim.AdamW``: ``lr < 0``, a beta
            outside ``[0, 1)``, ``eps < 0``, ``weight_decay < 0``, NaN; a seed outside
            ``[0, 2**64)``), an unsupported flag (``foreach`` not ``None``, ``fused=False``,
            ``differentiable=True``, ``capturable=True`` with non-CUDA params), an empty or
            non-contiguous param, params on several devices.
        TypeError: ``params`` is a module (pass ``model.parameters()``); fp16, complex or integer
            params; a seed that is a bool or not an integer.
        RuntimeError: ``fused=True`` with params where the fused step cannot run (CPU without the
            Triton interpreter); from ``step``: sparse gradients, or a step captured in a CUDA
            graph with ``capturable=False``.

    AMP: a drop-in for torch's fused AdamW under ``torch.amp.GradScaler`` too: ``scaler.step(opt)``
    passes the loss scale and the inf flag (``_step_supports_amp_scaling``), the kernel unscales
    the gradients (the bits of an explicit ``scaler.unscale_``) and skips a step with inf/NaN
    gradients on the device, leaving params, moments and step counts bitwise untouched (see
    ``step``).

    Without a GradScaler, NaN or Inf gradients are not rejected: as in ``torch.optim.AdamW`` they
    propagate into the moments and the weights (``amsgrad``'s maximum propagates NaN like
    ``torch.maximum``).
    Params whose ``grad`` is ``None`` are skipped and their ``step`` does not advance, as in torch.
    ``step`` is fp32 (torch's layout), which counts exactly up to ``2**24`` (16.7M steps); past it
    the count stops advancing, as in ``torch.optim.AdamW``, and the rounding bits of a step repeat.
    fp16 params are rejected: without a loss-scaled master copy their 5-bit exponent range makes
    updates underflow, and det-core's rounding contract covers fp32 -> bf16 only.

    **Determinism:** the update of every element is a pure function of its inputs, the
    hyperparameters, ``(seed, step)`` and its global index (by default the running element offset
    over the optimizer's params in order, each param starting on a multiple of 8, see
    ``default_base_indices``; or an explicit ``base_index``; for DTensor params the shard's position
    is derived from its placement). So steps are bitwise identical run to run, in a
    fresh process, after a state_dict round trip, under any sharding (FSDP2 over any number of
    ranks, even, uneven or empty shards) and equal to the plain-torch reference on a CPU. Not
    guaranteed across Triton versions or GPU models (only expected, see the docs).

    Method: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019); Kingma & Ba,
    "Adam" (ICLR 2015); AMSGrad (Reddi et al., ICLR 2018); stochastic rounding (Gupta et al.,
    ICML 2015); Philox4x32-10 (Salmon et al., SC'11).
    """

    # torch.amp.GradScaler hands a fused-AMP optimizer its scale and inf flag as the attributes
    # grad_scale / found_inf instead of unscaling the gradients and syncing on found_inf itself
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        seed: int = 0,
        stochastic_rounding: bool | None = None,
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() == 1 and not 0.0 <= float(lr):
            # torch.optim.AdamW reads a tensor lr here too (a one-off sync at construction)
            raise ValueError(f"AdamWSR: Invalid learning rate: {float(lr)}; it must be >= 0")
        _check_hyperparameters(lr, betas, eps, weight_decay, "AdamWSR")
        seed = rng.as_seed(seed, "AdamWSR")
        if stochastic_rounding not in (None, True, False):
            raise ValueError(f"stochastic_rounding must be None, True or False, got {stochastic_rounding!r}")
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                f"AdamWSR: params must be an iterable of tensors or param-group dicts, got the module "
                f"{type(params).__name__}; pass model.parameters()"
            )
        if fused is False or foreach is False:
            name = "fused" if fused is False else "foreach"
            raise ValueError(
                f"AdamWSR always runs its fused Triton step; {name}=False is not supported "
                "(use torch.optim.AdamW for an unfused step)."
            )
        if foreach:
            # torch.optim.AdamW refuses fused=True with foreach=True; AdamWSR is always fused
            raise ValueError(
                "AdamWSR always runs its fused Triton step (one launch over all tensors); foreach=True asks "
                "for torch's multi-tensor implementation, which it does not have (torch.optim.AdamW refuses "
                "foreach=True together with fused=True too). Leave foreach=None."
            )
        if fused not in (None, True):
            raise ValueError(f"AdamWSR: fused must be None or True, got {fused!r}")
        if differentiable:
            raise ValueError("AdamWSR does not support differentiable=True (its step is a Triton kernel)")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=None, capturable=capturable, differentiable=False, fused=fused,
            seed=seed, stochastic_rounding=stochastic_rounding, base_index=None,
        )  # fmt: skip
        self._base_index_cache = {}
        self._segments_cache = runtime.PlanCache(limit=64)  # param list -> its launch's index segments
        self._hyper_cache = runtime.PlanCache(limit=256)  # hyperparameter values -> their device tensor
        # "unchecked": a loaded state not yet validated (states this class creates are valid by
        # construction, so the per-tensor state check runs once per load, not every step). A dict
        # mutated in place: dynamo (torch 2.11) refuses setattr on the optimizer while tracing
        self._state_flags = {"unchecked": True}
        super().__init__(params, defaults)

    # ----------------------------------------------------------------- groups and indices

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as ``torch.optim.Optimizer.add_param_group``), validating its params.

        Raises:
            TypeError: a param is fp16, complex or not floating point; the group's ``seed`` is not
                an integer (a bool or a float).
            ValueError: a param is empty or non-contiguous, on another device than the others,
                ``base_index`` does not give one entry per param, or ``seed`` is outside ``[0, 2**64)``;
                the group sets ``foreach``, ``fused=False``, or ``capturable=True`` with non-CUDA params.
            RuntimeError: ``fused=True`` with params where the fused step cannot run (CPU without
                the Triton interpreter).
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        devices = {_local(p).device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            self.param_groups.pop()
            raise ValueError(
                f"AdamWSR: all params must be on one device (one fused launch), got "
                f"{sorted(map(str, devices))}; use one optimizer per device"
            )
        for p in group["params"]:
            problem = self._param_problem(p)
            if problem:
                self.param_groups.pop()
                raise (TypeError if "dtype" in problem else ValueError)(f"AdamWSR: {problem}")
        try:
            if group["foreach"] is not None or group["fused"] not in (None, True):
                raise ValueError(
                    f"AdamWSR: a param group's foreach must be None and fused None or True (the step is "
                    f"always fused), got foreach={group['foreach']!r}, fused={group['fused']!r}"
                )
            self._check_device_flags(group)
        except (RuntimeError, ValueError):
            self.param_groups.pop()
            raise
        try:
            group["seed"] = rng.as_seed(group["seed"], "AdamWSR")
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        base = group.get("base_index")
        if base is not None:
            if isinstance(base, int):
                base = group["base_index"] = [base]
            if len(base) != len(group["params"]) or not all(
                b is None or (isinstance(b, int) and b >= 0) for b in base
            ):
                self.param_groups.pop()
                raise ValueError(
                    f"AdamWSR: base_index must list one non-negative int (or None) per param, "
                    f"got {base!r} for {len(group['params'])} params"
                )
        self._base_index_cache = {}
        self._segments_cache.clear()

    @staticmethod
    def _check_device_flags(group: dict) -> None:
        """The device flags of a group against its params' device, as torch checks them: ``fused=True``
        needs a device the fused step runs on (CUDA, or CPU with the Triton interpreter), and
        ``capturable=True`` (step counts on the device, for CUDA-graph capture) needs CUDA params."""
        if not group["params"]:
            return
        device = _local(group["params"][0]).device
        if group.get("fused"):
            runtime.check_kernel_device(*(_local(p) for p in group["params"]), op="AdamWSR(fused=True)")
        if group.get("capturable") and device.type != "cuda":
            raise ValueError(
                f"AdamWSR: capturable=True keeps the step counts on the device for CUDA-graph capture, "
                f"which needs CUDA params; these are on {device.type} (torch.optim.AdamW refuses "
                "capturable=True there too): pass capturable=False"
            )

    @staticmethod
    def _param_problem(p: torch.Tensor) -> str | None:
        if p.is_complex():
            return (
                f"complex params (dtype {p.dtype}) are not supported; view them as real (torch.view_as_real)"
            )
        if p.dtype == torch.float16:
            return (
                "float16 params are not supported (dtype float16): train in bfloat16 (stochastic rounding) "
                "or float32"
            )
        if p.dtype not in _SUPPORTED_PARAM_DTYPES:
            return f"params must be float32 or bfloat16, got dtype {p.dtype}"
        if not _is_dtensor(p) and p.numel() == 0:
            return f"zero-size param of shape {tuple(p.shape)}: remove it from the optimizer"
        if not _local(p).is_contiguous():
            return (
                f"param of shape {tuple(p.shape)} is not contiguous: make it contiguous before building "
                "the optimizer"
            )
        return None

    def _base_indices(self) -> dict[int, int]:
        """id(param) -> global index of its first element (running offset, or the group's override)."""
        # filled in place, never reassigned inside step(): dynamo (torch 2.11) refuses a setattr on
        # the optimizer object while tracing a compiled step
        if not self._base_index_cache:
            params = [p for group in self.param_groups for p in group["params"]]
            defaults = default_base_indices(p.numel() for p in params)  # global numel for a DTensor
            explicit = [
                b for g in self.param_groups for b in (g.get("base_index") or [None] * len(g["params"]))
            ]
            out = {id(p): d if b is None else b for p, d, b in zip(params, defaults, explicit, strict=True)}
            self._base_index_cache.update(out)
        return self._base_index_cache

    def _segments(self, ps: list[torch.Tensor], base: dict[int, int]) -> torch.Tensor:
        """``(slot, local_start, length, global_start)`` rows of one launch (cached per param list)."""
        key = tuple(id(p) for p in ps)
        segments = self._segments_cache.get(key)
        if segments is None:
            rows = []
            for slot, p in enumerate(ps):
                rows.extend((slot, *seg) for seg in local_segments(p, base[id(p)]))
            segments = self._segments_cache.put(key, torch.tensor(rows, dtype=torch.int64).reshape(-1, 4))
        return segments

    # ----------------------------------------------------------------- state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as ``torch.optim.Optimizer`` does, but keep the moments in fp32 (torch casts
        floating state to the param dtype, which would round them to bf16) and copy every state
        tensor (torch keeps a reference to the caller's ``step`` tensors)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        order = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for pid, p in zip(saved_ids, order, strict=True):
            if pid in saved:
                for key in _STATE_KEYS:
                    value = saved[pid].get(key)
                    if value is None:
                        continue
                    # a copy, so in-place steps never write into the caller's state_dict
                    if _is_dtensor(value):
                        self.state[p][key] = value.to(dtype=torch.float32, copy=True)
                    else:
                        self.state[p][key] = value.to(device=_local(p).device, dtype=torch.float32, copy=True)
                step = self.state[p].get("step")
                if isinstance(step, torch.Tensor) and step is saved[pid].get("step"):
                    self.state[p]["step"] = step.clone()  # torch would alias the caller's step tensor
        self._base_index_cache = {}
        self._segments_cache.clear()
        self._state_flags = {"unchecked": True}

    def _check_state(self, p: torch.Tensor, state: dict, amsgrad: bool) -> None:
        """A loaded or existing state must hold fp32 moments of the param's shape and a step tensor."""
        if not isinstance(state.get("step"), torch.Tensor):
            raise RuntimeError(f"AdamWSR: state of a param of shape {tuple(p.shape)} lacks a 'step' tensor")
        for key in _STATE_KEYS[: 3 if amsgrad else 2]:
            value = state.get(key)
            if value is None:
                if key == "max_exp_avg_sq":
                    continue  # amsgrad switched on later: created at zero, as torch does
                raise RuntimeError(f"AdamWSR: state of a param of shape {tuple(p.shape)} lacks '{key}'")
            if value.dtype != torch.float32 or value.shape != p.shape:
                raise RuntimeError(
                    f"AdamWSR: state '{key}' must be float32 of shape {tuple(p.shape)}, "
                    f"got {value.dtype} {tuple(value.shape)}"
                )

    def __setstate__(self, state: dict) -> None:
        """Fill group options a loaded state lacks (e.g. a ``torch.optim.AdamW`` state_dict), like torch."""
        super().__setstate__(state)
        self._state_flags = {"unchecked": True}
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("seed", self.defaults.get("seed", 0) if hasattr(self, "defaults") else 0)
            group.setdefault("stochastic_rounding", None)
            group.setdefault("base_index", None)

    # ----------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every param with a gradient (one fused launch per group and dtype pair).

        Shapes, dtypes and the **Determinism** guarantees are the class's (see ``AdamWSR``).

        Raises:
            RuntimeError: a sparse gradient; capture with ``capturable=False``; a malformed loaded state.
            ValueError: a gradient of another shape, device or layout than its param; a group's
                ``seed`` outside ``[0, 2**64)`` or ``lr``, ``betas``, ``eps``, ``weight_decay``
                outside torch.optim.AdamW's ranges (param_groups are re-checked at each eager step).
            TypeError: a gradient dtype other than fp32/bf16; a group's ``seed`` not an integer, a
                hyperparameter not a real number; ``grad_scale`` / ``found_inf`` not fp32 tensors.

        Every check runs before any state changes: a rejected step leaves params and state
        (the step counters included) untouched.

        AMP: ``torch.amp.GradScaler.step(opt)`` sets ``opt.grad_scale`` and ``opt.found_inf`` for
        the call (this class has ``_step_supports_amp_scaling``, as torch's fused AdamW); the step
        then unscales the gradients in the kernel (the bits of ``scaler.unscale_(opt)`` followed by
        a step; ``p.grad`` is left unscaled, as torch's fused AdamW leaves it) and, where
        ``found_inf`` is nonzero, writes nothing (``p.grad`` included) and leaves every step count as
        it is, decided on the device (no host sync; the counts live on the params' device from
        the first such step on).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # as torch's optimizers: the capture query is not traceable (dynamo would break the graph here)
        capturing = (
            not torch.compiler.is_compiling()
            and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing()
        )
        work = []
        for group in self.param_groups:
            if capturing and not group["capturable"]:
                raise RuntimeError("AdamWSR: step() is being captured in a CUDA graph; pass capturable=True")
            if not torch.compiler.is_compiling():
                # param_groups are user-editable (schedulers write lr): re-check the values the
                # kernel reads before any state (the step counters) changes. Not while tracing:
                # the compiled step guards on these values, checked by the eager calls before it.
                group["seed"] = rng.as_seed(group["seed"], "AdamWSR.step")
                _check_hyperparameters(
                    group["lr"], group["betas"], group["eps"], group["weight_decay"], "AdamWSR.step"
                )
            with_grad = [p for p in group["params"] if p.grad is not None]
            self._check_grads(with_grad)
            if with_grad:  # CPU params need the Triton interpreter: say so before any state is touched
                runtime.check_kernel_device(*(_local(p) for p in with_grad), op="AdamWSR.step")
                if group["capturable"] and _local(with_grad[0]).device.type != "cuda":
                    self._check_device_flags(group)  # a loaded param group may set capturable
            work.append((group, with_grad))
        check_states = self._state_flags["unchecked"] or torch.compiler.is_compiling()
        if check_states:
            for group in self.param_groups:
                for p in group["params"]:
                    if self.state.get(p):
                        self._check_state(p, self.state[p], group["amsgrad"])
            if not torch.compiler.is_compiling():
                self._state_flags["unchecked"] = False
        # set by torch.amp.GradScaler.step for the length of this call (None: not under a GradScaler,
        # or grad_scale None when the gradients were unscaled already)
        amp = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        if (amp[0] is not None or amp[1] is not None) and any(with_grad for _, with_grad in work):
            device = next(_local(ps[0]).device for _, ps in work if ps)
            amp = tuple(
                _amp_scalar(value, name, device, "AdamWSR.step")
                for value, name in zip(amp, ("grad_scale", "found_inf"), strict=True)
            )
        base = self._base_indices()
        for group, with_grad in work:
            if with_grad:
                self._group_step(group, with_grad, base, *amp)
        return loss

    @staticmethod
    def _check_grads(ps: list[torch.Tensor]) -> None:
        """``_check_grad`` for each param, with a fast test for the common plain-tensor case."""
        strided, dtypes, param_dtypes = torch.strided, _SUPPORTED_GRAD_DTYPES, _SUPPORTED_PARAM_DTYPES
        for p in ps:
            g = p.grad
            if (
                type(g) not in _PLAIN_TENSOR_TYPES
                or type(p) not in _PLAIN_TENSOR_TYPES
                or p.dtype not in param_dtypes
                or not p.is_contiguous()
                or g.layout != strided
                or g.dtype not in dtypes
                or g.shape != p.shape
                or g.device != p.device
                or not g.is_contiguous()
            ):
                AdamWSR._check_grad(p)  # the full check, with its precise error

    @staticmethod
    def _check_grad(p: torch.Tensor) -> None:
        # the param itself again: ``p.data`` may have been replaced since the optimizer was built
        problem = AdamWSR._param_problem(p)
        if problem:
            raise (TypeError if "dtype" in problem else ValueError)(f"AdamWSR: {problem}")
        g = p.grad
        if g.is_sparse or g.layout != torch.strided:
            raise RuntimeError("AdamWSR does not support sparse gradients; use torch.optim.SparseAdam")
        if g.dtype not in _SUPPORTED_GRAD_DTYPES:
            raise TypeError(f"AdamWSR: gradients must be float32 or bfloat16, got {g.dtype}")
        if g.shape != p.shape:
            raise ValueError(f"AdamWSR: gradient shape {tuple(g.shape)} != param shape {tuple(p.shape)}")
        lg, lp = _local(g), _local(p)
        if lg.device != lp.device:
            raise ValueError(f"AdamWSR: gradient on {lg.device}, param on {lp.device}")
        if lg.shape != lp.shape or not lg.is_contiguous():
            raise ValueError(
                f"AdamWSR: gradient of a param of shape {tuple(p.shape)} is not a contiguous tensor of the "
                "param's local shape; make it contiguous (e.g. in a post-accumulate-grad hook)"
            )

    def _group_step(
        self,
        group: dict,
        with_grad: list[torch.Tensor],
        base: dict[int, int],
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        amsgrad, capturable = group["amsgrad"], group["capturable"]
        device = _local(with_grad[0]).device
        all_states = [self.state[p] for p in with_grad]  # one (Python-level) tensor hash per param
        for p, state in zip(with_grad, all_states, strict=True):
            if len(state) == 0:
                step_device = device if capturable or found_inf is not None else torch.device("cpu")
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(
                    p, dtype=torch.float32, memory_format=torch.preserve_format
                )
                state["exp_avg_sq"] = torch.zeros_like(
                    p, dtype=torch.float32, memory_format=torch.preserve_format
                )
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(
                    p, dtype=torch.float32, memory_format=torch.preserve_format
                )
        if found_inf is None:
            torch._foreach_add_([s["step"] for s in all_states], 1.0)
        else:
            # a skipped step leaves the counts as they are, decided on the device: the counts move
            # there (once; torch's fused AdamW keeps them there too) and advance after the launch
            for state in all_states:
                if state["step"].device != device:
                    state["step"] = kernel.to_device_async(state["step"], device)
        hyper = _hyper_tensor(
            group["lr"], group["betas"], group["eps"], group["weight_decay"], device, self._hyper_cache
        )
        # one launch per (param dtype, grad dtype): the kernel is specialized on both
        by_dtype: dict = {}
        for p, state in zip(with_grad, all_states, strict=True):
            ps_states = by_dtype.setdefault((p.dtype, p.grad.dtype), ([], []))
            ps_states[0].append(p)
            ps_states[1].append(state)
        for (param_dtype, _), (ps, states) in by_dtype.items():
            segments = self._segments(ps, base)
            steps = torch.stack([s["step"] for s in states]).to(torch.float32)
            if steps.device != device:
                steps = kernel.to_device_async(steps, device)
            if found_inf is not None:
                steps = steps + 1.0  # the step number of this step; the counts advance below
            _fused_step(
                _StepLaunch(
                    params=[_local(p) for p in ps],
                    grads=[_local(p.grad) for p in ps],
                    exp_avgs=[_local(s["exp_avg"]) for s in states],
                    exp_avg_sqs=[_local(s["exp_avg_sq"]) for s in states],
                    max_exp_avg_sqs=[_local(s["max_exp_avg_sq"]) for s in states] if amsgrad else [],
                    steps=steps,
                    hyper=hyper,
                    segments=segments,
                    seed=group["seed"],
                    amsgrad=amsgrad,
                    maximize=group["maximize"],
                    stochastic=param_dtype == torch.bfloat16 and group["stochastic_rounding"] is not False,
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                )
            )
        if found_inf is not None:  # + 1 where no inf was found, + 0.0 (the same bits) where one was
            advance = (found_inf == 0).to(torch.float32).reshape(())
            torch._foreach_add_([s["step"] for s in all_states], [advance] * len(all_states))
