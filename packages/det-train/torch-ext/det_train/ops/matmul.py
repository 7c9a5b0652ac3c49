"""Batch-invariant matmul: ``C = A @ B`` with one fixed reduction order over K.

Each output tile is a sequential fp32 fold over K in steps of ``block_k`` (one ``tl.dot`` per step,
K ascending from 0). The config comes from a fixed table keyed by dtype, operand layout and the
shape class of N and K (``configs.py``); M only picks the rows class — for the large forward
``x @ W.T`` the TMA kernel (M >= ``configs.TMA_MIN_ROWS``) or the pointer kernel, and for the
forward and dX smaller output tiles where the large ones would leave SMs idle (``configs.wave_fill``)
— all with the same ``block_k`` and the same bits (tested on the GPU across the thresholds).
There is no split-K: a row's bits depend only on that row of A, on B and on K, never on M or the
row's position. Operands are read through their strides (transposed and sliced views are not copied).

Row-parallel chaining: ``matmul_partial(a, b, carry=c)`` continues the fp32 fold from ``c``, so
cutting K at multiples of ``block_k`` into consecutive parts and chaining the parts' fp32
accumulators reproduces the unsplit result bit for bit (see docs/det-train.md, tensor parallelism).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from det_core import runtime
from det_core.launch import BoundLaunch, DescriptorTemplate, PlanCache

from . import configs
from ._library import Op, plain_eager
from ._tiles import (
    INTERPRET,
    bf16_by_bits,
    dot_precision,
    grouped_tile,
    row_major,
    runtime_programs,
    store_rounded,
)
from .configs import MatmulConfig, layout_of, matmul_config

__all__ = ["matmul", "matmul_partial"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    # pointers
    a_ptr, b_ptr, c_ptr, carry_ptr, bias_ptr,
    # sizes
    M, N, K,
    # strides (batch, row, col) and the pointer step of one K block
    stride_az, stride_am, stride_ak,
    stride_bz, stride_bk, stride_bn,
    stride_cz, stride_cm, stride_cn,
    stride_carry_z, stride_carry_m, stride_carry_n,
    a_k_step, b_k_step,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_CARRY: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BF16_BY_BITS: tl.constexpr, B_NK_TILES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    # rows / columns past the end wrap around: they are computed and never stored, so every load
    # is in bounds without an M or N mask and no other row is touched
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = (rows % M).to(tl.int64)
    offs_n = (cols % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + batch * stride_az + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    if B_NK_TILES:  # B = W.T read as (BLOCK_N, BLOCK_K) tiles of W, transposed in registers (a view)
        b_ptrs = b_ptr + batch * stride_bz + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
    else:
        b_ptrs = b_ptr + batch * stride_bz + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    if HAS_CARRY:  # continue the fold of the previous K part (row-parallel chaining)
        carry_ptrs = (
            carry_ptr
            + batch * stride_carry_z
            + offs_m[:, None] * stride_carry_m
            + offs_n[None, :] * stride_carry_n
        )
        acc = tl.load(carry_ptrs)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            if B_NK_TILES:
                b = tl.trans(b)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            if B_NK_TILES:
                b = tl.trans(tl.load(b_ptrs, mask=offs_k[None, :] < k_left, other=0.0))
            else:
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:  # Triton interpreter: no bf16 dot; the fp32 dot of bf16 values is exact per product
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            if B_NK_TILES:  # as in the TMA kernel: a row-major copy for numpy's dot
                b = row_major(b, BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += a_k_step
        b_ptrs += b_k_step

    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    c_ptrs = (
        c_ptr
        + batch * stride_cz
        + rows.to(tl.int64)[:, None] * stride_cm
        + cols.to(tl.int64)[None, :] * stride_cn
    )
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    store_rounded(c_ptrs, acc, mask, BF16_BY_BITS)


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    a_desc, b_desc, c_ptr, bias_ptr, M, N, K, stride_cm, stride_cn, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    B_KMAJOR: tl.constexpr, PERSISTENT: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BF16_BY_BITS: tl.constexpr,
):  # fmt: skip
    """``_matmul_kernel`` (2-D, no carry) with A and B tiles loaded by TMA (Hopper tensor memory
    accelerator) through host tensor descriptors: the same K fold, the same ``tl.dot`` per step, so
    the same bits. ``B_KMAJOR``: B = W.T described as W (N, K), tiles (BLOCK_N, BLOCK_K) fed to
    the dot transposed (wgmma's native K-major B). Rows / columns / K past the end are zero-filled
    by TMA and never stored. ``PERSISTENT``: ``num_programs`` programs walk the tiles."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    if PERSISTENT:
        first, step = tl.program_id(0), num_programs
    else:
        first, step = tl.program_id(0), num_pid_m * num_pid_n
    for tile_id in range(first, num_pid_m * num_pid_n, step):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_steps):
            a = a_desc.load([off_m, k * BLOCK_K])
            if B_KMAJOR:
                b = tl.trans(b_desc.load([off_n, k * BLOCK_K]))
            else:
                b = b_desc.load([k * BLOCK_K, off_n])
            if UPCAST:  # interpreter: fp32 dot of a row-major copy (numpy sums a transposed view
                a = a.to(tl.float32)  # in another order); the GPU dot reads either from smem
                b = row_major(b.to(tl.float32), BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
        store_rounded(c_ptrs, acc, (rows[:, None] < M) & (cols[None, :] < N), BF16_BY_BITS)


def _tma_operands(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig, carry) -> tuple | None:
    """Host TMA descriptors of A and of B, and whether B is K-major: B = W.T described as W (N, K)
    (``"nt"``), or a row-major B (K, N) itself (``"nn"``); None when the call does not qualify
    (batched, carry, fp32, B neither K- nor N-contiguous, strides or addresses not 16-byte aligned)."""
    if carry is not None or a.dim() != 2 or b.dim() != 2 or a.dtype not in (torch.bfloat16, torch.float16):
        return None
    if a.stride(1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16 or b.data_ptr() % 16:
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton < 3.4
        return None
    M, K = a.shape
    N = b.shape[1]
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [config.block_m, config.block_k])
    if b.stride(0) == 1 and b.stride(1) % 8 == 0:  # W.T of a (N, K) weight: describe W itself
        return (
            a_desc,
            TensorDescriptor(b.t(), [N, K], [b.stride(1), 1], [config.block_n, config.block_k]),
            True,
        )
    if b.stride(1) == 1 and b.stride(0) % 8 == 0:  # row-major B ("nn", dX = dY @ W): (BLOCK_K, BLOCK_N)
        return a_desc, TensorDescriptor(b, [K, N], [b.stride(0), 1], [config.block_k, config.block_n]), False
    return None


class _Plan:
    """The launch of one matmul call signature (shapes, strides, dtypes, alignment, config): the
    kernel with its sizes, strides and constexprs bound; the calls pass the tensors."""

    __slots__ = ("tma", "grid", "launch", "a_desc", "b_desc", "b_kmajor")

    def __init__(
        self, tma, grid, kernel, n_tensors, scalars, meta, a_desc=None, b_desc=None, b_kmajor=True
    ) -> None:
        self.tma, self.grid = tma, grid
        self.launch = BoundLaunch(kernel, n_tensors, scalars, **meta)
        self.a_desc, self.b_desc = a_desc, b_desc
        self.b_kmajor = b_kmajor  # TMA: B's descriptor is of W = B.T (True) or of B itself


# Launch plans by call signature: the host side of a matmul is then a dict lookup and the launch
# (~600 launches per training step: the config lookup, the strides and the constexprs were tens of
# microseconds of host time per call). The key holds everything a plan is computed from.
_PLANS = PlanCache()


def _plan_key(a, b, out, carry, bias, config, transposed_b: bool) -> tuple:
    return (
        a.shape, a.stride(), b.shape, b.stride(), out.shape, out.stride(), a.dtype, out.dtype, a.device,
        a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0, None if carry is None else carry.stride(),
        bias is None, config, transposed_b, configs.TMA_MIN_ROWS, configs.MID_MAX_FILL, configs.LOW_MAX_FILL,
        configs.WAVE_SMS,
    )  # fmt: skip


def _make_plan(key, a, b, out, carry, bias, config) -> _Plan:
    """The plan of ``out = (carry + a @ b) (+ bias)`` (``b`` (K, N), any strides), stored under ``key``."""
    if a.dim() == 2 and b.dim() == 2 and out.dim() != 2:  # (..., N) holding the M rows: its (M, N) view
        out = out.view(-1, out.shape[-1])
    M, K = a.shape[-2:]
    N = b.shape[-1]
    if config is None:  # M picks the rows class (kernel and tiles), never block_k (same bits)
        config = matmul_config(a.dtype, layout_of(a, b), N, K, rows=M)
    common = dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(a.dtype),
        BF16_BY_BITS=bf16_by_bits(out.dtype),
    )  # fmt: skip
    descs = _tma_operands(a, b, config, carry) if config.tma else None
    if descs is not None:
        a_desc, b_desc, b_kmajor = descs
        tiles = runtime.cdiv(M, config.block_m) * runtime.cdiv(N, config.block_n)
        programs = min(tiles, runtime_programs(a.device)) if config.persistent else tiles
        plan = _Plan(
            True, (programs,), _matmul_tma_kernel, 4, (M, N, K, out.stride(0), out.stride(1), programs),
            dict(
                common, B_KMAJOR=b_kmajor, PERSISTENT=config.persistent, UPCAST=INTERPRET,
                num_warps=config.num_warps, num_stages=config.num_stages,
            ),
            DescriptorTemplate(a_desc), DescriptorTemplate(b_desc), b_kmajor,
        )  # fmt: skip
    else:
        a3, saz = _as_batched(a)
        b3, sbz = _as_batched(b)
        c3, scz = _as_batched(out)
        if carry is not None:
            carry3, scarz = _as_batched(carry)
            carry_strides = (scarz, carry3.stride(1), carry3.stride(2))
        else:
            carry_strides = (0, 0, 0)
        z = max(a3.shape[0], b3.shape[0])
        plan = _Plan(
            False, (runtime.cdiv(M, config.block_m) * runtime.cdiv(N, config.block_n), z), _matmul_kernel, 5,
            (
                M, N, K,
                saz, a3.stride(1), a3.stride(2),
                sbz, b3.stride(1), b3.stride(2),
                scz, c3.stride(1), c3.stride(2),
                *carry_strides,
                config.block_k * a3.stride(2), config.block_k * b3.stride(1),
            ),
            dict(
                common, EVEN_K=K % config.block_k == 0, HAS_CARRY=carry is not None,
                UPCAST=INTERPRET and a.dtype != torch.float32, B_NK_TILES=config.b_nk_tiles,
                num_warps=config.num_warps, num_stages=config.num_stages,
            ),
        )  # fmt: skip
    return _PLANS.put(key, plan)


