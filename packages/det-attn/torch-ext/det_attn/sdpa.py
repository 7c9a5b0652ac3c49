"""``scaled_dot_product_attention`` with torch's argument names, backed by ``det_attn.attention``."""

from __future__ import annotations

import torch

from ._checks import as_dropout_p, as_seed
from .flash_attention import attention

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    seed: int | None = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on the deterministic kernels.

    Args:
        query: ``(B, H_q, L, E)`` bf16 or fp16 (torch's layout; transposed views are fine).
        key: ``(B, H_kv, S, E)``.
        value: ``(B, H_kv, S, E)``.
        attn_mask: must be ``None``: arbitrary masks are not supported (use ``is_causal`` or
            ``det_attn.attention_varlen`` for padding/packing).
        dropout_p: dropout probability, a real number in ``[0, 1)``; needs ``seed``.
        is_causal: causal mask; torch aligns it top-left, so ``L == S`` is required here.
        scale: softmax scale, default ``1 / sqrt(E)``.
        enable_gqa: must be ``True`` when ``H_q != H_kv`` (as in torch).
        seed: Philox seed for dropout, an integer in ``[0, 2**64)`` (keyword only; torch's global
            generator is never used).

    Returns:
        ``(B, H_q, L, E)``, a transposed view of ``attention``'s ``(B, L, H_q, E)`` output.

    Raises:
        TypeError: a non-tensor input, ``is_causal`` not a bool, a ``dropout_p`` that is not a real
            number, a ``seed`` that is not an integer, or what ``det_attn.attention`` rejects by
            type (dtypes).
        ValueError: ``attn_mask`` given, an input not 4-D, ``H_q`` not a multiple of ``H_kv``,
            ``H_q != H_kv`` without ``enable_gqa``, ``is_causal`` with ``L != S``, ``dropout_p``
            outside ``[0, 1)``, ``dropout_p > 0`` without a ``seed``, a ``seed`` outside
            ``[0, 2**64)``, or what
            ``det_attn.attention`` rejects by value (those messages name ``det_attn.attention``
            and its arguments: ``q``, ``softmax_scale``).

    **Determinism:** as ``det_attn.attention`` (run to run, batch invariant, no atomics; the same
    bits under ``torch.compile``, which traces it with no graph break).

    Method: FlashAttention-2 (Dao, 2023); see ``det_attn.attention``.
    """
    op = "det_attn.scaled_dot_product_attention"
    if attn_mask is not None:
        raise ValueError(
            f"{op}: attn_mask is not supported; use is_causal=True, or det_attn.attention_varlen "
            "for padded/packed sequences"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):  # as det_attn.attention: a TypeError
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D (B, H, T, E) tensor, got shape {tuple(t.shape)}")
    if not isinstance(is_causal, bool):  # checked here so that the message names this argument
        raise TypeError(f"{op}: is_causal must be a bool, got {type(is_causal).__name__} {is_causal!r}")
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:  # (B, H, T, E): not a layout mix-up
        raise ValueError(
            f"{op}: query's {query.shape[1]} heads must be a multiple of key's {key.shape[1]} (GQA: each key "
            "head serves H_q / H_kv query heads)"
        )
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"{op}: query has {query.shape[1]} heads and key {key.shape[1]}; pass enable_gqa=True for GQA/MQA"
        )
    if is_causal and query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{op}: is_causal with L={query.shape[2]} != S={key.shape[2]} is aligned top-left in torch but "
            "bottom-right here; call det_attn.attention(causal=True) if bottom-right is what you want"
        )
    # checked here, as the transformers function does, so the messages name this function
    dropout_p = as_dropout_p(dropout_p, "dropout_p", op)
    if seed is not None:
        seed = as_seed(seed, "seed", op)
    elif dropout_p > 0.0:
        raise ValueError(
            f"{op}: dropout_p > 0 needs an explicit integer seed, the keyword seed= (there is no global "
            "generator)"
        )
    out = attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=is_causal,
        softmax_scale=scale,
        dropout_p=dropout_p,
        seed=seed,
    )
    return out.transpose(1, 2)
