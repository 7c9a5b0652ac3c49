"""GPU tests of ``AdamWSR(state_dtype=...)`` (marked ``gpu``; skipped without CUDA). No GPU work at import.

* bf16 and 8-bit moments on CUDA equal the plain-torch CPU reference bit for bit (digests), with
  stochastic and nearest rounding, bf16 and fp32 params, amsgrad with bf16 moments, AMP unscaling;
* FSDP2 on 2 GPUs (NCCL) equals the unsharded run (fsdp_states_worker.py);
* a ``capturable`` step replayed from a CUDA graph equals eager steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from adamw_sr import AdamWSR, _states, adamw_sr_step_reference, default_base_indices
from det_core.testing import assert_bitwise_equal, digest

pytestmark = pytest.mark.gpu

# odd sizes (masked tails, partial 8-bit blocks) and 2-D scales; ~5.2 M elements
SHAPES = [(2048, 2048), (1_000_003,), (2048,), (7, 13), (4096, 32)]
# a second group at explicit base indices beyond 2**32: multiples of 32 (8-bit blocks), else unaligned
EXTRA_SHAPES = [(333,), (5000,)]


def _grads(shapes, step, dtype, device):
    g = torch.Generator().manual_seed(step)
    out = [torch.randn(s, generator=g) for s in shapes]
    out[1] = out[1] * torch.logspace(-8, 2, out[1].numel())  # subnormal codes in the 8-bit blocks
    return [x.to(device=device, dtype=dtype) for x in out]


def _ref_state(shape, state_dtype: str, amsgrad: bool) -> dict:
    dtype = _states.moment_dtype(state_dtype)
    out = {"m": torch.zeros(shape, dtype=dtype), "v": torch.zeros(shape, dtype=dtype), "vm": None}
    if amsgrad:
        out["vm"] = torch.zeros(shape, dtype=dtype)
    if state_dtype == "8bit":
        scale = _states.scale_shape(tuple(shape))
        out["ms"], out["vs"] = torch.zeros(scale, dtype=torch.uint8), torch.zeros(scale, dtype=torch.uint8)
    return out


@pytest.mark.parametrize(
    "state_dtype,rounding,param_dtype,amsgrad,amp",
    [
        ("bfloat16", "stochastic", torch.bfloat16, False, False),
        ("bfloat16", "nearest", torch.float32, True, False),
        ("bfloat16", "stochastic", torch.bfloat16, True, True),
        ("8bit", "stochastic", torch.bfloat16, False, False),
        ("8bit", "nearest", torch.bfloat16, False, False),
        ("8bit", "stochastic", torch.float32, False, True),
    ],
)
def test_cuda_states_equal_cpu_reference_bitwise(state_dtype, rounding, param_dtype, amsgrad, amp):
    shapes = SHAPES + EXTRA_SHAPES
    extra_bases = [2**33, 10**12] if state_dtype == "8bit" else [2**33 + 1, 10**12 + 7]
    init = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)).to(param_dtype)
        for i, s in enumerate(shapes)
    ]
    params = [x.cuda() for x in init]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad)
    groups = [{"params": params[: len(SHAPES)]}, {"params": params[len(SHAPES) :], "base_index": extra_bases}]
    opt = AdamWSR(groups, seed=123456789012345, state_dtype=state_dtype, state_rounding=rounding, **kw)
    align = 32 if state_dtype == "8bit" else 8
    bases = default_base_indices([s.numel() for s in init], [align] * len(init))[: len(SHAPES)] + extra_bases
    refs = [x.clone() for x in init]
    ref_states = [_ref_state(s, state_dtype, amsgrad) for s in shapes]
    scale = torch.tensor([1024.0])  # AMP: gradients carry the loss scale, unscaled in the kernel
    for step in range(1, 4):
        grads = _grads(shapes, step, param_dtype, "cpu")
        if amp:
            opt.grad_scale, opt.found_inf = scale.cuda(), torch.zeros(1, device="cuda")
            grads = [(g.float() * 1024).to(param_dtype) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to("cuda", copy=True)  # the AMP step writes the unscaled gradient back
        opt.step()
        for r, g, st, base in zip(refs, grads, ref_states, bases, strict=True):
            adamw_sr_step_reference(
                r, g, st["m"], st["v"], st["vm"], step=step, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                weight_decay=0.1, amsgrad=amsgrad, seed=123456789012345, base_index=base,
                state_rounding=rounding, exp_avg_scale=st.get("ms"), exp_avg_sq_scale=st.get("vs"),
                grad_scale=scale if amp else None,
            )  # fmt: skip
    keys = ["exp_avg", "exp_avg_sq"] + (list(_states.SCALE_KEYS) if state_dtype == "8bit" else [])
    ref_keys = {"exp_avg": "m", "exp_avg_sq": "v", "exp_avg_scale": "ms", "exp_avg_sq_scale": "vs"}
    gpu = {"params": params, **{k: [opt.state[p][k] for p in params] for k in keys}}
    cpu = {"params": refs, **{k: [st[ref_keys[k]] for st in ref_states] for k in keys}}
    if digest(gpu) != digest(cpu):
        for i, (a, b) in enumerate(zip(params, refs, strict=True)):
            assert_bitwise_equal(a.cpu(), b, f"param {i}")
            for k in keys:
                assert_bitwise_equal(opt.state[a][k].cpu(), ref_states[i][ref_keys[k]], f"{k} {i}")
    assert digest(gpu) == digest(cpu)
    print(f"digest {state_dtype} {rounding} {param_dtype} amsgrad={amsgrad} amp={amp}: {digest(gpu)}")


def test_fsdp2_nccl_2_gpus_states_equal_unsharded(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_adamw_sr_states import _launch_fsdp, fsdp_unsharded_digest

    _launch_fsdp(2, [1, 2], tmp_path, {"DET_FSDP_BACKEND": "nccl", "TRITON_INTERPRET": "0"})
    expected = fsdp_unsharded_digest(torch.device("cuda", 0))
    for w in (1, 2):
        assert (tmp_path / f"ws{w}.txt").read_text() == expected, w


@pytest.mark.parametrize("state_dtype", ["bfloat16", "8bit"])
def test_cuda_graph_capture_of_a_states_step_equals_eager(state_dtype):
    shapes = [(1024, 512), (333,)]

    def make():
        params = [
            torch.randn(s, generator=torch.Generator().manual_seed(i)).to("cuda", torch.bfloat16)
            for i, s in enumerate(shapes)
        ]
        for p in params:
            p.grad = torch.zeros_like(p)
        lr = torch.tensor(1e-3, device="cuda")
        return params, lr, AdamWSR(params, lr=lr, capturable=True, seed=5, state_dtype=state_dtype)

    def load_grads(params, step):
        g = torch.Generator().manual_seed(step)
        for p, s in zip(params, shapes, strict=True):
            p.grad.copy_(torch.randn(s, generator=g).to("cuda", torch.bfloat16))

    eager, lr_e, opt_e = make()
    for step in range(6):
        load_grads(eager, step)
        lr_e.fill_(1e-3 * (step + 1))
        opt_e.step()
    graphed, lr_g, opt_g = make()
    load_grads(graphed, 0)
    opt_g.step()  # warm-up outside the graph: state and launch tables
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        opt_g.step()
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(1, 6):
        load_grads(graphed, step)
        lr_g.fill_(1e-3 * (step + 1))
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(graphed, eager, strict=True):
        assert_bitwise_equal(a, b)
        for key, value in opt_g.state[a].items():
            assert_bitwise_equal(value, opt_e.state[b][key], key)
