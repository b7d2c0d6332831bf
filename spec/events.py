"""The event vocabulary: every kind of event an engine emits, its fields by name, and the accessors
everything else decodes events with.

An event is a tuple ``(kind, field, ...)`` with its fields in the order ``KINDS`` lists them. A
*decision* is what an engine chooses (``actions.apply`` takes one); an *effect* is what a decision
causes, emitted right after it, in order (the spec computes every effect of a decision itself).
The trace format (``conformance/trace.py``, ``docs/trace-format.md``) names the same fields in
JSON; the readers, the judge's id checks, the reports and the replay plan all decode events with
``blocks_of``, ``request_of``, ``requests_of`` and ``step_of`` below, never by position.

Field types: ``id`` a request or step id (an int >= 0), ``block`` a block id (0 .. N - 1), ``nat``
an int >= 0, ``int`` any int, ``tokens`` a non-empty tuple of token ids >= 0, ``blocks`` a tuple
of block ids, ``ids`` a tuple of request ids, ``sampled`` a tuple of ``(req, token)`` pairs,
``reason`` one of ``REASONS``.

Several KV-cache groups (``Config.groups``): ``alloc``, ``hit``, ``publish``, ``dedup`` and
``snapshot`` and ``track`` (always in a slot group, so always with it) take an optional trailing field
``group`` (a nat, default 0; ``TRAILING``), after the kind's fields. The tuple form is canonical: the field is there exactly when the group is not 0 (``grouped``
builds such an event, ``canonical`` drops a trailing 0, ``group_of`` reads it), so a one-group
event never carries it and every event before groups reads as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

Event = tuple[object, ...]

REASONS = ("length", "stop", "abort")
"""Why a request finished (``finish``'s ``reason``)."""


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of event: its name, whether it is a decision, its fields (name, type) in tuple
    order, and what it means."""

    name: str
    decision: bool
    fields: tuple[tuple[str, str], ...]
    meaning: str

    def position(self, field: str) -> int:
        """The index of ``field`` in the event tuple (the kind is at 0)."""
        for i, (name, _) in enumerate(self.fields, 1):
            if name == field:
                return i
        raise KeyError(f"{self.name} has no field {field!r}")


def _kinds(*kinds: Kind) -> dict[str, Kind]:
    return {kind.name: kind for kind in kinds}


KINDS: dict[str, Kind] = _kinds(
    # -- decisions ----------------------------------------------------------------------------
    Kind(
        "arrive",
        True,
        (("req", "id"), ("tokens", "tokens"), ("max_tokens", "nat"), ("priority", "int")),
        "a request arrives with its prompt; a lower priority value is more important",
    ),
    Kind("begin", True, (("step", "id"),), "the scheduler starts building a step"),
    Kind(
        "schedule",
        True,
        (("req", "id"), ("tokens", "nat"), ("loaded", "nat")),
        "the request gets tokens to compute in the building step, or on admission full blocks "
        "to load from an external store; a waiting request is admitted first",
    ),
    Kind("preempt", True, (("req", "id"),), "a running request loses its blocks, back to waiting"),
    Kind(
        "trim",
        True,
        (("req", "id"),),
        "a running request not yet scheduled in the building step gives up the blocks no step "
        "reads any more (a window's, a state group's), as its schedule would; vLLM's "
        "allocate_slots frees them before it finds no room and preempts",
    ),
    Kind("submit", True, (("step", "id"),), "the building step goes to the worker"),
    Kind(
        "execute",
        True,
        (("step", "id"), ("failed", "ids")),
        "the worker runs the oldest submitted step (writes, then reads); listed loads fail",
    ),
    Kind(
        "commit",
        True,
        (("step", "id"), ("sampled", "sampled")),
        "the scheduler processes the oldest executed step's output: its sampled tokens",
    ),
    Kind("abort", True, (("req", "id"),), "the client aborts the request, between steps"),
    Kind("reset", True, (), "the prefix cache is reset (nothing referenced, nothing in flight)"),
    # -- effects ------------------------------------------------------------------------------
    Kind(
        "hit",
        False,
        (("req", "id"), ("blocks", "blocks")),
        "an admission's lookup hits these published blocks (possibly none); they are touched",
    ),
    Kind(
        "evict", False, (("block", "block"),), "a cached free block loses its hash as it is reused"
    ),
    Kind(
        "alloc", False, (("req", "id"), ("block", "block")), "the free queue's head joins a table"
    ),
    Kind(
        "publish",
        False,
        (("req", "id"), ("index", "nat"), ("block", "block")),
        "the block is registered under the request's index-th chained hash",
    ),
    Kind("unpublish", False, (("block", "block"),), "a registration is rolled back or dropped"),
    Kind("free", False, (("block", "block"),), "one reference to the block is dropped"),
    Kind(
        "load_failed",
        False,
        (("req", "id"),),
        "the request's external load failed; it was freed and will recompute",
    ),
    Kind(
        "finish",
        False,
        (("req", "id"), ("reason", "reason")),
        "the request finished (length, stop or abort)",
    ),
    Kind(
        "dedup",
        False,
        (("req", "id"), ("index", "nat"), ("block", "block")),
        "the request's table position now names this published copy of its block, which "
        "takes the reference, or in a window group the null block: the request gives that "
        "position up (engines that register on their own: observed judging only)",
    ),
    Kind(
        "snapshot",
        False,
        (("req", "id"), ("index", "nat"), ("block", "block")),
        "the request's recurrent state is cached in block, published at the boundary of its "
        "index-th block of a slot group (key: its first (index + 1) * block_size tokens): its "
        "own slot, published in place, or a free block taking a copy of the slot (engines that "
        "register on their own: observed judging only; docs/model.md, Slot groups)",
    ),
    Kind(
        "track",
        False,
        (("req", "id"), ("block", "block"), ("tokens", "nat")),
        "the request's entry in the step being built also writes its recurrent state after "
        "exactly tokens tokens into block, one of its track slots in a slot group (SGLang's "
        "MAMBA extra_buffer; observed judging only; docs/model.md, Track slots)",
    ),
)

OPTIONAL = {"publish": ("hash",)}
"""Fields an event may carry beside its tuple: a publish the engine's opaque hash of the block
(the trace format's ``hash``; the judge checks it against the token chain)."""

TRAILING: dict[str, tuple[str, str]] = {
    kind: ("group", "nat") for kind in ("alloc", "hit", "publish", "dedup", "snapshot", "track")
} | {"arrive": ("encoder", "nat")}
"""The optional trailing field of each kind that has one: its name and type. An event of such a
kind is its fields, then that field when it is not 0 (the trace format's ``"group"``; an
``arrive``'s ``"encoder"``: the request's encoder tokens, which a ``cross`` group's table holds,
``docs/model.md``, "Cross-attention"; a property of the request, known when it arrives, needed
again at every re-admission, and no choice of the scheduler's: so the arrival carries it, not a
``schedule`` decision)."""

WHEN_SET: dict[str, tuple[str, str]] = {
    "schedule": ("bound", "nat"),
    "reset": ("preempting", "true"),
}
"""A decision's optional last field past its kind's fields, there exactly when the engine set it
(every value is meaningful, 0 included: no value stands for its absence): an admission's
``schedule`` carries ``bound``, the engine's bound on the request's prefix-cache hit in tokens
(``actions.schedule``; the trace format's ``"bound"``), and a ``reset`` made in the building step
that preempted every running request beside steps in flight carries ``preempting`` (always
``True``: ``("reset", True)``, ``actions.reset``; the trace format's ``"preempting": true``).
Without the field the hit is unbounded and the reset needs no step in flight, so every event
before the field reads as before."""

DECISIONS = frozenset(name for name, kind in KINDS.items() if kind.decision)
EFFECTS = frozenset(name for name, kind in KINDS.items() if not kind.decision)


def _positions(type_: str) -> dict[str, int]:
    return {
        name: i
        for name, kind in KINDS.items()
        for i, (_, t) in enumerate(kind.fields, 1)
        if t == type_
    }


REQUEST_AT = {
    name: kind.position("req")
    for name, kind in KINDS.items()
    if kind.fields and kind.fields[0][0] == "req"
}
_BLOCK = _positions("block")
_BLOCKS = _positions("blocks")
STEP_AT = {
    name: kind.position("step")
    for name, kind in KINDS.items()
    if kind.fields and kind.fields[0][0] == "step"
}
"""Where an event of each kind holds its one request (``REQUEST_AT``) or step (``STEP_AT``): the
tables ``request_of`` and ``step_of`` read, public for compiled readers (``judge/ids.py``)."""


def kind_of(event: Event) -> Kind | None:
    """The event's kind, or None for an unknown one."""
    name = event[0] if event else None
    return KINDS.get(name) if isinstance(name, str) else None


def field(event: Event, name: str) -> object:
    """The value of the named field (``KeyError`` for a field the kind does not have)."""
    kind = kind_of(event)
    if kind is None:
        raise KeyError(f"unknown event kind {event[:1]!r}")
    return event[kind.position(name)]


def request_of(event: Event) -> int | None:
    """The one request an event is about (its ``req`` field), or None (also for an event too
    short to have one: accessors never raise, a malformed event is the judge's to report)."""
    at = REQUEST_AT.get(cast(str, event[0])) if event else None
    return cast(int, event[at]) if at is not None and at < len(event) else None


def requests_of(event: Event) -> tuple[int, ...]:
    """Every request an event names: its ``req``, an execute's failed loads, a commit's sampled
    requests."""
    rid = request_of(event)
    if rid is not None:
        return (rid,)
    kind = event[0] if event else None
    if len(event) > 2 and isinstance(event[2], tuple):
        if kind == "execute":
            return cast("tuple[int, ...]", event[2])
        if kind == "commit":
            return tuple(pair[0] for pair in event[2] if isinstance(pair, tuple) and pair)
    return ()


def blocks_of(event: Event) -> tuple[int, ...]:
    """Every block an event names (a hit's blocks; the block of an evict, alloc, publish,
    unpublish, free or dedup)."""
    kind = cast(str, event[0]) if event else ""
    at = _BLOCK.get(kind)
    if at is not None:
        return (cast(int, event[at]),) if at < len(event) else ()
    at = _BLOCKS.get(kind)
    if at is not None and at < len(event) and isinstance(event[at], tuple):
        return cast("tuple[int, ...]", event[at])
    return ()


def step_of(event: Event) -> int | None:
    """The step a decision names (begin, submit, execute, commit), or None."""
    at = STEP_AT.get(cast(str, event[0])) if event else None
    return cast(int, event[at]) if at is not None and at < len(event) else None


def group_of(event: Event) -> int:
    """The KV-cache group an ``alloc``, ``hit``, ``publish``, ``dedup`` or ``snapshot`` is about
    (its trailing ``group``; 0 when absent, and for every other kind)."""
    kind = kind_of(event)
    if kind is None or TRAILING.get(kind.name, ("",))[0] != "group":
        return 0
    if len(event) <= len(kind.fields) + 1:
        return 0
    return cast(int, event[len(kind.fields) + 1])


def grouped(event: Event, group: int) -> Event:
    """``event`` (of a kind with a trailing ``group``, without it) in group ``group``: the
    canonical tuple, which carries the field only for a group other than 0."""
    return (*event, group) if group else event


def canonical(event: Event) -> Event:
    """``event`` with a trailing ``group`` of 0 dropped (the canonical tuple form)."""
    kind = kind_of(event)
    if kind is not None and kind.name in TRAILING and len(event) == len(kind.fields) + 2:
        if event[-1] == 0:
            return event[:-1]
    return event
