"""det_train under torch.compile: the custom ops pass torch.library.opcheck (forward and backward),
a transformer block of det ops traces as one graph (fullgraph=True) and gives the eager bits
(forward, gradients, weights after optimizer steps), also through the accumulator with micro-batches
cut inside leaves (no recompile per micro-batch), with Inductor, and through kernels' kernelize in
Mode.TRAINING | Mode.TORCH_COMPILE. The GPU tests repeat the block with Inductor on CUDA.

CPU: TRITON_INTERPRET=1, tiny shapes, the aot_eager backend (AOTAutograd's graphs, eager kernels)
except one Inductor test.
"""

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import det_train
import pytest
import torch
import torch.nn.functional as F
from det_core.testing import OpNames, assert_bitwise_equal, contiguous_splits
from det_train import CanonicalGradAccumulator, layers
from det_train.accum import deposit
from det_train.ops._library import NAMESPACE
from torch._dynamo.testing import CompileCounterWithBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


def _randn(*shape, dtype=BF16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)
    return t.requires_grad_(requires_grad)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles its own graphs (no cache-limit carry-over)
    yield
    torch._dynamo.reset()


# the ops register when their modules are imported (det_train imports its modules on first use)
for _module in (
    "matmul",
    "linear",
    "rms_norm",
    "layer_norm",
    "embedding",
    "cross_entropy",
    "conv1d",
    "swiglu",
):
    importlib.import_module(f"det_train.{_module}")
for _module in ("moe_router", "moe_experts"):
    importlib.import_module(f"det_train.ops.{_module}")
importlib.import_module("det_train.parallel.tensor_parallel")


def _op(name):
    return getattr(getattr(torch.ops, NAMESPACE), name).default


