"""``CanonicalGradAccumulator(recoverable=False)``: no undo log, the same bits.

Without the undo log an open leaf's fold is continued in its own buffer and the tree nodes a
completed leaf consumes are freed at once (the peak memory is asserted in test_memory_accounting.py).
These tests check that the gradients keep the bits of ``recoverable=True`` (and of one batch) for
micro-batches that cut leaves, on and off the folds' steps, for a Linear weight and bias, an RMSNorm
weight and an Embedding table; that a micro-batch that raises after depositing poisons the
accumulator (every later call raises, naming the parameters) until ``reset``; and that one that
raises before any deposit does not.
"""

from __future__ import annotations

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal

LEAF = 64
T = 3 * LEAF + 20  # a short last leaf
V, D, H = 50, 16, 24
# cuts inside leaves, on the Linear fold's 64-token step and off it (rows past the step are copied)
BOUNDS = [0, 40, 100, 128, 150, 200, T]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        det_train.Embedding(V, D), det_train.RMSNorm(D, eps=1e-6), det_train.Linear(D, H, bias=True)
    )


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed))


def _loss(model, ids):
    return model(ids).float().square().sum()


def _grads(bounds: list[int], recoverable: bool, model=None, acc=None) -> dict[str, torch.Tensor]:
    model = _model() if model is None else model
    ids = _tokens()
    if acc is None:
        acc = det_train.CanonicalGradAccumulator(
            model.named_parameters(), leaf_tokens=LEAF, recoverable=recoverable
        )
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        with acc.micro_batch(token_offset=lo):
            _loss(model, ids[lo:hi]).backward()
    acc.reduce(total_tokens=T)
    grads = {name: p.grad for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return grads


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{name}: {what}")


@pytest.mark.parametrize("bounds", [BOUNDS, [0, 10, 20, 30, 70, 100, 140, 190, T], [0, 128, T]])
def test_bits_equal_recoverable_and_one_batch(bounds):
    want = _grads(bounds, recoverable=True)
    assert all(g is not None and g.abs().sum() > 0 for g in want.values())
    _assert_same(_grads(bounds, recoverable=False), want, f"recoverable=False vs True, {bounds}")
    _assert_same(_grads([0, T], recoverable=False), want, "one batch, recoverable=False")


def test_reusable_after_reduce():
    """The in-place state of one step is gone after ``reduce``: a second step has the same bits."""
    model = _model()
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF, recoverable=False)
    first = _grads(BOUNDS, False, model, acc)
    _assert_same(_grads(BOUNDS[::2] + [T], False, model, acc), first, "second step on the same accumulator")
    ids = _tokens()
    with acc.micro_batch(token_offset=0):
        _loss(model, ids).backward()
    acc.reduce(total_tokens=T)
    written = [p.grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"p\.grad already holds a non-zero gradient.*a previous step"):
        acc.reduce(total_tokens=T)  # a second reduce of the step, its p.grad still there
    assert all(p.grad is g for p, g in zip(model.parameters(), written, strict=True))
    for p in model.parameters():
        p.grad = None
    with pytest.raises(RuntimeError, match="nothing was deposited since .* last reduced"):
        acc.reduce(total_tokens=T)  # the same after zero_grad
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("recoverable", [True, False])
def test_the_open_fold_is_continued_in_its_buffer_only_without_undo(recoverable):
    model = _model()
    ids = _tokens()
    weight = model[2].weight
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=T, recoverable=recoverable)
    folds = []
    for lo, hi in ((0, 64), (64, 128), (128, 192)):  # inside leaf 0, on the Linear fold's step
        with acc.micro_batch(token_offset=lo):
            _loss(model, ids[lo:hi]).backward()
        (fold,) = (v.acc for k, v in acc._carry.items() if acc._params[k[0]] is weight)
        folds.append(fold)
    same = [folds[0].data_ptr() == f.data_ptr() for f in folds[1:]]
    assert same == [not recoverable] * 2  # a new buffer each micro-batch only under the undo contract


