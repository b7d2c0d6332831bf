"""What a deviation breaks: an engine's events judged on past the first difference from the spec.

Strict matching stops at the first effect or observable that differs from the spec's
(``Disagreement``). That says *where* the engine went its own way, not what it costs: a double
free (the pool's bookkeeping is corrupt), a reference not taken (a live block can be recycled), a
free order that only costs hits, and a legal choice the spec happens not to make all read alike.

``follow`` judges the same events again with observed matching (``core.Judge``: the engine's legal
choices of allocated and hit blocks steered into the spec, its own unpublishes applied) and a
``Follower``: where the engine's effects still differ from the spec's, the spec's state is made
to have the engine's instead (an extra ``free`` drops a reference, a missing one keeps it, a
missing ``evict`` keeps the hash on the reused block, a hit the spec's index does not hold is
registered there, an allocation of a block the spec holds puts it on the free queue first, the
engine's refcounts and free queue replace the spec's at each snapshot), and every invariant is
checked by its full definition after every decision. The run goes on to its end (the rest of the
file, or the fuzzer's run to idle) or to the first invariant that breaks: the deviation's
*consequence* (``Consequence``). None broken means an efficiency difference at worst: the
hits the engine's lookups missed although the spec's index (following the engine) held them, and
the registrations it left out, are counted.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvspec.spec import INVARIANTS, Config, groups
from kvspec.spec.pool import add_key, lookup
from kvspec.spec.state import NULL_BLOCK, Request, State

from .core import Judge, Model
from .findings import Finding
from .spec_model import SpecModel

Event = tuple[object, ...]
Snapshot = tuple[tuple[int, ...], tuple[int, ...]]

SAFETY = frozenset(INVARIANTS) | {"TablesAppendOnly"}
"""Invariants whose break is a safety finding (every invariant of the spec is one)."""


class CannotFollow(Exception):
    """An engine effect the spec's state cannot be made to have (a ``finish`` of its own)."""


@dataclass
class Consequence:
    """What a deviation leads to. ``invariant`` None: none broke in the rest of the run."""

    deviation: str
    """The first deviation, as the strict judge reported it."""
    deviation_event: int
    invariant: str | None = None
    message: str | None = None
    event: int | None = None
    """Index of the event at which the invariant broke."""
    deviations: list[tuple[int, str]] = field(default_factory=list)
    """(event index, what) of every deviation the follower applied, in order."""
    missed_hits: int = 0
    """Blocks the engine's lookups did not hit although the spec's index held them."""
    missing_publishes: int = 0
    """Registrations the spec makes that the engine left out (hits lost to later requests)."""
    stopped: str | None = None
    """Why the run could not be followed to its end (the follower's own limit), or None."""
    events: int = 0
    """Events judged."""

    @property
    def safety(self) -> bool:
        return self.invariant in SAFETY

    @property
    def lost_hits(self) -> int:
        return self.missed_hits + self.missing_publishes

    def headline(self) -> str:
        """One line: the deviation, then what it breaks."""
        where = f"deviation at event {self.deviation_event}"
        if self.invariant is not None:
            return (
                f"{self.deviation} ({where}) -> {self.invariant} broken by the decision at event "
                f"{self.event}: {self.message}"
            )
        if self.stopped is not None:
            return f"{self.deviation} ({where}) -> not followed further: {self.stopped}"
        return (
            f"{self.deviation} ({where}) -> no invariant broken in the rest of the run "
            f"(judged to its end, event {self.events}): efficiency at worst, {self.lost_hits} "
            "hits lost "
            f"({self.missed_hits} missed by lookups, {self.missing_publishes} registrations "
            "left out)"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "deviation": self.deviation,
            "deviation_event": self.deviation_event,
            "safety": self.safety,
            "invariant": self.invariant,
            "message": self.message,
            "invariant_event": self.event,
            "lost_hits": self.lost_hits,
            "missed_hits": self.missed_hits,
            "missing_publishes": self.missing_publishes,
            "deviations": [{"event": i, "what": what} for i, what in self.deviations],
            "stopped": self.stopped,
            "headline": self.headline(),
        }


