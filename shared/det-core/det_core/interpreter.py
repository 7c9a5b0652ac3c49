"""Host-independent arithmetic for the Triton interpreter (``TRITON_INTERPRET=1``).

Triton's interpreter computes a kernel with numpy. Two of the numpy calls it makes are not the same
on every x86-64 CPU: ``tl.dot`` is ``np.matmul``, an OpenBLAS sgemm whose kernel (FMA or not,
blocking, edge tiles) is chosen per CPU and per tile shape, and ``tl.exp`` / ``exp2`` / ``log`` /
``log2`` are numpy's SIMD float32 routines, whose AVX-512, AVX2 and scalar versions differ in the
last bits (an AVX2 host, ``OPENBLAS_CORETYPE=Haswell`` or ``NPY_DISABLE_CPU_FEATURES=X86_V3``
each change kernel results). ``install()`` replaces these five operations of the interpreter
with versions built only from separately rounded IEEE-754 operations (multiply, add, divide,
``frexp``, ``ldexp``, casts), which numpy computes identically on every host:

* ``dot(a, b, acc)``: a sequential fp32 fold over K starting from the accumulator,
  ``acc + a[:, 0] b[0, :] + a[:, 1] b[1, :] + ...``, each product and each sum rounded to fp32
  (``np.add.accumulate`` is a scan, so its order is fixed by definition). bf16 operands (stored as
  raw uint16 by the interpreter, which would otherwise multiply the bit patterns:
  triton-lang/triton#11584) are widened to fp32 exactly.
* ``exp2``, ``exp``, ``log2``, ``log``: range reduction and a Taylor / atanh series evaluated in
  float64, rounded once to the input's dtype; under 1e-15 relative error before that rounding, so
  the results are float32's correctly rounded values in all but a vanishing share of cases (and the
  same bits everywhere in every case).

It also makes the interpreter's fp32 -> bf16 cast (every ``.to(tl.bfloat16)`` and every store of
fp32 values into bf16 memory) round to nearest-even (``round_bf16``), as the GPU's
``cvt.rn.bf16.f32`` and torch do: the interpreter's own cast truncates, so a kernel's bf16 output on
CPU was the GPU's rounded toward zero.

``install()`` also silences numpy's warnings about infinities and NaNs inside a launch (IEEE
arithmetic the kernels make on purpose, which the GPU does without a word), and spares the
interpreter a cost that changes no value: Triton's interpreter patches
``triton.language`` for the interpreter at every launch (restored when the launch ends) and patches it
again at every call of a nested ``triton.jit`` function, ``tl.zeros`` included (a scan of the
language's few hundred members per call, and a program of a kernel makes several such calls).
Inside a launch, a nested call whose language modules were already patched during
that launch now skips the repeat, which would set every patched attribute to an equivalent one.

The GPU path is untouched (compiled kernels never call the interpreter). Method: the classic
reductions ``2^x = 2^n 2^f`` with ``|f| <= 1/2``, ``ln m = 2 atanh((m - 1)/(m + 1))`` with
``m`` in ``[sqrt(1/2), sqrt(2))`` (J.-M. Muller, *Elementary Functions*, 3rd ed., ch. 11).
"""

from __future__ import annotations

import inspect
import math

import numpy as np

__all__ = ["exp", "exp2", "fixed_order_dot", "install", "log", "log2", "round_bf16"]

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
_SQRT_HALF = math.sqrt(0.5)
# 2^f = e^(f ln 2) = sum t^k / k!, t = f ln 2, |t| <= 0.347: 14 terms reach 4e-18
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(14, -1, -1)]
# ln m = 2 s sum s^(2k) / (2k + 1), s = (m - 1)/(m + 1), |s| <= 0.1716: 12 terms reach 2e-20
_ATANH_COEFFS = [1.0 / (2 * k + 1) for k in range(12, -1, -1)]
_FLOAT_RESULTS = (np.float16, np.float32, np.float64)


def _horner(coeffs: list[float], t: np.ndarray) -> np.ndarray:
    p = np.full_like(t, coeffs[0])
    for c in coeffs[1:]:
        p = p * t + c
    return p


def _as_float64(x: np.ndarray) -> np.ndarray:
    if x.dtype.type not in _FLOAT_RESULTS:
        raise TypeError(f"det_core.interpreter: transcendental of dtype {x.dtype} (float16/32/64 expected)")
    return np.asarray(x, dtype=np.float64)


