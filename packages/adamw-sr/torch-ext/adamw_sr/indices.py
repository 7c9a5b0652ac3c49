"""The global element index: where each parameter element sits in the unsharded parameter list.

The stochastic-rounding bits of an element are keyed by its global index (det-core's RNG
contract), so a sharded run must map every local element to the index it has in the unsharded
run. Here: the default base index of each parameter (``default_base_indices``), the runs of a
local tensor or DTensor shard that are consecutive in the global index (``local_segments``), and
the 8-bit states' layout check over every rank's shard (``check_8bit_layout``).
"""

from __future__ import annotations

import itertools
import math

import torch
from det_core import runtime

from . import _state_codes, _states

__all__ = [
    "BASE_INDEX_ALIGNMENT",
    "check_8bit_layout",
    "check_disjoint_indices",
    "default_base_indices",
    "first_overlap",
    "is_dtensor",
    "local_segments",
    "local_tensor",
    "param_starts",
]

# Default base indices start every parameter on a multiple of 8: its windows are then 4-aligned in the
# global index (one Philox call per 4 elements) and 8-aligned in memory (vectorized loads) at once.
BASE_INDEX_ALIGNMENT = 8


def default_base_indices(numels, alignments=None) -> list[int]:
    """The default global index of each parameter's first element: the running element offset over
    the parameters in order, each rounded up to a multiple of its alignment (``BASE_INDEX_ALIGNMENT``,
    8; a param with 8-bit states starts on a block of ``_state_codes.QUANT_BLOCK``, 32).

    Args:
        numels: iterable of element counts (global counts for DTensors): non-negative integers
            (int, numpy integer or 0-dim integer tensor; not bools or floats).
        alignments: iterable of positive integers, one per param (default: 8 for every param).

    Returns: list of ints.

    Raises:
        TypeError: a count or an alignment that is not an integer (a bool, a float, a string).
        ValueError: a negative count, an alignment below 1, or not one alignment per count.

    **Determinism:** a pure function of the counts, the alignments and their order: a sharded run,
    which sees the global counts, assigns the same indices as the unsharded one.
    """
    op = "adamw_sr.default_base_indices"
    numels = [
        runtime.as_index(n, f"numels[{i}]", op, "; pass element counts (p.numel())")
        for i, n in enumerate(numels)
    ]
    if alignments is None:
        alignments = [BASE_INDEX_ALIGNMENT] * len(numels)
    else:
        alignments = [runtime.as_index(a, f"alignments[{i}]", op) for i, a in enumerate(alignments)]
        if len(alignments) != len(numels):
            raise ValueError(
                f"{op}: alignments has {len(alignments)} entries but numels has {len(numels)}; give one "
                "alignment per param (or None: 8 for every param)"
            )
    for what, values, low, fix in (
        ("numels", numels, 0, "an element count is non-negative (p.numel())"),
        ("alignments", alignments, 1, "an alignment is positive: 8, or 32 for a param with 8-bit states"),
    ):
        bad = next((i for i, v in enumerate(values) if v < low), None)
        if bad is not None:
            raise ValueError(f"{op}: {what}[{bad}] = {values[bad]} must be >= {low}: {fix}")
    out, offset = [], 0
    for n, align in zip(numels, alignments, strict=True):
        offset = runtime.cdiv(offset, align) * align
        out.append(offset)
        offset = runtime.cdiv(offset + n, BASE_INDEX_ALIGNMENT) * BASE_INDEX_ALIGNMENT
    return out


def first_overlap(ranges) -> tuple[int, int] | None:
    """Two ranges of global indices that share an index, or ``None`` when all are disjoint.

    Args:
        ranges: sequence of ``(start, length)`` int pairs, the half-open ranges
            ``[start, start + length)`` (a param's base index and its global element count).

    Returns: the positions ``(i, j)``, ``i < j``, of two overlapping ranges (the pair met first in
    the order of ``start``), or ``None``. Empty ranges overlap nothing. Raises nothing.

    **Determinism:** a pure function of the ranges. Two params whose ranges overlap would draw the
    same stochastic-rounding bits at their shared indices: ``AdamWSR`` refuses them with this, and
    (given byte ranges ``(data_ptr, nbytes)``) params whose memory overlaps.
    """
    reach, holder = None, -1  # the furthest end so far and the range that reaches it
    for start, end, i in sorted((int(s), int(s) + int(n), i) for i, (s, n) in enumerate(ranges) if n > 0):
        if reach is not None and start < reach:
            return (min(holder, i), max(holder, i))
        if reach is None or end > reach:
            reach, holder = end, i
    return None