class Follower:
    """The spec's state made to have the engine's effects (``core.Follower``)."""

    def __init__(self) -> None:
        self.deviations: list[tuple[int, str]] = []
        self.missed_hits = 0
        self.missing_publishes = 0
        self.hidden: list[tuple[tuple[int, ...], list[int]]] = []
        self.keys: dict[int, Hashable] = {}
        self.index = 0

    def _state(self, model: Model) -> State:
        return model.export()

    def before(self, model: Model, decision: Event, effects: list[Event], index: int) -> None:
        s = self._state(model)
        self.index = index
        self.keys = {b: blk.key for b, blk in enumerate(s.blocks) if blk.key is not None}
        if decision[0] != "schedule":
            return
        req = _request(s, decision[1])
        if req is None:
            return
        for effect in effects:
            if effect[0] == "hit" and req.status == "waiting":
                hits: tuple[object, ...] = tuple(effect[2])  # type: ignore[arg-type]
                for i, block in enumerate(hits):
                    if not isinstance(block, int) or not 0 <= block < len(s.blocks):
                        raise CannotFollow(f"hit of an unknown block {block!r}")
                    key = s.key(req, i)
                    if block not in s.index.get(key, []):
                        self._deviate(
                            index,
                            f"r{req.id} hits block {block} as its block {i}, which the spec's "
                            "index does not hold under that prefix",
                        )
                        if s.blocks[block].key is not None:
                            _drop(s, block)
                        add_key(s, block, key)
                spec_hits = lookup(s, req)
                if len(spec_hits) > len(hits):
                    self.missed_hits += len(spec_hits) - len(hits)
                    self._deviate(
                        index,
                        f"r{req.id} hits {len(hits)} blocks where the spec's index holds "
                        f"{len(spec_hits)}",
                    )
                    key = s.key(req, len(hits))
                    hidden = _Hidden(s.index[key])
                    s.index[key] = hidden
                    self.hidden.append((key, hidden))
            elif effect[0] == "alloc":
                block = effect[2]
                if not isinstance(block, int) or not 0 < block < len(s.blocks):
                    raise CannotFollow(f"allocation of block {block!r}")
                if block not in s.free:
                    self._deviate(
                        index, f"r{req.id} is allocated block {block}, which the spec holds in use"
                    )
                    s.free.insert(0, block)

    def after(
        self, model: Model, decision: Event, expected: list[Event], effects: list[tuple[Event, int]]
    ) -> None:
        s = self._state(model)
        for key, blocks in self.hidden:
            if s.index.get(key) is blocks:
                del s.index[key]
            if len(blocks):  # (an allocation may have evicted some of them meanwhile)
                s.index.setdefault(key, []).extend(list.__iter__(blocks))
        self.hidden = []
        remaining = list(expected)
        reordered = False
        done: list[Event] = []
        for effect, at in effects:
            if effect in done and effect not in remaining and effect[0] == "free":
                self._deviate(at, f"engine freed block {effect[1]} twice")
            done.append(effect)
            if effect in remaining:
                if remaining.index(effect) != 0 and not reordered:
                    reordered = True
                    self._deviate(at, f"effect {effect} comes earlier than the spec's order")
                remaining.remove(effect)
                continue
            self._extra(s, effect, at)
        for missing in remaining:
            self._missing(s, missing, effects[-1][1] if effects else self.index)

    def sync(self, judge: Judge, refcounts: Sequence[int], free: Sequence[int]) -> None:
        """The engine's snapshot: its refcounts and free queue replace the spec's."""
        s = self._state(judge.model)
        at = judge.events_seen
        mine = [b.refcount for b in s.blocks]
        if len(refcounts) != len(mine):
            raise CannotFollow(f"a snapshot of {len(refcounts)} blocks, the pool has {len(mine)}")
        for block, (theirs, ours) in enumerate(zip(refcounts, mine, strict=True)):
            if theirs != ours:
                self._deviate(at, f"engine's refcount of block {block} is {theirs}, spec's {ours}")
                s.blocks[block].refcount = theirs
                s.touched.blocks.add(block)
        if list(free) != s.free:
            if sorted(free) == sorted(s.free):
                self._deviate(at, f"engine's free queue is in another order: {list(free)}")
            else:
                self._deviate(at, f"engine's free queue {list(free)}, spec's {s.free}")
            s.free[:] = list(free)
            s.touched.blocks.update(free)

    # -- the effects ------------------------------------------------------------------------------

    def _extra(self, s: State, effect: Event, at: int) -> None:
        """An effect of the engine's that the spec does not have: applied to the spec's state."""
        kind = effect[0]
        self._deviate(at, f"engine emitted {effect}, which the spec does not")
        if kind == "free":
            block = self._block(s, effect[1])
            _window_gives_up(s, block)
            b = s.blocks[block]
            b.refcount -= 1
            if b.refcount == 0:
                s.free.insert(0, block) if b.key is None else s.free.append(block)
            s.touched.blocks.add(block)
        elif kind in ("evict", "unpublish"):
            block = self._block(s, effect[1])
            if s.blocks[block].key is not None:
                _drop(s, block)
        elif kind == "alloc":
            block = self._block(s, effect[2])
            req = _request(s, effect[1])
            if block in s.free:
                s.free.remove(block)
            if s.blocks[block].key is not None:
                _drop(s, block)
            s.blocks[block].refcount += 1
            if req is not None:
                req.table.append(block)
                s.touched.requests.add(req.id)
            s.touched.blocks.add(block)
        elif kind == "publish":
            block = self._block(s, effect[3])
            req = _request(s, effect[1])
            index = effect[2]
            if req is None or not isinstance(index, int):
                raise CannotFollow(f"{effect} names no known request")
            if (index + 1) * s.config.block_size > len(req.tokens):
                raise CannotFollow(f"{effect}: that block of r{req.id}'s tokens is not full")
            if s.blocks[block].key is not None:
                _drop(s, block)
            add_key(s, block, s.key(req, index))
        elif kind == "hit":
            pass  # its blocks were followed before the decision (``before``)
        else:
            raise CannotFollow(f"the engine emitted {effect}, which the spec cannot follow")

    def _missing(self, s: State, effect: Event, at: int) -> None:
        """An effect of the spec's that the engine did not have: undone in the spec's state."""
        kind = effect[0]
        self._deviate(at, f"engine did not emit {effect}")
        if kind == "free":
            block = self._block(s, effect[1])
            if block in s.free:
                s.free.remove(block)
            s.blocks[block].refcount += 1
            s.touched.blocks.add(block)
        elif kind in ("evict", "unpublish"):
            block = self._block(s, effect[1])
            key = self.keys.get(block)
            if key is not None and s.blocks[block].key is None:
                add_key(s, block, key)  # type: ignore[arg-type]
        elif kind == "publish":
            self.missing_publishes += 1
            block = self._block(s, effect[3])
            if s.blocks[block].key is not None:
                _drop(s, block)
        elif kind == "alloc":
            block = self._block(s, effect[2])
            req = _request(s, effect[1])
            if req is not None and block in req.table:
                req.table.remove(block)
                s.touched.requests.add(req.id)
            s.blocks[block].refcount -= 1
            if s.blocks[block].refcount == 0:
                s.free.insert(0, block)
            s.touched.blocks.add(block)
        elif kind == "hit":
            pass
        else:
            raise CannotFollow(f"the engine did not emit {effect}, which the spec cannot follow")

    def _block(self, s: State, value: object) -> int:
        if not isinstance(value, int) or not 0 <= value < len(s.blocks) or value == NULL_BLOCK:
            raise CannotFollow(f"an effect on block {value!r}")
        return value

    def _deviate(self, at: int, what: str) -> None:
        self.deviations.append((at, what))


