"""End to end: FSDP2 (``fully_shard``) sharding of the parameters and of the AdamWSR state gives the
bits of the unsharded single-process run (gloo on CPU; 3 ranks, the shards uneven, one of them empty).
FSDP2 with gradient accumulation (micro-batches of 2 on 2 ranks) is checked on the same main job by
packages/det-train/tests/test_dp_reduce.py, at every step's gradients.

Gradients come from det_train.CanonicalGradAccumulator (canonical order over all ranks'
micro-batches), not from FSDP's reduce-scatter; AdamWSR keys its stochastic rounding by global
element index read from the DTensor placement (examples/train_gpt.py: ``shard_with_fsdp2``)."""

from __future__ import annotations

import pytest

from examples import train_gpt as tg
from tests._e2e_runs import assert_same_training, baseline, ranks, tiny


def test_fsdp2_sharded_matches_unsharded():
    # 3 ranks: 3, 3, 2 sequences in one micro-batch each, and torch.chunk shards every weight 3
    # ways, unevenly (the 256-row embedding table as 86, 86, 84 rows; the 4-row position table as
    # 2, 2 and an empty shard on rank 2)
    got = ranks(3)[("fsdp", 3)]
    assert_same_training(got, baseline(), "FSDP2 over 3 ranks, micro-batch 3")


def test_fsdp_refuses_unsupported_combinations():
    with pytest.raises(ValueError, match="fsdp needs"):
        tg.train(tiny(), fsdp=True)  # one rank
    with pytest.raises(ValueError, match="same count on every rank"):
        tg.train(tiny(micro_batch_seqs=1), rank=0, world=3, fsdp=True)  # 3, 3, 2 micro-batches
