"""Speculative decoding under async scheduling (``Config.spec_tokens`` with
``Config.async_scheduling``, vLLM's ``AsyncScheduler`` with drafts): a decode in flight holds
one placeholder per token it may sample (its drafts, then its own token), the next decode is
scheduled as if every draft were accepted, and when the earlier step commits with rejected
drafts the later decode moves back over them (vLLM's model runner does it on the device, its
scheduler rolls back ``num_computed_tokens`` and ``num_output_placeholders``), its writes laid
again; a step waits for that commit before it executes. Only verified tokens are hashed.
Stale output delivered with drafts moves the later stale decode back too. The invariants hold
on correct runs and name a block published over a rejected draft; the reference engine follows
the spec in lockstep (random workloads, depths 2 and 3, both stale-output modes), two bugs
planted in it are caught, and the incremental checks agree with the full ones."""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_reference import lockstep_run

from kvspec.conformance.trace import read_trace, write_trace
from kvspec.judge import Judge
from kvspec.reference import EngineConfig
from kvspec.reference.scheduler import Scheduler
from kvspec.spec import POLICIES, Config, Illegal, apply, check, initial_state, policies
from kvspec.spec import actions as spec_actions
from kvspec.spec.state import Draft, Placeholder, State

PROMPT = (1, 2, 3, 4, 5, 6)
Event = tuple[object, ...]
ASYNC = Config(16, 4, depth=2, policy="eager-unsafe", async_scheduling=True, spec_tokens=3)

PIPELINE: list[Event] = [
    ("arrive", 0, PROMPT, 20, 0),
    ("begin", 0),
    ("schedule", 0, 6, 0),  # the prompt, sampling position 6
    ("submit", 0),
    ("begin", 1),
    ("schedule", 0, 4, 0),  # on step 0's placeholder (position 6) and three drafts
    ("submit", 1),
    ("execute", 0, ()),
    ("commit", 0, ((0, 8),)),
    ("begin", 2),
    ("schedule", 0, 4, 0),  # as if step 1 accepted all three: position 10 and three drafts
    ("submit", 2),
    ("execute", 1, ()),
]
"""Step 1 computes positions 6..9 (token 8, drafts at 7, 8, 9); step 2, scheduled before step
1's output, computes 10..13 (step 1's own token at 10, as if all drafts were right)."""


class Found(Exception):
    """An invariant failed in ``run``: ``args`` are the decision and the ``Violation``."""


def run(config: Config, decisions: list[Event]) -> tuple[State, list[Event]]:
    """Apply ``decisions`` checking every invariant after each (else ``Found``); the state and
    the trace."""
    s, trace = initial_state(config), []
    for decision in decisions:
        trace += [decision, *apply(s, decision)]
        violation = check(s)
        if violation is not None:
            raise Found(decision, violation)
    return s, trace


def test_placeholders_cover_a_decodes_drafts() -> None:
    s, _ = run(ASYNC, PIPELINE[:7])
    ahead = s.ahead(s.requests[0])
    assert ahead[6:] == [
        Placeholder(0, 0),
        Draft(1, 0, 0),
        Draft(1, 0, 1),
        Draft(1, 0, 2),
        Placeholder(1, 0),
    ]
    s, _ = run(ASYNC, PIPELINE[:10])
    with pytest.raises(Illegal, match="nor one of its draft slots"):
        apply(s, ("schedule", 0, 5, 0))  # 1 + K past the placeholders at most


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_a_later_decode_moves_back_over_rejected_drafts(accepted: int) -> None:
    sampled = tuple((0, 20 + j) for j in range(accepted + 1))
    s, trace = run(ASYNC, [*PIPELINE, ("commit", 1, sampled)])
    req, rejected = s.requests[0], 3 - accepted
    assert req.tokens == [*PROMPT, 8, *range(20, 21 + accepted)]
    entry = s.steps[0].entries[0]
    assert (entry.start, entry.end) == (10 - rejected, 14 - rejected)
    assert req.computed == 14 - rejected  # vLLM's num_computed_tokens after the rollback
    assert len(req.table) == 4  # the table keeps the slots scheduled as if all were accepted
    # step 2's writes, laid again: its first position is step 1's own token
    for w in (w for block in req.table for w in s.blocks[block].pending):
        assert w.prefix[: len(req.tokens)] == tuple(req.tokens)[: len(w.prefix)]
    # only verified tokens are hashed: up to the known tokens but the newest
    full = (len(req.tokens) - 1) // 4
    assert [e[2] for e in trace if e[0] == "publish"] == list(range(full))
    s2, _ = run(ASYNC, [*PIPELINE, ("commit", 1, sampled), ("execute", 2, ())])
    tail = s2.blocks[req.table[2]].written
    assert tail is not None and tail[: len(req.tokens)] == tuple(req.tokens)[: len(tail)]


