"""The spec as a judge's model: ``kvspec.spec`` itself, its actions applied to its own state.

``SpecModel`` is the model every report is made with (the fast model only finds). It applies a
decision with ``spec.apply``, takes an observed engine's choices and own effects with
``spec.observed``, and checks the invariants on what the decisions since the last check touched
(``State.touched``), by their incremental forms (``incremental.py``, the same answers) or, with
``incremental=False``, by the full definitions of ``spec/invariants.py`` plus TablesAppendOnly
against a snapshot of the running tables. Finished requests that no step in flight references are
forgotten (``prune``), so memory follows the requests alive at once, not the length of a stream:
no invariant depends on a finished request, whose table is empty.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

from kvspec.spec import (
    Config,
    Violation,
    apply,
    check,
    initial_state,
    running_tables,
    tables_append_only,
)
from kvspec.spec.observed import engine_effect, steer
from kvspec.spec.state import State, Touched

from .incremental import TABLES_APPEND_ONLY, Incremental, restates

Event = tuple[object, ...]


LEAVING = frozenset({"commit", "abort", "preempt"})
"""The decisions after which ``prune`` may find a finished request no step references."""


class SpecModel:
    def __init__(self, config: Config, incremental: bool = True, state: State | None = None):
        """``state``: start from this spec state (between decisions) instead of the initial one."""
        self.config = config
        self.state = initial_state(config) if state is None else state
        # What the incremental forms do not follow (kvspec/twins.py: a sliding window) is
        # judged by the full definitions.
        follows = incremental and restates(config)
        self.incremental = Incremental(self.state) if follows else None
        self.touched = Touched()
        """What the decisions (and engine effects) since the last check touched, but the last."""
        self.tables = running_tables(self.state)
        """Full-definition mode: the running tables at the last check (TablesAppendOnly)."""
        self.finished = {rid for rid, r in self.state.requests.items() if r.status == "finished"}
        self.prunable = True
        """A decision since the last ``prune`` that may finish a request or drop a step's
        reference to one (``LEAVING``), or an engine's effect."""

    def apply(self, decision: Event) -> list[Event]:
        s = self.state
        self.touched.merge(s.touched)  # the previous decision's, if not checked since
        effects = apply(s, decision)
        if decision[0] == "commit" or decision[0] == "abort":
            self.finished.update(e[1] for e in effects if e[0] == "finish")  # type: ignore[misc]
        self.prunable = self.prunable or decision[0] in LEAVING
        return effects

    def steer(self, decision: Event, effects: list[Event]) -> None:
        steer(self.state, decision, effects)
        self.prunable = self.prunable or decision[0] in LEAVING

    def engine_effect(self, effect: Event) -> None:
        engine_effect(self.state, effect)  # recorded in the decision's State.touched
        self.prunable = True

    def check(self, names: Collection[str] | None) -> Violation | None:
        s = self.state
        fp, self.touched = self.touched, Touched()
        fp.merge(s.touched)
        s.touched = Touched()
        if self.incremental is not None:
            return self.incremental.check(s, fp, names)
        violation = check(s, names)
        if violation is not None:
            return violation
        if names is None or TABLES_APPEND_ONLY in names:
            # Requests that left running since the snapshot may come back with another table.
            before = {r: t for r, t in self.tables.items() if r not in fp.left and r in s.requests}
            for rid, index, block in fp.swapped:  # an engine's sanctioned dedup
                table = before.get(rid)
                if table is not None and index < len(table):
                    before[rid] = table[:index] + (block,) + table[index + 1 :]
            grew = tables_append_only(before, s)
            if grew is not None:
                return grew
        self.tables = running_tables(s)
        return None

    def hold(self, keys: Collection[Hashable]) -> None:
        pass  # keys are token tuples: nothing to recycle

    def has_request(self, rid: object) -> bool:
        return rid in self.state.requests

    def prune(self) -> list[int]:
        if not self.finished or not self.prunable:  # nothing new to drop since the last call
            return []
        self.prunable = False
        s, gone = self.state, []
        for rid in list(self.finished):
            if any(rid in st.entries or rid in st.registrations for st in s.steps):
                continue
            self.finished.discard(rid)
            s.requests.pop(rid, None)
            gone.append(rid)
        return gone

    def chain_key(self, rid: int, index: int) -> Hashable:
        return self.state.key(self.state.requests[rid], index)

    def prefix_length(self, key: Hashable) -> int:
        return len(key)  # type: ignore[arg-type]

    def spec_key(self, key: Hashable) -> tuple[int, ...]:
        return key  # type: ignore[return-value]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        s = self.state
        return tuple(b.refcount for b in s.blocks), tuple(s.free)

    def export(self) -> State:
        return self.state
