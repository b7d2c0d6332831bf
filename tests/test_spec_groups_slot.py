"""Slot groups (``spec/slots.py``, ``docs/model.md``, "Slot groups"): a recurrent state held in
one slot per request, rewritten in place, cached and hit by copying whole states (SGLang
0.5.23's MAMBA component, ``no_buffer``, page size 1), judged under ``engine-registers``.

Hand-written streams: the spec's actions give each decision's effects, and the engine's own
effects (``publish``, ``snapshot``, ``evict``) are applied where the engine makes them, as
SGLang's scheduler would (``stream``). A correct run holds; each plant is named by its
invariant."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from own_streams import Own, judged, stream

from kvspec.cli import main
from kvspec.conformance import trace
from kvspec.conformance.check import check_file
from kvspec.judge import Judge
from kvspec.spec import Config, actions
from kvspec.spec.events import Event
from kvspec.spec.state import Group

SLOT = Config(
    24,
    1,
    groups=(Group("full", 1), Group("slot", 1)),
    policy="engine-registers",
    discipline="general",
)
"""Page size 1, as SGLang's hybrid Mamba models run: group 0 full attention, group 1 the state."""


def step(n: int, *schedules: Event, sampled: tuple[tuple[int, int], ...] = ()) -> list[Event]:
    """Step ``n``: begin, the schedules, submit, execute, commit sampling ``sampled``."""
    return [("begin", n), *schedules, ("submit", n), ("execute", n, ()), ("commit", n, sampled)]


PROMPT = (1, 2, 3, 4)
"""r0's prompt; r1's is r0's tokens after its first decode, and one more."""
R0_BLOCKS = (1, 2, 3, 4)  # its group-0 blocks: the free queue's head, in order
R0_SLOT = 5  # its slot, allocated after them
TREE = 6  # the free block r0's prefill state is copied into (SGLang's insert of a running request)


def prefill(snapshot: Event | None = None) -> list[Event | Own]:
    """r0's prefill (step 0); then the engine inserts it: group 0's blocks published, and its
    state after 4 tokens copied into block 6, published at boundary 4 (``snapshot``)."""
    own = [("own", ("publish", 0, i, block)) for i, block in enumerate(R0_BLOCKS)]
    return [
        ("arrive", 0, PROMPT, 2, 0),
        *step(0, ("schedule", 0, 4, 0), sampled=((0, 7),)),
        *own,
        ("own", snapshot or ("snapshot", 0, 3, TREE, 1)),
    ]


def decode_and_donate() -> list[Event | Own]:
    """r0's decode (step 1) reaches max_tokens; finished, it donates its slot (in place, at
    boundary 5, the tokens its state has seen) and its group-0 block 4 (block 7)."""
    return [
        *step(1, ("schedule", 0, 1, 0), sampled=((0, 8),)),
        ("own", ("publish", 0, 4, 7)),
        ("own", ("snapshot", 0, 4, R0_SLOT, 1)),
    ]


HIT = [
    ("arrive", 1, (1, 2, 3, 4, 7, 9), 3, 0),
    *step(2, ("schedule", 1, 1, 0), sampled=((1, 10),)),
    *step(3, ("schedule", 1, 1, 0), sampled=((1, 11),)),
]
"""r1 hits 5 tokens (group 0's blocks 1..4 and 7, the slot group's state in block 5, copied into
its fresh slot), computes its last prompt token, then decodes on from its own slot."""


def test_an_sglang_like_run_holds() -> None:
    """Admission, prefill, a snapshot by copy, a decode, a finish that donates the slot, and a
    second request hitting the donated state by copy and running on: no finding; the hit copies
    block 5 into r1's fresh slot and takes no reference on it."""
    s, events = stream(SLOT, [*prefill(), *decode_and_donate(), *HIT])
    assert ("snapshot", 0, 3, TREE, 1) in events and ("snapshot", 0, 4, R0_SLOT, 1) in events
    assert ("hit", 1, (R0_SLOT,), 1) in events
    admission = events.index(("hit", 1, (R0_SLOT,), 1))
    assert events[admission + 1 : admission + 3] == [("alloc", 1, 8), ("alloc", 1, 9, 1)]
    assert judged(SLOT, events) is None
    assert s.blocks[R0_SLOT].refcount == 0 and s.blocks[R0_SLOT].key == (1, 2, 3, 4, 7)
    assert s.blocks[TREE].key == PROMPT and s.blocks[TREE].written == PROMPT
    assert not s.bad_state_reads and not s.copies


