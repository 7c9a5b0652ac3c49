"""The Hub build trees load through `kernels` exactly as a user would load them, fully offline.

Each package is built (tools/build_hub.py) into a temporary folder laid out like its Hub
repository, then loaded in a fresh Python process that has neither the package sources nor
shared/det-core on its path, with ``HF_HUB_OFFLINE=1``, three ways:

1. ``kernels.get_kernel("phanerozoic/<name>", version=1)`` from a pre-filled Hugging Face cache
   (``refs/v1`` -> ``snapshots/<commit>/build/...``): ``version=1`` means branch ``v1``;
2. the same call with ``LOCAL_KERNELS="phanerozoic/<name>=<repo folder>"``;
3. ``kernels.get_local_kernel(<repo folder>)``.

Each load must give the package's whole ``__all__`` (which must contain a minimal public API),
resolve every exported name, and import nothing from the source tree.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DET_CORE = ROOT / "shared" / "det-core" / "det_core"
HUB_ORG = "phanerozoic"

# package folder -> (import name, names its __all__ must contain at least)
PACKAGES = {
    "adamw-sr": ("adamw_sr", {"AdamWSR"}),
    "det-train": ("det_train", {"matmul", "linear", "Linear", "rms_norm", "cross_entropy"}),
    "det-attn": ("det_attn", {"attention", "attention_varlen"}),
}

kernels = pytest.importorskip("kernels", reason="the Hub loading tests need the `kernels` package")


def _load_build_tool():
    spec = importlib.util.spec_from_file_location("build_hub", ROOT / "tools" / "build_hub.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


build_hub = _load_build_tool()


def _expected_variant() -> str:
    """The variant kernels picks here: a CUDA build of torch takes torch-cuda, a CPU build torch-cpu."""
    import torch

    return "torch-cuda" if torch.version.cuda else "torch-cpu"


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def hub_repos(tmp_path_factory) -> Path:
    """Every package built by tools/build_hub.py into <tmp>/<name>/ (a failure is kept for its tests)."""
    out = tmp_path_factory.mktemp("hub")
    for name in PACKAGES:
        (out / name).mkdir()
        try:
            build_hub.build_package(ROOT / "packages" / name, out / name)
        except build_hub.BuildError as e:
            (out / name / "BUILD_ERROR").write_text(str(e))
    return out


def _built_repo(hub_repos: Path, name: str) -> Path:
    error = hub_repos / name / "BUILD_ERROR"
    if error.exists():
        pytest.fail(f"building {name} failed: {error.read_text()}")
    return hub_repos / name


# The probe runs in a fresh interpreter, so HF_HUB_OFFLINE and the cache location are read at
# import, as for a user, and no module of this test process (or source folder) can leak in. One
# interpreter per way of loading: kernels keeps a loaded kernel in sys.modules under its metadata
# id, so a second load of the same build in one process returns the first.
PROBE = r"""
import importlib, json, os, sys
from pathlib import Path
import kernels

repo_id, python_name, method, location, cache_only_check = sys.argv[1:6]

def describe(module):
    failed = {}
    for name in module.__all__:
        try:
            getattr(module, name)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
    compat = importlib.import_module(module.__name__ + "." + python_name)
    return {
        "module": module.__name__,
        "file": module.__file__,
        "all": list(module.__all__),
        "unresolved": failed,
        "compat_all": list(compat.__all__),
    }

os.environ.pop("LOCAL_KERNELS", None)
if method == "hub_cache":
    report = describe(kernels.get_kernel(repo_id, version=1, trust_remote_code=True))
    try:
        kernels.get_kernel(repo_id, version=2, trust_remote_code=True)
        report["missing_version_error"] = None
    except Exception as e:
        report["missing_version_error"] = f"{type(e).__name__}: {e}"
elif method == "local_kernels":
    os.environ["LOCAL_KERNELS"] = f"{repo_id}={location}"
    report = describe(kernels.get_kernel(repo_id, version=1))
else:
    report = describe(kernels.get_local_kernel(Path(location)))

def _from_source_tree(mod):
    # a file under the repo counts, except the Python environment itself (nox keeps it in .nox/)
    path = os.path.realpath(str(getattr(mod, "__file__", "") or ""))
    env = os.path.realpath(sys.prefix)
    return path.startswith(os.path.realpath(cache_only_check)) and not path.startswith(env + os.sep)

