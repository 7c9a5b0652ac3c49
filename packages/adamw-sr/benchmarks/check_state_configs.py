"""GPU check of the bf16 / 8-bit state kernels' launch configs against the CPU reference.

For each candidate config (``_kernel.LAUNCH_CONFIGS`` entry shape), three steps on sizes whose tails cut
an 8-bit block and a masked sub-tile, compared bitwise with ``adamw_sr_step_reference``; the step is
run twice to tell a wrong result from a run-to-run one. Prints one line per (format, config).

    python packages/adamw-sr/benchmarks/check_state_configs.py
"""

from __future__ import annotations

import torch
from adamw_sr import AdamWSR, _kernel, _states, adamw_sr_step_reference, default_base_indices
from adamw_sr.functional import PLAN_CACHE

SHAPES = [(1_000_003,), (333,), (323,), (1024, 512), (2048 + 256 + 67,)]
CANDIDATES = {
    "shipped": None,
    "sub256-w2-edge256": dict(BLOCK=2048, SUB=256, num_warps=2, TILE_2D=True, PRECOMPUTED=True, EDGE_SUB=256),
    "sub256-w2-edge128": dict(BLOCK=2048, SUB=256, num_warps=2, TILE_2D=True, PRECOMPUTED=True, EDGE_SUB=128),
    "sub256-w1-edge64": dict(BLOCK=2048, SUB=256, num_warps=1, TILE_2D=True, PRECOMPUTED=True, EDGE_SUB=64),
    "sub256-w4-edge64": dict(BLOCK=2048, SUB=256, num_warps=4, TILE_2D=True, PRECOMPUTED=True, EDGE_SUB=64),
    "sub512-w4-edge128": dict(BLOCK=2048, SUB=512, num_warps=4, TILE_2D=True, PRECOMPUTED=True, EDGE_SUB=128),
    "sub256-w2-edge64-1d": dict(
        BLOCK=2048, SUB=256, num_warps=2, TILE_2D=False, PRECOMPUTED=True, EDGE_SUB=64
    ),
}


def _run(state_dtype: str, device: str) -> tuple[list[torch.Tensor], list[dict]]:
    params = [torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16().to(device)
              for i, s in enumerate(SHAPES)]  # fmt: skip
    opt = AdamWSR(
        params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, seed=123, state_dtype=state_dtype
    )
    for step in range(1, 4):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        grads[0] = grads[0] * torch.logspace(-8, 2, grads[0].numel())
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr.bfloat16().to(device)
        opt.step()
    torch.cuda.synchronize()
    return [p.cpu() for p in params], [{k: v.cpu() for k, v in opt.state[p].items()} for p in params]


def _reference(state_dtype: str) -> tuple[list[torch.Tensor], list[dict]]:
    params = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16() for i, s in enumerate(SHAPES)
    ]
    dtype = _states.moment_dtype(state_dtype)
    sts = []
    for p in params:
        st = {"exp_avg": torch.zeros(p.shape, dtype=dtype), "exp_avg_sq": torch.zeros(p.shape, dtype=dtype)}
        if state_dtype == "8bit":
            shape = _states.scale_shape(tuple(p.shape))
            st["exp_avg_scale"] = torch.zeros(shape, dtype=torch.uint8)
            st["exp_avg_sq_scale"] = torch.zeros(shape, dtype=torch.uint8)
        sts.append(st)
    bases = default_base_indices(
        [p.numel() for p in params], [32 if state_dtype == "8bit" else 8] * len(params)
    )
    for step in range(1, 4):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        grads[0] = grads[0] * torch.logspace(-8, 2, grads[0].numel())
        for p, gr, st, b in zip(params, grads, sts, bases, strict=True):
            adamw_sr_step_reference(
                p, gr.bfloat16(), st["exp_avg"], st["exp_avg_sq"], None, step=step, lr=1e-3, beta1=0.9,
                beta2=0.95, eps=1e-8, weight_decay=0.1, seed=123, base_index=b,
                exp_avg_scale=st.get("exp_avg_scale"), exp_avg_sq_scale=st.get("exp_avg_sq_scale"),
            )  # fmt: skip
    return params, sts


def _differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        bad = x.contiguous().view(torch.uint8) != y.contiguous().view(torch.uint8)
        n = int(bad.sum())
        if n:
            first = int(bad.flatten().nonzero()[0]) // x.element_size()
            out.append(f"t{i}:{n}B@{first}")
    return " ".join(out) or "equal"


def main() -> None:
    for fmt, key in (("8bit", "cuda-8bit"), ("bfloat16", "cuda-bf16")):
        ref_p, ref_s = _reference(fmt)
        shipped = dict(_kernel.LAUNCH_CONFIGS[key])
        for name, cfg in CANDIDATES.items():
            _kernel.LAUNCH_CONFIGS[key] = dict(cfg or shipped)
            PLAN_CACHE.clear()
            p1, s1 = _run(fmt, "cuda")
            p2, s2 = _run(fmt, "cuda")
            line = [f"{fmt:8s} {name:22s} params {_differ(p1, ref_p)}"]
            for k in ref_s[0]:
                line.append(f"{k} {_differ([s[k] for s in s1], [s[k] for s in ref_s])}")
            line.append(f"repeat {_differ(p1, p2)}")
            print(" | ".join(line), flush=True)
        _kernel.LAUNCH_CONFIGS[key] = shipped
        PLAN_CACHE.clear()


if __name__ == "__main__":
    main()
