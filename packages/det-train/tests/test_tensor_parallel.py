"""Tensor-parallel invariance of linear: column-parallel (N split) and row-parallel (K split) in
2, 3 and 4 parts reproduce the unsplit Y, dX, dW and db bit for bit.

Each "rank" is simulated in one process with the calls a rank makes:

- column-parallel: rank r holds W[N_r] (and b[N_r]); Y[:, N_r] = linear(X, W_r, b_r). dX sums over
  N, so ranks chain their fp32 accumulators (``matmul_partial(dY_r, W_r, carry)``).
- row-parallel: rank r holds X[:, K_r] and W[:, K_r]; Y = the chain of ``matmul_partial`` over the
  K parts (the last adds the bias and rounds); dX[:, K_r] = dY W_r and dW[:, K_r] = dY^T X_r.

Cuts are at multiples of the K step (``block_k`` = 64 for bf16), the unit of the fixed K order.
"""

import os
import re

import pytest
import torch
from det_core.testing import assert_bitwise_equal, contiguous_splits
from det_train import linear
from det_train.ops.matmul import matmul_partial

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=torch.bfloat16, device=DEVICE)


def _unsplit(x, w, b, dy):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = linear(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad


def _column_parallel(x, w, b, dy, parts):
    ys, dws, dbs, carry = [], [], [], None
    cuts = contiguous_splits(w.shape[0], parts, granule=64)
    for i, (s, e) in enumerate(cuts):
        w_r, b_r = w[s:e].clone().requires_grad_(), b[s:e].clone().requires_grad_()
        y_r = linear(x, w_r, b_r)
        y_r.backward(dy[:, s:e])
        ys.append(y_r)
        dws.append(w_r.grad)
        dbs.append(b_r.grad)
        carry = matmul_partial(dy[:, s:e], w[s:e], carry, finish=i == len(cuts) - 1)  # dX chain over N
    return torch.cat(ys, 1), carry, torch.cat(dws, 0), torch.cat(dbs, 0)


def _row_parallel(x, w, b, dy, parts):
    carry, dxs, dws = None, [], []
    cuts = contiguous_splits(w.shape[1], parts, granule=64)
    for i, (s, e) in enumerate(cuts):
        last = i == len(cuts) - 1
        carry = matmul_partial(x[:, s:e], w[:, s:e].t(), carry, bias=b if last else None, finish=last)
        x_r, w_r = x[:, s:e].clone().requires_grad_(), w[:, s:e].clone().requires_grad_()
        linear(x_r, w_r).backward(dy)
        dxs.append(x_r.grad)
        dws.append(w_r.grad)
    db = b.detach().clone().requires_grad_()
    linear(x, w, db).backward(dy)  # db needs no split: every rank (or the last) has all of dY
    return carry, torch.cat(dxs, 1), torch.cat(dws, 1), db.grad


def _check(kind, fn, sizes, parts_list, seed):
    m, k, n = sizes
    x, w, b, dy = (
        _randn(m, k, seed=seed),
        _randn(n, k, seed=seed + 1),
        _randn(n, seed=seed + 2),
        _randn(m, n, seed=seed + 3),
    )
    ref = _unsplit(x, w, b, dy)
    for parts in parts_list:
        got = fn(x, w, b, dy, parts)
        for name, g, r in zip(("y", "dx", "dw", "db"), got, ref, strict=True):
            assert_bitwise_equal(g, r, f"{kind} {parts} parts: {name}")


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_column_parallel_reproduces_unsplit(parts):
    _check("column-parallel", _column_parallel, (33, 256, 256), [parts], seed=1)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_row_parallel_reproduces_unsplit(parts):
    _check("row-parallel", _row_parallel, (33, 320, 128), [parts], seed=5)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_row_parallel_chain_matches_unsplit_fp32_accumulator(parts):
    """Before rounding to bf16 (where most differences vanish): the chain is the unsplit fold exactly,
    while summing independent per-rank partials (what an all-reduce does) is not."""
    x, w = _randn(65, 640, seed=20), _randn(96, 640, seed=21)
    whole = matmul_partial(x, w.t())
    carry, partials = None, []
    for s, e in contiguous_splits(640, parts, granule=64):
        carry = matmul_partial(x[:, s:e], w[:, s:e].t(), carry)
        partials.append(matmul_partial(x[:, s:e], w[:, s:e].t()))
    assert_bitwise_equal(carry, whole, f"fp32 chain of {parts}")
    summed = partials[0]
    for p in partials[1:]:
        summed = summed + p
    assert not torch.equal(summed, whole), "independent partial sums should not reproduce the fold"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["column", "row"])
