"""The reference engine's cross-attention group (issue #36, docs/hybrid.md, "The reference's
cross group"; the spec's rule: docs/model.md, "Cross-attention"): a request's encoder tokens
arrive with it (``Engine.add_request``'s ``encoder``, the ``arrive`` event's trailing field),
the schedule that admits it allocates its whole cross table and that step's encoder pass writes
it, every step reads it whole, nothing hashes, publishes or hits it, and it is freed with the
other tables. Judged in lockstep with the spec (effects and pool after every decision) and by
the engine's own fake device memory; a planted bug per rule is named by its invariant by
``kvspec fuzz --groups`` within 30 s."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from test_reference import recording_engine
from test_reference_groups import _replay_groups

from kvspec.conformance.fuzz_groups import parse_groups, run_groups_cell
from kvspec.reference import Engine, EngineConfig, GroupSpec
from kvspec.reference.block_pool import Block
from kvspec.reference.groups import GroupedKV
from kvspec.reference.request import Request

Event = tuple[object, ...]

# -- the encoder count at arrival -------------------------------------------------------------


def test_the_encoder_count_is_checked_and_rides_on_the_arrival() -> None:
    """A non-negative int, refused by name without a cross group (as the spec's ``arrive``)
    and where its table cannot fit the pool; the ``arrive`` event carries it only when not 0;
    a cross group 0 is refused (it follows a decoder group)."""
    cross = (GroupSpec("full", 2), GroupSpec("cross", 4))
    engine = Engine(EngineConfig(num_blocks=12, block_size=2, groups=cross))
    for bad in (-1, True, 1.5, "3", None):
        with pytest.raises(ValueError, match="encoder must be an int >= 0"):
            engine.add_request(0, (1, 2), 1, encoder=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="blocks"):  # 2 + 9 of the 11 blocks
        engine.add_request(0, (1, 2), 1, encoder=37)
    engine.add_request(0, (1, 2), 1, encoder=5)
    engine.add_request(1, (1, 2), 1)
    assert engine.events[:2] == [("arrive", 0, (1, 2), 1, 0, 5), ("arrive", 1, (1, 2), 1, 0)]
    plain = Engine(EngineConfig(num_blocks=12, block_size=2))
    with pytest.raises(ValueError, match="encoder tokens but no cross group"):
        plain.add_request(0, (1, 2), 1, encoder=1)
    plain.add_request(0, (1, 2), 1, encoder=0)
    with pytest.raises(ValueError, match="kind cross is never group 0"):
        EngineConfig(num_blocks=12, block_size=2, groups=(GroupSpec("cross", 2),))


def test_a_cross_table_is_allocated_at_admission_read_whole_and_freed() -> None:
    """full@2 + cross@4, 9 encoder tokens: the admitting schedule allocates group 0's block,
    then 3 cross blocks (``ceil(9 / 4)``); its ``hit`` for the cross group is empty; the decodes
    allocate none; the finish frees group 0's, then the cross table's last first; the fake
    memory saw every read right (the encoder pass wrote every block, each step read all)."""
    engine = Engine(
        EngineConfig(
            num_blocks=12, block_size=2, groups=(GroupSpec("full", 2), GroupSpec("cross", 4))
        )
    )
    engine.add_request(0, (1, 2), 3, encoder=9)
    engine.run()
    allocs = [e for e in engine.events if e[0] == "alloc"]
    assert allocs[:4] == [
        ("alloc", 0, 1),
        ("alloc", 0, 2, 1),
        ("alloc", 0, 3, 1),
        ("alloc", 0, 4, 1),
    ]
    assert ("hit", 0, (), 1) in engine.events
    assert len(allocs) == 5  # a second group 0 block for the decodes, no cross block
    frees = [e[1] for e in engine.events if e[0] == "free"]
    assert frees == [5, 1, 4, 3, 2]
    assert not any(e[0] == "publish" and len(e) == 5 for e in engine.events)
    assert engine.bad_reads == []
    assert engine.stats["computed_tokens"] == 4  # the prompt, then 2 decodes (3 samples)


# -- lockstep with the spec -------------------------------------------------------------------

CROSS_GROUPS = [
    (GroupSpec("full", 2), GroupSpec("cross", 2)),
    (GroupSpec("full", 2), GroupSpec("cross", 4)),
    (GroupSpec("window", 2, 3), GroupSpec("cross", 2)),
    (GroupSpec("full", 2), GroupSpec("window", 2, 5), GroupSpec("cross", 6)),
]


def _drive(engine: Engine, rng: random.Random, num_requests: int) -> None:
    """Requests sharing prefixes, half with encoder input (1 .. 12 tokens), arrive between
    steps; some running ones are aborted; the pool is small enough to preempt."""
    prefixes = [tuple(rng.randrange(3) for _ in range(rng.randint(1, 4))) for _ in range(2)]
    added = 0
    for _ in range(4000):
        if added < num_requests and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + tuple(
                rng.randrange(3) for _ in range(rng.randint(0, 3))
            )
            encoder = rng.choice((0, rng.randint(1, 12)))
            engine.add_request(added, prompt, rng.randint(1, 6), rng.randrange(3), encoder=encoder)
            added += 1
        if added and rng.random() < 0.04:
            engine.abort(rng.randrange(added))
        if not engine.step() and added >= num_requests:
            return
    raise AssertionError("the engine did not finish in 4000 steps (livelock?)")


def _cross_lockstep(
    rng: random.Random,
    seed: int,
    groups: tuple[GroupSpec, ...],
    policy: str,
    depth: int,
    asynchronous: bool,
    seen: Counter[str],
) -> None:
    """One run with ``groups`` (the rest drawn from ``rng``): its events replayed by the spec
    decision by decision (effects and pool after each, ``_replay_groups``), the spec's
    invariants at the end and the fake memory's reads held under the safe policies; ``seen``
    counts cross tables allocated, steps reading one after their admission, and cross blocks
    freed by preemption."""
    from kvspec.spec import INVARIANTS

    cfg = EngineConfig(
        num_blocks=rng.randint(16, 30),
        block_size=2,
        depth=depth,
        policy=policy,
        discipline=rng.choice(["vllm", "general"]),
        preemption=rng.choice(["fcfs", "priority"]),
        token_budget=rng.randint(2, 10),
        max_running=rng.randint(1, 4),
        stop_token=0,
        vocab=3,
        prefix_caching=rng.random() < 0.75,
        async_scheduling=asynchronous,
        stale_output="deliver" if depth > 1 and rng.random() < 0.5 else "drop",
        groups=groups,
    )
    engine, rec = recording_engine(cfg, seed, fail_rate=0.0)
    _drive(engine, rng, num_requests=rng.randint(4, 10))
    rec.snapshots.append(engine.snapshot())
    events: list[Event] = list(rec)
    s = _replay_groups(cfg, events, rec.snapshots)
    if policy in ("deferred", "hide-uncommitted"):
        broken = [name for name, inv in INVARIANTS.items() if inv(s) is not None]  # type: ignore[operator]
        assert not broken, (cfg, broken)
        assert engine.bad_reads == [], engine.bad_reads[:3]
    _count(cfg, events, seen)


def _count(cfg: EngineConfig, events: list[Event], seen: Counter[str]) -> None:
    """The cross paths the run reached, read from its events decision by decision."""
    from test_reference import DECISIONS

    cross = {g for g, spec in enumerate(cfg.groups) if spec.kind == "cross"}
    encoder: dict[object, object] = {}
    group_of: dict[object, object] = {}
    starts = [i for i, e in enumerate(events) if e[0] in DECISIONS] + [len(events)]
    for i, end in zip(starts, starts[1:], strict=False):
        decision, effects = events[i], events[i + 1 : end]
        for e in effects:
            if e[0] == "alloc":
                group_of[e[2]] = e[3] if len(e) > 3 else 0
        if decision[0] == "arrive":
            encoder[decision[1]] = decision[5] if len(decision) > 5 else 0
        elif decision[0] == "schedule" and encoder.get(decision[1]):
            admits = any(e[0] == "hit" for e in effects)
            if admits and any(e[0] == "alloc" and e[3:] and e[3] in cross for e in effects):
                seen["cross tables allocated"] += 1
            elif not admits:
                seen["steps reading a cross table after its admission"] += 1
        elif decision[0] == "preempt":
            freed = [e for e in effects if e[0] == "free" and group_of.get(e[1]) in cross]
            seen["cross blocks freed by preemption"] += len(freed)
        seen["cross blocks published"] += sum(
            1 for e in effects if e[0] == "publish" and len(e) == 5 and e[4] in cross
        )


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted", "eager-rollback-fifo"])
def test_the_reference_engine_with_a_cross_group_conforms(policy: str) -> None:
    """Lockstep: with a cross group after a full or window group (and beside a window group),
    depth 1..3, async scheduling on and off, prefix caching on and off, preemption, requests
    with and without encoder input, the reference engine emits the spec's effects decision by
    decision and its pool is the spec's after each; under the safe policies the spec's
    invariants hold at the end and the fake memory found every read right. Cross tables are
    allocated, read by later steps and freed by preemption; none is ever published."""
    seen: Counter[str] = Counter()
    for n, groups in enumerate(CROSS_GROUPS):
        for depth, asynchronous in ((1, False), (2, False), (2, True), (3, True)):
            for run in range(2):
                rng = random.Random(f"cross-{policy}-{n}-{depth}-{asynchronous}-{run}")
                _cross_lockstep(rng, n + run, groups, policy, depth, asynchronous, seen)
    assert seen["cross tables allocated"] > 50, seen
    assert seen["steps reading a cross table after its admission"] > 100, seen
    assert seen["cross blocks freed by preemption"] > 5, seen
    assert seen["cross blocks published"] == 0, seen


def test_the_reference_adapter_takes_a_cross_group() -> None:
    """The spec's ``Group("cross", B)`` reaches the engine (no longer refused by its row in
    twins.py), and the adapter hands a request's encoder tokens over."""
    from kvspec.conformance.adapter import ReferenceAdapter
    from kvspec.reference import DefaultChoices
    from kvspec.spec import Config
    from kvspec.spec.state import Group

    config = Config(
        num_blocks=16, block_size=2, groups=(Group("full", 2), Group("cross", 2)), policy="deferred"
    )
    adapter = ReferenceAdapter(config, DefaultChoices())
    assert adapter.engine.config.groups == (GroupSpec("full", 2), GroupSpec("cross", 2))
    adapter.add_request(0, (1, 2, 3), 2, 0, encoder=3)
    while adapter.step():
        pass
    assert ("arrive", 0, (1, 2, 3), 2, 0, 3) in adapter.events
    assert sum(1 for e in adapter.events if e[0] == "alloc" and e[3:] == (1,)) == 2


