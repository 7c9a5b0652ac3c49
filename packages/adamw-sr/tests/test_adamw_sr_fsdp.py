"""FSDP2 (fully_shard, DTensor) over 1, 2, 3 and 4 ranks equals the unsharded run bit for bit.

Ranks run as separate processes (fsdp_worker.py) with gloo on CPU (the kernel through the Triton
interpreter), or NCCL on 2 GPUs in the ``gpu`` test. The shard offsets come from the DTensor
placements: Shard(0) and Shard(1), uneven shards, and empty shards on the last rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from det_core.testing import digest, run_ranks

WORKER = Path(__file__).with_name("fsdp_worker.py")
sys.path.insert(0, str(WORKER.parent))
import fsdp_worker  # noqa: E402


def _launch(nprocs: int, sizes: list[int], out_dir: Path, env_extra: dict) -> None:
    run_ranks(WORKER, nprocs, [out_dir, ",".join(map(str, sizes))], env=env_extra)


def _unsharded_digest(device) -> str:
    from adamw_sr import AdamWSR

    model = fsdp_worker.build_model(device)
    opt = AdamWSR(model.parameters(), lr=1e-2, weight_decay=0.1, seed=fsdp_worker.SEED)
    for step in range(fsdp_worker.STEPS):
        for i, p in enumerate(model.parameters()):
            p.grad = fsdp_worker.full_grad(i, p.shape, step, device)
        opt.step()
    return digest(fsdp_worker.state_tensors(model, opt, lambda t: t.cpu()))


def test_fsdp2_gloo_1_2_3_4_ranks_equal_unsharded(tmp_path):
    sizes = [1, 2, 3, 4]
    _launch(4, sizes, tmp_path, {"DET_FSDP_BACKEND": "gloo", "TRITON_INTERPRET": "1"})
    expected = _unsharded_digest(torch.device("cpu"))
    got = {w: (tmp_path / f"ws{w}.txt").read_text() for w in sizes}
    assert all(d == expected for d in got.values()), got


@pytest.mark.gpu
def test_fsdp2_nccl_2_gpus_equal_unsharded(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _launch(2, [1, 2], tmp_path, {"DET_FSDP_BACKEND": "nccl", "TRITON_INTERPRET": "0"})
    expected = _unsharded_digest(torch.device("cuda", 0))
    for w in (1, 2):
        assert (tmp_path / f"ws{w}.txt").read_text() == expected, w
