"""JUnit XML reports (``--junit FILE`` of ``kvspec check``, ``fuzz`` and ``which-policy``), so
that a CI system shows kvspec's findings as failed tests.

One ``<testsuite>`` per command, one ``<testcase>`` per trace judged (``check``), per fuzzed
cell (``fuzz``) or per (policy, discipline) (``which-policy``). A finding is a ``<failure>``
whose text is the report kvspec prints; an unreadable input an ``<error>``; an undecided
cell (nothing ran in the budget) ``<skipped>``. The layout is the common one of JUnit XML as
Jenkins, GitLab and GitHub's test reporters read it (``testsuites/testsuite/testcase`` with
``tests``, ``failures``, ``errors``, ``skipped`` and ``time`` counts).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .report import Report
    from .which import Cell


@dataclass
class Case:
    """One test case: its name, seconds, and at most one outcome other than passing."""

    name: str
    classname: str
    seconds: float = 0.0
    failure: tuple[str, str] | None = None
    """(message, text) of a finding."""
    error: str | None = None
    skipped: str | None = None


@dataclass
class Suite:
    name: str
    cases: list[Case] = field(default_factory=list)


def _clean(text: str) -> str:
    """``text`` without the characters XML 1.0 cannot hold (a trace's bytes may reach here)."""
    return "".join(c for c in text if c in "\t\n\r" or (" " <= c <= "\ud7ff") or c >= "\ue000")


def to_xml(suites: list[Suite]) -> bytes:
    root = ET.Element("testsuites")
    for suite in suites:
        failures = sum(1 for c in suite.cases if c.failure)
        errors = sum(1 for c in suite.cases if c.error)
        skipped = sum(1 for c in suite.cases if c.skipped)
        element = ET.SubElement(root, "testsuite", name=suite.name, tests=str(len(suite.cases)),
                                failures=str(failures), errors=str(errors), skipped=str(skipped),
                                time=f"{sum(c.seconds for c in suite.cases):.3f}")  # fmt: skip
        for case in suite.cases:
            item = ET.SubElement(element, "testcase", name=_clean(case.name),
                                 classname=case.classname, time=f"{case.seconds:.3f}")  # fmt: skip
            if case.failure:
                message, text = case.failure
                ET.SubElement(
                    item, "failure", message=_clean(message), type="finding"
                ).text = _clean(text)
            elif case.error:
                ET.SubElement(item, "error", message=_clean(case.error), type="bad input")
            elif case.skipped:
                ET.SubElement(item, "skipped", message=_clean(case.skipped))
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def write_junit(path: str, suites: list[Suite]) -> None:
    with open(path, "wb") as out:
        out.write(to_xml(suites) + b"\n")


def check_suite(reports: list[Report]) -> Suite:
    """``kvspec check``: one case per trace (or KV-event capture)."""
    suite = Suite("kvspec check")
    for r in reports:
        case = Case(r.path, "kvspec.check", r.seconds)
        if r.exit_code == 1:
            case.failure = (f"{r.invariant}: {r.message}", r.text())
        elif r.exit_code == 2:
            case.error = r.error or "unreadable"
        suite.cases.append(case)
    return suite


def fuzz_suite(name: str, seconds: float, outcome: str, text: str) -> Suite:
    """``kvspec fuzz``: the one cell fuzzed; ``outcome`` is holds, finding or undecided."""
    case = Case(name, "kvspec.fuzz", seconds)
    if outcome == "finding":
        case.failure = (text.splitlines()[-2] if text.count("\n") else text, text)
    elif outcome == "undecided":
        case.skipped = text
    return Suite("kvspec fuzz", [case])


def which_suite(path: str, cells: list[Cell]) -> Suite:
    """``kvspec which-policy``: one case per (policy, discipline); a cell that does not hold is
    a failure (it is information, not an error: the exit code says whether any holds)."""
    suite = Suite(f"kvspec which-policy {path}")
    for cell in cells:
        case = Case(
            f"{cell.policy} ({cell.discipline})", "kvspec.which_policy", cell.report.seconds
        )
        if cell.report.exit_code == 1:
            case.failure = (cell.verdict(), cell.report.text())
        elif cell.report.exit_code == 2:
            case.error = cell.verdict()
        suite.cases.append(case)
    return suite
