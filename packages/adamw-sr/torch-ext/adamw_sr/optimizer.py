"""``AdamWSR``: a drop-in ``torch.optim.AdamW`` whose whole step is one fused Triton kernel per
(param dtype, grad dtype) group, with stochastic rounding of bf16 weights keyed by global element index,
and moments stored in fp32, bf16 or 8 bits (``state_dtype``; formats in ``states``, ``state_codes``).

Reading order: the global element index (plain tensors and DTensor shards), the functional step
``adamw_sr_step`` (a ``torch.library`` custom op, opaque to ``torch.compile``), the optimizer class.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from typing import Optional

import torch
from det_core import rng, runtime
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import kernel, state_codes, states
from .launch import LaunchPlan, launch_fused_step, to_device_async

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


def default_base_indices(numels, alignments=None) -> list[int]:
    """The default global index of each parameter's first element: the running element offset over
    the parameters in order, each rounded up to a multiple of its alignment (``BASE_INDEX_ALIGNMENT``,
    8; a param with 8-bit states starts on a block of ``state_codes.QUANT_BLOCK``, 32).

    Args:
        numels: iterable of element counts (global counts for DTensors).
        alignments: iterable of ints, one per param (default: 8 for every param).

    Returns: list of ints.

    **Determinism:** a pure function of the counts, the alignments and their order: a sharded run,
    which sees the global counts, assigns the same indices as the unsharded one.
    """
    out, offset = [], 0
    numels = list(numels)
    alignments = [BASE_INDEX_ALIGNMENT] * len(numels) if alignments is None else list(alignments)
    for n, align in zip(numels, alignments, strict=True):
        offset = runtime.cdiv(offset, align) * align
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
    return _box_runs(global_shape, tuple(local_shape), tuple(offset), base_index)


def _box_runs(global_shape: tuple, local_shape: tuple, offset: tuple, base_index: int) -> list:
    """``local_segments`` of the box ``local_shape`` at ``offset`` in a tensor of ``global_shape``."""
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


def _merged(runs) -> list[tuple[int, int, int]]:
    """``(local_start, length, global_start)`` runs with neighbours in both indices joined."""
    out: list[list[int]] = []
    for local_start, length, global_start in runs:
        if out and out[-1][0] + out[-1][1] == local_start and out[-1][2] + out[-1][1] == global_start:
            out[-1][1] += length
        else:
            out.append([local_start, length, global_start])
    return [tuple(r) for r in out]


def _boxes(global_shape: tuple, mesh_shape: tuple, placements) -> dict:
    """``{mesh coordinate: (local_shape, offset)}`` of every rank's shard of a ``Shard``/``Replicate``
    DTensor, by DTensor's rule (mesh dimensions in order, each ``Shard(d)`` splitting the current
    extent of dim ``d`` as ``torch.chunk`` does)."""
    from torch.distributed.tensor import Shard

    out = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        shape, offset = list(global_shape), [0] * len(global_shape)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                d, n, k = placement.dim % len(global_shape), mesh_shape[mesh_dim], coord[mesh_dim]
                chunk = runtime.cdiv(shape[d], n)
                start = min(k * chunk, shape[d])
                offset[d] += start
                shape[d] = min(chunk, shape[d] - start)
        out[coord] = (tuple(shape), tuple(offset))
    return out


def _check_8bit_layout(param: torch.Tensor, base_index: int, runs: list) -> None:
    """8-bit states: every run of every rank's shard starts on a block, and every rank's scale
    shard (``states.scale_shape`` with the param's placements) holds exactly its blocks.

    Checked for all ranks of a DTensor's mesh from the placement alone (no communication), so
    every rank refuses the same params: a step never updates some ranks' shards and not others'.

    Raises:
        ValueError: a run off the block grid (``states.check_8bit_segments``, naming the block size),
            or scales that the placement shards differently from the blocks (a sharded param whose
            last dimension is not a multiple of 32, on some meshes), naming the fix.
    """
    shape = tuple(param.shape)
    if not _is_dtensor(param):
        states.check_8bit_segments(runs, shape, "AdamWSR.step")
        return
    from torch.distributed.tensor import Shard

    block = state_codes.QUANT_BLOCK
    mesh_shape = tuple(param.device_mesh.shape)
    scale = states.scale_shape(shape)
    mismatch = ValueError(
        f"AdamWSR.step: state_dtype='8bit': the block scales (shape {scale}) of a param of shape "
        f"{shape} with placements {tuple(param.placements)} do not shard like its blocks of {block} "
        f"elements (a sharded param needs its last dimension to be a multiple of {block}); put "
        "this parameter in a param group with state_dtype=torch.bfloat16"
    )
    if any(isinstance(pl, Shard) and not -len(scale) <= pl.dim < len(scale) for pl in param.placements):
        raise mismatch  # the scales (new_state: the param's placements) have no such dimension
    scale_boxes = _boxes(scale, mesh_shape, param.placements)
    for coord, box in _boxes(shape, mesh_shape, param.placements).items():
        rank_runs = _box_runs(shape, *box, base_index)
        states.check_8bit_segments(rank_runs, shape, f"AdamWSR.step (the shard at mesh coordinate {coord})")
        want = [(lo // block, runtime.cdiv(n, block), (g - base_index) // block) for lo, n, g in rank_runs]
        if _merged(_box_runs(scale, *scale_boxes[coord], 0)) != _merged(want):
            raise mismatch


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
    ``found_inf`` is nonzero). bf16 / 8-bit moments (their dtype says which): ``state_stochastic``
    rounds them stochastically (else to nearest); ``exp_avg_scales``, ``exp_avg_sq_scales``: the
    8-bit block scales (uint8), one tensor per param, else ``[]``.
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
    state_stochastic: bool = True
    exp_avg_scales: list = dataclasses.field(default_factory=list)
    exp_avg_sq_scales: list = dataclasses.field(default_factory=list)

    @property
    def state_format(self) -> int:
        """The moments' format (``kernel.FORMAT_*``), from their dtype: fp32, bf16 or uint8 (8 bits)."""
        return states.format_of_moments(self.exp_avgs[0].dtype)

    def op_args(self) -> tuple:
        """The custom ops' arguments in schema order (the schema spells each one out), AMP's aside."""
        # seed travels as a decimal string: the schema's int is 64-bit signed, a seed is unsigned
        return (
            self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs, self.steps,
            self.hyper, self.segments, str(self.seed), self.amsgrad, self.maximize, self.stochastic,
        )  # fmt: skip


def _get_plan(launch: _StepLaunch) -> LaunchPlan:
    roles = (launch.params, launch.grads, launch.exp_avgs, launch.exp_avg_sqs, launch.max_exp_avg_sqs)
    scales = (launch.exp_avg_scales, launch.exp_avg_sq_scales)
    key = (
        launch.params[0].device,
        # element offsets depend on element size: the same addresses with other dtypes need another plan
        tuple(t.dtype for t in (launch.params[0], launch.grads[0], launch.exp_avgs[0])),
        tuple(t.dtype for t in launch.grads),
        *(tuple(t.data_ptr() for t in tensors) for tensors in roles + scales),
        launch.segments.numpy().tobytes(),
    )
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        if launch.params[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "adamw_sr: the launch tables of this step are not built yet, and building them copies "
                "host memory, which CUDA graph capture forbids. Run one step (warm-up) before capturing."
            )
        plan = _PLAN_CACHE.put(
            key,
            LaunchPlan(
                *roles, launch.segments, launch.params[0].device, state_format=launch.state_format,
                exp_avg_scales=launch.exp_avg_scales, exp_avg_sq_scales=launch.exp_avg_sq_scales,
            ),
        )  # fmt: skip
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


# bf16 / 8-bit moments: one op for all (8-bit scales among the mutated tensors; the gradients too,
# written back unscaled under AMP: declared always, which costs a compiled graph a copy at most)
@torch.library.custom_op(
    "adamw_sr::fused_step_states", mutates_args=(*_MUTATED, "exp_avg_scales", "exp_avg_sq_scales", "grads")
)
def _fused_step_states_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    exp_avg_scales: list[torch.Tensor],
    exp_avg_sq_scales: list[torch.Tensor],
    steps: torch.Tensor,
    hyper: torch.Tensor,
    segments: torch.Tensor,
    seed: str,
    amsgrad: bool,
    maximize: bool,
    stochastic: bool,
    state_stochastic: bool,
    grad_scale: Optional[torch.Tensor],  # noqa: UP045 (torch 2.11's schema inference knows Optional)
    found_inf: Optional[torch.Tensor],  # noqa: UP045
) -> None:
    _fused_step_impl(
        _StepLaunch(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hyper, segments, int(seed),
            amsgrad, maximize, stochastic, grad_scale, found_inf, state_stochastic, exp_avg_scales,
            exp_avg_sq_scales,
        )
    )  # fmt: skip


