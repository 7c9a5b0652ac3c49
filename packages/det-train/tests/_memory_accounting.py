"""The peak bytes a ``CanonicalGradAccumulator`` holds or allocates over a step, measured exactly on CPU.

``AccumulatorMemory(acc)`` wraps the accumulator's own work (``deposit_rows``, ``deposit``,
``deposit_partial``, ``flush``, the undo of a failed micro-batch and ``reduce``) in a
``TorchDispatchMode`` that sees every tensor op those calls run (factory functions included), and
registers each output storage that is new (not a view of an input, not an input written in place)
under a weak reference (``StorageWeakRef``). After every op, and at the entry and exit of each
wrapped call, it samples the live accumulator-owned bytes: the registered storages still alive,
together with every storage reachable from the accumulator's state (tree nodes, open folds and
leaves, undo logs, queued copy destinations). Memory only grows inside an op (an allocation), so
the maximum of these samples is the exact peak of simultaneously live accumulator-owned bytes.

Not counted: the model's tensors (activations, the rows an op hands to ``deposit_rows``; an op's
own leaf sums before it deposits them) and the finished gradients (any storage that a tracked
``p.grad`` holds when the peak is read: the memory torch's own ``p.grad`` takes). Counted: every copy
the accumulator makes and every buffer its calls allocate, transient or kept, including what the op
callbacks (leaf sums, folds) allocate while the accumulator runs them.

A Triton kernel run by the interpreter copies its tensor arguments to host buffers and back; those
copies are the interpreter's, not the accumulator's (a GPU kernel makes none), so the mode ignores
what it sees while a kernel runs (the kernel's outputs are allocated before the launch, and counted),
and collects the reference cycles it leaves (a closure holding the arguments) after each launch.

Results are per phase (``"micro"``: inside micro-batches; ``"reduce"``) in bytes and, divided by
the tracked parameters' elements, in bytes per parameter element.
"""

from __future__ import annotations

import functools
import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:  # the interpreter's launch, whose argument copies are not counted
    from triton.runtime.interpreter import GridExecutor
except ImportError:  # no Triton: nothing to exclude
    GridExecutor = None

_WRAPPED = ("deposit_rows", "deposit", "deposit_partial", "flush", "_undo", "reduce")


def _storages(tensors) -> dict[int, torch.UntypedStorage]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            out[s._cdata] = s
    return out


def _state_tensors(acc) -> list[torch.Tensor]:
    """Every tensor the accumulator's state reaches (not the rows queued copies read from).

    An explicit stack, not a recursive closure: a closure that refers to itself is a reference cycle,
    which would keep the tensors it found alive until the garbage collector runs."""
    found: list[torch.Tensor] = []
    stack = [getattr(acc, name, None) for name in ("_partials", "_carry")]
    stack += [
        getattr(acc, name, None) for name in ("_undo_trees", "_undo_carry", "_undo_fills")
    ]  # (older layout)
    log = getattr(acc, "_log", None)
    if log is not None:
        stack += [log.trees, log.carry, log.fills]
    stack.append([dst for dst, _src in acc.pending_copies])
    while stack:
        obj = stack.pop()
        if obj is None:
            continue
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (tuple, list, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "nodes") and isinstance(obj.nodes, dict):  # TreePartial
            stack.append(obj.nodes)
        elif hasattr(type(obj), "__slots__"):  # OpenFold, OpenLeaf, SubLeafFold
            stack.extend(
                getattr(obj, n, None) for n in type(obj).__slots__ if n not in ("fold", "leaf_partial")
            )
    return found


