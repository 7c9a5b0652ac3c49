"""Kernel launches with less host time: ``launch``, ``BoundLaunch``, ``DescriptorTemplate``, ``PlanCache``.

``launch(kernel, grid, *args, **kwargs)`` is ``kernel[grid](*args, **kwargs)``. On the Triton versions
in ``_DIRECT_LAUNCH_TRITON`` (on a GPU, ``DET_DIRECT_LAUNCH`` not ``0``) it finds the compiled kernel
by a key of what Triton specializes on and calls its C launcher directly, without Triton's per-launch
argument binding; everywhere else (the interpreter, other Triton versions) it is ``kernel[grid]``
itself. ``BoundLaunch`` fixes a launch's arguments after its tensors, ``DescriptorTemplate`` copies a
validated TMA descriptor onto new bases, and ``PlanCache`` holds the launch plans that packages build
per call signature. Host code only: no kernel is defined here.

These names were first defined in ``det_core.runtime``, which still imports them (the same objects).

**Determinism:** every path launches the same compiled kernel with the same arguments as
``kernel[grid](...)``, so the same bits (the GPU tests compare the direct path with Triton's).
"""

from __future__ import annotations

import collections
import os
import types

import torch

from .interpreter_mode import interpreter_active  # its import installs det_core.interpreter under it

__all__ = ["BoundLaunch", "DescriptorTemplate", "PlanCache", "launch"]

# Triton versions whose launch path ``launch`` replays directly (checked bitwise against Triton's
# path on a GPU; the host time it saves: see docs/benchmarks.md). Elsewhere ``launch`` is
# ``kernel[grid](...)`` itself.
_DIRECT_LAUNCH_TRITON = ("3.6.",)
_LAUNCHES: collections.OrderedDict = collections.OrderedDict()  # least recently used first
_MAX_LAUNCHES = 4096
_KERNEL_PARAMS: dict = {}  # kernel -> (positional flags, (name, default) per parameter)
_knobs = None  # triton.knobs once the direct path is on
_direct_launch: bool | None = None


class _NoKey(Exception):
    pass


def _int_class(value: int) -> int:
    # Triton 3.6 types an int argument i32, i64 or u64 by its range (native_specialize_impl)
    if -(2**31) <= value < 2**31:
        return 0
    return 1 if -(2**63) <= value < 2**63 else 2