def _fused_step_impl(launch: _StepLaunch) -> None:
    plan = _get_plan(launch)
    roles = (
        launch.params, launch.grads, launch.exp_avgs, launch.exp_avg_sqs,
        launch.max_exp_avg_sqs or launch.exp_avg_sqs,
    )  # fmt: skip
    launch_fused_step(
        plan, roles, launch.steps, launch.hyper, seed=launch.seed, amsgrad=launch.amsgrad,
        maximize=launch.maximize, param_bf16=launch.params[0].dtype == torch.bfloat16,
        stochastic=launch.stochastic, grad_scale=launch.grad_scale, found_inf=launch.found_inf,
        state_stochastic=launch.state_stochastic,
        scales=(launch.exp_avg_scales, launch.exp_avg_sq_scales),
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
        if launch.state_format != kernel.FORMAT_FP32:
            args = launch.op_args()
            _fused_step_states_op(
                *args[:5], launch.exp_avg_scales, launch.exp_avg_sq_scales, *args[5:],
                launch.state_stochastic, launch.grad_scale, launch.found_inf,
            )  # fmt: skip
        elif amp:
            _fused_step_amp_op(*launch.op_args(), launch.grad_scale, launch.found_inf)
        else:
            _fused_step_op(*launch.op_args())
        return
    _fused_step_impl(launch)
    written = [*launch.params, *launch.exp_avgs, *launch.exp_avg_sqs, *launch.max_exp_avg_sqs]
    written += [*launch.exp_avg_scales, *launch.exp_avg_sq_scales]
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
_fused_step_states_op.register_fake(_no_output)


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
    state_rounding: str = "stochastic",
    exp_avg_scales: list[torch.Tensor] | None = None,
    exp_avg_sq_scales: list[torch.Tensor] | None = None,
) -> None:
    """One fused AdamW(-SR) step over many tensors of one dtype, in place, in one kernel launch.

    Args:
        params: contiguous tensors, all fp32 or all bf16, on one device (CUDA, or CPU with
            ``TRITON_INTERPRET=1``); updated in place.
        grads: contiguous tensors of the params' shapes, all fp32 or all bf16.
        exp_avgs, exp_avg_sqs: contiguous tensors of the params' shapes, all of one dtype, which is
            the state format (``AdamWSR``'s ``state_dtype``): fp32, bf16 (rounded per
            ``state_rounding``) or uint8 (8-bit codes, ``state_codes``; then ``exp_avg_scales`` and
            ``exp_avg_sq_scales`` are required and no amsgrad); updated in place.
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
        state_rounding: bf16 / 8-bit moments: ``"stochastic"`` (default; the bits of det-core's
            ``STREAM_EXP_AVG_SR`` / ``STREAM_EXP_AVG_SQ_SR`` at each element's global index) or
            ``"nearest"``. No effect on fp32 moments.
        exp_avg_scales, exp_avg_sq_scales: 8-bit moments: contiguous uint8 tensors, one per param,
            of ``ceil(numel / 32)`` block scales (``states.scale_shape``); updated in place. With
            8-bit moments every segment (every param with ``base_indices``) must start on a
            multiple of 32 in the global and the local index; the default ``base_indices`` then
            start every param on a multiple of 32.

    Raises:
        TypeError: unsupported dtypes (moments other than fp32, bf16 or uint8, or of mixed dtypes);
            a seed that is not an integer (a bool, a float); ``grad_scale`` or ``found_inf`` not an
            fp32 tensor.
        ValueError: mismatched lengths, shapes, devices or layouts; 8-bit moments with amsgrad,
            without their scales or with a segment off the block grid; an unknown
            ``state_rounding``; a seed outside ``[0, 2**64)``;
            a step outside ``[1, 2**24 - 1]`` or not an integer; ``lr < 0``, a beta outside
            ``[0, 1)``, ``eps < 0`` or ``weight_decay < 0`` (NaN included); ``grad_scale`` or
            ``found_inf`` with other than 1 element. Every check runs before anything is written:
            a rejected call leaves params and states untouched.

    **Determinism:** each element's result is a pure function of its inputs, the hyperparameters,
    ``(seed, step)``, ``grad_scale`` and its global index (with 8-bit moments: of its block of 32
    global indices): identical run to run, for any grouping of tensors into launches, any split of
    a tensor into shards with matching indices (8 bits: split on the block grid), and bitwise
    equal to ``reference.adamw_sr_step_reference``. Not guaranteed across Triton versions or GPU
    models.

    Method: AdamW (Loshchilov & Hutter, ICLR 2019); stochastic rounding (Gupta et al., ICML 2015);
    8-bit states: block-wise quantization (Dettmers et al., ICLR 2022) with power-of-two block
    scales (OCP Microscaling formats), see ``state_codes``.
    """
    max_exp_avg_sqs = list(max_exp_avg_sqs or [])
    seed = rng.as_seed(seed, "adamw_sr_step")
    _check_hyperparameters(lr, (beta1, beta2), eps, weight_decay, "adamw_sr_step")
    state_rounding = states.check_state_rounding(state_rounding, "adamw_sr_step")
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    moment_dtype = exp_avgs[0].dtype if n and len(exp_avgs) else torch.float32
    quantized = moment_dtype == torch.uint8
    if quantized:
        states.check_combination(states.EIGHT_BIT, amsgrad, "adamw_sr_step")
        lists["exp_avg_scales"] = list(exp_avg_scales or [])
        lists["exp_avg_sq_scales"] = list(exp_avg_sq_scales or [])
    for name, values in lists.items():
        if len(values) != n:
            raise ValueError(
                f"adamw_sr_step: {name} has {len(values)} entries but params has {n}; give one per param"
            )
    if n == 0:
        return
    device = runtime.check_kernel_device(
        *params, *grads, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs, *lists.get("exp_avg_scales", []),
        *lists.get("exp_avg_sq_scales", []), op="adamw_sr_step",
    )  # fmt: skip
    if {p.dtype for p in params} - {params[0].dtype} or params[0].dtype not in _SUPPORTED_PARAM_DTYPES:
        found = sorted({str(p.dtype) for p in params})
        raise TypeError(f"adamw_sr_step: params must be all float32 or all bfloat16, got {found}")
    if {g.dtype for g in grads} - {grads[0].dtype} or grads[0].dtype not in _SUPPORTED_GRAD_DTYPES:
        found = sorted({str(g.dtype) for g in grads})
        raise TypeError(f"adamw_sr_step: grads must be all float32 or all bfloat16, got {found}")
    if moment_dtype not in (torch.float32, torch.bfloat16, torch.uint8):
        raise TypeError(
            f"adamw_sr_step: moments must be float32, bfloat16 or uint8 (8-bit codes), got {moment_dtype}"
        )
    for i, p in enumerate(params):
        for name, values in lists.items():
            t = values[i]
            scale = name.endswith("_scales")
            want = states.scale_shape(tuple(p.shape)) if scale else tuple(p.shape)
            if tuple(t.shape) != want:
                raise ValueError(f"adamw_sr_step: {name}[{i}] has shape {tuple(t.shape)}, expected {want}")
            want_dtype = torch.uint8 if scale else moment_dtype
            if name != "grads" and t.dtype != want_dtype:
                raise TypeError(
                    f"adamw_sr_step: {name}[{i}] must be {want_dtype} (as exp_avgs[0] says), got {t.dtype}"
                )
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
            align = state_codes.QUANT_BLOCK if quantized else BASE_INDEX_ALIGNMENT
            base_indices = default_base_indices((p.numel() for p in params), [align] * n)
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
    if quantized:
        for i, p in enumerate(params):
            rows = segments[segments[:, 0] == i, 1:].tolist()
            states.check_8bit_segments(rows, tuple(p.shape), "adamw_sr_step")
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
            state_stochastic=state_rounding == "stochastic",
            exp_avg_scales=lists.get("exp_avg_scales", []),
            exp_avg_sq_scales=lists.get("exp_avg_sq_scales", []),
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
        hyper = to_device_async(torch.tensor([float(lr), *rest], dtype=torch.float64), device)
        if cache is not None:
            cache.put(key, hyper)
    return hyper


