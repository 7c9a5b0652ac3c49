"""det_attn under torch.compile, on CPU through the Triton interpreter (tiny sizes) and on the GPU.

Every call goes through det_attn's torch.library operators (``_ops``): they pass
``torch.library.opcheck`` (schema, autograd registration, fake tensors, AOT dispatch with dynamic
shapes); models built from the public functions trace with no graph break (``fullgraph=True``) and
give the eager bits (outputs and gradients), with ``aot_eager`` and with Inductor (which treats the
operators as extern calls, so it cannot reorder their sums); the ``kernels`` layer declares
``can_torch_compile`` and kernelizes in ``Mode.TRAINING | Mode.TORCH_COMPILE``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from det_attn import _ops, attention, attention_varlen, scaled_dot_product_attention
from det_attn.layers import DetAttention
from det_attn.transformers_integration import det_attn_transformers_forward
from det_core.testing import assert_bitwise_equal

D = 64
NAMES = ("o", "lse", "dq", "dk", "dv")
ALL_CHECKS = {"test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"}


def _randn(*shape, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def _leaves(*tensors):
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _compile_counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("aot_eager")


# --------------------------------------------------------------------------- opcheck


def test_padded_operators_pass_opcheck():
    q, k, v = _leaves(_randn(1, 9, 2, D, seed=1), _randn(1, 9, 1, D, seed=2), _randn(1, 9, 1, D, seed=3))
    # causal, default scale, dropout with a seed above 2**63 (a negative seed word), both offsets
    options = (True, None, 0.25, _ops.seed_word(2**63 + 5), 3, 1)
    assert options[3] < 0
    assert set(torch.library.opcheck(_ops.attention_forward, (q, k, v, *options))) == ALL_CHECKS
    with torch.no_grad():
        out, lse2 = _ops.attention_forward(q, k, v, *options)
    grad_out = _randn(*out.shape, seed=4)
    args = (grad_out, q.detach(), k.detach(), v.detach(), out, lse2, *options)
    assert set(torch.library.opcheck(_ops.attention_backward, args)) == ALL_CHECKS
    # the operators are what the public function runs: the same bits
    qa, ka, va = _leaves(q, k, v)
    o = attention(qa, ka, va, causal=True, dropout_p=0.25, seed=2**63 + 5, sequence_offset=3, head_offset=1)
    o.backward(grad_out.view(o.shape))
    assert_bitwise_equal(o.reshape(out.shape), out, "o")
    for name, a, b in zip(
        NAMES[2:], (qa.grad, ka.grad, va.grad), _ops.attention_backward(*args), strict=True
    ):
        assert_bitwise_equal(a.reshape(b.shape), b, name)


def test_packed_operators_pass_opcheck():
    # three sequences, the middle one empty; causal (keys >= queries), a given scale, no dropout
    q = _randn(9, 2, D, seed=5)
    k, v = _randn(11, 1, D, seed=6), _randn(11, 1, D, seed=7)
    cu_q = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 5, 11], dtype=torch.int32)
    options = (cu_q, cu_k, 5, 6, True, 0.125, 0.0, 0, 0, 0)
    q, k, v = _leaves(q, k, v)
    assert set(torch.library.opcheck(_ops.attention_varlen_forward, (q, k, v, *options, True))) == ALL_CHECKS
    with torch.no_grad():
        out, lse2 = _ops.attention_varlen_forward(q, k, v, *options, False)
    args = (_randn(*out.shape, seed=8), q.detach(), k.detach(), v.detach(), out, lse2, *options)
    assert set(torch.library.opcheck(_ops.attention_varlen_backward, args)) == ALL_CHECKS
    assert_bitwise_equal(attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True, softmax_scale=0.125), out)


def test_backward_operator_checks_direct_callers():
    q, k, v = _randn(1, 9, 2, D, seed=9), _randn(1, 9, 1, D, seed=10), _randn(1, 9, 1, D, seed=11)
    options = (False, None, 0.0, 0, 0, 0)
    out, lse2 = _ops.attention_forward(q, k, v, *options)
    with pytest.raises(ValueError, match=r"grad_out must be \(9, 2, 64\)"):
        _ops.attention_backward(out[:4], q, k, v, out, lse2, *options)
    with pytest.raises(
        ValueError, match=r"lse2 must be the forward's \(2, 9\) float32 on cpu, got \(2, 9\) float64 on cpu"
    ):
        _ops.attention_backward(out, q, k, v, out, lse2.double(), *options)


def test_packed_backward_operator_checks_the_cu_seqlens_values_of_direct_callers():
    """A direct call of the packed backward with cu_seqlens past the tokens indexed out of bounds
    (a new-user trial: the process aborted in free()); it now reads and checks them, as the forward
    does with ``validate``; the autograd formula, whose forward checked them, passes validate=False."""
    q, k = _randn(5, 2, D, seed=12), _randn(5, 1, D, seed=13)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    options = (3, 3, True, None, 0.0, 0, 0, 0)
    with torch.no_grad():
        out, lse2 = _ops.attention_varlen_forward(q, k, k, cu, cu, *options, True)
    for bad, match in (([0, 3, 4000], "cu_seqlens_q"), ([0, 4, 2], "cu_seqlens_q")):
        bad = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            _ops.attention_varlen_backward(torch.ones_like(out), q, k, k, out, lse2, bad, bad, *options)
        with pytest.raises(ValueError, match=match):
            _ops.attention_varlen_forward(q, k, k, bad, bad, *options, True)
    grads = _ops.attention_varlen_backward(torch.ones_like(out), q, k, k, out, lse2, cu, cu, *options)
    unchecked = _ops.attention_varlen_backward(
        torch.ones_like(out), q, k, k, out, lse2, cu, cu, *options, validate=False
    )
    for a, b in zip(grads, unchecked, strict=True):
        assert_bitwise_equal(a, b)


def test_window_and_softcap_operators_pass_opcheck_and_compile_to_eagers_bits():
    # the options' tail (window, softcap): operators checked, then a compiled padded and packed call
    q, k, v = _leaves(
        _randn(1, 21, 2, D, seed=40), _randn(1, 21, 1, D, seed=41), _randn(1, 21, 1, D, seed=42)
    )
    options = (True, None, 0.0, 0, 0, 0, 5, 2.0)
    assert set(torch.library.opcheck(_ops.attention_forward, (q, k, v, *options))) == ALL_CHECKS
    with torch.no_grad():
        out, lse2 = _ops.attention_forward(q, k, v, *options)
    args = (_randn(*out.shape, seed=43), q.detach(), k.detach(), v.detach(), out, lse2, *options)
    assert set(torch.library.opcheck(_ops.attention_backward, args)) == ALL_CHECKS
    cu = torch.tensor([0, 8, 21], dtype=torch.int32)

    def f(q, k, v):
        o = attention(q, k, v, causal=True, window=5, softcap=2.0)
        p = attention_varlen(q[0], k[0], v[0], cu, cu, 13, 13, causal=True, window=3, softcap=1.5)
        return o, p

    def fwd_bwd(run):
        leaves = _leaves(q, k, v)
        o, p = run(*leaves)
        (o.float().sum() + (p.float() * 2).sum()).backward()
        return o.detach(), p.detach(), *(t.grad for t in leaves)

    counter = _compile_counter()
    for i, (a, b) in enumerate(
        zip(fwd_bwd(torch.compile(f, fullgraph=True, backend=counter)), fwd_bwd(f), strict=True)
    ):
        assert_bitwise_equal(a, b, f"output {i}")
    assert counter.frame_count == 1


# --------------------------------------------------------------------------- compiled == eager


class _Block(torch.nn.Module):
    """Fused q/k/v projection, causal det_attn attention with dropout, output projection, residual."""

    def __init__(self, width: int = 96, heads: int = 2, kv_heads: int = 1) -> None:
        super().__init__()
        self.heads = (heads, kv_heads, kv_heads)
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * D, bias=False, dtype=torch.bfloat16)
        self.out = torch.nn.Linear(heads * D, width, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, -1, D).split(self.heads, dim=2)  # strided views, no copies
        o = attention(q, k, v, causal=True, dropout_p=0.2, seed=seed)
        return x + self.out(o.reshape(b, t, -1))


def _block_step(block, run, x, dy, seed):
    """Output and gradients (x, both weights) of one forward + backward of ``run`` (``block`` or its
    compiled self)."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = run(x, seed)
    y.backward(dy)
    return y.detach(), x.grad, block.qkv.weight.grad, block.out.weight.grad


