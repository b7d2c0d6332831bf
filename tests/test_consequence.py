"""A deviation's consequence (``judge/consequence.py``): the bugs of ``planted.py``,
planted in the reference engine and fuzzed with a fixed seed, are found as a ``Disagreement`` by
strict matching (what the fuzzer reported before), and judged on past it they name the invariant
they break, or say that they break none (efficiency)."""

from __future__ import annotations

import pytest
from planted import CRASHING, PLANTS, Plant

from kvspec.conformance.check import check_file
from kvspec.conformance.fuzz import Failure, run_cell
from kvspec.conformance.report import format_counterexample, observed_hint
from kvspec.conformance.trace import write_trace

FOLLOWED = [p for p in PLANTS if p.name != "short-lookup"]
"""``short-lookup`` is found as ``Illegal`` by strict matching (the admission's token count
follows the engine's shorter hit), then followed (``test_a_shorter_lookup_...``)."""


def fuzzed(plant: Plant) -> Failure:
    with plant.patch():
        result = run_cell("deferred", seconds=20, seed_value=0)
    assert result.failure is not None, plant.name
    return result.failure


@pytest.mark.parametrize("plant", FOLLOWED, ids=lambda p: p.name)
def test_a_planted_deviation_is_reported_with_what_it_breaks(plant: Plant) -> None:
    failure = fuzzed(plant)
    assert failure.finding.invariant == "Disagreement"  # strict matching: the bare deviation
    consequence = failure.consequence
    assert consequence is not None and consequence.stopped is None
    assert consequence.invariant == plant.expect
    assert consequence.safety == (plant.kind == "safety")
    text = format_counterexample(failure.program, failure.finding, failure.config, consequence)
    first = text.splitlines()[0]
    if plant.expect is None:
        assert first.startswith("EFFICIENCY: ") and "no invariant broken" in first
    else:
        assert first.startswith("SAFETY: ") and f"-> {plant.expect} broken" in first


def test_a_shorter_lookup_found_illegal_is_reported_as_efficiency() -> None:
    """Strictly the admission is Illegal (its token count, from the engine's one-block hit,
    runs past the known tokens once the spec's lookup hits two); following the engine's hit, it
    is a lookup that missed cached blocks: efficiency, its missed hits counted."""
    failure = fuzzed(next(p for p in PLANTS if p.name == "short-lookup"))
    assert failure.finding.invariant == "Illegal"
    consequence = failure.consequence
    assert consequence is not None and consequence.stopped is None
    assert consequence.invariant is None and not consequence.safety
    assert consequence.missed_hits >= 1
    assert "where the spec's index holds" in consequence.deviation
    assert consequence.deviation_event <= failure.finding.event
    text = format_counterexample(failure.program, failure.finding, failure.config, consequence)
    assert text.splitlines()[0].startswith("EFFICIENCY: ")


def test_an_illegal_decision_of_the_engine_s_own_has_no_consequence() -> None:
    """An Illegal the follower meets too (not explained by the engine's effects) stays bare."""
    from kvspec.judge.consequence import explain
    from kvspec.judge.findings import Finding
    from kvspec.spec import Config

    config = Config(num_blocks=4, block_size=2, policy="deferred")
    events = [("arrive", 0, (1, 2, 3), 2, 0), ("begin", 0), ("schedule", 0, 9, 0)]
    strict = Finding("Illegal", "schedule r0 in step 0: too many tokens", 2)
    assert explain(config, events, strict) is None


def test_a_double_free_is_named_as_one() -> None:
    failure = fuzzed(PLANTS[0])
    assert failure.consequence is not None
    assert " twice" in failure.consequence.deviation


def test_only_a_difference_observed_judging_accepts_gets_the_hint() -> None:
    hints = {}
    for plant in FOLLOWED:
        f = fuzzed(plant)
        hints[plant.name] = observed_hint(f.config, f.events, f.finding, "strict", f.snapshots)
    assert hints.pop("cached-to-head") is not None  # only the free queue's order differs
    assert all(hint is None for hint in hints.values()), hints


def test_check_reports_the_consequence_as_fields(tmp_path) -> None:  # type: ignore[no-untyped-def]
    failure = fuzzed(PLANTS[0])  # the double free
    path = tmp_path / "double-free.jsonl"
    write_trace(path, failure.config, failure.events)
    report = check_file(path)
    assert report.invariant == "Disagreement"
    fields = report.as_dict()["violation"]
    assert fields["safety"] is True  # type: ignore[index]
    assert fields["consequence"]["invariant"] == "RefcountIsOwnership"  # type: ignore[index]
    assert report.text().startswith("SAFETY: ")


def test_check_follows_an_illegal_the_engine_s_effects_explain(tmp_path) -> None:  # type: ignore[no-untyped-def]
    failure = fuzzed(next(p for p in PLANTS if p.name == "short-lookup"))
    path = tmp_path / "short-lookup.jsonl"
    write_trace(path, failure.config, failure.events)
    report = check_file(path)
    assert report.invariant == "Illegal"
    fields = report.as_dict()["violation"]
    assert fields["safety"] is False  # type: ignore[index]
    assert fields["consequence"]["missed_hits"] >= 1  # type: ignore[index]
    assert report.text().startswith("EFFICIENCY: ")


def test_events_before_an_engine_exception_are_judged_first() -> None:
    """The double free's events come before the assertion that it later trips, in the same
    program entry (the run to idle): the deviation and what it breaks are the finding, not
    ``AssertionError:`` with no message."""
    failure = fuzzed(CRASHING[0])
    assert failure.finding.invariant == "Disagreement"
    assert failure.consequence is not None
    assert failure.consequence.invariant == "RefcountIsOwnership"


def test_an_engine_exception_names_its_type_message_and_innermost_frames() -> None:
    failure = fuzzed(CRASHING[1])
    finding = failure.finding
    assert finding.invariant == "EngineError" and finding.error_type == "KeyError"
    assert "tests/planted.py:" in finding.frames[-1]  # where it was raised
    assert finding.frames[-1].endswith(" in _free_crashes")
    assert any("kv_cache_manager.py" in frame for frame in finding.frames)
    assert "fuzz.py" not in " ".join(finding.frames)  # the driver's own frames are not named
    assert finding.message.startswith("KeyError: 1 at ") and "planted.py:" in finding.message


def test_check_json_gives_the_history_as_fields(tmp_path) -> None:  # type: ignore[no-untyped-def]
    failure = fuzzed(PLANTS[0])
    path = tmp_path / "double-free.jsonl"
    write_trace(path, failure.config, failure.events)
    history = check_file(path).as_dict()["violation"]["history"]  # type: ignore[index]
    assert history and all("kind" in item and "fields" in item for item in history)
    frees = [item for item in history if item["kind"] == "free"]
    assert frees and set(frees[0]["fields"]) == {"block"}


def test_a_kv_stream_finding_has_its_explanation() -> None:
    """Stream findings inside ``kvspec fuzz`` printed ``()`` for what their invariant guards."""
    from kvspec.judge.findings import Finding

    assert Finding("ViewEqualsCache", "", 0).explanation.startswith("At a step boundary")