def _arg_key(value, exact: bool = True, specialize: bool = True):
    """A key for what Triton 3.6 compiles a kernel for: tensors by dtype and 16-byte alignment; ints
    by exact value (Triton specializes on their range, ``== 1`` and divisibility by 16), by range
    only when the parameter is ``do_not_specialize``; floats and bools by type only; ``exact``
    (constexprs, keyword values): the type and the exact value (floats by their bits, so 0.0 and
    -0.0 differ)."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if kind is int:
        if specialize or exact:  # exact: stricter than Triton's classes (range, == 1, % 16), the
            return int, value  # behaviour the GPU suite ran; a varying int argument only misses
        return int, _int_class(value)
    if kind is float:
        return (float, value.hex()) if exact else float
    if kind is bool:
        return (bool, value) if exact else bool
    if value is None or kind is str:
        return kind, value
    if kind.__name__ == "TensorDescriptor":
        base = value.base
        return (base.dtype, base.data_ptr() % 16 == 0, _descriptor_layout(value))
    raise _NoKey


def _descriptor_layout(desc) -> tuple:
    # what a launch key holds of a tensor descriptor besides its base: shape, strides, block, padding
    return (
        "desc",
        tuple(desc.shape),
        tuple(desc.strides),
        tuple(desc.block_shape),
        getattr(desc, "padding", None),
    )


def _params(kernel):
    """``(flags, named, token)`` of ``kernel``: per parameter ``(is_constexpr, specialize)`` and
    ``(name, default)``, and a token standing for the kernel in launch keys. Looked up by ``id``:
    a JITFunction hashes by its source hash (a property, on every launch otherwise); the table
    keeps the kernel alive, so its id is not reused while the entry exists."""
    entry = _KERNEL_PARAMS.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        flags = tuple((p.is_constexpr, not p.do_not_specialize) for p in kernel.params)
        named = tuple((p.name, p.default) for p in kernel.signature.parameters.values())
        entry = _KERNEL_PARAMS[id(kernel)] = (kernel, (flags, named, id(kernel)))
    return entry[1]


# Keyword values keyed by the values themselves (with their types): exact, hashable and never a
# tensor. Other keyword values (floats: 0.0 == -0.0; tensors) go through ``_arg_key``.
_PLAIN_KEYWORD_TYPES = frozenset((int, bool, str, type(None)))
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_cuda_device = getattr(torch._C, "_cuda_getDevice", None)  # None in a CPU-only build (no direct path)


def _args_key(args: tuple, flags: tuple) -> tuple:
    """``_arg_key`` of every positional argument, with the common kinds (ints, plain tensors)
    inline: a launch has tens of arguments and a training step makes hundreds of launches."""
    key = []
    append = key.append
    for value, (exact, specialize) in zip(args, flags, strict=False):
        kind = type(value)
        if kind is int:  # no other kind gives a bare int: the value is its own key
            append(value if specialize or exact else (int, _int_class(value)))
        elif kind in _PLAIN_TENSOR_TYPES:
            append((value.dtype, value.data_ptr() % 16 == 0))
        else:
            append(_arg_key(value, exact, specialize))
    return tuple(key)


_ALIGNED = object()  # tags ``_tensors_key``'s short form: no ``_args_key`` entry equals it
# A DescriptorTemplate copy carries its layout (shape, strides, block, padding: what ``_arg_key``
# keys a descriptor by, besides its base) under this attribute name, computed once per template.
_LAYOUT = "_det_layout"
_NO_FIELDS: dict = {}


def _tensors_key(args: tuple, flags: tuple) -> tuple:
    """``_args_key`` for a bound launch's leading arguments: when all are plain tensors or
    ``DescriptorTemplate`` copies, on 16-byte aligned addresses (the common case), ``(_ALIGNED,
    dtypes and layouts)`` in one pass; else ``_args_key``."""
    dtypes = []
    misaligned = 0
    for value in args:
        if type(value) in _PLAIN_TENSOR_TYPES:
            dtypes.append(value.dtype)
            misaligned |= value.data_ptr() & 15
            continue
        layout = getattr(value, "__dict__", _NO_FIELDS).get(_LAYOUT)  # a DescriptorTemplate copy
        if layout is None:
            return _args_key(args, flags)
        base = value.base
        dtypes.append((base.dtype, layout))
        misaligned |= base.data_ptr() & 15
    if misaligned:
        return _args_key(args, flags)
    return (_ALIGNED, tuple(dtypes))


def _kwargs_key(kwargs: dict) -> tuple[tuple, bool]:
    """The key of the keyword arguments, and whether they are all plain (ints, bools, strs, None:
    keyed by type and value, so equal keys mean equal values and the kernel's tail of constexprs
    can be kept with its compiled kernel)."""
    kinds = tuple(map(type, kwargs.values()))
    if _PLAIN_KEYWORD_TYPES.issuperset(kinds):
        return (True, tuple(kwargs.items()), kinds), True
    return (False, tuple((name, _arg_key(v)) for name, v in kwargs.items())), False


def _hook_set(hook) -> bool:
    # Triton 3.6 keeps launch hooks in a HookChain (never None): set when it holds a callable
    return hook is not None and bool(getattr(hook, "calls", True))


def _direct_launch_enabled() -> bool:
    global _direct_launch, _knobs
    if _direct_launch is None:
        import triton

        _direct_launch = (
            not interpreter_active()
            and os.environ.get("DET_DIRECT_LAUNCH", "1") != "0"
            and triton.__version__.startswith(_DIRECT_LAUNCH_TRITON)
        )
        if _direct_launch:
            from triton import knobs

            _knobs = knobs
    return _direct_launch


def _globals_unchanged(kernel) -> bool:
    # JITFunction.run raises when a global the kernel read at compile time has changed: let it
    missing = object()
    return all(g.get(name, missing) == val for (name, _), (val, g) in kernel.used_global_vals.items())


def launch(kernel, grid: tuple, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with less host time per launch on known Triton versions.

    Triton's ``JITFunction.run`` binds and specializes every argument on every launch, host time
    that a training step pays hundreds of times (see docs/benchmarks.md). Here
    the compiled kernel is looked up by a key that determines what Triton 3.6 specializes on (its
    ``native_specialize_impl``): tensor dtype and 16-byte alignment; ints by exact value
    (``do_not_specialize`` ones by their i32 / i64 / u64 range); float and bool types; constexprs,
    keyword arguments and the debug / instrumentation knobs by exact value. It is launched with the
    live arguments as ``JITFunction.run`` launches it, through its C launcher directly where that
    launcher needs no scratch memory (``_CompiledLaunch``: without the launcher's Python wrapper,
    tensor descriptors encoded as Triton encodes them), else through its ``run`` (the parameters after the
    positional ones, filled from keyword values or defaults, are kept with the compiled kernel when
    every keyword value is an int, bool, str or None: keyed exactly, they are the same for every
    launch of the key; a float or tensor keyword value is read from the live call). An int argument that
    changes every call (a per-step dropout seed) misses every time: Triton's path, as before. The
    first launch of each key, arguments of another kind, launch or pre-run hooks, a changed global
    of the kernel, the interpreter, Triton versions other than those in ``_DIRECT_LAUNCH_TRITON``
    and ``DET_DIRECT_LAUNCH=0`` (read at the first launch of the process) take Triton's own path.

    Args:
        kernel: a ``triton.jit`` function.
        grid: launch grid, a tuple of 1 to 3 ints (programs per axis).
        *args: the kernel's leading arguments, positionally (tensors, scalars, tensor descriptors).
        **kwargs: the remaining arguments by name (constexprs) and launch options (``num_warps``,
            ``num_stages``, ...), as for ``kernel[grid]``.

    Returns:
        The compiled kernel (``triton.compiler.CompiledKernel``), as ``kernel[grid](...)`` does.

    Raises:
        Exception: whatever ``kernel[grid](...)`` raises for these arguments (compile errors,
            missing arguments); the first launch of every key goes through it.

    **Determinism:** the same compiled kernel with the same arguments as ``kernel[grid]``: the
    same bits (a GPU test compares both paths).
    """
    if not (_direct_launch or _direct_launch_enabled()):
        return kernel[grid](*args, **kwargs)
    device = _cuda_device() if _LAUNCHES and _cuda_device else torch.cuda.current_device()  # as BoundLaunch
    runtime_knobs = _knobs.runtime
    try:
        flags, named, token = _params(kernel)
        kw_key, plain = _kwargs_key(kwargs)
        key = (token, device, len(grid), _args_key(args, flags), kw_key, runtime_knobs.debug,
               _knobs.compilation.instrumentation_mode)  # fmt: skip
        entry = _LAUNCHES.get(key)
    except (_NoKey, TypeError, AttributeError):  # another kind of argument or kernel
        return kernel[grid](*args, **kwargs)
    if entry is None or _needs_triton_path(kernel, runtime_knobs):
        compiled = kernel[grid](*args, **kwargs)  # compiles or finds the kernel: Triton's path
        if entry is None and hasattr(compiled, "run"):
            if len(_LAUNCHES) >= _MAX_LAUNCHES:
                _LAUNCHES.popitem(last=False)
            # plain keyword values are part of the key: the tail (constexprs by keyword or by
            # default) is then the same for every launch of the key and is kept with it
            tail = _tail(named, len(args), kwargs) if plain else None
            _LAUNCHES[key] = (_CompiledLaunch(compiled), tail)
        return compiled
    _LAUNCHES.move_to_end(key)
    direct, tail = entry
    if tail is None:
        tail = _tail(named, len(args), kwargs)
    return direct(grid, device, (*args, *tail))


