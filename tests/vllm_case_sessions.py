"""The plugin's case files (``tests/vllm_cases``) judged in one vLLM pytest session per supported
release and per pass, shared by every test that reads a case file's part.

Why: each ``tests/test_vllm_plugin_*.py`` used to start vLLM's pytest twice (without and with
kvspec's plugin) for its one case file, on every release; each session pays vLLM's import and
collection (about 15 s on a quiet 2-core machine, the tests themselves well under a second), so
the e2e stage paid that import four times per case file. Here the first test that asks for a
release's pass runs it over every registered case file whose test file is collected, and the
others read its results.

Under pytest-xdist the workers share the results through a folder of the whole run (the parent
of each worker's base temporary folder) and a file lock per (release, pass): a worker that finds
the one it needs taken by another runs the other pass meanwhile, then waits; a worker holds one
lock at a time, so none can wait on another in a cycle. A lock rather than ``--dist loadgroup``:
it holds under any ``-n`` and any ``--dist`` (a plain ``pytest`` included), where xdist groups
are ignored unless the command line asks for them, and it lets two workers run one release's two
passes at once.

Each part stays separable: the session runs with the case folder as its root directory, so every
node id carries its file's name (``case_cross.py::test_...``; from a temporary root directory
they all read ``::test_...`` and would collide across files) and JUnit's class name its module;
the plugin's report is split on the node id, JUnit's cases on the class name (a module skipped or
broken at collection is a case named after the module, with no class name).

A new case file joins by one line in ``CASE_FILES`` (``tests/test_vllm_case_sessions.py`` fails
while a test file that asks for the sessions is not registered with its case file). Left alone,
each in its own sessions: the crash test (``test_pytest_plugin.py``, ``case_crash.py``), which
asserts the summary's count of kvspec internal errors over its whole session (its planted crashes
are the errors counted) and runs without the CPU platform plugin; and ``test_pytest_plugin.py``'s
tests outside the e2e stage (the twelve files of ``test_the_plugin_judges_vllm_style_tests`` and
``test_without_the_plugin_every_case_passes``, ``case_loads.py``), which assert the counts of their
own session's summary ("14 failed", "45 passed", "31  judged and holding") on ``.venv-vllm``
alone, in ``make test``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock, Timeout
from test_pytest_plugin import CASES, CPU_PLATFORM, _pytest

CASE_FILES = {  # the case file -> the test file that reads its part: one line joins a case
    "case_admission.py": "test_vllm_plugin_admission.py",
    "case_answered.py": "test_vllm_plugin_answered.py",
    "case_chunked.py": "test_vllm_plugin_chunked.py",
    "case_cross.py": "test_vllm_plugin_cross.py",
    "case_hitbound.py": "test_vllm_plugin_hitbound.py",
    "case_hybrid.py": "test_vllm_plugin_hybrid.py",
    "case_lookahead.py": "test_vllm_plugin_lookahead.py",
    "case_rejected.py": "test_vllm_plugin_rejected.py",
    "case_reset.py": "test_vllm_plugin_reset.py",
    "case_winconn.py": "test_vllm_plugin_winconn.py",
    "case_window_connector.py": "test_vllm_plugin_window_connector.py",
}
PASSES = {  # a pass -> how its session loads the plugin (asked with --kvspec where loaded)
    "bare": ("-p", "no:kvspec.pytest_plugin"),
    "judged": ("-p", "kvspec.pytest_plugin"),
}
TIMEOUT = 1800  # seconds for one session over every case file (a busy 2-core machine included)


@dataclass(frozen=True)
class Part:
    """One case file's share of one session: the session's output (for messages), JUnit's
    outcome of each of the file's tests by name (``passed`` or ``failed``: a skip counts as
    passed, as JUnit has it), the skipped ones' reasons, and the plugin's report by name."""

    out: str
    outcomes: dict[str, str]
    skipped: dict[str, str]
    tests: dict[str, dict]


def split(record: dict, case: str) -> Part:
    """``case``'s part of a session's ``record`` (``CaseSessions._run``): its JUnit cases by class
    name (a module-level skip or collection error: the module's name, no class name), its report
    entries by node id; each keyed by the test's name, as JUnit has it (two alike: refused)."""
    module = case.removesuffix(".py")
    outcomes, skipped = {}, {}
    for test in ET.fromstring(record["junit"]).iter("testcase"):
        classname, name = test.get("classname") or "", test.get("name") or ""
        if classname.split(".")[0] != module and not (classname == "" and name == module):
            continue
        assert name not in outcomes, f"{case}: two JUnit cases named {name}"
        failed = any(child.tag in ("failure", "error") for child in test)
        outcomes[name] = "failed" if failed else "passed"
        for child in test.iter("skipped"):
            skipped[name] = f"{child.get('message', '')}: {child.text or ''}"
    tests: dict[str, dict] = {}
    for nodeid, entry in (record["report"] or {}).get("tests", {}).items():
        if nodeid.startswith(f"{case}::"):
            name = nodeid.split("::")[-1]  # as JUnit names it
            assert name not in tests, f"{case}: two tests named {name}"
            tests[name] = entry
    return Part(record["out"], outcomes, skipped, tests)


class CaseSessions:
    """The sessions of one pytest run (shared by its xdist workers through ``root``) over
    ``cases``, each run once per (release, pass) on first use."""

    def __init__(self, root: Path, cases: tuple[str, ...]) -> None:
        self.root, self.cases = root, cases
        self.records: dict[tuple[str, str], dict] = {}

    @classmethod
    def of(cls, session: pytest.Session, factory: pytest.TempPathFactory) -> CaseSessions:
        """The registered case files whose test file this run collected, their results under
        the run's shared temporary folder (the workers' common parent under xdist)."""
        base = factory.getbasetemp()
        root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
        collected = {item.path.name for item in session.items}
        cases = tuple(case for case, test in CASE_FILES.items() if test in collected)
        return cls(root / "vllm-case-sessions", cases)

    def parts(self, venv: Path, case: str, modes: tuple[str, ...] = tuple(PASSES)) -> list[Part]:
        """``case``'s parts of ``modes``' sessions on ``venv``, in that order: each session run
        here unless another worker has run it or is running it (then run what is free first)."""
        assert case in self.cases, (
            f"{case} is not among this run's case files {self.cases}: "
            "tests/vllm_case_sessions.py's CASE_FILES joins a case file to its test file"
        )
        self.root.mkdir(exist_ok=True)
        keys = [(venv.name.lstrip("."), mode) for mode in modes]  # no hidden files
        waiting = [key for key in keys if key not in self.records]
        while waiting:
            for key in waiting:
                lock = FileLock(str(self.root / f"{key[0]}-{key[1]}.lock"))
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    continue
                break
            else:  # every one being run by another worker: wait for the first
                key = waiting[0]
                lock = FileLock(str(self.root / f"{key[0]}-{key[1]}.lock"))
                lock.acquire()
            try:
                path = self.root / f"{key[0]}-{key[1]}.json"
                if not path.exists():
                    record = self._run(venv, key[1])
                    path.with_suffix(".part").write_text(json.dumps(record))
                    path.with_suffix(".part").replace(path)
                self.records[key] = json.loads(path.read_text())
            finally:
                lock.release()
            waiting.remove(key)
        parts = []
        for key in keys:
            record = self.records[key]
            assert record["error"] is None, f"{key[1]} session on {key[0]}: {record['error']}"
            parts.append(split(record, case))
        return parts

    def _run(self, venv: Path, mode: str) -> dict:
        """One session of every case file in ``venv``: its output, JUnit file and report, or
        what stopped it (then every test that reads it fails saying so)."""
        folder = self.root / f"{venv.name.lstrip('.')}-{mode}"
        folder.mkdir(exist_ok=True)  # left by a worker stopped mid-run: run again
        junit = folder / "junit.xml"
        argv = [str(CASES / case) for case in self.cases]
        argv += [*CPU_PLATFORM, *PASSES[mode], f"--junitxml={junit}"]
        start = time.monotonic()
        try:
            done, _ = _pytest(folder, *argv, venv=venv, rootdir=CASES, timeout=TIMEOUT)
        except subprocess.TimeoutExpired as err:
            return {"error": f"timed out after {err.timeout} s", "out": "", "junit": ""}
        out = done.stdout
        if not junit.exists():
            why = f"no JUnit file (exit {done.returncode}): {out[-2000:]}{done.stderr[-2000:]}"
            return {"error": why, "out": out}
        report = folder / "report.json"
        return {
            "error": None,
            "out": out,
            "junit": junit.read_text(),
            "report": json.loads(report.read_text()) if report.exists() else None,
            "seconds": round(time.monotonic() - start, 1),  # the session's wall time, for its cost
        }


def judge_case(
    sessions: CaseSessions,
    case: str,
    venv: Path,
    passing: tuple[str, ...],
    planted: dict[str, str],
) -> dict:
    """A vLLM-style case file's parts of the sessions without and with the plugin in ``venv``:
    without it exactly ``passing`` and ``planted`` run and pass; with it the same, but each
    planted test fails with a violation whose finding says what ``planted`` gives. The plugin's
    per-test report of the file."""
    bare_part, judged_part = sessions.parts(venv, Path(case).name)
    bare = bare_part.outcomes
    assert bare == dict.fromkeys((*passing, *planted), "passed"), bare
    judged, tests = judged_part.outcomes, judged_part.tests
    expected = {**bare, **dict.fromkeys(planted, "failed")}
    unexpected = {name: tests.get(name) for name in judged if judged[name] != expected.get(name)}
    assert judged == expected, (judged, unexpected)  # with the plugin's entry of each off one
    for name, finding in planted.items():
        assert tests[name]["outcome"] == "violation", tests[name]
        assert finding in tests[name]["finding"], tests[name]["finding"]
    return tests
