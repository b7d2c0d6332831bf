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


ADAPTERS = sorted(
    "kvspec."
    + ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
    for path in (REPO_ROOT / "conformance" / "adapters").rglob("*.py")
)
"""Every adapter module of the checkout (packages and modules), by its installed name."""

IMPORT_EACH = """
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        out[name] = ["ok", module.__file__]
    except ImportError as err:  # a third-party engine this interpreter lacks is no fault
        out[name] = ["missing", err.name or ""]
print(json.dumps(out))
"""


@pytest.mark.packaging
def test_the_built_wheel_ships_every_adapter(tmp_path: Path) -> None:
    """The wheel (pure Python, ``KVSPEC_PURE_PYTHON=1``) installed into a folder of its own
    imports every adapter module from there: none is left out of the package list (setup.py's
    ``packages``). An import may only fail for a third-party engine that is not installed."""
    import json
    import os
    import shutil
    import subprocess

    from test_wheel import _copy_checkout

    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    source, dist, target = tmp_path / "src", tmp_path / "dist", tmp_path / "target"
    _copy_checkout(source)
    env = {**os.environ, "KVSPEC_PURE_PYTHON": "1"}
    pip = [sys.executable, "-m", "pip"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)]
    built = subprocess.run(build, capture_output=True, text=True, env=env, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("kvspec-*.whl")
    install = [*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)]
    installed = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert "kvspec.conformance.adapters.sglang_adapter" in ADAPTERS
    env = {**os.environ, "PYTHONPATH": str(target)}
    ran = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *ADAPTERS],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    results = json.loads(ran.stdout.splitlines()[-1])
    for name in ADAPTERS:
        how, detail = results[name]
        if how == "ok":
            assert Path(detail).resolve().is_relative_to(target.resolve()), (name, detail)
        else:
            assert not detail.startswith("kvspec"), f"{name}: {detail} is not in the wheel"
    assert any(how == "ok" for how, _ in results.values())
