"""Track slots of a slot group (``spec/tracks.py``, ``docs/model.md``, "Track slots"): SGLang
0.5.23's MAMBA ``extra_buffer`` strategy, a ping-pong pair of track slots per request beside its
working slot, a step's ``track`` write of a boundary state into one, an insert donating the
tracked slot to the tree and taking a fresh one.

Hand-written streams, as ``tests/test_spec_groups_slot.py``: the spec's actions give each
decision's effects; the engine's own effects (track-slot ``alloc``, ``track``, ``publish``,
``snapshot``) are applied where SGLang makes them. A correct run holds, at depth 1 and with the
donated slot's writer still in flight at depth 2; each plant is named by its invariant."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from own_streams import Own, judged, own, stream

from kvspec.cli import main
from kvspec.conformance import trace
from kvspec.judge import Judge
from kvspec.spec import Config, actions
from kvspec.spec.events import Event
from kvspec.spec.observed import engine_effect
from kvspec.spec.state import NULL_BLOCK, Group, Illegal, initial_state

TRACKED = Config(
    24,
    1,
    groups=(Group("full", 1), Group("slot", 2)),
    policy="engine-registers",
    discipline="general",
)
"""Page size 1 for group 0; the slot group's grid is 2 tokens (SGLang's track interval)."""

OVERLAP = replace(TRACKED, depth=2, async_scheduling=True)
"""SGLang's overlap loop: a batch is built while the one before it runs."""

PROMPT = (1, 2, 3, 4, 5)
"""r0's prompt: 5 tokens, so its prefill tracks the state after 4 (the last boundary in it)."""
R0_SLOT = 6  # after group 0's blocks 1..5
PING, PONG = 7, 8  # r0's track slots, allocated by the engine after its working slot
FRESH = 9  # the track slot r0 takes after donating PING

Item = Event | Own


def admit(tokens: int, track: int) -> list[Item]:
    """r0 admitted in step 0 (5 prompt tokens): its two track slots allocated after its working
    slot, and the step also writes the state after ``track`` tokens into PING."""
    return [
        ("arrive", 0, PROMPT, 3, 0),
        ("begin", 0),
        ("schedule", 0, tokens, 0),
        *own(("alloc", 0, PING, 1), ("alloc", 0, PONG, 1), ("track", 0, PING, track, 1)),
        ("submit", 0),
    ]


def insert(index: int = 1, block: int = PING) -> list[Item]:
    """SGLang's insert of the running r0 after its prefill: group 0's first 4 blocks published,
    the tracked slot donated at boundary ``(index + 1) * 2`` and a fresh track slot taken."""
    return own(
        *[("publish", 0, i, i + 1) for i in range(4)],
        ("snapshot", 0, index, block, 1),
        ("alloc", 0, FRESH, 1),
    )


def hit(step_id: int) -> list[Item]:
    """r1 (``1 2 3 4 9 9``) hits 4 tokens: group 0's blocks 1..4, the donated state in PING
    (copied into its fresh working slot), and runs its last 2 prompt tokens."""
    return [
        ("arrive", 1, (1, 2, 3, 4, 9, 9), 2, 0),
        ("begin", step_id),
        ("schedule", 1, 2, 0),
        ("submit", step_id),
        ("execute", step_id, ()),
        ("commit", step_id, ((1, 10),)),
    ]


SYNC_RUN: list[Item] = [
    *admit(5, 4),
    ("execute", 0, ()),
    ("commit", 0, ((0, 6),)),
    *insert(),
    *hit(1),
]


def test_an_extra_buffer_run_holds() -> None:
    """Admission with two track slots, a prefill tracking the state after 4 tokens, the insert
    donating the tracked slot (published in place, refcount 0) and refilling its position, a
    second request hitting the donated state by copy: no finding."""
    s, events = stream(TRACKED, SYNC_RUN)
    assert judged(TRACKED, events) is None
    assert s.blocks[PING].key == (1, 2, 3, 4) and s.blocks[PING].refcount == 0
    assert s.blocks[PING].written == (1, 2, 3, 4)
    assert s.requests[0].group_tables[0] == [R0_SLOT, FRESH, PONG]
    assert ("hit", 1, (PING,), 1) in events


