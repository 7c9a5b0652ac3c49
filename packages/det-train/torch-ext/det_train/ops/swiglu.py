"""SwiGLU's gate: ``silu(gate) * up`` on one packed tensor, forward and backward as our own kernels.

``swiglu(x)`` takes the ``(..., 2F)`` output of one gate-and-up projection (``gate = x[..., :F]``,
``up = x[..., F:]``, as ``x.chunk(2, dim=-1)`` splits it) and returns ``silu(gate) * up``
``(..., F)``: per element, in fp32, ``s = 1 / (1 + exp(-g))``, ``y = g * s * u``, rounded once to
the input dtype. The backward recomputes ``s`` from the saved input and writes one packed
``(..., 2F)`` gradient: ``dg = dy * u * s * (1 + g * (1 - s))``, ``du = dy * g * s`` (fp32, rounded
once), so there is no chunk / cat and no saved activation besides ``x``.

Why an op of ours for an elementwise function (it reduces nothing): under ``torch.compile``, torch's
``silu`` and ``*`` become Inductor's code (its own ``exp``, fp32 intermediates fused across ops), so a
compiled model's bits would differ from the eager model's; as a custom op it is opaque, the same
kernel runs eager and compiled. Fused, it is also one launch forward and one backward instead of
torch's three and four.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from det_core import runtime, sr
from det_core.launch import launch
from det_core.runtime import check_kernel_device

from ._library import Op

__all__ = ["swiglu"]

# Columns per program. Elementwise: neither it nor the grid changes any bit (each element runs the
# same fp32 operations on the same values whatever program computes it).
MAX_BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rounded(v, OUT: tl.constexpr):
    # fp32 -> OUT, nearest-even: bit arithmetic for bf16 (the Triton interpreter's cast truncates,
    # so the CPU would round differently from the GPU), the cast for fp16 / fp32
    if OUT == tl.bfloat16:
        return sr.round_nearest_bf16(v)
    else:
        return v.to(OUT)


@triton.jit
def _tile(n_rows, F, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """The tile's row numbers, column offsets and mask: one row (a scalar row, 1-D columns) on the
    GPU, ``ROWS`` rows (``(ROWS, 1)`` rows, ``(1, BLOCK)`` columns) in the interpreter."""
    if ROWS == 1:
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
    else:
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
        mask = (cols < F) & (row < n_rows)
    return row, cols, mask


@triton.jit(do_not_specialize=["R"])  # R is read only by the interpreter's multi-row tiles
def _swiglu_fwd_kernel(x_ptr, y_ptr, R, F, stride_x, stride_y, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    row, cols, mask = _tile(R, F, BLOCK, ROWS)
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(y_ptr + row * stride_y + cols, _rounded(g * s * u, y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _swiglu_bwd_kernel(
    dy_ptr, x_ptr, dx_ptr, R, F, stride_dy, stride_x, stride_dx, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    row, cols, mask = _tile(R, F, BLOCK, ROWS)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dg = dy * u * (s * (1.0 + g * (1.0 - s)))
    du = dy * (g * s)
    out = dx_ptr.dtype.element_ty
    tl.store(dx_ptr + row * stride_dx + cols, _rounded(dg, out), mask=mask)
    tl.store(dx_ptr + row * stride_dx + F + cols, _rounded(du, out), mask=mask)


# Rows per program in the interpreter, which runs programs one after another and each operation as
# one numpy call: a tile of many rows costs about what one row does. On the GPU one row per program.
INTERPRETER_ROWS = 64


def _grid(rows: int, f: int) -> tuple[tuple[int, int], int, int]:
    block = min(MAX_BLOCK, runtime.next_power_of_2(f))
    per = min(INTERPRETER_ROWS, runtime.next_power_of_2(rows)) if runtime.interpreter_active() else 1
    return (runtime.cdiv(rows, per), runtime.cdiv(f, block)), block, per


def _check_packed(x2: torch.Tensor, op: str) -> None:
    # the ops can be called directly (torch.ops.det_train.*): a wrong layout would read the wrong elements
    if x2.dim() != 2 or x2.shape[1] % 2 or x2.dtype not in _DTYPES or (x2.shape[1] > 1 and x2.stride(1) != 1):
        raise ValueError(
            f"{op}: x must be a 2-D (R, 2F) float32 / bfloat16 / float16 tensor with unit last stride, got "
            f"shape {tuple(x2.shape)}, stride {tuple(x2.stride())}, {x2.dtype} (det_train.swiglu reshapes "
            "any (..., 2F) input to this)"
        )


# ----------------------------------------------------------------------------- torch.library ops
@Op("swiglu")
def swiglu_op(x2: torch.Tensor) -> torch.Tensor:
    """The ``det_train::swiglu`` op on a ``(R, 2F)`` tensor with unit last stride: ``(R, F)``."""
    _check_packed(x2, "det_train::swiglu")
    rows, f = x2.shape[0], x2.shape[1] // 2
    y = x2.new_empty((rows, f))
    if rows and f:
        grid, block, per = _grid(rows, f)
        launch(
            _swiglu_fwd_kernel, grid, x2, y, rows, f, x2.stride(0), y.stride(0), BLOCK=block, ROWS=per,
            num_warps=4,
        )  # fmt: skip
    return y


@swiglu_op.register_fake
def _(x2):
    return x2.new_empty((x2.shape[0], x2.shape[1] // 2))


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(ctx, dy):
    runtime.check_first_order("det_train.swiglu")
    (x2,) = ctx.saved_tensors
    return swiglu_backward_op(dy, x2)


swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


@Op("swiglu_backward")
def swiglu_backward_op(dy: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The ``det_train::swiglu_backward`` op: the packed ``(R, 2F)`` gradient ``[dgate | dup]``."""
    _check_packed(x2, "det_train::swiglu_backward")
    rows, f = x2.shape[0], x2.shape[1] // 2
    if tuple(dy.shape) != (rows, f) or dy.dtype != x2.dtype or dy.device != x2.device:
        raise ValueError(
            f"det_train::swiglu_backward: dy must be ({rows}, {f}) {x2.dtype} on {x2.device} for x of shape "
            f"{tuple(x2.shape)}, got {tuple(dy.shape)} {dy.dtype} on {dy.device}"
        )
    dx = x2.new_empty((rows, 2 * f))
    if rows and f:
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        grid, block, per = _grid(rows, f)
        launch(
            _swiglu_bwd_kernel, grid, dy, x2, dx, rows, f, dy.stride(0), x2.stride(0), dx.stride(0),
            BLOCK=block, ROWS=per, num_warps=4,
        )  # fmt: skip
    return dx


