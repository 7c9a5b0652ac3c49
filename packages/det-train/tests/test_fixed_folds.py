"""``CanonicalGradAccumulator.fixed_folds``: the Linear, RMSNorm and Embedding weights' open leaves in
buffers of fixed address, continued in place by one op each (no host bookkeeping per deposit).

The gradients keep the plain accumulator's bits (and one batch's) for micro-batches inside leaves
(any sizes on the folds' steps, several micro-batches per leaf, whole leaves, a short last leaf,
RMSNorm weights with several sub-leaves per leaf), over steps that reuse the buffers, eager and under
``torch.compile`` (AOTAutograd keeps the fold ops' writes in the backward; Inductor too). Bad use is
refused with the remedy and without a partial write; a micro-batch that raises poisons the
accumulator until ``reset``; a backward that leaves the weights alone folds nothing (eager).
"""

from __future__ import annotations

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal
from det_train import CanonicalGradAccumulator
from det_train.accum import _leaf_sums, deposit
from torch._dynamo.testing import CompileCounterWithBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
V, D, FF = 64, 32, 64


class _Block(torch.nn.Module):
    """Embedding, RMSNorm, two Linears (the first with a bias, deposited plainly), a head."""

    def __init__(self) -> None:
        super().__init__()
        kw = dict(dtype=BF16, device=DEVICE)
        self.emb = det_train.Embedding(V, D, **kw)
        self.norm = det_train.RMSNorm(D, **kw)
        self.up = det_train.Linear(D, FF, bias=True, **kw)
        self.down = det_train.Linear(FF, D, bias=False, **kw)
        self.head = det_train.Linear(D, V, bias=False, **kw)

    def forward(self, ids, targets, n):
        h = self.emb(ids)
        h = h + self.down(self.up(self.norm(h)))
        logits = self.head(h)
        return det_train.cross_entropy(logits.flatten(0, -2), targets.flatten(), num_global_tokens=n)


def _batch(tokens: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, tokens), generator=g).to(DEVICE)
    return ids, torch.randint(0, V, (1, tokens), generator=g).to(DEVICE)


def _model() -> _Block:
    torch.manual_seed(0)
    return _Block()


