"""End to end: the main job's final weights are the same bits run to run, in a fresh process (cold
Triton cache), and after a checkpoint resumed in a fresh process (examples/train_gpt.py, "tiny"
preset on CPU through the Triton interpreter; the `gpu` test uses a 4-layer slice of the GPU preset)."""

from __future__ import annotations

import dataclasses

import pytest
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


def test_resume_refuses_another_config():
    cfg = tiny(micro_batch_seqs=8, lr=1e-3)
    with pytest.raises(ValueError, match="another config"):
        tg.train(cfg, resume_from=baseline()["checkpoint"])


@pytest.mark.gpu
def test_gpu_run_to_run_fresh_process_and_resume(tmp_path):
    cfg = tg.make_config("gpu", steps=4, batch_seqs=8, micro_batch_seqs=4, n_layer=4)
    path = tmp_path / "step2.pt"
    first = tg.train(cfg, save_at=2, save_path=path)
    assert_same_training(tg.train(cfg), first, "second run")
    assert _fresh_process_digest(cfg) == first["digest"]
    assert _fresh_process_digest(cfg, resume_from=str(path)) == first["digest"]