# -- kvspec fuzz --groups with a cross group: planted bugs named -------------------------------


def test_cross_groups_syntax() -> None:
    assert parse_groups("full,cross") == (("full", None, None), ("cross", None, None))
    assert parse_groups("full@2,window:3@2,cross@4")[2] == ("cross", 4, None)
    for bad in ("cross", "cross,full", "full,cross:4", "full,cross:when-known"):
        with pytest.raises(ValueError):
            parse_groups(bad)


def _plant_table_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cross table is allocated one block short of ``ceil(encoder / B_g)``."""
    grow_cross = GroupedKV.grow_cross

    def planted(self: GroupedKV, req: Request, g: int, table: list[Block]) -> list[tuple[int, int]]:
        encoder = req.encoder
        req.encoder = max(0, encoder - self.groups[g].block_size)
        try:
            return grow_cross(self, req, g, table)
        finally:
            req.encoder = encoder

    monkeypatch.setattr(GroupedKV, "grow_cross", planted)


def _plant_freed_under_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode's schedule frees (and nulls) the cross table, as a window's skipped blocks,
    though its step and the steps in flight still read it (vLLM's planted
    ``CrossAttentionManager`` bug)."""
    remove_skipped = GroupedKV.remove_skipped

    def planted(self: GroupedKV, req: Request, processed: int) -> None:
        remove_skipped(self, req, processed)
        null = self.pool.blocks[0]
        for g, table in enumerate(self.tables(req)):
            if self.groups[g].kind == "cross" and processed > 0:
                freed = [b for b in table if b is not null]
                table[:] = [null] * len(table)
                if freed:
                    self.pool.free_batch(freed)

    monkeypatch.setattr(GroupedKV, "remove_skipped", planted)


