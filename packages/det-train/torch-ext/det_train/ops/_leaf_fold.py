"""The fp32 fold of dW = dY^T X over one leaf's tokens, in steps of ``block_t`` tokens.

The JIT helpers here are the leaf sums the dW tree kernels (``weight_grad``) build their nodes
from; ``weight_grad_fold`` runs the same fold over a run of a leaf's tokens, starting from a stored
fp32 accumulator: the form in which ``CanonicalGradAccumulator`` carries a Linear weight's open leaf
from one micro-batch to the next. Resumed at a multiple of ``block_t`` tokens, the fold has the
bits of one call.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import BoundLaunch, DescriptorTemplate, PlanCache

from ._tiles import INTERPRET, dot_precision, grouped_tile, row_major
from .configs import WeightGradConfig, weight_grad_fold_config

__all__ = ["dw_tma_operands", "fold", "leaf_sum", "leaf_sum_tma", "tma_step", "weight_grad_fold"]


@triton.jit
def leaf_sum(
    dy_ptr, x_ptr, tok_start, tok_end, offs_n, offs_k,
    stride_dyt, stride_dyn, stride_xt, stride_xk, dy_t_step, x_t_step,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    EVEN_T: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """fp32 (BLOCK_N, BLOCK_K) tile of sum_t dY[t, n] X[t, k] over one leaf, folded in BLOCK_T steps."""
    return fold(
        tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), dy_ptr, x_ptr, tok_start, tok_end, offs_n, offs_k,
        stride_dyt, stride_dyn, stride_xt, stride_xk, dy_t_step, x_t_step, BLOCK_N, BLOCK_K, BLOCK_T, EVEN_T,
        UPCAST, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def fold(
    acc, dy_ptr, x_ptr, tok_start, tok_end, offs_n, offs_k,
    stride_dyt, stride_dyn, stride_xt, stride_xk, dy_t_step, x_t_step,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    EVEN_T: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``acc`` + the fold of sum_t dY[t, n] X[t, k] over tokens [tok_start, tok_end) in BLOCK_T steps."""
    offs_t = tl.arange(0, BLOCK_T)
    tok = (tok_start + offs_t).to(tl.int64)
    a_ptrs = dy_ptr + tok[None, :] * stride_dyt + offs_n[:, None] * stride_dyn  # dY^T tile (BLOCK_N, BLOCK_T)
    b_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk  # X tile (BLOCK_T, BLOCK_K)
    for t in range(tok_start, tok_end, BLOCK_T):
        if EVEN_T:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            left = tok_end - t
            a = tl.load(a_ptrs, mask=offs_t[None, :] < left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_t[:, None] < left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += dy_t_step
        b_ptrs += x_t_step
    return acc


@triton.jit
def tma_step(
    dy_desc, x_desc, t, off_n, off_k, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr
):
    """The operands of one token step by TMA: dY^T (BLOCK_N, BLOCK_T) and X (BLOCK_T, BLOCK_K)."""
    a = tl.trans(dy_desc.load([t, off_n]))
    b = x_desc.load([t, off_k])
    if UPCAST:  # interpreter: fp32 dot of a row-major copy, as matmul's TMA kernel
        a = row_major(a.to(tl.float32), BLOCK_N, BLOCK_T)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def leaf_sum_tma(
    dy_desc, x_desc, tok_start, tok_end, off_n, off_k,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``_leaf_sum`` with TMA tile loads (tokens past T zero-filled; leaf ends are BLOCK_T-aligned)."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t in range(tok_start, tok_end, BLOCK_T):
        a, b = tma_step(dy_desc, x_desc, t, off_n, off_k, BLOCK_N, BLOCK_T, UPCAST)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["T"])
def _weight_grad_fold_kernel(
    # pointers: dY (T, N) and X (T, K) (or their TMA descriptors), the fold so far and the result
    # (N, K) fp32 contiguous (may be the same tensor)
    dy_ptr, x_ptr, acc_ptr, out_ptr,
    T, N, K, stride_dyt, stride_dyn, stride_xt, stride_xk, dy_t_step, x_t_step,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr,
    RESUME: tl.constexpr, TMA: tl.constexpr, EVEN_T: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One dW tile of a leaf's fold continued over T more tokens: ``out = fold(acc; tokens 0..T)``,
    the steps of ``_leaf_sum`` / ``_leaf_sum_tma`` starting from the stored fp32 accumulator
    (``RESUME``) or from zero: split at a step, a leaf's fold has the bits of one fold."""
    pid_n, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K), GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tile = rows.to(tl.int64)[:, None] * K + cols[None, :]
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    if RESUME:
        acc = tl.load(acc_ptr + tile, mask=mask, other=0.0)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if TMA:  # tokens past T are zero-filled by the descriptors
        for t in range(0, T, BLOCK_T):
            a, b = tma_step(dy_ptr, x_ptr, t, pid_n * BLOCK_N, pid_k * BLOCK_K, BLOCK_N, BLOCK_T, UPCAST)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    else:
        acc = fold(
            acc, dy_ptr, x_ptr, 0, T, (rows % N).to(tl.int64), (cols % K).to(tl.int64),
            stride_dyt, stride_dyn, stride_xt, stride_xk, dy_t_step, x_t_step,
            BLOCK_N, BLOCK_K, BLOCK_T, EVEN_T, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    tl.store(out_ptr + tile, acc, mask=mask)


def dw_tma_operands(dy: torch.Tensor, x: torch.Tensor, config: WeightGradConfig, leaf_tokens: int):
    """TMA descriptors of dY (T, N) and X (T, K), or None when not applicable (leaf ends not on
    ``block_t`` steps, fp32, rows or addresses not 16-byte aligned, Triton < 3.4)."""
    if leaf_tokens % config.block_t or dy.dtype not in (torch.bfloat16, torch.float16):
        return None
    if dy.stride(1) != 1 or x.stride(1) != 1 or dy.stride(0) % 8 or x.stride(0) % 8:
        return None
    if dy.data_ptr() % 16 or x.data_ptr() % 16:
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    T, N = dy.shape
    K = x.shape[1]
    return (
        TensorDescriptor(dy, [T, N], [dy.stride(0), 1], [config.block_t, config.block_n]),
        TensorDescriptor(x, [T, K], [x.stride(0), 1], [config.block_t, config.block_k]),
    )


def weight_grad_fold(
    dy: torch.Tensor,
    x: torch.Tensor,
    acc: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: WeightGradConfig | None = None,
) -> torch.Tensor:
    """A leaf's dW fold continued over the tokens of ``dy`` / ``x``: ``acc`` + dY^T X in ``block_t`` steps.

    Args:
        dy: ``(T, N)`` output gradient rows of one leaf, in token order; bf16 / fp16 / fp32.
        x: ``(T, K)`` the layer's input rows, same dtype and device.
        acc: fp32 ``(N, K)`` contiguous, the fold of the leaf's earlier tokens (None: the leaf's
            first tokens, the fold starts from zero). Not modified unless it is ``out``.
        out: fp32 ``(N, K)`` contiguous to write the result into, or None (a new tensor). It may be
            ``acc`` itself (the fold continued in place, ``CanonicalGradAccumulator(...,
            recoverable=False)``): each program of the kernel loads its own ``(block_n, block_k)``
            tile of ``acc`` before its steps and stores that tile once after them, and no other
            program reads or writes that tile, so the bits are those of a new tensor. Any other
            ``out`` must not overlap ``acc``.
        config: override of the fold's tiles (``configs.weight_grad_fold_config``; benchmark
            sweeps and tests of configs). Its ``block_t`` is the fold's step: the table's keeps the
            bits of ``weight_grad_partial``; the tile, warps and stages never change bits.

    Raises:
        ValueError: ``out`` not fp32, contiguous, ``(N, K)`` on ``dy``'s device.

    Returns:
        A new fp32 ``(N, K)`` tensor (or ``out``): the fold so far. With ``acc=None`` over a whole
        leaf it is that leaf's node of ``weight_grad_partial`` (bitwise).

    **Determinism:** the fold's steps are ``weight_grad_partial``'s (the table's ``block_t``, the
    same dot): resumed at a multiple of ``block_t`` tokens from the start of the leaf, a fold split
    into any number of calls gives the bits of one call. A ``T`` that is not a multiple of
    ``block_t`` masks the last step, as the short last leaf of a batch does, so only the call
    that ends the leaf (or the batch) may have one.

    Method: the sequential fp32 fold of ``weight_grad_partial``'s leaves, resumed from its stored
    accumulator (the "main grad" of gradient accumulation, Megatron-LM's ``main_grad``).
    """
    T, N = dy.shape
    K = x.shape[1]
    resume = acc is not None
    key = (
        dy.shape, dy.stride(), x.shape, x.stride(), dy.dtype, dy.device, dy.data_ptr() % 16 == 0,
        x.data_ptr() % 16 == 0, resume, config,
    )  # fmt: skip
    plan = _FOLD_PLANS.get(key)
    if plan is None:
        if config is None:
            config = weight_grad_fold_config(dy.dtype, N, K)
        descs = dw_tma_operands(dy, x, config, config.block_t)
        if descs is None and config.block_k > 128:  # pointer loads of a 128x256 tile spill: 128x128
            config = dataclasses.replace(config, block_k=128)  # (the tile does not change bits)
        meta = dict(
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_T=config.block_t, GROUP_N=config.group_n,
            RESUME=resume, TMA=descs is not None, EVEN_T=T % config.block_t == 0,
            UPCAST=INTERPRET and dy.dtype != torch.float32, DOT_PRECISION=dot_precision(dy.dtype),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        scalars = (
            T, N, K, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
            config.block_t * dy.stride(0), config.block_t * x.stride(0),
        )  # fmt: skip
        grid = (runtime.cdiv(N, config.block_n) * runtime.cdiv(K, config.block_k),)
        launch = BoundLaunch(_weight_grad_fold_kernel, 4, scalars, **meta)
        templates = None if descs is None else tuple(map(DescriptorTemplate, descs))
        plan = _FOLD_PLANS.put(key, (grid, launch, templates))
    grid, launch, templates = plan
    if out is None:
        out = torch.empty((N, K), dtype=torch.float32, device=dy.device)
    elif (
        out.dtype != torch.float32
        or out.shape != (N, K)
        or not out.is_contiguous()
        or out.device != dy.device
    ):
        raise ValueError(
            f"weight_grad_fold: out must be a contiguous fp32 ({N}, {K}) tensor on {dy.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})"
        )
    operands = (dy, x) if templates is None else (templates[0](dy), templates[1](x))
    launch(grid, *operands, out if acc is None else acc, out)
    return out


_FOLD_PLANS = PlanCache()
