"""pytest plugin: ``gpu`` and ``slow`` markers, and the CPU interpreter switch.

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
    if not _cuda_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    has_gpu = _cuda_available()
    run_slow = config.getoption("--run-slow") or os.environ.get("DET_RUN_SLOW") == "1"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `nox -s tests_gpu` on a GPU machine)")
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
