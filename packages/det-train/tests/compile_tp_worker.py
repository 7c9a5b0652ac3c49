"""One rank of the compiled tensor-parallel test (run by test_compile.py as a separate process).

Usage: python compile_tp_worker.py RANK WORLD INIT_FILE OUT_FILE. The problem and the cuts of
tp_worker.py, each linear run through torch.compile(fullgraph=True, backend="aot_eager").
"""

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from det_core.testing import contiguous_splits  # noqa: E402
from det_train.parallel.tensor_parallel import column_parallel_linear, row_parallel_linear  # noqa: E402

_spec = importlib.util.spec_from_file_location("_tp_worker", Path(__file__).with_name("tp_worker.py"))
tp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tp_worker)


def main():
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    x, w, b, dy = tp_worker.problem()
    row = torch.compile(
        lambda x, w, b: row_parallel_linear(x, w, b, chunk_rows=16), fullgraph=True, backend="aot_eager"
    )
    col = torch.compile(
        lambda x, w, b: column_parallel_linear(x, w, b, chunk_rows=16), fullgraph=True, backend="aot_eager"
    )
    got = {}
    s, e = contiguous_splits(tp_worker.K, world, 64)[rank]
    x_r, w_r, b_r = (t.clone().requires_grad_() for t in (x[:, s:e], w[:, s:e], b))
    y = row(x_r, w_r, b_r)
    y.backward(dy)
    got.update(row_y=y.detach(), row_dx=x_r.grad, row_dw=w_r.grad, row_db=b_r.grad)
    s, e = contiguous_splits(tp_worker.N, world, 64)[rank]
    x_c, w_c, b_c = (t.clone().requires_grad_() for t in (x, w[s:e], b[s:e]))
    y = col(x_c, w_c, b_c)
    y.backward(dy[:, s:e])
    got.update(col_y=y.detach(), col_dx=x_c.grad, col_dw=w_c.grad, col_db=b_c.grad)
    torch.save(got, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
