"""A reset preempting the running requests beside steps in flight (``("reset", True)``): the rule
that a reset discards the output in flight of the requests it preempts, whatever
``Config.stale_output``, its guard, and the drop that sticks while a dropped share is in flight
(docs/model.md, "Resets beside steps in flight")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvspec.spec import INVARIANTS, Config, Illegal, Violation, apply, check, initial_state
from kvspec.spec.state import State


def run(config: Config, *decisions: tuple[object, ...]) -> State:
    s = initial_state(config)
    for decision in decisions:
        apply(s, decision)
        assert check(s) is None, (decision, check(s))
    return s


DELIVER = Config(num_blocks=8, block_size=2, depth=5, async_scheduling=True, stale_output="deliver")
PREFILL = (("arrive", 0, (1, 2, 3), 6, 0), ("begin", 0), ("schedule", 0, 3, 0), ("submit", 0))
"""r0's prompt computed in step 0, which samples its 4th token: step 0 is in flight."""
RESET = (("begin", 1), ("preempt", 0), ("reset", True), ("submit", 1))
"""The reset's own step: it preempts r0 (the only running request), then resets."""


def test_a_reset_drops_its_victims_output_in_flight_even_when_stale_output_is_delivered() -> None:
    s = run(DELIVER, *PREFILL, *RESET)
    assert 0 not in s.steps[0].live and s.index == {}
    apply(s, ("begin", 2))
    apply(s, ("schedule", 0, 3, 0))  # admissible at once: nothing of it is still to be delivered
    apply(s, ("submit", 2))
    apply(s, ("execute", 0, ()))
    with pytest.raises(Illegal, match="expected"):
        apply(s, ("commit", 0, ((0, 7),)))  # its sample there is dropped, not appended
    apply(s, ("commit", 0, ()))
    assert s.requests[0].tokens == [1, 2, 3] and check(s) is None


def test_a_plain_preemption_still_delivers() -> None:
    """The rule is the reset's: without it, stale output is delivered as configured."""
    s = run(DELIVER, *PREFILL, ("begin", 1), ("preempt", 0), ("submit", 1))
    assert 0 in s.steps[0].live
    apply(s, ("begin", 2))
    with pytest.raises(Illegal, match="stale output"):
        apply(s, ("schedule", 0, 3, 0))


def test_a_dropped_share_in_flight_keeps_the_next_preemption_dropping() -> None:
    """Re-admitted after the reset while step 0 still holds its dropped share, r0 is preempted
    again by a step: that preemption drops its output in flight too (vLLM's sticky
    ``drop_stale_output``), so step 2's sample is not appended either."""
    s = run(
        DELIVER,
        *PREFILL,
        *RESET,
        ("begin", 2),
        ("schedule", 0, 3, 0),
        ("submit", 2),
        ("begin", 3),
        ("preempt", 0),
    )
    assert all(0 not in st.live for st in s.steps if 0 in st.entries)
    apply(s, ("submit", 3))
    apply(s, ("begin", 4))
    apply(s, ("schedule", 0, 3, 0))  # admissible: nothing of it is to be delivered


@pytest.mark.parametrize(
    "decisions, why",
    [
        ((*PREFILL, ("reset", True)), "no step is being scheduled"),
        ((*PREFILL, ("begin", 1), ("reset", True)), "requests still run"),
        ((*PREFILL, ("begin", 1), ("preempt", 0), ("reset", "yes")), "malformed"),
        ((*PREFILL, ("begin", 1), ("preempt", 0), ("reset",)), "steps in flight"),
    ],
)
def test_the_guard(decisions: tuple[tuple[object, ...], ...], why: str) -> None:
    s = run(DELIVER, *decisions[:-1])
    with pytest.raises(Illegal, match=why):
        apply(s, decisions[-1])


def test_a_reset_with_nothing_in_flight_keeps_its_meaning() -> None:
    s = run(Config(num_blocks=8, block_size=2), *PREFILL, ("execute", 0, ()))
    apply(s, ("commit", 0, ((0, 7),)))
    s2 = run(Config(num_blocks=8, block_size=2), ("arrive", 0, (1, 2, 3), 6, 0))
    assert apply(s2, ("reset",)) == []
    with pytest.raises(Illegal, match="blocks are in use"):
        apply(s, ("reset",))


def test_incremental_checks_agree_on_a_reset_beside_steps_in_flight() -> None:
    """The incremental checks follow ``reset_running`` (kvspec/twins.py): after every decision of
    a reset beside steps in flight, a re-admission and the steps' commits, their verdict is the
    full definitions'."""
    from kvspec.judge.incremental import Incremental

    decisions = (
        *PREFILL,
        *RESET,
        ("begin", 2),
        ("schedule", 0, 3, 0),
        ("submit", 2),
        ("execute", 0, ()),
        ("commit", 0, ()),
        ("execute", 1, ()),
        ("commit", 1, ()),
        ("execute", 2, ()),
        ("commit", 2, ((0, 9),)),
    )
    s = initial_state(DELIVER)
    inc = Incremental(s)
    for decision in decisions:
        apply(s, decision)
        assert check(s) is None and inc.check(s, s.touched) is None, decision
    assert s.requests[0].tokens == [1, 2, 3, 9]


