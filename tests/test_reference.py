"""The reference implementation: unit tests of its block pool, and conformance to the spec.

The conformance test runs the engine on small random workloads and replays its event stream
through ``kvspec.spec``: every decision must be legal, the effects the spec computes must equal
the effects the engine emitted, and the pool (refcounts, free queue) must agree after every
decision. (Tests may import the spec; ``kvspec.reference`` itself may not.)
"""

from __future__ import annotations

import ast
import itertools
import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from kvspec.conformance.fuzz_groups import spec_config
from kvspec.reference import (
    DefaultChoices,
    Engine,
    EngineConfig,
    RandomChoices,
    shared_prefix_workload,
)
from kvspec.reference.block_pool import Block, BlockPool, FreeBlockQueue
from kvspec.reference.hashing import SEED_HASH, hash_block
from kvspec.reference.policies import Policy, TraitPolicy
from kvspec.reference.request import Request
from kvspec.reference.scheduler import Scheduler
from kvspec.spec import (
    INVARIANTS,
    POLICIES,
    STALE_OUTPUTS,
    Illegal,
    State,
    apply,
    initial_state,
)
from kvspec.spec.actions import admissible

Event = tuple[object, ...]
Snapshot = tuple[tuple[int, ...], tuple[int, ...]]
DECISIONS = {
    "arrive",
    "begin",
    "schedule",
    "preempt",
    "submit",
    "execute",
    "commit",
    "abort",
    "reset",
}
REFERENCE = Path(__file__).resolve().parents[1] / "reference"

# -- block pool --------------------------------------------------------------------------------


def test_free_queue_ops_and_order() -> None:
    blocks = [Block(i) for i in range(6)]
    q = FreeBlockQueue(blocks[1:])
    assert [b.block_id for b in q] == [1, 2, 3, 4, 5] and len(q) == 5
    q.remove(blocks[3])  # from the middle
    assert [b.block_id for b in q] == [1, 2, 4, 5]
    assert q.popleft() is blocks[1]
    q.appendleft(blocks[3])
    q.append(blocks[1])
    assert [b.block_id for b in q] == [3, 2, 4, 5, 1] and len(q) == 5
    for expected in (3, 2, 4, 5, 1):
        assert q.popleft().block_id == expected
    assert len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.popleft()


def test_pool_allocate_free_touch_order() -> None:
    events: list[tuple[object, ...]] = []
    pool = BlockPool(6, events)
    assert pool.snapshot() == ((0,) * 6, (1, 2, 3, 4, 5))
    a, b, c = pool.allocate(7), pool.allocate(7), pool.allocate(7)
    assert [x.block_id for x in (a, b, c)] == [1, 2, 3]
    pool.publish(a, b"h0", 7, 0)
    pool.publish(b, b"h1", 7, 1)
    pool.free_reversed([a, b, c])  # c uncached -> head; b then a cached -> tail
    assert pool.snapshot() == ((0,) * 6, (3, 4, 5, 2, 1))
    assert pool.cached_block(b"h0") is a
    pool.touch([a])  # removed from the middle... here the tail
    assert pool.snapshot() == ((0, 1, 0, 0, 0, 0), (3, 4, 5, 2))
    assert pool.in_use()
    assert events == [
        ("alloc", 7, 1),
        ("alloc", 7, 2),
        ("alloc", 7, 3),
        ("publish", 7, 0, 1),
        ("publish", 7, 1, 2),
        ("free", 3),
        ("free", 2),
        ("free", 1),
    ]


def test_pool_eviction_and_several_blocks_per_hash() -> None:
    events: list[tuple[object, ...]] = []
    pool = BlockPool(4, events)
    x, y, z = pool.allocate(1), pool.allocate(2), pool.allocate(3)
    pool.publish(x, b"h", 1, 0)
    pool.publish(y, b"h", 2, 0)  # a second block under the same hash
    pool.publish(y, b"other", 2, 0)  # already published: no-op
    assert list(pool.index[b"h"]) == [1, 2] and pool.cached_block(b"h") is x
    pool.free_reversed([x])
    pool.free_reversed([z])
    assert pool.snapshot()[1] == (3, 1)
    events.clear()
    assert pool.allocate(4) is z
    assert pool.allocate(4) is x  # cached: its hash is evicted on reuse
    assert events == [("alloc", 4, 3), ("evict", 1), ("alloc", 4, 1)]
    assert pool.cached_block(b"h") is y and x.block_hash is None
    pool.unpublish(y)
    assert pool.index == {} and pool.cached_block(b"h") is None
    with pytest.raises(IndexError):
        pool.allocate(4)