@swiglu_backward_op.register_fake
def _(dy, x2):
    return x2.new_empty((x2.shape[0], x2.shape[1]))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating, ``silu(gate) * up``, of a packed gate-and-up projection output.

    Args:
        x: ``(..., 2F)`` float32 / bfloat16 / float16, ``gate = x[..., :F]`` and ``up = x[..., F:]``
            (the halves ``x.chunk(2, dim=-1)`` gives). Rows may be strided; a non-unit last stride is
            copied.

    Returns:
        ``(..., F)`` in ``x``'s dtype: ``silu(gate) * up`` computed in fp32 and rounded once (torch's
        ``F.silu(gate) * up`` rounds twice, after the SiLU and after the product: in bf16 the two
        differ by up to 1 ULP; in fp16 by a few, where torch's SiLU rounds to a subnormal; in fp32
        by a few, the two ``exp``). Differentiable: the gradient is the packed
        ``(..., 2F)`` ``[dgate | dup]``, also fp32 rounded once.

    Raises:
        TypeError: ``x`` not a tensor, or of another dtype.
        ValueError: 0-d ``x``, or an odd or empty last dimension (no gate / up halves).
        RuntimeError: ``x`` on a device our kernels do not run on; a double backward
            (``create_graph=True``).

    **Determinism:** bitwise run to run, and batch-invariant: elementwise, so an element's output
    and gradient depend only on its own gate, up and output-gradient values (one fixed sequence of
    fp32 operations whatever the shape, grid or position), never on the batch or the split into
    micro-batches. Compiled and eager give the same bits (the op is opaque to Inductor). Not across
    GPU models / Triton versions (the ``exp`` lowering).

    Reference: Shazeer, "GLU Variants Improve Transformer" (2020), SwiGLU; SiLU (Hendrycks & Gimpel,
    2016; Elfwing et al., 2018). Fusing the gate into one kernel follows Liger-Kernel's
    ``ops/swiglu.py``; the packed layout follows the fused gate-and-up projections of Megatron-LM.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"swiglu: x must be a torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"swiglu: dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    if x.dim() < 1 or x.shape[-1] % 2 or x.shape[-1] == 0:
        raise ValueError(
            f"swiglu: x must be (..., 2F) with F >= 1, the gate and up halves side by side on the last dim; "
            f"got shape {tuple(x.shape)}"
        )
    check_kernel_device(x, op="swiglu")
    width = x.shape[-1]
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return swiglu_op(x2).view(*x.shape[:-1], width // 2)