report["source_modules"] = sorted(
    name for name, mod in list(sys.modules.items())
    if name.split(".")[0] in ("det_core", python_name) or _from_source_tree(mod)
)
print("PROBE-REPORT " + json.dumps(report))
"""


def _prefill_hub_cache(cache: Path, repo_id: str, repo: Path) -> str:
    """Lay out ``repo`` in a Hugging Face cache as branch v1 of ``repo_id``; return the commit."""
    commit = hashlib.sha1(json.dumps(sorted(_tree_bytes(repo / "build"))).encode()).hexdigest()
    folder = cache / ("kernels--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "v1").write_text(commit)
    shutil.copytree(repo / "build", folder / "snapshots" / commit / "build")
    return commit


METHODS = ["hub_cache", "local_kernels", "get_local_kernel"]


@pytest.fixture(scope="module")
def load_reports(hub_repos, tmp_path_factory) -> dict:
    """(name, method) -> the probe's report, computed lazily once; ``report["path"]`` is the folder
    the module must be loaded from (the prefilled cache, the repo folder, or a copy of it)."""
    reports: dict = {}

    def get(name: str, method: str) -> dict:
        if (name, method) in reports:
            return reports[name, method]
        repo = _built_repo(hub_repos, name)
        work = tmp_path_factory.mktemp(f"load-{name}-{method}")
        repo_id = f"{HUB_ORG}/{name}"
        _prefill_hub_cache(work / "hf-cache", repo_id, repo)
        location = {"hub_cache": work / "hf-cache", "local_kernels": repo, "get_local_kernel": work / "copy"}
        shutil.copytree(repo, location["get_local_kernel"])
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_KERNELS")}
        env.update(
            HF_HUB_OFFLINE="1",
            HF_HUB_CACHE=str(work / "hf-cache"),
            HF_HUB_DISABLE_TELEMETRY="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.pop("KERNELS_CACHE", None)
        args = [repo_id, PACKAGES[name][0], method, str(location[method]), str(ROOT)]
        cmd = [sys.executable, "-c", PROBE, *args]
        result = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE-REPORT ")]
        assert result.returncode == 0 and lines, (
            f"loading {repo_id} ({method}) through kernels failed:\n{result.stdout[-4000:]}\n"
            f"{result.stderr[-4000:]}"
        )
        reports[name, method] = json.loads(lines[-1][len("PROBE-REPORT ") :]) | {"path": location[method]}
        return reports[name, method]

    return get


@pytest.mark.parametrize("name", list(PACKAGES))
@pytest.mark.parametrize("method", METHODS)
def test_built_package_loads_offline_with_its_public_api(load_reports, name, method):
    python_name, required = PACKAGES[name]
    loaded = load_reports(name, method)
    source_all = importlib.import_module(python_name).__all__

    assert Path(loaded["file"]).is_relative_to(loaded["path"]), loaded["file"]
    assert Path(loaded["file"]).parent.name == _expected_variant()
    assert loaded["module"].startswith(f"_{python_name}_{_expected_variant()[len('torch-') :]}_")
    assert sorted(loaded["all"]) == sorted(source_all)
    assert required <= set(loaded["all"]), f"{name} lacks {sorted(required - set(loaded['all']))}"
    assert loaded["unresolved"] == {}, f"exported names that do not resolve: {loaded['unresolved']}"
    assert sorted(loaded["compat_all"]) == sorted(source_all)


@pytest.mark.parametrize("name", list(PACKAGES))
@pytest.mark.parametrize("method", METHODS)
def test_loaded_package_uses_no_source_tree_module(load_reports, name, method):
    # det_core, the source package, or any module under the repo would mean the build is not
    # self-contained (it would break on a user's machine).
    assert load_reports(name, method)["source_modules"] == []


@pytest.mark.parametrize("name", list(PACKAGES))
def test_offline_cache_has_only_version_1(load_reports, name):
    error = load_reports(name, "hub_cache")["missing_version_error"]
    assert error is not None and "Version 2 not found" in error


@pytest.mark.parametrize("name", list(PACKAGES))
def test_metadata_is_what_kernels_validates(hub_repos, name):
    from kernels._rust import Digest, DigestAlgorithm, Metadata
    from kernels.validate import AllMetadataValidator, default_metadata_validators

    python_name = PACKAGES[name][0]
    repo = _built_repo(hub_repos, name)
    variants = sorted(p.name for p in (repo / "build").iterdir())
    assert "torch-cuda" in variants and "torch-cpu" in variants, variants
    for variant in variants:
        variant_dir = repo / "build" / variant
        raw = json.loads((variant_dir / "metadata.json").read_text())
        assert raw["name"] == name
        assert raw["version"] == 1
        assert raw["license"] == "Apache-2.0"
        assert raw["python-depends"] == []  # never triton or torch
        assert raw["backend"]["type"] == variant.removeprefix("torch-")
        assert raw["id"].isidentifier() and raw["id"].startswith(f"_{python_name}_{raw['backend']['type']}_")
        metadata = Metadata.read_from_file(variant_dir / "metadata.json")
        validator = AllMetadataValidator(default_metadata_validators())
        validator.validate_metadata(metadata=metadata, variant=variant)
        metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant_dir))
        # the flattened package is the source package, file for file, with `from det_core` made relative
        source = _tree_bytes(ROOT / "packages" / name / "torch-ext" / python_name)
        built = _tree_bytes(variant_dir)
        for rel, data in source.items():
            dots = "." * rel.count("/") + "."
            assert built[rel].replace(f"from {dots}_vendor.det_core".encode(), b"from det_core") == data, rel
        vendored = {
            f"_vendor/{p.relative_to(ROOT / 'shared' / 'det-core').as_posix()}" for p in DET_CORE.glob("*.py")
        }
        assert set(built) - set(source) == {
            "metadata.json",
            f"{python_name}/__init__.py",
            "_vendor/__init__.py",
            *vendored,
        }


@pytest.mark.parametrize("name", list(PACKAGES))
def test_built_tree_imports_only_stdlib_torch_triton_and_itself(hub_repos, name):
    stdlib = set(sys.stdlib_module_names)
    repo = _built_repo(hub_repos, name)
    for variant_dir in (repo / "build").iterdir():
        for path in variant_dir.rglob("*.py"):
            # the interpreter-only module (imported under TRITON_INTERPRET=1) may use Triton's numpy
            allowed = stdlib | {"torch", "triton"} | ({"numpy"} if path.name == "interpreter.py" else set())
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    tops = {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    tops = {node.module.split(".")[0]}
                else:
                    continue
                assert tops <= allowed, f"{path.relative_to(repo)}:{node.lineno}: {tops}"


@pytest.mark.parametrize("name", list(PACKAGES))
def test_vendored_det_core_in_build_equals_shared_det_core(hub_repos, name):
    repo = _built_repo(hub_repos, name)
    modules = sorted(DET_CORE.glob("*.py"))
    assert {"rng.py", "sr.py", "reduce.py", "runtime.py", "interpreter.py"} <= {m.name for m in modules}
    for module in modules:
        for variant_dir in (repo / "build").iterdir():
            vendored = (variant_dir / "_vendor" / "det_core" / module.name).read_text()
            assert vendored.split("\n", 1)[1] == module.read_text(), (
                f"{variant_dir.name}/_vendor/det_core/{module.name} drifted"
            )


def _a_buildable_package() -> str:
    names = [
        n
        for n, (python_name, _) in PACKAGES.items()
        if (ROOT / "packages" / n / "build.toml").is_file()
        and (ROOT / "packages" / n / "torch-ext" / python_name / "__init__.py").is_file()
    ]
    if not names:
        pytest.fail("no package has a build.toml yet (see tools/build_hub.py BUILD_TOML_TEMPLATE)")
    return names[0]


def test_build_is_reproducible_and_replaces_stale_files(tmp_path):
    name = _a_buildable_package()
    first, second = tmp_path / "a", tmp_path / "b"
    build_hub.build_package(ROOT / "packages" / name, first)
    stale = first / "build" / "torch-cpu" / "stale.py"
    stale.write_text("x = 1\n")
    build_hub.build_package(ROOT / "packages" / name, first)
    build_hub.build_package(ROOT / "packages" / name, second)
    assert not stale.exists()
    assert _tree_bytes(first / "build") == _tree_bytes(second / "build")


def test_cli_builds_one_package(tmp_path, capsys):
    name = _a_buildable_package()
    assert build_hub.main(["--package", name, "--out", str(tmp_path)]) == 0
    assert (tmp_path / name / "build" / "torch-cpu" / "metadata.json").is_file()
    assert f"built {tmp_path / name / 'build'}" in capsys.readouterr().out
    assert build_hub.main(["--package", "no-such-kernel", "--out", str(tmp_path)]) == 1
    assert "unknown package(s) ['no-such-kernel']" in capsys.readouterr().err


# ----------------------------------------------------------------- bad packages give clear errors

GOOD_TOML = build_hub.BUILD_TOML_TEMPLATE.format(name="toy-kernel")


def _toy_package(
    tmp_path: Path, toml: str | None, init: str = "__all__ = ['f']\ndef f():\n    return 1\n"
) -> Path:
    package = tmp_path / "toy-kernel"
    (package / "torch-ext" / "toy_kernel").mkdir(parents=True)
    (package / "torch-ext" / "toy_kernel" / "__init__.py").write_text(init)
    if toml is not None:
        (package / "build.toml").write_text(toml)
    return package


def test_toy_package_builds_and_loads_through_get_local_kernel(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: patch it
    package = _toy_package(tmp_path, GOOD_TOML, "from .ops import f\n__all__ = ['f']\n")
    (package / "torch-ext" / "toy_kernel" / "ops.py").write_text(
        "import math\n\ndef f():\n    return math.pi\n"
    )
    build_hub.build_package(package, tmp_path / "repo")
    module = kernels.get_local_kernel(tmp_path / "repo")
    assert module.__all__ == ["f"] and module.f() == pytest.approx(3.141592653589793)
    assert Path(module.__file__).parent.name == _expected_variant()


def test_missing_build_toml_is_a_clear_error(tmp_path):
    with pytest.raises(build_hub.BuildError, match=r"build.toml is missing(.|\n)*edition = 5"):
        build_hub.build_package(_toy_package(tmp_path, None), tmp_path / "out")


def test_legacy_build_toml_is_a_clear_error(tmp_path):
    legacy = '[general]\nname = "toy-kernel"\nuniversal = true\n\n[torch]\nsrc = []\n'
    with pytest.raises(build_hub.BuildError, match="not a valid kernel-builder build.toml"):
        build_hub.build_package(_toy_package(tmp_path, legacy), tmp_path / "out")


def test_name_mismatch_is_a_clear_error(tmp_path):
    toml = GOOD_TOML.replace('name = "toy-kernel"', 'name = "other-kernel"')
    with pytest.raises(build_hub.BuildError, match="general.name is 'other-kernel'"):
        build_hub.build_package(_toy_package(tmp_path, toml), tmp_path / "out")


def test_det_core_import_is_vendored_and_made_relative(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    package = _toy_package(tmp_path, GOOD_TOML, "from .sub.ops import f\n__all__ = ['f']\n")
    (package / "torch-ext" / "toy_kernel" / "sub").mkdir()
    (package / "torch-ext" / "toy_kernel" / "sub" / "__init__.py").write_text("")
    (package / "torch-ext" / "toy_kernel" / "sub" / "ops.py").write_text(
        "from det_core.runtime import cdiv\n\ndef f():\n    return cdiv(7, 2)\n"
    )
    build_hub.build_package(package, tmp_path / "repo")
    built = tmp_path / "repo" / "build" / _expected_variant()
    assert (built / "sub" / "ops.py").read_text().startswith("from .._vendor.det_core.runtime import cdiv\n")
    module = kernels.get_local_kernel(tmp_path / "repo")
    assert module.f() == 4
    assert "det_core" not in {m.split(".")[0] for m in sys.modules if m.startswith(module.__name__)}


def test_vendor_folder_in_kernel_source_is_a_clear_error(tmp_path):
    package = _toy_package(tmp_path, GOOD_TOML)
    (package / "torch-ext" / "toy_kernel" / "_vendor").mkdir()
    (package / "torch-ext" / "toy_kernel" / "_vendor" / "__init__.py").write_text("")
    with pytest.raises(build_hub.BuildError, match="'_vendor' would collide"):
        build_hub.build_package(package, tmp_path / "out")


@pytest.mark.parametrize("line", ["import det_core", "import det_core.rng", "import numpy as np"])
def test_non_hub_import_in_kernel_source_fails_the_build(tmp_path, line):
    package = _toy_package(tmp_path, GOOD_TOML, f"{line}\n__all__ = []\n")
    with pytest.raises(build_hub.BuildError, match=r"may import only the standard library, torch, triton"):
        build_hub.build_package(package, tmp_path / "out")


def test_triton_in_python_depends_is_rejected(tmp_path):
    toml = GOOD_TOML.replace('license = "Apache-2.0"', 'license = "Apache-2.0"\npython-depends = ["triton"]')
    with pytest.raises(build_hub.BuildError):
        build_hub.build_package(_toy_package(tmp_path, toml), tmp_path / "out")
