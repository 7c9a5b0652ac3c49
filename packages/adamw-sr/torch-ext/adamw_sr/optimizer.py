"""``AdamWSR``: a drop-in ``torch.optim.AdamW`` whose whole step is one fused Triton kernel per
(param dtype, grad dtype) group, with stochastic rounding of bf16 weights keyed by global element index,
and moments stored in fp32, bf16 or 8 bits (``state_dtype``; formats in ``_states``, ``_state_codes``).

The class validates its param groups, keeps the state and builds each step's launches, which it
runs through the functional step ``functional.fused_step`` (the one way to the kernel, also behind
``adamw_sr_step``, re-exported here), on both its full and its recorded (``_step_cache``) path; the
global element index is ``indices``, the host launch code ``_launch``, the kernels ``_kernel``, and
the checkpoint checks and copies behind ``load_state_dict`` ``_state_dict``.
"""

from __future__ import annotations

import torch
from det_core import rng, runtime
from det_core.launch import PlanCache

from . import _states
from ._checks import (
    amp_scalar,
    check_base_index,
    check_device_flags,
    check_flags,
    check_grads,
    check_hyperparameters,
    first_repeat,
    param_problem,
)
from ._launch import LaunchPlan, to_device_async
from ._state_dict import (
    STATE_KEYS,
    check_loadable,
    check_loaded_states,
    copy_loaded_states,
    fill_group_defaults,
)
from ._step_cache import GroupLaunches, LaunchSet, grad_mask, pack_steps, packed_steps
from .functional import StepLaunch, adamw_sr_step, dispatch_mode_active, fused_step, hyper_tensor
from .indices import (
    PLAIN_TENSOR_TYPES,
    check_8bit_layout,
    check_disjoint_indices,
    default_base_indices,
    first_overlap,
    is_dtensor,
    local_segments,
    local_tensor,
    param_starts,
)

__all__ = ["AdamWSR", "adamw_sr_step", "default_base_indices", "local_segments"]


