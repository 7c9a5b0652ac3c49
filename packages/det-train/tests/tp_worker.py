"""One rank of a gloo tensor-parallel test (run by test_tensor_parallel.py as a separate process).

Usage: python tp_worker.py RANK WORLD INIT_FILE OUT_FILE [refusals]. Builds the same global problem
as the test, runs row- and column-parallel linear on this rank's part, and torch.save()s what it got
(``refusals``, 2 ranks: parts off the K step, and the error each rank got).
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from det_core.testing import contiguous_splits  # noqa: E402
from det_train.parallel.tensor_parallel import column_parallel_linear, row_parallel_linear  # noqa: E402

M, K, N = 37, 320, 192  # K and N cut at multiples of 64


def problem():
    g = torch.Generator().manual_seed(3)
    make = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    return make(M, K), make(N, K), make(N), make(M, N)


def refusals(rank, world, out):
    """Parts cut off the K step (rank 0 holds 100 of K and of N): what each rank's call raised."""
    x, w, b, _ = problem()
    cut = lambda size: [(0, 100), (100, size)][rank] if world == 2 else None  # noqa: E731
    (ks, ke), (ns, ne) = cut(K), cut(N)
    got = {}
    for kind, call in (
        ("row", lambda: row_parallel_linear(x[:, ks:ke], w[:, ks:ke], b, chunk_rows=16)),
        ("col", lambda: column_parallel_linear(x.clone().requires_grad_(), w[ns:ne], b[ns:ne])),
    ):
        try:
            call()
            got[kind] = "no error"
        except ValueError as e:
            got[kind] = str(e)
    torch.save(got, out)


def main():
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    if sys.argv[5:] == ["refusals"]:
        refusals(rank, world, out)
        dist.destroy_process_group()
        return
    x, w, b, dy = problem()
    got = {}
    s, e = contiguous_splits(K, world, 64)[rank]
    x_r, w_r, b_r = (
        x[:, s:e].clone().requires_grad_(),
        w[:, s:e].clone().requires_grad_(),
        b.clone().requires_grad_(),
    )
    y = row_parallel_linear(x_r, w_r, b_r, chunk_rows=16)
    y.backward(dy)
    got.update(row_y=y.detach(), row_dx=x_r.grad, row_dw=w_r.grad, row_db=b_r.grad)
    s, e = contiguous_splits(N, world, 64)[rank]
    x_c, w_c, b_c = (
        x.clone().requires_grad_(),
        w[s:e].clone().requires_grad_(),
        b[s:e].clone().requires_grad_(),
    )
    y = column_parallel_linear(x_c, w_c, b_c, chunk_rows=16)
    y.backward(dy[:, s:e])
    got.update(col_y=y.detach(), col_dx=x_c.grad, col_dw=w_c.grad, col_db=b_c.grad)
    torch.save(got, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
