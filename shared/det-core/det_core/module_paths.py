"""Module paths a package has moved away from, kept importing: ``keep_module_paths``.

When a package renames or regroups its modules (``adamw_sr.kernel`` -> ``adamw_sr._kernel``,
``det_train.grad_accum`` -> ``det_train.accum.grad_accum``), scripts and notebooks that import the
old path must keep working, and must get the very module the package uses, not a copy. Standard
library only (no torch, no triton), so a package's ``__init__`` can call it without importing
either.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Mapping

__all__ = ["keep_module_paths"]


class _ModuleAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``<package>.<old>`` for each old name with the module ``<package>.<new>``."""

    def __init__(self, package_name: str, moved: dict[str, str]):
        self.package_name = package_name
        self.moved = moved

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != self.package_name or name not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        old = spec.name.rpartition(".")[2]
        module = importlib.import_module(f".{self.moved[old]}", self.package_name)
        spec.loader_state = module.__spec__  # the import system sets __spec__ to this alias spec
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the module's own spec back; nothing to run


def keep_module_paths(package_name: str, moved: Mapping[str, str]) -> importlib.abc.MetaPathFinder:
    """Keep ``<package_name>.<old>`` importing, as the module ``<package_name>.<new>``, for each entry.

    Installs an import hook (a ``sys.meta_path`` finder and loader) that answers an old path by
    importing the module it moved to and returning that module object: one module under both names
    (``import pkg.old`` binds ``sys.modules["pkg.old"]`` and the attribute ``pkg.old`` to it), so a
    global monkeypatched through either path, an ``isinstance`` check or a module-level cache sees
    one module. The module keeps its own ``__name__`` and ``__spec__`` (the new path). Nothing is
    imported before an old path is asked for, and both ``import pkg.old`` and
    ``from pkg import old`` work, in either order with the new path.

    The hook is appended after the path finders, so it answers only names that no file of the
    package bears; a name of ``moved`` that is still a module file imports that file. Call it
    from the package's ``__init__`` with ``__name__`` (under a Hub build the package has a unique
    name, ``_<pkg>_<backend>_<hash>``, and each build gets its own hook). Calling it again for the
    same ``package_name`` (a reloaded package) replaces the earlier hook.

    Args:
        package_name: the package's import name (``__name__`` of its ``__init__``).
        moved: old submodule name (one component: ``"kernel"``, ``"grad_accum"``) -> the module it
            now is, relative to the package (``"_kernel"``, ``"accum.grad_accum"``).

    Returns:
        The installed finder (on ``sys.meta_path``).

    Raises:
        ValueError: an old name that is not one Python identifier (a dotted path such as
            ``"ops.matmul"``; give the last component only), or an entry that maps a name to itself.

    **Determinism:** no numerics; which module object a path resolves to is fixed by ``moved``.

    Method: a PEP 451 meta path finder whose loader's ``create_module`` returns the already
    imported target module (``importlib.import_module``) and whose ``exec_module`` runs nothing.
    """
    moved = dict(moved)
    for old, new in moved.items():
        if not old.isidentifier():
            raise ValueError(
                f"keep_module_paths({package_name!r}): old module name {old!r} is not one identifier; "
                "give the submodule's last name (e.g. 'grad_accum', not 'det_train.grad_accum')"
            )
        if old == new:
            raise ValueError(
                f"keep_module_paths({package_name!r}): {old!r} maps to itself; list only modules that moved"
            )
    sys.meta_path[:] = [
        f for f in sys.meta_path if not (isinstance(f, _ModuleAliases) and f.package_name == package_name)
    ]
    finder = _ModuleAliases(package_name, moved)
    sys.meta_path.append(finder)
    return finder
