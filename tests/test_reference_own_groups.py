"""The reference engine's own registration (``engine-registers``) with window, state and chunked
groups, and the observed judge's steering of a block that one decision frees and allocates again
(issue #36; docs/hybrid.md, "Slot groups in the reference engine", rule 6).

A schedule frees a window's, a chunked group's or a state group's skipped blocks before it
allocates (``remove_skipped``); with a short free queue an engine allocates one of them again in
the same decision. The observed judge used to move the engine's allocated blocks to the head of
its free queue before the decision, so such a block was "not free" (``Illegal``) on a safe
engine. Such a block is now steered when it is allocated (``spec/pool.take_free``); a block
free before the decision is moved to the free queue's head as before. Under
``engine-registers`` a window group beside group 0 is let go of by the engine itself, at each
step's begin (``GroupedKV.let_go_windows``, the spec's ``observed.let_go``); a plant that lets
go too early is named by its invariant."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from test_reference_slots import RUNS, _plant_copy_before_the_write, judged_run, own_config

from kvspec.conformance.fuzz_groups import parse_groups, run_groups_cell
from kvspec.reference import EngineConfig, GroupSpec
from kvspec.reference.groups import GroupedKV
from kvspec.reference.request import Request

DECISIONS = {"arrive", "begin", "schedule", "submit", "execute", "commit", "abort", "preempt"}

SKIPPING_GROUPS = [
    (GroupSpec("full", 2), GroupSpec("window", 2, 4)),
    (GroupSpec("full", 2), GroupSpec("state", 2)),
    (GroupSpec("full", 2), GroupSpec("chunked", 2, chunk=4)),
    (GroupSpec("full", 2), GroupSpec("window", 2, 3), GroupSpec("slot", 2)),
    (GroupSpec("window", 2, 4),),  # one window group, as group 0: freed at schedule
]
"""Groups whose skipped blocks are freed (or let go of) while a request runs."""


def _tight(cfg: EngineConfig, rng: random.Random) -> EngineConfig:
    """The configuration with a short pool: a decision that frees skipped blocks is often left
    with nothing else to allocate."""
    return dataclasses.replace(cfg, num_blocks=rng.randint(19, 21))


def _coverage(events: list) -> Counter[str]:  # type: ignore[type-arg]
    """Counted from the events: allocations of a block the same decision freed, window blocks
    the engine let go of (a ``dedup`` to the null block), hits of groups beside group 0."""
    seen: Counter[str] = Counter()
    freed: set[int] = set()
    for e in events:
        if e[0] in DECISIONS:
            freed = set()
        elif e[0] == "free":
            freed.add(e[1])
        elif e[0] == "alloc" and e[2] in freed:
            seen["allocated again"] += 1
        elif e[0] == "dedup" and e[3] == 0:
            seen["let go"] += 1
        elif e[0] == "hit" and len(e) == 4 and e[2]:
            seen["group hits"] += 1
    return seen


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted"])
def test_the_observed_judge_follows_a_block_freed_and_allocated_again(policy: str) -> None:
    """The reference engine under the spec's own policies (which it follows in strict lockstep,
    ``test_reference_groups.py``), judged by the observed judge, its pool compared after every
    decision: no finding, and blocks a decision freed were allocated again in it."""
    seen: Counter[str] = Counter()
    for n, groups in enumerate(SKIPPING_GROUPS[:3]):
        for depth, asynchronous in RUNS:
            for run in range(3):
                rng = random.Random(f"again-{policy}-{n}-{depth}-{asynchronous}-{run}")
                cfg = own_config(rng, groups, depth, asynchronous)
                cfg = dataclasses.replace(_tight(cfg, rng), policy=policy)
                found, events, _ = judged_run(cfg, run, rng, 12, observed=True)
                assert found is None, (cfg, found)
                seen += _coverage(events)
    assert seen["allocated again"] > 3, seen


@pytest.mark.parametrize("n", range(len(SKIPPING_GROUPS)))
def test_the_reference_engine_registering_on_its_own_with_skipping_groups_is_judged_safe(
    n: int,
) -> None:
    """``engine-registers`` with a window, state or chunked group: judged by the observed judge
    decision by decision, no finding; the engine let go of window blocks (a group beside
    group 0) or allocated a freed block again in the same decision (the others), and groups
    beside group 0 were hit."""
    groups = SKIPPING_GROUPS[n]
    seen: Counter[str] = Counter()
    for depth, asynchronous in RUNS:
        for run in range(4):
            rng = random.Random(f"own-skip-{n}-{depth}-{asynchronous}-{run}")
            cfg = _tight(own_config(rng, groups, depth, asynchronous), rng)
            found, events, _ = judged_run(cfg, run, rng, 12)
            assert found is None, (cfg, found)
            seen += _coverage(events)
    if len(groups) > 1:
        assert seen["group hits"] > 20, seen
    if any(g and spec.kind == "window" for g, spec in enumerate(groups)):
        assert seen["let go"] > 20, seen
    elif groups[-1].kind in ("state", "chunked"):
        assert seen["allocated again"] > 0, seen


# -- planted bugs in the engine's letting go of window blocks, each named by its invariant -----


def _plant_let_go_inside_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine lets go of one window block more than it skips: the block the window of the
    next token still reads."""
    let_go = GroupedKV.let_go_windows

    def planted(self: GroupedKV, req: Request, processed: int) -> None:
        let_go(self, req, processed + self.groups[1].block_size)

    monkeypatch.setattr(GroupedKV, "let_go_windows", planted)


