"""CPU smoke test of examples/adamw_states_quality.py (the state_dtype quality run) on the tiny preset."""

from __future__ import annotations

import json

import pytest


def test_quality_script_runs_one_step_merges_and_writes_curves(tmp_path, monkeypatch):
    from examples import adamw_states_quality as quality
    from examples import train_gpt

    # the tiny preset with a global batch of 2 sequences (2 canonical leaves, one micro-batch, 2 held-out
    # sequences): the script's code path is the same at any batch, and the interpreter's cost grows with it
    small = {"batch_seqs": 2, "micro_batch_seqs": 2, "eval_seqs": 2}
    monkeypatch.setitem(train_gpt.PRESETS, "tiny", {**train_gpt.PRESETS["tiny"], **small})
    args = ["--preset", "tiny", "--steps", "1", "--out", str(tmp_path)]
    first = quality.main([*args, "--configs", "fp32"])
    curves = quality.main([*args, "--configs", "8bit-sr", "--merge"])  # added to the first run's JSON
    saved = json.loads((tmp_path / "adamw_states_quality.json").read_text())
    assert saved["curves"] == curves and set(curves) == {"fp32", "8bit-sr"}
    assert curves["fp32"] == first["fp32"]
    assert saved["run"]["config"]["steps"] == 1 and saved["run"]["device"]
    assert saved["run"]["config"]["batch_seqs"] == 2  # the preset the script read
    assert (tmp_path / "adamw_states_quality.png").stat().st_size > 0
    # the first step updates the weights from the fp32 moments of a zero state, whatever their format:
    # the same train loss (same data) and the same held-out loss (same weights) for every config
    assert len({c["train_loss"][0] for c in curves.values()}) == 1
    assert len({c["val_loss"][0] for c in curves.values()}) == 1
    assert all(c["val_steps"] == [1] for c in curves.values())
    with pytest.raises(SystemExit, match="another setup"):  # refused before any training
        quality.main(["--preset", "tiny", "--steps", "2", "--out", str(tmp_path), "--merge"])


def test_quality_script_rejects_unknown_configs():
    from examples import adamw_states_quality as quality

    with pytest.raises(SystemExit, match="unknown --configs"):
        quality.main(["--preset", "tiny", "--configs", "fp32,fp16"])
