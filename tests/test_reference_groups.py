"""Several KV-cache groups in the reference engine (issue #36, docs/hybrid.md): one group is
today's engine exactly; the coordinator's hit is the largest length every group accepts; the
hand-made scenarios of full + state and full + window groups emit the events docs/hybrid.md
fixes; safe policies hold under ``kvspec fuzz --groups``; and a planted bug per new invariant is
caught and named by it within 30 s.

Until the spec models groups (h-groups' branch), the engine is judged by its own fake device
memory (``reference.memory``) and the per-admission hit check of ``conformance.fuzz_groups``;
the lockstep test joins here once the spec's groups are merged.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from kvspec.conformance.fuzz_groups import parse_groups, run_groups_cell
from kvspec.reference import Engine, EngineConfig, GroupSpec, RandomChoices
from kvspec.reference import scheduler as reference_scheduler
from kvspec.reference.block_pool import BlockPool
from kvspec.reference.groups import GroupedKV
from kvspec.reference.hashing import pack_tokens
from kvspec.reference.request import Request

# -- one group is today's engine ------------------------------------------------------------


def _workload_run(config: EngineConfig, seed: int) -> tuple[list[tuple[object, ...]], object]:
    engine = Engine(config, RandomChoices(seed))
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(3) for _ in range(8)) for _ in range(2)]
    for rid in range(8):
        prompt = rng.choice(prefixes) + tuple(rng.randrange(3) for _ in range(rng.randint(1, 5)))
        engine.add_request(rid, prompt, rng.randint(1, 6), rng.randrange(3))
        engine.run(rng.randint(0, 3))
        if rng.random() < 0.2:
            engine.abort(rng.randrange(rid + 1))
    engine.run()
    return engine.events, engine.snapshot()


@pytest.mark.parametrize("discipline", ["vllm", "general"])
@pytest.mark.parametrize("policy", ["eager-unsafe", "deferred", "hide-uncommitted"])
def test_one_group_is_todays_engine(policy: str, discipline: str) -> None:
    """``groups=(full,)`` and ``groups=(window W,)`` at the hash block size run exactly as the
    engine without groups and with ``sliding_window=W``: same events, same pool. (Planted:
    routing a one-group config to the coordinator adds the group field to every event.)"""
    for seed in range(4):
        base = dict(
            num_blocks=18, block_size=2, depth=1 + seed % 2, policy=policy, discipline=discipline
        )
        today = _workload_run(EngineConfig(**base), seed)  # type: ignore[arg-type]
        one = _workload_run(EngineConfig(**base, groups=(GroupSpec("full", 2),)), seed)  # type: ignore[arg-type]
        assert one == today
        window = _workload_run(EngineConfig(**base, sliding_window=5), seed)  # type: ignore[arg-type]
        one_window = _workload_run(
            EngineConfig(**base, groups=(GroupSpec("window", 2, 5),)),  # type: ignore[arg-type]
            seed,
        )
        assert one_window == window


def test_group_config_is_checked() -> None:
    """Bad groups are refused by name when the config is made."""
    cases = [
        (dict(groups=(GroupSpec("cross", 2),)), "kind"),
        (dict(groups=(GroupSpec("chunked", 2),)), "chunk is a multiple of its block"),
        (dict(groups=(GroupSpec("chunked", 2, chunk=3),)), "chunk is a multiple of its block"),
        (dict(groups=(GroupSpec("full", 2, chunk=4),)), "only a chunked group has a chunk"),
        (dict(groups=(GroupSpec("full", 3),)), "multiple"),
        (dict(groups=(GroupSpec("window", 2),)), "window"),
        (dict(groups=(GroupSpec("state", 2, 4),)), "only a window group"),
        (dict(groups=(GroupSpec("full", 2),), sliding_window=4), "exclusive"),
        (dict(groups=(GroupSpec("full", 2), GroupSpec("state", 2)), spec_tokens=1), "speculative"),
    ]
    for extra, words in cases:
        with pytest.raises(ValueError, match=words):
            EngineConfig(num_blocks=8, block_size=2, **extra)  # type: ignore[arg-type]


def test_group_spec_is_the_spec_group() -> None:
    """The engine's ``GroupSpec`` and kinds are the spec's ``Group`` and ``GROUP_KINDS`` field
    for field (the engine imports no spec)."""
    from kvspec.reference import GROUP_KINDS
    from kvspec.reference.config import STATE_REGISTRATIONS
    from kvspec.spec import state

    assert GroupSpec._fields == state.Group._fields
    assert GroupSpec("window", 4, 8) == tuple(state.Group("window", 4, 8))
    assert GroupSpec("state", 4, None, "when-known") == tuple(
        state.Group("state", 4, None, "when-known")
    )
    # every kind the spec has
    assert GROUP_KINDS == state.GROUP_KINDS
    assert STATE_REGISTRATIONS == state.STATE_REGISTRATIONS


# -- the hit across groups ------------------------------------------------------------------


def _accepted(groups: tuple[GroupSpec, ...], cached: set[tuple[int, int]], length: int) -> bool:
    """Each group's own rule, restated: does every group serve a hit of ``length`` tokens?"""
    for g, spec in enumerate(groups):
        blocks = length // spec.block_size
        if spec.kind == "full":
            need = range(blocks)
        elif spec.kind == "window":
            assert spec.window is not None
            need = range(max(0, length - spec.window + 1) // spec.block_size, blocks)
        else:
            need = range(blocks - 1, blocks) if length else range(0)
        if any((g, slot) not in cached for slot in need):
            return False
    return True


GROUP_SETS = [
    (GroupSpec("full", 2), GroupSpec("state", 4)),
    (GroupSpec("state", 2), GroupSpec("full", 2)),
    (GroupSpec("window", 2, 3), GroupSpec("full", 4), GroupSpec("state", 2)),
    (GroupSpec("state", 4), GroupSpec("window", 2, 5)),
]


@pytest.mark.parametrize("groups", GROUP_SETS, ids=lambda gs: ",".join(g.kind for g in gs))
def test_hit_is_the_largest_length_every_group_accepts(groups: tuple[GroupSpec, ...]) -> None:
    """vLLM's iteration (each group shortens the candidate until none does) finds the spec's
    maximum, on random published indexes. (Planted: one pass over the groups, no restart,
    fails with a state group before the full one.)"""
    rng = random.Random(36)
    h = 2
    align = math.lcm(*(g.block_size for g in groups))
    for _ in range(300):
        pool = BlockPool(64)
        kv = GroupedKV(pool, h, groups, align)
        tokens = tuple(rng.randrange(2) for _ in range(rng.randint(1, 24)))
        req = Request(0, tokens, pack_tokens(tokens), 1, 0, 0, False)
        if len(tokens) >= h:
            kv.block_hash(req, len(tokens) // h - 1)
        cached: set[tuple[int, int]] = set()
        free_ids = iter(range(1, 64))
        for g, spec in enumerate(groups):
            for slot in range(len(tokens) // spec.block_size):
                if rng.random() < 0.7:
                    block = pool.blocks[next(free_ids)]
                    pool.publish(block, kv._key(req.block_hashes, g, slot), 9, slot, g)
                    cached.add((g, slot))
        hits = kv.lookup(req)
        cap = (len(tokens) - 1) // align * align
        best = max(n for n in range(0, cap + 1, align) if _accepted(groups, cached, n))
        assert hits.length == best
        for g, spec in enumerate(groups):
            assert len(hits.groups[g]) == best // spec.block_size


# -- hand-made scenarios --------------------------------------------------------------------


def _engine(groups: tuple[GroupSpec, ...], h: int, budget: int, **extra: object) -> Engine:
    config = EngineConfig(
        num_blocks=40,
        block_size=h,
        token_budget=budget,
        groups=groups,
        **extra,  # type: ignore[arg-type]
    )
    return Engine(config)


def test_a_state_is_kept_only_where_a_step_ended() -> None:
    """full@2 + state@4, deferred: a 9-token prompt with a budget of 4 is computed in chunks
    ending at 4 and 8 (the state boundaries), so states are registered at 4 and 8 (group 1's
    slots 0 and 1), and a request sharing 8 tokens hits all 8: four full blocks and the state
    at 8, nulls before it, one ``hit`` per group."""
    engine = _engine((GroupSpec("full", 2), GroupSpec("state", 4)), 2, 4)
    prompt = (1, 2, 3, 4, 5, 6, 7, 0, 1)
    engine.add_request(0, prompt, 1)
    engine.run()
    states = [e for e in engine.events if e[0] == "publish" and len(e) == 5 and e[4] == 1]
    assert [e[2] for e in states] == [0, 1]
    engine.add_request(1, prompt[:8] + (3, 3), 1)
    engine.run()
    hits = [(e[2], e[3] if len(e) > 3 else 0) for e in engine.events if e[:2] == ("hit", 1)]
    assert [(len(b), g) for b, g in hits] == [(4, 0), (2, 1)]  # type: ignore[arg-type]
    assert hits[1][0] == (0, states[1][3])
    assert engine.bad_reads == []


def test_a_state_group_shortens_the_hit() -> None:
    """full@4 + state@4: a 13-token prompt computed in one chunk cut at 12 keeps a state at 12
    only; a request sharing its first 8 tokens finds both full blocks but no state at 8 or 4,
    so its hit is empty: shortened by the state group (counted by the coordinator)."""
    engine = _engine((GroupSpec("full", 4), GroupSpec("state", 4)), 4, 16)
    prompt = tuple(range(13))
    engine.add_request(0, prompt, 1)
    engine.run()
    schedules = [e[2] for e in engine.events if e[0] == "schedule" and e[1] == 0]
    assert schedules[0] == 12  # clipped to the last state boundary before the last token
    engine.add_request(1, prompt[:8] + (0, 0, 0), 1)
    engine.run()
    assert [e[2] for e in engine.events if e[0] == "hit" and e[1] == 1] == [(), ()]
    assert isinstance(engine.kv, GroupedKV) and engine.kv.n_shortened == 1


def test_window_and_state_groups_free_what_no_step_reads() -> None:
    """full@2 + window 3@2 + state@2, one step at a time: while a 14-token prompt is computed
    2 tokens a step, the window and state groups null and free their leading blocks, the full
    group keeps all; the frees come first among a schedule's effects, group order."""
    engine = _engine((GroupSpec("full", 2), GroupSpec("window", 2, 3), GroupSpec("state", 2)), 2, 2)
    engine.add_request(0, tuple(range(14)), 1)
    for _ in range(10):
        engine.step()
    req = engine.requests[0]
    full, window, state = req.tables
    assert all(b.block_id for b in full)
    assert window[0].block_id == 0 and window[-1].block_id != 0
    assert state[0].block_id == 0 and state[-1].block_id != 0
    after_schedule = False
    for event in engine.events:
        if event[0] == "schedule":
            after_schedule = True
        elif event[0] == "alloc":
            after_schedule = False
        elif event[0] == "free":
            assert after_schedule  # no free after an alloc of the same schedule
    assert engine.bad_reads == []


# -- kvspec fuzz --groups: safe cells hold, planted bugs are named ---------------------------


def test_groups_syntax() -> None:
    assert parse_groups("full,window:8,state") == (
        ("full", None, None),
        ("window", None, 8),
        ("state", None, None),
    )
    assert parse_groups("full@2,state@4") == (("full", 2, None), ("state", 4, None))
    assert parse_groups("state") == (("state", None, None),)
    assert parse_groups("full,state:when-known@4") == (
        ("full", None, None),
        ("state", 4, "when-known"),
    )
    bad_ones = ("full,", "attn", "window", "full:3", "state@x", "full@0", "full", "window:4")
    for bad in (*bad_ones, "state:later", "full:when-known", "window:when-known"):
        with pytest.raises(ValueError):
            parse_groups(bad)
    assert parse_groups("full,chunked:8") == (("full", None, None), ("chunked", None, 8))
    assert parse_groups("chunked:6@2") == (("chunked", 2, 6),)
    for bad, says in (
        ("full,chunked", "names its chunk"),
        ("full,chunked:3@2", "not a multiple of its block size"),
        ("full@2,chunked:5", "not a multiple of its block size"),
        ("full,chunked:x", "chunk must be an int"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_groups(bad)
    assert parse_groups("full,slot@2") == (("full", None, None), ("slot", 2, None))
    for bad, says in (("slot,full", "never group 0"), ("full,slot:3", "takes no :VALUE")):
        with pytest.raises(ValueError, match=says):
            parse_groups(bad)


@pytest.mark.parametrize(
    "policy,discipline,preemption,groups",
    [
        ("deferred", "vllm", "priority", "full,window:4,state"),
        ("hide-uncommitted", "general", "fcfs", "full@2,window:3@2,state@4"),
        ("eager-rollback-fifo", "vllm", "fcfs", "full,state"),
        ("deferred", "vllm", "fcfs", "full,state:when-known"),
        ("hide-uncommitted", "general", "priority", "full@2,window:3@2,state:when-known@4"),
    ],
)
def test_safe_cells_hold_with_groups(
    policy: str, discipline: str, preemption: str, groups: str
) -> None:
    """Bounded (100 runs of seed 0, judged by the spec in lockstep): nothing found, and the
    hybrid paths reached."""
    result = run_groups_cell(
        parse_groups(groups), policy, discipline, preemption, seconds=60, max_runs=100
    )
    assert result.finding is None, result.finding
    assert result.runs == 100
    cov = result.coverage
    assert cov.state_hits > 0 and cov.hits_shortened > 0
    if "window" in groups:
        assert cov.window_nulled_shared > 0


@pytest.mark.parametrize(
    "policy,discipline,preemption,groups",
    [
        ("deferred", "vllm", "priority", "full,chunked:4"),
        ("hide-uncommitted", "general", "fcfs", "window:3,chunked:6,state"),
        ("eager-rollback-fifo", "vllm", "fcfs", "full@2,chunked:4@2"),
    ],
)
def test_safe_cells_hold_with_a_chunked_group(
    policy: str, discipline: str, preemption: str, groups: str
) -> None:
    """``--groups`` with chunked local attention, bounded as above: nothing found; hits were
    shortened by a group and chunk blocks nulled while the request shared others."""
    result = run_groups_cell(
        parse_groups(groups), policy, discipline, preemption, seconds=60, max_runs=100
    )
    assert result.finding is None, result.finding
    assert result.runs == 100
    cov = result.coverage
    assert cov.hits_shortened > 0 and cov.window_nulled_shared > 0, cov.groups_line()


def _plant_chunk_hit_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator accepts any length for a chunked group, its hit all null blocks: the
    chunk of the hit's next token is not served."""
    accepts, hit_blocks = GroupedKV._accepts, GroupedKV._hit_blocks

    def _accepts(self: GroupedKV, hashes: list[bytes], g: int, length: int) -> int:
        return length if self.groups[g].kind == "chunked" else accepts(self, hashes, g, length)

    def _hit_blocks(self: GroupedKV, hashes: list[bytes], g: int, length: int) -> list[object]:
        if self.groups[g].kind == "chunked":
            return [self.pool.blocks[0]] * (length // self.groups[g].block_size)
        return hit_blocks(self, hashes, g, length)  # type: ignore[return-value]

    monkeypatch.setattr(GroupedKV, "_accepts", _accepts)
    monkeypatch.setattr(GroupedKV, "_hit_blocks", _hit_blocks)


def _plant_ignore_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator ignores the state group: it accepts any length, with no state block."""
    accepts, hit_blocks = GroupedKV._accepts, GroupedKV._hit_blocks

    def _accepts(self: GroupedKV, hashes: list[bytes], g: int, length: int) -> int:
        return length if self.groups[g].kind == "state" else accepts(self, hashes, g, length)

    def _hit_blocks(self: GroupedKV, hashes: list[bytes], g: int, length: int) -> list[object]:
        if self.groups[g].kind == "state":
            return [self.pool.blocks[0]] * (length // self.groups[g].block_size)
        return hit_blocks(self, hashes, g, length)  # type: ignore[return-value]

    monkeypatch.setattr(GroupedKV, "_accepts", _accepts)
    monkeypatch.setattr(GroupedKV, "_hit_blocks", _hit_blocks)


def _plant_state_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step registers the state slot it ends in whatever position in the slot it ends at."""
    pending = GroupedKV.group_pending

    def planted(self: GroupedKV, req: Request, end: int, limit: int) -> list[tuple[int, int]]:
        out = pending(self, req, end, limit)
        for g, spec in enumerate(self.groups):
            slot = -(-end // spec.block_size) - 1  # (registered under its boundary's key)
            if (
                spec.kind == "state"
                and end % spec.block_size
                and (slot + 1) * spec.block_size <= limit
            ):
                out.append((g, slot))
        return out

    monkeypatch.setattr(GroupedKV, "group_pending", planted)


def _plant_window_ignores_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window is measured from the computed tokens, not from what no step in flight reads."""
    monkeypatch.setattr(reference_scheduler.Scheduler, "processed", lambda self, req: req.computed)


def _plant_state_not_carried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that ends in the state slot its request's previous step ended in gets a fresh
    block for it (vLLM's align mode allocates one per step), but the state is not carried over:
    the step starts from a block nothing wrote."""
    grow = GroupedKV.grow

    def planted(self: GroupedKV, req: Request, end: int) -> None:
        tables = self.tables(req)
        for g, spec in enumerate(self.groups):
            slot = -(-end // spec.block_size) - 1
            table = tables[g]
            if spec.kind == "state" and 0 <= slot < len(table) and table[slot].block_id:
                if table[slot].block_hash is None:  # (a registered state stays)
                    self.pool.free_batch([table[slot]])
                    table[slot] = self.pool.allocate(req.rid, g)
        grow(self, req, end)

    monkeypatch.setattr(GroupedKV, "grow", planted)


def _plant_chunks_unaligned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler does not split prefill chunks at state boundaries (vLLM's
    ``_mamba_block_aligned_split`` left out): under ``when-known`` a slot a chunk left inside its
    block is registered at its boundary by a later schedule, holding the state of another."""
    monkeypatch.setattr(
        reference_scheduler.Scheduler, "clip", lambda self, req, start, num_tokens: num_tokens
    )


PLANTS = [
    ("HitServedByEveryGroup", _plant_ignore_state, "deferred", "vllm", "fcfs", "full,state"),
    (
        "HitServedByEveryGroup",
        _plant_chunk_hit_unchecked,
        "deferred",
        "vllm",
        "fcfs",
        "full,chunked:4",
    ),
    ("StateAtItsBoundary", _plant_state_anywhere, "deferred", "vllm", "fcfs", "full,state"),
    (
        "StateAtItsBoundary",
        _plant_chunks_unaligned,
        "deferred",
        "vllm",
        "fcfs",
        "full,state:when-known",
    ),
    (
        "NoReadOfRecycled",
        _plant_window_ignores_flight,
        "eager-rollback-fifo",  # (a deferred registration of a nulled block is an engine error)
        "vllm",
        "fcfs",
        "full,window:3",
    ),
    (
        "NoUnwrittenStateRead",
        _plant_state_not_carried,
        "deferred",
        "vllm",
        "fcfs",
        "full,state",
    ),
]


@pytest.mark.parametrize(
    "name,plant,policy,discipline,preemption,groups",
    PLANTS,
    ids=[f"{p[0]}-{p[1].__name__}" for p in PLANTS],  # type: ignore[attr-defined]
)
def test_planted_bug_is_named_by_its_invariant(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    plant: object,
    policy: str,
    discipline: str,
    preemption: str,
    groups: str,
) -> None:
    """Each planted bug is caught by ``kvspec fuzz --groups`` (seed 0, derandomized) and named
    by its invariant, within 30 s; the same cell without the plant holds over those runs."""
    plant(monkeypatch)  # type: ignore[operator]
    result = run_groups_cell(
        parse_groups(groups), policy, discipline, preemption, seconds=30, max_runs=2000
    )
    assert result.finding is not None, "the planted bug was not caught"
    assert result.finding.invariant == name, result.finding
    assert result.finding.seconds < 30
    monkeypatch.undo()
    clean = run_groups_cell(
        parse_groups(groups), policy, discipline, preemption, max_runs=result.runs
    )
    assert clean.finding is None, clean.finding


def test_the_seed_question_for_a_state_group() -> None:
    """eager-unsafe, vllm/priority, full + window + state: a state registered when its step
    was scheduled, whose writer was then preempted out of that step, stays registered for a
    state it will never hold: found by the spec in lockstep within the 30 s budget and named
    StateAtItsBoundary. (Same-step hits of such a state wait a step, as vLLM's.)"""
    result = run_groups_cell(  # seed 3: run 106 (seed 0's first is run 777 since 6476775)
        parse_groups("full,window:4,state"), "eager-unsafe", "vllm", "priority", seconds=30, seed=3
    )
    assert result.finding is not None
    assert result.finding.invariant == "StateAtItsBoundary", result.finding
    assert "preempt" in result.finding.detail


def test_fuzz_groups_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvspec fuzz --groups``: bad syntax or a flag it does not combine with is exit 2 with
    one line naming ``--groups``; a safe cell holds (exit 0) and prints the groups' coverage
    line; the seed's cell is a finding (exit 1) named by its invariant."""
    from kvspec.cli import main

    for argv in (
        ["--groups", "full,mamba"],
        ["--groups", "window"],
        ["--groups", "full"],
        ["--groups", "full,state", "--loads"],
        ["--groups", "full,state", "--sliding-window", "4"],
    ):
        assert main(["fuzz", "--policy", "deferred", "--seconds", "1", *argv]) == 2
        err = capsys.readouterr().err
        assert "--groups" in err and len(err.strip().splitlines()) == 1
    base = ["fuzz", "--groups", "full,window:4,state", "--seconds", "2"]
    assert main([*base, "--policy", "deferred"]) == 0
    out = capsys.readouterr().out
    assert "no counterexample" in out and "state blocks hit" in out
    seed = ["fuzz", "--groups", "full,window:4,state", "--seconds", "30", "--preemption"]
    seed += ["priority", "--seed", "3"]  # run 106 (seed 0's first is run 777 since 6476775)
    assert main([*seed, "--policy", "eager-unsafe"]) == 1
    assert "StateAtItsBoundary" in capsys.readouterr().out


# -- lockstep with the spec -----------------------------------------------------------------

LOCKSTEP_GROUPS = [
    (GroupSpec("full", 2), GroupSpec("state", 2)),
    (GroupSpec("full", 2), GroupSpec("state", 4)),
    (GroupSpec("full", 2), GroupSpec("window", 2, 3)),
    (GroupSpec("window", 2, 5), GroupSpec("full", 4), GroupSpec("state", 4)),
    (GroupSpec("full", 2), GroupSpec("state", 2, None, "when-known")),  # vLLM's align timing
    (GroupSpec("full", 2), GroupSpec("state", 4, None, "when-known")),
]


def _replay_groups(cfg: EngineConfig, events: list[tuple[object, ...]], snapshots: list) -> object:  # type: ignore[type-arg]
    """Feed the engine's decisions to the spec with the same groups; each decision's effects
    must be the engine's, and the pool (refcounts, free queue) the engine's after it."""
    from test_reference import DECISIONS, spec_config

    from kvspec.spec import Illegal, apply, initial_state

    spec_cfg = spec_config(cfg)
    s = initial_state(spec_cfg)
    starts = [i for i, e in enumerate(events) if e[0] in DECISIONS]
    for n, i in enumerate(starts):
        decision = events[i]
        end = starts[n + 1] if n + 1 < len(starts) else len(events)
        context = f"decision #{n} {decision!r}; previous {events[max(0, i - 8) : i]!r}"
        try:
            effects = apply(s, decision)
        except Illegal as err:
            raise AssertionError(f"illegal {context}: {err}") from None
        assert [tuple(e) for e in effects] == events[i + 1 : end], context
        after = snapshots[n + 1] if n + 1 < len(snapshots) else None
        if after is not None:
            assert (tuple(b.refcount for b in s.blocks), tuple(s.free)) == after, context
    return s


def _lockstep(
    rng: random.Random,
    n: int,
    groups: tuple[GroupSpec, ...],
    policy: str,
    discipline: str | None,
    depth: int,
    asynchronous: bool,
) -> Any:
    """One lockstep run of the reference engine with ``groups`` (the rest of its configuration
    drawn from ``rng``; ``discipline`` too where None): its events replayed by the spec decision
    by decision (``_replay_groups``), and every invariant held at the end under the safe
    policies. The recorded events."""
    from test_reference import drive, recording_engine

    from kvspec.spec import INVARIANTS

    cfg = EngineConfig(
        num_blocks=rng.randint(30, 45),
        block_size=2,
        depth=depth,
        policy=policy,
        discipline=discipline or rng.choice(["vllm", "general"]),
        preemption=rng.choice(["fcfs", "priority"]),
        token_budget=rng.randint(2, 10),
        max_running=rng.randint(1, 4),
        stop_token=0,
        vocab=3,
        async_scheduling=asynchronous,
        stale_output="deliver" if depth > 1 and rng.random() < 0.5 else "drop",
        groups=groups,
    )
    eng, rec = recording_engine(cfg, n, fail_rate=0.0)
    drive(eng, rng, num_requests=rng.randint(4, 10))
    rec.snapshots.append(eng.snapshot())
    s = _replay_groups(cfg, list(rec), rec.snapshots)
    if policy in ("deferred", "hide-uncommitted"):
        broken = [name for name, inv in INVARIANTS.items() if inv(s) is not None]  # type: ignore[operator]
        assert not broken, (cfg, broken)
    return rec


@pytest.mark.parametrize("discipline", ["vllm", "general"])
@pytest.mark.parametrize(
    "policy", ["deferred", "hide-uncommitted", "eager-rollback-fifo", "eager-unsafe"]
)
def test_the_reference_engine_with_groups_conforms(policy: str, discipline: str) -> None:
    """Lockstep: with several groups the reference engine emits the spec's effects decision by
    decision, its pool is the spec's after each, and the spec's invariants hold at the end
    under the safe policies; state hits, hits with nulls and skipped frees happen."""
    from collections import Counter

    seen: Counter[str] = Counter()
    for n, groups in enumerate(LOCKSTEP_GROUPS):
        for depth, asynchronous in ((1, False), (2, False), (2, True), (3, True)):
            rng = random.Random(f"groups-{policy}-{discipline}-{n}-{depth}-{asynchronous}")
            rec = _lockstep(rng, n, groups, policy, discipline, depth, asynchronous)
            kinds = [g.kind for g in groups]
            for e in rec:
                if e[0] == "hit" and len(e) > 3 and kinds[e[3]] == "state" and any(e[2]):  # type: ignore[index]
                    seen["state hits"] += 1
                if e[0] == "hit" and 0 in e[2]:  # type: ignore[operator]
                    seen["null hits"] += 1
    assert seen["state hits"] > 3 and seen["null hits"] > 3, seen


CHUNKED_GROUPS = [
    (GroupSpec("chunked", 2, chunk=4),),
    (GroupSpec("chunked", 2, chunk=2),),
    (GroupSpec("full", 2), GroupSpec("chunked", 2, chunk=4)),
    (GroupSpec("window", 2, 3), GroupSpec("chunked", 2, chunk=6), GroupSpec("state", 2)),
]


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted", "eager-unsafe"])
def test_the_reference_engine_with_a_chunked_group_conforms(policy: str) -> None:
    """Lockstep with chunked local attention (h-chunked): alone and beside other groups, the
    reference engine (its own chunk hit rule, skipped frees and reads in ``groups.GroupedKV``
    and ``memory``) emits the spec's effects decision by decision, its pool is the spec's after
    each, and the invariants hold at the end under the safe policies; hits with nulls before
    the chunk and skipped frees happen."""
    from collections import Counter

    seen: Counter[str] = Counter()
    for n, groups in enumerate(CHUNKED_GROUPS):
        for depth, asynchronous in ((1, False), (2, False), (2, True), (3, True)):
            rng = random.Random(f"chunked-{policy}-{n}-{depth}-{asynchronous}")
            rec = _lockstep(rng, n, groups, policy, None, depth, asynchronous)
            seen["null hits"] += sum(1 for e in rec if e[0] == "hit" and 0 in e[2] and any(e[2]))  # type: ignore[operator]
            seen["frees"] += sum(1 for e in rec if e[0] == "free")
    assert seen["null hits"] > 3 and seen["frees"] > 10, seen


def test_the_reference_adapter_takes_the_spec_groups() -> None:
    """The reference adapter hands the spec's ``Config.groups`` to the engine (its own
    ``GroupSpec``), which then emits the group field of docs/hybrid.md. (Planted: the
    adapter's former refusal of several groups fails it.)"""
    from kvspec.conformance.adapter import ReferenceAdapter
    from kvspec.reference import DefaultChoices
    from kvspec.spec import Config
    from kvspec.spec.state import Group

    config = Config(
        num_blocks=16, block_size=2, groups=(Group("full", 2), Group("state", 4)), policy="deferred"
    )
    adapter = ReferenceAdapter(config, DefaultChoices())
    assert adapter.engine.config.groups == (GroupSpec("full", 2), GroupSpec("state", 4))
    adapter.add_request(0, (1, 2, 3, 1, 2), 2, 0)
    while adapter.step():
        pass
    assert ("hit", 0, (), 1) in adapter.events
    assert any(e[0] == "alloc" and len(e) == 4 and e[3] == 1 for e in adapter.events)


def test_group_coverage_counters_read_the_events() -> None:
    """``RunCoverage(kinds)`` counts a state block hit and a window block freed by a schedule
    while the request shares a block of another group; one group counts neither. (Planted:
    counting frees of any group as window frees makes the full-group free count.)"""
    from kvspec.conformance.fuzz_coverage import RunCoverage

    events: list[tuple[object, ...]] = [
        ("arrive", 0, (1, 2, 3, 4), 4, 0),
        ("begin", 0),
        ("schedule", 0, 3, 0),
        ("alloc", 0, 1),
        ("alloc", 0, 2, 1),
        ("alloc", 0, 3, 2),
        ("publish", 0, 0, 1),
        ("submit", 0),
        ("arrive", 1, (1, 2, 3, 4), 4, 0),
        ("begin", 1),
        ("schedule", 1, 1, 0),
        ("hit", 1, (1,)),
        ("hit", 1, (2,), 1),
        ("hit", 1, (0,), 2),
        ("schedule", 0, 1, 0),
        ("free", 2),
        ("submit", 1),
    ]
    run = RunCoverage(("full", "window", "state"))
    run.observe(events)
    assert run.window_nulled_shared == 1  # block 2 (window) while r0 shares block 1 (full)
    assert run.state_hits == 0
    run = RunCoverage(("full", "state", "window"))
    run.observe(events)
    assert run.state_hits == 1 and run.window_nulled_shared == 0
    plain = RunCoverage()
    plain.observe(events)
    assert plain.state_hits == plain.window_nulled_shared == 0
