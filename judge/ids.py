"""Request and step ids of a stream: which were ever used, and the check that an event names only
those (``UnknownId`` otherwise: the input is not a trace). The judge's core checks them for every
model, so all judges reject the same events with the same message."""

from __future__ import annotations

from typing import Final, cast

from kvspec.judge.findings import UnknownId
from kvspec.spec.events import REQUEST_AT as _REQUEST_AT
from kvspec.spec.events import STEP_AT as _STEP_AT
from kvspec.spec.events import Event

__all__ = ["IdSet", "UnknownId", "check_ids"]

REQUEST_AT: Final = _REQUEST_AT
STEP_AT: Final = _STEP_AT
"""``spec.events``' tables, Final here (compiled: read from a C static, not looked up)."""


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
    named = REQUEST_AT.get(kind) if isinstance(kind, str) else None
    if named is not None:  # one request (no tuple made: this runs at every decision)
        if named < len(event):
            rid = cast(int, event[named])
            if rid not in ids:
                raise UnknownId(f"{kind}: request r{rid} never arrived")
    elif kind == "commit" and len(event) > 2 and isinstance(event[2], tuple):
        for pair in event[2]:  # as requests_named, without making its tuple
            if isinstance(pair, tuple) and pair:
                rid = cast(int, pair[0])
                if rid not in ids:
                    raise UnknownId(f"{kind}: request r{rid} never arrived")
    else:
        for rid in requests_named(kind, event):
            if rid not in ids:
                raise UnknownId(f"{kind}: request r{rid} never arrived")
    at = STEP_AT.get(kind) if isinstance(kind, str) else None
    if at is None or at >= len(event):
        return max_step
    step = event[at]
    if step <= max_step:  # type: ignore[operator]
        return max_step
    if kind != "begin":
        raise UnknownId(f"{kind}: step {step} never began")
    return step  # type: ignore[return-value]


def requests_named(kind: object, event: Event) -> tuple[int, ...]:
    """``spec.events.requests_of``, read here from the same tables so that the compiled judge
    calls no interpreted function per event (``tests/test_events.py`` holds them equal)."""
    at = REQUEST_AT.get(kind) if isinstance(kind, str) else None
    if at is not None:
        return (event[at],) if at < len(event) else ()  # type: ignore[return-value]
    if len(event) > 2 and isinstance(event[2], tuple):
        if kind == "execute":
            return event[2]
        if kind == "commit":
            return tuple(pair[0] for pair in event[2] if isinstance(pair, tuple) and pair)
    return ()
