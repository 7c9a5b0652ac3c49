"""What every det_train ``torch.library`` custom op shares: its namespace, the accumulator state an op
reads at trace time, and the deposit ticket that orders the accumulator's deposits in a compiled graph.

Every public op of det_train is a ``torch.library`` operator (``det_train::linear``,
``det_train::rms_norm``, ...) with a fake (meta) implementation and, where it has a backward, a
registered autograd formula whose backward ops are operators too (``Op``). The eager public functions call
the ops, so eager and ``torch.compile`` run one code path; the ops are opaque to Inductor, which
therefore cannot rewrite their reductions.

The accumulator under ``torch.compile``. Whether a backward deposits into the active
``CanonicalGradAccumulator`` or returns an autograd gradient is a property of the traced graph, so
it is decided in the forward (``accumulation()``: Dynamo guards the active accumulator's presence
and ``leaf_tokens``, not the micro-batch's token offset, so micro-batches do not recompile). The
deposit itself is an opaque op (``det_train::linear_deposit_weight``, ...) whose implementation runs
at every call of the compiled backward and does the accumulator's bookkeeping there (it reads the
micro-batch's token offset then); it declares the deposit ticket (``deposit_ticket()``, one int64
counter) mutated, which keeps it in the graph (functionalization drops an op that returns nothing
and mutates nothing) and orders all deposits of a graph in autograd's order (each reads the
ticket the previous one wrote), the order in which uses of a tied parameter are numbered.
"""

from __future__ import annotations

import weakref

import torch
from det_core.runtime import check_no_functorch_autodiff, plain_eager

from ..accum.grad_accum import DEFAULT_LEAF_TOKENS, CanonicalGradAccumulator, current_accumulator

__all__ = [
    "NAMESPACE",
    "Op",
    "accumulation",
    "active_accumulator",
    "deposit_ticket",
    "finish_deposit",
    "op_name",
    "plain_eager",
    "tracked_parameter",
]


def _namespace(package: str) -> str:
    """``det_train`` in the source tree; the Hub build's unique package name (``_det_train_<backend>_<hash>``)
    when ``kernels`` loads a build, so two copies of det_train in one process register apart."""
    name = package.split(".")[0]
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


NAMESPACE = _namespace(__package__ or "det_train")


def op_name(name: str) -> str:
    """``<namespace>::<name>``, the qualified name of one of det_train's custom ops."""
    return f"{NAMESPACE}::{name}"


# ``Function.apply`` below its Python wrapper, which binds nothing for these Functions (no
# setup_context) and, with no functorch transform active (``plain_eager``), only unwraps dead
# functorch wrappers, which ``plain_eager`` sends to the dispatcher instead (host time saved per call).
_apply = torch._C._FunctionBase.__dict__["apply"]
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # held for the process: dropping it deregisters
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd
_any_requires_grad = torch._C._any_requires_grad
_FORWARD_AD = torch.autograd.forward_ad


