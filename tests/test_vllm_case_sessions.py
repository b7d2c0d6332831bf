"""The shared vLLM sessions of the plugin's case files (``tests/vllm_case_sessions.py``), without
vLLM: every test file that reads a case file's part is registered with that case file (a case
file a test asks for but the registry lacks would not be in the session), and a session's
results split per case file even where two files name a test alike (JUnit by class name, the
plugin's report by node id), a module skipped at collection going to its own file."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_case_sessions import CASE_FILES, split

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
