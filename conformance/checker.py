"""The streaming checker: judge a trace file (or an engine in-process) one event at a time.

``Checker`` is the ``Judge`` of ``lockstep.py`` (a subclass: one judging core) made to run over
unbounded streams:

* every decision is applied to the spec and every effect compared with the spec's, exactly as the
  Judge does; with ``check_every=1`` (the default) every invariant is checked after every
  decision, so the checker finds every violation the Judge finds, at the same event. The check is
  incremental (``spec/incremental.py``): only what the decision changed is re-evaluated, with the
  same answer as the full definitions of ``spec/invariants.py`` (``docs/checker.md`` gives the
  argument; ``tests/test_incremental.py`` tests it), so the default mode is also the fast one;
* finished requests are dropped from the spec's state once no in-flight step references them (the
  spec would keep them forever); the ids ever used are kept as compact ranges so that a reused or
  unknown id is still recognised; so memory depends on the pool size and the requests alive at
  once, not on the length of the trace;
* for each block and each live request it keeps a bounded ring of the last ``history`` events that
  touched it (an executed step is one record per block, expanded into its writes and reads for a
  report), so a violation comes with its *minimal history*: only the earlier events that touched
  the blocks and requests involved;
* when ``publish`` lines carry opaque hashes, it checks that the same hash always names the same
  token prefix and the same prefix always the same hash, among the blocks published at once
  (``HashChainConsistent``).

``check_every=k > 1`` checks the state only every k decisions and at the end: effects are still
compared at every event and every decision's guard is still checked (``Illegal`` and
``Disagreement`` are found at once), but a violation is reported up to k - 1 decisions late (the
report says in which range of lines it arose), and one that arises and is repaired between two
checks (e.g. a zombie publication rolled back or evicted before anyone reads it) is missed.
``NoUnwrittenRead`` is latched by the spec (a bad read is recorded at ``execute`` and stays), so it
is never missed. Since the default mode is incremental, k > 1 saves little (see
``bench/bench_checker.py``); it is kept for compatibility.

``Monitor`` feeds a ``Checker`` from inside an engine; ``check_path`` checks a file. Both judge
with the fast model by default (``engine="fast"``, ``fastmodel.py``, kept equal to this
``Checker`` by differential tests), which hands a finding over to this ``Checker`` for the
report (``fastpath.py``); ``engine="spec"`` judges every event here.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import orjson

from kvspec.spec import ACTIONS, Config
from kvspec.spec.events import blocks_of, request_of, requests_of

from .ids import IdSet, UnknownId, check_ids
from .lockstep import Event, Finding, Judge
from .report import describe
from .trace import TraceError, iter_trace, judging_of

if TYPE_CHECKING:
    from .background import Background
    from .fastpath import FastRun

HASH_CHAIN = "HashChainConsistent"
EXPLANATIONS = {
    HASH_CHAIN: "The engine's opaque block hashes agree with the token chain: one hash names one "
    "token prefix, and one prefix has one hash. A mismatch means a lookup can hit a block holding "
    "other tokens (or miss a valid one).",
}


def explanation(finding: Finding) -> str:
    return EXPLANATIONS.get(finding.invariant) or finding.explanation


class Checker(Judge):
    """A ``Judge`` for unbounded streams: file lines, bounded memory, rings for reports, ids and
    opaque hashes checked."""

    def __init__(
        self,
        config: Config,
        check_every: int = 1,
        history: int = 50,
        retired_requests: int = 256,
        incremental: bool = True,
    ) -> None:
        """``history``: events kept per block and per request for reports; ``retired_requests``:
        rings of this many finished requests are kept for reports."""
        super().__init__(config, check_every=check_every, incremental=incremental)
        self.history = history
        self.retired_requests = retired_requests
        self.finding_line: int | None = None
        self.arose_after: int | None = None
        """Every-k mode: the line of the last check that passed before the finding."""
        self.last_check_line = 0
        self._line = 0
        self._ids = IdSet()
        self._max_step = -1
        self._finished: set[int] = set()
        self.block_rings: list[deque[tuple[int, Event]]] = [
            deque(maxlen=history) for _ in range(config.num_blocks)
        ]
        self.request_rings: dict[int, deque[tuple[int, Event]]] = {}
        self.retired: OrderedDict[int, deque[tuple[int, Event]]] = OrderedDict()
        self._block_hash: dict[int, str] = {}
        self._hash_key: dict[str, list[object]] = {}
        self._key_hash: dict[tuple[int, ...], list[object]] = {}
        self._event: Event | None = None

    @property
    def last_event(self) -> tuple[int, Event] | None:
        """(line, event) of the last event fed."""
        return None if self._event is None else (self._line, self._event)

    # -- feeding --------------------------------------------------------------------------------

    def feed(  # type: ignore[override]
        self, event: Event, line: int | None = None, hash_: str | None = None
    ) -> Finding | None:
        """Judge one event (``line``: where it is in its file; default its index + 1).
        Raises ``UnknownId`` for a request or step id that never existed."""
        if self.finding is not None:
            return self.finding
        index = self.events_seen
        self.events_seen += 1
        line = index + 1 if line is None else line
        self._line = line
        self._event = event
        kind = event[0]
        if kind in ACTIONS:
            self._check_ids(kind, event)
            return self._decide(event, kind, index, line)
        expected = self.expected
        if not expected or event != expected[0]:
            # An effect the spec computed names only known ids: check them on a mismatch only.
            self._check_ids(kind, event)
            return self.match(event, index)
        expected.popleft()
        self._remember_effect(event, kind, line)
        if hash_ is not None and kind == "publish":
            return self._check_hash(event, hash_, index)
        if kind in ("unpublish", "evict"):
            self._drop_hash(event[1])  # type: ignore[arg-type]
        return None

    def finish(self, line: int | None = None) -> Finding | None:
        """End of the stream: no effect may be missing; the last invariant check runs."""
        line = self.events_seen + 1 if line is None else line
        self._line = line
        if self.finding is None and self.expected:
            self._found("Disagreement", f"missing effect {self.expected[0]}", self.events_seen)
        if self.finding is None and self.check_every > 1:
            self.check_now(self.events_seen)
        return self.finding

    # -- internals ------------------------------------------------------------------------------

    def _check_ids(self, kind: object, event: Event) -> None:
        self._max_step = check_ids(kind, event, self._ids, self._max_step)

    def _decide(self, event: Event, kind: object, index: int, line: int) -> Finding | None:
        s = self.state
        if self.expected:
            return self._found("Disagreement", f"missing effect {self.expected[0]}", index)
        self._prune()
        if kind == "arrive":
            rid = event[1]
            if rid in self._ids and rid not in s.requests:
                return self._found("Illegal", f"arrive r{rid}: the id is taken", index)
        elif kind in ("schedule", "preempt", "abort"):
            rid = event[1]
            if rid not in s.requests:
                return self._found("Illegal", f"{kind} r{rid}: it has finished", index)
        elif kind == "execute":
            self._remember_execute(line)
        found = self.decide(event, index)
        if self.finding is not None and self.finding.invariant in ("Illegal", "Disagreement"):
            return found
        if kind == "arrive":
            rid = event[1]
            self._ids.add(rid)  # type: ignore[arg-type]
            self.request_rings[rid] = deque(maxlen=self.history)  # type: ignore[index]
        self._remember(event, line)
        for effect in self.expected:
            if effect[0] == "finish":
                self._finished.add(effect[1])  # type: ignore[arg-type]
        if found is None and self.decisions % self.check_every == 0:
            self.last_check_line = line
        return found

    def _prune(self) -> None:
        """Drop finished requests no in-flight step references any more."""
        if not self._finished:
            return
        s = self.state
        for rid in list(self._finished):
            if any(rid in st.entries or rid in st.registrations for st in s.steps):
                continue
            self._finished.discard(rid)
            s.requests.pop(rid, None)
            ring = self.request_rings.pop(rid, None)
            if ring is not None:
                self.retired[rid] = ring
                if len(self.retired) > self.retired_requests:
                    self.retired.popitem(last=False)

    def _remember(self, event: Event, line: int) -> None:
        kind = event[0]
        rings = self.request_rings
        if kind in ("arrive", "schedule", "preempt", "abort"):
            ring = rings.get(event[1])  # type: ignore[call-overload]
            if ring is not None:
                ring.append((line, event))
        elif kind == "execute":
            for rid in event[2]:  # type: ignore[attr-defined]
                if rid in rings:
                    rings[rid].append((line, event))
        elif kind == "commit":
            for rid, _ in event[2]:  # type: ignore[attr-defined]
                if rid in rings:
                    rings[rid].append((line, event))

    def _remember_effect(self, event: Event, kind: object, line: int) -> None:
        if kind in ("evict", "unpublish", "free"):
            self.block_rings[event[1]].append((line, event))  # type: ignore[index]
            return
        if kind in ("alloc", "publish", "dedup"):
            self.block_rings[event[-1]].append((line, event))  # type: ignore[index]
        elif kind == "hit":
            for block in event[2]:  # type: ignore[attr-defined]
                self.block_rings[block].append((line, event))
        ring = self.request_rings.get(event[1])  # type: ignore[call-overload]
        if ring is not None:
            ring.append((line, event))

    def _remember_execute(self, line: int) -> None:
        """The oldest submitted step is about to execute: one record of its writes and reads goes
        to the ring of every block it touches (``step_accesses`` expands it for a report)."""
        step = next((st for st in self.state.steps if st.phase == "submitted"), None)
        if step is None:
            return
        bsz = self.config.block_size
        accesses = tuple((rid, e.start // bsz, e.blocks) for rid, e in step.entries.items())
        record = (line, ("step-io", step.id, accesses))
        rings = self.block_rings
        for block in {block for _, _, blocks in accesses for block in blocks}:
            rings[block].append(record)

    def _check_hash(self, event: Event, hash_: str, index: int) -> Finding | None:
        _, rid, i, block = event
        key = self.state.key(self.state.requests[rid], i)  # type: ignore[index, arg-type]
        named = self._hash_key.get(hash_)
        if named is not None and named[0] != key:
            return self._found(
                HASH_CHAIN,
                f"block {block} is published under hash {hash_!r} for r{rid}'s tokens "
                f"0..{len(key) - 1}, but that hash names a different {len(named[0])}-token "  # type: ignore[arg-type]
                "prefix",
                index,
                (block,),  # type: ignore[arg-type]
                (rid,),  # type: ignore[arg-type]
            )
        other = self._key_hash.get(key)
        if other is not None and other[0] != hash_:
            return self._found(
                HASH_CHAIN,
                f"block {block} is published under hash {hash_!r}, but the same token prefix "
                f"(r{rid}'s tokens 0..{len(key) - 1}) is published under {other[0]!r}",
                index,
                (block,),  # type: ignore[arg-type]
                (rid,),  # type: ignore[arg-type]
            )
        self._drop_hash(block)  # type: ignore[arg-type]
        self._block_hash[block] = hash_  # type: ignore[index]
        for table, k, v in ((self._hash_key, hash_, key), (self._key_hash, key, hash_)):
            entry = table.setdefault(k, [v, 0])  # type: ignore[attr-defined]
            entry[1] += 1
        return None

    def _drop_hash(self, block: int) -> None:
        hash_ = self._block_hash.pop(block, None)
        if hash_ is None:
            return
        key = self._hash_key[hash_][0]
        for table, k in ((self._hash_key, hash_), (self._key_hash, key)):
            entry = table[k]  # type: ignore[index]
            entry[1] -= 1  # type: ignore[operator]
            if entry[1] == 0:
                del table[k]  # type: ignore[attr-defined]

    def _found(
        self,
        invariant: str,
        message: str,
        index: int,
        blocks: tuple[int, ...] = (),
        requests: tuple[int, ...] = (),
    ) -> Finding:
        finding = super()._found(invariant, message, index, blocks, requests)
        self.finding_line = self._line
        if self.check_every > 1 and invariant not in ("Illegal", "Disagreement", HASH_CHAIN):
            self.arose_after = self.last_check_line
        return finding

    # -- the minimal history --------------------------------------------------------------------

    def involved(self) -> tuple[set[int], set[int]]:
        """(blocks, requests) named by the finding and by the violating event."""
        if self.finding is None:
            return set(), set()
        blocks, reqs = set(self.finding.blocks), set(self.finding.requests)
        if self.last_event is not None:
            event = self.last_event[1]
            blocks.update(blocks_of(event))
            reqs.update(requests_of(event))
        n = self.config.num_blocks
        return {b for b in blocks if isinstance(b, int) and 0 <= b < n}, reqs

    def minimal_history(self) -> list[tuple[int, Event]]:
        """The remembered events that touched the involved blocks and requests, in file order."""
        blocks, reqs = self.involved()
        seen: dict[tuple[int, str], tuple[int, Event]] = {}
        rings: list[Iterable[tuple[int, Event]]] = [
            step_accesses(self.block_rings[b], b) for b in sorted(blocks)
        ]
        for rid in sorted(reqs):
            ring = self.request_rings.get(rid) or self.retired.get(rid)
            if ring is not None:
                rings.append(ring)
        for ring in rings:
            for line, event in ring:
                seen.setdefault((line, repr(event)), (line, event))
        if self.last_event is not None:
            line, event = self.last_event
            seen.setdefault((line, repr(event)), (line, event))
        return sorted(seen.values(), key=lambda item: item[0])


def step_accesses(ring: Iterable[tuple[int, Event]], block: int) -> Iterator[tuple[int, Event]]:
    """A block's ring with each step's record expanded into that step's writes and reads of the
    block: ``("wrote" | "read", request, block, step)``."""
    for line, event in ring:
        if event[0] != "step-io":
            yield line, event
            continue
        _, step, accesses = event
        for rid, first, blocks in accesses:  # type: ignore[attr-defined]
            for i, b in enumerate(blocks):
                if b == block:
                    yield line, ("wrote" if i >= first else "read", rid, block, step)


def describe_any(event: Event) -> str:
    """``describe`` plus the checker's own entries (a step's writes and reads of a block)."""
    kind = event[0]
    if kind in ("wrote", "read"):
        _, rid, block, step = event
        verb = "writes" if kind == "wrote" else "reads"
        return f"step {step} {verb} block {block} for r{rid}"
    return describe(event)


# -- checking a file ------------------------------------------------------------------------------


@dataclass
class Report:
    path: str
    exit_code: int
    """0 holds, 1 violation, 2 unreadable."""
    events: int = 0
    seconds: float = 0.0
    error: str | None = None
    """For exit 2: ``file:line: message``."""
    line: int | None = None
    invariant: str | None = None
    message: str | None = None
    explanation: str | None = None
    event: str | None = None
    arose_after: int | None = None
    history: list[tuple[int, str]] = field(default_factory=list)
    timeline: list[tuple[int, int, str, int | None]] = field(default_factory=list)
    """(line, block, what, request) for the picture: the involved blocks' history."""
    note: str | None = field(default=None, compare=False)
    """How it was judged, when not as usual: the fast model from source (``fastbuild.py``)."""

    @property
    def status(self) -> str:
        return ("holds", "violation", "unreadable")[self.exit_code]

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "status": self.status,
            "exit": self.exit_code,
            "events": self.events,
            "seconds": round(self.seconds, 3),
        }
        if self.error is not None:
            out["error"] = self.error
        if self.note is not None:
            out["note"] = self.note
        if self.invariant is not None:
            out["violation"] = {
                "line": self.line,
                "where": f"{self.path}:{self.line}",
                "invariant": self.invariant,
                "message": self.message,
                "explanation": self.explanation,
                "event": self.event,
                "arose_after_line": self.arose_after,
                "history": [{"line": ln, "event": text} for ln, text in self.history],
            }
        return out

    def text(self) -> str:
        if self.exit_code == 2:
            return self.error or f"{self.path}: unreadable"
        note = "" if self.note is None else f" [note: {self.note}]"
        if self.exit_code == 0:
            return f"{self.path}: holds ({self.events} events, {self.seconds:.2f} s){note}"
        lines = [
            f"{self.path}:{self.line}: {self.invariant}: {self.message}",
            f"  event: {self.event}",
            f"  ({self.explanation})",
        ]
        if self.arose_after is not None:
            lines.append(
                f"  (incremental check: the state was fine at line {self.arose_after}; it broke "
                f"between there and line {self.line})"
            )
        lines.append("  minimal history (events that touched the blocks and requests involved):")
        lines += [f"    {self.path}:{ln}: {text}" for ln, text in self.history]
        if note:
            lines.append(f" {note}")
        return "\n".join(lines)


