"""Argument checks of ``attention`` and ``attention_varlen``: each returns the checked values or
raises a ``TypeError`` / ``ValueError`` that says what was wrong and what to pass instead, before
anything is allocated or launched. They read tensor attributes only, except the ``cu_seqlens``
checks, which read the values on the host: under torch.compile ``attention_varlen`` runs those
(``check_packed_values``) inside its operator, the others (``check_packed_traced``) at trace time.
"""

from __future__ import annotations

import math
import numbers

import torch
from det_core import rng, runtime

SUPPORTED_HEAD_DIMS = (64, 128)
# Dropout packs query and key positions into 22 bits each of the Philox index (see _tiles).
MAX_SEQLEN = 1 << 22
MAX_HEADS = 1 << 19  # head (plus head_offset) gets the remaining 19 bits
MAX_GRID_YZ = 65535  # CUDA grid limit for the sequence and head axes
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# appended to the errors a layout mix-up can cause: (B, H, T, D) read as (B, T, H, D) takes T for H
LAYOUT_HINT = (
    "; q, k, v are read as (B, T, H, D): torch SDPA's (B, H, T, D) tensors need .transpose(1, 2) "
    "(or det_attn.scaled_dot_product_attention)"
)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: int, op: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            layout = "(B, T, H, D)" if dims == 4 else "(total_tokens, H, D)"
            raise ValueError(f"{op}: {name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        autocast = (  # torch SDPA is cast by autocast; a custom op is not
            "; torch.autocast does not cast det_attn's inputs: cast q, k, v to torch.bfloat16 yourself"
            if q.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(q.device.type)
            else ""
        )
        raise TypeError(
            f"{op}: q has dtype {q.dtype}; supported are torch.bfloat16 and torch.float16{autocast}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    runtime.check_kernel_device(q, k, v, op=op)
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{op}: head dim {head_dim} is not supported; supported head dims are {SUPPORTED_HEAD_DIMS} "
            "(256 is not implemented: pad or split the heads)"
        )
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(
            f"{op}: q, k, v must share the head dim, got {head_dim}, {k.shape[-1]}, {v.shape[-1]}"
        )
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    h_q, h_kv = q.shape[-2], k.shape[-2]
    if h_q == 0 or h_kv == 0 or h_q % h_kv:
        hint = LAYOUT_HINT if dims == 4 else ""
        raise ValueError(
            f"{op}: query heads ({h_q}) must be a positive multiple of key/value heads ({h_kv}) "
            f"(GQA/MQA){hint}"
        )
    if h_q > MAX_GRID_YZ:
        raise ValueError(f"{op}: at most {MAX_GRID_YZ} query heads are supported, got {h_q}")


def check_padded(q, k, v, causal, softmax_scale, dropout_p, seed, sequence_offset, head_offset, op) -> tuple:
    """Every check of ``attention``, in order; returns ``(scale, dropout_p, seed, sequence_offset,
    head_offset)``."""
    check_qkv(q, k, v, 4, op)
    batch, t_q, heads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"{op}: q and k must share the batch size, got {batch} and {k.shape[0]}")
    t_k = k.shape[1]
    if batch == 0 or t_q == 0 or t_k == 0:
        raise ValueError(f"{op}: empty input (B={batch}, T_q={t_q}, T_k={t_k}); every size must be >= 1")
    if max(t_q, t_k) > MAX_SEQLEN:
        raise ValueError(f"{op}: sequence length {max(t_q, t_k)} exceeds the supported {MAX_SEQLEN}")
    if batch > MAX_GRID_YZ:
        raise ValueError(f"{op}: batch {batch} exceeds {MAX_GRID_YZ}; split it into several calls")
    check_causal(causal, op)
    if causal and t_k < t_q:
        raise ValueError(
            f"{op}: causal attention needs T_k >= T_q (bottom-right alignment), got {t_k} < {t_q}"
            f"{LAYOUT_HINT}"
        )
    dropout_p, seed, sequence_offset, head_offset = check_dropout(
        dropout_p, seed, sequence_offset, head_offset, heads, batch, op
    )
    return as_scale(softmax_scale, head_dim, op), dropout_p, seed, sequence_offset, head_offset


