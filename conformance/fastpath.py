"""The fast path of ``kvspec check`` and ``Monitor``: the fast model finds, the spec reports.

``FastChecker`` (``fastmodel.py``) judges every event. A report (message, explanation, minimal
history, picture) is only ever built by the spec-based ``Checker`` (``checker.py``): when the
fast model finds something, the spec-based ``Checker`` re-judges the stream from a *checkpoint*
and its finding is the one reported. The two must agree on the invariant and the event; if they
do not, ``FastPathDisagrees`` is raised naming both verdicts (a bug in the fast model: loud,
never a silent wrong answer).

Checkpoints, so that memory stays bounded and a report does not cost a re-check of the whole
stream: every ``window`` events (at the next decision, when no effect is outstanding) the fast
model's state is exported as a ready-to-resume spec ``Checker`` (``resume``). Two are kept, the
newer and the one before it; a re-judge starts from the older one, so it covers at least
``window`` events before the finding (at most ``2 * window``). A file is re-read from the older
checkpoint's line; the ``Monitor`` keeps the events since the older checkpoint (at most
``2 * window`` of them). The spec ``Checker``'s rings (the minimal history) therefore start at
that checkpoint: for a stream shorter than ``window`` events the report is exactly the spec-based
checker's from the start; for a longer one, its history is limited to the last ``window`` events
at least (``docs/checker.md``).
"""

from __future__ import annotations

from collections import deque

from kvspec.spec import running_tables
from kvspec.spec.incremental import Incremental

from .checker import Checker
from .fastmodel import FastChecker
from .ids import IdSet
from .lockstep import Event

FILE_WINDOW = 100_000
"""Events between checkpoints of ``kvspec check``: a report re-judges 100,000 to 200,000 events
with the spec (5 to 10 s) and shows a history of at least that many."""
MONITOR_WINDOW = 10_000
"""Events between checkpoints of a ``Monitor``, which keeps the events since the older one."""


class FastPathDisagrees(AssertionError):
    """The fast model and the spec-based checker reached different verdicts: a bug in
    ``fastmodel.py`` (or in the checkpoint export)."""


def resume(fast: FastChecker) -> Checker:
    """A spec-based ``Checker`` in the state ``fast`` stands for now (between decisions, no
    effect outstanding): it judges the rest of the stream as one fed from the start would
    (rings and caches start empty)."""
    checker = Checker(fast.config)
    s = fast.to_spec()
    checker.state = s
    checker.incremental = Incremental(s)
    checker._tables = running_tables(s)
    checker.events_seen = fast.events_seen
    checker.decisions = fast.decisions
    ids = IdSet()
    ids.low, ids.above = fast.ids.low, set(fast.ids.above)
    checker._ids = ids
    checker._max_step = fast.max_step
    checker._finished = set(fast.finished)
    checker.request_rings = {rid: deque(maxlen=checker.history) for rid in s.requests}
    seq = fast.tokens_of
    checker._block_hash = dict(fast.block_hash)
    checker._hash_key = {h: [seq(k), n] for h, (k, n) in fast.hash_key.items()}
    checker._key_hash = {seq(k): [h, n] for k, (h, n) in fast.key_hash.items()}  # type: ignore[misc]
    return checker


class FastRun:
    """The fast model plus its two checkpoints (and, for a ``Monitor``, the events since the
    older one)."""

    def __init__(self, fast: FastChecker, window: int, keep_events: bool) -> None:
        self.fast = fast
        self.window = window
        self.due = window
        self.keep_events = keep_events
        self.older: Checker | None = None
        """None: the start of the stream."""
        self.newer: Checker | None = None
        self.older_line = self.newer_line = 2
        self.older_events: list[tuple[Event, str | None]] = []
        self.newer_events: list[tuple[Event, str | None]] = []
        self.crash: tuple[str, int] | None = None
        """(what the fast model raised, at which event): a bug, or a malformed in-process event;
        the spec-based checker must find something at that event."""

    def checkpoint(self, line: int) -> None:
        """Before a decision, once ``window`` events have passed since the last checkpoint."""
        fast = self.fast
        self.due = fast.events_seen + self.window
        if fast.epos != len(fast.expected) or fast.verdict is not None:
            return
        self.older, self.older_line = self.newer, self.newer_line
        self.newer, self.newer_line = resume(fast), line
        self.older_events, self.newer_events = self.newer_events, []

    def start(self) -> Checker:
        """The spec-based checker at the older checkpoint, to re-judge from there."""
        return Checker(self.fast.config) if self.older is None else self.older

    def events(self) -> list[tuple[Event, str | None]]:
        return self.older_events + self.newer_events

    def agree(self, checker: Checker, name: str) -> None:
        """Raise ``FastPathDisagrees`` unless both found the same invariant at the same event."""
        found = checker.finding
        spec = None if found is None else (found.invariant, found.event)
        if self.crash is None and spec == self.fast.verdict:
            return
        if self.crash is not None and spec is not None and spec[1] == self.crash[1]:
            return
        fast = self.crash or self.fast.verdict
        raise FastPathDisagrees(
            f"{name}: internal error: the fast model found {fast}, the spec-based checker "
            f"{spec} (check again with --engine spec, and report this trace)"
        )