def _events(
    path: str | Path, start: int = 2, fast: bool = False
) -> tuple[Config, Iterator[tuple[int, Event, str | None]]]:
    """v1 traces stream (from line ``start``; ``fast``: the fast reader); v0 event files
    (``kvspec-events``) are read whole."""
    from .eventfile import sniff

    if sniff(path) == "v0":
        from .report import read_events

        config, events = read_events(path)
        numbered = ((number, event, None) for number, event in enumerate(events, 2))
        return config, (item for item in numbered if item[0] >= start)
    return iter_trace(path, start, fast)


ENGINES = ("fast", "spec")
"""``fast``: the fast model judges, the spec-based Checker reports (``fastpath.py``); ``spec``:
the spec-based Checker judges every event."""


def check_path(path: str | Path, check_every: int = 1, engine: str = "fast") -> Report:
    """Check one trace file; never raises for bad content (exit code 2 instead). ``engine``:
    ``fast`` (the default; with ``check_every`` 1 only: every k > 1 is the spec's mode) or
    ``spec``."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
    observed = judging_of(path) == "observed"
    if engine == "fast" and check_every == 1 and not observed and not _async_header(path):
        return _check_path_fast(path)
    started = time.perf_counter()
    name = str(path)
    line = 1
    checker: Checker | None = None
    try:
        config, events = _events(path)
        if observed:
            from .observed import ObservedChecker

            if check_every != 1:
                raise ValueError("an observed trace is checked after every decision")
            checker = ObservedChecker(config)
        else:
            checker = Checker(config, check_every)
        for line, event, hash_ in events:
            if checker.events_seen == 0 and event[0] not in ACTIONS:
                raise TraceError(path, line, f"effect {event[0]!r} before any decision")
            try:
                if checker.feed(event, line, hash_) is not None:
                    break
            except UnknownId as err:
                at = getattr(err, "line", line)
                raise TraceError(path, at, str(err)) from None
        else:
            checker.finish(line + 1)
    except TraceError as err:
        return Report(name, 2, checker.events_seen if checker else 0, error=str(err))
    except (ValueError, OSError) as err:
        return Report(name, 2, checker.events_seen if checker else 0, error=_where(err, name, line))
    seconds = time.perf_counter() - started
    if checker.finding is None:
        return Report(name, 0, checker.events_seen, seconds)
    return report_of(checker, name, seconds)


def _async_header(path: str | Path) -> bool:
    """Whether the header declares async scheduling or delivered stale output, which the fast
    model does not judge yet (the spec does)."""
    try:
        with open(path, "rb") as f:
            model = orjson.loads(f.readline()).get("model", {})
        return bool(model.get("async_scheduling")) or model.get("stale_output") == "deliver"
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return False


def _where(err: Exception, name: str, line: int) -> str:
    text = str(err)
    return text if text.startswith(name) else f"{name}:{line}: {text}"


def _check_path_fast(
    path: str | Path, limit: int | None = None, model: ModuleType | None = None
) -> Report:
    """``check_path`` on the fast model; on a finding, the spec-based Checker re-judges from the
    older checkpoint and reports (``fastpath.py``). ``limit`` (bench): stop at the first decision
    after that many events, without the end-of-stream check. ``model``: the module whose
    ``FastChecker`` judges (default: ``fastbuild.fast_model()``, its note goes in the report)."""
    from .fastbuild import fast_model
    from .fastpath import FILE_WINDOW, FastRun

    note = None
    if model is None:
        model, note = fast_model()
    FastChecker = model.FastChecker

    started = time.perf_counter()
    name = str(path)
    line = 1
    run: FastRun | None = None
    try:
        config, events = _events(path, fast=True)
        fast = FastChecker(config)
        run = FastRun(fast, FILE_WINDOW, keep_events=False)
        feed, actions = fast.feed, ACTIONS
        for line, event, hash_ in events:
            if fast.events_seen >= run.due and event[0] in actions:
                if limit is not None and fast.events_seen >= limit:
                    break  # the first decision past the limit: nothing cut from a decision
                run.checkpoint(line)
            elif fast.decisions == 0 and event[0] not in actions:
                raise TraceError(path, line, f"effect {event[0]!r} before any decision")
            try:
                if feed(event, hash_) is not None:
                    break
            except UnknownId as err:
                raise TraceError(path, line, str(err)) from None
            except Exception as err:  # a bug in the fast model: the spec decides, loudly
                run.crash = (repr(err), fast.events_seen - 1)
                break
        else:
            fast.finish()
    except TraceError as err:
        return Report(name, 2, run.fast.events_seen if run else 0, error=str(err), note=note)
    except (ValueError, OSError) as err:
        seen = run.fast.events_seen if run else 0
        return Report(name, 2, seen, error=_where(err, name, line), note=note)
    if fast.verdict is None and run.crash is None:
        return Report(name, 0, fast.events_seen, time.perf_counter() - started, note=note)
    # Hand over: the spec-based Checker re-judges from the older checkpoint and reports.
    checker = run.start()
    line = run.older_line - 1
    _, again = _events(path, start=run.older_line)
    for line, event, hash_ in again:
        if checker.feed(event, line, hash_) is not None:
            break
    else:
        checker.finish(line + 1)
    run.agree(checker, name)
    report = report_of(checker, name, time.perf_counter() - started)
    report.note = note
    return report


def report_of(checker: Checker, name: str, seconds: float = 0.0) -> Report:
    finding = checker.finding
    assert finding is not None
    history = checker.minimal_history()
    blocks, _ = checker.involved()
    timeline = []
    for line, event in history:
        kind = str(event[0])
        rid = event[1] if kind in ("wrote", "read") else request_of(event)
        ids: Iterable[object] = (event[2],) if kind in ("wrote", "read") else blocks_of(event)
        for block in ids:
            if block in blocks:
                timeline.append((line, block, kind, rid))  # type: ignore[arg-type]
    last = checker.last_event
    return Report(
        name,
        1,
        checker.events_seen,
        seconds,
        line=checker.finding_line,
        invariant=finding.invariant,
        message=finding.message,
        explanation=explanation(finding),
        event=describe_any(last[1]) if last else None,
        arose_after=checker.arose_after,
        history=[(ln, describe_any(e)) for ln, e in history],
        timeline=timeline,  # type: ignore[arg-type]
    )


# -- the HTML report ------------------------------------------------------------------------------

MARKERS = {
    "alloc": ("o", "tab:blue", "allocated"),
    "hit": ("D", "tab:cyan", "hit (touched)"),
    "publish": ("^", "tab:orange", "published"),
    "wrote": ("s", "tab:green", "written by a step"),
    "read": ("v", "tab:purple", "read by a step"),
    "unpublish": ("x", "tab:brown", "unpublished"),
    "evict": ("X", "tab:gray", "evicted"),
    "free": ("P", "black", "freed"),
    "dedup": ("*", "tab:pink", "deduplicated onto"),
}


def picture(report: Report) -> bytes:
    """Blocks against time (trace lines): who allocated, published, wrote, read and freed each
    involved block; the violating event is the red line. A PNG."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.5 * len({b for _, b, _, _ in report.timeline})))
    try:
        for kind, (marker, color, label) in MARKERS.items():
            points = [(ln, b, r) for ln, b, k, r in report.timeline if k == kind]
            if not points:
                continue
            ax.scatter([p[0] for p in points], [p[1] for p in points], marker=marker, c=color, s=60, label=label, zorder=3)  # fmt: skip
            for ln, b, r in points:
                if r is not None:
                    ax.annotate(f"r{r}", (ln, b), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)  # fmt: skip
        if report.line is not None:
            ax.axvline(report.line, color="red", linewidth=2, label=f"{report.invariant} (line {report.line})")  # fmt: skip
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("trace line (time)")
        ax.set_ylabel("block")
        blocks = sorted({b for _, b, _, _ in report.timeline})
        if blocks:
            ax.set_yticks(blocks)
            ax.set_ylim(min(blocks) - 0.8, max(blocks) + 0.8)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.set_title(f"{report.path}: history of the blocks involved")
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()
    finally:
        plt.close(fig)