# ----------------------------------------------------------------------------- opcheck
def _opcheck_cases():
    """(name, op, args, inside a micro-batch?) for every det_train op; autograd ops with inputs that
    require grad, so opcheck's AOT test also traces their backward (and its backward ops)."""
    x = _randn(2, 3, 16, seed=1, requires_grad=True)
    w = _randn(8, 16, seed=2, requires_grad=True)
    b = _randn(8, seed=3, requires_grad=True)
    dy = _randn(6, 8, seed=4)
    x2 = _randn(6, 16, seed=5)
    nw = (_randn(16, seed=6) + 2).requires_grad_()
    ids = torch.tensor([[1, 2, 2], [0, 6, 1]], device=DEVICE)
    emb = _randn(7, 16, seed=7, requires_grad=True)
    logits = _randn(6, 10, dtype=torch.float32, seed=8, requires_grad=True)
    targets = torch.tensor([1, 9, -100, 0, 3, 3], device=DEVICE)
    with torch.no_grad():  # the saved statistics the backward ops take
        rstd = _op("rms_norm")(x2, nw, 1e-6, 16, 0.0, None, 8192, False)[1]
        _, mean, lrstd = _op("layer_norm")(x2, nw, nw.new_ones(16), 1e-5, 16, None, 8192, False, False)
        lse, count = _op("cross_entropy")(logits, targets, -100, "mean", None)[1:]
    ticket = deposit.ticket()
    fold = _randn(8, 16, dtype=torch.float32, seed=19)  # a Linear weight's fixed fold
    sub_folds = _randn(2, 16, dtype=torch.float32, seed=20)  # an RMSNorm weight's: 2048-token leaves
    fold_pos = torch.tensor(512, device=DEVICE)  # the micro-batch's first token in its leaf
    fold_count = torch.zeros((), dtype=torch.int64, device=DEVICE)  # a fixed fold's counter
    emb_fold = (  # an embedding table's: the rows of 1024-token leaves
        torch.zeros(1024, dtype=torch.int64, device=DEVICE),
        torch.zeros(1024, 16, dtype=BF16, device=DEVICE),
    )
    # mixture of experts: 6 tokens, 4 experts (one gets no token), top 2, hidden 16, intermediate 8
    router_logits = _randn(6, 4, seed=13, requires_grad=True)
    experts_idx = torch.tensor([[0, 1], [1, 0], [3, 0], [0, 3], [1, 3], [3, 1]], device=DEVICE)
    gate_up = (0.3 * _randn(4, 16, 16, seed=14)).requires_grad_()
    down = (0.3 * _randn(4, 16, 8, seed=15)).requires_grad_()
    experts_in = (
        x2.detach().clone().requires_grad_(),
        experts_idx,
        _randn(6, 2, seed=16, requires_grad=True),
    )
    with torch.no_grad():
        saved = _op("moe_experts")(*experts_in, gate_up, down, None, 8192, False, False)[1:]
    experts_rows = (_randn(6, 4, 16, seed=17), x2)
    want_all = (True, True, True, True)
    cases = [
        ("matmul", (_randn(3, 4, 16), _randn(16, 5)), False),
        ("matmul_partial", (_randn(3, 64), _randn(64, 5), None, None, False), False),
        ("linear", (x, w, b, None, None, None, 8192, False, False), False),
        ("linear_weight_grad", (dy, x2, 8192, BF16), False),
        ("linear_bias_grad", (dy, 8192, BF16), False),
        ("rms_norm", (x, nw, 1e-6, 16, 0.0, None, 8192, False), False),
        ("rms_norm_backward", (x2, x2, nw.detach(), rstd, 0.0, 8192, True), False),
        (
            "layer_norm",
            (x, nw, b.detach().new_ones(16).requires_grad_(), 1e-5, 16, None, 8192, False, False),
            False,
        ),
        ("layer_norm_backward", (x2, x2, nw.detach(), mean, lrstd, 8192, True), False),
        ("embedding", (ids, emb, 2, None, 8192, False), False),
        ("embedding_backward", (ids, _randn(2, 3, 16), 7, 2, 8192, BF16), False),
        ("cross_entropy", (logits, targets, -100, "mean", None), False),
        ("cross_entropy", (logits, targets, -100, "none", None), False),
        ("cross_entropy_fixed_scale", (logits, targets, -100, "mean", 5), False),
        ("cross_entropy_fixed_scale", (logits, targets, -100, "sum", 0), False),
        (
            "cross_entropy_fixed_scale_backward",
            (torch.ones((), device=DEVICE), logits.detach(), targets, lse, -100, "mean", 5),
            False,
        ),
        (
            "cross_entropy_backward",
            (torch.ones((), device=DEVICE), logits.detach(), targets, lse, count, -100, "mean"),
            False,
        ),
        ("conv1d", (x, w.detach().t().contiguous().requires_grad_(), b, None, 8192, False, False), False),
        ("swiglu", (_randn(6, 16, seed=9, requires_grad=True),), False),
        ("swiglu_backward", (_randn(6, 8, seed=10), x2), False),
        # inside a micro-batch: the forward ops' backward deposits, and the deposit ops themselves
        # (backward and deposit ops are first order: no input requires grad; a detached parameter
        # is found by its storage, as a compiled backward's saved tensor)
        ("linear", (x, w, b, ticket, None, None, 4, True, True), True),
        # fixed folds (CanonicalGradAccumulator.fixed_folds): the forward carries the weight's fold
        ("linear", (x, w, b, ticket, fold, fold_count, 4, True, True), True),
        ("linear_fold_weight", (dy, x2, fold, fold_count), True),
        ("rms_norm", (x, nw, 1e-6, 16, 0.0, None, 2048, True, 1, sub_folds, fold_pos, fold_count), True),
        (
            "rms_norm_backward_fold",
            (x2, x2, nw.detach(), rstd, 0.0, 2048, sub_folds, fold_pos, fold_count),
            True,
        ),
        ("embedding", (ids, emb, None, None, 8, True, *emb_fold, fold_pos, fold_count), True),
        ("embedding_fold_rows", (ids, _randn(2, 3, 16), 2, *emb_fold, fold_pos, fold_count), True),
        ("rms_norm", (x, nw, 1e-6, 16, 0.0, ticket, 4, True), True),
        ("embedding", (ids, emb, None, ticket, 4, True), True),
        ("linear_deposit_weight", (dy, x2, w.detach(), ticket), True),
        ("linear_deposit_bias", (dy, b.detach(), ticket), True),
        ("rms_norm_backward_deposit", (x2, x2, nw.detach(), rstd, 0.0, ticket), True),
        ("layer_norm_backward_deposit", (x2, x2, nw.detach(), mean, lrstd, ticket), True),
        ("embedding_deposit", (ids, _randn(2, 3, 16), emb.detach(), 2, ticket), True),
        ("moe_router", (router_logits, 2, True), False),
        ("moe_router_backward", (router_logits.detach(), experts_idx, _randn(6, 2, seed=18), 2, True), False),
        ("moe_experts", (*experts_in, gate_up, down, None, 8192, False, False), False),
        ("moe_experts", (*experts_in, gate_up, down, ticket, 4, True, True), True),
        (
            "moe_experts_backward",
            (x2, *[t.detach() for t in experts_in[::2]], gate_up.detach(), down.detach(), *saved, *want_all),
            False,
        ),  # fmt: skip
        ("moe_experts_weight_grad", (*experts_rows, 8192, BF16), False),
        ("moe_experts_deposit", (*experts_rows, gate_up.detach(), ticket), True),
    ]
    params = [w, b, nw, emb, gate_up, down]
    return cases, params


