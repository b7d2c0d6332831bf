"""A window group under an observed policy: the engine gives up its window blocks on its own
(``spec.groups.engine_lets_go``, ``spec.observed.let_go``: ``dedup`` to the null block), as
SGLang's SWA component does when a request's window lock moves on or its out-of-window slots are
freed; the spec frees none at schedule itself, and the invariants judge a let-go too early."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvspec.judge import Judge
from kvspec.spec import Config, actions
from kvspec.spec.observed import engine_effect
from kvspec.spec.state import Group, Illegal, initial_state

HYBRID = Config(
    14,
    2,
    groups=(Group("full", 2), Group("window", 2, window=4)),
    policy="engine-registers",
    discipline="general",
)
RAN = [
    ("arrive", 0, (1, 2, 3, 4, 5), 3, 0),
    ("begin", 0),
    ("schedule", 0, 5, 0),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ((0, 7),)),
]
"""r0's prefill: its window table is blocks 4, 5, 6 (positions 0..2)."""


def run(config: Config, decisions: list[tuple[object, ...]]) -> tuple[object, list[object]]:
    s = initial_state(config)
    events: list[object] = []
    for decision in decisions:
        events += [decision, *actions.apply(s, decision)]
    return s, events


def test_the_spec_frees_no_window_block_at_schedule_where_the_engine_lets_go() -> None:
    """The same decode frees position 0 under the spec's own policy, none under
    ``engine-registers`` (planted: without ``engine_lets_go``'s check in ``remove_skipped``
    and ``gone``, the observed run frees them too and fails)."""
    decode = [*RAN, ("begin", 1), ("schedule", 0, 1, 0)]
    own, own_events = run(replace(HYBRID, policy="deferred"), decode)
    assert ("free", 4) in own_events and own.requests[0].group_tables == [[0, 5, 6]]  # type: ignore[attr-defined]
    observed, events = run(HYBRID, decode)
    assert not [e for e in events if e[0] == "free"]  # type: ignore[index]
    assert observed.requests[0].group_tables == [[4, 5, 6]]  # type: ignore[attr-defined]


def test_a_let_go_nulls_the_position_and_drops_the_reference() -> None:
    s, _ = run(HYBRID, [*RAN, ("begin", 1)])
    assert engine_effect(s, ("dedup", 0, 0, 0, 1)) == [("dedup", 0, 0, 0, 1)]  # type: ignore[arg-type]
    assert s.requests[0].group_tables == [[0, 5, 6]]  # type: ignore[attr-defined]
    assert s.blocks[4].refcount == 0 and 4 in s.free  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "decisions, effect, words",
    [
        ([*RAN, ("begin", 1)], ("dedup", 0, 0, 0), "unknown request, index or block"),
        ([*RAN, ("begin", 1)], ("dedup", 0, 5, 0, 1), "not running with a block 5"),
        ([*RAN, ("begin", 1)], ("dedup", 0, 2, 0, 1), None),
        ([*RAN, ("begin", 1), ("schedule", 0, 1, 0)], ("dedup", 0, 2, 0, 1), "being built"),
    ],
)
def test_a_let_go_is_refused_in_group_0_past_the_table_or_under_the_step_being_built(
    decisions: list[tuple[object, ...]], effect: tuple[object, ...], words: str | None
) -> None:
    s, _ = run(HYBRID, decisions)
    if words is None:
        engine_effect(s, effect)  # type: ignore[arg-type]
        with pytest.raises(Illegal, match="only a window block a request holds"):
            engine_effect(s, effect)  # type: ignore[arg-type]  # the position is null now
        return
    with pytest.raises(Illegal, match=words):
        engine_effect(s, effect)  # type: ignore[arg-type]


def test_a_let_go_is_refused_in_a_full_group() -> None:
    full = replace(HYBRID, groups=(Group("full", 2), Group("full", 2)))
    s, _ = run(full, [*RAN, ("begin", 1)])
    with pytest.raises(Illegal, match="only a window block"):
        engine_effect(s, ("dedup", 0, 0, 0, 1))  # type: ignore[arg-type]


def judge(events: list[object]) -> object:
    j = Judge.spec(HYBRID, observed=True)
    j.feed_all(events)  # type: ignore[arg-type]
    j.settle()
    return j.finding


def test_a_let_go_under_a_submitted_step_is_judged_by_the_bytes_it_reads() -> None:
    """r0's decode (step 1) is submitted reading positions 1 and 2 (the window of token 5); the
    engine then gives position 1 up. On one stream the step still reads the bytes it was handed:
    no finding (planted: without the submitted-step clause of ``NoReadOfRecycled``, that
    invariant fires). A step built after the let-go reads the null block there:
    ``NoUnwrittenRead``; so does one that writes a position given up (nothing is written
    there: planted, laying the write into the null block, the step reads it back and holds)."""
    _, ran = run(HYBRID, RAN)
    submitted = [*ran, ("begin", 1), ("schedule", 0, 1, 0), ("submit", 1)]
    assert judge([*submitted, ("dedup", 0, 1, 0, 1), ("execute", 1, ())]) is None
    early = [*ran, ("begin", 1), ("dedup", 0, 1, 0, 1), ("schedule", 0, 1, 0), ("submit", 1)]
    finding = judge([*early, ("execute", 1, ())])
    assert finding is not None and "NoUnwrittenRead" in str(finding), finding
    gone = [*ran, ("begin", 1), ("dedup", 0, 2, 0, 1), ("schedule", 0, 1, 0), ("submit", 1)]
    written = judge([*gone, ("execute", 1, ())])
    assert written is not None and "NoUnwrittenRead" in str(written), written


def test_a_dedup_in_another_group_leaves_group_0s_table_alone() -> None:
    """``TablesAppendOnly`` watches group 0's table: a group-1 ``dedup`` is no swap there
    (planted: recording it in ``touched.swapped`` made SGLang's hybrid tree fail
    ``TablesAppendOnly`` within seconds, a group-1 block written into group 0's snapshot)."""
    s, _ = run(replace(HYBRID, num_blocks=20), [*RAN, ("arrive", 1, (1, 2, 3, 4, 5), 3, 0)])
    s.touched = type(s.touched)()  # type: ignore[attr-defined]
    actions.apply(s, ("begin", 1))  # type: ignore[arg-type]
    actions.apply(s, ("schedule", 1, 5, 0))  # type: ignore[arg-type]
    actions.apply(s, ("submit", 1))  # type: ignore[arg-type]
    engine_effect(s, ("publish", 0, 0, 4, 1))  # type: ignore[arg-type]
    table = s.requests[1].group_tables[0]  # type: ignore[attr-defined]
    engine_effect(s, ("dedup", 1, 0, 4, 1))  # type: ignore[arg-type]
    assert table[0] == 4 and s.touched.swapped == []  # type: ignore[attr-defined]
