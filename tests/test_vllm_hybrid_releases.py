"""``tests/test_vllm_hybrid.py`` (vLLM's hybrid models: built from their ``config.json``, the
groups in the header and the events, what is not followed refused by name) in every supported
vLLM release's environment (``tests/vllm_venvs.py``), as subprocesses since vLLM's pins conflict
with ours."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from vllm_venvs import VENVS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("venv", VENVS)
def test_hybrid_models_on_every_release(venv: Path) -> None:
    argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:kvspec.pytest_plugin"]
    done = subprocess.run(
        [str(venv / "bin" / "python"), *argv, "tests/test_vllm_hybrid.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-2000:]
