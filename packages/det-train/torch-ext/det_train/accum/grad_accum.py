"""Canonical-order parameter gradients across micro-batches and data-parallel ranks.

A parameter gradient summed over tokens (a Linear weight and bias, an RMSNorm weight, an Embedding
table) is defined in one order that depends only on the global batch (det_core.reduce): the global
token axis is cut into leaves of ``leaf_tokens`` tokens, each leaf is summed in fp32 in an order fixed
by the op, and the leaves are combined by the fixed pairwise tree over global leaf indices
(``TreePartial``). Ops deposit their per-leaf sums here while a ``micro_batch`` is active; ``reduce``
merges the partial trees of every micro-batch and every data-parallel rank and writes ``p.grad``.

A micro-batch may end inside a leaf: the ops then hand over the rows of the unfinished leaf (their
inputs to the gradient, e.g. dY and X of a Linear) and the accumulator keeps them until the next
micro-batch completes the leaf, or until ``reduce`` when the leaf ends the global batch. The leaf is
then summed from all its rows by the same kernel as an aligned one, so any micro-batch sizes give
the bits of one batch.

An op's rows may be tokens x a row group (``rows_per_token``, a per-head q/k norm's heads, token-major):
leaves stay ``leaf_tokens`` tokens and micro-batch boundaries tokens, so the sums have one batch's bits.

Interface: ``deposit_rows`` (any micro-batch boundaries; the ops reach it through ``deposit.rows``)
and ``leaf_span`` + ``deposit`` / ``deposit_partial`` (leaf-aligned micro-batches). The checks at
reduce time and the cross-rank reduction are in ``_reduce.py``, what entering and leaving a micro-batch
does in ``_micro_batch.py``, the error messages in ``_messages.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from det_core.reduce import TreePartial, num_leaves
from det_core.runtime import as_index

from . import _micro_batch, _reduce, dp_reduce
from ._backward import WantedGradients
from ._fixed_folds import FixedFolds, register
from ._messages import frozen_hint, slot_name, token_mismatch, who
from ._micro_batch import ACTIVE as _ACTIVE  # the active accumulators, innermost last
from ._open_leaf import LeafFold, LeafPartial, OpenFold, OpenLeaf, foreach_copy, place_rows, token_rows
from ._slots import take_slot, tracked_param
from ._step_guard import mark_reduced, supersede
from ._undo_log import NoUndoLog, UndoLog

__all__ = ["DEFAULT_LEAF_TOKENS", "CanonicalGradAccumulator", "current_accumulator"]

# Leaf size used by the ops when no accumulator is active (part of each op's reduction order) and
# the accumulator's default. 8192 tokens: each leaf close costs the dW kernel tensor-core time, a
# large share at 1024-token leaves and little at 8192 (see docs/benchmarks.md); micro-batches of any
# size still split a batch freely (an unfinished leaf's rows are carried); data-parallel shards must
# be multiples of it.
DEFAULT_LEAF_TOKENS = 8192


def current_accumulator() -> CanonicalGradAccumulator | None:
    """The accumulator whose ``micro_batch`` context is active, or None outside every context.

    Returns:
        The innermost active ``CanonicalGradAccumulator`` (contexts nest per thread of Python
        execution; the last entered wins), or None. Raises nothing.

    **Determinism:** a lookup only; ops that find an accumulator deposit leaf sums into it instead
    of returning a gradient, which is what makes their weight gradients micro-batch invariant.
    """
    return _ACTIVE[-1] if _ACTIVE else None


class CanonicalGradAccumulator:
    """Collects per-leaf fp32 gradient sums and finishes them in the canonical order.

    Args:
        params: the parameters to track, as ``Parameter``s or ``(name, Parameter)`` pairs (e.g.
            ``model.named_parameters()``, which gives better error messages). Parameters with
            ``requires_grad=False`` are ignored. Every data-parallel rank must pass the same
            parameters in the same order (their position is the key exchanged between ranks).
        leaf_tokens: tokens per leaf of the canonical order (positive; default
            ``DEFAULT_LEAF_TOKENS`` = 8192). Micro-batches may have any size: one that ends inside
            a leaf leaves it open, and a later micro-batch on this rank continues it from the token
            where it ended. Every other micro-batch starts on a leaf boundary, so data-parallel
            shards are multiples of ``leaf_tokens`` (except the one ending the global batch).
        recoverable: keyword only. True (default): a micro-batch whose ``with`` block raises leaves no
            deposit behind (an undo log keeps old folds and tree nodes until it succeeds). False: no
            undo log, open folds continued in their buffers and consumed nodes freed at once (the
            canonical tree's least memory, below; the same bits); a micro-batch that raises after its
            deposits began poisons the accumulator: every later ``micro_batch``, deposit or ``reduce``
            raises RuntimeError naming the parameters that may hold partial sums, until ``reset()``.

    Usage::

        acc = CanonicalGradAccumulator(model.named_parameters())  # leaf_tokens=8192
        for start, batch in micro_batches:             # this rank's micro-batches
            with acc.micro_batch(token_offset=start):  # global index of its first token
                model(batch).backward()                # det_train ops deposit leaf sums
        acc.reduce(total_tokens=T)                     # merge across ranks, write p.grad

    Under CUDA graphs (``torch.compile(mode="reduce-overhead")``) build it with ``recoverable=False``,
    call ``acc.fixed_folds(model)`` and give each micro-batch its ``num_tokens``: the Linear, RMSNorm
    and Embedding weights' deposits are then kernels into buffers of fixed address (``fixed_folds``).

    Ops call ``deposit_rows`` (or, for leaf-aligned micro-batches only, ``leaf_span`` then
    ``deposit`` / ``deposit_partial``) and return None as the autograd gradient of the parameter.
    A parameter used k times in one forward (tied weights, a layer applied twice) gets k deposits
    per micro-batch: deposit number u (in the order autograd runs the backward, fixed by the graph)
    goes to its own tree, and the k roots are added in order u = 0, 1, ...

    **Determinism:** ``p.grad`` depends only on the global batch, ``leaf_tokens`` and the ops'
    fixed leaf orders: any split of the global tokens into micro-batches (any sizes; leaf-aligned
    ones in any order) and leaf-aligned data-parallel shards (any count, any DP degree) gives
    identical bits on every rank. An unfinished leaf's rows are carried to the micro-batch that
    completes it and summed there as one leaf, by the kernel that sums aligned leaves. Not
    covered: a parameter whose gradient also comes from an op that is not canonical-order aware
    (``reduce`` raises when it finds such a gradient in ``p.grad``). ``recoverable=False`` changes
    only where sums are written and when old buffers are freed: same kernels, same order, same bits.

    Memory: the partial trees (fp32 nodes of each parameter's shape, ``popcount(i)`` after ``i``
    leaves) and the open leaf: its fp32 fold, or (ops without a fold) its rows (buffers that grow by
    doubling, at most one leaf). With ``L`` leaves per rank and step, micro-batches that cut leaves
    peak at ``4 * (2 + ceil(log2 L))`` bytes per parameter element (the undo log keeps the old fold
    and the consumed nodes until the micro-batch succeeds); ``recoverable=False``: the canonical
    tree's least, ``4 * (1 + floor(log2 L))`` (4 at ``L = 1``: one fp32 main grad). A micro-batch of
    ``W`` whole leaves adds the op's ``W`` leaf sums while they are combined. ``reduce`` frees one
    parameter at a time (docs/det-train.md, "Gradient memory").

    A micro-batch whose ``with`` block raises leaves no deposit behind (``recoverable=True``), so
    it can be run again. A det_train op given a cast or view of a tracked parameter
    (``p.to(torch.bfloat16)``, ``p * 1``) returns an ordinary autograd gradient for it (the
    canonical sum of that call's tokens), which ``reduce`` then reports as a non-zero ``p.grad``.

    Raises:
        ValueError: bad ``leaf_tokens``, a non-leaf tensor among ``params`` (the result of an op,
            whose ``.grad`` autograd never sets), a micro-batch that starts inside a leaf no earlier
            micro-batch left open, an open leaf not continued (or not completed by ``reduce``),
            missing or duplicated leaves, a deposit for an unknown parameter or of the wrong shape.
        RuntimeError: deposits outside ``micro_batch``; a tracked parameter without deposits at
            ``reduce``; ``p.grad`` already holding a non-zero gradient at ``reduce``; any call after
            a micro-batch raised under ``recoverable=False`` (until ``reset``); from any torch
            optimizer's ``step()`` over a tracked parameter while micro-batches wait for ``reduce``
            (it would skip them: their ``.grad`` is not set yet; nothing is updated). A torch global
            optimizer pre-hook, registered only while deposits wait; a new accumulator over the same
            parameters replaces a waiting one.
        TypeError: ``recoverable`` not a bool; ``params`` a module (pass ``model.named_parameters()``),
            one tensor or not an iterable; an item not a tensor or a ``(name, tensor)`` pair.

    Method: pairwise summation with the tree fixed by global index (Higham, SISC 1993), as in
    det_core.reduce and DESIGN.md's canonical reduction order.
    """

    def __init__(
        self, params: Iterable, leaf_tokens: int = DEFAULT_LEAF_TOKENS, *, recoverable: bool = True
    ) -> None:
        leaf_tokens = as_index(leaf_tokens, "leaf_tokens", "CanonicalGradAccumulator")  # TypeError
        if leaf_tokens <= 0:
            raise ValueError(f"leaf_tokens must be a positive int, got {leaf_tokens!r}")
        if not isinstance(recoverable, bool):
            raise TypeError(f"recoverable must be True or False, got {recoverable!r}")
        self.leaf_tokens = leaf_tokens
        self.recoverable = recoverable
        self._poisoned: str | None = None  # recoverable=False: the error of a micro-batch that raised
        self._params: list[torch.Tensor] = []
        self._names: list[str] = []
        self._index: dict[int, int] = {}
        module = isinstance(params, torch.nn.Module) and not isinstance(params, torch.nn.ParameterList)
        if module or isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
            raise TypeError(
                f"CanonicalGradAccumulator takes the parameters to track, got {type(params).__name__}: "
                "pass model.named_parameters() (or model.parameters(), a list of Parameters)"
            )
        for i, item in enumerate(params):
            if isinstance(item, tuple) and len(item) != 2:
                raise TypeError(f"params[{i}]: a Parameter or a (name, Parameter), got {len(item)} items")
            name, p = item if isinstance(item, tuple) else (f"param[{i}]", item)
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor / Parameter, got {type(p).__name__}")
            if not p.requires_grad or id(p) in self._index:
                continue
            if not p.is_leaf:  # its .grad is never set: deposits for it would go nowhere
                raise ValueError(
                    f"{name}: a non-leaf tensor (made by {type(p.grad_fn).__name__} from others), not a "
                    "parameter: the accumulator sets the .grad of leaf tensors; pass the Parameter itself"
                )
            self._index[id(p)] = len(self._params)
            self._params.append(p)
            self._names.append(name)
        supersede(self)  # a pending accumulator of these parameters no longer holds back a step
        # (param index, use number) -> partial tree of this rank
        self._partials: dict[tuple[int, int], TreePartial] = {}
        self._uses: dict[int, int] = {}  # deposits per parameter in the current micro-batch
        self._unfinished: set[int] = set()  # autograd graph tasks of this micro-batch not yet finished
        self._wanted = WantedGradients()  # which parameters the running backward accumulates into
        self._spans: list[tuple[int, int]] = []  # (token_offset, tokens) seen by the ops
        self._token_offset: int | None = None
        self._tokens: int | None = None  # tokens of the active micro-batch, as the ops report them
        self._tokens_by: tuple = (None, None)  # (parameter, op) of the op that reported them first
        self._open_ends: set[int] = set()  # tokens where micro-batches ended inside a leaf
        self._max_end = 0  # the last token + 1 any deposit covered
        self._carry: dict[
            tuple[int, int, int], OpenLeaf | OpenFold
        ] = {}  # (param index, use, leaf) -> its rows
        # (destination, source) row copies into open leaves, queued by ``OpenLeaf``, run by ``flush`` as
        # one _foreach_copy_: at the micro-batch's end, before a leaf's rows are read or a deposit returns
        self.pending_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._fsdp: dict[int, object] = {}  # param index -> FSDP2 FSDPParam (see track_fsdp)
        # The active micro-batch's undo log (what its deposits replaced; its adds write only the sums
        # it made), or recoverable=False: a NoUndoLog per step, keeps nothing, adds write any own sum
        self._log = UndoLog() if recoverable else NoUndoLog()
        self._open_leaves: dict[tuple[int, int], set[int]] = {}  # slot -> leaves of its _carry entries
        # slot -> rows per token of its deposit_rows calls (fixed: an open leaf is continued with rows of
        # its layout); the active micro-batch's entries wait in _new_groups until it succeeds
        self._groups: dict[tuple[int, int], int] = {}
        self._new_groups: dict[tuple[int, int], int] = {}
        self._by_storage: dict[tuple, torch.Tensor] = {}  # tracked tensors by memory (``tracked``)
        self._fixed: FixedFolds | None = None  # fixed_folds: the weights' fixed-address folds

    def track_fsdp(self, module: torch.nn.Module) -> CanonicalGradAccumulator:
        """Accept deposits for FSDP2's unsharded parameters of ``module`` (``fully_shard``).

        Under FSDP2 the ops see the all-gathered (unsharded) parameter objects, while this
        accumulator tracks the sharded ones (``module.named_parameters()``). After this call a
        deposit for an unsharded parameter counts for its sharded parameter, and ``reduce`` writes
        each rank's shard of the full canonical gradient into ``p.grad`` (a DTensor like FSDP2's).
        FSDP2's own reduce-scatter does not run for these parameters: det_train ops return no
        autograd gradient for them. Returns ``self``.

        Raises ValueError if ``module`` holds no FSDP2 parameter that this accumulator tracks.
        """
        self._fsdp.update(dp_reduce.fsdp_params(module, self._index))
        if not self._fsdp:
            raise ValueError(
                "track_fsdp: no parameter of this module is both FSDP2-sharded (fully_shard) and tracked "
                "by this accumulator; build the accumulator from the sharded module's parameters"
            )
        return self

    def fixed_folds(self, module: torch.nn.Module) -> CanonicalGradAccumulator:
        """Fold the weight gradient of every ``det_train.Linear``, ``det_train.RMSNorm`` (without
        ``heads``) and ``det_train.Embedding`` of ``module`` into buffers of fixed address: deposits
        a CUDA graph can hold (``torch.compile(mode="reduce-overhead")``) and no host bookkeeping per
        deposit. Returns ``self``.

        Each such weight this accumulator tracks gets its buffers here, kept for the accumulator's
        life (also between steps): a Linear weight's open leaf's fp32 fold (its shape: 4 bytes per
        element); an RMSNorm weight's fp32 sub-leaf folds (``leaf_tokens / 1024`` rows of its size at
        leaves over 1024 tokens); an embedding table's open leaf's rows (ids and ``dy``,
        ``leaf_tokens`` rows of its width). The forward passes them to the backward, whose op
        (``det_train::linear_fold_weight``, ``rms_norm_backward_fold``, ``embedding_fold_rows``)
        continues the open leaf in them and adds 1 to the weight's device counter; ``micro_batch``
        zeroes the folds when a micro-batch starts a leaf and, when one ends a leaf, adds each
        weight's leaf node (a new tensor) to its tree; ``reduce`` checks the counters (one device
        read): every weight folded once in each micro-batch of the step. The micro-batches must give
        ``num_tokens`` and each lie inside one leaf (micro-batch sizes that divide ``leaf_tokens``),
        a leaf's micro-batches in token order. Under ``torch.compile`` a backward that does not
        accumulate into the weights (``torch.autograd.grad`` of other tensors) still folds them
        (eager execution checks it, as the plain path).

        Args:
            module: the model (or part of it) whose ``det_train.Linear`` / ``RMSNorm`` / ``Embedding``
                modules get fixed folds; those whose weight is not tracked or is held by another
                module too (tied weights, a module used twice) stay on the plain deposit path.

        Raises:
            ValueError: the accumulator was built with ``recoverable=True`` (a fold continued in
                place cannot be undone: build it with ``recoverable=False``); it holds deposits or
                open leaves (call this before a step's first micro-batch, or after ``reduce`` /
                ``reset``); ``module`` has no such module with a tracked, unshared weight;
                the weights are FSDP2-sharded (``track_fsdp``: not supported with fixed folds).
                Later, at ``reduce``: a weight not folded exactly once per micro-batch (named).

        **Determinism:** the same kernels and fold order as the plain path (a leaf's fold from a
        zeroed buffer has the bits of a fold from zero; an embedding leaf is summed from its rows by
        the plain path's kernel), the same leaves and tree: ``p.grad`` has the plain path's bits for
        any split into micro-batches that fit.

        Method: the open leaf's "main grad" of gradient accumulation (Megatron-LM's ``main_grad``)
        at a fixed address, as CUDA graphs need (PyTorch's CUDA-graph documentation: static inputs).
        """
        register(self, module)
        return self

    # ------------------------------------------------------------------ micro-batches
    def micro_batch(
        self, token_offset: int, num_tokens: int | None = None
    ) -> contextlib.AbstractContextManager[CanonicalGradAccumulator]:
        """Make this accumulator active for one micro-batch starting at global token ``token_offset``.

        The micro-batch may have any number of tokens, and micro-batches may come in any order,
        except that one which starts inside a leaf must start where an earlier micro-batch on this
        rank ended (the pieces of a leaf are summed in token order); every other micro-batch starts
        on a leaf boundary.

        ``num_tokens`` (optional; required with ``fixed_folds``): the micro-batch's token count,
        which every op that deposits must then see (a ValueError otherwise). With fixed folds the
        micro-batch must lie inside one leaf and either continue the open leaf on a multiple of the
        folds' token steps inside it (64 tokens for a bf16 Linear weight, 32 fp32, 16 RMSNorm) or,
        with no leaf open, start a leaf this step has not folded; the weights must have kept their
        dtypes and shapes; and every context counts as a micro-batch of the step (evaluate outside).

        Raises:
            TypeError: ``token_offset`` or ``num_tokens`` not an integer.
            ValueError: ``token_offset`` negative, or inside a leaf where no earlier micro-batch on
                this rank ended; ``num_tokens`` not positive, missing with fixed folds, or (fixed
                folds) a micro-batch that crosses a leaf boundary, continues a leaf off the step,
                starts a leaf while another is open or one already folded, or weights cast since.
            RuntimeError: another micro-batch context is active; a tracked parameter has a tensor
                hook (``register_hook``) or a post-accumulate-grad hook
                (``register_post_accumulate_grad_hook``): it would see ``None``, det's gradient going
                to the accumulator; the accumulator is poisoned; on
                exit, a backward in the micro-batch raised after its first deposit and the error was
                caught inside the context (its deposits are partial, and a forward and backward run
                again there would deposit twice): the micro-batch is then treated as one that raised.

        A micro-batch that raises inside the context leaves the accumulator as it was before it
        (its deposits are undone); under ``recoverable=False``, once its deposits began, it poisons
        the accumulator instead (RuntimeError on every later call until ``reset``).

        **Determinism:** the deposits made inside land in the leaves of their global token indices
        (``token_offset`` onward), so the final gradients do not depend on how the tokens were cut
        into micro-batches, their order or their sizes (the canonical order of ``det_core.reduce``).
        """
        return _micro_batch.micro_batch(self, token_offset, num_tokens)

    def _undo(self, spans: int, max_end: int) -> None:
        """Undo the active micro-batch's deposits (its undo log) and its spans and token range."""
        self._log.undo(self._partials, self._carry, self._set_carry)  # (recoverable=False: no deposit)
        del self._spans[spans:]
        self._max_end = max_end

    def _tree(self, slot: tuple[int, int]) -> TreePartial:
        """The slot's partial tree (a new one if none), logged before this micro-batch's first change."""
        return self._log.tree(self._partials, slot)

    def _set_carry(self, key: tuple[int, int, int], value) -> None:
        """``_carry[key] = value`` (None: delete it) and the slot's set of open leaves, the old entry
        logged for an undo."""
        carry = self._carry
        self._log.log_carry(carry, key)
        if value is None:
            del carry[key]
            self._open_leaves[key[:2]].discard(key[2])
        else:
            if key not in carry:
                self._open_leaves.setdefault(key[:2], set()).add(key[2])
            carry[key] = value

    @property
    def token_offset(self) -> int:
        """Global index of the first token of the active micro-batch (RuntimeError outside one)."""
        if self._token_offset is None:
            raise RuntimeError("no micro_batch is active on this accumulator")
        return self._token_offset

    def tracked(self, t: torch.Tensor) -> torch.Tensor:
        """The tracked parameter that ``t`` is, or aliases exactly (same storage, offset, shape,
        strides, dtype and device), else ``t`` itself (a deposit for it then raises "does not track").

        A compiled backward hands an op the tensor AOTAutograd saved, which need not be the Parameter
        object this accumulator keys on; the same memory is the same parameter. FSDP2's unsharded
        parameters (``track_fsdp``) are matched the same way.

        **Determinism:** a lookup; it only chooses which parameter's tree a deposit joins.
        """
        return t if id(t) in self._index else tracked_param(self, t)  # eager: the Parameter itself

    def leaf_span(
        self, num_tokens: int, param: torch.Tensor | None = None, op: str | None = None
    ) -> tuple[int, int]:
        """For an op that saw ``num_tokens`` tokens: ``(first_leaf, n_leaves)`` of its global leaves.

        Local token t is global token ``token_offset + t`` and lies in global leaf
        ``first_leaf + t // leaf_tokens``. Records the span so ``reduce`` can check that only the
        micro-batch ending the global batch has a partial last leaf. ``param`` (the parameter the
        op deposits for) and ``op`` (its name) only name it in errors: a ``ValueError`` when
        another op of this micro-batch saw another token count.
        """
        offset = self.token_offset
        if num_tokens <= 0:
            raise ValueError(f"an op deposited for {num_tokens} tokens; a micro-batch needs at least one")
        if offset % self.leaf_tokens:
            raise ValueError(
                f"this micro-batch starts inside a leaf (token {offset}, leaf_tokens {self.leaf_tokens}); "
                "leaf_span / deposit need leaf-aligned micro-batches: use deposit_rows, which carries "
                "the open leaf's rows"
            )
        self._note_tokens(int(num_tokens), param, op)
        span = (offset, int(num_tokens))
        if span not in self._spans:
            self._spans.append(span)
        return offset // self.leaf_tokens, num_leaves(num_tokens, self.leaf_tokens)

    # ------------------------------------------------------------------ deposits
    def _backward_wants(self, param: torch.Tensor) -> bool:
        """False inside a backward that leaves ``param``'s gradient alone (``WantedGradients``)."""
        return self._wanted(param, self._index.get(id(param)), self._names)

    def _slot(self, param: torch.Tensor) -> tuple[int, int]:
        return take_slot(self, param)

    def deposit_rows(
        self,
        param: torch.Tensor,
        rows: tuple,
        leaf_partial: LeafPartial,
        fold: LeafFold | None = None,
        op: str | None = None,
        rows_per_token: int = 1,
    ) -> None:
        """Deposit ``param``'s gradient over this micro-batch's tokens, given as rows: any boundaries.

        Args:
            param: a tracked parameter.
            rows: the op's per-token inputs to the gradient, tensors whose dim 0 is this
                micro-batch's tokens in order (e.g. ``(dy, x)`` of a Linear), all of one length;
                with ``rows_per_token`` ``g > 1``, dim 0 is tokens x ``g`` rows, token-major (row
                ``t * g + h`` is row ``h`` of token ``t``: a per-head norm's heads).
            leaf_partial: ``leaf_partial(first_leaf, leaf_rows)`` -> ``TreePartial`` of the leaf
                sums over ``leaf_rows`` (rows of whole leaves starting at global leaf
                ``first_leaf``; only the last leaf of the global batch may be short), its nodes new
                tensors, which the accumulator then owns (its tree adds may write them). It is called
                now for the whole leaves, later (next micro-batch or ``reduce``) for an open leaf.
            fold: the op's resumable leaf fold, ``(step, fold_fn)``: ``fold_fn(leaf_rows, acc)``
                returns a new fp32 tensor of ``param``'s shape (the accumulator's then), ``acc``
                (the fold of the leaf's earlier tokens, or None) continued over ``leaf_rows`` in
                steps of ``step`` tokens;
                over a whole leaf from None it equals that leaf's node of ``leaf_partial``. Or
                ``(step, fold_fn, close_fn)``: the fold's state is any immutable object (e.g. the
                RMSNorm weight's sub-leaf folds) and ``close_fn(state)`` gives the leaf's fp32
                node. This call's ``fold`` continues a leaf an earlier call left open (an op may
                bind what it already computed for these rows).
            op: the op's name (e.g. ``"det_train.linear"``), for errors only.
            rows_per_token: the row group ``g`` (default 1), the same in every call for ``param``
                (per use). ``leaf_partial`` and ``fold_fn`` then see rows of whole tokens (``g``
                rows each, a leaf being ``leaf_tokens * g`` rows) and ``step`` counts rows: the
                fold continues at multiples of ``lcm(step, g)`` rows.

        The leaf this micro-batch leaves unfinished stays open. With ``fold`` its fp32 fold is kept
        (one tensor of ``param``'s shape; rows past the last whole step, fewer than ``step``, are
        copied) and the next micro-batch's ``fold_fn`` continues it; without, its rows are copied
        and kept, the next micro-batch prepends them to its own rows of that leaf, and one
        ``leaf_partial`` call sums them. ``reduce`` finishes a leaf that ends the global batch.
        Inside a backward that does not accumulate into ``param`` (``torch.autograd.grad``, or
        ``backward(inputs=...)`` without it) the call deposits nothing, as autograd leaves
        ``p.grad`` alone there (``deposit`` and ``deposit_partial`` likewise); inside
        ``torch.autograd.grad(..., inputs=[param])`` it raises a RuntimeError.

        **Determinism:** ``leaf_partial`` sees the rows of whole leaves (and of the short last
        leaf) exactly as one unsplit micro-batch would give them, and ``fold_fn`` continues a leaf
        only at multiples of ``step`` tokens from its start (a shorter remainder waits for the next
        rows), so the partial trees, and ``p.grad`` after ``reduce``, have the bits of one batch
        for any micro-batch sizes.

        Raises:
            ValueError: rows of different lengths or a length other than another op reported for
                this micro-batch (both ops and their parameters named); a length that is not a
                multiple of ``rows_per_token``, or a ``rows_per_token`` other than this parameter's
                earlier calls'; an open leaf of ``param``
                that does not end where this micro-batch starts (the parameter skipped a
                micro-batch); an unaligned start with nothing to continue.
            RuntimeError: outside ``micro_batch``; inside ``torch.autograd.grad`` with ``param``
                among its inputs (autograd would return None for it).
        """
        # Host work per call is O(1) in the rows and the leaves: a few views, one leaf-sum or fold
        # call, no device value read.
        n = rows[0].shape[0]
        for r in rows:
            if r.shape[0] != n:
                raise ValueError(f"deposit_rows: rows of different lengths {[int(r.shape[0]) for r in rows]}")
        if not self._backward_wants(param):
            return
        group = rows_per_token
        if group != 1:  # tokens x group rows: dim 0 becomes tokens (views), the op's functions see rows
            if isinstance(group, bool) or not isinstance(group, int) or group < 1 or n % group:
                raise ValueError(
                    f"{who(self, param, op)} has {n} rows in this micro-batch, not a multiple of its "
                    f"rows_per_token {group!r} (a positive int; its rows are tokens x {group!r}): pass the "
                    "op an input whose rows are whole tokens (e.g. a per-head norm's (B, T, H, D), H heads)"
                )
            n //= group
            rows = tuple(r.unflatten(0, (n, group)) for r in rows)
            leaf_partial, fold = token_rows(leaf_partial, fold, group)
        if self._token_offset is not None:  # before _slot counts a use (outside: _slot raises)
            self._note_tokens(n, param, op)
        slot = self._slot(param)
        known = self._new_groups.get(slot, self._groups.get(slot, group))
        if known != group:
            raise ValueError(
                f"{who(self, param, op)} (use {slot[1]}) gave {group} rows per token, but {known} in an "
                "earlier call: a parameter's rows per token (a per-head norm's heads) must not change "
                "between the micro-batches of a step"
            )
        self._new_groups[slot] = group
        place_rows(self, slot, rows, n, leaf_partial, fold)

    def _note_tokens(self, n: int, param: torch.Tensor | None, op: str | None) -> None:
        """Record the micro-batch's token count; every canonical-order op must report the same.
        ``param``, ``op``: the parameter the op deposits for and the op's name (named lazily)."""
        if self._tokens is None:
            self._tokens, self._tokens_by = n, (param, op)
        elif n != self._tokens:
            raise ValueError(token_mismatch(self, n, param, op))
        end = self._token_offset + n
        if end > self._max_end:
            self._max_end = end

    def flush(self) -> None:
        """Run the queued open-leaf row copies now (one multi-tensor copy where torch has one).

        ``deposit_rows`` queues the copies of an open leaf's rows and the micro-batch runs them when
        it ends; a deposit op whose inputs a compiled graph may reuse as soon as it returns
        (Inductor's buffer reuse) calls this before it returns (``deposit.rows`` does). Raises nothing.

        **Determinism:** copies only; no value changes.
        """
        if self.pending_copies:
            dst, src = zip(*self.pending_copies, strict=True)
            self.pending_copies = []
            with torch.no_grad():  # the views were made in the backward; the copy is not a graph op
                foreach_copy(list(dst), list(src))

    def _merge(self, slot: tuple[int, int], partial: TreePartial, rows: tuple | None = None) -> None:
        """Merge ``partial`` into ``slot``'s tree. ``rows``: the rows a ``leaf_partial`` summed into it:
        its new nodes are the tree's then (the tree may add into them; never into one that shares memory
        with the rows) and ``partial`` is emptied. Nodes that are views of a larger buffer (an op's sums
        of several leaves) are copied out, so that buffer is freed once the tree has combined the rest."""
        tree = self._tree(slot)
        own = rows is not None
        if own:
            held = {r.untyped_storage().data_ptr() for r in rows}
            for value in partial.nodes.values():
                if value.untyped_storage().data_ptr() not in held:
                    self._log.own(value)
        try:
            tree.merge(partial, self._log.combine)
        except ValueError as err:
            raise ValueError(f"{slot_name(self._names[slot[0]], slot[1])}: {err}") from None
        if own:
            partial.nodes = {}
        self._log.compact(tree)

    def _add_node(self, slot: tuple[int, int], leaf: int, value: torch.Tensor) -> None:
        """``_merge`` of one finished leaf (a node on this accumulator's device) without a partial."""
        try:
            self._tree(slot).add_node(0, leaf, value, self._log.combine)
        except ValueError as err:
            raise ValueError(f"{slot_name(self._names[slot[0]], slot[1])}: {err}") from None

    def deposit(self, param: torch.Tensor, first_leaf: int, leaf_sums: torch.Tensor) -> None:
        """Add leaves ``first_leaf, first_leaf + 1, ...`` of ``param``'s gradient.

        Args:
            param: a tracked parameter.
            first_leaf: global index of the first leaf (from ``leaf_span``).
            leaf_sums: fp32 tensor ``(n_leaves, *param.shape)`` on ``param``'s device, leaf ``i``
                being the sum over the tokens of global leaf ``first_leaf + i`` in the op's order.
        """
        if leaf_sums.dtype != torch.float32:
            raise ValueError(f"leaf_sums must be float32 (fp32 leaf sums), got {leaf_sums.dtype}")
        if tuple(leaf_sums.shape[1:]) != tuple(param.shape) or leaf_sums.dim() != param.dim() + 1:
            raise ValueError(
                f"leaf_sums must have shape (n_leaves, *{tuple(param.shape)}), got {tuple(leaf_sums.shape)}"
            )
        if not self._backward_wants(param):
            return
        slot = self._slot(param)
        try:
            self._tree(slot).add_leaves(first_leaf, leaf_sums)
        except ValueError as err:
            raise ValueError(f"{slot_name(self._names[slot[0]], slot[1])}: {err}") from None

    def deposit_partial(self, param: torch.Tensor, partial: TreePartial) -> None:
        """Add an already combined partial tree (fp32 nodes of ``param``'s shape) of ``param``'s gradient."""
        shape = param.shape
        for key, value in partial.nodes.items():
            if value.dtype != torch.float32 or value.shape != shape:
                raise ValueError(
                    f"node {key} must be float32 of shape {tuple(param.shape)}, "
                    f"got {value.dtype} {tuple(value.shape)}"
                )
        if self._backward_wants(param):
            self._merge(self._slot(param), partial)

    # ------------------------------------------------------------------ reduce
    # a graph boundary under torch.compile: host bookkeeping and collectives, always run eagerly
    @torch.compiler.disable
    def reduce(self, total_tokens: int, group=None) -> None:
        """Merge all partials (this rank's micro-batches and, if distributed, every rank's), finish
        the canonical tree over ``ceil(total_tokens / leaf_tokens)`` leaves and set ``p.grad``.

        Under ``torch.compile`` this is a graph boundary (``torch.compiler.disable``): a compiled
        step that calls it breaks the graph there and runs it eagerly (``fullgraph=True`` raises).

        Args:
            total_tokens: tokens in the global batch (all micro-batches of all ranks).
            group: the data-parallel process group. None means the default group when
                torch.distributed is initialized, and this process alone otherwise.

        ``p.grad`` is replaced by the result in ``p.dtype`` (an existing all-zero ``p.grad`` is
        fine; a non-zero one raises). Afterwards the accumulator is empty and reusable. A reduce
        that raises (a wrong ``total_tokens``, missing tokens) writes no ``p.grad`` and keeps every
        deposit and open leaf (its checks run before anything is written; one process then finishes
        one parameter at a time, freeing its nodes once its ``p.grad`` is written): add the missing
        micro-batches or call it again with the right arguments (or build a new accumulator to
        start over). Under torch.distributed a rank whose own checks fail (an open leaf, a stale
        ``p.grad``) raises its error and every other rank a ValueError naming that rank: the checks
        travel with the first collective, so no rank waits in a collective another rank never joins.
        Collectives (``dp_reduce.py``, the fixed-order owner reduction): one ``all_gather_object``
        (node keys and refusals), then per gradient bucket one ``all_to_all_single`` sending every
        node's slice to the rank that owns it (under FSDP2: FSDP2's shard) and, for replicated
        parameters, one ``all_gather_single`` of the finished gradient in ``p.dtype``. Per rank, bytes
        and transient memory are O(numel) and do not grow with the world size (docs/det-train.md,
        "Data parallel"); under FSDP2 no rank holds an unsharded gradient. One process: no collective.

        Raises:
            TypeError: ``total_tokens`` not an integer.
            ValueError: ``total_tokens`` does not cover the deposits, tokens are missing, a leaf is
                still open, a ``p.grad`` is non-zero, or another rank's checks failed (named).
            RuntimeError: called inside a micro-batch context; one process with nothing deposited
                since the accumulator was built, reset or last reduced (a second ``reduce`` of a step
                after ``zero_grad``; with the first one's ``p.grad`` still set, the non-zero
                ``p.grad`` error comes first).

        **Determinism:** every gradient is the fixed pairwise tree over fp32 leaf sums in global
        token order (``det_core.reduce``), finished by the rank that owns each element in a fixed
        order: the same bits for any micro-batch split and any data-parallel degree. Method: the
        canonical reduction order of DESIGN.md (pairwise summation, Higham, *Accuracy and Stability
        of Numerical Algorithms*, 2nd ed., section 4.2).
        """
        if _ACTIVE:
            raise RuntimeError("reduce() inside a micro_batch context; call it after the last micro-batch")
        one_process = dp_reduce.group_size(group) == 1
        if one_process:  # (under data parallelism the poisoning travels with the other refusals)
            self._check_poisoned()
        total_tokens = as_index(total_tokens, "total_tokens", "reduce")  # TypeError
        if total_tokens <= 0:
            raise ValueError(f"total_tokens must be a positive int, got {total_tokens!r}")
        names, params, leaf_tokens = self._names, self._params, self.leaf_tokens
        state = dict(leaf_tokens=leaf_tokens, names=names, carry=self._carry)
        checks = dict(state, params=params, spans=self._spans, max_end=self._max_end)
        fixed = self._fixed
        if one_process:  # one parameter finished (and freed) at a time
            if fixed is not None:  # every fixed fold once per micro-batch (one device read)
                fixed.check_counts(self)
            with frozen_hint(names, params):
                _reduce.reduce_one_process(self, total_tokens, checks, state)
            return
        try:  # this rank's checks: under data parallelism every rank learns of a refusal (no hang)
            self._check_poisoned()
            if fixed is not None:
                fixed.check_counts(self)
            local = _reduce.local_partials(total_tokens, partials=self._partials, **checks)
            refusal = None
        except (ValueError, RuntimeError) as err:
            local, refusal = {}, err
        # data parallel: every rank's nodes go to their owners
        with frozen_hint(names, params):
            grads = _reduce.reduce_across_ranks(
                group,
                local,
                refusal,
                total_tokens,
                leaf_tokens=leaf_tokens,
                names=names,
                params=params,
                fsdp=self._fsdp,
            )
        for index, grad in grads.items():
            p = params[index]
            p.grad = dp_reduce.fsdp_shard(self._fsdp[index], grad) if index in self._fsdp else grad
        self._clear()

    def _clear(self) -> None:
        """Empty (after a reduce, or ``reset``): no partial tree, span, open leaf or poisoning."""
        if self._fixed is not None:
            self._fixed.clear()
        self._partials, self._spans, self._carry, self._open_ends, self._max_end = {}, [], {}, set(), 0
        self._open_leaves, self._groups, self.pending_copies, self._poisoned = {}, {}, [], None
        self._log = UndoLog() if self.recoverable else NoUndoLog()
        mark_reduced(self)

    def _holds_deposits(self) -> bool:
        """Whether deposits of a step wait for ``reduce`` (trees, open leaves or token spans; fixed
        folds keep their own count, ``FixedFolds.micro_batches``)."""
        return bool(self._partials or self._carry or self._spans)

    def reset(self) -> None:
        """Drop every deposit, open leaf and span of the step (and a ``recoverable=False`` poisoning).

        As new (same parameters and settings); ``p.grad`` is not touched. After a micro-batch raised
        under ``recoverable=False``, call this and run the step's micro-batches again. Raises
        RuntimeError inside its micro-batch context. **Determinism:** computes nothing.
        """
        if _ACTIVE and _ACTIVE[-1] is self:
            raise RuntimeError("reset() inside this accumulator's micro_batch context; call it after it")
        self._clear()

    def _check_poisoned(self) -> None:
        """Raise the poisoning error (``recoverable=False``, a micro-batch raised after depositing)."""
        if self._poisoned is not None:
            raise RuntimeError(self._poisoned)