def test_donating_the_other_ping_pong_slot_is_state_at_its_boundary() -> None:
    """The insert donates PONG, which no step wrote: StateAtItsBoundary."""
    _, events = stream(
        TRACKED, [*admit(5, 4), ("execute", 0, ()), ("commit", 0, ((0, 6),)), *insert(block=PONG)]
    )
    found = judged(TRACKED, events)
    assert found is not None and found.invariant == "StateAtItsBoundary", found


def test_a_track_seqlen_one_boundary_off_is_state_at_its_boundary() -> None:
    """The step tracks the state after 2 tokens but the insert publishes it at 4."""
    _, events = stream(
        TRACKED, [*admit(5, 2), ("execute", 0, ()), ("commit", 0, ((0, 6),)), *insert()]
    )
    found = judged(TRACKED, events)
    assert found is not None and found.invariant == "StateAtItsBoundary", found


def test_donated_while_its_writer_is_in_flight_holds_under_overlap() -> None:
    """Depth 2: the insert after step 0 is built while step 0 still runs (submitted, not
    executed): the donated PING is published on the strength of step 0's track write in
    flight ("will once the writes in flight run"); r1's hit copies it in step 1, after step 0
    ran. No finding; the same donation of PONG is StateAtItsBoundary."""

    def run(block: int) -> list[Item]:
        return [*admit(5, 4), *insert(block=block), *hit_overlap()]

    s, events = stream(OVERLAP, run(PING))
    assert judged(OVERLAP, events) is None
    assert s.blocks[PING].written == (1, 2, 3, 4)
    _, bad = stream(OVERLAP, run(PONG))
    found = judged(OVERLAP, bad)
    assert found is not None and found.invariant == "StateAtItsBoundary", found


def hit_overlap() -> list[Item]:
    """r1 admitted in step 1 while step 0 is in flight; step 0 executes and commits, then 1."""
    return [
        ("arrive", 1, (1, 2, 3, 4, 9, 9), 2, 0),
        ("begin", 1),
        ("schedule", 1, 2, 0),
        ("submit", 1),
        ("execute", 0, ()),
        ("commit", 0, ((0, 6),)),
        ("execute", 1, ()),
        ("commit", 1, ((1, 10),)),
    ]


NO_BUFFER = replace(OVERLAP, groups=(Group("full", 1), Group("slot", 1)))


