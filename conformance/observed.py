"""The observed judge: strict judging, except for the orderings the spec leaves to its pool.

For engines whose pool picks other free blocks, or other duplicates of a hash, than the spec's
(``docs/adapters.md``, "Judging modes"). Each decision is held until its effects have arrived
(the next decision, ``settle`` or ``compare``); then ``kvspec.spec.observed.steer`` takes the
engine's legal choices of allocated and hit blocks, the decision is applied to the spec, and the
engine's effects must equal the spec's, except that the engine may also drop registrations on
its own (``unpublish``) and, under the policy ``engine-registers``, register and deduplicate on its
own (``publish``, ``dedup``): those are applied where they come with
``kvspec.spec.observed.engine_effect``. Invariants are checked once the decision and all its
effects are in; a ``dedup`` swap is not a TablesAppendOnly violation. ``compare`` checks
refcounts and the *set* of free blocks.
"""

from __future__ import annotations

from collections import deque

from kvspec.spec import (
    ACTIONS,
    Config,
    Illegal,
    apply,
    check,
    running_tables,
    tables_append_only,
)
from kvspec.spec.observed import engine_effect, steer
from kvspec.spec.state import Touched

from .checker import Checker
from .ids import UnknownId
from .lockstep import Event, Finding, Judge, unexpected


def engine_effects(policy: str) -> tuple[str, ...]:
    """The effects an engine may have beyond the spec's under ``policy``."""
    return ("unpublish", "publish", "dedup") if policy == "engine-registers" else ("unpublish",)


class ObservedJudge(Judge):
    free_order_matters = False
    judges_engine_registrations = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.pending: tuple[int, Event, list[tuple[int, Event]]] | None = None
        self.own_effects = engine_effects(self.config.policy)

    def feed(self, event: Event) -> Finding | None:
        if self.finding is not None:
            return self.finding
        index = self.events_seen
        self.events_seen += 1
        if event and event[0] in ACTIONS:
            if self._flush() is None:
                self.pending = (index, event, [])
        elif self.pending is None:
            self._found("Disagreement", f"effect {event} before any decision", index)
        else:
            self.pending[2].append((index, event))
        return self.finding

    def settle(self) -> Finding | None:
        return self._flush()

    def _flush(self) -> Finding | None:
        if self.finding is not None or self.pending is None:
            return self.finding
        index, decision, effects = self.pending
        self.pending = None
        try:
            steer(self.state, decision, [effect for _, effect in effects])
            expected = deque(apply(self.state, decision))
        except Illegal as err:
            return self._found("Illegal", str(err), index)
        for at, effect in effects:
            if expected and effect == expected[0]:
                expected.popleft()
                continue
            if effect[0] not in self.own_effects:
                want = expected[0] if expected else None
                return self._found("Disagreement", unexpected(effect, want), at)
            try:
                engine_effect(self.state, effect)
            except Illegal as err:
                return self._found("Illegal", str(err), at)
            if effect[0] == "dedup":
                sanction(self._tables, effect)
        if expected:
            return self._found("Disagreement", f"missing effect {expected[0]}", index)
        violated = check(self.state, self.invariants)
        if violated is not None:
            return self._violated(violated, index)
        grew = tables_append_only(self._tables, self.state)
        if grew is not None and (self.invariants is None or "TablesAppendOnly" in self.invariants):
            return self._violated(grew, index)
        self._tables = running_tables(self.state)
        return None


def sanction(tables: dict[int, tuple[int, ...]], effect: Event) -> None:
    """A dedup changed a running table in place: make the snapshot agree, so TablesAppendOnly
    judges only the rest of the change."""
    rid, index, block = effect[1], effect[2], effect[3]
    assert isinstance(rid, int) and isinstance(index, int) and isinstance(block, int)
    table = tables.get(rid)
    if table is not None and index < len(table):
        tables[rid] = table[:index] + (block,) + table[index + 1 :]


class ObservedChecker(Checker):
    """The streaming ``Checker`` judging as ``ObservedJudge`` does, for trace files whose header
    says ``"judging": "observed"``: each decision is held until its effects are in (the next
    decision or ``finish``), the engine's legal choices are steered into the spec, the engine's
    own effects are applied where they come, and the invariants (full definitions) are checked
    once the decision and all its effects are in. File lines, ids, hashes, rings and reports are
    the ``Checker``'s. The fast model judges strict traces only, so these run on the spec."""

    judges_engine_registrations = True

    def __init__(self, config: Config, history: int = 50, retired_requests: int = 256) -> None:
        super().__init__(config, 1, history, retired_requests, incremental=False)
        self.own_effects = engine_effects(config.policy)
        self.pending: list[tuple[Event, int, str | None]] = []
        self._holding = False
        self._held: Touched | None = None

    def feed(  # type: ignore[override]
        self, event: Event, line: int | None = None, hash_: str | None = None
    ) -> Finding | None:
        """Hold ``event``; a decision first judges the one held before it. A finding surfaces
        at the next decision or at ``finish``, with the line of the event that caused it.
        ``UnknownId`` carries that event's line (``line``)."""
        if self.finding is not None:
            return self.finding
        if line is None:
            line = self.events_seen + len(self.pending) + 1
        if event[0] in ACTIONS:
            if self._flush() is not None:
                return self.finding
        elif not self.pending:
            return super().feed(event, line, hash_)  # an effect before any decision
        self.pending.append((event, line, hash_))
        return None

    def finish(self, line: int | None = None) -> Finding | None:
        if self._flush() is not None:
            return self.finding
        return super().finish(line)

    def _flush(self) -> Finding | None:
        if self.finding is not None or not self.pending:
            return self.finding
        (decision, line, hash_), effects = self.pending[0], self.pending[1:]
        self.pending = []
        index = self.events_seen
        try:
            try:
                steer(self.state, decision, [effect for effect, _, _ in effects])
            except Illegal as err:
                self.events_seen += 1
                self._line, self._event = line, decision
                return self._found("Illegal", str(err), index)
            self._holding = True
            super().feed(decision, line, hash_)
            self._holding = False  # the effects below are fed with checks as usual
            for effect, at, effect_hash in effects:
                if self.finding is not None:
                    return self.finding
                if self.expected and effect == self.expected[0]:
                    super().feed(effect, at, effect_hash)
                elif effect[0] in self.own_effects:
                    self._engine_effect(effect, at, effect_hash)
                else:
                    super().feed(effect, at, effect_hash)  # the disagreement
        except UnknownId as err:
            err.line = self._line
            raise
        finally:
            self._holding = False
        if self.finding is None:
            self._line, self._event = line, decision
            if self.expected:
                return self._found("Disagreement", f"missing effect {self.expected[0]}", index)
            held, self._held = self._held, None
            if held is not None:
                super()._check(held, index)
        return self.finding

    def _check(self, fp: Touched, index: int) -> Finding | None:
        if self._holding:  # the decision's effects are not all in yet
            self._held = fp
            return None
        return super()._check(fp, index)

    def _engine_effect(self, effect: Event, line: int, hash_: str | None) -> Finding | None:
        index = self.events_seen
        self.events_seen += 1
        self._line, self._event = line, effect
        kind = effect[0]
        self._check_ids(kind, effect)
        try:
            engine_effect(self.state, effect)
        except Illegal as err:
            return self._found("Illegal", str(err), index)
        self._remember_effect(effect, kind, line)
        if kind == "dedup":
            sanction(self._tables, effect)
        elif kind == "unpublish":
            self._drop_hash(effect[1])  # type: ignore[arg-type]
        elif hash_ is not None:
            return self._check_hash(effect, hash_, index)
        return None
