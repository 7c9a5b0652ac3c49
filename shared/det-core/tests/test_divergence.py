"""The divergence finder names exactly the module and gradient where a step stops being split-invariant.

The models (tests/_divergence_models.py) are plain torch on CPU with small-integer / dyadic values:
the clean model's sums are exact in fp32, so only a split-dependent op can change bits.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from det_core.testing import Difference, DivergenceReport, digest, find_divergence
from det_core.testing.divergence import main
from torch import nn
from torch.nn.modules import module as torch_module

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_divergence_models", HERE / "_divergence_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

SPLITS = (2, 3, 6)  # micro-batch counts compared against one micro-batch


@pytest.mark.parametrize("parts", SPLITS)
def test_names_the_split_dependent_module_and_no_earlier_one(parts):
    report = find_divergence(models.make_split_dependent, models.step, 1, parts)
    assert isinstance(report, DivergenceReport) and report.diverged
    assert report.micro_batches == (1, parts)
    # fc1 and act agree; mixer (x - micro-batch mean) is the first; what runs after it follows
    assert [d.name for d in report.output_differences] == ["mixer", "fc2", ""]
    assert report.outputs_before_first == 2 and report.outputs_compared == 5
    first = report.first_output
    assert first.reason == "bits" and first.call == 0 and first.path == ""
    assert first.shape_a == first.shape_b == (models.ROWS, 8) and first.dtype_a == torch.float32
    assert first.inputs_agree is True
    # the element the report names really differs, with the values and bits it gives
    whole = _outputs(models.make_split_dependent, 1)["mixer"]
    split = _outputs(models.make_split_dependent, parts)["mixer"]
    assert first.count == int((whole != split).sum()) and first.numel == whole.numel()
    assert first.value_a == whole[first.index].item() and first.value_b == split[first.index].item()
    assert first.bits_a == f"0x{whole[first.index].view(torch.int32).item() & 0xFFFFFFFF:08x}"
    # gradients: everything upstream of the mixer, and fc2.weight (it sees the mixed rows); not fc2.bias
    assert [d.name for d in report.gradient_differences] == ["fc1.weight", "fc1.bias", "fc2.weight"]
    assert report.gradients_compared == 4
    text = str(report)
    assert "first module output that differs" in text and "\n  mixer: float32 (6, 8): " in text
    assert "inside this module's forward" in text and "fc1.weight: float32 (8, 4)" in text


def _outputs(make_model, parts):
    """Each module's output joined over the micro-batches, recorded by hand (the test's own oracle)."""
    model, seen = make_model(), {}
    hooks = [
        m.register_forward_hook(
            lambda mod, args, out, name=name: seen.setdefault(name, []).append(out.detach())
        )
        for name, m in model.named_modules()
    ]
    models.step(model, parts)
    for h in hooks:
        h.remove()
    return {name: torch.cat(outs) for name, outs in seen.items()}


@pytest.mark.parametrize("parts", SPLITS)
def test_no_divergence_for_a_split_invariant_model(parts):
    report = find_divergence(models.make_clean, models.step, 1, parts)
    assert not report.diverged and report.first_output is None and report.first_gradient is None
    assert report.outputs_compared == 5 and report.gradients_compared == 4 and report.skipped == ()
    assert "no divergence: 5 module outputs and 4 gradients are bitwise equal" in str(report)


def test_a_step_that_never_reads_its_split_is_refused_before_anything_runs():
    built = []

    def make_model():
        built.append(1)
        return models.make_split_dependent()

    def ignores_split(model, parts):
        models.step(model, 1)

    class Trainer:
        def step(self, model, micro_batches):
            models.step(model, 1)

    for step, name in (
        (ignores_split, "parts"),
        (lambda m, _: models.step(m, 1), "_"),
        (Trainer().step, "micro_batches"),
    ):
        with pytest.raises(
            ValueError, match=rf"step never reads its split parameter '{name}'.*x\.chunk\({name}\)"
        ):
            find_divergence(make_model, step, 1, 3)
    assert built == []  # refused before a model was built or a hook installed
    # one split run twice (run-to-run) does not need the split: a step may ignore it there
    assert not find_divergence(make_model, ignores_split, 3).diverged and len(built) == 2


def test_a_step_that_reads_its_split_but_does_not_decompose_by_it_is_warned_about_not_reported_as_invariant():
    def reads_but_ignores(model, parts):
        models.step(model, 1 if parts else 1)

    with pytest.warns(
        UserWarning, match=r"same micro-batch sizes \[6\]: does step\(model, split\) use its split"
    ):
        report = find_divergence(models.make_split_dependent, reads_but_ignores, 1, 3)
    assert not report.diverged and report.same_decomposition
    assert report.micro_batch_sizes == ((models.ROWS,), (models.ROWS,))
    text = str(report)
    assert "warning: both runs called the model with the same micro-batch sizes [6]" in text
    assert "no divergence" not in text and "not a split-invariance check: 5 module outputs" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an honest step: no warning
        honest = find_divergence(models.make_clean, models.step, 1, 3)
    assert not honest.same_decomposition and honest.micro_batch_sizes == ((6,), (2, 2, 2))
    assert "warning" not in str(honest) and "no divergence: 5 module outputs" in str(honest)


def test_the_split_read_check_reads_what_it_can_and_never_refuses_a_step_it_cannot_read():
    # split read by an inner function, through a partial, by a callable object, in *args: all run
    # (the split-dependent model diverges, so each step really decomposed by its split)
    def closure(model, parts):
        def run():
            models.step(model, parts)

        run()

    class Step:
        def __call__(self, model, parts):
            models.step(model, parts)

    def star(*args):
        models.step(*args)

    for step in (closure, functools.partial(models.step), Step(), star, lambda m, s: models.step(m, s)):
        assert find_divergence(models.make_split_dependent, step, 1, 3).diverged, step


def test_inline_code_is_blamed_on_the_parent_not_the_module_that_receives_it():
    report = find_divergence(models.make_inline, models.step, 1, 3)
    first = report.first_output
    assert first.name == "fc2" and first.inputs_agree is False
    assert "inline code in <root>'s forward" in str(report)


def test_gradient_only_divergence_of_a_bf16_layer_norm():
    # LayerNorm's forward is per row (outputs agree); its weight gradient is summed by autograd over
    # micro-batches in bf16: 1 + 5 * 2^-9 rounds once to 0x3f81 in one micro-batch, to 0x3f80 in three
    report = find_divergence(models.make_layer_norm, models.step_layer_norm, 1, 3)
    assert report.output_differences == () and report.outputs_compared == 2
    grad = report.first_gradient
    assert grad.name == "ln.weight" and grad.dtype_a == torch.bfloat16 and grad.shape_a == (8,)
    assert (grad.index, grad.value_a, grad.value_b) == ((0,), 1.0078125, 1.0)
    assert (grad.bits_a, grad.bits_b, grad.count, grad.numel) == ("0x3f81", "0x3f80", 8, 8)
    assert "module outputs: all 2 compared are bitwise equal" in str(report)
    assert "ln.weight: bfloat16 (8,): 8 of 8 elements differ; first at index (0,): 1.0078125 (0x3f81)" in str(
        report
    )
    whole = models.make_layer_norm()
    models.step_layer_norm(whole, 1)
    assert whole.ln.weight.grad.view(torch.int16)[0].item() == 0x3F81  # the oracle: plain torch


class Drift(nn.Module):
    """Adds ``ulps`` units in the last place to its input (a stale cache, a leaked counter)."""

    def __init__(self, ulps: int) -> None:
        super().__init__()
        self.ulps = ulps  # not a buffer: the initial state_dicts of both runs agree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        int_dtype = {2: torch.int16, 4: torch.int32}[x.element_size()]
        bumped = (x.detach().view(int_dtype) + self.ulps).view(x.dtype)
        return x + (bumped - x).detach()


def _drifting(dtype: torch.dtype):
    runs = iter(range(2))

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        lin = nn.Linear(4, 4, dtype=dtype)
        with torch.no_grad():
            lin.weight.zero_()
            lin.bias.fill_(1.0)
        return nn.Sequential(OrderedDict(lin=lin, drift=Drift(next(runs))))

    def step(model: nn.Module, micro_batches: int) -> None:
        x = torch.arange(24, dtype=dtype).view(6, 4)
        for xb in x.chunk(micro_batches):
            model(xb).sum().backward()

    return make_model, step


@pytest.mark.parametrize(
    "dtype, one, next_up",
    [
        (torch.bfloat16, "0x3f80", "0x3f81"),
        (torch.float16, "0x3c00", "0x3c01"),
        (torch.float32, "0x3f800000", "0x3f800001"),
    ],
)
def test_run_to_run_mode_and_hex_bit_patterns(dtype, one, next_up):
    make_model, step = _drifting(dtype)
    report = find_divergence(make_model, step, 3)  # split_b omitted: split 3 twice
    assert report.run_to_run and report.split_b == 3 and report.micro_batches == (3, 3)
    assert [d.name for d in report.output_differences] == ["drift", ""]
    first = report.first_output
    assert (first.index, first.value_a, first.count, first.numel) == ((0, 0), 1.0, 24, 24)
    assert (
        first.value_b == torch.nextafter(torch.ones((), dtype=dtype), torch.full((), 2.0, dtype=dtype)).item()
    )
    assert (first.bits_a, first.bits_b) == (one, next_up)
    assert f"1.0 ({one}) vs " in str(report) and "run twice (run-to-run, 3 micro-batches)" in str(report)
    assert report.gradient_differences == () and report.gradients_compared == 2


def test_run_to_run_of_a_deterministic_model_and_per_micro_batch_values():
    # the loss module's scalar per micro-batch is compared run to run, but not across splits
    same = find_divergence(models.make_clean, models.step_mse, 3)
    assert not same.diverged and same.outputs_compared == 6 and same.skipped == ()
    split = find_divergence(models.make_clean, models.step_mse, 1, 3)
    assert not split.diverged and split.outputs_compared == 5
    assert len(split.skipped) == 1 and split.skipped[0].startswith("<unregistered MSELoss>: no dim 0")


class CenterTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(1, keepdim=True)


def test_batch_dim_joins_packed_tokens_and_skips_what_does_not_join():
    def make_model() -> nn.Module:
        model = nn.Sequential(OrderedDict(proj=nn.Linear(4, 4), mix=CenterTokens()))
        with torch.no_grad():  # dyadic weights: proj's fp32 sums are exact in any order, so its rows
            # equal on every host whatever its CPU matmul does with 6 rows or 2 (a random init differs)
            model.proj.weight.copy_((torch.arange(16.0).view(4, 4) - 8) / 16)
            model.proj.bias.copy_(torch.arange(4.0) / 4)
        return model

    def step(model: nn.Module, parts: int) -> None:  # (1, T, D) packed tokens, split along T
        x = torch.arange(24.0).view(1, 6, 4) / 8
        for xb in x.chunk(parts, dim=1):
            model(xb).sum().backward()

    report = find_divergence(make_model, step, 1, 3, batch_dim=1)
    assert report.first_output.name == "mix" and report.first_output.shape_a == (1, 6, 4)
    assert report.outputs_before_first == 1 and report.skipped == ()
    wrong = find_divergence(make_model, step, 1, 3, batch_dim=0)  # (1, 6, 4) vs (3, 2, 4): not one tensor
    assert wrong.output_differences == () and len(wrong.skipped) == 3
    assert "dim 0 is not the batch dim" in wrong.skipped[0]


def test_keep_tensors_false_or_by_name():
    digests = find_divergence(models.make_split_dependent, models.step, 1, 3, keep_tensors=False)
    first = digests.first_output
    assert first.name == "mixer" and first.count is None and first.digest_a != first.digest_b
    assert "keep_tensors={'mixer'}" in str(digests)
    some = find_divergence(
        models.make_split_dependent, models.step, 1, 3, keep_tensors={"mixer", "fc2.weight"}
    )
    assert some.first_output.count is not None and some.output_differences[1].count is None
    assert {d.name: d.count is not None for d in some.gradient_differences} == {
        "fc1.weight": False,
        "fc1.bias": False,
        "fc2.weight": True,
    }


def test_the_tool_only_reads():
    plain = models.make_clean()
    models.step(plain, 3)
    seen = {}
    find_divergence(models.make_clean, models.step, 3, gradients=lambda m: seen.setdefault("g", _grads(m)))
    assert digest(seen["g"]) == digest(_grads(plain))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_bad_input_raises_clear_errors_and_removes_the_hooks():
    before = (len(torch_module._global_forward_hooks), len(torch_module._global_forward_pre_hooks))

    def unseeded():
        return nn.Linear(4, 2)

    with pytest.raises(ValueError, match="different initial weights.*seed it"):
        find_divergence(unseeded, lambda m, s: m(torch.ones(1, 4)), 1)
    with pytest.raises(ValueError, match="never called the model"):
        find_divergence(models.make_clean, lambda m, s: None, 1)
    with pytest.raises(ValueError, match="batch_dim"):
        find_divergence(models.make_clean, models.step, 1, 2, batch_dim=-1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        find_divergence(lambda: "model", models.step, 1, 2)
    with pytest.raises(
        TypeError,
        match=r"make_model must be a factory: a zero-argument callable that returns a "
        r"fresh model, e\.g\. make_model=lambda: Tiny\(\).*got a model instance \(Tiny\)",
    ):
        find_divergence(models.make_clean(), models.step, 1, 2)
    with pytest.raises(
        TypeError, match=r"factory.*Tiny\(center\).*cannot be called without arguments.*lambda: Tiny"
    ):
        find_divergence(models.Tiny, models.step, 1, 2)  # a class whose constructor needs arguments
    with pytest.raises(TypeError, match=r"step must take two positional arguments, step\(model, split\)"):
        find_divergence(models.make_clean, lambda model: None, 1, 2)
    shared = models.make_clean()
    with pytest.raises(ValueError, match="same model object twice.*not lambda: model"):
        find_divergence(lambda: shared, models.step, 1, 2)
    with pytest.raises(TypeError, match="step must be callable"):
        find_divergence(models.make_clean, "step", 1, 2)
    with pytest.raises(TypeError, match="keep_tensors"):
        find_divergence(models.make_clean, models.step, 1, 2, keep_tensors="mixer")
    with pytest.raises(TypeError, match="'fc1.weight' is a str"):
        find_divergence(models.make_clean, models.step, 1, 2, gradients=lambda m: {"fc1.weight": "x"})

    def failing(model, parts):
        model(torch.ones(2, 4))
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        find_divergence(models.make_clean, failing, 1)
    assert (len(torch_module._global_forward_hooks), len(torch_module._global_forward_pre_hooks)) == before


def test_difference_reports_missing_dtype_and_shape():
    assert str(Difference("gradient", "w", None, "", "missing", digest_a="ab")) == "w: present in run a only"
    kw = dict(dtype_a=torch.float32, dtype_b=torch.bfloat16)
    assert str(Difference("output", "a.b", 1, "/0", "dtype", **kw)).startswith(
        "a.b output /0 (call 1): dtype"
    )


def test_cli_in_process(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(HERE))
    assert main(["_divergence_models:make_clean", "_divergence_models:step", "--split-a", "3"]) == 0
    assert "run twice (run-to-run, 3 micro-batches)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["_divergence_models:no_such_factory", "_divergence_models:step", "--split-a", "1"])
    assert exit_info.value.code == 2 and "cannot load the target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["_divergence_models", "_divergence_models:step", "--split-a", "1"])
    assert "MODULE:FUNCTION" in capsys.readouterr().err
    # a step that raises is not a divergence (1): status 2 with its traceback
    assert main(["_divergence_models:make_clean", "_divergence_models:step", "--split-a", "'x'"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "the run raised" in err


def _target(tmp_path, monkeypatch, name, body):
    """A module ``name`` on the path, with ``body`` as its source (CLI targets of every kind)."""
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(HERE))
    return name


def _exit_code(capsys, argv):
    """``main(argv)``'s exit status (returned or raised) and what it wrote to stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_cli_bad_targets_exit_2_with_a_message_never_0_or_1(tmp_path, monkeypatch, capsys):
    step = ["_divergence_models:step", "--split-a", "1", "--split-b", "3"]
    # a module whose import raises: not an uncaught traceback (1 would read as a divergence)
    broken = _target(tmp_path, monkeypatch, "_div_broken", "raise RuntimeError('no GPU here')\n")
    code, err = _exit_code(capsys, [f"{broken}:make_model", *step])
    assert (
        code == 2 and "cannot load the target: importing _div_broken raised RuntimeError: no GPU here" in err
    )
    # a script that exits when imported (here with status 0): not a silent 0 ("no divergence")
    script = _target(
        tmp_path, monkeypatch, "_div_script", "import sys\nprint('usage: train.py')\nsys.exit(0)\n"
    )
    code, err = _exit_code(capsys, [f"{script}:make_model", *step])
    assert code == 2 and "importing _div_script exited (SystemExit(0))" in err and "__main__" in err
    # a model instance where the factory belongs: the factory message, as a usage error
    instance = _target(
        tmp_path,
        monkeypatch,
        "_div_instance",
        "from _divergence_models import make_clean\nmodel = make_clean()\n",
    )
    code, err = _exit_code(capsys, [f"{instance}:model", *step])
    assert code == 2 and "make_model must be a factory" in err and "lambda: Tiny()" in err
    assert "Traceback" not in err and "error:" in err
    # a step that never reads its split
    lazy = _target(tmp_path, monkeypatch, "_div_lazy", "def step(model, parts):\n    pass\n")
    code, err = _exit_code(
        capsys, ["_divergence_models:make_clean", f"{lazy}:step", "--split-a", "1", "--split-b", "3"]
    )
    assert code == 2 and "step never reads its split parameter 'parts'" in err
    code, err = _exit_code(
        capsys, ["_divergence_models:make_clean", "_divergence_models:ROWS", "--split-a", "1"]
    )
    assert code == 2 and "_divergence_models:ROWS is a int, not a callable" in err
    code, err = _exit_code(capsys, ["_divergence_models:make_clean", *step, "--batch-dim", "-1"])
    assert code == 2 and "batch_dim must be a non-negative int" in err


