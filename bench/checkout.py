"""Lets a benchmark script run from a checkout without installing kvspec.

``import_kvspec()`` keeps an installed ``kvspec``; without one it makes this checkout's root (which
is the ``kvspec`` package) importable under that name. A script in ``bench/`` imports this module
by its bare name: Python puts the script's folder first on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def import_kvspec() -> None:
    """Use the installed package, or this checkout (its root is the ``kvspec`` package)."""
    try:
        import kvspec  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parent.parent
        spec = importlib.util.spec_from_file_location(
            "kvspec", root / "__init__.py", submodule_search_locations=[str(root)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["kvspec"] = module
        spec.loader.exec_module(module)
