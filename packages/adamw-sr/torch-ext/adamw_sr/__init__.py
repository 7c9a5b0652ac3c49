"""adamw_sr: fused AdamW with stochastic rounding for bf16 weights, deterministic and shard-invariant.

``AdamWSR`` is a drop-in for ``torch.optim.AdamW`` whose step is one fused Triton kernel; bf16
weights are written back with stochastic rounding keyed by ``(seed, step, global element index)``,
so they train without an fp32 master copy and every step is bitwise reproducible under any sharding.
See docs/adamw-sr.md.
"""

from .functional import adamw_sr_step
from .indices import default_base_indices, local_segments
from .optimizer import AdamWSR
from .reference import adamw_sr_step_reference

__version__ = "1.0.0"

__all__ = ["AdamWSR", "adamw_sr_step", "adamw_sr_step_reference", "default_base_indices", "local_segments"]