def check_packed_qkv(q, k, v, op: str) -> None:
    """``attention_varlen``'s checks of q, k, v alone (the first ones it makes)."""
    check_qkv(q, k, v, 3, op)
    total_q, total_k = q.shape[0], k.shape[0]
    if total_q == 0 or total_k == 0:
        raise ValueError(f"{op}: empty input (total_q={total_q}, total_k={total_k}); need at least one token")


def check_packed(
    q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout_p, seed,
    sequence_offset, head_offset, op,
) -> tuple:  # fmt: skip
    """``attention_varlen``'s checks after those of q, k, v (``check_packed_qkv``), in order; returns
    ``(batch, max_seqlen_q, max_seqlen_k, scale, dropout_p, seed, sequence_offset, head_offset)``."""
    total_q, heads, head_dim = q.shape
    total_k = k.shape[0]
    check_cu_seqlens_meta(cu_seqlens_q, q.device, "cu_seqlens_q", op)
    len_q = cu_seqlens_lengths(cu_seqlens_q, total_q, "cu_seqlens_q", op)
    check_cu_seqlens_meta(cu_seqlens_k, q.device, "cu_seqlens_k", op)
    len_k = cu_seqlens_lengths(cu_seqlens_k, total_k, "cu_seqlens_k", op)
    batch = check_sequence_count(cu_seqlens_q, cu_seqlens_k, op)
    max_seqlen_q = as_max_seqlen(max_seqlen_q, "max_seqlen_q", len_q, op)
    max_seqlen_k = as_max_seqlen(max_seqlen_k, "max_seqlen_k", len_k, op)
    check_keys_present(len_q, len_k, op)
    check_causal(causal, op)
    if causal:
        check_causal_lengths(len_q, len_k, op)
    dropout_p, seed, sequence_offset, head_offset = check_dropout(
        dropout_p, seed, sequence_offset, head_offset, heads, batch, op
    )
    scale = as_scale(softmax_scale, head_dim, op)
    return batch, max_seqlen_q, max_seqlen_k, scale, dropout_p, seed, sequence_offset, head_offset


def check_packed_traced(
    q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, dropout_p, seed,
    sequence_offset, head_offset, op,
) -> tuple:  # fmt: skip
    """The checks of ``check_packed`` that read no tensor values, for torch.compile's trace (fake
    tensors: shapes, dtypes, devices); the rest, ``check_packed_values``, runs inside the operator.
    Takes and returns what ``check_packed`` does."""
    heads, head_dim = q.shape[1:]
    check_cu_seqlens_meta(cu_seqlens_q, q.device, "cu_seqlens_q", op)
    check_cu_seqlens_meta(cu_seqlens_k, q.device, "cu_seqlens_k", op)
    batch = check_sequence_count(cu_seqlens_q, cu_seqlens_k, op)
    max_seqlen_q = as_max_seqlen(max_seqlen_q, "max_seqlen_q", None, op)
    max_seqlen_k = as_max_seqlen(max_seqlen_k, "max_seqlen_k", None, op)
    check_causal(causal, op)
    dropout_p, seed, sequence_offset, head_offset = check_dropout(
        dropout_p, seed, sequence_offset, head_offset, heads, batch, op
    )
    scale = as_scale(softmax_scale, head_dim, op)
    return batch, max_seqlen_q, max_seqlen_k, scale, dropout_p, seed, sequence_offset, head_offset


def check_packed_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, causal, op):
    """The checks of ``check_packed`` that read the ``cu_seqlens`` values (on the host), for an
    operator call whose arguments passed ``check_packed_traced``."""
    len_q = cu_seqlens_lengths(cu_seqlens_q, total_q, "cu_seqlens_q", op)
    len_k = cu_seqlens_lengths(cu_seqlens_k, total_k, "cu_seqlens_k", op)
    as_max_seqlen(max_seqlen_q, "max_seqlen_q", len_q, op)
    as_max_seqlen(max_seqlen_k, "max_seqlen_k", len_k, op)
    check_keys_present(len_q, len_k, op)
    if causal:
        check_causal_lengths(len_q, len_k, op)


