"""det_core: what makes our kernels deterministic.

* ``det_core.rng``     counter-based Philox4x32-10 (Triton + torch reference) and the RNG contract
* ``det_core.sr``      stochastic rounding fp32 -> bf16 (Triton + torch reference)
* ``det_core.reduce``  the canonical reduction order (leaves + fixed pairwise tree)
* ``det_core.runtime`` GPU / Triton-interpreter dispatch checks
* ``det_core.launch``  kernel launches with less host time (``launch``, ``BoundLaunch``, ...)
* ``det_core.interpreter_mode`` GPU or the Triton interpreter (``interpreter_active``)
* ``det_core.interpreter`` host-independent arithmetic for the Triton interpreter (CPU path)
* ``det_core.module_paths`` old module paths of a package kept importing (``keep_module_paths``)
* ``det_core.testing`` the determinism-test harness and pytest plugin (dev only, not vendored)

The runtime modules use only the standard library, torch, triton and relative imports (numpy only
in ``interpreter``, under ``TRITON_INTERPRET=1``), so the Hub build (``tools/build_hub.py``) can
copy them into each built kernel. Submodules are imported on
first use: importing ``det_core`` (or its pytest plugin) must not import triton, which reads
``TRITON_INTERPRET`` when kernels are decorated.
"""

import importlib

__version__ = "1.0.0"

__all__ = ["launch", "module_paths", "reduce", "rng", "runtime", "sr"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'det_core' has no attribute {name!r}")
