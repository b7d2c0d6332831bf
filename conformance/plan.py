"""From a trace to a replay plan: what each executed step writes and reads, per the spec (the arrow
"the same trace replays on real tensors").

``replay_plan`` runs the trace through a spec judge (strict or observed, as its header says; no
invariant checked: a replay shows what the bytes hold, whatever the verdict) whose recorder turns
the spec's state into work for real tensors, in trace order:

* ``Fill(block)`` for every block the spec allocates (its bytes are garbage until written);
* ``Executed(step, event_index, work)`` at every ``execute`` decision, with one ``Work`` per
  entry of the step in scheduling order, read from the spec's state just before the execution
  (with several groups, every group's table prefix: ``Entry.group_blocks``).

``replay_groups`` says how the replay lays out the trace's groups (``model.groups``).

Under async scheduling a step may compute the K/V of a position whose token is a placeholder
(``docs/model.md``): the plan gives it the token the sampling step's commit resolves it to, or,
when that sample is discarded, a token no real one equals (the bytes are garbage for every later
reader). ``impl/paged/replay.py`` executes the plan on a paged KV cache and compares every
attention output with dense attention computed from scratch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from kvspec.impl.paged.records import Executed, Fill, GroupLayout, Record, Work
from kvspec.judge import Judge, Model
from kvspec.judge.spec_model import SpecModel
from kvspec.spec import Config, Placeholder

Event = tuple[object, ...]


class PlanError(ValueError):
    """An event the spec does not accept; ``index`` is its position in the trace (0-based)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"event {index}: {message}")
        self.index = index
        self.reason = message


class PlanRecorder:
    """A judge's recorder that writes the replay plan."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.resolved: dict[Placeholder, int] = {}

    def decision(self, line: int, event: Event, model: Model) -> None:
        """``line``: the event's index + 1 (an in-process stream)."""
        if event[0] == "commit":
            for rid, token in event[2]:  # type: ignore[attr-defined]
                self.resolved[Placeholder(event[1], rid)] = token  # type: ignore[arg-type]
        elif event[0] == "execute":
            s = model.export()
            step = next((st for st in s.steps if st.phase != "executed"), None)
            if step is not None and step.id == event[1]:
                failed = event[2]
                work = tuple(
                    Work(
                        req=rid,
                        tokens=tuple(s.ahead(s.requests[rid])[: e.end]),  # type: ignore[arg-type]
                        start=e.start,
                        end=e.end,
                        blocks=tuple(e.blocks),
                        load=e.load,
                        failed=rid in failed,  # type: ignore[operator]
                        live=rid in step.live,
                        groups=tuple(e.group_blocks),
                    )
                    for rid, e in step.entries.items()
                )
                self.records.append(Executed(step.id, line - 1, work))

    def effect(self, line: int, event: Event) -> None:
        if event[0] == "alloc":
            self.records.append(Fill(event[2]))  # type: ignore[arg-type]

    def pruned(self, rid: int) -> None:
        pass

    def plan(self) -> list[Record]:
        """The records, each placeholder a token: its resolution, or garbage."""
        return [_resolved(record, self.resolved) for record in self.records]


def replay_plan(config: Config, events: Iterable[Event], judging: str = "strict") -> list[Record]:
    """The plan of a trace; ``PlanError`` (a ``ValueError``) where the spec does not accept it."""
    recorder = PlanRecorder()
    judge = Judge(SpecModel(config), judging == "observed", recorder, invariants=())
    finding = judge.feed_all(events) or judge.finish()
    if finding is not None:
        illegal = finding.invariant == "Illegal"  # the message says what was illegal
        raise PlanError(
            finding.event, finding.message if illegal else f"{finding.invariant}: {finding.message}"
        )
    return recorder.plan()


def replay_groups(config: Config) -> tuple[GroupLayout, ...]:
    """The trace's KV-cache groups as the replay lays them out: ``model.groups`` in order, or
    one group (full attention, or ``sliding_window``'s window)."""
    if config.groups:
        return tuple(GroupLayout(g.kind, g.block_size, g.window or 0) for g in config.groups)
    window = config.sliding_window
    if window is not None:
        return (GroupLayout("window", config.block_size, window),)
    return (GroupLayout("full", config.block_size),)


def _resolved(record: Record, tokens: dict[Placeholder, int]) -> Record:
    if not isinstance(record, Executed):
        return record
    work = []
    for w in record.work:
        if any(isinstance(t, Placeholder) for t in w.tokens):
            resolved = tuple(
                (tokens.get(t, _garbage(t)) if isinstance(t, Placeholder) else t) for t in w.tokens
            )
            w = replace(w, tokens=resolved)
        work.append(w)
    return replace(record, work=tuple(work))


def _garbage(placeholder: Placeholder) -> int:
    """A token no real one equals (real tokens are >= 0), distinct per placeholder."""
    return -1 - (placeholder.step << 32) - placeholder.req