def _launch_tma(plan: _Plan, a_desc, b_desc, out: torch.Tensor, bias) -> torch.Tensor:
    plan.launch(plan.grid, a_desc, b_desc, out, bias if bias is not None else out)
    return out


def _as_batched(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A 3-D view (batch, rows, cols) and its batch stride (0 for a 2-D tensor shared by all batches)."""
    if t.dim() == 2:
        return t.unsqueeze(0), 0
    return t, t.stride(0)


def launch_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    carry: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """Launch the kernel: ``out = (carry + a @ b) (+ bias)`` cast to ``out.dtype`` (no checks here).

    ``a`` is (M, K) or (Z, M, K), ``b`` (K, N) or (Z, K, N), ``out`` and ``carry`` (Z, M, N) or
    (M, N); with 2-D ``a`` and ``b``, ``out`` may also be any (..., N) tensor that views as (M, N)
    (the caller's final shape, no reshape after). ``config`` overrides the table (benchmark
    sweeps); tests assert that every table entry of one dtype gives the same bits.
    """
    key = _plan_key(a, b, out, carry, bias, config, False)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(key, a, b, out, carry, bias, config)
    if bias is not None:
        bias = bias.contiguous()
    if plan.tma:
        return _launch_tma(plan, plan.a_desc(a), plan.b_desc(b.t() if plan.b_kmajor else b), out, bias)
    # a 2-D operand is passed as it is: the kernel reads it through the plan's strides (batch stride 0)
    plan.launch(plan.grid, a, b, out, carry if carry is not None else out, bias if bias is not None else out)
    return out


def launch_linear(x2d: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias=None) -> torch.Tensor:
    """``launch_matmul(x2d, weight.t(), out, bias=bias)`` without making the transposed view: the
    same plan and kernel arguments, with W itself as the TMA descriptor's base (``weight.t().t()``)
    and as the pointer kernel's B (the same address), so the same bits."""
    key = _plan_key(x2d, weight, out, None, bias, None, True)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(key, x2d, weight.t(), out, None, bias, None)
    if bias is not None:
        bias = bias.contiguous()
    if plan.tma:
        return _launch_tma(
            plan, plan.a_desc(x2d), plan.b_desc(weight if plan.b_kmajor else weight.t()), out, bias
        )
    plan.launch(plan.grid, x2d, weight, out, out, bias if bias is not None else out)
    return out


def check_operands(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
        if t.dim() < 2:
            raise ValueError(
                f"{op}: {name} must have at least 2 dims (rows, cols), got shape {tuple(t.shape)}; "
                "use x.unsqueeze(0) / x.unsqueeze(-1) for vectors"
            )
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"{op}: inner dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
            f"(a.shape[-1]={a.shape[-1]} != b.shape[-2]={b.shape[-2]})"
        )
    runtime.check_kernel_device(a, b, op=op)


def _broadcast(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Bring a and b to (M, K)/(K, N) or (Z, M, K)/(Z, K, N) views; returns the batch shape."""
    if a.dim() == 2 and b.dim() == 2:
        return a, b, ()
    try:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"det_train.matmul: batch dims do not broadcast: a is {tuple(a.shape)}, b is "
            f"{tuple(b.shape)} (batch {tuple(a.shape[:-2])} vs {tuple(b.shape[:-2])}); each pair of "
            "batch sizes, aligned from the right, must be equal or 1, as in torch.matmul"
        ) from None
    # the batch count is explicit: reshape cannot infer -1 for a tensor of 0 elements (K = 0 or M = 0)
    z = math.prod(batch)
    if b.dim() == 2:  # (..., M, K) @ (K, N): one 3-D launch with B shared (batch stride 0)
        a3 = a.reshape(z, *a.shape[-2:])
        return a3, b, batch
    a_e = a.expand(*batch, *a.shape[-2:]).reshape(z, *a.shape[-2:])
    b_e = b.expand(*batch, *b.shape[-2:]).reshape(z, *b.shape[-2:])
    return a_e, b_e, batch


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``a @ b`` with fp32 accumulation. **No autograd** (forward only).

    ``det_train.matmul`` has no backward: with grad mode on and ``a`` or ``b`` requiring grad
    it raises instead of returning a result that silently has no ``grad_fn``. For trainable
    weights use ``det_train.linear`` (canonical-order dW); for whole models
    ``det_train.deterministic_mode()`` (its routed ``mm`` / ``bmm`` keep autograd's formulas);
    for inference call it under ``torch.no_grad()`` / ``torch.inference_mode()``.

    Args:
        a: ``(M, K)`` or batched ``(*batch, M, K)``; bfloat16, float16 or float32; any strides.
        b: ``(K, N)`` or ``(*batch, K, N)`` (batch dims broadcast as in ``torch.matmul``); same
            dtype and device as ``a``. ``W.T`` of an nn.Linear weight is read in place.

    Returns:
        ``(*batch, M, N)`` in the inputs' dtype: the fp32 sum rounded once to nearest.

    Raises:
        TypeError: non-tensor, unsupported or mismatched dtypes.
        ValueError: fewer than 2 dims, inner dims that differ, batch dims that do not broadcast,
            tensors on different devices.
        RuntimeError: ``a`` or ``b`` requires grad while grad mode is on (there is no backward:
            see above); CPU tensors without the Triton interpreter (``TRITON_INTERPRET=1``).

    Empty dims: ``M == 0`` or ``N == 0`` gives an empty result, ``K == 0`` gives zeros. Tensors over
    2^31 elements are indexed in 64 bits.

    **Determinism:** bitwise identical run to run (no atomics, no split-K, configs from a fixed
    table; M only chooses between a TMA and a pointer kernel with the same K order, hence the
    same bits). Row invariant: row ``i`` of the result depends only on row ``i`` of ``a``, on ``b`` and
    on K — not on M, on the row's position, on the other rows, or on the batch index. Column
    invariant in the same way (not on N). Not guaranteed: equal bits across GPU models, Triton
    versions, or against cuBLAS / ``torch.matmul`` (a different summation order).

    Method: tiled GEMM with grouped ordering (Triton tutorial 03, "Matrix Multiplication") with the
    K loop of every tile in one fixed order, as the batch-invariant kernels of He et al.,
    "Defeating Nondeterminism in LLM Inference" (Thinking Machines Lab, 2025).
    """
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (a, b)):
        raise RuntimeError(
            "det_train.matmul has no backward: use det_train.linear (canonical-order dW) for trainable "
            "weights, det_train.deterministic_mode() for whole models, or call it under torch.no_grad()"
        )
    check_operands(a, b, "det_train.matmul")
    _batch_shape(a, b)  # the broadcast error, before the op (also while torch.compile traces)
    return matmul_op(a, b)


def _batch_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    """The broadcast batch shape of ``a @ b`` (``()`` for 2-D operands), or ``_broadcast``'s ValueError."""
    if a.dim() == 2 and b.dim() == 2:
        return ()
    try:
        return tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except RuntimeError:
        raise ValueError(
            f"det_train.matmul: batch dims do not broadcast: a is {tuple(a.shape)}, b is "
            f"{tuple(b.shape)} (batch {tuple(a.shape[:-2])} vs {tuple(b.shape[:-2])}); each pair of "
            "batch sizes, aligned from the right, must be equal or 1, as in torch.matmul"
        ) from None


def forward_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``matmul`` without the autograd check, for kernels registered below autograd
    (``deterministic_mode``'s routed ``mm`` / ``bmm``: autograd records the op's own backward
    there, and the operands still report ``requires_grad``) and for the ``det_train::matmul`` op."""
    check_operands(a, b, "det_train.matmul")
    a_v, b_v, batch = _broadcast(a, b)
    M, K = a_v.shape[-2:]
    N = b_v.shape[-1]
    z = a_v.shape[0] if a_v.dim() == 3 else 1
    out = torch.empty((z, M, N) if batch else (M, N), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out.reshape(*batch, M, N)
    if K == 0:
        return out.zero_().reshape(*batch, M, N)
    launch_matmul(a_v, b_v, out)
    return out.reshape(*batch, M, N)


def matmul_partial(
    a: torch.Tensor,
    b: torch.Tensor,
    carry: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    finish: bool = False,
) -> torch.Tensor:
    """One K part of a chained matmul: ``carry + a @ b``, as the fp32 accumulator or finished.

    Row-parallel tensor parallelism cuts K into consecutive parts ``K_0, K_1, ...`` (each a
    multiple of the config's ``block_k`` — 64 for bf16/fp16, 32 for fp32 — except the last). Part
    ``r`` continues the fp32 fold of part ``r - 1`` (``carry``); the last part, called with
    ``finish=True`` (and the bias, if any), gives exactly ``matmul(a_full, b_full)`` (or
    ``linear``'s forward) bit for bit.

    Args:
        a: ``(M, K_r)`` (2-D only); bfloat16, float16 or float32.
        b: ``(K_r, N)``, any strides (``W_r.T`` in place).
        carry: fp32 ``(M, N)`` from the previous part, or None for the first part.
        bias: ``(N,)`` in ``a``'s dtype, added in fp32 before rounding; only with ``finish=True``.
        finish: round to ``a.dtype`` (the last part) instead of returning the fp32 accumulator.

    Returns:
        ``(M, N)``: fp32 accumulator, or ``a.dtype`` when ``finish``.

    Raises:
        TypeError: as ``matmul``; a bias of another dtype.
        ValueError: as ``matmul``; ``carry`` not fp32 ``(M, N)`` on ``a``'s device; ``bias``
            without ``finish`` or not of shape ``(N,)``.

    **Determinism:** bitwise equal to the unsplit result when every part but the last has a K
    that is a multiple of ``block_k``; row invariant as ``matmul``. Parts cut elsewhere give a
    valid, still deterministic, but different order. Cost: the parts run one after another (a chain,
    not a tree); each hop sends an fp32 ``(M, N)`` accumulator.
    """
    check_operands(a, b, "det_train.matmul_partial")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError("det_train.matmul_partial takes 2-D a and b")
    M, N = a.shape[0], b.shape[1]
    if carry is not None and (
        carry.dtype != torch.float32 or tuple(carry.shape) != (M, N) or carry.device != a.device
    ):
        raise ValueError(
            f"carry must be float32 of shape {(M, N)} on {a.device}, got "
            f"{carry.dtype} {tuple(carry.shape)} on {carry.device}"
        )
    if bias is not None:
        if not finish:
            raise ValueError("bias is added by the last part only: pass finish=True with it")
        check_bias(bias, N, a, "det_train.matmul_partial")
    return matmul_partial_op(a, b, carry, bias, bool(finish))


def chain_part(
    a: torch.Tensor, b: torch.Tensor, carry: torch.Tensor | None, bias: torch.Tensor | None, finish: bool
) -> torch.Tensor:
    """``matmul_partial`` after its checks: the launch (also the ``det_train::matmul_partial`` op).

    ``a (M, K)``, ``b (K, N)``, ``carry`` fp32 ``(M, N)`` or None, ``bias (N,)`` or None (with
    ``finish``); returns fp32 ``(M, N)`` or, with ``finish``, ``a.dtype``. No checks (see
    ``matmul_partial`` for the errors). **Determinism:** ``matmul_partial``'s: the fold over K
    continues ``carry`` in the fixed ``block_k`` steps.
    """
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=a.dtype if finish else torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    if K == 0:
        acc = (
            carry.clone() if carry is not None else torch.zeros((M, N), dtype=torch.float32, device=a.device)
        )
        if bias is not None:
            acc = acc + bias.float()
        return out.copy_(acc)
    return launch_matmul(a, b, out, carry=carry, bias=bias)


def check_bias(bias: torch.Tensor, n: int, like: torch.Tensor, op: str) -> None:
    if not isinstance(bias, torch.Tensor):  # a TypeError, as for the other non-tensor inputs
        raise TypeError(f"{op}: bias must be a 1-D tensor of {n} elements, got {type(bias).__name__}")
    if bias.dim() != 1 or bias.shape[0] != n:
        raise ValueError(f"{op}: bias must be a 1-D tensor of {n} elements, got {tuple(bias.shape)}")
    if bias.dtype != like.dtype:
        raise TypeError(f"{op}: bias dtype {bias.dtype} differs from the input dtype {like.dtype}")
    if bias.device != like.device:
        raise ValueError(f"{op}: bias is on {bias.device}, the inputs on {like.device}")


# ----------------------------------------------------------------------------- torch.library ops
# Forward only (no autograd formula: a backward through them raises torch's "no autograd formula"
# RuntimeError; the public functions refuse operands that require grad, or are used where autograd
# has its own formula). Opaque to torch.compile: Inductor runs them as they are.
@Op("matmul")
def matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The ``det_train::matmul`` op: ``forward_matmul(a, b)`` (``matmul`` after its checks)."""
    return forward_matmul(a, b)


@matmul_op.register_fake
def _(a, b):
    return a.new_empty((*_batch_shape(a, b), a.shape[-2], b.shape[-1]))


def matmul_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``matmul_op(a, b)`` for 2-D operands a backward already knows valid (dX = dY W of a Linear-like
    op: the forward checked W, autograd matched dY to the output): in plain eager execution the
    launch without the op's checks and broadcast (their host time, on every backward call), else the op.

    ``a (M, K)``, ``b (K, N)``, one dtype and device; returns ``(M, N)``. **Determinism:** the same
    launch as ``matmul_op``, so the same bits."""
    if not plain_eager((a, b)):
        return matmul_op(a, b)
    M, K = a.shape
    out = torch.empty((M, b.shape[1]), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    return launch_matmul(a, b, out)


@Op("matmul_partial")
def matmul_partial_op(
    a: torch.Tensor, b: torch.Tensor, carry: torch.Tensor | None, bias: torch.Tensor | None, finish: bool
) -> torch.Tensor:
    """The ``det_train::matmul_partial`` op: ``chain_part`` (``matmul_partial`` after its checks)."""
    return chain_part(a, b, carry, bias, finish)


@matmul_partial_op.register_fake
def _(a, b, carry, bias, finish):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=a.dtype if finish else torch.float32)
