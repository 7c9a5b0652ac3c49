"""One rank of the FSDP2 test of bf16 and 8-bit states (launched by test_adamw_sr_states.py).

For each world size w in the requested list, ranks < w shard four bf16 params with FSDP2 over a
w-rank mesh, run ``STEPS`` AdamWSR steps with 8-bit states on two 2-D ones and bf16 states on two
1-D ones (``param_groups``), gather the full params and states (8-bit scales included), and rank 0
writes their digest to ``<out_dir>/ws<w>.txt``. With 3 ranks each rank also puts the (32,) param
into an 8-bit group, whose shards (11, 11, 10 elements) do not start on blocks of 32, and writes
the error to ``<out_dir>/misaligned<rank>.txt``. The parent compares against one unsharded run.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

STEPS = 2
SEED = 7


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


def full_grad(index: int, shape, step: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + index)
    return torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16)


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


def main() -> None:
    out_dir, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    from adamw_sr import AdamWSR
    from det_core.testing import digest
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    backend = os.environ.get("DET_FSDP_BACKEND", "gloo")
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    for w in sizes:
        mesh = DeviceMesh(device.type, list(range(w)))  # every rank builds every mesh (group creation)
        if rank < w:
            model = build_model(device)
            _shard(model, mesh)
            opt = AdamWSR(param_groups(model), lr=1e-2, weight_decay=0.1, seed=SEED)
            for step in range(STEPS):
                for i, p in enumerate(model.parameters()):
                    p.grad = distribute_tensor(full_grad(i, p.shape, step, device), mesh, p.placements)
                opt.step()
            tensors = state_tensors(model, opt, lambda t: t.full_tensor().cpu())
            if rank == 0:
                with open(os.path.join(out_dir, f"ws{w}.txt"), "w") as f:
                    f.write(digest(tensors))
            if w == 3:  # an 8-bit bias whose shards start at 11 and 22: refused before any state exists
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
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
