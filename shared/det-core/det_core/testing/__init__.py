"""The determinism-test harness every package uses (dev only; not copied into Hub kernels).

Four kinds of test (STYLE.md): run-to-run, slice/batch invariance, decomposition invariance,
golden digests and resume-replay. Each helper raises ``AssertionError`` with a report that
names the first mismatching element, both values and their bit patterns. When a model fails
them, ``find_divergence`` (``det_core.testing.divergence``) names the first module output and the
first gradient whose bits differ between two decompositions of one step.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._nested import hex_bits, nested_leaves

__all__ = [
    "assert_bitwise_equal",
    "assert_decomposition_invariant",
    "assert_row_invariant",
    "assert_run_to_run",
    "bits",
    "contiguous_splits",
    "digest",
    "find_divergence",
    "run_in_fresh_process",
    "run_processes",
    "run_ranks",
    "DivergenceReport",
    "Difference",
    "OpNames",
]

# det_core.testing.divergence (the divergence finder, a subpackage) loads on first use: the
# harness's own helpers need none of it
_DIVERGENCE = ("find_divergence", "DivergenceReport", "Difference")


def __getattr__(name: str):
    if name in _DIVERGENCE:
        from . import divergence

        return getattr(divergence, name)
    raise AttributeError(f"module 'det_core.testing' has no attribute {name!r}")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t`` as an integer tensor of the same shape (int64 for 8 bytes)."""
    t = t.detach().contiguous().cpu()
    size = t.element_size()
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(int_dtype)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> None:
    """Assert two tensors have the same dtype, shape and bits (NaN payloads and -0 included).

    On failure the message gives the count of differing elements and the first one: its index,
    both values and both bit patterns in hex.
    """
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != {expected.dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, e = bits(actual), bits(expected)
    diff = a != e
    if bool(diff.any()):
        count = int(diff.sum())
        flat = int(diff.flatten().nonzero()[0])
        index = (
            tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape))
            if actual.dim()
            else ()
        )
        av = actual.detach().cpu().flatten()[flat].item()
        ev = expected.detach().cpu().flatten()[flat].item()
        ab, eb = (hex_bits(int(x.flatten()[flat]), actual.element_size()) for x in (a, e))
        raise AssertionError(
            f"{name}: {count} of {actual.numel()} elements differ; first at index {index}: "
            f"{av!r} ({ab}) != {ev!r} ({eb})"
        )


def digest(obj) -> str:
    """sha256 hex digest of a tensor, or of a (nested) dict/list of tensors such as a state_dict.

    Hashes each tensor's name, dtype, shape and raw bytes in key order, so equal digests mean
    bitwise-equal contents. Non-tensor leaves are hashed by ``repr``.
    """
    h = hashlib.sha256()
    for name, item in nested_leaves(obj):
        h.update(name.encode())
        if isinstance(item, torch.Tensor):
            t = item.detach().contiguous().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(bits(t).numpy().tobytes())
        else:
            h.update(item.encode())
    return h.hexdigest()


