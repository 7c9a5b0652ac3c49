"""Every weight digest the docs quote is recomputed here.

The main job prints ``final weights sha256: <digest>``; docs/main-job.md quotes the CPU run's
digest (checked on every commit, through the Triton interpreter, whose bits are the same on every
x86-64 host: tests/test_host_independence.py) and the GPU run's (a ``gpu`` test: the bits of that
GPU model and Triton version). A digest anywhere else in the docs must be one of these.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from examples import train_gpt

ROOT = Path(__file__).resolve().parents[1]
# `python examples/train_gpt.py` (`nox -s demo`): the cpu preset, torch 2.13 + Triton 3.9 (pinned)
CPU_DIGEST = "24413e697ec44b9c2a53f5018c53743eab24f330d3aa909ac2fd5b33eeba073a"
# the gpu preset on an NVIDIA H200, torch 2.11 + Triton 3.6 (docs/main-job.md names the run)
GPU_DIGEST = "875b625fa42a6064b33b6af20978c8287030d0e08c53b2e595a9f0c7a900453b"
# raw output of past runs, kept as the record of what that code printed
RECORDS = ("docs/benchmarks/run",)


def _quoted_digests() -> dict[str, set[str]]:
    """Hex digests (8+ hex digits after 'sha256' or in backticks) quoted by each docs page."""
    pages = [*ROOT.glob("docs/**/*.md"), ROOT / "README.md", *ROOT.glob("packages/*/README.md")]
    found = {}
    for page in pages:
        rel = page.relative_to(ROOT).as_posix()
        if rel.startswith(RECORDS):
            continue
        text = page.read_text()
        hexes = set(re.findall(r"sha256: ?`?([0-9a-f]{8,64})", text))
        hexes |= {h for h in re.findall(r"`([0-9a-f]{8,64})(?:\.\.\.)?`", text) if not h.isdigit()}
        if hexes:
            found[rel] = hexes
    return found


def test_docs_quote_only_digests_that_a_test_recomputes():
    quoted = _quoted_digests()
    assert CPU_DIGEST in quoted.get("docs/main-job.md", set())
    assert GPU_DIGEST in quoted.get("docs/main-job.md", set())
    unchecked = {
        page: sorted(h for h in hexes if not (CPU_DIGEST.startswith(h) or GPU_DIGEST.startswith(h)))
        for page, hexes in quoted.items()
    }
    assert not any(unchecked.values()), (
        f"digests no test recomputes: { {k: v for k, v in unchecked.items() if v} }"
    )


@pytest.mark.long
def test_cpu_main_job_prints_the_documented_digest():
    if torch.cuda.is_available():
        pytest.skip("the cpu preset's digest is the interpreter's; this machine runs the GPU path")
    assert train_gpt.train(train_gpt.make_config("cpu"))["digest"] == CPU_DIGEST


@pytest.mark.gpu
def test_gpu_main_job_prints_the_documented_digest():
    if torch.cuda.get_device_name().find("H200") < 0:
        pytest.skip(f"the documented GPU digest is an H200's, this is {torch.cuda.get_device_name()}")
    assert train_gpt.train(train_gpt.make_config("gpu"))["digest"] == GPU_DIGEST
