"""Fixed-address folds (``CanonicalGradAccumulator.fixed_folds``): each registered weight's open leaf
lives in buffers allocated once (a Linear weight's fp32 fold, an RMSNorm weight's sub-leaf folds, an
embedding table's rows), so a micro-batch's weight-gradient deposit is kernels into fixed memory with
no host bookkeeping per call.

Why: a deposit through ``deposit.rows`` decides on the host, at every call, where its rows go (which
leaf, a new fold or a continued one, a node of the tree), so no CUDA graph can hold it
(``torch.compile(mode="reduce-overhead")`` runs it between graph partitions) and its Python is host
time at every call. With fixed folds the forward hands the op the weight's buffers (graph inputs
under ``torch.compile``), the backward's fold op continues them in place and adds 1 to the weight's
device counter, and the bookkeeping runs once per micro-batch, here: ``begin`` checks the micro-batch
and zeroes the folds when it starts a leaf, ``end`` hands a completed leaf's node to the tree (a new
tensor: the buffers hold the next leaf) or records how far the open one reaches, and ``reduce``
reads the counters once (``check_counts``).

Between micro-batches the open leaf is an ordinary ``OpenFold`` carry entry of slot ``(index,
FIXED_USE)`` whose state is the buffer itself, so ``reduce``'s checks and the data-parallel reduction
see it as any open leaf (a short last leaf is closed there by the same close).

**Determinism:** a fold continues its buffer from +0.0 at a leaf's start exactly as a fold from zero
starts (``weight_grad_fold``'s ``RESUME`` from a zeroed buffer adds the same products to the same
+0.0; the sub-leaf folds likewise), resumed at multiples of its token step inside the leaf, and an
embedding leaf is summed from its rows by the plain path's kernel: a leaf's node has the plain
path's bits, and the nodes join the parameter's canonical tree as any leaf's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ._messages import slot_name, token_mismatch
from ._open_leaf import OpenFold

__all__ = ["FIXED_USE", "FixedFolds", "fold_for", "fold_once", "register"]

# The use number of a fixed fold's slot: before every deposit's use (0, 1, ...), so its root is added
# first. A weight's other uses keep their numbers (a tied embedding table: use 0).
FIXED_USE = -1


def _not_advanced(rows: tuple, state) -> None:
    raise AssertionError("a fixed fold is continued by its op's kernel, never through deposit_rows")


# An op's fixed fold, from its ``fixed_fold_spec(param, leaf_tokens)``: (buffer shape, token step,
# close(buffer, tokens) -> the leaf's fp32 node, a new tensor: the buffer holds the next leaf). A shape
# gives one fp32 buffer, zeroed when a leaf starts; a callable ``make(param)`` gives the op's own
# buffers (a tuple of tensors, e.g. an embedding table's rows), which are not zeroed (the op writes
# every row it reads).
FoldSpec = tuple


class FixedFolds:
    """The fixed folds of one accumulator, by tracked parameter index: ``folds`` (the buffer, or the
    op's buffers), the token step each is continued in, its close, its ``counts`` (an int64 device
    scalar each fold op adds 1 to, read once at ``reduce``: every weight folded once per micro-batch),
    the weight's dtype and shape it was made for and the op that continues it; ``by_id`` finds a
    weight's index from the Parameter the forward sees; ``pos`` (int64, on the folds' device) holds
    the micro-batch's first token within its leaf, for kernels that place rows by it."""

    __slots__ = (
        "folds",
        "steps",
        "closes",
        "counts",
        "made_for",
        "ops",
        "by_id",
        "by_count",
        "seen",
        "pos",
        "micro_batches",
        "behind",
    )

    def __init__(self) -> None:
        self.folds: dict[int, torch.Tensor | tuple] = {}  # tracked parameter index -> its fold buffer(s)
        self.steps: dict[int, int] = {}  # index -> the op's token step (a continued leaf's offsets)
        self.closes: dict[int, Callable] = {}  # index -> close(fold, tokens) -> the leaf's node
        self.counts: dict[int, torch.Tensor] = {}  # index -> folds made since the last reduce (device)
        self.made_for: dict[int, tuple] = {}  # index -> the weight's (dtype, shape) when its fold was made
        self.ops: dict[int, str] = {}  # index -> the op whose backward continues the fold
        self.by_id: dict[int, int] = {}  # id(parameter) -> index
        self.by_count: dict[int, int] = {}  # id(count tensor) -> index (what a fold op receives)
        self.seen: set[int] = set()  # the indices folded in this micro-batch (op bodies that ran)
        self.pos: torch.Tensor | None = None
        self.micro_batches = 0  # micro-batches completed since the last reduce or reset
        # (device, bool per fold) a fold's count was behind the micro-batches at some micro-batch's end
        self.behind: torch.Tensor | None = None

    def add(self, index: int, param: torch.Tensor, spec: FoldSpec, op: str) -> None:
        if index in self.folds:
            return
        shape, step, close = spec
        if callable(shape):
            fold = tuple(_static(t) for t in shape(param))
        else:
            fold = _static(torch.zeros(shape, dtype=torch.float32, device=param.device))
        if self.pos is None:
            self.pos = _static(torch.zeros((), dtype=torch.int64, device=param.device))
        elif self.pos.device != param.device:
            raise ValueError(
                f"fixed folds on {self.pos.device} and {param.device}: one accumulator's fixed folds live "
                "on one device"
            )
        count = _static(torch.zeros((), dtype=torch.int64, device=param.device))
        self.folds[index], self.steps[index], self.closes[index] = fold, step, close
        self.counts[index], self.made_for[index], self.ops[index] = count, (param.dtype, param.shape), op
        self.by_id[id(param)], self.by_count[id(count)] = index, index

    def clear(self) -> None:
        """After a reduce or a reset: no fold counted, no micro-batch."""
        torch._foreach_zero_(list(self.counts.values()))
        self.micro_batches = 0
        self.behind = None

    def begin(self, acc, offset: int, tokens: int) -> None:
        """Before a micro-batch of ``tokens`` tokens at ``offset``: check it stays inside one leaf,
        continues its leaf at a step boundary (or starts a leaf no micro-batch filled), and that the
        weights kept their dtypes; zero the folds when it starts a leaf. Raises ValueError (nothing
        changed) when it does not fit."""
        leaf, j = acc.leaf_tokens, offset // acc.leaf_tokens
        changed = [
            i for i, made in self.made_for.items() if (acc._params[i].dtype, acc._params[i].shape) != made
        ]
        if changed:
            i = changed[0]
            dtype, shape = self.made_for[i]
            raise ValueError(
                f"{acc._names[i]}: its dtype or shape changed after fixed_folds ({dtype} {tuple(shape)} -> "
                f"{acc._params[i].dtype} {tuple(acc._params[i].shape)}), and its fold was laid out for the "
                "old one: build a new accumulator (and call fixed_folds) after casting or resizing the model"
            )
        if offset % leaf + tokens > leaf:
            raise ValueError(
                f"micro_batch(token_offset={offset}, num_tokens={tokens}) crosses a leaf boundary "
                f"(leaf_tokens {leaf}), and this accumulator has fixed folds, which hold one open leaf: "
                "use micro-batches inside one leaf each (micro-batch tokens dividing leaf_tokens), or an "
                "accumulator without fixed_folds"
            )
        if offset % leaf == 0:
            open_keys = [key for key in acc._carry if key[1] == FIXED_USE]
            if open_keys:
                held = acc._carry[open_keys[0]]
                raise ValueError(
                    f"micro_batch(token_offset={offset}) starts leaf {j} while leaf {open_keys[0][2]} is "
                    f"open (tokens [{held.start}, {held.end}) so far): fixed folds hold one open leaf, so "
                    f"complete it first (the next micro-batch starts at token {held.end}), or use an "
                    "accumulator without fixed_folds for micro-batches in another order"
                )
            filled = [acc._names[i] for i in self.folds if _covers(acc._partials.get((i, FIXED_USE)), j)]
            if filled:
                raise ValueError(
                    f"{slot_name(filled[0], FIXED_USE)}: leaf {j} (tokens [{offset}, {offset + leaf})) was "
                    "already folded by an earlier micro-batch of this step: micro-batches overlap (with "
                    "fixed folds every micro_batch context counts, an evaluation forward inside one too: "
                    "run it outside, or acc.reset() and run the step again)"
                )
            zeroed = [f for f in self.folds.values() if isinstance(f, torch.Tensor)]  # (not the rows)
            if zeroed:
                torch._foreach_zero_(zeroed)
            self.pos.zero_()
        else:
            misaligned = sorted({step for step in self.steps.values() if offset % leaf % step})
            if misaligned:
                step = math.lcm(*self.steps.values())  # what every fold resumes on
                raise ValueError(
                    f"micro_batch(token_offset={offset}) continues its leaf {offset % leaf} tokens in, not "
                    f"a multiple of the fixed folds' token steps ({misaligned} do not divide it: the "
                    "previous micro-batch's num_tokens did not): a fold resumes only at whole steps. Use "
                    f"micro-batch sizes that are multiples of {step} tokens inside a leaf (only the "
                    "batch's last may be shorter)"
                )
            for index in self.folds:
                key = (index, FIXED_USE, j)
                if key not in acc._carry or acc._carry[key].end != offset:
                    raise ValueError(
                        f"{acc._names[index]}: the fixed fold of leaf {j} does not end at token {offset}: "
                        "fixed_folds was called inside a step; call it before the step's first micro-batch"
                    )
            self.pos.fill_(offset % leaf)
        self.seen = set()

    def end(self, acc, offset: int, tokens: int) -> None:
        """After a micro-batch that succeeded: a leaf it completed joins each weight's tree (its node,
        a new tensor); an open one is recorded as the weight's carry entry up to ``offset + tokens``."""
        leaf = acc.leaf_tokens
        end, j = offset + tokens, offset // leaf
        start = j * leaf
        for index, fold in self.folds.items():
            key = (index, FIXED_USE, j)
            close = functools.partial(self.closes[index], tokens=end - start)
            if end % leaf == 0:
                if key in acc._carry:
                    acc._set_carry(key, None)
                acc._add_node(key[:2], j, close(fold))
            else:  # (a short last leaf is closed by reduce, through the carry entry's close)
                acc._set_carry(key, OpenFold(start, (self.steps[index], _not_advanced, close), end, fold))
        self.micro_batches += 1
        # recorded on the device (no host read): a count behind the micro-batches here means a fold
        # missing, or made after its micro-batch (a backward run after the `with` block, where no fold
        # op's Python check runs: a CUDA graph's replay), into a leaf this end may have closed
        behind = torch.stack(list(self.counts.values())) != self.micro_batches
        self.behind = behind if self.behind is None else self.behind.logical_or_(behind)

    def check_counts(self, acc) -> None:
        """At ``reduce``: every fixed-fold weight was folded once in each micro-batch of the step, inside
        it (one device read). Raises ValueError naming those that were not."""
        if not self.counts:
            return
        counts = torch.stack(list(self.counts.values()))
        behind = torch.zeros_like(counts) if self.behind is None else self.behind.to(torch.int64)
        counts, behind = torch.stack([counts, behind]).tolist()
        wrong = [
            (acc._names[i], f"{n}x" if n != self.micro_batches else f"{n}x, one after its micro-batch")
            for i, n, late in zip(self.counts, counts, behind, strict=True)
            if n != self.micro_batches or late
        ]
        if wrong:
            shown = ", ".join(f"{name} {n}" for name, n in wrong[:8]) + (" ..." if len(wrong) > 8 else "")
            raise ValueError(
                f"fixed folds: {len(wrong)} weight(s) were not folded exactly once in each of this step's "
                f"{self.micro_batches} micro-batches ({shown}): a micro-batch whose backward did not "
                "run, a module skipped, a weight frozen after fixed_folds (requires_grad=False), used "
                "twice, or a backward run after its micro-batch. Their gradients are not the batch's: "
                "acc.reset() and run the step again with each weight used once per micro-batch (or use "
                "an accumulator without fixed_folds for such a model)"
            )


