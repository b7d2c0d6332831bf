"""Slot groups in the reference engine (SGLang's MAMBA ``no_buffer``; issue #36, docs/hybrid.md,
"Slot groups in the reference engine").

Stage 1, under the spec's own policies (prefix caching off: the spec caches a slot group only
by an engine's own snapshots): the engine allocates one slot per request at admission, after
group 0's blocks, reads and rewrites it in place every step and frees it with the tables, in
lockstep with the spec decision by decision, its pool the spec's after each; its own device
memory finds no bad read, and a planted bug in the slot's in-place state is named by it."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from test_reference import spec_config

from kvspec.reference import EngineConfig, GroupSpec
from kvspec.reference.groups import GroupedKV
from kvspec.reference.request import Request, Step
from kvspec.reference.slots import SlotCopies

SLOT_GROUPS = [
    (GroupSpec("full", 2), GroupSpec("slot", 2)),
    (GroupSpec("window", 2, 3), GroupSpec("slot", 4)),
    (GroupSpec("full", 2), GroupSpec("state", 2), GroupSpec("slot", 2)),
]
RUNS = ((1, False), (2, False), (2, True), (3, True))
"""(depth, async scheduling) of each lockstep run."""


def _config(
    rng: random.Random, groups: tuple[GroupSpec, ...], policy: str, depth: int, asynchronous: bool
) -> EngineConfig:
    return EngineConfig(
        num_blocks=rng.randint(20, 40),
        block_size=2,
        depth=depth,
        policy=policy,
        discipline=rng.choice(["vllm", "general"]),
        preemption=rng.choice(["fcfs", "priority"]),
        token_budget=rng.randint(2, 10),
        max_running=rng.randint(1, 4),
        stop_token=0,
        vocab=3,
        async_scheduling=asynchronous,
        prefix_caching=False,
        groups=groups,
    )


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted", "eager-unsafe"])
def test_the_reference_engine_with_a_slot_group_conforms(policy: str) -> None:
    """Lockstep under the spec's own policies, judged by the strict judge decision by decision
    (each effect the spec's, every invariant after each decision), the engine's refcounts and
    free queue the spec's after each: a slot per admission, allocated after group 0's blocks
    (one ``alloc`` of the slot group per admission), freed with the tables; the engine's own
    memory found no wrong state read (it names a read of a block recycled under a submitted
    step even when its bytes are still right, which the spec does not); preemptions happen
    (a slot freed and allocated anew)."""
    seen: Counter[str] = Counter()
    for n, groups in enumerate(SLOT_GROUPS):
        g = len(groups) - 1
        for depth, asynchronous in RUNS:
            rng = random.Random(f"slots-{policy}-{n}-{depth}-{asynchronous}")
            cfg = _config(rng, groups, policy, depth, asynchronous)
            found, events, eng = judged_run(cfg, n, rng, rng.randint(4, 10), observed=False)
            assert found is None, (cfg, found)
            wrong = [b for b in eng.bad_reads if b.invariant != "NoReadOfRecycled"]
            assert wrong == [], wrong[:3]
            slot_allocs = [e for e in events if e[0] == "alloc" and len(e) == 4 and e[3] == g]
            admissions = [e for e in events if e[0] == "hit" and len(e) == 4 and e[3] == g]
            assert len(slot_allocs) == len(admissions)
            seen["slots"] += len(slot_allocs)
            seen["preempts"] += sum(1 for e in events if e[0] == "preempt")
            seen["reads"] += sum(1 for e in events if e[0] == "schedule" and e[2] == 1)
    assert seen["slots"] > 20 and seen["preempts"] > 3 and seen["reads"] > 20, seen


def test_a_slot_group_is_checked() -> None:
    """A slot group is never group 0, and with prefix caching needs ``engine-registers``: both
    refused by name when the config is made (as the spec's ``Config`` refuses them)."""
    base = dict(num_blocks=8, block_size=2, prefix_caching=False)
    with pytest.raises(ValueError, match="never group 0"):
        EngineConfig(**base, groups=(GroupSpec("slot", 2), GroupSpec("full", 2)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine-registers"):
        EngineConfig(
            num_blocks=8, block_size=2, groups=(GroupSpec("full", 2), GroupSpec("slot", 2))
        )


def _plant_slot_not_carried(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step of a request gets a fresh slot (a block per step, as vLLM's align mode would),
    the state not carried over: its next step reads a slot nothing wrote."""
    grow = GroupedKV.grow

    def planted(self: GroupedKV, req: object, end: int) -> None:
        for g, spec in enumerate(self.groups):
            table = self.tables(req)[g]  # type: ignore[arg-type]
            if spec.kind == "slot" and table:
                self.pool.free_batch([table[0]])
                table[0] = self.pool.allocate(req.rid, g)  # type: ignore[attr-defined]
        grow(self, req, end)  # type: ignore[arg-type]

    monkeypatch.setattr(GroupedKV, "grow", planted)


def test_a_slot_not_carried_is_named_by_the_engine_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted: a fresh slot every step. The engine's own memory names the read
    NoUnwrittenStateRead (without the plant: none, as the lockstep test shows)."""
    _plant_slot_not_carried(monkeypatch)
    from test_reference import recording_engine

    rng = random.Random("slot-plant")
    cfg = _config(rng, SLOT_GROUPS[0], "deferred", 1, False)
    eng, _ = recording_engine(cfg, 0, fail_rate=0.0)
    own_drive(eng, rng, num_requests=6)
    names = {bad.invariant for bad in eng.bad_reads}
    assert "NoUnwrittenStateRead" in names, names


# -- the engine's own registration: states snapshotted, donated and hit ----------------------

OWN_GROUPS = [
    (GroupSpec("full", 1), GroupSpec("slot", 1)),  # SGLang's hybrid Mamba models: page size 1
    (GroupSpec("full", 1), GroupSpec("slot", 2)),
    (GroupSpec("full", 2), GroupSpec("slot", 2)),
    (GroupSpec("full", 1), GroupSpec("full", 2), GroupSpec("slot", 2)),
    (),  # one full group: the engine's own registration without a slot group
]


def own_config(
    rng: random.Random, groups: tuple[GroupSpec, ...], depth: int, asynchronous: bool
) -> EngineConfig:
    """A configuration of the engine registering on its own, with ``groups``."""
    return EngineConfig(
        num_blocks=rng.randint(30, 48),
        block_size=groups[0].block_size if groups else 2,
        depth=depth,
        policy="engine-registers",
        discipline=rng.choice(["vllm", "general"]),
        preemption=rng.choice(["fcfs", "priority"]),
        token_budget=rng.randint(2, 8),
        max_running=rng.randint(1, 4),
        stop_token=0,
        vocab=3,
        async_scheduling=asynchronous,
        groups=groups,
    )


def own_drive(eng: object, rng: random.Random, num_requests: int, max_steps: int = 3000) -> None:
    """Requests sharing long prefixes (so that states at their chunk boundaries are hit) arrive
    between steps; a few are aborted."""
    prefixes = [tuple(rng.randrange(3) for _ in range(rng.randint(3, 9))) for _ in range(3)]
    added = 0
    for _ in range(max_steps):
        if added < num_requests and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + tuple(rng.randrange(3) for _ in range(rng.randrange(4)))
            eng.add_request(added, prompt, rng.randint(1, 5), rng.randrange(3))  # type: ignore[attr-defined]
            added += 1
        if added and rng.random() < 0.03:
            eng.abort(rng.randrange(added))  # type: ignore[attr-defined]
        if not eng.step() and added >= num_requests:  # type: ignore[attr-defined]
            return
    raise AssertionError(f"the engine did not finish in {max_steps} steps (livelock?)")


def judged_run(
    cfg: EngineConfig, seed: int, rng: random.Random, num_requests: int, observed: bool = True
) -> tuple:  # type: ignore[type-arg]
    """One run judged by the spec decision by decision: observed (the judge ``kvspec check``
    takes for an engine-registers trace), or strict (the spec's own policies); the engine's
    refcounts and free blocks (strict: the free queue, in order) compared with the judge's
    after each. (finding or None, events, engine)."""
    from test_reference import DECISIONS, recording_engine

    from kvspec.judge import Judge

    eng, rec = recording_engine(cfg, seed, fail_rate=0.0)
    own_drive(eng, rng, num_requests)
    rec.snapshots.append(eng.snapshot())
    events = list(rec)
    judge = Judge.spec(spec_config(cfg), observed=observed)
    starts = [i for i, e in enumerate(events) if e[0] in DECISIONS]
    for n, i in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(events)
        found = judge.feed_all(events[i:end]) or judge.compare(*rec.snapshots[n + 1])
        if found is not None:
            return found, events, eng
    return judge.settle(), events, eng


def own_coverage(events: list, slots: set[int]) -> Counter[str]:  # type: ignore[type-arg]
    """Counted from the events: snapshots by copy (into a block that is not the request's
    slot) and by donation (its own slot, after its ``finish``), and hits of the slot groups
    ``slots`` naming a state."""
    seen: Counter[str] = Counter()
    slot_of: dict[tuple[int, int], int] = {}
    admitted: set[tuple[int, int]] = set()
    finished: set[int] = set()
    for e in events:
        if e[0] == "alloc" and len(e) == 4 and e[3] in slots:
            if (e[1], e[3]) in admitted:  # the working slot (track slots come after it)
                admitted.discard((e[1], e[3]))  # type: ignore[arg-type]
                slot_of[(e[1], e[3])] = e[2]  # type: ignore[index]
        elif e[0] == "finish":
            finished.add(e[1])  # type: ignore[arg-type]
        elif e[0] == "snapshot":
            donated = e[1] in finished and slot_of.get((e[1], e[4])) == e[3]  # type: ignore[index]
            seen["donations" if donated else "copies"] += 1
        elif e[0] == "hit" and len(e) == 4 and e[3] in slots:
            admitted.add((e[1], e[3]))  # type: ignore[arg-type]
            seen["state hits"] += bool(e[2])
    return seen


@pytest.mark.parametrize("n", range(len(OWN_GROUPS)))
def test_the_reference_engine_registering_on_its_own_is_judged_safe(n: int) -> None:
    """The engine under ``engine-registers`` (``own_registration.py``): judged by the spec's
    observed judge decision by decision, the engine's pool the judge's after each, no finding;
    states are snapshotted by copy and by donation, and hit."""
    groups = OWN_GROUPS[n]
    slots = {g for g, spec in enumerate(groups) if spec.kind == "slot"}
    seen: Counter[str] = Counter()
    for depth, asynchronous in RUNS:
        for run in range(3):
            rng = random.Random(f"own-{n}-{depth}-{asynchronous}-{run}")
            cfg = own_config(rng, groups, depth, asynchronous)
            found, events, _ = judged_run(cfg, run, rng, rng.randint(5, 10))
            assert found is None, (cfg, found)
            seen += own_coverage(events, slots)
    if slots:
        assert seen["copies"] > 3 and seen["donations"] > 3 and seen["state hits"] > 3, seen


# -- planted bugs in the engine's own registration, each named by its invariant --------------


def _plant_key_one_block_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot by copy is published one block of the slot group past the state it copies."""
    from kvspec.reference.own_registration import EngineRegisters

    def planted(self: EngineRegisters, req: Request, step: Step, end: int) -> None:
        kv = self.kv
        assert isinstance(kv, GroupedKV)
        c = step.entries[req.rid].start
        for g in self.slot_groups:
            size, tables = kv.groups[g].block_size, kv.tables(req)
            longer = c + size
            if c and not c % size and longer <= len(req.tokens) and tables[g]:
                if kv.pool.cached_block(kv.state_key(req, g, longer)) is None:
                    kv.snapshot_state(req, g, longer, tables[g][0])

    monkeypatch.setattr(EngineRegisters, "on_schedule", planted)


def _plant_copy_before_the_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot by copy is taken at the end of the entry just scheduled, whose step (being
    built) has not written it: the copy runs before that step's writes."""
    from kvspec.reference.own_registration import EngineRegisters

    def planted(self: EngineRegisters, req: Request, step: Step, end: int) -> None:
        kv = self.kv
        assert isinstance(kv, GroupedKV)
        for g in self.slot_groups:
            tables = kv.tables(req)
            if end % kv.groups[g].block_size == 0 and end <= len(req.tokens) and tables[g]:
                if kv.pool.cached_block(kv.state_key(req, g, end)) is None:
                    kv.snapshot_state(req, g, end, tables[g][0])

    monkeypatch.setattr(EngineRegisters, "on_schedule", planted)


def _plant_hit_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot group's hit is not copied into the fresh slot: the admitting step starts its
    recurrence from a slot nothing wrote."""
    make = SlotCopies.make

    def planted(self: SlotCopies, step: int, source: object, target: object, rid: int) -> None:
        if step != self.building or target.ref_cnt == 0:  # type: ignore[attr-defined]
            make(self, step, source, target, rid)  # type: ignore[arg-type]
        # (a copy into a held block, for the building step: an admission's, left out)

    monkeypatch.setattr(SlotCopies, "make", planted)


def _plant_donate_under_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finishing request donates its slot though a later submitted step still holds it (and
    will rewrite the slot when it runs)."""
    from kvspec.reference.own_registration import EngineRegisters

    on_finish = EngineRegisters.on_finish
    monkeypatch.setattr(
        EngineRegisters,
        "on_finish",
        lambda self, req, entry, later: on_finish(self, req, entry, False),
    )


def _plant_publish_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's working slot itself is published at the end of the entry just scheduled
    (no copy): a hit admitted in the same step copies it before that step writes it."""
    from kvspec.reference.own_registration import EngineRegisters

    def planted(self: EngineRegisters, req: Request, step: Step, end: int) -> None:
        kv = self.kv
        assert isinstance(kv, GroupedKV)
        for g in self.slot_groups:
            slot = kv.tables(req)[g][0]
            if end % kv.groups[g].block_size or end > len(req.tokens) or slot.block_hash:
                continue
            key = kv.state_key(req, g, end)
            if kv.pool.cached_block(key) is None:
                slot.block_hash = key
                kv.pool.index.setdefault(key, {})[slot.block_id] = slot
                index = end // kv.groups[g].block_size - 1
                kv.pool.events.append(("snapshot", req.rid, index, slot.block_id, g))  # type: ignore[union-attr]

    monkeypatch.setattr(EngineRegisters, "on_schedule", planted)


def _plant_slot_freed_under_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preempted request's output in a submitted step is still delivered (the config's
    refusal of ``deliver`` with a slot group left out): the engine frees its slot while that
    step, still live, will read and write it."""
    from dataclasses import replace

    from kvspec.reference.config import EngineConfig as Config

    monkeypatch.setattr(Config, "_check_slots", lambda self: None)
    make = own_config
    monkeypatch.setitem(
        globals(),
        "own_config",
        lambda *args: replace(make(*args), stale_output="deliver"),  # type: ignore[arg-type]
    )


OWN_PLANTS = [
    ("StateAtItsBoundary", _plant_key_one_block_long, False),
    ("StateAtItsBoundary", _plant_copy_before_the_write, False),
    ("NoReadOfRecycled", _plant_slot_freed_under_a_step, True),
    ("StateAtItsBoundary", _plant_donate_under_a_step, True),
]


def hunt(asynchronous: bool, seconds: float = 30.0, max_runs: int = 10**6) -> tuple:  # type: ignore[type-arg]
    """Judged runs over the slot configurations (seeded, in a fixed order) until one is a
    finding, ``seconds`` pass or ``max_runs`` are done: (finding or None, seconds, runs)."""
    import time

    began = time.monotonic()
    runs = 0
    while time.monotonic() - began < seconds and runs < max_runs:
        for n, groups in enumerate(OWN_GROUPS[:3]):
            depth = 2 if asynchronous else 1 + runs % 2
            rng = random.Random(f"plant-{n}-{runs}-{asynchronous}")
            cfg = own_config(rng, groups, depth, asynchronous)
            found, _, _ = judged_run(cfg, runs, rng, rng.randint(5, 10))
            runs += 1
            if found is not None:
                return found, time.monotonic() - began, runs
    return None, time.monotonic() - began, runs


@pytest.mark.parametrize(
    "name,plant,asynchronous", OWN_PLANTS, ids=[p[1].__name__ for p in OWN_PLANTS]
)
def test_a_planted_bug_in_the_own_registration_is_named(
    monkeypatch: pytest.MonkeyPatch, name: str, plant: object, asynchronous: bool
) -> None:
    """Each plant is caught by the observed judge and named by its invariant in under 30 s; the
    same runs without it hold (``hunt`` is deterministic)."""
    plant(monkeypatch)  # type: ignore[operator]
    found, seconds, runs = hunt(asynchronous)
    assert found is not None, f"not caught in {runs} runs"
    assert found.invariant == name, found
    assert seconds < 30
    monkeypatch.undo()
    clean, _, _ = hunt(asynchronous, seconds=60, max_runs=runs)
    assert clean is None, clean


def test_a_hit_not_copied_is_named_by_the_engine_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a slot group's hit is not copied into the fresh slot (``_plant_hit_not_copied``).
    The trace is the same (the copy is implied by the hit), so the judge cannot see it; the
    engine's own memory names the admitting step's read NoUnwrittenStateRead. Without the
    plant the same runs read no wrong state."""

    def wrong_reads() -> set[str]:
        names: set[str] = set()
        for run in range(20):
            rng = random.Random(f"copy-{run}")
            cfg = own_config(rng, OWN_GROUPS[run % 3], 1 + run % 2, False)
            _, _, eng = judged_run(cfg, run, rng, rng.randint(5, 10))
            names |= {b.invariant for b in eng.bad_reads if b.invariant != "NoReadOfRecycled"}
        return names

    _plant_hit_not_copied(monkeypatch)
    assert "NoUnwrittenStateRead" in wrong_reads()
    monkeypatch.undo()
    assert wrong_reads() == set()


# -- track slots (extra_buffer) ------------------------------------------------------------


def track_runs(runs: int = 8) -> tuple:  # type: ignore[type-arg]
    """Judged runs of the engine under ``extra_buffer`` over the slot configurations: (the first
    finding or None, coverage)."""
    from dataclasses import replace

    seen: Counter[str] = Counter()
    for n, groups in enumerate(OWN_GROUPS[:4]):
        slots = {g for g, spec in enumerate(groups) if spec.kind == "slot"}
        for run in range(runs):
            rng = random.Random(f"track-{n}-{run}")
            cfg = replace(own_config(rng, groups, 1, False), slot_buffer="extra_buffer")
            found, events, _ = judged_run(cfg, run, rng, rng.randint(5, 10))
            if found is not None:
                return found, seen
            seen += own_coverage(events, slots)
            tracked: dict[object, set[object]] = {}  # per request, its track slots written
            for e in events:
                if e[0] == "hit" and len(e) == 4 and e[3] in slots:
                    tracked[e[1]] = set()
                elif e[0] == "track":
                    tracked[e[1]].add(e[2])
                    seen["track writes"] += 1
                elif e[0] == "snapshot" and e[3] in tracked.get(e[1], ()):
                    seen["track donations"] += 1
    return None, seen


def test_the_reference_engine_with_track_slots_is_judged_safe() -> None:
    """``extra_buffer`` (depth 1): two track slots per admission, a track write per schedule
    that crosses a boundary, the written track slot donated at the commit and replaced;
    judged by the observed judge decision by decision with the pool compared after each, no
    finding; track writes, track donations and hits of donated states happen, and no state is
    copied but by a hit."""
    found, seen = track_runs()
    assert found is None, found
    assert seen["track writes"] > 20 and seen["track donations"] > 10, seen
    assert seen["state hits"] > 5 and seen["donations"] > 5, seen
    assert seen["copies"] == seen["track donations"], seen  # every other snapshot is a donation


def test_a_track_slot_donated_unwritten_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the commit donates the other ping-pong slot, not the one the step wrote: named
    StateAtItsBoundary (its state is another boundary's, or none) within 30 s."""
    import time

    from kvspec.reference.own_registration import EngineRegisters

    donate = GroupedKV.donate_track

    def planted(self: GroupedKV, req: Request, g: int, block: object, t: int) -> None:
        table = self.tables(req)[g]
        other = next(b for b in table[1:] if b is not block and b.block_id)
        donate(self, req, g, other, t)

    monkeypatch.setattr(GroupedKV, "donate_track", planted)
    began = time.monotonic()
    found, _ = track_runs()
    assert found is not None and found.invariant == "StateAtItsBoundary", found
    assert time.monotonic() - began < 30
    assert EngineRegisters is not None


def test_a_slot_allocated_before_group_0_is_a_disagreement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the admission allocates the slot before group 0's blocks (the spec orders the
    effects group by group): the strict lockstep finds the first ``alloc`` out of order."""
    grow = GroupedKV.grow

    def planted(self: GroupedKV, req: Request, end: int) -> None:
        for g, table in enumerate(self.tables(req)):
            if self.groups[g].kind == "slot" and not table:
                self._slot(req, g, table)
        grow(self, req, end)

    monkeypatch.setattr(GroupedKV, "grow", planted)
    rng = random.Random("slots-deferred-0-1-False")
    cfg = _config(rng, SLOT_GROUPS[0], "deferred", 1, False)
    found, _, _ = judged_run(cfg, 0, rng, 6, observed=False)
    assert found is not None and found.invariant == "Disagreement", found
    assert "alloc" in found.message


def test_kvspec_check_judges_the_engines_own_trace(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine's ``engine-registers`` run written as a trace (judging ``observed``) holds
    under ``kvspec check`` (exit 0); with a copy taken before its step wrote the state it is
    exit 1 naming StateAtItsBoundary."""
    from pathlib import Path

    from kvspec.cli import main
    from kvspec.conformance.trace import write_trace

    def check(name: str, runs: int) -> tuple[int, Path]:
        for run in range(runs):
            rng = random.Random(f"own-0-2-True-{run}")
            cfg = own_config(rng, OWN_GROUPS[0], 2, True)
            found, events, _ = judged_run(cfg, run, rng, 8)
            if found is not None or run == runs - 1:
                break
        path = Path(str(tmp_path)) / name
        write_trace(path, spec_config(cfg), events, judging="observed")
        return main(["check", str(path)]), path

    code, _ = check("own.jsonl", 1)
    assert code == 0 and "holds" in capsys.readouterr().out
    _plant_copy_before_the_write(monkeypatch)
    code, _ = check("planted.jsonl", 50)
    assert code == 1 and "StateAtItsBoundary" in capsys.readouterr().out
