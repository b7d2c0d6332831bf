"""The package layout that shows the flow, as a re-runnable script: the judge moves up to where a
newcomer looks first (``judge/``, beside ``spec/`` and ``reference/``), engine integrations stay
in ``conformance/`` (adapters, their KV-event streams), whose import paths users type in
``--target``.

Run it from anywhere in the checkout (``python tools/relayout.py``, or ``--root DIR`` for
another checkout); it prints what it changed, and "nothing to change" once the layout is done.
Every step is idempotent, so it is run again after merging branches that still edit files at
their old paths:

1. ``git mv`` every tracked file under each old folder of ``MOVES`` to the new one (files a
   merge brought back under the old folder included), fixing what computes paths from the
   moved file's depth (``DEPTH_FIXUPS``, applied only to a file as it moves);
2. in every tracked text file, the dotted name ``kvspec.<old>`` becomes ``kvspec.<new>`` and the
   path ``<old>`` becomes ``<new>`` (lines that name this script, and the files of ``KEEP``, are left as written: they say
   what moved where);
3. relative imports that cross a moved folder's boundary become absolute (a file outside it
   importing into it, a moved file importing out of it, resolved from where it was);
4. ``TEXT_FIXUPS``: the few places that spell a moved folder in pieces;
5. the old dotted name stays importable: ``ALIASES`` writes a module there that warns once and
   hands out the new modules themselves (never a second copy of them).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

MOVES = (("conformance/judge", "judge"),)
"""(old folder, new folder), relative to the repository root (the ``kvspec`` package)."""

DEPTH_FIXUPS = {
    "judge/fastbuild.py": (
        ("HERE.parents[1]", "HERE.parent"),
        ("HERE.parents[2]", "HERE.parents[1]"),
    ),
}
"""For a file as it moves (its new path): replacements, in order, of what counts folders up
from it (one level less deep than before)."""

TEXT_FIXUPS = (
    ("setup.py", 'ROOT / "conformance" / "judge" / "fastbuild.py"', 'ROOT / "judge" / "fastbuild.py"'),
    ("judge/fastbuild.py", '"[mypy-kvspec.conformance.*]\\n"', '"[mypy-kvspec.conformance.*,kvspec.judge.*]\\n"'),
    ("pyproject.toml", '"kvspec.conformance.*", "kvspec.cli"', '"kvspec.conformance.*", "kvspec.judge.*", "kvspec.cli"'),
    ("docs/architecture.md", "verdict: judge/  Judge", "verdict: judge/" + " " * 14 + "Judge"),
)  # fmt: skip
"""(file, old text, new text): replaced where the old text is still there."""

ALIASES = {
    "conformance/judge.py": (
        "kvspec.conformance.judge",
        "kvspec.judge",
    ),
}
"""The module written at each old dotted name: (old name, new name)."""

ALIAS = '''"""``{old}`` moved to ``{new}`` (``tools/relayout.py``): this module
keeps the old name importable, with one warning; ``{old}.X`` is the module
``{new}.X`` itself."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

OLD, NEW = "{old}", "{new}"