def test_no_buffer_under_overlap_copies_a_slot_the_next_batch_rewrites() -> None:
    """Why SGLang tracks under overlap: ``no_buffer`` copies the working slot at an insert, but
    at depth 2 the next batch (r0's decode, submitted) rewrites the slot before the copy runs:
    the copy publishes the state after 6 tokens at boundary 5 (StateAtItsBoundary). The same
    insert at depth 1 (no batch in flight) holds."""
    tree = 10  # a free block taking the copy
    script: list[Item] = [
        ("arrive", 0, PROMPT, 3, 0),
        ("begin", 0),
        ("schedule", 0, 5, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("begin", 1),
        ("schedule", 0, 1, 0),
        ("submit", 1),
        ("commit", 0, ((0, 6),)),
        *own(*[("publish", 0, i, i + 1) for i in range(5)], ("snapshot", 0, 4, tree, 1)),
    ]
    _, events = stream(NO_BUFFER, script)
    found = judged(NO_BUFFER, events)
    assert found is not None and found.invariant == "StateAtItsBoundary", found
    sync = replace(NO_BUFFER, depth=1, async_scheduling=False)
    in_order: list[Item] = [
        ("arrive", 0, PROMPT, 3, 0),
        ("begin", 0),
        ("schedule", 0, 5, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ((0, 6),)),
        *own(*[("publish", 0, i, i + 1) for i in range(5)], ("snapshot", 0, 4, tree, 1)),
    ]
    _, events = stream(sync, in_order)
    assert judged(sync, events) is None


@pytest.mark.parametrize(
    ("effect", "words"),
    [
        (("track", 0, PING, 3, 1), "not a boundary"),
        (("track", 0, PING, 6, 1), "not a boundary"),
        (("track", 0, R0_SLOT, 4, 1), "not one of r0's track slots"),
        (("track", 0, PING, 4, 0), "no slot group"),
        (("alloc", 0, 2, 1), "not free"),
    ],
)
def test_a_track_effect_the_guard_refuses_is_illegal_by_name(effect: Event, words: str) -> None:
    s, _ = stream(
        TRACKED,
        [
            ("arrive", 0, PROMPT, 3, 0),
            ("begin", 0),
            ("schedule", 0, 5, 0),
            *own(("alloc", 0, PING, 1)),
        ],
    )
    with pytest.raises(Illegal, match=words):
        engine_effect(s, effect)


def test_a_track_under_the_specs_own_policy_is_refused_by_name() -> None:
    config = replace(TRACKED, policy="deferred", prefix_caching=False)
    s = initial_state(config)
    actions.apply(s, ("arrive", 0, PROMPT, 3, 0))
    actions.apply(s, ("begin", 0))
    actions.apply(s, ("schedule", 0, 5, 0))
    with pytest.raises(Illegal, match="engine's own effect"):
        engine_effect(s, ("track", 0, PING, 4, 1))


def test_a_finished_request_frees_its_track_slots() -> None:
    """r0 finishes after its decode: its working slot and both track slots are freed with its
    tables (TableMatchesComputed holds throughout: the working slot plus the track slots)."""
    script: list[Item] = [
        *SYNC_RUN[:-6],
        ("begin", 1),
        ("schedule", 0, 1, 0),
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, ((0, 7),)),
        ("begin", 2),
        ("schedule", 0, 1, 0),
        ("submit", 2),
        ("execute", 2, ()),
        ("commit", 2, ((0, 8),)),
    ]
    s, events = stream(TRACKED, script)
    assert judged(TRACKED, events) is None
    assert s.requests[0].status == "finished"
    assert {("free", b) for b in (R0_SLOT, FRESH, PONG)} <= set(events)


def test_the_track_round_trips_and_kvspec_check_judges_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, events = stream(TRACKED, SYNC_RUN)
    ok = tmp_path / "ok.jsonl"
    trace.write_trace(ok, TRACKED, events, judging="observed")
    assert '{"ev":"track","req":0,"block":7,"tokens":4,"group":1}' in ok.read_text()
    assert trace.read_trace(ok) == (TRACKED, events)
    assert main(["check", str(ok)]) == 0
    _, bad_events = stream(
        TRACKED, [*admit(5, 2), ("execute", 0, ()), ("commit", 0, ((0, 6),)), *insert()]
    )
    bad = tmp_path / "bad.jsonl"
    trace.write_trace(bad, TRACKED, bad_events, judging="observed")
    capsys.readouterr()
    assert main(["check", str(bad)]) == 1
    assert "StateAtItsBoundary" in capsys.readouterr().out


def test_an_empty_track_position_is_refilled_first() -> None:
    s, _ = stream(
        TRACKED,
        [
            *admit(5, 4),
            ("execute", 0, ()),
            ("commit", 0, ((0, 6),)),
            *own(("snapshot", 0, 1, PING, 1)),
        ],
    )
    assert s.requests[0].group_tables[0] == [R0_SLOT, NULL_BLOCK, PONG]


def finish_and_donate(block: int) -> list[Item]:
    """r0 (max 2 tokens) after the insert: its decode (tokens 1..6) also tracks the state after
    6 tokens into FRESH, samples its last token and finishes (its tables freed, track slots
    too); then SGLang's finished insert donates ``block`` at boundary 6
    (``_select_finished_checkpoint``: the tracked slot is kept)."""
    return [
        *admit_max(2),
        ("execute", 0, ()),
        ("commit", 0, ((0, 6),)),
        *insert(),
        ("begin", 1),
        ("schedule", 0, 1, 0),
        *own(("track", 0, FRESH, 6, 1)),
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, ((0, 7),)),
        *own(("snapshot", 0, 2, block, 1)),
    ]