def _left_keyed(drop: bool) -> tuple[Violation | None, Violation | None, Violation | None]:
    """r0's decode of its 4th token (step 1) is in flight when the reset preempts it; both
    steps still write r0's blocks, block 1 with step 0's placeholder for that token. A buggy
    engine leaves block 1 keyed under (1, 2, 3, 7) after the reset (planted: the key put back
    by hand), and r1, whose prompt starts with those tokens, hits it in step 3. The first
    failing invariant once it is keyed, NoUnwrittenRead's verdict once r1 read it, and the
    first failing one then."""
    config = replace(DELIVER, discipline="general")  # r1 admitted ahead of the waiting r0
    s = run(config, *PREFILL, ("begin", 1), ("schedule", 0, 1, 0), ("submit", 1))
    first, block = s.requests[0].table[:2]
    for decision in (("begin", 2), ("preempt", 0)):
        apply(s, decision)
    if drop:
        apply(s, ("reset", True))
    apply(s, ("submit", 2))
    for decision in (("execute", 0, ()), ("commit", 0, () if drop else ((0, 7),))):
        apply(s, decision)
    for b, key in ((first, (1, 2)), (block, (1, 2, 3, 7))):  # planted: the reset left them keyed
        s.blocks[b].key = key
        s.index[key] = [b]
    keyed = check(s)
    for decision in (
        ("arrive", 1, (1, 2, 3, 7, 5), 2, 0),
        ("execute", 1, ()),
        ("commit", 1, () if drop else ((0, 8),)),
        ("execute", 2, ()),
        ("commit", 2, ()),
        ("begin", 3),
        ("schedule", 1, 1, 0),
        ("submit", 3),
        ("execute", 3, ()),
    ):
        apply(s, decision)
    assert s.requests[1].table[1] == block  # the hit
    return keyed, INVARIANTS["NoUnwrittenRead"](s), check(s)


def test_a_block_left_keyed_after_the_reset_is_named() -> None:
    """What must hold of a block whose write was in flight at the reset: nothing keys or reads
    it before it is written again. Its placeholder is never resolved (the output is dropped):
    keyed, it is published for a prefix it will never hold (NoUnwrittenPublish), and a hit on it
    is an unwritten read (NoUnwrittenRead). Had the output been delivered (the rule undone), the
    placeholder would resolve to the token and the same key and hit would pass, hiding the bug."""
    keyed, read, _ = _left_keyed(drop=True)
    assert keyed is not None and keyed.invariant == "NoUnwrittenPublish", keyed
    assert read is not None and read.invariant == "NoUnwrittenRead", read
    assert _left_keyed(drop=False) == (None, None, None)


# -- the trace format: the flag is written, read back and judged, never lost ---------------------


def test_the_trace_format_keeps_a_preempting_reset(tmp_path: pytest.TempPathFactory) -> None:
    """``("reset", True)`` is ``{"ev": "reset", "preempting": true}`` in a trace (the schema's
    optional field, ``spec.events.WHEN_SET``): written, read back as the same tuple, judged by
    ``kvspec check`` like the run it came from; a ``false`` or a number is bad input, and the
    plain reset is written without the field. Planted: ``to_json`` dropping the flag makes the
    first assertion fail (and the check's verdict would be an Illegal reset, not a hold)."""
    from kvspec.conformance.check import check_file
    from kvspec.conformance.report import describe
    from kvspec.conformance.trace import event_error, parse_object, to_json, write_trace

    line = to_json(("reset", True))
    assert line == {"ev": "reset", "preempting": True}
    assert parse_object(line, 8)[0] == ("reset", True)
    assert to_json(("reset",)) == {"ev": "reset"}
    assert parse_object({"ev": "reset"}, 8)[0] == ("reset",)
    for bad in (False, 1, "yes"):
        with pytest.raises(ValueError, match="preempting"):
            parse_object({"ev": "reset", "preempting": bad}, 8)
    assert event_error(("reset", True), 8) is None
    assert event_error(("reset", False), 8) is not None
    assert "preempted" in describe(("reset", True))
    s, events = initial_state(DELIVER), []
    for decision in [*PREFILL, *RESET, ("execute", 0, ()), ("commit", 0, ())]:
        events += [decision, *apply(s, decision)]  # the decision, then its effects
    path = tmp_path / "reset.jsonl"  # type: ignore[operator]
    write_trace(path, DELIVER, events, engine=("test", "0"))
    assert '"preempting":true' in path.read_text().replace(" ", "")
    assert check_file(path).exit_code == 0


def test_the_fast_judges_hand_a_preempting_reset_to_the_spec() -> None:
    """The fast model refuses ``("reset", True)`` by name (``twins.py``), seen only when the
    decision comes: ``kvspec check`` (above) and a fast ``Monitor`` hand the stream to the spec
    judge from their older checkpoint, which takes over and judges the rest, not a disagreement
    between the two (``handover.FastRun.refused``). Planted: ``agree`` comparing verdicts after
    a refusal raised ``FastPathDisagrees`` here, an internal error on a trace that holds."""
    from kvspec.conformance.monitor import Monitor

    s, events = initial_state(DELIVER), []
    for decision in [*PREFILL, *RESET, ("execute", 0, ()), ("commit", 0, ())]:
        events += [decision, *apply(s, decision)]
    one, every = Monitor.fast(DELIVER, raise_on_finding=False), Monitor.fast(DELIVER)
    assert one.run is not None and every.run is not None  # the fast path, to begin with
    assert all(one.feed(event) is None for event in events)
    assert every.feed_all(events) is None
    assert one.run is None and every.run is None  # the spec judge took over
    assert one.close() is None and every.close() is None
