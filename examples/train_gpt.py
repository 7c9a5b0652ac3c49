"""The main job: deterministic bf16 training of a small GPT on the King James Bible.

    python examples/train_gpt.py                  # CPU (Triton interpreter) or GPU preset, auto-detected
    python examples/train_gpt.py --verify         # 3 runs (repeat, finer micro-batches): same digest?
    python examples/train_gpt.py --dp 3           # 3 data-parallel ranks (spawned; gloo on CPU, NCCL on GPU)
    torchrun --nproc-per-node 2 examples/train_gpt.py
    python examples/train_gpt.py --rounding nearest   # bf16 weights updated with round-to-nearest
    python examples/train_gpt.py --reference      # NOT deterministic: the same model from plain torch parts

Every reduction of the training step runs in a fixed, global order: det_train (linear, RMSNorm,
embedding, cross-entropy), det_attn (attention) and adamw_sr (AdamW with stochastic rounding on
bf16 weights, no fp32 master). Parameter gradients are summed over tokens by
``det_train.CanonicalGradAccumulator`` in the canonical tree order, across micro-batches and
data-parallel ranks alike, so the final weights (their sha256 is printed) are the same bits for
any (data-parallel degree, micro-batch size, accumulation steps) with the same global batch.
"""

from __future__ import annotations

import os

import torch

# No GPU: the kernels run through the Triton interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ----------------------------------------------------------------------------------------------------
# Config. Two presets: "cpu" (Triton interpreter, a few minutes on 2 cores) and "gpu" (~100 M params).
# fmt: off
PRESETS = {
    "cpu": dict(  # every kernel runs through the Triton interpreter: keep it small
        d_model=64, n_layer=2, n_head=1, d_ff=128, seq_len=32,  # det_attn head dims: 64 or 128
        batch_seqs=8, micro_batch_seqs=8, steps=10, lr=5e-3, warmup_steps=2,
        leaf_tokens=32, eval_seqs=8, sample_tokens=32,
    ),
    "gpu": dict(
        d_model=768, n_layer=12, n_head=12, d_ff=2560, seq_len=1024,
        batch_seqs=32, micro_batch_seqs=16, steps=600, lr=1e-3, warmup_steps=50,
        leaf_tokens=8192, eval_seqs=64, sample_tokens=400,
    ),
    # the end-to-end tests and the executable tutorials: seconds per step through the interpreter
    "tiny": dict(
        d_model=64, n_layer=1, n_head=1, d_ff=64, seq_len=16,
        batch_seqs=8, micro_batch_seqs=8, steps=2, lr=3e-3, warmup_steps=1,
        leaf_tokens=16, eval_seqs=8, sample_tokens=16,
    ),
}
# fmt: on
COMMON = dict(
    min_lr_ratio=0.1,  # cosine decay to lr * min_lr_ratio
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    rounding="stochastic",  # or "nearest": how AdamWSR rounds the fp32 update into the bf16 weights
    seed=1234,  # weight init, data order and the optimizer's stochastic rounding
    kernels="det",  # "torch" = the non-deterministic reference model (--reference)
    optimizer="adamw_sr",  # "torch_adamw" = torch's fused AdamW (--reference)
)
# ----------------------------------------------------------------------------------------------------

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

_HERE = Path(__file__).resolve().parent
try:  # imported as examples.train_gpt (tests, benchmarks), or run as a script (examples/ on sys.path)
    from examples.gpt import GPT, GPTConfig
except ModuleNotFoundError:
    from gpt import GPT, GPTConfig

DATA_PATH = _HERE / "data" / "kjv.txt.gz"
DATA_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"  # of the uncompressed text
VAL_BYTES = 100_000  # the last 100 kB (end of Revelation) are held out


@dataclasses.dataclass
class TrainConfig:
    """Everything that determines the final weights, plus how the work is split (which must not)."""

    d_model: int
    n_layer: int
    n_head: int
    d_ff: int
    seq_len: int
    batch_seqs: int  # global batch, in sequences of seq_len tokens
    micro_batch_seqs: int  # sequences per micro-batch on one rank (decomposition, not semantics)
    steps: int
    lr: float
    warmup_steps: int
    leaf_tokens: int  # canonical-order leaf size of parameter-gradient sums (DP shards: multiples)
    eval_seqs: int
    sample_tokens: int
    min_lr_ratio: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    rounding: str
    seed: int
    kernels: str
    optimizer: str

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=256,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_ff=self.d_ff,
        )


