"""Training runs shared by the end-to-end tests, cached per process: through the Triton
interpreter a step of even the "tiny" model costs seconds, so the reference run is trained once."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
from det_core.testing import assert_bitwise_equal

from examples import train_gpt as tg

STEPS = 2  # two optimizer steps: the second one reads the optimizer state the first one wrote
CHECKPOINT_STEP = 1
GLOBAL_BATCH = 8  # sequences of the tiny preset's 16 tokens

_TMP = Path(tempfile.mkdtemp(prefix="e2e-runs-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


def tiny(**overrides) -> tg.TrainConfig:
    """The tiny preset for ``STEPS`` steps with a global batch of ``GLOBAL_BATCH`` sequences."""
    return tg.make_config("tiny", **{"steps": STEPS, "batch_seqs": GLOBAL_BATCH, **overrides})


@functools.cache
def baseline() -> dict:
    """(DP 1, micro-batch 8, accumulation 1) in this process; writes a checkpoint after step 1
    (``result["checkpoint"]``; saving does not change the run)."""
    path = _TMP / "baseline-step1.pt"
    result = tg.train(tiny(micro_batch_seqs=GLOBAL_BATCH), save_at=CHECKPOINT_STEP, save_path=path)
    result["checkpoint"] = str(path)
    return result


# Spawned process groups, one per world size, each running several jobs (start-up paid once):
# (kind, micro-batch size). "dp": replicated weights; "fsdp": FSDP2-sharded weights and state.
# 3 ranks hold 3, 3, 2 sequences; FSDP needs the same micro-batch count on every rank (3 -> 1 each).
SPAWNED_JOBS = {
    2: [("dp", 4), ("dp", 2), ("fsdp", 2)],
    3: [("dp", 2), ("fsdp", 3)],
    4: [("dp", 2)],
}


@functools.cache
def spawned(world: int) -> dict[tuple[str, int], dict]:
    """Results of ``SPAWNED_JOBS[world]`` on ``world`` spawned gloo ranks, keyed by (kind, micro)."""
    jobs = [(tiny(micro_batch_seqs=micro), {"fsdp": kind == "fsdp"}) for kind, micro in SPAWNED_JOBS[world]]
    return dict(zip(SPAWNED_JOBS[world], tg.train_spawned_many(jobs, world), strict=True))


def assert_same_training(got: dict, want: dict, what: str) -> None:
    """Weights and optimizer state bit for bit (first mismatch named), then the weight digests."""
    assert sorted(got["state_dict"]) == sorted(want["state_dict"]), what
    for name in sorted(want["state_dict"]):
        assert_bitwise_equal(got["state_dict"][name], want["state_dict"][name], f"{what}: {name}")
    for name in sorted(want["optim_state"]):
        for key, value in want["optim_state"][name].items():
            if torch.is_tensor(value):
                assert_bitwise_equal(got["optim_state"][name][key], value, f"{what}: optimizer {name}.{key}")
            else:
                assert got["optim_state"][name][key] == value, f"{what}: optimizer {name}.{key}"
    assert got["digest"] == want["digest"], what
