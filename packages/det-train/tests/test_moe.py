"""Mixture of experts: ``moe_router`` (fp32 softmax, top-k ties to the lower index), ``moe_experts``
(batch-invariant expert GEMMs, 3-D expert weight gradients in the canonical token order) and
``convert`` of a tiny Qwen3-MoE model: one micro-batch and three cut inside leaves give every
parameter's gradient bitwise, run to run, with and without the sequence-wise load-balancing loss
(``moe_balance_loss``: against its fp64 reference and transformers' loss on one sequence); what
``convert`` refuses; the converted model under ``torch.compile(fullgraph=True)`` (aux loss off) gives
the eager bits. A ``gpu`` test at a modest realistic size, 1 vs 4 micro-batches."""

import sys
from pathlib import Path

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal
from det_train.accum.grad_accum import CanonicalGradAccumulator
from det_train.integrations.moe import MoeExperts, MoeTopKRouter
from det_train.ops.moe_balance_loss import moe_balance_loss
from det_train.ops.moe_experts import moe_experts
from det_train.ops.moe_router import moe_router
from det_train.reference_moe import moe_balance_loss_reference, moe_experts_reference, router_topk_reference
from torch._dynamo.testing import CompileCounterWithBackend

sys.path.insert(0, str(Path(__file__).parent))
from _hf_micro_batches import split_grads  # noqa: E402


# ---------------------------------------------------------------- router
def test_router_ties_go_to_the_lower_expert_index():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all tied: experts 0, 1, 2
            [0.0, 1.0, 0.0, 1.0, 0.0, 1.0],  # three tied maxima: 1, 3, 5
            [2.0, 0.5, 2.0, 0.5, 2.0, 0.5],  # 0, 2, 4
            [-1.0, 0.5, 0.5, 3.0, 0.5, 0.5],  # 3, then the tied 0.5s: 1, 2
        ],
        dtype=torch.bfloat16,
    )
    weights, indices = moe_router(logits, 3, norm_topk_prob=False)
    assert indices.tolist() == [[0, 1, 2], [1, 3, 5], [0, 2, 4], [3, 1, 2]]
    ref_weights, ref_indices = router_topk_reference(logits, 3, False)
    assert torch.equal(indices, ref_indices)
    assert weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights, ref_weights.to(torch.bfloat16), rtol=0, atol=0)
    weights, _ = moe_router(logits, 3, norm_topk_prob=True)
    assert torch.equal(weights[0], torch.full((3,), 1 / 3).to(torch.bfloat16))


def test_router_matches_the_reference_and_its_gradient():
    torch.manual_seed(0)
    logits = torch.randn(37, 8, dtype=torch.float32, requires_grad=True)
    ref_logits = logits.detach().double().requires_grad_()
    g = torch.randn(37, 2)
    for norm in (True, False):
        weights, indices = moe_router(logits, 2, norm_topk_prob=norm)
        ref_weights, ref_indices = router_topk_reference(ref_logits, 2, norm)
        assert torch.equal(indices, ref_indices)
        torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-6, atol=1e-7)
        (grad,) = torch.autograd.grad((weights * g).sum(), logits)
        (ref_grad,) = torch.autograd.grad((ref_weights * g.double()).sum(), ref_logits)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
        assert ref_grad.abs().max() > 0.05


def test_router_rows_do_not_depend_on_the_other_rows():
    torch.manual_seed(1)
    logits = torch.randn(20, 6, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(20, 2).to(torch.bfloat16)
    weights, indices = moe_router(logits, 2)
    (grad,) = torch.autograd.grad(weights, logits, g)
    part = logits.detach()[7:12].clone().requires_grad_()
    w2, i2 = moe_router(part, 2)
    (grad2,) = torch.autograd.grad(w2, part, g[7:12])
    assert_bitwise_equal(w2, weights[7:12], "weights of rows 7..11 alone")
    assert torch.equal(i2, indices[7:12])
    assert_bitwise_equal(grad2, grad[7:12], "logit gradient of rows 7..11 alone")


def test_router_refuses_bad_input():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        moe_router(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="must be \\(T, E\\)"):
        moe_router(torch.zeros(3, 4, 2), 1)
    with pytest.raises(TypeError, match="float32 / bfloat16 / float16"):
        moe_router(torch.zeros(3, 4, dtype=torch.int32), 1)


# ---------------------------------------------------------------- load-balancing loss
def _balance_inputs(seed=0):
    """2 layers' logits over 20 tokens, 6 experts: sequences 0 (7 tokens, one masked out: -1), 1
    (8) and 2 (5), packed in one call in that order."""
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(20, 6, generator=g) for _ in range(2)]
    sequence = torch.tensor([0] * 7 + [1] * 8 + [2] * 5)
    position = torch.cat([torch.arange(7), torch.arange(8), torch.arange(5)])
    sequence[3] = -1
    return logits, sequence, position, torch.tensor([6, 7, 4]), 20


