"""The vLLM environments kvspec's tests run the adapter in: one per supported release
(``make thirdparty``: ``.venv-vllm`` holds 0.33.0, ``.venv-vllm-VERSION`` the others;
``conformance/adapters/vllm_adapter/versions.py`` lists them). ``VENVS`` parametrizes a test over
them, each skipped with the reason where it is not built. ``run_in`` runs a script of the
repository in one of them, as the tests that need vLLM's objects do (``run_script``: through
``tests/preforked.py``, vLLM imported once per environment and pytest process)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import preforked
import pytest

ROOT = Path(__file__).resolve().parent.parent
RELEASES = {"0.33.0": ".venv-vllm", "0.34.0": ".venv-vllm-0.34.0"}


def _param(version: str, folder: str) -> object:
    built = (ROOT / folder / ".stamp").exists()
    why = f"no {folder} (vLLM {version}): run `make thirdparty` to build it"
    return pytest.param(
        ROOT / folder, id=f"vllm-{version}", marks=pytest.mark.skipif(not built, reason=why)
    )


VENVS = [_param(version, folder) for version, folder in RELEASES.items()]


def run_script(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``venv``'s python with ``argv`` at the repository root, vLLM on the CPU (``.pp`` first on
    the path: a worktree's kvspec where one is linked there); its exit code is the caller's to
    judge (a findings script exits 1 where the bug is present)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / ".pp"), "VLLM_TARGET_DEVICE": "cpu"}
    return preforked.run(venv / "bin" / "python", argv, cwd=ROOT, env=env, timeout=600)


def run_in(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``run_script`` with exit 0 asserted, the tail of the child's stderr as the message."""
    done = run_script(venv, *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