def _grads(sizes, leaf, fixed, steps=1, run=None, model=None):
    """The gradients after each of ``steps`` steps of micro-batches of ``sizes`` tokens."""
    model = _model() if model is None else model
    run = model if run is None else run
    tokens = sum(sizes)
    ids, targets = _batch(tokens)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=leaf, recoverable=not fixed)
    if fixed:
        acc.fixed_folds(model)
    out = []
    for _ in range(steps):
        lo = 0
        for n in sizes:
            with acc.micro_batch(lo, num_tokens=n if fixed else None):
                run(ids[:, lo : lo + n], targets[:, lo : lo + n], tokens).backward()
            lo += n
        acc.reduce(tokens)
        out.append({name: p.grad for name, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return out


def _assert_grads(got: list[dict], want: dict, what: str) -> None:
    for step, grads in enumerate(got):
        assert grads.keys() == want.keys()
        for name in want:
            assert_bitwise_equal(grads[name], want[name], f"{what}, step {step}: {name}")


@pytest.mark.parametrize(
    ("sizes", "leaf", "steps"),
    [
        ([256], 256, 1),  # one micro-batch of one leaf
        ([64] * 4, 128, 2),  # two micro-batches per leaf, over two steps (the buffers reused)
        ([64, 128, 64], 256, 1),  # unequal sizes inside a leaf, on the Linear fold's 64-token step
        ([128, 128, 64], 128, 1),  # whole leaves, then a short last leaf
        ([128, 64, 32], 128, 1),  # a short last leaf cut in two micro-batches
    ],
)
def test_fixed_folds_give_the_plain_accumulators_bits(sizes, leaf, steps):
    want = _grads([sum(sizes)], leaf, fixed=False)[0]  # one micro-batch, the plain path
    _assert_grads(_grads(sizes, leaf, fixed=True, steps=steps), want, f"fixed folds {sizes}, leaf {leaf}")


def test_rms_norm_fixed_fold_spans_sub_leaves(monkeypatch):
    """Leaves of two sub-leaves (of 128 tokens here, 1024 by default), each filled by two
    micro-batches of 64 tokens, and the leaf's node the tree over both; a short last leaf of half a
    sub-leaf closes over the one present."""
    monkeypatch.setattr(_leaf_sums, "SUB_LEAF_TOKENS", 128)
    sizes = [64] * 5
    want = _grads([sum(sizes)], 256, fixed=False)[0]
    _assert_grads(_grads(sizes, 256, fixed=True), want, "fixed folds, two sub-leaves per leaf")


def test_compiled_model_with_fixed_folds_gives_the_eager_bits():
    """Under torch.compile (Inductor) the forward hands the folds to the backward as graph inputs,
    which the fold ops write in the backward graph (AOTAutograd keeps a backward's input mutations
    there); one compiled graph serves every micro-batch and step."""
    backend = CompileCounterWithBackend("inductor")
    sizes, leaf = [64] * 4, 128
    want = _grads([sum(sizes)], leaf, fixed=False)[0]
    torch._dynamo.reset()
    model = _model()
    run = torch.compile(model, backend=backend, fullgraph=True)
    got = _grads(sizes, leaf, fixed=True, steps=2, run=run, model=model)
    _assert_grads(got, want, "compiled (Inductor) with fixed folds")
    assert backend.frame_count == 1, f"{backend.frame_count} graphs compiled for 8 micro-batches"
    torch._dynamo.reset()


class _BrokenBlock(_Block):
    """The block with a graph break after its up projection: two compiled graphs per forward."""

    def forward(self, ids, targets, n):
        h = self.emb(ids)
        up = self.up(self.norm(h))
        torch._dynamo.graph_break()
        logits = self.head(h + self.down(up))
        return det_train.cross_entropy(logits.flatten(0, -2), targets.flatten(), num_global_tokens=n)


def _broken_model() -> _BrokenBlock:
    torch.manual_seed(0)
    return _BrokenBlock()


@pytest.mark.parametrize("how", ["graph break", "modules compiled one by one"])
def test_fixed_folds_take_any_number_of_compiled_graphs(how):
    """A graph break, or each module compiled on its own (the FSDP2 recipe): fixed folds give the
    eager bits; each weight's folds are its own, which no other graph saves. The plain deposits share
    one ticket (test_several_graphs_with_plain_deposits_are_refused_and_undone): the one left here,
    the up projection's bias, sits in one graph."""
    sizes, leaf = [64] * 4, 128
    want = _grads([sum(sizes)], leaf, fixed=False)[0]
    torch._dynamo.reset()
    model = _broken_model()
    if how == "graph break":
        run = torch.compile(model, backend="aot_eager")
    else:
        for module in (model.emb, model.norm, model.up, model.down, model.head):
            module.compile(backend="aot_eager", fullgraph=True)
        run = model
    _assert_grads(_grads(sizes, leaf, fixed=True, run=run, model=model), want, f"fixed folds, {how}")
    torch._dynamo.reset()


def test_several_graphs_with_plain_deposits_are_refused_and_undone():
    """Plain deposits mutate one ticket tensor that every compiled graph saves, so a second graph's
    backward fails autograd's version check of the first's (found by a new-user trial): the error
    says why and what to use, and the micro-batch left no deposit (it runs again eagerly)."""
    sizes, leaf = [64] * 4, 128
    want = _grads([sum(sizes)], leaf, fixed=False)[0]
    torch._dynamo.reset()
    model = _broken_model()
    ids, targets = _batch(sum(sizes))
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=leaf)
    run = torch.compile(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match="several torch.compile graphs .* fullgraph=True.* fixed folds"):
        with acc.micro_batch(0):
            run(ids[:, :64], targets[:, :64], 256).backward()
    lo = 0
    for n in sizes:  # the same accumulator, eagerly: the refused micro-batch left nothing behind
        with acc.micro_batch(lo):
            model(ids[:, lo : lo + n], targets[:, lo : lo + n], 256).backward()
        lo += n
    acc.reduce(256)
    _assert_grads([{name: p.grad for name, p in model.named_parameters()}], want, "after the refusal")
    torch._dynamo.reset()


class _TwoBiasGraphs(_BrokenBlock):
    """A graph break between two plain deposits: the up projection's bias before it, a LayerNorm's
    weight and bias (no fold) after it."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = det_train.LayerNorm(D, dtype=BF16, device=DEVICE)

    def forward(self, ids, targets, n):
        h = self.emb(ids)
        up = self.up(self.norm(h))
        torch._dynamo.graph_break()
        logits = self.head(self.ln(h + self.down(up)))
        return det_train.cross_entropy(logits.flatten(0, -2), targets.flatten(), num_global_tokens=n)


def test_fixed_folds_with_plain_deposits_in_several_graphs_say_so():
    """With fixed folds (recoverable=False) the plain deposits left must sit in one graph; when they
    do not, the micro-batch raises the accumulator's explanation, not autograd's version error, and
    the poisoned accumulator repeats it (found by a new-user trial)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TwoBiasGraphs()
    ids, targets = _batch(128)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=128, recoverable=False)
    acc.fixed_folds(model)
    run = torch.compile(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match="several torch.compile graphs .* refuses further use"):
        with acc.micro_batch(0, num_tokens=64):
            run(ids[:, :64], targets[:, :64], 128).backward()
    with pytest.raises(RuntimeError, match="several torch.compile graphs"):
        with acc.micro_batch(64, num_tokens=64):
            pass
    torch._dynamo.reset()


