"""Running SGLang-side check scripts from the kvspec test suite: the ``.venv-sglang``
environment, the skip mark for a machine without it, and one subprocess per script that runs
every case and hands each its line (SGLang takes seconds to import, so the cases of one test
file share one process). Used by ``tests/test_sglang_swa.py`` and ``tests/test_sglang_mamba.py``
(``tests/sglang_swa_checks.py``, ``tests/sglang_mamba_checks.py`` print one line per case, and
``judge-trace`` two)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
from run_once import once

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-sglang"

needs_sglang = pytest.mark.skipif(
    not (VENV / ".stamp").exists(), reason="no .venv-sglang: run `make thirdparty` to build it"
)


def run_cases(script: str, cases: tuple[str, ...]) -> dict[str, str]:
    """Each case's line printed by ``script`` (a path under ``tests/``) run once in
    ``.venv-sglang`` with every case; ``judge-trace``'s two lines joined. Once per test run, the
    xdist workers sharing it (``tests/run_once.py``)."""
    name = Path(script).stem + "-" + hashlib.sha256(" ".join(cases).encode()).hexdigest()[:12]
    return once(name, lambda: _run_cases(script, cases))


def _run_cases(script: str, cases: tuple[str, ...]) -> dict[str, str]:
    done = subprocess.run(
        [str(VENV / "bin" / "python"), script, *cases],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()[-len(cases) - 1 :]  # judge-trace prints two lines
    said = dict(zip(cases, lines, strict=False))
    said["judge-trace"] = "\n".join(lines[-2:])
    return said
