"""Data-parallel invariance over gloo on CPU: DP degree 1, 2, 3, 4 give bitwise identical gradients.

Each DP degree is one launch of ranks running dp_worker.run_rank with every case at once; the
tests compare the saved gradients across degrees and ranks.
"""

import functools
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from det_core.reduce import canonical_sum
from det_core.testing import assert_bitwise_equal, run_processes

CASES = {
    1: "accum_contiguous,accum_interleaved,ops_accum,ops_accum_odd,ops_accum_fixed,hook8,hook12",
    2: "accum_contiguous,accum_interleaved,ops_accum,ops_accum_odd,ops_accum_fixed,fsdp_accum,hook8,refused,"
    "total_mismatch,poisoned",
    3: "accum_contiguous,accum_interleaved,ops_accum,ops_accum_odd,ops_accum_fixed,fsdp_accum,hook12",
    4: "accum_contiguous,accum_interleaved,ops_accum,ops_accum_odd,ops_accum_fixed,fsdp_accum,hook8",
}


@functools.cache
def run_ranks(world: int) -> tuple[dict, ...]:
    """Run this degree's cases on ``world`` gloo ranks; return each rank's saved gradients.

    Ranks are forked from this process (torch already imported: a fresh import per rank costs
    seconds on a small CI machine); the parent never joins a process group.
    """

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp, 'init')}"
        outs = [str(Path(tmp, f"rank{r}.pt")) for r in range(world)]
        args = [(r, world, CASES[world], init, outs[r]) for r in range(world)]
        run_processes(_rank_main, args, timeout=300, what=f"DP={world} ranks")
        return tuple(torch.load(o) for o in outs)


def _rank_main(rank, world, cases, init, out):
    sys.path.insert(0, str(Path(__file__).parent))
    import dp_worker

    dp_worker.run_rank(rank, world, cases, init, out)


def assert_same_on_all(case: str, degrees, reference_degree: int = 1) -> dict:
    ref = {k: v for k, v in run_ranks(reference_degree)[0].items() if k.startswith(case + "/")}
    assert ref, f"no results for {case}"
    for world in degrees:
        for rank, got in enumerate(run_ranks(world)):
            for name, value in ref.items():
                assert_bitwise_equal(got[name], value, f"{name}, DP={world}, rank {rank}")
    return ref


def test_accumulator_dp_1_2_3_4_contiguous():
    ref = assert_same_on_all("accum_contiguous", (1, 2, 3, 4))
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(48, 5, generator=g), torch.randn(48, 5, generator=g)
    assert_bitwise_equal(ref["accum_contiguous/w"], canonical_sum(x * dy, 4), "DP grad vs canonical sum")


def test_accumulator_dp_2_3_4_interleaved_leaves():
    ref = assert_same_on_all("accum_interleaved", (2, 3, 4))
    assert_bitwise_equal(ref["accum_interleaved/w"], run_ranks(1)[0]["accum_contiguous/w"], "interleaved")


def test_ops_through_accumulator_dp_1_2_3_4():
    """Embedding (bf16) + RMSNorm + cross-entropy: every parameter's gradient, DP 1-4, 2 micro-batches."""
    ref = assert_same_on_all("ops_accum", (1, 2, 3, 4))
    assert ref["ops_accum/emb.weight"].dtype == torch.bfloat16
    assert bool(ref["ops_accum/norm.weight"].abs().gt(0).all())


def test_fixed_folds_give_the_same_gradients_dp_1_2_3_4():
    """With fixed folds (the RMSNorm weight's) every rank of DP 1-4 gets the plain accumulator's
    gradients: the fixed folds' nodes, and the short last leaf's open fold, reduce as any."""
    ref = {k.replace("ops_accum/", ""): v for k, v in run_ranks(1)[0].items() if k.startswith("ops_accum/")}
    for world in (1, 2, 3, 4):
        for rank, got in enumerate(run_ranks(world)):
            for name, value in ref.items():
                where = f"{name}, DP={world}, rank {rank}"
                assert_bitwise_equal(got[f"ops_accum_fixed/{name}"], value, where)


def test_odd_micro_batches_carry_open_leaves_dp_1_2_3_4():
    """The same gradients when every rank cuts its shard into 3-token micro-batches (leaves of 4):
    open leaves are carried to the micro-batch that completes them, on every rank."""
    ref = {k.replace("ops_accum/", ""): v for k, v in run_ranks(1)[0].items() if k.startswith("ops_accum/")}
    for world in (1, 2, 3, 4):
        for rank, got in enumerate(run_ranks(world)):
            for name, value in ref.items():
                assert_bitwise_equal(got[f"ops_accum_odd/{name}"], value, f"{name}, DP={world}, rank {rank}")


def test_a_refused_reduce_raises_on_every_rank_instead_of_hanging():
    """Rank 0's shard ends inside a leaf: rank 0 raises its own error, rank 1 a ValueError naming
    rank 0's (both join the metadata all-gather first, so neither waits for the other)."""
    for rank, got in enumerate(run_ranks(2)):
        assert int(got["refused/refused"]) == 1, f"rank {rank}: code {int(got['refused/refused'])}"


def test_a_poisoned_rank_refuses_with_the_others_instead_of_hanging():
    """Rank 1's accumulator (recoverable=False) is poisoned: its reduce raises the poisoning error,
    rank 0's a RuntimeError naming rank 1's (the poisoning travels with the first collective)."""
    for rank, got in enumerate(run_ranks(2)):
        assert int(got["poisoned/poisoned"]) == 1, f"rank {rank}: code {int(got['poisoned/poisoned'])}"


