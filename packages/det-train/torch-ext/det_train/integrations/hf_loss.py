"""A drop-in for transformers' causal-LM loss (``ForCausalLMLoss``) on ``det_train.cross_entropy``.

transformers' loss upcasts the logits to fp32, shifts the labels left by one (padding the end with
``ignore_index``), and takes ``F.cross_entropy`` with ``reduction="sum"`` divided by
``num_items_in_batch`` (or the mean over the call's counted tokens without it). This computes the
same loss with ``det_train.cross_entropy``: row-invariant token losses and gradients, the sum in the
canonical token order, and, given ``num_items_in_batch`` (the counted tokens of the whole global
batch), one fp32 gradient scale ``1 / num_items_in_batch`` for every token of every micro-batch.
The logits are read in their own dtype (fp32 math in the kernel): no fp32 copy of ``(B, T, V)``.

transformers is not imported here: install with ``model.loss_function = det_train.causal_lm_loss``
(``det_train.convert`` does this for causal-LM models).
"""

from __future__ import annotations

import numbers

import torch

from ..accum.grad_accum import current_accumulator
from ..ops.cross_entropy import cross_entropy

__all__ = ["causal_lm_loss"]


def _token_count(value) -> int:
    """``num_items_in_batch`` as a positive int: an int, or a one-element tensor holding an integral
    value (transformers' Trainer passes a float tensor: the count divided by its parallel sizes)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"causal_lm_loss: num_items_in_batch must hold one count, got a tensor of shape "
                f"{tuple(value.shape)} (torch.nn.DataParallel is not supported: use one process per GPU)"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"causal_lm_loss: num_items_in_batch must be a number, got {type(value).__name__}")
    if value != int(value) or value <= 0:
        raise ValueError(
            f"causal_lm_loss: num_items_in_batch must be a positive whole number of tokens, got {value}"
        )
    return int(value)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Causal-LM cross-entropy as transformers computes it, in the canonical order.

    The signature of transformers' ``ForCausalLMLoss`` (``model.loss_function``): position ``t``
    of each sequence predicts label ``t + 1``.

    Args:
        logits: ``(B, T, V)`` (or any ``(..., V)``) float32 / bfloat16 / float16 logits.
        labels: ``(B, T)`` int64 / int32 token ids or ``ignore_index``; shifted left by one here
            (the last position of each row gets ``ignore_index``), unless ``shift_labels`` is given.
        vocab_size: if given, must equal ``logits.shape[-1]``.
        num_items_in_batch: the number of counted (not ``ignore_index``) shifted labels of the
            whole global batch (all micro-batches and data-parallel ranks), as transformers'
            Trainer passes it; an int or a one-element tensor with an integral value. None: the
            mean over this call's counted tokens (not allowed inside an accumulator's micro-batch).
        ignore_index: label that is not predicted (default -100).
        shift_labels: already shifted labels of ``logits.shape[:-1]`` (packed / padding-free
            batches); ``labels`` is then not read.
        **kwargs: the model's other keyword arguments, ignored (as transformers' loss does).

    Returns:
        fp32 scalar: the canonical sum of token losses divided by ``num_items_in_batch`` (or by
        the call's counted tokens).

    **Determinism:** as ``det_train.cross_entropy``: a token's loss and its dlogits row depend only
    on its logits row, label and the scale; with ``num_items_in_batch`` the scale is the same fp32
    ``1 / N`` in every micro-batch, so the logits' gradients, and everything upstream of them, do
    not depend on how the global batch was split. The returned value is this call's partial loss
    (summed over micro-batches by the caller, for logging). Not bitwise equal to transformers'
    loss (another summation order), within fp32 rounding of it.

    Raises:
        TypeError: ``num_items_in_batch`` not a number; as ``cross_entropy`` (dtypes).
        ValueError: ``vocab_size`` other than ``logits.shape[-1]``; ``labels`` / ``shift_labels``
            not of ``logits.shape[:-1]``; ``num_items_in_batch`` not a positive whole number or of
            several elements, or smaller than this call's own counted labels (transformers divides by
            any count; a global count is never below one micro-batch's); no ``num_items_in_batch``
            inside a ``CanonicalGradAccumulator``
            micro-batch (each micro-batch would divide by its own count); a label outside
            ``[0, V)`` that is not ``ignore_index``.

    Method: transformers ``loss.loss_utils.ForCausalLMLoss`` (shift, ignore_index, sum /
    ``num_items_in_batch``) on ``det_train.cross_entropy``.
    """
    v = logits.shape[-1]
    if vocab_size is not None and int(vocab_size) != v:
        raise ValueError(f"causal_lm_loss: vocab_size={vocab_size} but the logits' last dim is {v}")
    if shift_labels is None:
        if tuple(labels.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"causal_lm_loss: labels of shape {tuple(labels.shape)} must match the logits without "
                f"the vocabulary dim, {tuple(logits.shape[:-1])}"
            )
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    elif tuple(shift_labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"causal_lm_loss: shift_labels of shape {tuple(shift_labels.shape)} must match the logits "
            f"without the vocabulary dim, {tuple(logits.shape[:-1])}"
        )
    targets = shift_labels.to(logits.device)
    if num_items_in_batch is None:
        if current_accumulator() is not None:
            raise ValueError(
                "causal_lm_loss: inside a CanonicalGradAccumulator micro-batch the loss needs "
                "num_items_in_batch (the counted tokens of the whole global batch; transformers' "
                "Trainer passes it, or call model(..., num_items_in_batch=N)): a mean over each "
                "micro-batch would make the gradients depend on the split"
            )
        return cross_entropy(logits, targets, ignore_index=ignore_index)
    count = _token_count(num_items_in_batch)
    return cross_entropy(logits, targets, ignore_index=ignore_index, num_global_tokens=count)
