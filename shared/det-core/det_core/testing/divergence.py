"""Find where a training step stops being split-invariant (or run-to-run reproducible).

``find_divergence(make_model, step, split_a, split_b)`` runs one training step twice, under two
decompositions (or twice under one, for run-to-run), records every module's output through
PyTorch's global module hooks and names the first module output and the first gradient whose bits
differ. Also a command line tool::

    python -m det_core.testing.divergence mypkg.repro:make_model mypkg.repro:step --split-a 1 --split-b 3
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import sys
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from . import _digest_items, _hex, bits, digest

__all__ = ["DivergenceReport", "Difference", "find_divergence", "main"]

ROOT_NAME = "<root>"  # how reports show the model itself (qualified name "")
_SHOWN = 8  # names listed per "also differ" line


@dataclass(frozen=True)
class Difference:
    """One compared tensor whose bits (or dtype, shape, presence) differ between the two runs.

    Attributes:
        kind: ``"output"`` (a module's output) or ``"gradient"`` (an entry of ``gradients``).
        name: the module's qualified name (``""`` for the model itself; ``"<unregistered Cls>"``
            for a module that is not part of the model, such as a loss built inside the step), or
            the gradient's name (the parameter's qualified name by default).
        call: outputs: which call of the module within a micro-batch (0 = its first call in each
            micro-batch); ``None`` for gradients.
        path: outputs: where the tensor sits in the module's output (``""`` for a tensor output,
            ``"/0"`` for the first item of a tuple, ``"/logits"`` for a dict key); ``""`` for
            gradients.
        reason: ``"bits"`` (same dtype and shape, other bits), ``"dtype"``, ``"shape"``, or
            ``"missing"`` (produced in one run only: a module called a different number of times,
            a gradient that is ``None`` in one run).
        dtype_a, dtype_b, shape_a, shape_b: of the compared (global) tensors, ``None`` where missing.
        count, numel: differing elements and all elements (``reason == "bits"`` with both tensors
            kept; else ``None``).
        index: the first differing element's index in the global tensor (row-major order).
        value_a, value_b: that element in run a and b (Python numbers).
        bits_a, bits_b: its bit patterns in hex, e.g. ``"0x3f81"`` for bf16 1.0078125, ``"0x3c00"``
            for fp16 1.0, ``"0x3f800000"`` for fp32 1.0.
        digest_a, digest_b: sha256 of the compared bytes in each run (``None`` where missing).
        inputs_agree: outputs only: whether the module's positional tensor inputs were bitwise
            equal in both runs (``True``: the difference arises inside its forward; ``False``: it was
            already in its inputs, made by code that is not a module, e.g. inline in the parent's
            forward or in the step itself); ``None`` where not comparable or no tensor inputs.

    **Determinism:** a plain record of two finished runs; nothing in it is recomputed.

    Method: element report as in ``det_core.testing.assert_bitwise_equal``.
    """

    kind: str
    name: str
    call: int | None
    path: str
    reason: str
    dtype_a: torch.dtype | None = None
    dtype_b: torch.dtype | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    count: int | None = None
    numel: int | None = None
    index: tuple[int, ...] | None = None
    value_a: float | int | bool | None = None
    value_b: float | int | bool | None = None
    bits_a: str | None = None
    bits_b: str | None = None
    digest_a: str | None = None
    digest_b: str | None = None
    inputs_agree: bool | None = None

    @property
    def where(self) -> str:
        """The tensor as reports name it, e.g. ``"layers.1.mlp"``, ``"attn output /0 (call 1)"``."""
        return _where(self.kind, self.name, self.call, self.path)

    def __str__(self) -> str:
        head = f"{self.where}: "
        if self.reason == "missing":
            which = "a" if self.digest_b is None else "b"
            return head + f"present in run {which} only"
        if self.reason == "dtype":
            return head + f"dtype {self.dtype_a} vs {self.dtype_b}"
        if self.reason == "shape":
            return head + f"shape {self.shape_a} vs {self.shape_b}"
        text = head + f"{_dtype_name(self.dtype_a)} {self.shape_a}: "
        if self.count is None:
            text += (
                f"sha256 {self.digest_a[:12]}... vs {self.digest_b[:12]}... (tensors not kept: pass "
                f"keep_tensors={{{self.name!r}}}, or --keep {self.name!r} on the command line, "
                "for the elements)"
            )
        else:
            text += (
                f"{self.count} of {self.numel} elements differ; first at index {self.index}: "
                f"{self.value_a!r} ({self.bits_a}) vs {self.value_b!r} ({self.bits_b})"
            )
        if self.inputs_agree is True:
            text += "; its inputs agree, so the difference arises inside this module's forward"
        elif self.inputs_agree is False:
            parent = self.name.rsplit(".", 1)[0] if "." in self.name else ROOT_NAME
            text += (
                "; its inputs already differ, though no earlier module output does: the difference "
                f"arises outside any module (inline code in {parent}'s forward, or the step's own inputs)"
            )
        return text


@dataclass(frozen=True)
class DivergenceReport:
    """What ``find_divergence`` found: the differing outputs and gradients, in order.

    Attributes:
        split_a, split_b: the two decompositions as passed (``split_b is split_a`` for run-to-run).
        run_to_run: ``True`` when ``split_b`` was not given (one decomposition run twice).
        micro_batches: how many times each run called the model, ``(a, b)``.
        micro_batch_sizes: per run, the ``batch_dim`` size of each model call's first tensor input
            (None where it has no such dim); ``same_decomposition`` flags two different splits with
            equal sizes (``str(report)`` then warns that ``step`` may ignore its split).
        outputs_compared, gradients_compared: how many tensors were compared bit for bit.
        output_differences: the module outputs that differ, in forward execution order of run a
            (the order the outputs were produced: a submodule before its parent).
        gradient_differences: the gradients that differ, in the order of run a's ``gradients``
            mapping (``model.named_parameters()`` order by default).
        skipped: one line per recorded output that could not be compared like with like (e.g. a
            per-micro-batch loss when the runs have different micro-batch counts).

    ``str(report)`` is the human report; ``bool(report.diverged)`` says whether anything differs.

    **Determinism:** a plain record of two finished runs.

    Method: see ``find_divergence``.
    """

    split_a: object
    split_b: object
    run_to_run: bool
    micro_batches: tuple[int, int]
    outputs_compared: int
    gradients_compared: int
    output_differences: tuple[Difference, ...]
    gradient_differences: tuple[Difference, ...]
    skipped: tuple[str, ...]
    outputs_before_first: int = (
        0  # compared outputs, in forward order, that agree before the first difference
    )
    micro_batch_sizes: tuple[tuple[int | None, ...], tuple[int | None, ...]] = ((), ())

    @property
    def same_decomposition(self) -> bool:
        """Two different splits that called the model with the same micro-batch sizes: ``step``
        probably ignores its ``split`` argument, and "no divergence" then says nothing."""
        sizes_a, sizes_b = self.micro_batch_sizes
        return (
            not self.run_to_run
            and bool(sizes_a)
            and sizes_a == sizes_b
            and not _same(self.split_a, self.split_b)
        )

    @property
    def diverged(self) -> bool:
        """Whether any compared output or gradient differs."""
        return bool(self.output_differences or self.gradient_differences)

    @property
    def first_output(self) -> Difference | None:
        """The first differing module output in forward execution order, or ``None``."""
        return self.output_differences[0] if self.output_differences else None

    @property
    def first_gradient(self) -> Difference | None:
        """The first differing gradient in ``gradients`` order, or ``None``."""
        return self.gradient_differences[0] if self.gradient_differences else None

    def __str__(self) -> str:
        mb_a, mb_b = self.micro_batches
        if self.run_to_run:
            title = f"split {self.split_a!r} run twice (run-to-run, {_plural(mb_a, 'micro-batch')})"
        else:
            title = (
                f"split_a={self.split_a!r} ({_plural(mb_a, 'micro-batch')}) vs split_b={self.split_b!r} "
                f"({_plural(mb_b, 'micro-batch')})"
            )
        lines = [f"find_divergence: {title}"]
        if self.same_decomposition:
            lines.append(
                f"warning: both runs called the model with the same micro-batch sizes "
                f"{list(self.micro_batch_sizes[0])}: does step(model, split) use its split? "
                "(a step that ignores it compares a decomposition with itself)"
            )
        if not self.diverged:
            lines.append(
                f"no divergence: {self.outputs_compared} module outputs and {self.gradients_compared} "
                "gradients are bitwise equal"
            )
        first = self.first_output
        if first is None and self.diverged:
            lines.append(f"module outputs: all {self.outputs_compared} compared are bitwise equal")
        elif first is not None:
            lines.append(
                f"first module output that differs (forward order; {self.outputs_before_first} of "
                f"{self.outputs_compared} compared outputs agree before it):"
            )
            lines.append(f"  {first}")
        grad = self.first_gradient
        if grad is None and self.diverged:
            lines.append(f"gradients: all {self.gradients_compared} compared are bitwise equal")
        elif grad is not None:
            lines.append(
                f"first gradient that differs (of {self.gradients_compared} compared, by name order):"
            )
            lines.append(f"  {grad}")
        for label, diffs in (("outputs", self.output_differences), ("gradients", self.gradient_differences)):
            rest = [d.where for d in diffs[1:]]
            if rest:
                more = f", ... ({len(rest) - _SHOWN} more)" if len(rest) > _SHOWN else ""
                lines.append(f"also differ ({label}, {len(rest)}): {', '.join(rest[:_SHOWN])}{more}")
        if self.skipped:
            lines.append(f"not compared ({len(self.skipped)}):")
            lines.extend(f"  {s}" for s in self.skipped[:_SHOWN])
            if len(self.skipped) > _SHOWN:
                lines.append(f"  ... ({len(self.skipped) - _SHOWN} more)")
        return "\n".join(lines)


def _where(kind: str, name: str, call: int | None, path: str) -> str:
    text = name or ROOT_NAME
    if kind == "output":
        if path:
            text += f" output {path}"
        if call:
            text += f" (call {call})"
    return text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("h") else "s")


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


class _Stream:
    """One recorded tensor across a run: its pieces (one per call) hashed in order, joined on demand."""

    __slots__ = ("hasher", "dtypes", "shapes", "batched", "pieces")

    def __init__(self, keep: bool) -> None:
        self.hasher = hashlib.sha256()
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []  # per piece, with the batch dim moved first
        self.batched: list[bool] = []
        self.pieces: list[torch.Tensor] | None = [] if keep else None

    def add(self, t: torch.Tensor, batch_dim: int | None, where: str) -> None:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"find_divergence: {where} is a {type(t).__name__} (a tensor subclass); only plain tensors "
                "can be compared: run the step without the wrapper (no DTensor / FSDP / compile) "
                "for the search"
            )
        batched = batch_dim is not None and t.dim() > batch_dim
        piece = t.detach().movedim(batch_dim, 0) if batched else t.detach()
        # a copy when kept: the step may change the tensor in place after the hook
        piece = piece.to("cpu", copy=self.pieces is not None).contiguous()
        self.hasher.update(piece.reshape(-1).view(torch.uint8).numpy())
        self.dtypes.append(piece.dtype)
        self.shapes.append(tuple(piece.shape))
        self.batched.append(batched)
        if self.pieces is not None:
            self.pieces.append(piece)

    @property
    def joins(self) -> bool:
        """Whether the pieces join into one global tensor along the batch dim."""
        return all(self.batched) and len({s[1:] for s in self.shapes}) == 1 and len(set(self.dtypes)) == 1

    @property
    def stacks(self) -> bool:
        """Whether the pieces are batch-free tensors of one shape and dtype (stacked when several)."""
        return not any(self.batched) and len(set(self.shapes)) == 1 and len(set(self.dtypes)) == 1

    def global_shape(self, batch_dim: int | None) -> tuple:
        if self.joins:
            shape = [sum(s[0] for s in self.shapes), *self.shapes[0][1:]]
            shape.insert(batch_dim, shape.pop(0))
            return tuple(shape)
        if self.stacks:
            return self.shapes[0] if len(self.shapes) == 1 else (len(self.shapes), *self.shapes[0])
        return tuple(self.shapes)  # not one tensor: the pieces' shapes

    def global_tensor(self, batch_dim: int | None) -> torch.Tensor | None:
        if self.pieces is None:
            return None
        if self.joins:
            return torch.cat(self.pieces, 0).movedim(0, batch_dim)
        if self.stacks:
            return self.pieces[0] if len(self.pieces) == 1 else torch.stack(self.pieces)
        return None


class _Run:
    """The module calls of one step, recorded by global forward hooks (pre: inputs, post: outputs)."""

    def __init__(self, model: torch.nn.Module, batch_dim: int, keep: Callable[[str], bool]) -> None:
        self.model = model
        self.batch_dim = batch_dim
        self.keep = keep
        self.names: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self.names.setdefault(id(module), name)
        self.micro_batches = 0
        self.sizes: list[int | None] = []  # batch_dim size of each micro-batch's first tensor input
        self.uses: dict[str, int] = {}  # calls per module name in the current micro-batch
        self.stack: list[tuple[int, str, int]] = []  # (id(module), name, call) of the open calls
        self.outputs: dict[tuple[str, int, str], _Stream] = {}  # insertion order = forward order
        self.inputs: dict[tuple[str, int, str], _Stream] = {}
        self.alive: list[torch.nn.Module] = []  # unregistered modules kept alive: their ids stay unique

    def _name(self, module: torch.nn.Module) -> str:
        name = self.names.get(id(module))
        if name is None:
            name = f"<unregistered {type(module).__qualname__}>"
            self.alive.append(module)
        return name

    def pre_hook(self, module, args) -> None:
        if module is self.model and not self.stack:
            self.micro_batches += 1
            self.uses.clear()
            first = next((t for _, t in _digest_items(tuple(args)) if isinstance(t, torch.Tensor)), None)
            self.sizes.append(
                first.shape[self.batch_dim] if first is not None and first.dim() > self.batch_dim else None
            )
        name = self._name(module)
        call = self.uses.get(name, 0)
        self.uses[name] = call + 1
        self.stack.append((id(module), name, call))
        for path, t in _digest_items(tuple(args)):
            if isinstance(t, torch.Tensor):
                key = (name, call, path)
                self.inputs.setdefault(key, _Stream(keep=False)).add(
                    t, self.batch_dim, f"input {path} of {_where('output', name, call, '')}"
                )

    def post_hook(self, module, args, output) -> None:
        while self.stack:  # a forward that raised inside leaves its entries: drop them
            ident, name, call = self.stack.pop()
            if ident == id(module):
                break
        else:
            return  # a call that began before the hooks were installed
        keep = self.keep(name)
        for path, t in _digest_items(output):
            if isinstance(t, torch.Tensor):
                key = (name, call, path)
                stream = self.outputs.get(key)
                if stream is None:
                    stream = self.outputs[key] = _Stream(keep)
                stream.add(t, self.batch_dim, _where("output", name, call, path))


def _compare(
    kind: str,
    key: tuple[str, int | None, str],
    a: _Stream | None,
    b: _Stream | None,
    batch_dim: int | None,
    strict: bool,
) -> Difference | str | None:
    """None when equal, a Difference, or a string saying why the two cannot be compared."""
    name, call, path = key
    if a is None or b is None:
        return Difference(
            kind,
            name,
            call,
            path,
            "missing",
            digest_a=a and a.hasher.hexdigest(),
            digest_b=b and b.hasher.hexdigest(),
        )
    shape_a, shape_b = a.global_shape(batch_dim), b.global_shape(batch_dim)
    one_tensor = a.joins and b.joins
    if not strict and not one_tensor:
        what = (
            f"no dim {batch_dim} to join the micro-batches along (a per-micro-batch value)"
            if a.stacks and b.stacks
            else f"its pieces do not join along dim {batch_dim}"
        )
        return (
            f"{_where(kind, name, call, path)}: {what}, shapes {shape_a} vs {shape_b}; compared only "
            "run-to-run or for equal splits"
        )
    dtype_a, dtype_b = a.dtypes[0], b.dtypes[0]
    if set(a.dtypes) != set(b.dtypes) or (strict and a.dtypes != b.dtypes):
        return Difference(kind, name, call, path, "dtype", dtype_a=dtype_a, dtype_b=dtype_b)
    if shape_a != shape_b:
        if not strict:
            return (
                f"{_where(kind, name, call, path)}: global shapes {shape_a} vs {shape_b} after joining the "
                f"micro-batches along dim {batch_dim}: dim {batch_dim} is not the batch dim here"
            )
        return Difference(
            kind,
            name,
            call,
            path,
            "shape",
            dtype_a=dtype_a,
            dtype_b=dtype_b,
            shape_a=shape_a,
            shape_b=shape_b,
        )
    digest_a, digest_b = a.hasher.hexdigest(), b.hasher.hexdigest()
    if digest_a == digest_b:
        return None
    fields = dict(dtype_a=dtype_a, dtype_b=dtype_b, shape_a=shape_a, shape_b=shape_b)
    fields.update(digest_a=digest_a, digest_b=digest_b)
    ta, tb = a.global_tensor(batch_dim), b.global_tensor(batch_dim)
    if ta is not None and tb is not None:
        fields.update(_first_element(ta, tb))
    return Difference(kind, name, call, path, "bits", **fields)


def _first_element(a: torch.Tensor, b: torch.Tensor) -> dict:
    ba, bb = bits(a).flatten(), bits(b).flatten()
    diff = ba != bb
    flat = int(diff.nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    nbytes = a.element_size()
    return dict(
        count=int(diff.sum()),
        numel=a.numel(),
        index=index,
        value_a=a.flatten()[flat].item(),
        value_b=b.flatten()[flat].item(),
        bits_a=_hex(int(ba[flat]), nbytes),
        bits_b=_hex(int(bb[flat]), nbytes),
    )


def _default_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def _keep_predicate(keep_tensors: bool | Collection[str]) -> Callable[[str], bool]:
    if isinstance(keep_tensors, bool):
        return lambda name: keep_tensors
    if isinstance(keep_tensors, str):
        raise TypeError(
            f"keep_tensors must be a bool or a collection of names, got the string {keep_tensors!r} "
            f"(write {{{keep_tensors!r}}} for one name)"
        )
    names = set(keep_tensors)
    return lambda name: name in names


def find_divergence(
    make_model: Callable[[], torch.nn.Module],
    step: Callable[[torch.nn.Module, object], object],
    split_a: object,
    split_b: object = None,
    *,
    batch_dim: int = 0,
    gradients: Callable[[torch.nn.Module], Mapping[str, torch.Tensor | None]] | None = None,
    keep_tensors: bool | Collection[str] = True,
) -> DivergenceReport:
    """Run one training step under two decompositions and name the first module and gradient that differ.

    For each run the tool calls ``model = make_model()`` and then ``step(model, split)`` with
    PyTorch's global module hooks installed, then reads ``gradients(model)``. Run a uses
    ``split_a``, run b ``split_b`` (or ``split_a`` again when ``split_b`` is None: run-to-run).

    What is compared, exactly:

    * **Micro-batches** are delimited by the calls of ``model`` itself: micro-batch ``j`` is
      everything from the ``j``-th ``model(...)`` call to the next one (including the backward, a
      loss module and activation-checkpoint recomputes in between). ``step`` must run its
      micro-batches in global order (the first sequences first).
    * **Module outputs**: every tensor in every module's output (tuples, lists and dicts walked,
      e.g. ``"/0"``, ``"/logits"``), keyed by ``(qualified module name, call number within the
      micro-batch, position in the output)``. A tensor with a dim ``batch_dim`` is joined over
      the micro-batches along ``batch_dim`` in micro-batch order, so both runs compare the same
      global tensor (e.g. shape ``(6, T, D)`` from one micro-batch of 6 sequences or from three of
      2), element by element in global sequence order. A tensor without that dim (a scalar loss) is
      compared per micro-batch, and only when both runs use the same split (run-to-run or
      ``split_a == split_b``); otherwise it is listed in ``skipped``, as is a tensor whose joined
      shapes differ between two different splits (its ``batch_dim`` is not the batch).
    * **Order**: module outputs are listed in forward execution order of run a, i.e. in the order
      the outputs were produced (a submodule before the module that calls it), so the first
      difference is the innermost module where the bits first change. A difference in a module's
      positional tensor inputs is reported with it (``Difference.inputs_agree``), to tell a module
      that creates the difference from one that receives it from inline code.
    * **Gradients**: ``gradients(model)`` after ``step`` returns (default: ``p.grad`` of
      ``model.named_parameters()``; if ``step`` uses an accumulator, call its ``reduce`` inside
      ``step``). Compared whole, by name, in the mapping's order; any named tensors can be given,
      e.g. ``lambda m: dict(m.named_parameters())`` for the updated weights after an optimizer step.
    * Equality is of raw bits (sha256 of the bytes, with dtype and shape): ``-0.0 != 0.0``, NaN
      payloads count.

    Args:
        make_model: builds the model with the same initial weights on every call (seed inside it).
            The model is only built once per run; it may live on any device.
        step: ``step(model, split)`` runs one training step of ``model`` under decomposition
            ``split`` (e.g. a micro-batch count, or a list of micro-batch sizes) on the same global
            batch; its return value is ignored. Run it eagerly: a ``torch.compile``'d region hides
            its inner modules.
        split_a, split_b: the two decompositions, passed to ``step`` unchanged. ``split_b=None``:
            run-to-run (``split_a`` twice).
        batch_dim: the batch (or packed-token) dim of the module outputs, e.g. 0 for ``(B, T, D)``,
            1 for ``(1, T, D)`` packed sequences split along the tokens. Non-negative.
        gradients: ``gradients(model) -> {name: tensor or None}``, read after ``step``.
        keep_tensors: keep CPU copies of the outputs and gradients, so the report can give the first
            differing element and the count (``True``); only digests (``False``, for large models:
            memory is one sha256 per output); or keep only for these module / gradient names.

    Returns:
        A ``DivergenceReport``; ``print(report)`` gives the first differing module output and the
        first differing gradient with the first differing element's index, both values and both
        bit patterns in hex, and the count of differing elements.

    Raises:
        TypeError: ``make_model`` is a model instance instead of a function that builds one, or
            ``make_model`` / ``step`` is not callable; ``make_model`` does not return a
            ``torch.nn.Module``; ``gradients`` returns something other than tensors or None; an
            output is a tensor subclass (e.g. DTensor); ``keep_tensors`` is a string.
        ValueError: ``batch_dim`` negative; ``make_model`` returned different initial weights in the
            two runs (it must seed); ``step`` never called ``model``.
        Exception: whatever ``make_model``, ``step`` or ``gradients`` raise, unchanged (the hooks
            are removed first).

    **Determinism:** the tool only reads: hooks detach and copy, never modify a tensor, and use no
    RNG, so a step behaves as without the tool, with one exception: copying every output to the
    CPU synchronizes a CUDA device after each module, which changes timing and may hide a race that
    needs overlap. The comparison and the report are a pure function of the two runs' bits.

    Method: PyTorch's global module hooks (``torch.nn.modules.module.register_module_forward_pre_hook``
    and ``register_module_forward_hook``) record every call; tensors are compared by sha256
    (FIPS 180-4) of their raw bytes, joined in global batch order, as batch invariance is defined
    in He et al., "Defeating Nondeterminism in LLM Inference" (Thinking Machines Lab, 2025).
    """
    if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
        raise ValueError(f"batch_dim must be a non-negative int, got {batch_dim!r}")
    if isinstance(make_model, torch.nn.Module):
        raise TypeError(
            "make_model must be a function that builds the model (e.g. lambda: "
            f"{type(make_model).__name__}(...)), got a model instance: each run needs a fresh "
            "model with the same initial weights"
        )
    if not callable(make_model) or not callable(step):
        bad = "make_model" if not callable(make_model) else "step"
        raise TypeError(
            f"{bad} must be callable, got {type(make_model if bad == 'make_model' else step).__name__}"
        )
    keep = _keep_predicate(keep_tensors)
    read_gradients = gradients or _default_gradients
    run_to_run = split_b is None
    if run_to_run:
        split_b = split_a
    strict = run_to_run or _same(split_a, split_b)

    runs, grads, initial = [], [], []
    for split in (split_a, split_b):
        model = make_model()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"make_model must return a torch.nn.Module, got {type(model).__name__}")
        initial.append({k: digest(v) for k, v in model.state_dict().items()})
        run = _Run(model, batch_dim, keep)
        handles = [
            register_module_forward_pre_hook(run.pre_hook),
            register_module_forward_hook(run.post_hook),
        ]
        try:
            step(model, split)
        finally:
            for handle in handles:
                handle.remove()
        if run.micro_batches == 0:
            raise ValueError(
                f"step(model, {split!r}) never called the model that make_model returned "
                f"({type(model).__name__}); find_divergence delimits micro-batches by its calls"
            )
        streams = {}
        for name, g in read_gradients(model).items():
            if g is None:
                continue
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"gradients: {name!r} is a {type(g).__name__}, expected a tensor or None")
            streams[name] = _Stream(keep(name))
            streams[name].add(g, None, f"gradient {name!r}")
        runs.append(run)
        grads.append(streams)
        run.alive.clear()
    changed = [k for k in initial[0] if initial[0][k] != initial[1].get(k)]
    changed += [k for k in initial[1] if k not in initial[0]]
    if changed:
        raise ValueError(
            f"make_model returned different initial weights in the two runs ({', '.join(changed[:4])}"
            f"{', ...' if len(changed) > 4 else ''}): seed it (torch.manual_seed) or load fixed "
            "weights inside it"
        )

    run_a, run_b = runs
    output_diffs, skipped = [], []
    compared = before_first = 0
    for key in [*run_a.outputs, *(k for k in run_b.outputs if k not in run_a.outputs)]:
        found = _compare("output", key, run_a.outputs.get(key), run_b.outputs.get(key), batch_dim, strict)
        if isinstance(found, str):
            skipped.append(found)
            continue
        compared += 1
        if found is None:
            before_first += not output_diffs
            continue
        output_diffs.append(_with_inputs(found, key, run_a, run_b, batch_dim, strict))
    grad_diffs, grads_compared = [], 0
    grad_a, grad_b = grads
    for name in [*grad_a, *(n for n in grad_b if n not in grad_a)]:
        found = _compare("gradient", (name, None, ""), grad_a.get(name), grad_b.get(name), None, True)
        grads_compared += 1
        if found is not None:
            grad_diffs.append(found)
    return DivergenceReport(
        split_a=split_a,
        split_b=split_b,
        run_to_run=run_to_run,
        micro_batches=(run_a.micro_batches, run_b.micro_batches),
        outputs_compared=compared,
        gradients_compared=grads_compared,
        output_differences=tuple(output_diffs),
        gradient_differences=tuple(grad_diffs),
        skipped=tuple(skipped),
        outputs_before_first=before_first,
        micro_batch_sizes=(tuple(run_a.sizes), tuple(run_b.sizes)),
    )


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors: an elementwise ==, not one answer
        return a is b


def _with_inputs(
    found: Difference, key, run_a: _Run, run_b: _Run, batch_dim: int, strict: bool
) -> Difference:
    name, call, _ = key
    verdicts = []
    for in_key in dict.fromkeys(k for k in (*run_a.inputs, *run_b.inputs) if k[:2] == (name, call)):
        verdict = _compare(
            "input", in_key, run_a.inputs.get(in_key), run_b.inputs.get(in_key), batch_dim, strict
        )
        if isinstance(verdict, str):
            continue
        verdicts.append(verdict is None)
    if not verdicts:
        return found
    return Difference(**{**found.__dict__, "inputs_agree": all(verdicts)})


def _load(target: str) -> Callable:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FUNCTION (e.g. mypkg.repro:make_model), got {target!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target} is a {type(obj).__name__}, not a callable")
    return obj


def _split(text: str) -> object:
    try:
        return ast.literal_eval(text)  # 3, (2, 4), [1, 1, 4]
    except (ValueError, SyntaxError):
        return text  # a name the step understands


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m det_core.testing.divergence MODEL STEP --split-a A [--split-b B]``.

    ``MODEL`` and ``STEP`` are ``module:function`` targets (importable from the current directory
    or ``PYTHONPATH``): ``make_model()`` and ``step(model, split)`` as for ``find_divergence``.
    Splits are Python literals (``3``, ``"(2, 4)"``) or else plain strings. Prints the report.

    Returns:
        The exit status: 0 no divergence, 1 divergence, 2 a run that raised (its traceback is
        printed), bad arguments or a target that does not import (argparse's convention).

    Raises:
        SystemExit: for bad arguments (status 2, after argparse prints the usage).

    **Determinism:** as ``find_divergence``.

    Method: ``argparse`` over ``find_divergence``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m det_core.testing.divergence",
        description="Run one training step under two decompositions (or twice under one) and name the "
        "first module output and the first gradient whose bits differ.",
    )
    parser.add_argument("model", metavar="MODEL", help="module:function returning a fresh, seeded model")
    parser.add_argument("step", metavar="STEP", help="module:function step(model, split): one training step")
    parser.add_argument(
        "--split-a", required=True, type=_split, help="first decomposition (a Python literal)"
    )
    parser.add_argument("--split-b", type=_split, default=None, help="second one; omitted: run-to-run")
    parser.add_argument("--batch-dim", type=int, default=0, help="batch dim of module outputs (default 0)")
    parser.add_argument(
        "--digests-only", action="store_true", help="keep no tensor copies (less memory; no element details)"
    )
    parser.add_argument(
        "--keep",
        action="append",
        default=None,
        metavar="NAME",
        help="keep tensors of this module/gradient only",
    )
    args = parser.parse_args(argv)
    try:
        make_model, step = _load(args.model), _load(args.step)
    except (ImportError, AttributeError, ValueError) as e:
        parser.error(f"cannot load the target: {type(e).__name__}: {e}")
    keep = set(args.keep) if args.keep else not args.digests_only
    try:
        report = find_divergence(
            make_model, step, args.split_a, args.split_b, batch_dim=args.batch_dim, keep_tensors=keep
        )
    except Exception:  # the model or the step failed: not a divergence (exit 1 would say there is one)
        traceback.print_exc()
        print("divergence: the run raised (above); no comparison was made", file=sys.stderr)
        return 2
    print(report)
    return 1 if report.diverged else 0


if __name__ == "__main__":
    sys.exit(main())
