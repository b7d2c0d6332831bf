"""The compiled fast path: building the judge's core and the fast model with mypyc, and choosing
which build judges.

``make venv`` runs ``python -m kvspec.judge.fastbuild`` (again whenever one of
``COMPILED`` or this file changes): it copies the modules of ``COMPILED`` into a package of their
own, ``kvspec_fast`` (relative imports between them kept, every other relative import made
absolute), writes the SHA-256 of their sources into its ``__init__.py`` as ``SOURCE_SHA256``,
compiles them with mypyc as one group and keeps the result in ``<venv>/kvspec-mypyc/`` (the folder
of the interpreter that built it, so another interpreter never loads it). The compiled package
has a name of its own, so it never shadows the source: ``fast_judge`` imports it from that folder,
and only when its ``SOURCE_SHA256`` is the hash of the current sources.

A wheel (``setup.py``, the build backend's hook) compiles the same copies (``prepare`` writes them
and the mypy configuration both builds use) with ``mypyc.build.mypycify`` and installs the package
``kvspec_fast`` beside ``kvspec``. Without mypyc, with ``KVSPEC_PURE_PYTHON=1``, or when the C
compile fails, the wheel is pure Python and ``kvspec check`` notes it (without the "(run make
venv)" that only a checkout can follow). ``fast_judge`` looks in ``<venv>/kvspec-mypyc/`` first (a
developer's fresh build), then beside the installed package (a wheel).

This file is also loaded by ``setup.py`` on its own (by path, before kvspec is installed): it
imports only the standard library at module level.

``fast_judge(config)`` answers ``(judge, note)``: a ``Judge`` over the ``FastModel`` of the
compiled build and no note, or of the source (``kvspec.judge``, the same verdicts,
about a third of the speed) and a note saying why (not built, older than the source, not
loadable, or ``KVSPEC_FAST_MODEL=source``). The note is never silent and never on stderr (where
an unreadable file gets exactly one line): ``kvspec check`` appends it to its report
(``Report.note``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Collection

    from kvspec.spec import Config

NAME = "kvspec_fast"
"""The compiled package's own name (never ``kvspec.judge``)."""
HERE = Path(__file__).resolve().parent
COMPILED = ("ids.py", "fastmodel.py", "core.py")
"""The modules of the hot path, compiled together (in import order)."""
FOLDER = Path(sys.prefix) / "kvspec-mypyc"
"""Where ``make venv`` keeps the build: in the virtual environment that built it."""
INSTALLED = HERE.parents[1]
"""Where a wheel installs ``kvspec_fast``: beside the ``kvspec`` package (site-packages)."""
PURE_ENV = "KVSPEC_PURE_PYTHON"
"""Set (to anything but empty or 0) when building a wheel: no compiled fast model."""
ENV = "KVSPEC_FAST_MODEL"
"""``source``: judge with the source modules even when the compiled ones are current."""

_compiled: tuple[ModuleType | None, str | None] | None = None


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in COMPILED:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return digest.hexdigest()


_hashed: tuple[tuple[tuple[str, int, int], ...], str] | None = None
"""The sources' files as last hashed (path, modification time, size) and their hash."""


def current_source_hash() -> str:
    """``source_hash()``, computed again only when a source's path, modification time or size
    has changed since it was last computed: ``compiled`` asks on every judge it builds (the
    fuzzer builds one per run), and a stat of each file costs a tenth of reading and hashing
    them."""
    global _hashed
    files = tuple(
        (path, stat.st_mtime_ns, stat.st_size)
        for path in (os.path.join(HERE, name) for name in COMPILED)
        for stat in (os.stat(path),)
    )
    if _hashed is None or _hashed[0] != files:
        _hashed = (files, source_hash())
    return _hashed[1]


def fast_judge(
    config: Config, unknown_ids: str = "finding", invariants: Collection[str] | None = None
) -> tuple[Any, str | None]:
    """A ``Judge`` over the fast model, and a note when it is not the compiled one."""
    from . import core

    if os.environ.get(ENV) == "source":
        note = f"fast model from source ({ENV}=source)"
        return core.Judge.fast(config, unknown_ids, invariants), note
    module, why = compiled()
    if module is None:
        note = f"fast model from source, about a third of the speed: {why}"
        return core.Judge.fast(config, unknown_ids, invariants), note
    return module.Judge.fast(config, unknown_ids, invariants), None


def compiled() -> tuple[ModuleType | None, str | None]:
    """The compiled core if it is built from the current sources, else None and why not."""
    global _compiled
    if _compiled is None:
        _compiled = _load()
    module, why = _compiled
    if module is not None and _stamp() != current_source_hash():  # edited since the import
        return None, f"the compiled module is older than its source{_how_to_build()}"
    return module, why


