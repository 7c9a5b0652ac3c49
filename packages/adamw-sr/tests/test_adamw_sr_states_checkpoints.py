"""CPU tests of ``AdamWSR(state_dtype=...)``: checkpoints of bf16 and 8-bit moments and bad input.

Split from test_adamw_sr_states.py (the kernel, codes, SR, shards, AMP and compile tests).
"""

from __future__ import annotations

import pytest
import torch
from adamw_sr import AdamWSR, _states, adamw_sr_step
from det_core.testing import assert_bitwise_equal, digest, run_in_fresh_process

FORMATS = [torch.bfloat16, "8bit"]

# --------------------------------------------------------------------------- checkpoints


_RESUME_CODE = """
import torch
from adamw_sr import AdamWSR
from det_core.testing import digest
out = []
KWARGS = (("bf16", dict(amsgrad=True, state_dtype=torch.bfloat16)), ("8bit", dict(state_dtype="8bit")))
for name, kw in KWARGS:
    params = [torch.zeros(5, 13, dtype=torch.bfloat16)]
    opt = AdamWSR(params, lr=1e-2, weight_decay=0.1, seed=11, **kw)
    saved = torch.load({path!r} + name, weights_only=True)
    for p, x in zip(params, saved["params"]):
        p.copy_(x)
    opt.load_state_dict(saved["opt"])
    for step in range(8, 16):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
    out.append(digest({{"params": params, "state": opt.state_dict()}}))
print(" ".join(out))
"""


def test_resume_in_fresh_process_equals_straight_run(tmp_path):
    # one param (65 elements: 8-bit scales for two blocks and a partial one): the interpreter pays per program
    init = [torch.randn(5, 13, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)]

    expected = []
    for name, kw in (
        ("bf16", dict(state_dtype=torch.bfloat16, amsgrad=True)),
        ("8bit", dict(state_dtype="8bit")),
    ):
        straight = [x.clone() for x in init]
        opt = AdamWSR(straight, lr=1e-2, weight_decay=0.1, seed=11, **kw)
        for step in range(16):
            if step == 8:  # the checkpoint is the straight run's own state after 8 steps (saved as bytes now)
                torch.save({"params": straight, "opt": opt.state_dict()}, str(tmp_path / "ckpt") + name)
            g = torch.Generator().manual_seed(step)
            for p in straight:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
        expected.append(digest({"params": straight, "state": opt.state_dict()}))
    got = run_in_fresh_process(_RESUME_CODE.format(path=str(tmp_path / "ckpt")))
    assert got.split() == expected


@pytest.mark.parametrize("state_dtype", FORMATS)
def test_state_dict_round_trip_keeps_dtypes_and_bits(state_dtype):
    p = torch.randn(4, 64).to(torch.bfloat16)
    opt = AdamWSR([p], state_dtype=state_dtype)
    p.grad = torch.randn(4, 64).to(torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["state_dtype"] == _states.canonical_state_dtype(state_dtype, "t")
    q = p.clone()
    opt2 = AdamWSR([q], state_dtype=state_dtype)
    opt2.load_state_dict(sd)
    keys = set(opt.state[p]) - {"step"}
    assert keys == ({"exp_avg", "exp_avg_sq"} | (set(_states.SCALE_KEYS) if state_dtype == "8bit" else set()))
    for k in keys:
        assert opt2.state[q][k].dtype == opt.state[p][k].dtype  # torch's own load would cast them
        assert_bitwise_equal(opt2.state[q][k], opt.state[p][k], k)
        assert opt2.state[q][k].data_ptr() != sd["state"][0][k].data_ptr()  # not aliasing the dict
    for o, x in ((opt, p), (opt2, q)):
        x.grad = torch.ones(4, 64, dtype=torch.bfloat16)
        o.step()
    assert_bitwise_equal(q, p)


def _stepped(state_dtype, optimizer=AdamWSR):
    p = torch.randn(4, 64)
    kw = {} if optimizer is torch.optim.AdamW else dict(state_dtype=state_dtype)
    opt = optimizer([p], lr=1e-3, **kw)
    p.grad = torch.randn(4, 64)
    opt.step()
    return opt


@pytest.mark.parametrize(
    "saved,target",
    [("float32", torch.bfloat16), ("8bit", torch.float32), ("bfloat16", "8bit"), ("torch", torch.bfloat16)],
)
def test_loading_a_checkpoint_of_another_state_dtype_raises_and_loads_nothing(saved, target):
    sd = _stepped(None, torch.optim.AdamW).state_dict() if saved == "torch" else _stepped(saved).state_dict()
    opt = _stepped(target)
    before = digest(opt.state_dict())
    with pytest.raises(ValueError, match=r"state_dtype=.* not converted"):
        opt.load_state_dict(sd)
    assert digest(opt.state_dict()) == before


def test_loading_a_checkpoint_whose_tensors_do_not_match_its_format_raises():
    sd = _stepped("bfloat16").state_dict()
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].float()
    with pytest.raises(ValueError, match="exp_avg.*float32.*bfloat16"):
        _stepped(torch.bfloat16).load_state_dict(sd)
    sd = _stepped("8bit").state_dict()
    del sd["state"][0]["exp_avg_sq_scale"]
    with pytest.raises(ValueError, match="lacks 'exp_avg_sq_scale'"):
        _stepped("8bit").load_state_dict(sd)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "value", [torch.float16, torch.uint8, torch.float64, "bf16", "int8", "8-bit", None, 8]
)
def test_unsupported_state_dtype_names_the_supported_ones(value):
    with pytest.raises(ValueError, match=r"torch\.float32 .*torch\.bfloat16 .*'8bit'"):
        AdamWSR([torch.zeros(3)], state_dtype=value)
    opt = AdamWSR([torch.zeros(3)])
    with pytest.raises(ValueError, match="state_dtype must be"):
        opt.add_param_group({"params": [torch.zeros(2)], "state_dtype": value})
    assert len(opt.param_groups) == 1


