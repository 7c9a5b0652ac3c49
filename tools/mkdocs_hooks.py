"""mkdocs hook: write each package's API reference from the package's own ``__all__``.

A page line ``<!-- api-reference: det_train -->`` becomes one mkdocstrings block per module that
defines a public name, listing exactly the names ``__all__`` exports from it. The package is
imported to learn where each name lives (lazy ``__getattr__`` exports included), so the reference
follows the code without a hand-kept list. A name that cannot be resolved is shown in a visible
"not available" box; ``tests/test_docs.py`` fails while any such name exists.

A line ``<!-- include-if-present: docs/benchmarks/benchmarks.md -->`` is replaced by that file
(headings moved two levels down), or by a note saying no results are recorded yet.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_PATHS = [
    "shared/det-core",
    "packages/adamw-sr/torch-ext",
    "packages/det-train/torch-ext",
    "packages/det-attn/torch-ext",
]
MARKER = re.compile(r"^<!-- api-reference: ([A-Za-z_][A-Za-z0-9_]*) -->$", re.MULTILINE)
INCLUDE = re.compile(r"^<!-- include-if-present: (\S+) -->$", re.MULTILINE)


def _ensure_source_paths() -> None:
    for rel in SOURCE_PATHS:
        path = str(ROOT / rel)
        if path not in sys.path:
            sys.path.append(path)


def public_api(python_name: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Map each defining module of ``python_name``'s ``__all__`` to its names, and list failures.

    Returns:
        ``(modules, missing)``: ``modules`` maps a dotted module name (the package itself for
        names defined in ``__init__``) to the exported names it defines, in ``__all__`` order;
        ``missing`` maps each name that could not be resolved to the error.
    """
    _ensure_source_paths()
    try:
        package = importlib.import_module(python_name)
    except Exception as e:  # report, do not crash the site build
        return {}, {"(package)": f"{type(e).__name__}: {e}"}
    modules: dict[str, list[str]] = {}
    missing: dict[str, str] = {}
    for name in getattr(package, "__all__", []):
        try:
            value = getattr(package, name)
        except Exception as e:
            missing[name] = f"{type(e).__name__}: {e}"
            continue
        if isinstance(value, types.ModuleType):
            modules.setdefault(value.__name__, [])  # a whole public submodule
            continue
        module = getattr(value, "__module__", None) or python_name
        if module != python_name and not module.startswith(python_name + "."):
            module = python_name  # a re-export of a foreign object: document it where it is exported
        modules.setdefault(module, []).append(name)
    return modules, missing


def api_reference_markdown(python_name: str) -> str:
    modules, missing = public_api(python_name)
    blocks = []
    if missing:
        rows = "\n".join(f"    - `{name}`: {error}" for name, error in missing.items())
        blocks.append(f'!!! failure "Not available in this build of `{python_name}`"\n\n{rows}\n')
    for module, names in modules.items():
        block = f"::: {module}"
        if names:
            block += "\n    options:\n      members:\n" + "".join(f"        - {n}\n" for n in names)
        blocks.append(block.rstrip("\n") + "\n")
    return "\n".join(blocks)


def include_if_present(rel_path: str) -> str:
    path = ROOT / rel_path
    if not path.is_file():
        return (
            '!!! note "No results recorded yet"\n\n'
            f"    Run the benchmarks on a GPU with `--out {path.parent.relative_to(ROOT)}` "
            "to fill this section.\n"
        )
    lines, in_fence = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        lines.append("##" + line if line.startswith("#") and not in_fence else line)
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs hook signature)
    markdown = MARKER.sub(lambda m: api_reference_markdown(m.group(1)), markdown)
    return INCLUDE.sub(lambda m: include_if_present(m.group(1)), markdown)