class AccumulatorMemory(TorchDispatchMode):
    """Exact peak of the bytes ``acc`` holds or allocates, per phase (see the module docstring).

    Use as a context manager around a whole step (micro-batches and ``reduce``); read ``peak`` (bytes
    per phase) or ``per_param()`` (bytes per tracked parameter element) afterwards.
    """

    def __init__(self, acc) -> None:
        super().__init__()
        self.acc = acc
        self.numel = sum(p.numel() for p in acc._params)
        self.created: dict[int, tuple[StorageWeakRef, int, int]] = {}  # key -> (ref, bytes, serial)
        self._serial = 0
        self.peak = {"micro": 0, "reduce": 0}
        self._reduce_samples: list[dict] = []  # judged once the gradients are known
        self.phase = "micro"
        self._depth = 0  # nesting of wrapped calls (the mode is on while > 0)
        self._saved: dict[str, object] = {}
        self._in_kernel = 0
        self.origin: dict[tuple[int, int], tuple[str, str]] = {}  # what made a storage, in which call
        self.at_peak: dict[str, list] = {}  # phase -> [(bytes, what made it)] at the peak
        self._where = ""

    # -- wrapping the accumulator's calls
    def __enter__(self):
        for name in _WRAPPED:
            self._saved[name] = getattr(self.acc, name)
            setattr(self.acc, name, self._wrap(name, self._saved[name]))
        if GridExecutor is not None:
            launch = self._launch = GridExecutor.__call__

            @functools.wraps(launch)
            def call(executor, *args, **kwargs):
                # the interpreter leaves reference cycles (its copy-back closure holds the arguments):
                # collected after the launch, from the youngest generation, where they stay because no
                # automatic collection runs during the launch to promote them
                enabled = gc.isenabled()
                gc.disable()
                self._in_kernel += 1
                try:
                    return launch(executor, *args, **kwargs)
                finally:
                    self._in_kernel -= 1
                    gc.collect(0)
                    if enabled:
                        gc.enable()

            GridExecutor.__call__ = call
        return self

    def __exit__(self, *exc):
        for name in _WRAPPED:
            delattr(self.acc, name)  # back to the class's methods
        if GridExecutor is not None:
            GridExecutor.__call__ = self._launch
        return False

    def _wrap(self, name, method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            outer = self._depth == 0
            where, self._where = self._where, name
            if outer and name == "reduce":
                self.phase = "reduce"
            self._sample()
            if outer:
                TorchDispatchMode.__enter__(self)
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                self._where = where
                if outer:
                    TorchDispatchMode.__exit__(self, None, None, None)
                self._sample()
                if outer and name == "reduce":
                    self._judge_reduce()
                    self.phase = "micro"

        return call

    # -- the dispatch hook
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_kernel:
            return func(*args, **kwargs)
        inputs = _storages(tree_flatten((args, kwargs))[0])
        out = func(*args, **kwargs)
        for key, storage in _storages(tree_flatten(out)[0]).items():
            if key not in inputs:
                self._serial += 1
                self.created[key] = (StorageWeakRef(storage), storage.nbytes(), self._serial)
                self.origin[key, self._serial] = (str(func), self._where)
        self._sample()
        return out

    # -- sampling
    def _identity(self, key: int) -> tuple[int, int]:
        """A storage's identity: its address and creation serial (an address may be reused)."""
        hit = self.created.get(key)
        return key, (hit[2] if hit is not None else 0)

    def _live(self) -> dict[tuple[int, int], int]:
        live = {}
        for key, (ref, nbytes, serial) in list(self.created.items()):
            if ref.expired():
                del self.created[key]
            else:
                live[key, serial] = nbytes
        for key, storage in _storages(_state_tensors(self.acc)).items():
            live[self._identity(key)] = storage.nbytes()
        return live

    def _grads(self) -> set[tuple[int, int]]:
        """The storages the tracked ``p.grad`` hold: torch's gradients, not the accumulator's."""
        return {
            self._identity(p.grad.untyped_storage()._cdata) for p in self.acc._params if p.grad is not None
        }

    def _sample(self) -> None:
        live = self._live()
        if self.phase == "reduce":  # a gradient counts as p.grad from its allocation on
            self._reduce_samples.append(live)
            return
        for key in self._grads():
            live.pop(key, None)
        total = sum(live.values())
        if total > self.peak["micro"]:
            self.peak["micro"] = total
            self.at_peak["micro"] = self._explain(live)

    def _judge_reduce(self) -> None:
        grads = self._grads()
        for live in self._reduce_samples:
            total = sum(n for key, n in live.items() if key not in grads)
            if total > self.peak["reduce"]:
                self.peak["reduce"] = total
                self.at_peak["reduce"] = self._explain({k: n for k, n in live.items() if k not in grads})
        self._reduce_samples = []

    def _explain(self, live: dict) -> list:
        return sorted((n, self.origin.get(key, ("state", ""))) for key, n in live.items())

    def held(self) -> int:
        """Bytes the accumulator holds now (between calls: its state and anything its calls left)."""
        grads = self._grads()
        return sum(n for key, n in self._live().items() if key not in grads)

    def per_param(self) -> dict[str, float]:
        """The peaks in bytes per tracked parameter element, by phase."""
        return {phase: nbytes / self.numel for phase, nbytes in self.peak.items()}