def assert_run_to_run(fn: Callable[[], object], repeats: int = 3, name: str = "output") -> object:
    """Call ``fn`` ``repeats`` times and assert every result has the digest of the first.

    Returns the first result. ``fn`` must build its own inputs or reuse fixed ones.

    Raises:
        ValueError: ``repeats`` below 2 (nothing would be compared: a check that did not run
            never passes).
        AssertionError: a repeat's digest differs (the first differing tensor is named).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"assert_run_to_run: repeats must be an int >= 2 (runs to compare), got {repeats!r}")
    first = fn()
    ref = digest(first)
    for r in range(1, repeats):
        got = fn()
        if digest(got) != ref:
            _compare_nested(got, first, f"{name} (repeat {r})")
            raise AssertionError(f"{name}: digest changed on repeat {r}")
    return first


def _compare_nested(actual, expected, name: str) -> None:
    for (ka, a), (_, e) in zip(nested_leaves(actual), nested_leaves(expected), strict=False):
        if isinstance(a, torch.Tensor):
            assert_bitwise_equal(a, e, f"{name}{ka}")


def assert_row_invariant(
    fn: Callable[[torch.Tensor], torch.Tensor],
    make_batch: Callable[[int], torch.Tensor],
    batch_sizes: Sequence[int],
    anchor: torch.Tensor,
    name: str = "row",
) -> None:
    """Assert a row's result does not depend on the batch size or its position in the batch.

    ``anchor`` is one row (shape ``(1, ...)``). For each batch size M, ``make_batch(M)`` gives
    other rows of shape ``(M, ...)``; the anchor replaces row 0, M // 2 and M - 1 in turn and
    ``fn(batch)[pos]`` must equal ``fn(anchor)[0]`` bit for bit.

    Raises:
        ValueError: no batch size, or one below 1 (nothing would be compared).
        AssertionError: a row differs.
    """
    batch_sizes = list(batch_sizes)
    if not batch_sizes or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in batch_sizes):
        raise ValueError(
            f"assert_row_invariant: batch_sizes must be ints >= 1, at least one; got {batch_sizes}"
        )
    ref = fn(anchor)[0]
    for m in batch_sizes:
        positions = sorted({0, m // 2, m - 1})
        for pos in positions:
            batch = make_batch(m).clone()
            batch[pos : pos + 1] = anchor
            assert_bitwise_equal(fn(batch)[pos], ref, f"{name}: M={m}, row {pos}")


def contiguous_splits(length: int, parts: int, granule: int = 1) -> list[tuple[int, int]]:
    """Split ``range(length)`` into ``parts`` contiguous, as-even-as-possible ranges of whole granules.

    The first ranges take the extra granules (e.g. 8 in 3 parts -> 3, 3, 2). Raises
    ``ValueError`` if ``length`` is not a multiple of ``granule``, there are more parts than granules,
    or ``parts`` or ``granule`` is below 1.
    """
    if parts < 1 or granule < 1:
        raise ValueError(
            f"contiguous_splits: parts and granule must be >= 1, got parts={parts}, granule={granule}"
        )
    if length % granule:
        raise ValueError(f"length {length} is not a multiple of the granule {granule}")
    units = length // granule
    if parts > units:
        raise ValueError(f"cannot split {units} granules into {parts} non-empty parts")
    base, extra = divmod(units, parts)
    out, start = [], 0
    for p in range(parts):
        size = (base + (p < extra)) * granule
        out.append((start, start + size))
        start += size
    return out


def assert_decomposition_invariant(
    whole: Callable[[], object],
    split: Callable[[int], object],
    parts: Sequence[int] = (1, 2, 3, 4, 7),
    name: str = "result",
) -> None:
    """Assert ``split(p)`` (the same work in ``p`` parts) equals ``whole()`` bitwise for each p.

    Include 3 or more parts: a degree-2 test proves little (a + b == b + a).

    Raises:
        ValueError: ``parts`` is empty or holds a count below 1 (nothing would be compared).
        AssertionError: a decomposition's digest differs.
    """
    parts = list(parts)
    if not parts or any(p < 1 for p in parts):
        raise ValueError(
            f"assert_decomposition_invariant: parts must be counts >= 1, at least one; got {parts}"
        )
    ref = whole()
    for p in parts:
        got = split(p)
        if digest(got) != digest(ref):
            _compare_nested(got, ref, f"{name} [{p} parts]")
            raise AssertionError(f"{name}: digest differs with {p} parts")


def run_processes(
    target: Callable,
    args_per_process: Sequence[tuple],
    *,
    start_method: str = "fork",
    timeout: float = 600,
    what: str = "processes",
) -> None:
    """Start one ``torch.multiprocessing`` process per argument tuple (``target(*args)``), wait
    for all, and raise unless every one exited with 0.

    For multi-rank tests (one process per gloo / NCCL rank): a rank that fails or hangs past
    ``timeout`` seconds gets the others killed, so the test fails instead of waiting in a
    collective. ``start_method``: ``"fork"`` (ranks inherit the loaded kernels) or ``"spawn"``
    (needed once CUDA is initialised in the parent). Results travel through files the target writes.

    Raises:
        AssertionError: ``what`` and every process's exit code (None: still running at the timeout),
            the tracebacks being on stderr.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    procs = [ctx.Process(target=target, args=args) for args in args_per_process]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        for p in procs:
            p.kill()
        raise AssertionError(f"{what}: exit codes {codes} (tracebacks above, on stderr)")


