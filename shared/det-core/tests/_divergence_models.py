"""Tiny plain-torch models for the divergence-finder tests (tests/test_divergence.py and its CLI run).

Every value is a small integer or a dyadic fraction, so every sum in the clean model is exact in
fp32 and its bits cannot depend on the summation order: only a split-dependent op can change them.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

ROWS = 6  # global batch: 6 sequences (splits into 1, 2, 3 and 6 micro-batches)


class Center(nn.Module):
    """Subtracts the micro-batch mean: its output depends on which rows share the micro-batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class Tiny(nn.Module):
    """fc1 -> act -> mixer -> fc2; ``mixer`` is ``Center`` (split-dependent) or ``Identity``."""

    def __init__(self, center: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.mixer = Center() if center else nn.Identity()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.mixer(self.act(self.fc1(x))))


class InlineCenter(Tiny):
    """Centers inline in its own forward, between two modules (no module of its own)."""

    def __init__(self) -> None:
        super().__init__(center=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        return self.fc2(h - h.mean(0, keepdim=True))


def _dyadic(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g) / 4)
    return model


def make_split_dependent() -> nn.Module:
    return _dyadic(Tiny(center=True))


def make_clean() -> nn.Module:
    return _dyadic(Tiny(center=False))


def make_inline() -> nn.Module:
    return _dyadic(InlineCenter())


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (ROWS, 4), generator=g).float()
    target = torch.randint(-2, 3, (ROWS, 2), generator=g).float()
    return x, target


def step(model: nn.Module, micro_batches: int) -> None:
    """One step: the global batch in ``micro_batches`` equal parts, sum loss, gradients accumulated."""
    x, target = _data()
    for xb, tb in zip(x.chunk(micro_batches), target.chunk(micro_batches), strict=True):
        (model(xb) * tb).sum().backward()


def step_mse(model: nn.Module, micro_batches: int) -> None:
    """As ``step``, with the loss as a module built inside the step (a scalar output per micro-batch)."""
    x, target = _data()
    loss_fn = nn.MSELoss(reduction="sum")
    for xb, tb in zip(x.chunk(micro_batches), target.chunk(micro_batches), strict=True):
        loss_fn(model(xb), tb).backward()


def make_layer_norm() -> nn.Module:
    """A bf16 ``nn.LayerNorm`` alone: per-row forward, weight gradient summed over rows and micro-batches."""
    return nn.Sequential(OrderedDict(ln=nn.LayerNorm(8, dtype=torch.bfloat16)))


def step_layer_norm(model: nn.Module, micro_batches: int) -> None:
    """Rows ``[1, -1, ...] * r`` (x-hat ~ +-0.999995) and loss weights 1 (row 0) and 2^-9 (the rest).

    One micro-batch sums the weight gradient of all rows in fp32 and rounds once: 1 + 5 * 2^-9 ->
    bf16 0x3f81. Three micro-batches round each part to bf16 and add in bf16: 1.0, then
    1 + 2^-8 (a tie, to even) -> 1.0 twice: 0x3f80. The forward is per row, so outputs agree.
    """
    x = torch.tensor([1.0, -1.0] * 4).repeat(ROWS, 1) * torch.arange(1, ROWS + 1).view(ROWS, 1)
    weight = torch.full((ROWS, 8), 2.0**-9)
    weight[0] = 1.0
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    for xb, wb in zip(x.chunk(micro_batches), weight.chunk(micro_batches), strict=True):
        (model(xb) * wb).sum().backward()