def test_cli_a_step_that_exits_is_a_run_that_raised_not_a_result(tmp_path, monkeypatch, capsys):
    quits = _target(
        tmp_path, monkeypatch, "_div_quits", "import sys\ndef step(model, parts):\n    sys.exit(parts - 3)\n"
    )
    code, err = _exit_code(capsys, ["_divergence_models:make_clean", f"{quits}:step", "--split-a", "3"])
    assert code == 2 and "SystemExit" in err and "no comparison was made" in err


def test_cli_subprocess_a_target_script_that_exits_0_on_import_exits_2(tmp_path):
    (tmp_path / "_div_exits.py").write_text("import sys\nsys.exit(0)\n")
    path = [str(tmp_path), str(HERE), *(p for p in sys.path if p)]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "det_core.testing.divergence",
            "_div_exits:make_model",
            "_divergence_models:step",
        ]
        + ["--split-a", "1", "--split-b", "3"],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "importing _div_exits exited (SystemExit(0))" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "factory, code, expected",
    [
        ("make_split_dependent", 1, "first module output that differs"),
        ("make_clean", 0, "no divergence: 5 module outputs and 4 gradients are bitwise equal"),
    ],
)
def test_cli_subprocess(factory, code, expected):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *(p for p in sys.path if p)]))
    proc = subprocess.run(
        [sys.executable, "-m", "det_core.testing.divergence", f"_divergence_models:{factory}"]
        + ["_divergence_models:step", "--split-a", "1", "--split-b", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == code, proc.stderr
    assert expected in proc.stdout and "RuntimeWarning" not in proc.stderr  # runpy: not imported twice
    if code:
        assert "\n  mixer: float32 (6, 8): " in proc.stdout


@pytest.mark.gpu
def test_on_cuda_the_same_module_and_no_divergence_for_the_clean_model():
    def on_cuda(make_model):
        return lambda: make_model().cuda()

    def step(model, parts):
        x, target = models._data()
        for xb, tb in zip(x.cuda().chunk(parts), target.cuda().chunk(parts), strict=True):
            (model(xb) * tb).sum().backward()

    report = find_divergence(on_cuda(models.make_split_dependent), step, 1, 3)
    assert [d.name for d in report.output_differences] == ["mixer", "fc2", ""]
    assert report.first_output.count is not None and report.first_output.inputs_agree is True
    assert not find_divergence(on_cuda(models.make_clean), step, 1, 3).diverged
    assert not find_divergence(on_cuda(models.make_clean), step, 3).diverged


def test_the_docs_example_runs_and_names_the_mixing_module(capsys):
    page = (HERE.parents[2] / "docs" / "det-core.md").read_text()
    section = page.split("## Finding where a step diverges", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {"__name__": "__docs_example__"}
    exec(compile(code, "<det-core.md example>", "exec"), namespace)
    report = namespace["report"]
    assert report.first_output.name == "mix" and report.first_output.inputs_agree is True
    assert report.outputs_before_first == 2 and report.first_gradient.name == "fc1.weight"
    printed = capsys.readouterr().out
    assert printed.startswith("find_divergence: split_a=1 (1 micro-batch) vs split_b=3 (3 micro-batches)\n")
    assert "\n  mix: float32 (6, 8): " in printed and "also differ (outputs, 2): fc2, <root>" in printed


def test_public_names_resolve_from_every_import_path_to_the_same_objects():
    """The finder is a subpackage by role (report, capture, compare, find, cli): its public names
    stay importable from det_core.testing.divergence and det_core.testing, as the same objects."""
    import det_core.testing as testing
    import det_core.testing.divergence as divergence
    from det_core.testing.divergence import cli, find, report

    assert divergence.__all__ == ["DivergenceReport", "Difference", "find_divergence", "main"]
    assert divergence.Difference is report.Difference is testing.Difference is Difference
    assert divergence.DivergenceReport is report.DivergenceReport is testing.DivergenceReport
    assert divergence.find_divergence is find.find_divergence is testing.find_divergence
    assert divergence.main is cli.main is main
