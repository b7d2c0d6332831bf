"""The compiled fast model: building ``fastmodel.py`` with mypyc, and choosing which module judges.

``make venv`` runs ``python -m kvspec.conformance.fastbuild`` (again whenever ``fastmodel.py`` or
this file changes): it copies ``fastmodel.py`` as the top-level module ``kvspec_fastmodel_mypyc``
(relative imports made absolute, the SHA-256 of the source appended as ``SOURCE_SHA256``),
compiles that copy with mypyc and keeps the extension in ``<venv>/kvspec-mypyc/`` (the folder of
the interpreter that built it, so another interpreter never loads it). The compiled module has a
name of its own, so it never shadows the source: ``fast_model()`` loads it by path, and only when
its ``SOURCE_SHA256`` is the hash of the current ``fastmodel.py``.

``fast_model()`` answers ``(module, note)``: the compiled module and no note, or the source
module (``kvspec.conformance.fastmodel``, the same verdicts, about half the speed) and a note
saying why (not built, older than the source, not loadable, or ``KVSPEC_FAST_MODEL=source``).
The note is never silent and never on stderr (where an unreadable file gets exactly one line):
``kvspec check`` appends it to its report (``Report.note``: the ``holds`` line, the end of a
violation, and ``note`` in ``--json``; ``docs/checker.md``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

NAME = "kvspec_fastmodel_mypyc"
"""The compiled module's own name (never ``kvspec.conformance.fastmodel``)."""
SOURCE = Path(__file__).with_name("fastmodel.py")
FOLDER = Path(sys.prefix) / "kvspec-mypyc"
"""Where ``make venv`` keeps the extension: in the virtual environment that built it."""
ENV = "KVSPEC_FAST_MODEL"
"""``source``: judge with the source module even when the compiled one is current."""

_compiled: tuple[ModuleType | None, str | None] | None = None


def source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def fast_model() -> tuple[ModuleType, str | None]:
    """The module whose ``FastChecker`` judges, and a note when it is not the compiled one."""
    from . import fastmodel

    if os.environ.get(ENV) == "source":
        return fastmodel, f"fast model from source ({ENV}=source)"
    module, why = compiled()
    if module is None:
        return fastmodel, f"fast model from source, about half the speed: {why}"
    return module, None


def compiled() -> tuple[ModuleType | None, str | None]:
    """The compiled module if it is built from the current source, else None and why not."""
    global _compiled
    if _compiled is None:
        _compiled = _load()
    module, why = _compiled
    if module is not None and module.SOURCE_SHA256 != source_hash():  # edited since the import
        return None, f"the compiled module is older than {SOURCE.name} (run make venv)"
    return module, why


def _load() -> tuple[ModuleType | None, str | None]:
    found = sorted(FOLDER.glob(NAME + "*" + importlib.machinery.EXTENSION_SUFFIXES[0]))
    if not found:
        return None, f"no compiled module in {FOLDER} (run make venv)"
    try:
        spec = importlib.util.spec_from_file_location(NAME, found[0])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
    except Exception as err:  # a broken or foreign build: the source module judges, noted
        sys.modules.pop(NAME, None)
        return None, f"the compiled module does not load ({type(err).__name__}: {err})"
    if getattr(module, "SOURCE_SHA256", None) != source_hash():
        return None, f"the compiled module is older than {SOURCE.name} (run make venv)"
    return module, None


def build(folder: Path = FOLDER) -> Path:
    """Compile the current ``fastmodel.py`` with mypyc into ``folder``; the extension's path."""
    raw = SOURCE.read_bytes()
    text, digest = raw.decode(), hashlib.sha256(raw).hexdigest()  # the hash of what is compiled
    absolute, count = re.subn(
        r"^from \.(\w*) import", r"from kvspec.conformance.\1 import", text, flags=re.M
    )
    if count == 0 or re.search(r"^from \.", absolute, flags=re.M):
        raise SystemExit(f"{SOURCE}: expected relative imports of the form 'from .x import'")
    absolute += f'\n\nSOURCE_SHA256 = "{digest}"\n"""The hash of the source compiled."""\n'
    with tempfile.TemporaryDirectory(prefix="kvspec-mypyc-") as work:
        (Path(work) / f"{NAME}.py").write_text(absolute)
        # mypy reads the package from the venv's link to the repository (see pyproject.toml);
        # kvspec/__init__.py names the LLM engine for type checkers, which would pull in torch
        # and transformers (minutes): the fast model needs none of it.
        (Path(work) / "mypy.ini").write_text(
            "[mypy]\n"
            f"mypy_path = {Path(sys.prefix) / 'mypy-path'}\n"
            "check_untyped_defs = True\n"
            "strict_equality = True\n"
            "[mypy-kvspec.impl,kvspec.impl.*,torch,torch.*,transformers,transformers.*]\n"
            "follow_imports = skip\n"
            "[mypy-kvspec.conformance.*]\n"  # as in pyproject.toml: their errors not reported
            "follow_imports = silent\n"
        )
        config = ["--config-file", "mypy.ini", "--cache-dir", str(folder / "mypy")]
        subprocess.run([sys.executable, "-m", "mypyc", *config, f"{NAME}.py"], cwd=work, check=True)
        built = sorted(Path(work).glob(NAME + "*" + importlib.machinery.EXTENSION_SUFFIXES[0]))
        if len(built) != 1:
            raise SystemExit(f"mypyc built {built}, expected one extension named {NAME}")
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(NAME + "*"):
            old.unlink()
        target = folder / built[0].name
        shutil.copyfile(built[0], target)
    return target


if __name__ == "__main__":
    print(f"compiled {SOURCE} -> {build()}")
