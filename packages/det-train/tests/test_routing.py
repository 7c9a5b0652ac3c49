"""deterministic_mode() routing of aten's matmul family, and the `kernels` layer mapping class."""

import types

import det_train
import pytest
import torch
from det_core.testing import assert_bitwise_equal, assert_row_invariant
from det_train import deterministic_mode, layers, linear, matmul
from det_train.integrations.routing import routed_ops
from det_train.ops.matmul import matmul_partial

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def test_routed_ops_give_det_train_bits():
    a, b, bias = _randn(17, 96, seed=1), _randn(96, 40, seed=2), _randn(40, seed=3)
    with deterministic_mode():
        assert_bitwise_equal(torch.mm(a, b), matmul(a, b), "mm")
        assert_bitwise_equal(a @ b, matmul(a, b), "@")
        assert_bitwise_equal(torch.matmul(a[None].repeat(3, 1, 1), b)[2], matmul(a, b), "matmul 3-D @ 2-D")
        assert_bitwise_equal(torch.bmm(a[None], b[None])[0], matmul(a, b), "bmm")
        assert_bitwise_equal(torch.addmm(bias, a, b), linear(a, b.t(), bias), "addmm = linear forward")
        assert_bitwise_equal(torch.mv(a, b[:, 0]), matmul(a, b[:, :1])[:, 0], "mv")
        assert_bitwise_equal(torch.dot(a[0], b[:, 0]), matmul(a[:1], b[:, :1]).reshape(()), "dot")
        assert_bitwise_equal(torch.nn.functional.linear(a, b.t(), bias), linear(a, b.t(), bias), "F.linear")
        scaled = torch.addmm(bias[None].expand(17, 40), a, b, beta=0.5, alpha=2.0)
        expected = (matmul_partial(a, b) * 2.0 + 0.5 * bias.float()).to(a.dtype)  # one rounding
        assert_bitwise_equal(scaled, expected, "addmm beta/alpha")
        sb = torch.baddbmm(torch.zeros(1, 17, 40, dtype=a.dtype, device=DEVICE), a[None], b[None], alpha=1.0)
        assert_bitwise_equal(sb[0], matmul(a, b), "baddbmm")
        mv = torch.addmv(bias[:17], a, b[:, 0], beta=0.5, alpha=2.0)
        expected = (matmul_partial(a, b[:, :1])[:, 0] * 2.0 + 0.5 * bias[:17].float()).to(a.dtype)
        assert_bitwise_equal(mv, expected, "addmv beta/alpha (one rounding)")
    assert "linear" in routed_ops() and "mm" in routed_ops() and "addmv" in routed_ops()


def test_out_overloads_and_addbmm_raise_inside_the_mode():
    """Ops the mode does not route raise inside it rather than run torch's batch-variant kernel
    silently: the out= overloads of the routed ops and addbmm; outside, torch's kernels run."""
    a, b = _randn(17, 96, seed=1), _randn(96, 40, seed=2)
    out = torch.empty(17, 40, dtype=a.dtype, device=DEVICE)
    with deterministic_mode():
        with pytest.raises(RuntimeError, match=r"aten::mm\.out is not routed .*without out="):
            torch.mm(a, b, out=out)
        with pytest.raises(RuntimeError, match=r"aten::mm\.out is not routed"):
            torch.matmul(a, b, out=out)
        with pytest.raises(RuntimeError, match=r"aten::addbmm is not routed .*bmm is routed"):
            torch.addbmm(out, a[None], b[None])
        assert_bitwise_equal(torch.mm(a, b), matmul(a, b), "the functional form still routed")
    torch.mm(a, b, out=out)  # torch's own kernel again


def test_routed_matmul_is_row_invariant():
    b = _randn(96, 40, seed=4)
    with deterministic_mode():
        assert_row_invariant(
            lambda x: x @ b, lambda m: _randn(m, 96, seed=m), [1, 3, 65], _randn(1, 96, seed=5)
        )


def test_nn_linear_forward_and_grads_equal_det_train_linear():
    torch.manual_seed(0)
    m = torch.nn.Linear(96, 40, dtype=torch.bfloat16, device=DEVICE)
    x = _randn(2, 9, 96, seed=6).requires_grad_()
    with deterministic_mode():
        y = m(x)
        y.backward(torch.ones_like(y))
    w = m.weight.detach().clone().requires_grad_()
    bb = m.bias.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y2 = linear(x2, w, bb)
    y2.backward(torch.ones_like(y2))
    assert_bitwise_equal(y, y2, "y")
    assert_bitwise_equal(x.grad, x2.grad, "dx")
    assert_bitwise_equal(m.weight.grad, w.grad, "dw")
    assert_bitwise_equal(m.bias.grad, bb.grad, "db")


