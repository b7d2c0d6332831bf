"""The declared twins (kvspec/twins.py): every module that restates the spec is registered, says
so (``TWIN_OF``), and names equality tests that exist."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import kvspec
from kvspec.twins import TWINS

ROOT = Path(__file__).resolve().parents[1]
SKIP = ("kvspec.impl", "kvspec.conformance.adapters", "kvspec.pytest_plugin")
"""Not imported here: torch, third-party engines (their modules are not twins)."""


def declared() -> set[str]:
    """Modules whose source declares ``TWIN_OF`` (read, not imported: some need z3)."""
    found = set()
    for info in pkgutil.walk_packages(kvspec.__path__, "kvspec."):
        if info.name.startswith(SKIP):
            continue
        spec = importlib.util.find_spec(info.name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "TWIN_OF" for t in node.targets
            ):
                found.add(info.name.removesuffix(".__init__"))
    return found


def test_every_form_of_the_spec_is_registered_and_every_registered_form_says_so() -> None:
    assert declared() == {twin.form for twin in TWINS}


def test_every_twin_names_tests_that_exist() -> None:
    for twin in TWINS:
        assert twin.shown_by, twin.form
        for node in twin.shown_by:
            path, _, name = node.partition("::")
            tree = ast.parse((ROOT / path).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in names, f"{twin.form}: {node} does not exist"
