"""The harness itself: failures are reported precisely and digests mean bitwise equality."""

import pytest
import torch
from det_core.testing import (
    OpNames,
    assert_bitwise_equal,
    assert_decomposition_invariant,
    assert_row_invariant,
    assert_run_to_run,
    contiguous_splits,
    digest,
    run_in_fresh_process,
    run_processes,
    run_ranks,
)


def test_bitwise_report_names_first_mismatch_with_hex():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    b = a.clone()
    b[1, 0] = 3.015625  # one bf16 ULP above 3.0
    with pytest.raises(AssertionError) as err:
        assert_bitwise_equal(a, b, "w")
    msg = str(err.value)
    assert "1 of 4 elements differ" in msg and "(1, 0)" in msg
    assert "0x4040" in msg and "0x4041" in msg


def test_bitwise_distinguishes_signed_zero_and_nan_payload_and_dtype():
    with pytest.raises(AssertionError):
        assert_bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    nan1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(nan1, nan2)
    assert_bitwise_equal(nan1, nan1.clone())
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal(torch.ones(2), torch.ones(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match="shape"):
        assert_bitwise_equal(torch.ones(2), torch.ones(3))


def test_digest_is_sensitive_to_bits_dtype_shape_and_names():
    t = torch.arange(6, dtype=torch.float32)
    d = digest({"a": t, "b": [t * 2]})
    assert d == digest({"b": [t * 2], "a": t.clone()})  # key order does not matter
    assert d != digest({"a": t, "b": [t * 2 + 1e-6]})
    assert digest(t) != digest(t.reshape(2, 3))
    assert digest(t) != digest(t.double())
    assert digest({"a": t}) != digest({"c": t})
    assert len(d) == 64


def test_run_to_run_catches_a_nondeterministic_function():
    counter = iter(range(100))
    with pytest.raises(AssertionError):
        assert_run_to_run(lambda: torch.tensor([float(next(counter))]))
    assert_run_to_run(lambda: torch.ones(3))


def test_row_invariance_catches_a_batch_dependent_function():
    anchor = torch.randn(1, 8)
    make = lambda m: torch.randn(m, 8)  # noqa: E731
    assert_row_invariant(lambda x: x * 2, make, [1, 3, 17], anchor)
    with pytest.raises(AssertionError):
        assert_row_invariant(lambda x: x - x.mean(0), make, [3], anchor)


def test_contiguous_splits_and_decomposition_helper():
    assert contiguous_splits(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert contiguous_splits(16, 3, granule=2) == [(0, 6), (6, 12), (12, 16)]
    with pytest.raises(ValueError):
        contiguous_splits(7, 2, granule=2)
    with pytest.raises(ValueError):
        contiguous_splits(2, 3)
    g = torch.Generator().manual_seed(0)  # fixed data with a wide dynamic range: splitting changes the sum
    x = torch.randn(64, generator=g) * 10.0 ** torch.randint(-3, 8, (64,), generator=g)
    with pytest.raises(AssertionError):  # a naive split sum is not decomposition invariant
        assert_decomposition_invariant(
            lambda: x.sum(), lambda p: sum(x[a:b].sum() for a, b in contiguous_splits(64, p)), parts=(3, 7)
        )


def test_fresh_process_returns_last_line_and_reports_failure():
    code = "import torch; from det_core.testing import digest; print('noise'); print(digest(torch.arange(4)))"
    assert run_in_fresh_process(code) == digest(torch.arange(4))
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        run_in_fresh_process("1/0")


def test_plugin_registers_markers(pytestconfig):
    markers = "\n".join(pytestconfig.getini("markers"))
    assert "gpu:" in markers and "slow:" in markers


def _exit_with(code: int, path: str) -> None:
    with open(path, "w") as f:
        f.write(str(code))
    raise SystemExit(code)


def test_run_processes_passes_when_every_process_exits_0_and_names_the_codes_otherwise(tmp_path):
    paths = [str(tmp_path / f"p{i}") for i in range(3)]
    run_processes(_exit_with, [(0, p) for p in paths], what="ok ranks")
    assert [open(p).read() for p in paths] == ["0", "0", "0"]
    with pytest.raises(AssertionError, match=r"bad ranks: exit codes \[0, 3, 0\]"):
        run_processes(_exit_with, [(0, paths[0]), (3, paths[1]), (0, paths[2])], what="bad ranks")


_RANK_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")  # env://, from torchrun's variables
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([rank + 1])
dist.all_reduce(t)  # a collective: the ranks found each other
open(os.path.join(sys.argv[1], f"rank{rank}"), "w").write(f"{world} {int(t)} {os.environ['LOCAL_RANK']}")
dist.destroy_process_group()
if rank == int(sys.argv[2]):
    raise SystemExit("rank " + sys.argv[2] + " fails on purpose")
"""


def test_run_ranks_gives_each_rank_torchruns_environment_and_reports_a_failing_rank(tmp_path):
    script = tmp_path / "rank_script.py"
    script.write_text(_RANK_SCRIPT)
    run_ranks(script, 3, [tmp_path, -1])
    assert sorted((tmp_path / f"rank{r}").read_text() for r in range(3)) == ["3 6 0", "3 6 1", "3 6 2"]
    with pytest.raises(
        AssertionError, match=r"rank_script.py on 2 ranks: torchrun exited 1(.|\n)*rank 1 fails on purpose"
    ):
        run_ranks(script, 2, [tmp_path, 1])


_ABORT_SCRIPT = """
import os, sys
from pathlib import Path
runs = Path(sys.argv[1]) / "runs"
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
if len(runs.read_text()) <= int(sys.argv[2]):  # abort as a std::thread destroyed while joinable would
    sys.stderr.write("terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()
"""


@pytest.mark.parametrize("aborts, runs", [(1, 2), (2, 2)])
def test_run_ranks_runs_again_once_after_a_cpp_terminate(tmp_path, aborts, runs):
    """A rank that aborts with libstdc++'s "terminate called without an active exception" (a gloo
    teardown fault seen in CI) is run again once, with a warning; a second failure raises."""
    script = tmp_path / "abort_script.py"
    script.write_text(_ABORT_SCRIPT)
    # the warning carries the aborting rank's stderr from the message on: the fault handler's stacks
    with pytest.warns(UserWarning, match="a rank aborted in C\\+\\+(.|\n)*Fatal Python error: Aborted"):
        if aborts == 1:
            run_ranks(script, 1, [tmp_path, aborts])
        else:
            with pytest.raises(AssertionError, match="abort_script.py on 1 ranks: torchrun exited 1"):
                run_ranks(script, 1, [tmp_path, aborts])
    assert (tmp_path / "runs").read_text() == "x" * runs


def test_helpers_that_would_compare_nothing_refuse_instead_of_passing():
    """A determinism check that did not run never passes: one repeat, no batch size, no
    decomposition, or zero parts are refused (they used to pass, or to fail deep with a
    ZeroDivisionError / IndexError)."""
    with pytest.raises(ValueError, match="repeats must be an int >= 2"):
        assert_run_to_run(lambda: torch.rand(2), repeats=1)
    with pytest.raises(ValueError, match="batch_sizes must be ints >= 1, at least one"):
        assert_row_invariant(lambda x: torch.rand_like(x), lambda m: torch.zeros(m, 2), [], torch.zeros(1, 2))
    with pytest.raises(ValueError, match="batch_sizes must be ints >= 1"):
        assert_row_invariant(lambda x: x, lambda m: torch.zeros(m, 2), [0], torch.zeros(1, 2))
    for parts in ((), (0, 2)):
        with pytest.raises(ValueError, match="parts must be counts >= 1, at least one"):
            assert_decomposition_invariant(lambda: torch.zeros(1), lambda p: torch.rand(1), parts=parts)
    for parts, granule in ((0, 1), (-1, 1), (2, 0)):
        with pytest.raises(ValueError, match="parts and granule must be >= 1"):
            contiguous_splits(6, parts, granule)


def test_op_names_records_each_aten_op_in_order_and_leaves_results_alone():
    with OpNames() as ops:
        t = torch.zeros(3)
        t.add_(2.0)
        out = t * 3
    assert ops.names == ["zeros.default", "add_.Tensor", "mul.Tensor"]
    assert out.tolist() == [6.0, 6.0, 6.0]
    torch.ones(1)  # outside the mode: not recorded
    assert len(ops.names) == 3
