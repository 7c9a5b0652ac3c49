"""End to end: transformers models (Llama, Qwen2, GPT-2: RMSNorm and LayerNorm, tied and untied
heads, biases, GPT-2's Conv1D) built from config objects, made deterministic by
``det_train.convert`` with ``attn_implementation="det_attn"``, trained with
``CanonicalGradAccumulator`` and ``AdamWSR``: the weights after two steps are bitwise the same for
one micro-batch, four micro-batches that end inside leaves, data-parallel degree 3 on gloo ranks,
and a run resumed from a checkpoint in a fresh process (its last step in two micro-batches, one
ending inside a leaf). The converted models' loss matches the unconverted ones (SDPA, torch ops) to
bf16 rounding. (Uneven data-parallel shards are a property of the reduction, not of the model:
tests/test_e2e_decomposition.py and packages/det-train/tests/test_dp_reduce.py check them.)

Tiny sizes (head dim 64: det_attn supports 64 and 128) through the Triton interpreter on CPU; a
``gpu`` test repeats the split and resume checks at a small size on CUDA."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import adamw_sr  # noqa: E402
import det_attn  # noqa: E402
import det_train  # noqa: E402
from det_core.testing import contiguous_splits, digest, run_in_fresh_process, run_processes  # noqa: E402

from tests._e2e_runs import _once_per_run  # noqa: E402

det_attn.register_transformers_attention()

MODELS = ("llama", "qwen2", "gpt2")
STEPS = 2  # the second step reads the optimizer state the first one wrote
VOCAB = 64


class Size:
    """One problem size: ``batch`` sequences of ``seq`` tokens, canonical leaves of ``leaf`` tokens;
    ``ffn``: the MLP width (None: twice ``hidden``, GPT-2's own four times)."""

    def __init__(self, hidden, layers, heads, seq, batch, leaf, device, ffn=None):
        self.hidden, self.layers, self.heads, self.ffn = hidden, layers, heads, ffn
        self.seq, self.batch, self.leaf, self.device = seq, batch, leaf, device


# 3 leaves of 2 sequences; an MLP as wide as the model (the interpreter's cost grows with the width)
CPU = Size(hidden=64, layers=1, heads=1, seq=4, batch=6, leaf=8, device="cpu", ffn=64)


def make_model(name: str, size: Size = CPU, attn: str = "det_attn", convert: bool = True):
    """A randomly initialised bf16 model (seed 0) from a config object: no download."""
    torch.manual_seed(0)
    head_dim = size.hidden // size.heads
    common = dict(vocab_size=VOCAB, attn_implementation=attn)
    decoder = dict(
        hidden_size=size.hidden,
        intermediate_size=size.ffn or 2 * size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=max(1, size.heads // 2),  # grouped-query attention where heads allow
        max_position_embeddings=size.seq,
        **common,
    )
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=head_dim, **decoder))
    elif name == "qwen2":  # q/k/v biases, tied embedding and head
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **decoder))
    elif name == "gpt2":  # Conv1D, LayerNorm, learned positions, tied head; dropout off
        cfg = transformers.GPT2Config(
            n_embd=size.hidden,
            n_layer=size.layers,
            n_head=size.heads,
            n_positions=size.seq,
            n_inner=size.ffn,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            **common,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(name)
    model = model.to(device=size.device, dtype=torch.bfloat16)
    return det_train.convert(model) if convert else model


def global_batch(step: int, size: Size = CPU) -> torch.Tensor:
    """Token ids ``(batch, seq)`` of step ``step``: a function of the step alone."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (size.batch, size.seq), generator=g).to(size.device)


def train(name, micro_batches, *, size=CPU, group=None, resume=None, save=None, steps=STEPS) -> str:
    """Train ``name`` for ``steps`` steps; ``micro_batches``: this rank's ``(first sequence,
    sequences)`` of each global batch, in order. ``save``: write a checkpoint after step 1 there;
    ``resume``: start from such a checkpoint. Returns the digest of the final state_dict."""
    model = make_model(name, size)
    opt = adamw_sr.AdamWSR(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, seed=1234)
    acc = det_train.CanonicalGradAccumulator(model.named_parameters(), leaf_tokens=size.leaf)
    start = 0
    if resume is not None:
        state = torch.load(resume, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    n_items = size.batch * (size.seq - 1)  # the global batch's counted (shifted) labels
    for step in range(start, steps):
        ids = global_batch(step, size)
        for first, n in micro_batches:
            x = ids[first : first + n]
            # positions of the batch's shape: GPT-2's learned position embedding then sees every token
            positions = torch.arange(size.seq, device=x.device).expand(n, size.seq)
            with acc.micro_batch(token_offset=first * size.seq):
                out = model(input_ids=x, labels=x, position_ids=positions, num_items_in_batch=n_items)
                out.loss.backward()
        acc.reduce(total_tokens=size.batch * size.seq, group=group)
        opt.step()
        opt.zero_grad()
        if save is not None and step + 1 == 1:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}, save)
    return digest(model.state_dict())


WHOLE = [(0, 6)]
FOUR = [(0, 1), (1, 2), (3, 1), (4, 2)]  # token cuts 4 and 12 inside leaves 0 and 1
TWO = [(0, 3), (3, 3)]  # a cut at token 12, inside leaf 1
DP = {  # world -> each rank's micro-batches; shards are whole leaves (2 sequences)
    3: [[(0, 2)], [(2, 2)], [(4, 2)]],
}


def baseline() -> dict:
    """One micro-batch, one process, per model: the final digest, the initial one and a checkpoint
    after step 1 (in the pytest run's shared folder)."""

    def run(folder: Path) -> dict:
        out = {}
        for name in MODELS:
            path = folder / f"hf-{name}-step1.pt"
            out[name] = {
                "digest": train(name, WHOLE, save=path),
                "initial": digest(make_model(name).state_dict()),
                "checkpoint": str(path),
            }
        return out

    return _once_per_run("hf-baseline", run)


def test_micro_batches_give_the_bits_of_one_batch():
    want = baseline()
    for name in MODELS:
        assert want[name]["digest"] != want[name]["initial"], f"{name}: training did not move the weights"
        assert train(name, FOUR) == want[name]["digest"], f"{name}: 4 micro-batches (cuts inside leaves)"


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        digests = {name: train(name, DP[world][rank], group=dist.group.WORLD) for name in MODELS}
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(digests))


