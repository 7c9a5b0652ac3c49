"""det_train: deterministic, batch-invariant training ops for PyTorch (Triton).

Every op here gives bitwise-identical results run to run, for any batch size or position of a row
in the batch, and (with ``CanonicalGradAccumulator``) for any split of the tokens into micro-batches
and data-parallel ranks. See docs/det-train.md for exactly what is and is not guaranteed.
"""

import importlib
import sys
import types

from det_core.module_paths import keep_module_paths

__version__ = "1.0.0"

# public module name -> where it lives: ops/ (the ops, their kernels and config table), accum/ (the
# accumulator and its canonical reduction order), parallel/ (TP linears, DP reduction) and
# integrations/ (convert, transformers' loss, the ``kernels`` layers, aten routing). The keys are the
# flat layout's module names: ``det_train.grad_accum`` still imports, as the very module object
# ``det_train.accum.grad_accum`` (``keep_module_paths``, below).
_MODULES = {
    "matmul": "ops.matmul",
    "linear": "ops.linear",
    "weight_grad": "ops.weight_grad",
    "configs": "ops.configs",
    "conv1d": "ops.conv1d",
    "rms_norm": "ops.rms_norm",
    "layer_norm": "ops.layer_norm",
    "embedding": "ops.embedding",
    "cross_entropy": "ops.cross_entropy",
    "swiglu": "ops.swiglu",
    "grad_accum": "accum.grad_accum",
    "dp_reduce": "accum.dp_reduce",
    "tensor_parallel": "parallel.tensor_parallel",
    "distributed": "parallel.distributed",
    "convert": "integrations.convert",
    "hf_loss": "integrations.hf_loss",
    "layers": "integrations.layers",
    "routing": "integrations.routing",
}

# public name -> defining module (a key of _MODULES; imported on first use, so one op's import error
# cannot hide the others)
_EXPORTS = {
    "matmul": "matmul",
    "matmul_partial": "matmul",
    "row_parallel_linear": "tensor_parallel",
    "column_parallel_linear": "tensor_parallel",
    "linear": "linear",
    "Linear": "linear",
    "conv1d": "conv1d",
    "Conv1D": "conv1d",
    "deterministic_mode": "routing",
    "rms_norm": "rms_norm",
    "RMSNorm": "rms_norm",
    "layer_norm": "layer_norm",
    "LayerNorm": "layer_norm",
    "embedding": "embedding",
    "Embedding": "embedding",
    "cross_entropy": "cross_entropy",
    "swiglu": "swiglu",
    "causal_lm_loss": "hf_loss",
    "convert": "convert",
    "ConversionError": "convert",
    "ScaledEmbedding": "convert",
    "register_conversion": "convert",
    "CanonicalGradAccumulator": "grad_accum",
    "current_accumulator": "grad_accum",
    "deterministic_allreduce_hook": "distributed",
    "DeterministicAllreduceState": "distributed",
    "reduce_gradients": "distributed",
    "layers": "layers",
}

__all__ = sorted(_EXPORTS)


class _Package(types.ModuleType):
    """Keeps ``det_train.rms_norm`` (and matmul, linear, ...) the function, not its module.

    The import system binds a loaded submodule as an attribute of its package; where a public
    function shares its module's name, bind the function instead (``from det_train.rms_norm import
    RMSNorm`` still works: it reads sys.modules).
    """

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'det_train' has no attribute {name!r}")
    value = importlib.import_module(f".{_MODULES[module]}", __name__)
    return value if name == module and not hasattr(value, name) else getattr(value, name)


# det_train.<module> of the flat layout (det_train.grad_accum, det_train.configs, ...) imports as the
# module it now is (det_train.accum.grad_accum): one module object under both names
keep_module_paths(__name__, _MODULES)
