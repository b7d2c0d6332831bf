"""Bugs planted in vLLM's own hybrid KV-cache code (``planted_vllm_hybrid.py``), fuzzed through
``hybrid.swa_factory`` with a fixed seed in each supported release's environment
(``bench/planted_child.py vllm-hybrid``): each is caught and named by the invariant of several
groups it breaks (``HitServedByEveryGroup``), not a bare ``Disagreement``, and each bug in its
per-group KV-event stream by the stream invariant it breaks, within 30 s of fuzzing; the same
factory with nothing planted (its stream judged too) holds under that seed (the first row).
Likewise the bugs planted in vLLM's Mamba ``align`` code (``planted_vllm_mamba.py``, through
``hybrid.mamba_factory`` under fcfs: ``bench/planted_child.py vllm-mamba``), named
``StateAtItsBoundary`` and ``NoUnwrittenStateRead``; and the bug planted in vLLM's window manager
(``planted_vllm_window.py``, through ``hybrid.swa_full_first_factory``, whose window is group 1:
``bench/planted_child.py vllm-window``), named ``NoReadOfRecycled``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_venvs import VENVS, run_in

ROOT = Path(__file__).resolve().parent.parent


def _child(venv: Path, engine: str) -> list[dict[str, object]]:
    """The rows ``bench/planted_child.py ENGINE`` prints in ``venv`` (30 s per plant)."""
    done = run_in(venv, "bench/planted_child.py", engine, "tests", "30")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.e2e  # minutes per release: make test-e2e
@pytest.mark.parametrize("venv", VENVS)
def test_planted_hybrid_bugs_are_named_by_their_invariant(venv: Path) -> None:
    rows = _child(venv, "vllm-hybrid")
    assert rows[0]["name"] == "baseline" and rows[0]["finding"] is None, rows[0]
    assert len(rows) == 5, rows
    for row in rows[1:]:
        # a deviation's consequence names an invariant; a stream bug is its invariant's finding
        assert (row["named"] or row["finding"]) == row["expect"], row
        assert row["first"] is not None and float(row["first"]) < 30, row


@pytest.mark.e2e  # about a minute and a half per release: make test-e2e
@pytest.mark.parametrize("venv", VENVS)
def test_planted_mamba_bugs_are_named_by_their_invariant(venv: Path) -> None:
    """The aligned split disabled -> StateAtItsBoundary; the same-step deferral forgotten ->
    NoUnwrittenStateRead; the Mamba model with nothing planted holds under fcfs at that seed."""
    rows = _child(venv, "vllm-mamba")
    assert rows[0]["name"] == "baseline" and rows[0]["finding"] is None, rows[0]
    assert [row["expect"] for row in rows[1:]] == ["StateAtItsBoundary", "NoUnwrittenStateRead"]
    for row in rows[1:]:
        assert (row["named"] or row["finding"]) == row["expect"], row
        assert row["first"] is not None and float(row["first"]) < 30, row


@pytest.mark.e2e  # about a minute per release: make test-e2e
@pytest.mark.parametrize("venv", VENVS)
def test_planted_window_bug_is_named_no_read_of_recycled(venv: Path) -> None:
    """The window's skip counted one token late frees a block the step being scheduled reads ->
    NoReadOfRecycled (judging on past the deviation applies vLLM's extra free as the window table
    giving the block up; without that, RefcountIsOwnership); the full-first model with nothing
    planted holds at that seed."""
    rows = _child(venv, "vllm-window")
    assert rows[0]["name"] == "baseline" and rows[0]["finding"] is None, rows[0]
    assert [row["expect"] for row in rows[1:]] == ["NoReadOfRecycled"], rows
    for row in rows[1:]:
        assert row["named"] == row["expect"], row
        assert row["first"] is not None and float(row["first"]) < 30, row
