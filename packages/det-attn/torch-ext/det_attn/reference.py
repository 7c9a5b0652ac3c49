"""Plain-torch reference attention (fp32 or fp64): dense, causal, sliding window, logit soft-cap,
GQA, varlen, Philox dropout.

Slow and simple on purpose: tests and benchmarks compare the kernels against it. The dropout
mask is drawn with det-core's torch Philox reference under the same key as the kernels.
"""

from __future__ import annotations

import math

import torch
from det_core import rng, runtime

from ._checks import MAX_HEADS, MAX_SEQLEN

__all__ = ["attention_reference", "attention_varlen_reference", "dropout_keep_mask"]


def dropout_keep_mask(
    seed: int,
    sequence: int,
    head: int,
    t_q: int,
    t_k: int,
    dropout_p: float,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean ``(t_q, t_k)`` keep mask of one (sequence, head), exactly as the kernels draw it.

    Philox key ``seed``, step word ``sequence``, stream ``rng.STREAM_ATTN_DROPOUT``, index
    ``head << 44 | query << 22 | key``; keep iff the 32 bits are ``>= round(dropout_p * 2**32)``.

    Raises:
        ValueError: ``dropout_p`` outside ``[0, 1)``, ``t_q`` or ``t_k`` outside ``[0, 2**22]``,
            ``head`` outside ``[0, 2**19)`` (the fields of the index, as the kernels bound them), a
            seed or sequence outside the contract's word sizes (from det-core).
        TypeError: ``head``, ``t_q`` or ``t_k`` not an integer.

    **Determinism:** a pure function of its arguments (counter-based RNG, no global state).
    Method: Philox4x32-10 (Salmon et al., SC'11) through det-core's torch reference.
    """
    op = "det_attn.reference.dropout_keep_mask"
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p}")
    for name, value, high in (
        ("t_q", t_q, MAX_SEQLEN + 1),
        ("t_k", t_k, MAX_SEQLEN + 1),
        ("head", head, MAX_HEADS),
    ):
        value = runtime.as_index(value, name, op)
        if not 0 <= value < high:  # a wider value would spill into the next field of the index
            raise ValueError(f"{op}: {name} must be in [0, {high}), got {value}")
    threshold = min(int(round(dropout_p * 2**32)), 2**32 - 1)
    qi = torch.arange(t_q, dtype=torch.int64, device=device)[:, None]
    ki = torch.arange(t_k, dtype=torch.int64, device=device)[None, :]
    index = (int(head) << 44) + (qi << 22) + ki
    bits = rng.random_bits_torch(seed, sequence, rng.STREAM_ATTN_DROPOUT, index)
    return bits >= threshold


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    sequence_offset: int = 0,
    head_offset: int = 0,
    window: int | None = None,
    softcap: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``det_attn.attention`` on ``(B, T, H, D)`` inputs, computed in ``dtype``.

    Returns ``(o, lse)``: ``o`` ``(B, T_q, H_q, D)`` in ``dtype`` and the natural LSE
    ``(B, H_q, T_q)``. Differentiable (autograd through plain torch ops). Causal masks are
    bottom-right aligned like the kernels; ``window`` keeps key ``j`` for query ``i`` iff
    ``i + T_k - T_q - window < j`` (with ``causal``: transformers' ``sliding_window``);
    ``softcap`` maps the scaled scores ``x`` to ``softcap * tanh(x / softcap)`` before the mask
    (transformers' Gemma 2 order); dropout uses ``dropout_keep_mask`` (needs ``seed``).

    **Determinism:** plain torch on CPU in fp64 is deterministic; on CUDA it follows torch's
    matmul (not guaranteed bitwise). It is an accuracy reference, not a bitwise one.
    Method: the textbook softmax attention (Vaswani et al., 2017), materialising the scores.
    """
    batch, t_q, heads, head_dim = q.shape
    t_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    qf = q.to(dtype).transpose(1, 2)  # (B, H, T, D)
    kf = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(t_k - t_q)
    if window is not None:
        visible = visible & ~torch.ones_like(visible).tril(t_k - t_q - window)
    if causal or window is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None])
    if dropout_p > 0.0:
        keep = torch.stack(
            [
                torch.stack(
                    [
                        dropout_keep_mask(
                            seed, sequence_offset + b, head_offset + h, t_q, t_k, dropout_p, q.device
                        )
                        for h in range(heads)
                    ]
                )
                for b in range(batch)
            ]
        )
        p = torch.where(keep, p / (1.0 - dropout_p), torch.zeros_like(p))
    o = (p @ vf).transpose(1, 2)
    return o, lse


def attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``det_attn.attention_varlen``: ``(o (total_q, H, D), lse (H, total_q))``.

    Runs ``attention_reference`` per sequence (sequence index ``sequence_offset + b``); takes
    ``(total, H, D)`` tensors and int32 ``cu_seqlens`` plus ``attention_reference``'s keywords.

    **Determinism:** as ``attention_reference``. Method: as ``attention_reference``.
    """
    sequence_offset = kwargs.pop("sequence_offset", 0)
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]]
        vs = v[ck[b] : ck[b + 1]]
        o, lse = attention_reference(
            qs[None], ks[None], vs[None], sequence_offset=sequence_offset + b, **kwargs
        )
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)