def test_a_step_executes_after_the_commit_that_moves_it() -> None:
    s, _ = run(ASYNC, PIPELINE[:-1])
    apply(s, ("execute", 1, ()))
    with pytest.raises(Illegal, match="wait for step 1's accepted drafts"):
        apply(s, ("execute", 2, ()))


def test_stale_output_delivered_with_drafts_moves_the_stale_decode_back() -> None:
    """Depth 3: steps 1 and 2 hold r0's decodes when step 3 preempts it; step 1's output
    (one draft of three accepted) is delivered, step 2's decode moves back, executes over the
    freed blocks as a live reader and delivers its tokens too; r0 is admitted again after."""
    config = Config(
        16,
        4,
        depth=3,
        policy="eager-unsafe",
        async_scheduling=True,
        spec_tokens=3,
        stale_output="deliver",
    )
    decisions: list[Event] = [
        *PIPELINE[:12],
        ("begin", 3),
        ("preempt", 0),
        ("submit", 3),
        ("execute", 1, ()),
        ("commit", 1, ((0, 20), (0, 21))),
    ]
    s, _ = run(config, decisions)
    entry = s.steps[0].entries[0]
    assert s.requests[0].status == "waiting" and 0 in s.steps[0].live
    assert (entry.start, entry.end) == (8, 12)  # moved back over the two rejected drafts
    decisions += [
        ("execute", 2, ()),
        ("commit", 2, ((0, 30), (0, 31), (0, 32), (0, 33))),
        ("execute", 3, ()),
        ("commit", 3, ()),
        ("begin", 4),
        ("schedule", 0, 1, 0),
        ("submit", 4),
    ]
    s, trace = run(config, decisions)
    req = s.requests[0]
    assert req.tokens == [*PROMPT, 8, 20, 21, 30, 31, 32, 33]
    assert req.status == "running"
    # stale output is not registered (vLLM caches no blocks for it): block 0 only is hit
    assert ("hit", 0, (1,)) in trace


def _publishing_the_newest_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted engine: its post-output registration counts the rejected drafts as computed
    (capped at the known tokens), so the newest token's slot, computed from a rejected draft,
    is published."""
    register = policies.register

    def on_output(s: State, req: Any, entry: object, rejected: int = 0) -> list[Event]:
        return register(s, req, min(len(req.tokens) // s.config.block_size, len(req.table)))[0]

    monkeypatch.setattr(policies, "on_output", on_output)


def test_publishing_over_a_rejected_draft_is_caught_under_async(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step 1 accepts none of its three drafts: its own token lands at position 7, the last
    slot of block 1, whose K/V step 1 computed from draft 0. With no decode of r0 in flight
    nothing rewrites it: the correct engine leaves block 1 unpublished, the planted one
    publishes it and NoUnwrittenPublish names it. With step 2's decode in flight (moved back
    to position 7) the slot is written again before any reader can hit the block, so the
    same publication is not yet wrong."""
    decisions: list[Event] = [
        *PIPELINE[:10],
        ("submit", 2),  # r0 not scheduled in step 2: nothing in flight rewrites its slots
        ("execute", 1, ()),
        ("commit", 1, ((0, 20),)),
    ]
    s, _ = run(ASYNC, decisions)
    assert len(s.index) == 1  # block 0 only: position 7 is not computed yet
    _publishing_the_newest_token(monkeypatch)
    with pytest.raises(Found) as caught:
        run(ASYNC, decisions)
    decision, violation = caught.value.args
    assert decision[0] == "commit"
    assert violation.invariant == "NoUnwrittenPublish" and violation.blocks == (2,)
    s, trace = run(ASYNC, [*PIPELINE, ("commit", 1, ((0, 20),))])
    assert ("publish", 0, 1, 2) in trace and s.steps[0].entries[0].start == 7


