"""The det-core copies inside the Hub kernels must equal shared/det-core (regenerate, never edit)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_vendor_tool():
    spec = importlib.util.spec_from_file_location("vendor_det_core", ROOT / "tools" / "vendor_det_core.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vendored_det_core_has_not_drifted():
    drifted = _load_vendor_tool().drifted()
    assert not drifted, (
        f"vendored det-core differs from shared/det-core in {[str(p.relative_to(ROOT)) for p in drifted]}; "
        "run `python tools/vendor_det_core.py`"
    )


def test_every_package_vendors_every_runtime_module():
    tool = _load_vendor_tool()
    names = {p.name for p in tool.vendored_files() if p.parent.name == "det_core"}
    assert names == set(tool.RUNTIME_MODULES)
