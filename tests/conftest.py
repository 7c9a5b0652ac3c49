"""A folder for the whole pytest run, shared by its xdist workers: the end-to-end tests
(tests/_e2e_runs.py) train each shared run once there instead of once per worker."""

from __future__ import annotations

import os
import shutil
import tempfile

SHARED_DIR_ENV = "DET_E2E_SHARED_DIR"  # read by tests/_e2e_runs.py


def pytest_configure(config):
    # the controller (or a run without xdist) makes the folder; xdist workers are started after
    # this and inherit the variable
    if hasattr(config, "workerinput") or os.environ.get(SHARED_DIR_ENV):
        return
    config._det_e2e_dir = tempfile.mkdtemp(prefix="det-e2e-run-")
    os.environ[SHARED_DIR_ENV] = config._det_e2e_dir


def pytest_unconfigure(config):
    folder = getattr(config, "_det_e2e_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(SHARED_DIR_ENV, None)
