"""Request and step ids of a stream: which were ever used, and the check that an event names only
those (``UnknownId`` otherwise: the input is not a trace). The judge's core checks them for every
model, so all judges reject the same events with the same message."""

from __future__ import annotations

from kvspec.conformance.judge.findings import UnknownId
from kvspec.spec.events import Event, requests_of, step_of

__all__ = ["IdSet", "UnknownId", "check_ids"]


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

    def copy(self) -> IdSet:
        ids = IdSet()
        ids.low, ids.above = self.low, set(self.above)
        return ids


def check_ids(kind: object, event: Event, ids: IdSet, max_step: int) -> int:
    """Raise ``UnknownId`` when ``event`` names a request that never arrived or a step that never
    began; return the highest step id begun so far (``begin`` raises it)."""
    if kind == "arrive":
        return max_step
    rids = requests_of(event)
    for rid in rids:
        if rid not in ids:
            raise UnknownId(f"{kind}: request r{rid} never arrived")
    step = step_of(event)
    if step is None or step <= max_step:
        return max_step
    if kind != "begin":
        raise UnknownId(f"{kind}: step {step} never began")
    return step
