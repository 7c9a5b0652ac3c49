"""Host TMA tensor descriptors for the forward kernel (``_fwd_kernel``, ``TMA``): which calls can
use them, and the descriptors, built once per call shape.

The descriptors read and write the same elements as the pointer loads and stores (rows past a
batch row's end read as zeros, stores past it dropped), so both paths give the same bits.
"""

from __future__ import annotations

from det_core.launch import DescriptorTemplate

try:  # Triton >= 3.4; older versions take the pointer loads (the same bits)
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

    _HAS_HOST_DESCRIPTORS = True
except ImportError:
    _HAS_HOST_DESCRIPTORS = False


def fwd_descriptors_fit(q, k, o_strides, dense) -> bool:
    """Whether host descriptors over ``(B, T, H * D)`` can describe a forward call of this shape:
    Triton has them, the input is a padded batch (``dense``, not packed), every row is 16-byte
    aligned and a token's heads lie side by side. Otherwise the call takes the pointer loads (the
    same bits)."""
    if dense is None or not _HAS_HOST_DESCRIPTORS:
        return False
    head_dim = q.shape[2]
    if any(stride % 8 for stride in (q.stride(0), k.stride(0), o_strides[0])):  # 8 x 2 bytes: TMA's rule
        return False
    return q.stride(1) == head_dim and k.stride(1) == head_dim and o_strides[1] == head_dim


def fwd_descriptor_templates(q, k, o_strides, dense, block_m: int, block_n: int) -> tuple:
    """Host TMA descriptors of q, k, v, o over ``(B, T, H * D)`` as ``DescriptorTemplate``
    (validated here once; a call copies each with its tensor as the base, whose 16-byte alignment
    the launcher checks per call)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, t_q, t_k = dense
    head_dim = q.shape[2]
    probe = q.new_empty(0)  # validation reads the dtype; the base is set per call

    def template(t_len, heads, stride_t, block):
        shape, strides = [batch, t_len, heads * head_dim], [t_len * stride_t, stride_t, 1]
        return DescriptorTemplate(TensorDescriptor(probe, shape, strides, [1, block, head_dim]))

    q_desc = template(t_q, q.shape[1], q.stride(0), block_m)
    k_desc = template(t_k, k.shape[1], k.stride(0), block_n)
    return q_desc, k_desc, k_desc, template(t_q, q.shape[1], o_strides[0], block_m)
