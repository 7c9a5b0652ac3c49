"""The main job's checkpoints hold tensors and plain types only and are loaded with
``torch.load(weights_only=True)``: a checkpoint that carries code (a pickled callable) is refused
before the code runs. That a normal checkpoint resumes onto the straight run's bits is
tests/test_e2e_reproducibility.py's test; here, that the checkpoint it resumes from is plain data."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from examples import train_gpt as tg
from tests._e2e_runs import CHECKPOINT_STEP, baseline, tiny


class _TouchOnLoad:
    """Unpickles to ``Path(marker).touch()``: what a tampered checkpoint could run when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_carrying_a_pickled_callable_is_refused_before_it_runs(tmp_path):
    cfg = tiny(micro_batch_seqs=8)
    model = tg.build_model(cfg, torch.device("cpu"))
    opt = tg.build_optimizer(cfg, model)
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil.pt"
    payload = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 0,
        "config": dataclasses.asdict(cfg),
        "hook": _TouchOnLoad(marker),
    }
    torch.save(payload, evil)
    # the payload is live: a full unpickler runs it
    torch.load(evil, weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        tg.train(cfg, resume_from=evil)
    assert not marker.exists()


def test_written_checkpoint_is_plain_data():
    ckpt = torch.load(baseline()["checkpoint"], weights_only=True)  # raises on anything but plain data
    assert sorted(ckpt) == ["config", "model", "optim", "step"]
    assert type(ckpt["step"]) is int and ckpt["step"] == CHECKPOINT_STEP
    assert type(ckpt["config"]) is dict and ckpt["config"] == dataclasses.asdict(tiny(micro_batch_seqs=8))
    assert all(torch.is_tensor(v) for v in ckpt["model"].values())
