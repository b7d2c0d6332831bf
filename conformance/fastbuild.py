"""The compiled fast model: building it with mypyc, and choosing which module judges.

``UNITS`` is the one list of source files compiled (one mypyc group; the first is the module whose
``FastChecker`` judges). Each is copied as a top-level module of its own name (``compiled_name``:
``fastmodel.py`` -> ``kvspec_fastmodel_mypyc``), with its relative imports made absolute (to the
compiled name of another unit, else to ``kvspec.conformance.<module>``) and the SHA-256 of the
group's sources appended as ``SOURCE_SHA256``; ``prepare`` writes those copies and the mypy
configuration that compiles them. Two builds use it:

* ``make venv`` runs ``python -m kvspec.conformance.fastbuild`` (again whenever a unit or this file
  changes): mypyc compiles the copies and the extensions go to ``<venv>/kvspec-mypyc/`` (the folder
  of the interpreter that built them, so another interpreter never loads them);
* a wheel (``setup.py``, the build backend's hook): the same copies, compiled by
  ``mypyc.build.mypycify``, installed as top-level extension modules beside the package. A plain
  source install that wants no compiler sets ``KVSPEC_PURE_PYTHON=1``; a failed compile leaves the
  wheel pure Python, with a warning.

The compiled modules have names of their own, so they never shadow the source. ``fast_model()``
answers ``(module, note)``: the compiled module and no note, or the source module
(``kvspec.conformance.fastmodel``, the same verdicts, about half the speed) and a note saying why
(not built, older than the source, not loadable, or ``KVSPEC_FAST_MODEL=source``). It looks in
``<venv>/kvspec-mypyc/`` first (a developer's fresh build), then for an installed module (a wheel),
and takes a build only when its ``SOURCE_SHA256`` is the hash of the current sources. The note is
never silent and never on stderr (where an unreadable file gets exactly one line): ``kvspec check``
appends it to its report (``Report.note``: the ``holds`` line, the end of a violation, and
``note`` in ``--json``; ``docs/checker.md``).

This file is also loaded by ``setup.py`` on its own (by path, before kvspec is installed): it
imports only the standard library at module level.
"""

from __future__ import annotations

import hashlib
import importlib
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

UNITS: tuple[str, ...] = ("fastmodel.py",)
"""The source files (in ``conformance/``) compiled together; the first one judges."""
HERE = Path(__file__).resolve().parent


def compiled_name(unit: str) -> str:
    """The top-level module a unit compiles to (never its own ``kvspec.conformance`` name)."""
    return f"kvspec_{Path(unit).stem}_mypyc"


NAME = compiled_name(UNITS[0])
"""The compiled module that judges."""
SOURCE = HERE / UNITS[0]
FOLDER = Path(sys.prefix) / "kvspec-mypyc"
"""Where ``make venv`` keeps the extensions: in the virtual environment that built them."""
ENV = "KVSPEC_FAST_MODEL"
"""``source``: judge with the source module even when the compiled one is current."""
PURE_ENV = "KVSPEC_PURE_PYTHON"
"""Set (to anything but empty or 0) when building a wheel: no compiled fast model."""
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]

_compiled: tuple[ModuleType | None, str | None] | None = None


def sources() -> list[Path]:
    """The group's source files (``SOURCE`` first)."""
    return [SOURCE] + [SOURCE.with_name(unit) for unit in UNITS[1:]]