def admit_max(max_tokens: int) -> list[Item]:
    first, *rest = admit(5, 4)
    return [("arrive", 0, PROMPT, max_tokens, 0), *rest]


def test_a_finished_request_donates_the_track_slot_it_left() -> None:
    """After the finish frees r0's slot table, the snapshot of FRESH (a track slot r0 left,
    tracked at 6) publishes it in place, no copy: no finding, and r1 can hit it. Donating PONG
    (never written) instead is StateAtItsBoundary."""
    s, events = stream(TRACKED, finish_and_donate(FRESH))
    assert judged(TRACKED, events) is None
    assert s.requests[0].status == "finished"
    assert (
        s.blocks[FRESH].key == (1, 2, 3, 4, 5, 6) and s.blocks[FRESH].written == s.blocks[FRESH].key
    )
    assert not s.copies and s.blocks[FRESH].refcount == 0
    _, bad = stream(TRACKED, finish_and_donate(PONG))
    found = judged(TRACKED, bad)
    assert found is not None and found.invariant == "StateAtItsBoundary", found


def test_a_track_in_a_strict_stream_is_refused_by_name() -> None:
    """The spec's own policy, strict judging: a ``track`` after a schedule is Illegal, named
    (not a disagreement about an effect the spec did not expect)."""
    config = Config(8, 1)
    s = initial_state(config)
    events: list[Event] = []
    for decision in [("arrive", 0, (1, 2), 2, 0), ("begin", 0), ("schedule", 0, 2, 0)]:
        events += [decision, *actions.apply(s, decision)]
    judge = Judge.spec(config)
    found = judge.feed_all([*events, ("track", 0, 1, 2, 1), ("submit", 0)])
    found = found or judge.settle() or judge.finding
    assert found is not None and found.invariant == "Illegal", found
    assert "track write is the engine's own effect" in found.message


R1_SLOT = 14  # r1's working slot when both are admitted in step 0 (after r0's and its tracks)


def both_then_withdraw(r1_tracks: bool) -> list[Item]:
    """r0 and r1 (the same prompt) admitted in step 0, both sample 6. Step 1 schedules both
    decodes, r0's also writing the state after 6 tokens into PONG (``track``); then r0 is
    preempted while step 1 is built (its entry withdrawn, its tables freed: PONG too), the
    engine gives PONG to r1 as a track slot, and r1's insert donates it at boundary 6. With
    ``r1_tracks`` r1's entry writes it first."""
    return [
        ("arrive", 0, PROMPT, 3, 0),
        ("arrive", 1, PROMPT, 3, 0),
        ("begin", 0),
        ("schedule", 0, 5, 0),
        *own(("alloc", 0, PING, 1), ("alloc", 0, PONG, 1), ("track", 0, PING, 4, 1)),
        ("schedule", 1, 5, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ((0, 6), (1, 6))),
        ("begin", 1),
        ("schedule", 0, 1, 0),
        *own(("track", 0, PONG, 6, 1)),
        ("schedule", 1, 1, 0),
        ("preempt", 0),
        *own(("alloc", 1, PONG, 1)),
        *(own(("track", 1, PONG, 6, 1)) if r1_tracks else []),
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, ((1, 7),)),
        *own(("snapshot", 1, 2, PONG, 1)),
    ]


def test_a_track_write_withdrawn_with_its_entry_vouches_for_nothing() -> None:
    """A track write of an entry withdrawn from the step being built is not made (SGLang
    rebuilds the batch without the retracted request): it goes with the entry
    (``tracks.withdraw``). So r1's donation of PONG, which no step wrote, of the very tokens
    r0's withdrawn write named, is StateAtItsBoundary; the same donation after r1's own track
    write holds. (Planted: a withdrawal that keeps the track writes lets the first hold.)"""
    s, events = stream(TRACKED, both_then_withdraw(False))
    assert ("preempt", 0) in events and s.requests[1].group_tables[0][0] == R1_SLOT
    found = judged(TRACKED, events)
    assert found is not None and found.invariant == "StateAtItsBoundary", found
    assert not s.blocks[PONG].pending and s.blocks[PONG].written is None
    s, events = stream(TRACKED, both_then_withdraw(True))
    assert judged(TRACKED, events) is None
    assert s.blocks[PONG].written == s.blocks[PONG].key == (1, 2, 3, 4, 5, 6)