class _Hidden(list[int]):
    """An index entry past the engine's shorter hit, during its decision: it holds its blocks
    (an allocation that evicts one of them drops it as usual) but reads as empty, so the spec's
    lookup stops where the engine's did."""

    def __bool__(self) -> bool:
        return False


def _request(s: State, value: object) -> Request | None:
    return s.requests.get(value) if isinstance(value, int) else None


def _window_gives_up(s: State, block: int) -> None:
    """An engine's extra free of a block one running request's window table holds is that
    table giving the block up (vLLM's ``remove_skipped_blocks``: the slot nulled, then the
    reference dropped), so the spec's table says so too and ``NoUnwrittenRead`` (group 0) or
    ``NoReadOfRecycled`` (groups 1 ..) meets any step in flight that still attends to it. A block
    no running request's window holds, or several do (the free names no request), only drops a
    reference, as under full attention, where no engine gives a slot up."""
    holders = [
        (req, table, at)
        for req in s.requests.values()
        if req.status == "running"
        for g in range(max(1, len(s.config.groups)))
        if groups.kind(s, g) == "window" and (g == 0 or req.group_tables)
        for table in (s.table_of(req, g),)
        for at, held in enumerate(table)
        if held == block
    ]
    if len(holders) == 1:
        req, table, at = holders[0]
        table[at] = NULL_BLOCK
        s.touched.requests.add(req.id)


