"""One rank of the FSDP2 test (launched by test_adamw_sr_fsdp.py; gloo on CPU or NCCL on GPUs).

For each world size w in the requested list, ranks < w shard a small bf16 model with FSDP2 over a
w-rank mesh (Shard(0) everywhere except one weight on Shard(1); uneven and empty shards), run
``STEPS`` AdamWSR steps with fixed full gradients, gather the full params and states, and rank 0
writes their digest to ``<out_dir>/ws<w>.txt``. The parent compares against one unsharded run.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

STEPS = 2
SEED = 7


def build_model(device) -> nn.Module:
    torch.manual_seed(0)
    # (10, 12) weight on Shard(1) (FSDP2 needs even dim-1 shards); the (10,) bias splits 4, 4, 2 and
    # 3, 3, 3, 1 (uneven); (3, 10) and (3,) leave rank 3 of 4 empty
    return nn.Sequential(nn.Linear(12, 10), nn.Linear(10, 3)).to(device=device, dtype=torch.bfloat16)


def full_grad(index: int, shape, step: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + index)
    return torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16)


def state_tensors(model, opt, gather):
    out = [gather(p.detach()) for p in model.parameters()]
    for key in ("exp_avg", "exp_avg_sq"):
        out += [gather(opt.state[p][key]) for p in model.parameters()]
    return out


def init_rank() -> tuple[int, torch.device]:
    """Join the process group (``DET_FSDP_BACKEND``: gloo on CPU, or NCCL with one GPU per rank)."""
    backend = os.environ.get("DET_FSDP_BACKEND", "gloo")
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    return rank, device


def run_world_sizes(out_dir, sizes, build, shard, groups, gather_state, after=None) -> None:
    """For each world size ``w`` of ``sizes``: ranks < w build the model (``build(device)``), shard
    it over a w-rank mesh (``shard(model, mesh)``), run ``STEPS`` AdamWSR steps over ``groups(model)``
    with ``full_grad``'s gradients, and rank 0 writes the digest of ``gather_state(model, opt,
    gather)`` to ``<out_dir>/ws<w>.txt``; then ``after(w, model, mesh, device, rank)`` if given."""
    from adamw_sr import AdamWSR
    from det_core.testing import digest
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    rank, device = init_rank()
    for w in sizes:
        mesh = DeviceMesh(device.type, list(range(w)))  # every rank builds every mesh (group creation)
        if rank < w:
            model = build(device)
            shard(model, mesh)
            opt = AdamWSR(groups(model), lr=1e-2, weight_decay=0.1, seed=SEED)
            for step in range(STEPS):
                for i, p in enumerate(model.parameters()):
                    p.grad = distribute_tensor(full_grad(i, p.shape, step, device), mesh, p.placements)
                opt.step()
            tensors = gather_state(model, opt, lambda t: t.full_tensor().cpu())
            if rank == 0:
                with open(os.path.join(out_dir, f"ws{w}.txt"), "w") as f:
                    f.write(digest(tensors))
            if after is not None:
                after(w, model, mesh, device, rank)
        dist.barrier()
    dist.destroy_process_group()


def exit_now() -> None:
    """End the rank without C++ static destructors: a gloo rank (4 ranks, loaded 2-core CI) aborted
    after every result was written with "terminate called without an active exception" and no
    Python frame left (the fault handler's stacks, run_ranks' warning), i.e. in process teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _shard(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def placement(p):
        return Shard(1) if p.shape == (10, 12) else Shard(0)

    for layer in model:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)


def main() -> None:
    out_dir, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    run_world_sizes(out_dir, sizes, build_model, _shard, lambda model: model.parameters(), state_tensors)


if __name__ == "__main__":
    main()
    exit_now()
