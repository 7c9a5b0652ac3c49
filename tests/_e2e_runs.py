"""Training runs shared by the end-to-end tests, computed once per pytest run: through the Triton
interpreter a step of even the "tiny" model costs seconds, so each run is trained once and its
result read by every test that checks a property of it.

Under pytest-xdist every worker is its own process, so a per-process cache would train the
reference run (and spawn each gloo group) once per worker. The results are therefore also shared
through files in a folder of the whole pytest run (``DET_E2E_SHARED_DIR``, made by
tests/conftest.py): the first worker to need one takes its file lock and trains it; a worker that
needs it meanwhile waits on the lock and then reads the file."""

from __future__ import annotations

import atexit
import fcntl
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from det_core.testing import assert_bitwise_equal

from examples import train_gpt as tg

STEPS = 2  # two optimizer steps: the second one reads the optimizer state the first one wrote
CHECKPOINT_STEP = 1
GLOBAL_BATCH = 8  # sequences of SEQ_LEN tokens
# Shorter sequences than the tiny preset's 16 (the interpreter's cost grows with the token count);
# one canonical leaf per sequence, so every split below is at leaf boundaries and still has to
# reproduce the same 8-leaf reduction tree. At 4 tokens every kernel still runs the tile and leaf
# structure it runs at 8 (a micro-batch is one row tile either way, a leaf one fold chunk).
SEQ_LEN = 4

SHARED_DIR_ENV = "DET_E2E_SHARED_DIR"
_PRIVATE_DIR = None  # this process's own folder when no shared one is set


def _run_dir() -> Path:
    global _PRIVATE_DIR
    if os.environ.get(SHARED_DIR_ENV):
        return Path(os.environ[SHARED_DIR_ENV])
    if _PRIVATE_DIR is None:
        _PRIVATE_DIR = Path(tempfile.mkdtemp(prefix="e2e-runs-"))
        atexit.register(shutil.rmtree, _PRIVATE_DIR, ignore_errors=True)
    return _PRIVATE_DIR


def _once_per_run(key: str, compute: Callable[[Path], object]):
    """``compute(folder)`` once per pytest run (all xdist workers), its result read from a file after."""
    folder = _run_dir()
    result_path = folder / f"{key}.pt"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while another worker trains it: wait for its file
        if result_path.exists():
            return torch.load(result_path, weights_only=True)
        result = compute(folder)
        torch.save(result, result_path.with_suffix(".tmp"))
        os.replace(result_path.with_suffix(".tmp"), result_path)
        return result


def tiny(**overrides) -> tg.TrainConfig:
    """The tiny preset with ``SEQ_LEN``-token sequences, ``STEPS`` steps, a global batch of
    ``GLOBAL_BATCH`` sequences."""
    base = {"steps": STEPS, "batch_seqs": GLOBAL_BATCH, "seq_len": SEQ_LEN, "leaf_tokens": SEQ_LEN}
    return tg.make_config("tiny", **{**base, **overrides})


@functools.cache
def baseline() -> dict:
    """(DP 1, micro-batch 8, accumulation 1) in one process; writes a checkpoint after step 1
    (``result["checkpoint"]``; saving does not change the run). No ``"model"``."""

    def run(folder: Path) -> dict:
        path = folder / "baseline-step1.pt"
        result = tg.train(tiny(micro_batch_seqs=GLOBAL_BATCH), save_at=CHECKPOINT_STEP, save_path=path)
        result.pop("model")
        result["checkpoint"] = str(path)
        return result

    return _once_per_run("baseline", run)


# Jobs on spawned gloo ranks, per world size: (kind, micro-batch size). "dp": replicated weights;
# "fsdp": FSDP2-sharded weights and state. 3 ranks hold 3, 3, 2 sequences (2 + 1, 2 + 1 and 2 in
# micro-batches of 2); FSDP needs the same micro-batch count on every rank (3 -> 1 each).
SPAWNED_JOBS = {
    4: [("dp", 2)],
    3: [("dp", 2), ("fsdp", 3)],
}


def _spawned_worker(rank: int, jobs: dict, folder: str) -> None:
    """One of ``max(jobs)`` spawned processes: for each world size, largest first, the ranks below
    it join a new process group of that size (the process start-up is paid once for all sizes), run
    its jobs, and rank 0 writes their results."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the cores
    cuda = torch.cuda.is_available()  # as train_gpt's own ranks: one GPU each, else gloo on CPU
    if cuda:
        torch.cuda.set_device(rank)
    for world, world_jobs in sorted(jobs.items(), reverse=True):
        if rank >= world:
            return
        init = f"file://{os.path.join(folder, f'pg-{world}')}"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
        try:
            results = []
            for cfg, kwargs in world_jobs:
                device = f"cuda:{rank}" if cuda else "cpu"
                result = tg.train(cfg, rank=rank, world=world, device=device, **kwargs)
                result.pop("model")
                results.append(result)
            if rank == 0:
                torch.save(results, os.path.join(folder, f"result-{world}.pt"))
        finally:
            dist.destroy_process_group()


def _train_spawned(jobs: dict) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned_worker, args=(jobs, tmp), nprocs=max(jobs), join=True)
        return {w: torch.load(os.path.join(tmp, f"result-{w}.pt"), weights_only=True) for w in jobs}


@functools.cache
def spawned(world: int) -> dict[tuple[str, int], dict]:
    """Results of ``SPAWNED_JOBS[world]`` on ``world`` gloo ranks, keyed by (kind, micro). All world
    sizes run in one set of spawned processes, once per pytest run."""
    jobs = {
        w: [(tiny(micro_batch_seqs=micro), {"fsdp": kind == "fsdp"}) for kind, micro in w_jobs]
        for w, w_jobs in SPAWNED_JOBS.items()
    }
    results = _once_per_run("spawned", lambda _: _train_spawned(jobs))[world]
    return dict(zip(SPAWNED_JOBS[world], results, strict=True))


def assert_same_training(got: dict, want: dict, what: str) -> None:
    """Weights and optimizer state bit for bit (first mismatch named), then the weight digests."""
    assert sorted(got["state_dict"]) == sorted(want["state_dict"]), what
    for name in sorted(want["state_dict"]):
        assert_bitwise_equal(got["state_dict"][name], want["state_dict"][name], f"{what}: {name}")
    for name in sorted(want["optim_state"]):
        for key, value in want["optim_state"][name].items():
            if torch.is_tensor(value):
                assert_bitwise_equal(got["optim_state"][name][key], value, f"{what}: optimizer {name}.{key}")
            else:
                assert got["optim_state"][name][key] == value, f"{what}: optimizer {name}.{key}"
    assert got["digest"] == want["digest"], what