class Op:
    """One det_train op: a ``torch.library`` operator and, for plain eager calls, the same functions
    called directly.

    ``Op(name, mutates_args)`` decorates the implementation (``@Op("linear")``): the schema is
    inferred from its annotations (``torch.library.infer_schema``), defined in det_train's namespace
    and the implementation registered as its ``CompositeExplicitAutograd`` kernel.
    ``register_fake`` registers the fake (meta) kernel; ``register_autograd`` an ``Autograd``
    kernel (a ``torch.autograd.Function`` in functorch's style, whose forward redispatches below
    autograd) and the Function of the eager path. A call runs the operator
    (``torch.ops.<namespace>.<name>``) whenever something traces it (Dynamo, AOTAutograd, fake
    tensors, opcheck, functorch transforms, a tensor subclass); in plain eager execution it runs
    the implementation directly, through a Function built from the same ``setup_context`` and
    backward when the op has a backward.

    Why ``torch.library.Library`` and not ``torch.library.custom_op`` (as det-attn's operators):
    custom_op's per-call Python wrappers (a Dynamo-disable frame, the schema's aliasing and
    ``out`` checks, its autograd wrapper) cost several times the Library registrations' host time
    per call, and a compiled graph calls hundreds of ops per micro-batch through the dispatcher
    (the eager step's host time: see docs/benchmarks.md).

    **Determinism:** every path runs the same implementation and the same backward on the same
    arguments, so the same kernels in the same order: compiled and eager results are compared bit
    for bit in ``tests/test_compile.py``.
    """

    def __init__(self, name: str, mutates_args: tuple[str, ...] = ()) -> None:
        self.name = name
        self.mutates_args = mutates_args
        self.impl = None
        self.overload = None  # torch.ops.<namespace>.<name>.default
        self.function = None
        self.apply = None  # the eager Function's apply, bound once
        self.nondifferentiable: tuple[int, ...] = ()

    def __call__(self, *args):
        if self.overload is None:  # used as the decorator of the implementation
            (impl,) = args
            self.impl = impl
            _LIB.define(self.name + torch.library.infer_schema(impl, mutates_args=self.mutates_args))
            _LIB.impl(self.name, impl, "CompositeExplicitAutograd")
            self.overload = getattr(getattr(torch.ops, NAMESPACE), self.name).default
            self.__doc__ = impl.__doc__
            return self
        if _FORWARD_AD._current_level >= 0:  # inside a dual_level: a dual tensor would lose its tangent
            check_no_functorch_autodiff(f"det_train.{self.name}", args)
        if plain_eager(args):
            return self.impl(*args) if self.apply is None else self.apply(*args)
        check_no_functorch_autodiff(f"det_train.{self.name}", args)
        return self.overload(*args)

    def register_fake(self, fake):
        """Register the fake (meta) implementation: output shapes, dtypes and devices, no data."""
        torch.library.register_fake(op_name(self.name), fake, lib=_LIB)
        return fake

    def register_autograd(self, backward, *, setup_context, nondifferentiable: tuple[int, ...] = ()) -> None:
        """Register the autograd formula as the operator's ``Autograd`` kernel and build the eager
        ``autograd.Function``.

        ``nondifferentiable``: indices of floating-point outputs that carry no gradient (saved
        statistics); both Functions mark them so.
        """
        impl, nondiff, user_backward, overload = self.impl, nondifferentiable, backward, self.overload
        public = f"det_train.{self.name}"

        class _Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                output = impl(*inputs)
                setup_context(ctx, inputs, output)
                if nondiff:
                    ctx.mark_non_differentiable(*(output[i] for i in nondiff))
                return output

            backward = staticmethod(user_backward)  # called as it is: one Python frame less

        class _Dispatched(torch.autograd.Function):
            """The Autograd kernel's Function: forward and setup_context apart (functorch's grad /
            vjp / vmap need it so; it has no jvp, so forward-mode AD raises)."""

            generate_vmap_rule = True

            @staticmethod
            def forward(*inputs):
                with _BELOW_AUTOGRAD():
                    return overload(*inputs)

            @staticmethod
            def setup_context(ctx, inputs, output):
                setup_context(ctx, inputs, output)
                if nondiff:
                    ctx.mark_non_differentiable(*(output[i] for i in nondiff))

            backward = staticmethod(user_backward)

        def autograd_kernel(*args):
            check_no_functorch_autodiff(public, args)  # also for calls that reach the operator directly
            # nothing to record (a compiled graph's forward runs under no_grad): straight below autograd
            if not (torch.is_grad_enabled() and _any_requires_grad(*args)):
                with _BELOW_AUTOGRAD():
                    return overload(*args)
            return _Dispatched.apply(*args)

        _LIB.impl(self.name, autograd_kernel, "Autograd")
        for cls in (_Function, _Dispatched):
            cls.__name__ = cls.__qualname__ = f"{self.name}_{cls.__name__.strip('_').lower()}"
        self.function = _Function
        self.apply = _apply.__get__(None, _Function)


# One int64 counter for every deposit op: each op adds 1 (its value counts deposits made through the
# ops, nothing reads it). What matters is that it is a tensor every deposit op declares mutated.
_DEPOSIT_TICKET = torch.zeros((), dtype=torch.int64)


def deposit_ticket() -> torch.Tensor:
    """The tensor the deposit ops declare mutated (a CPU int64 counter of deposits).

    Returns:
        The process-wide 0-d int64 ticket. Passed to a forward op, it reaches that op's backward,
        whose deposit op adds 1 to it. Raises nothing.

    **Determinism:** the ticket carries no value into any result; it only makes the deposits of a
    compiled graph one chain (each deposit op reads what the previous one wrote), so Inductor keeps
    them, in the order autograd traced them.
    """
    return _DEPOSIT_TICKET