def check_sequence_count(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, op: str) -> int:
    """The number of sequences that two valid ``cu_seqlens`` describe (from their shapes)."""
    n_q, n_k = cu_seqlens_q.shape[0] - 1, cu_seqlens_k.shape[0] - 1
    if n_q != n_k:
        raise ValueError(
            f"{op}: cu_seqlens_q and cu_seqlens_k describe {n_q} and {n_k} sequences; they must match"
        )
    if n_q > MAX_GRID_YZ:
        raise ValueError(f"{op}: {n_q} sequences exceed {MAX_GRID_YZ}; split into several calls")
    return n_q


def check_keys_present(len_q: torch.Tensor, len_k: torch.Tensor, op: str) -> None:
    """Every sequence with queries has keys (host sequence lengths)."""
    if bool(((len_q > 0) & (len_k == 0)).any()):
        raise ValueError(f"{op}: a sequence has queries but no keys (its attention is undefined)")


def check_causal_lengths(len_q: torch.Tensor, len_k: torch.Tensor, op: str) -> None:
    """Every key length is at least its query length (causal, bottom-right; host sequence lengths)."""
    if bool((len_k < len_q).any()):
        raise ValueError(f"{op}: causal attention needs every key length >= its query length (bottom-right)")


def check_dropout(
    dropout_p: float,
    seed: int | None,
    sequence_offset: int,
    head_offset: int,
    heads: int,
    batch: int,
    op: str,
) -> tuple[float, int | None, int, int]:
    """Validate the dropout arguments; returns them as (float, int or None, int, int). Plain values
    in range (a float ``dropout_p``, int offsets, no seed without dropout or an int seed with it:
    every call of a training loop) are returned after comparisons alone; anything else goes through
    the conversions and their errors."""
    if (
        type(dropout_p) is float
        and type(sequence_offset) is int
        and type(head_offset) is int
        and 0.0 <= dropout_p < 1.0
        and 0 <= sequence_offset
        and sequence_offset + batch <= 2**32
        and 0 <= head_offset
        and head_offset + heads <= MAX_HEADS
        and (seed is None if dropout_p == 0.0 else type(seed) is int and 0 <= seed < 2**64)
    ):
        return dropout_p, seed, sequence_offset, head_offset
    dropout_p = as_dropout_p(dropout_p, "dropout_p", op)
    if seed is not None:
        seed = as_seed(seed, "seed", op)
    elif dropout_p > 0.0:
        raise ValueError(f"{op}: dropout_p > 0 needs an explicit integer seed (there is no global generator)")
    sequence_offset = runtime.as_index(
        sequence_offset, "sequence_offset", op, "; pass the global index of the batch's first sequence"
    )
    head_offset = runtime.as_index(
        head_offset, "head_offset", op, "; pass the global index of the first query head"
    )
    if not 0 <= sequence_offset or sequence_offset + batch > 2**32:
        raise ValueError(
            f"{op}: sequence_offset + sequences must be in [0, 2**32], got {sequence_offset} + {batch}"
        )
    if not 0 <= head_offset or head_offset + heads > MAX_HEADS:
        raise ValueError(
            f"{op}: head_offset + heads must be in [0, {MAX_HEADS}], got {head_offset} + {heads}"
        )
    return dropout_p, seed, sequence_offset, head_offset


def as_dropout_p(value, name: str, op: str) -> float:
    """``value`` as a float in ``[0, 1)``: any real number (int, float, numpy scalar), never a bool,
    str or tensor."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{op}: {name} must be a real number in [0, 1), got {type(value).__name__} {value!r}; "
            "pass a Python float such as 0.1"
        )
    p = float(value)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")
    return p


def as_max_seqlen(value, name: str, lengths: torch.Tensor | None, op: str) -> int:
    """``value`` as an int, at least the longest of ``lengths`` (host sequence lengths; None: not
    checked here) and at most ``MAX_SEQLEN``."""
    given = runtime.as_index(value, name, op, "; pass the longest sequence length, e.g. int(seqlens.max())")
    if lengths is not None:
        longest = int(lengths.max())
        if given < longest:
            raise ValueError(f"{op}: {name}={given} is below the longest sequence ({longest})")
    if given > MAX_SEQLEN:
        raise ValueError(f"{op}: {name}={given} exceeds the supported {MAX_SEQLEN}")
    return given


def as_seed(value, name: str, op: str) -> int:
    return rng.as_seed(value, op, name, "; pass an int such as 0, a new one per training step")


def check_cu_seqlens_meta(cu: torch.Tensor, device: torch.device, name: str, op: str) -> None:
    """A ``cu_seqlens``'s type, dtype, rank and device (no values read)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{op}: {name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{op}: {name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{op}: {name} is on {cu.device} but q is on {device}")