def param_starts(groups: list[dict]) -> list[tuple[torch.Tensor, int, bool]]:
    """``(param, global index of its first element, whether the group's base_index gave it)`` for
    every param of ``groups`` (``AdamWSR``'s param-group dicts: ``params``, ``state_dtype``, optional
    ``base_index``) in order: the running default offsets (``default_base_indices``, each param
    aligned for its group's ``state_dtype``; a DTensor counts its global elements), overridden by
    ``base_index`` entries that are not ``None``. Raises nothing for groups ``AdamWSR`` accepted.

    **Determinism:** a pure function of the groups' element counts, formats and base indices.
    """
    params = [p for g in groups for p in g["params"]]
    aligns = [_states.base_index_alignment(g["state_dtype"]) for g in groups for _ in g["params"]]
    defaults = default_base_indices((p.numel() for p in params), aligns)
    explicit = [b for g in groups for b in (g.get("base_index") or [None] * len(g["params"]))]
    return [
        (p, d if b is None else b, b is not None) for p, d, b in zip(params, defaults, explicit, strict=True)
    ]


def check_disjoint_indices(groups: list[dict], op: str) -> None:
    """Refuse two params of ``groups`` (``AdamWSR``'s param-group dicts) whose global index ranges
    ``[start, start + numel)`` (``param_starts``) overlap. Default indices never overlap each
    other: only groups with a ``base_index`` are checked. ``op`` names the caller in the message.

    Raises:
        ValueError: naming both params (group and position), their ranges and the fixes.

    **Determinism:** an element's rounding bits are keyed by its global index, so overlapping
    params would draw the same random bits at their shared indices: this keeps the streams apart.
    """
    if not any(g.get("base_index") for g in groups):
        return
    starts = param_starts(groups)
    hit = first_overlap([(start, p.numel()) for p, start, _ in starts])
    if hit is None:
        return
    where = [(gi, pi) for gi, g in enumerate(groups) for pi in range(len(g["params"]))]

    def name(k: int) -> str:
        p, start, explicit = starts[k]
        how = f"base_index={start}" if explicit else f"default index {start}"
        return (
            f"param {where[k][1]} of param group {where[k][0]} ({how}, {p.numel()} elements: global "
            f"indices [{start}, {start + p.numel()}))"
        )

    raise ValueError(
        f"{op}: {name(hit[0])} and {name(hit[1])} overlap: the stochastic-rounding bits of an element "
        "are keyed by its global index, so these params would share random bits. Give each param its own "
        "disjoint range [base_index, base_index + numel), or omit base_index (None) for the default "
        "indices."
    )


# the types of a plain (unsharded) tensor: tested by ``type(t) in PLAIN_TENSOR_TYPES``, a set lookup
# cheap enough for every tensor of every step
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 / tensor-parallel parameter),
    tested without importing ``torch.distributed`` (any shape and dtype).

    **Determinism:** a pure function of ``t``'s type.
    """
    kind = type(t)
    return kind not in PLAIN_TENSOR_TYPES and kind.__name__ == "DTensor" and hasattr(t, "_local_tensor")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor the kernel reads: a DTensor's local shard, else ``t`` itself (same dtype; the
    shard's shape).

    **Determinism:** no copy: the shard itself, so the kernel writes it in place.
    """
    return t if type(t) in PLAIN_TENSOR_TYPES else (t._local_tensor if is_dtensor(t) else t)


def local_segments(param: torch.Tensor, base_index: int) -> list[tuple[int, int, int]]:
    """The runs of ``param``'s local elements that are consecutive in the global element index.

    Args:
        param: a plain tensor, or a DTensor (e.g. an FSDP2 parameter) whose local shard is a
            box of the global tensor: placements ``Replicate``, ``Shard(d)`` (even, uneven or empty
            shards), on a mesh of any dimension.
        base_index: global index of the unsharded parameter's first element.

    Returns:
        ``[(local_start, length, global_start), ...]`` in local element order. One run for a plain
        tensor or a ``Shard(0)`` shard, one per leading-index row for ``Shard(d)``, ``d > 0``;
        empty for an empty shard.

    Raises:
        ValueError: the placement is not a box (e.g. ``_StridedShard``, ``Partial``).

    **Determinism:** a pure function of the global shape, the placements and the rank's mesh
    coordinate, so every rank maps its elements to the indices they have in the unsharded run.
    """
    if not is_dtensor(param):
        return [(0, param.numel(), base_index)] if param.numel() else []
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"adamw_sr: DTensor placement {placement} is not supported; the global element index "
                "is derived for Replicate and Shard(d) placements only. Pass an explicit base_index "
                "per local tensor instead (param group key 'base_index')."
            )
    global_shape = tuple(param.shape)
    local_shape, offset = compute_local_shape_and_global_offset(
        global_shape, param.device_mesh, param.placements
    )
    return _box_runs(global_shape, tuple(local_shape), tuple(offset), base_index)