def _balance_run(logits, sequence, position, tokens, total, dw):
    """Terms and logit gradients of ``sum(weights * dw) + sum(terms)``: the routing weights' and the
    probabilities' (dP) gradients through one router backward each."""
    logits = [x.clone().requires_grad_() for x in logits]
    routed = [moe_router(x, 2, True, return_probs=True) for x in logits]
    terms = moe_balance_loss(
        [r[2] for r in routed], [r[1] for r in routed], sequence, position, tokens, total
    )
    loss = terms.sum() + sum((r[0] * d).sum() for r, d in zip(routed, dw, strict=True))
    return terms, torch.autograd.grad(loss, logits), [r[1] for r in routed]


def test_balance_loss_matches_the_fp64_reference_with_gradients():
    logits, sequence, position, tokens, total = _balance_inputs()
    dw = [torch.randn(20, 2, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    terms, grads, indices = _balance_run(logits, sequence, position, tokens, total, dw)
    ref_logits = [x.double().requires_grad_() for x in logits]
    ref_terms = moe_balance_loss_reference(ref_logits, indices, sequence, tokens, total)
    routed = [router_topk_reference(x, 2, True) for x in ref_logits]
    assert all(torch.equal(r[1], i) for r, i in zip(routed, indices, strict=True))
    ref_loss = ref_terms.sum() + sum((r[0] * d.double()).sum() for r, d in zip(routed, dw, strict=True))
    ref_grads = torch.autograd.grad(ref_loss, ref_logits, retain_graph=True)
    torch.testing.assert_close(terms.double(), ref_terms, rtol=1e-6, atol=0)
    assert ref_terms.min() > 0.1
    aux_only = torch.autograd.grad(ref_terms.sum(), ref_logits)
    assert min(g.abs().max() for g in aux_only) > 1e-3  # the dP part is a real share of the gradient
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_balance_loss_of_a_sequence_does_not_depend_on_the_others():
    """Sequence 1 alone, at offset 0 and without sequences 0 and 2: its term and its tokens' logit
    gradients bitwise (another position in the call, another number of sequences)."""
    logits, sequence, position, tokens, total = _balance_inputs()
    dw = [torch.randn(20, 2, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    terms, grads, _ = _balance_run(logits, sequence, position, tokens, total, dw)
    rows = slice(7, 15)
    alone = _balance_run(
        [x[rows] for x in logits], torch.zeros(8, dtype=torch.int64), position[rows], tokens[1:2], total,
        [d[rows] for d in dw],
    )  # fmt: skip
    assert_bitwise_equal(alone[0], terms[1:2], "term of sequence 1 alone")
    for layer, (got, want) in enumerate(zip(alone[1], grads, strict=True)):
        assert_bitwise_equal(got, want[rows], f"layer {layer}: logit gradient of sequence 1 alone")


def test_router_without_return_probs_is_unchanged_by_a_zero_dp():
    """The probabilities' path with an all-zero dP and the plain path: the same logit gradient."""
    torch.manual_seed(2)
    logits = torch.randn(19, 8, requires_grad=True)
    g = torch.randn(19, 2)
    weights, _ = moe_router(logits, 2)
    (plain,) = torch.autograd.grad(weights, logits, g)
    weights, _, probs = moe_router(logits, 2, return_probs=True)
    torch.testing.assert_close(probs, torch.softmax(logits.detach(), -1), rtol=1e-6, atol=1e-7)
    (with_dp,) = torch.autograd.grad((weights, probs), logits, (g, torch.zeros(19, 8)))
    assert_bitwise_equal(with_dp, plain, "zero dP")


# ---------------------------------------------------------------- experts
def _experts_inputs(t=29, hidden=64, inter=32, experts=4, k=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    logits = torch.randn(t, experts, generator=g)
    weights, indices = router_topk_reference(logits, k, True, torch.float32)
    gate_up = (0.1 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype)
    down = (0.1 * torch.randn(experts, hidden, inter, generator=g)).to(dtype)
    return x, indices, weights.to(dtype), gate_up, down


def test_experts_match_the_fp64_reference_with_gradients():
    leaves = [t.requires_grad_() if t.is_floating_point() else t for t in _experts_inputs()]
    x, indices, weights, gate_up, down = leaves
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    out = moe_experts(x, indices, weights, gate_up, down)
    grads = torch.autograd.grad(out, (x, weights, gate_up, down), dy)
    ref = moe_experts_reference(x, indices, weights, gate_up, down)
    ref_grads = torch.autograd.grad(ref, (x, weights, gate_up, down), dy.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for name, grad, ref_grad in zip(("x", "weights", "gate_up", "down"), grads, ref_grads, strict=True):
        assert ref_grad.abs().max() > 0.01, name
        # fp32 operands, fp32 accumulation (IEEE dots): a few fp32 ULPs of the largest terms
        close = torch.isclose(grad, ref_grad.to(grad.dtype), rtol=1e-5, atol=1e-5)
        assert close.all(), f"{name}: {(grad - ref_grad).abs().max()} off"


def test_experts_rows_do_not_depend_on_which_tokens_share_an_expert():
    """Token rows 3..9 alone, and the batch reversed, give the rows and input gradients of the whole
    batch bitwise (other tokens, other counts per expert, other positions)."""
    x, indices, weights, gate_up, down = _experts_inputs(dtype=torch.bfloat16)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def run(rows):
        xs, ws = x[rows].clone().requires_grad_(), weights[rows].clone().requires_grad_()
        out = moe_experts(xs, indices[rows], ws, gate_up, down)
        return (out, *torch.autograd.grad(out, (xs, ws), dy[rows]))

    whole = run(torch.arange(x.shape[0]))
    for rows in (torch.arange(3, 10), torch.arange(x.shape[0]).flip(0)):
        for name, got, want in zip(("out", "dx", "dweights"), run(rows), whole, strict=True):
            assert_bitwise_equal(got, want[rows], f"{name} of rows {rows.tolist()}")


def _routed_grads(x, params, cuts, leaf: int = 24, recoverable: bool = True):
    """The gradients of ``params`` (router weight, gate_up_proj, down_proj) of a weighted sum of the
    router + experts output over ``x``, cut at tokens ``cuts``, through the accumulator (leaves of
    ``leaf`` tokens)."""
    weight = torch.linspace(-1, 1, x.shape[1])
    named = list(zip(("router", "gate_up", "down"), params, strict=True))
    acc = CanonicalGradAccumulator(named, leaf_tokens=leaf, recoverable=recoverable)
    bounds = [0, *cuts, x.shape[0]]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        with acc.micro_batch(token_offset=lo):
            xs = x[lo:hi]
            routing, indices = moe_router(det_train.linear(xs, params[0]), 2)
            out = moe_experts(xs, indices, routing, *params[1:])
            (out.float() * weight).sum().backward()
    acc.reduce(total_tokens=x.shape[0])
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def test_expert_weight_gradients_split_bitwise_and_run_to_run():
    """Router + experts, 48 tokens, leaves of 24: one micro-batch; three cut at 16 and 32 (inside
    leaves); five of uneven sizes; the one micro-batch again: every gradient bitwise equal."""
    x, _, _, gate_up, down = _experts_inputs(t=48, dtype=torch.bfloat16)
    router = (0.3 * torch.randn(4, 64, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
    params = [torch.nn.Parameter(p) for p in (router, gate_up, down)]
    whole = _routed_grads(x, params, [])
    for cuts in ([16, 32], [5, 6, 30, 47], []):
        split = _routed_grads(x, params, cuts)
        for name, got, want in zip(("router", "gate_up", "down"), split, whole, strict=True):
            assert want.abs().sum() > 0, name
            assert_bitwise_equal(got, want, f"{name}: cuts {cuts}")


def test_expert_folds_continued_in_place_keep_the_bits():
    """``recoverable=False``: the 3-D expert weights' open folds (one per expert, 64-token steps) are
    continued in their buffers (``_expert_fold(..., out=acc)``); the bits of ``recoverable=True``."""
    x, _, _, gate_up, down = _experts_inputs(t=256, dtype=torch.bfloat16)
    router = (0.3 * torch.randn(4, 64, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
    params = [torch.nn.Parameter(p) for p in (router, gate_up, down)]
    want = _routed_grads(x, params, [64, 192], leaf=128)
    got = _routed_grads(x, params, [64, 192], leaf=128, recoverable=False)
    for name, g, w in zip(("router", "gate_up", "down"), got, want, strict=True):
        assert w.abs().sum() > 0, name
        assert_bitwise_equal(g, w, f"{name}: recoverable=False vs True")


def test_experts_refuse_bad_input():
    x, indices, weights, gate_up, down = _experts_inputs()
    with pytest.raises(ValueError, match=r"down_proj must be \(E, H, I\)"):
        moe_experts(x, indices, weights, gate_up, down[:, :, :8])
    with pytest.raises(TypeError, match="indices must be an int64 tensor"):
        moe_experts(x, indices.int(), weights, gate_up, down)
    with pytest.raises(TypeError, match="must have one dtype"):
        moe_experts(x.bfloat16(), indices, weights, gate_up, down)


# ---------------------------------------------------------------- converted Qwen3-MoE
transformers = pytest.importorskip("transformers")


def _config(**kw):
    det_attn = pytest.importorskip("det_attn")
    det_attn.register_transformers_attention()
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=16,
        attn_implementation="det_attn",
    )
    return transformers.Qwen3MoeConfig(**{**common, **kw})


def _model(device="cpu", **kw):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(_config(**kw))
    return det_train.convert(model.to(device=device, dtype=torch.bfloat16))


def test_converted_qwen3_moe_split_bitwise():
    """2 layers, 4 experts top 2: 3 sequences of 16 tokens in one micro-batch and in three (run to run:
    ``test_expert_weight_gradients_split_bitwise_and_run_to_run``)."""
    model = _model()
    block = model.model.layers[0].mlp
    assert type(block.experts) is MoeExperts
    assert type(block.gate) is MoeTopKRouter
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))  # 48 tokens, 2 leaves
    whole = split_grads(model, ids, [(0, 3)], leaf=24)
    split = split_grads(model, ids, [(0, 1), (1, 1), (2, 1)], leaf=24)  # cuts at 16 and 32: inside leaves
    assert set(whole) == {name for name, _ in model.named_parameters()}
    assert whole["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    for name, grad in whole.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert_bitwise_equal(split[name], grad, f"{name}: 1 vs 3 micro-batches")


def test_converted_moe_block_rows_are_batch_invariant():
    block = _model(num_hidden_layers=1).model.layers[0].mlp
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = block(x)
    assert_bitwise_equal(block(x[1:2, 5:11]), whole[1:2, 5:11], "tokens 5..10 of sequence 1 alone")
    assert_bitwise_equal(block(x.flip(0)), whole.flip(0), "the sequences reversed")


def test_converted_qwen3_moe_aux_loss_split_bitwise():
    """The load-balancing loss on (coefficient 0.5): 3 sequences of 8 tokens in one micro-batch, in
    three (cuts at 8 and 16, inside leaves of 12) and in one again: every gradient bitwise; each
    sequence's aux term the same bits, so the three calls' aux_loss add up to the whole call's."""
    model = _model(output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(1))
    whole_out, split_out = [], []
    whole = split_grads(model, ids, [(0, 3)], leaf=12, outputs=whole_out)
    split = split_grads(model, ids, [(0, 1), (1, 1), (2, 1)], leaf=12, outputs=split_out)
    again = split_grads(model, ids, [(0, 3)], leaf=12)
    for name, grad in whole.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert_bitwise_equal(split[name], grad, f"{name}: 1 vs 3 micro-batches")
        assert_bitwise_equal(again[name], grad, f"{name}: run to run")
    (out,) = whole_out
    parts = [o.aux_loss for o in split_out]
    assert_bitwise_equal((parts[0] + parts[1]) + parts[2], out.aux_loss, "aux_loss: 1 vs 3 micro-batches")
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (24, 4)
    # the value is the fp64 reference of the definition on the recorded logits
    indices = [router_topk_reference(x, 2, True, torch.float32)[1] for x in out.router_logits]
    sequence = torch.arange(3).repeat_interleave(8)
    ref = moe_balance_loss_reference(out.router_logits, indices, sequence, torch.tensor([7] * 3), 21)
    torch.testing.assert_close(out.aux_loss.double(), ref.sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(sum(o.loss for o in split_out), out.loss, rtol=1e-6, atol=0)


def test_converted_aux_loss_of_one_sequence_is_transformers():
    """One sequence (num_items_in_batch its predicted tokens): aux_loss is transformers'
    load_balancing_loss_func on the same router logits, and the loss its cross-entropy plus
    router_aux_loss_coef times it."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = _model(output_router_logits=True, router_aux_loss_coef=0.25)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, num_items_in_batch=15)
        plain = model(input_ids=ids, labels=ids, num_items_in_batch=15, output_router_logits=False)
        tuple_out = model(ids, labels=ids, num_items_in_batch=15, return_dict=False)
    hf = load_balancing_loss_func(tuple(x.double() for x in out.router_logits), 4, 2, None)
    torch.testing.assert_close(out.aux_loss.double(), hf.double(), rtol=1e-6, atol=0)
    assert plain.aux_loss is None
    torch.testing.assert_close(out.loss, plain.loss + 0.25 * out.aux_loss, rtol=1e-6, atol=0)
    assert_bitwise_equal(tuple_out[0], out.loss, "return_dict=False: the loss first")
    assert_bitwise_equal(tuple_out[1], out.aux_loss, "return_dict=False: then aux_loss")


def test_converted_aux_loss_needs_num_items_in_a_micro_batch():
    model = _model(output_router_logits=True)
    ids = torch.zeros(1, 4, dtype=torch.int64)
    acc = CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=24)
    with (
        pytest.raises(ValueError, match="the call needs num_items_in_batch"),
        acc.micro_batch(token_offset=0),
    ):
        model(input_ids=ids)  # no labels: no cross-entropy, the aux loss's weights alone


@pytest.mark.parametrize("splits", [[(0, 2)], [(0, 1), (1, 1)]], ids=["1-micro-batch", "2-micro-batches"])
def test_converted_qwen3_moe_compiles_to_one_graph_with_the_eager_bits(splits):
    """``torch.compile(fullgraph=True)`` (aot_eager) of the converted model, aux loss off: the router
    and experts are custom ops with static output shapes, so the whole call is one graph; its logits
    and every parameter's gradient through the accumulator (2 sequences of 8 tokens, leaves of 12:
    the second micro-batch starts inside a leaf) are the eager whole batch's bits."""
    model = _model()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    eager_out = []
    want = split_grads(model, ids, [(0, 2)], leaf=12, outputs=eager_out)
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(fullgraph=True, backend=counter, dynamic=False)
    compiled_out = []
    got = split_grads(model, ids, splits, leaf=12, outputs=compiled_out)
    assert counter.frame_count == 1  # one graph, reused by the second micro-batch
    for (first, n), out in zip(splits, compiled_out, strict=True):
        want_logits = eager_out[0].logits[first : first + n]
        assert_bitwise_equal(out.logits, want_logits, f"logits of sequences {first}..{first + n - 1}")
    assert set(got) == set(want)
    for name, grad in want.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert_bitwise_equal(got[name], grad, f"{name}: compiled, {len(splits)} micro-batch(es)")


def test_converted_qwen3_moe_aux_loss_is_a_graph_break():
    """With the load-balancing loss on, the router's probabilities path is torch.compiler.disable'd:
    fullgraph=True refuses it (a documented graph break, not a silent eager fallback)."""
    model = _model(num_hidden_layers=1, output_router_logits=True)
    model.compile(fullgraph=True, backend="aot_eager", dynamic=False)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="_router_with_probs"):
        model(input_ids=ids)


def test_convert_refuses_other_moe_families():
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(transformers.Qwen3MoeForCausalLM(_config(hidden_act="gelu")).to(torch.bfloat16))
    assert [(n, r) for n, _, r in info.value.problems] == [
        (f"model.layers.{i}.mlp.experts", "experts with hidden_act='gelu': moe_experts computes SwiGLU "
         "(hidden_act='silu') only")
        for i in range(2)
    ]  # fmt: skip

    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
        attn_implementation="det_attn",
    )  # fmt: skip
    mixtral = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    with pytest.raises(det_train.ConversionError) as info:
        det_train.convert(mixtral)
    problems = {n: r for n, _, r in info.value.problems}
    assert set(problems) == {"model.layers.0.mlp.experts", "model.layers.0.mlp.gate"}
    for reason in problems.values():
        assert reason.startswith("a mixture-of-experts layer of a family det_train does not convert")
        assert "Qwen3MoeExperts, Qwen3MoeTopKRouter" in reason
    assert type(mixtral.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # nothing changed


@pytest.mark.gpu
@pytest.mark.parametrize("aux_loss", [False, True], ids=["no-aux", "aux-loss"])
def test_gpu_qwen3_moe_split_bitwise_at_a_realistic_size(aux_loss):
    """Qwen3-MoE, hidden 1024, 4 layers (16 query, 8 KV heads of 64), 16 experts of 512, top 4: 4
    sequences of 1024 tokens in one micro-batch and in four, leaves of 1536 tokens (cuts inside);
    without and with the sequence-wise load-balancing loss (coefficient 0.01)."""
    model = _model(
        device="cuda", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, num_experts=16,
        num_experts_per_tok=4, max_position_embeddings=1024, vocab_size=4096,
        output_router_logits=aux_loss, router_aux_loss_coef=0.01,
    )  # fmt: skip
    ids = torch.randint(0, 4096, (4, 1024), generator=torch.Generator().manual_seed(1)).cuda()
    whole_out, split_out = [], []
    whole = split_grads(model, ids, [(0, 4)], leaf=1536, outputs=whole_out)
    splits = [(0, 1), (1, 1), (2, 1), (3, 1)]  # cuts at 1024 and 3072: inside leaves
    split4 = split_grads(model, ids, splits, leaf=1536, outputs=split_out)
    again = split_grads(model, ids, [(0, 4)], leaf=1536)
    for name, grad in whole.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert_bitwise_equal(split4[name], grad, f"{name}: 1 vs 4 micro-batches")
        assert_bitwise_equal(again[name], grad, f"{name}: run to run")
    if aux_loss:  # each sequence's term has the same bits in any split
        parts = [o.aux_loss for o in split_out]
        summed = ((parts[0] + parts[1]) + parts[2]) + parts[3]
        assert float(whole_out[0].aux_loss) > 0
        assert_bitwise_equal(summed, whole_out[0].aux_loss, "aux_loss: 1 vs 4 micro-batches")


def test_a_row_packed_by_position_ids_gives_the_rows_logits_and_aux_loss():
    """Two documents packed into one row by position_ids alone (DataCollatorWithFlattening's
    default): det_attn keeps them apart and the load-balancing loss takes each document as a
    sequence, so the logits and aux_loss are bitwise those of the two rows."""
    model = _model(output_router_logits=True)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        rows = model(input_ids=ids)
        packed = model(input_ids=ids.reshape(1, -1), position_ids=torch.arange(8).repeat(2)[None])
    assert_bitwise_equal(packed.logits[0].reshape(rows.logits.shape), rows.logits, "logits")
    assert float(rows.aux_loss) > 0
    assert_bitwise_equal(packed.aux_loss, rows.aux_loss, "aux_loss")