def test_fixed_folds_are_the_weights_no_other_module_holds():
    model = _model()
    model.head.weight = model.emb.weight  # tied: the embedding table deposits as before
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=128, recoverable=False)
    acc.fixed_folds(model)
    names = sorted(acc._names[i] for i in acc._fixed.folds)
    assert names == ["down.weight", "norm.weight", "up.weight"]  # not the tied emb.weight / head.weight
    untied = _model()
    plain = CanonicalGradAccumulator(untied.named_parameters(), leaf_tokens=128, recoverable=False)
    names = sorted(plain._names[i] for i in plain.fixed_folds(untied)._fixed.folds)
    assert names == ["down.weight", "emb.weight", "head.weight", "norm.weight", "up.weight"]
    sizes = [64] * 4
    ids, targets = _batch(256)
    with torch.no_grad():
        model.head.weight.mul_(0.5)
    _step(model, acc, sizes, ids, targets)
    acc.reduce(256)
    got = {name: p.grad for name, p in model.named_parameters()}
    ref = _model()
    ref.head.weight = ref.emb.weight
    with torch.no_grad():
        ref.head.weight.mul_(0.5)
    plain = CanonicalGradAccumulator(ref.named_parameters(), leaf_tokens=128)
    with plain.micro_batch(0):
        ref(ids, targets, 256).backward()
    plain.reduce(256)
    for name, p in ref.named_parameters():
        assert_bitwise_equal(got[name], p.grad, f"tied model, fixed folds: {name}")


def _fixed_acc(leaf=256):
    model = _model()
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=leaf, recoverable=False)
    return model, acc.fixed_folds(model)


