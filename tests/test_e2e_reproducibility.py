"""End to end: the main job's final weights are the same bits run to run, in a fresh process, and
after a checkpoint resumed in a fresh process (examples/train_gpt.py at the "tiny" preset on CPU
through the Triton interpreter; the `gpu` tests use a larger model on the GPU)."""

from __future__ import annotations

import dataclasses

import pytest
from det_core.testing import assert_bitwise_equal, run_in_fresh_process

from examples import train_gpt as tg

STEPS = 3


def _tiny(**overrides) -> tg.TrainConfig:
    return tg.make_config("tiny", steps=STEPS, **overrides)


def assert_same_weights(a: dict, b: dict, what: str) -> None:
    """Every tensor of two state dicts bit for bit (a readable first mismatch), then the digests."""
    assert sorted(a["state_dict"]) == sorted(b["state_dict"])
    for name in sorted(a["state_dict"]):
        assert_bitwise_equal(a["state_dict"][name], b["state_dict"][name], f"{what}: {name}")
    assert a["digest"] == b["digest"]


def _fresh_process_digest(cfg: tg.TrainConfig, **train_kwargs) -> str:
    code = (
        "from examples import train_gpt as tg\n"
        f"cfg = tg.TrainConfig(**{dataclasses.asdict(cfg)!r})\n"
        f"print(tg.train(cfg, **{train_kwargs!r})['digest'])\n"
    )
    return run_in_fresh_process(code)


def test_run_to_run_and_fresh_process():
    cfg = _tiny()
    first = tg.train(cfg)
    second = tg.train(cfg)
    assert_same_weights(second, first, "second run")
    assert first["losses"] == second["losses"]
    # a cold Triton cache and a new interpreter give the same bits
    assert _fresh_process_digest(cfg) == first["digest"]
    # the digest is sensitive: the weights moved, and another seed gives other weights
    initial = tg.build_model(cfg, "cpu").state_dict()
    assert any(not (initial[k] == first["state_dict"][k]).all() for k in initial)
    assert tg.train(dataclasses.replace(cfg, seed=cfg.seed + 1))["digest"] != first["digest"]


def test_checkpoint_resumed_in_fresh_process_matches_straight_run(tmp_path):
    cfg = _tiny(steps=4)
    path = tmp_path / "step2.pt"
    straight = tg.train(cfg, save_at=2, save_path=path)  # saving does not change the run
    resumed_here = tg.train(cfg, resume_from=path)
    assert_same_weights(resumed_here, straight, "resumed at step 2")
    assert resumed_here["losses"] == straight["losses"][2:]
    assert _fresh_process_digest(cfg, resume_from=str(path)) == straight["digest"]


def test_resume_refuses_another_config(tmp_path):
    cfg = _tiny()
    path = tmp_path / "ckpt.pt"
    tg.train(dataclasses.replace(cfg, steps=1), save_at=1, save_path=path)
    with pytest.raises(ValueError, match="another config"):
        tg.train(dataclasses.replace(cfg, lr=cfg.lr * 2), resume_from=path)


@pytest.mark.gpu
def test_gpu_run_to_run_fresh_process_and_resume(tmp_path):
    cfg = tg.make_config("gpu", steps=4, batch_seqs=8, micro_batch_seqs=4, n_layer=4)
    path = tmp_path / "step2.pt"
    first = tg.train(cfg, save_at=2, save_path=path)
    assert_same_weights(tg.train(cfg), first, "second run")
    assert _fresh_process_digest(cfg) == first["digest"]
    assert _fresh_process_digest(cfg, resume_from=str(path)) == first["digest"]
