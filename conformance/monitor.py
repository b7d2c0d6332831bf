"""In-process judging: an engine feeds its events to a ``Monitor`` as it emits them.

>>> with Monitor.fast(config) as monitor:      # doctest: +SKIP
...     for event in engine_events():
...         monitor.feed(event)             # raises Violation at the first finding

The named constructors say how it judges:

* ``Monitor.fast(config)`` (also plain ``Monitor(config)``): the fast model judges every event,
  keeping the events since its older checkpoint (``window`` to ``2 * window`` of them, more
  while many requests are alive: ``handover.EVENTS_PER_LIVE_REQUEST``); on a finding a spec
  judge re-judges them from that checkpoint and makes the report (its minimal history reaches
  back at least ``window`` events);
* ``Monitor.on_spec(config, check_every=1)``: a spec judge judges every event (invariants every
  k decisions);
* ``Monitor.observed(config)``: a spec judge with observed matching, for engines whose pool orders
  its choices differently or that register on their own (``docs/adapters.md``);
* ``background.BackgroundMonitor``: the same in a child process, the engine only buffering.

``raise_on_finding=False`` makes ``feed`` return the ``Finding`` (or None) instead. An id that never
existed is an ``Illegal`` finding here (a file would be unreadable instead). An event that is not
one of the format's (a missing field, a field of the wrong type) is bad input, not a finding:
``feed`` raises ``MalformedEvent`` (a ``ValueError``, one line naming it). The fast monitor
checks arrivals, commits and executions as they come (``KEPT``; ``_fine``, exact and quick,
passes most; the rest go to ``trace.event_error``) and the rest only once judging raised or
found something (``_well_formed``); the spec judges check every event first. ``feed_all`` is
``feed``'s loop inlined (the fast judge's own call per event, and little else): engines that
hand over a step's events at once pay less per event, as does the ``BackgroundMonitor``'s child.
``compare`` checks the engine's refcounts and free queue against the spec's; ``settle`` that no
effect is missing at a point where the engine has emitted everything (the lockstep fuzzer judges
each run this way).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from kvspec.judge import Finding, Judge
from kvspec.judge.fastbuild import fast_judge
from kvspec.judge.fastmodel import restates
from kvspec.judge.handover import MONITOR_WINDOW, FastRun
from kvspec.spec import Config
from kvspec.spec.events import DECISIONS
from kvspec.twins import NotFollowed

from .report import Report, report_of
from .trace import event_error

Event = tuple[object, ...]


class Violation(AssertionError):
    """Raised by a ``Monitor`` with ``raise_on_finding`` (the report is ``.report``)."""

    def __init__(self, report: Report) -> None:
        super().__init__(report.text())
        self.report = report


class MalformedEvent(ValueError):
    """An event that is not one of the trace format's (``trace.event_error`` says why): bad
    input, not a finding. One line, ``NAME:N: why: the event``, N its number in the stream (1
    for the first fed). The monitor judges nothing after it (the judge's state is undefined)."""

    def __init__(self, name: str, number: int, event: object, why: str) -> None:
        shown = " ".join(repr(event).split())
        if len(shown) > 200:
            shown = shown[:200] + "..."
        super().__init__(f"{name}:{number}: {why}: {shown}")
        self.name, self.number, self.event, self.why = name, number, event, why

    def __reduce__(self) -> tuple[object, ...]:  # from a BackgroundMonitor's child, whole
        return (type(self), (self.name, self.number, self.event, self.why))


class Monitor:
    def __init__(
        self,
        config: Config,
        raise_on_finding: bool = True,
        name: str = "<monitor>",
        judge: Judge | None = None,
        window: int | None = None,
        invariants: Collection[str] | None = None,
    ) -> None:
        """The fast monitor, or, given ``judge`` (a stream judge: spec model and recorder), that
        judge. Prefer the named constructors. ``invariants``: the fast monitor checks only these
        (a subset of the fast model's, ``judge.core.FAST_INVARIANTS``; None: all)."""
        self.config = config
        self.raise_on_finding = raise_on_finding
        self.name = name
        self.note: str | None = None
        """Set when the fast model judges from source (``judge/fastbuild.py``); in the report."""
        self.judge = judge
        """The spec judge: given, or once the fast one handed over."""
        self.run: FastRun | None = None
        if judge is None:
            fast, self.note = fast_judge(config, invariants=invariants)
            self.run = FastRun(fast, window or MONITOR_WINDOW)

    @classmethod
    def fast(
        cls,
        config: Config,
        raise_on_finding: bool = True,
        name: str = "<monitor>",
        window: int | None = None,
        invariants: Collection[str] | None = None,
    ) -> Monitor:
        if not restates(config):  # drafts, deferred frees: not in the fast model (twins.py)
            return cls.on_spec(config, raise_on_finding=raise_on_finding, name=name)
        return cls(config, raise_on_finding, name, window=window, invariants=invariants)

    @classmethod
    def on_spec(
        cls,
        config: Config,
        check_every: int = 1,
        raise_on_finding: bool = True,
        name: str = "<monitor>",
    ) -> Monitor:
        return cls(config, raise_on_finding, name, Judge.stream(config, check_every=check_every))

    @classmethod
    def observed(
        cls, config: Config, raise_on_finding: bool = True, name: str = "<monitor>"
    ) -> Monitor:
        return cls(config, raise_on_finding, name, Judge.stream(config, observed=True))

    # -- feeding --------------------------------------------------------------------------------

    def feed(self, event: Event, hash_: str | None = None) -> Finding | None:
        """Judge one event; ``Violation`` (or the finding) at the first finding,
        ``MalformedEvent`` if it is not one of the format's events."""
        run = self.run
        if run is None:  # the spec judges: slow enough that checking every event costs nothing
            self._well_formed(event, hash_, self.events_seen + 1)
            return self._outcome(self.judge.feed(event, hash_))  # type: ignore[union-attr]
        fast = run.fast
        number = fast.events_seen + 1
        kind = event[0] if event else None
        if kind in KEPT and (hash_ is not None or not _fine(event)):
            self._well_formed(event, hash_, number)  # values the model keeps: checked as they come
        if fast.events_seen >= run.due and kind in DECISIONS:
            run.checkpoint()
        run.newer_events.append((event, hash_))
        try:
            if fast.feed(event, hash_) is None:
                return None
        except Exception as err:  # a malformed event (or a bug): the spec decides
            run.crash = (repr(err), fast.events_seen - 1)
            run.refused = isinstance(err, NotFollowed)  # a decision it does not follow
        self._kept_well_formed(run, number)
        return self._outcome(self._hand_over(None))

    def feed_all(self, events: Iterable[Event]) -> Finding | None:
        """``feed`` of each event (no hashes), up to a finding. The fast monitor's loop is
        ``feed``'s, inlined: per event, the judge's own call and little else."""
        run = self.run
        if run is None:
            for event in events:
                if self.feed(event) is not None:
                    break
            return self.finding
        fast = run.fast
        feed, kept, due = fast.feed, run.newer_events, run.due
        for event in events:
            kind = event[0] if event else None
            if kind in KEPT and not _fine(event):
                self._well_formed(event, None, fast.events_seen + 1)
            if kind in DECISIONS and fast.events_seen >= due:
                run.checkpoint()
                kept, due = run.newer_events, run.due
            kept.append((event, None))
            try:
                if feed(event, None) is None:
                    continue
            except Exception as err:  # a malformed event (or a bug): the spec decides
                run.crash = (repr(err), fast.events_seen - 1)
                run.refused = isinstance(err, NotFollowed)  # a decision it does not follow
            self._kept_well_formed(run, fast.events_seen)
            self._outcome(self._hand_over(None))
            break
        return self.finding

    def compare(self, refcounts: tuple[int, ...], free: tuple[int, ...]) -> Finding | None:
        """The engine's refcounts and free queue against the spec's, at a point where the
        engine has emitted everything so far."""
        return self._at_rest(lambda judge: judge.compare(refcounts, free))

    def settle(self) -> Finding | None:
        """At a point where the engine has emitted everything so far: no effect is missing."""
        return self._at_rest(lambda judge: judge.settle())

    def close(self) -> Finding | None:
        return self._at_rest(lambda judge: judge.finish())

    def _at_rest(self, call: Callable[[Judge], Finding | None]) -> Finding | None:
        """``call`` on the judge judging now (the fast one, or the spec's once handed over); a
        fast finding is handed over, ``call`` made again on the spec judge."""
        run = self.run
        if run is None:
            return self._outcome(call(self.judge))  # type: ignore[arg-type]
        if call(run.fast) is None:
            return None
        self._kept_well_formed(run, run.fast.events_seen)
        return self._outcome(self._hand_over(call))

    @property
    def finding(self) -> Finding | None:
        return None if self.judge is None else self.judge.finding

    @property
    def model(self) -> object:
        """The model judging now: the fast model, or the spec's once the judge handed over."""
        return self.run.fast.model if self.run is not None else self.judge.model  # type: ignore[union-attr]

    @property
    def events_seen(self) -> int:
        return self.run.fast.events_seen if self.run is not None else self.judge.events_seen  # type: ignore[union-attr]

    def report(self) -> Report:
        judge = self.judge
        if judge is None or judge.finding is None:
            return Report(self.name, 0, self.events_seen, note=self.note)
        return report_of(judge, self.name, note=self.note)

    # -- internals ------------------------------------------------------------------------------

    def _kept_well_formed(self, run: FastRun, last: int) -> None:
        """The fast model raised or found something: before the spec judge re-judges the kept
        events (the last of them the ``last``-th), each is checked (the first malformed one
        raises ``MalformedEvent``)."""
        kept = run.events()
        first = last - len(kept) + 1
        for number, (event, hash_) in enumerate(kept, first):
            self._well_formed(event, hash_, number)

    def _well_formed(self, event: object, hash_: object, number: int) -> None:
        """Raise ``MalformedEvent`` if ``event`` (the ``number``-th) is not one of the format's
        events. The fast monitor checks an arrival and a commit as they come (the model keeps
        their values) and every kept event when the fast model raises or finds something (the
        rest are used at once: a malformed one makes a finding or an error there); a spec
        judge checks every event before judging it."""
        why = event_error(event, self.config.num_blocks, hash_)
        if why is not None:
            raise MalformedEvent(self.name, number, event, why)

    def _hand_over(self, then: Callable[[Judge], object] | None) -> Finding | None:
        """The fast model found something: the spec judge re-judges the kept events from the
        older checkpoint (and, when none of them is a finding, does ``then``, the call that made
        the fast judge find), must find the same, and takes over from here."""
        run = self.run
        assert run is not None
        judge = run.start()
        for event, hash_ in run.events():
            if judge.feed(event, hash_) is not None:
                break
        else:
            if then is not None:
                then(judge)
        run.agree(judge.finding, self.name)
        self.judge, self.run = judge, None
        return judge.finding

    def _outcome(self, finding: Finding | None) -> Finding | None:
        if finding is not None and self.raise_on_finding:
            raise Violation(self.report())
        return finding

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        if kind is None:
            self.close()


KEPT = frozenset(("arrive", "commit", "execute"))
"""The kinds whose values the fast model keeps (an arrival's prompt and priority, a commit's
samples, an execution's failed loads): the fast monitor checks them as they come, since a value
of the wrong type may pass through the model (the source build turns a list of failed loads into
a tuple) and never raise. One arrival per request, one commit and one execution per step."""


def _fine(event: object) -> bool:
    """True only for an ``arrive``, ``commit`` or ``execute`` that ``trace.event_error`` passes
    (no hash): exact types (a tuple, ints, not subclasses), ids and tokens >= 0, a prompt not
    empty. Most events are; anything else (False) is left to ``event_error``, which says why or
    passes it (a subclass, say). The fast monitor checks these kinds as they come (``KEPT``),
    and ``event_error``'s general checks cost as much as judging them."""
    if type(event) is not tuple:
        return False
    if len(event) == 3 and event[0] == "execute":  # ("execute", step, (failed req, ...))
        _, step, failed = event
        return (
            type(step) is int
            and step >= 0
            and type(failed) is tuple
            and all(type(req) is int and req >= 0 for req in failed)
        )
    if len(event) == 5:  # ("arrive", req, tokens, max_tokens, priority)
        _, req, tokens, most, priority = event
        return (
            event[0] == "arrive"
            and type(req) is int
            and type(most) is int
            and type(priority) is int
            and req >= 0
            and most >= 0
            and type(tokens) is tuple
            and len(tokens) > 0
            and all(type(token) is int for token in tokens)
            and min(tokens) >= 0
        )
    if len(event) == 3:  # ("commit", step, ((req, token), ...))
        _, step, sampled = event
        return (
            event[0] == "commit"
            and type(step) is int
            and step >= 0
            and type(sampled) is tuple
            and all(
                type(pair) is tuple
                and len(pair) == 2
                and type(pair[0]) is int
                and type(pair[1]) is int
                and pair[0] >= 0
                and pair[1] >= 0
                for pair in sampled
            )
        )
    return False