def test_an_engine_publishing_over_a_rejected_draft_is_caught_by_the_observed_judge() -> None:
    """Observed judging (``engine-registers``): the engine's own ``publish`` of the block whose
    last slot holds step 1's rejected draft 0 (no decode of r0 in flight to write it again) is
    a NoUnwrittenPublish finding; with NoUnwrittenPublish left out, another request's hit and
    read of it is a NoUnwrittenRead finding; the correct engine's trace holds."""
    config = Config(16, 4, depth=2, policy="engine-registers", async_scheduling=True, spec_tokens=3)
    decisions: list[Event] = [
        *PIPELINE[:10],
        ("submit", 2),
        ("execute", 1, ()),
        ("commit", 1, ((0, 20),)),
    ]
    _, trace = run(config, decisions)
    judge = Judge.stream(config, observed=True)  # the correct engine's trace holds
    judge.feed_all(trace)
    assert judge.finish() is None
    planted = [*trace, ("publish", 0, 0, 1), ("publish", 0, 1, 2)]
    judge = Judge.stream(config, observed=True)
    judge.feed_all(planted)
    finding = judge.finish()
    assert finding is not None and finding.invariant == "NoUnwrittenPublish", finding
    assert finding.blocks == (2,)
    reader: list[Event] = [
        ("arrive", 1, (*PROMPT, 8, 20, 9), 4, 0),
        ("begin", 3),
        ("schedule", 1, 1, 0),
        ("hit", 1, (1, 2)),
        ("alloc", 1, 5),
        ("submit", 3),
    ]
    judge = Judge.stream(config, observed=True, invariants=("NoUnwrittenRead",))
    judge.feed_all([*planted, *reader])
    finding = judge.finish()
    assert finding is not None and finding.invariant == "NoUnwrittenRead", finding
    assert finding.blocks == (2,)


def test_kvspec_check_judges_drafts_under_async_by_the_spec(tmp_path: Path) -> None:
    """A trace file with K and async scheduling in its header is judged by the spec: the
    pipeline holds; executing step 2 before step 1's commit is illegal (exit 1)."""
    from kvspec.conformance.check import check_file

    _, trace = run(ASYNC, [*PIPELINE, ("commit", 1, ((0, 20), (0, 21)))])
    path = tmp_path / "t.jsonl"
    write_trace(path, ASYNC, trace, engine=("test", "0"))
    assert read_trace(path)[0] == ASYNC
    assert check_file(path).exit_code == 0
    early = trace[: trace.index(("execute", 1, ()))] + [("execute", 1, ()), ("execute", 2, ())]
    write_trace(path, ASYNC, early, engine=("test", "0"))
    assert check_file(path).exit_code == 1


