"""Old import paths of modules that moved, kept for one release with a ``DeprecationWarning``.

A package that moved a module calls ``redirect(package, {old: (new, ...)}, renamed)`` from its
``__init__``: importing ``package.old`` then warns, naming the new path, and gives a module
whose names are looked up in the new modules in order (a module that was split resolves each
name where it now lives); ``renamed`` maps ``(old, name)`` to a new name for names that changed
too. Only imports of the listed names are served; everything else imports as before.
docs/migrating.md lists every move. This module imports nothing from the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import cast

__all__ = ["package_getattr", "redirect"]


class _MovedModule(types.ModuleType):
    """The old module: each attribute read is served from the new modules."""

    def __init__(self, name: str, targets: Sequence[str], renamed: Mapping[str, str]) -> None:
        super().__init__(name, f"moved: import from {' or '.join(targets)}")
        self._moved_targets = tuple(targets)
        self._moved_renamed = dict(renamed)

    def __getattr__(self, attr: str) -> object:
        if attr == "__all__":  # what `from old import *` takes: every name served
            return [n for n in self.__dir__() if not n.startswith("_")]
        if attr.startswith("__"):
            raise AttributeError(attr)
        wanted = self._moved_renamed.get(attr, attr)
        for target in self._moved_targets:
            module = importlib.import_module(target)
            if hasattr(module, wanted):
                return getattr(module, wanted)
        raise AttributeError(
            f"module {self.__name__!r} moved to {' and '.join(self._moved_targets)}, "
            f"which have no {wanted!r}"
        )

    def __dir__(self) -> list[str]:
        names: set[str] = set(self._moved_renamed)
        for target in self._moved_targets:
            names.update(n for n in dir(importlib.import_module(target)) if not n.startswith("_"))
        return sorted(names)


class _Loader(importlib.abc.Loader):
    def __init__(self, targets: Sequence[str], renamed: Mapping[str, str]) -> None:
        self._targets = targets
        self._renamed = renamed

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved: import from {' or '.join(self._targets)} (or the package "
            f"face); the old path goes in the next release (docs/migrating.md)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _MovedModule(spec.name, self._targets, self._renamed)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.moves: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        move = self.moves.get(fullname)
        if move is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(*move))


_FINDER = _Finder()


def redirect(
    package: str,
    moves: Mapping[str, Sequence[str]],
    renamed: Mapping[tuple[str, str], str] | None = None,
) -> None:
    """Serve ``package.<old>`` from the modules ``moves[old]`` (absolute names), warning."""
    for old, targets in moves.items():
        names = {n: new for (o, n), new in (renamed or {}).items() if o == old}
        _FINDER.moves[f"{package}.{old}"] = (tuple(targets), names)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def package_getattr(
    package: str, old: str, targets: Sequence[str], renamed: Mapping[str, str] | None = None
) -> types.FunctionType:
    """A module ``__getattr__`` for a package that took the name of a moved module: reading
    one of the old module's names from the package warns and serves it from ``targets``
    (``renamed`` maps an old name to its new one)."""

    def __getattr__(attr: str) -> object:  # noqa: N807  # a module __getattr__ (PEP 562)
        # A submodule of the package is imported by the import system, not served here (it
        # asks for the attribute first, while the package may still be importing).
        if not attr.startswith("__") and importlib.util.find_spec(f"{package}.{attr}") is None:
            wanted = (renamed or {}).get(attr, attr)
            for target in targets:
                module = importlib.import_module(target)
                if wanted in getattr(module, "__all__", ()):
                    warnings.warn(
                        f"{package}.{attr}: the module {package} ({old}) became a package; "
                        f"import {wanted} from {target} (or the package face); the old path "
                        f"goes in the next release (docs/migrating.md)",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    return getattr(module, wanted)
        raise AttributeError(f"module {package!r} has no attribute {attr!r}")

    return cast(types.FunctionType, __getattr__)