def write_html(reports: list[Report], path: str | Path) -> None:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvspec check</title>",
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}"
        "pre{background:#f6f6f6;padding:1em;overflow-x:auto}.bad{color:#b00}</style>",
        "</head><body><h1>kvspec check</h1>",
    ]
    for report in reports:
        esc = html.escape
        parts.append(f"<h2>{esc(report.path)}: {esc(report.status)}</h2>")
        if report.exit_code == 2:
            parts.append(f"<p class='bad'>{esc(report.error or '')}</p>")
            continue
        parts.append(f"<p>{report.events} events checked in {report.seconds:.2f} s.</p>")
        if report.exit_code == 0:
            continue
        parts.append(
            f"<p class='bad'><b>{esc(report.invariant or '')}</b> at "
            f"<code>{esc(report.path)}:{report.line}</code>: {esc(report.message or '')}</p>"
            f"<p>Violating event: {esc(report.event or '')}</p>"
            f"<p><i>{esc(report.explanation or '')}</i></p>"
        )
        png = base64.b64encode(picture(report)).decode("ascii")
        parts.append(
            f"<img alt='history of the blocks involved' src='data:image/png;base64,{png}'>"
        )
        parts.append("<h3>Minimal history</h3><pre>")
        parts += [f"{ln:>8}  {esc(text)}\n" for ln, text in report.history]
        parts.append("</pre>")
    parts.append("</body></html>")
    Path(path).write_text("".join(parts), encoding="utf-8")