def _drop(s: State, block: int) -> None:
    b = s.blocks[block]
    owners = s.index.get(b.key, [])  # type: ignore[arg-type]
    if block in owners:
        owners.remove(block)
        if not owners:
            del s.index[b.key]  # type: ignore[arg-type]
    b.key = None
    s.touched.blocks.add(block)


def follow(
    config: Config,
    events: Iterable[Event],
    deviation: Finding,
    snapshots: Sequence[tuple[int, Snapshot]] = (),
) -> Consequence:
    """Judge ``events`` (the whole stream, from its first event) past ``deviation``, the strict
    judge's ``Disagreement``: the engine's effects followed, every invariant checked after every
    decision, the engine's ``snapshots`` ((events seen, (refcounts, free queue)), in order)
    taken where they were taken. What it leads to."""
    judge = Judge(SpecModel(config, incremental=False), observed=True)
    follower = Follower()
    judge.follower = follower
    result = Consequence(deviation.message, deviation.event)
    pending = list(snapshots)
    seen = 0
    try:
        for event in events:
            while pending and pending[0][0] <= seen:
                _sync(judge, follower, pending.pop(0)[1])
                if judge.finding is not None:
                    break
            if judge.finding is not None or judge.feed(event) is not None:
                break
            seen += 1
        else:
            for _, snapshot in pending:
                _sync(judge, follower, snapshot)
                if judge.finding is not None:
                    break
            judge.settle()
            if judge.finding is None and not judge.held:
                judge._check(judge.events_seen)
    except CannotFollow as err:
        result.stopped = str(err)
    except Exception as err:  # a state the spec never reaches by itself: the follower stops
        result.stopped = f"the spec's state could not follow: {type(err).__name__}: {err}"
    result.events = judge.events_seen
    result.deviations = follower.deviations
    twice = [what for _, what in follower.deviations if what.endswith(" twice")]
    if twice:  # the strict judge saw only the effect after it differ
        result.deviation = f"{twice[0]} ({deviation.message})"
    result.missed_hits = follower.missed_hits
    result.missing_publishes = follower.missing_publishes
    finding = judge.finding
    if finding is not None:
        if finding.invariant in SAFETY:
            result.invariant, result.message, result.event = (
                finding.invariant,
                finding.message,
                finding.event,
            )
        elif result.stopped is None:
            result.stopped = f"{finding.invariant}: {finding.message}"
    return result


def explain(
    config: Config,
    events: Iterable[Event],
    finding: Finding,
    snapshots: Sequence[tuple[int, Snapshot]] = (),
) -> Consequence | None:
    """A strict finding's consequence, or None: a ``Disagreement``'s always (``follow``); an
    ``Illegal``'s where following the engine's own effects gets past it. A decision the spec
    judges illegal only because of what its effects would be in the spec's state (an admission
    whose ``schedule`` counts tokens from the engine's shorter ``hit``: the spec's longer lookup
    leaves the count past the known tokens) is the engine's effect deviating; its consequence
    names the deviation (``r1 hits 1 blocks where the spec's index holds 2``) and what it leads
    to. An ``Illegal`` the follower meets too is the engine's own decision: no consequence."""
    if finding.invariant == "Disagreement":
        return follow(config, events, finding, snapshots)
    if finding.invariant != "Illegal":
        return None
    result = follow(config, events, finding, snapshots)
    first = [(at, what) for at, what in result.deviations if at <= finding.event]
    if result.stopped is not None or not first:
        return None
    at, what = first[0]
    result.deviation = f"{what} (strictly: Illegal: {finding.message})"
    result.deviation_event = at
    return result


def _sync(judge: Judge, follower: Follower, snapshot: Snapshot) -> None:
    if judge.settle() is not None:
        return
    follower.sync(judge, snapshot[0], snapshot[1])
    judge._check(judge.events_seen)