def test_fixed_folds_refuse_what_they_cannot_hold():
    model = _model()
    with pytest.raises(ValueError, match="recoverable=False"):
        CanonicalGradAccumulator(model.named_parameters()).fixed_folds(model)
    torch_only = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no det_train.Linear, RMSNorm or Embedding"):
        CanonicalGradAccumulator(torch_only.named_parameters(), recoverable=False).fixed_folds(torch_only)
    model, acc = _fixed_acc()
    ids, targets = _batch(512)
    with pytest.raises(ValueError, match="num_tokens=..."):
        acc.micro_batch(0).__enter__()
    with pytest.raises(ValueError, match="crosses a leaf boundary"):
        acc.micro_batch(0, num_tokens=384).__enter__()
    with acc.micro_batch(0, num_tokens=96):  # 96 tokens: the next one would resume off the 64-step
        model(ids[:, :96], targets[:, :96], 512).backward()
    with pytest.raises(
        ValueError, match=r"96 tokens in, not a multiple of the fixed folds' token steps \(\[64\]"
    ):
        acc.micro_batch(96, num_tokens=32).__enter__()
    acc.reset()
    with acc.micro_batch(0, num_tokens=128):
        model(ids[:, :128], targets[:, :128], 512).backward()
    with pytest.raises(ValueError, match="holds deposits of a step in progress"):
        acc.fixed_folds(model)


def test_an_op_over_other_tokens_than_num_tokens_is_refused():
    model, acc = _fixed_acc()
    ids, targets = _batch(512)
    with pytest.raises(ValueError, match=r"saw 64 tokens .* but micro_batch\(num_tokens=...\) saw 128"):
        with acc.micro_batch(0, num_tokens=128):
            model(ids[:, :64], targets[:, :64], 512).backward()


def test_a_weight_folded_twice_in_a_micro_batch_is_refused():
    """Two uses of a fixed-fold weight in one micro-batch would fold their rows interleaved by
    micro-batch (not the canonical order of either use): eager execution refuses the second."""
    model, acc = _fixed_acc()
    ids, targets = _batch(128)
    with pytest.raises(ValueError, match="continued twice in this micro-batch"):
        with acc.micro_batch(0, num_tokens=128):
            h = model.emb(ids)
            loss = (
                model.up(model.norm(h)).float().sum() + det_train.linear(model.norm(h), model.up.weight).sum()
            )
            loss.backward()
    with pytest.raises(RuntimeError, match="poisoned"):
        acc.micro_batch(0, num_tokens=128).__enter__()


def test_a_micro_batch_that_raises_poisons_until_reset_and_the_step_runs_again():
    model, acc = _fixed_acc(leaf=128)
    sizes = [64] * 4
    ids, targets = _batch(256)
    with pytest.raises(KeyError):
        with acc.micro_batch(0, num_tokens=64):
            model(ids[:, :64], targets[:, :64], 256).backward()
            raise KeyError("after the backward: the folds were written in place")
    with pytest.raises(RuntimeError, match="poisoned"):
        acc.reduce(256)
    acc.reset()
    _step(model, acc, sizes, ids, targets)
    acc.reduce(256)
    want = _grads([256], 128, fixed=False)[0]
    for name, p in model.named_parameters():
        assert_bitwise_equal(p.grad, want[name], f"after reset: {name}")


def test_autograd_grad_of_the_input_folds_nothing():
    """``torch.autograd.grad`` of an activation inside a micro-batch leaves the weights' folds as they
    were (eager; as the plain path leaves their deposits)."""
    model, acc = _fixed_acc()
    ids, targets = _batch(128)
    with acc.micro_batch(0, num_tokens=128):
        h = model.emb(ids).detach().requires_grad_()
        (gx,) = torch.autograd.grad(model.up(model.norm(h)).float().sum(), h)
    assert gx.shape == h.shape
    for index, fold in acc._fixed.folds.items():
        for buffer in fold if isinstance(fold, tuple) else (fold,):  # (the embedding's: its rows)
            assert not buffer.any(), f"{acc._names[index]}: folded inside torch.autograd.grad"


