"""det_train's face after the regrouping into ops/, accum/, parallel/ and integrations/: the same
public names, and every module path of the flat layout still imports, as the very same module."""

import importlib
import json
import sys
import types

import det_train
import pytest
from det_core.testing import run_in_fresh_process

# det_train.__all__ of the flat layout, name for name
PUBLIC_NAMES = [
    "CanonicalGradAccumulator",
    "Conv1D",
    "ConversionError",
    "DeterministicAllreduceState",
    "Embedding",
    "LayerNorm",
    "Linear",
    "RMSNorm",
    "ScaledEmbedding",
    "causal_lm_loss",
    "column_parallel_linear",
    "conv1d",
    "convert",
    "cross_entropy",
    "current_accumulator",
    "deterministic_allreduce_hook",
    "deterministic_mode",
    "embedding",
    "layer_norm",
    "layers",
    "linear",
    "matmul",
    "matmul_partial",
    "reduce_gradients",
    "register_conversion",
    "rms_norm",
    "row_parallel_linear",
    "swiglu",
]

# module path of the flat layout -> (its module now, names imported from it in docs, examples,
# benchmarks and tests)
OLD_MODULES = {
    "det_train.matmul": ("det_train.ops.matmul", ["matmul", "matmul_partial", "launch_matmul"]),
    "det_train.linear": ("det_train.ops.linear", ["linear", "Linear", "weight_grad_partial"]),
    "det_train.weight_grad": ("det_train.ops.weight_grad", ["weight_grad_partial", "bias_grad_partial"]),
    "det_train.configs": ("det_train.ops.configs", ["MatmulConfig", "WeightGradConfig", "TMA_MIN_ROWS"]),
    "det_train.conv1d": ("det_train.ops.conv1d", ["conv1d", "Conv1D"]),
    "det_train.rms_norm": ("det_train.ops.rms_norm", ["rms_norm", "RMSNorm", "MAX_ROWS_PER_CHUNK"]),
    "det_train.layer_norm": ("det_train.ops.layer_norm", ["layer_norm", "LayerNorm"]),
    "det_train.embedding": ("det_train.ops.embedding", ["embedding", "Embedding"]),
    "det_train.cross_entropy": ("det_train.ops.cross_entropy", ["cross_entropy"]),
    "det_train.swiglu": ("det_train.ops.swiglu", ["swiglu"]),
    "det_train.grad_accum": (
        "det_train.accum.grad_accum",
        ["CanonicalGradAccumulator", "current_accumulator", "DEFAULT_LEAF_TOKENS"],
    ),
    "det_train.dp_reduce": ("det_train.accum.dp_reduce", ["owner_reduce", "bucket_layout", "GradSpec"]),
    "det_train.tensor_parallel": (
        "det_train.parallel.tensor_parallel",
        ["row_parallel_linear", "column_parallel_linear"],
    ),
    "det_train.distributed": (
        "det_train.parallel.distributed",
        ["reduce_gradients", "deterministic_allreduce_hook", "DeterministicAllreduceState", "rank_tree_sum"],
    ),
    "det_train.convert": (
        "det_train.integrations.convert",
        ["convert", "ConversionError", "ScaledEmbedding", "register_conversion"],
    ),
    "det_train.hf_loss": ("det_train.integrations.hf_loss", ["causal_lm_loss"]),
    "det_train.layers": ("det_train.integrations.layers", ["Linear", "RMSNorm", "RMSNormZeroCentered"]),
    "det_train.routing": ("det_train.integrations.routing", ["deterministic_mode", "routed_ops"]),
}
# modules that keep their path
UNMOVED = ["det_train.reference", "det_train.reference_norms"]


def test_the_face_exports_the_same_names():
    assert det_train.__all__ == PUBLIC_NAMES


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_each_export_is_its_defining_modules_object(name):
    value = getattr(det_train, name)
    if isinstance(value, types.ModuleType):  # det_train.layers: the module itself
        assert value is importlib.import_module("det_train.integrations.layers")
        return
    module = sys.modules[value.__module__]
    assert module.__name__.split(".")[1] in ("ops", "accum", "parallel", "integrations")
    assert getattr(module, name) is value


# Run in a new interpreter so that the old paths are imported first (before anything imported the
# new ones), in both import forms, and read back what each resolved to.
_OLD_FIRST = """
import importlib, json, sys
old_modules = {old_modules!r}
out = {{}}
for old, (new, names) in old_modules.items():
    module = importlib.import_module(old)
    imported = {{n: getattr(module, n) for n in names}}
    real = importlib.import_module(new)
    out[old] = {{
        "same_module": module is real and sys.modules[old] is real,
        "same_names": all(imported[n] is getattr(real, n) for n in names),
        "name": real.__name__,
        "spec": real.__spec__.name,
    }}
import det_train
functions = ("matmul", "linear", "rms_norm", "convert")
out["functions"] = {{n: type(getattr(det_train, n)).__name__ for n in functions}}
out["layers"] = det_train.layers.__name__
print(json.dumps(out))
"""


def test_old_module_paths_import_as_the_same_modules_in_a_fresh_process():
    code = _OLD_FIRST.format(old_modules={k: list(v) for k, v in OLD_MODULES.items()})
    out = json.loads(run_in_fresh_process(code, cold_triton_cache=False))
    for old, (new, _) in OLD_MODULES.items():
        assert out[old] == {"same_module": True, "same_names": True, "name": new, "spec": new}, old
    # importing det_train.matmul (a module path) leaves det_train.matmul the function, as before
    assert out["functions"] == {n: "function" for n in ("matmul", "linear", "rms_norm", "convert")}
    assert out["layers"] == "det_train.integrations.layers"


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_old_module_path_is_the_new_module(old):
    new, names = OLD_MODULES[old]
    real = importlib.import_module(new)
    assert importlib.import_module(old) is real
    for name in names:
        assert getattr(importlib.import_module(old), name) is getattr(real, name)
    assert real.__spec__.name == new  # the alias path leaves the module's own spec


def test_a_global_patched_through_the_old_path_is_the_new_modules(monkeypatch):
    old = importlib.import_module("det_train.configs")
    monkeypatch.setattr(old, "TMA_MIN_ROWS", 7)
    assert importlib.import_module("det_train.ops.configs").TMA_MIN_ROWS == 7


@pytest.mark.parametrize("path", UNMOVED)
def test_unmoved_modules_import(path):
    assert importlib.import_module(path).__name__ == path


def test_an_unknown_module_path_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("det_train.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("det_train._leaf_sums")  # private modules of the flat layout: no alias
