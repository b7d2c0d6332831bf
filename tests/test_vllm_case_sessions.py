"""The shared vLLM sessions of the plugin's case files (``tests/vllm_case_sessions.py``), without
vLLM: every test file that reads a case file's part is registered with that case file (a case
file a test asks for but the registry lacks would not be in the session), and a session's
results split per case file even where two files name a test alike (JUnit by class name, the
plugin's report by node id), a module skipped at collection going to its own file; and a pass
another xdist worker holds is read once it is written, never run twice."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock
from vllm_case_sessions import CASE_FILES, CaseSessions, split

TESTS = Path(__file__).resolve().parent


def test_every_case_file_read_through_the_sessions_is_registered() -> None:
    readers = {}
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        if "vllm_case_sessions: CaseSessions" in text:  # the fixture, asked for
            cases = set(re.findall(r"\b(case_\w+\.py)\b", text))
            readers[path.name] = cases
    assert readers, "no test file reads the shared sessions"
    registered = {}
    for case, test in CASE_FILES.items():
        assert (TESTS / "vllm_cases" / case).exists() and (TESTS / test).exists(), case
        registered.setdefault(test, set()).add(case)
    readers.pop(Path(__file__).name, None)
    assert readers == registered, "tests/vllm_case_sessions.py's CASE_FILES: one line a case"


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="" name="case_b"><skipped message="collection skipped">no such setting
</skipped></testcase>
<testcase classname="case_a" name="test_same[1]" />
<testcase classname="case_a" name="test_other"><failure message="boom" /></testcase>
<testcase classname="case_c.TestGroup" name="test_same[1]"><failure message="x" /></testcase>
</testsuite></testsuites>"""
REPORT = {
    "tests": {
        "case_a.py::test_same[1]": {"outcome": "judged"},
        "case_a.py::test_other": {"outcome": "violation"},
        "case_c.py::TestGroup::test_same[1]": {"outcome": "violation"},
    }
}


def test_a_session_splits_per_case_file() -> None:
    record = {"out": "", "junit": JUNIT, "report": REPORT}
    a = split(record, "case_a.py")
    assert a.outcomes == {"test_same[1]": "passed", "test_other": "failed"}, a
    assert a.tests == {
        "test_same[1]": {"outcome": "judged"},
        "test_other": REPORT["tests"]["case_a.py::test_other"],
    }
    assert a.skipped == {}
    b = split(record, "case_b.py")
    assert b.outcomes == {"case_b": "passed"} and "no such setting" in b.skipped["case_b"], b
    assert b.tests == {}
    c = split(record, "case_c.py")
    assert c.outcomes == {"test_same[1]": "failed"}, c
    assert c.tests == {"test_same[1]": {"outcome": "violation"}}, c
    assert split({**record, "report": None}, "case_a.py").tests == {}  # the bare pass


def test_a_pass_another_worker_holds_is_read_not_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers of one run: this one finds the bare pass's lock taken, runs the judged pass
    meanwhile, then waits and reads the bare pass the other wrote; a third asker runs nothing."""
    ran = []

    def run(self: CaseSessions, venv: Path, mode: str) -> dict:
        ran.append(mode)
        return {"error": None, "out": mode, "junit": JUNIT, "report": REPORT}

    monkeypatch.setattr(CaseSessions, "_run", run)
    sessions = CaseSessions(tmp_path, ("case_a.py",))
    tmp_path.mkdir(exist_ok=True)
    other = FileLock(str(tmp_path / "venv-x-bare.lock"))
    other.acquire()
    parts: list = []
    asker = threading.Thread(
        target=lambda: parts.extend(sessions.parts(Path(".venv-x"), "case_a.py")), daemon=True
    )  # a daemon: a planted wait never holds the test run open
    asker.start()
    record = tmp_path / "venv-x-judged.json"
    for _ in range(500):
        if record.exists():
            break
        time.sleep(0.01)
    assert ran == ["judged"] and asker.is_alive()  # the free pass run, the held one awaited
    (tmp_path / "venv-x-bare.json").write_text(
        json.dumps({"error": None, "out": "other", "junit": JUNIT, "report": None})
    )
    other.release()
    asker.join(timeout=10)
    assert [part.out for part in parts] == ["other", "judged"], parts  # in the asked order
    assert parts[1].tests["test_other"] == {"outcome": "violation"}
    again = CaseSessions(tmp_path, ("case_a.py",)).parts(Path(".venv-x"), "case_a.py")
    assert ran == ["judged"] and [part.out for part in again] == ["other", "judged"]
