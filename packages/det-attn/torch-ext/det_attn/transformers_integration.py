"""Register det_attn as a transformers attention implementation: ``attn_implementation="det_attn"``.

transformers is optional: nothing here imports it until ``register_transformers_attention`` is
called (``import det_attn`` calls it only when transformers is already imported).
"""

from __future__ import annotations

import importlib

import torch

from ._checks import as_dropout_p, as_seed
from .flash_attention import SUPPORTED_HEAD_DIMS, attention, attention_varlen  # noqa: F401  (convert reads it)

__all__ = ["det_attn_transformers_forward", "register_transformers_attention"]


def det_attn_transformers_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (the ``AttentionInterface`` signature) on det_attn kernels.

    Layout: transformers passes torch SDPA's ``(B, H, T, D)``; this function hands
    ``det_attn.attention`` (whose layout is ``(B, T, H, D)``) the ``transpose(1, 2)`` views and
    returns ``(B, T, H, D)``, as transformers' attention functions do.

    Args:
        module: the calling attention module (its ``is_causal`` is read, default True).
        query: ``(B, H_q, T_q, D)``; key, value: ``(B, H_kv, T_k, D)`` (GQA handled natively).
        attention_mask: must be ``None`` (no padding); pack sequences instead (transformers'
            ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments, with ``B == 1``; or rows
            whose ``position_ids`` restart at each document, ``DataCollatorWithFlattening``'s one
            row or several such rows).
        scaling: softmax scale (default ``1 / sqrt(D)``); the module passes its own (Gemma's
            ``query_pre_attn_scalar ** -0.5``), given to ``det_attn.attention`` as
            ``softmax_scale``.
        dropout: attention-dropout probability (transformers' attention modules pass their
            attention-dropout probability in training mode, 0.0 in eval mode); above 0 it needs
            ``det_attn_seed``.
        **kwargs: what the model call passes through (transformers forwards a model's extra
            keyword arguments to every attention layer). Read here: ``det_attn_seed``, the
            Philox seed of attention dropout, an integer in ``[0, 2**64)`` (int or numpy
            integer; not a bool, float or str), given with the model call,
            ``model(input_ids, ..., det_attn_seed=step_seed)``: required when ``dropout > 0``,
            checked whenever given, used only with dropout; use a new seed per training step.
            Every layer receives the same seed and the call's sequences are numbered from 0
            (``sequence_offset=0``, ``head_offset=0``), so every layer of one call draws the same
            mask, and a sequence's mask depends on its index in the micro-batch (not global: the
            masks are not micro-batch or data-parallel invariant; call ``det_attn.attention``
            with ``sequence_offset`` where that matters). Also read: ``is_causal``,
            ``cu_seq_lens_q/k``, ``max_length_q/k``, ``sliding_window`` (the layer's window, None
            for a full-attention layer: passed as det_attn's ``window``, which means what
            transformers' sliding-window mask means, key ``j`` visible to query ``i`` iff
            ``i - sliding_window < j <= i``; causal layers only) and ``softcap`` (Gemma 2's
            ``attn_logit_softcapping``: passed as det_attn's ``softcap``, applied after the scale,
            in the order of transformers' eager attention), and ``position_ids`` (packed rows'
            documents when no ``cu_seq_lens_q/k`` are given, any batch size:
            ``_documents_from_position_ids``; under ``torch.compile`` a packed row raises).

    Returns:
        ``(attn_output (B, T_q, H_q, D), None)``: no attention weights.

    Raises:
        TypeError: ``dropout`` not a real number, ``det_attn_seed`` not an integer (a bool, float
            or str), or anything ``det_attn.attention`` rejects as a type.
        RuntimeError: under ``torch.compile``, ``position_ids`` that restart inside a row (a
            device-side assertion: pass ``cu_seq_lens_q/k``).
        ValueError: a query, key or value that is not 4-D (transformers' ``(B, H, T, D)``), a
            padding mask, ``cu_seq_lens_q`` without ``cu_seq_lens_k`` or the reverse, a sliding
            window on a non-causal layer (a bidirectional window, as Gemma 3's
            ``use_bidirectional_attention``: not implemented), dropout outside
            ``[0, 1)`` or without a seed, a seed outside ``[0, 2**64)``, or anything
            ``det_attn.attention`` rejects.

    **Determinism:** as ``det_attn.attention`` / ``attention_varlen``; causal masks are
    bottom-right aligned, which is what KV-cache decoding needs. ``torch.compile`` traces it with no
    graph break (eager's bits) when ``attention_mask`` is None and packed calls give
    ``max_length_q/k`` as ints (a mask or a missing max length is read from tensor values).
    Method: FlashAttention-2 (Dao, 2023).
    """
    op = "det_attn (transformers)"
    if attention_mask is not None:
        if attention_mask.dim() == 2 and bool(attention_mask.all()):
            attention_mask = None  # an all-ones padding mask is no mask
        else:
            raise ValueError(
                f"{op}: attention masks (padding) are not supported; pack the sequences into one row "
                "instead (DataCollatorWithFlattening: position_ids restarting at each document, or "
                "return_flash_attn_kwargs=True for cu_seq_lens); padded batches need a non-deterministic "
                "attention such as attn_implementation='sdpa', which det_train.convert refuses"
            )
    dropout = as_dropout_p(dropout, "dropout", op)
    seed = kwargs.get("det_attn_seed")
    if seed is not None:
        seed = as_seed(seed, "det_attn_seed", op)
    elif dropout > 0.0:
        raise ValueError(
            f"{op}: attention dropout needs a seed: pass det_attn_seed=<int> through the model call"
        )
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(
                f"{op}: {name} must be 4-D, transformers' (B, H, T, D) layout; got shape {tuple(t.shape)}"
            )
    # transformers' (B, H, T, D) -> det_attn.attention's (B, T, H, D): views, no copy
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    window = kwargs.get("sliding_window")
    if window is not None and not causal:
        raise ValueError(
            f"{op}: a sliding window on a non-causal layer (bidirectional window, sliding_window={window}) "
            "is not supported; use causal layers (e.g. Gemma 3 with use_bidirectional_attention=False) "
            "or a non-deterministic attention such as attn_implementation='sdpa', which "
            "det_train.convert refuses"
        )
    common = dict(
        causal=causal,
        softmax_scale=scaling,
        dropout_p=dropout,
        seed=seed,
        window=window,
        softcap=kwargs.get("softcap"),
    )
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if (cu_q is None) != (cu_k is None):  # one half of the pair: its documents would be ignored
        given, missing = (
            ("cu_seq_lens_q", "cu_seq_lens_k") if cu_k is None else ("cu_seq_lens_k", "cu_seq_lens_q")
        )
        raise ValueError(
            f"{op}: {given} given without {missing}: packed sequences need both (the same tensor for "
            "self-attention), as transformers' flash-attention kwargs carry them"
        )
    if cu_q is None and cu_k is None:
        position_ids = kwargs.get("position_ids")
        documents = _documents_from_position_ids(position_ids, q.shape[0], q.shape[1], k.shape[1])
        if documents is not None:
            # every row's documents, the rows one after another: (B * T, H, D), one varlen call
            cu, longest = documents
            b, t = q.shape[:2]
            q, k, v = (x.reshape(b * t, *x.shape[2:]) for x in (q, k, v))
            out = attention_varlen(q, k, v, cu, cu, longest, longest, **common)
            return out.view(b, t, *out.shape[1:]), None
    if cu_q is not None and cu_k is not None:
        if q.shape[0] != 1:
            raise ValueError(f"{op}: packed sequences (cu_seq_lens_q/k) need batch size 1, got {q.shape[0]}")
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        out = attention_varlen(q[0], k[0], v[0], cu_q.int(), cu_k.int(), max_q, max_k, **common)[None]
    else:
        out = attention(q, k, v, **common)
    return out, None  # (B, T, H, D), the layout transformers' attention functions return


# the position_ids tensor a model call hands every layer -> its rows' documents (or None): read
# once per call, not once per layer (each read waits for the device)
_DOCUMENTS: dict[tuple[int, int], tuple] = {}

_PACKED_UNDER_COMPILE = (
    "det_attn (transformers): position_ids restart inside a row (packed documents), which torch.compile "
    "and CUDA-graph capture cannot read from the device; pass cu_seq_lens_q/k with max_length_q/k as ints "
    "(DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or run the packed rows eagerly"
)


def _documents_from_position_ids(
    position_ids, batch: int, t_q: int, t_k: int
) -> tuple[torch.Tensor, int] | None:
    """The documents of packed rows given by their ``position_ids`` alone: ``(cu_seqlens, longest)``
    over the ``batch * t_q`` tokens of the rows laid one after another, or None (one sequence per row).

    A row whose positions are not ``p0 + arange(T)`` packs several documents, each starting at the
    row's first token and wherever the position equals the row's minimum (transformers'
    flash-attention rule, ``prepare_fa_kwargs_from_position_ids``; ``DataCollatorWithFlattening``
    without ``return_flash_attn_kwargs``). When any row of the call is packed, every row is split
    into its documents (a row that is not packed is one document), so a row gives the same bits
    whatever rows share its micro-batch: a document attended through ``attention_varlen`` equals it
    attended alone (det_attn's packing invariance). ``position_ids`` of shape ``(B, T)``, ``(1, T)``
    (the same positions for every row) or ``(S, B, T)`` (multimodal RoPE sections: the first
    section is read). None without a device read for one query (decoding), a KV cache
    (``t_q != t_k``) or a shape that does not match the rows. The positions are read from the device
    once per model call (every layer gets the same tensor).

    Under ``torch.compile`` and CUDA-graph capture nothing is read: a device-side assertion
    (``torch._assert_async``) that no row is packed stands in its place, so a packed row fails
    loudly instead of attending across its documents (pass ``cu_seq_lens_q/k`` there).
    """
    if not isinstance(position_ids, torch.Tensor) or t_q == 1 or t_q != t_k or position_ids.shape[-1] != t_q:
        return None
    rows = position_ids[0] if position_ids.dim() == 3 else position_ids
    if rows.dim() != 2 or rows.shape[0] not in (1, batch):
        return None
    if torch.compiler.is_compiling():
        return _assert_one_sequence_per_row(rows)
    key = (id(position_ids), position_ids._version, batch)
    if key not in _DOCUMENTS:
        if rows.is_cuda and torch.cuda.is_current_stream_capturing():  # a graph cannot read the device
            return _assert_one_sequence_per_row(rows)
        _DOCUMENTS.clear()  # one call's position_ids at a time: nothing outlives the next call
        pos = rows.expand(batch, t_q).cpu()  # the one device read of the call
        documents = None
        if bool((pos.diff(dim=-1) != 1).any()):
            starts = pos == pos.min(dim=-1, keepdim=True).values
            starts[:, 0] = True
            first = starts.reshape(-1).nonzero().view(-1)
            cu = torch.cat((first, first.new_tensor([batch * t_q])))
            longest = int((cu[1:] - cu[:-1]).max())
            documents = (cu.to(device=position_ids.device, dtype=torch.int32), longest)
        # the tensor kept alive: its id cannot be reused meanwhile
        _DOCUMENTS[key] = (position_ids, documents)
    return _DOCUMENTS[key][1]


def _assert_one_sequence_per_row(rows: torch.Tensor) -> None:
    """Where the positions cannot be read (torch.compile, CUDA-graph capture): a device-side
    assertion that no row restarts, so a packed row fails loudly instead of being one sequence."""
    torch._assert_async((rows.diff(dim=-1) == 1).all(), _PACKED_UNDER_COMPILE)


def register_transformers_attention(name: str = "det_attn") -> bool:
    """Register ``det_attn_transformers_forward`` under ``name`` in transformers' interfaces.

    Registers the attention function (``AttentionInterface``) and, when transformers has one, the
    flash-attention mask builder (``AttentionMaskInterface``), which gives ``None`` when there is
    no padding. Returns False, and registers nothing, when transformers is not installed.

    Args:
        name: a non-empty str, what ``attn_implementation=`` names (default ``"det_attn"``).

    Raises:
        TypeError: ``name`` is not a str. ValueError: ``name`` is empty (or only spaces). Both
            before anything is registered; an error raised while importing transformers other
            than ``ImportError`` (a broken install) propagates.

    **Determinism:** registration only; see ``det_attn_transformers_forward``.
    """
    # transformers keys its registries by the name: a non-str one is never reachable from a config
    if not isinstance(name, str):
        raise TypeError(
            f"det_attn.register_transformers_attention: name must be a str (what attn_implementation= "
            f"names), got {type(name).__name__} {name!r}"
        )
    if not name.strip():
        raise ValueError(
            f"det_attn.register_transformers_attention: name must be a non-empty str, got {name!r}; "
            "the default is 'det_attn'"
        )
    # transformers is an optional peer, never a dependency of the kernel: it is looked up at call
    # time (importlib, so the Hub build's import check sees no hard import) and its absence is a no-op.
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        return False
    transformers.AttentionInterface.register(name, det_attn_transformers_forward)
    try:
        masking = importlib.import_module("transformers.masking_utils")
    except ImportError:  # older transformers: no mask interface, masks come from the model
        return True
    masking.ALL_MASK_ATTENTION_FUNCTIONS.register(name, masking.flash_attention_mask)
    return True
