"""The functional fused step: ``fused_step``, the one path from every caller to the kernel, and
``adamw_sr_step``, its public form that checks its arguments first; their launch plans (one cache)
and ``torch.library`` custom ops (opaque to ``torch.compile``).

One front door (class -> functional -> backend): ``AdamWSR.step`` (validated param groups and
state, both its full and its recorded eager path) and ``adamw_sr_step`` (validated arguments) each
build a ``StepLaunch`` and call ``fused_step``, which runs it through a custom op (under a
compiler or a dispatch mode) or straight through its ``_launch()`` -> ``_launch.launch_fused_step`` ->
``_kernel``. ``AdamWSR``'s recorded launches (``_step_cache.LaunchSet``) are caches that
``fused_step`` reads (the plan, the written tensors), not another way to the kernel.

Reading order: ``StepLaunch`` (one launch's tensors and options), the plan cache, the custom ops,
``fused_step`` (op or direct launch), ``adamw_sr_step`` and the device scalars it builds
(``hyper_tensor``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from det_core import rng, runtime
from det_core.launch import PlanCache
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _kernel, _state_codes, _states
from ._checks import (
    SUPPORTED_GRAD_DTYPES,
    SUPPORTED_PARAM_DTYPES,
    amp_scalar,
    check_hyperparameters,
    first_repeat,
)
from ._launch import LaunchPlan, launch_fused_step, to_device_async
from .indices import BASE_INDEX_ALIGNMENT, PLAIN_TENSOR_TYPES, default_base_indices, first_overlap

__all__ = [
    "MAX_STEP",
    "PLAN_CACHE",
    "StepLaunch",
    "adamw_sr_step",
    "dispatch_mode_active",
    "fused_step",
    "get_plan",
    "hyper_tensor",
    "increment_versions",
]


# Steps travel as fp32 (torch's layout of ``state["step"]``), exact for integers up to 2**24; the
# next increment (2**24 + 1) rounds back to 2**24, so a step count at or past it would repeat its
# stochastic-rounding bits. The kernel's own counters (Philox word, 32-bit exponent) hold 2**32.
MAX_STEP = 2**24 - 1


# launch tables by addresses, dtypes and index segments (one per param list in use; rebuilt on a miss)
PLAN_CACHE = PlanCache(limit=64)


@dataclasses.dataclass(eq=False)
class StepLaunch:
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
    8-bit block scales (uint8), one tensor per param, else ``[]``. Built by callers that have
    validated every tensor (``adamw_sr_step``, ``AdamWSR.step``); holds no checks of its own. Not
    frozen (its ``__init__`` is then plain attribute stores, cheap enough for every eager step);
    nothing changes a built one.

    **Determinism:** a record of one launch's arguments: ``fused_step`` of equal records writes
    equal bits.
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
        """The moments' format (``_kernel.FORMAT_*``), from their dtype: fp32, bf16 or uint8 (8 bits)."""
        return _states.format_of_moments(self.exp_avgs[0].dtype)

    def op_args(self) -> tuple:
        """The custom ops' arguments in schema order (``_fused_step_op_body`` spells each one out)."""
        # seed travels as a decimal string: the schema's int is 64-bit signed, a seed is unsigned
        return (
            self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs,
            self.exp_avg_scales, self.exp_avg_sq_scales, self.steps, self.hyper, self.segments,
            str(self.seed), self.amsgrad, self.maximize, self.stochastic, self.state_stochastic,
            self.grad_scale, self.found_inf,
        )  # fmt: skip


def get_plan(launch: StepLaunch) -> LaunchPlan:
    """The ``LaunchPlan`` of ``launch``'s tensors, from ``PLAN_CACHE`` (keyed by device, dtypes, every
    tensor's address and the segments) or built and cached on a miss.

    Raises:
        RuntimeError: a miss while a CUDA graph is being captured (building copies host memory,
            which capture forbids): run one step before capturing.

    **Determinism:** a plan is a pure function of its key; the cache changes host time only.
    """
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
    plan = PLAN_CACHE.get(key)
    if plan is None:
        if launch.params[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "adamw_sr: the launch tables of this step are not built yet, and building them copies "
                "host memory, which CUDA graph capture forbids. Run one step (warm-up) before capturing."
            )
        plan = PLAN_CACHE.put(
            key,
            LaunchPlan(
                *roles, launch.segments, launch.params[0].device, state_format=launch.state_format,
                exp_avg_scales=launch.exp_avg_scales, exp_avg_sq_scales=launch.exp_avg_sq_scales,
            ),
        )  # fmt: skip
    return plan


_MUTATED = ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")