def test_unsupported_combinations_and_roundings_raise():
    with pytest.raises(ValueError, match="amsgrad is not supported with state_dtype='8bit'"):
        AdamWSR([torch.zeros(3)], amsgrad=True, state_dtype="8bit")
    opt = AdamWSR([torch.zeros(3)], state_dtype="8bit")
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [torch.zeros(2)], "amsgrad": True})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="state_rounding must be 'stochastic' .* or 'nearest'"):
        AdamWSR([torch.zeros(3)], state_dtype=torch.bfloat16, state_rounding="up")
    assert AdamWSR([torch.zeros(3)], state_dtype="float32").param_groups[0]["state_dtype"] == "float32"


@pytest.mark.parametrize(
    "edit,error,match",
    [
        (
            dict(state_dtype="8bit"),
            RuntimeError,
            "exp_avg. must be torch.uint8.*state_dtype was changed.*set state_dtype before the first step",
        ),  # states exist in bf16
        (dict(state_dtype=torch.float16), ValueError, "state_dtype must be"),
        (dict(state_rounding="down"), ValueError, "state_rounding"),
        (dict(amsgrad=True, state_dtype="8bit"), ValueError, "amsgrad"),
    ],
)
def test_group_edited_after_a_step_is_checked_before_anything_moves(edit, error, match):
    p = torch.randn(64).bfloat16()
    opt = AdamWSR([p], lr=1e-2, state_dtype=torch.bfloat16)
    p.grad = torch.ones(64, dtype=torch.bfloat16)
    opt.step()
    before = digest({"p": p, "state": opt.state_dict()})
    opt.param_groups[0].update(edit)
    with pytest.raises(error, match=match):
        opt.step()
    opt.param_groups[0].update(state_dtype="bfloat16", state_rounding="stochastic", amsgrad=False)
    assert digest({"p": p, "state": opt.state_dict()}) == before


def test_8bit_explicit_base_index_off_the_block_grid_is_refused_untouched():
    p = torch.zeros(64).bfloat16()
    opt = AdamWSR([{"params": [p], "base_index": [8]}], lr=1e-2, state_dtype="8bit")
    p.grad = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"multiple of 32.*base_index values that are multiples of 32"):
        opt.step()
    assert len(opt.state[p]) == 0 and not p.any()


def test_functional_step_checks_the_state_format():
    p, g = torch.zeros(64), torch.ones(64)
    m, v = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    scales = [torch.zeros(2, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="exp_avg_scales has 0 entries"):
        adamw_sr_step([p], [g], [m], [v], None, torch.ones(1), lr=1e-2)
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\] must be torch.uint8"):
        adamw_sr_step(
            [p], [g], [m], [torch.zeros(64)], None, torch.ones(1), lr=1e-2, exp_avg_scales=scales,
            exp_avg_sq_scales=scales,
        )  # fmt: skip
    with pytest.raises(ValueError, match="amsgrad"):
        adamw_sr_step([p], [g], [m], [v], [v.clone()], torch.ones(1), lr=1e-2, amsgrad=True)
    with pytest.raises(ValueError, match="global index 16"):
        adamw_sr_step(
            [p], [g], [m], [v], None, torch.ones(1), lr=1e-2, base_indices=[16], exp_avg_scales=scales,
            exp_avg_sq_scales=scales,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"exp_avg_scales\[0\] has shape \(3,\), expected \(2,\)"):
        adamw_sr_step(
            [p], [g], [m], [v], None, torch.ones(1), lr=1e-2,
            exp_avg_scales=[torch.zeros(3, dtype=torch.uint8)], exp_avg_sq_scales=scales,
        )  # fmt: skip
    with pytest.raises(TypeError, match="float32, bfloat16 or uint8"):
        adamw_sr_step([p], [g], [m.half()], [v.half()], None, torch.ones(1), lr=1e-2)
    assert not p.any() and not m.any() and not scales[0].any()  # nothing written
    adamw_sr_step([p], [g], [m], [v], None, torch.ones(1), lr=1e-2, exp_avg_scales=scales, exp_avg_sq_scales=[
        torch.zeros(2, dtype=torch.uint8)])  # fmt: skip
    assert p.any() and m.any() and scales[0].any()