STOPS = replace(OVERLAP, stop_token=0)


def let_go_in_flight(r1_tracks: bool) -> list[Item]:
    """Depth 2: r0 and r1 (``1 2 3 4 8 8``) admitted in step 0; step 1 (both decodes, r0's
    also writing the state after 6 tokens into PONG) is submitted when step 0's commit
    finishes r0 (it samples the stop token): r0's tables, PONG too, are freed while step 1 will
    still write PONG. The engine gives PONG to r1 as a track slot in step 2 (with
    ``r1_tracks``, writing the state after 8 tokens into it), and r1's insert, with step 2 in
    flight, donates PONG at boundary 8."""
    return [
        ("arrive", 0, PROMPT, 3, 0),
        ("arrive", 1, (1, 2, 3, 4, 8, 8), 3, 0),
        ("begin", 0),
        ("schedule", 0, 5, 0),
        *own(("alloc", 0, PING, 1), ("alloc", 0, PONG, 1), ("track", 0, PING, 4, 1)),
        ("schedule", 1, 6, 0),
        ("submit", 0),
        ("begin", 1),
        ("schedule", 0, 1, 0),
        *own(("track", 0, PONG, 6, 1)),
        ("schedule", 1, 1, 0),
        ("submit", 1),
        ("execute", 0, ()),
        ("commit", 0, ((0, 0), (1, 9))),
        ("begin", 2),
        ("schedule", 1, 1, 0),
        *own(("alloc", 1, PONG, 1)),
        *(own(("track", 1, PONG, 8, 1)) if r1_tracks else []),
        ("submit", 2),
        ("execute", 1, ()),
        ("commit", 1, ((1, 10),)),
        *own(("snapshot", 1, 3, PONG, 1)),
        ("execute", 2, ()),
        ("commit", 2, ((1, 11),)),
    ]


def test_a_track_slot_let_go_under_its_submitted_writer_is_not_named() -> None:
    """NoReadOfRecycled has no track-slot clause, and needs none: a step reads no track slot,
    and a track slot let go while a submitted step still writes it (here freed by a finish at
    the commit before) takes that write before any later step's copy or write (one stream,
    steps in order), from an entry whose recurrence is judged as any. r1, given PONG and
    writing it in step 2, donates it: holds (step 1's stale write of r0's state lands first and
    is overwritten). Without r1's write the donation names the stale state:
    StateAtItsBoundary."""
    s, events = stream(STOPS, let_go_in_flight(True))
    assert ("finish", 0, "stop") in events and ("free", PONG) in events
    assert judged(STOPS, events) is None
    assert s.blocks[PONG].written == s.blocks[PONG].key == (1, 2, 3, 4, 8, 8, 9, 10)
    _, stale = stream(STOPS, let_go_in_flight(False))
    found = judged(STOPS, stale)
    assert found is not None and found.invariant == "StateAtItsBoundary", found


def test_the_fuzzers_coverage_counts_the_track_paths_of_a_judged_run() -> None:
    """``fuzz_coverage.RunCoverage`` on the events of the correct run (and of a finished
    request's donation): the track writes, the donations of a track slot (a running insert's,
    and one after the finish freed the table), r1's hit of the donated state by copy; no
    snapshot counted a copy or a donation of a working slot."""
    from kvspec.conformance.fuzz_coverage import RunCoverage

    _, events = stream(TRACKED, SYNC_RUN)
    run = RunCoverage(("full", "slot"))
    run.observe(events)
    assert (run.track_writes, run.track_donations, run.slot_hits) == (1, 1, 1)
    assert run.snapshots_copied == run.snapshots_donated == 0
    _, events = stream(TRACKED, finish_and_donate(FRESH))
    finished = RunCoverage(("full", "slot"))
    finished.observe(events)
    assert (finished.track_writes, finished.track_donations) == (2, 2)
