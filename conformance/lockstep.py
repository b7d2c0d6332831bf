"""The judge: an engine's event stream replayed through the spec, one event at a time.

This is the arrow "the spec judges the trace". Each *decision* event (arrive, begin, schedule,
preempt, submit, execute, commit, abort, reset) is applied to the spec; the spec computes the
effects it must cause (hits, evictions, allocations, publications, frees, finishes) and the engine's
*effect* events that follow must be exactly those, in order. After every decision every invariant is
checked (incrementally: ``spec/incremental.py``). The first problem found is kept as a ``Finding``:

* an invariant's name (``NoUnwrittenRead``, ...): the engine did what the spec allows, and the
  resulting state is unsafe: a finding about the engine's *design* (its policy, its discipline);
* ``Disagreement``: the engine's effects or observable state differ from the spec's: a bug in the
  engine (or in the spec);
* ``Illegal``: the engine made a decision the spec does not allow in that state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from kvspec.spec import (
    ACTIONS,
    INVARIANTS,
    Config,
    Illegal,
    apply,
    check,
    initial_state,
    running_tables,
    tables_append_only,
)
from kvspec.spec.events import blocks_of, requests_of
from kvspec.spec.incremental import Incremental
from kvspec.spec.invariants import Violation
from kvspec.spec.observed import refuse_strict
from kvspec.spec.state import Touched

Event = tuple[object, ...]


@dataclass(frozen=True)
class Finding:
    invariant: str
    """An invariant's name, ``Disagreement``, ``Illegal`` or ``EngineError``."""
    message: str
    event: int
    """Index of the event in the stream at which it was found."""
    blocks: tuple[int, ...] = ()
    """The blocks it is about (an invariant's ``Violation.blocks``, a disagreement's events')."""
    requests: tuple[int, ...] = ()

    @property
    def explanation(self) -> str:
        """What the invariant guards, from its docstring."""
        doc = INVARIANTS[self.invariant].__doc__ if self.invariant in INVARIANTS else None
        if self.invariant == "Disagreement":
            doc = "The engine and the spec disagree on an observable: a bug in one of them."
        if self.invariant == "EngineError":
            doc = "The engine raised an exception on an input the workload may send."
        if self.invariant == "Illegal":
            doc = "The engine took a decision that no action of the spec allows in this state."
        return " ".join((doc or "").split())

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message} (event {self.event})"


def unexpected(event: Event, want: Event | None) -> str:
    """An engine's effect that is not the one the spec computed next (``want``; None: none)."""
    if want is None:
        return f"engine emitted {event}, but the spec computes no further effect of the decision"
    return f"engine emitted {event}, but the spec expects {want}"


