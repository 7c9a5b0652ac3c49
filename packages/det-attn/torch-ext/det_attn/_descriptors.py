"""TMA tensor descriptors for the forward kernel's variants (``_fwd_kernel``, ``TMA`` 1 and 2):
which calls can use them, host descriptors built once per call shape, Triton's scratch allocator.

The descriptors read and write the same elements as the pointer kernel (rows past a sequence or
batch row's end read as zeros, stores past it dropped), so every mode gives the same bits.
"""

from __future__ import annotations

import dataclasses

import torch

try:  # Triton >= 3.4; older versions take the pointer loads (the same bits)
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

    _HAS_HOST_DESCRIPTORS = True
except ImportError:
    _HAS_HOST_DESCRIPTORS = False


def fwd_tma_mode(mode: int, q, k, o_strides, dense) -> int:
    """The TMA mode (``flash_attention._Config.fwd_tma``) a call of this shape can use: ``mode``, or
    0 where descriptors cannot describe it (rows or heads not 16-byte aligned; mode 2: packed
    input, or heads not side by side in memory). Same bits in every mode."""
    if mode == 0 or not _HAS_HOST_DESCRIPTORS:
        return 0
    head_dim = q.shape[2]
    row_strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), o_strides[0], o_strides[1])
    if any(stride % 8 for stride in row_strides):  # 8 elements of 2 bytes: TMA's 16-byte rule
        return 0
    if mode == 2 and (
        dense is None or q.stride(1) != head_dim or k.stride(1) != head_dim or o_strides[1] != head_dim
    ):
        return 0
    return mode


def fwd_descriptor_templates(q, k, o_strides, dense, block_m: int, block_n: int) -> tuple:
    """Host TMA descriptors of q, k, v, o over ``(B, T, H * D)`` without a base (set per call by
    ``with_base``): validated here once, so a call only copies one."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, t_q, t_k = dense
    head_dim = q.shape[2]
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(TensorDescriptor)
        if f.default is not dataclasses.MISSING
    }

    def template(t_len, heads, stride_t, block):
        desc = object.__new__(TensorDescriptor)
        desc.__dict__.update(defaults)
        desc.__dict__.update(
            base=None,
            shape=[batch, t_len, heads * head_dim],
            strides=[t_len * stride_t, stride_t, 1],
            block_shape=[1, block, head_dim],
        )
        return desc

    q_desc = template(t_q, q.shape[1], q.stride(0), block_m)
    k_desc = template(t_k, k.shape[1], k.stride(0), block_n)
    return q_desc, k_desc, k_desc, template(t_q, q.shape[1], o_strides[0], block_m)


def with_base(template, base: torch.Tensor):
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = base
    return desc


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # global scratch for tensor descriptors made in a kernel (128 bytes each; torch blocks are 512-aligned)
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_triton_allocator() -> None:
    """Set ``_scratch`` as Triton's allocator in this thread's context unless one is set (Triton
    keeps it in a ContextVar, so an autograd or checkpointing thread starts without one)."""
    import triton

    try:
        from triton.runtime import _allocation

        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # another Triton layout: set ours
        unset = True
    if unset:
        triton.set_allocator(_scratch)