def tracemalloc_peak(checker: Checker, events: Iterable[Event]) -> int:
    """Bytes allocated at peak (above what was live before) while ``checker`` judges ``events``."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for event in events:
            if checker.feed(event) is not None:
                break
        checker.finish()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# -- in-process monitoring ------------------------------------------------------------------------


class Violation(AssertionError):
    """Raised by a ``Monitor`` with ``raise_on_finding``."""

    def __init__(self, report: Report) -> None:
        super().__init__(report.text())
        self.report = report


class Monitor:
    """Feed an engine's events as it emits them; each is judged at once.

    >>> with Monitor(config) as monitor:        # doctest: +SKIP
    ...     for event in engine_events():
    ...         monitor.feed(event)            # raises Violation at the first finding

    ``raise_on_finding=False`` makes ``feed`` return the ``Finding`` (or None) instead. An id that
    never existed is an ``Illegal`` finding here (a file would be unreadable instead).

    ``engine="fast"`` (the default, with ``check_every=1``): the fast model judges; it keeps the
    events since its older checkpoint (``window`` to ``2 * window`` of them, ``fastpath.py``), and
    on a finding the spec-based ``Checker`` re-judges them from that checkpoint and makes the
    report (its minimal history reaches back at least ``window`` events). ``engine="spec"``:
    the spec-based ``Checker`` judges every event.

    ``background=True``: the events are judged in a child process (``background.py``) by a
    synchronous ``Monitor`` with the same options, so the report is the same; ``feed`` only
    appends to a buffer and, every ``batch_size`` events, sends it. A finding is raised (or
    returned) at the first ``feed`` that completes a batch, or at ``close``, after the child
    found it: fewer than ``(queue_depth + 1) * batch_size`` events after the offending one (at
    most ``queue_depth`` batches wait for the judge; the engine waits when they are that many).
    ``close()`` always waits for the verdict; leaving a ``with`` block on an exception kills the
    child. Events must not be mutated after ``feed``."""

    def __init__(
        self,
        config: Config,
        check_every: int = 1,
        raise_on_finding: bool = True,
        name: str = "<monitor>",
        engine: str = "fast",
        window: int | None = None,
        background: bool = False,
        batch_size: int | None = None,
        queue_depth: int | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
        self.raise_on_finding = raise_on_finding
        self.name = name
        self.checker: Checker | None = None
        """The spec-based checker: with ``engine="spec"``, or once the fast one handed over."""
        self.run: FastRun | None = None
        self.background: Background | None = None
        self._buffer: list[Event] | None = None
        """Background mode: the events not sent yet (and their hashes by index)."""
        self._hashes: dict[int, str] = {}
        self.note: str | None = None
        """Set when the fast model judges from source (``fastbuild.py``); in the report."""
        if background:
            from .background import BATCH_SIZE, QUEUE_DEPTH, Background

            options = dict(check_every=check_every, name=name, engine=engine, window=window)
            self.background = Background(
                config,
                options,
                BATCH_SIZE if batch_size is None else batch_size,
                QUEUE_DEPTH if queue_depth is None else queue_depth,
            )
            self._buffer = []
        elif engine == "fast" and check_every == 1:
            from .fastbuild import fast_model
            from .fastpath import MONITOR_WINDOW, FastRun

            model, self.note = fast_model()
            fast = model.FastChecker(config)
            self.run = FastRun(fast, window or MONITOR_WINDOW, keep_events=True)
        else:
            self.checker = Checker(config, check_every)

    def feed(self, event: Event, hash_: str | None = None) -> Finding | None:
        buffer = self._buffer
        if buffer is not None:  # background: the judge is a child process
            if hash_ is not None:
                self._hashes[len(buffer)] = hash_
            buffer.append(event)
            if len(buffer) < self.background.batch_size:  # type: ignore[union-attr]
                return None
            return self._outcome(self._ship())
        run = self.run
        if run is None:
            return self._outcome(_monitor_feed(self.checker, event, hash_))  # type: ignore[arg-type]
        fast = run.fast
        if fast.events_seen >= run.due and event[0] in ACTIONS:
            run.checkpoint(fast.events_seen + 1)
        run.newer_events.append((event, hash_))
        try:
            if fast.feed(event, hash_) is None:
                return None
        except UnknownId:
            fast.verdict = ("Illegal", fast.events_seen - 1)
        except Exception as err:  # a malformed event (or a bug): the spec decides
            run.crash = (repr(err), fast.events_seen - 1)
        return self._outcome(self._hand_over(finish=False))

    def feed_all(self, events: Iterable[Event]) -> Finding | None:
        if self._buffer is not None:
            batch = self.background.batch_size  # type: ignore[union-attr]
            rest = iter(events)
            while True:
                buffer = self._buffer
                buffer.extend(itertools.islice(rest, batch - len(buffer)))
                if len(buffer) < batch:
                    return self.finding
                if self._outcome(self._ship()) is not None:
                    return self.finding
        for event in events:
            if self.feed(event) is not None:
                break
        return self.finding

    @property
    def finding(self) -> Finding | None:
        """(Background: as far as the child has told so far.)"""
        if self.background is not None:
            return None if self.background.result is None else self.background.result[0]
        return None if self.checker is None else self.checker.finding

    @property
    def events_seen(self) -> int:
        """(Background: the events fed so far, or at a verdict the events judged.)"""
        bg = self.background
        if bg is not None:
            return bg.events + len(self._buffer) if bg.result is None else bg.result[1].events  # type: ignore[arg-type]
        return self.run.fast.events_seen if self.run is not None else self.checker.events_seen  # type: ignore[union-attr]

    def _ship(self) -> Finding | None:
        """Background: send the buffer (full); the finding if the child has made one."""
        bg = self.background
        assert bg is not None and self._buffer is not None
        events, hashes = self._buffer, self._hashes
        self._buffer, self._hashes = [], {}
        return bg.send(events, hashes)

    def close(self) -> Finding | None:
        bg = self.background
        if bg is not None:
            events, hashes = self._buffer or [], self._hashes
            self._buffer, self._hashes = [], {}
            return self._outcome(bg.finish(events, hashes))
        run = self.run
        if run is None:
            return self._outcome(self.checker.finish())  # type: ignore[union-attr]
        if run.fast.finish() is None:
            return None
        return self._outcome(self._hand_over(finish=True))

    def _hand_over(self, finish: bool) -> Finding | None:
        """The fast model found something: the spec-based checker re-judges the kept events from
        the older checkpoint, must find the same, and takes over from here."""
        run = self.run
        assert run is not None
        checker = run.start()
        for event, hash_ in run.events():
            if _monitor_feed(checker, event, hash_) is not None:
                break
        else:
            if finish:
                checker.finish()
        run.agree(checker, self.name)
        self.checker, self.run = checker, None
        return checker.finding

    def report(self) -> Report:
        if self.background is not None and self.background.result is not None:
            return self.background.result[1]
        if self.checker is None or self.checker.finding is None:
            return Report(self.name, 0, self.events_seen, note=self.note)
        report = report_of(self.checker, self.name)
        report.note = self.note
        return report

    def _outcome(self, finding: Finding | None) -> Finding | None:
        if finding is not None and self.raise_on_finding:
            raise Violation(self.report())
        return finding

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        if kind is None:
            self.close()
        elif self.background is not None:
            self.background.stop()


def _monitor_feed(checker: Checker, event: Event, hash_: str | None) -> Finding | None:
    """One event to the spec-based checker; an unknown id is an ``Illegal`` finding."""
    try:
        return checker.feed(event, None, hash_)
    except UnknownId as err:
        index = checker.events_seen - 1
        checker._line = index + 1
        return checker._found("Illegal", str(err), index)
