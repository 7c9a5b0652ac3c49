"""Where kernels run: on a CUDA GPU, or on CPU through the Triton interpreter.

The interpreter is chosen by ``TRITON_INTERPRET=1`` *before* Triton is imported (Triton reads it
when a kernel is decorated). Under the interpreter bf16 ``tl.dot`` is not supported
(triton-lang/triton#11584), so kernels upcast bf16 tiles to fp32 before a dot when
``interpreter_active()`` (exact: a bf16 product is exact in fp32). Importing this module with the
interpreter active installs ``det_core.interpreter``: the interpreter's dot and transcendentals
then give the same bits on every x86-64 host. ``det_core.runtime`` (the checks) and
``det_core.launch`` (the launches) both stand on it, so either import installs it.

**Determinism:** on the GPU nothing here runs; under the interpreter the installed arithmetic is
the same on every host (see ``det_core.interpreter``).
"""

from __future__ import annotations

import os

__all__ = ["check_triton_interprets", "interpreter_active"]


# POSIX keeps the environment as a dict of bytes (``os.environ._data``, updated by every assignment
# to and deletion from ``os.environ``, pytest's ``monkeypatch.setenv`` included): one dict lookup per
# call instead of ``os.environ.get``'s five Python frames, on every kernel-device check of every op
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENV_BYTES, dict):
    _ENV_BYTES = None
_OFF = (b"", b"0")


def interpreter_active() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``), read from
    the environment at each call (a test may set or clear it)."""
    if _ENV_BYTES is not None:
        return _ENV_BYTES.get(b"TRITON_INTERPRET", b"0") not in _OFF
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_triton_interprets() -> None:
    """Raise if Triton was imported before ``TRITON_INTERPRET=1`` was set: its own ``triton.jit``
    functions (``tl.sum``, ...) are then compiled-kernel functions, and every kernel fails inside with
    Triton's "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.sum, InterpretedFunction):
        raise RuntimeError(
            "det_core: TRITON_INTERPRET=1 was set after triton was imported (transformers, accelerate and "
            "torch._inductor import it too), and Triton reads it at its import: its kernels cannot run "
            "through the interpreter now. Set TRITON_INTERPRET=1 before anything imports triton: in the "
            "shell (TRITON_INTERPRET=1 python ...) or in the first lines of the script"
        )


_TRITON_INTERPRETS = False  # set once the check has passed: Triton's mode cannot change after


def check_triton_interprets() -> None:
    """Raise a ``RuntimeError`` saying what to do when ``TRITON_INTERPRET=1`` is set but Triton was
    imported without it (set later in the process, e.g. after a first kernel call on CPU failed);
    Triton's own error would be "0 active drivers". Checked once per process when it passes.

    Raises:
        RuntimeError: Triton's ``@jit`` functions are compiled-kernel functions, not interpreted ones.

    **Determinism:** reads Triton's import-time mode; computes nothing.
    """
    global _TRITON_INTERPRETS
    if not _TRITON_INTERPRETS:
        _check_triton_interprets()
        _TRITON_INTERPRETS = True


if interpreter_active():  # the interpreter's dot and transcendentals, made the same on every CPU
    check_triton_interprets()
    from . import interpreter as _interpreter

    _interpreter.install()
