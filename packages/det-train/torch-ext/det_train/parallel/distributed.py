"""Deterministic data-parallel gradient reduction on top of torch.distributed collectives.

Two paths (docs/det-train.md, "Reductions"):

1. **The general one: ``CanonicalGradAccumulator.reduce(total_tokens, group)``** (accum/grad_accum.py,
   accum/dp_reduce.py). Every rank's partial canonical trees go to the owners of their element ranges
   (an all-to-all), each owner finishes the canonical tree for its range and, for replicated
   parameters, the finished gradients are all-gathered; under FSDP2 the owner's range is its shard.
   The reduced gradient is bitwise identical on every rank *and* for any DP degree, micro-batch
   count and leaf-aligned split of the global batch; per-rank bytes and memory do not grow with the
   DP degree. ``reduce_gradients`` below is that call.
2. **``deterministic_allreduce_hook``, a DDP communication hook**: sends each rank's slice of a
   gradient bucket to the slice's owner (an all-to-all), which sums the W slices in the fixed
   pairwise tree over rank index in fp32; an all-gather returns the sums. Every rank gets
   identical bits and the result is run-to-run reproducible for a fixed W; it is invariant across
   DP degrees only in the aligned case described in its docstring.

We add the deterministic reduction on top of torch's collectives; we do not write a communication
runtime.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from det_core.reduce import TreePartial

from ..accum.dp_reduce import all_gather_single
from ..accum.grad_accum import CanonicalGradAccumulator

__all__ = ["DeterministicAllreduceState", "deterministic_allreduce_hook", "rank_tree_sum", "reduce_gradients"]


def reduce_gradients(accumulator, total_tokens: int, group=None) -> None:
    """The general deterministic DP reduction: ``accumulator.reduce(total_tokens, group)``.

    Args:
        accumulator: a ``CanonicalGradAccumulator`` that received this rank's micro-batches.
        total_tokens: tokens of the global batch (all ranks, all micro-batches).
        group: data-parallel process group (None: the default group).

    Raises:
        TypeError: ``accumulator`` is not a ``CanonicalGradAccumulator``; ``total_tokens`` not an
            integer.
        ValueError, RuntimeError: as ``CanonicalGradAccumulator.reduce`` (``total_tokens`` not
            covering the deposits, missing tokens, an open leaf, a non-zero ``p.grad``, another
            rank's failed checks; a call inside a micro-batch, nothing deposited, a ``group`` without
            an initialized process group), before any ``p.grad`` is written.

    **Determinism:** ``p.grad`` is bitwise identical on every rank and for every DP degree /
    micro-batch split whose boundaries are leaf-aligned (tested with gloo for DP 1, 2, 3, 4, 5, 8,
    and FSDP2 over 2, 3, 4 ranks). Do not
    also wrap the model in DDP (or keep every micro-batch under ``no_sync``): the accumulator does the
    communication, and det_train ops return no autograd gradient for the tracked parameters.
    """
    if not isinstance(accumulator, CanonicalGradAccumulator):
        raise TypeError(
            "det_train.reduce_gradients: accumulator must be the det_train.CanonicalGradAccumulator that "
            f"received this rank's micro-batches, got {type(accumulator).__name__}; build one with "
            "CanonicalGradAccumulator(model.parameters()) and run each micro-batch under "
            "acc.micro_batch(token_offset)"
        )
    accumulator.reduce(total_tokens=total_tokens, group=group)


def rank_tree_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """fp32 sum of ``tensors`` (one per rank, in rank order) by the canonical pairwise tree over ranks."""
    if not tensors:
        raise ValueError("rank_tree_sum needs at least one tensor")
    return TreePartial().add_leaves(0, [t.to(torch.float32) for t in tensors]).result(len(tensors))


@dataclass
class DeterministicAllreduceState:
    """State of ``deterministic_allreduce_hook``.

    Attributes:
        group: the process group (None: the default group).
        average: divide the sum by the world size (DDP's default semantics, for a loss that is a
            per-rank mean). Use ``average=False`` with ``cross_entropy(..., num_global_tokens=N)``,
            whose gradients are already scaled by 1 / (global tokens).

    Raises:
        TypeError: ``group`` is neither None nor a ``torch.distributed.ProcessGroup``; ``average``
            is not a bool (a string such as ``"no"`` is truthy: it would average).

    **Determinism:** configuration only. With ``average=True`` the division by the world size is
    one elementwise fp32 operation after the fixed rank-order tree, so it is run-to-run
    deterministic but makes the result depend on the DP degree; ``average=False`` keeps the
    DP-degree invariance described in ``deterministic_allreduce_hook``.
    """

    group: object = None
    average: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.average, bool):
            raise TypeError(
                f"DeterministicAllreduceState: average must be True or False, got {self.average!r}"
            )
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(
                "DeterministicAllreduceState: group must be None (the default group) or a "
                f"torch.distributed ProcessGroup, got {type(self.group).__name__} {self.group!r} (the state "
                "of deterministic_allreduce_hook is a DeterministicAllreduceState, a ProcessGroup or None)"
            )


# no `from __future__ import annotations` here: DDP checks the hook's annotations as objects
def deterministic_allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: each bucket slice summed on its owner in a fixed tree over ranks, in fp32.

    Register with ``ddp_model.register_comm_hook(state, deterministic_allreduce_hook)`` where
    ``state`` is a ``DeterministicAllreduceState``, a process group, or None (default group,
    averaging like DDP's built-in all-reduce).

    Args:
        state: see above.
        bucket: ``torch.distributed.GradBucket`` (flat gradient buffer of any float dtype).

    Returns:
        A future holding the reduced bucket (same dtype; the sum is computed in fp32 and rounded once).

    Raises:
        TypeError: ``state`` is neither a ``DeterministicAllreduceState``, a ``ProcessGroup`` nor
            None (as ``DeterministicAllreduceState`` refuses such a group).
        ValueError: torch.distributed's, when ``group`` is None and no default process group is
            initialized. RuntimeError: a failed collective (torch.distributed's, from the backend).

    Method: rank r owns elements ``[r * c, (r + 1) * c)`` of the bucket (``c = ceil(numel / W)``);
    one ``all_to_all_single`` gives it every rank's copy of them, it sums the W copies by
    ``rank_tree_sum``, and one ``all_gather_single`` (in the bucket's dtype) returns every owner's
    sums to every rank. Per rank that moves ``2 * (W - 1) / W`` bucket sizes each way and holds
    about 2 bucket sizes transiently, as a ring all-reduce does (the hook before this held W
    gathered copies). The all-to-all is waited for in the hook (on NCCL a wait on the current
    stream, not on the host); the all-gather is returned as the future.

    **Determinism:** every rank gets identical bits, run to run, for a fixed DP degree W (NCCL's
    ring / tree all-reduce guarantees neither across W). Invariance *across* DP degrees holds only
    when every rank's local gradient is a whole subtree of the canonical tree of the global batch:
    (a) ranks hold contiguous token ranges in rank order, each exactly ``2**k`` full leaves of the
    ops' leaf size (k may differ between degrees, e.g. 8 leaves as DP 1, 2, 4 or 12 leaves as DP 1
    and 3); (b) one micro-batch per rank (DDP adds accumulated gradients in autograd order, not the
    canonical one); (c) fp32 gradients (a bf16 bucket was rounded per rank before the sum);
    (d) loss scaling that is the same on every rank (``num_global_tokens`` with ``average=False``).
    Outside that case use the general path, ``CanonicalGradAccumulator.reduce`` / ``reduce_gradients``.
    """
    if state is None or not isinstance(state, DeterministicAllreduceState):
        state = DeterministicAllreduceState(group=state)
    group = state.group
    buffer = bucket.buffer()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = buffer.numel()
    chunk = -(-numel // world)
    sizes = [max(0, min(chunk, numel - r * chunk)) for r in range(world)]  # elements each rank owns
    copies = torch.empty(world * sizes[rank], dtype=buffer.dtype, device=buffer.device)
    dist.all_to_all_single(copies, buffer, [sizes[rank]] * world, sizes, group=group)
    total = rank_tree_sum(list(copies.view(world, sizes[rank])))
    if state.average:
        total = total / world
    contribution = torch.empty(chunk, dtype=buffer.dtype, device=buffer.device)
    contribution[: sizes[rank]].copy_(total)  # the one rounding to the bucket's dtype
    gathered = torch.empty(world * chunk, dtype=buffer.dtype, device=buffer.device)
    future = all_gather_single(gathered, contribution, group=group, async_op=True).get_future()

    def finish(_fut):
        buffer.copy_(gathered[:numel])
        return buffer

    return future.then(finish)
