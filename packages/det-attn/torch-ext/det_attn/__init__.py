"""det_attn: deterministic flash attention (forward and backward) for PyTorch, in Triton.

Bitwise identical run to run, and a sequence's outputs and gradients do not depend on the batch
or packing it sits in. No atomics in the backward pass. See docs/det-attn.md for exactly what is
and is not guaranteed.
"""

import importlib

__version__ = "1.0.0"

# public name -> defining module (imported on first use)
_EXPORTS = {
    "attention": "flash_attention",
    "attention_varlen": "flash_attention",
    "scaled_dot_product_attention": "sdpa",
    "register_transformers_attention": "transformers_integration",
    "reference": "reference",
    "layers": "layers",
}

_MODULES = {"reference", "layers"}  # exported as modules; the rest are attributes of their module

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'det_attn' has no attribute {name!r}")
    value = importlib.import_module(f".{module}", __name__)
    value = value if name in _MODULES else getattr(value, name)
    globals()[name] = value  # later lookups skip this hook (an import_module call each)
    return value


def _register_with_transformers_if_loaded() -> None:
    # Only when transformers is already imported: importing it here would slow `import det_attn`.
    import sys

    if "transformers" in sys.modules:
        from .transformers_integration import register_transformers_attention

        register_transformers_attention()


_register_with_transformers_if_loaded()