def accumulation() -> tuple[int, bool]:
    """``(leaf_tokens, active)`` of the current micro-batch, read when the forward runs (or is traced).

    Returns:
        The active ``CanonicalGradAccumulator``'s ``leaf_tokens`` and True inside its
        ``micro_batch``; ``(DEFAULT_LEAF_TOKENS, False)`` outside every micro-batch. Raises nothing.

    Under ``torch.compile`` Dynamo guards on what this reads (whether an accumulator is active and
    its ``leaf_tokens``), so entering another micro-batch of the same accumulator reuses the graph,
    and a graph traced outside a micro-batch is not reused inside one (or the other way round).

    **Determinism:** a lookup; it selects between the deposit and the plain gradient, which is
    what makes the weight gradients micro-batch invariant under an accumulator.
    """
    acc = current_accumulator()
    if acc is None:
        return DEFAULT_LEAF_TOKENS, False
    return acc.leaf_tokens, True


def active_accumulator(op: str) -> CanonicalGradAccumulator:
    """The accumulator a deposit op deposits into, at run time (inside the op's implementation).

    Args:
        op: the public name of the op, for the message.

    Returns:
        The active ``CanonicalGradAccumulator``.

    Raises:
        RuntimeError: no micro-batch is active: the forward ran inside ``acc.micro_batch(...)``
            (so its backward deposits) but the backward runs outside it. Run both inside.

    **Determinism:** a lookup; the deposit that follows keeps the canonical order.
    """
    acc = current_accumulator()
    if acc is None:
        raise RuntimeError(
            f"{op}: the forward ran inside a CanonicalGradAccumulator micro_batch (its weight gradients "
            "go to the accumulator) but the backward runs outside every micro_batch: run forward and "
            "backward inside the same `with acc.micro_batch(...)`"
        )
    return acc


# accumulator -> {(data_ptr, shape, stride, dtype, device): parameter} for tensors that alias a tracked
# parameter without being the Parameter object itself (what a compiled backward may hand an op)
_BY_STORAGE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def tracked_parameter(acc: CanonicalGradAccumulator, t: torch.Tensor) -> torch.Tensor:
    """The parameter of ``acc`` that ``t`` is, or aliases exactly (same storage, offset, shape, strides).

    A compiled backward passes the op the tensor AOTAutograd saved, which need not be the Parameter
    object the accumulator tracks (its identity is the accumulator's key). Same data pointer,
    shape, strides, dtype and device is the same tensor's memory, so it is that parameter.
    FSDP2's unsharded parameters (``track_fsdp``) are matched the same way.

    Args:
        acc: the accumulator of the micro-batch.
        t: the weight or bias tensor the op received.

    Returns:
        The tracked tensor (a Parameter, or FSDP2's unsharded parameter), or ``t`` itself when no
        tracked tensor matches (the accumulator then raises its "does not track" ``ValueError``).

    **Determinism:** a lookup; it only chooses which parameter's tree a deposit joins.
    """
    if id(t) in acc._index:  # eager: the Parameter itself (an id-keyed lookup, as the accumulator's)
        return t
    key = _storage_key(t)
    cache = _BY_STORAGE.get(acc)
    hit = None if cache is None else cache.get(key)
    if hit is not None and _storage_key(hit) == key:
        return hit
    candidates = list(acc._params)
    candidates += [u for fp in acc._fsdp.values() if (u := getattr(fp, "_unsharded_param", None)) is not None]
    cache = {_storage_key(p): p for p in candidates}
    _BY_STORAGE[acc] = cache
    return cache.get(key, t)


def finish_deposit(acc: CanonicalGradAccumulator) -> None:
    """Run the accumulator's queued open-leaf row copies now, before the deposit op returns.

    The accumulator queues the copies of an open leaf's rows and runs them at the end of the
    micro-batch; a compiled graph may reuse the memory of an op's inputs as soon as the op returns
    (Inductor's buffer reuse), so a deposit op copies before it returns. Same values, one copy
    launch per op instead of one per micro-batch, and only for micro-batches that end inside a leaf.

    **Determinism:** copies only; no value changes.
    """
    acc._flush()
