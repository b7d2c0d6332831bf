"""``kvspec.conformance.judge`` moved to ``kvspec.judge`` (``tools/relayout.py``): this module
keeps the old name importable, with one warning; ``kvspec.conformance.judge.X`` is the module
``kvspec.judge.X`` itself."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

OLD, NEW = "kvspec.conformance.judge", "kvspec.judge"

warnings.warn(f"{OLD} moved to {NEW}: import it from there", DeprecationWarning, stacklevel=2)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``OLD.X`` and loads it as the module ``NEW.X`` already is."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if not name.startswith(OLD + "."):
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(NEW + spec.name[len(OLD) :])

    def exec_module(self, module: ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Alias())
sys.modules[__name__] = importlib.import_module(NEW)