def _box_runs(global_shape: tuple, local_shape: tuple, offset: tuple, base_index: int) -> list:
    """``local_segments`` of the box ``local_shape`` at ``offset`` in a tensor of ``global_shape``."""
    if math.prod(local_shape) == 0:
        return []
    ndim = len(global_shape)
    differing = [d for d in range(ndim) if local_shape[d] != global_shape[d]]
    if not differing:
        return [(0, math.prod(local_shape), base_index)]
    j = differing[-1]
    inner = math.prod(local_shape[j:])  # contiguous run: dims j.. are whole beyond j
    global_strides = [math.prod(global_shape[d + 1 :]) for d in range(ndim)]
    segments = []
    outer_shape = local_shape[:j]
    for n in range(math.prod(outer_shape)):
        coords, rest = [], n
        for size in reversed(outer_shape):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        start = (
            sum((offset[d] + coords[d]) * global_strides[d] for d in range(j)) + offset[j] * global_strides[j]
        )
        segments.append((n * inner, inner, base_index + start))
    return segments


def _merged(runs) -> list[tuple[int, int, int]]:
    """``(local_start, length, global_start)`` runs with neighbours in both indices joined."""
    out: list[list[int]] = []
    for local_start, length, global_start in runs:
        if out and out[-1][0] + out[-1][1] == local_start and out[-1][2] + out[-1][1] == global_start:
            out[-1][1] += length
        else:
            out.append([local_start, length, global_start])
    return [tuple(r) for r in out]


def _boxes(global_shape: tuple, mesh_shape: tuple, placements) -> dict:
    """``{mesh coordinate: (local_shape, offset)}`` of every rank's shard of a ``Shard``/``Replicate``
    DTensor, by DTensor's rule (mesh dimensions in order, each ``Shard(d)`` splitting the current
    extent of dim ``d`` as ``torch.chunk`` does)."""
    from torch.distributed.tensor import Shard

    out = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        shape, offset = list(global_shape), [0] * len(global_shape)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                d, n, k = placement.dim % len(global_shape), mesh_shape[mesh_dim], coord[mesh_dim]
                chunk = runtime.cdiv(shape[d], n)
                start = min(k * chunk, shape[d])
                offset[d] += start
                shape[d] = min(chunk, shape[d] - start)
        out[coord] = (tuple(shape), tuple(offset))
    return out


def check_8bit_layout(param: torch.Tensor, base_index: int, runs: list) -> None:
    """8-bit states: every run of every rank's shard starts on a block, and every rank's scale
    shard (``_states.scale_shape`` with the param's placements) holds exactly its blocks.

    Checked for all ranks of a DTensor's mesh from the placement alone (no communication), so
    every rank refuses the same params: a step never updates some ranks' shards and not others'.

    Args:
        param: a plain tensor or a DTensor (any shape; fp32 or bf16).
        base_index: global index of the unsharded param's first element (int).
        runs: this rank's ``local_segments(param, base_index)``.

    Raises:
        ValueError: a run off the block grid (``_states.check_8bit_segments``, naming the block size),
            or scales that the placement shards differently from the blocks (a sharded param whose
            last dimension is not a multiple of 32, on some meshes), naming the fix.

    **Determinism:** a check only, a pure function of the shape, the placements and the mesh
    shape: every rank reaches the same verdict.

    Method: DTensor's sharding rule (``torch.chunk`` per ``Shard`` mesh dimension, in order).
    """
    shape = tuple(param.shape)
    if not is_dtensor(param):
        _states.check_8bit_segments(runs, shape, "AdamWSR.step")
        return
    from torch.distributed.tensor import Shard

    block = _state_codes.QUANT_BLOCK
    mesh_shape = tuple(param.device_mesh.shape)
    scale = _states.scale_shape(shape)
    mismatch = ValueError(
        f"AdamWSR.step: state_dtype='8bit': the block scales (shape {scale}) of a param of shape "
        f"{shape} with placements {tuple(param.placements)} do not shard like its blocks of {block} "
        f"elements (a sharded param needs its last dimension to be a multiple of {block}); put "
        "this parameter in a param group with state_dtype=torch.bfloat16"
    )
    if any(isinstance(pl, Shard) and not -len(scale) <= pl.dim < len(scale) for pl in param.placements):
        raise mismatch  # the scales (new_state: the param's placements) have no such dimension
    scale_boxes = _boxes(scale, mesh_shape, param.placements)
    for coord, box in _boxes(shape, mesh_shape, param.placements).items():
        rank_runs = _box_runs(shape, *box, base_index)
        _states.check_8bit_segments(rank_runs, shape, f"AdamWSR.step (the shard at mesh coordinate {coord})")
        want = [(lo // block, runtime.cdiv(n, block), (g - base_index) // block) for lo, n, g in rank_runs]
        if _merged(_box_runs(scale, *scale_boxes[coord], 0)) != _merged(want):
            raise mismatch