@pytest.mark.gpu
@pytest.mark.parametrize("mark", ["micro-batch", "step"])
def test_gpu_reduce_overhead_with_fixed_folds_gives_the_eager_bits(mark):
    """``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees) with fixed folds: the fold ops are
    not ``cudagraph_unsafe``, so the graphs hold them (no deposit runs between partitions); three
    steps (warm-up, recording, replays) of four micro-batches give the eager whole batch's gradients
    bit for bit, the graphs marked per micro-batch or per step."""
    sizes, leaf = [64] * 4, 128
    want = _grads([sum(sizes)], leaf, fixed=False)[0]
    torch._dynamo.reset()
    model = _model()
    calls = [0]

    def marked(*args):  # CUDA-graph trees' generations: per micro-batch, or per step of four
        if mark == "micro-batch" or calls[0] % len(sizes) == 0:
            torch.compiler.cudagraph_mark_step_begin()
        calls[0] += 1
        return run(*args)

    with torch._inductor.config.patch(emulate_precision_casts=True, graph_partition=True):
        run = torch.compile(model, fullgraph=True, dynamic=False, mode="reduce-overhead")
        got = _grads(sizes, leaf, fixed=True, steps=3, run=marked, model=model)
    _assert_grads(got, want, f"reduce-overhead with fixed folds, marked per {mark}")
    torch._dynamo.reset()


def test_embedding_fixed_fold_with_padding_and_a_short_leaf():
    """An embedding table's fixed fold holds its open leaf's rows (padded tokens' rows zeroed, as
    the plain path's copies): the table's gradient has the plain bits, a short last leaf included."""

    def grads(sizes, fixed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            det_train.Embedding(V, D, padding_idx=3, dtype=BF16, device=DEVICE),
            det_train.Linear(D, V, bias=False, dtype=BF16, device=DEVICE),
        )
        ids, _ = _batch(sum(sizes))
        ids[0, ::5] = 3  # padded tokens
        acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=128, recoverable=not fixed)
        if fixed:
            acc.fixed_folds(model)
        lo = 0
        for n in sizes:
            with acc.micro_batch(lo, num_tokens=n if fixed else None):
                model(ids[:, lo : lo + n]).float().square().sum().backward()
            lo += n
        acc.reduce(sum(sizes))
        return {name: p.grad for name, p in model.named_parameters()}

    _assert_grads([grads([64, 64, 64, 32], fixed=True)], grads([224], fixed=False), "padded embedding")


def _step(model, acc, sizes, ids, targets, run=None, skip=()):
    """One step of micro-batches of ``sizes`` through ``run`` (default: the model); the micro-batches
    at the offsets in ``skip`` run their forward only."""
    run = model if run is None else run
    lo, total = 0, sum(sizes)
    for n in sizes:
        with acc.micro_batch(lo, num_tokens=n):
            loss = run(ids[:, lo : lo + n], targets[:, lo : lo + n], total)
            if lo not in skip:
                loss.backward()
        lo += n


def test_reduce_refuses_a_fold_missing_or_repeated_in_a_micro_batch():
    """Every fixed-fold weight must be folded once per micro-batch (the folds count on the device,
    read once by ``reduce``): a micro-batch without its backward, a weight frozen after
    ``fixed_folds``, are refused there, naming the weights; ``reset`` then starts the step over."""
    model, acc = _fixed_acc(leaf=128)
    ids, targets = _batch(256)
    _step(model, acc, [64] * 4, ids, targets, skip={64})
    with pytest.raises(ValueError, match=r"not folded exactly once in each of this step's 4 micro-batches"):
        acc.reduce(256)
    acc.reset()
    model.up.weight.requires_grad_(False)
    _step(model, acc, [64] * 4, ids, targets)
    with pytest.raises(ValueError, match=r"up\.weight 0x.*frozen after fixed_folds"):
        acc.reduce(256)
    model.up.weight.requires_grad_(True)
    acc.reset()
    _step(model, acc, [64] * 4, ids, targets)
    acc.reduce(256)
    want = _grads([256], 128, fixed=False)[0]
    for name, p in model.named_parameters():
        assert_bitwise_equal(p.grad, want[name], f"after the refusals: {name}")


