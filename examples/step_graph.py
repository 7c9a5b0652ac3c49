"""The main job's training step captured in one CUDA graph (PyTorch's whole-network capture
recipe), for examples/bench_step.py and the CUDA-graph end-to-end test; and the one-line description
of the error that stopped a capture."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parent.parent


class GraphStepError(RuntimeError):
    """A step that could not be run as a CUDA graph; the message starts with the failed phase
    ("warm-up failed", "capture failed", "replay failed") and names the first error."""


def graphed(s, warmup: int = 3) -> Callable[[], None]:
    """``s`` (a ``bench_step.Step``) captured in one CUDA graph; returns the replay (copy a batch
    into the static inputs, replay).

    ``warmup`` eager steps on a side stream first compile the Triton kernels, create the optimizer
    states and fill the host-side caches (launch plans, configs) that capture cannot build; the
    captured step then runs the same Python on the same shapes. One replay runs here to check that
    the graph updates the weights. So the weights have taken ``warmup + 1`` steps on return.

    Raises:
        GraphStepError: naming the phase that failed, the original error chained.
    """
    batch_x, batch_y = s.x.clone(), s.y.clone()  # "the next batch" (the same tokens: timing only)
    phase = "warm-up"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                s.run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        phase = "capture"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            s.run()
        phase = "replay"

        def replay():
            s.x.copy_(batch_x, non_blocking=True)
            s.y.copy_(batch_y, non_blocking=True)
            graph.replay()

        weight = next(p for p in s.model.parameters() if p.dim() == 2)
        before = weight.detach().clone()
        replay()
        torch.cuda.synchronize()
        if torch.equal(before, weight.detach()):
            raise RuntimeError("a replay left the weights unchanged: the captured step does not update them")
    except Exception as exc:
        raise GraphStepError(f"{phase} failed: {_describe(exc)}") from exc
    return replay


def _describe(exc: BaseException) -> str:
    """``Type: first line of the message at file:line (function)`` of the error that started the
    chain (a failed capture often raises again when the capture is ended: the first error is the
    informative one), located at its innermost frame in this repository."""
    chain = [exc]
    while True:
        last = chain[-1]
        nxt = last.__cause__ or (None if last.__suppress_context__ else last.__context__)
        if nxt is None or nxt in chain:
            break
        chain.append(nxt)
    first = chain[-1]
    lines = str(first).strip().splitlines()
    text = f"{type(first).__name__}: {lines[0] if lines else ''}"
    frames = traceback.extract_tb(first.__traceback__)
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(_REPO)]
    if frames:
        frame = (ours or frames)[-1]
        where = Path(frame.filename).resolve().relative_to(_REPO) if ours else Path(frame.filename).name
        text += f" at {where}:{frame.lineno} ({frame.name})"
    if first is not exc:
        outer = str(exc).strip().splitlines()
        text += f" (then {type(exc).__name__}: {outer[0] if outer else ''})"
    return text