def _how_to_build() -> str:
    """In a checkout, how to rebuild; an installed package has no make."""
    return " (run make venv)" if (HERE.parent / "Makefile").is_file() else ""


def _stamp() -> str | None:
    package = sys.modules.get(NAME)
    return getattr(package, "SOURCE_SHA256", None)


def _built(folder: Path) -> bool:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    package = folder / NAME
    return package.is_dir() and any(package.glob("*" + suffix))


def _load() -> tuple[ModuleType | None, str | None]:
    folder = next((f for f in (FOLDER, INSTALLED) if _built(f)), None)
    if folder is None:
        if _how_to_build():
            return None, f"no compiled module in {FOLDER}{_how_to_build()}"
        return None, "no compiled module installed"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    try:
        module = importlib.import_module(f"{NAME}.core")
    except Exception as err:  # a broken or foreign build: the source judges, noted
        for name in [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]:
            sys.modules.pop(name, None)
        return None, f"the compiled module does not load ({type(err).__name__}: {err})"
    if _stamp() != source_hash():
        return None, f"the compiled module is older than its source{_how_to_build()}"
    return module, None


def prepare(work: Path) -> tuple[list[Path], Path]:
    """Write the package ``kvspec_fast`` (the copies of ``COMPILED`` and its ``__init__.py``) and
    a mypy configuration into ``work``; return the copies and the configuration's path.
    ``work/path/kvspec`` links to the package, for mypy."""
    package = work / NAME
    package.mkdir(parents=True, exist_ok=True)
    local = {name[:-3] for name in COMPILED}
    copies = []
    for name in COMPILED:
        text = (HERE / name).read_text()

        def absolute(match: re.Match[str]) -> str:
            module = match.group(1)
            if module in local:
                return match.group(0)
            return f"from kvspec.judge.{module} import"

        copy = package / name
        copy.write_text(re.sub(r"^from \.(\w+) import", absolute, text, flags=re.M))
        copies.append(copy)
    (package / "__init__.py").write_text(
        f'"""The compiled hot path of kvspec (judge/fastbuild.py)."""\n\n'
        f'SOURCE_SHA256 = "{source_hash()}"\n'
    )
    link = work / "path" / "kvspec"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(HERE.parent, target_is_directory=True)
    config = work / "mypy.ini"
    # kvspec/__init__.py names the LLM engine for type checkers, which would pull in torch and
    # transformers (minutes): the hot path needs none of it.
    config.write_text(
        "[mypy]\n"
        f"mypy_path = {link.parent}\n"
        "check_untyped_defs = True\n"
        "strict_equality = True\n"
        "ignore_missing_imports = True\n"
        "[mypy-kvspec.impl,kvspec.impl.*,torch,torch.*,transformers,transformers.*]\n"
        "follow_imports = skip\n"
        "[mypy-kvspec.conformance.*,kvspec.judge.*]\n"  # as in pyproject.toml: their errors not reported
        "follow_imports = silent\n"
    )
    return copies, config


def build(folder: Path = FOLDER) -> Path:
    """Compile the current ``COMPILED`` modules with mypyc into ``folder``; the package's path."""
    with tempfile.TemporaryDirectory(prefix="kvspec-mypyc-") as work:
        copies, mypy_ini = prepare(Path(work))
        package = Path(work) / NAME
        config = ["--config-file", mypy_ini.name, "--cache-dir", str(folder / "mypy")]
        sources = [str(copy.relative_to(work)) for copy in copies]
        subprocess.run([sys.executable, "-m", "mypyc", *config, *sources], cwd=work, check=True)
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        # in place: the package's modules, and the group's shared library
        built = sorted([*Path(work).glob("*" + suffix), *package.glob("*" + suffix)])
        if len([p for p in built if p.parent == package]) != len(COMPILED):
            raise SystemExit(f"mypyc built {built}, expected one extension per module of {NAME}")
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder / NAME, ignore_errors=True)
        for old in [*folder.glob("*__mypyc*"), *folder.glob("kvspec_fastmodel_mypyc*")]:
            old.unlink()
        (folder / NAME).mkdir()
        shutil.copyfile(package / "__init__.py", folder / NAME / "__init__.py")
        for path in built:
            target = folder / path.relative_to(work)
            shutil.copyfile(path, target)
    return folder / NAME


if __name__ == "__main__":
    print(f"compiled {', '.join(COMPILED)} -> {build()}")
