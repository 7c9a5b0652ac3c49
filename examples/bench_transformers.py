"""Benchmark (GPU): one training step of a transformers model, converted by det_train vs as it is.

    python examples/bench_transformers.py --out docs/benchmarks
    python examples/bench_transformers.py --layers 4 --micro-batches 1,4
    python examples/bench_transformers.py --family all --out docs/benchmarks

``--family``: one or more of examples/model_families.py's families (comma-separated, or ``all``;
default ``llama``). Both models of a family are built from one config (no download; by default
hidden 1024, 8 layers, 16 heads of 64 with 4 KV heads (GPT-2: 16, no GQA), FFN 2816, vocabulary
32000: ~150 M parameters for a Llama), bf16 weights, sequences of 1024 tokens:

* **det**: ``attn_implementation="det_attn"``, ``det_train.convert(model)`` (det_train Linear,
  RMSNorm / LayerNorm / Conv1D, Embedding and the causal-LM loss), ``CanonicalGradAccumulator``,
  ``AdamWSR``: bitwise the same weights for any split of the global batch.
* **torch**: ``attn_implementation="sdpa"`` with the cuDNN backend (flash if cuDNN is refused),
  transformers' own layers and loss (cuBLAS, torch norms), autograd accumulation, fused
  ``torch.optim.AdamW``: not deterministic.

A step is forward + backward over the global batch in ``--micro-batches`` micro-batches (each
given ``num_items_in_batch``, the global batch's label count) plus the optimizer step, eager. The
accumulator's leaf is the default 8192 tokens, halved until a micro-batch is whole leaves (the
speed guidance of docs/det-train.md; micro-batches that end inside leaves are correct but slower).
Timed with ``triton.testing.do_bench`` (median ms, both in this process, side by side). Writes
``DIR/transformers_train_step.md`` and ``.json`` (one row per family and micro-batch count).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:  # imported as examples.bench_transformers, or run as a script (examples/ on sys.path)
    from examples import model_families
except ModuleNotFoundError:
    import model_families


def families(spec: str) -> list[str]:
    """The families named by ``--family`` (comma-separated, or ``all``); ValueError for an unknown one."""
    names = list(model_families.FAMILIES) if spec == "all" else [f.strip() for f in spec.split(",")]
    unknown = [f for f in names if f not in model_families.FAMILIES]
    if unknown or not names:
        raise ValueError(
            f"--family {spec!r}: unknown {unknown}; choose from {', '.join(model_families.FAMILIES)} or all"
        )
    return names


def build(args, family: str, det: bool, leaf_tokens: int = 8192):
    heads = args.hidden // 64
    kv_heads = heads if family == "gpt2" else max(1, args.hidden // 256)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_families.build(
            family,
            hidden=args.hidden,
            layers=args.layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=64,
            ffn=args.ffn,
            vocab=args.vocab,
            seq=args.seq,
            attn="det_attn" if det else model_families.peer_attention(family),
        )
    model = model.to(dtype=torch.bfloat16)
    if det:
        import adamw_sr
        import det_train

        model = det_train.convert(model)
        opt = adamw_sr.AdamWSR(model.parameters(), lr=1e-4, weight_decay=0.1, seed=0)
        acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=leaf_tokens)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        acc = None
    return model, opt, acc


def make_step(args, family: str, det: bool, micro_batches: int, backend):
    """A closure running one full training step of ``family``'s det or torch model."""
    from torch.nn.attention import sdpa_kernel

    per = args.batch // micro_batches
    leaf = 8192  # the default leaf, halved until micro-batches are whole leaves (the fast path)
    while (per * args.seq) % leaf:
        leaf //= 2
    model, opt, acc = build(args, family, det, leaf)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)
    n_items = args.batch * (args.seq - 1)

    def step():
        for i in range(micro_batches):
            x = ids[i * per : (i + 1) * per]
            if det:
                with acc.micro_batch(token_offset=i * per * args.seq):
                    model(input_ids=x, labels=x, num_items_in_batch=n_items).loss.backward()
            else:
                with sdpa_kernel([backend]):
                    model(input_ids=x, labels=x, num_items_in_batch=n_items).loss.backward()
        if det:
            acc.reduce(total_tokens=args.batch * args.seq)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _sdpa_backend(args):
    """The fastest SDPA backend this GPU accepts for the model's shapes: cuDNN, else flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads = args.hidden // 64
    q = torch.randn(2, heads, args.seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            return backend
        except RuntimeError:
            continue
    raise RuntimeError("neither the cuDNN nor the flash SDPA backend runs on this GPU")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for transformers_train_step.md/.json")
    p.add_argument(
        "--family",
        default="llama",
        help=f"comma-separated families, or all ({', '.join(model_families.FAMILIES)}; default llama)",
    )
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="sequences per global batch")
    p.add_argument("--micro-batches", default="1,4", help="comma-separated micro-batch counts")
    p.add_argument("--warmup-ms", type=float, default=300)
    p.add_argument("--rep-ms", type=float, default=2000)
    args = p.parse_args(argv)
    try:
        names = families(args.family)
    except ValueError as err:
        p.error(str(err))
    if not torch.cuda.is_available():
        print("bench_transformers: needs a CUDA GPU", file=sys.stderr)
        return 1
    import det_attn
    import transformers
    import triton

    det_attn.register_transformers_attention()
    backend = _sdpa_backend(args)
    rows = []
    for family in names:
        for micro in (int(m) for m in args.micro_batches.split(",")):
            times = {}
            for name, det in (("det", True), ("torch", False)):
                step = make_step(args, family, det, micro, backend)
                times[name] = triton.testing.do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms)
                del step
                torch.cuda.empty_cache()
            rows.append(
                {"family": family, "micro_batches": micro, **times, "ratio": times["det"] / times["torch"]}
            )
            print(
                f"{family}, micro-batches {micro}: det {times['det']:.1f} ms, torch {times['torch']:.1f} ms",
                flush=True,
            )
    gpu = torch.cuda.get_device_name()
    versions = (
        f"torch {torch.__version__}; triton {triton.__version__}; transformers {transformers.__version__}"
    )
    env = f"{gpu}; {versions}"
    shape = (
        f"hidden {args.hidden}, {args.layers} layers, {args.hidden // 64} heads of 64, FFN {args.ffn}, "
        f"vocab {args.vocab}, {args.batch} x {args.seq} tokens per step"
    )
    lines = [
        "## transformers train step: det_train.convert + det_attn vs SDPA (" + backend.name + ")",
        "",
        f"{env}. {shape}. Median ms per step (eager), side by side in one process.",
        "",
        "| family | micro-batches | det (ms) | torch (ms) | det / torch |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['family']} | {r['micro_batches']} | {r['det']:.1f} | {r['torch']:.1f} | {r['ratio']:.2f}x |"
        for r in rows
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "transformers_train_step.md").write_text(table)
        payload = {"environment": env, "shape": shape, "sdpa_backend": backend.name, "rows": rows}
        (out / "transformers_train_step.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
