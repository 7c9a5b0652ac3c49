"""det_train: deterministic, batch-invariant training ops for PyTorch (Triton).

Every op here gives bitwise-identical results run to run, for any batch size or position of a row
in the batch, and (with ``CanonicalGradAccumulator``) for any split of the tokens into micro-batches
and data-parallel ranks. See docs/det-train.md for exactly what is and is not guaranteed.
"""

import importlib
import sys
import types

__version__ = "1.0.0"

# public name -> defining module (imported on first use, so one op's import error cannot hide the others)
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
    value = importlib.import_module(f".{module}", __name__)
    return value if name == module and not hasattr(value, name) else getattr(value, name)