def test_gpu_tensor_parallel_real_sizes(kind):
    fn = _column_parallel if kind == "column" else _row_parallel
    _check(kind, fn, (4096, 4096, 4096), [2, 3, 4], seed=9)


# ----------------------------------------------------------------------------- real ranks (gloo)
def _run_tp_ranks(world: int, *mode: str, timeout: float = 600) -> list[dict]:
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    worker = Path(__file__).with_name("tp_worker.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryDirectory() as tmp:
        init, outs = Path(tmp, "init"), [Path(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), str(r), str(world), str(init), str(outs[r]), *mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for r in range(world)
        ]
        try:
            logs = [p.communicate(timeout=timeout)[0] for p in procs]
        except subprocess.TimeoutExpired as e:
            for p in procs:
                p.kill()
            raise AssertionError(
                f"{world} ranks ran past {timeout} s (a rank left waiting in the chain?)"
            ) from e
        for r, p in enumerate(procs):
            if p.returncode != 0:
                raise AssertionError(f"rank {r} of {world} failed:\n{logs[r][-3000:]}")
        return [torch.load(o) for o in outs]


@pytest.mark.skipif(DEVICE == "cuda", reason="gloo ranks on CPU through the Triton interpreter")
@pytest.mark.parametrize("world", [3])
def test_distributed_row_and_column_parallel_reproduce_unsplit(world):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_tp_worker", Path(__file__).with_name("tp_worker.py"))
    tp_worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp_worker)
    x, w, b, dy = (t.to(DEVICE) for t in tp_worker.problem())
    y, dx, dw, db = _unsplit(x, w, b, dy)
    k_cuts = contiguous_splits(tp_worker.K, world, 64)
    n_cuts = contiguous_splits(tp_worker.N, world, 64)
    for rank, got in enumerate(_run_tp_ranks(world)):
        (ks, ke), (ns, ne) = k_cuts[rank], n_cuts[rank]
        where = f"TP={world}, rank {rank}"
        assert_bitwise_equal(got["row_y"], y, f"row-parallel y, {where}")
        assert_bitwise_equal(got["row_dx"], dx[:, ks:ke], f"row-parallel dx, {where}")
        assert_bitwise_equal(got["row_dw"], dw[:, ks:ke], f"row-parallel dw, {where}")
        assert_bitwise_equal(got["row_db"], db, f"row-parallel db, {where}")
        assert_bitwise_equal(got["col_y"], y[:, ns:ne], f"column-parallel y, {where}")
        assert_bitwise_equal(got["col_dx"], dx, f"column-parallel dx, {where}")
        assert_bitwise_equal(got["col_dw"], dw[ns:ne], f"column-parallel dw, {where}")
        assert_bitwise_equal(got["col_db"], db[ns:ne], f"column-parallel db, {where}")


@pytest.mark.skipif(DEVICE == "cuda", reason="gloo ranks on CPU through the Triton interpreter")
def test_a_part_off_the_k_step_is_refused_on_every_rank_not_only_its_own():
    """Rank 0 holds 100 elements of the summed axis (not a multiple of the K step): it used to be
    the only rank to raise, and rank 1 waited in the chain for it forever."""
    for rank, got in enumerate(_run_tp_ranks(2, "refusals", timeout=240)):
        for kind in ("row", "col"):
            assert re.fullmatch(
                r"rank 0's part of the summed axis has 100 elements; every part but the last must be a "
                r"multiple of \d+ .*\(refused on every rank of the group\)",
                got[kind],
            ), (rank, kind, got[kind])
