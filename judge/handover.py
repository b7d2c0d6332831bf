"""The fast path of ``kvspec check`` and ``Monitor``: the fast model finds, the spec reports.

A judge over the ``FastModel`` judges every event. A report (message, explanation, minimal
history, picture) is only ever made by a judge over the ``SpecModel`` with a ``Recorder``: when
the fast judge finds something, a spec judge re-judges the stream from a *checkpoint* and its
finding is the one reported. The two must agree on the invariant and the event; if they do not,
``FastPathDisagrees`` is raised naming both verdicts (a bug in the fast model: loud, never a
silent wrong answer).

Checkpoints, so that memory stays bounded and a report does not cost a re-check of the whole
stream: every ``window`` events (at the next decision, when no effect is outstanding) the fast
judge is forked onto a spec model of the state it stands for (``Judge.fork``), or after
``EVENTS_PER_LIVE_REQUEST`` events per live request if that is more (a checkpoint costs in
proportion to the state it exports, so its share per event stays bounded as requests pile up).
Two are kept, the newer and the one before it; a re-judge starts from the older one, so it covers
at least ``window`` events before the finding (at most twice the larger spacing). A file is
re-read from the older checkpoint's position; the ``Monitor`` keeps the events since the older
checkpoint (as many). The spec judge's recorder therefore starts at that checkpoint: for a
stream shorter than ``window`` events the report is exactly the spec judge's from the start; for
a longer one, its history reaches back at least ``window`` events (``docs/checker.md``).
"""

from __future__ import annotations

from typing import Any

from .core import Judge
from .findings import Finding
from .recorder import Recorder
from .spec_model import SpecModel

Event = tuple[object, ...]

FILE_WINDOW = 100_000
"""Events between checkpoints of ``kvspec check``: a report re-judges 100,000 to 200,000 events
with the spec and shows a history of at least that many."""
MONITOR_WINDOW = 10_000
"""Events between checkpoints of a ``Monitor``, which keeps the events since the older one."""
EVENTS_PER_LIVE_REQUEST = 64
"""A checkpoint's cost grows with the state it exports (every live request, every block), so the
next one is due after at least this many events per live request, if that is more than the
window: the checkpoints then cost a bounded share of the judging per event however many requests
are alive (``bench/bench_check_shape.py`` measures it), and a re-judge covers at most twice that
many events."""


class FastPathDisagrees(AssertionError):
    """The fast model and the spec judge reached different verdicts: a bug in ``fastmodel.py``
    (or in the export of its state)."""


class FastRun:
    """A fast judge plus its two checkpoints (and, for a ``Monitor``, the events since the
    older one). ``fast`` is a ``Judge`` over a ``FastModel`` (of the compiled build or the
    source: ``fastbuild.fast_judge``)."""

    def __init__(self, fast: Any, window: int) -> None:
        self.fast = fast
        self.window = window
        self.due = window
        self.last = 0
        """Events seen at the last checkpoint (0: the start of the stream)."""
        self.older: Any = None
        """The spec judge at the older checkpoint; None: the start of the stream."""
        self.newer: Any = None
        self.older_at: object = None
        """Where the older checkpoint is in the stream (a file position, for a re-read)."""
        self.newer_at: object = None
        self.older_events: list[tuple[Event, str | None]] = []
        self.newer_events: list[tuple[Event, str | None]] = []
        self.crash: tuple[str, int] | None = None
        """(what the fast model raised, at which event): a bug, or a malformed in-process event;
        the spec judge must find something at that event."""
        self.refused = False
        """The crash is the fast model refusing a decision it does not follow (``twins.
        NotFollowed``: a decision feature its row refuses, seen only when the decision comes):
        no bug, so the spec judge re-judges from the older checkpoint, takes over, and its
        verdict stands, whatever it is."""

    def checkpoint(self, at: object = None) -> None:
        """Before a decision, once ``due``: a checkpoint is made if the spacing has passed since
        the last one (``window`` events, or ``EVENTS_PER_LIVE_REQUEST`` per request alive now if
        that is more), else ``due`` moves to where it will have."""
        fast = self.fast
        spacing = max(self.window, EVENTS_PER_LIVE_REQUEST * len(fast.model.requests))
        if fast.events_seen - self.last < spacing:
            self.due = self.last + spacing
            return
        self.due = fast.events_seen + self.window
        if fast.epos != len(fast.expected) or fast.finding is not None:
            return
        state = fast.model.export()
        self.last = fast.events_seen
        recorder = Recorder(fast.config.num_blocks, live=state.requests)
        self.older, self.older_at = self.newer, self.newer_at
        self.newer, self.newer_at = fast.fork(SpecModel(fast.config, state=state), recorder), at
        self.older_events, self.newer_events = self.newer_events, []

    def start(self) -> Any:
        """The spec judge at the older checkpoint, to re-judge from there."""
        if self.older is not None:
            return self.older
        unknown = "raise" if self.fast.raise_unknown else "finding"
        return Judge.stream(self.fast.config, unknown_ids=unknown, invariants=self.fast.invariants)

    def events(self) -> list[tuple[Event, str | None]]:
        return self.older_events + self.newer_events

    def agree(self, spec: Finding | None, name: str) -> None:
        """Raise ``FastPathDisagrees`` unless both found the same invariant at the same event."""
        found = None if spec is None else (spec.invariant, spec.event)
        verdict = self.fast.finding
        fast = None if verdict is None else (verdict.invariant, verdict.event)
        if self.crash is None and found == fast:
            return
        if self.refused:  # the fast model stepped aside: nothing to compare
            return
        if self.crash is not None and found is not None and found[1] == self.crash[1]:
            return
        raise FastPathDisagrees(
            f"{name}: internal error: the fast model found {self.crash or fast}, the spec judge "
            f"{found} (check again with --engine spec, and report this trace)"
        )
