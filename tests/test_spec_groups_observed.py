"""Several KV-cache groups under observed judging (an engine that registers on its own, SGLang's
hybrid tree cache): its ``publish`` and ``dedup`` effects carry the group, and a request that
leaves before it was ever admitted has no group tables to free."""

from __future__ import annotations

import pytest

from kvspec.judge import Judge
from kvspec.spec import Config, actions
from kvspec.spec.state import Group, Illegal, initial_state

HYBRID = Config(
    12,
    4,
    groups=(Group("full", 4), Group("window", 4, window=6)),
    policy="engine-registers",
    discipline="general",
)
DECISIONS = [
    ("arrive", 0, (1, 2, 3, 4, 5), 2, 0),
    ("arrive", 1, (1, 2, 3, 4, 6), 2, 0),
    ("begin", 0),
    ("schedule", 0, 5, 0),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ((0, 7),)),
]


def spec_events(decisions: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """The decisions with the effects the spec itself gives them (one hit and allocs per group)."""
    s = initial_state(HYBRID)
    events: list[tuple[object, ...]] = []
    for decision in decisions:
        events += [decision, *actions.apply(s, decision)]
    return events


def test_a_request_that_leaves_before_admission_has_no_group_tables_to_free() -> None:
    events = spec_events([*DECISIONS, ("abort", 1)])
    assert events[-1] == ("finish", 1, "abort")


def test_an_engine_publishes_in_each_group_under_that_groups_index() -> None:
    s_events = spec_events(DECISIONS)
    assert ("alloc", 0, 3, 1) in s_events  # block 3 is r0's block 0 of the window group
    judge = Judge.spec(HYBRID, observed=True)
    judge.feed_all([*s_events, ("publish", 0, 0, 1), ("publish", 0, 0, 3, 1)])
    judge.settle()
    assert judge.finding is None, judge.finding
    state = judge.model.state
    assert state.index == {(1, 2, 3, 4): [1]}
    assert state.index_of(1) == {(1, 2, 3, 4): [3]}


@pytest.mark.parametrize(
    "effect, words",
    [
        (("publish", 0, 0, 1, 1), "another group"),  # block 1 is the full group's
        (("publish", 0, 0, 3), "another group"),  # block 3 is the window group's
        (("publish", 0, 0, 3, 0), "malformed"),  # group 0 is never written
        (("publish", 0, 0, 3, 2), "unknown group"),
    ],
)
def test_a_publish_in_the_wrong_group_is_illegal(effect: tuple[object, ...], words: str) -> None:
    from kvspec.spec.observed import engine_effect

    s = initial_state(HYBRID)
    for decision in DECISIONS:
        actions.apply(s, decision)
    with pytest.raises(Illegal, match=words):
        engine_effect(s, effect)