class _CopiesAccumulator(CanonicalGradAccumulator):
    """An accumulator that takes a deposit for a copy of a tracked parameter as one for the
    parameter of that shape: opcheck runs each op on copies of its arguments, which a real
    accumulator (keyed by the parameter's identity and storage) rightly refuses."""

    def _slot(self, param):
        if id(param) not in self._index:
            param = next(p for p in self._params if p.shape == param.shape)
        return super()._slot(param)


def test_opcheck_every_op_forward_and_backward():
    """torch.library.opcheck (schema, autograd registration, fake tensors, AOT dispatch with dynamic
    shapes: forward and backward traced) passes for each op; deposit ops inside a micro-batch."""
    cases, params = _opcheck_cases()
    for name, args, in_micro_batch in cases:
        acc = _CopiesAccumulator(params, leaf_tokens=4)
        with acc.micro_batch(token_offset=0) if in_micro_batch else contextlib.nullcontext():
            result = torch.library.opcheck(_op(name), args)
        failed = {test: status for test, status in result.items() if status != "SUCCESS"}
        assert not failed, f"{name}: {failed}"


# ----------------------------------------------------------------------------- a transformer block
class _Block(torch.nn.Module):
    """Embedding, RMSNorm, attention (on det_train.Linear projections: torch SDPA, or det_attn on
    the GPU, where SDPA's backward is not deterministic), LayerNorm, an MLP of det_train.Linear and
    Conv1D, the LM head and det_train.cross_entropy; bf16."""

    def __init__(self, vocab=32, d=16, ff=32, heads=2, det_attn=False):
        super().__init__()
        kw = dict(dtype=BF16, device=DEVICE)
        torch.manual_seed(0)
        self.heads, self.det_attn = heads, det_attn
        self.emb = det_train.Embedding(vocab, d, **kw)
        self.norm1 = det_train.RMSNorm(d, eps=1e-5, **kw)
        self.qkv = det_train.Linear(d, 3 * d, bias=False, **kw)
        self.out = det_train.Linear(d, d, **kw)
        self.norm2 = det_train.LayerNorm(d, **kw)
        self.up = det_train.Linear(d, ff, **kw)
        self.down = det_train.Conv1D(d, ff, **kw)
        self.head = det_train.Linear(d, vocab, bias=False, **kw)

    def forward(self, ids, targets, n):
        B, T = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, -1).unbind(2)
        if self.det_attn:
            import det_attn

            a = det_attn.attention(q, k, v, causal=True)
        else:
            t = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            a = F.scaled_dot_product_attention(*t, is_causal=True).transpose(1, 2)
        x = x + self.out(a.reshape(B, T, -1))
        x = x + self.down(torch.relu(self.up(self.norm2(x))))
        logits = self.head(x)
        return det_train.cross_entropy(logits.view(B * T, -1), targets.reshape(-1), num_global_tokens=n)


def _batch(seqs=3, t=6, vocab=32, seed=11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (seqs, t + 1), generator=g).to(DEVICE)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def test_block_compiles_to_one_graph_with_the_eager_bits():
    """fullgraph=True traces the whole block (forward and backward) once; the loss and every
    parameter gradient equal the eager model's bit for bit (no accumulator: the plain backward)."""
    ids, targets = _batch()
    eager = _Block()
    loss = eager(ids, targets, ids.numel())
    loss.backward()
    compiled_model = _Block()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, fullgraph=True, backend=counter)
    c_loss = compiled(ids, targets, ids.numel())
    c_loss.backward()
    assert counter.frame_count == 1
    assert_bitwise_equal(c_loss, loss, "loss")
    want, got = _grads(eager), _grads(compiled_model)
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"grad {name}")