warnings.warn(f"{{OLD}} moved to {{NEW}}: import it from there", DeprecationWarning, stacklevel=2)


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
'''

KEEP = ("tools/relayout.py", "tests/test_relayout.py")
"""Files that name the old layout on purpose (this script and its test): never rewritten."""

TEXT_SUFFIXES = (".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".json", ".yaml", ".yml", ".sh")
TEXT_NAMES = ("Makefile", "run")
RELATIVE = re.compile(r"^(\s*from\s+)(\.+)([\w.]*)(\s+import\b)", re.M)


def git(root: Path, *words: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *words], check=True, capture_output=True, text=True
    ).stdout


def tracked(root: Path) -> list[str]:
    return [line for line in git(root, "ls-files").splitlines() if (root / line).is_file()]


def dotted(folder: str) -> str:
    return "kvspec." + folder.replace("/", ".")


def package_of(path: str) -> list[str]:
    """The package a module file at ``path`` (relative to the root) belongs to, as parts."""
    return ["kvspec", *Path(path).parent.parts]


def resolve(package: list[str], dots: str, name: str) -> str:
    """A relative import's absolute module name from ``package``."""
    base = package[: len(package) - (len(dots) - 1)]
    return ".".join(base + ([name] if name else []))


def move_files(root: Path, changed: list[str]) -> dict[str, str]:
    """Step 1: every tracked file under an old folder, git-moved; {new path: old path}."""
    moved: dict[str, str] = {}
    files = tracked(root)
    for old, new in MOVES:
        for path in files:
            if not path.startswith(old + "/"):
                continue
            target = new + path[len(old) :]
            (root / target).parent.mkdir(parents=True, exist_ok=True)
            if (root / target).exists():
                raise SystemExit(f"{path} and {target} both exist: merge them by hand, then rerun")
            git(root, "mv", path, target)
            moved[target] = path
            changed.append(f"moved {path} -> {target}")
        leftover = root / old
        if leftover.is_dir() and not any(
            p.is_file() and "__pycache__" not in p.parts for p in leftover.rglob("*")
        ):
            shutil.rmtree(leftover)  # what git does not track: caches
    for path, fixes in DEPTH_FIXUPS.items():
        if path in moved:
            text = (root / path).read_text()
            for before, after in fixes:
                text = text.replace(before, after)
            (root / path).write_text(text)
    return moved


def rewrite_names(text: str) -> str:
    """Step 2 on one file's text: dotted names and paths, line by line."""
    out = []
    for line in text.splitlines(keepends=True):
        if "relayout" not in line:
            for old, new in MOVES:
                line = re.sub(rf"\b{re.escape(dotted(old))}\b", dotted(new), line)
                line = re.sub(rf"\b{re.escape(old)}\b", new, line)
        out.append(line)
    return "".join(out)


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def rewrite_relative(path: str, text: str, moved: dict[str, str]) -> str:
    """Step 3 on one module's text: relative imports that cross a moved folder's boundary
    become absolute. A moved file's relative import that leaves its folder was written for
    where the file was (this script makes every such import absolute as it moves the file; one
    found later came with a merge), so it is resolved from there."""
    here = package_of(path)

    def absolute(match: re.Match[str]) -> str:
        head, dots, name, tail = match.groups()
        target = resolve(here, dots, name)
        for old, new in MOVES:
            if path.startswith(new + "/") and not within(target, dotted(new)):
                was = moved.get(path, old + path[len(new) :])
                target = resolve(package_of(was), dots, name)
            if within(target, dotted(old)):
                target = dotted(new) + target[len(dotted(old)) :]
            if target != resolve(here, dots, name):
                return f"{head}{target}{tail}"
        return match.group(0)

    return RELATIVE.sub(absolute, text)


def tidy(root: Path, paths: list[str]) -> None:
    """The rewritten modules' imports sorted and their lines formatted as the project's
    linter wants them (ruff, from this Python's environment; skipped, and said, without it)."""
    paths = [p for p in paths if (root / p).is_file()]
    if not paths:
        return
    ruff = [sys.executable, "-m", "ruff"]
    try:
        subprocess.run([*ruff, "check", "-q", "--select", "I", "--fix", *paths], cwd=root)
        subprocess.run([*ruff, "format", "-q", *paths], cwd=root, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"ruff did not tidy the rewritten modules ({err}): run ruff check --fix, format")


def is_text(path: str) -> bool:
    name = Path(path).name
    return path.endswith(TEXT_SUFFIXES) or name in TEXT_NAMES


def relayout(root: Path) -> list[str]:
    """Run every step on the checkout at ``root``; what changed, in words."""
    changed: list[str] = []
    moved = move_files(root, changed)
    for path in tracked(root):
        if not is_text(path) or path in KEEP or path in ALIASES:
            continue
        before = (root / path).read_text()
        after = rewrite_names(before)
        if path.endswith(".py"):
            after = rewrite_relative(path, after, moved)
        for file, old, new in TEXT_FIXUPS:
            if file == path:
                after = after.replace(old, new)
        if after != before:
            (root / path).write_text(after)
            changed.append(f"rewrote {path}")
    tidy(root, [line.split()[-1] for line in changed if line.endswith(".py")])
    for path, (old, new) in ALIASES.items():
        text = ALIAS.format(old=old, new=new)
        alias = root / path
        if not alias.exists() or alias.read_text() != text:
            alias.write_text(text)
            git(root, "add", path)
            changed.append(f"wrote the alias {path}")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", type=Path, help="the checkout (default: the one this script is in)"
    )
    args = parser.parse_args(argv)
    here = args.root or Path(__file__).resolve().parent
    root = Path(git(here, "rev-parse", "--show-toplevel").strip())
    changed = relayout(root)
    for line in changed:
        print(line)
    print(f"{len(changed)} change(s)" if changed else "nothing to change: the layout is done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