def test_routed_ops_keep_autograd_with_operands_requiring_grad():
    # the routed mm / bmm / mv / dot run below autograd, where grad mode is on and the operands
    # require grad: they must not hit det_train.matmul's "no backward" error, and autograd records
    # torch's own backward; the forward bits are det_train.matmul's
    a, b = _randn(5, 16, seed=20), _randn(16, 6, seed=21)
    a_g, b_g = a.clone().requires_grad_(), b.clone().requires_grad_()
    with deterministic_mode():
        outs = {
            "mm": a_g @ b_g,
            "bmm": torch.bmm(a_g[None], b_g[None])[0],
            "mv": torch.mv(a_g, b_g[:, 0]),
            "dot": torch.dot(a_g[0], b_g[:, 0]),
        }
        sum(o.float().sum() for o in outs.values()).backward()
    with torch.no_grad():
        expected = {
            "mm": matmul(a, b),
            "bmm": matmul(a[None], b[None])[0],
            "mv": matmul(a, b[:, :1])[:, 0],
            "dot": matmul(a[:1], b[:, :1]).reshape(()),
        }
    for name, out in outs.items():
        assert out.grad_fn is not None, name
        assert_bitwise_equal(out.detach(), expected[name], name)
    assert a_g.grad is not None and b_g.grad is not None
    assert bool(a_g.grad.abs().sum() > 0) and bool(b_g.grad.abs().sum() > 0)


def test_unsupported_dtype_raises_inside_and_torch_is_restored_on_exit():
    a = _randn(4, 8, dtype=torch.float64)
    with deterministic_mode():
        with pytest.raises(TypeError, match="supported"):
            torch.mm(a, a.t())
        with deterministic_mode():  # re-entrant
            pass
        with pytest.raises(TypeError, match="supported"):
            torch.mm(a, a.t())  # still routed after the inner context closed
    assert torch.mm(a, a.t()).dtype == torch.float64  # torch's kernel is back


def test_kernels_layer_mapping_class():
    from kernels.layer.layer import _validate_layer

    _validate_layer(check_cls=torch.nn.Linear, cls=layers.Linear, repo="phanerozoic/det-train")
    torch.manual_seed(0)
    m = torch.nn.Linear(96, 40, dtype=torch.bfloat16, device=DEVICE)
    x = _randn(5, 96, seed=7)
    m.forward = types.MethodType(layers.Linear.forward, m)  # what kernels.kernelize does
    assert_bitwise_equal(m(x), linear(x, m.weight, m.bias), "kernelized forward")


@pytest.fixture(scope="module")
def det_train_hub_build(tmp_path_factory):
    """det-train's Hub build tree (tools/build_hub.py), the folder `kernels` loads layers from."""
    import importlib.util
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("hub")
    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("_build_hub_for_test", root / "tools" / "build_hub.py")
    build_hub = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build_hub  # its dataclasses look their module up
    spec.loader.exec_module(build_hub)
    assert build_hub.main(["--package", "det-train", "--out", str(out)]) == 0
    return out / "det-train"


def test_kernelize_maps_a_linear_to_the_hub_build(det_train_hub_build):
    """The Hub build tree of det-train, loaded by `kernels` (LocalLayerRepository), drives kernelize."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping

    @use_kernel_forward_from_hub("Linear")
    class HubLinear(torch.nn.Linear):
        pass

    torch.manual_seed(0)
    model = torch.nn.Sequential(HubLinear(96, 40, dtype=torch.bfloat16, device=DEVICE))
    device = "cuda" if DEVICE == "cuda" else "cpu"
    repo = LocalLayerRepository(repo_path=det_train_hub_build, layer_name="Linear")
    with use_kernel_mapping({"Linear": {device: repo}}):
        model = kernelize(model, mode=Mode.TRAINING, device=device, use_fallback=False)
    x = _randn(5, 96, seed=8)
    assert_bitwise_equal(model(x), linear(x, model[0].weight, model[0].bias), "kernelized (Hub build)")


def test_kernelize_maps_transformers_rms_norms_to_the_hub_build(det_train_hub_build):
    """transformers' own RMSNorm classes (decorated ``@use_kernel_forward_from_hub("RMSNorm")``) take
    det-train's layer under kernelize: this needs the kernels version transformers accepts (the pin)."""
    transformers = pytest.importorskip("transformers")
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        for norm in model.modules():
            if isinstance(norm, LlamaRMSNorm):
                norm.weight.normal_()
    device = "cuda" if DEVICE == "cuda" else "cpu"
    repo = LocalLayerRepository(repo_path=det_train_hub_build, layer_name="RMSNorm")
    with use_kernel_mapping({"RMSNorm": {device: repo}}):
        model = kernelize(model, mode=Mode.TRAINING, device=device)  # other layers keep their forward
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 3  # input, post-attention, final
    x = _randn(5, 32, seed=9)
    for norm in norms:
        # the Hub build's module (``_det_train_<backend>_<hash>``), not the source tree's det_train
        assert norm.forward.__func__.__module__.startswith("_det_train_"), norm.forward
        assert_bitwise_equal(norm(x), det_train.rms_norm(x, norm.weight, norm.variance_epsilon), "RMSNorm")
