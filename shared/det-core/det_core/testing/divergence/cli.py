"""The command line: ``python -m det_core.testing.divergence MODEL STEP --split-a A [--split-b B]``."""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import traceback
from collections.abc import Callable, Sequence

from .find import _check_arguments, find_divergence


def _load(target: str, parser: argparse.ArgumentParser) -> Callable:
    """The callable that ``MODULE:FUNCTION`` names; anything else ends the command through
    ``parser.error`` (status 2): never an uncaught traceback (status 1 would read as a divergence),
    never a target module's own exit (a script that exits 0 when imported would read as none)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        parser.error(
            f"cannot load the target: expected MODULE:FUNCTION (e.g. mypkg.repro:make_model), got {target!r}"
        )
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        parser.error(f"cannot load the target: {type(e).__name__}: {e} (is its folder on PYTHONPATH?)")
    except SystemExit as e:
        parser.error(
            f"cannot load the target {target}: importing {module_name} exited (SystemExit({e.code!r})): "
            "a target module must only define functions when imported; put make_model and step in a "
            "module of their own, or guard the script's code with if __name__ == '__main__'"
        )
    except Exception as e:  # a module that fails on import: its traceback, then a usage error
        traceback.print_exc()
        parser.error(f"cannot load the target: importing {module_name} raised {type(e).__name__}: {e}")
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as e:
        parser.error(f"cannot load the target: AttributeError: {e}")
    if not callable(obj):
        parser.error(f"cannot load the target: {target} is a {type(obj).__name__}, not a callable")
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
        The exit status: 0 no divergence, 1 divergence, 2 a run that raised or exited (its
        traceback is printed; no comparison was made).

    Raises:
        SystemExit: status 2 (argparse's convention, after the usage and a message): bad arguments;
            a target that does not load (not ``MODULE:FUNCTION``, a module that does not import or
            exits when imported, a missing or non-callable name); targets that ``find_divergence``
            refuses before running (a model instance for ``MODEL``, a step that never reads its
            split, ...).

    **Determinism:** as ``find_divergence``.

    Method: ``argparse`` over ``find_divergence``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m det_core.testing.divergence",
        description="Run one training step under two decompositions (or twice under one) and name the "
        "first module output and the first gradient whose bits differ.",
        epilog="A split is whatever STEP reads to decompose its batch (a Python literal, else a string), "
        "e.g. "
        "--split-a 1 --split-b 4 for 1 vs 4 micro-batches, or --split-a '[8]' --split-b '[3, 5]' for "
        "micro-batch sizes. STEP(model, split) builds its batch itself and must use the split. "
        "Exit status: 0 no divergence, 1 divergence, 2 bad arguments or a run that raised.",
    )
    parser.add_argument("model", metavar="MODEL", help="module:function returning a fresh, seeded model")
    parser.add_argument("step", metavar="STEP", help="module:function step(model, split): one training step")
    parser.add_argument(
        "--split-a",
        required=True,
        type=_split,
        help="first decomposition, passed to STEP as split: a Python literal (1, 4, '[3, 5]'), else a string",
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
    make_model, step = _load(args.model, parser), _load(args.step, parser)
    try:  # what find_divergence refuses before running: a usage error, without a traceback
        _check_arguments(make_model, step, args.split_a, args.split_b, args.batch_dim)
    except (TypeError, ValueError) as e:
        parser.error(f"{args.model} / {args.step}: {e}")
    keep = set(args.keep) if args.keep else not args.digests_only
    try:
        report = find_divergence(
            make_model, step, args.split_a, args.split_b, batch_dim=args.batch_dim, keep_tensors=keep
        )
    except (Exception, SystemExit):  # the model or the step failed or exited: not a comparison
        traceback.print_exc()
        print("divergence: the run raised (above); no comparison was made", file=sys.stderr)
        return 2
    print(report)
    return 1 if report.diverged else 0