def _covers(tree, leaf: int) -> bool:
    """Whether a partial tree holds a node whose leaves include ``leaf``."""
    return tree is not None and any(index == leaf >> level for level, index in tree.nodes)


def _static(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked as a static input of compiled graphs: its address never changes, so CUDA-graph
    trees read it in place (no copy into the graph's pool) and may capture kernels that write it."""
    torch._dynamo.mark_static_address(t)
    return t


def register(acc, module: torch.nn.Module) -> None:
    """``CanonicalGradAccumulator.fixed_folds``: a fixed fold for every eligible weight of ``module``
    (its checks and errors are documented there)."""
    from ..ops import embedding, linear, rms_norm  # (the ops import the accumulator)

    if acc.recoverable:
        raise ValueError(
            "fixed_folds continues each weight's fold in place, which an undo log cannot undo: build the "
            "accumulator with CanonicalGradAccumulator(..., recoverable=False)"
        )
    if acc._holds_deposits() or acc._token_offset is not None:
        raise ValueError(
            "fixed_folds: this accumulator holds deposits of a step in progress: call it before the "
            "step's first micro-batch (or after reduce / reset)"
        )
    found = [  # (weight, its op module's fixed_fold_spec, the op's public name)
        (m.weight, op.fixed_fold_spec, f"det_train.{op.__name__.rsplit('.', 1)[-1]}")
        for m in module.modules()
        for op in (linear, rms_norm, embedding)
        if op.takes_fixed_fold(m)
    ]
    holders: dict[int, int] = {}
    for _, m in module.named_modules(remove_duplicate=False):  # every holder, a module used twice too
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    chosen = [(w, spec, name) for w, spec, name in found if holders[id(w)] == 1 and id(w) in acc._index]
    if any(acc._index[id(w)] in acc._fsdp for w, _, _ in chosen):
        raise ValueError("fixed_folds: FSDP2-sharded weights (track_fsdp) do not take fixed folds")
    if not chosen:
        raise ValueError(
            f"fixed_folds: {type(module).__name__} has no det_train.Linear, RMSNorm or Embedding whose "
            "weight this accumulator tracks (and no other module shares): convert the model first "
            "(det_train.convert) and build the accumulator from its parameters"
        )
    acc._fixed = acc._fixed or FixedFolds()
    for weight, spec, name in chosen:
        acc._fixed.add(acc._index[id(weight)], weight, spec(weight, acc.leaf_tokens), name)


def fold_for(acc, weight: torch.Tensor, tokens: int, op: str) -> tuple | None:
    """``(fold, count)`` of ``weight`` in ``acc`` for a forward over ``tokens`` rows that records
    autograd (a forward under ``no_grad`` gets none), or None. Raises ValueError when ``tokens`` is
    not the micro-batch's ``num_tokens``."""
    if acc._fixed is None or not torch.is_grad_enabled():
        return None
    index = acc._fixed.by_id.get(id(weight))
    if index is None or acc._fixed.ops[index] != op:  # a weight tied to another kind of op: plain
        return None
    if tokens != acc._tokens:
        raise ValueError(token_mismatch(acc, tokens, weight, op))
    return acc._fixed.folds[index], acc._fixed.counts[index]


def fold_once(acc, count: torch.Tensor, op: str) -> None:
    """A fold op's check when its body runs (eager, and compiled graphs outside CUDA graphs): the
    fold identified by its ``count`` is continued once in this micro-batch; raises ValueError at a
    second time (two uses of the weight, or a second backward). A count ``acc`` did not make (a test
    calling the op directly) is not checked."""
    fixed = acc._fixed
    index = None if fixed is None else fixed.by_count.get(id(count))
    if index is None:
        return
    if index in fixed.seen:
        raise ValueError(
            f"{acc._names[index]} ({op}): its fixed fold was continued twice in this micro-batch (the weight "
            "used by two ops, or a second backward): fixed folds take one use per micro-batch, in token "
            "order. Build the accumulator without fixed_folds for this model, or run each token range in "
            "its own micro_batch"
        )
    fixed.seen.add(index)
