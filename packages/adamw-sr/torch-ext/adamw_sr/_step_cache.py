"""What ``AdamWSR.step`` keeps between eager steps: a steady-state step re-checks its launches with a
few C-level passes over the tensors instead of rebuilding them in Python, tensor by tensor.

A full step (the first one of a param group, and any step after something changed) validates
every tensor, builds the launches and records them here (``GroupLaunches``): the group's params,
which of them have gradients and, per launch (``LaunchSet``), its tensors, what they were
validated as (addresses, dtypes, shapes, device, layout, contiguity), its launch plan and one
fp32 step-count buffer whose elements *are* the params' ``state["step"]`` tensors (0-dim views), so
that advancing 2,000 counts is one ``add_`` and the kernel reads the buffer itself. A later step
compares that record with the live tensors (``GroupLaunches.match``): the same param objects with
the same storage, dtype, shape and contiguity; gradients present where they were, each a plain,
dense, contiguous tensor of the recorded dtype, shape and device; the same state dicts holding the
same tensors at the same addresses; the same group options that shape the state. Any difference
sends the group down the full path (which validates everything and raises its precise errors
before anything is written), so a changed param set, dtype, device or state is never served a
stale plan. Gradients that moved but match otherwise get a new plan (``functional.get_plan``).
Records are kept for plain tensors in eager mode only (not under torch.compile, a dispatch mode
or CUDA-graph capture); DTensor groups take the full path every step.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator

import torch

from ._launch import LaunchPlan
from .functional import StepLaunch, get_plan
from .indices import PLAIN_TENSOR_TYPES

__all__ = ["GroupLaunches", "LaunchSet", "grad_mask", "pack_steps"]

_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_LAYOUT = operator.attrgetter("layout")
_DEVICE = operator.attrgetter("device")
_GET_DEVICE = torch.Tensor.get_device
_GRAD = operator.attrgetter("grad")
_STEP = operator.itemgetter("step")
_PLAIN = frozenset(PLAIN_TENSOR_TYPES)
_PLANS_PER_SET = 8
_IS = operator.is_  # ``all(map(_IS, a, b))``: the same objects in order (inline: no call per check)


def _same_shapes(tensors, shapes) -> bool:
    # lazily: a list of 2,000 torch.Size (tuples, tracked by the garbage collector) would set off
    # collections that cost more than the comparison
    return all(map(operator.eq, map(_SHAPE, tensors), shapes))


def grad_mask(grads: list) -> tuple[bool, ...]:
    """Which entries of ``grads`` (a param's ``.grad`` or ``None`` each) are tensors.

    **Determinism:** bookkeeping only.
    """
    return tuple(map(operator.is_not, grads, itertools.repeat(None)))


def pack_steps(param_states: list[dict]) -> torch.Tensor:
    """Make the params' step counters the elements of one buffer and return it (fp32 ``[T]``, on the
    counters' device): ``state["step"]`` of each param becomes a 0-dim view of it, in order, holding
    its count unchanged. Already packed counters are left as they are.

    **Determinism:** the counts keep their values (fp32, exact); only where they are stored changes.
    """
    base = packed_steps(param_states)
    if base is not None:
        return base
    counts = torch.stack(list(map(_STEP, param_states))).to(torch.float32)
    for state, view in zip(param_states, counts.unbind(0), strict=True):
        state["step"] = view
    return counts


def packed_steps(param_states: list[dict]) -> torch.Tensor | None:
    """The buffer ``pack_steps`` made of these params' step counters, when each ``state["step"]``
    is still its 0-dim view in order (fp32 ``[T]``), else None. Allocates and launches nothing, so
    a step being captured in a CUDA graph advances the counters with one ``add_`` on the buffer
    instead of a multi-tensor add and a ``stack`` of every counter.

    **Determinism:** a lookup; the counts are not read.
    """
    steps = list(map(_STEP, param_states))
    base = steps[0]._base
    if (
        base is not None
        and base.dtype == torch.float32
        and base.shape == (len(steps),)
        and base.is_contiguous()
        and all(
            t._base is base and t.dim() == 0 and t.storage_offset() == base.storage_offset() + i
            for i, t in enumerate(steps)
        )
    ):
        return base
    return None


class LaunchSet:
    """One recorded launch of a group's step (params of one dtype pair) and what it was validated as.

    Args:
        launch: the full path's ``StepLaunch`` of this launch (plain tensors), just run.
        plan: its ``LaunchPlan``.
        picks: the params' positions in the group's ``params`` (``None``: all of them, in order).
        param_states: the params' state dicts.
        roles: the state keys the format has (``"exp_avg"``, ...).
        counts: the step-count buffer of ``pack_steps``.

    Holds the params, their states (``moments``: the launch's state lists in ``StepLaunch``'s order),
    the ``segments`` and the step counts, but not the gradients (a record must not keep freed
    gradients alive): only their addresses, for the plan. Launches nothing itself: ``AdamWSR.step``
    builds the step's ``StepLaunch`` from it and ``functional.fused_step`` reads its plan
    (``plan_for``) and ``written`` list.

    **Determinism:** a step served by the record makes the launch the full path would make for the
    same tensors and options (same plan tables, step numbers and flags): the same bits.
    """

    def __init__(
        self, launch: StepLaunch, plan: LaunchPlan, picks, param_states: list, roles, counts: torch.Tensor
    ) -> None:
        ps = launch.params
        self.params, self.picks, self.states, self.plan, self.counts = ps, picks, param_states, plan, counts
        self.moments = (
            launch.exp_avgs, launch.exp_avg_sqs, launch.max_exp_avg_sqs, launch.exp_avg_scales,
            launch.exp_avg_sq_scales,
        )  # fmt: skip
        self.segments = launch.segments
        self.roles = {key: [state[key] for state in param_states] for key in roles}
        self.steps = list(map(_STEP, param_states))
        self.param_dtype = ps[0].dtype
        self.shapes = list(map(_SHAPE, ps))
        self.grad_dtype = launch.grads[0].dtype
        self.grad_ptrs = list(map(_DATA_PTR, launch.grads))
        # plans by gradient addresses (the rest of the record fixed): gradients that alternate
        # between a few buffers find theirs without ``get_plan``'s key over every tensor
        self.plans = {tuple(self.grad_ptrs): plan}
        self.device = ps[0].device
        self.device_index = ps[0].get_device() if self.device.type == "cuda" else -1
        self.written = [*ps, *itertools.chain.from_iterable(self.roles.values())]
        self.stored = self.written  # the tensors whose storage the plan addresses (grads aside)
        self.stored_ptrs = list(map(_DATA_PTR, self.stored))

    def pick(self, grads: list) -> list:
        """This launch's gradients out of the group's list (one per param)."""
        if self.picks is None:
            return grads
        return [grads[i] for i in self.picks]

    def match(self, grads: list, state) -> bool:
        """Whether the live tensors are still what this record was validated as (see the module
        docstring); ``grads``: this launch's gradients, none ``None``; ``state``: the optimizer's."""
        ps = self.params
        if (
            not all(map(operator.is_, map(_DTYPE, ps), itertools.repeat(self.param_dtype)))
            or not _same_shapes(ps, self.shapes)
            or not all(map(_IS_CONTIGUOUS, ps))
        ):
            return False
        # the layout first: a sparse tensor has no strides to ask about
        if not _PLAIN.issuperset(map(type, grads)) or not all(
            map(operator.is_, map(_LAYOUT, grads), itertools.repeat(torch.strided))
        ):
            return False
        if (
            not all(map(operator.is_, map(_DTYPE, grads), itertools.repeat(self.grad_dtype)))
            or not _same_shapes(grads, self.shapes)
            or not self._on_device(grads)
            or not all(map(_IS_CONTIGUOUS, grads))
        ):
            return False
        live = list(map(state.get, ps))
        if not all(map(_IS, live, self.states)):
            return False
        try:
            if not all(map(_IS, map(_STEP, live), self.steps)):
                return False
            for key, tensors in self.roles.items():
                if not all(map(_IS, map(operator.itemgetter(key), live), tensors)):
                    return False
        except KeyError:  # an entry removed from a state dict
            return False
        # the params' and the state tensors' storage where it was (``.data`` replaced: elsewhere)
        return list(map(_DATA_PTR, self.stored)) == self.stored_ptrs

    def _on_device(self, grads: list) -> bool:
        if self.device_index >= 0:  # CUDA: the device index alone (an int, no device object)
            return all(map(operator.eq, map(_GET_DEVICE, grads), itertools.repeat(self.device_index)))
        return set(map(_DEVICE, grads)) == {self.device}  # CPU (-1) and meta (-1) told apart

    def plan_for(self, launch: StepLaunch) -> LaunchPlan:
        """The launch plan of ``launch`` (this record's tensors with validated gradients): the
        recorded one, or for gradients elsewhere in memory theirs (kept per address set, built by
        ``functional.get_plan`` on a miss). Read by ``functional.fused_step``, the one launch path."""
        grad_ptrs = list(map(_DATA_PTR, launch.grads))
        if grad_ptrs != self.grad_ptrs:
            key = tuple(grad_ptrs)
            plan = self.plans.get(key)
            if plan is None:
                if len(self.plans) >= _PLANS_PER_SET:
                    self.plans.clear()
                plan = self.plans[key] = get_plan(launch)
            self.plan, self.grad_ptrs = plan, grad_ptrs
        return self.plan


@dataclasses.dataclass(eq=False)
class GroupLaunches:
    """A param group's recorded launches: ``group`` (the dict itself), its ``params`` and gradient
    ``mask`` at the time, the ``options`` that shape its state (amsgrad, state_dtype, capturable),
    the params' ``device`` and the ``sets`` (``LaunchSet``, one per dtype pair).

    **Determinism:** a record changes host work only; a step served by it writes the bits of the
    full path.
    """

    group: dict
    params: list
    mask: tuple
    options: tuple
    device: torch.device
    sets: list

    @staticmethod
    def options_of(group: dict) -> tuple:
        """The group options a record depends on."""
        return group["amsgrad"], group["state_dtype"], group["capturable"]

    def match(self, group: dict, state, found_inf) -> list | None:
        """Each launch's live gradients if the record still holds for ``group`` (else ``None``)."""
        # under torch.compile the step frame may run eagerly while dynamo traces its callees (this
        # one included): a traced step takes the full path, through the custom op
        if torch.compiler.is_compiling():
            return None
        params = group["params"]
        if (
            group is not self.group
            or len(params) != len(self.params)
            or not all(map(_IS, params, self.params))
            or self.options_of(group) != self.options
        ):
            return None
        grads = list(map(_GRAD, params))
        if grad_mask(grads) != self.mask:
            return None
        picked = []
        for launch_set in self.sets:
            # AMP decides on the device whether the counts advance: they must live there
            if found_inf is not None and launch_set.counts.device != self.device:
                return None
            ls_grads = launch_set.pick(grads)
            if not launch_set.match(ls_grads, state):
                return None
            picked.append(ls_grads)
        return picked
