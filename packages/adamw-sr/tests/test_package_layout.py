"""adamw_sr's face after its internal modules took an underscore (``kernel`` -> ``_kernel``, ...): the
same public names, imported on first use, and every old module path still imports, as the very
same module."""

import importlib
import json
import sys

import adamw_sr
import pytest
from det_core.testing import run_in_fresh_process

# adamw_sr.__all__ before the renaming, name for name
PUBLIC_NAMES = [
    "AdamWSR",
    "adamw_sr_step",
    "adamw_sr_step_reference",
    "default_base_indices",
    "local_segments",
]
DEFINED_IN = {
    "AdamWSR": "adamw_sr.optimizer",
    "adamw_sr_step": "adamw_sr.functional",
    "adamw_sr_step_reference": "adamw_sr.reference",
    "default_base_indices": "adamw_sr.indices",
    "local_segments": "adamw_sr.indices",
}

# old module path -> (its module now, names read from it in docs, examples, benchmarks and tests)
OLD_MODULES = {
    "adamw_sr.checks": ("adamw_sr._checks", ["check_hyperparameters", "SUPPORTED_PARAM_DTYPES"]),
    "adamw_sr.kernel": ("adamw_sr._kernel", ["LAUNCH_CONFIGS", "adamw_sr_kernel", "step_scalars_kernel"]),
    "adamw_sr.launch": ("adamw_sr._launch", ["launch_fused_step", "exactness_options", "LaunchPlan"]),
    "adamw_sr.state_codes": ("adamw_sr._state_codes", ["QUANT_BLOCK", "encode", "decode"]),
    "adamw_sr.states": ("adamw_sr._states", ["EIGHT_BIT", "scale_shape", "check_8bit_segments"]),
    "adamw_sr.step_cache": ("adamw_sr._step_cache", ["LaunchSet", "GroupLaunches"]),
}
# modules that keep their path: each defines public names
UNMOVED = ["adamw_sr.functional", "adamw_sr.indices", "adamw_sr.optimizer", "adamw_sr.reference"]


def test_the_face_exports_the_same_names():
    assert adamw_sr.__all__ == PUBLIC_NAMES
    assert sorted(DEFINED_IN) == PUBLIC_NAMES


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_each_export_is_its_defining_modules_object(name):
    value = getattr(adamw_sr, name)
    assert value.__module__ == DEFINED_IN[name]
    assert getattr(importlib.import_module(DEFINED_IN[name]), name) is value


def test_an_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'kernel_configs'"):
        adamw_sr.kernel_configs  # noqa: B018


# A new interpreter: the old paths are imported first (before anything imported the new ones), in
# both import forms; then what each resolved to, and whether the package's import alone imported
# any submodule (the face is lazy) and whether the public classes register the custom ops.
_OLD_FIRST = """
import importlib, json, sys
import adamw_sr
out = {{"submodules_after_import": sorted(m for m in sys.modules if m.startswith("adamw_sr."))}}
old_modules = {old_modules!r}
for old, (new, names) in old_modules.items():
    if old.endswith("kernel"):
        from adamw_sr import kernel as module
    else:
        module = importlib.import_module(old)
    imported = {{n: getattr(module, n) for n in names}}
    real = importlib.import_module(new)
    out[old] = {{
        "same_module": module is real and sys.modules[old] is real,
        "attribute": getattr(adamw_sr, old.rpartition(".")[2]) is real,
        "same_names": all(imported[n] is getattr(real, n) for n in names),
        "name": real.__name__,
        "spec": real.__spec__.name,
    }}
import torch
adamw_sr.AdamWSR
out["ops"] = [hasattr(torch.ops.adamw_sr, op) for op in ("fused_step", "fused_step_amp", "fused_step_states")]
print(json.dumps(out))
"""


def test_old_module_paths_import_as_the_same_modules_in_a_fresh_process():
    code = _OLD_FIRST.format(old_modules={k: list(v) for k, v in OLD_MODULES.items()})
    out = json.loads(run_in_fresh_process(code, cold_triton_cache=False))
    assert out["submodules_after_import"] == []
    for old, (new, _) in OLD_MODULES.items():
        assert out[old] == {
            "same_module": True,
            "attribute": True,
            "same_names": True,
            "name": new,
            "spec": new,
        }, old
    assert out["ops"] == [True, True, True]


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_old_module_path_is_the_new_module(old):
    new, names = OLD_MODULES[old]
    real = importlib.import_module(new)
    assert importlib.import_module(old) is real
    assert sys.modules[old] is real
    for name in names:
        assert getattr(importlib.import_module(old), name) is getattr(real, name)
    assert real.__name__ == new and real.__spec__.name == new  # the alias path leaves the module's own


def test_a_global_patched_through_the_old_path_is_the_new_modules(monkeypatch):
    old = importlib.import_module("adamw_sr.kernel")
    monkeypatch.setitem(old.LAUNCH_CONFIGS, "interpreter", {"BLOCK": 8})
    assert importlib.import_module("adamw_sr._kernel").LAUNCH_CONFIGS["interpreter"] == {"BLOCK": 8}
    monkeypatch.setattr(importlib.import_module("adamw_sr.launch"), "launch_fused_step", None)
    assert importlib.import_module("adamw_sr._launch").launch_fused_step is None


@pytest.mark.parametrize("path", UNMOVED)
def test_unmoved_modules_import(path):
    assert importlib.import_module(path).__name__ == path


def test_an_unknown_module_path_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("adamw_sr.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("adamw_sr.optimizer_state")