def test_compiled_block_equals_eager_bitwise_with_per_step_seeds():
    torch.manual_seed(0)
    block = _Block()
    x, dy = _randn(1, 11, 96, seed=12), _randn(1, 11, 96, seed=13)
    counter = _compile_counter()
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    for seed in (5, 6, 7):  # a new dropout seed per step, as an argument of the compiled model
        want = _block_step(block, block, x, dy, seed)
        got = _block_step(block, compiled, x, dy, seed)
        for name, a, b in zip(("y", "dx", "dW_qkv", "dW_out"), got, want, strict=True):
            assert_bitwise_equal(a, b, f"{name}, seed {seed}")
    # the first seed is traced as a constant, the second makes it dynamic: no graph per step
    assert counter.frame_count == 2


_LAYER = DetAttention()


def _entry_points(q, k, v, cu, module):
    """det_attn's other public entry points on (B=1) q, k, v: packed (output and LSE), SDPA-style,
    transformers' and the kernels layer."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return (
        *attention_varlen(q[0], k[0], v[0], cu, cu, 7, 7, causal=True, return_lse=True),
        scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True, scale=0.2),
        det_attn_transformers_forward(
            module, qt, kt, vt, None, scaling=0.125, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
            max_length_k=7,
        )[0],
        _LAYER(q, k, v, causal=False, dropout_p=0.1, seed=3),
    )  # fmt: skip


def test_compiled_entry_points_equal_eager_bitwise_and_check_cu_seqlens_at_run_time():
    module = torch.nn.Module()
    module.is_causal = True
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    inputs = (_randn(1, 10, 2, D, seed=14), _randn(1, 10, 1, D, seed=15), _randn(1, 10, 1, D, seed=16))
    weights = [_randn(10 * 2 * D, seed=17 + i).float() for i in range(4)]

    def step(run, cu):
        leaves = _leaves(*inputs)
        outs = run(*leaves, cu, module)
        differentiable = (outs[0], *outs[2:])  # not the LSE
        sum((o.float().flatten() * w).sum() for o, w in zip(differentiable, weights, strict=True)).backward()
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    counter = _compile_counter()
    compiled = torch.compile(_entry_points, fullgraph=True, backend=counter)
    want = step(_entry_points, cu)
    for i, (a, b) in enumerate(zip(step(compiled, cu), want, strict=True)):
        assert_bitwise_equal(a, b, f"output {i}")
    # the values of cu_seqlens are checked when the compiled graph runs (no recompile, no sync at
    # trace time), with eager's error
    with pytest.raises(ValueError, match=r"max_seqlen_q=7 is below the longest sequence \(8\)"):
        compiled(*_leaves(*inputs), torch.tensor([0, 2, 10], dtype=torch.int32), module)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        compiled(*_leaves(*inputs), torch.tensor([0, 11, 10], dtype=torch.int32), module)
    assert counter.frame_count == 1


def test_compiled_transformers_forward_refuses_rows_packed_by_position_ids():
    """Under torch.compile the positions are not read (a graph break): a row whose position_ids
    restart raises when the compiled graph runs (a device-side assertion), instead of attending
    across its documents as one sequence; plain positions give eager's bits."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (_randn(2, 12, h, D, seed=30 + h).transpose(1, 2) for h in (2, 1, 1))

    def forward(q, k, v, position_ids):
        return det_attn_transformers_forward(module, q, k, v, None, position_ids=position_ids)[0]

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    plain = torch.arange(12).expand(2, 12)
    assert_bitwise_equal(compiled(q, k, v, plain), forward(q, k, v, plain), "plain positions")
    packed = torch.cat((torch.arange(5), torch.arange(7))).expand(2, 12)
    with pytest.raises(RuntimeError, match="cu_seq_lens_q/k"):
        compiled(q, k, v, packed)