def _train(model, run, micro_batches, steps, leaf_tokens, batch=None, mark=False):
    """``steps`` SGD steps of ``run`` (a model or its compiled form) over the batch (``_batch(**batch)``)
    cut into ``micro_batches`` contiguous micro-batches through the accumulator; returns the last grads.
    ``mark``: ``torch.compiler.cudagraph_mark_step_begin()`` before each micro-batch (CUDA-graph trees)."""
    ids, targets = _batch(**(batch or {}))
    t = ids.shape[1]
    total = ids.numel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=leaf_tokens)
    for _ in range(steps):
        for s, e in contiguous_splits(ids.shape[0], micro_batches):
            if mark:
                torch.compiler.cudagraph_mark_step_begin()
            with acc.micro_batch(token_offset=s * t):
                run(ids[s:e], targets[s:e], total).backward()
        acc.reduce(total_tokens=total)
        grads = _grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def test_dynamic_shapes_compile_rms_norm_and_linear_with_the_eager_bits():
    """``dynamic=True`` (symbolic sizes and floats) under ``fullgraph``: RMSNorm's offset check traces
    (it used to raise Unsupported on ``math.isfinite``), and at two row counts outputs and input
    gradients equal eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        det_train.RMSNorm(64, dtype=torch.bfloat16), det_train.Linear(64, 64, dtype=torch.bfloat16)
    )
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=True)
    for rows in (3, 5):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = compiled(got_x), model(want_x)
        got.float().sum().backward()
        want.float().sum().backward()
        assert_bitwise_equal(got, want, f"output, {rows} rows")
        assert_bitwise_equal(got_x.grad, want_x.grad, f"input gradient, {rows} rows")
    assert counter.frame_count >= 1  # compiled, not run eagerly


def test_accumulator_micro_batches_through_the_compiled_block_give_the_eager_batch_bits():
    """Three micro-batches of 6 tokens (leaves of 8: every micro-batch after the first starts
    inside a leaf, the open folds and rows are carried) through the compiled block give the
    gradients of the eager block on the whole batch, and the same weights after 2 SGD steps; the
    6 micro-batches of the 2 steps run one graph (no recompile per micro-batch or token offset)."""
    eager = _Block()
    want = _train(eager, eager, micro_batches=1, steps=2, leaf_tokens=8)
    compiled_model = _Block()
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(compiled_model, fullgraph=True, backend=counter)
    got = _train(compiled_model, run, micro_batches=3, steps=2, leaf_tokens=8)
    assert counter.frame_count == 1
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"step 2 grad {name}")
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach(), f"weight {name} after 2 steps")


def test_backward_outside_the_micro_batch_raises_and_device_checks_run_in_the_compiled_graph():
    """A forward traced inside a micro-batch deposits in its backward: run outside, the deposit op
    raises (no silent plain gradient); the id range check reads the ids when the graph runs."""
    model = _Block()
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids, targets = _batch()
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=8)
    with acc.micro_batch(token_offset=0):
        loss = run(ids, targets, ids.numel())
    with pytest.raises(RuntimeError, match="backward runs outside every micro_batch"):
        loss.backward()
    with pytest.raises(ValueError, match="ids must lie in"):
        run(ids + 32, targets, ids.numel())


def test_reduce_is_a_graph_boundary():
    """acc.reduce is torch.compiler.disable'd: inside fullgraph=True it raises, otherwise it
    breaks the graph and runs eagerly (the gradients of an eager reduce)."""
    w = torch.nn.Parameter(_randn(8, 16, seed=1))
    x = _randn(6, 16, seed=2)

    def grads(reduce):
        acc = CanonicalGradAccumulator([w], leaf_tokens=4)
        for s, e in ((0, 2), (2, 6)):
            with acc.micro_batch(token_offset=s):
                det_train.linear(x[s:e], w).float().sum().backward()
        reduce(acc)
        g, w.grad = w.grad, None
        return g

    want = grads(lambda acc: acc.reduce(total_tokens=6))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        grads(torch.compile(lambda acc: acc.reduce(total_tokens=6), fullgraph=True, backend="aot_eager"))
    got = grads(torch.compile(lambda acc: acc.reduce(total_tokens=6), backend="aot_eager"))
    assert_bitwise_equal(got, want, "reduce called from a compiled function")


def test_inductor_block_with_accumulator_gives_the_eager_bits():
    """The default backend (Inductor, C++ on CPU): det ops stay opaque calls, so 3 micro-batches
    through the compiled model give the eager whole-batch gradients bit for bit.
    ``emulate_precision_casts`` makes Inductor round the torch ops' bf16 intermediates as eager does."""

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.emb = det_train.Embedding(32, 16, dtype=BF16, device=DEVICE)
            self.norm = det_train.RMSNorm(16, dtype=BF16, device=DEVICE)
            self.up = det_train.Linear(16, 32, dtype=BF16, device=DEVICE)
            self.head = det_train.Linear(32, 32, bias=False, dtype=BF16, device=DEVICE)

        def forward(self, ids, targets, n):
            x = self.emb(ids)
            logits = self.head(torch.relu(self.up(self.norm(x))) + 1)
            return det_train.cross_entropy(logits.view(-1, 32), targets.reshape(-1), num_global_tokens=n)

    eager = Small()
    want = _train(eager, eager, micro_batches=1, steps=1, leaf_tokens=8)
    compiled_model = Small()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        run = torch.compile(compiled_model, fullgraph=True)
        got = _train(compiled_model, run, micro_batches=3, steps=1, leaf_tokens=8)
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"inductor grad {name}")