# --------------------------------------------------------------------------- the optimizer


class AdamWSR(torch.optim.Optimizer):
    """AdamW with the whole step fused in Triton and stochastic rounding of bf16 weights.

    A drop-in for ``torch.optim.AdamW``: same arguments, param groups, LR-scheduler support and
    ``state_dict`` layout (``step`` as an fp32 tensor, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``). Parameters may be fp32 (written back unrounded) or bf16 (written back with
    stochastic rounding by default, no fp32 master copy needed); gradients fp32 or bf16; moments
    fp32 (default), bf16 or 8-bit (``state_dtype``).

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
        state_dtype: how ``exp_avg`` and ``exp_avg_sq`` are stored (a group may give its own):
            ``torch.float32`` (default: unrounded, 8 bytes/param), ``torch.bfloat16`` (4 bytes/param)
            or ``"8bit"`` (block-quantized codes, ``adamw_sr.state_codes``: 1 byte each plus one
            scale byte per block of 32 elements, 2.0625 bytes/param). The moments are updated in
            fp32 and the step uses those values; only the stored copies are rounded, on their own
            Philox streams (det-core's ``STREAM_EXP_AVG_SR``, ``STREAM_EXP_AVG_SQ_SR``). With
            ``"8bit"`` a block is 32 consecutive global indices: each param starts on a block (the
            default indices do that), each shard of a param must too (else ``ValueError`` at the
            step), and ``amsgrad`` is refused. Param groups store the name as a string
            (``"float32"``, ``"bfloat16"``, ``"8bit"``), which these strings also select.
        state_rounding: ``"stochastic"`` (default, unbiased) or ``"nearest"`` (nearest-even): how
            the moments are rounded into bf16 or 8 bits. No effect with fp32 states.

    Raises:
        ValueError: an out-of-range hyperparameter (as ``torch.optim.AdamW``: ``lr < 0``, a beta
            outside ``[0, 1)``, ``eps < 0``, ``weight_decay < 0``, NaN; a seed outside
            ``[0, 2**64)``), an unsupported flag (``foreach`` not ``None``, ``fused=False``,
            ``differentiable=True``, ``capturable=True`` with non-CUDA params), an unsupported
            ``state_dtype`` (the message lists the supported ones) or ``state_rounding``,
            ``amsgrad`` with ``state_dtype="8bit"``, an empty or non-contiguous param, params on
            several devices.
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
    guaranteed across Triton versions or GPU models (only expected, see the docs). The same holds
    for bf16 and 8-bit moments: their rounding bits are keyed like the weights' (own streams), and
    an 8-bit block's scale is computed from the whole block of 32 global indices, which no shard
    boundary may split (such a sharding is refused with a ``ValueError`` naming the block size).
    ``load_state_dict`` of a checkpoint written with another ``state_dtype`` raises ``ValueError``
    (no conversion).

    Method: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019); Kingma & Ba,
    "Adam" (ICLR 2015); AMSGrad (Reddi et al., ICLR 2018); stochastic rounding (Gupta et al.,
    ICML 2015); Philox4x32-10 (Salmon et al., SC'11); 8-bit states: Dettmers et al., "8-bit
    Optimizers via Block-wise Quantization" (ICLR 2022), with the power-of-two block scales of the
    OCP Microscaling (MX) formats.
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
        state_dtype: torch.dtype | str = torch.float32,
        state_rounding: str = "stochastic",
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() == 1 and not 0.0 <= float(lr):
            # torch.optim.AdamW reads a tensor lr here too (a one-off sync at construction)
            raise ValueError(f"AdamWSR: Invalid learning rate: {float(lr)}; it must be >= 0")
        _check_hyperparameters(lr, betas, eps, weight_decay, "AdamWSR")
        seed = rng.as_seed(seed, "AdamWSR")
        if stochastic_rounding not in (None, True, False):
            raise ValueError(f"stochastic_rounding must be None, True or False, got {stochastic_rounding!r}")
        state_dtype = states.canonical_state_dtype(state_dtype, "AdamWSR")
        state_rounding = states.check_state_rounding(state_rounding, "AdamWSR")
        states.check_combination(state_dtype, amsgrad, "AdamWSR")
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
            seed=seed, stochastic_rounding=stochastic_rounding, base_index=None, state_dtype=state_dtype,
            state_rounding=state_rounding,
        )  # fmt: skip
        self._base_index_cache = {}
        self._segments_cache = runtime.PlanCache(limit=64)  # param list -> its launch's index segments
        self._hyper_cache = runtime.PlanCache(limit=256)  # hyperparameter values -> their device tensor
        # "unchecked": a loaded state not yet validated (states this class creates are valid by
        # construction, so the per-tensor state check runs once per load, not every step). A dict
        # mutated in place: dynamo (torch 2.11) refuses setattr on the optimizer while tracing.
        # "state_dtypes": each group's state_dtype when last checked (an edit re-checks the states)
        self._state_flags = {"unchecked": True, "state_dtypes": ()}
        super().__init__(params, defaults)

    # ----------------------------------------------------------------- groups and indices

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as ``torch.optim.Optimizer.add_param_group``), validating its params.

        Raises:
            TypeError: a param is fp16, complex or not floating point; the group's ``seed`` is not
                an integer (a bool or a float).
            ValueError: a param is empty or non-contiguous, on another device than the others,
                ``base_index`` does not give one entry per param, or ``seed`` is outside ``[0, 2**64)``;
                the group sets ``foreach``, ``fused=False``, or ``capturable=True`` with non-CUDA params;
                an unsupported ``state_dtype`` or ``state_rounding``, or amsgrad with 8-bit states.
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
            group["state_dtype"] = states.canonical_state_dtype(group["state_dtype"], "AdamWSR")
            group["state_rounding"] = states.check_state_rounding(group["state_rounding"], "AdamWSR")
            states.check_combination(group["state_dtype"], group["amsgrad"], "AdamWSR")
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
            aligns = [
                states.base_index_alignment(g["state_dtype"]) for g in self.param_groups for _ in g["params"]
            ]
            defaults = default_base_indices((p.numel() for p in params), aligns)  # global numel for a DTensor
            explicit = [
                b for g in self.param_groups for b in (g.get("base_index") or [None] * len(g["params"]))
            ]
            out = {id(p): d if b is None else b for p, d, b in zip(params, defaults, explicit, strict=True)}
            self._base_index_cache.update(out)
        return self._base_index_cache

    def _segments(self, ps: list, base: dict[int, int], state_dtype: str = states.FLOAT32) -> torch.Tensor:
        """``(slot, local_start, length, global_start)`` rows of one launch (cached per param list).

        Raises:
            ValueError: with 8-bit states, a param or shard that does not start on a block.
        """
        key = tuple(id(p) for p in ps)
        segments = self._segments_cache.get(key)
        if segments is None:
            rows = []
            for slot, p in enumerate(ps):
                runs = local_segments(p, base[id(p)])
                if state_dtype == states.EIGHT_BIT:
                    _check_8bit_layout(p, base[id(p)], runs)
                rows.extend((slot, *seg) for seg in runs)
            segments = self._segments_cache.put(key, torch.tensor(rows, dtype=torch.int64).reshape(-1, 4))
        return segments

    def _launch_plans(self, group: dict, with_grad: list, base: dict[int, int]) -> list:
        """``[(params, segments)]``: one launch per (param dtype, grad dtype), the kernel being
        specialized on both; built (and checked) before any state changes."""
        by_dtype: dict = {}
        for p in with_grad:
            by_dtype.setdefault((p.dtype, p.grad.dtype), []).append(p)
        return [(ps, self._segments(ps, base, group["state_dtype"])) for ps in by_dtype.values()]

    # ----------------------------------------------------------------- state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as ``torch.optim.Optimizer`` does, but keep every moment in its group's
        ``state_dtype`` (torch casts floating state to the param dtype, which would round fp32
        moments to bf16 and turn 8-bit codes into numbers) and copy every state tensor (torch keeps a
        reference to the caller's ``step`` tensors).

        Each checkpoint param group carries its ``state_dtype``; one without it (a ``torch.optim.AdamW``
        state_dict, or one saved before ``state_dtype`` existed) holds float moments, which load into
        ``torch.float32`` states (cast to fp32, as before). Moments are never converted between
        formats: a checkpoint of another ``state_dtype`` is refused.

        Raises:
            ValueError: a checkpoint group's ``state_dtype`` differs from this optimizer's group's,
                or a saved state does not hold its format's tensors (moment dtype, 8-bit scales).
                Checked before anything is loaded: the optimizer is left as it was.
        """
        saved = state_dict["state"]
        self._check_loadable(state_dict)
        super().load_state_dict(state_dict)
        order = [(p, g) for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for pid, (p, group) in zip(saved_ids, order, strict=True):
            if pid in saved:
                fp32 = group["state_dtype"] == states.FLOAT32
                for key in (*_STATE_KEYS, *states.SCALE_KEYS):
                    value = saved[pid].get(key)
                    if value is None:
                        continue
                    dtype = torch.float32 if fp32 else value.dtype
                    # a copy, so in-place steps never write into the caller's state_dict
                    if _is_dtensor(value):
                        self.state[p][key] = value.to(dtype=dtype, copy=True)
                    else:
                        self.state[p][key] = value.to(device=_local(p).device, dtype=dtype, copy=True)
                step = self.state[p].get("step")
                if isinstance(step, torch.Tensor) and step is saved[pid].get("step"):
                    self.state[p]["step"] = step.clone()  # torch would alias the caller's step tensor
        self._base_index_cache = {}
        self._segments_cache.clear()
        self._state_flags = {"unchecked": True, "state_dtypes": ()}

    def _check_loadable(self, state_dict: dict) -> None:
        """``load_state_dict``'s format checks, before anything changes (see there)."""
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            return  # torch's own load names this mismatch
        for i, (mine, theirs) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            raw = theirs.get("state_dtype", states.FLOAT32)
            try:
                saved_dtype = states.canonical_state_dtype(raw, "AdamWSR.load_state_dict")
            except ValueError as e:
                raise ValueError(f"param group {i} of the checkpoint: {e}") from None
            if saved_dtype != mine["state_dtype"]:
                raise ValueError(
                    f"AdamWSR.load_state_dict: param group {i} of the checkpoint has state_dtype="
                    f"{saved_dtype!r}, this optimizer's group has state_dtype={mine['state_dtype']!r}; "
                    "moments are not converted between formats: build the optimizer with "
                    f"state_dtype={saved_dtype!r} to resume this checkpoint"
                )
            want = states.moment_dtype(saved_dtype)
            for pid in theirs.get("params", []):
                state = state_dict["state"].get(pid) or {}
                keys = (*_STATE_KEYS, *(states.SCALE_KEYS if saved_dtype == states.EIGHT_BIT else ()))
                for key in keys:
                    value = state.get(key)
                    if value is None:
                        if key in states.SCALE_KEYS and state.get("exp_avg") is not None:
                            raise ValueError(
                                f"AdamWSR.load_state_dict: the 8-bit state of param {pid} (group {i}) "
                                f"lacks '{key}'"
                            )
                        continue
                    ok = value.is_floating_point() if want == torch.float32 and key in _STATE_KEYS else (
                        value.dtype == (torch.uint8 if key in states.SCALE_KEYS else want)
                    )  # fmt: skip
                    if not ok:
                        raise ValueError(
                            f"AdamWSR.load_state_dict: state '{key}' of param {pid} (group {i}, "
                            f"state_dtype={saved_dtype!r}) has dtype {value.dtype}; that format stores "
                            f"{torch.uint8 if key in states.SCALE_KEYS else want}"
                        )

    def _check_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        """A loaded or existing state must hold its format's tensors at the param's shape and a step."""
        states.check_state(p, state, group["state_dtype"], group["amsgrad"])

    def __setstate__(self, state: dict) -> None:
        """Fill group options a loaded state lacks (e.g. a ``torch.optim.AdamW`` state_dict), like torch."""
        super().__setstate__(state)
        self._state_flags = {"unchecked": True, "state_dtypes": ()}
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
            group.setdefault("state_dtype", states.FLOAT32)  # a checkpoint without it has float moments
            group.setdefault("state_rounding", "stochastic")

    # ----------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every param with a gradient (one fused launch per group and dtype pair).

        Shapes, dtypes and the **Determinism** guarantees are the class's (see ``AdamWSR``).

        Raises:
            RuntimeError: a sparse gradient; capture with ``capturable=False``; a malformed loaded state,
                or a state of another format than its group's ``state_dtype`` (an edited group).
            ValueError: a gradient of another shape, device or layout than its param; a group's
                ``seed`` outside ``[0, 2**64)`` or ``lr``, ``betas``, ``eps``, ``weight_decay``
                outside torch.optim.AdamW's ranges, an unsupported ``state_dtype`` or
                ``state_rounding``, amsgrad with 8-bit states (param_groups are re-checked at each
                eager step); with 8-bit states, a param or shard not starting on a block of 32 global
                indices (the message names the block size and the fixes).
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
                group["state_dtype"] = states.canonical_state_dtype(group["state_dtype"], "AdamWSR.step")
                group["state_rounding"] = states.check_state_rounding(group["state_rounding"], "AdamWSR.step")
                states.check_combination(group["state_dtype"], group["amsgrad"], "AdamWSR.step")
            with_grad = [p for p in group["params"] if p.grad is not None]
            self._check_grads(with_grad)
            if with_grad:  # CPU params need the Triton interpreter: say so before any state is touched
                runtime.check_kernel_device(*(_local(p) for p in with_grad), op="AdamWSR.step")
                if group["capturable"] and _local(with_grad[0]).device.type != "cuda":
                    self._check_device_flags(group)  # a loaded param group may set capturable
            work.append((group, with_grad))
        if not torch.compiler.is_compiling():
            # a group's state_dtype edited since the last step: indices (8-bit params start on a
            # block) and launch segments are rebuilt, and existing states are checked against it
            formats = tuple(g["state_dtype"] for g in self.param_groups)
            if formats != self._state_flags["state_dtypes"]:
                self._base_index_cache.clear()
                self._segments_cache.clear()
                self._state_flags["unchecked"] = True
                self._state_flags["state_dtypes"] = formats
        check_states = self._state_flags["unchecked"] or torch.compiler.is_compiling()
        if check_states:
            for group in self.param_groups:
                for p in group["params"]:
                    if self.state.get(p):
                        self._check_state(p, self.state[p], group)
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
        # launch segments (8-bit: checked to lie on the block grid) before any state changes
        plans = [(group, with_grad, self._launch_plans(group, with_grad, base)) for group, with_grad in work]
        for group, with_grad, launches in plans:
            if with_grad:
                self._group_step(group, with_grad, launches, *amp)
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
        launches: list,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        amsgrad, capturable, state_dtype = group["amsgrad"], group["capturable"], group["state_dtype"]
        device = _local(with_grad[0]).device
        all_states = [self.state[p] for p in with_grad]  # one (Python-level) tensor hash per param
        for p, state in zip(with_grad, all_states, strict=True):
            if len(state) == 0:
                step_device = device if capturable or found_inf is not None else torch.device("cpu")
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=step_device)
                state.update(states.new_state(p, state_dtype, dtensor=_is_dtensor(p)))
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = states.zero_moment(p, state_dtype)
        if found_inf is None:
            torch._foreach_add_([s["step"] for s in all_states], 1.0)
        else:
            # a skipped step leaves the counts as they are, decided on the device: the counts move
            # there (once; torch's fused AdamW keeps them there too) and advance after the launch
            for state in all_states:
                if state["step"].device != device:
                    state["step"] = to_device_async(state["step"], device)
        hyper = _hyper_tensor(
            group["lr"], group["betas"], group["eps"], group["weight_decay"], device, self._hyper_cache
        )
        quantized = state_dtype == states.EIGHT_BIT
        for ps, segments in launches:
            ps_states = [self.state[p] for p in ps]
            steps = torch.stack([s["step"] for s in ps_states]).to(torch.float32)
            if steps.device != device:
                steps = to_device_async(steps, device)
            if found_inf is not None:
                steps = steps + 1.0  # the step number of this step; the counts advance below
            _fused_step(
                _StepLaunch(
                    params=[_local(p) for p in ps],
                    grads=[_local(p.grad) for p in ps],
                    exp_avgs=[_local(s["exp_avg"]) for s in ps_states],
                    exp_avg_sqs=[_local(s["exp_avg_sq"]) for s in ps_states],
                    max_exp_avg_sqs=[_local(s["max_exp_avg_sq"]) for s in ps_states] if amsgrad else [],
                    steps=steps,
                    hyper=hyper,
                    segments=segments,
                    seed=group["seed"],
                    amsgrad=amsgrad,
                    maximize=group["maximize"],
                    stochastic=ps[0].dtype == torch.bfloat16 and group["stochastic_rounding"] is not False,
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                    state_stochastic=group["state_rounding"] == "stochastic",
                    exp_avg_scales=[_local(s["exp_avg_scale"]) for s in ps_states] if quantized else [],
                    exp_avg_sq_scales=[_local(s["exp_avg_sq_scale"]) for s in ps_states] if quantized else [],
                )
            )
        if found_inf is not None:  # + 1 where no inf was found, + 0.0 (the same bits) where one was
            advance = (found_inf == 0).to(torch.float32).reshape(())
            torch._foreach_add_([s["step"] for s in all_states], [advance] * len(all_states))
