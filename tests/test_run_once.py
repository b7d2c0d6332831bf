"""``tests/run_once.py``: workers of one run (one ``PYTEST_XDIST_TESTRUNUID``) that ask for a
name at once compute it once and all get its result; another run computes it again."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ASK = """\
import sys, time, pathlib
from run_once import once
def compute():
    with open(sys.argv[1], "a") as log:
        log.write("computed\\n")
    time.sleep(1)
    return {"answer": [42]}
print(once("probe", compute))
"""


def _workers(log: Path, run: str, count: int) -> list[str]:
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": run, "PYTHONPATH": str(TESTS)}
    started = [
        subprocess.Popen(
            [sys.executable, "-c", ASK, str(log)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(count)
    ]
    return [process.communicate(timeout=120)[0] for process in started]


def test_one_computation_per_run(tmp_path: Path) -> None:
    log = tmp_path / "log"
    run = uuid.uuid4().hex
    assert _workers(log, run, 3) == ["{'answer': [42]}\n"] * 3
    assert log.read_text() == "computed\n"
    _workers(log, uuid.uuid4().hex, 1)  # another run
    assert log.read_text() == "computed\n" * 2
