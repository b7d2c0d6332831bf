"""Judging a trace file (``kvspec check``): open it once, judge its events, report.

``check_file`` never raises for bad content: an unreadable file or line is a ``Report`` with exit
code 2 (``file:line: message``). A strict trace is judged by the fast model (``engine="fast"``, the
default, with ``check_every`` 1), which hands a finding over to a spec judge from its older
checkpoint for the report (``judge/handover.py``); the loop that reads, decodes and feeds its
lines is the compiled ``judge.core.FileFeed``, which returns here only for a checkpoint, a
finding, a crash of the fast model, an effect before any decision or the end. An observed trace,
one with draft tokens (``model.spec_tokens``) or deferred frees (``model.defer_free``),
``engine="spec"`` or ``check_every`` > 1 is judged by a spec judge throughout. Either way the
report is made by the spec judge's recorder (``report.report_of``).

The judge's state lives as long as the file is read, and it grows with the requests alive (a
trace whose arrivals come first holds them all). Python's cyclic garbage collector would scan all
of it again and again as allocation goes on, a cost that grows with the state, not with the event.
So the fast path (``FileFeed``) freezes what is alive every ``FREEZE_EVERY`` events
(``gc.freeze``: later collections skip it; reference counting still frees it) and unfreezes it at
the end (``long_lived``). Between two freezes the youngest generation is collected every
``YOUNG`` allocations rather than every 700 (Python's default): the judge makes no cycles, so a
collection finds nothing to free, and what it walks is mostly the new state of a trace whose
arrivals come first (``docs/checker.md``). The threshold is put back at the end.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from kvspec.judge import Judge, UnknownId, handover
from kvspec.judge.consequence import Consequence, explain
from kvspec.judge.core import CRASH, DUE, EFFECT_FIRST, FOUND
from kvspec.judge.fastbuild import fast_judge
from kvspec.judge.fastmodel import restates
from kvspec.judge.findings import Finding
from kvspec.spec.events import DECISIONS

from .report import Report, observed_accepts, observed_hint_text, report_of
from .trace import Trace, TraceError, open_trace

FREEZE_EVERY = 16_384
"""Events between two ``gc.freeze`` calls of the fast path (each is O(1))."""
YOUNG = 100_000
"""The fast path's threshold of the youngest generation (``gc.set_threshold``; default 700): at
most this many more tracked objects than freed ones before a collection, a few MiB."""

ENGINES = ("fast", "spec")
"""``fast``: the fast model judges, the spec judge reports; ``spec``: the spec judges every event."""


def check_file(
    path: str | Path,
    check_every: int = 1,
    engine: str = "fast",
    limit: int | None = None,
    build: ModuleType | None = None,
    observed: bool = False,
) -> Report:
    """Judge one trace file. ``limit`` (bench): stop at the first decision after that many
    events, without the end-of-stream check. ``build``: the module whose ``Judge`` judges on the
    fast path (default: ``fastbuild.fast_judge``'s choice, its note in the report)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
    name = str(path)
    started = time.perf_counter()
    try:
        trace = open_trace(path, fast=engine == "fast")
    except TraceError as err:
        return Report(name, 2, error=str(err))
    except OSError as err:
        return Report(name, 2, error=f"{name}:1: {err}")
    with trace:
        if observed:
            trace.judging = "observed"
        fast = engine == "fast" and check_every == 1 and trace.judging == "strict"
        if fast and restates(trace.config):
            return _fast(trace, name, started, limit, build)
        if trace.judging == "observed" and check_every != 1:
            return Report(
                name, 2, error=f"{name}:1: an observed trace is checked after every decision"
            )
        observed = trace.judging == "observed"
        judge = Judge.stream(trace.config, observed, check_every, unknown_ids="raise")
        return _judged(trace, judge, name, started)


def _judged(trace: Trace, judge: Judge, name: str, started: float, start: int = 2) -> Report:
    """A spec judge over the trace's events from line ``start``; its report."""
    line = start - 1
    try:
        for line, event, hash_ in trace.events(start):
            if judge.events_seen == 0 and event[0] not in DECISIONS:
                raise TraceError(name, line, f"effect {event[0]!r} before any decision")
            try:
                if judge.feed(event, hash_, line) is not None:
                    break
            except UnknownId as err:  # at its own line: observed, an effect held till now
                raise TraceError(name, judge.line, str(err)) from None
        else:
            judge.finish(line + 1)
    except (TraceError, ValueError, OSError) as err:
        return Report(name, 2, judge.events_seen, error=_where(err, name, line))
    seconds = time.perf_counter() - started
    if judge.finding is None:
        return Report(name, 0, judge.events_seen, seconds)
    report = report_of(judge, name, seconds)
    if judge.finding.invariant in ("Disagreement", "Illegal") and not judge.observed:
        report.consequence = _consequence(trace, judge)
    if judge.finding.invariant == "Disagreement" and not judge.observed:
        if _observed_accepts(trace, judge.finding):
            report.observed_hint = observed_hint_text() + f" {trace.path}"
    return report


def _observed_accepts(trace: Trace, finding: Finding) -> bool:
    """Whether observed matching judges the trace past ``finding`` (strict's first finding)
    without a finding of its own there (``report.observed_accepts``)."""
    if finding.event > FOLLOW_AT_MOST:
        return False
    return observed_accepts(trace.config, _readable(trace), finding)


FOLLOW_AT_MOST = 200_000
"""The most events a deviation's consequence is judged over (from the trace's start, with
every invariant's full definition after every decision)."""


def _consequence(trace: Trace, judge: Judge) -> Consequence | None:
    """A strict trace's ``Disagreement`` (or ``Illegal`` the engine's effects explain) judged on
    to the end of the file (``judge/consequence.py``); None for a trace too long to follow."""
    assert judge.finding is not None
    if judge.events_seen > FOLLOW_AT_MOST:
        return None
    return explain(trace.config, _readable(trace), judge.finding)


def _readable(trace: Trace) -> Iterator[tuple[object, ...]]:
    """The trace's events from its start, at most ``FOLLOW_AT_MOST``, up to a line that cannot
    be read (a finding's consequence is judged on what can)."""
    try:
        for i, (_, event, _) in enumerate(trace.events(2)):
            if i >= FOLLOW_AT_MOST:
                return
            yield event
    except (TraceError, ValueError, OSError):
        return


@contextlib.contextmanager
def long_lived() -> Iterator[None]:
    """Objects frozen inside (``gc.freeze``) are unfrozen at the end, unless they were before;
    the youngest generation is collected every ``YOUNG`` allocations inside."""
    frozen = gc.get_freeze_count()
    threshold = gc.get_threshold()
    gc.set_threshold(YOUNG, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if frozen == 0:
            gc.unfreeze()


def _fast(
    trace: Trace, name: str, started: float, limit: int | None, build: ModuleType | None
) -> Report:
    with long_lived():
        return _fast_run(trace, name, started, limit, build)


def _fast_run(
    trace: Trace, name: str, started: float, limit: int | None, build: ModuleType | None
) -> Report:
    """The fast model judges; on a finding the spec judge re-judges from the older checkpoint
    (the same open file, read again from that line) and reports."""
    if build is not None:
        fast, note = build.Judge.fast(trace.config, "raise"), None
    else:
        fast, note = fast_judge(trace.config, "raise")
    run = handover.FastRun(fast, handover.FILE_WINDOW)
    feed = fast.file_feed(trace.lines(), 1, trace.parts, trace.slow, FREEZE_EVERY)
    try:
        while True:
            try:
                why = feed.run(run.due)
            except UnknownId as err:
                raise TraceError(name, fast.line, str(err)) from None
            if why == DUE:
                if limit is not None and fast.events_seen >= limit:
                    break  # the first decision past the limit: nothing cut from a decision
                run.checkpoint(feed.number)
            elif why == EFFECT_FIRST:
                effect = feed.pending[0][0]
                raise TraceError(name, feed.number, f"effect {effect!r} before any decision")
            elif why == CRASH:
                run.crash = (feed.crash, fast.events_seen - 1)
                run.refused = feed.refused
                break
            elif why == FOUND:
                break
            else:
                fast.finish(feed.number + 1)
                break
    except (TraceError, ValueError, OSError) as err:
        return Report(name, 2, fast.events_seen, error=_where(err, name, feed.number), note=note)
    if fast.finding is None and run.crash is None:
        return Report(name, 0, fast.events_seen, time.perf_counter() - started, note=note)
    judge = run.start()
    start = 2 if run.older_at is None else run.older_at
    report = _judged(trace, judge, name, started, start)  # type: ignore[arg-type]
    run.agree(judge.finding, name)
    report.note = note
    return report


def _where(err: Exception, name: str, line: int) -> str:
    text = str(err)
    return text if text.startswith(name) else f"{name}:{line}: {text}"
