# Root conftest: loads det-core's pytest plugin (gpu/slow markers, CPU interpreter switch) after
# pytest has put the package source folders on sys.path (pyproject's `pythonpath`).
pytest_plugins = ["det_core.testing.pytest_plugin"]