def _exp2_f64(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        xc = np.clip(x, -1100.0, 1100.0)  # beyond the float64 range: 0 or inf after ldexp
        n = np.rint(xc)
        n = np.where(np.isnan(n), 0.0, n)
        f = xc - n  # exact: |xc| < 2^52
        r = np.ldexp(_horner(_EXP_COEFFS, f * _LN2), n.astype(np.int64))
        return np.where(np.isnan(x), np.nan, r)


def _ln_f64(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        m, e = np.frexp(x)  # x = m 2^e, m in [0.5, 1)
        small = m < _SQRT_HALF
        m = np.where(small, m * 2.0, m)
        e = np.where(small, e - 1, e).astype(np.float64)
        s = (m - 1.0) / (m + 1.0)
        r = e * _LN2 + 2.0 * s * _horner(_ATANH_COEFFS, s * s)
        r = np.where(x == 0, -np.inf, r)
        r = np.where(x == np.inf, np.inf, r)
        return np.where((x < 0) | np.isnan(x), np.nan, r)


def _round_to(r: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond the dtype's range: inf, as IEEE rounding says
        return r.astype(dtype)


def exp2(x: np.ndarray) -> np.ndarray:
    """``2**x`` elementwise, the same bits on every host; float16/32/64 in, same dtype out."""
    return _round_to(_exp2_f64(_as_float64(x)), x.dtype)


def exp(x: np.ndarray) -> np.ndarray:
    """``e**x`` elementwise as ``2**(x log2 e)`` in float64; float16/32/64 in, same dtype out."""
    return _round_to(_exp2_f64(_as_float64(x) * _LOG2E), x.dtype)


def log(x: np.ndarray) -> np.ndarray:
    """Natural logarithm elementwise (``-inf`` at 0, NaN below); float16/32/64 in, same dtype out."""
    return _round_to(_ln_f64(_as_float64(x)), x.dtype)


def log2(x: np.ndarray) -> np.ndarray:
    """Base-2 logarithm elementwise (``-inf`` at 0, NaN below); float16/32/64 in, same dtype out."""
    return _round_to(_ln_f64(_as_float64(x)) * _LOG2E, x.dtype)


def fixed_order_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``acc + a @ b`` as a sequential fold over K in ``acc``'s dtype, the same bits on every host.

    Args:
        a: ``(..., M, K)`` float array; b: ``(..., K, N)``; acc: ``(..., M, N)`` float array whose
            dtype is the accumulation dtype (operands are widened to it; exact for bf16/fp16 -> fp32).

    Returns:
        ``(..., M, N)`` array of ``acc``'s dtype: ``((acc + a[:, 0] b[0]) + a[:, 1] b[1]) + ...``, every
        product and sum rounded separately.
    """
    dtype = acc.dtype
    products = a.astype(dtype)[..., :, :, None] * b.astype(dtype)[..., None, :, :]  # (..., M, K, N)
    start = np.broadcast_to(acc, products.shape[:-2] + acc.shape[-1:])[..., None, :]
    terms = np.concatenate([start, products], axis=-2)
    return np.add.accumulate(terms, axis=-2)[..., -1, :]


def _bf16_bits_to_f32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 ``x`` rounded to bf16, nearest-even (ties to the even pattern), as bf16 bit patterns
    (uint16, the interpreter's storage of bf16), same shape. NaN -> ``0x7FC0`` (torch's quiet NaN);
    values past bf16's largest finite one round to infinity. The interpreter's own cast truncates
    (rounds toward zero), which the GPU's ``cvt.rn.bf16.f32`` does not. Raises nothing.

    **Determinism:** integer arithmetic on the fp32 pattern: the same bits on every host, and those of
    ``torch.Tensor.to(torch.bfloat16)``."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
        np.uint16
    )  # no wrap: only NaN patterns lie within 0x7FFF of 2**32
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def install() -> None:
    """Make the interpreter's dot, exp, exp2, log and log2 host-independent, and its fp32 -> bf16
    cast round to nearest-even as the GPU's ``cvt.rn.bf16.f32`` does (idempotent).

    Called by ``det_core.interpreter_mode`` when the interpreter is active. Integer and fp8 dots keep
    Triton's own path (integer sums are exact; fp8 is not used by our kernels). Also installs
    ``_skip_repeated_patches`` (nested ``triton.jit`` calls inside a launch patch the language once).

    Raises:
        RuntimeError: this Triton's interpreter lacks the builder methods replaced here (its
            results could then depend on the host CPU; pin a supported Triton, >= 3.4).
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    names = ("create_dot", "create_exp", "create_exp2", "create_log", "create_log2", "cast_impl")
    missing = [n for n in names if not hasattr(builder, n)]
    if missing or not hasattr(interpreter, "TensorHandle"):
        raise RuntimeError(
            f"det_core.interpreter: this Triton's interpreter has no {missing or ['TensorHandle']}; "
            "its results would depend on the host CPU. Use Triton >= 3.4 (CI pins 3.9)."
        )
    if getattr(builder, "_det_core_host_independent", False):
        return
    handle = interpreter.TensorHandle
    triton_dot = builder.create_dot
    triton_cast = builder.cast_impl

    def operand(h):
        if h.dtype == tl.bfloat16:
            return _bf16_bits_to_f32(h.data)
        return h.data

    def create_dot(self, a, b, d, *args, **kwargs):
        floats = all(h.dtype.is_floating() and h.dtype.primitive_bitwidth >= 16 for h in (a, b, d))
        if not floats or d.data.dtype.type not in _FLOAT_RESULTS:
            return triton_dot(self, a, b, d, *args, **kwargs)
        return handle(fixed_order_dot(operand(a), operand(b), d.data), d.dtype.scalar)

    def unary(fn):
        return lambda self, arg: handle(fn(arg.data), arg.dtype.scalar)

    def cast_impl(self, src, dst_type):  # every cast and store into bf16 goes through it
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(round_bf16(src.data), dst_type.scalar)
        return triton_cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.create_exp = unary(exp)
    builder.create_exp2 = unary(exp2)
    builder.create_log = unary(log)
    builder.create_log2 = unary(log2)
    builder.cast_impl = cast_impl
    builder._det_core_host_independent = True
    _skip_repeated_patches(interpreter, tl)
    _quiet_ieee_special_values(interpreter)


def _quiet_ieee_special_values(interpreter) -> None:
    """Run every launch under ``np.errstate(all="ignore")``: numpy warns (``RuntimeWarning: overflow /
    invalid value encountered``) where IEEE arithmetic makes an infinity or a NaN, which kernels make
    on purpose (``-inf`` masks before a softmax, an overflow the step propagates as torch does) and the
    GPU computes without a word; the warnings reached users' output. The values are unchanged."""
    grid_executor = getattr(interpreter, "GridExecutor", None)
    if grid_executor is None or getattr(grid_executor, "_det_core_quiet", False):
        return
    triton_launch = grid_executor.__call__

    def launch(self, *args, **kwargs):
        with np.errstate(all="ignore"):
            return triton_launch(self, *args, **kwargs)

    grid_executor.__call__ = launch
    grid_executor._det_core_quiet = True


def _skip_repeated_patches(interpreter, tl) -> None:
    """Let a nested ``triton.jit`` call inside a launch skip re-patching what the launch already patched.

    Triton's ``GridExecutor.__call__`` (a launch) calls ``_patch_lang(kernel)``, which patches, for each
    of the modules ``triton.language`` / ``triton.language.core`` that the kernel's globals name, the
    module's builtins, tensor methods and language hooks, and restores them all when the launch ends.
    ``InterpretedFunction.__call__`` (a nested jit call) calls ``_patch_lang(fn)`` again at every call
    and never restores what it sets. Inside one launch nothing is restored before its end, so once a
    module has been patched during the launch (by the launch itself or by a nested call), patching it
    again finds no unpatched builtin and sets each hook to an equivalent one (stateless closures of the
    same code): no effect on what a kernel computes. Such a repeated call is skipped here; the first
    patch of each module during a launch, and every call outside a launch, run as Triton wrote them.
    Left as it is (no error) when this Triton's interpreter lacks ``_patch_lang`` / ``GridExecutor``:
    only speed depends on it.
    """
    grid_executor = getattr(interpreter, "GridExecutor", None)
    triton_patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if grid_executor is None or triton_patch_lang is None or scope_type is None:
        return
    if getattr(grid_executor, "_det_core_patches_once", False):
        return
    triton_launch = grid_executor.__call__
    # one entry per running launch (innermost last): the kernel, then the modules patched during it
    launches: list[list] = []

    def modules_of(fn) -> set[int]:
        # what Triton's _patch_lang patches for fn: triton.language and its core, where fn's globals name them
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        if not launches:
            return triton_patch_lang(fn)
        kernel, patched = launches[-1]
        if patched is None:  # the launch's own patch (of its kernel), before any program runs
            scope = triton_patch_lang(fn)
            launches[-1][1] = modules_of(fn) if fn is kernel else set()
            return scope
        modules = modules_of(fn)
        if modules <= patched:
            return scope_type()  # nothing set, nothing to restore (Triton discards a nested call's scope)
        scope = triton_patch_lang(fn)
        patched |= modules
        return scope

    def launch(self, *args, **kwargs):
        launches.append([self.fn, None])
        try:
            return triton_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_lang
    grid_executor.__call__ = launch
    grid_executor._det_core_patches_once = True
