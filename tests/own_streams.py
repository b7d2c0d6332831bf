"""Hand-written event streams of an engine that makes effects of its own (the policy
``engine-registers``, ``spec/observed.py``), and their verdict: shared by the slot-group and
track-slot tests (``tests/test_spec_groups_slot.py``, ``tests/test_spec_tracks.py``)."""

from __future__ import annotations

from kvspec.judge import Judge
from kvspec.judge.findings import Finding
from kvspec.spec import Config, actions
from kvspec.spec.events import Event
from kvspec.spec.observed import engine_effect
from kvspec.spec.state import Illegal, State, initial_state

Own = tuple[str, Event]
"""``("own", effect)``: an effect the engine makes on its own, after the decision before it."""


def own(*effects: Event) -> list[Own]:
    """Each of ``effects`` as the engine's own."""
    return [("own", e) for e in effects]


def stream(config: Config, script: list[Event | Own]) -> tuple[State, list[Event]]:
    """The events an engine running ``script`` emits: each decision with the spec's effects,
    each own effect as the engine makes it. An own effect whose guard fails is written all the
    same (the judge names it), and not applied."""
    s = initial_state(config)
    events: list[Event] = []
    for item in script:
        if item[0] == "own":
            effect: Event = item[1]  # type: ignore[assignment]
            events.append(effect)
            try:
                engine_effect(s, effect)
            except Illegal:
                pass
            continue
        events += [item, *actions.apply(s, item)]
    return s, events


def judged(config: Config, events: list[Event]) -> Finding | None:
    """The observed judge's finding on ``events``, or None."""
    judge = Judge.spec(config, observed=True)
    judge.feed_all(events)
    judge.settle()
    return judge.finding