def cu_seqlens_lengths(cu: torch.Tensor, total: int, name: str, op: str) -> torch.Tensor:
    """The sequence lengths ``cu[1:] - cu[:-1]`` (on the host) of a ``cu_seqlens`` that passed
    ``check_cu_seqlens_meta``, after checking its values: from 0 to ``total``, non-decreasing."""
    host = cu.cpu()  # one small device-to-host copy: the checks below need the values
    if int(host[0]) != 0 or int(host[-1]) != total:
        raise ValueError(
            f"{op}: {name} must start at 0 and end at the token count {total}, "
            f"got {int(host[0])} ... {int(host[-1])}"
        )
    lengths = host[1:] - host[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"{op}: {name} must be non-decreasing (monotone), got {host.tolist()}")
    return lengths


# softmax_scale and softcap reach the kernels as fp32 (times log2(e) for the scale): outside the
# normal fp32 range Triton types a Python float fp64 (a dtype error) or the product overflows to inf
_FP32_RANGE = (2.0**-126, 2.0**127)


def _in_fp32_range(value: float, name: str, op: str, hint: str) -> None:
    low, high = _FP32_RANGE
    if not low <= value <= high:
        raise ValueError(
            f"{op}: {name} must lie in [2**-126, 2**127] (the kernels take it as a normal fp32), got {value}"
            f"{hint}"
        )


def as_scale(softmax_scale: float | None, head_dim: int, op: str) -> float:
    """``softmax_scale`` as a float: None gives ``1 / sqrt(head_dim)``; else a real number (int,
    float, numpy scalar; not a bool, str or tensor), finite and positive, in ``[2**-126, 2**127]``."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"{op}: softmax_scale must be a real number or None, got {type(softmax_scale).__name__} "
            f"{softmax_scale!r}; pass a Python float such as 0.125"
        )
    try:
        scale = float(softmax_scale)
    except OverflowError:  # an int beyond the float range
        scale = math.inf
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"{op}: softmax_scale must be a finite positive number, got {softmax_scale}")
    _in_fp32_range(scale, "softmax_scale", op, "; the usual value is 1 / sqrt(head_dim)")
    return scale


def check_causal(causal, op: str) -> None:
    """``causal`` must be a Python bool: a string, number or tensor is a mistake, never a flag."""
    if not isinstance(causal, bool):
        raise TypeError(
            f"{op}: causal must be a bool, got {type(causal).__name__} {causal!r}; pass True or False"
        )


def check_window_softcap(window, softcap, causal: bool, op: str) -> tuple[int, float]:
    """``window`` and ``softcap`` as the kernels take them: ``(window, softcap)`` with 0 and 0.0 for
    none. ``window``: None or an integer >= 1 (int or numpy integer; not a bool or float), causal
    attention only; one above ``MAX_SEQLEN`` masks nothing that ``MAX_SEQLEN`` does not (no key is
    that far back), so it is taken as ``MAX_SEQLEN``. ``softcap``: None or a finite positive real
    number in ``[2**-126, 2**127]`` (not a bool, str or tensor)."""
    if window is not None:
        window = runtime.as_index(window, "window", op, "; pass the number of keys a query sees, e.g. 4096")
        if window < 1:
            raise ValueError(
                f"{op}: window must be >= 1 (query i sees keys i - window < j <= i), got {window}; "
                "pass None for no window"
            )
        if not causal:
            raise ValueError(
                f"{op}: window needs causal=True (a sliding window over the past keys; a window over "
                "future keys is not implemented)"
            )
        window = min(window, MAX_SEQLEN)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(
                f"{op}: softcap must be a real number or None, got {type(softcap).__name__} {softcap!r}; "
                "pass a Python float such as 50.0"
            )
        try:
            cap = float(softcap)
        except OverflowError:
            cap = math.inf
        if not math.isfinite(cap) or cap <= 0.0:
            raise ValueError(
                f"{op}: softcap must be a finite positive number (None: no soft-capping), got {softcap}"
            )
        _in_fp32_range(cap, "softcap", op, " (None: no soft-capping)")
        softcap = cap
    return window or 0, softcap or 0.0
