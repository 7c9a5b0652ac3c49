"""One rank of the DCP test (launched by test_adamw_sr_dcp.py; gloo on CPU, the kernel through the
Triton interpreter).

For each world size w in the requested list, ranks < w shard a tiny bf16 model with FSDP2
(``Shard(0)``, uneven shards) over a w-rank mesh and, with AdamWSR:

* ``straight``: ``STEPS`` steps;
* ``resumed``: ``RESUME_AT`` steps, ``get_state_dict`` + ``dcp.save``, then a fresh model and
  optimizer (``get_state_dict`` on them runs DCP's lr=0 initialisation step), ``dcp.load`` +
  ``set_state_dict``, and the remaining steps;
* round trips, compared bitwise (full tensors): the state after ``dcp.load`` + ``set_state_dict``
  (sharded state dicts) against the saved optimizer's, and ``get_optimizer_state_dict`` ->
  ``set_optimizer_state_dict`` with ``full_state_dict=True`` into another fresh optimizer;
* whether the initialisation step left the fresh parameters bitwise unchanged.

Rank 0 writes ``<out_dir>/ws<w>.json``; the parent compares the digests with one unsharded run.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

STEPS = 2
RESUME_AT = 1
SEED = 7
LR, WEIGHT_DECAY = 1e-2, 0.1


def build_model() -> nn.Module:
    torch.manual_seed(0)
    # Shard(0): the (5, 8) weight and (5,) bias split 3, 2 over 2 ranks and 2, 2, 1 over 3 (uneven)
    return nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 3)).to(torch.bfloat16)


def full_grad(index: int, shape, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + index)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def make(mesh):
    from adamw_sr import AdamWSR
    from torch.distributed.fsdp import fully_shard

    model = build_model()
    fully_shard(model, mesh=mesh)
    return model, AdamWSR(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, seed=SEED)


def train(model, opt, mesh, steps) -> None:
    from torch.distributed.tensor import distribute_tensor

    for step in steps:
        for i, p in enumerate(model.parameters()):
            p.grad = distribute_tensor(full_grad(i, p.shape, step), mesh, p.placements)
        opt.step()
    opt.zero_grad(set_to_none=True)


def full_state(model, opt) -> list[torch.Tensor]:
    """Params, moments and step counts as full tensors (a collective over the mesh)."""
    out = [p.detach().full_tensor() for p in model.parameters()]
    for p in model.parameters():
        state = opt.state[p]
        out += [state["exp_avg"].full_tensor(), state["exp_avg_sq"].full_tensor(), state["step"].clone()]
    return out


def main() -> None:
    out_dir, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    import torch.distributed.checkpoint as dcp
    from det_core.testing import digest
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for w in sizes:
        mesh = DeviceMesh("cpu", list(range(w)))  # every rank builds every mesh (group creation)
        if rank < w:
            group = mesh.get_group()
            model, opt = make(mesh)
            train(model, opt, mesh, range(STEPS))
            straight = digest(full_state(model, opt))

            model, opt = make(mesh)
            train(model, opt, mesh, range(RESUME_AT))
            saved = full_state(model, opt)
            model_sd, optim_sd = get_state_dict(model, opt)
            path = os.path.join(out_dir, f"ckpt-ws{w}")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)

            model2, opt2 = make(mesh)
            fresh = [p.detach().full_tensor() for p in model2.parameters()]
            model_sd2, optim_sd2 = get_state_dict(model2, opt2)  # DCP's lr=0 step creates the state
            init_ran = all(float(opt2.state[p]["step"]) == 1.0 for p in model2.parameters())
            init_unchanged = digest(fresh) == digest([p.detach().full_tensor() for p in model2.parameters()])
            dcp.load({"model": model_sd2, "optim": optim_sd2}, checkpoint_id=path, process_group=group)
            set_state_dict(model2, opt2, model_state_dict=model_sd2, optim_state_dict=optim_sd2)
            loaded_equal = digest(full_state(model2, opt2)) == digest(saved)
            groups_equal = opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]

            model3, opt3 = make(mesh)
            model3.load_state_dict(model.state_dict())
            options = StateDictOptions(full_state_dict=True)
            osd = get_optimizer_state_dict(model, opt, options=options)
            set_optimizer_state_dict(model3, opt3, osd, options=options)
            full_round_trip = digest(full_state(model3, opt3)) == digest(saved)

            train(model2, opt2, mesh, range(RESUME_AT, STEPS))
            resumed = digest(full_state(model2, opt2))
            if rank == 0:
                result = dict(
                    straight=straight, resumed=resumed, init_ran=init_ran, init_unchanged=init_unchanged,
                    loaded_equal=loaded_equal, groups_equal=groups_equal, full_round_trip=full_round_trip,
                )  # fmt: skip
                with open(os.path.join(out_dir, f"ws{w}.json"), "w") as f:
                    json.dump(result, f)
        dist.barrier()
    dist.destroy_process_group()
    # Every result is written and every rank passed the barrier: leave without the interpreter's
    # finalization, where gloo's worker threads can still hold tensors and abort the process
    # ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291), which
    # the clean-clone CI saw twice on 3 ranks with no Python error in any rank
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