def test_the_copy_runs_first_in_the_admitting_step() -> None:
    """Between the admission and its step's execute the fresh slot holds nothing yet; its copy is
    laid as a pending write foreseen to bring the source's state, then run at execute (planted:
    running the copies after the step's writes, the slot ends up with block 5's state)."""
    script = [*prefill(), *decode_and_donate(), ("arrive", 1, (1, 2, 3, 4, 7, 9), 3, 0)]
    s, _ = stream(SLOT, [*script, ("begin", 2), ("schedule", 1, 1, 0), ("submit", 2)])
    slot = s.requests[1].group_tables[0][0]
    assert s.copies == [(2, R0_SLOT, slot)]
    assert [w.source for w in s.blocks[slot].pending] == [R0_SLOT, None]
    actions.apply(s, ("execute", 2, ()))
    assert s.blocks[slot].written == (1, 2, 3, 4, 7, 9) and not s.bad_state_reads


def test_a_snapshot_at_a_boundary_the_slot_did_not_hold_is_state_at_its_boundary() -> None:
    """The engine copies r0's slot (the state after 4 tokens) but publishes it at boundary 3."""
    _, events = stream(SLOT, prefill(snapshot=("snapshot", 0, 2, TREE, 1)))
    finding = judged(SLOT, events)
    assert finding is not None and finding.invariant == "StateAtItsBoundary", finding
    assert TREE in finding.blocks


def test_a_copy_of_a_snapshot_made_while_the_step_is_building_leaves_out_its_writes() -> None:
    """A snapshot by copy made in the building step that takes r0 to boundary 5 copies the
    slot as the submitted steps leave it (the state after 4): published at 5, it never holds
    that state (StateAtItsBoundary); published in place, the slot will (no finding)."""
    building = [*prefill(), ("begin", 1), ("schedule", 0, 1, 0)]
    _, copied = stream(SLOT, [*building, ("own", ("snapshot", 0, 4, 10, 1))])
    finding = judged(SLOT, copied)
    assert finding is not None and finding.invariant == "StateAtItsBoundary", finding
    _, in_place = stream(SLOT, [*building, ("own", ("snapshot", 0, 4, R0_SLOT, 1))])
    assert judged(SLOT, in_place) is None


def test_a_hit_copying_a_source_not_yet_at_its_boundary_is_no_unwritten_state_read() -> None:
    """r0's slot is published in place at boundary 5 by the engine while the step that takes it
    there is being built; r1 is admitted in that same step hitting it. Its copy runs first in
    the step, before r0's write: it brings the state after 4 tokens, and r1's first read finds
    the wrong state (StateAtItsBoundary holds: the slot will hold that state once the step
    runs). Planted: foreseeing the copy after the step's own writes hides it."""
    script = [
        *prefill(),
        ("begin", 1),
        ("schedule", 0, 1, 0),
        ("own", ("snapshot", 0, 4, R0_SLOT, 1)),
        ("own", ("publish", 0, 4, 7)),
        ("arrive", 1, (1, 2, 3, 4, 7, 9), 3, 0),
        ("schedule", 1, 1, 0),
    ]
    s, events = stream(SLOT, script)
    assert ("hit", 1, (R0_SLOT,), 1) in events
    finding = judged(SLOT, events)
    assert finding is not None and finding.invariant == "NoUnwrittenStateRead", finding
    assert finding.requests == (1,) and R0_SLOT in finding.blocks  # the copy's source too
    actions.apply(s, ("submit", 1))
    actions.apply(s, ("execute", 1, ()))
    assert s.bad_state_reads and s.bad_state_reads[0][1] == 1  # and at execute: the bytes


def test_an_evicted_source_rewritten_in_the_admitting_step_is_copied_before() -> None:
    """The hit's source (the tree's block 6, the state after 4 tokens) is evicted and taken as
    another request's slot in the admitting step itself, whose write rewrites it: the copy runs
    first in the step, so the hit still reads the state after 4 (no finding; SGLang's lock on
    the hit's node is stricter than needed). Planted: running the copies after the step's
    writes makes this NoUnwrittenStateRead."""
    other = (5, 6)
    script = [
        *prefill(),
        ("arrive", 1, (1, 2, 3, 4, 9), 2, 0),
        ("arrive", 2, other, 2, 0),
        ("begin", 1),
        ("schedule", 1, 1, 0),  # hits 4 tokens: block 6's state copied into its slot
        ("schedule", 2, 2, 0),  # its slot: block 6, evicted (steered below)
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, ((1, 10), (2, 11))),
    ]
    s, events = stream(SLOT, script)
    assert ("hit", 1, (TREE,), 1) in events
    at = events.index(("schedule", 2, 2, 0))
    events = _steer_slot(events, at, TREE)  # the engine hands block 6 out (the spec: block 11)
    assert events[at + 5 : at + 7] == [("evict", TREE), ("alloc", 2, TREE, 1)]
    finding = judged(SLOT, events)
    assert finding is None, finding


