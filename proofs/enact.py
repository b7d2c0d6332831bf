"""Force the reference engine through a given list of decisions, and judge what it does.

A counterexample from Z3 (``prove.py``) is a list of *decisions* (arrive, begin, schedule,
preempt, submit, execute, commit, abort, reset). The executable spec confirms it by applying
them; this module confirms it on the *implementation*: each decision is enacted by calling the
reference scheduler's own operations (``Scheduler.admit``/``schedule_running``/``preempt``/...,
the worker's ``execute``, ``update_from_output``), bypassing only the scheduling discipline,
whose job the decision list does. The engine's recorded events (its decisions and the block
pool's effects) then go to the lockstep ``Judge``, exactly as in fuzzing: the engine must agree
with the spec effect by effect, and the violation must show up in the engine's own run.

``EnactError`` means the engine cannot take a decision the spec took (a guard the engine checks
differently): that is a disagreement between spec and engine, reported, never ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec import twins
from kvspec.conformance.adapter import ReferenceAdapter
from kvspec.judge import Finding, Judge
from kvspec.reference import Engine
from kvspec.spec import Config

Event = tuple[object, ...]


class EnactError(RuntimeError):
    """The reference engine cannot take one of the decisions."""


class _ScriptedLoads:
    """``Choices`` for the worker: which external loads of the next execute fail; and which
    steps have executed (the reference engine executes and commits in one ``step()``)."""

    def __init__(self) -> None:
        self.failing: list[int] = []
        self.executed: set[int] = set()

    def pick(self, n: int, label: str) -> int:
        if label != "load-fails":
            raise EnactError(f"the engine asked for a {label!r} choice while enacting decisions")
        return self.failing.pop(0) if self.failing else 0


def enact(config: Config, decisions: Sequence[Event]) -> tuple[list[Event], Finding | None]:
    """Run the decisions on a fresh reference engine; return its events and the Judge's first
    finding (None if every invariant held and the engine agreed with the spec throughout)."""
    choices = _ScriptedLoads()
    engine = ReferenceAdapter(config, choices).engine
    for number, decision in enumerate(decisions, 1):
        try:
            _enact_one(engine, choices, decision)
        except twins.NotFollowed:  # a decision its row refuses: not a disagreement
            raise
        except (EnactError, ValueError, KeyError, AssertionError, IndexError) as err:
            raise EnactError(
                f"decision {number} {decision}: the engine cannot take it: {err}"
            ) from None
    judge = Judge.spec(config)
    finding = judge.feed_all(engine.events)
    return engine.events, finding


def _enact_one(engine: Engine, choices: _ScriptedLoads, decision: Event) -> None:
    sched, kind = engine.scheduler, decision[0]
    if kind == "arrive":
        _, rid, prompt, max_tokens, priority = decision
        engine.add_request(rid, tuple(prompt), max_tokens, priority)  # type: ignore[arg-type]
    elif kind == "begin":
        step = sched.begin()
        if step.step_id != decision[1]:
            raise EnactError(f"the engine numbered the step {step.step_id}")
    elif kind == "schedule":
        _, rid, tokens, loaded = decision
        step = _building(engine)
        req = sched.requests[rid]  # type: ignore[index]
        if req.status == "waiting":
            hits = sched.kv.lookup(req)
            end = len(hits) * sched.kv.block_size + tokens  # type: ignore[operator]
            if sched.kv.blocks_short(req, end, hits):
                raise EnactError("not enough free blocks to admit")
            sched.admit(step, req, hits, tokens, loaded)  # type: ignore[arg-type]
        else:
            if sched.kv.blocks_short(req, req.computed + tokens):  # type: ignore[operator]
                raise EnactError("not enough free blocks to schedule")
            sched.schedule_running(step, req, tokens)  # type: ignore[arg-type]
    elif kind == "preempt":
        _building(engine)
        sched.preempt(sched.requests[decision[1]])  # type: ignore[index]
    elif kind == "submit":
        step = _building(engine)
        if step.step_id != decision[1]:
            raise EnactError(f"the building step is {step.step_id}")
        sched.submit(step)
    elif kind == "execute":
        _, sid, failed = decision
        pending = [s for s in sched.in_flight if s.step_id not in choices.executed]
        oldest = pending[0] if pending else None
        if oldest is None or oldest.step_id != sid:
            raise EnactError("no such step to execute")
        choices.failing = [1 if rid in failed else 0 for rid, e in oldest.entries.items() if e.load]  # type: ignore[operator]
        got = engine.worker.execute(oldest, sched.requests)
        choices.executed.add(oldest.step_id)
        engine.events.append(("execute", oldest.step_id, got))
    elif kind == "commit":
        _, sid, sampled = decision
        first = sched.in_flight[0] if sched.in_flight else None
        if first is None or first.step_id != sid or sid not in choices.executed:
            raise EnactError("no such executed step to commit")
        sched.update_from_output(first, tuple(sampled))  # type: ignore[arg-type]
    elif kind == "abort":
        if not engine.abort(decision[1]):  # type: ignore[arg-type]
            raise EnactError("the engine refuses the abort")
    elif kind == "reset":
        if decision[1:]:  # a reset preempting running requests
            raise twins.refused("kvspec.reference", "reset_running")
        if not engine.reset_prefix_cache():
            raise EnactError("the engine refuses the reset")
    else:
        raise EnactError(f"unknown decision {kind!r}")


def _building(engine: Engine):  # type: ignore[no-untyped-def]
    step = engine.scheduler.building
    if step is None:
        raise EnactError("no step is building")
    return step