def _fused_step_op_body(
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
    """The body of the three custom ops: ``StepLaunch``'s fields in order (``StepLaunch.op_args``)."""
    launch = StepLaunch(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hyper, segments, int(seed),
        amsgrad, maximize, stochastic, grad_scale, found_inf, state_stochastic, exp_avg_scales,
        exp_avg_sq_scales,
    )  # fmt: skip
    _launch(launch, get_plan(launch))


# One schema, three ops that differ in what they declare written: fp32 moments without AMP only
# read the gradients; under AMP the unscaled gradients are written back (as torch's fused AdamW
# does); bf16 / 8-bit moments also write the 8-bit scales, and declare the gradients always (which
# costs a compiled graph a copy at most).
_OPS = {
    "fp32": torch.library.custom_op("adamw_sr::fused_step", _fused_step_op_body, mutates_args=_MUTATED),
    "fp32_amp": torch.library.custom_op(
        "adamw_sr::fused_step_amp", _fused_step_op_body, mutates_args=(*_MUTATED, "grads")
    ),
    "states": torch.library.custom_op(
        "adamw_sr::fused_step_states",
        _fused_step_op_body,
        mutates_args=(*_MUTATED, "exp_avg_scales", "exp_avg_sq_scales", "grads"),
    ),
}


def _no_output(*args) -> None:
    """The ops' fake (meta) kernel: they write in place and return nothing."""
    return None


for _op in _OPS.values():
    _op.register_fake(_no_output)


def _launch(launch: StepLaunch, plan: LaunchPlan) -> None:
    """``launch`` over ``plan`` (its tensors' plan): the one call of the backend, from the custom ops'
    body and from ``fused_step``'s eager way."""
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


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (e.g. fake tensors, a debug mode) is watching the dispatcher:
    then ``fused_step`` goes through its custom op, and ``AdamWSR`` records no launches.

    **Determinism:** a query; changes nothing.
    """
    return _get_current_dispatch_mode() is not None


def fused_step(launch: StepLaunch, record=None) -> LaunchPlan | None:
    """Run one ``StepLaunch``: the functional step of validated tensors (no checks: callers validate
    first, as ``adamw_sr_step`` and ``AdamWSR.step`` do), the one way to the kernel.

    Through a custom op when a compiler or a dispatch mode (e.g. fake tensors) is watching or the
    params are not plain tensors; in plain eager mode straight to the launch, skipping the op's
    per-tensor dispatch checks (a large part of ``step()``'s host time at thousands of tensors), and
    bumping the version counters of the tensors written in place, as the op would.

    Args:
        launch: the launch (see ``StepLaunch``).
        record: ``AdamWSR``'s recorded launch of these tensors (``_step_cache.LaunchSet``; its
            caller checked that it still holds, in plain eager mode): its plan for the gradients'
            addresses and its list of written tensors are used instead of building them.

    Returns: the ``LaunchPlan`` it launched over (``None`` through the op).

    **Determinism:** every way runs the same launch over the same plan tables: the bits of
    ``adamw_sr_step``.
    """
    amp = launch.grad_scale is not None or launch.found_inf is not None
    if record is not None:
        plan, written = record.plan_for(launch), record.written
    elif (
        torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or type(launch.params[0]) not in PLAIN_TENSOR_TYPES
    ):
        fp32 = launch.state_format == _kernel.FORMAT_FP32
        _OPS["states" if not fp32 else "fp32_amp" if amp else "fp32"](*launch.op_args())
        return None
    else:
        plan = get_plan(launch)
        written = [*launch.params, *launch.exp_avgs, *launch.exp_avg_sqs, *launch.max_exp_avg_sqs]
        written += [*launch.exp_avg_scales, *launch.exp_avg_sq_scales]
    _launch(launch, plan)
    increment_versions(written + launch.grads if amp else written)
    return plan


def increment_versions(tensors: list[torch.Tensor]) -> None:
    """Bump the autograd version counter of each tensor (any shape and dtype) written in place
    outside the dispatcher, as a custom op that mutates them would: a backward that saved one
    of them then raises instead of reading the new values.

    **Determinism:** bookkeeping only; no value changes.
    """
    try:
        torch.autograd.graph.increment_version(tensors)
    except TypeError:  # a torch whose increment_version takes one tensor at a time
        for t in tensors:
            torch.autograd.graph.increment_version(t)


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
            ``state_rounding``) or uint8 (8-bit codes, ``_state_codes``; then ``exp_avg_scales`` and
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
            the running offset with each param starting on a multiple of 8); the ranges
            ``[base_indices[i], base_indices[i] + numel)`` must be disjoint.
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
        state_rounding: bf16 / 8-bit moments: ``"stochastic"`` (default; 8 bits each of the high half
            of the param's word, det-core's ``STREAM_PARAM_SR`` at each element's global index:
            ``_state_codes.state_rounding_bits``) or
            ``"nearest"``. No effect on fp32 moments.
        exp_avg_scales, exp_avg_sq_scales: 8-bit moments: contiguous uint8 tensors, one per param,
            of ``ceil(numel / 32)`` block scales (``_states.scale_shape``); updated in place. With
            8-bit moments every segment (every param with ``base_indices``) must start on a
            multiple of 32 in the global and the local index; the default ``base_indices`` then
            start every param on a multiple of 32.

    Raises:
        TypeError: unsupported dtypes (moments other than fp32, bf16 or uint8, or of mixed dtypes);
            a seed that is not an integer (a bool, a float); ``grad_scale`` or ``found_inf`` not an
            fp32 tensor.
        ValueError: mismatched lengths, shapes, devices or layouts; one param given twice (without
            ``segments``); ``base_indices`` giving two
            params overlapping ranges of global indices; 8-bit moments with amsgrad,
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
    scales (OCP Microscaling formats), see ``_state_codes``.
    """
    max_exp_avg_sqs = list(max_exp_avg_sqs or [])
    seed = rng.as_seed(seed, "adamw_sr_step")
    check_hyperparameters(lr, (beta1, beta2), eps, weight_decay, "adamw_sr_step")
    state_rounding = _states.check_state_rounding(state_rounding, "adamw_sr_step")
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    moment_dtype = exp_avgs[0].dtype if n and len(exp_avgs) else torch.float32
    quantized = moment_dtype == torch.uint8
    if quantized:
        _states.check_combination(_states.EIGHT_BIT, amsgrad, "adamw_sr_step")
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
    if {p.dtype for p in params} - {params[0].dtype} or params[0].dtype not in SUPPORTED_PARAM_DTYPES:
        found = sorted({str(p.dtype) for p in params})
        raise TypeError(f"adamw_sr_step: params must be all float32 or all bfloat16, got {found}")
    if {g.dtype for g in grads} - {grads[0].dtype} or grads[0].dtype not in SUPPORTED_GRAD_DTYPES:
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
            want = _states.scale_shape(tuple(p.shape)) if scale else tuple(p.shape)
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
    grad_scale = amp_scalar(grad_scale, "grad_scale", device, "adamw_sr_step")
    found_inf = amp_scalar(found_inf, "found_inf", device, "adamw_sr_step")
    if segments is None:
        if base_indices is None:
            align = _state_codes.QUANT_BLOCK if quantized else BASE_INDEX_ALIGNMENT
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
        # keyed by address (an empty param, with no elements to update twice, by its position)
        addresses = (("at", p.data_ptr()) if p.numel() else ("empty", i) for i, p in enumerate(params))
        repeat = first_repeat(addresses)
        if repeat is not None:  # one launch would read and write the same elements twice
            i, j = repeat
            raise ValueError(
                f"adamw_sr_step: params[{i}] and params[{j}] are the same tensor (or start at the same "
                "address); give each param once"
            )
        hit = first_overlap([(b, p.numel()) for p, b in zip(params, base_indices, strict=True)])
        if hit is not None:  # shared global indices would share rounding bits
            (i, bi), (j, bj) = ((k, base_indices[k]) for k in hit)
            raise ValueError(
                f"adamw_sr_step: params[{i}] (global indices [{bi}, {bi + params[i].numel()})) and "
                f"params[{j}] (global indices [{bj}, {bj + params[j].numel()})) overlap: their "
                "stochastic-rounding bits would be shared. Give each param a disjoint range "
                "[base_indices[i], base_indices[i] + numel), or omit base_indices for the defaults."
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
            _states.check_8bit_segments(rows, tuple(p.shape), "adamw_sr_step")
    hyper = hyper_tensor(lr, (beta1, beta2), eps, weight_decay, device)
    fused_step(
        StepLaunch(
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


def hyper_tensor(lr, betas, eps, weight_decay, device, cache: PlanCache | None = None) -> torch.Tensor:
    """fp64 ``[lr, beta1, beta2, eps, weight_decay]`` on ``device`` (lr may be a device tensor).

    With ``cache``, kept by value: a float lr's tensor whole, a tensor lr's constant tail (groups
    with equal hyperparameters share the read-only tensor; the key holds no ``id(group)``, which
    torch 2.11's dynamo cannot trace). Checks nothing (see ``check_hyperparameters``).

    **Determinism:** the values exactly as given (fp64 holds every float lr); the kernels round them
    once, as ``reference.step_scalars`` does.
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
