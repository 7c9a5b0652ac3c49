"""What ``find_divergence`` reports: ``Difference`` (one compared tensor that differs) and
``DivergenceReport`` (all of them, in order, with the text a person reads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
            equal sizes (``find_divergence`` then issues a ``UserWarning`` that ``step`` may ignore
            its split, and ``str(report)`` does not call equal bits "no divergence").
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
    def same_decomposition_warning(self) -> str:
        """The warning ``find_divergence`` issues (and ``str(self)`` shows) for ``same_decomposition``."""
        return (
            f"both runs called the model with the same micro-batch sizes {list(self.micro_batch_sizes[0])}: "
            "does step(model, split) use its split? (a step that ignores it compares a decomposition "
            "with itself)"
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
            lines.append(f"warning: {self.same_decomposition_warning}")
        if not self.diverged and self.same_decomposition:
            lines.append(
                f"not a split-invariance check: {self.outputs_compared} module outputs and "
                f"{self.gradients_compared} gradients are bitwise equal, but both runs made the same "
                "micro-batches, so unless split changes something else they ran the same computation"
            )
        elif not self.diverged:
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


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors: an elementwise ==, not one answer
        return a is b
