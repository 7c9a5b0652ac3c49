"""One rank of a gloo data-parallel test (run by test_distributed.py as a separate process).

Usage: python dp_worker.py CASE RANK WORLD INIT_FILE OUT_FILE. Each case computes this rank's
share of a fixed global batch, reduces gradients across the group and torch.save()s them.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from det_core.testing import contiguous_splits  # noqa: E402
from det_train.grad_accum import CanonicalGradAccumulator  # noqa: E402

LEAF = 4
TOKENS = 48  # 12 leaves


def _toy_batch():
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(TOKENS, 5, generator=g),
        torch.randn(TOKENS, 5, generator=g),
        torch.randn(5, generator=g),
    )


def case_accum_contiguous(rank, world):
    """Each rank holds a contiguous run of leaves, split again into two micro-batches."""
    from _canonical_toy import toy_scale

    x, dy, w0 = _toy_batch()
    w = w0.clone().requires_grad_()
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    start, end = contiguous_splits(TOKENS, world, LEAF)[rank]
    n_leaves = (end - start) // LEAF
    for a, b in contiguous_splits(end - start, min(2, n_leaves), LEAF):
        with acc.micro_batch(token_offset=start + a):
            toy_scale(x[start + a : start + b], w).backward(dy[start + a : start + b])
    acc.reduce(total_tokens=TOKENS)
    return {"w": w.grad}


def case_accum_interleaved(rank, world):
    """Round-robin leaves over ranks (not contiguous): leaf j goes to rank j % world."""
    from _canonical_toy import toy_scale

    x, dy, w0 = _toy_batch()
    w = w0.clone().requires_grad_()
    acc = CanonicalGradAccumulator([("w", w)], leaf_tokens=LEAF)
    for leaf in range(rank, TOKENS // LEAF, world):
        s = leaf * LEAF
        with acc.micro_batch(token_offset=s):
            toy_scale(x[s : s + LEAF], w).backward(dy[s : s + LEAF])
    acc.reduce(total_tokens=TOKENS)
    return {"w": w.grad}


def main():
    case, rank, world, init_file, out_file = sys.argv[1:6]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = globals()[f"case_{case}"](rank, world)
        torch.save({k: v.detach().clone() for k, v in result.items()}, out_file)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
