"""Host side of the fused step: the launch tables of ``_kernel`` and the launch itself.

Reading order: the exactness options and the fixed launch config, the chunk table (BLOCK-element
windows 4-aligned in the global index), the tensor table of a role (element offsets from its
lowest-address tensor), ``LaunchPlan`` (a launch's device tables, cached by the caller while the
tensors' addresses stay the same) and ``launch_fused_step``. The table layouts are described in
``_kernel``'s module docstring; nothing here changes a result bit (``launch_config``'s entries
only change which thread computes what).
"""

from __future__ import annotations

import torch
from det_core import rng, runtime
from det_core.launch import PlanCache, launch

from . import _kernel, _state_codes
from ._kernel import (
    CHUNK_TABLE_COLUMNS,
    FORMAT_8BIT,
    FORMAT_BF16,
    FORMAT_FP32,
    SCALAR_TABLE_COLUMNS,
    SCALARS_BLOCK,
)

__all__ = [
    "LaunchPlan",
    "build_chunk_table",
    "exactness_options",
    "launch_config",
    "launch_fused_step",
    "to_device_async",
]


def exactness_options() -> dict:
    """Launch options that make the GPU's fp32 arithmetic IEEE like the CPU reference's.

    ``enable_fp_fusion=False``: no ``a * b + c`` contracted into an FMA. ``enable_reflect_ftz=False``:
    libdevice's ``div_rn``/``sqrt_rn`` keep subnormals instead of flushing them to zero (Triton's
    default flushes); passed only where the installed Triton knows the option.

    Returns: a dict of ``triton`` compile options (``bool`` values).

    **Determinism:** these options are what makes the GPU's results bitwise equal to the CPU
    reference; every launch of this package passes them.
    """
    options = {"enable_fp_fusion": False}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__:
            options["enable_reflect_ftz"] = False
    except ImportError:  # no NVIDIA backend: nothing to flush
        pass
    return options


_EXACTNESS_OPTIONS: dict = {}


_STATE_CONFIG_KEYS = {FORMAT_BF16: "cuda-bf16", FORMAT_8BIT: "cuda-8bit"}


def launch_config(device: torch.device, state_format: int = FORMAT_FP32) -> dict:
    """The fixed launch config for ``device`` and the moments' format (``_kernel.FORMAT_*``): a dict
    ``BLOCK``, ``SUB``, ``num_warps``, ``TILE_2D``, ``PRECOMPUTED``, and for the bf16 / 8-bit kernel on
    CUDA ``EDGE_SUB`` (optional ``maxnreg``); see ``_kernel.LAUNCH_CONFIGS``.

    **Determinism:** a fixed table keyed by the device type and the moments' format, no autotuning;
    no entry changes a result bit.
    """
    if device.type != "cuda":
        return _kernel.LAUNCH_CONFIGS["interpreter"]
    return _kernel.LAUNCH_CONFIGS[_STATE_CONFIG_KEYS.get(state_format, "cuda")]


def build_chunk_table(segments: torch.Tensor, block: int) -> torch.Tensor:
    """Windows of ``block`` elements, 4-aligned in the global index, covering every segment.

    Args:
        segments: int64 CPU tensor ``[S, 4]`` of ``(slot, local_start, length, global_start)``;
            a segment is a run of elements contiguous both in the local tensor and in the global index.
        block: window size, a multiple of 4.

    Returns:
        int64 CPU tensor ``[C, 5]``: ``(slot, window_local_start, segment_local_start,
        segment_local_end, window_global_start)`` with ``window_global_start % 4 == 0``.

    **Determinism:** a pure function of ``segments`` and ``block``; the windows only decide which
    program computes an element, never its bits.
    """
    if segments.numel() == 0:
        return torch.zeros((0, CHUNK_TABLE_COLUMNS), dtype=torch.int64)
    slot, local_start, length, global_start = segments.unbind(1)
    lead = global_start & 3  # elements between the 4-aligned window start and the segment start
    n_windows = runtime.cdiv(length + lead, block)  # elementwise on the int64 tensors
    seg_of_window = torch.repeat_interleave(torch.arange(len(segments)), n_windows)
    first_window = torch.cumsum(n_windows, 0) - n_windows
    k = torch.arange(int(n_windows.sum())) - first_window[seg_of_window]
    offset = k * block - lead[seg_of_window]
    return torch.stack(
        [
            slot[seg_of_window],
            local_start[seg_of_window] + offset,
            local_start[seg_of_window],
            (local_start + length)[seg_of_window],
            global_start[seg_of_window] + offset,
        ],
        dim=1,
    ).contiguous()