def _child_env(env: dict | None) -> dict[str, str]:
    """This process's environment for a child Python: ``sys.path`` as its ``PYTHONPATH``, plus ``env``.

    ``PYTHONFAULTHANDLER`` is set, so a child that dies of a signal (a C++ abort in a collective
    library, a segfault) prints every thread's Python stack to its stderr before it goes."""
    child = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONFAULTHANDLER="1")
    child.update(env or {})  # env may set PYTHONPATH too
    return child


# libstdc++'s message when std::terminate runs outside exception handling
_CPP_TERMINATE = "terminate called without an active exception"


def run_ranks(
    script: str | os.PathLike,
    nprocs: int,
    args: Sequence[str | os.PathLike] = (),
    *,
    env: dict | None = None,
    timeout: float = 300,
) -> None:
    """Run ``script args...`` on ``nprocs`` local ranks with torchrun and raise unless all succeed.

    ``python -m torch.distributed.run --standalone --nproc-per-node nprocs script args``: each rank
    gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a free local
    port), so the script calls ``dist.init_process_group(backend)`` with the default ``env://``;
    torchrun ends every rank when one fails. The ranks inherit ``sys.path`` (as ``PYTHONPATH``) and
    the environment, plus ``env``. Results travel through files the script writes.

    One known fault outside the script is run again, once, with a warning: a rank that aborts in
    C++ with libstdc++'s "terminate called without an active exception" (a ``std::thread`` destroyed
    while joinable). It came from 4 gloo ranks of the FSDP2 test on a loaded 2-core machine, after
    every result had been written, about once in 270 runs here (twice in CI). A second failure of
    any kind raises.

    Raises:
        AssertionError: a rank failed (torchrun's exit code and the end of its stderr, the failing
            rank's traceback included; every rank runs with ``PYTHONFAULTHANDLER``, so a rank that
            dies of a signal prints its threads' Python stacks) or the ranks ran past ``timeout``
            seconds.

    **Determinism:** none of its own: the ranks run the script as it is; which rank starts first is
    up to the OS, so a script that is to be invariant must not depend on it.

    Method: torch.distributed.run (torchrun), the launcher torch documents for multi-process jobs.
    """
    child_env = _child_env(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
           str(script), *map(str, args)]  # fmt: skip
    for attempt in (1, 2):
        try:
            proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{Path(script).name} on {nprocs} ranks ran past {timeout} s") from e
        if proc.returncode == 0:
            return
        if attempt == 1 and _CPP_TERMINATE in proc.stderr:
            at = proc.stderr.index(_CPP_TERMINATE)  # the fault handler's stacks follow the message
            warnings.warn(
                f"{Path(script).name} on {nprocs} ranks: a rank aborted in C++ ({_CPP_TERMINATE!r}); "
                "ran the ranks again. Its stderr from there:\n" + proc.stderr[max(at - 500, 0) : at + 8000],
                stacklevel=2,
            )
            continue
        raise AssertionError(
            f"{Path(script).name} on {nprocs} ranks: torchrun exited {proc.returncode}:\n"
            + proc.stderr[-6000:]
        )


def run_in_fresh_process(
    code: str, *, cold_triton_cache: bool = True, env: dict | None = None, timeout: float = 600
) -> str:
    """Run Python ``code`` in a new interpreter and return its last stdout line (e.g. a digest).

    With ``cold_triton_cache`` the child gets an empty ``TRITON_CACHE_DIR``, so kernels compile
    from scratch. The child inherits ``sys.path`` and the environment (plus ``env``). Raises
    ``AssertionError`` with the child's stderr if it fails.
    """
    child_env = _child_env(env)
    with tempfile.TemporaryDirectory() as cache:
        if cold_triton_cache:
            child_env["TRITON_CACHE_DIR"] = cache
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=Path.cwd(),
        )
    if proc.returncode != 0:
        raise AssertionError(f"fresh process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise AssertionError("fresh process printed nothing")
    return lines[-1]


class OpNames(TorchDispatchMode):
    """A dispatch mode that records the name of every aten op run inside it, in call order.

    ``with OpNames() as ops: ...`` then ``ops.names``: overload names such as ``"add_.Tensor"`` or
    ``"zeros.default"``, for tests that say which ops a path runs (or never runs). Each op runs
    unchanged. Any active dispatch mode changes some paths, this one too: det-train's ops and
    AdamWSR's step take their custom-op route under one (AdamWSR's step also leaves its recorded
    launches), which tests use to reach that route.
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Record ``func``'s name, then run it as it is."""
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))
