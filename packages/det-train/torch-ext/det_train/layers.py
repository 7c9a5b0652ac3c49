"""Layers for the ``kernels`` package's layer mapping (``kernelize`` / ``use_kernel_forward_from_hub``).

``kernels`` replaces the ``forward`` of a model's layer with ours: the class must not define
``__init__`` or extra members, and ``forward`` must have the signature of the layer it replaces
(``torch.nn.Linear.forward(self, input)``); it reads the replaced module's ``weight`` and ``bias``.

Usage::

    from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping
    mapping = {"Linear": {"cuda": LayerRepository(repo_id="phanerozoic/det-train", layer_name="Linear")}}
    with use_kernel_mapping(mapping):
        # layers decorated with @use_kernel_forward_from_hub("Linear") get det_train's forward
        model = kernelize(model, mode=Mode.TRAINING)
"""

from __future__ import annotations

import torch

from .linear import linear

__all__ = ["Linear"]


class Linear(torch.nn.Module):
    """Forward of ``torch.nn.Linear`` computed by ``det_train.linear`` (kernels layer; stateless).

    ``forward(input)``: ``input (*, in_features)`` -> ``(*, out_features)`` with the module's
    ``weight (out_features, in_features)`` and optional ``bias``. Dtypes, errors and the
    **Determinism:** paragraph are those of ``det_train.linear`` (row-invariant output and dX,
    canonical-order dW / db; accumulator-aware).
    """

    has_backward = True
    can_torch_compile = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)
