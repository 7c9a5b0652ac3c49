"""A small GPT (pre-norm decoder: RMSNorm, causal attention, SwiGLU MLP) built from our kernels.

``GPT(config, kernels="det")`` is the deterministic model of the main job: every op that reduces
(matmuls and their gradients, RMSNorm, embedding backward, attention, cross-entropy) is a
det-train / det-attn kernel, and so is SwiGLU's gate (``det_train.swiglu``: elementwise, but as
our op it keeps its bits under ``torch.compile``, where torch's SiLU would become Inductor's
code); what remains in plain torch is the residual adds (one bf16 add each, the same under
Inductor) and reshapes.

``GPT(config, kernels="torch")`` is the **reference** model, clearly not deterministic: the same
architecture and initialisation from torch's fastest parts (``nn.Linear``/cuBLAS, SDPA,
``nn.RMSNorm``, ``nn.Embedding``, ``F.cross_entropy``). The benchmark and ``--reference`` use it
for comparison; it is never a fallback of the deterministic model.

Weights live in bf16 only (no fp32 master copy): the optimizer (adamw_sr.AdamWSR) updates them
with stochastic rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``d_model`` must be a multiple of ``n_head``."""

    vocab_size: int = 256  # byte-level tokens
    seq_len: int = 64  # context length T (learned position embedding)
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_ff: int = 192  # SwiGLU hidden width
    norm_eps: float = 1e-5


def _swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _Ops:
    """The layer factories and functional ops of one backend (``det`` or ``torch``)."""

    def __init__(self, kernels: str) -> None:
        if kernels == "det":
            import det_attn
            import det_train

            self.Linear = lambda i, o: det_train.Linear(i, o, bias=False)
            self.RMSNorm = lambda d, eps: det_train.RMSNorm(d, eps=eps)
            self.Embedding = det_train.Embedding
            self.attention = lambda q, k, v: det_attn.attention(q, k, v, causal=True)
            self.cross_entropy = lambda logits, y, n: det_train.cross_entropy(logits, y, num_global_tokens=n)
            self.swiglu = det_train.swiglu
        elif kernels == "torch":
            self.Linear = lambda i, o: nn.Linear(i, o, bias=False)
            self.RMSNorm = lambda d, eps: nn.RMSNorm(d, eps=eps)
            self.Embedding = nn.Embedding
            # SDPA wants (B, H, T, D); our layout is (B, T, H, D) like det_attn
            self.attention = lambda q, k, v: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)
            self.cross_entropy = lambda logits, y, n: F.cross_entropy(logits.float(), y, reduction="sum") / n
            self.swiglu = _swiglu_torch
        else:
            raise ValueError(
                f"kernels must be 'det' (our deterministic kernels) or 'torch' (reference), got {kernels!r}"
            )


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + swiglu(norm(x))."""

    def __init__(self, cfg: GPTConfig, ops: _Ops) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_norm = ops.RMSNorm(cfg.d_model, cfg.norm_eps)
        self.qkv = ops.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_out = ops.Linear(cfg.d_model, cfg.d_model)
        self.mlp_norm = ops.RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate_up = ops.Linear(cfg.d_model, 2 * cfg.d_ff)
        self.down = ops.Linear(cfg.d_ff, cfg.d_model)
        self.attention = ops.attention
        self.swiglu = ops.swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
        x = x + self.attn_out(self.attention(q, k, v).reshape(B, T, C))
        return x + self.down(self.swiglu(self.gate_up(self.mlp_norm(x))))


class GPT(nn.Module):
    """Byte-level GPT. ``forward(idx (B, T) int64, targets (B, T) int64 | None, num_global_tokens)``.

    Returns ``logits`` (B, T, vocab) in the weight dtype, and the loss when ``targets`` is given:
    the sum of this call's token losses divided by ``num_global_tokens`` (the tokens of the whole
    global batch), so micro-batch losses add up to the global mean and gradients need no rescaling.
    """

    def __init__(self, cfg: GPTConfig, kernels: str = "det") -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of n_head {cfg.n_head}")
        self.cfg = cfg
        self.kernels = kernels
        ops = _Ops(kernels)
        self._cross_entropy = ops.cross_entropy
        self.tok_emb = ops.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = ops.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, ops) for _ in range(cfg.n_layer))
        self.final_norm = ops.RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = ops.Linear(cfg.d_model, cfg.vocab_size)  # untied: one gradient source per weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 style init from a CPU generator seeded by ``seed`` (same bits on every device)."""
        gen = torch.Generator().manual_seed(seed)
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                value = torch.ones(p.shape)
            else:
                std = out_std if name.endswith(("attn_out.weight", "down.weight")) else 0.02
                value = torch.randn(p.shape, generator=gen) * std
            p.copy_(value.to(p.dtype))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, num_global_tokens: int | None = None
    ):
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device).expand(B, T)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits
        n = B * T if num_global_tokens is None else num_global_tokens
        return logits, self._cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), n)

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, seed: int = 0
    ) -> torch.Tensor:
        """Sample ``new_tokens`` tokens after ``idx`` (B, T0). Sampling uses a seeded CPU generator."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.seq_len :])[:, -1, :].float().cpu()
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
