"""One rank of the FSDP2 test of bf16 and 8-bit states (launched by test_adamw_sr_states.py).

For each world size w in the requested list, ranks < w shard four bf16 params with FSDP2 over a
w-rank mesh, run ``STEPS`` AdamWSR steps with 8-bit states on two 2-D ones and bf16 states on two
1-D ones (``param_groups``), gather the full params and states (8-bit scales included), and rank 0
writes their digest to ``<out_dir>/ws<w>.txt``. With 3 ranks each rank also puts the (32,) param
into an 8-bit group, whose shards (11, 11, 10 elements) do not start on blocks of 32, and writes
the error to ``<out_dir>/misaligned<rank>.txt``. The parent compares against one unsharded run.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from fsdp_worker import SEED, STEPS, exit_now, full_grad, run_world_sizes  # noqa: F401 (the test reads SEED, STEPS)
from torch import nn


class Params(nn.Module):
    """The parameters only (the test sets their gradients): few rows, so few programs per step."""

    def __init__(self):
        super().__init__()
        # Shard(1): 384 / w columns, a multiple of 32 for w = 1..4 (a segment per row and rank)
        self.cols = nn.Parameter(torch.randn(3, 384))
        # Shard(0): one 32-element row (one block) per rank, rank 3 of 4 empty
        self.rows = nn.Parameter(torch.randn(3, 32))
        # bf16 states: split unevenly (11, 11, 10 and 8 x 4; 1, 1, 1 and 1, 1, 1, 0)
        self.long = nn.Parameter(torch.randn(32))
        self.short = nn.Parameter(torch.randn(3))


def build_model(device) -> nn.Module:
    torch.manual_seed(0)
    return Params().to(device=device, dtype=torch.bfloat16)


def param_groups(model: nn.Module) -> list[dict]:
    return [
        {"params": [model.cols, model.rows], "state_dtype": "8bit"},
        {"params": [model.long, model.short], "state_dtype": torch.bfloat16},
    ]


def state_tensors(model, opt, gather):
    out = [gather(p.detach()) for p in model.parameters()]
    for p in model.parameters():
        out += [gather(value) for key, value in sorted(opt.state[p].items()) if key != "step"]
    return out


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def placement(p):
        return Shard(1) if p.shape == (3, 384) else Shard(0)

    fully_shard(model, mesh=mesh, shard_placement_fn=placement)


def _refuse_misaligned_8bit(out_dir, w, model, mesh, device, rank) -> None:
    """With 3 ranks: an 8-bit bias whose shards start at 11 and 22 is refused before any state exists."""
    if w != 3:
        return
    from adamw_sr import AdamWSR
    from torch.distributed.tensor import distribute_tensor

    bias = model.long
    opt = AdamWSR([{"params": [bias], "state_dtype": "8bit"}], lr=1e-2)
    bias.grad = distribute_tensor(full_grad(1, bias.shape, 0, device), mesh, bias.placements)
    before = bias.to_local().clone()
    try:
        opt.step()
        message = "no error"
    except ValueError as e:
        message = str(e)
    untouched = torch.equal(bias.to_local(), before) and len(opt.state[bias]) == 0
    with open(os.path.join(out_dir, f"misaligned{rank}.txt"), "w") as f:
        f.write(f"untouched={untouched}\n{message}")


def main() -> None:
    out_dir, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    after = functools.partial(_refuse_misaligned_8bit, out_dir)
    run_world_sizes(out_dir, sizes, build_model, _shard, param_groups, state_tensors, after)


if __name__ == "__main__":
    main()
    exit_now()