def _after_the_first_micro_batch():
    """(model, tokens, one batch's gradients, a recoverable=False accumulator holding tokens [0, 40))."""
    model = _model()
    ids = _tokens()
    want = _grads(BOUNDS, recoverable=True)
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF, recoverable=False)
    with acc.micro_batch(token_offset=0):
        _loss(model, ids[:40]).backward()
    return model, ids, want, acc


def test_a_micro_batch_that_raises_poisons_until_reset():
    model, ids, want, acc = _after_the_first_micro_batch()
    with pytest.raises(RuntimeError, match="after the deposit"):
        with acc.micro_batch(token_offset=40):
            _loss(model, ids[40:100]).backward()  # continues leaf 0's folds in place, then raises
            raise RuntimeError("after the deposit")
    for call in (
        lambda: acc.micro_batch(token_offset=40).__enter__(),
        lambda: acc.reduce(total_tokens=T),
        lambda: acc.deposit(model[2].weight, 0, torch.zeros(1, H, D)),
    ):
        with pytest.raises(RuntimeError) as err:
            call()
        msg = str(err.value)
        assert "recoverable=False" in msg and "poisoned" in msg and "token_offset 40" in msg
        assert "after the deposit" in msg and "acc.reset()" in msg and "recoverable=True" in msg
        for name in ("0.weight", "1.weight", "2.weight", "2.bias"):
            assert name in msg, (name, msg)
    assert all(p.grad is None for p in model.parameters())  # nothing was written
    acc.reset()
    _assert_same(_grads(BOUNDS, False, model, acc), want, "after reset, the step run again")


def test_a_micro_batch_that_raises_before_depositing_does_not_poison():
    model, ids, want, acc = _after_the_first_micro_batch()
    with pytest.raises(RuntimeError, match="in the forward"):
        with acc.micro_batch(token_offset=40):
            _loss(model, ids[40:100])
            raise RuntimeError("in the forward")
    for lo, hi in zip(BOUNDS[1:-1], BOUNDS[2:], strict=True):
        with acc.micro_batch(token_offset=lo):
            _loss(model, ids[lo:hi]).backward()
    acc.reduce(total_tokens=T)
    _assert_same({n: p.grad for n, p in model.named_parameters()}, want, "after a forward that raised")


class _FailOnce(torch.autograd.Function):
    """The identity, whose backward raises once while ``armed``: placed under the Linear, it fails
    a backward after the Linear's weight and bias deposited and before the norm and the embedding."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("the backward failed")
        return grad


def _loss_through_fail_once(model, ids):
    return model[2](_FailOnce.apply(model[1](model[0](ids)))).float().square().sum()


@pytest.mark.parametrize("recoverable", [True, False])
def test_a_backward_caught_inside_the_micro_batch_raises_when_the_micro_batch_ends(recoverable):
    """A backward that raises after its first deposit, its error caught inside the ``with`` block
    and the forward and backward run again there: the retry would deposit a second time (a second
    use of each parameter, the doubled gradient with one micro-batch per step). The micro-batch
    raises when it ends, naming the cause and the remedy; then the documented recovery (run it again
    with the undo log; ``reset`` and the whole step without) gives one batch's bits."""
    model, ids = _model(), _tokens()
    want = _grads(BOUNDS, recoverable=True)
    acc = det_train.CanonicalGradAccumulator(
        model.named_parameters(), leaf_tokens=LEAF, recoverable=recoverable
    )
    for lo, hi in ((0, 40), (40, 100), (100, 128)):
        with acc.micro_batch(token_offset=lo):
            _loss_through_fail_once(model, ids[lo:hi]).backward()
    _FailOnce.armed = True
    with pytest.raises(RuntimeError) as err:  # a micro-batch on a leaf boundary: no leaf-gap error
        with acc.micro_batch(token_offset=128):
            try:
                _loss_through_fail_once(model, ids[128:150]).backward()
            except RuntimeError as caught:
                assert "the backward failed" in str(caught)
                _loss_through_fail_once(model, ids[128:150]).backward()
    msg = str(err.value)
    assert "token_offset 128" in msg and "caught inside" in msg and "2.weight" in msg and "2.bias" in msg
    assert "second use" in msg and "recoverable=True" in msg and "acc.reset()" in msg
    if recoverable:  # undone: the micro-batch runs again, then the rest of the step
        bounds = BOUNDS[3:]
    else:  # poisoned until reset; then the whole step again
        with pytest.raises(RuntimeError, match="poisoned.*caught inside"):
            acc.reduce(total_tokens=T)
        acc.reset()
        bounds = BOUNDS
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        with acc.micro_batch(token_offset=lo):
            _loss_through_fail_once(model, ids[lo:hi]).backward()
    acc.reduce(total_tokens=T)
    _assert_same({n: p.grad for n, p in model.named_parameters()}, want, "after the recovery")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_and_repeated_backwards_that_finish_are_not_taken_for_failed_ones(use_reentrant):
    """What the failed-backward check must let through: a checkpointed segment (its recomputation's
    backward is another autograd graph task, nested in the step's with ``use_reentrant=True``) gives
    the bits of the plain model, and two backward calls that both finish in one micro-batch (two
    losses) end it without an error."""
    from torch.utils.checkpoint import checkpoint

    model, ids = _model(), _tokens()
    want = _grads(BOUNDS, recoverable=True)
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    for lo, hi in zip(BOUNDS[:-1], BOUNDS[1:], strict=True):
        with acc.micro_batch(token_offset=lo):
            h = model[0](ids[lo:hi])
            y = checkpoint(lambda t: model[2](model[1](t)), h, use_reentrant=use_reentrant)
            y.float().square().sum().backward()
    acc.reduce(total_tokens=T)
    _assert_same({n: p.grad for n, p in model.named_parameters()}, want, "checkpointed")
    for p in model.parameters():
        p.grad = None
    two = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    with two.micro_batch(token_offset=0):
        out = model(ids)
        out.float().square().sum().backward(retain_graph=True)
        out.float().sum().backward()
    two.reduce(total_tokens=T)
    assert all(p.grad is not None and bool(p.grad.float().abs().sum() > 0) for p in model.parameters())


