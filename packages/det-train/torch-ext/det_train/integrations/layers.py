"""Layers for the ``kernels`` package's layer mapping (``kernelize`` / ``use_kernel_forward_from_hub``).

``kernels`` replaces the ``forward`` of a model's layer with ours: the class must not define
``__init__`` or extra members, and ``forward`` must have the signature of the layer it replaces
(``torch.nn.Linear.forward(self, input)``); it reads the replaced module's attributes.

Layer names, as transformers' ``@use_kernel_forward_from_hub(...)`` decorates its classes (5.x):

- ``"Linear"``: ``torch.nn.Linear`` (``weight``, ``bias``);
- ``"RMSNorm"``: the Llama / Qwen2 / Qwen3 / Mistral / ... RMSNorm classes (``weight``,
  ``variance_epsilon`` or ``eps``; ``x_hat * weight``);
- ``"RMSNormZeroCentered"``: Qwen3.5's zero-centred RMSNorm (``weight``, ``eps``;
  ``x_hat * (1 + weight)`` in fp32, as Gemma's, which transformers does not decorate).

Usage::

    from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping
    repo = lambda name: LayerRepository(
        repo_id="phanerozoic/det-train", layer_name=name, version=1, trust_remote_code=True
    )
    mapping = {name: {"cuda": repo(name)} for name in ("Linear", "RMSNorm", "RMSNormZeroCentered")}
    with use_kernel_mapping(mapping):
        # layers decorated with @use_kernel_forward_from_hub(name) get det_train's forward
        model = kernelize(model, mode=Mode.TRAINING)

The mapping covers only the decorated classes: ``det_train.convert(model)`` converts every layer
(embeddings, plain ``nn.Linear``, LayerNorm, the loss) and names what it cannot.
"""

from __future__ import annotations

import torch

from ..ops.linear import linear
from ..ops.rms_norm import rms_norm

__all__ = ["Linear", "RMSNorm", "RMSNormZeroCentered"]


class Linear(torch.nn.Module):
    """Forward of ``torch.nn.Linear`` computed by ``det_train.linear`` (kernels layer; stateless).

    ``forward(input)``: ``input (*, in_features)`` -> ``(*, out_features)`` with the module's
    ``weight (out_features, in_features)`` and optional ``bias``. Dtypes, errors and the
    **Determinism:** paragraph are those of ``det_train.linear`` (row-invariant output and dX,
    canonical-order dW / db; accumulator-aware).
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


class RMSNorm(torch.nn.Module):
    """Forward of transformers' RMSNorm classes computed by ``det_train.rms_norm`` (kernels layer;
    stateless): ``hidden_states * rsqrt(mean(hidden_states**2) + eps) * weight`` with the module's
    ``weight (D,)`` and ``variance_epsilon`` (Llama, Qwen2, Mistral, ...) or ``eps``.

    ``forward(hidden_states)``: ``(..., D)`` -> ``(..., D)`` in ``promote_types(x, weight)``; fp32
    math, one rounding (transformers' Llama form rounds ``x_hat`` to the input dtype before the
    weight product: the two differ by bf16 rounding, not in kind). Errors and the **Determinism:**
    paragraph are those of ``det_train.rms_norm`` (row-invariant y and dX, canonical-order dweight,
    accumulator-aware).
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", None)
        return rms_norm(hidden_states, self.weight, self.eps if eps is None else eps)


class RMSNormZeroCentered(torch.nn.Module):
    """Forward of a zero-centred RMSNorm (transformers' Qwen3.5 ``RMSNormZeroCentered``; Gemma's
    form) computed by ``det_train.rms_norm(..., offset=1.0)`` (kernels layer; stateless):
    ``x_hat * (1 + weight)`` with ``1 + weight`` formed in fp32, the module's ``weight (D,)`` and
    ``eps``.

    ``forward(x)``: ``(..., D)`` -> ``(..., D)`` in ``promote_types(x, weight)``. Errors and the
    **Determinism:** paragraph are those of ``det_train.rms_norm``.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, offset=1.0)