def test_pool_reset_and_double_free() -> None:
    pool = BlockPool(4, [])
    a, b = pool.allocate(1), pool.allocate(1)
    pool.publish(b, b"x", 1, 0)
    pool.publish(a, b"y", 1, 1)
    pool.free_reversed([a, b])
    assert not pool.in_use()
    assert pool.events is not None
    pool.events.clear()
    pool.reset()
    assert pool.events == [("unpublish", 1), ("unpublish", 2)] and pool.index == {}
    with pytest.raises(RuntimeError):
        pool.free_reversed([a])


def test_pool_ops_are_constant_time() -> None:
    """Touching a cached block in the middle of the queue and freeing it back do not scan the
    queue: the same number of operations takes about as long on a 100x larger pool."""

    def churn(num_blocks: int) -> float:
        pool = BlockPool(num_blocks)
        blocks = [pool.allocate(0) for _ in range(num_blocks - 1)]
        for i, block in enumerate(blocks):
            pool.publish(block, i.to_bytes(4, "little"), 0, i)
        pool.free_reversed(blocks)
        middle = blocks[len(blocks) // 2 : len(blocks) // 2 + 200]
        started = time.perf_counter()
        for _ in range(50):
            pool.touch(middle)
            pool.free_reversed(middle)
            pool.free_reversed([pool.allocate(1)])
        return time.perf_counter() - started

    small = min(churn(1_000) for _ in range(3))
    large = min(churn(100_000) for _ in range(3))
    assert large < 10 * small, (small, large)


def test_chained_hashes() -> None:
    cfg = EngineConfig(num_blocks=8, block_size=2)
    eng = Engine(cfg)
    eng.add_request(0, (1, 2, 3, 4, 5), 1)
    h0 = hash_block(SEED_HASH, [1, 2])
    h1 = hash_block(h0, [3, 4])
    req = eng.requests[0]
    assert eng.kv.block_hash(req, 1) == h1 and req.block_hashes == [h0, h1]
    assert hash_block(SEED_HASH, [3, 4]) != h1


def test_config_and_request_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(num_blocks=1, block_size=2)
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(num_blocks=4, block_size=2, policy="lazy")
    with pytest.raises(ValueError, match="vocab"):
        EngineConfig(num_blocks=4, block_size=2, vocab=0)
    eng = Engine(EngineConfig(num_blocks=4, block_size=2))
    eng.add_request(1, (1, 2), 4)  # 6 tokens, 3 blocks: fits exactly
    for args in [(1, (1,), 1), (2, (), 1), (3, (1,), 0), (4, (1, 2, 3), 4)]:
        with pytest.raises(ValueError):
            eng.add_request(*args)
    assert eng.events == [("arrive", 1, (1, 2), 4, 0)]


def test_reference_imports_nothing_of_kvspec() -> None:
    for path in REFERENCE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 1 or not (node.module or "").startswith("kvspec"), path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvspec") for a in node.names), path


def test_abort_and_reset_guards() -> None:
    eng = Engine(EngineConfig(num_blocks=8, block_size=2))
    eng.add_request(0, (1, 2, 3), 3)
    assert not eng.abort(5)
    eng.step()  # schedules step 0: blocks in use, a step in flight
    assert not eng.reset_prefix_cache()
    eng.run()
    assert not eng.abort(0)  # finished
    n = len(eng.events)
    assert eng.reset_prefix_cache()
    assert eng.events[n:] == [("reset",), ("unpublish", 1), ("unpublish", 2)]
    eng.add_request(1, (1, 2, 3), 1)
    assert eng.abort(1)  # waiting
    assert eng.events[-2:] == [("abort", 1), ("finish", 1, "abort")]


def test_record_false_and_stats() -> None:
    cfg = EngineConfig(num_blocks=64, block_size=4, token_budget=32)
    eng = Engine(cfg, record=False)
    for rid, prompt, max_tokens, _ in shared_prefix_workload(20, 2, 16, 3, 4, seed=1):
        eng.add_request(rid, prompt, max_tokens)
    eng.run()
    st = eng.stats
    assert eng.events == [] and eng.worker_log == []
    assert not eng.has_unfinished() and st["requests_finished"] == 20
    assert st["hit_tokens"] > 0 and st["blocks_allocated"] > 0
    assert all(r.status == "finished" and r.num_output == 4 for r in eng.requests.values())
    assert eng.snapshot()[0] == (0,) * 64 and len(eng.snapshot()[1]) == 63


# -- conformance to the spec -------------------------------------------------------------------


class Recorder(list[Event]):
    """An event list that, when a decision is appended, remembers the engine's pool snapshot
    (the state after the previous decision and its effects)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self.snapshots: list[Snapshot] = []

    def append(self, event: Event) -> None:
        if event[0] in DECISIONS:
            self.snapshots.append(self.engine.snapshot())
        super().append(event)


def recording_engine(cfg: EngineConfig, seed: int, fail_rate: float) -> tuple[Engine, Recorder]:
    eng = Engine(cfg, RandomChoices(seed, fail_rate))
    rec = Recorder(eng)
    eng.events = eng.pool.events = eng.scheduler.events = rec
    return eng, rec


def drive(eng: Engine, rng: random.Random, num_requests: int, max_steps: int = 4000) -> None:
    """A random workload: requests sharing prefixes over a tiny vocabulary arrive between steps,
    some are external, some are aborted, now and then the prefix cache is reset."""
    cfg = eng.config
    bsz = cfg.block_size
    prefixes = [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 3 * bsz))) for _ in range(3)]
    added = 0
    for _ in range(max_steps):
        if added < num_requests and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + tuple(rng.randrange(3) for _ in range(rng.randrange(3)))
            room = (cfg.num_blocks - 1) * bsz - len(prompt) - cfg.reach
            if room >= 1:
                eng.add_request(
                    added,
                    prompt,
                    rng.randint(1, min(6, room)),
                    rng.randrange(3),
                    external=rng.random() < 0.3,
                )
            added += 1
        if added and rng.random() < 0.05:
            eng.abort(rng.randrange(added))
        if rng.random() < 0.03:
            eng.reset_prefix_cache()
        if not eng.step() and added >= num_requests:
            return
    raise AssertionError(f"the engine did not finish in {max_steps} steps (livelock?)")


def lockstep_run(
    cfg: EngineConfig,
    seed: int,
    rng: random.Random,
    num_requests: int,
    seen: Counter[str] | None = None,
    compare: bool = True,
) -> tuple[Engine, Recorder, State]:
    """One random workload on the recording engine, replayed through the spec event by event
    (``replay``), the bookkeeping invariants checked at its end and, with ``compare``, the
    engine's final state compared with the spec's."""
    eng, rec = recording_engine(cfg, seed, fail_rate=0.3)
    drive(eng, rng, num_requests=num_requests)
    rec.snapshots.append(eng.snapshot())
    s = replay(cfg, rec, rec.snapshots, seen)
    for name in BOOKKEEPING:
        assert INVARIANTS[name](s) is None, (name, INVARIANTS[name](s))
    if compare:
        _compare_final_state(eng, s)
    return eng, rec, s


def replay(
    cfg: EngineConfig,
    events: list[Event],
    snapshots: list[Snapshot],
    seen: Counter[str] | None = None,
) -> State:
    """Feed the engine's decisions to the spec; check effects, and pool state if given
    ``snapshots`` (the engine's before each decision, then the final one). ``seen`` counts the
    async situations the run went through (``_async_situations``)."""
    spec_cfg = spec_config(cfg)
    s = initial_state(spec_cfg)
    starts = [i for i, e in enumerate(events) if e[0] in DECISIONS]
    assert not snapshots or len(snapshots) == len(starts) + 1  # before each, and at the end
    for n, i in enumerate(starts):
        decision = events[i]
        end = starts[n + 1] if n + 1 < len(starts) else len(events)
        emitted = events[i + 1 : end]
        context = f"decision #{n} {decision!r}; previous {events[max(0, i - 8) : i]!r}"
        before = _before(s, decision) if seen is not None else None
        try:
            effects = apply(s, decision)
        except Illegal as err:
            raise AssertionError(f"illegal {context}: {err}") from None
        assert [tuple(e) for e in effects] == emitted, context
        if seen is not None:
            seen.update(_async_situations(s, decision, before))
        after = snapshots[n + 1] if n + 1 < len(snapshots) else None
        if after is not None:
            spec_snapshot = (tuple(b.refcount for b in s.blocks), tuple(s.free))
            assert spec_snapshot == after, context
    return s


def _before(s: State, decision: Event) -> object:
    """What ``_async_situations`` needs of the state before the decision."""
    if decision[0] == "commit":
        statuses = {rid: s.requests[rid].status for rid, _ in decision[2]}
        return statuses, [set(st.live) for st in s.steps[1:]]
    if decision[0] == "schedule" and s.requests[decision[1]].status == "waiting":
        order = list(s.waiting)
        if s.config.preemption == "priority":
            order.sort(key=lambda r: (s.requests[r].priority, s.requests[r].arrival))
        ahead = order[: order.index(decision[1])]
        return any(not admissible(s, r) for r in ahead)
    return None


def _async_situations(s: State, decision: Event, before: object) -> list[str]:
    """Names of the async situations the decision went through: ``placeholder`` (a schedule
    past the known tokens), ``delivered`` (a preempted request's stale sample appended),
    ``stale-finish`` (a finish while a later step held the request), ``skipped`` (an
    admission while an earlier waiting request was held for its stale output)."""
    out = []
    if decision[0] == "schedule":
        step = s.building
        rid = decision[1]
        assert step is not None
        entry = step.entries.get(rid)
        if entry is not None and entry.end > len(s.requests[rid].tokens):
            out.append("placeholder")
        if before:
            out.append("skipped")
    elif decision[0] == "commit":
        statuses, lives = before
        out += ["delivered" for status in statuses.values() if status == "waiting"]
        for live, step in zip(lives, s.steps, strict=True):
            out += ["stale-finish" for rid in live - step.live]
    return out


BOOKKEEPING = [
    "RefcountIsOwnership",
    "FreeQueueExact",
    "HashIndexConsistent",
    "NullBlockPinned",
    "TableMatchesComputed",
    "StepsInOrder",
    "NoLeakAtQuiescence",
]


@pytest.mark.parametrize("discipline", ["vllm", "general"])
@pytest.mark.parametrize("policy", POLICIES)
def test_engine_conforms_to_spec(policy: str, discipline: str) -> None:
    runs = 0
    for depth in (1, 2, 3):
        for preemption in ("fcfs", "priority"):
            for seed in range(4):
                rng = random.Random(f"{policy}-{discipline}-{depth}-{preemption}-{seed}")
                cfg = EngineConfig(
                    num_blocks=rng.randint(5, 10),
                    block_size=rng.randint(1, 3),
                    depth=depth,
                    policy=policy,
                    discipline=discipline,
                    preemption=preemption,
                    token_budget=rng.randint(2, 10),
                    max_running=rng.randint(1, 4),
                    stop_token=rng.choice([None, 0]),
                    vocab=3,
                )
                _, rec, _ = lockstep_run(cfg, seed, rng, rng.randint(4, 12))
                runs += 1
    assert runs == 24


@pytest.mark.parametrize("sync_loads", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_engine_with_connector_loads_conforms_to_spec(policy: str, sync_loads: bool) -> None:
    """Loads of both kinds (``sync_loads``: the rest of the prompt computed in the load's step),
    with the loaded blocks registered at the load or when the request is next scheduled
    (``delay_load_registration``), replayed through the spec event by event."""
    loaded = 0
    for depth in (1, 2):
        for delay in (False, True):
            for seed in range(3):
                rng = random.Random(f"loads-{policy}-{sync_loads}-{depth}-{delay}-{seed}")
                cfg = EngineConfig(
                    num_blocks=rng.randint(6, 10),
                    block_size=rng.randint(1, 3),
                    depth=depth,
                    policy=policy,
                    preemption=rng.choice(["fcfs", "priority"]),
                    token_budget=rng.randint(4, 10),
                    max_running=rng.randint(1, 4),
                    stop_token=rng.choice([None, 0]),
                    vocab=3,
                    sync_loads=sync_loads,
                    delay_load_registration=delay,
                )
                _, rec, _ = lockstep_run(cfg, seed, rng, rng.randint(4, 12))
                kinds = [e for e in rec if e[0] == "schedule" and e[3]]
                loaded += sum(1 for e in kinds if bool(e[2]) == sync_loads)
    assert loaded >= 6, loaded  # the runs did load, of the kind asked for


def async_run(
    policy: str,
    discipline: str,
    stale_output: str,
    depth: int,
    preemption: str,
    seed: int,
    seen: Counter[str],
) -> None:
    """One random async workload on the engine, replayed through the spec event by event, with
    the bookkeeping invariants and the final state compared."""
    rng = random.Random(f"async-{policy}-{discipline}-{stale_output}-{depth}-{preemption}-{seed}")
    cfg = EngineConfig(
        num_blocks=rng.randint(5, 10),
        block_size=rng.randint(1, 3),
        depth=depth,
        policy=policy,
        discipline=discipline,
        preemption=preemption,
        token_budget=rng.randint(2, 10),
        max_running=rng.randint(1, 4),
        stop_token=rng.choice([None, 0]),
        vocab=3,
        async_scheduling=True,
        stale_output=stale_output,
    )
    lockstep_run(cfg, seed, rng, rng.randint(4, 12), seen)
    seen["runs"] += 1


@pytest.mark.parametrize("discipline", ["vllm", "general"])
@pytest.mark.parametrize("policy", POLICIES)
def test_async_engine_conforms_to_spec(policy: str, discipline: str) -> None:
    """Async scheduling, both stale-output modes, depths 2 and 3, both preemption modes: every
    decision legal, every effect and pool snapshot the spec's, and the runs really went through
    the async situations (decodes on placeholders, finishes while a later step held the
    request, and in deliver mode stale samples appended and held requests skipped)."""
    for stale_output in STALE_OUTPUTS:
        seen: Counter[str] = Counter()
        for depth, preemption, seed in itertools.product((2, 3), ("fcfs", "priority"), range(6)):
            async_run(policy, discipline, stale_output, depth, preemption, seed, seen)
        assert seen["runs"] == 24
        assert seen["placeholder"] > 0 and seen["stale-finish"] > 0, seen
        if stale_output == "deliver":
            assert seen["delivered"] > 0 and seen["skipped"] > 0, seen
        else:
            assert seen["delivered"] == 0, seen


def _uncapped_registration(self: Policy, req: Request, end: int) -> int:
    return end // self.block_size


def _never_held(original):  # type: ignore[no-untyped-def]
    def preempt(self: Scheduler, req: Request) -> None:
        original(self, req)
        self.held.discard(req.rid)

    return preempt


def _stale_always_dropped(original):  # type: ignore[no-untyped-def]
    def leave(self: Scheduler, req: Request, keep_stale: bool = False) -> None:
        original(self, req, False)

    return leave


PLANTED = {
    # name: (class, attribute, replacement from the original, policies, what catches it)
    "registration not capped at known tokens": (
        Policy,
        "known_upto",
        lambda original: _uncapped_registration,
        ("eager-unsafe", "hide-uncommitted"),
        (RuntimeError, "its tokens are not all known"),  # the KV cache manager's guard
    ),
    "no post-output registration": (
        TraitPolicy,
        "on_output",
        lambda original: lambda self, req, entry, rejected=0: None,
        ("eager-rollback-fifo", "hide-uncommitted"),
        (AssertionError, "('commit'"),  # the spec computes publications the engine lacks
    ),
    "deliver-mode admission not blocked": (
        Scheduler,
        "preempt",
        _never_held,
        ("deferred",),
        (AssertionError, "stale output of a step in flight is still to be delivered"),
    ),
    "stale output dropped in deliver mode": (
        Scheduler,
        "leave",
        _stale_always_dropped,
        ("deferred",),
        (AssertionError, "expected"),  # the spec expects the stale sample at commit
    ),
    "a finished request stays live in later steps": (
        Scheduler,
        "_leave_later_steps",
        lambda original: lambda self, req: None,
        ("deferred",),
        (KeyError, ""),  # the engine's own queues: the finished request is sampled again
    ),
    "no decode on placeholders": (
        Scheduler,
        "schedulable_end",
        lambda original: lambda self, req: len(req.tokens),
        ("deferred",),
        (AssertionError, "Counter("),  # legal (synchronous), caught by the coverage check
    ),
}


@pytest.mark.parametrize("name", PLANTED)
def test_planted_async_bugs_are_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bug planted in the reference's async mode makes the async conformance check fail:
    a decision the spec refuses, an effect it does not compute, an engine guard, or (an engine
    that never schedules on placeholders is legal, just not async) the coverage assertion."""
    cls, attribute, replacement, policies, (kind, fragment) = PLANTED[name]
    monkeypatch.setattr(cls, attribute, replacement(getattr(cls, attribute)))
    with pytest.raises(kind, match=re.escape(fragment) if fragment else None):
        for policy, discipline in itertools.product(policies, ("vllm", "general")):
            for stale_output in STALE_OUTPUTS:
                seen: Counter[str] = Counter()
                for depth, preemption, seed in itertools.product(
                    (2, 3), ("fcfs", "priority"), range(6)
                ):
                    async_run(policy, discipline, stale_output, depth, preemption, seed, seen)
                assert seen["placeholder"] > 0 and seen["stale-finish"] > 0, seen
                if stale_output == "deliver":
                    assert seen["delivered"] > 0 and seen["skipped"] > 0, seen


def _compare_final_state(eng: Engine, s: State) -> None:
    for rid, req in eng.requests.items():
        sr = s.requests[rid]
        assert (sr.status, sr.tokens, sr.computed, sr.cached) == (
            req.status,
            req.tokens,
            req.computed,
            req.cached,
        )
        assert sr.table == [b.block_id for b in req.table]
    # The hash index: the same blocks, in the same order, under each chained prefix.
    bsz = eng.config.block_size
    for key, blocks in s.index.items():
        h = SEED_HASH
        for i in range(len(key) // bsz):
            h = hash_block(h, list(key[i * bsz : (i + 1) * bsz]))
        assert list(eng.pool.index[h]) == blocks
    assert len(eng.pool.index) == len(s.index)


def test_default_choices_make_progress() -> None:
    for discipline, depth, preemption in itertools.product(
        ("vllm", "general"), (1, 2), ("fcfs", "priority")
    ):
        cfg = EngineConfig(
            num_blocks=12,
            block_size=4,
            depth=depth,
            discipline=discipline,
            preemption=preemption,
            token_budget=16,
        )
        eng = Engine(cfg, DefaultChoices())
        for rid, prompt, max_tokens, prio in shared_prefix_workload(30, 3, 12, 6, 5, seed=3):
            eng.add_request(rid, prompt, max_tokens, prio, external=rid % 3 == 0)
        eng.run(max_steps=20_000)
        assert not eng.has_unfinished(), (discipline, depth, preemption)
        replay(cfg, eng.events, [])


def test_worker_log_records_writes_and_reads() -> None:
    cfg = EngineConfig(num_blocks=8, block_size=2, token_budget=4)
    eng = Engine(cfg)
    eng.add_request(0, (5, 6, 7), 2)
    eng.run()
    log = eng.worker_log
    assert [x.step for x in log] == [0, 1]
    first = log[0]
    assert [(w.block, w.lo, w.hi) for w in first.writes(2)] == [(1, 0, 2), (2, 2, 3)]
    second = log[1]  # decode token 3 into block 2, reading blocks 1 and 2
    assert [(w.block, w.lo, w.hi) for w in second.writes(2)] == [(2, 3, 4)]
    assert [(r.block, r.lo, r.hi) for r in second.reads(2)] == [(1, 0, 2), (2, 2, 4)]
    assert second.entries[0].blocks == (1, 2) and second.failed == ()


@pytest.mark.parametrize("policy", POLICIES)
def test_engine_loading_the_last_block_conforms_to_spec(policy: str) -> None:
    """``load_last_block``: an external request whose store holds every block of its prompt
    loads them all asynchronously and recomputes its last token over the loaded block (vLLM's
    whole-prompt load), replayed through the spec event by event; such loads happen."""
    whole = 0
    for depth in (1, 2):
        for delay in (False, True):
            for seed in range(3):
                rng = random.Random(f"last-block-{policy}-{depth}-{delay}-{seed}")
                cfg = EngineConfig(
                    num_blocks=rng.randint(6, 10),
                    block_size=rng.randint(2, 3),
                    depth=depth,
                    policy=policy,
                    preemption=rng.choice(["fcfs", "priority"]),
                    token_budget=rng.randint(4, 10),
                    max_running=rng.randint(1, 4),
                    stop_token=rng.choice([None, 0]),
                    vocab=3,
                    load_last_block=True,
                    delay_load_registration=delay,
                )
                _, rec, _ = lockstep_run(cfg, seed, rng, rng.randint(4, 12))
                whole += _whole_loads(list(rec), cfg.block_size)
    assert whole >= 4, whole


def _whole_loads(events: list[Event], bsz: int) -> int:
    """Asynchronous loads that end at their request's last known token."""
    tokens: dict[object, int] = {}
    count = 0
    for i, event in enumerate(events):
        if event[0] == "arrive":
            tokens[event[1]] = len(event[2])  # type: ignore[arg-type]
        elif event[0] == "commit":
            for rid, _ in event[2]:  # type: ignore[union-attr]
                tokens[rid] += 1
        elif event[0] == "schedule" and event[3] and not event[2]:
            hit = next(e for e in events[i + 1 :] if e[0] == "hit")
            count += (len(hit[2]) + event[3]) * bsz == tokens[event[1]]  # type: ignore[operator]
    return count
