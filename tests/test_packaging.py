"""The repository root installs as the ``kvspec`` package, with its console script."""

import importlib
import importlib.metadata
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["spec", "reference", "conformance", "impl"])
def test_subpackage_imports_from_working_tree(name: str) -> None:
    module = importlib.import_module(f"kvspec.{name}")
    assert module.__file__ is not None
    # The editable install must point at this checkout, not at a stale copy.
    assert Path(module.__file__).resolve() == REPO_ROOT / name / "__init__.py"


def test_version_matches_metadata() -> None:
    import kvspec

    assert kvspec.__version__ == importlib.metadata.version("kvspec")


def test_console_script_installed_next_to_python() -> None:
    script = Path(sys.executable).parent / "kvspec"
    assert script.is_file(), f"no console script at {script}"
    (entry_point,) = importlib.metadata.entry_points(group="console_scripts", name="kvspec")
    assert entry_point.value == "kvspec.cli:main"
    assert callable(entry_point.load())
