"""torch.distributed.checkpoint (DCP) with AdamWSR under FSDP2, on 2 and 3 gloo ranks (CPU, the
kernel through the Triton interpreter; ranks are processes running dcp_worker.py).

* ``get_state_dict`` + ``dcp.save``, a fresh model and optimizer, ``dcp.load`` + ``set_state_dict``:
  the loaded state equals the saved one bitwise, and the resumed run ends on the straight run's bits
  (``STEPS`` straight == ``RESUME_AT`` + save + fresh load + the rest), which are the unsharded run's;
* ``get_optimizer_state_dict`` -> ``set_optimizer_state_dict`` round-trips bitwise (sharded: the
  DCP path above; and with ``full_state_dict=True``);
* DCP's initialisation step for a missing state (``optimizer.step()`` with lr = 0 and zero
  gradients) leaves the parameters bitwise unchanged; in one process too, with the one exception
  the docs name (a -0.0 weight becomes +0.0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from adamw_sr import AdamWSR
from det_core.testing import assert_bitwise_equal, digest, run_ranks
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

WORKER = Path(__file__).with_name("dcp_worker.py")
sys.path.insert(0, str(WORKER.parent))
import dcp_worker  # noqa: E402


def _launch(nprocs: int, sizes: list[int], out_dir: Path) -> None:
    run_ranks(WORKER, nprocs, [out_dir, ",".join(map(str, sizes))], env={"TRITON_INTERPRET": "1"})


def _unsharded_digest() -> str:
    model = dcp_worker.build_model()
    opt = AdamWSR(
        model.parameters(), lr=dcp_worker.LR, weight_decay=dcp_worker.WEIGHT_DECAY, seed=dcp_worker.SEED
    )
    for step in range(dcp_worker.STEPS):
        for i, p in enumerate(model.parameters()):
            p.grad = dcp_worker.full_grad(i, p.shape, step)
        opt.step()
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        out += [opt.state[p][k] for k in ("exp_avg", "exp_avg_sq", "step")]
    return digest(out)


def test_dcp_fsdp2_gloo_2_and_3_ranks_round_trip_and_resume_on_the_straight_bits(tmp_path):
    _launch(3, [2, 3], tmp_path)
    expected = _unsharded_digest()
    for w in (2, 3):
        got = json.loads((tmp_path / f"ws{w}.json").read_text())
        assert got["straight"] == expected, (w, got)
        assert got["resumed"] == got["straight"], (w, got)
        assert got["loaded_equal"] and got["groups_equal"], (w, got)
        assert got["full_round_trip"], (w, got)
        assert got["init_ran"] and got["init_unchanged"], (w, got)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_dcp_initialisation_step_leaves_parameters_unchanged(amsgrad):
    # get_optimizer_state_dict on an optimizer without state runs step() with lr = 0 and zero grads
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    model[1].to(torch.bfloat16)  # one fp32 and one bf16 layer (stochastic rounding)
    with torch.no_grad():
        model[0].bias[0] = 0.0
        model[1].bias[1] = -0.0  # the exception: -0.0 - (-0.0 * 0) is +0.0 in IEEE arithmetic
    opt = AdamWSR(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1, amsgrad=amsgrad, seed=5)
    before = [p.detach().clone() for p in model.parameters()]
    state = get_optimizer_state_dict(model, opt)
    assert all(float(s["step"]) == 1.0 for s in state["state"].values())  # the step ran
    assert opt.param_groups[0]["lr"].item() == torch.tensor(1e-2).item()  # and gave the lr back
    for i in range(3):
        assert_bitwise_equal(list(model.parameters())[i].detach(), before[i], f"param {i}")
    bias = list(model.parameters())[3].detach()
    assert_bitwise_equal(bias[[0, 2]], before[3][[0, 2]])
    assert bias[1].item() == 0.0 and not torch.signbit(bias[1]) and torch.signbit(before[3][1])
