"""The stream's engine invariants on the reference engine's own KV-event stream
(``conformance/kvevents/reference.py``), driven by the lockstep fuzzer: what a router is told of a
zombie block, a lost removal, and nothing under a safe policy."""

from __future__ import annotations

from pathlib import Path

from kvspec.conformance.fuzz import run_cell
from kvspec.conformance.kvevents import reference as rs
from kvspec.conformance.kvevents.frames import Frame, write_capture
from kvspec.conformance.kvevents.stream_judge import check_capture
from kvspec.spec import INVARIANTS

# the spec's end-to-end invariants off: the stream's own must find the zombie
BOOKKEEPING = [n for n in INVARIANTS if n not in ("NoUnwrittenPublish", "NoUnwrittenRead")]


def test_a_router_is_told_of_a_zombie_block() -> None:
    """eager-unsafe under the general discipline: a block published and its writer preempted in
    the same step stays cached past the step, and the batch announces it."""
    r = run_cell("eager-unsafe", "general", "fcfs", 1, seconds=120, invariants=BOOKKEEPING, factory=rs.factory)  # fmt: skip
    assert r.failure is not None, "no zombie found"
    finding = r.failure.finding
    assert finding.invariant == "AnnouncedHoldsPrefix", finding
    assert "will never hold" in finding.message
    actions = " ".join(action for action, _ in r.failure.program)
    assert "engine step" in actions


def test_a_lost_removal_is_caught_against_the_engines_cache() -> None:
    r = run_cell("deferred", "vllm", "fcfs", 1, seconds=120, factory=rs.dropping_factory)
    assert r.failure is not None and r.failure.finding.invariant == "ViewEqualsCache"
    message = r.failure.finding.message  # the view keeps what the engine dropped: a hash it no
    assert (
        "no longer holds" in message or "the engine holds" in message
    )  # longer holds, or more copies


def test_a_safe_policy_streams_what_it_caches(tmp_path: Path) -> None:
    """deferred: no finding, and the streams of every example, written as captures, hold for
    ``kvspec check --kv-events`` too."""
    built: list[rs.ReferenceStreamAdapter] = []

    def keeping(config: object, choices: object) -> rs.ReferenceStreamAdapter:
        adapter = rs.factory(config, choices)  # type: ignore[arg-type]
        built.append(adapter)
        return adapter

    r = run_cell("deferred", "general", "fcfs", None, seconds=6, factory=keeping)  # type: ignore[arg-type]
    assert r.failure is None and r.runs > 20
    batches = [a.stream.frames for a in built if a.stream.frames]
    assert sum(len(f) for f in batches) > 50
    for i, frames in enumerate(batches[:20]):
        path = tmp_path / f"{i}.jsonl"
        write_capture(path, [Frame("pub", f.seq, f.topic, f.payload) for f in frames])
        assert check_capture(path).exit_code == 0