def _plant_encoder_skips_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder pass writes every block of the new cross table but its last."""
    grow_cross = GroupedKV.grow_cross

    def planted(self: GroupedKV, req: Request, g: int, table: list[Block]) -> list[tuple[int, int]]:
        return grow_cross(self, req, g, table)[:-1]

    monkeypatch.setattr(GroupedKV, "grow_cross", planted)


def _plant_cross_published(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cross group registers its blocks as a full group does (under the decoder's
    prefix): another request's lookup could then be handed one request's encoder output."""
    pending = GroupedKV.group_pending

    def planted(self: GroupedKV, req: Request, end: int, limit: int) -> list[tuple[int, int]]:
        out = pending(self, req, end, limit)
        for g, spec in enumerate(self.groups):
            if spec.kind == "cross":
                count = min(len(self.tables(req)[g]), min(end, limit) // spec.block_size)
                out += [(g, i) for i in range(count)]
        return out

    monkeypatch.setattr(GroupedKV, "group_pending", planted)


CROSS_PLANTS = [
    ("TableMatchesComputed", _plant_table_short),
    ("NoReadOfRecycled", _plant_freed_under_flight),
    ("NoUnwrittenRead", _plant_encoder_skips_a_block),
    ("CrossBlocksPrivate", _plant_cross_published),
]


@pytest.mark.parametrize("name,plant", CROSS_PLANTS, ids=[p[0] for p in CROSS_PLANTS])
def test_a_planted_cross_bug_is_named_by_its_invariant(
    monkeypatch: pytest.MonkeyPatch, name: str, plant: object
) -> None:
    """Each planted bug is caught by ``kvspec fuzz --groups full,cross`` (seed 0) and named by
    its invariant within 30 s; the same cell without the plant holds over those runs."""
    parsed = parse_groups("full,cross")
    plant(monkeypatch)  # type: ignore[operator]
    result = run_groups_cell(parsed, "deferred", seconds=30, max_runs=2000)
    assert result.finding is not None, "the planted bug was not caught"
    assert result.finding.invariant == name, result.finding
    assert result.finding.seconds < 30
    monkeypatch.undo()
    clean = run_groups_cell(parsed, "deferred", max_runs=result.runs)
    assert clean.finding is None, clean.finding


def test_stale_output_delivered_is_judged_as_the_spec_judges_it() -> None:
    """With stale output delivered a preempted request's entry in a step in flight stays live
    (its token is appended at the commit) though its tables are gone: the spec names a recycled
    block only for a running request's read and judges this one by its bytes. So does the fake
    memory: the cell holds. (Before, ``kvspec fuzz --groups full,window:3 --stale-output
    deliver`` named NoReadOfRecycled at run 26 of seed 0, 0.4 s, where the spec holds.)"""
    for groups in ("full,window:3", "full,cross"):
        result = run_groups_cell(
            parse_groups(groups), "deferred", "general", stale_output="deliver", max_runs=200
        )
        assert result.finding is None, result.finding


def test_cross_coverage_counts_read_the_events() -> None:
    """``RunCoverage`` with a cross group counts its allocations and the frees a ``preempt``
    decision makes of them (not a finish's, nor another group's). (Planted: counting the
    frees of any decision makes the finish's count.)"""
    from kvspec.conformance.fuzz_coverage import RunCoverage

    events: list[Event] = [
        ("arrive", 0, (1, 2, 3), 2, 0, 3),
        ("begin", 0),
        ("schedule", 0, 3, 0),
        ("hit", 0, ()),
        ("hit", 0, (), 1),
        ("alloc", 0, 1),
        ("alloc", 0, 2, 1),
        ("alloc", 0, 3, 1),
        ("submit", 0),
        ("begin", 1),
        ("preempt", 0),
        ("free", 1),
        ("free", 3),
        ("free", 2),
        ("schedule", 0, 3, 0),
        ("hit", 0, ()),
        ("hit", 0, (), 1),
        ("alloc", 0, 1),
        ("alloc", 0, 3, 1),
        ("alloc", 0, 2, 1),
        ("submit", 1),
        ("finish", 0, "length"),
        ("free", 1),
        ("free", 2),
        ("free", 3),
    ]
    run = RunCoverage(("full", "cross"))
    run.observe(events)
    assert (run.cross_blocks, run.cross_preempt_frees, run.cross_runs) == (4, 2, 1)
    assert "2 freed by a preemption" in run.groups_line()
    plain = RunCoverage(("full", "window"))
    plain.observe(events)
    assert plain.cross_blocks == plain.cross_preempt_frees == 0
    assert "cross" not in plain.groups_line()
