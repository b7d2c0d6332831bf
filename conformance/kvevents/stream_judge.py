"""The stream's judge: batches of KV events through ``spec/stream.py``, with the history a report
needs, and the reports of ``kvspec check --kv-events`` and ``kvspec watch``.

``StreamJudge.feed(batch, line)`` judges one delivered batch (the stream invariants before each
event), ``boundary(...)`` the engine invariants at a step boundary when an adapter knows the
engine's cache. A judge stops at its first violation. For every announced hash it keeps a short
ring of the events that named it, so that a violation comes with the *minimal history*: the
earlier events about the hashes involved. Memory follows the view (what the engine holds), not
the length of the stream: rings of removed hashes are kept for a bounded number of them.

``check_capture(path)`` judges a capture file (``frames.py``) and returns a
``report.Report``, so ``kvspec check``'s text, ``--json`` and ``--html`` forms print it.

``known``: engine findings a judge is told to take as known (``known_findings.KNOWN``):
each such event is read as the engine means it, counted and named in the report, and everything
else in the stream is judged as usual; without ``known`` the finding is reported as a violation.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvspec.spec import stream as spec
from kvspec.spec.invariants import Violation
from kvspec.spec.stream import Batch, Cleared, Hash, Key, Removed, Stored, StreamEvent, View

from ..report import Report
from .frames import CaptureError, FrameError, Sequencer, decode_batch, iter_capture, read_header
from .known_findings import Known

RETIRED = 4096
"""Rings of removed hashes kept for reports."""
MAX_VIEW = 1 << 22
"""More live announced blocks than this is refused (exit 2): no engine this judge serves holds
that many, and the judge must not grow without bound on hostile input."""


class ViewTooLarge(ValueError):
    pass


def describe(event: StreamEvent, limit: int = 8) -> str:
    """One line for a report."""
    if isinstance(event, Stored):
        hashes = ", ".join(spec.show(h) for h in event.hashes[:limit])
        more = f" (+{len(event.hashes) - limit})" if len(event.hashes) > limit else ""
        tokens = list(event.tokens[: limit * event.block_size])
        where = f"{event.medium} group {event.group}"
        lora = f", lora {event.lora_name}" if event.lora_name else ""
        return (
            f"BlockStored [{hashes}{more}] after {spec.show(event.parent)}, tokens {tokens}"
            f"{'…' if len(event.tokens) > len(tokens) else ''} ({where}{lora})"
        )
    if isinstance(event, Removed):
        hashes = ", ".join(spec.show(h) for h in event.hashes[:limit])
        more = f" (+{len(event.hashes) - limit})" if len(event.hashes) > limit else ""
        return f"BlockRemoved [{hashes}{more}] ({event.medium} group {event.group})"
    return "AllBlocksCleared"


Record = tuple[int, int, object]
"""(line, batch seq, the event or, for a batch's own line, its number of events)."""


def render(seq: int, what: object) -> str:
    if isinstance(what, int):
        return f"batch {seq}: {what} events"
    return f"batch {seq}: {describe(what)}"  # type: ignore[arg-type]


@dataclass
class Stats:
    batches: int = 0
    events: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    boundaries: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


class StreamJudge:
    """Judge one engine's stream (one publisher, one data-parallel rank).

    ``invariants``: the stream invariants to judge (default: ``spec.EVENT_INVARIANTS`` and
    ``SequenceInOrder``; ``StoreNamesNewHash`` only when named); ``capacity``: the engine's
    blocks, for ``ViewWithinCapacity``; ``keep_prefixes``: keep token prefixes (for
    ``AnnouncedHoldsPrefix``); ``join``: a stream whose first batch is not 0 is judged as joined
    late (``spec.joined``) rather than as a gap; ``start``: the sequence number the stream
    starts at (a publisher shared by several engines in turn starts each later than 0)."""

    def __init__(
        self,
        invariants: Iterable[str] | None = None,
        capacity: int | None = None,
        keep_prefixes: bool = False,
        join: bool = True,
        history: int = 32,
        start: int = 0,
        known: Iterable[str] = (),
    ) -> None:
        self.names = None if invariants is None else set(invariants)
        unknown = (self.names or set()) - set(spec.INVARIANTS)
        if unknown:
            raise ValueError(f"unknown stream invariant(s) {sorted(unknown)}")
        self.known = Known(known)
        self.capacity = capacity
        self.keep_prefixes = keep_prefixes
        self.join = join
        self.start = start
        self.view: View | None = None
        self.joined_at: int | None = None
        self.finding: Violation | None = None
        self.finding_line: int | None = None
        self.finding_event: str | None = None
        self.history_size = history
        self.rings: dict[Key, deque[Record]] = {}
        self.retired: OrderedDict[Key, deque[Record]] = OrderedDict()
        self.clears: deque[Record] = deque(maxlen=4)
        self.batch_lines: deque[Record] = deque(maxlen=4)
        self.stats = Stats()
        self._involved: list[Key] = []

    def take_up(self, origin: int | None) -> None:
        """Before the first batch: where the subscriber took the stream up (``Sequencer.origin``).
        The view starts there; it joined late when that is not 0, else a first batch past it is
        a gap."""
        if self.view is None and origin is not None:
            self.start, self.join = origin, origin != 0

    def wants(self, name: str) -> bool:
        return self.names is None or name in self.names

    # -- feeding --------------------------------------------------------------------------------

    def feed(self, batch: Batch, line: int | None = None) -> Violation | None:
        """Judge and apply one batch (``line``: where it is in its file; default its seq)."""
        if self.finding is not None:
            return self.finding
        line = batch.seq if line is None else line
        if self.view is None:
            if batch.seq != self.start and self.join:
                self.view, self.joined_at = spec.joined(self.keep_prefixes), batch.seq
            else:
                self.view = View(next_seq=self.start, keep_prefixes=self.keep_prefixes)
        v = self.view
        batch = self.known.read(v, batch)
        self.batch_lines.append((line, batch.seq, len(batch.events)))
        names = self.names
        if names is None:
            names = {"SequenceInOrder", *spec.EVENT_INVARIANTS}
            if self.capacity is not None:
                names.add("ViewWithinCapacity")
        found = spec.judge_batch(v, batch, names, self.capacity)
        applied = batch.events if found is None else batch.events[: max(found[0], 0)]
        for event in applied:
            self._remember(event, line, batch.seq)
        self.stats.batches += 1
        self.stats.events += len(applied)
        if len(v.blocks) > MAX_VIEW:
            raise ViewTooLarge(f"batch {batch.seq}: more than {MAX_VIEW} blocks announced")
        if found is None:
            return None
        index, violation = found
        event = batch.events[index] if index >= 0 else None
        if event is not None:
            self.stats.events += 1
            self._involved = self._keys_of(event)
        self.finding_event = (
            f"batch {batch.seq}: {describe(event)}" if event is not None else f"batch {batch.seq}"
        )
        return self._found(violation, line)

    def boundary(
        self,
        cache: Mapping[tuple[int | None, Hash], int] | None = None,
        medium: str | None = "GPU",
        blocks_of: Callable[[Key], Iterable[int]] | None = None,
        bad_blocks: Callable[[tuple[int, ...], Iterable[int]], tuple[int, ...]] | None = None,
        line: int | None = None,
    ) -> Violation | None:
        """The engine invariants at a step boundary: ``cache`` for ``ViewEqualsCache``,
        ``blocks_of`` and ``bad_blocks`` for ``AnnouncedHoldsPrefix`` (``spec/stream.py``)."""
        if self.finding is not None:
            return self.finding
        v = self.view
        if v is None:
            v = View(next_seq=self.start, keep_prefixes=self.keep_prefixes)
        self.view = v
        self.stats.boundaries += 1
        at = v.seq if line is None else line
        violation = None
        if cache is not None and self.wants("ViewEqualsCache"):
            violation = spec.view_equals_cache(v, cache, medium)
        if violation is None and blocks_of is not None and bad_blocks is not None:
            if self.wants("AnnouncedHoldsPrefix"):
                violation = spec.announced_holds_prefix(v, blocks_of, bad_blocks)
        if violation is None:
            return None
        self._involved = self._keys_named(violation, cache or {}, medium)
        self.finding_event = f"the step boundary after batch {v.seq}"
        return self._found(violation, at if at is not None else 0)

    # -- history --------------------------------------------------------------------------------

    def _keys_of(self, event: StreamEvent) -> list[Key]:
        if isinstance(event, Stored):
            keys = [(event.medium, event.group, h) for h in event.hashes]
            if event.parent is not None:
                keys.append((event.medium, event.group, event.parent))
            return keys
        if isinstance(event, Removed):
            return [(event.medium, event.group, h) for h in event.hashes]
        return []

    def _keys_named(
        self, violation: Violation, cache: Mapping[tuple[int | None, Hash], int], medium: str | None
    ) -> list[Key]:
        v = self.view
        assert v is not None
        named = [k for k in v.blocks if spec.show(k[2]) in violation.sentence]
        named += [(medium, g, h) for g, h in cache if spec.show(h) in violation.sentence]
        return named[:4]

    def _remember(self, event: StreamEvent, line: int, seq: int) -> None:
        record = (line, seq, event)
        if isinstance(event, Cleared):
            self.clears.append(record)
            for key, ring in self.rings.items():
                self._retire(key, ring)
            self.rings = {}
            self.stats.cleared += 1
            return
        v = self.view
        assert v is not None
        for key in self._keys_of(event):
            ring = self.rings.get(key) or self.retired.pop(key, None)
            if ring is None:
                ring = deque(maxlen=self.history_size)
            ring.append(record)
            if key in v.blocks:
                self.rings[key] = ring
            else:
                self.rings.pop(key, None)
                self._retire(key, ring)
        if isinstance(event, Stored):
            self.stats.stored += len(event.hashes)
        else:
            self.stats.removed += len(event.hashes)

    def _retire(self, key: Key, ring: deque[Record]) -> None:
        self.retired[key] = ring
        self.retired.move_to_end(key)
        if len(self.retired) > RETIRED:
            self.retired.popitem(last=False)

    def minimal_records(self) -> list[Record]:
        """The remembered events about the hashes involved, the last clears and batches, in
        stream order."""
        seen: dict[tuple[int, int, int], Record] = {}
        for key in self._involved:
            for record in self.rings.get(key) or self.retired.get(key) or ():
                seen[(record[0], record[1], id(record[2]))] = record
        for record in (*self.clears, *self.batch_lines):
            seen[(record[0], record[1], id(record[2]))] = record
        return sorted(seen.values(), key=lambda r: (r[0], r[1], isinstance(r[2], int)))

    def minimal_history(self) -> list[tuple[int, str]]:
        return [(line, render(seq, what)) for line, seq, what in self.minimal_records()]

    def _found(self, violation: Violation, line: int) -> Violation:
        self.finding = violation
        self.finding_line = line
        return violation

    # -- reports --------------------------------------------------------------------------------

    def report(self, path: str, seconds: float | None = None) -> Report:
        seconds = self.stats.seconds if seconds is None else seconds
        notes = []
        if self.joined_at is not None:
            notes.append(
                f"joined the stream at batch {self.joined_at}: blocks announced before it are "
                "unknown, so removals and parents of unknown hashes were not judged until the "
                "first clear"
            )
        notes += self.known.notes()
        note = "; ".join(notes) or None
        if self.finding is None:
            return Report(path, 0, self.stats.events, seconds, note=note)
        violation = self.finding
        records = self.minimal_records()
        history = [(line, render(seq, what)) for line, seq, what in records]
        involved = {key: i for i, key in enumerate(self._involved)}
        timeline = []
        for line, _, what in records:
            if isinstance(what, (Stored, Removed)):
                kind = "publish" if isinstance(what, Stored) else "unpublish"
                for key in self._keys_of(what):
                    if key in involved:
                        timeline.append((line, involved[key], kind, None))
            elif isinstance(what, Cleared):
                timeline += [(line, y, "free", None) for y in involved.values()]
        return Report(
            path,
            1,
            self.stats.events,
            seconds,
            line=self.finding_line,
            invariant=violation.invariant,
            message=violation.sentence,
            explanation=explanation(violation.invariant),
            event=self.finding_event,
            history=history,
            timeline=timeline,
            note=note,
        )


def explanation(name: str) -> str:
    doc = spec.INVARIANTS[name].__doc__ if name in spec.INVARIANTS else ""
    return " ".join((doc or "").split())


# -- judging a capture file ---------------------------------------------------------------------


def check_capture(
    path: str | Path,
    invariants: Iterable[str] | None = None,
    capacity: int | None = None,
    known: Iterable[str] = (),
) -> Report:
    """Judge a capture file; never raises for bad content (exit code 2, ``file:line: message``).
    ``known``: names from ``known_findings.KNOWN`` whose events are read as the engine means them."""
    name = str(path)
    started = time.perf_counter()
    judge = StreamJudge(invariants, capacity, known=known)
    try:
        header = read_header(path)
        replay = header.get("replay") is not None
        sequencer = Sequencer(expected=None)
        number = 1
        for number, frame in iter_capture(path):
            ready: list[tuple[int, bytes]]
            if frame.via == "replay-end":
                ready = sequencer.give_up() if sequencer.wanted is not None else []
                sequencer.start_at(0)  # if the first replay found nothing, the stream starts at 0
            else:
                ready = sequencer.offer(frame.seq, frame.payload)
                if not replay and sequencer.wanted is not None:
                    ready += sequencer.give_up()  # no replay socket: a gap stays a gap
            if _feed_all(judge, ready, number, name, sequencer.origin):
                break
        else:
            _feed_all(judge, sequencer.give_up(), number, name, sequencer.origin)
    except (CaptureError, ViewTooLarge) as err:
        return Report(name, 2, judge.stats.events, error=_where(err, name))
    except OSError as err:
        return Report(name, 2, judge.stats.events, error=f"{name}: {err.strerror or err}")
    return judge.report(name, time.perf_counter() - started)


def _feed_all(
    judge: StreamJudge, ready: list[tuple[int, bytes]], line: int, name: str, origin: int | None
) -> bool:
    for seq, payload in ready:
        judge.take_up(origin)
        try:
            batch = decode_batch(seq, payload)
        except FrameError as err:
            raise CaptureError(name, line, str(err)) from None
        if judge.feed(batch, line) is not None:
            return True
    return False


def _where(err: Exception, name: str) -> str:
    text = str(err)
    return text if text.startswith(name) else f"{name}: {text}"
