"""The fixed-order owner reduction (det_train/dp_reduce.py) on gloo: bits, bytes and memory per rank.

The main job (examples/train_gpt.py, tiny preset with 8-token sequences, one leaf each, one step)
runs in one process and on 2, 3, 4, 5 and 8 forked gloo ranks (one process group per degree,
several jobs each, dp_reduce_worker.py). Every rank's gradients at every step and weights at the
end must equal the single process's bit for bit: replicated (uneven shards at 3 ranks; at 5 ranks a
batch of 4 sequences, so one shard is empty, in small buckets that cut parameters) and FSDP2 at 2, 3
and 4 ranks.
Inside each reduce the worker counts every collective's bytes and the tensor memory allocated; the
tests check they follow the stated bounds (docs/det-train.md, "Data parallel"), without growth in W.
"""

from __future__ import annotations

import functools
import math
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from det_core.testing import assert_bitwise_equal, run_processes

sys.path.insert(0, str(Path(__file__).parent))
import dp_reduce_worker as worker  # noqa: E402
from det_train.accum import dp_reduce  # noqa: E402

# per DP degree: (job name, kwargs) run in order in one process group; "main" = the main job
JOBS = {
    2: [("main", dict(micro_batch_seqs=2)), ("main", dict(micro_batch_seqs=2, fsdp=True))],
    3: [
        ("main", dict(micro_batch_seqs=2)),
        ("main", dict(micro_batch_seqs=3, fsdp=True)),
        ("refused", {}),
        ("tied", {}),
    ],
    4: [("main", dict(micro_batch_seqs=2)), ("main", dict(micro_batch_seqs=2, fsdp=True))],
    # 4 sequences on 5 ranks (one shard empty) in buckets of 4099 elements, which cut parameters;
    # the toy with a parameter used twice in buckets of 50 elements
    5: [("main", dict(micro_batch_seqs=1, batch_seqs=4, bucket_numel=4099)), ("tied", dict(bucket_numel=50))],
    8: [("main", dict(micro_batch_seqs=1))],
}
DP, FSDP = 0, 1  # positions in JOBS of the replicated and FSDP2 main-job runs
BATCH = {5: 4}  # global batch (sequences) of a degree's replicated run; 8 where not named


@functools.cache
def one_process(batch_seqs: int = 8) -> dict:
    return worker.job_main(0, 1, micro_batch_seqs=batch_seqs, batch_seqs=batch_seqs)


@functools.cache
def ranks(world: int) -> tuple[list, ...]:
    """Each rank's job results for ``world`` forked gloo ranks (the parent joins no group)."""

    one_process(8), one_process(4)  # first, so the forked ranks inherit loaded kernels
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp, 'init')}"
        outs = [str(Path(tmp, f"rank{r}.pt")) for r in range(world)]
        args = [(r, world, JOBS[world], init, outs[r]) for r in range(world)]
        run_processes(worker.run_rank, args, timeout=300, what=f"DP={world} ranks")
        return tuple(torch.load(o, weights_only=False) for o in outs)


def assert_same_training(got: dict, want: dict, what: str) -> None:
    assert len(got["steps"]) == len(want["steps"]) == worker.STEPS, what
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        assert sorted(g["grads"]) == sorted(w["grads"]), what
        for name, value in w["grads"].items():
            assert_bitwise_equal(g["grads"][name], value, f"{what}: step {step} gradient of {name}")
    for name, value in want["weights"].items():
        assert_bitwise_equal(got["weights"][name], value, f"{what}: final {name}")
    assert got["digest"] == want["digest"], what


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_dp_degrees_give_the_bits_of_one_process(world):
    batch = BATCH.get(world, 8)
    for rank, results in enumerate(ranks(world)):
        assert_same_training(results[DP], one_process(batch), f"DP={world}, {batch} sequences, rank {rank}")


