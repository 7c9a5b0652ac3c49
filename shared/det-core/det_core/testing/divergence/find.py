"""``find_divergence``: run one training step under two decompositions (or twice under one) and name
the first module output and the first gradient whose bits differ."""

from __future__ import annotations

import dis
import inspect
import types
import warnings
from collections.abc import Callable, Collection, Mapping

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .. import digest
from .capture import _Run, _Stream
from .compare import _compare, _with_inputs
from .report import DivergenceReport, _same


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


def _check_arguments(make_model, step, split_a, split_b, batch_dim) -> None:
    """Raise the error a new user needs before anything runs: a model where its factory belongs, a
    factory or step that cannot be called as ``make_model()`` / ``step(model, split)``, a step that
    never reads the split of two different ones."""
    if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
        raise ValueError(f"batch_dim must be a non-negative int, got {batch_dim!r}")
    if isinstance(make_model, torch.nn.Module):
        cls = type(make_model).__name__
        raise TypeError(
            f"make_model must be a factory: a zero-argument callable that returns a fresh model, e.g. "
            f"make_model=lambda: {cls}() (with the constructor's arguments), or a def make_model() that "
            f"seeds and builds it; got a model instance ({cls}). Each run builds its own model with the "
            "same initial weights, so the tool needs the recipe, not the model"
        )
    for name, fn, args in (("make_model", make_model, ()), ("step", step, (None, None))):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: the call will tell
            continue
        try:
            signature.bind(*args)
        except TypeError:
            params = (p.replace(annotation=p.empty) for p in signature.parameters.values())
            label = f"{getattr(fn, '__name__', type(fn).__name__)}({', '.join(map(str, params))})"
            if name == "make_model":
                raise TypeError(
                    f"make_model must be a factory: a zero-argument callable that returns a fresh model, "
                    f"but {label} cannot be called without arguments; wrap it, e.g. "
                    f"make_model=lambda: {label.partition('(')[0]}(...) with its arguments"
                ) from None
            raise TypeError(
                f"step must take two positional arguments, step(model, split), but {label} "
                "cannot be called so; e.g. def step(model, split): ... (split: the decomposition, such "
                "as a micro-batch count)"
            ) from None
    if split_b is not None and not _same(split_a, split_b):
        unread = _unread_split_parameter(step)
        if unread is not None:
            raise ValueError(
                f"step never reads its split parameter {unread!r}: split_a={split_a!r} and "
                f"split_b={split_b!r} would run the same computation and 'no divergence' would say "
                "nothing. step(model, split) must run the step under the decomposition it is given, "
                f"e.g. for xb, yb in zip(x.chunk({unread}), y.chunk({unread})): "
                "loss_fn(model(xb), yb).backward()"
            )


# Names through which a function can read its locals without naming them in its code
_DYNAMIC_READS = frozenset(("locals", "vars", "eval", "exec"))


def _unread_split_parameter(step) -> str | None:
    """The name of the parameter that receives ``split`` in ``step(model, split)`` when ``step``'s
    code never reads it; None when it reads it or that cannot be told (a ``functools.partial``, a
    callable object, a builtin, a decorated function, ``*args``, ``locals()``)."""
    func, index = step, 1  # split is the second positional argument
    if inspect.ismethod(func):
        func, index = func.__func__, 2  # after self
    if not isinstance(func, types.FunctionType) or hasattr(func, "__wrapped__"):
        return None
    code = func.__code__
    if index >= code.co_argcount:
        return None  # collected by *args
    name = code.co_varnames[index]
    if name in code.co_cellvars or _DYNAMIC_READS.intersection(code.co_names):
        return None  # read by an inner function or comprehension, or maybe through locals()
    for instruction in dis.get_instructions(code):
        op, arg = instruction.opname, instruction.argval
        if op.startswith("LOAD") and ("FAST" in op or "DEREF" in op or "CLOSURE" in op):
            if arg == name or (isinstance(arg, tuple) and name in arg):  # LOAD_FAST_LOAD_FAST: a pair
                return None
    return name


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
    * **A check that did not run** is never reported as "no divergence". Before any run, a step
      whose code never reads its ``split`` parameter (a plain function or method; read in its
      bytecode) raises ``ValueError`` when the two splits differ. After the runs, two different
      splits that called the model with the same micro-batch sizes (a step that reads its split
      but does not decompose by it) give a ``UserWarning`` and ``report.same_decomposition``.

    Args:
        make_model: a factory: a zero-argument callable that returns a fresh model with the same
            initial weights on every call (seed inside it), e.g. ``lambda: MyModel()``. It is
            called once per run; the model may live on any device.
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
        TypeError: ``make_model`` is a model instance instead of a factory, or cannot be called
            without arguments; ``step`` cannot be called as ``step(model, split)``; either is not
            callable; ``make_model`` does not return a ``torch.nn.Module``; ``gradients`` returns
            something other than tensors or None; an output is a tensor subclass (e.g. DTensor);
            ``keep_tensors`` is a string.
        ValueError: ``batch_dim`` negative; ``step`` never reads its split parameter (two different
            splits); ``make_model`` returned the same model object twice, or different initial
            weights in the two runs (it must seed); ``step`` never called ``model``.
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
    _check_arguments(make_model, step, split_a, split_b, batch_dim)
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
        if runs and model is runs[0].model:
            raise ValueError(
                "make_model returned the same model object twice: it must build a fresh one on every "
                "call (make_model=lambda: MyModel(), not lambda: model), else run b starts from the "
                "state run a left"
            )
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
    report = DivergenceReport(
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
    if report.same_decomposition:
        warnings.warn(report.same_decomposition_warning, UserWarning, stacklevel=2)
    return report
