"""Digests of a representative set of kernel results on CPU (Triton interpreter), printed as JSON.

Run by tests/test_host_independence.py in fresh processes whose numpy SIMD dispatch, OpenBLAS
kernel and torch CPU kernels are limited to emulate other x86-64 hosts. Every entry must have the
same bits under every emulation: the interpreter's dot and transcendentals (det_core.interpreter)
are the ones numpy computes differently per CPU.

    python tests/host_probe.py            # {"matmul_fp32": "<sha256>", ...}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
ROOT = Path(__file__).resolve().parents[1]
for src in (
    "shared/det-core",
    "packages/adamw-sr/torch-ext",
    "packages/det-train/torch-ext",
    "packages/det-attn/torch-ext",
    ".",
):
    sys.path.insert(0, str(ROOT / src))

import torch  # noqa: E402
from det_core.testing import digest  # noqa: E402


def _values(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Inputs with the same bits on every host: small integers / 64 (``torch.randn`` draws through
    torch's SIMD or scalar CPU kernels, which differ between hosts with and without AVX2)."""
    return torch.randint(-128, 128, shape, generator=gen).float() / 64


def _matmul(dtype: torch.dtype) -> str:
    import det_train

    gen = torch.Generator().manual_seed(1)
    a = _values(gen, 37, 48).to(dtype)
    b = _values(gen, 48, 40).to(dtype)
    return digest([det_train.matmul(a, b), det_train.matmul(a[17:18], b)])


def _linear_dw_split_inside_a_leaf() -> str:
    import det_train

    gen = torch.Generator().manual_seed(2)
    layer = det_train.Linear(48, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(_values(gen, 40, 48))
        layer.bias.copy_(_values(gen, 40))
    x = _values(gen, 48, 48).to(torch.bfloat16)
    acc = det_train.CanonicalGradAccumulator(layer.named_parameters(), leaf_tokens=32)
    for lo, hi in ((0, 20), (20, 48)):  # the first micro-batch ends inside leaf 0
        with acc.micro_batch(token_offset=lo):
            layer(x[lo:hi]).float().square().sum().backward()
    acc.reduce(total_tokens=48)
    return digest([layer.weight.grad, layer.bias.grad])


def _attention_packed_and_padded() -> str:
    import det_attn

    gen = torch.Generator().manual_seed(3)
    q, k, v = (_values(gen, 2, 24, 2, 64).to(torch.bfloat16).requires_grad_() for _ in range(3))
    o = det_attn.attention(q, k, v, causal=True)
    o.float().square().sum().backward()
    lens = torch.tensor([0, 24, 48], dtype=torch.int32)
    packed = [t.detach().reshape(48, 2, 64) for t in (q, k, v)]
    o_varlen = det_attn.attention_varlen(*packed, lens, lens, 24, 24, causal=True)
    return digest([o, q.grad, k.grad, v.grad, o_varlen])


def _cross_entropy_and_rms_norm() -> str:
    import det_train

    gen = torch.Generator().manual_seed(4)
    logits = _values(gen, 40, 96).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 96, (40,), generator=gen)
    loss = det_train.cross_entropy(logits, targets)
    loss.backward()
    x = _values(gen, 40, 64).to(torch.bfloat16).requires_grad_()
    w = _values(gen, 64).to(torch.bfloat16).requires_grad_()
    det_train.rms_norm(x, w, eps=1e-6).float().square().sum().backward()
    return digest([loss, logits.grad, x.grad, w.grad])


def _main_job_tiny() -> str:
    from examples import train_gpt

    # a global batch of 4 sequences (4 canonical leaves) instead of the preset's 8: every kernel and
    # the reduction tree still run, at half the interpreter's cost
    cfg = train_gpt.make_config("tiny", batch_seqs=4, micro_batch_seqs=4)
    return train_gpt.train(cfg)["digest"]


PROBES = {
    "matmul_fp32": lambda: _matmul(torch.float32),
    "matmul_bf16": lambda: _matmul(torch.bfloat16),
    "linear_dw_split_inside_a_leaf": _linear_dw_split_inside_a_leaf,
    "attention_packed_and_padded": _attention_packed_and_padded,
    "cross_entropy_and_rms_norm": _cross_entropy_and_rms_norm,
    "main_job_tiny": _main_job_tiny,
}


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps({name: probe() for name, probe in PROBES.items()}))
