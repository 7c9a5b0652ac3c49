"""What every det_train ``torch.library`` custom op shares: its namespace and the ``Op`` that registers it.

Every public op of det_train is a ``torch.library`` operator (``det_train::linear``,
``det_train::rms_norm``, ...) with a fake (meta) implementation and, where it has a backward, a
registered autograd formula whose backward ops are operators too (``Op``). The eager public functions call
the ops, so eager and ``torch.compile`` run one code path; the ops are opaque to Inductor, which
therefore cannot rewrite their reductions. How a backward's parameter gradient reaches the
accumulator (the deposit ops, their ticket, the forward's choice) is ``accum/deposit.py``.
"""

from __future__ import annotations

import torch
from det_core.runtime import check_no_functorch_autodiff, plain_eager

__all__ = ["NAMESPACE", "Op", "op_name", "plain_eager"]


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
_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)  # torch >= 2.8


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
    backward when the op has a backward. The deposit ops (those that mutate the deposit ticket)
    and the ``data_dependent`` ones (whose launches depend on their inputs' values, read on the host)
    are tagged ``torch.Tag.cudagraph_unsafe``: under ``torch.compile(mode="reduce-overhead")``
    Inductor's graph partitions run them eagerly between the CUDA graphs of the rest.

    Why ``torch.library.Library`` and not ``torch.library.custom_op`` (as det-attn's operators):
    custom_op's per-call Python wrappers (a Dynamo-disable frame, the schema's aliasing and
    ``out`` checks, its autograd wrapper) cost several times the Library registrations' host time
    per call, and a compiled graph calls hundreds of ops per micro-batch through the dispatcher
    (the eager step's host time: see docs/benchmarks.md).

    **Determinism:** every path runs the same implementation and the same backward on the same
    arguments, so the same kernels in the same order: compiled and eager results are compared bit
    for bit in ``tests/test_compile.py``.
    """

    def __init__(self, name: str, mutates_args: tuple[str, ...] = (), data_dependent: bool = False) -> None:
        self.name = name
        self.mutates_args = mutates_args
        # an op that mutates the deposit ticket does the accumulator's bookkeeping in Python at
        # every call, and a data_dependent one reads its inputs' values on the host to size its
        # launches (MoE's tokens per expert): no CUDA graph may capture either (torch.compile's
        # mode="reduce-overhead" runs them between graph partitions, eagerly)
        unsafe = "ticket" in mutates_args or data_dependent
        self.tags = (_CUDAGRAPH_UNSAFE,) if unsafe and _CUDAGRAPH_UNSAFE else ()
        self.impl = None
        self.overload = None  # torch.ops.<namespace>.<name>.default
        self.function = None
        self.apply = None  # the eager Function's apply, bound once
        self.nondifferentiable: tuple[int, ...] = ()

    def __call__(self, *args):
        if self.overload is None:  # used as the decorator of the implementation
            (impl,) = args
            self.impl = impl
            schema = torch.library.infer_schema(impl, mutates_args=self.mutates_args)
            _LIB.define(self.name + schema, tags=self.tags)
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
        statistics); both Functions mark them so, and pass ``None`` for their gradients rather than
        zeros (``set_materialize_grads(False)``: autograd would allocate and fill a zero tensor per
        such output and call, a launch each on the GPU). Output 0 must be the only differentiable
        output of such an op; ``backward`` always gets a tensor for it (zeros where autograd gives
        none: a downstream Function that returned ``None`` for it).
        """
        impl, nondiff, user_backward, overload = self.impl, nondifferentiable, backward, self.overload
        public = f"det_train.{self.name}"

        def mark_statistics(ctx, output) -> None:  # what both Functions declare of the outputs
            if nondiff:
                ctx.mark_non_differentiable(*(output[i] for i in nondiff))
                ctx.set_materialize_grads(False)
                ctx.output0 = (output[0].shape, output[0].dtype, output[0].device)

        if nondiff:

            def op_backward(ctx, *grads):
                if grads[0] is None:  # undefined, not materialized: the zeros autograd would pass
                    shape, dtype, device = ctx.output0
                    grads = (torch.zeros(shape, dtype=dtype, device=device), *grads[1:])
                return user_backward(ctx, *grads)

        else:
            op_backward = user_backward

        class _Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                output = impl(*inputs)
                setup_context(ctx, inputs, output)
                mark_statistics(ctx, output)
                return output

            backward = staticmethod(op_backward)  # the op's own, called as it is where it can be

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
                mark_statistics(ctx, output)

            backward = staticmethod(op_backward)

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