def test_compiled_autograd_backwards_are_not_taken_for_failed_ones():
    """Under compiled autograd the engine runs no callbacks queued inside its graph, so the
    failed-backward check is off there: its micro-batches end without an error, with eager's bits."""
    model, ids = _model(), _tokens()
    want = _grads(BOUNDS, recoverable=True)
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            for lo, hi in zip(BOUNDS[:-1], BOUNDS[1:], strict=True):
                with acc.micro_batch(token_offset=lo):
                    loss = _loss(model, ids[lo:hi])
                    torch.compile(lambda: loss.backward(), backend="aot_eager")()  # noqa: B023
    finally:
        torch._dynamo.reset()
    acc.reduce(total_tokens=T)
    _assert_same({n: p.grad for n, p in model.named_parameters()}, want, "compiled autograd")


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
def test_an_input_gradient_inside_the_micro_batch_deposits_nothing(how):
    """An adversarial (FGSM) step takes the input gradient inside the micro-batch, then trains on the
    perturbed input: the first backward computes dX through the det ops, which would deposit their
    weight gradients too; autograd leaves ``p.grad`` alone there, and so does the accumulator (the
    gradient is the perturbed batch's alone, bit for bit)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(det_train.RMSNorm(D, eps=1e-6), det_train.Linear(D, H, bias=True))
    x = torch.randn(T, D, dtype=torch.bfloat16)

    def input_grad(xs):
        xs = xs.detach().requires_grad_()
        loss = model(xs).float().square().sum()
        if how == "autograd.grad":
            return torch.autograd.grad(loss, xs)[0]
        loss.backward(inputs=[xs])
        return xs.grad

    def step(inside: bool) -> dict[str, torch.Tensor]:
        acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
        for lo, hi in zip(BOUNDS[:-1], BOUNDS[1:], strict=True):
            gx = None if inside else input_grad(x[lo:hi])  # outside: no accumulator active
            with acc.micro_batch(token_offset=lo):
                gx = input_grad(x[lo:hi]) if inside else gx
                adversarial = (x[lo:hi] + 0.01 * gx.sign()).to(torch.bfloat16)
                model(adversarial).float().square().sum().backward()
        acc.reduce(total_tokens=T)
        grads = {name: p.grad for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    _assert_same(step(inside=True), step(inside=False), f"FGSM with {how} inside the micro-batch")


def test_input_gradients_over_part_of_the_micro_batch_and_after_a_dtype_round_trip():
    """An input gradient over the micro-batch's first leaf only (the norms' whole-leaf path) deposits
    nothing and records no token count; a model cast to float64 and back between steps (new
    AccumulateGrad nodes) keeps depositing with the same accumulator: one-batch bits both times."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(det_train.RMSNorm(D, eps=1e-6), det_train.Linear(D, H, bias=True))
    x = torch.randn(2 * LEAF, D)

    def step(acc, probe: bool) -> dict[str, torch.Tensor]:
        with acc.micro_batch(token_offset=0):
            if probe:  # e.g. a saliency map of the first sequence
                first = x[:LEAF].clone().requires_grad_()
                torch.autograd.grad(model(first).square().sum(), first)
            model(x).square().sum().backward()
        acc.reduce(total_tokens=2 * LEAF)
        grads = {name: p.grad for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    want = step(det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF), False)
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    _assert_same(step(acc, True), want, "input gradient over the first leaf")
    model.double()
    model.float()
    _assert_same(step(acc, True), want, "after model.double().float()")


