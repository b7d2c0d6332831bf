"""Every ``NoUnwrittenPublish`` shown end to end: the counterexample extended by a consumer.

A ``NoUnwrittenPublish`` finding says that a block is published under a prefix it will never hold
(a *zombie*). Nothing has read it yet, so replaying the counterexample on tensors (``kvspec
replay``) finds every attention output right, which reads as "no problem". The *witness* is the
consumer the finding warns about: a new request whose prompt is the zombie's prefix plus one
token, which hits the zombie, is scheduled and executed, and so reads garbage. ``extend`` returns
the counterexample cut right after the decision that broke the invariant, followed by the
shortest such consumer this module finds (its decisions and the spec's effects); replayed, the
file shows the wrong attention output and names the zombie block. The file still judges the same
(the finding comes first, unchanged).

The consumer's decisions are searched on a copy of the spec's state, shortest plan first (schedule
it in the step being built; else in the next step, after the steps in flight; else after aborting
the waiting requests ahead of it; else after aborting every other request), and kept only when the
spec confirms the read of the zombie (``State.bad_reads``). The same is tried at the end of the
whole trace. Strictly judged traces only: an observed trace's pool choices are the engine's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvspec.spec import ACTIONS, Config, Illegal, apply, initial_state
from kvspec.spec.pool import eventual_content, holds, lookup
from kvspec.spec.state import Key, State

Event = tuple[object, ...]

INVARIANT = "NoUnwrittenPublish"


@dataclass
class Witness:
    events: list[Event]
    """The trace to write: the counterexample, extended when a witness was found."""
    note: str = ""
    """One line for the user ("" when there was nothing to extend)."""
    request: int | None = None
    block: int | None = None
    read_at: int | None = None
    """Index (0-based) in ``events`` of the ``execute`` in which the consumer reads the zombie."""
    found: bool = False
    decisions: list[Event] = field(default_factory=list)


def extend(
    config: Config,
    events: Sequence[Event],
    invariant: str,
    index: int,
    judging: str = "strict",
    header_lines: int = 1,
) -> Witness:
    """``events`` (a counterexample whose finding is ``invariant`` at event ``index``) with a
    consumer of the zombie appended. ``header_lines``: lines before the first event in the file
    written (for the note)."""
    events = list(events)
    if invariant != INVARIANT:
        return Witness(events)
    if judging != "strict":
        return Witness(events, "no witness: the consumer is searched for strictly judged traces")
    try:
        cut, at_cut = _state_after(config, events, index)
    except Illegal as err:
        return Witness(events, f"no witness: the spec does not replay the trace ({err})")
    tries = [(cut, at_cut)]
    if cut < len(events):
        try:
            tries.append((len(events), _state_after(config, events, len(events))[1]))
        except Illegal:
            pass
    rid = 1 + max((int(e[1]) for e in events if e[0] == "arrive"), default=-1)  # type: ignore[call-overload]
    for end, state in tries:
        for block, key in zombies(state):
            for plan in PLANS:
                found = _consumer(state, rid, block, key, plan)
                if found is None:
                    continue
                decisions, trace, read = found
                out = events[:end] + trace
                at = end + read
                line = at + 1 + header_lines
                return Witness(
                    out,
                    f"witness: r{rid} arrives with block {block}'s {len(key)}-token prefix and "
                    f"reads it (line {line}); kvspec replay shows the wrong attention output",
                    rid,
                    block,
                    at,
                    True,
                    decisions,
                )
    return Witness(events, "no witness: no consumer of the zombie block was found")


def _state_after(config: Config, events: list[Event], index: int) -> tuple[int, State]:
    """The spec's state once the decision at ``index`` and its effects are in (``cut``: the
    index of the next decision), and ``cut``."""
    s = initial_state(config)
    cut = len(events)
    for i, event in enumerate(events):
        if event[0] not in ACTIONS:
            continue
        if i > index:
            cut = i
            break
        apply(s, event)
    return cut, s


def zombies(s: State) -> list[tuple[int, Key]]:
    """(block, key) of every publication its block will never hold (not excused by a failed
    load the scheduler has not seen), oldest first."""
    bsz = s.config.block_size
    excused = {
        block
        for step in s.steps
        for rid in step.failed
        for block in step.entries[rid].blocks[step.entries[rid].start // bsz :]
    }
    return [
        (block, key)
        for key, blocks in s.index.items()
        for block in blocks
        if block not in excused and not holds(eventual_content(s, block), key)
    ]


Plan = tuple[bool, str]
"""(schedule the consumer in the step being built, which others to abort first: "", "waiting",
"all")."""
PLANS: tuple[Plan, ...] = ((True, ""), (False, ""), (False, "waiting"), (False, "all"))


def _consumer(
    state: State, rid: int, block: int, key: Key, plan: Plan
) -> tuple[list[Event], list[Event], int] | None:
    """The plan's decisions and events (each decision followed by the spec's effects), and the
    position in them of the execute that reads ``block``; None when the spec refuses a step of
    the plan or the consumer does not read the zombie."""
    s = copy.deepcopy(state)
    decisions: list[Event] = []
    trace: list[Event] = []

    def do(event: Event) -> None:
        effects = apply(s, event)
        decisions.append(event)
        trace.append(event)
        trace.extend(effects)

    cfg = s.config
    token = 1 if cfg.stop_token != 1 else 2
    priorities = [r.priority for r in s.requests.values()]
    priority = min([0, *priorities]) - 1  # first in line under priority preemption
    in_building, aborts = plan
    try:
        do(("arrive", rid, (*key, token), 1, priority))
        req = s.requests[rid]
        hits = lookup(s, req)
        if block not in hits:
            return None
        tokens = len(req.tokens) - len(hits) * cfg.block_size
        if in_building:
            if s.building is None:
                return None
            do(("schedule", rid, tokens, 0))
        else:
            if s.building is not None:
                do(("submit", s.building.id))
            for other in _to_abort(s, rid, aborts):
                do(("abort", other))
            while len(s.steps) >= cfg.depth:
                _commit_oldest(s, do, token)
            do(("begin", s.next_step))
            do(("schedule", rid, tokens, 0))
        mine = s.steps[-1].id
        do(("submit", mine))
        while True:
            step = next(st for st in s.steps if st.phase != "executed")
            do(("execute", step.id, ()))
            if step.id == mine:
                break
        read = len(trace) - 1
        if not any(r == rid and b == block for _, r, b in s.bad_reads):
            return None
        while s.steps and s.steps[0].id <= mine:
            _commit_oldest(s, do, token)
    except Illegal:
        return None
    return decisions, trace, read


def _to_abort(s: State, rid: int, which: str) -> list[int]:
    if which == "waiting":
        return [r for r in s.waiting if r != rid]
    if which == "all":
        return [r for r in s.waiting + s.running if r != rid]
    return []


def _commit_oldest(s: State, do: Callable[[Event], None], token: int) -> None:
    """Execute (if need be) and commit the oldest step in flight."""
    oldest = s.steps[0]
    if oldest.phase == "submitted":
        do(("execute", oldest.id, ()))
    sampled = tuple((r, token) for r, e in oldest.entries.items() if e.samples and r in oldest.live)
    do(("commit", oldest.id, sampled))


def extend_file(path: str | Path, invariant: str | None, line: int | None, out: str | Path) -> str:
    """``kvspec check --witness``: the trace at ``path``, whose violation is ``invariant`` at
    ``line``, extended and written to ``out`` in the same format; the line to print."""
    if invariant != INVARIANT or line is None:
        return f"no witness written: the violation is {invariant}, not {INVARIANT}"
    import orjson

    from . import budget
    from .trace import TraceError, open_trace, write_events, write_trace

    with open_trace(path) as trace:
        try:
            budget.check_read_whole(path)
        except budget.OverBudget as err:
            raise TraceError(path, 1, err.reason) from None
        config, judging, v1 = trace.config, trace.judging, trace.version == 1
        events = [event for _, event, _ in trace.events()]
    found = extend(config, events, invariant, line - 2, judging)
    if not found.found:
        return found.note
    if v1:
        with open(path, "rb") as f:
            engine = orjson.loads(f.readline()).get("engine", {})
        name = (str(engine.get("name", "unknown")), str(engine.get("version", "")))
        count = write_trace(out, config, found.events, engine=name, judging=judging)
    else:
        count = write_events(out, config, found.events)
    return f"wrote {count} events to {out}; {found.note}"
