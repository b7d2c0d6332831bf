"""CI-ready output (issue #34): ``--junit FILE`` of ``check``, ``fuzz`` and ``which-policy``
is JUnit XML whose counts agree with its test cases, a finding a ``<failure>`` with kvspec's
report, an unreadable input an ``<error>``, an undecided cell ``<skipped>``; and
``which-policy`` names the policies a trace conforms to."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from edges import run, seed_counterexample

from kvspec.conformance.trace import write_trace


def junit(path: Path) -> list[ET.Element]:
    """The test cases of a JUnit file, after checking its structure: a ``testsuites`` root whose
    suites' ``tests``/``failures``/``errors``/``skipped`` counts match their cases, each case
    named, with a numeric ``time`` and at most one outcome element."""
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    cases = []
    for suite in root:
        assert suite.tag == "testsuite" and suite.get("name")
        mine = list(suite)
        assert all(c.tag == "testcase" and c.get("name") and c.get("classname") for c in mine)
        for key, tag in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped")):
            assert int(suite.get(key, "-1")) == sum(1 for c in mine if c.find(tag) is not None)
        assert int(suite.get("tests", "-1")) == len(mine)
        for case in mine:
            float(case.get("time", "x"))
            assert len(list(case)) <= 1
        cases += mine
    return cases


@pytest.fixture
def traces(tmp_path: Path) -> dict[str, Path]:
    config, events = seed_counterexample()
    zombie = tmp_path / "zombie.jsonl"
    write_trace(zombie, config, events)
    clean = tmp_path / "clean.jsonl"
    done = run(["simulate", "--policy", "deferred", "--discipline", "general", "--requests", "20",
                "--blocks", "24", "--block-size", "4", "--out", str(clean), "--format", "v1"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{}\n")
    return {"zombie": zombie, "clean": clean, "broken": broken}


def test_check_junit_has_one_case_per_trace(traces: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "check.xml"
    done = run(["check", *map(str, traces.values()), "--junit", str(out)])
    assert done.returncode == 2, done.stdout + done.stderr
    cases = {c.get("name"): c for c in junit(out)}
    assert set(cases) == {str(p) for p in traces.values()}
    failure = cases[str(traces["zombie"])].find("failure")
    assert failure is not None and "NoUnwrittenPublish" in (failure.get("message") or "")
    assert "minimal history" in (failure.text or "")
    assert cases[str(traces["broken"])].find("error") is not None
    assert len(list(cases[str(traces["clean"])])) == 0


def test_fuzz_junit_reports_the_cell(tmp_path: Path) -> None:
    found, nothing = tmp_path / "found.xml", tmp_path / "nothing.xml"
    done = run(["fuzz", "--policy", "eager-unsafe", "--discipline", "general", "--seconds", "30",
                "--junit", str(found)])  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    (case,) = junit(found)
    failure = case.find("failure")
    assert failure is not None and "violated: NoUnwrittenPublish" in (failure.text or "")
    done = run(["fuzz", "--policy", "deferred", "--seconds", "1e-9", "--junit", str(nothing)])
    assert done.returncode == 3
    (case,) = junit(nothing)
    assert case.find("skipped") is not None


def test_which_policy_names_what_a_trace_conforms_to(
    traces: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "which.xml"
    done = run(["which-policy", str(traces["clean"]), "--junit", str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = done.stdout.splitlines()[-1]
    assert "deferred (general)" in verdict and "eager-unsafe" not in verdict
    cases = {c.get("name"): c for c in junit(out)}
    assert cases["deferred (general)"].find("failure") is None
    assert cases["eager-unsafe (general)"].find("failure") is not None


def test_which_policy_of_a_trace_that_breaks_an_invariant_everywhere(
    traces: dict[str, Path],
) -> None:
    done = run(["which-policy", str(traces["zombie"])])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NoUnwrittenPublish" in done.stdout and "conforms to no policy" in done.stdout


def test_which_policy_of_an_unreadable_trace_is_one_line(traces: dict[str, Path]) -> None:
    done = run(["which-policy", str(traces["broken"])])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