def _grad_accumulator(p: torch.Tensor):
    return p.view_as(p).grad_fn.next_functions[0][0]


@pytest.mark.parametrize("recoverable", [True, False])
def test_no_autograd_node_outlives_the_micro_batch(recoverable):
    """The accumulator asks autograd's engine whether the running backward accumulates into each
    parameter, through the parameter's AccumulateGrad node; it must not keep that node alive past
    the micro-batch. torch makes a new node for the next forward once the graph is gone, on the
    stream current then; a kept one would be reused with the stream it was made on, and the engine
    syncs that stream at the end of every backward (inside a CUDA graph capture after a warm-up on a
    side stream: a wait on uncaptured work, ``cudaErrorStreamCaptureIsolation``)."""
    model, ids = _model(), _tokens()
    acc = det_train.CanonicalGradAccumulator(
        model.named_parameters(), leaf_tokens=LEAF, recoverable=recoverable
    )
    with acc.micro_batch(token_offset=0):
        loss = _loss(model, ids[:LEAF])
        for p in model.parameters():  # the nodes of this micro-batch's graph, marked
            _grad_accumulator(p).metadata["marked"] = True
        loss.backward()
    del loss
    kept = [n for n, p in model.named_parameters() if "marked" in _grad_accumulator(p).metadata]
    assert kept == [], f"AccumulateGrad nodes kept alive after the micro-batch: {kept}"
    acc.reduce(total_tokens=LEAF)


def test_autograd_grad_of_a_tracked_parameter_inside_the_micro_batch_is_refused():
    """``torch.autograd.grad(loss, [p])`` would return None for a tracked parameter (its gradient goes
    to the accumulator) and deposit it besides: refused, naming the parameter; the micro-batch is
    undone and the step can go on."""
    model, ids = _model(), _tokens()
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    with pytest.raises(RuntimeError, match=r"asks for 2\.weight's gradient, but det_train ops send"):
        with acc.micro_batch(token_offset=0):
            torch.autograd.grad(_loss(model, ids[:LEAF]), [model[2].weight])
    _assert_same(_grads(BOUNDS, True, model=model, acc=acc), _grads(BOUNDS, True), "after the refusal")


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_on_a_tracked_parameter_is_refused(kind):
    """A tensor hook on a tracked parameter would receive ``None`` (the det ops' weight gradient goes to
    the accumulator, not through autograd): a mask or scale it applies would be skipped silently; a
    post-accumulate-grad hook (optimizer-in-backward, per-parameter clipping) would see ``p.grad``
    None. The micro-batch refuses to start, naming the parameter; without the hook it runs."""
    model, ids = _model(), _tokens()
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    if kind == "register_hook":
        handle = model[0].weight.register_hook(lambda grad: grad * 0)  # e.g. freezing embedding rows
    else:
        handle = model[2].weight.register_post_accumulate_grad_hook(lambda p: p.grad.clamp_(-1, 1))
    name = "0.weight" if kind == "register_hook" else "2.weight"
    with pytest.raises(RuntimeError, match=rf"gradient hooks \(register_hook or .*\): {name}\. .*see None"):
        with acc.micro_batch(token_offset=0):
            _loss(model, ids[:LEAF]).backward()
    assert all(p.grad is None for p in model.parameters())
    handle.remove()
    _assert_same(_grads(BOUNDS, True, model=model, acc=acc), _grads(BOUNDS, True), "after the hook's removal")