@pytest.mark.slow  # ~15 s on 2 cores (det_attn and AdamWSR through the interpreter too)
def test_main_job_step_with_compiled_model_gives_the_eager_bits():
    """examples/bench_step.py's check on the main job's GPT (det_train, det_attn, AdamWSR; tiny
    preset, leaves of 12 tokens cut by micro-batches of 16): 2 steps with the model compiled
    (fullgraph, aot_eager) leave every weight bitwise equal to 2 eager steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from examples import bench_step

    cfg = bench_step.tg.make_config("tiny", batch_seqs=4, micro_batch_seqs=2, seq_len=8, leaf_tokens=12)
    options = dict(fullgraph=True, backend="aot_eager")
    assert bench_step.compiled_matches_eager(cfg, 2, DEVICE, options) is None


# ----------------------------------------------------------------------------- kernels layers
class _Repo:
    """A kernels repository (``load()``) serving det_train.layers from the source tree (no Hub build)."""

    def __init__(self, layer):
        self.layer = layer

    def load(self):
        return self.layer


def test_kernelize_training_and_torch_compile_modes():
    """kernelize(..., mode=Mode.TRAINING | Mode.TORCH_COMPILE) accepts det_train's layers
    (can_torch_compile = True) and the kernelized model compiles as one graph with the eager bits."""
    from kernels import Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping

    @use_kernel_forward_from_hub("Linear")
    class HubLinear(torch.nn.Linear):
        pass

    @use_kernel_forward_from_hub("RMSNorm")
    class LlamaRMSNorm(torch.nn.Module):  # transformers' form: weight, variance_epsilon
        def __init__(self, d, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(d, dtype=BF16, device=DEVICE))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            return hidden_states  # replaced by kernelize

    def build():
        torch.manual_seed(2)
        return torch.nn.Sequential(HubLinear(16, 24, dtype=BF16, device=DEVICE), LlamaRMSNorm(24))

    device = "cuda" if DEVICE == "cuda" else "cpu"
    mode = Mode.TRAINING | Mode.TORCH_COMPILE
    mapping = {
        "Linear": {device: {mode: _Repo(layers.Linear)}},
        "RMSNorm": {device: {mode: _Repo(layers.RMSNorm)}},
    }
    with use_kernel_mapping(mapping):
        eager = kernelize(build(), mode=mode, device=device, use_fallback=False)
        compiled_model = kernelize(build(), mode=mode, device=device, use_fallback=False)
    x = _randn(5, 16, seed=3)
    y = eager(x)
    y.float().square().sum().backward()
    run = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    c_y = run(x)
    c_y.float().square().sum().backward()
    assert_bitwise_equal(c_y, y, "kernelized forward")
    assert_bitwise_equal(
        y,
        det_train.rms_norm(det_train.linear(x, eager[0].weight, eager[0].bias), eager[1].weight, 1e-6),
        "det ops",
    )
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        assert_bitwise_equal(p.grad, q.grad, f"kernelized grad {name}")


# ----------------------------------------------------------------------------- tensor parallel
@pytest.fixture
def _one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(DEVICE == "cuda", reason="gloo on CPU through the Triton interpreter")
def test_tensor_parallel_linears_compile_with_the_eager_bits(_one_rank_group):
    """row_parallel_linear / column_parallel_linear trace as one graph (the chain's collectives run
    inside the opaque ops, the group passed by name) and give the eager bits; opcheck passes.
    One rank: the op structure; the chain over 3 real ranks compiled is the slow test below."""
    from det_train import column_parallel_linear, row_parallel_linear

    group = _one_rank_group
    x, w, b = _randn(5, 64, seed=1), _randn(24, 64, seed=2), _randn(24, seed=3)
    for fn in (row_parallel_linear, column_parallel_linear):

        def step(x, w, b, fn=fn):
            return fn(x, w, b, group=group, chunk_rows=2)

        outs = []
        for run in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
            xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
            y = run(xs, ws, bs)
            y.float().sum().backward()
            outs.append((y, xs.grad, ws.grad, bs.grad))
        for name, got, want in zip(("y", "dx", "dw", "db"), outs[1], outs[0], strict=True):
            assert_bitwise_equal(got, want, f"{fn.__name__} {name}")
    for name in ("row_parallel_linear", "column_parallel_linear"):
        args = (
            x.clone().requires_grad_(),
            w.clone().requires_grad_(),
            b,
            group.group_name,
            2,
            None,
            8192,
            False,
            False,
        )
        result = torch.library.opcheck(_op(name), args)
        assert all(status == "SUCCESS" for status in result.values()), f"{name}: {result}"


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="gloo ranks on CPU through the Triton interpreter")
def test_compiled_tensor_parallel_over_3_ranks_reproduces_unsplit(tmp_path):
    """3 gloo ranks, each running both tensor-parallel linears under torch.compile(fullgraph=True)
    (aot_eager), give the unsplit linear's bits (the compiled counterpart of test_tensor_parallel's)."""
    here = Path(__file__).parent
    spec = importlib.util.spec_from_file_location("_tp_worker", here / "tp_worker.py")
    tp_worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp_worker)
    x, w, b, dy = tp_worker.problem()
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    y = det_train.linear(xs, ws, bs)
    y.backward(dy)
    world = 3
    init = tmp_path / "init"
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    procs = [
        subprocess.Popen(
            [sys.executable, str(here / "compile_tp_worker.py"), str(r), str(world), str(init), str(outs[r])],
            env=env,
        )
        for r in range(world)
    ]
    assert all(p.wait(timeout=600) == 0 for p in procs)
    k_cuts = contiguous_splits(tp_worker.K, world, 64)
    n_cuts = contiguous_splits(tp_worker.N, world, 64)
    for rank in range(world):
        got = torch.load(outs[rank])
        (ks, ke), (ns, ne) = k_cuts[rank], n_cuts[rank]
        where = f"compiled TP={world}, rank {rank}"
        assert_bitwise_equal(got["row_y"], y.detach(), f"row-parallel y, {where}")
        assert_bitwise_equal(got["row_dx"], xs.grad[:, ks:ke], f"row-parallel dx, {where}")
        assert_bitwise_equal(got["row_dw"], ws.grad[:, ks:ke], f"row-parallel dw, {where}")
        assert_bitwise_equal(got["row_db"], bs.grad, f"row-parallel db, {where}")
        assert_bitwise_equal(got["col_y"], y.detach()[:, ns:ne], f"column-parallel y, {where}")
        assert_bitwise_equal(got["col_dx"], xs.grad, f"column-parallel dx, {where}")
        assert_bitwise_equal(got["col_dw"], ws.grad[ns:ne], f"column-parallel dw, {where}")
        assert_bitwise_equal(got["col_db"], bs.grad[ns:ne], f"column-parallel db, {where}")


# ----------------------------------------------------------------------------- GPU (Inductor, CUDA)
@pytest.mark.gpu
def test_gpu_inductor_block_plain_and_accumulated_give_the_eager_bits():
    """On CUDA with Inductor (det_attn attention, head dim 64): the block's loss and gradients equal
    eager's (plain backward), and 3 micro-batches cut inside leaves through the compiled block give
    the eager whole-batch gradients and weights after 2 SGD steps."""

    def block():
        return _Block(vocab=512, d=128, ff=384, heads=2, det_attn=True)

    ids, targets = _batch(seqs=3, t=40, vocab=512)
    eager = block()
    loss = eager(ids, targets, ids.numel())
    loss.backward()
    compiled_model = block()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        c_loss = torch.compile(compiled_model, fullgraph=True)(ids, targets, ids.numel())
        c_loss.backward()
        assert_bitwise_equal(c_loss, loss, "loss")
        for name, g in _grads(eager).items():
            assert_bitwise_equal(_grads(compiled_model)[name], g, f"grad {name}")
        torch._dynamo.reset()
        eager, compiled_model = block(), block()
        batch = dict(seqs=3, t=40, vocab=512)
        want = _train(eager, eager, micro_batches=1, steps=2, leaf_tokens=64, batch=batch)
        run = torch.compile(compiled_model, fullgraph=True)
        got = _train(compiled_model, run, micro_batches=3, steps=2, leaf_tokens=64, batch=batch)
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"step 2 grad {name}")
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach(), f"weight {name} after 2 steps")


@pytest.mark.gpu
def test_gpu_main_job_step_with_inductor_gives_the_eager_bits():
    """The main job's GPT (gpu preset's width, 2 layers, 6 x 1024 tokens in 2 micro-batches of 3
    sequences over leaves of 2 sequences: a cut inside a leaf) compiled by Inductor with bf16 intermediates
    rounded as eager (``emulate_precision_casts``): weights after 2 steps (AdamWSR) equal eager's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from examples import bench_step

    cfg = bench_step.tg.make_config("gpu", n_layer=2, batch_seqs=6, micro_batch_seqs=3, leaf_tokens=2048)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        differs = bench_step.compiled_matches_eager(cfg, 2, "cuda", dict(fullgraph=True, dynamic=False))
    assert differs is None, f"compiled weight {differs} differs from eager after 2 steps"


