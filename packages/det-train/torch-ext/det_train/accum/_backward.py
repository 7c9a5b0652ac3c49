"""What the accumulator asks autograd's engine about the backward that is running.

The running graph task (``graph_task_id``, -1 outside a backward), its end-of-backward callbacks
(``queue_callback``, run only when that backward finishes without an error), whether a
compiled-autograd graph runs (``in_compiled_autograd``), and whether the running backward
accumulates into a parameter at all (``WantedGradients``: ``torch.autograd.grad`` and
``backward(inputs=...)`` leave the others' ``p.grad`` alone).
"""

from __future__ import annotations

import sys

import torch

from ._messages import grad_of_tracked

__all__ = ["WantedGradients", "graph_task_id", "in_compiled_autograd", "queue_callback"]

graph_task_id = torch._C._current_graph_task_id
queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_will_engine_execute_node = torch._C._will_engine_execute_node


def in_compiled_autograd() -> bool:
    """True while a compiled-autograd graph runs (``torch._dynamo.config.compiled_autograd``), whose
    engine does not run the callbacks queued inside it; not imported unless it is in use."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(module is not None and getattr(module, "in_compiled_autograd_region", False))


def _grad_accumulator(param: torch.Tensor):
    """``param``'s AccumulateGrad node (where autograd would add its gradient), or None when it
    does not require grad."""
    with torch.enable_grad():
        view = param.view_as(param)
    return None if view.grad_fn is None else view.grad_fn.next_functions[0][0]


class WantedGradients:
    """Whether the running backward accumulates into a parameter, from its AccumulateGrad node.

    The det ops deposit their weight gradients from the backward that computes dX, also inside
    ``torch.autograd.grad`` (e.g. an adversarial step's input gradient) or ``backward(inputs=...)``
    without the parameter, where torch leaves ``p.grad`` alone; the accumulator drops those
    deposits. Nodes of tracked parameters are cached for one backward (one not in it is looked up
    again: a dtype or device change through ``.data``, or ``swap_tensors``, gives a new node), and
    ``forget`` drops them when the micro-batch ends: a node kept alive would be reused by the next
    forward, with the stream it was made on, and the engine would sync that stream at the end of
    every later backward (inside a CUDA graph capture, a wait on uncaptured work).

    **Determinism:** a yes / no per deposit from the engine's graph, no value read.
    """

    def __init__(self) -> None:
        self._nodes: dict[int, object] = {}  # tracked parameter index -> its AccumulateGrad node
        self._task = -1  # the graph task the cached nodes were found in

    def forget(self) -> None:
        """Drop the cached nodes (autograd keeps each one only while a graph uses it)."""
        self._nodes = {}
        self._task = -1

    def __call__(self, param: torch.Tensor, index: int | None, names: list[str]) -> bool:
        """True outside a backward, under compiled autograd (no engine to ask) and when ``param``
        (tracked at ``index`` of ``names``, or None) gets its gradient in the running backward.

        Raises:
            RuntimeError: inside ``torch.autograd.grad(..., inputs=[param, ...])``: autograd would
                return the parameter's gradient, but the det ops send it to the accumulator (their
                autograd gradient is None), so neither result would be right.
        """
        task = graph_task_id()
        if task < 0 or in_compiled_autograd():
            return True
        if task != self._task:
            self._nodes, self._task = {}, task
        node = self._nodes.get(index) if index is not None else None
        if node is not None and _runs(node, param, index, names):
            return True
        fresh = _grad_accumulator(param)  # not cached, or not in this backward: the current node
        if fresh is None:
            return True
        if index is not None:
            self._nodes[index] = fresh
        return fresh is not node and _runs(fresh, param, index, names)


def _runs(node, param: torch.Tensor, index: int | None, names: list[str]) -> bool:
    try:
        return _will_engine_execute_node(node)
    except RuntimeError:  # a leaf's node during torch.autograd.grad: asked for this parameter
        name = names[index] if index is not None else f"a parameter of shape {tuple(param.shape)}"
        raise RuntimeError(grad_of_tracked(name)) from None