@pytest.mark.parametrize("runs", [((1, False),), ((2, False), (3, True))])
def test_a_window_let_go_too_early_is_named(
    monkeypatch: pytest.MonkeyPatch, runs: tuple[tuple[int, bool], ...]
) -> None:
    """Planted in the engine's own letting go of window blocks, one block too many: the
    observed judge names NoUnwrittenRead (the next step reads the null block the window still
    needs), not an ``Illegal`` or a ``Disagreement``, within a few runs. Letting go of blocks a
    submitted step still reads (counting its tokens as processed) is no plant: steps run in
    order, so a block given up at a begin is rewritten only by a later step, after the
    submitted one has read it (the spec's ``observed.let_go`` says so)."""
    _plant_let_go_inside_the_window(monkeypatch)
    found_names: Counter[str] = Counter()
    for depth, asynchronous in runs:
        for run in range(6):
            rng = random.Random(f"own-skip-plant-{depth}-{asynchronous}-{run}")
            cfg = _tight(own_config(rng, SKIPPING_GROUPS[0], depth, asynchronous), rng)
            found, _, _ = judged_run(cfg, run, rng, 12)
            if found is not None:
                found_names[found.invariant] += 1
    assert found_names and set(found_names) == {"NoUnwrittenRead"}, found_names


# -- kvspec fuzz --groups under engine-registers: the observed judge in the fuzzer -------------


@pytest.mark.parametrize(
    "discipline,preemption,groups",
    [
        ("vllm", "fcfs", "full,slot"),
        ("general", "priority", "full,window:4,slot@2"),
        ("vllm", "priority", "full@2,state@2,slot@2"),
    ],
)
def test_fuzz_groups_under_the_engines_own_registration_holds(
    discipline: str, preemption: str, groups: str
) -> None:
    """``kvspec fuzz --groups ... --policy engine-registers`` (``fuzz_groups.ObservedJudge``):
    100 runs of seed 0 hold, and slot states were hit, snapshotted by copy and by donation."""
    result = run_groups_cell(
        parse_groups(groups), "engine-registers", discipline, preemption, max_runs=100
    )
    assert result.finding is None, result.finding
    assert result.runs == 100
    cov = result.coverage
    line = cov.groups_line()
    assert cov.slot_hits > 0 and cov.snapshots_copied > 0 and cov.snapshots_donated > 0, line
    assert cov.hits_shortened > 0, line


def test_fuzz_groups_command_under_the_engines_own_registration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``kvspec fuzz --groups full,slot --policy engine-registers`` needs no ``--target``: it
    holds (exit 0) and prints the slot groups' coverage; a slot group with prefix caching under
    a spec policy is exit 2 in one line."""
    from kvspec.cli import main

    base = ["fuzz", "--groups", "full,slot", "--seconds", "2"]
    assert main([*base, "--policy", "engine-registers"]) == 0
    out = capsys.readouterr().out
    assert "no counterexample" in out and "snapshots by copy" in out, out
    assert main([*base, "--policy", "deferred"]) == 2
    err = capsys.readouterr().err
    assert "engine-registers" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "name,plant,groups",
    [
        ("StateAtItsBoundary", _plant_copy_before_the_write, "full,slot"),
        ("NoUnwrittenRead", _plant_let_go_inside_the_window, "full,window:4,slot@2"),
    ],
)
def test_fuzz_groups_names_a_plant_in_the_engines_own_registration(
    monkeypatch: pytest.MonkeyPatch, name: str, plant: object, groups: str
) -> None:
    """Planted in the engine's own registration, caught by ``kvspec fuzz --groups`` (seed 0)
    and named by its invariant within 30 s; the same runs hold without the plant."""
    plant(monkeypatch)  # type: ignore[operator]
    parsed = parse_groups(groups)
    result = run_groups_cell(parsed, "engine-registers", seconds=30, max_runs=2000)
    assert result.finding is not None, "the planted bug was not caught"
    assert result.finding.invariant == name, result.finding
    assert result.finding.seconds < 30
    monkeypatch.undo()
    clean = run_groups_cell(parsed, "engine-registers", max_runs=result.runs)
    assert clean.finding is None, clean.finding
