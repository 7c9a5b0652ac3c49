"""End to end: the main job's weights after N steps do not depend on how the global batch is split
into data-parallel ranks, micro-batches and accumulation steps (DP through torch.distributed:
spawned gloo processes on CPU, NCCL on GPUs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from det_core.testing import assert_bitwise_equal

from examples import train_gpt as tg

STEPS = 2
GLOBAL_BATCH = 8  # sequences

# (DP degree, micro-batch size, accumulation steps); the global batch is always 8 sequences
SINGLE_PROCESS = [(1, 4, 2), (1, 2, 4)]
TWO_RANKS = [(2, 4, 1), (2, 2, 2)]
FOUR_RANKS = [(4, 2, 1)]
# 3 ranks: uneven slices of 3, 3, 2 sequences; with micro-batch 2 the ranks run 2+1, 2+1, 2
THREE_RANKS = [(3, 2, None), (3, 1, None)]


def _cfg(micro_batch: int) -> tg.TrainConfig:
    return tg.make_config("tiny", steps=STEPS, batch_seqs=GLOBAL_BATCH, micro_batch_seqs=micro_batch)


@pytest.fixture(scope="module")
def baseline() -> dict:
    """(1, 8, 1): one process, the whole batch in one micro-batch."""
    return tg.train(_cfg(8))


def _assert_same(got: dict, want: dict, what: str) -> None:
    for name in sorted(want["state_dict"]):
        assert_bitwise_equal(got["state_dict"][name], want["state_dict"][name], f"{what}: {name}")
    for name in sorted(want["optim_state"]):
        for key, value in want["optim_state"][name].items():
            if torch.is_tensor(value):
                assert_bitwise_equal(got["optim_state"][name][key], value, f"{what}: optimizer {name}.{key}")
    assert got["digest"] == want["digest"]


@pytest.mark.parametrize("dp, micro, accum", SINGLE_PROCESS)
def test_micro_batches_in_one_process(baseline, dp, micro, accum):
    assert dp * micro * accum == GLOBAL_BATCH
    _assert_same(tg.train(_cfg(micro)), baseline, f"(dp {dp}, micro-batch {micro}, accum {accum})")


@pytest.mark.parametrize("world, splits", [(2, TWO_RANKS), (4, FOUR_RANKS), (3, THREE_RANKS)])
def test_data_parallel_ranks(baseline, world, splits):
    results = tg.train_spawned_many([(_cfg(micro), {}) for _, micro, _ in splits], world)
    for (dp, micro, accum), got in zip(splits, results, strict=True):
        _assert_same(got, baseline, f"(dp {dp}, micro-batch {micro}, accum {accum})")


def test_split_helpers():
    assert tg.split_range(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert tg.split_range(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    a = tg.batch_starts(10_000, 32, 8, seed=1, step=5)
    assert torch.equal(a, tg.batch_starts(10_000, 32, 8, seed=1, step=5))
    assert not torch.equal(a, tg.batch_starts(10_000, 32, 8, seed=1, step=6))


@pytest.mark.gpu
def test_gpu_micro_batches_and_nccl_ranks():
    cfg = tg.make_config("gpu", steps=2, batch_seqs=12, micro_batch_seqs=12, n_layer=4)
    want = tg.train(cfg)
    for micro in (6, 4, 3, 5):  # 5: micro-batches of 5, 5, 2
        _assert_same(tg.train(dataclasses.replace(cfg, micro_batch_seqs=micro)), want, f"micro-batch {micro}")
    for world in (2, 3, 4):
        if torch.cuda.device_count() >= world:
            got = tg.train_spawned(dataclasses.replace(cfg, micro_batch_seqs=2), world)
            _assert_same(got, want, f"{world} NCCL ranks")
