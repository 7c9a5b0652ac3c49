"""Layers for the ``kernels`` layer mapping (``kernels.use_kernel_forward_from_hub``).

``DetAttention`` is a parameter-free module whose ``forward`` is ``det_attn.attention``; map a
model's attention-core layer to it with ``kernels.kernelize`` / ``LayerRepository(...,
layer_name="DetAttention")``.
"""

from __future__ import annotations

import torch
from torch import nn

from .flash_attention import attention

__all__ = ["DetAttention"]


class DetAttention(nn.Module):
    """Deterministic attention core: ``forward(q, k, v, **kwargs) = det_attn.attention(q, k, v, **kwargs)``.

    Shapes, dtypes, errors and the **Determinism:** guarantees are those of ``det_attn.attention``
    (``(B, T, H, D)`` bf16/fp16, run-to-run bitwise, batch and packing invariant; under
    ``torch.compile`` the eager bits, as the call runs det_attn's ``torch.library`` operators, which
    torch.compile traces with no graph break: ``can_torch_compile = True``, so ``kernels.kernelize``
    maps it in ``Mode.TORCH_COMPILE`` too).
    Method: FlashAttention-2 (Dao, 2023).
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        return attention(q, k, v, **kwargs)