class Judge:
    """Feed events with ``feed``; compare observable state with ``compare``; ``settle`` at the
    end. A judge stops at its first finding and returns it from then on.

    This is kvspec's one judging core: ``checker.Checker`` (the streaming checker and the in-process
    ``Monitor``) is a ``Judge`` with file positions, bounded memory and reports added.

    Invariants are checked after every decision (``check_every=1``) by their incremental forms
    (``spec/incremental.py``): only what the decision changed is re-evaluated, with the same answer
    as the full definitions. ``incremental=False`` evaluates the full definitions instead (the
    reference the incremental forms are tested against). ``check_every=k`` checks only every k
    decisions (the state at those points, not the ones between)."""

    free_order_matters = True
    """``compare`` checks the free queue's order (False: only which blocks are free)."""
    judges_engine_registrations = False
    """Whether this judge can take the engine's own registrations (policy ``engine-registers``)."""

    def __init__(
        self,
        config: Config,
        invariants: Collection[str] | None = None,
        check_every: int = 1,
        incremental: bool = True,
    ) -> None:
        """``invariants``: check only these (default: all); bookkeeping disagreements and
        illegal decisions are always findings."""
        if check_every < 1:
            raise ValueError("check_every must be >= 1")
        if not self.judges_engine_registrations:
            refuse_strict(config)
        self.config = config
        self.invariants = invariants
        self.check_every = check_every
        self.state = initial_state(config)
        self.expected: deque[Event] = deque()
        self.events_seen = 0
        self.decisions = 0
        self.finding: Finding | None = None
        self.incremental = Incremental(self.state) if incremental else None
        self.footprint = Touched()
        """What the decisions since the last check changed."""
        self._tables = running_tables(self.state)

    def feed(self, event: Event) -> Finding | None:
        if self.finding is not None:
            return self.finding
        index = self.events_seen
        self.events_seen += 1
        if event and event[0] in ACTIONS:
            return self.decide(event, index)
        return self.match(event, index)

    def decide(self, event: Event, index: int) -> Finding | None:
        """Apply a decision; its effects become the expected ones; check every ``check_every``."""
        if self.expected:
            return self._found("Disagreement", f"missing effect {self.expected[0]}", index)
        s = self.state
        try:
            effects = apply(s, event)
        except Illegal as err:
            return self._found("Illegal", str(err), index)
        fp = s.touched
        self.expected.extend(effects)
        self.decisions += 1
        if self.check_every == 1:
            return self._check(fp, index)
        self.footprint.merge(fp)
        if self.decisions % self.check_every == 0:
            return self.check_now(index)
        return None

    def match(self, event: Event, index: int) -> Finding | None:
        """An effect: it must be the next one the spec computed."""
        want = self.expected.popleft() if self.expected else None
        if event != want:
            named = (event,) if want is None else (event, want)
            return self._found(
                "Disagreement",
                unexpected(event, want),
                index,
                tuple(sorted({b for e in named for b in blocks_of(e)})),
                tuple(sorted({r for e in named for r in requests_of(e)})),
            )
        return None

    def check_now(self, index: int) -> Finding | None:
        """Check the invariants (and TablesAppendOnly since the last check) now."""
        fp, self.footprint = self.footprint, Touched()
        return self._check(fp, index)

    def _check(self, fp: Touched, index: int) -> Finding | None:
        s = self.state
        if self.incremental is not None:
            return self._violated(self.incremental.check(s, fp, self.invariants), index)
        violated = check(s, self.invariants)
        if violated is not None:
            return self._violated(violated, index)
        # Requests that left running since the snapshot may come back with another table.
        before = {r: t for r, t in self._tables.items() if r not in fp.left and r in s.requests}
        grew = tables_append_only(before, s)
        if grew is not None and (self.invariants is None or "TablesAppendOnly" in self.invariants):
            return self._violated(grew, index)
        self._tables = running_tables(s)
        return None

    def _violated(self, violation: Violation | None, index: int) -> Finding | None:
        if violation is None:
            return None
        return self._found(
            violation.invariant, violation.sentence, index, violation.blocks, violation.requests
        )

    def feed_all(self, events: Iterable[Event]) -> Finding | None:
        for event in events:
            if self.feed(event) is not None:
                break
        return self.finding

    def settle(self) -> Finding | None:
        """At a point where the engine has emitted everything: no effect may be missing."""
        if self.finding is None and self.expected:
            self._found("Disagreement", f"missing effect {self.expected[0]}", self.events_seen)
        return self.finding

    def compare(self, refcounts: tuple[int, ...], free: tuple[int, ...]) -> Finding | None:
        """Check the engine's refcounts and free-queue order against the spec's."""
        if self.settle() is not None:
            return self.finding
        s = self.state
        mine = tuple(b.refcount for b in s.blocks)
        if refcounts != mine:
            return self._found(
                "Disagreement", f"refcounts {refcounts}, spec {mine}", self.events_seen
            )
        if self.free_order_matters and free != tuple(s.free):
            return self._found(
                "Disagreement", f"free queue {free}, spec {s.free}", self.events_seen
            )
        if sorted(free) != sorted(s.free) or len(set(free)) != len(free):
            return self._found(
                "Disagreement",
                f"free blocks {sorted(free)}, spec {sorted(s.free)}",
                self.events_seen,
            )
        return None

    def _found(
        self,
        invariant: str,
        message: str,
        index: int,
        blocks: tuple[int, ...] = (),
        requests: tuple[int, ...] = (),
    ) -> Finding:
        self.finding = Finding(invariant, message, index, blocks, requests)
        return self.finding
