"""Request and step ids of a stream: which were ever used, and the check that an event names only
those (``UnknownId`` otherwise: the input is not a trace). Shared by the spec-based ``Checker``
and the ``FastChecker``, so both reject the same events with the same message."""

from __future__ import annotations

from collections.abc import Iterable

Event = tuple[object, ...]

REQUEST_FIELDS = {
    "schedule": 1,
    "preempt": 1,
    "abort": 1,
    "hit": 1,
    "alloc": 1,
    "publish": 1,
    "load_failed": 1,
    "finish": 1,
    "dedup": 1,
}
STEP_FIELDS = ("submit", "execute", "commit")


class UnknownId(ValueError):
    """An event names a request or step that never existed: the input is not a trace."""


class IdSet:
    """A set of non-negative ints stored as ``all below low`` plus a sparse set above it:
    constant memory for ids handed out (roughly) in order."""

    def __init__(self) -> None:
        self.low = 0
        self.above: set[int] = set()

    def add(self, value: int) -> None:
        if value < self.low:
            return
        self.above.add(value)
        while self.low in self.above:
            self.above.discard(self.low)
            self.low += 1

    def __contains__(self, value: int) -> bool:
        return value < self.low or value in self.above


def check_ids(kind: object, event: Event, ids: IdSet, max_step: int) -> int:
    """Raise ``UnknownId`` when ``event`` names a request that never arrived or a step that never
    began; return the highest step id begun so far (``begin`` raises it)."""
    if kind == "arrive":
        return max_step
    position = REQUEST_FIELDS.get(kind)  # type: ignore[arg-type]
    rids: Iterable[object] = ()
    if position is not None:
        rids = (event[position],)
    elif kind == "execute":
        rids = event[2]  # type: ignore[assignment]
    elif kind == "commit":
        rids = [pair[0] for pair in event[2]]  # type: ignore[attr-defined]
    for rid in rids:
        if rid not in ids:
            raise UnknownId(f"{kind}: request r{rid} never arrived")
    if kind in STEP_FIELDS and event[1] > max_step:  # type: ignore[operator]
        raise UnknownId(f"{kind}: step {event[1]} never began")
    if kind == "begin" and event[1] > max_step:  # type: ignore[operator]
        return event[1]  # type: ignore[return-value]
    return max_step
