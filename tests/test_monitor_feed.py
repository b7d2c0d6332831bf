"""The fast ``Monitor``'s own loop (conformance/monitor.py): ``feed_all`` judges as ``feed`` does,
event for event, and its quick check of arrivals, commits and executions (``_fine``) never passes
an event that ``trace.event_error`` refuses. Findings and reports against fuzzed runs are in
``test_fastmodel.py``; malformed events fed one by one in ``test_checker.py``.
"""

from __future__ import annotations

import enum

import pytest
from test_checker import _malformed, safe_run

from kvspec.conformance.monitor import KEPT, MalformedEvent, Monitor, Violation, _fine
from kvspec.conformance.trace import event_error


class Token(int):
    """An int subclass: ``event_error`` takes it (an int), ``_fine`` must leave it to it."""


class Colour(enum.IntEnum):
    RED = 1


class Pair(tuple):  # type: ignore[type-arg]
    pass


def variants(event: tuple) -> list[object]:
    """An arrival, a commit or an execution made wrong (or only unusual) in every way ``_fine``
    looks at."""
    out: list[object] = [*_malformed(event), list(event), (), ("arrive",), ("commit",)]
    if event[0] == "arrive":
        _, req, prompt, most, priority = event
        for token in (True, Token(3), Colour.RED, -1, 1.0, None, (1,)):
            out.append((*event[:2], (*prompt[:-1], token), most, priority))
        out += [
            (*event[:2], (), most, priority),
            (*event[:2], list(prompt), most, priority),
            (*event[:2], Pair(prompt), most, priority),
            ("arrive", True, prompt, most, priority),
            ("arrive", req, prompt, -1, priority),
            ("arrive", req, prompt, most, -7),  # a priority may be negative: fine
            ("arrive", req, prompt, Token(2), priority),
            ("commit", req, prompt, most, priority),
            ("arrive", req, prompt, most, priority, 0),
        ]
    elif event[0] == "execute":
        _, step, failed = event
        for value in (True, Token(1), Colour.RED, 1.0, -1, None, (1,)):
            out.append(("execute", step, (*failed, value)))
        out += [
            ("execute", step, ()),  # nothing failed: fine
            ("execute", step, (3,)),  # a failed load named: fine (here)
            ("execute", step, list(failed)),
            ("execute", step, {}),
            ("execute", step, Pair(failed)),
            ("execute", -1, failed),
            ("execute", Token(step), failed),
            ("execute", True, failed),
            ("execute", step),  # the spec's short form: event_error passes it
            ("execute", step, failed, 0),
            ("commit", step, failed),
        ]
    else:
        _, step, sampled = event
        pair = sampled[0]
        for wrong in ((pair[0], -1), (pair[0],), (*pair, 0), list(pair), Pair(pair), 5, None):
            out.append(("commit", step, (*sampled[1:], wrong)))
        for value in (True, Token(1), 1.0, -1):
            out.append(("commit", step, ((value, pair[1]), *sampled[1:])))
            out.append(("commit", step, ((pair[0], value), *sampled[1:])))
        out += [
            ("commit", step, ()),  # nothing sampled: fine
            ("commit", step, list(sampled)),
            ("commit", -1, sampled),
            ("commit", Token(step), sampled),
            ("arrive", step, sampled),
            ("commit", step),
        ]
    return out


def test_the_quick_check_passes_only_what_event_error_passes() -> None:
    """Every arrival and commit of a clean run passes ``_fine`` (so ``event_error`` is not
    asked); each made wrong in every way it looks at does not, unless ``event_error`` passes it
    too (a negative priority, an empty commit)."""
    config, events = safe_run(10)
    kept = [event for event in events if event[0] in KEPT]
    assert len(kept) > 20 and all(_fine(event) for event in kept)
    assert not any(_fine(event) for event in events if event[0] not in KEPT)
    refused = 0
    commit = next(e for e in kept if e[0] == "commit" and e[2])
    for event in [kept[0], commit, next(e for e in kept if e[0] == "execute")]:
        for bad in variants(event):
            why = event_error(bad, config.num_blocks)
            assert not _fine(bad) or why is None, (bad, why)
            refused += why is not None
    assert refused > 40


@pytest.mark.parametrize("window", [2, 10_000])
def test_feed_all_judges_as_feed_does(window: int) -> None:
    """A clean run and one with a freed block that was never held, fed in one ``feed_all`` and
    one ``feed`` at a time: the same report; every malformed arrival and commit at its place:
    the same ``MalformedEvent``, naming the same event."""
    config, events = safe_run(30)
    frees = [i for i, event in enumerate(events) if event[0] == "free"]
    bad_free = frees[len(frees) // 2]
    runs = [events, [*events[:bad_free], ("free", 0), *events[bad_free + 1 :]]]
    for run in runs:
        reports = []
        for how in ("feed", "feed_all"):
            monitor = Monitor.fast(config, raise_on_finding=False, window=window)
            if how == "feed":
                for event in run:
                    if monitor.feed(event) is not None:
                        break
            else:
                monitor.feed_all(run)
            monitor.close()
            reports.append(monitor.report())
        assert reports[0] == reports[1]
    assert reports[0].exit_code == 1
    with pytest.raises(Violation):
        Monitor.fast(config, window=window).feed_all(runs[1])
    for at in (
        max(i for i, e in enumerate(events) if e[0] == "arrive"),
        next(i for i, e in enumerate(events) if e[0] == "commit" and e[2] and i > 50),
        next(i for i, e in enumerate(events) if e[0] == "execute" and i > 50),
    ):
        for bad in variants(events[at]):
            stream = [*events[:at], bad, *events[at + 1 :]]
            errors = []
            for how in ("feed", "feed_all"):
                monitor = Monitor.fast(config, window=window)
                try:
                    if how == "feed":
                        for event in stream:
                            monitor.feed(event)  # type: ignore[arg-type]
                    else:
                        monitor.feed_all(stream)  # type: ignore[arg-type]
                    monitor.close()
                except MalformedEvent as err:
                    errors.append(str(err))
                except Violation as found:
                    errors.append(f"Violation {found.report.line}")
                else:
                    errors.append("holds")
            assert errors[0] == errors[1], bad
