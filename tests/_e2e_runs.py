"""Training runs shared by the end-to-end tests, computed once per pytest run: through the Triton
interpreter a step of even the "tiny" model costs seconds, so each run is trained once and its
result read by every test that checks a property of it.

Under pytest-xdist every worker is its own process, so a per-process cache would train the
reference run (and start the gloo ranks) once per worker. The results are therefore also shared
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
from det_core.testing import assert_bitwise_equal, run_in_fresh_process, run_processes

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


# Jobs on gloo ranks, per world size: (kind, micro-batch size). "dp": replicated weights; "fsdp":
# FSDP2-sharded weights and state. 3 ranks hold 3, 3, 2 sequences (2 + 1, 2 + 1 and 2 in
# micro-batches of 2); FSDP needs the same micro-batch count on every rank (3 -> 1 each).
RANK_JOBS = {
    4: [("dp", 2)],
    3: [("dp", 2), ("fsdp", 3)],
}


def _rank_worker(rank: int, folder: str) -> None:
    """One of ``max(RANK_JOBS)`` forked ranks: for each world size, largest first, the ranks below
    it join a new gloo group of that size, run its jobs, and rank 0 writes their results."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the cores
    for world, jobs in sorted(RANK_JOBS.items(), reverse=True):
        if rank >= world:
            return
        init = f"file://{os.path.join(folder, f'pg-{world}')}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        try:
            results = []
            for kind, micro in jobs:
                result = tg.train(tiny(micro_batch_seqs=micro), rank=rank, world=world, fsdp=kind == "fsdp")
                result.pop("model")
                results.append(result)
            if rank == 0:
                torch.save(results, os.path.join(folder, f"result-{world}.pt"))
        finally:
            dist.destroy_process_group()


def _fresh_process_main(checkpoint: str, out: str) -> None:
    """The body of ``fresh_runs``' new interpreter, which has run no torch op yet: fork the ranks
    (a forked OpenMP thread pool would deadlock), then resume and train straight here."""
    # the kernel packages imported once, before the fork, for all ranks
    import adamw_sr  # noqa: F401
    import det_attn  # noqa: F401
    import det_train  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        run_processes(_rank_worker, [(r, tmp) for r in range(max(RANK_JOBS))], what="gloo ranks")
        ranks = {w: torch.load(os.path.join(tmp, f"result-{w}.pt"), weights_only=True) for w in RANK_JOBS}
    # resumed first: nothing of steps 0 and 1 has run in this process
    cfg = tiny(micro_batch_seqs=GLOBAL_BATCH)
    runs = {"resumed": tg.train(cfg, resume_from=checkpoint)}
    runs["straight"] = tg.train(cfg)
    for result in runs.values():
        result.pop("model")
    torch.save({"ranks": ranks, **runs}, out)


@functools.cache
def fresh_runs() -> dict:
    """Everything the tests need from new processes, in one new interpreter (cold Triton cache),
    once per pytest run: ``"ranks"``: ``{world: [result per RANK_JOBS[world] job]}`` on forked gloo
    ranks (all world sizes in one set of ``max(RANK_JOBS)`` processes; ranks 0-2 then form the
    3-rank group); then, in the interpreter itself, ``"resumed"``: the baseline resumed from its
    step-1 checkpoint, and ``"straight"``: the baseline's config trained again. No ``"model"``."""
    checkpoint = baseline()["checkpoint"]

    def run(folder: Path) -> dict:
        out = folder / "fresh-runs-out.pt"
        code = (
            "from tests import _e2e_runs\n"
            f"_e2e_runs._fresh_process_main({checkpoint!r}, {str(out)!r})\n"
            "print('done')\n"
        )
        run_in_fresh_process(code)
        return torch.load(out, weights_only=True)

    return _once_per_run("fresh-runs", run)


def ranks(world: int) -> dict[tuple[str, int], dict]:
    """Rank 0's results of ``RANK_JOBS[world]`` on ``world`` gloo ranks, keyed by (kind, micro)."""
    return dict(zip(RANK_JOBS[world], fresh_runs()["ranks"][world], strict=True))


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