def test_a_hook_registered_inside_the_micro_batch_is_refused_at_its_first_deposit():
    """The micro-batch's entry check cannot see a hook registered after it (between the forward and
    the backward, or by a module's forward pre-hook): the deposit for that parameter refuses it, before
    the hook would run with ``None``; the micro-batch is undone, and without the hook it runs again."""
    model, ids = _model(), _tokens()
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    with pytest.raises(RuntimeError, match=r"gradient hooks \(register_hook or .*\): 0\.weight\."):
        with acc.micro_batch(token_offset=0):
            loss = _loss(model, ids[:LEAF])
            handle = model[0].weight.register_hook(lambda grad: grad * 0)
            loss.backward()
    handle.remove()
    assert all(p.grad is None for p in model.parameters())
    _assert_same(_grads(BOUNDS, True, model=model, acc=acc), _grads(BOUNDS, True), "after the hook's removal")


def test_a_parameter_frozen_after_the_accumulator_was_built_is_named_as_the_likely_cause():
    """A tracked parameter frozen (``requires_grad_(False)``) before or during the step deposits
    nothing from then on; ``reduce``'s refusal names it as the likely cause. A parameter frozen when
    the accumulator was built is not tracked: its deposit, once unfrozen, says so."""
    model, ids = _model(), _tokens()
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    with acc.micro_batch(token_offset=0):
        _loss(model, ids[:LEAF]).backward()
    model[1].weight.requires_grad_(False)
    with acc.micro_batch(token_offset=LEAF):
        _loss(model, ids[LEAF:]).backward()
    with pytest.raises(
        ValueError,
        match=r"1\.weight \(use 0\): tokens \[64, 212\) .*Likely cause: "
        r"requires_grad=False on 1\.weight, set after this accumulator was built",
    ):
        acc.reduce(total_tokens=T)
    model[1].weight.requires_grad_(True)
    acc.reset()
    model.zero_grad(set_to_none=True)
    model[1].weight.requires_grad_(False)
    frozen_at_build = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    model[1].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"does not track: .*requires_grad=False when the accumulator"):
        with frozen_at_build.micro_batch(token_offset=0):
            _loss(model, ids[:LEAF]).backward()
    # a generator read before (the optimizer took it): the accumulator tracks nothing, and says so
    params = model.named_parameters()
    torch.optim.SGD([p for _, p in params], lr=0.1)
    of_nothing = det_train.CanonicalGradAccumulator(params, leaf_tokens=LEAF)
    with pytest.raises(ValueError, match=r"does not track: .*it tracks no parameter at all: .*reads once"):
        with of_nothing.micro_batch(token_offset=0):
            _loss(model, ids[:LEAF]).backward()


def test_bad_recoverable_and_params():
    with pytest.raises(TypeError, match="recoverable must be True or False"):
        det_train.CanonicalGradAccumulator(_model().parameters(), recoverable=0)
    for params in (_model(), 3):  # a module itself, a non-iterable: what to pass instead
        with pytest.raises(TypeError, match=r"takes the parameters to track.*model\.named_parameters\(\)"):
            det_train.CanonicalGradAccumulator(params)
    with pytest.raises(TypeError, match="takes the parameters to track, got Parameter"):
        det_train.CanonicalGradAccumulator(_model()[2].weight)  # one Parameter: not its rows
    with pytest.raises(TypeError, match=r"params\[0\]: a Parameter or a \(name, Parameter\), got 3 items"):
        det_train.CanonicalGradAccumulator([("w", _model()[2].weight, 1)])
    listed = torch.nn.ParameterList(_model().parameters())  # a module that is a list of Parameters
    assert len(det_train.CanonicalGradAccumulator(listed)._params) == 4
    acc = det_train.CanonicalGradAccumulator(_model().parameters())
    assert acc.recoverable is True


