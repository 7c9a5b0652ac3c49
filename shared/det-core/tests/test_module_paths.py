"""``det_core.module_paths.keep_module_paths`` on a throwaway package: an old path is the new module
object, in either import order and form; real files win; bad tables are refused; a second call
for the same package replaces the first hook."""

import importlib
import sys
import textwrap

import pytest
from det_core.module_paths import keep_module_paths


@pytest.fixture
def package(tmp_path, monkeypatch):
    """``pkg_paths_<test>``: a package whose ``__init__`` keeps ``old`` -> ``_new`` and ``flat`` ->
    ``sub.deep``, and has a real file ``kept.py`` that is also listed as moved."""
    name = "pkg_paths_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name)  # one per test
    root = tmp_path / name
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text(
        textwrap.dedent(
            """
            from det_core.module_paths import keep_module_paths
            FINDER = keep_module_paths(__name__, {"old": "_new", "flat": "sub.deep", "kept": "_new"})
            """
        )
    )
    (root / "_new.py").write_text("VALUE = 1\n")
    (root / "kept.py").write_text("VALUE = 'file'\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "deep.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "package_name", None) != name]


def test_old_path_first_is_the_new_module(package):
    old = importlib.import_module(f"{package}.old")
    new = importlib.import_module(f"{package}._new")
    assert old is new and sys.modules[f"{package}.old"] is new
    assert new.__name__ == f"{package}._new" and new.__spec__.name == f"{package}._new"
    assert sys.modules[package].old is new


def test_new_path_first_and_from_import(package):
    new = importlib.import_module(f"{package}.sub.deep")
    namespace = {}
    exec(f"from {package} import flat", namespace)
    assert namespace["flat"] is new and namespace["flat"].VALUE == 2


def test_a_patch_through_the_old_path_is_seen_through_the_new(package, monkeypatch):
    monkeypatch.setattr(importlib.import_module(f"{package}.old"), "VALUE", 7)
    assert importlib.import_module(f"{package}._new").VALUE == 7


def test_a_real_file_wins_over_the_table(package):
    assert importlib.import_module(f"{package}.kept").VALUE == "file"


def test_unlisted_names_still_fail(package):
    importlib.import_module(package)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{package}.missing")


def test_a_second_call_replaces_the_first_hook(package):
    importlib.import_module(package)
    keep_module_paths(package, {"other": "_new"})
    hooks = [f for f in sys.meta_path if getattr(f, "package_name", None) == package]
    assert len(hooks) == 1 and hooks[0].moved == {"other": "_new"}
    assert importlib.import_module(f"{package}.other") is importlib.import_module(f"{package}._new")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{package}.old")


@pytest.mark.parametrize(
    "moved, match",
    [({"ops.matmul": "ops._matmul"}, "not one identifier"), ({"same": "same"}, "maps to itself")],
)
def test_bad_tables_are_refused(moved, match):
    before = list(sys.meta_path)
    with pytest.raises(ValueError, match=match):
        keep_module_paths("pkg_never_imported", moved)
    assert sys.meta_path == before  # nothing installed