SEED_LIMIT = 2**32  # batch_starts seeds torch's generator with seed * 1_000_003 + step (int64)


def check_config(cfg: TrainConfig) -> None:
    """Raise ``ValueError`` for counts below 1 (``steps``, ``batch_seqs``, ``micro_batch_seqs`` in
    sequences, ``seq_len`` and ``leaf_tokens`` in tokens) or a seed outside ``[0, 2**32)``, before any
    work. **Determinism:** a check only (reads ``cfg``, computes nothing)."""
    for name in ("steps", "batch_seqs", "micro_batch_seqs", "seq_len", "leaf_tokens"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {cfg.seed!r}")


def make_config(preset: str | None = None, **overrides) -> TrainConfig:
    """The preset (default: "gpu" with CUDA, else "cpu") with ``overrides`` applied (checked:
    ``check_config``)."""
    preset = preset or ("gpu" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(**{**COMMON, **PRESETS[preset], **overrides})
    check_config(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------------
# Data: bytes of the corpus; batch `step` is drawn by a generator seeded by (seed, step) alone.


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) uint8 tensors of the corpus bytes; raises if the file is not the committed one."""
    raw = gzip.decompress(DATA_PATH.read_bytes())
    if hashlib.sha256(raw).hexdigest() != DATA_SHA256:
        raise RuntimeError(
            f"{DATA_PATH} is not the committed corpus (sha256 mismatch); see examples/data/README.md"
        )
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return data[:-VAL_BYTES], data[-VAL_BYTES:]


def batch_starts(n_bytes: int, seq_len: int, n_seqs: int, seed: int, step: int) -> torch.Tensor:
    """Start offsets of the global batch of ``step``: a pure function of (seed, step)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_bytes - seq_len - 1, (n_seqs,), generator=gen)


def get_batch(
    data: torch.Tensor, starts: torch.Tensor, seq_len: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets (len(starts), seq_len) int64 for the sequences at ``starts``."""
    idx = starts[:, None] + torch.arange(seq_len + 1)
    tokens = data[idx].long()
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def split_range(n: int, parts: int) -> list[tuple[int, int]]:
    """``range(n)`` in ``parts`` contiguous pieces, the first ones one larger (8 in 3 -> 3, 3, 2)."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for p in range(parts):
        bounds.append(bounds[-1] + base + (p < extra))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up then cosine decay to ``lr * min_lr_ratio`` (plain Python floats: deterministic)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------------
# Model, optimizer and one training step.


def build_model(cfg: TrainConfig, device) -> GPT:
    """The bf16 model, initialised from ``cfg.seed`` (the same bits on every device)."""
    if cfg.rounding not in ("stochastic", "nearest"):
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {cfg.rounding!r}")
    if cfg.leaf_tokens <= 0:
        raise ValueError(f"leaf_tokens must be positive, got {cfg.leaf_tokens}")
    model = GPT(cfg.model_config(), kernels=cfg.kernels)
    model.to(torch.bfloat16)  # pure bf16: no fp32 master copy anywhere
    model.init_weights(cfg.seed)
    return model.to(device)


def build_optimizer(cfg: TrainConfig, model: GPT, *, capturable: bool = False) -> torch.optim.Optimizer:
    """AdamWSR over the bf16 weights (or, for the reference, torch's fused AdamW).

    ``capturable`` keeps the step counts on the device so ``opt.step()`` can be captured in a CUDA
    graph (both optimizers' flag of that name); the default is the eager setup of the main job.
    """
    hyper = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw_sr":
        import adamw_sr

        sr = cfg.rounding == "stochastic"
        return adamw_sr.AdamWSR(
            model.parameters(), **hyper, seed=cfg.seed, stochastic_rounding=sr, capturable=capturable
        )
    if cfg.optimizer != "torch_adamw":
        raise ValueError(f"optimizer must be 'adamw_sr' or 'torch_adamw', got {cfg.optimizer!r}")
    # reference: torch's AdamW, round-to-nearest into bf16; not deterministic across splits
    if cfg.rounding != "nearest":
        raise ValueError("the torch reference optimizer rounds to nearest: pass --rounding nearest")
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), **hyper, fused=fused, capturable=capturable)


