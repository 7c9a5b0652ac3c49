"""End to end: the main job's final weights are the same bits run to run, in a fresh process (cold
Triton cache), and after a checkpoint resumed in a fresh process (examples/train_gpt.py, "tiny"
preset on CPU through the Triton interpreter; the `gpu` test uses a 4-layer slice of the GPU preset)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from det_core.testing import run_in_fresh_process

from examples import train_gpt as tg
from tests._e2e_runs import CHECKPOINT_STEP, assert_same_training, baseline, fresh_runs, tiny


def _fresh_process_digest(cfg: tg.TrainConfig, **train_kwargs) -> str:
    code = (
        "from examples import train_gpt as tg\n"
        f"cfg = tg.TrainConfig(**{dataclasses.asdict(cfg)!r})\n"
        f"print(tg.train(cfg, **{train_kwargs!r})['digest'])\n"
    )
    return run_in_fresh_process(code)


def test_run_to_run_and_fresh_process():
    first = baseline()
    cfg = tiny(micro_batch_seqs=8)
    assert_same_training(tg.train(cfg), first, "second run")
    assert_same_training(fresh_runs()["straight"], first, "fresh process")
    # the digest covers weights that moved: training changed every tensor
    initial = tg.build_model(cfg, "cpu").state_dict()
    for name, value in initial.items():
        assert not (value == first["state_dict"][name]).all(), f"{name} did not change"


def test_checkpoint_resumed_in_fresh_process_matches_straight_run():
    straight = baseline()
    cfg = tiny(micro_batch_seqs=8)
    resumed = tg.train(cfg, resume_from=straight["checkpoint"])
    assert_same_training(resumed, straight, f"resumed at step {CHECKPOINT_STEP}")
    assert resumed["losses"] == straight["losses"][CHECKPOINT_STEP:]
    fresh = fresh_runs()["resumed"]
    assert_same_training(fresh, straight, f"resumed at step {CHECKPOINT_STEP} in a fresh process")
    assert fresh["losses"] == straight["losses"][CHECKPOINT_STEP:]


def test_resume_refuses_another_config_and_takes_another_split():
    """The message names what differs; the micro-batch split is not part of what must match (it
    changes no bit: the resumed run under micro-batches of 3 ends on the straight run's digest)."""
    cfg = tiny(micro_batch_seqs=8, lr=1e-3)
    with pytest.raises(ValueError, match=r"another config \(lr: 0\.003 there, 0\.001 here\)"):
        tg.train(cfg, resume_from=baseline()["checkpoint"])
    resumed = tg.train(tiny(micro_batch_seqs=3), resume_from=baseline()["checkpoint"])
    assert_same_training(resumed, baseline(), "resumed under micro-batches of 3")


def test_bad_counts_seeds_and_checkpoints_are_refused_before_training(tmp_path):
    """Found by a new-user trial: they failed late (range() step 0, an int64 overflow in the data
    order, an IndexError after training) or not at all (a checkpoint step past the run)."""
    for field, value in (("steps", 0), ("micro_batch_seqs", 0), ("batch_seqs", -4), ("seed", 2**40)):
        with pytest.raises(ValueError, match=f"{field} must be an integer"):
            tiny(**{field: value})
    cfg = tiny(micro_batch_seqs=8)
    with pytest.raises(ValueError, match=r"save_at must be a step in \[1, 2\]"):
        tg.train(cfg, save_at=5, save_path=tmp_path / "c.pt")
    with pytest.raises(ValueError, match="save_at and save_path go together"):
        tg.train(cfg, save_at=1)
    with pytest.raises(ValueError, match="its folder does not exist"):
        tg.train(cfg, save_at=1, save_path=tmp_path / "missing" / "c.pt")
    ckpt = torch.load(baseline()["checkpoint"], weights_only=True)
    for name, bad, match in (
        ("step.pt", {**ckpt, "step": 5}, r"checkpoint step 5 is outside \[0, 2\]"),
        ("keys.pt", {k: v for k, v in ckpt.items() if k != "optim"}, "not a train_gpt checkpoint"),
    ):
        torch.save(bad, tmp_path / name)
        with pytest.raises(ValueError, match=match):
            tg.train(cfg, resume_from=tmp_path / name)
    with pytest.raises(SystemExit):  # argparse: "--micro-batch: must be an integer >= 1, got '0'"
        tg.parse_args(["--micro-batch", "0"])


@pytest.mark.gpu
def test_gpu_run_to_run_fresh_process_and_resume(tmp_path):
    cfg = tg.make_config("gpu", steps=4, batch_seqs=8, micro_batch_seqs=4, n_layer=4)
    path = tmp_path / "step2.pt"
    first = tg.train(cfg, save_at=2, save_path=path)
    assert_same_training(tg.train(cfg), first, "second run")
    assert _fresh_process_digest(cfg) == first["digest"]
    assert _fresh_process_digest(cfg, resume_from=str(path)) == first["digest"]
