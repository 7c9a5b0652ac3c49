"""The data-parallel reduction of canonical-order gradients: a fixed-order owner reduction.

Every rank holds finished nodes of each (parameter, use)'s canonical tree (``TreePartial``, as
``CanonicalGradAccumulator`` collects them). The reduction, on top of torch.distributed's
collectives:

1. **Metadata**: one ``all_gather_object`` of every rank's node keys per (parameter, use) and of
   its refusal (a rank whose own checks failed), so every rank learns the whole tree structure
   and a refusing rank makes every rank raise before any data moves.
2. **Layout**: the gradients are cut into buckets of at most ``bucket_numel`` elements, in
   parameter order, grouped by (dtype, device, FSDP2 or not): a pure function of the parameter
   list and the world size W, the same on every rank. Each rank *owns* a contiguous element
   range of every bucket: of a replicated bucket, chunk r of ``ceil(numel / W)`` elements; of an
   FSDP2 parameter, exactly FSDP2's shard (the dim-0 ``torch.chunk`` over W).
3. **Data**: per bucket one ``all_to_all_single`` sends every owner the slices of every node for
   its range. The owner merges all ranks' slices in the canonical tree (``TreePartial.merge``,
   then ``result(total_leaves)``), adds the uses in order and rounds once to the parameter dtype:
   the elementwise fp32 additions of the whole-tensor tree on a sub-range, so the bits of a
   single process, for every W.
4. **Replicated parameters**: one ``all_gather_single`` per bucket of the finished gradient in the
   parameter dtype (not fp32: the owner's rounding to the parameter dtype is elementwise, so the
   gathered bits are those of a single process, in half the bytes for bf16). FSDP2 parameters
   skip it: the owner's shard is this rank's gradient.

Per rank, for ``N`` gradient elements, ``n`` nodes per (parameter, use) on a rank and ``e`` bytes
per element of the parameter dtype: about ``(W - 1) / W * N * (4 * n + e)`` bytes sent and as many
received (FSDP2: ``4 * n`` instead of ``4 * n + e``), and per bucket of ``S`` elements at most
``4 S (n + n_max) + 4 S / W (ceil(log2 leaves) + 1) + e S (1 + 1 / W)`` bytes of transient memory:
only the ``(W - 1) / W`` and ``1 / W`` factors depend on W (docs/det-train.md, "The data-parallel
reduction").

Method: owner-computes reduction (a reduce-scatter by all-to-all, as in ZeRO / FSDP gradient
sharding, Rajbhandari et al., SC'20) with the fixed pairwise tree of det_core.reduce (Higham,
SISC 1993) as the reduction operator.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from det_core.reduce import TreePartial

__all__ = [
    "BUCKET_NUMEL",
    "Bucket",
    "GradSpec",
    "Piece",
    "all_gather_single",
    "bucket_layout",
    "exchange_node_keys",
    "fsdp_layout_error",
    "fsdp_shard",
    "group_size",
    "merge_node_keys",
    "owner_reduce",
]

# 8 Mi elements: 32 MiB of fp32 gradient per bucket (DDP's default bucket is 25 MiB). Part of the
# communication layout only: any bucket size gives the same bits.
BUCKET_NUMEL = 8 * 2**20

Slot = tuple[int, int]  # (parameter index, use)
Key = tuple[int, int]  # (level, index) of a node of the canonical tree


@dataclass(frozen=True)
class GradSpec:
    """One tracked parameter as the reduction sees it (identical on every rank).

    Attributes:
        name: for error messages.
        shape: the full gradient's shape (under FSDP2 the unsharded one).
        dtype: the gradient's dtype (the parameter's): the owner rounds the fp32 sum to it once.
        device: where the gradient and the communication buffers live.
        sharded: FSDP2: this rank keeps only its dim-0 ``torch.chunk`` of the gradient (no
            all-gather); otherwise every rank receives the whole gradient.

    **Determinism:** description only; which rank owns which elements changes no bits.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    sharded: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_rows(self, world: int, rank: int) -> tuple[int, int]:
        """Rows ``[first, end)`` of dim 0 in ``rank``'s ``torch.chunk(grad, world, dim=0)``: FSDP2's shard."""
        rows = self.shape[0]
        chunk = -(-rows // world)
        return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


@dataclass(frozen=True)
class Piece:
    """Flat elements ``[lo, hi)`` of parameter ``param`` (row-major) in a bucket; ``owned[r]``: the
    ``[a, b)`` of them rank r owns (the ranks' ranges tile ``[lo, hi)`` in rank order).

    **Determinism:** layout only.
    """

    param: int
    lo: int
    hi: int
    owned: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Bucket:
    """Pieces reduced by one all-to-all (and, unless ``sharded``, one all-gather of ``chunk`` elements
    per rank: rank r owns elements ``[r * chunk, (r + 1) * chunk)`` of the bucket's concatenation).

    **Determinism:** layout only.
    """

    pieces: tuple[Piece, ...]
    sharded: bool
    chunk: int


def group_size(group=None) -> int:
    """Ranks in ``group``: 1 when torch.distributed is not initialized and ``group`` is None.

    Raises RuntimeError when ``group`` is given but torch.distributed is not initialized.
    **Determinism:** a query.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("reduce(group=...) was given but torch.distributed is not initialized")
        return 1
    return dist.get_world_size(group)


def bucket_layout(specs: list[GradSpec], world: int, bucket_numel: int = BUCKET_NUMEL) -> list[Bucket]:
    """The buckets of ``specs`` for ``world`` ranks: a pure function of its arguments.

    Parameters are taken in order, grouped by (sharded, dtype, device) in order of first
    appearance, and concatenated (flattened, row-major) into buckets of at most ``bucket_numel``
    elements; a parameter may span buckets. Rank r owns, of a replicated bucket of ``S``
    elements, elements ``[r * c, min((r + 1) * c, S))`` with ``c = ceil(S / world)``, and of an
    FSDP2 parameter the rows of its ``torch.chunk`` along dim 0.

    Raises ValueError for a non-positive ``bucket_numel`` or an FSDP2 parameter of zero dims.
    **Determinism:** the layout decides who adds which elements, never the order of any sum.
    """
    if bucket_numel <= 0:
        raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
    groups: dict[tuple, list[int]] = {}
    for index, spec in enumerate(specs):
        if spec.sharded and not spec.shape:
            raise ValueError(f"{spec.name}: an FSDP2 parameter needs a dim 0 to shard, got shape ()")
        if spec.numel:
            groups.setdefault((spec.sharded, spec.dtype, spec.device), []).append(index)
    buckets: list[Bucket] = []
    for (sharded, _dtype, _device), indices in groups.items():
        runs: list[list[tuple[int, int, int]]] = [[]]  # (param, lo, hi) per bucket
        filled = 0
        for index in indices:
            numel, lo = specs[index].numel, 0
            while lo < numel:
                if filled == bucket_numel:
                    runs.append([])
                    filled = 0
                take = min(numel - lo, bucket_numel - filled)
                runs[-1].append((index, lo, lo + take))
                filled += take
                lo += take
        for run in runs:
            buckets.append(_make_bucket(run, specs, world, sharded))
    return buckets


def _make_bucket(run: list[tuple[int, int, int]], specs: list[GradSpec], world: int, sharded: bool) -> Bucket:
    size = sum(hi - lo for _, lo, hi in run)
    chunk = -(-size // world)
    pieces, offset = [], 0
    for index, lo, hi in run:
        if sharded:  # FSDP2's shard: rows of the dim-0 torch.chunk, contiguous in the flat gradient
            spec = specs[index]
            row = spec.numel // spec.shape[0]
            bounds = [spec.shard_rows(world, r) for r in range(world)]
            owned = tuple((min(max(a * row, lo), hi), min(max(b * row, lo), hi)) for a, b in bounds)
        else:
            n = hi - lo  # bucket elements [offset, offset + n) are this piece's
            owned = tuple(
                (lo + min(max(r * chunk - offset, 0), n), lo + min(max((r + 1) * chunk - offset, 0), n))
                for r in range(world)
            )
        pieces.append(Piece(index, lo, hi, owned))
        offset += hi - lo
    return Bucket(tuple(pieces), sharded, chunk)


def exchange_node_keys(
    partials: dict[Slot, TreePartial],
    specs: list[GradSpec],
    group=None,
    refusal: Exception | None = None,
    agree: tuple[tuple[str, object], ...] = (),
) -> list[dict[Slot, list[Key]]]:
    """Every rank's node keys per (parameter, use), by one ``all_gather_object`` (a collective).

    Args:
        partials: this rank's partial trees, ``{(param index, use): TreePartial}``.
        specs: the tracked parameters (their count, shapes, dtypes and sharding are checked to be
            the same on every rank).
        group: the process group (None: the default group).
        refusal: this rank's own error, if its checks failed: it travels with the keys.
        agree: ``(name, value)`` pairs every rank must pass alike (``reduce``'s ``total_tokens``
            and ``leaf_tokens``): a rank whose checks passed with its own values would otherwise
            go on to the data collectives while another raised.

    Returns:
        ``keys[rank][slot]``: the sorted node keys rank ``rank`` holds for ``slot``.

    Raises:
        ``refusal`` itself on the refusing rank and, on every other rank, ValueError naming the
        first refusing rank: every rank joins this collective first, so none waits in a later
        collective a refusing rank never joins. ValueError on every rank when the ``agree``
        values differ between ranks (naming each rank's). RuntimeError when ranks track different
        parameters.

    **Determinism:** metadata only.
    """
    world = dist.get_world_size(group)
    local_keys = {slot: sorted(tree.nodes) for slot, tree in partials.items()}
    refused = None if refusal is None else f"{type(refusal).__name__}: {refusal}"
    layout = [(spec.shape, str(spec.dtype), spec.sharded) for spec in specs]
    fingerprint = hashlib.sha256(repr(layout).encode()).hexdigest()[:16]
    meta: list = [None] * world
    dist.all_gather_object(meta, (len(specs), fingerprint, local_keys, refused, agree), group=group)
    for i, (name, _) in enumerate(agree):  # first: a rank's refusal may only be its consequence
        values = [m[4][i][1] for m in meta]
        if len(set(values)) != 1:
            raise ValueError(
                f"data-parallel ranks passed different {name} to reduce: "
                + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                + "; every rank must pass the global batch's values"
            )
    if refusal is not None:
        raise refusal
    others = [(rank, m[3]) for rank, m in enumerate(meta) if m[3] is not None]
    if others:  # every rank raises, none waits in a collective the refusing rank never joins
        rank, message = others[0]
        raise ValueError(f"data-parallel rank {rank} refused the reduce: {message}")
    if len({m[0] for m in meta}) != 1:
        raise RuntimeError(f"ranks track different numbers of parameters: {[m[0] for m in meta]}")
    if len({m[1] for m in meta}) != 1:
        raise RuntimeError(
            "ranks track parameters of different shapes, dtypes or FSDP2 sharding: every rank must "
            "build the accumulator from the same parameters (and call track_fsdp alike)"
        )
    return [m[2] for m in meta]


_NO_DATA = torch.empty(0)


def merge_node_keys(keys: list[dict[Slot, list[Key]]], names: list[str]) -> dict[Slot, TreePartial]:
    """The merged tree *structure* of every slot: ``TreePartial``s of empty tensors, all ranks' keys.

    The same merges ``owner_reduce`` does with data, on keys alone, so every rank can check the
    whole tree (overlaps, gaps) before any data moves and every rank raises alike.

    Raises ValueError (``"<name>: rank r: ..."``) when two ranks supply the same leaves.
    **Determinism:** structure only.
    """
    trees: dict[Slot, TreePartial] = {}
    for slot in sorted(set().union(*keys)):
        tree = trees[slot] = TreePartial()
        for rank, rank_keys in enumerate(keys):
            part = TreePartial()
            part.nodes = {key: _NO_DATA for key in rank_keys.get(slot, ())}
            try:
                tree.merge(part)
            except ValueError as err:
                raise ValueError(f"{names[slot[0]]}: rank {rank}: {err}") from None
    return trees


def owner_reduce(
    specs: list[GradSpec],
    partials: dict[Slot, TreePartial],
    keys: list[dict[Slot, list[Key]]],
    total_leaves: int,
    group=None,
    bucket_numel: int | None = None,
) -> dict[int, torch.Tensor]:
    """Reduce every rank's partial trees to the canonical gradients (a collective on ``group``).

    Args:
        specs: the tracked parameters, the same list on every rank.
        partials: this rank's ``{(param index, use): TreePartial}`` (fp32 nodes of each
            parameter's full shape, on its device).
        keys: ``exchange_node_keys``'s result (checked with ``merge_node_keys``: no overlaps, no gaps).
        total_leaves: leaves of the global batch (``TreePartial.result``'s argument).
        group: the process group (None: the default group).
        bucket_numel: elements per bucket (None: ``BUCKET_NUMEL``, read at the call); the same on
            every rank; no effect on the bits.

    Returns:
        ``{param index: gradient}`` for every parameter with a slot on some rank, in the spec's
        dtype on its device: the full gradient (``spec.shape``) for replicated parameters, this
        rank's dim-0 ``torch.chunk`` (FSDP2's local shard) for sharded ones; the uses of a
        parameter are added in use order in fp32 before the one rounding.

    **Determinism:** each element of each node is added by the fixed pairwise tree of
    det_core.reduce on its owner, with the same operands and order as a single process adding
    whole tensors (fp32 addition is elementwise and correctly rounded on every device), so the
    result has the bits of ``TreePartial.result`` over all leaves in one process, for any world
    size, bucket size, leaf-aligned split of the leaves over ranks and micro-batches.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    uses: dict[int, list[Slot]] = {}
    for slot in sorted(set().union(*keys)):
        uses.setdefault(slot[0], []).append(slot)
    out: dict[int, torch.Tensor] = {}
    for index in sorted(uses):
        spec = specs[index]
        if spec.sharded:
            first, end = spec.shard_rows(world, rank)
            out[index] = torch.empty((end - first, *spec.shape[1:]), dtype=spec.dtype, device=spec.device)
        else:
            out[index] = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
    for bucket in bucket_layout(specs, world, BUCKET_NUMEL if bucket_numel is None else bucket_numel):
        pieces = tuple(p for p in bucket.pieces if p.param in uses)
        if pieces:
            _reduce_bucket(bucket, pieces, specs, partials, keys, uses, out, total_leaves, group)
    return out


def _reduce_bucket(bucket, pieces, specs, partials, keys, uses, out, total_leaves, group) -> None:
    """One bucket: all-to-all of node slices to their owners, the owner's tree, (all-gather)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = specs[pieces[0].param].device
    # Slots whose ranks hold the same keys (usually all slots of a bucket) travel and merge as one
    # vector: the tree's additions are elementwise, so concatenating them changes no bits.
    groups: dict[tuple, list[tuple[int, Slot]]] = {}
    for k, piece in enumerate(pieces):
        for slot in uses[piece.param]:
            signature = tuple(tuple(rank_keys.get(slot, ())) for rank_keys in keys)
            groups.setdefault(signature, []).append((k, slot))

    def owned(k: int, r: int) -> int:
        a, b = pieces[k].owned[r]
        return b - a

    def owned_by(members: list, r: int) -> int:  # elements rank r owns of a group's members
        return sum(owned(k, r) for k, _ in members)

    # the send buffer: for each owner r, for each group, for each of this rank's keys, for each
    # member, the node's slice that r owns
    send_sizes = [
        sum(len(sig[rank]) * owned_by(members, r) for sig, members in groups.items()) for r in range(world)
    ]
    (signature, members), *others = groups.items()
    if not bucket.sharded and not others and len(members) == len(pieces) and len(signature[rank]) == 1:
        # one use per parameter, one node per slot here: owners of a replicated bucket's elements
        # never decrease along the bucket, so its whole pieces in order are that buffer
        node = signature[rank][0]
        send = [partials[slot].nodes[node].reshape(-1)[pieces[k].lo : pieces[k].hi] for k, slot in members]
    else:
        send = []
        for r in range(world):
            for signature, members in groups.items():
                for key in signature[rank]:
                    for k, slot in members:
                        a, b = pieces[k].owned[r]
                        if b > a:
                            send.append(partials[slot].nodes[key].reshape(-1)[a:b])
    widths = [owned_by(members, rank) for members in groups.values()]
    recv_sizes = [sum(len(sig[q]) * w for sig, w in zip(groups, widths, strict=True)) for q in range(world)]
    if len(send) == 1:  # one contiguous slice of one node (e.g. a piece of a large parameter): no copy
        send_buffer = send[0]
    else:
        send_buffer = torch.cat(send) if send else torch.empty(0, device=device)
    del send
    recv = torch.empty(sum(recv_sizes), dtype=torch.float32, device=device)
    dist.all_to_all_single(recv, send_buffer, recv_sizes, send_sizes, group=group)
    del send_buffer

    # the owner's trees: rank q's nodes of a group arrive in q's key order
    trees = [TreePartial() for _ in groups]
    offset = 0
    for q in range(world):
        for tree, signature, width in zip(trees, groups, widths, strict=True):
            part = TreePartial()
            for key in signature[q]:
                part.nodes[key] = recv[offset : offset + width]
                offset += width
            if width:
                tree.merge(part)
    roots: dict[tuple[int, Slot], torch.Tensor] = {}
    for tree, members, width in zip(trees, groups.values(), widths, strict=True):
        if not width:
            continue
        root, pos = tree.result(total_leaves), 0
        for k, slot in members:
            roots[(k, slot)] = root[pos : pos + owned(k, rank)]
            pos += owned(k, rank)
    del trees

    mine = []  # this rank's finished elements, in piece order (fp32, uses added in order)
    for k, piece in enumerate(pieces):
        if owned(k, rank):
            total = None
            for slot in uses[piece.param]:
                total = roots[(k, slot)] if total is None else total + roots[(k, slot)]
            mine.append(total)
    del roots
    if bucket.sharded:  # FSDP2: the owner's elements are its shard; nothing to gather
        dst = []
        for piece in pieces:
            a, b = piece.owned[rank]
            if b > a:
                spec = specs[piece.param]
                first = spec.shard_rows(world, rank)[0] * (spec.numel // spec.shape[0])  # in the flat grad
                dst.append(out[piece.param].view(-1)[a - first : b - first])
        _copy_all(dst, mine)  # the one rounding to the parameter dtype
        return
    dtype = specs[pieces[0].param].dtype
    chunk = bucket.chunk
    contribution = torch.empty(chunk, dtype=dtype, device=device)
    pos, dst = 0, []
    for total in mine:  # this rank's elements of the bucket, in order
        dst.append(contribution[pos : pos + total.numel()])
        pos += total.numel()
    _copy_all(dst, mine)  # the one rounding to the parameter dtype
    del mine
    gathered = torch.empty(world * chunk, dtype=dtype, device=device)
    all_gather_single(gathered, contribution, group)
    dst, src, offset = [], [], 0
    for piece in pieces:
        n = piece.hi - piece.lo
        dst.append(out[piece.param].view(-1)[piece.lo : piece.hi])
        src.append(gathered[offset : offset + n])
        offset += n
    _copy_all(dst, src)


def all_gather_single(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_single`` (torch 2.13; ``all_gather_into_tensor``, its name
    before and deprecated there, on torch 2.11): ``output`` (W * n) gets every rank's ``inp`` (n)
    in rank order. Returns the work handle when ``async_op``. **Determinism:** a copy."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, inp, group=group, async_op=async_op)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair (one multi-tensor copy where torch has one)."""
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


def fsdp_layout_error(name: str, fsdp_param, world: int, rank: int) -> Exception | None:
    """Why the owner reduction cannot write this FSDP2 parameter's shard, or None: it owns the dim-0
    ``torch.chunk`` of rank ``rank`` of the reduce group, which must be FSDP2's shard."""
    info, dim = fsdp_param.mesh_info, fsdp_param.fsdp_placement.dim
    if dim != 0:
        return ValueError(f"{name}: FSDP2 shards it along dim {dim}; the reduction supports Shard(0) only")
    if (info.shard_mesh_size, info.shard_mesh_rank) != (world, rank):
        return ValueError(
            f"{name}: FSDP2 shards it over {info.shard_mesh_size} ranks (this one: {info.shard_mesh_rank}) "
            f"but reduce's group has {world} (this one: {rank}): pass the FSDP2 shard group as group "
            "(HSDP / 2-D meshes are not supported)"
        )
    return None


def fsdp_shard(fsdp_param, grad: torch.Tensor):
    """``grad`` as FSDP2's sharded gradient (a DTensor): ``grad`` is this rank's shard (the owner
    reduction's result) or, in one process, the full gradient, cut by FSDP2's layout (torch.chunk
    along the shard dim)."""
    if tuple(grad.shape) != tuple(fsdp_param.sharded_size):
        info = fsdp_param.mesh_info
        chunks = list(torch.chunk(grad, info.shard_mesh_size, dim=fsdp_param.fsdp_placement.dim))
        grad = chunks[info.shard_mesh_rank] if info.shard_mesh_rank < len(chunks) else grad.new_empty(0)
        if grad.numel() == 0:
            grad = grad.new_empty(fsdp_param.sharded_size)
    return fsdp_param.to_sharded_dtensor(grad.contiguous())


def fsdp_params(module: torch.nn.Module, index: dict[int, int]) -> dict[int, object]:
    """``{tracked index: FSDPParam}`` of ``module``'s FSDP2 (``fully_shard``) parameters whose sharded
    parameter is tracked (``index``: id of a tracked parameter -> its position)."""
    from torch.distributed.fsdp import FSDPModule

    found = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
        for group in groups:
            for fsdp_param in group.fsdp_params:
                position = index.get(id(fsdp_param.sharded_param))
                if position is not None:
                    found[position] = fsdp_param
    return found