@pytest.mark.gpu
# 4: run 22's assertion (a tuple among a partition's recorded outputs) came from the counting
# cross-entropy pair; the model's loss now takes the fixed-scale pair, captured with the ops around it
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_gpu_reduce_overhead_block_gives_the_eager_bits(micro_batches):
    """``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees over Inductor's graph partitions,
    ``cudagraph_mark_step_begin`` before each micro-batch) of the block with det_attn, through the
    accumulator with micro-batches cut inside leaves: 3 steps (warm-up, recording, replay) give the
    gradients and weights of the eager whole batch bit for bit. The deposits and cross-entropy run
    eagerly between the graphs; the empty deposit ticket is a static input of the graphs."""
    batch = dict(seqs=4, t=40, vocab=512)

    def block():
        return _Block(vocab=512, d=128, ff=384, heads=2, det_attn=True)

    eager, compiled_model = block(), block()
    want = _train(eager, eager, micro_batches=1, steps=3, leaf_tokens=64, batch=batch)
    torch._dynamo.reset()
    options = dict(fullgraph=True, dynamic=False, mode="reduce-overhead")
    with torch._inductor.config.patch(emulate_precision_casts=True, graph_partition=True):
        run = torch.compile(compiled_model, **options)
        got = _train(compiled_model, run, micro_batches, steps=3, leaf_tokens=64, batch=batch, mark=True)
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"step 3 grad {name}")
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach(), f"weight {name} after 3 steps")