def _needs_triton_path(kernel, runtime_knobs) -> bool:
    # launch hooks, pre-run hooks and changed globals are handled by JITFunction.run only
    return bool(
        _hook_set(runtime_knobs.launch_enter_hook)
        or _hook_set(runtime_knobs.launch_exit_hook)
        or kernel.pre_run_hooks
        or (kernel.used_global_vals and not _globals_unchanged(kernel))
    )


class _CompiledLaunch:
    """How the direct path launches one compiled kernel (Triton 3.6): its C launcher called with what
    ``CompiledKernel.run`` (a ``CudaLauncher``) would pass it, without that wrapper's Python.

    ``CudaLauncher.__call__`` allocates no scratch for kernels that need none and then calls the
    module's C ``launch``; for kernels with tensor-descriptor parameters that ``launch`` is
    ``wrap_handle_tensordesc``'s Python loop over every argument, which replaces each descriptor by
    its encoded ``CUtensorMap`` (``fill_tma_descriptor``) and its shape and strides. Here the
    descriptors' positions and encodings (swizzle, element size and type, block) are read once from
    that wrapper, and a launch replaces just those arguments: fewer Python calls per launch than
    the wrapper's (see docs/benchmarks.md). Kernels that need scratch memory, other launchers and
    wrappers of another form keep ``compiled.run``.

    **Determinism:** the same C launch with the same arguments (the same encoded descriptors) as
    ``compiled.run``: the same kernel, the same bits (GPU tests compare the paths).
    """

    __slots__ = ("compiled", "c_launch", "function", "head", "descs")

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self.c_launch = self.function = self.head = None
        self.descs = ()
        try:  # built after Triton's own launch of this kernel: a launcher of another form keeps run
            found = _c_launch_of(compiled)
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            found = None
        if found is not None:
            self.c_launch, self.head, self.descs = found
            self.function = compiled.function

    def __call__(self, grid: tuple, device: int, args):
        if len(grid) == 1:  # most launches: one axis
            grid_y = grid_z = 1
        else:
            grid_y = grid[1]
            grid_z = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        compiled = self.compiled
        if self.c_launch is None:  # the call JITFunction.run makes for a compiled kernel
            meta = compiled.packed_metadata
            compiled.run(grid[0], grid_y, grid_z, stream, compiled.function, meta, None, None, None, *args)
            return compiled
        if self.descs:
            args = _encode_descriptors(list(args), self.descs)
        self.c_launch(grid[0], grid_y, grid_z, stream, self.function, *self.head, *args)
        return compiled


