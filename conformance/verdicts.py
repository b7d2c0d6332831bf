"""The verdict table: every registration policy fuzzed under every scheduling discipline.

Cells are (policy, discipline, preemption). Under ``general`` the victim may be any running request
whatever the preemption setting, so ``general`` has one cell per policy. A verdict is what the
fuzzer found within its budget: ``FAILS`` with a shrunk counterexample, or ``holds`` (no
counterexample found, which is evidence, not proof: issue #3 adds proofs).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

from kvspec.spec import POLICIES

from .fuzz import CellResult, run_cell

CELLS = (
    ("vllm", "fcfs", False),
    ("vllm", "priority", False),
    ("general", "priority", False),
    ("vllm", "fcfs", True),
)
"""(discipline, preemption, KV-load failures): the last cell adds requests whose prompt sits in an
external KV store, and loads that fail."""


def all_cells(
    seconds: float, seed_value: int = 0, policies: tuple[str, ...] = POLICIES, workers: int = 0
) -> Iterator[CellResult]:
    """Fuzz every cell for ``seconds`` each, ``workers`` processes at once (0: one per core);
    results come in table order."""
    jobs = [
        (policy, discipline, preemption, None, loads, seconds, seed_value)
        for policy in policies
        for discipline, preemption, loads in CELLS
    ]
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        yield from pool.map(_run, jobs)


def _run(job: tuple) -> CellResult:
    return run_cell(*job)


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
                "kv-load failures" if r.loads else "preempt/abort",
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
    "workload",
    "verdict",
    "invariant broken",
    "cex steps",
    "1st failure s",
    "lost hits/1k steps",
)


def print_table(results: list[CellResult], echo: Callable[[object], None] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvspec verdicts (lockstep fuzzing of the reference engine)")
    for header in HEADERS:
        table.add_column(header)
    for row in rows(results):
        style = "red" if row[3] == "FAILS" else "green"
        table.add_row(*row, style=style)
    (echo or Console(width=160).print)(table)
