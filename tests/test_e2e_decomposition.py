"""End to end: the main job's weights and optimizer state after N steps do not depend on how the
global batch is split into data-parallel ranks, micro-batches and accumulation steps (DP through
torch.distributed: gloo ranks on CPU, forked from one new interpreter (tests/_e2e_runs.py); NCCL
ranks on GPUs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples import train_gpt as tg
from tests._e2e_runs import GLOBAL_BATCH, SEQ_LEN, assert_same_training, baseline, ranks, tiny

# (DP degree, micro-batch size, accumulation steps); (1, 8, 1) is the baseline. Two parts prove
# little (the docs' rule): 4 accumulation steps in one process; 4 ranks with one micro-batch each;
# 3 uneven ranks (3, 3, 2 sequences) whose micro-batches of 2 accumulate 2, 2 and 1 steps
SINGLE_PROCESS = [(1, 2, 4)]
DATA_PARALLEL = [(4, 2, 1), (3, 2, None)]


@pytest.mark.parametrize("dp, micro, accum", SINGLE_PROCESS)
def test_micro_batches_in_one_process(dp, micro, accum):
    assert dp * micro * accum == GLOBAL_BATCH
    got = tg.train(tiny(micro_batch_seqs=micro))
    assert_same_training(got, baseline(), f"(dp {dp}, micro-batch {micro}, accum {accum})")


def test_micro_batches_that_split_leaves():
    """Leaves of 4 sequences, micro-batches of 3 (3 + 3 + 2): leaves 0 and 1 each span two
    micro-batches, whose rows the accumulator carries; the same training as one micro-batch."""
    leaf = 4 * SEQ_LEN
    want = tg.train(tiny(micro_batch_seqs=GLOBAL_BATCH, leaf_tokens=leaf))
    got = tg.train(tiny(micro_batch_seqs=3, leaf_tokens=leaf))
    assert_same_training(got, want, "(micro-batch 3, leaves of 4 sequences)")
    with pytest.raises(
        ValueError, match=r"slices of 8 sequences .* start at sequences \[3, 6\], inside leaves"
    ):
        tg.train(tiny(leaf_tokens=leaf), world=3)


@pytest.mark.parametrize("dp, micro, accum", DATA_PARALLEL)
def test_data_parallel_ranks(dp, micro, accum):
    assert accum is None or dp * micro * accum == GLOBAL_BATCH
    got = ranks(dp)[("dp", micro)]
    assert_same_training(got, baseline(), f"(dp {dp}, micro-batch {micro}, accum {accum})")


def test_split_helpers():
    assert tg.split_range(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert tg.split_range(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    a = tg.batch_starts(10_000, 32, 8, seed=1, step=5)
    assert torch.equal(a, tg.batch_starts(10_000, 32, 8, seed=1, step=5))
    assert not torch.equal(a, tg.batch_starts(10_000, 32, 8, seed=1, step=6))


@pytest.mark.gpu
def test_gpu_micro_batches_and_nccl_ranks():
    cfg = tg.make_config("gpu", steps=2, batch_seqs=12, micro_batch_seqs=12, n_layer=4)
    want = tg.train(cfg)  # leaves of 8192 tokens (8 sequences): micro-batches below split leaf 0
    for micro in (6, 4, 3, 5):  # 5: micro-batches of 5, 5, 2
        got = tg.train(dataclasses.replace(cfg, micro_batch_seqs=micro))
        assert_same_training(got, want, f"micro-batch {micro}")
    cfg = dataclasses.replace(cfg, leaf_tokens=1024)  # rank slices of 6, 4, 3 sequences: leaf-aligned
    want = tg.train(cfg)
    for world in (2, 3, 4):
        if torch.cuda.device_count() >= world:
            got = tg.train_spawned(dataclasses.replace(cfg, micro_batch_seqs=2), world)
            assert_same_training(got, want, f"{world} NCCL ranks")
