"""CPU smoke test of examples/adamw_sub_ulp.py (sub-ULP moment updates per state format)."""

from __future__ import annotations

import json
import math

import pytest


def test_sub_ulp_script_nearest_stalls_while_sr_mean_moves_with_fp32(tmp_path):
    from examples import adamw_sub_ulp

    # betas 0.6: the moments reach 1 - 0.6^t of their limits g, g^2 fast, and an update
    # 0.4 (limit - moment) falls below half a bf16 ULP once 1 - 0.6^t > 1 - 2^-9 / 0.4, from step ~10:
    # nearest then stores the same value at every step, while fp32 still moves ~0.5 ULP by step 14.
    # fp32 weights: no weight rounding bits to draw (the moments are the subject)
    n, steps = 1024, 14
    args = ["--steps", str(steps), "--numel", str(n), "--betas", "0.6", "0.6", "--param-dtype", "fp32"]
    content = adamw_sub_ulp.main([*args, "--configs", "fp32,bf16-sr,bf16-rn", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "adamw_sub_ulp.json").read_text()) == json.loads(json.dumps(content))
    assert (tmp_path / "adamw_sub_ulp.png").stat().st_size > 0
    assert content["run"]["device"] and content["run"]["setup"]["steps"] == steps
    fp32, sr, rn = (content["configs"][k] for k in ("fp32", "bf16-sr", "bf16-rn"))
    assert fp32["steps"] == list(range(1, steps + 1))
    for key in ("exp_avg", "exp_avg_sq"):
        exact = content["exact"][key]
        stall = rn[key + "_last_change"]  # nearest's last change of a stored bit
        assert 4 <= stall <= steps - 4, (key, stall)
        mean32, mean_sr, mean_rn = (r[key + "_mean"] for r in (fp32, sr, rn))
        assert len(set(mean_rn[stall - 1 :])) == 1  # stalled: every element the same value, step after step
        ulp = 2.0 ** (math.floor(math.log2(exact[-1])) - 7)  # bf16 spacing at the limit
        assert mean32[-1] - mean32[stall - 1] > 0.3 * ulp  # ... while the fp32 moment still moves
        assert max(abs(a - b) for a, b in zip(mean32, exact, strict=True)) < 1e-3 * ulp  # fp32 ~ exact
        sigma = sr[key + "_std"][-1] / math.sqrt(n)  # of SR's mean over n independent roundings
        assert 0.0 < sigma < 0.05 * ulp
        assert abs(mean_sr[-1] - mean32[-1]) < 4 * sigma, (key, mean_sr[-1], mean32[-1], sigma)
        moved_sr, moved32 = mean_sr[-1] - mean_sr[stall - 1], mean32[-1] - mean32[stall - 1]
        assert abs(moved_sr - moved32) < 6 * sigma, (key, moved_sr, moved32, sigma)  # SR moves with fp32
        assert mean32[-1] - mean_rn[-1] > 20 * sigma  # nearest stays below, far outside SR's noise
        assert sr[key + "_last_change"] == steps  # SR's stored bits keep changing


def test_sub_ulp_script_rejects_bad_arguments():
    from examples import adamw_sub_ulp

    with pytest.raises(SystemExit, match="unknown --configs"):
        adamw_sub_ulp.main(["--configs", "fp32,fp16"])
    with pytest.raises(SystemExit, match="--betas"):
        adamw_sub_ulp.main(["--betas", "0.9", "1.0"])
    with pytest.raises(SystemExit, match="names a config twice"):
        adamw_sub_ulp.main(["--configs", "fp32,fp32"])
    with pytest.raises(SystemExit, match="must include fp32"):
        adamw_sub_ulp.main(["--configs", "8bit-sr"])
    with pytest.raises(SystemExit, match="--lr and --eps must be > 0"):
        adamw_sub_ulp.main(["--lr", "-1"])
    with pytest.raises(SystemExit, match="--seed must be >= 0"):
        adamw_sub_ulp.main(["--seed", "-1"])
