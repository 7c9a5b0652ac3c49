"""The tutorials run as written (at their tiny CPU size, through the Triton interpreter).

Convention of the tutorial pages: ```` ```bash ```` blocks run first, in order, from the repository
root; then every ```` ```python ```` block, in order, as one script in a fresh interpreter (so the
page's own ``TRITON_INTERPRET`` switch happens before triton is imported). ```` ```py ```` blocks
are illustrations that are not run (e.g. a download from the Hub, which CI cannot reach).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "docs" / "tutorials"


def _blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.MULTILINE | re.DOTALL)


def _run_tutorial(page: Path, extra_env: dict | None = None) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra_env or {})
    for block in _blocks(page, "bash"):
        subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, check=True, timeout=600)
    script = "\n".join(_blocks(page, "python"))
    assert script.strip(), f"{page.name} has no python blocks"
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{page.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_install_from_hub_tutorial_runs_offline():
    pytest.importorskip("kernels")
    out = _run_tutorial(TUTORIALS / "install-from-hub.md", {"HF_HUB_OFFLINE": "1"})
    assert "SR update reproducible: True" in out
    assert "adamw-sr 1." in out


def test_deterministic_training_tutorial_runs():
    out = _run_tutorial(TUTORIALS / "deterministic-training.md")
    assert "digests match: True" in out
    assert "resumed run matches: True" in out


def test_transformers_tutorial_runs():
    pytest.importorskip("transformers")
    out = _run_tutorial(TUTORIALS / "transformers.md")
    # the outputs the page quotes
    assert "Embedding RMSNorm Linear causal_lm_loss" in out
    assert "attention implementation 'sdpa' (config._attn_implementation)\n" in out
    assert "model.embed_tokens.weight: p.grad already holds a non-zero gradient" in out
    assert "loop digests match: True" in out
    assert "Trainer digests match: True" in out