# ---------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
def test_gpu_mlp_four_micro_batches_cutting_leaves():
    """A bf16 MLP (1024 -> 4096 -> 1024) over 16384 tokens in 4 micro-batches that cut 4096-token
    leaves (off the fold's step too): ``recoverable=False`` (folds continued in place by the dW fold
    kernel, ``out=acc``) gives the bits of ``recoverable=True``."""
    tokens, leaf = 16384, 4096
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)

    def step(recoverable: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(
            det_train.Linear(1024, 4096, bias=True), torch.nn.GELU(), det_train.Linear(4096, 1024, bias=False)
        ).to(device="cuda", dtype=torch.bfloat16)
        acc = det_train.CanonicalGradAccumulator(
            mlp.named_parameters(), leaf_tokens=leaf, recoverable=recoverable
        )
        bounds = [0, 3000, 7000, 12345, tokens]
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            with acc.micro_batch(token_offset=lo):
                mlp(x[lo:hi]).float().square().mean().backward()
        acc.reduce(total_tokens=tokens)
        return [p.grad for p in mlp.parameters()]

    want = step(True)
    for i, (got, ref) in enumerate(zip(step(False), want, strict=True)):
        assert ref.abs().sum() > 0
        assert_bitwise_equal(got, ref, f"parameter {i}: recoverable=False vs True")


@pytest.mark.parametrize("fixed", [False, True])
def test_an_optimizer_step_before_reduce_is_refused_and_updates_nothing(fixed):
    """Forgetting ``acc.reduce`` used to skip a whole step silently (every tracked ``.grad`` still
    None): any optimizer's step over a tracked parameter now raises while deposits wait, and updates
    nothing; an optimizer of other parameters is left alone; after ``reduce`` (or ``reset``) the
    step runs and the hook is gone."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    hooks_before = len(_global_optimizer_pre_hooks)
    model, ids = _model(), _tokens()
    acc = det_train.CanonicalGradAccumulator(
        model.named_parameters(), leaf_tokens=LEAF, recoverable=not fixed
    )
    if fixed:
        acc.fixed_folds(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.nn.Parameter(torch.ones(3))
    other_opt = torch.optim.SGD([other], lr=0.1)
    for lo, hi in ((0, 32), (32, 64)):  # inside one leaf: fixed folds hold one open leaf
        with acc.micro_batch(token_offset=lo, num_tokens=hi - lo if fixed else None):
            _loss(model, ids[lo:hi]).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"SGD.step\(\) while a CanonicalGradAccumulator holds "
                           r"micro-batches not reduced \(0.weight, 1.weight, 2.weight and 1 more\): call "
                           r"acc.reduce\(total_tokens=...\)"):  # fmt: skip
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        other.grad = torch.ones(3)
        other_opt.step()  # tracks nothing of the accumulator's
        assert torch.equal(other.detach(), torch.full((3,), 0.9))
        other.data.fill_(1.0)
    acc.reset()
    assert len(_global_optimizer_pre_hooks) == hooks_before
    for lo, hi in ((0, 64), (64, 128), (128, 192), (192, T)):
        with acc.micro_batch(token_offset=lo, num_tokens=hi - lo if fixed else None):
            _loss(model, ids[lo:hi]).backward()
    acc.reduce(total_tokens=T)
    assert len(_global_optimizer_pre_hooks) == hooks_before
    before = model[2].weight.detach().clone()
    opt.step()
    assert not torch.equal(model[2].weight, before)
    # a new accumulator over the same parameters replaces a pending one ("start over")
    with acc.micro_batch(token_offset=0, num_tokens=32 if fixed else None):
        _loss(model, ids[:32]).backward()
    with pytest.raises(RuntimeError, match="not reduced"):
        opt.step()
    det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=LEAF)
    assert len(_global_optimizer_pre_hooks) == hooks_before
    opt.zero_grad()
    opt.step()