def test_an_empty_shard_gives_the_bits_of_one_process():
    """4 sequences on 5 ranks: rank 4 runs no micro-batch and holds no node, yet owns its ranges."""
    results = ranks(5)
    assert results[0][DP]["steps"][0]["nodes"] == [1, 1, 1, 1, 0]  # nodes per parameter on each rank
    for rank, r in enumerate(results):
        assert_same_training(r[DP], one_process(4), f"4 sequences on 5 ranks, rank {rank}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_gives_the_bits_of_one_process_and_never_unshards(world):
    numel = one_process(8)["numel"]
    for rank, results in enumerate(ranks(world)):
        assert_same_training(results[FSDP], one_process(8), f"FSDP2 over {world} ranks, rank {rank}")
        for step in results[FSDP]["steps"]:
            names = {name for name, _, _ in step["calls"]}
            assert names == {"all_gather_object", "all_to_all_single"}, names  # no all-gather of gradients
            # p.grad holds the shard: FSDP2's torch.chunk rows of every parameter, about 1/W of it
            assert step["grad_bytes"] <= 2 * (numel / world + 256), (step["grad_bytes"], numel)


def test_a_refusing_rank_makes_every_rank_raise():
    assert [r[2]["code"] for r in ranks(3)] == [1, 1, 1]


def test_a_parameter_used_twice_dp_3_and_5():
    """Two uses of one parameter (two trees with the same node keys, added in use order after the
    owner's trees), 1- and 2-node shards, open leaves, buckets that cut the gradients: the bits of
    one process, which are the canonical tree of each use's tokens, use 0 + use 1."""
    from det_core.reduce import canonical_sum

    want = worker.job_tied(0, 1)
    x, dy, _, _ = worker.tied_batch()
    definition = canonical_sum(x * dy[0], worker.TIED_LEAF) + canonical_sum(2.0 * x * dy[1], worker.TIED_LEAF)
    assert_bitwise_equal(want["w"], definition, "w: one process vs the definition")
    for world, job in ((3, 3), (5, 1)):
        for rank, results in enumerate(ranks(world)):
            for name in ("w", "v"):
                assert_bitwise_equal(results[job][name], want[name], f"{name}, DP={world}, rank {rank}")


def _data_bytes(step: dict) -> tuple[int, int]:
    """(sent, received) by the gradient collectives of one reduce (without the metadata)."""
    calls = [c for c in step["calls"] if c[0] != "all_gather_object"]
    return sum(c[1] for c in calls), sum(c[2] for c in calls)


def peak_bound(numel: int, n_local: int, n_max: int, leaves: int, e: int) -> float:
    """The stated bound on a reduce's transient memory for any W >= 2 (docs/det-train.md): the
    send and receive buffers ``4 N (n_local + n_max)``, the owner's tree ``4 N / W (ceil(log2 L) + 1)``,
    the all-gather ``e N (1 + 1 / W)``; plus 64 KiB (metadata, small pieces)."""
    return (
        4 * numel * (n_local + n_max)
        + 2 * numel * (math.ceil(math.log2(leaves)) + 1)
        + 1.5 * e * numel
        + 65536
    )


def test_bytes_and_memory_per_rank_do_not_grow_with_the_world_size():
    """W = 2, 4, 8, each rank's shard one aligned subtree (n = 1 node per parameter). Bytes sent and
    received by each rank each ``<= (W - 1) / W * N * (4 n + e)`` (plus rounding), at most 1.25x a
    ring reduce-scatter + all-gather of fp32 gradients (``2 (W - 1) / W * 4 N``), and per
    ``(W - 1) / W`` the same at W = 8 as at W = 2 (within 5 %); the peak extra memory of the reduce
    below ``peak_bound``, which does not grow with W (the old all-gather of nodes needed
    ``W * n * 4 N``: above the bound at W = 8)."""
    numel = one_process(8)["numel"]
    e = 2  # bf16 parameters
    assert 8 * 1 * 4 * numel > peak_bound(numel, 1, 1, 8, e)  # the bound tells the two reductions apart
    normalized = {}
    for world in (2, 4, 8):
        for rank, results in enumerate(ranks(world)):
            for step in results[DP]["steps"]:
                n = max(step["nodes"])
                assert n == 1 and min(step["nodes"]) == 1, step["nodes"]
                sent, received = _data_bytes(step)
                bound = (world - 1) / world * numel * (4 * n + e) + 4 * world * 64  # 64: pieces' rounding
                ring = 2 * (world - 1) / world * 4 * numel
                for what, value in (("sent", sent), ("received", received)):
                    assert 0 < value <= bound, f"W={world} rank {rank}: {what} {value} > {bound:.0f}"
                    assert value <= 1.25 * ring, f"W={world} rank {rank}: {what} {value} > 1.25 x ring"
                normalized.setdefault(world, []).append(max(sent, received) / ((world - 1) / world))
                limit = peak_bound(numel, n, n, 8, e)
                assert step["peak"] <= limit, f"W={world} rank {rank}: peak {step['peak']} > {limit:.0f}"
                meta = sum(c[1] for c in step["calls"] if c[0] == "all_gather_object")
                assert meta <= 1024 * world, f"metadata {meta} B"  # O(W * parameters), no gradient data
    assert max(normalized[8]) <= 1.05 * min(normalized[2]), normalized


def test_fsdp2_moves_only_the_reduce_scatter_half():
    numel = one_process(8)["numel"]
    for world in (2, 4):
        for results in ranks(world):
            for step in results[FSDP]["steps"]:
                n = max(step["nodes"])
                sent, received = _data_bytes(step)
                bound = (world - 1) / world * numel * 4 * n + 4 * world * 64
                assert max(sent, received) <= bound, (world, sent, received, bound)
                limit = peak_bound(numel, n, n, 8, 0)  # no all-gather
                assert step["peak"] <= limit, (world, step["peak"], limit)


def test_bucket_layout_partitions_every_parameter_among_owners():
    """The layout alone (no processes): every element has exactly one owner; an FSDP2 parameter's
    owners are its torch.chunk rows; buckets hold at most bucket_numel elements."""
    cpu = torch.device("cpu")
    specs = [
        dp_reduce.GradSpec("a", (7, 3), torch.bfloat16, cpu),
        dp_reduce.GradSpec("b", (5,), torch.float32, cpu),
        dp_reduce.GradSpec("c", (10, 2), torch.bfloat16, cpu, sharded=True),
        dp_reduce.GradSpec("d", (2, 4), torch.bfloat16, cpu),
        dp_reduce.GradSpec("e", (3,), torch.bfloat16, cpu, sharded=True),  # 3 rows over 4 ranks: one empty
    ]
    for world in (1, 3, 4):
        for cap in (1, 6, 13, 1000):
            layout = dp_reduce.bucket_layout(specs, world, cap)
            assert layout == dp_reduce.bucket_layout(specs, world, cap)
            owners = {i: torch.full((s.numel,), -1) for i, s in enumerate(specs)}
            for bucket in layout:
                assert sum(p.hi - p.lo for p in bucket.pieces) <= cap
                assert len({(specs[p.param].dtype, specs[p.param].sharded) for p in bucket.pieces}) == 1
                for piece in bucket.pieces:
                    # the owners' ranges tile the piece in rank order: contiguous in the bucket
                    bounds = [piece.lo] + [b for _, b in piece.owned]
                    assert [a for a, _ in piece.owned] == bounds[:-1] and bounds[-1] == piece.hi
                    for r, (a, b) in enumerate(piece.owned):
                        assert a <= b
                        assert bool(owners[piece.param][a:b].eq(-1).all())
                        owners[piece.param][a:b] = r
            for i, spec in enumerate(specs):
                assert bool(owners[i].ge(0).all()), (spec.name, world, cap)
                if spec.sharded:
                    rows = torch.arange(spec.shape[0]).repeat_interleave(spec.numel // spec.shape[0])
                    chunks = torch.chunk(torch.arange(spec.shape[0]), world)
                    want = torch.cat([torch.full((len(c),), r) for r, c in enumerate(chunks)])
                    assert torch.equal(owners[i], want[rows]), (spec.name, world, cap)


@pytest.mark.gpu
def test_gpu_single_process_reduce_is_the_tree_of_all_deposits():
    """One GPU, no process group: reduce runs no collective and its p.grad is TreePartial.result of
    the deposits (the one-process path, unchanged by the owner reduction), bf16 and fp32."""
    from det_core.reduce import TreePartial
    from det_train.accum.grad_accum import CanonicalGradAccumulator

    assert dp_reduce.group_size() == 1
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.zeros(257, 33, device="cuda", dtype=dtype, requires_grad=True)
        leaves = torch.randn(11, 257, 33, device="cuda", generator=g)
        acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=4)
        for first, n in ((0, 3), (3, 5), (8, 3)):  # three micro-batches of whole leaves
            with acc.micro_batch(token_offset=first * 4):
                first_leaf, n_leaves = acc.leaf_span(n * 4)
                acc.deposit(w, first_leaf, leaves[first_leaf : first_leaf + n_leaves])
        acc.reduce(total_tokens=44)
        want = TreePartial().add_leaves(0, leaves).result(11).to(dtype)
        assert_bitwise_equal(w.grad, want, f"single-GPU reduce, {dtype}")
