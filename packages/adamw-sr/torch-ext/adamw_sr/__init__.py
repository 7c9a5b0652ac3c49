"""adamw_sr: fused AdamW with stochastic rounding for bf16 weights, deterministic and shard-invariant.

``AdamWSR`` is a drop-in for ``torch.optim.AdamW`` whose step is one fused Triton kernel; bf16
weights are written back with stochastic rounding keyed by ``(seed, step, global element index)``,
so they train without an fp32 master copy and every step is bitwise reproducible under any sharding.
See docs/adamw-sr.md.
"""

import importlib

from det_core.module_paths import keep_module_paths

__version__ = "1.0.0"

# public name -> defining module (imported on first use). Importing ``functional`` (as AdamWSR and
# adamw_sr_step do) registers the custom ops ``adamw_sr::fused_step*``.
_EXPORTS = {
    "AdamWSR": "optimizer",
    "adamw_sr_step": "functional",
    "adamw_sr_step_reference": "reference",
    "default_base_indices": "indices",
    "local_segments": "indices",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'adamw_sr' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this hook (an import_module call each)
    return value


# internal modules' old paths (adamw_sr.kernel, adamw_sr.launch, ...) import as the very module
keep_module_paths(
    __name__,
    {name: f"_{name}" for name in ("checks", "kernel", "launch", "state_codes", "states", "step_cache")},
)