def _role_table(tensors: list[torch.Tensor]) -> tuple[int, list[int], bool]:
    """The position of a role's lowest-address tensor, each tensor's element offset from it, and
    whether all are 16-byte aligned."""
    size = tensors[0].element_size()
    addresses = [t.data_ptr() for t in tensors]
    low = min(range(len(tensors)), key=addresses.__getitem__)
    offsets = []
    aligned = True
    for a in addresses:
        diff = a - addresses[low]
        if diff % size:
            raise RuntimeError("adamw_sr: tensors of one role are not element-aligned to each other")
        offsets.append(diff // size)
        aligned &= (diff // size) % 8 == 0
    aligned &= addresses[low] % 16 == 0
    return low, offsets, aligned


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to ``device`` without blocking the host (pinned staging on CUDA).

    A copy from pageable memory would wait for the stream to drain, serializing host and GPU.
    Returns the copy (``t`` itself's copy on CPU); any shape and dtype.

    **Determinism:** a copy, in stream order before any later launch on the current stream.
    """
    if device.type != "cuda" or torch.compiler.is_compiling():
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# device chunk tables by segments: they depend on shapes and indices, not addresses, so launch plans
# of the same params with new gradient tensors share one
_CHUNK_TABLES = PlanCache(limit=16)


def _chunk_table(segments: torch.Tensor, block: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The device chunk table of ``segments`` and whether every window starts 8-aligned (cached)."""
    key = (device, block, segments.numpy().tobytes())
    hit = _CHUNK_TABLES.get(key)
    if hit is None:
        chunks = build_chunk_table(segments, block)
        # windows start 8-aligned in every tensor only if each local window start is a multiple of 8
        starts_aligned = bool(((chunks[:, 1] % 8) == 0).all()) if len(chunks) else True
        hit = _CHUNK_TABLES.put(key, (to_device_async(chunks, device), starts_aligned))
    return hit


class LaunchPlan:
    """Device tables of one launch, cached while the tensors' addresses and layout stay the same.

    Holds no reference to the tensors (a cached plan must not keep freed gradients alive): only
    which position of each role has the lowest address, which the launch uses as the base pointer.
    ``config`` overrides the entry of ``_kernel.LAUNCH_CONFIGS`` (benchmarks compare variants; no
    variant changes a result bit).

    Args: the role lists of ``launch_fused_step`` (contiguous tensors, one per param); ``segments``
    int64 CPU ``[S, 4]`` (slot, local start, length, global start); ``device``; ``state_format``
    (``_kernel.FORMAT_*``) and, for 8 bits, the uint8 scale tensors.

    Raises:
        ValueError: a ``config`` whose ``BLOCK`` is not a multiple of ``SUB``, ``SUB`` not of 8 and
            of ``EDGE_SUB``, ``EDGE_SUB`` not of 8 (with 8-bit moments: not of the block size), or an
            ``EDGE_SUB`` other than ``SUB`` with fp32 moments.
        RuntimeError: tensors of one role that are not element-aligned to each other.

    **Determinism:** the tables are a pure function of the tensors' addresses, dtypes and the
    segments.
    """

    def __init__(
        self, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, segments, device, config=None, *,
        state_format=FORMAT_FP32, exp_avg_scales=(), exp_avg_sq_scales=(),
    ):  # fmt: skip
        self.config = dict(config or launch_config(device, state_format))
        self.block = self.config["BLOCK"]
        self.state_format = state_format
        sub = self.config["SUB"]
        self.edge_sub = self.config.get("EDGE_SUB", sub)
        # tiles start 8-aligned in every tensor (the ALIGNED hints rely on it) and 4-aligned globally
        if self.block % sub or sub % 8 or sub % self.edge_sub or self.edge_sub % 8:
            raise ValueError(
                f"adamw_sr: launch config {self.config}: BLOCK must be a multiple of SUB, SUB of 8 and "
                "of EDGE_SUB, EDGE_SUB of 8"
            )
        if state_format == FORMAT_FP32 and self.edge_sub != sub:
            raise ValueError(f"adamw_sr: launch config {self.config}: EDGE_SUB is for bf16 / 8-bit moments")
        # with 8-bit moments every tile starts on a block (segments start on one): whole blocks per tile
        if state_format == FORMAT_8BIT and self.edge_sub % _state_codes.QUANT_BLOCK:
            raise ValueError(
                f"adamw_sr: launch config {self.config}: with 8-bit states SUB and EDGE_SUB must be "
                f"multiples of the block size {_state_codes.QUANT_BLOCK}"
            )
        self.num_warps = self.config["num_warps"]
        roles = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or exp_avg_sqs]
        lowest, columns, aligned = [], [], True
        for tensors in roles:
            low, offsets, role_aligned = _role_table(tensors)
            lowest.append(low)
            columns.append(offsets)
            aligned &= role_aligned
        if state_format == FORMAT_8BIT:
            for tensors in (exp_avg_scales, exp_avg_sq_scales):  # read per block: no vector hints
                low, offsets, _ = _role_table(tensors)
                lowest.append(low)
                columns.append(offsets)
        self.lowest = lowest
        table = torch.tensor(list(zip(*columns, strict=True)), dtype=torch.int64).reshape(-1, len(columns))
        self.tensor_table = to_device_async(table, device)
        self.num_tensors = len(table)
        # per-tensor fp32 scalars, rewritten by the scalar kernel at every step (PRECOMPUTED)
        self.scalars = torch.empty(
            (self.num_tensors, SCALAR_TABLE_COLUMNS), dtype=torch.float32, device=device
        )
        self.chunk_table, starts_aligned = _chunk_table(segments, self.block, device)
        self.aligned = aligned and starts_aligned
        self.num_chunks = len(self.chunk_table)


def launch_fused_step(
    plan: LaunchPlan,
    roles: tuple[list[torch.Tensor], ...],
    steps: torch.Tensor,
    hyper: torch.Tensor,
    *,
    seed: int,
    amsgrad: bool,
    maximize: bool,
    param_bf16: bool,
    stochastic: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    state_stochastic: bool = True,
    scales: tuple[list[torch.Tensor], list[torch.Tensor]] = ((), ()),
):
    """Run the fused step over a prepared ``LaunchPlan`` (no checks: callers validate first).

    ``roles`` are the lists the plan was built from, in order: params, grads, exp_avgs, exp_avg_sqs,
    max_exp_avg_sqs (``exp_avg_sqs`` again without amsgrad); ``scales`` the 8-bit plan's
    ``(exp_avg_scales, exp_avg_sq_scales)``. ``steps``: fp32 ``[T]``, ``hyper``: fp64 ``[5]``, on
    the device. ``state_stochastic``: bf16 / 8-bit moments are rounded stochastically (else to
    nearest-even). ``grad_scale`` / ``found_inf`` (1-element fp32 tensors on the device, as
    ``torch.amp.GradScaler`` sets them): gradients are unscaled in the kernel (and written back
    unscaled), and a nonzero ``found_inf`` makes the kernel write nothing. With the config's
    ``PRECOMPUTED``, two launches in stream order: the per-tensor scalars, then the step.

    Returns: Triton's handle of the step kernel (benchmarks read its register count), or ``None``
    when there is nothing to do.

    **Determinism:** the kernels' (``_kernel.adamw_sr_kernel``): each element's bits are a pure
    function of its inputs, the hyperparameters, ``(seed, step)`` and its global index.
    """
    if plan.num_chunks == 0:
        return None
    if not _EXACTNESS_OPTIONS:
        _EXACTNESS_OPTIONS.update(exactness_options())
    config = plan.config
    if config["PRECOMPUTED"]:
        launch(
            _kernel.step_scalars_kernel,
            (runtime.cdiv(plan.num_tensors, SCALARS_BLOCK),),
            steps,
            hyper,
            plan.scalars,
            plan.num_tensors,
            BLOCK_T=SCALARS_BLOCK,
            num_warps=4,
            **_EXACTNESS_OPTIONS,
        )
    seed_lo, seed_hi = rng.split_seed(seed)
    p, g, m, v, vmax = (tensors[low] for tensors, low in zip(roles, plan.lowest[:5], strict=True))
    tables = (plan.tensor_table, plan.chunk_table, steps, hyper, plan.scalars)
    # an unread fp32 pointer where AMP's scalars are not given
    amp = (steps if grad_scale is None else grad_scale, steps if found_inf is None else found_inf)
    meta = dict(
        AMSGRAD=amsgrad,
        MAXIMIZE=maximize,
        PARAM_BF16=param_bf16,
        STOCHASTIC=stochastic,
        ALIGNED=plan.aligned and not runtime.interpreter_active(),
        BLOCK=plan.block,
        SUB=config["SUB"],
        TILE_2D=config["TILE_2D"],
        PRECOMPUTED=config["PRECOMPUTED"],
        UNSCALE=grad_scale is not None,
        SKIP_ON_INF=found_inf is not None,
        num_warps=plan.num_warps,
        **_EXACTNESS_OPTIONS,
    )
    if plan.state_format == FORMAT_FP32:
        return launch(
            _kernel.adamw_sr_kernel, (plan.num_chunks,), p, g, m, v, vmax, *tables,
            seed_lo, seed_hi, rng.STREAM_PARAM_SR, *amp, **meta,
        )  # fmt: skip
    ms, vs = m, v  # unread pointers with bf16 moments
    if plan.state_format == FORMAT_8BIT:
        ms, vs = (tensors[low] for tensors, low in zip(scales, plan.lowest[5:], strict=True))
    if "maxnreg" in config:
        meta["maxnreg"] = config["maxnreg"]
    return launch(
        _kernel.adamw_sr_states_kernel, (plan.num_chunks,), p, g, m, v, vmax, ms, vs, *tables,
        seed_lo, seed_hi, rng.STREAM_PARAM_SR, *amp,
        STATE=plan.state_format, STATE_STOCHASTIC=state_stochastic, EDGE_SUB=plan.edge_sub, **meta,
    )  # fmt: skip
