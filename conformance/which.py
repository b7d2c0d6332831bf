"""``kvspec which-policy TRACE``: judge one trace under every registration policy and scheduling
discipline, and say which it conforms to.

A third-party engine's author knows what their engine does, not which of the spec's policy names
it is (README, "Policies"). Each (policy, discipline) is a spec judge over the trace's events with
the header's configuration but that policy and discipline (``Judge.stream``, as ``kvspec check``
judges with ``--engine spec``); the trace conforms to a cell when that judge finds nothing.
Several cells may hold (a trace that never preempts cannot tell ``vllm`` from ``general``, nor
``deferred`` from ``hide-uncommitted``); none holding means the engine does something no policy
models, or breaks an invariant under every one.

The policy names come from ``policy_names``, the one place that asks the spec for them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from kvspec.judge import Judge
from kvspec.spec import DISCIPLINES, OBSERVED_POLICIES

from .check import _judged
from .report import Report
from .trace import TraceError, open_trace


def policy_names(observed: bool = False) -> tuple[str, ...]:
    """The spec's registration policies (and, for an observed trace, those only observed
    judging has): the names ``kvspec fuzz --policy`` takes."""
    from kvspec.spec import POLICIES

    return tuple(POLICIES) + (tuple(OBSERVED_POLICIES) if observed else ())


@dataclass
class Cell:
    policy: str
    discipline: str
    report: Report
    declared: bool
    """Whether this is what the trace's header declares."""

    @property
    def holds(self) -> bool:
        return self.report.exit_code == 0

    def verdict(self) -> str:
        r = self.report
        if r.exit_code == 0:
            return "conforms"
        if r.exit_code == 1:
            return f"{r.invariant} at line {r.line}"
        return f"refused: {(r.error or '').split(': ', 2)[-1]}"


def which_policy(path: str) -> tuple[list[Cell], Report | None]:
    """Every (policy, discipline) cell judged over ``path``, or the report of a trace that
    cannot be read (exit 2)."""
    name = str(path)
    try:
        with open_trace(path) as trace:
            base, judging = trace.config, trace.judging
    except TraceError as err:
        return [], Report(name, 2, error=str(err))
    observed = judging == "observed"
    cells = []
    for policy in policy_names(observed):
        for discipline in DISCIPLINES:
            declared = (policy, discipline) == (base.policy, base.discipline)
            try:
                config = dataclasses.replace(base, policy=policy, discipline=discipline)
            except (TypeError, ValueError) as err:  # a combination the spec does not model
                cells.append(
                    Cell(policy, discipline, Report(name, 2, error=f"{name}:1: {err}"), declared)
                )
                continue
            started = time.perf_counter()
            with open_trace(path) as trace:
                judge = Judge.stream(config, observed, 1, unknown_ids="raise")
                cells.append(
                    Cell(policy, discipline, _judged(trace, judge, name, started), declared)
                )
    return cells, None