def test_compiled_attention_raises_eagers_errors():
    # gradients of gradients: eager raises at the create_graph backward, compiled at the second
    (q,) = _leaves(_randn(1, 8, 2, D, seed=19))
    out = torch.compile(lambda q: attention(q, q, q), backend="aot_eager")(q)
    (grad,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        grad.sum().backward()
    # bad arguments: eager's errors, at trace time
    with pytest.raises(ValueError, match="head dim 32 is not supported"):
        q32 = _randn(1, 8, 2, 32, seed=18)
        torch.compile(lambda q: attention(q, q, q), backend="aot_eager")(q32)
    with pytest.raises(ValueError, match=r"dropout_p > 0 needs an explicit integer seed"):
        torch.compile(lambda q: attention(q, q, q, dropout_p=0.1), backend="aot_eager")(q.detach())
    # after an error Dynamo runs the frame eagerly from then on, tracing only what it calls: the
    # eager path below the checks is not traced
    compiled = torch.compile(attention, backend="aot_eager")
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        compiled(q, q, q, dropout_p=1.5, seed=1)
    assert_bitwise_equal(compiled(q, q, q, dropout_p=0.5, seed=1), attention(q, q, q, dropout_p=0.5, seed=1))


def test_inductor_compiled_attention_equals_eager_bitwise():
    q, k, v = _randn(2, 9, 2, D, seed=20), _randn(2, 9, 1, D, seed=21), _randn(2, 9, 1, D, seed=22)
    do = _randn(2, 9, 2, D, seed=23)

    def fwd_bwd(run):
        leaves = _leaves(q, k, v)
        o, lse = run(*leaves)
        o.backward(do)
        return o.detach(), lse, *(t.grad for t in leaves)

    def f(q, k, v):  # the LSE's scaling (lse2 * ln 2) and the views around the operators are Inductor's
        return attention(q, k, v, causal=True, return_lse=True)

    for name, a, b in zip(NAMES, fwd_bwd(torch.compile(f, fullgraph=True)), fwd_bwd(f), strict=True):
        assert_bitwise_equal(a, b, f"{name}: inductor")


# --------------------------------------------------------------------------- kernels layer


def _build_hub(out: Path) -> Path:
    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("_build_hub_for_test", root / "tools" / "build_hub.py")
    build_hub = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build_hub  # its dataclasses look their module up
    spec.loader.exec_module(build_hub)
    assert build_hub.main(["--package", "det-attn", "--out", str(out)]) == 0
    return out / "det-attn"


def test_kernelize_in_training_and_compile_mode_then_compile(tmp_path):
    """The Hub build, loaded by `kernels` (LocalLayerRepository), kernelizes an attention core for
    Mode.TRAINING | Mode.TORCH_COMPILE; the compiled model has eager det_attn's bits. The build's
    operators live in its own namespace, beside the source tree's."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping

    @use_kernel_forward_from_hub("DetAttention")
    class AttentionCore(torch.nn.Module):
        def forward(self, q, k, v, **kwargs):  # what a model would run without the kernel
            raise AssertionError("not kernelized")

    repo = LocalLayerRepository(repo_path=_build_hub(tmp_path), layer_name="DetAttention")
    with use_kernel_mapping({"DetAttention": {"cpu": repo}}):
        core = kernelize(
            AttentionCore(), mode=Mode.TRAINING | Mode.TORCH_COMPILE, device="cpu", use_fallback=False
        )
    hub_forward = core.forward.__func__
    assert hub_forward.__module__.split(".")[0] not in ("det_attn", __name__)  # the build's own module
    assert sys.modules[hub_forward.__module__].DetAttention.can_torch_compile

    q, k, v = _randn(1, 9, 2, D, seed=24), _randn(1, 9, 1, D, seed=25), _randn(1, 9, 1, D, seed=26)
    do = _randn(1, 9, 2, D, seed=27)

    def fwd_bwd(run):
        leaves = _leaves(q, k, v)
        o = run(*leaves, causal=True)
        o.backward(do)
        return o.detach(), *(t.grad for t in leaves)

    want = fwd_bwd(attention)
    for name, a, b in zip(
        ("o", "dq", "dk", "dv"),
        fwd_bwd(torch.compile(core, fullgraph=True, backend="aot_eager")),
        want,
        strict=True,
    ):
        assert_bitwise_equal(a, b, f"{name}: kernelized, compiled")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_inductor_compiled_equals_eager_bitwise_on_cuda(d):
    """Real sizes on the GPU, Inductor (the default backend), fullgraph: padded (causal, dropout with
    a per-step seed, LSE), packed and SDPA-style calls in one graph; outputs and gradients.

    Each call gets its own leaf tensors (same values): with shared leaves the three gradient
    contributions would be summed by autograd in eager and by Inductor's own bf16 adds in the
    compiled backward, an order that is torch's, not ours (the first H200 run, run 12, failed so)."""
    cu = torch.tensor([0, 700, 701, 2048], dtype=torch.int32, device="cuda")
    shapes = ((2, 1024, 16, d), (2, 1024, 4, d), (2, 1024, 4, d))
    inputs = [_randn(*s, seed=30 + i, device="cuda") for i, s in enumerate(shapes)]
    grads_out = [_randn(2, 1024, 16, d, seed=40 + i, device="cuda") for i in range(3)]

    def f(padded, packed_in, sdpa_in, seed):
        q, k, v = padded
        o, lse = attention(q, k, v, causal=True, dropout_p=0.1, seed=seed, return_lse=True)
        packed = attention_varlen(
            *(t.view(-1, *t.shape[2:]) for t in packed_in), cu, cu, 1347, 1347, causal=True
        )
        sdpa = scaled_dot_product_attention(*(t.transpose(1, 2) for t in sdpa_in), enable_gqa=True)
        return o, lse, packed.view(q.shape), sdpa.transpose(1, 2)

    def step(run, seed):
        uses = [_leaves(*inputs) for _ in range(3)]
        o, lse, packed, sdpa = run(*uses, seed)
        torch.autograd.backward((o, packed, sdpa), grads_out)
        return o.detach(), lse, packed.detach(), sdpa.detach(), *(t.grad for use in uses for t in use)

    compiled = torch.compile(f, fullgraph=True)
    for seed in (11, 12, 13):
        names = ("o", "lse", "packed", "sdpa") + tuple(
            f"{g} of the {call} call" for call in ("padded", "packed", "sdpa") for g in ("dq", "dk", "dv")
        )
        for name, a, b in zip(names, step(compiled, seed), step(f, seed), strict=True):
            assert_bitwise_equal(a, b, f"{name}, seed {seed}")


@pytest.mark.gpu
def test_inductor_compiled_block_equals_eager_bitwise_on_cuda():
    """A block with cuBLAS projections around det_attn: compiled by Inductor, the attention's
    inputs and gradients come from the projections; the block's bits equal eager's where Inductor
    keeps the matmuls as cuBLAS calls (checked on the attention output and gradient both ways)."""
    torch.manual_seed(0)
    block = _Block(width=1024, heads=16, kv_heads=4).cuda()
    x, dy = _randn(4, 1024, 1024, seed=50, device="cuda"), _randn(4, 1024, 1024, seed=51, device="cuda")
    compiled = torch.compile(block, fullgraph=True)
    for seed in (1, 2):
        want = _block_step(block, block, x, dy, seed)
        got = _block_step(block, compiled, x, dy, seed)
        for name, a, b in zip(("y", "dx", "dW_qkv", "dW_out"), got, want, strict=True):
            assert_bitwise_equal(a, b, f"{name}, seed {seed}")


def test_functorch_jvp_and_grad_raise():
    """torch.func.jvp / grad through attention raise (a jvp used to return zero tangents)."""
    q, k, v = (_randn(1, 4, 1, D, seed=s) for s in (1, 2, 3))
    with pytest.raises(RuntimeError, match="torch.func transforms other than vmap"):
        torch.func.jvp(lambda a: attention(a, k, v), (q,), (torch.ones_like(q),))
    with pytest.raises(RuntimeError, match="torch.func transforms other than vmap"):
        torch.func.grad(lambda a: attention(a, k, v).float().sum())(q)


def test_forward_mode_dual_tensors_raise_even_without_requires_grad():
    """A dual tensor (torch.autograd.forward_ad) used to lose its tangent when it did not require grad."""
    q = _randn(1, 4, 1, D, seed=4)
    for requires_grad in (False, True):
        with torch.autograd.forward_ad.dual_level():
            leaf = q.clone().requires_grad_(requires_grad)
            dual = torch.autograd.forward_ad.make_dual(leaf, torch.ones_like(q))
            with pytest.raises(RuntimeError, match="forward-mode AD|jvp"):
                attention(dual, dual, dual)
