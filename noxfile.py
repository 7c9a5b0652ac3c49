"""Every task of the monorepo. A bare `nox` runs what a CPU-only machine can: lint, tests, docs.

Every session runs in one shared virtual environment, .nox/dev, into which each session installs
the pinned dependency groups it needs (once; again only when their pins change).

    nox -s tests       every non-GPU test, kernels through the Triton interpreter on CPU
    nox -s tests_gpu   the `gpu`-marked tests (on a GPU machine)
    nox -s demo        the main job: deterministic bf16 training (CPU interpreter or GPU)
    nox -s build       Hub build trees: packages/<name>/build/<variant>/
    nox -s docs        mkdocs build --strict
    nox -s lint        ruff
    nox -s bench       benchmarks (GPU)

On a GPU machine where nothing can be installed, run the GPU tests with its own python:
    python -m pytest -m gpu -p no:cacheprovider
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests", "docs"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
SOURCE_PATHS = PYPROJECT["tool"]["pytest"]["ini_options"]["pythonpath"]
HERE = Path(__file__).resolve().parent
# One virtual environment for every session (the torch stack is ~2.2 GB: one copy, one install).
# Each dependency group is installed into it once, and again only when its pins change.
DEV_ENV = HERE / ".nox" / "dev"


def _python(session: nox.Session, *groups: str) -> str:
    """The shared environment's python, with the pinned dependency ``groups`` installed."""
    python = DEV_ENV / "bin" / "python"
    if not python.exists():
        session.run_install(sys.executable, "-m", "venv", str(DEV_ENV), external=True)
    for group in groups:
        pins = "\n".join(nox.project.dependency_groups(PYPROJECT, group))
        stamp = DEV_ENV / f"installed-{group}.txt"
        if not stamp.is_file() or stamp.read_text() != pins:
            session.run_install(str(python), "-m", "pip", "install", *pins.split("\n"), external=True)
            stamp.write_text(pins)
    return str(python)


def _source_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(str(HERE / p) for p in SOURCE_PATHS)}


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every non-GPU test on CPU (Triton interpreter), in two processes."""
    python = _python(session, "test")
    session.run(
        python,
        "-m",
        "pytest",
        "-m",
        "not gpu",
        "-n",
        os.environ.get("DET_TEST_WORKERS", "2"),
        "--timeout",
        "900",
        *session.posargs,
        env={"TRITON_INTERPRET": "1"},
        external=True,
    )


@nox.session(venv_backend="none")
def tests_gpu(session: nox.Session) -> None:
    """The `gpu`-marked tests, on a CUDA machine."""
    session.run(_python(session, "test"), "-m", "pytest", "-m", "gpu", *session.posargs, external=True)


@nox.session(venv_backend="none")
def demo(session: nox.Session) -> None:
    """The main job: composed deterministic bf16 training (pass --verify to check digests)."""
    python = _python(session, "test")
    session.run(python, "examples/train_gpt.py", *session.posargs, env=_source_env(), external=True)


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Write each package's Hub build tree (packages/<name>/build/<variant>/) with det-core vendored."""
    python = _python(session, "test")
    session.run(python, "tools/build_hub.py", *session.posargs, env=_source_env(), external=True)


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """Build the documentation site, warnings as errors."""
    python = _python(session, "test", "docs")
    # the API pages import the kernels to list their exports; on a machine without a GPU, Triton
    # must be in interpreter mode before it is imported
    env = {**_source_env(), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    session.run(python, "-m", "mkdocs", "build", "--strict", *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    python = _python(session, "lint")
    session.run(python, "-m", "ruff", "check", ".", external=True)
    session.run(python, "-m", "ruff", "format", "--check", ".", external=True)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """All benchmarks on the GPU, side by side with the peers: tables, JSON and figures in bench-results/."""
    python = _python(session, "test")
    args = session.posargs or ["--out", "bench-results"]  # raw tables + JSON + figures; docs/ is curated
    session.run(python, "tools/run_benchmarks.py", *args, env=_source_env(), external=True)
    out = "bench-results"
    for i, arg in enumerate(args):  # --out DIR or --out=DIR
        if arg == "--out" and i + 1 < len(args):
            out = args[i + 1]
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
    session.run(python, "tools/plot_benchmarks.py", f"{out}/benchmarks.json", "--out", out, external=True)