@pytest.mark.gpu
@pytest.mark.slow  # ~45 s of GPU time compiling the main job's GPT
def test_gpu_main_job_step_with_reduce_overhead_gives_the_eager_bits():
    """``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees, ``cudagraph_mark_step_begin``
    before each step) on the main job's GPT (2 layers, 2 micro-batches cutting a leaf): the
    deposit ops run eagerly between the graph partitions, and the weights after 2 steps (AdamWSR)
    equal eager's bit for bit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from examples import bench_step

    cfg = bench_step.tg.make_config("gpu", n_layer=2, batch_seqs=6, micro_batch_seqs=3, leaf_tokens=2048)
    options = dict(fullgraph=True, dynamic=False, mode="reduce-overhead")
    with torch._inductor.config.patch(emulate_precision_casts=True, graph_partition=True):
        differs = bench_step.compiled_matches_eager(cfg, 2, "cuda", options)
    assert differs is None, f"reduce-overhead weight {differs} differs from eager after 2 steps"


def test_deposit_ops_are_tagged_cudagraph_unsafe_and_the_others_are_not():
    """The ops that do the accumulator's bookkeeping at run time (every op mutating the deposit
    ticket) and those that read input values on the host carry ``torch.Tag.cudagraph_unsafe``, so
    CUDA-graph trees run them between graph partitions; every other det_train op may be captured.
    The deposit ticket, a CPU tensor the forward ops take, is empty and a static input: CUDA-graph
    trees refuse a partition input or output in CPU memory (an empty storage is accepted)."""
    import det_train.ops.cross_entropy  # noqa: F401  (registers its ops)
    import det_train.ops.embedding  # noqa: F401
    import det_train.ops.layer_norm  # noqa: F401
    import det_train.ops.linear  # noqa: F401
    import det_train.ops.rms_norm  # noqa: F401
    from det_train.ops._library import NAMESPACE

    namespace = getattr(torch.ops, NAMESPACE)
    deposits = {"linear_deposit_weight", "linear_deposit_bias", "rms_norm_backward_deposit",
                "embedding_deposit", "layer_norm_backward_deposit", "moe_experts_deposit"}  # fmt: skip
    # MoE's experts size their launches by the tokens per expert, read on the host; cross-entropy's
    # counting pair counts tokens there and passes the denominator as a CPU tensor (its fixed-scale
    # pair, num_global_tokens given, returns CUDA tensors only and is captured)
    data_dependent = {"moe_experts", "moe_experts_backward", "cross_entropy", "cross_entropy_backward"}
    others = (
        "linear_fold_weight",
        "rms_norm_backward_fold",
        "embedding_fold_rows",
        "cross_entropy_fixed_scale",
        "cross_entropy_fixed_scale_backward",
        "linear",
        "linear_weight_grad",
        "rms_norm",
        "embedding",
        "moe_router",
        "moe_experts_weight_grad",
    )
    for name in (*deposits, *data_dependent, *others):
        tagged = torch.Tag.cudagraph_unsafe in getattr(namespace, name).default.tags
        assert tagged == (name not in others), f"{name}: cudagraph_unsafe tag {tagged}"
    assert deposit.ticket().untyped_storage().data_ptr() == 0  # empty: no CPU memory in a CUDA graph
    assert torch._dynamo.utils.get_static_address_type(deposit.ticket()) == "unguarded"


@pytest.mark.parametrize("path", ["eager", "operator"])
def test_an_undefined_output_gradient_counts_as_zeros(path):
    """Output 0 of an op with saved statistics may get no gradient (a downstream Function that
    returned ``None``): its backward then runs with zeros, as autograd would pass them, and the
    inputs get the gradient of the other paths alone (here ``x.sum()``'s ones)."""

    class NoGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y * 2

        @staticmethod
        def backward(ctx, grad):
            return None

    x = _randn(8, 32, seed=1, requires_grad=True)
    w = (1 + 0.1 * _randn(32, seed=2, dtype=torch.float32)).to(BF16).requires_grad_()
    b = _randn(32, seed=3, requires_grad=True)
    targets = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ops = {
        "rms_norm": lambda: det_train.rms_norm(x, w, 1e-6),
        "layer_norm": lambda: det_train.layer_norm(x, 32, w, b, 1e-5),
        "cross_entropy": lambda: det_train.cross_entropy(x, targets, reduction="sum"),
    }
    for name, op in ops.items():
        with OpNames() if path == "operator" else contextlib.nullcontext():
            out = op()
        loss = NoGradient.apply(out).float().sum() + x.float().sum()
        gx = torch.autograd.grad(loss, x)[0]
        assert_bitwise_equal(gx, torch.ones_like(x), f"{name}: dx with output 0's gradient undefined")


@pytest.mark.parametrize("path", ["eager", "operator"])
def test_saved_statistics_get_no_zero_gradient_in_the_backward(path):
    """The ops whose extra outputs are saved statistics (RMSNorm's rstd, LayerNorm's mean and rstd,
    cross-entropy's lse) mark them non-differentiable and take ``None`` for their gradients: the
    backward allocates and fills no zero tensor for them (on the GPU a launch per output and call),
    in plain eager and through the operator (a dispatch mode routes the forward to it); the
    gradients are those of the unfused composition of the same ops."""
    x = _randn(48, 32, seed=1, requires_grad=True)
    w = (1 + 0.1 * _randn(32, seed=2, dtype=torch.float32)).to(BF16).requires_grad_()
    b = _randn(32, seed=3, requires_grad=True)
    targets = torch.randint(0, 32, (48,), generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def loss_fn():
        h = det_train.rms_norm(x, w, 1e-6)
        h = det_train.layer_norm(h, 32, w, b, 1e-5)
        return det_train.cross_entropy(h, targets, reduction="sum")

    grads = {}
    for mode in ("eager", path):
        forward_mode = OpNames() if mode == "operator" else contextlib.nullcontext()
        with forward_mode:
            loss = loss_fn()
        with OpNames() as backward_ops:
            grads[mode] = torch.autograd.grad(loss, (x, w, b))
        fills = ("zeros", "zero_", "fill_", "zeros_like")
        filled = [n for n in backward_ops.names if n.split(".")[0] in fills]
        assert filled == [], f"{mode}: the backward materialized zero gradients: {filled}"
    for got, want in zip(grads[path], grads["eager"], strict=True):
        assert_bitwise_equal(got, want)
    assert all(g.abs().sum() > 0 for g in grads["eager"])


# ----------------------------------------------------------------------------- torch.func
def test_functorch_autodiff_transforms_raise_and_vmap_equals_the_loop():
    """torch.func.grad / vjp / jvp / jacfwd and forward_ad dual tensors through det ops raise (a jvp
    used to return zero tangents without a word); vmap equals the per-sample loop bit for bit."""
    x = _randn(3, 16, dtype=torch.float32, seed=12)
    w = _randn(4, 16, dtype=torch.float32, seed=13)
    transforms = {
        "grad": lambda f: torch.func.grad(lambda v: f(v).sum())(x),
        "vjp": lambda f: torch.func.vjp(f, x)[1](torch.ones_like(f(x))),
        "jvp": lambda f: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
        "jacfwd": lambda f: torch.func.jacfwd(f)(x[0]),
        "vmap(jvp)": lambda f: torch.func.vmap(lambda v: torch.func.jvp(f, (v,), (torch.ones_like(v),)))(x),
    }
    for fname, f in (("swiglu", det_train.swiglu), ("linear", lambda v: det_train.linear(v, w))):
        for tname, transform in transforms.items():
            with pytest.raises(RuntimeError, match="torch.func transforms other than vmap"):
                transform(f)
                pytest.fail(f"{tname} of {fname} did not raise")
    for fname, f in (("swiglu", det_train.swiglu), ("matmul", lambda v: det_train.matmul(v, w.t()))):
        with torch.autograd.forward_ad.dual_level():  # a dual tensor that does not require grad
            dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
            with pytest.raises(RuntimeError, match="forward-mode AD"):
                f(dual)
                pytest.fail(f"forward_ad through {fname} did not raise")
    looped = torch.stack([det_train.swiglu(row) for row in x])
    assert_bitwise_equal(torch.func.vmap(det_train.swiglu)(x), looped, "vmap(swiglu)")
