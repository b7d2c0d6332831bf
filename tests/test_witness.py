"""Every NoUnwrittenPublish shown end to end (conformance/witness.py): the counterexample extended
with a consumer of the zombie replays to a mismatch that names the zombie block."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from edges import SEED_CONFIG, SEED_UNREAD, seed_counterexample, with_effects

from kvspec.cli import main
from kvspec.conformance.trace import read_events, write_events, write_trace
from kvspec.conformance.witness import extend, zombies
from kvspec.judge import Judge
from kvspec.spec import ACTIONS, apply, initial_state


def finding_of(config, events):  # type: ignore[no-untyped-def]
    return Judge.spec(config).feed_all(events)


def test_the_seed_counterexample_gets_a_consumer_that_reads_its_zombie() -> None:
    config, events = seed_counterexample()
    finding = finding_of(config, events)
    assert finding is not None and finding.invariant == "NoUnwrittenPublish"
    shown = extend(config, events, finding.invariant, finding.event)
    assert shown.found and shown.request == 3 and "witness: r3" in shown.note
    assert finding_of(config, shown.events) == finding  # the file still judges the same
    s = initial_state(config)  # and the spec confirms the consumer's read of the zombie
    for event in shown.events[: shown.read_at + 1]:
        if event[0] in ACTIONS:
            apply(s, event)
    assert (shown.request, shown.block) in {(r, b) for _, r, b in s.bad_reads}


def test_the_witness_replays_to_a_mismatch_naming_the_zombie(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config, events = seed_counterexample()
    finding = finding_of(config, events)
    assert finding is not None
    plain, shown = tmp_path / "plain.jsonl", tmp_path / "witness.jsonl"
    write_events(plain, config, events)
    assert main(["replay", str(plain), "--backend", "torch", "--layers", "1"]) in (0, 3)
    assert "MISMATCH" not in capsys.readouterr().out  # nobody reads the zombie: no wrong number
    found = extend(config, events, finding.invariant, finding.event)
    write_events(shown, config, found.events)
    assert main(["replay", str(shown), "--backend", "torch", "--layers", "1"]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"MISMATCH at .*r{found.request}.*block {found.block} .*is a zombie", out), (
        out
    )


def test_check_witness_writes_the_extended_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config, events = seed_counterexample()
    trace, out = tmp_path / "t.jsonl", tmp_path / "w.jsonl"
    write_trace(trace, config, events)
    assert main(["check", str(trace), "--witness", str(out)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert main(["check", str(out)]) == 1
    assert capsys.readouterr().out.splitlines()[0].replace(str(out), str(trace)) == first
    assert main(["replay", str(out), "--backend", "torch", "--layers", "1"]) == 1
    assert "is a zombie" in capsys.readouterr().out


def test_the_fuzzers_counterexample_of_the_seed_bug_replays_to_a_mismatch(
    seed_bug_run,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture,
) -> None:
    """The issue's case: fuzz --policy eager-unsafe --preemption priority --out F; replay F
    (the fuzzer's run is shared with other tests: ``conftest.seed_bug_run``)."""
    assert seed_bug_run.returncode == 1, seed_bug_run.stderr
    assert "witness: r" in seed_bug_run.stdout
    assert main(["replay", str(seed_bug_run.path), "--backend", "torch"]) == 1
    assert "is a zombie" in capsys.readouterr().out


def test_other_findings_are_left_as_they_are() -> None:
    from scenarios import SEED

    events = with_effects(SEED_CONFIG, SEED)  # the consumer is there: NoUnwrittenRead first?
    shown = extend(SEED_CONFIG, events, "NoUnwrittenRead", len(events) - 1)
    assert shown.events == events and not shown.found and shown.note == ""


def test_no_witness_when_no_consumer_can_reach_the_zombie() -> None:
    """With the zombie's parent block unpublished (as an eviction would), no lookup reaches the
    zombie: every plan must give up rather than claim a read that does not happen."""
    from kvspec.conformance.witness import PLANS, _consumer

    config, events = seed_counterexample()
    s = initial_state(config)
    for event in events:
        if event[0] in ACTIONS:
            apply(s, event)
    ((block, key),) = zombies(s)
    assert all(_consumer(s, 9, block, key, plan) is not None for plan in PLANS[1:2])
    for parent in s.index.pop(key[: config.block_size]):
        s.blocks[parent].key = None
    assert all(_consumer(s, 9, block, key, plan) is None for plan in PLANS)


def test_the_seed_prefix_is_what_the_scenario_says() -> None:
    assert SEED_UNREAD[-1] == ("commit", 2, ((2, 3),))


def test_prove_writes_the_witness(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cex.jsonl"
    argv = ["prove", "--policy", "eager-unsafe", "--discipline", "general", "--method", "bmc"]
    assert main(argv + ["--bound", "5", "--out", str(out)]) == 1
    assert "witness: r" in capsys.readouterr().out
    config, events = read_events(out)
    assert finding_of(config, events).invariant == "NoUnwrittenPublish"  # type: ignore[union-attr]
    assert main(["replay", str(out), "--backend", "torch", "--layers", "1"]) == 1
    assert "is a zombie" in capsys.readouterr().out