def shard_with_fsdp2(model: GPT, world: int, device) -> None:
    """FSDP2 (``fully_shard``) over ``world`` ranks; the gradients come from the accumulator.

    FSDP2 all-gathers each parameter into an unsharded ``nn.Parameter`` for forward and backward;
    the det_train ops deposit their leaf sums for *that* tensor and return no autograd gradient, so
    FSDP's own reduce-scatter (whose summation order is not canonical) has nothing to do. The
    accumulator tracks the sharded parameters (``acc.track_fsdp(model)``): ``acc.reduce`` sends each
    tree node's slice to the rank whose FSDP2 shard holds it (``torch.chunk`` along dim 0, uneven
    shards included) and writes that rank's canonical shard as the sharded DTensor's gradient; no
    rank holds an unsharded gradient. AdamWSR then updates the shards, drawing its stochastic-rounding
    bits by global element index (from the DTensor placement), so the result is the unsharded one.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh(torch.device(device).type, (world,)))
    # our outputs are never modified in place, which is what this FSDP2 warning is about
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full value (a collective: every rank must call), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train_step(model, opt, acc, cfg: TrainConfig, data, step: int, rank: int, world: int, device) -> float:
    """One optimizer step on the global batch of ``step``; returns this rank's share of the mean loss.

    This rank takes its contiguous slice of the batch's sequences and cuts it into micro-batches
    of ``cfg.micro_batch_seqs``; each micro-batch tells the accumulator the global index of its
    first token, so the gradient sums come out in the canonical order whatever the split.
    """
    global_tokens = cfg.batch_seqs * cfg.seq_len
    starts = batch_starts(len(data), cfg.seq_len, cfg.batch_seqs, cfg.seed, step)
    lo, hi = split_range(cfg.batch_seqs, world)[rank]
    for group in opt.param_groups:
        group["lr"] = lr_at(cfg, step)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)  # read once per step (one sync)
    for mb_lo in range(lo, hi, cfg.micro_batch_seqs):
        mb_hi = min(mb_lo + cfg.micro_batch_seqs, hi)
        x, y = get_batch(data, starts[mb_lo:mb_hi], cfg.seq_len, device)
        if acc is None:  # reference mode: torch's own accumulation in .grad
            _, loss = model(x, y, num_global_tokens=global_tokens)
            loss.backward()
        else:
            with acc.micro_batch(token_offset=mb_lo * cfg.seq_len):
                _, loss = model(x, y, num_global_tokens=global_tokens)
                loss.backward()
        loss_sum += loss.detach().float()
    if acc is not None:
        acc.reduce(total_tokens=global_tokens, group=dist.group.WORLD if world > 1 else None)
    elif world > 1:  # reference DP: an all-reduce whose order NCCL/gloo chooses
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss_sum)


@torch.no_grad()
def evaluate(model, cfg: TrainConfig, val: torch.Tensor, device) -> float:
    """Mean next-byte loss (nats) on ``cfg.eval_seqs`` fixed held-out sequences."""
    starts = batch_starts(len(val), cfg.seq_len, cfg.eval_seqs, cfg.seed + 1, 0)
    total = 0.0
    for lo in range(0, cfg.eval_seqs, cfg.micro_batch_seqs):
        x, y = get_batch(val, starts[lo : lo + cfg.micro_batch_seqs], cfg.seq_len, device)
        total += float(model(x, y, num_global_tokens=cfg.eval_seqs * cfg.seq_len)[1])
    return total


def full_state(model, opt) -> tuple[dict, dict]:
    """(weights, optimizer state) as full CPU tensors keyed by parameter name (collective under FSDP)."""
    weights = {k: full_tensor(v).detach().cpu() for k, v in model.state_dict().items()}
    optim = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        optim[name] = {
            k: full_tensor(v).detach().cpu() if torch.is_tensor(v) else v for k, v in sorted(state.items())
        }
    return weights, optim


# how a run is split (micro-batches) changes no bit of it: a checkpoint resumes under another split
_DECOMPOSITION = ("micro_batch_seqs",)


def check_checkpoint(ckpt, cfg: TrainConfig, path) -> int:
    """The step to resume at from ``ckpt`` (what ``train(save_at=...)`` wrote), checked against
    ``cfg``: every field but the decomposition (``micro_batch_seqs``) equal, the step in
    ``[0, cfg.steps]``. Raises ``ValueError`` naming what differs or is missing. **Determinism:** a
    check only; a resume under another ``micro_batch_seqs`` ends on the straight run's bits (the
    accumulator's split invariance, ``test_resume_refuses_another_config_and_takes_another_split``)."""
    keys = ("model", "optim", "step", "config")
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in keys):
        found = sorted(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{path}: not a train_gpt checkpoint (needs {', '.join(keys)}; found {found})")
    saved, wanted = ckpt["config"], dataclasses.asdict(cfg)
    differ = sorted(
        k for k in saved.keys() | wanted.keys() if k not in _DECOMPOSITION and saved.get(k) != wanted.get(k)
    )
    if differ:
        shown = "; ".join(f"{k}: {saved.get(k)!r} there, {wanted.get(k)!r} here" for k in differ)
        raise ValueError(
            f"{path}: checkpoint was written with another config ({shown}); resume with the same one"
        )
    step = ckpt["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= cfg.steps:
        raise ValueError(f"{path}: checkpoint step {step!r} is outside [0, {cfg.steps}] (cfg.steps)")
    return step


def train(
    cfg: TrainConfig,
    *,
    rank: int = 0,
    world: int = 1,
    device=None,
    progress: bool = False,
    resume_from: str | os.PathLike | None = None,
    save_at: int | None = None,
    save_path: str | os.PathLike | None = None,
    evaluate_end: bool = False,
    fsdp: bool = False,
) -> dict:
    """Train ``cfg.steps`` steps (in a torch.distributed group of ``world`` ranks if > 1).

    Returns ``{"digest", "state_dict" (CPU), "losses" (per step, this rank's share), "val_loss"}``.
    ``save_at``/``save_path`` write a checkpoint (model, optimizer, step) after that many steps;
    ``resume_from`` continues from one. The data order depends on the step alone, so a resumed run
    sees the batches the straight run saw. ``fsdp`` shards parameters and optimizer state over the
    ranks with FSDP2 (``fully_shard``).
    """
    check_config(cfg)
    if (save_at is None) != (save_path is None):
        raise ValueError("save_at and save_path go together: the step after which to save, and the file")
    if save_at is not None:
        if isinstance(save_at, bool) or not isinstance(save_at, int) or not 1 <= save_at <= cfg.steps:
            raise ValueError(f"save_at must be a step in [1, {cfg.steps}] (cfg.steps), got {save_at!r}")
        if not Path(save_path).parent.is_dir():
            raise ValueError(f"save_path {save_path}: its folder does not exist (create it first)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    train_data, val_data = load_corpus()
    model = build_model(cfg, device)
    named_params = list(model.named_parameters())
    if fsdp:
        if cfg.kernels != "det" or world < 2 or resume_from or save_at:
            raise ValueError("fsdp needs the det kernels, world >= 2, and no checkpointing (not implemented)")
        counts = {-(-(hi - lo) // cfg.micro_batch_seqs) for lo, hi in split_range(cfg.batch_seqs, world)}
        if len(counts) != 1:
            raise ValueError(
                f"fsdp: ranks would run {sorted(counts)} micro-batches; FSDP's collectives need the same "
                "count on every rank: choose micro_batch_seqs so that every rank's slice has as many"
            )
        shard_with_fsdp2(model, world, device)
        named_params = list(model.named_parameters())  # the sharded (DTensor) parameters
    opt = build_optimizer(cfg, model)
    acc = None
    if cfg.kernels == "det":
        import det_train

        unaligned = [lo for lo, _ in split_range(cfg.batch_seqs, world) if lo * cfg.seq_len % cfg.leaf_tokens]
        if unaligned:  # a leaf is summed on one rank: each rank's slice starts on a leaf boundary
            raise ValueError(
                f"leaf_tokens {cfg.leaf_tokens}: with {world} ranks the slices of {cfg.batch_seqs} sequences "
                f"of {cfg.seq_len} tokens start at sequences {unaligned}, inside leaves; choose a "
                "leaf_tokens that divides every rank's first token (or another batch / rank count)"
            )
        acc = det_train.CanonicalGradAccumulator(named_params, leaf_tokens=cfg.leaf_tokens)
        if fsdp:
            acc.track_fsdp(model)  # deposits for FSDP2's unsharded parameters count for the shards
    start = 0
    if resume_from is not None:
        # weights_only: tensors and plain containers only; a checkpoint carrying code (a pickled
        # callable or class) is refused instead of run
        ckpt = torch.load(resume_from, map_location=device, weights_only=True)
        start = check_checkpoint(ckpt, cfg, resume_from)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
    losses = []
    bar = range(start, cfg.steps)
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(bar, desc=f"train ({cfg.kernels}, {cfg.rounding})", unit="step")
    tokens_per_step = cfg.batch_seqs * cfg.seq_len
    t0 = time.perf_counter()
    for step in bar:
        loss = train_step(model, opt, acc, cfg, train_data, step, rank, world, device)
        if world > 1:  # display only: the weights never see this sum
            t = torch.tensor([loss], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            loss = float(t)
        losses.append(loss)
        if progress and rank == 0:
            if device.type == "cuda":
                torch.cuda.synchronize()
            rate = (step + 1 - start) * tokens_per_step / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}")
        if save_at is not None and step + 1 == save_at and rank == 0:
            # tensors and plain types only (the config as a dict, the step as an int): what
            # torch.load(weights_only=True) accepts
            torch.save(
                {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "step": step + 1,
                    "config": dataclasses.asdict(cfg),
                },
                save_path,
            )
    from det_core.testing import digest

    weights, optim_state = full_state(model, opt)
    result = {"digest": digest(weights), "state_dict": weights, "optim_state": optim_state}
    result.update(losses=losses, model=model)
    if evaluate_end:
        result["val_loss"] = evaluate(model, cfg, val_data, device)
    return result


# ----------------------------------------------------------------------------------------------------
# Data parallelism: torchrun, or ranks spawned here (gloo on CPU, NCCL with one GPU per rank).


def _dp_worker(rank: int, world: int, jobs: list, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)  # ranks share the cores
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = []
        for cfg, kwargs in jobs:
            result = train(cfg, rank=rank, world=world, device=f"cuda:{rank}" if cuda else "cpu", **kwargs)
            result.pop("model")
            results.append(result)
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


def train_spawned_many(jobs: list[tuple[TrainConfig, dict]], world: int) -> list[dict]:
    """Run ``train(cfg, **kwargs)`` for each job, one after the other, on ``world`` spawned ranks
    (one process group for all: the start-up is paid once). Returns rank 0's results (no model)."""
    import torch.multiprocessing as mp

    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        raise RuntimeError(f"--dp {world} needs {world} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "pg"), os.path.join(tmp, "result.pt")
        mp.spawn(_dp_worker, args=(world, jobs, init_file, out_file), nprocs=world, join=True)
        return torch.load(out_file, weights_only=True)  # tensors, strings, numbers, lists, dicts


def train_spawned(cfg: TrainConfig, world: int, **kwargs) -> dict:
    """``train(cfg, **kwargs)`` on ``world`` spawned ranks; rank 0's result (without the model)."""
    return train_spawned_many([(cfg, kwargs)], world)[0]


# ----------------------------------------------------------------------------------------------------
# Command line: progress bar, loss plot, a sample of generated text, the digest; --verify.


def save_loss_plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """Loss curves (one per label) as a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def sample_text(model: GPT, cfg: TrainConfig, prompt: str = "And God said") -> str:
    device = next(model.parameters()).device
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    out = model.generate(idx, cfg.sample_tokens, seed=cfg.seed)
    return bytes(out[0].tolist()).decode("ascii", errors="replace")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: gpu with CUDA, else cpu")
    p.add_argument("--steps", type=_at_least_one)
    p.add_argument(
        "--micro-batch", type=_at_least_one, dest="micro_batch_seqs", help="sequences per micro-batch"
    )
    p.add_argument("--batch", type=_at_least_one, dest="batch_seqs", help="global batch in sequences")
    p.add_argument("--rounding", choices=["stochastic", "nearest"])
    p.add_argument("--seed", type=_seed, help="an integer in [0, 2**32)")
    p.add_argument(
        "--dp", type=_at_least_one, default=1, help="data-parallel ranks to spawn (not with torchrun)"
    )
    p.add_argument("--verify", action="store_true", help="train 3x: repeat and a 2x finer micro-batch split")
    p.add_argument(
        "--reference", action="store_true", help="NOT deterministic: plain torch modules, for comparison"
    )
    p.add_argument("--out", help="folder for loss.png (default: out/; not with torchrun)")
    return p.parse_args(argv)


def _int_in(low: int, high: int | None, wanted: str):
    """An argparse type: an integer in ``[low, high)`` (no upper bound for None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value >= high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    return parse


_at_least_one = _int_in(1, None, "an integer >= 1")
_seed = _int_in(0, SEED_LIMIT, "an integer in [0, 2**32)")


def _check_sources() -> None:
    """Exit with the set-up to use when the kernel packages cannot be imported."""
    import importlib.util

    packages = ("det_core", "det_train", "det_attn", "adamw_sr")
    missing = [m for m in packages if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"cannot import {', '.join(missing)}: run the main job with `nox -s demo`, or put the source "
            "folders on PYTHONPATH (README.md, 'import the packages from the checkout')"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    _check_sources()
    overrides = {k: getattr(args, k) for k in ("steps", "micro_batch_seqs", "batch_seqs", "rounding", "seed")}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.reference:
        overrides.update(
            kernels="torch", optimizer="torch_adamw", rounding=overrides.get("rounding", "nearest")
        )
    cfg = make_config(args.preset, **overrides)
    where = "GPU" if torch.cuda.is_available() else "CPU (Triton interpreter)"

    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        flags = (("--dp", args.dp != 1), ("--verify", args.verify), ("--out", args.out is not None))
        given = [flag for flag, value in flags if value]
        if given:  # they would be ignored: torchrun sets the ranks, and only the digest is printed
            raise SystemExit(
                f"{', '.join(given)}: not with torchrun, which sets the ranks and prints the final digest "
                "only; run `python examples/train_gpt.py --dp N` for them"
            )
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        result = train(cfg, rank=rank, world=world, progress=True)
        dist.destroy_process_group()
        if rank == 0:
            print(f"final weights sha256: {result['digest']}")
        return 0

    out = Path(args.out or "out")
    try:  # before training: an unwritable folder would otherwise fail after it
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {out}: cannot create the folder ({e}); pass a writable one") from e
    if not os.access(out, os.W_OK):
        raise SystemExit(f"--out {out}: the folder is not writable; pass a writable one")
    n_params = sum(p.numel() for p in GPT(cfg.model_config(), kernels="torch").parameters())
    print(
        f"{where}: {n_params / 1e6:.2f} M params, {cfg.n_layer} layers, d_model {cfg.d_model}, "
        f"seq {cfg.seq_len}, global batch {cfg.batch_seqs} x {cfg.seq_len} tokens, "
        f"micro-batch {cfg.micro_batch_seqs}, dp {args.dp}, {cfg.steps} steps, "
        f"kernels={cfg.kernels}, rounding={cfg.rounding}"
    )
    if args.dp > 1:
        result = train_spawned(cfg, args.dp, progress=True, evaluate_end=True)
    else:
        result = train(cfg, progress=True, evaluate_end=True)
        print("--- sample ---")
        print(sample_text(result["model"], cfg))
        print("--------------")
    save_loss_plot(
        {f"{cfg.kernels}, {cfg.rounding}": result["losses"]}, out / "loss.png", f"{where}, bf16 weights"
    )
    print(f"final train loss {result['losses'][-1]:.4f}, held-out loss {result['val_loss']:.4f} (nats/byte)")
    print(f"loss plot: {out / 'loss.png'}")
    print(f"final weights sha256: {result['digest']}")
    if not args.verify:
        return 0

    # --verify: the same training again, then with half the micro-batch size (2x the accumulation
    # steps), or twice it from micro-batches of 1 sequence
    other = cfg.micro_batch_seqs // 2 if cfg.micro_batch_seqs > 1 else min(2, cfg.batch_seqs)
    runs = {f"repeat (micro-batch {cfg.micro_batch_seqs})": cfg}
    if other != cfg.micro_batch_seqs:
        name = f"micro-batch {other} (x{-(-cfg.batch_seqs // other)} accumulation)"
        runs[name] = dataclasses.replace(cfg, micro_batch_seqs=other)
    else:
        print("(a global batch of 1 sequence has no other micro-batch split: the repeat only)")
    digests = {"first run": result["digest"]}
    for name, run_cfg in runs.items():  # each run shows its own progress bar
        other = (
            train_spawned(run_cfg, args.dp, progress=True) if args.dp > 1 else train(run_cfg, progress=True)
        )
        digests[name] = other["digest"]
    ok = len(set(digests.values())) == 1
    print(f"{'run':<40} digest")
    for name, value in digests.items():
        mark = "" if name == "first run" else ("  MATCH" if value == result["digest"] else "  DIFFERENT")
        print(f"{name:<40} {value}{mark}")
    if cfg.kernels != "det":
        print("(--reference uses non-deterministic torch parts: differences are expected)")
    print("verify:", "all digests match" if ok else "DIGESTS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