def test_ranks_passing_different_total_tokens_all_raise_instead_of_hanging():
    """Rank 1 passes another total_tokens: its own checks could fail while rank 0's pass and rank 0
    would wait in the data collective; the values travel with the node keys, so both raise, naming
    each rank's value."""
    for rank, got in enumerate(run_ranks(2)):
        assert int(got["total_mismatch/mismatch"]) == 1, (
            f"rank {rank}: code {int(got['total_mismatch/mismatch'])}"
        )


def test_fsdp2_sharded_grads_equal_unsharded_dp_2_3_4():
    """FSDP2 (fully_shard on gloo, uneven shards, an empty shard at DP 4): the accumulator replaces
    FSDP2's reduce-scatter, and the gathered sharded gradients equal the DP-1 unsharded ones bitwise."""
    ref = {k.replace("ops_accum/", ""): v for k, v in run_ranks(1)[0].items() if k.startswith("ops_accum/")}
    for world in (2, 3, 4):
        for rank, got in enumerate(run_ranks(world)):
            for name, value in ref.items():
                assert_bitwise_equal(
                    got[f"fsdp_accum/{name}"], value, f"FSDP2 {name}, DP={world}, rank {rank}"
                )


def test_ddp_hook_aligned_power_of_two_subtrees():
    """The DDP hook is DP-invariant when each rank holds 2**k whole leaves: 8 leaves as DP 1, 2, 4 and
    12 leaves as DP 1, 3 (fp32 grads, one micro-batch per rank, num_global_tokens scaling)."""
    assert_same_on_all("hook8", (1, 2, 4))
    assert_same_on_all("hook12", (1, 3))


def test_ddp_hook_matches_accumulator_when_aligned():
    from det_train.parallel.distributed import rank_tree_sum

    one = run_ranks(1)[0]
    assert_bitwise_equal(one["hook12/norm.weight"], one["hook12/norm.weight"], "self")
    a, b, c = (torch.randn(7, generator=torch.Generator().manual_seed(i)) for i in range(3))
    assert_bitwise_equal(rank_tree_sum([a, b, c]), (a + b) + c, "tree over 3 ranks")
    assert_bitwise_equal(rank_tree_sum([a, b, c, a]), (a + b) + (c + a), "tree over 4 ranks")


def _run_nccl(world: int, cases: str) -> list[dict]:

    sys.path.insert(0, str(Path(__file__).parent))
    import dp_worker

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp, 'init')}"
        outs = [str(Path(tmp, f"rank{r}.pt")) for r in range(world)]
        args = [(r, world, cases, init, outs[r], "nccl") for r in range(world)]
        # CUDA is initialised in this process: no fork
        run_processes(dp_worker.run_rank, args, start_method="spawn", what="NCCL ranks")
        return [torch.load(o) for o in outs]


@pytest.mark.gpu
def test_gpu_nccl_dp_2_equals_dp_1():
    """NCCL on 2 GPUs: accumulator path (DP 1 vs 2, 2 micro-batches per rank) and DDP hook (8 leaves)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    (ref,) = _run_nccl(1, "ops_accum,hook8")
    for rank, got in enumerate(_run_nccl(2, "ops_accum,hook8")):
        for name, value in ref.items():
            assert_bitwise_equal(got[name], value, f"NCCL {name}, DP=2, rank {rank}")


def test_reduce_with_group_needs_initialized_process_group():
    from det_train.accum.grad_accum import CanonicalGradAccumulator

    w = torch.randn(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="not initialized"):
        CanonicalGradAccumulator([w]).reduce(total_tokens=4, group=object())


def test_reduce_gradients_needs_an_accumulator_and_a_refused_call_keeps_the_deposits():
    from det_train import CanonicalGradAccumulator, linear, reduce_gradients

    with pytest.raises(
        TypeError, match="accumulator must be the det_train.CanonicalGradAccumulator .*NoneType"
    ):
        reduce_gradients(None, 8)
    w = torch.nn.Parameter(torch.tensor([[1.0, -2.0]]))
    acc = CanonicalGradAccumulator([w], leaf_tokens=2)
    with acc.micro_batch(token_offset=0):
        linear(torch.tensor([[3.0, 4.0], [1.0, 1.0]]), w).sum().backward()
    with pytest.raises(TypeError, match="total_tokens must be an integer"):
        reduce_gradients(acc, 2.0)
    reduce_gradients(acc, 2)
    assert_bitwise_equal(w.grad, torch.tensor([[4.0, 5.0]]), "w.grad: the sum of x's rows")


def test_deterministic_allreduce_state_refuses_a_non_bool_average_and_a_non_group():
    from det_train import DeterministicAllreduceState, deterministic_allreduce_hook

    with pytest.raises(TypeError, match="average must be True or False, got 'no'"):
        DeterministicAllreduceState(average="no")
    with pytest.raises(
        TypeError, match="group must be None .* or a torch.distributed ProcessGroup, got int 5"
    ):
        DeterministicAllreduceState(group=5)
    with pytest.raises(
        TypeError, match="state of deterministic_allreduce_hook is a DeterministicAllreduceState"
    ):
        deterministic_allreduce_hook(5, None)  # refused before the bucket is read
    state = DeterministicAllreduceState(average=False)
    assert state.group is None and state.average is False