def async_drafts_run(
    policy: str, discipline: str, stale_output: str, depth: int, seed: int, seen: Counter[str]
) -> None:
    """One random workload on the reference engine with drafts under async scheduling,
    replayed through the spec in lockstep, final states compared."""
    rng = random.Random(f"async-drafts-{policy}-{discipline}-{stale_output}-{depth}-{seed}")
    cfg = EngineConfig(
        num_blocks=rng.randint(8, 14),
        block_size=rng.randint(1, 3),
        depth=depth,
        policy=policy,
        discipline=discipline,
        preemption=rng.choice(["fcfs", "priority"]),
        token_budget=rng.randint(3, 10),
        max_running=rng.randint(1, 4),
        stop_token=rng.choice([None, 0]),
        vocab=3,
        prefix_caching=rng.random() < 0.8,
        spec_tokens=rng.randint(1, 3),
        async_scheduling=True,
        stale_output=stale_output,
    )
    eng, _, _ = lockstep_run(cfg, seed, rng, 8, seen)
    seen["drafted"] += eng.stats["draft_tokens"]
    seen["rejected"] += eng.stats["rejected_drafts"]


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the spec's move-backs of a later decode (``actions._move_back``), by whether
    the request was running or waiting for its stale output."""
    seen: Counter[str] = Counter()
    original = spec_actions._move_back

    def move_back(s: State, req: object, rejected: int) -> None:
        seen["moved" if req.status == "running" else "moved-stale"] += 1  # type: ignore[attr-defined]
        original(s, req, rejected)  # type: ignore[arg-type]

    monkeypatch.setattr(spec_actions, "_move_back", move_back)
    return seen


@pytest.mark.parametrize("discipline", ["vllm", "general"])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_reference_engine_with_drafts_under_async_conforms(
    policy: str, discipline: str, moves: Counter[str]
) -> None:
    """Lockstep: random workloads (shared prefixes, preemption, external loads that fail,
    aborts, resets) on the reference engine with drafts under async scheduling; every decision
    legal, every effect and pool snapshot the spec's, final states equal; the runs went through
    later decodes moved back over rejected drafts."""
    seen: Counter[str] = Counter()
    for stale_output, depth, seed in itertools.product(("drop", "deliver"), (2, 3), range(6)):
        async_drafts_run(policy, discipline, stale_output, depth, seed, seen)
    assert seen["drafted"] > 100 and seen["rejected"] > 10, seen
    assert seen["placeholder"] > 0 and seen["delivered"] > 0, seen
    assert sum(moves.values()) > 0, moves


def _undo(field: str):  # type: ignore[no-untyped-def]
    """A replacement of ``Scheduler._move_back`` that also undoes the rollback of ``field``
    over the rejected drafts, where a later step holds the request (the async case)."""

    def replacement(original):  # type: ignore[no-untyped-def]
        def move_back(self: Scheduler, req: object, rejected: int) -> None:
            original(self, req, rejected)
            setattr(req, field, getattr(req, field) + rejected)

        return move_back

    return replacement


PLANTED = {
    # name: (replacement of Scheduler._move_back from the original, what catches it)
    "placeholders not rolled back over rejected drafts": (
        _undo("placeholders"),
        "nor one of its draft slots",  # the next decode reaches past K drafts: illegal
    ),
    "computed tokens not rolled back while a later step is in flight": (
        _undo("computed"),
        "('alloc'",  # the engine allocates where the spec does not
    ),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_bugs_in_the_reference_are_caught(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replacement, fragment = PLANTED[name]
    monkeypatch.setattr(Scheduler, "_move_back", replacement(Scheduler._move_back))
    with pytest.raises(AssertionError, match=re.escape(fragment)):
        seen: Counter[str] = Counter()
        for policy, stale_output, depth, seed in itertools.product(
            ("eager-unsafe", "deferred"), ("drop", "deliver"), (2, 3), range(3)
        ):
            async_drafts_run(policy, "vllm", stale_output, depth, seed, seen)


def _spec_config(cfg: EngineConfig) -> Config:
    names = ("num_blocks", "block_size", "depth", "policy", "discipline", "preemption")
    names += ("token_budget", "max_running", "stop_token", "async_scheduling", "stale_output")
    names += ("prefix_caching", "spec_tokens", "delay_load_registration")
    return Config(**{name: getattr(cfg, name) for name in names})


@pytest.mark.parametrize("planted", [False, True])
def test_incremental_checks_agree_with_the_full_ones(
    planted: bool, moves: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the reference engine's runs with drafts under async scheduling (later decodes moved
    back, their writes laid again; vllm/fcfs, loads that never fail: cells that hold), the
    incremental checks report what the full ones report: nothing, and with the planted
    registration of the newest token's slot the same first violation."""
    from test_reference import drive, recording_engine

    if planted:
        _publishing_the_newest_token(monkeypatch)
    found = 0
    for policy, stale_output, depth, seed in itertools.product(
        ("eager-unsafe", "eager-rollback-fifo", "hide-uncommitted"),
        ("drop", "deliver"),
        (2, 3),
        range(2),
    ):
        rng = random.Random(f"incremental-{policy}-{stale_output}-{depth}-{seed}")
        cfg = EngineConfig(
            num_blocks=rng.randint(8, 14),
            block_size=rng.randint(1, 3),
            depth=depth,
            policy=policy,
            discipline="vllm",
            preemption="fcfs",
            token_budget=rng.randint(3, 10),
            max_running=rng.randint(1, 4),
            stop_token=rng.choice([None, 0]),
            vocab=3,
            spec_tokens=rng.randint(1, 3),
            async_scheduling=True,
            stale_output=stale_output,
        )
        eng, rec = recording_engine(cfg, seed, fail_rate=0.0)  # loads never fail
        with monkeypatch.context() as quiet:  # the engine runs unplanted: its trace is correct
            quiet.setattr(policies, "on_output", ORIGINAL_ON_OUTPUT)
            drive(eng, rng, num_requests=8)
        config = _spec_config(cfg)
        full = Judge.spec(config, False, None, 1, incremental=False).feed_all(list(rec))
        fast = Judge.spec(config, False, None, 1).feed_all(list(rec))
        assert fast == full
        found += full is not None
    assert sum(moves.values()) > 10, moves
    assert (found > 0) == planted


ORIGINAL_ON_OUTPUT = policies.on_output