def test_a_backward_after_its_micro_batch_is_refused_at_reduce_where_no_fold_op_checks(monkeypatch):
    """Where a fold op's Python check does not run (a CUDA graph's replay), a backward run after its
    micro-batch's ``with`` block folds into a leaf the block's end may have closed: each micro-batch's
    end records on the device which counts were behind, and ``reduce`` refuses, naming the weights."""
    monkeypatch.setattr(deposit, "fold_checked", lambda op, count: None)  # as in a CUDA graph's replay
    model = _model()
    model.up = det_train.Linear(D, FF, bias=False, dtype=BF16, device=DEVICE)  # every weight fixed-folded
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=128, recoverable=False)
    acc.fixed_folds(model)
    ids, targets = _batch(128)
    with acc.micro_batch(0, num_tokens=64):
        loss = model(ids[:, :64], targets[:, :64], 128)
    loss.backward()  # late: after the block
    with acc.micro_batch(64, num_tokens=64):
        model(ids[:, 64:], targets[:, 64:], 128).backward()
    with pytest.raises(ValueError, match=r"up\.weight 2x, one after its micro-batch"):
        acc.reduce(128)
    acc.reset()
    _step(model, acc, [64, 64], ids, targets)
    acc.reduce(128)
    plain = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=128)
    got = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with plain.micro_batch(0):
        model(ids, targets, 128).backward()
    plain.reduce(128)
    for name, p in model.named_parameters():
        assert_bitwise_equal(got[name], p.grad, f"after the refusal: {name}")


def test_compiled_backward_after_the_micro_batch_raises():
    """Under torch.compile (outside CUDA graphs) the fold ops' bodies run: a backward after its
    micro-batch's ``with`` block raises as in eager, instead of folding into the next leaf."""
    model, acc = _fixed_acc(leaf=128)
    ids, targets = _batch(64)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    with acc.micro_batch(0, num_tokens=64):
        loss = run(ids, targets, 64)
    with pytest.raises(RuntimeError, match="backward runs outside every micro_batch"):
        loss.backward()
    torch._dynamo.reset()


def test_checkpointed_weight_used_twice_is_refused_and_once_gives_the_bits():
    """Non-reentrant activation checkpointing recomputes the forward in the backward: a weight used
    once inside it folds once (the plain accumulator's bits); used twice, the second fold is refused."""
    from torch.utils.checkpoint import checkpoint

    def loss_of(model, twice):
        def body(h):
            h = model.down(model.up(model.norm(h)))
            return model.down(model.up(h)) if twice else h

        def run(ids, targets, n):
            logits = model.head(checkpoint(body, model.emb(ids), use_reentrant=False))
            return det_train.cross_entropy(logits.flatten(0, -2), targets.flatten(), num_global_tokens=n)

        return run

    ids, targets = _batch(256)
    grads = []
    for fixed, sizes in ((False, [256]), (True, [64] * 4)):
        model = _model()
        acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=128, recoverable=not fixed)
        if fixed:
            acc.fixed_folds(model)
        lo = 0
        for n in sizes:
            with acc.micro_batch(lo, num_tokens=n):
                loss_of(model, twice=False)(ids[:, lo : lo + n], targets[:, lo : lo + n], 256).backward()
            lo += n
        acc.reduce(256)
        grads.append({name: p.grad for name, p in model.named_parameters()})
    _assert_grads(grads[1:], grads[0], "checkpointed, fixed folds")
    model, acc = _fixed_acc(leaf=128)
    with pytest.raises(ValueError, match="continued twice in this micro-batch"):
        _step(model, acc, [64], ids, targets, run=loss_of(model, twice=True))


def test_a_module_used_twice_stays_on_the_plain_path():
    block = det_train.Linear(D, D, bias=False, dtype=BF16, device=DEVICE)
    model = torch.nn.Sequential(block, block, det_train.Linear(D, D, bias=False, dtype=BF16, device=DEVICE))
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=128, recoverable=False)
    assert [acc._names[i] for i in acc.fixed_folds(model)._fixed.folds] == ["2.weight"]