def source_hash() -> str:
    """The SHA-256 of the group's sources (for one unit, of its bytes)."""
    files = sources()
    if len(files) == 1:
        return hashlib.sha256(files[0].read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


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
    """The compiled module if it is built from the current sources, else None and why not."""
    global _compiled
    if _compiled is None:
        _compiled = _load()
    module, why = _compiled
    if module is not None and module.SOURCE_SHA256 != source_hash():  # edited since the import
        return None, f"the compiled module is older than {SOURCE.name}{_how_to_build()}"
    return module, why


def _how_to_build() -> str:
    """In a checkout, how to rebuild; an installed package has no make."""
    return " (run make venv)" if (HERE.parent / "Makefile").is_file() else ""


def _load() -> tuple[ModuleType | None, str | None]:
    found = sorted(FOLDER.glob(NAME + "*" + SUFFIX))
    if found:
        try:
            module = _load_folder(FOLDER)
        except Exception as err:  # a broken or foreign build: the source module judges, noted
            for unit in UNITS:
                sys.modules.pop(compiled_name(unit), None)
            return None, f"the compiled module does not load ({type(err).__name__}: {err})"
    else:
        module = _installed()
        if module is None:
            where = (
                f"no compiled module in {FOLDER}"
                if _how_to_build()
                else "no compiled module installed"
            )
            return None, f"{where}{_how_to_build()}"
    if getattr(module, "SOURCE_SHA256", None) != source_hash():
        return None, f"the compiled module is older than {SOURCE.name}{_how_to_build()}"
    return module, None


def _load_folder(folder: Path) -> ModuleType:
    """Load the group's extensions from ``folder`` by path (shared library first)."""
    libraries = sorted(folder.glob("*__mypyc*" + SUFFIX))
    units = [sorted(folder.glob(compiled_name(u) + "*" + SUFFIX)) for u in UNITS]
    modules: dict[str, ModuleType] = {}
    for path in libraries + [found[0] for found in units if found]:
        name = path.name.split(".")[0]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules[NAME]


def _installed() -> ModuleType | None:
    """The group as installed by a wheel (top-level extension modules), if any."""
    if importlib.util.find_spec(NAME) is None:
        return None
    try:
        return importlib.import_module(NAME)
    except Exception:  # a broken install: noted as missing, the source module judges
        return None


def prepare(work: Path) -> tuple[list[Path], Path]:
    """Write the group's copies and a mypy configuration into ``work``; return the copies and
    the configuration's path. ``work/path/kvspec`` links to the package, for mypy."""
    work.mkdir(parents=True, exist_ok=True)
    stems = {Path(unit).stem for unit in UNITS}
    digest = source_hash()

    def absolute(match: re.Match[str]) -> str:
        module = match.group(1)
        target = compiled_name(module) if module in stems else f"kvspec.conformance.{module}"
        return f"from {target} import"

    copies = []
    for index, path in enumerate(sources()):
        text, count = re.subn(r"^from \.(\w*) import", absolute, path.read_text(), flags=re.M)
        if re.search(r"^from \.", text, flags=re.M):
            raise SystemExit(f"{path}: expected relative imports of the form 'from .x import'")
        if index == 0:
            text += f'\n\nSOURCE_SHA256 = "{digest}"\n"""The hash of the sources compiled."""\n'
        copy = work / f"{compiled_name(path.name)}.py"
        copy.write_text(text)
        copies.append(copy)
    link = work / "path" / "kvspec"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(HERE.parent, target_is_directory=True)
    config = work / "mypy.ini"
    # kvspec/__init__.py names the LLM engine for type checkers, which would pull in torch and
    # transformers (minutes): the fast model needs none of it.
    config.write_text(
        "[mypy]\n"
        f"mypy_path = {link.parent}\n"
        "check_untyped_defs = True\n"
        "strict_equality = True\n"
        "ignore_missing_imports = True\n"
        "[mypy-kvspec.impl,kvspec.impl.*,torch,torch.*,transformers,transformers.*]\n"
        "follow_imports = skip\n"
        "[mypy-kvspec.conformance.*]\n"  # as in pyproject.toml: their errors not reported
        "follow_imports = silent\n"
    )
    return copies, config


def build(folder: Path = FOLDER) -> Path:
    """Compile the current sources with mypyc into ``folder``; the judging extension's path."""
    with tempfile.TemporaryDirectory(prefix="kvspec-mypyc-") as work:
        copies, config = prepare(Path(work))
        options = ["--config-file", config.name, "--cache-dir", str(folder / "mypy")]
        names = [copy.name for copy in copies]
        subprocess.run([sys.executable, "-m", "mypyc", *options, *names], cwd=work, check=True)
        built = sorted(Path(work).glob("*" + SUFFIX))
        if not any(path.name.startswith(NAME + ".") for path in built):
            raise SystemExit(f"mypyc built {built}, expected an extension named {NAME}")
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*" + SUFFIX):
            old.unlink()
        for path in built:
            shutil.copyfile(path, folder / path.name)
    return folder / next(p.name for p in built if p.name.startswith(NAME + "."))


if __name__ == "__main__":
    print(f"compiled {', '.join(UNITS)} -> {build()}")
