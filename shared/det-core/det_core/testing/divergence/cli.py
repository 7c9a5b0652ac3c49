"""The command line: ``python -m det_core.testing.divergence MODEL STEP --split-a A [--split-b B]``."""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import traceback
from collections.abc import Callable, Sequence

from .find import find_divergence


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
