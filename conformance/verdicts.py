"""The verdict table: every registration policy fuzzed under every scheduling discipline, with
synchronous and async scheduling.

Cells are (policy, discipline, preemption, workload, scheduling). Under ``general`` the victim may
be any running request whatever the preemption setting, so ``general`` has one cell per policy
and scheduling. Async cells schedule on placeholder tokens (``Config.async_scheduling``) at
depth 2 or 3, with a preempted request's stale output dropped or delivered (vLLM's default);
``general`` draws the stale-output mode per example. A verdict is what the fuzzer found within
its budget: ``FAILS`` with a shrunk counterexample, or ``holds`` (no counterexample found, which
is evidence, not proof: ``kvspec prove`` has the proofs). A cell whose fuzzing raised (a bug of
kvspec, not of the engine) shows ``ERROR`` with the exception, and ``kvspec demo`` exits 4.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kvspec.cell import NAMED_APART, Cell, OfCell
from kvspec.spec import POLICIES

from .fuzz import CellResult, fuzz_cell

EACH_POLICY = ""
"""The policy of a row of ``CELLS``: the table runs the row once for each policy."""


def _row(
    discipline: str, preemption: str, loads: bool, async_scheduling: bool, stale: str | None
) -> Cell:
    return Cell(EACH_POLICY, discipline, preemption, None, loads, async_scheduling, stale)


CELLS: tuple[Cell, ...] = (
    _row("vllm", "fcfs", False, False, "drop"),
    _row("vllm", "priority", False, False, "drop"),
    _row("general", "priority", False, False, "drop"),
    _row("vllm", "fcfs", True, False, "drop"),
    _row("vllm", "fcfs", False, True, "drop"),
    _row("vllm", "priority", False, True, "drop"),
    _row("general", "priority", False, True, None),
    _row("vllm", "fcfs", False, True, "deliver"),
    _row("vllm", "priority", False, True, "deliver"),
)
"""The table's rows (discipline, preemption, KV-load failures, async scheduling, stale output;
None: drawn), each a ``Cell`` run once per policy. The fourth adds requests whose prompt sits in
an external KV store, and loads that fail."""

QUICK_CELLS = CELLS[:4]
"""``kvspec demo`` without ``--full``: the synchronous cells (the ones ``kvspec prove`` also
decides, and kv-load failures), so that the table takes under two minutes on two cores; the
async cells are ``--full``'s."""

QUICK_SECONDS, FULL_SECONDS = 10.0, 12.0
"""Fuzzing seconds per cell of the quick and the full table (every seeded bug of the quick
cells is found well within 10 s: README's table, "1st failure s")."""


@dataclass
class CellError(OfCell):
    """A cell whose fuzzing raised instead of returning a verdict (its ``cell``, whose fields it
    answers for too)."""

    cell: Cell
    error: str
    """The exception, one line."""
    details: str
    """Its traceback."""


def all_cells(
    seconds: float,
    seed_value: int = 0,
    policies: tuple[str, ...] = tuple(POLICIES),
    workers: int = 0,
    cells: tuple[Cell, ...] = CELLS,
) -> Iterator[CellResult | CellError]:
    """Fuzz every cell (of ``cells``, for each policy) for ``seconds`` each, ``workers``
    processes at once (0: one per core); results come in table order."""
    jobs = [
        (dataclasses.replace(row, policy=policy), seconds, seed_value)
        for policy in policies
        for row in cells
    ]
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        yield from pool.map(_run, jobs)


def _run(job: tuple[Cell, float, int]) -> CellResult | CellError:
    cell, seconds, seed_value = job
    try:
        return fuzz_cell(cell, seconds, seed_value)
    except Exception as err:
        message = " ".join(f"{type(err).__name__}: {err}".split())
        return CellError(cell, message, traceback.format_exc())


def scheduling(async_scheduling: bool | None, stale_output: str | None) -> str:
    """The scheduling column: ``sync``, or ``async, drop`` / ``async, deliver`` /
    ``async, drop|deliver`` (``|``: drawn per example)."""
    stale = stale_output or "drop|deliver"
    if async_scheduling is False:
        return "sync" if stale == "drop" else f"sync, {stale}"
    return f"{'async' if async_scheduling else 'sync|async'}, {stale}"


def columns(cell: Cell) -> tuple[str, str, str, str]:
    """The cell's columns: policy, discipline, workload, and scheduling (``scheduling``, then
    every other value the cell sets, ``Cell.features``)."""
    others = cell.features(skip=(*NAMED_APART, "async_scheduling", "stale_output"))
    return (
        cell.policy,
        cell.discipline if cell.discipline == "general" else f"{cell.discipline}/{cell.preemption}",
        "kv-load failures" if cell.loads else "preempt/abort",
        ", ".join([scheduling(cell.async_scheduling, cell.stale_output), *others]),
    )


def rows(results: list[CellResult | CellError]) -> list[tuple[str, ...]]:
    """Table rows: the cell's ``columns``, verdict, invariant, shortest counterexample (steps),
    seconds to first failure, lost hits per 1,000 engine steps."""
    out: list[tuple[str, ...]] = []
    for r in results:
        cell = columns(r.cell)
        if isinstance(r, CellError):
            out.append((*cell, "ERROR", r.error[:60], "-", "-", "-"))
            continue
        failure = r.failure
        out.append(
            (
                *cell,
                verdict(r),
                failure.finding.invariant if failure else "-",
                str(len(failure.program)) if failure else "-",
                f"{r.seconds_to_failure:.1f}" if r.seconds_to_failure is not None else "-",
                f"{r.lost_hits_per_1000_steps:.1f}",
            )
        )
    return out


def verdict(result: CellResult) -> str:
    """``FAILS`` (a counterexample), ``holds`` (runs, none found) or ``undecided`` (no example
    ran in the budget: nothing was checked, which is not "holds")."""
    if result.failure is not None:
        return "FAILS"
    return "holds" if result.runs else "undecided"


HEADERS = (
    "policy",
    "discipline",
    "workload",
    "scheduling",
    "verdict",
    "invariant broken",
    "cex steps",
    "1st failure s",
    "lost hits/1k steps",
)


def print_table(
    results: list[CellResult | CellError], echo: Callable[[object], None] | None = None
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvspec verdicts (lockstep fuzzing of the reference engine)")
    for header in HEADERS:
        table.add_column(header)
    for row in rows(results):
        style = {"FAILS": "red", "ERROR": "bold magenta", "undecided": "yellow"}.get(
            row[4], "green"
        )
        table.add_row(*row, style=style)
    (echo or Console(width=180).print)(table)
