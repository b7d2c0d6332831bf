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

from kvspec.spec import ACTIONS, Illegal, apply, check, running_tables, tables_append_only
from kvspec.spec.observed import engine_effect, steer

from .lockstep import Event, Finding, Judge


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
                return self._found(
                    "Disagreement", f"engine emitted {effect}, spec expects {want}", at
                )
            try:
                engine_effect(self.state, effect)
            except Illegal as err:
                return self._found("Illegal", str(err), at)
            if effect[0] == "dedup":
                self._sanction(effect)
        if expected:
            return self._found("Disagreement", f"missing effect {expected[0]}", index)
        violated = check(self.state, self.invariants)
        if violated is not None:
            return self._found(*violated, index)
        grew = tables_append_only(self._tables, self.state)
        if grew is not None and (self.invariants is None or "TablesAppendOnly" in self.invariants):
            return self._found("TablesAppendOnly", grew, index)
        self._tables = running_tables(self.state)
        return None

    def _sanction(self, effect: Event) -> None:
        """A dedup changed a running table in place: make the snapshot agree, so TablesAppendOnly
        judges only the rest of the change."""
        rid, index, block = effect[1], effect[2], effect[3]
        assert isinstance(rid, int) and isinstance(index, int) and isinstance(block, int)
        table = self._tables.get(rid)
        if table is not None and index < len(table):
            self._tables[rid] = table[:index] + (block,) + table[index + 1 :]
