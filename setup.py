"""The build backend's one hook beyond pyproject.toml: the fast model compiled into the wheel.

setuptools reads everything else from ``pyproject.toml``, but the package list
(``packages``), derived here from the folders. Here, a wheel build compiles the fast
hot path (the judge's core and the fast model) with mypyc into the package ``kvspec_fast``
(``judge/fastbuild.py`` owns the list of sources and the copies compiled;
``fastbuild.fast_judge()`` finds the installed package). The compiled extension is
optional: without mypyc, with ``KVSPEC_PURE_PYTHON=1``, or when the compile fails, the wheel is
pure Python and ``kvspec check`` notes that it judges from source. Editable installs (``make
venv``) compile nothing here: ``make venv`` builds into the virtual environment, rebuilt on edits.
This file is not part of the installed package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
NOT_PACKAGES = ("tests", "bench", "docs", "build", "dist", "examples", "thirdparty")
"""Top-level folders that are not part of the installed package (folders whose name holds a
dot, such as the virtual environments, are skipped by setuptools' finder)."""


def packages() -> list[str]:
    """``kvspec`` (the root) and every folder below it that holds Python sources, as
    ``kvspec.<dotted path>``: derived, so that a new subpackage, with or without an
    ``__init__.py``, ships (``tests/test_packaging.py`` builds the wheel and imports each
    adapter from it)."""
    exclude = [*NOT_PACKAGES, *(f"{name}.*" for name in NOT_PACKAGES)]
    found = find_namespace_packages(where=str(ROOT), exclude=exclude)
    return ["kvspec"] + sorted(
        f"kvspec.{name}"
        for name in found
        if "__pycache__" not in name and any((ROOT / name.replace(".", "/")).glob("*.py"))
    )


COMPILING = ("bdist_wheel", "build_ext", "build", "install")
"""Commands that build what the wheel ships (metadata and sdist commands compile nothing)."""


class BuildPy(build_py):
    """The package is the repository root: leave this file out of it."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "kvspec" and m[1] == "setup")]


def fastbuild():  # type: ignore[no-untyped-def]
    """``judge/fastbuild.py``, loaded by path (kvspec is not installed yet)."""
    spec = importlib.util.spec_from_file_location(
        "kvspec_fastbuild", ROOT / "judge" / "fastbuild.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def warn(message: str) -> None:
    sys.stderr.write(f"kvspec setup.py: {message}; the wheel's fast model is pure Python\n")


def ext_modules() -> list[object]:
    if "editable_wheel" in sys.argv or not any(c in sys.argv for c in COMPILING):
        return []
    build = fastbuild()
    if os.environ.get(build.PURE_ENV, "") not in ("", "0"):
        warn(f"{build.PURE_ENV} is set")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        warn("mypyc is not installed")
        return []
    copies, config = build.prepare(ROOT / "build" / "kvspec-mypyc")
    package = [copies[0].parent / "__init__.py", *copies]  # compiled too: it ships no .py
    paths = [str(path.relative_to(ROOT)) for path in package]
    try:
        extensions = mypycify([*paths, "--config-file", str(config)], opt_level="3")
    except (Exception, SystemExit) as err:  # mypy's type errors end in SystemExit
        warn(f"mypyc failed ({type(err).__name__}: {err})")
        return []
    for extension in extensions:
        extension.optional = True  # a failed C compile leaves the wheel pure Python
    return list(extensions)


BUILD_OUTPUTS = ("build", "kvspec.egg-info")
"""What setuptools (and the mypyc copies, ``build/kvspec-mypyc``) write into the checkout while
building; removed again when this run made them, so that ``pip install .`` leaves the checkout as
it was (the wheel is already written elsewhere by then)."""

made_here = [ROOT / name for name in BUILD_OUTPUTS if not (ROOT / name).exists()]
if "editable_wheel" in sys.argv:  # an editable install (make venv) keeps its metadata as before
    made_here = []
try:
    setup(packages=packages(), ext_modules=ext_modules(), cmdclass={"build_py": BuildPy})
finally:
    for output in made_here:
        shutil.rmtree(output, ignore_errors=True)
