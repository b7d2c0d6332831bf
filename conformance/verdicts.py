"""The verdict table: every registration policy fuzzed under every scheduling discipline.

Cells are (policy, discipline, preemption). Under ``general`` the victim may be any running request
whatever the preemption setting, so ``general`` has one cell per policy. A verdict is what the
fuzzer found within its budget: ``FAILS`` with a shrunk counterexample, or ``holds`` (no
counterexample found, which is evidence, not proof: issue #3 adds proofs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvspec.spec import POLICIES

from .fuzz import CellResult, run_cell

CELLS = (("vllm", "fcfs"), ("vllm", "priority"), ("general", "priority"))


def all_cells(
    seconds: float, seed_value: int = 0, policies: tuple[str, ...] = POLICIES
) -> Iterator[CellResult]:
    for policy in policies:
        for discipline, preemption in CELLS:
            yield run_cell(policy, discipline, preemption, None, seconds, seed_value)


def rows(results: list[CellResult]) -> list[tuple[str, ...]]:
    """Table rows: policy, discipline, verdict, invariant, shortest counterexample (steps),
    seconds to first failure, lost hits per 1,000 engine steps."""
    out = []
    for r in results:
        failure = r.failure
        out.append(
            (
                r.policy,
                r.discipline if r.discipline == "general" else f"{r.discipline}/{r.preemption}",
                "FAILS" if failure else "holds",
                failure.finding.invariant if failure else "-",
                str(len(failure.program)) if failure else "-",
                f"{r.seconds_to_failure:.1f}" if r.seconds_to_failure is not None else "-",
                f"{r.lost_hits_per_1000_steps:.1f}",
            )
        )
    return out


HEADERS = (
    "policy",
    "discipline",
    "verdict",
    "invariant broken",
    "shortest cex (steps)",
    "s to 1st failure",
    "lost hits /1k steps",
)


def print_table(results: list[CellResult], echo: Callable[[object], None] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvspec verdicts (lockstep fuzzing of the reference engine)")
    for header in HEADERS:
        table.add_column(header)
    for row in rows(results):
        style = "red" if row[2] == "FAILS" else "green"
        table.add_row(*row, style=style)
    (echo or Console(width=140).print)(table)
