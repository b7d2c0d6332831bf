"""From an event trace to a replay plan: what each executed step writes and reads, per the spec.

The spec decides which block a step may read; ``replay_plan`` turns that into work for real
tensors. It runs the trace's decisions through the spec (the trace's own effect events are left
to the judge, ``lockstep.Judge``) and yields, in trace order:

* ``Fill(block)`` for every block the spec allocates (its bytes are garbage until written);
* ``Executed(step, event_index, work)`` at every ``execute`` decision, with one ``Work`` per
  entry of the step in scheduling order, taken from the spec's state just before the execution.

``impl/paged/replay.py`` executes the plan on a paged KV cache and compares every attention output
with dense attention computed from scratch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvspec.impl.paged.records import Executed, Fill, Record, Work
from kvspec.spec import Config, Illegal, apply, initial_state
from kvspec.spec.events import EFFECTS
from kvspec.spec.state import State

from .lockstep import Event


class PlanError(ValueError):
    """An event the spec does not accept; ``index`` is its position in the trace (0-based)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"event {index}: {message}")
        self.index = index
        self.reason = message


def replay_plan(config: Config, events: Iterable[Event]) -> Iterator[Record]:
    """Yield the plan of a trace; raise ``PlanError`` (a ``ValueError``) on an illegal event."""
    s = initial_state(config)
    for index, event in enumerate(events):
        if event and event[0] in EFFECTS:
            continue  # the spec computes every effect itself
        executed = _work_of(s, index, event) if event and event[0] == "execute" else None
        try:
            effects = apply(s, event)
        except Illegal as err:
            raise PlanError(index, str(err)) from None
        for effect in effects:
            if effect[0] == "alloc":
                yield Fill(int(effect[2]))  # type: ignore[call-overload]
        if executed is not None:
            yield executed


def _work_of(s: State, index: int, event: Event) -> Executed | None:
    """The step an ``execute`` decision runs, read before the spec applies it (None when the
    decision is illegal: ``apply`` then says why)."""
    if len(event) != 3 or not isinstance(event[2], tuple):
        return None
    step_id, failed = event[1], event[2]
    step = next((st for st in s.steps if st.phase != "executed"), None)
    if step is None or step.id != step_id:
        return None
    work = tuple(
        Work(
            req=rid,
            tokens=tuple(s.requests[rid].tokens[: e.end]),
            start=e.start,
            end=e.end,
            blocks=tuple(e.blocks),
            load=e.load,
            failed=rid in failed,
            live=rid in step.live,
        )
        for rid, e in step.entries.items()
    )
    return Executed(step.id, index, work)