def _steer_slot(events: list[Event], at: int, block: int) -> list[Event]:
    """The engine's choice: r2's slot (its group-1 alloc after ``at``) is ``block``, evicted."""
    out = list(events)
    for i in range(at, len(out)):
        if out[i][0] == "alloc" and len(out[i]) == 4:
            out[i : i + 1] = [("evict", block), ("alloc", out[i][1], block, 1)]
            return out
    raise AssertionError("no slot allocated")


DELIVER = replace(SLOT, depth=2, stale_output="deliver")


def test_a_slot_freed_while_a_step_in_flight_reads_it_is_no_read_of_recycled() -> None:
    """r0's decode (step 1) is submitted reading its slot; in step 2 r0 is preempted, its
    output delivered (the step's read still matters): its slot is freed under the step
    (NoReadOfRecycled). With the output dropped the step's read no longer matters (no
    finding). Planted: leaving submitted steps out of the slot clause hides it."""
    script = [
        ("arrive", 0, PROMPT, 4, 0),
        *step(0, ("schedule", 0, 4, 0), sampled=((0, 7),)),
        ("begin", 1),
        ("schedule", 0, 1, 0),
        ("submit", 1),
        ("begin", 2),
        ("preempt", 0),
    ]
    _, events = stream(DELIVER, script)
    finding = judged(DELIVER, events)
    assert finding is not None and finding.invariant == "NoReadOfRecycled", finding
    assert finding.blocks == (R0_SLOT,)
    dropped = replace(DELIVER, stale_output="drop")
    _, events = stream(dropped, script)
    assert judged(dropped, events) is None


@pytest.mark.parametrize(
    "effect, words",
    [
        (("snapshot", 0, 3, 2, 1), "the block is held"),  # r0's group-0 block 2
        (("snapshot", 0, 3, TREE, 0), "no slot group"),
        (("snapshot", 0, 9, TREE, 1), "beyond r0's known tokens"),
        (("snapshot", 1, 0, TREE, 1), "not running or finished"),  # r1 waits
    ],
)
def test_a_snapshot_the_guard_refuses_is_illegal_by_name(effect: Event, words: str) -> None:
    """A snapshot into a block held by another table, in a group that is no slot group, past
    the request's known tokens, or of a waiting request: Illegal, the message naming why."""
    own = [("own", ("publish", 0, i, block)) for i, block in enumerate(R0_BLOCKS)]
    script = [("arrive", 0, PROMPT, 2, 0), *step(0, ("schedule", 0, 4, 0), sampled=((0, 7),))]
    waiting = ("arrive", 1, (1, 2), 2, 0)
    _, events = stream(SLOT, [*script, *own, waiting, ("own", effect)])
    finding = judged(SLOT, events)
    assert finding is not None and finding.invariant == "Illegal", finding
    assert words in finding.message


def test_a_snapshot_into_a_published_free_block_needs_its_evict_first() -> None:
    """Block 6 holds r0's prefill state; a later snapshot that reuses it must evict it first
    (its own ``evict``, as an allocation would); without it the snapshot is Illegal."""
    base = [*prefill(), *step(1, ("schedule", 0, 1, 0), sampled=((0, 8),))]
    _, events = stream(SLOT, [*base, ("own", ("snapshot", 0, 4, TREE, 1))])
    finding = judged(SLOT, events)
    assert finding is not None and finding.invariant == "Illegal", finding
    assert "an evict comes first" in finding.message
    evicted = [*base, ("own", ("evict", TREE)), ("own", ("snapshot", 0, 4, TREE, 1))]
    s, events = stream(SLOT, evicted)
    assert judged(SLOT, events) is None
    assert s.blocks[TREE].key == (1, 2, 3, 4, 7) and s.blocks[TREE].refcount == 0


@pytest.mark.parametrize("policy", ["eager-unsafe", "deferred"])  # publish=at-schedule, deferred
def test_a_slot_group_under_the_specs_own_policies_is_refused_by_name(policy: str) -> None:
    with pytest.raises(ValueError, match=r"cached only by the engine's own snapshots"):
        replace(SLOT, policy=policy)
    replace(SLOT, policy=policy, prefix_caching=False)  # without caching: just a slot


