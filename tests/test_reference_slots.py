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

from kvspec.reference import EngineConfig, GroupSpec
from kvspec.reference.groups import GroupedKV

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
        stale_output="deliver" if depth > 1 and rng.random() < 0.5 else "drop",
        prefix_caching=False,
        groups=groups,
    )


def _lockstep(cfg: EngineConfig, seed: int, rng: random.Random) -> tuple[list, object]:  # type: ignore[type-arg]
    """The engine's run replayed by the spec (``test_reference_groups._replay_groups``): each
    decision's effects and the pool after it must be the spec's. The events and the engine."""
    from test_reference import drive, recording_engine
    from test_reference_groups import _replay_groups

    eng, rec = recording_engine(cfg, seed, fail_rate=0.0)
    drive(eng, rng, num_requests=rng.randint(4, 10))
    rec.snapshots.append(eng.snapshot())
    s = _replay_groups(cfg, list(rec), rec.snapshots)
    return list(rec), (eng, s)


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted", "eager-unsafe"])
def test_the_reference_engine_with_a_slot_group_conforms(policy: str) -> None:
    """Lockstep under the spec's own policies: a slot per admission, allocated after group 0's
    blocks (one ``alloc`` of the slot group per admission, none later), freed with the tables;
    the spec's invariants hold at the end and the engine's memory found no wrong state read
    (it names a read of a block recycled under a submitted step even when its bytes are still
    right, which the spec does not: stale output delivered after a preemption); preemptions
    happen (a slot freed and allocated anew)."""
    from kvspec.spec import INVARIANTS

    seen: Counter[str] = Counter()
    for n, groups in enumerate(SLOT_GROUPS):
        g = len(groups) - 1
        for depth, asynchronous in RUNS:
            rng = random.Random(f"slots-{policy}-{n}-{depth}-{asynchronous}")
            cfg = _config(rng, groups, policy, depth, asynchronous)
            events, (eng, s) = _lockstep(cfg, n, rng)
            broken = [name for name, inv in INVARIANTS.items() if inv(s) is not None]  # type: ignore[operator]
            assert not broken, (cfg, broken)
            wrong = [b for b in eng.bad_reads if b.invariant != "NoReadOfRecycled"]  # type: ignore[attr-defined]
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
    from test_reference import drive, recording_engine

    rng = random.Random("slot-plant")
    cfg = _config(rng, SLOT_GROUPS[0], "deferred", 1, False)
    eng, _ = recording_engine(cfg, 0, fail_rate=0.0)
    drive(eng, rng, num_requests=6)
    names = {bad.invariant for bad in eng.bad_reads}
    assert "NoUnwrittenStateRead" in names, names