def data_parallel(world: int) -> list[dict]:
    """Each rank's digests, on ``world`` gloo ranks forked from this process, which must not have
    run torch ops yet (a forked OpenMP thread pool deadlocks): ``fresh_runs`` calls it first thing
    in a new interpreter, so torch, transformers and the kernels are imported once for all ranks."""

    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp, f"rank{r}.json")) for r in range(world)]
        init = f"file://{Path(tmp, 'init')}"
        run_processes(_rank, [(r, world, init, outs[r]) for r in range(world)], what=f"DP={world} ranks")
        return [json.loads(Path(o).read_text()) for o in outs]


def fresh_runs() -> dict:
    """In one new interpreter (cold Triton cache): DP 3 on forked gloo ranks, then each model
    resumed from its step-1 checkpoint with the last step in two micro-batches."""
    ckpt = {n: baseline()[n]["checkpoint"] for n in MODELS}

    def run(_folder: Path) -> dict:
        code = (
            "import json, tests.test_transformers_e2e as t\n"
            "dp = {w: t.data_parallel(w) for w in t.DP}\n"
            f"ckpt = {json.dumps(ckpt)}\n"
            "resumed = {n: t.train(n, t.TWO, resume=ckpt[n]) for n in t.MODELS}\n"
            "print(json.dumps({'dp': dp, 'resume': resumed}))\n"
        )
        return json.loads(run_in_fresh_process(code, env={"TRITON_INTERPRET": "1"}))

    return _once_per_run("hf-fresh", run)


def test_data_parallel_3_gives_the_bits_of_one_process():
    for world, shards in DP.items():  # shards are contiguous runs of whole leaves
        spans = [(s[0][0] * CPU.seq, (s[-1][0] + s[-1][1]) * CPU.seq) for s in shards]
        assert spans == contiguous_splits(CPU.batch * CPU.seq, world, CPU.leaf)
    want = baseline()
    for world, results in fresh_runs()["dp"].items():
        assert len(results) == int(world)
        for rank, got in enumerate(results):
            for name in MODELS:
                assert got[name] == want[name]["digest"], f"{name}: DP {world}, rank {rank}"


def test_resume_in_a_fresh_process():
    want = baseline()
    got = fresh_runs()["resume"]
    for name in MODELS:
        assert got[name] == want[name]["digest"], f"{name}: resumed in a fresh process (step 2 in 2 parts)"


