"""What the harness (``det_core.testing``) and the divergence finder (``det_core.testing.divergence``)
share: the leaves of a nested structure in a fixed order, and a bit pattern written in hex."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["hex_bits", "nested_leaves"]


def hex_bits(value: int, nbytes: int) -> str:
    """``value``'s low ``8 * nbytes`` bits as fixed-width hex (``hex_bits(-1, 2) == "0xffff"``): a bit
    pattern from ``det_core.testing.bits`` as a report shows it. **Determinism:** a pure function."""
    return f"0x{value & ((1 << (8 * nbytes)) - 1):0{2 * nbytes}x}"


def nested_leaves(obj, prefix: str = "") -> Iterable[tuple[str, torch.Tensor | str]]:
    """``(path, leaf)`` for each leaf of a tensor or a nested dict / list / tuple of them, depth first.

    A path is ``prefix`` plus ``/key`` or ``/index`` per level; dict keys are visited sorted by
    ``str``, so equal contents give the same order whatever the insertion order. A tensor leaf is
    yielded as is, any other leaf as its ``repr``.

    **Determinism:** the order is a pure function of the structure (keys sorted), which is what
    makes ``digest`` and the element-by-element reports independent of dict insertion order.
    """
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield from nested_leaves(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from nested_leaves(item, f"{prefix}/{i}")
    else:
        yield prefix, repr(obj)