def test_refusals_at_micro_batch_entry_name_the_cause_and_change_nothing():
    model, acc = _fixed_acc(leaf=128)
    ids, targets = _batch(256)
    for lo in (0, 64):  # leaf 0 in two micro-batches
        if lo == 64:
            with pytest.raises(
                ValueError, match=r"starts leaf 1 while leaf 0 is open \(tokens \[0, 64\) so far"
            ):
                acc.micro_batch(128, num_tokens=64).__enter__()
        with acc.micro_batch(lo, num_tokens=64):
            model(ids[:, lo : lo + 64], targets[:, lo : lo + 64], 256).backward()
    with pytest.raises(ValueError, match="leaf 0 .* was already folded by an earlier micro-batch"):
        acc.micro_batch(0, num_tokens=64).__enter__()
    with torch.no_grad():  # an evaluation forward over other tokens: no fold, no refusal
        with acc.micro_batch(128, num_tokens=64):
            model(ids[:, :8], targets[:, :8], 8)
    model.to(torch.float32)
    with pytest.raises(
        ValueError,
        match=r"dtype or shape changed after fixed_folds \(torch.bfloat16 \(64, 32\) -> torch.float32",
    ):
        acc.micro_batch(128, num_tokens=64).__enter__()


def test_the_poisoning_message_names_the_fixed_folds():
    model, acc = _fixed_acc(leaf=128)
    with pytest.raises(KeyError):
        with acc.micro_batch(0, num_tokens=64):
            raise KeyError("before the backward")
    with pytest.raises(
        RuntimeError, match=r"raised KeyError: 'before the backward' inside it .* down\.weight"
    ):
        acc.reduce(64)


def test_a_leaf_is_resumed_on_its_own_steps_at_any_leaf_size():
    """The fold step counts tokens inside the leaf, not the global offset: with 96-token leaves,
    micro-batches of [96, 64, 32] resume leaf 1 at its token 64 (accepted, the plain bits) and
    [96, 32, 64] at its token 32 (refused: off the Linear fold's 64-token step)."""
    want = _grads([192], 96, fixed=False)[0]
    _assert_grads(_grads([96, 64, 32], 96, fixed=True), want, "leaves of 96 tokens")
    with pytest.raises(ValueError, match="32 tokens in, not a multiple of the fixed folds' token steps"):
        _grads([96, 32, 64], 96, fixed=True)


def test_a_weight_tied_across_kinds_of_ops_keeps_each_op_on_its_path():
    """An embedding table that a Linear outside the registered module also uses: the lookup folds
    into the table's fixed fold, the Linear deposits plainly (its kind of fold differs), and the
    gradient is the plain accumulator's; a model whose only fixed fold is an embedding table runs."""

    def grads(fixed):
        torch.manual_seed(0)
        emb = det_train.Embedding(V, D, dtype=BF16, device=DEVICE)
        head = det_train.Linear(D, V, bias=False, dtype=BF16, device=DEVICE)
        head.weight = emb.weight
        ids, _ = _batch(256)
        params = list(emb.named_parameters())
        acc = CanonicalGradAccumulator(params, leaf_tokens=128, recoverable=not fixed)
        if fixed:
            assert [acc._names[i] for i in acc.fixed_folds(emb)._fixed.folds] == ["weight"]
        for lo, n in ((0, 64), (64, 64), (128, 128)):
            with acc.micro_batch(lo, num_tokens=n if fixed else None):
                head(emb(ids[:, lo : lo + n])).float().square().sum().backward()
        acc.reduce(256)
        return {"weight": emb.weight.grad}

    _assert_grads([grads(fixed=True)], grads(fixed=False), "tied across op kinds")


def test_a_weight_resized_after_fixed_folds_is_refused_before_anything_changes():
    model, acc = _fixed_acc(leaf=128)
    with torch.no_grad():
        model.emb.weight.data = torch.cat([model.emb.weight, model.emb.weight[:8]])  # a resized vocabulary
    with pytest.raises(ValueError, match=r"emb\.weight: its dtype or shape changed after fixed_folds"):
        acc.micro_batch(0, num_tokens=64).__enter__()
