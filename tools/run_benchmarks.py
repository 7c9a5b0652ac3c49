"""Run every benchmark (GPU) side by side with its peers and gather the tables.

Discovers ``packages/*/benchmarks/bench_*.py`` and ``examples/bench_*.py``; each has
``main(argv)`` taking ``--out DIR`` and writing ``<name>.md`` / ``<name>.json`` there. This runner
calls each in turn (one failing benchmark does not stop the others), then writes
``OUT/benchmarks.md`` (all tables, with the GPU and versions) and ``OUT/benchmarks.json``.

    python tools/run_benchmarks.py --out bench-results [--only adamw,matmul]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def discover() -> list[Path]:
    """Every benchmark script, in a stable order."""
    return sorted(ROOT.glob("packages/*/benchmarks/bench_*.py")) + sorted(ROOT.glob("examples/bench_*.py"))


def environment() -> str:
    """One line naming the GPU and the versions the numbers were measured with."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{gpu}; torch {torch.__version__}; triton {triton.__version__}; "
        f"CUDA {torch.version.cuda}; Python {platform.python_version()}; {time.strftime('%Y-%m-%d')}"
    )


def run_one(script: Path, out: Path) -> str | None:
    """Import ``script`` and call its ``main(["--out", out])``; return an error text or None."""
    spec = importlib.util.spec_from_file_location(f"bench_{script.parent.parent.name}_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (and pickling) look their module up there
    try:
        spec.loader.exec_module(module)
        module.main(["--out", str(out)])
    except SystemExit as exc:
        return None if exc.code in (0, None) else f"exited with {exc.code}"
    except Exception:  # report and go on: one broken benchmark must not hide the others
        return traceback.format_exc()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results")
    parser.add_argument("--only", default="", help="comma-separated substrings of script paths to run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = [w for w in args.only.split(",") if w]
    scripts = [s for s in discover() if not wanted or any(w in str(s) for w in wanted)]
    sections, results, failures = [f"# Benchmark results\n\n{environment()}\n"], {}, 0
    with tempfile.TemporaryDirectory() as tmp:
        for script in scripts:
            name = str(script.relative_to(ROOT))
            print(f"=== {name}", flush=True)
            start = time.perf_counter()
            error = run_one(script, Path(tmp))
            seconds = time.perf_counter() - start
            if error:
                failures += 1
                print(error, flush=True)
                sections.append(f"## {name}\n\nFAILED after {seconds:.0f} s:\n\n```\n{error[-3000:]}\n```\n")
            else:
                print(f"--- {name}: {seconds:.0f} s", flush=True)
        for md in sorted(Path(tmp).glob("*.md")):
            sections.append(md.read_text())
        for js in sorted(Path(tmp).glob("*.json")):
            results[js.stem] = json.loads(js.read_text())
    (args.out / "benchmarks.md").write_text("\n\n".join(sections))
    (args.out / "benchmarks.json").write_text(json.dumps({"environment": environment(), **results}, indent=1))
    print("\n\n".join(sections[1:]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
