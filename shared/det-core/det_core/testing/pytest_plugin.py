"""pytest plugin: ``gpu``, ``slow`` and ``long`` markers, and the CPU interpreter switch.

Load with ``-p det_core.testing.pytest_plugin`` (the root pyproject does). Without a CUDA GPU
it sets ``TRITON_INTERPRET=1`` (before any test module imports triton) and skips ``gpu`` tests
with a reason; ``--run-slow`` (or ``DET_RUN_SLOW=1``) runs ``slow`` tests, skipped otherwise.
"""

from __future__ import annotations

import os

import pytest


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "slow: long test; run with --run-slow or DET_RUN_SLOW=1")
    config.addinivalue_line(
        "markers", "long: a test of minutes that always runs; scheduled first so it overlaps the rest"
    )
    if not _cuda_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    has_gpu = _cuda_available()
    run_slow = config.getoption("--run-slow") or os.environ.get("DET_RUN_SLOW") == "1"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `nox -s tests_gpu` on a GPU machine)")
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    # long tests first: pytest-xdist hands out tests in this order, so a worker starts on a long
    # one while the others share the rest, instead of one worker finishing it alone at the end
    items.sort(key=lambda item: "long" not in item.keywords)
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
