"""Every task of the monorepo. A bare `nox` runs what a CPU-only machine can: lint, tests, docs.

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

import nox

nox.options.sessions = ["lint", "tests", "docs"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYPROJECT = nox.project.load_toml("pyproject.toml")
SOURCE_PATHS = PYPROJECT["tool"]["pytest"]["ini_options"]["pythonpath"]


def _install(session: nox.Session, *groups: str) -> None:
    for group in groups:
        session.install(*nox.project.dependency_groups(PYPROJECT, group))


def _source_env() -> dict[str, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return {"PYTHONPATH": os.pathsep.join(os.path.join(here, p) for p in SOURCE_PATHS)}


@nox.session
def tests(session: nox.Session) -> None:
    """Every non-GPU test on CPU (Triton interpreter), in two processes."""
    _install(session, "test")
    session.run(
        "python",
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
    )


@nox.session
def tests_gpu(session: nox.Session) -> None:
    """The `gpu`-marked tests, on a CUDA machine."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: composed deterministic bf16 training (pass --verify to check digests)."""
    _install(session, "test")
    session.run("python", "examples/train_gpt.py", *session.posargs, env=_source_env())


@nox.session
def build(session: nox.Session) -> None:
    """Write each package's Hub build tree (packages/<name>/build/<variant>/) with det-core vendored."""
    _install(session, "test")
    session.run("python", "tools/build_hub.py", *session.posargs, env=_source_env())


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site, warnings as errors."""
    _install(session, "test", "docs")
    # the API pages import the kernels to list their exports; on a machine without a GPU, Triton
    # must be in interpreter mode before it is imported
    env = {**_source_env(), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    session.run("mkdocs", "build", "--strict", *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    _install(session, "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """All benchmarks on the GPU, side by side with the peers: tables, JSON and figures in bench-results/."""
    _install(session, "test")
    args = session.posargs or ["--out", "bench-results"]  # raw tables + JSON + figures; docs/ is curated
    session.run("python", "tools/run_benchmarks.py", *args, env=_source_env())
    out = "bench-results"
    for i, arg in enumerate(args):  # --out DIR or --out=DIR
        if arg == "--out" and i + 1 < len(args):
            out = args[i + 1]
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
    session.run("python", "tools/plot_benchmarks.py", f"{out}/benchmarks.json", "--out", out)