class AdamWSR(torch.optim.Optimizer):
    """AdamW with the whole step fused in Triton and stochastic rounding of bf16 weights.

    A drop-in for ``torch.optim.AdamW``: same arguments, param groups, LR-scheduler support and
    ``state_dict`` layout (``step`` as an fp32 tensor, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``). Parameters may be fp32 (written back unrounded) or bf16 (written back with
    stochastic rounding by default, no fp32 master copy needed); gradients fp32 or bf16; moments
    fp32 (default), bf16 or 8-bit (``state_dtype``).

    Args:
        params: iterable of tensors or param-group dicts. Tensors must be contiguous (zero-size ones
            are accepted, as torch.optim.AdamW accepts them: zero-size state, no global index), real,
            fp32 or bf16, all on one device (CUDA, or CPU with ``TRITON_INTERPRET=1``). A group may
            give ``base_index``: a list with one int (or ``None``) per param, the global index of its
            first element; the ranges ``[base_index, base_index + numel)`` of all params (defaults
            included) must be disjoint.
        lr: learning rate, float or 1-element tensor (a CUDA tensor for graph capture).
        betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW`` (decoupled decay,
            computed as ``p - p * (lr * weight_decay)``, not ``p * (1 - lr * weight_decay)``: see
            docs/adamw-sr.md).
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
            or ``"8bit"`` (block-quantized codes, ``adamw_sr._state_codes``: 1 byte each plus one
            scale byte per block of 32 elements, 2.0625 bytes/param). The moments are updated in
            fp32 and the step uses those values; only the stored copies are rounded, with 8 bits
            each of the high half of the param's Philox word (det-core's ``STREAM_PARAM_SR``). With
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
            ``amsgrad`` with ``state_dtype="8bit"``, a non-contiguous param, params on
            several devices, one Parameter listed twice in a group, two params whose ``base_index``
            ranges overlap (message names both).
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
    for bf16 and 8-bit moments: their rounding bits are keyed like the weights' (own stream), and
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
            raise ValueError(f"AdamWSR: Invalid learning rate: {float(lr):.7g}; it must be >= 0")
        check_hyperparameters(lr, betas, eps, weight_decay, "AdamWSR")
        seed = rng.as_seed(seed, "AdamWSR")
        if stochastic_rounding not in (None, True, False):
            raise ValueError(f"stochastic_rounding must be None, True or False, got {stochastic_rounding!r}")
        state_dtype = _states.canonical_state_dtype(state_dtype, "AdamWSR")
        state_rounding = _states.check_state_rounding(state_rounding, "AdamWSR")
        _states.check_combination(state_dtype, amsgrad, "AdamWSR")
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
        self._segments_cache = PlanCache(limit=64)  # param list -> its launch's index segments
        self._hyper_cache = PlanCache(limit=256)  # hyperparameter values -> their device tensor
        # id(group) -> the group's recorded launches (step_cache), re-checked at every eager step
        self._launch_records: dict = {}
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
                an integer (a bool or a float), a hyperparameter is not a real number, ``amsgrad``
                or ``maximize`` is not a bool, a ``base_index`` entry is not an integer.
            ValueError: a param is non-contiguous, on another device than the others,
                the group lists one Parameter twice, a param's memory overlaps another's (in any
                group), ``base_index`` does not give one entry per
                param, gives a param a range of global indices outside ``[0, 2**63)`` or one that
                overlaps another param's, ``seed`` is outside ``[0, 2**64)``, the group's ``lr``,
                ``betas``, ``eps`` or ``weight_decay`` is outside torch.optim.AdamW's ranges;
                the group sets ``foreach``, ``fused=False``, or ``capturable=True`` with non-CUDA params;
                an unsupported ``state_dtype`` or ``state_rounding``, or amsgrad with 8-bit states.
            RuntimeError: ``fused=True`` with params where the fused step cannot run (CPU without
                the Triton interpreter).
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        repeat = first_repeat(id(p) for p in group["params"])  # torch only warns
        if repeat is not None:
            self.param_groups.pop()
            raise ValueError(
                f"AdamWSR: the param group lists one Parameter twice (positions {repeat[0]} and {repeat[1]}, "
                f"shape {tuple(group['params'][repeat[0]].shape)}); each param must appear once (pass "
                "list(dict.fromkeys(params)) to drop repeats)"
            )
        devices = {local_tensor(p).device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            self.param_groups.pop()
            raise ValueError(
                f"AdamWSR: all params must be on one device (one fused launch), got "
                f"{sorted(map(str, devices))}; use one optimizer per device"
            )
        for p in group["params"]:
            problem = param_problem(p)
            if problem:
                self.param_groups.pop()
                raise (TypeError if "dtype" in problem else ValueError)(f"AdamWSR: {problem}")
        params = [p for g in self.param_groups for p in g["params"]]
        # memory as byte ranges (params are contiguous): overlapping views would be updated twice
        memory = [(t.data_ptr(), t.numel() * t.element_size()) for t in map(local_tensor, params)]
        overlap = first_overlap(memory)
        if overlap is not None:
            self.param_groups.pop()
            a, b = (params[i] for i in overlap)
            raise ValueError(
                f"AdamWSR: two params share memory (shapes {tuple(a.shape)} and {tuple(b.shape)}, "
                "overlapping views of one buffer): the fused step would update the shared elements twice, "
                "in an order that is not fixed; give each param its own memory, or views that do not overlap"
            )
        try:
            if group["foreach"] is not None or group["fused"] not in (None, True):
                raise ValueError(
                    f"AdamWSR: a param group's foreach must be None and fused None or True (the step is "
                    f"always fused), got foreach={group['foreach']!r}, fused={group['fused']!r}"
                )
            check_device_flags(group)
        except (RuntimeError, ValueError):
            self.param_groups.pop()
            raise
        try:
            check_group_options(group, "AdamWSR")
            group["base_index"] = check_base_index(group.get("base_index"), group["params"], "AdamWSR")
            check_disjoint_indices(self.param_groups, "AdamWSR")
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._clear_launch_caches()

    def _clear_launch_caches(self) -> None:
        """Forget the base indices, launch segments and recorded launches (params, groups, state
        formats or the state changed)."""
        self._base_index_cache.clear()
        self._segments_cache.clear()
        self._launch_records.clear()

    def _base_indices(self) -> dict[int, int]:
        """id(param) -> global index of its first element (running offset, or the group's override)."""
        # filled in place, never reassigned inside step(): dynamo (torch 2.11) refuses a setattr on
        # the optimizer object while tracing a compiled step
        if not self._base_index_cache:
            self._base_index_cache.update((id(p), start) for p, start, _ in param_starts(self.param_groups))
        return self._base_index_cache

    def _segments(self, ps: list, base: dict[int, int], state_dtype: str = _states.FLOAT32) -> torch.Tensor:
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
                if state_dtype == _states.EIGHT_BIT:
                    check_8bit_layout(p, base[id(p)], runs)
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
                or a saved state does not hold its format's tensors (moment dtype, 8-bit scales), or
                the checkpoint's ``base_index`` gives two params overlapping ranges of global indices
                (or not one entry per param); a checkpoint group's option out of range (as
                ``add_param_group`` checks: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``seed``,
                ``base_index``, ``state_rounding``); a state tensor of another shape than its param, a
                missing moment or ``step``, a negative ``step`` or a negative second moment.
            TypeError: a checkpoint group's option of the wrong type (``seed``, ``amsgrad``,
                ``maximize``, ``base_index``, a hyperparameter).

        Every check runs before the load takes effect: a refused checkpoint leaves the optimizer
        (params, states, groups) as it was.
        """
        saved = state_dict["state"]
        check_loadable(self.param_groups, state_dict)
        before = (self.state, self.param_groups, self._state_flags)  # torch's load replaces both
        super().load_state_dict(state_dict)
        try:
            copy_loaded_states(self.state, self.param_groups, saved, state_dict["param_groups"])
            where = "AdamWSR.load_state_dict"
            for i, group in enumerate(self.param_groups):
                try:
                    check_group_options(group, where)
                    group["base_index"] = check_base_index(group.get("base_index"), group["params"], where)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"param group {i} of the checkpoint: {e}") from None
            check_loaded_states(self.param_groups, self.state)
        except Exception:
            self.state, self.param_groups, self._state_flags = before
            self._clear_launch_caches()
            raise
        self._clear_launch_caches()
        self._state_flags = {"unchecked": True, "state_dtypes": ()}

    def __setstate__(self, state: dict) -> None:
        """Fill group options a loaded state lacks (e.g. a ``torch.optim.AdamW`` state_dict), like torch."""
        super().__setstate__(state)
        self._state_flags = {"unchecked": True, "state_dtypes": ()}
        # caches are not pickled (torch's __getstate__ keeps defaults, state and param_groups)
        self._base_index_cache = {}
        self._segments_cache = PlanCache(limit=64)
        self._hyper_cache = PlanCache(limit=256)
        self._launch_records = {}
        default_seed = self.defaults.get("seed", 0) if hasattr(self, "defaults") else 0
        fill_group_defaults(self.param_groups, default_seed)

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
                indices (the message names the block size and the fixes); a loaded group's
                ``capturable=True`` with non-CUDA params (eager; under torch.compile dynamo sets the
                flag itself and the compiler owns graph capture, as for torch's optimizers).
            TypeError: a gradient dtype other than fp32/bf16; a group's ``seed`` not an integer, a
                hyperparameter not a real number; ``grad_scale`` / ``found_inf`` not fp32 tensors.

        Every check runs before any state changes: a rejected step leaves params and state
        (the step counters included) untouched.

        Host work: in eager mode a group's first step (and any step after its params, gradients'
        dtypes / shapes / devices / layouts, states or shaping options changed) takes the full
        path and records its launches; later steps re-check that record in C-level passes and
        launch with it (``_step_cache``; the launch still goes through ``fused_step``, which reuses
        the record's plan), with the same bits. The step counters of one launch are
        then 0-dim views of one fp32 buffer (``state["step"]`` stays a 0-dim fp32 tensor).

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
        compiling = torch.compiler.is_compiling()
        # While dynamo traces, every group reads capturable=True whatever the user passed (torch's note
        # "torch.compile x capturable"): as in torch's optimizers, the capturable checks (a loaded
        # group may set it) run in eager mode only, and the compiler owns graph capture.
        groups = self.param_groups
        # as torch's optimizers: the capture query is not traceable (dynamo would break the graph here)
        capturing = not compiling and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        for group in groups:
            if capturing and not group["capturable"]:
                raise RuntimeError("AdamWSR: step() is being captured in a CUDA graph; pass capturable=True")
            if not compiling:
                # param_groups are user-editable (schedulers write lr): re-check the values the
                # kernel reads before any state (the step counters) changes. Not while tracing:
                # the compiled step guards on these values, checked by the eager calls before it.
                check_group_options(group, "AdamWSR.step")
        if not compiling:
            # a group's state_dtype edited since the last step: indices (8-bit params start on a
            # block) and launch segments are rebuilt, and existing states are checked against it
            formats = tuple(g["state_dtype"] for g in groups)
            if formats != self._state_flags["state_dtypes"]:
                self._clear_launch_caches()
                self._state_flags["unchecked"] = True
                self._state_flags["state_dtypes"] = formats
        check_states = self._state_flags["unchecked"] or compiling
        if check_states:
            for group in groups:
                for p in group["params"]:
                    if self.state.get(p):
                        # a loaded state must hold its format's tensors at the param's shape and a step
                        _states.check_state(p, self.state[p], group["state_dtype"], group["amsgrad"])
        # set by torch.amp.GradScaler.step for the length of this call (None: not under a GradScaler,
        # or grad_scale None when the gradients were unscaled already)
        amp = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        # recorded launches (step_cache) serve plain tensors in plain eager mode
        recordable = not (compiling or capturing or dispatch_mode_active())
        # per group: (group, its record, each recorded launch's gradients) when the record still
        # holds (step_cache), else (group, the params with a gradient, None) for the full path
        work = []
        for group in groups:
            record = self._launch_records.get(id(group)) if recordable else None
            picked = None if record is None else record.match(group, self.state, amp[1])
            if picked is not None:
                work.append((group, record, picked))
                continue
            with_grad = [p for p in group["params"] if p.grad is not None]
            check_grads(with_grad)
            if not check_states:  # the record did not hold: a state or a param may have changed
                for p in with_grad:
                    if self.state.get(p):  # moments at the param's shape, before the kernel reads them
                        _states.check_state(p, self.state[p], group["state_dtype"], group["amsgrad"])
            if with_grad:  # CPU params need the Triton interpreter: say so before any state is touched
                runtime.check_kernel_device(*(local_tensor(p) for p in with_grad), op="AdamWSR.step")
                if not compiling and group["capturable"] and local_tensor(with_grad[0]).device.type != "cuda":
                    check_device_flags(group)
            work.append((group, with_grad, None))
        if check_states and not compiling:
            self._state_flags["unchecked"] = False
        devices = [
            first.device if picked is not None else local_tensor(first[0]).device
            for _, first, picked in work
            if (picked if picked is not None else first)
        ]
        if (amp[0] is not None or amp[1] is not None) and devices:
            amp = tuple(
                amp_scalar(value, name, devices[0], "AdamWSR.step")
                for value, name in zip(amp, ("grad_scale", "found_inf"), strict=True)
            )
        base = self._base_indices()
        # launch segments (8-bit: checked to lie on the block grid) before any state changes
        launches = [
            None if picked is not None else self._launch_plans(g, first, base) for g, first, picked in work
        ]
        for (group, first, picked), group_launches in zip(work, launches, strict=True):
            if picked is not None:
                hyper = hyper_tensor(
                    group["lr"], group["betas"], group["eps"], group["weight_decay"], first.device,
                    self._hyper_cache,
                )  # fmt: skip
                for ls, grads in zip(first.sets, picked, strict=True):
                    _launch_step(
                        group, ls.params, grads, ls.moments, ls.segments, (ls.counts, None), first.device,
                        hyper, *amp, record=ls,
                    )  # fmt: skip
            elif first:
                record = self._group_step(group, first, group_launches, *amp, record=recordable)
                if record is not None:
                    self._launch_records[id(group)] = record
        return loss

    def _group_step(
        self,
        group: dict,
        with_grad: list[torch.Tensor],
        launches: list,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
        *,
        record: bool = False,
    ) -> GroupLaunches | None:
        """The step of one group's validated ``launches`` (``_launch_plans``), the full way; with
        ``record``, its ``GroupLaunches`` for the next steps when every param is a plain tensor."""
        amsgrad, capturable, state_dtype = group["amsgrad"], group["capturable"], group["state_dtype"]
        device = local_tensor(with_grad[0]).device
        all_states = [self.state[p] for p in with_grad]  # one (Python-level) tensor hash per param
        for p, state in zip(with_grad, all_states, strict=True):
            if len(state) == 0:
                step_device = device if capturable or found_inf is not None else torch.device("cpu")
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=step_device)
                state.update(_states.new_state(p, state_dtype, dtensor=is_dtensor(p)))
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = _states.zero_moment(p, state_dtype)
        if found_inf is not None:
            # a skipped step leaves the counts as they are, decided on the device: the counts move
            # there (once; torch's fused AdamW keeps them there too) and advance after the launch
            for state in all_states:
                if state["step"].device != device:
                    state["step"] = to_device_async(state["step"], device)
        record = (
            record
            and not torch.compiler.is_compiling()
            and all(type(p) in PLAIN_TENSOR_TYPES for p in with_grad)
        )
        hyper = hyper_tensor(
            group["lr"], group["betas"], group["eps"], group["weight_decay"], device, self._hyper_cache
        )
        roles = ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if amsgrad else ()))
        if state_dtype == _states.EIGHT_BIT:
            roles += _states.SCALE_KEYS
        position = {id(p): i for i, p in enumerate(group["params"])} if record else {}
        sets = []
        for ps, segments in launches:
            ps_states = [self.state[p] for p in ps]
            # one buffer: one add_ per step (packed by an eager step; a captured step uses it as is)
            if record:
                counts = pack_steps(ps_states)
            else:
                counts = None if torch.compiler.is_compiling() else packed_steps(ps_states)
            moments = tuple(_state_list(ps_states, key, roles) for key in (*STATE_KEYS, *_states.SCALE_KEYS))
            launch, plan = _launch_step(
                group, [local_tensor(p) for p in ps], [local_tensor(p.grad) for p in ps], moments, segments,
                (counts, [s["step"] for s in ps_states]), device, hyper, grad_scale, found_inf,
            )  # fmt: skip
            if record and plan is not None:
                picks = [position[id(p)] for p in ps]
                picks = None if picks == list(range(len(group["params"]))) else tuple(picks)
                sets.append(LaunchSet(launch, plan, picks, ps_states, roles, counts))
        if not record or len(sets) != len(launches):
            return None
        mask = grad_mask([p.grad for p in group["params"]])
        return GroupLaunches(
            group, list(group["params"]), mask, GroupLaunches.options_of(group), device, sets
        )


def check_group_options(group: dict, op: str) -> None:
    """Check a param group's options and store their canonical forms in it (``seed`` an int,
    ``state_dtype`` its name): what ``add_param_group``, ``load_state_dict`` and every eager step check.

    Raises:
        TypeError: ``seed`` not an integer, a hyperparameter not a real number, ``amsgrad`` or
            ``maximize`` not a bool.
        ValueError: ``seed`` outside ``[0, 2**64)``, ``lr``, ``betas``, ``eps`` or ``weight_decay``
            outside torch.optim.AdamW's ranges, an unsupported ``state_dtype`` or ``state_rounding``,
            amsgrad with 8-bit states.

    **Determinism:** checks; the stored forms are the same values.
    """
    group["seed"] = rng.as_seed(group["seed"], op)
    check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"], op)
    check_flags(group, op)
    group["state_dtype"] = _states.canonical_state_dtype(group["state_dtype"], op)
    group["state_rounding"] = _states.check_state_rounding(group["state_rounding"], op)
    _states.check_combination(group["state_dtype"], group["amsgrad"], op)


def _launch_step(
    group: dict,
    params: list,
    grads: list,
    moments: tuple,
    segments: torch.Tensor,
    counts: tuple,
    device: torch.device,
    hyper: torch.Tensor,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    record: LaunchSet | None = None,
) -> tuple[StepLaunch, LaunchPlan | None]:
    """One launch of a group's step, full or recorded path alike: advance the step counts, run the
    launch through the functional step ``fused_step`` with the group's current options (under AMP
    the counts advance after it, by ``found_inf == 0``). ``moments``: the state lists in
    ``StepLaunch``'s order; ``counts``: ``(pack_steps buffer or None, the state["step"] tensors)``;
    ``record``: the recorded launch of these tensors, which ``fused_step`` reuses."""
    buffer, step_list = counts
    if found_inf is None:
        if buffer is None:
            torch._foreach_add_(step_list, 1.0)
        else:
            buffer.add_(1.0)
    steps = buffer if buffer is not None else torch.stack(step_list).to(torch.float32)
    if steps.device != device:
        steps = to_device_async(steps, device)
    if found_inf is not None:
        steps = steps + 1.0  # the step number of this step; the counts advance below
    launch = StepLaunch(
        params, grads, moments[0], moments[1], moments[2], steps, hyper, segments, group["seed"],
        group["amsgrad"], group["maximize"],
        params[0].dtype == torch.bfloat16 and group["stochastic_rounding"] is not False,
        grad_scale, found_inf, group["state_rounding"] == "stochastic", moments[3], moments[4],
    )  # fmt: skip
    plan = fused_step(launch, record)
    if found_inf is not None:  # + 1 where no inf was found, + 0.0 (the same bits) where one was
        advance = (found_inf == 0).to(torch.float32).reshape(())
        if buffer is None:
            torch._foreach_add_(step_list, [advance] * len(step_list))
        else:
            buffer.add_(advance)
    return launch, plan


def _state_list(param_states: list[dict], key: str, roles: tuple) -> list[torch.Tensor]:
    """The local tensors of one state entry (``"exp_avg"``, ...), one per param, in order; ``[]``
    for an entry the format does not have (not in ``roles``)."""
    return [local_tensor(state[key]) for state in param_states] if key in roles else []
