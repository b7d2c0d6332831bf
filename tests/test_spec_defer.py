"""Deferred block freeing (``Config.defer_free``, vLLM's ``defer_block_free``): a request that
leaves while a submitted step still computes for it gives up its table at once, its blocks are
held by a ``Deferred`` holder until the fence (the newest submitted step that computes anything)
commits, then freed in vLLM's order. The spec's scenarios are those of vLLM 0.33.0's
``tests/v1/core/test_deferred_block_free.py``; the planted bugs (a free at once, a drain
before the fence) are caught by ``FreedAfterWrites``; the reference engine with deferred frees
conforms to the spec in lockstep; the fast and Z3 models refuse the flag by name; the trace
header carries it."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from test_reference import BOOKKEEPING, drive, recording_engine, replay

from kvspec.conformance.trace import read_trace, write_trace
from kvspec.judge.core import Judge
from kvspec.reference import Engine, EngineConfig
from kvspec.spec import INVARIANTS, Config, Illegal, apply, check, initial_state
from kvspec.spec import actions as spec_actions
from kvspec.spec.state import Deferred, State

PROMPT = (1, 2, 3, 4, 5, 6, 7, 8, 1)  # two full blocks of 4 and one token
STOP = 9


def _config(**kw: object) -> Config:
    base: dict[str, object] = dict(
        num_blocks=12,
        block_size=4,
        depth=3,
        async_scheduling=True,
        stop_token=STOP,
        defer_free=True,
        policy="eager-unsafe",
    )
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def _run(s: State, events: list[tuple[object, ...]]) -> list[list[tuple[object, ...]]]:
    """Apply each decision, every invariant checked after it; the effects of each."""
    out = []
    for event in events:
        out.append(apply(s, event))
        assert check(s) is None, (event, check(s))
    return out


PREFILL_AND_DECODE = [
    ("arrive", 1, PROMPT, 5, 0),
    ("begin", 0),
    ("schedule", 1, 9, 0),
    ("submit", 0),
    ("begin", 1),
    ("schedule", 1, 1, 0),  # over-scheduled decode on step 0's placeholder
    ("submit", 1),
    ("execute", 0, ()),
]


def test_a_finish_with_a_step_in_flight_holds_its_blocks_until_that_step_commits() -> None:
    s = initial_state(_config())
    _run(s, PREFILL_AND_DECODE)
    free_before = list(s.free)
    (effects,) = _run(s, [("commit", 0, ((1, STOP),))])
    assert ("finish", 1, "stop") in effects and not any(e[0] == "free" for e in effects)
    assert s.requests[1].table == [] and s.deferred == [Deferred(1, 1, (1, 2, 3))]
    assert s.free == free_before and [s.blocks[b].refcount for b in (1, 2, 3)] == [1, 1, 1]
    execute, commit = _run(s, [("execute", 1, ()), ("commit", 1, ())])
    # freed last block first: the unhashed one to the head, the cached ones to the tail
    assert commit == [("free", 3), ("free", 2), ("free", 1)]
    assert s.deferred == [] and s.free[0] == 3 and s.free[-2:] == [2, 1]


def test_without_deferral_the_same_finish_frees_at_once_and_the_invariant_names_it() -> None:
    """What deferral buys: freed at once, block 3 sits in the free queue while step 1 will
    still write it (the next owner's fill, e.g. a connector's load, races with that write).
    Holds without the flag (vLLM's behaviour then); FreedAfterWrites names it with the flag."""
    s = initial_state(_config(defer_free=False))
    _run(s, PREFILL_AND_DECODE)
    (effects,) = _run(s, [("commit", 0, ((1, STOP),))])
    assert [e for e in effects if e[0] == "free"] == [("free", 3), ("free", 2), ("free", 1)]
    assert any(not w.load for w in s.blocks[3].pending) and 3 in s.free
    s.config = replace(s.config, defer_free=True)
    violation = INVARIANTS["FreedAfterWrites"](s)
    assert violation is not None and violation.blocks == (3,) and violation.step == 1


def test_the_fence_is_the_newest_step_that_computes() -> None:
    """Three steps in flight, an abort: held through the first two commits, freed at the third
    (vLLM's test_fence_held_across_multiple_inflight_steps)."""
    s = initial_state(_config())
    _run(
        s,
        [
            ("arrive", 1, PROMPT, 10, 0),
            ("begin", 0),
            ("schedule", 1, 9, 0),
            ("submit", 0),
            ("begin", 1),
            ("schedule", 1, 1, 0),
            ("submit", 1),
            ("begin", 2),
            ("schedule", 1, 1, 0),
            ("submit", 2),
        ],
    )
    (abort,) = _run(s, [("abort", 1)])
    assert abort == [("finish", 1, "abort")] and s.deferred[0].fence == 2
    for step in (0, 1):
        effects = _run(s, [("execute", step, ()), ("commit", step, ())])
        assert effects == [[], []] and len(s.deferred) == 1
    effects = _run(s, [("execute", 2, ()), ("commit", 2, ())])
    assert effects[1] == [("free", 3), ("free", 2), ("free", 1)] and not s.deferred


def test_a_request_no_step_in_flight_computes_for_is_freed_at_once() -> None:
    """A request finishing at max_tokens is not in the later step (vLLM skips its decode), so
    it is freed at once although a step is in flight (test_max_tokens_finish_frees_...)."""
    s = initial_state(_config())
    _run(
        s,
        [
            ("arrive", 1, PROMPT, 1, 0),
            ("arrive", 2, (5, 5, 5, 5, 5), 100, 0),
            ("begin", 0),
            ("schedule", 1, 9, 0),
            ("schedule", 2, 5, 0),
            ("submit", 0),
            ("begin", 1),
            ("schedule", 2, 1, 0),
            ("submit", 1),
            ("execute", 0, ()),
        ],
    )
    (effects,) = _run(s, [("commit", 0, ((1, 3), (2, 3)))])
    assert ("finish", 1, "length") in effects and ("free", 1) in effects and not s.deferred


def test_deferred_frees_drain_in_order_and_an_empty_table_holds_nothing() -> None:
    """Two requests stop at one commit: two holders, one fence, freed oldest first, each
    table last block first (the free queue compared exactly)."""
    s = initial_state(_config())
    two = (8, 8, 8, 8, 8)
    _run(
        s,
        [
            ("arrive", 1, PROMPT, 5, 0),
            ("arrive", 2, two, 5, 0),
            ("begin", 0),
            ("schedule", 1, 9, 0),
            ("schedule", 2, 5, 0),
            ("submit", 0),
            ("begin", 1),
            ("schedule", 1, 1, 0),
            ("schedule", 2, 1, 0),
            ("submit", 1),
            ("execute", 0, ()),
            ("commit", 0, ((1, STOP), (2, STOP))),
        ],
    )
    assert [(d.fence, d.req) for d in s.deferred] == [(1, 1), (1, 2)]
    tables = [d.blocks for d in s.deferred]
    _, commit = _run(s, [("execute", 1, ()), ("commit", 1, ())])
    assert commit == [("free", b) for table in tables for b in reversed(table)]
    unhashed = [b for table in tables for b in reversed(table) if s.blocks[b].key is None]
    assert s.free[: len(unhashed)] == unhashed[::-1]  # each put at the head as freed


def test_vllm_never_preempts_a_request_whose_free_would_be_deferred() -> None:
    s = initial_state(_config(preemption="fcfs", depth=2))
    _run(s, PREFILL_AND_DECODE[:-1])
    _run(s, [("execute", 0, ()), ("commit", 0, ((1, 3),)), ("begin", 2)])
    with pytest.raises(Illegal, match="deferred"):
        apply(s, ("preempt", 1))
    general = initial_state(_config(discipline="general", depth=2))
    _run(general, PREFILL_AND_DECODE[:-1])
    _run(general, [("execute", 0, ()), ("commit", 0, ((1, 3),)), ("begin", 2)])
    assert apply(general, ("preempt", 1)) == [] and general.deferred[0].fence == 1


def _plant(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    if bug == "free at once":
        monkeypatch.setattr(spec_actions, "_fence", lambda s, rid, committing: None)
    else:  # drain before the fence: at any commit
        real = spec_actions._drain

        def early(s: State, step: object) -> list[tuple[object, ...]]:
            s.deferred = [replace(d, fence=-1) for d in s.deferred]
            return real(s, step)  # type: ignore[arg-type]

        monkeypatch.setattr(spec_actions, "_drain", early)


@pytest.mark.parametrize("bug", ["free at once", "drain before the fence"])
def test_planted_bugs_are_caught_by_freed_after_writes(
    monkeypatch: pytest.MonkeyPatch, bug: str
) -> None:
    """A spec that frees at once, or drains at the first commit, leaves a block in the free
    queue that a step in flight will still write: FreedAfterWrites names it."""
    events = [
        ("arrive", 1, PROMPT, 10, 0),
        ("begin", 0),
        ("schedule", 1, 9, 0),
        ("submit", 0),
        ("begin", 1),
        ("schedule", 1, 1, 0),
        ("submit", 1),
        ("begin", 2),
        ("schedule", 1, 1, 0),
        ("submit", 2),
        ("abort", 1),
        ("execute", 0, ()),
        ("commit", 0, ()),
    ]
    s = initial_state(_config())
    _run(s, events)  # correct: held to the end
    _plant(monkeypatch, bug)
    s = initial_state(_config())
    found = None
    for event in events:
        apply(s, event)
        found = found or check(s)
    assert found is not None and found.invariant == "FreedAfterWrites", found


def test_the_strict_judge_holds_a_free_at_once_against_the_spec() -> None:
    """An engine that frees at once under defer_free: its free events disagree."""
    judge = Judge.spec(_config())
    events = PREFILL_AND_DECODE + [
        ("commit", 0, ((1, STOP),)),
        ("free", 3),
        ("free", 2),
        ("free", 1),
        ("finish", 1, "stop"),
    ]
    finding = judge.feed_all(
        [e for e in events[:3]]
        + [("hit", 1, ()), ("alloc", 1, 1), ("alloc", 1, 2), ("alloc", 1, 3)]
        + events[3:]
    )
    assert finding is not None and "Disagreement" in str(finding), finding


def _deferrals(cfg: EngineConfig, events: list[tuple[object, ...]]) -> Counter[str]:
    """Replay the decisions through the spec, counting deferrals and drains; FreedAfterWrites
    holds after every decision (whatever the policy: it is about frees, not registrations)."""
    from kvspec.spec.events import DECISIONS

    spec_cfg = _config(
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size,
        depth=cfg.depth,
        policy=cfg.policy,
        discipline=cfg.discipline,
        preemption=cfg.preemption,
        token_budget=cfg.token_budget,
        max_running=cfg.max_running,
        stop_token=cfg.stop_token,
        async_scheduling=cfg.async_scheduling,
        stale_output=cfg.stale_output,
        delay_load_registration=cfg.delay_load_registration,
        defer_loads=cfg.defer_loads,
    )
    s, seen = initial_state(spec_cfg), Counter[str]()
    for event in events:
        if event[0] in DECISIONS:
            before = len(s.deferred)
            loading = event[0] == "abort" and s.requests[event[1]].loading is not None
            apply(s, event)
            seen["deferred"] += max(0, len(s.deferred) - before)
            seen["deferred loads"] += loading and len(s.deferred) > before
            seen["drained"] += max(0, before - len(s.deferred)) if event[0] == "commit" else 0
            assert INVARIANTS["FreedAfterWrites"](s) is None, event
    return seen


@pytest.mark.parametrize("discipline", ["vllm", "general"])
def test_the_reference_engine_with_deferred_frees_conforms(discipline: str) -> None:
    """Lockstep: the reference engine (its own step sequence numbers and fenced queue) emits
    the spec's effects event by event, and its refcounts and free queue are the spec's before
    every decision; deferrals and drains happen."""
    seen: Counter[str] = Counter()
    for depth in (1, 2, 3):
        for asynchronous in (False, True):
            for seed in range(3):
                if asynchronous and depth == 1:
                    continue
                rng = random.Random(f"defer-{discipline}-{depth}-{asynchronous}-{seed}")
                cfg = EngineConfig(
                    num_blocks=rng.randint(6, 12),
                    block_size=rng.randint(1, 3),
                    depth=depth,
                    policy=rng.choice(["eager-unsafe", "deferred", "eager-rollback-fifo"]),
                    discipline=discipline,
                    preemption=rng.choice(["fcfs", "priority"]),
                    token_budget=rng.randint(3, 10),
                    max_running=rng.randint(1, 4),
                    stop_token=0,
                    vocab=3,
                    async_scheduling=asynchronous,
                    stale_output=rng.choice(["drop", "deliver"]) if depth > 1 else "drop",
                    defer_free=True,
                )
                eng, rec = recording_engine(cfg, seed, fail_rate=0.3)
                drive(eng, rng, num_requests=rng.randint(4, 10))
                rec.snapshots.append(eng.snapshot())
                s = replay(cfg, rec, rec.snapshots)
                assert not s.deferred
                assert check(s, BOOKKEEPING + ["FreedAfterWrites"]) is None
                seen += _deferrals(cfg, list(rec))
    assert seen["deferred"] > 10 and seen["drained"] == seen["deferred"], seen


def test_the_fast_and_z3_models_refuse_deferred_frees() -> None:
    """Declared out of their scope (kvspec/twins.py): refused by name, never judged as if the
    frees were immediate; ``kvspec check`` judges such a trace by the spec."""
    from kvspec.conformance.monitor import Monitor
    from kvspec.judge.fastmodel import FastModel, restates
    from kvspec.proofs.symbolic import Fragment

    assert not restates(_config()) and restates(_config(defer_free=False))
    with pytest.raises(ValueError, match="defer_free"):
        FastModel(_config())
    with pytest.raises(ValueError, match="deferred block freeing"):
        Fragment(Config(4, 1, defer_free=True))
    assert Monitor.fast(_config()).run is None  # the spec judges


def _full_trace(cfg: Config) -> list[tuple[object, ...]]:
    """The finish-with-a-step-in-flight scenario, decisions and effects, as the spec makes it."""
    s, trace = initial_state(cfg), []
    for event in PREFILL_AND_DECODE + [
        ("commit", 0, ((1, STOP),)),
        ("execute", 1, ()),
        ("commit", 1, ()),
    ]:
        trace.append(event)
        trace += apply(s, event)
    return trace


def test_the_trace_header_carries_defer_free_and_old_traces_read_as_off(tmp_path: Path) -> None:
    cfg = _config()
    trace = _full_trace(cfg)
    path = tmp_path / "t.jsonl"
    write_trace(path, cfg, trace, engine=("test", "0"))
    header = json.loads(path.read_text().splitlines()[0])
    assert header["model"]["defer_free"] is True
    read = read_trace(path)
    assert read[0] == cfg and list(read[1]) == trace
    lines = path.read_text().splitlines()
    header["model"]["defer_free"] = "yes"
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(Exception, match="defer_free"):
        read_trace(path)
    del header["model"]["defer_free"]  # a trace written before the field: frees at once
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert read_trace(path)[0] == replace(cfg, defer_free=False)
    write_trace(path, replace(cfg, defer_free=False), [], engine=("test", "0"))
    assert "defer_free" not in json.loads(path.read_text().splitlines()[0])["model"]


def test_kvspec_check_judges_deferred_frees_by_the_spec(tmp_path: Path) -> None:
    """The fast model refuses the flag, so ``kvspec check`` judges by the spec: the deferred
    trace holds, and the same events judged as if the frees were immediate do not."""
    from kvspec.conformance.check import check_file

    cfg = _config()
    trace = _full_trace(cfg)
    path = tmp_path / "t.jsonl"
    write_trace(path, cfg, trace, engine=("test", "0"))
    assert check_file(path).exit_code == 0
    write_trace(path, replace(cfg, defer_free=False), trace, engine=("test", "0"))
    assert check_file(path).exit_code == 1


def test_a_reference_engine_that_frees_at_once_fails_the_lockstep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted in the reference engine: frees never deferred. The replay through the spec
    (defer_free on) finds its free events where the spec computes none."""
    from kvspec.reference.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "frees_later", lambda self, req: False)
    caught = 0
    for seed in range(6):
        rng = random.Random(f"defer-planted-{seed}")
        cfg = EngineConfig(
            num_blocks=10,
            block_size=2,
            depth=2,
            policy="deferred",
            token_budget=8,
            max_running=3,
            stop_token=0,
            vocab=3,
            async_scheduling=True,
            stale_output="deliver",
            defer_free=True,
        )
        eng, rec = recording_engine(cfg, seed, fail_rate=0.3)
        drive(eng, rng, num_requests=8)
        rec.snapshots.append(eng.snapshot())
        try:
            replay(cfg, rec, rec.snapshots)
        except AssertionError:
            caught += 1
    assert caught >= 3, caught


ABORT_IN_FLIGHT = [
    ("arrive", 1, PROMPT, 10, 0),
    ("begin", 0),
    ("schedule", 1, 9, 0),
    ("submit", 0),
    ("begin", 1),
    ("schedule", 1, 1, 0),
    ("submit", 1),
    ("abort", 1),
    ("execute", 0, ()),
    ("commit", 0, ()),
    ("execute", 1, ()),
    ("commit", 1, ()),
]


def _played(cfg: Config, decisions: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    s, trace = initial_state(cfg), []
    for decision in decisions:
        trace.append(decision)
        trace += apply(s, decision)
    return trace


@pytest.mark.parametrize("planted", [None, "free at once", "incremental skips free blocks"])
def test_the_incremental_checks_follow_deferred_frees(
    monkeypatch: pytest.MonkeyPatch, planted: str | None
) -> None:
    """The incremental and full checks give the same verdict on a trace with deferred frees,
    and on the trace of a spec planted to free at once (FreedAfterWrites at the same event);
    an incremental check planted to skip FreedAfterWrites misses what the full check finds."""
    from kvspec.judge.incremental import Incremental

    if planted == "incremental skips free blocks":
        monkeypatch.setattr(Incremental, "_freed_writes", lambda self, s, fp: False)
    if planted is not None:
        _plant(monkeypatch, "free at once")
    trace = _played(_config(), ABORT_IN_FLIGHT)
    full = Judge.spec(_config(), incremental=False).feed_all(trace)
    fast = Judge.spec(_config()).feed_all(trace)
    if planted is None:
        assert full is None and fast is None
    elif planted == "free at once":
        assert full is not None and full.invariant == "FreedAfterWrites"
        assert fast is not None and (fast.invariant, fast.event) == (full.invariant, full.event)
    else:
        assert full is not None and fast is None


# -- deferred asynchronous loads (Config.defer_loads, vLLM's defer_async_loads) --------------

LOADED = (5, 5, 5, 5, 6, 6, 6, 6, 7)  # two full blocks of 4 an external store holds, one token
LOAD_BESIDE_STEPS_IN_FLIGHT = [  # vLLM's _setup_async_load: a prefill and a decode in flight
    ("arrive", 1, PROMPT, 10, 0),
    ("arrive", 2, LOADED, 5, 0),
    ("begin", 0),
    ("schedule", 1, 9, 0),
    ("submit", 0),
    ("begin", 1),
    ("schedule", 1, 1, 0),
    ("submit", 1),
    ("begin", 2),
    ("schedule", 1, 1, 0),
    ("schedule", 2, 0, 2),  # the load: deferred, two computing steps older than it in flight
    ("submit", 2),
]


def _loads_config(**kw: object) -> Config:
    return _config(delay_load_registration=True, defer_loads=True, **kw)


def test_a_deferred_load_holds_its_blocks_until_the_newest_step_commits() -> None:
    """vLLM's test_abort_deferred_async_load_frees_after_inflight_step: a request whose load
    waits for the steps in flight is aborted; its blocks wait for the newest step that
    computes. Without ``defer_loads`` its load-only entry fences nothing: freed at once."""
    s = initial_state(_loads_config())
    _run(s, LOAD_BESIDE_STEPS_IN_FLIGHT)
    table = tuple(s.requests[2].table)
    (abort,) = _run(s, [("abort", 2)])
    assert abort == [("finish", 2, "abort")] and s.deferred == [Deferred(2, 2, table)]
    for step in (0, 1):
        _run(s, [("execute", step, ()), ("commit", step, ((1, 3),))])
        assert s.deferred == [Deferred(2, 2, table)]
    _, commit = _run(s, [("execute", 2, ()), ("commit", 2, ((1, 3),))])
    assert commit == [("free", b) for b in reversed(table)] and not s.deferred
    at_once = initial_state(_config(delay_load_registration=True))
    _run(at_once, LOAD_BESIDE_STEPS_IN_FLIGHT)
    (abort,) = _run(at_once, [("abort", 2)])
    assert abort == [("free", b) for b in reversed(table)] + [("finish", 2, "abort")]


def test_a_load_not_deferred_or_started_since_fences_nothing() -> None:
    """A load admitted with no computing step in flight starts at once; one whose older steps
    have committed has started: either request, aborted, is freed at once (vLLM: at once, or
    held by the connector until the load reports, which the vLLM attachment refuses)."""
    s = initial_state(_loads_config())
    _run(s, [("arrive", 2, LOADED, 5, 0), ("begin", 0), ("schedule", 2, 0, 2), ("submit", 0)])
    (abort,) = _run(s, [("abort", 2)])
    assert abort[-1] == ("finish", 2, "abort") and len(abort) == 3 and not s.deferred
    s = initial_state(_loads_config())
    _run(s, LOAD_BESIDE_STEPS_IN_FLIGHT)
    _run(s, [("execute", 0, ()), ("commit", 0, ((1, 3),)), ("execute", 1, ())])
    _run(s, [("commit", 1, ((1, 3),))])
    (abort,) = _run(s, [("abort", 2)])
    assert abort[-1] == ("finish", 2, "abort") and len(abort) == 3 and not s.deferred


def test_defer_loads_needs_defer_free_and_rides_in_the_trace_header(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="defer_loads"):
        Config(4, 1, defer_loads=True)
    with pytest.raises(ValueError, match="defer_loads"):
        EngineConfig(num_blocks=4, block_size=1, defer_loads=True)
    cfg = _loads_config()
    s, trace = initial_state(cfg), []
    for event in LOAD_BESIDE_STEPS_IN_FLIGHT + [("abort", 2)]:
        trace.append(event)
        trace += apply(s, event)
    path = tmp_path / "t.jsonl"
    write_trace(path, cfg, trace, engine=("test", "0"))
    assert json.loads(path.read_text().splitlines()[0])["model"]["defer_loads"] is True
    assert read_trace(path)[0] == cfg
    full = Judge.spec(cfg, incremental=False).feed_all(trace)
    fast = Judge.spec(cfg).feed_all(trace)
    assert full is None and fast is None
    write_trace(path, replace(cfg, defer_loads=False), trace, engine=("test", "0"))
    assert "defer_loads" not in json.loads(path.read_text().splitlines()[0])["model"]
    finding = Judge.spec(replace(cfg, defer_loads=False)).feed_all(trace)
    assert finding is not None and "Disagreement" in str(finding), finding  # freed at once


def test_the_reference_engine_with_deferred_loads_conforms() -> None:
    """Lockstep as above with ``defer_loads``: the reference engine's own sequence numbers
    (a deferred load's request counts the newest counted step at its admission) against the
    spec's ``_fence``; aborts of requests whose load was deferred happen and are held, and
    each run with one fails the lockstep against a spec without the flag."""
    seen: Counter[str] = Counter()
    for seed in range(12):
        rng = random.Random(f"defer-loads-{seed}")
        cfg = EngineConfig(
            num_blocks=rng.randint(8, 14),
            block_size=rng.randint(1, 3),
            depth=rng.choice([2, 3]),
            policy=rng.choice(["eager-unsafe", "deferred"]),
            preemption=rng.choice(["fcfs", "priority"]),
            token_budget=rng.randint(3, 10),
            max_running=rng.randint(2, 4),
            stop_token=0,
            vocab=3,
            async_scheduling=True,
            stale_output=rng.choice(["drop", "deliver"]),
            delay_load_registration=True,
            defer_free=True,
            defer_loads=True,
        )
        eng, rec = recording_engine(cfg, seed, fail_rate=0.0)
        _drive_loads(eng, rng, num_requests=rng.randint(6, 12))
        rec.snapshots.append(eng.snapshot())
        s = replay(cfg, rec, rec.snapshots)
        assert not s.deferred and check(s, BOOKKEEPING + ["FreedAfterWrites"]) is None
        run = _deferrals(cfg, list(rec))
        if run["deferred loads"]:  # the same run judged by a spec that starts loads at once
            with pytest.raises(AssertionError):
                replay(replace(cfg, defer_loads=False), rec, rec.snapshots)
        seen += run
    assert seen["deferred loads"] >= 3 and seen["drained"] == seen["deferred"], seen


def _drive_loads(eng: Engine, rng: random.Random, num_requests: int) -> None:
    """``drive``'s workload, most requests external with prompts of two blocks and more, and
    requests aborted while they load."""
    bsz = eng.config.block_size
    added = 0
    for _ in range(4000):
        if added < num_requests and rng.random() < 0.5:
            prompt = tuple(rng.randrange(3) for _ in range(rng.randint(2 * bsz + 1, 4 * bsz)))
            room = (eng.config.num_blocks - 1) * bsz - len(prompt) - eng.config.reach
            if room >= 1:
                max_tokens = rng.randint(1, min(4, room))
                external = rng.random() < 0.7
                eng.add_request(added, prompt, max_tokens, rng.randrange(3), external=external)
            added += 1
        loading = [r.rid for r in eng.scheduler.requests.values() if r.loading is not None]
        if loading and rng.random() < 0.4:
            eng.abort(rng.choice(loading))
        if not eng.step() and added >= num_requests:
            return
    raise AssertionError("the engine did not finish in 4000 steps")
