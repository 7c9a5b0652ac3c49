"""Benchmark (GPU): one training step of the main job's GPT, deterministic vs torch's fastest parts.

    python examples/bench_step.py --out docs/benchmarks

Both models have the same architecture, shapes and bf16 weights (the "gpu" preset of
train_gpt.py, ~100 M params, sequence 1024):

* **det**: det_train (Linear, RMSNorm, Embedding, cross-entropy), det_attn attention, the
  canonical-order gradient accumulator, AdamWSR with stochastic rounding: bitwise reproducible
  under any batch decomposition.
* **torch**: ``nn.Linear`` (cuBLAS), SDPA with the cuDNN backend (flash if cuDNN is refused),
  ``nn.RMSNorm``, ``nn.Embedding``, ``F.cross_entropy``, fused ``torch.optim.AdamW``: not
  deterministic (atomics in attention backward, cuBLAS algorithm choice per shape).

A step is forward + backward over the global batch (in ``--micro-batches`` micro-batches) plus the
optimizer step. Timed with ``triton.testing.do_bench`` (median, both in this process, side by side).
Target: det step time <= 1.2x the torch step. Writes ``DIR/main-job_train_step.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt as tg  # noqa: E402  (puts the monorepo's package sources on sys.path)


def make_step(cfg: tg.TrainConfig, micro_batches: int, device):
    """A closure running one full training step of ``cfg`` (det or torch), and its tokens per step."""
    model = tg.build_model(cfg, device)
    opt = tg.build_optimizer(cfg, model)
    acc = None
    if cfg.kernels == "det":
        import det_train

        acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=cfg.leaf_tokens)
    train, _ = tg.load_corpus()
    starts = tg.batch_starts(len(train), cfg.seq_len, cfg.batch_seqs, cfg.seed, 0)
    x, y = tg.get_batch(train, starts, cfg.seq_len, device)
    per = cfg.batch_seqs // micro_batches
    n_tokens = cfg.batch_seqs * cfg.seq_len

    def step():
        for m in range(micro_batches):
            xs, ys = x[m * per : (m + 1) * per], y[m * per : (m + 1) * per]
            if acc is None:
                model(xs, ys, num_global_tokens=n_tokens)[1].backward()
            else:
                with acc.micro_batch(token_offset=m * per * cfg.seq_len):
                    model(xs, ys, num_global_tokens=n_tokens)[1].backward()
        if acc is not None:
            acc.reduce(total_tokens=n_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, n_tokens


def _sdpa_backend():
    """The fastest SDPA backend this GPU accepts for the model's shapes: cuDNN, else flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the model's layout: (B, T, H, D) views transposed to (B, H, T, D)
    q = torch.randn(2, 1024, 12, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            return backend
        except RuntimeError:
            continue
    raise RuntimeError("neither the cuDNN nor the flash SDPA backend runs on this GPU")


def profile_step(step, steps: int = 3, top: int = 30) -> str:
    """Host wall time per step against device busy time, and the ops with the most device time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host_ms = (time.perf_counter() - t0) / steps * 1e3  # python returns before the GPU finishes...
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3  # ...so launch-bound when host_ms ~ wall_ms
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        step()
    host.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(35)
    table = events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    return (
        f"host {host_ms:.1f} ms/step to enqueue, wall {wall_ms:.1f} ms/step, "
        f"device busy {device_ms:.1f} ms/step (sum of kernel times)\n{table}\n{by_cpu}\n"
        f"python functions by own time ({steps} steps):\n{text.getvalue()}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for main-job_train_step.md/.json")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences of 1024 tokens")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="override n_layer (default: the gpu preset's 12)")
    p.add_argument(
        "--profile", action="store_true", help="also print where the det step spends device and host time"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_step.py needs a CUDA GPU (the interpreter path is for correctness, not speed)")
        return 1
    import triton.testing

    overrides = dict(batch_seqs=args.batch, micro_batch_seqs=args.batch // args.micro_batches)
    if args.layers:
        overrides["n_layer"] = args.layers
    det_cfg = tg.make_config("gpu", **overrides)
    torch_cfg = tg.make_config(
        "gpu", kernels="torch", optimizer="torch_adamw", rounding="nearest", **overrides
    )
    device = torch.device("cuda")
    n_params = sum(p.numel() for p in tg.GPT(det_cfg.model_config(), kernels="torch").parameters())

    rows = []
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backend()
    for name, cfg in (("det (ours)", det_cfg), (f"torch ({backend.name}, cuBLAS, fused AdamW)", torch_cfg)):
        step, n_tokens = make_step(cfg, args.micro_batches, device)
        with sdpa_kernel([backend]) if cfg.kernels == "torch" else contextlib.nullcontext():
            ms = triton.testing.do_bench(step, warmup=3, rep=30, return_mode="median")
        rows.append({"impl": name, "ms_per_step": ms, "tokens_per_s": n_tokens / ms * 1e3})
        if args.profile:
            with sdpa_kernel([backend]) if cfg.kernels == "torch" else contextlib.nullcontext():
                print(f"\n## profile: {name}\n{profile_step(step)}\n")
        torch.cuda.empty_cache()
    det_ms, torch_ms = rows[0]["ms_per_step"], rows[1]["ms_per_step"]
    ratio = det_ms / torch_ms

    title = (
        f"GPT train step, {n_params / 1e6:.0f} M params "
        f"({det_cfg.n_layer} layers, d_model {det_cfg.d_model}), "
        f"bf16 weights, batch {args.batch} x {det_cfg.seq_len} tokens in {args.micro_batches} micro-batches, "
        f"{torch.cuda.get_device_name()}"
    )
    lines = [
        f"**{title}**",
        "",
        "| implementation | ms / step | tokens / s | time vs torch |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} "
            f"| {r['ms_per_step'] / torch_ms:.2f}x |"
        )
    lines += [
        "",
        f"det / torch step time: **{ratio:.2f}x** (target <= 1.2x: {'met' if ratio <= 1.2 else 'NOT met'})",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "main-job_train_step.md").write_text(table + "\n")
        meta = {
            "title": title,
            "rows": rows,
            "ratio_det_over_torch": ratio,
            "n_params": n_params,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "config": vars(det_cfg),
            "sdpa_backend": backend.name,
            "cwd": os.getcwd(),
        }
        (out / "main-job_train_step.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