def test_a_slot_group_0_is_refused() -> None:
    with pytest.raises(ValueError, match="group 0 of kind 'slot'"):
        replace(SLOT, groups=(Group("slot", 1), Group("full", 1)))


def test_without_prefix_caching_a_slot_is_just_a_slot() -> None:
    """The spec's own policy, caching off: the slot is allocated at admission, read and
    rewritten by each step, freed with the table; nothing is hit or snapshotted."""
    config = replace(SLOT, policy="deferred", prefix_caching=False)
    script = [
        ("arrive", 0, PROMPT, 3, 0),
        *step(0, ("schedule", 0, 4, 0), sampled=((0, 7),)),
        *step(1, ("schedule", 0, 1, 0), sampled=((0, 8),)),
        *step(2, ("schedule", 0, 1, 0), sampled=((0, 9),)),
    ]
    s, events = stream(config, script)
    assert [e for e in events if e[0] == "alloc" and len(e) == 4] == [("alloc", 0, R0_SLOT, 1)]
    assert Judge.spec(config).feed_all(events) is None
    assert s.blocks[R0_SLOT].refcount == 0 and R0_SLOT in s.free


# -- through a JSON trace ---------------------------------------------------------------------------


def test_the_snapshot_round_trips_in_a_trace(tmp_path: Path) -> None:
    _, events = stream(SLOT, [*prefill(), *decode_and_donate(), *HIT])
    path = tmp_path / "slot.jsonl"
    trace.write_trace(path, SLOT, events, judging="observed")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert {"ev": "snapshot", "req": 0, "index": 3, "block": TREE, "group": 1} in lines
    assert lines[0]["model"]["groups"][1] == {"kind": "slot", "block_size": 1, "window": None}
    assert trace.read_trace(path) == (SLOT, events)


def test_kvspec_check_judges_a_slot_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvspec check``: the correct run exits 0; the snapshot at the wrong boundary exits 1
    naming StateAtItsBoundary; a snapshot line without its index, or a slot group under
    at-schedule in the header, is bad input (exit 2, one line naming the place)."""
    _, events = stream(SLOT, [*prefill(), *decode_and_donate(), *HIT])
    ok = tmp_path / "ok.jsonl"
    trace.write_trace(ok, SLOT, events, judging="observed")
    assert main(["check", str(ok)]) == 0
    _, bad_events = stream(SLOT, prefill(snapshot=("snapshot", 0, 2, TREE, 1)))
    bad = tmp_path / "bad.jsonl"
    trace.write_trace(bad, SLOT, bad_events, judging="observed")
    capsys.readouterr()
    assert main(["check", str(bad)]) == 1
    assert "StateAtItsBoundary" in capsys.readouterr().out
    lines = ok.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"snapshot"' in line)
    malformed = tmp_path / "malformed.jsonl"
    broken = '{"ev": "snapshot", "req": 0, "block": 6, "group": 1}'
    malformed.write_text("\n".join([*lines[:at], broken, *lines[at + 1 :]]) + "\n")
    report = check_file(malformed)
    assert report.exit_code == 2 and f"malformed.jsonl:{at + 1}" in (report.error or "")
    header = json.loads(lines[0])
    header["model"]["policy"] = "eager-unsafe"  # publish=at-schedule
    refused = tmp_path / "refused.jsonl"
    refused.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    report = check_file(refused)
    assert report.exit_code == 2 and "engine-registers" in (report.error or ""), report.error


def test_a_finished_requests_state_copied_into_another_free_block_is_hit_by_copy() -> None:
    """Instead of donating its slot, the finished r0's state is copied into free block 12 (the
    copy runs first in the next step): r1 hits block 12 and runs on (no finding); published at
    boundary 4 instead, the copy never holds that state (StateAtItsBoundary)."""
    donate = [
        *step(1, ("schedule", 0, 1, 0), sampled=((0, 8),)),
        ("own", ("publish", 0, 4, 7)),
        ("own", ("snapshot", 0, 4, 12, 1)),
    ]
    s, events = stream(SLOT, [*prefill(), *donate, *HIT])
    assert ("hit", 1, (12,), 1) in events and judged(SLOT, events) is None
    assert s.blocks[12].written == (1, 2, 3, 4, 7) and s.blocks[12].refcount == 0
    wrong = [*donate[:-1], ("own", ("snapshot", 0, 3, 12, 1))]
    _, events = stream(SLOT, [*prefill(snapshot=("snapshot", 0, 3, TREE, 1)), *wrong])
    finding = judged(SLOT, events)
    assert finding is not None and finding.invariant == "StateAtItsBoundary", finding