def _assert_loss_matches_unconverted(name: str, size: Size, logits: bool = True) -> None:
    plain = make_model(name, size, attn="sdpa", convert=False)
    ours = make_model(name, size)
    assert digest(plain.state_dict()) == digest(ours.state_dict())  # one initialisation
    with pytest.raises(det_train.ConversionError, match="attention implementation 'sdpa'"):
        det_train.convert(plain)  # refused, and left as it was
    ids = global_batch(0, size)
    with torch.no_grad():
        want = plain(input_ids=ids, labels=ids)
        got = ours(input_ids=ids, labels=ids)
    # bf16 tolerance: the loss to the bf16 unit roundoff 2^-8 (relative); at the one-layer CPU size
    # also each logit to 2 bf16 ulps of the largest logit (ulp(v) <= 2^-7 |v|)
    loss, ref = float(got.loss), float(want.loss)
    assert abs(loss - ref) <= 2**-8 * abs(ref), f"{name}: loss {loss} vs unconverted {ref}"
    if not logits:
        return
    scale = float(want.logits.float().abs().max())
    err = float((got.logits.float() - want.logits.float()).abs().max())
    assert err <= 2 * 2**-7 * scale, f"{name}: logits differ by {err} (largest logit {scale})"


@pytest.mark.parametrize("name", MODELS)
def test_converted_loss_matches_the_unconverted_model(name):
    """The same weights through torch's ops and SDPA, and through det_train's and det_attn's: the
    logits and the loss agree to bf16 rounding."""
    _assert_loss_matches_unconverted(name, CPU)


# ---------------------------------------------------------------- GPU, a small size
GPU = Size(hidden=256, layers=2, heads=4, seq=256, batch=8, leaf=512, device="cuda")  # 4 leaves


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_gpu_micro_batches_and_resume_give_the_bits_of_one_batch(name, tmp_path):
    path = tmp_path / "step1.pt"
    whole = train(name, [(0, 8)], size=GPU, save=path)
    assert train(name, [(0, 8)], size=GPU) == whole, f"{name}: run to run"
    for split in ([(0, 3), (3, 5)], [(0, 3), (3, 1), (4, 3), (7, 1)]):  # cuts inside leaves
        assert train(name, split, size=GPU) == whole, f"{name}: micro-batches {split}"
    assert train(name, [(0, 4), (4, 4)], size=GPU, resume=path) == whole, f"{name}: resumed"
    _assert_loss_matches_unconverted(name, GPU, logits=False)


def test_a_row_packed_by_position_ids_alone_gives_each_documents_logits():
    """DataCollatorWithFlattening's default packing (one row, position_ids restarting at each
    document, no cu_seq_lens): det_attn reads the documents from the positions, as transformers'
    flash attention does, so no document attends to another: each document's logits are bitwise
    those of its own row (they differed before: the row was attended as one sequence)."""
    model = make_model("llama")
    ids = global_batch(0)[:2]  # two documents of 4 tokens
    with torch.no_grad():
        rows = model(input_ids=ids).logits
        packed = model(
            input_ids=ids.reshape(1, -1), position_ids=torch.arange(CPU.seq).repeat(2)[None]
        ).logits
    assert torch.equal(packed[0].reshape(rows.shape), rows)


def test_rows_packed_by_position_ids_give_each_documents_logits_at_any_batch_size():
    """Several packed rows in one call (position_ids restarting inside each row): every document's
    logits are bitwise those of its own row, in a batch of 2 packed rows as in each packed row alone,
    so splitting packed rows into micro-batches of 1 or 2 rows gives the same bits."""
    model = make_model("llama")
    ids = global_batch(0)[:4]  # four documents of CPU.seq tokens, packed two per row
    positions = torch.arange(CPU.seq).repeat(2)[None].expand(2, -1)
    with torch.no_grad():
        rows = model(input_ids=ids).logits
        packed = model(input_ids=ids.reshape(2, -1), position_ids=positions).logits
        packed_rows = ids.reshape(2, -1)
        alone = [model(input_ids=packed_rows[r : r + 1], position_ids=positions[:1]).logits for r in (0, 1)]
    assert torch.equal(packed.reshape(rows.shape), rows)
    assert torch.equal(torch.cat(alone), packed)