_fill_tma_descriptor = None
# Triton 3.6's descriptor wrapper (backends/nvidia/driver.py) and the fields of its per-descriptor
# metadata that make_tensordesc_arg reads: a wrapper or metadata of another form keeps compiled.run
_TENSORDESC_WRAPPER = ("triton.backends.nvidia.driver", "wrap_handle_tensordesc.<locals>.inner")
_TMA_META_KEYS = frozenset(("swizzle", "elem_size", "elem_type", "block_size", "fp4_padded"))


def _c_launch_of(compiled):
    """``(c_launch, head, descs)`` of a Triton 3.6 ``CudaLauncher`` that needs no scratch memory, or
    None: the module's C launch, the arguments between the function and the kernel's own, and per
    tensor-descriptor parameter its position and encoding."""
    global _fill_tma_descriptor
    launcher = compiled.run
    if type(launcher).__name__ != "CudaLauncher":
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    c_launch, descs = launcher.launch, ()
    if isinstance(c_launch, types.FunctionType):  # Python: wrap_handle_tensordesc's inner
        if (c_launch.__module__, c_launch.__qualname__) != _TENSORDESC_WRAPPER:
            return None
        code, cells = c_launch.__code__, c_launch.__closure__ or ()
        free = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells), strict=False))
        indices, meta = free.get("tensordesc_indices"), free.get("tensordesc_meta")
        c_launch = free.get("launcher")
        if c_launch is None or isinstance(c_launch, types.FunctionType) or not indices or not meta:
            return None
        if len(meta) != len(indices) or any(
            m is None or set(m) != _TMA_META_KEYS or m["fp4_padded"] for m in meta
        ):
            return None  # host-decomposed descriptors, fp4 padding, fields this encoding does not know
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

        descs = tuple(
            (i, m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]], m["block_size"])
            for i, m in zip(sorted(indices), meta, strict=True)
        )
        if _fill_tma_descriptor is None:
            import triton

            _fill_tma_descriptor = triton.runtime.driver.active.utils.fill_tma_descriptor
    head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, compiled.packed_metadata,
            None, None, None)  # fmt: skip
    return c_launch, head, descs


def _encode_descriptors(args: list, descs: tuple) -> list:
    # what wrap_handle_tensordesc does per descriptor (make_tensordesc_arg), last position first so
    # the earlier positions stay where they are
    for i, swizzle, elem_size, dtype, block in reversed(descs):
        desc = args[i]
        padding = 1 if desc.padding == "nan" else 0
        encoded = _fill_tma_descriptor(
            desc.base.data_ptr(), swizzle, elem_size, dtype, block, desc.shape, desc.strides, padding
        )
        args[i : i + 1] = (encoded, *desc.shape, *desc.strides)
    return args


def _tail(named: tuple, n_args: int, kwargs: dict) -> tuple:
    # the parameters after the positional ones, from the keyword arguments or their defaults
    return tuple(kwargs[name] if name in kwargs else default for name, default in named[n_args:])


class PlanCache(dict):
    """Launch plans (or bound launches) by call signature, at most ``limit`` of them; a full cache
    is emptied before the next plan goes in (one process sees few signatures; a dropped plan is
    rebuilt on its next call).

    **Determinism:** a plan is a pure function of its key, so what the cache holds never changes a
    launch's arguments, only the host time spent building them.
    """

    def __init__(self, limit: int = 1024) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, plan):
        """Store ``plan`` under ``key`` (emptying a full cache first) and return it."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan


class BoundLaunch:
    """``launch(kernel, grid, *leading, *trailing, **kwargs)`` with ``trailing`` and ``kwargs`` fixed.

    A launch plan (one per call signature: shapes, strides, dtypes, config) knows every argument
    but the tensors: the sizes and strides after them and the constexprs / launch options. Bound
    here once, they are part of this object's identity: a call keys only its leading arguments
    (tensor dtypes and 16-byte alignment, descriptors: ``launch``'s rules) and finds the compiled
    kernel in this object's own table, instead of keying every argument again (the bulk of
    ``launch``'s host time at ~30 arguments per launch). Elsewhere than ``launch``'s direct path
    (the interpreter, other Triton versions) a call is ``kernel[grid](...)``.

    Args:
        kernel: a ``triton.jit`` function.
        n_leading: how many positional arguments each call passes (the kernel's first ones).
        trailing: the positional arguments after them: ints, floats, bools, strs or None.
        **kwargs: keyword arguments (constexprs, ``num_warps``, ...) of those same kinds.

    ``bound(grid, *leading)`` returns what ``launch`` returns.

    Raises:
        TypeError: a trailing or keyword value of another kind (a tensor can change address: it is
            a leading argument).
        Exception: from a call, whatever ``kernel[grid](...)`` raises (the first call of each key
            goes through it, as in ``launch``).

    **Determinism:** the same compiled kernel with the same arguments as ``launch`` (and
    ``kernel[grid]``): the same bits.
    """

    __slots__ = ("kernel", "n_leading", "trailing", "kwargs", "_flags", "_rest", "_entries")

    _MAX_ENTRIES = 64
    _FIXED_TYPES = (int, float, bool, str, type(None))

    def __init__(self, kernel, n_leading: int, trailing: tuple = (), **kwargs) -> None:
        for value in (*trailing, *kwargs.values()):
            if type(value) not in self._FIXED_TYPES:
                raise TypeError(
                    f"BoundLaunch: trailing and keyword arguments must be ints, floats, bools, strs or None, "
                    f"got {type(value).__name__}; pass tensors as leading arguments"
                )
        self.kernel, self.n_leading, self.trailing, self.kwargs = kernel, n_leading, tuple(trailing), kwargs
        # from the kernel's parameters, at the first direct launch: the leading arguments' flags, and
        # every argument after them (trailing, then the kernel's tail from kwargs or defaults) as one tuple
        self._flags = self._rest = None
        self._entries: dict = {}

    def __call__(self, grid: tuple, *leading):
        kernel = self.kernel
        if not _direct_launch and (_direct_launch is False or not _direct_launch_enabled()):
            return kernel[grid](*leading, *self.trailing, **self.kwargs)
        # a table entry means an earlier launch went through Triton, which initialised CUDA: the
        # current device can then be read without torch.cuda's initialisation check
        device = _cuda_device() if self._entries and _cuda_device else torch.cuda.current_device()
        runtime_knobs = _knobs.runtime
        try:
            flags = self._flags
            if flags is None:
                flags, named, _ = _params(kernel)
                tail = _tail(named, self.n_leading + len(self.trailing), self.kwargs)
                self._rest = (*self.trailing, *tail)
                flags = self._flags = flags[: self.n_leading]
            key = (device, len(grid), _tensors_key(leading, flags), runtime_knobs.debug,
                   _knobs.compilation.instrumentation_mode)  # fmt: skip
            direct = self._entries.get(key)
        except (_NoKey, TypeError, AttributeError):  # another kind of argument or kernel
            return kernel[grid](*leading, *self.trailing, **self.kwargs)
        # _needs_triton_path and _hook_set inline (frames less per launch): launch hooks (a HookChain
        # that holds a callable), pre-run hooks, changed globals
        enter, leave = runtime_knobs.launch_enter_hook, runtime_knobs.launch_exit_hook
        if (
            direct is None
            or (enter is not None and getattr(enter, "calls", True))
            or (leave is not None and getattr(leave, "calls", True))
            or kernel.pre_run_hooks
            or (kernel.used_global_vals and not _globals_unchanged(kernel))
        ):
            found = kernel[grid](*leading, *self.trailing, **self.kwargs)  # Triton's path
            if direct is None and hasattr(found, "run"):
                if len(self._entries) >= self._MAX_ENTRIES:
                    self._entries.clear()
                self._entries[key] = _CompiledLaunch(found)
            return found
        return direct(grid, device, (*leading, *self._rest))


class DescriptorTemplate:
    """Copies of one validated host tensor descriptor (``triton.tools.tensor_descriptor.
    TensorDescriptor``) with new bases: ``template(base)`` is ``TensorDescriptor(base, shape,
    strides, block_shape)`` without the constructor's validation (host time per descriptor, and a
    launch passes several).

    The descriptor given here was validated when it was built (dtype, strides, block shape): a
    launch plan keyed by everything that validation reads makes it once and copies it per call.
    The base's 16-byte alignment is the one field a copy does not re-check: the caller checks it
    (or keys its plan by it). On a Triton whose descriptor keeps its fields elsewhere than in a
    plain ``__dict__``, a call is the constructor.

    Args:
        desc: a ``TensorDescriptor`` built with any base of the right dtype (e.g. an empty tensor).

    The template keeps the descriptor's ``shape``, ``strides`` and ``block_shape`` and its other
    fields, never its base: a cached plan does not keep the tensor it was built from alive. Each
    copy also carries its layout as ``BoundLaunch`` keys it (``_det_layout``: computed once here,
    not per launch).

    **Determinism:** a copy holds the same fields as the constructor's result: the kernel gets the
    same descriptor, so the same bits.
    """

    __slots__ = ("shape", "strides", "block_shape", "_cls", "_fields")

    def __init__(self, desc) -> None:
        self._cls = type(desc)
        self.shape, self.strides, self.block_shape = desc.shape, desc.strides, desc.block_shape
        fields = getattr(desc, "__dict__", None)  # a plain dataclass on every Triton with descriptors
        self._fields = None if fields is None else {k: v for k, v in fields.items() if k != "base"}
        if self._fields is not None:  # the layout part of the launch key, for BoundLaunch's short key
            self._fields[_LAYOUT] = _descriptor_layout(desc)

    def __call__(self, base: torch.Tensor):
        if self._fields is None:
            return self._cls(base, self.shape, self.strides, self.block_shape)
        copy = object.__new__(self._cls)
        copy.__dict__.update(self._fields)
        copy.base = base
        return copy
