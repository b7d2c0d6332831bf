"""The fuzzer's coverage counters (``conformance/fuzz_coverage.py``) on hand-written streams whose
counts are known, and the per-run figures ``run_cell`` returns."""

from __future__ import annotations

from edges import SEED_CONFIG, with_effects
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from scenarios import CONSUMER, SEED

from kvspec.conformance.fuzz import SUFFIXES, lockstep_machine, run_cell
from kvspec.conformance.fuzz_coverage import Coverage, RunCoverage
from kvspec.spec import Config, apply, initial_state


def counted(config: Config, decisions: list[tuple]) -> RunCoverage:
    run = RunCoverage()
    run.observe(with_effects(config, decisions))
    return run


def test_the_seed_scenario_counts_its_preemption_and_its_zombie_hit() -> None:
    """A is preempted from step 2, which had published its block 1 (eager); r3 hits it."""
    run = counted(SEED_CONFIG, SEED)
    assert run.preempt_building == 1
    assert run.zombies_past_step == 1  # block 1 is still published when step 2 is submitted
    assert run.zombie_hits == 1
    assert run.preempt_at_depth == [1, 0, 0, 0]  # a synchronous engine: nothing in flight
    assert run.hit_same_step == run.hit_in_flight == run.load_failures == 0


def test_the_consumer_scenario_counts_a_same_step_hit() -> None:
    """B hits A's blocks in the step that allocated them, then A is withdrawn from it."""
    config = Config(6, 2, policy="eager-rollback-fifo", discipline="general", max_running=4)
    run = counted(config, CONSUMER)
    assert run.hit_same_step == 2 and run.preempt_building == 1
    assert run.zombie_hits == 0  # B's hit came before the withdrawal
    run = counted(config, [*CONSUMER, ("submit", 0)])
    assert run.zombies_past_step == 0  # the policy rolled A's registrations back


def test_a_preemption_with_a_step_in_flight_counts_at_depth_one() -> None:
    config = Config(num_blocks=4, block_size=2, depth=2, token_budget=8)
    decisions = [
        ("arrive", 0, (1, 2, 3), 3, 0),
        ("begin", 0),
        ("schedule", 0, 3, 0),
        ("submit", 0),
        ("begin", 1),  # step 0 still in flight
        ("preempt", 0),
    ]
    s = initial_state(config)
    run = RunCoverage()
    for decision in decisions:
        run.observe([decision, *apply(s, decision)])
    assert run.preempt_at_depth == [0, 1, 0, 0] and run.preempt_building == 0


def test_coverage_adds_up_over_runs() -> None:
    total = Coverage()
    for _ in range(2):
        total.add(counted(SEED_CONFIG, SEED))
    assert total.as_dict()["zombie_hits"] == 2 and total.preempt_at_depth[0] == 2
    assert "2 zombie hits" in total.line()


def test_suffix_table_holds_every_suffix_once_simplest_first() -> None:
    for n, table in enumerate(SUFFIXES):
        assert len(set(table)) == len(table) == 3**n
        assert table[0] == (1,) * n and all(set(t) <= {1, 2, 3} for t in table)


def test_the_machine_runs_deep_and_tallies_every_run() -> None:
    """Under the ci profile (bounded, derandomized): every run is tallied, its steps sum to the
    commits, and a run holds many engine steps (the old machine's runs held about four)."""
    machine = lockstep_machine("deferred", "vllm", "priority")
    run_state_machine_as_test(
        machine,
        settings=settings(
            settings.default, max_examples=20, stateful_step_count=40,
            suppress_health_check=list(HealthCheck),
        ),
    )  # fmt: skip
    tally = machine.tally  # type: ignore[attr-defined]
    assert len(tally.steps_per_run) == tally.runs > 0
    assert sum(tally.steps_per_run) == tally.commits
    assert max(tally.steps_per_run) >= 20
    assert sum(tally.coverage.preempt_at_depth) > 0


def test_run_cell_returns_the_runs_depth_and_coverage() -> None:
    result = run_cell("eager-unsafe", "vllm", "priority", seconds=60, seed_value=1)
    assert result.failure is not None
    assert len(result.steps_per_run) == result.runs
    assert sum(result.steps_per_run) == result.commits
    assert result.coverage.preempt_building >= 1  # the seed bug's trigger was reached


def test_hits_shortened_are_read_from_the_events_of_several_groups() -> None:
    """``RunCoverage(kinds, sizes)``: an admission whose group-0 (window) hit is shorter than
    the prefix the full group has published for the request counts as shortened; the same hit
    after the full group's block is evicted does not; without ``sizes`` (the reference engine
    counts its own) nothing is read. (Planted: a comparison that never counts fails the first
    assertion.)"""
    prompt = (1, 2, 3, 4, 5)
    events: list[tuple[object, ...]] = [
        ("arrive", 0, prompt, 1, 0),
        ("publish", 0, 0, 1),
        ("publish", 0, 1, 2),
        ("publish", 0, 0, 3, 1),
        ("publish", 0, 1, 4, 1),
        ("evict", 2),  # the window group's block of tokens 3..4
        ("arrive", 1, prompt, 1, 0),
        ("hit", 1, ()),  # the window serves nothing at 4 now
        ("hit", 1, (), 1),
    ]
    run = RunCoverage(("window", "full"), (2, 2))
    run.observe(events)
    assert run.hits_shortened == 1
    gone = RunCoverage(("window", "full"), (2, 2))
    gone.observe([*events[:6], ("evict", 3), *events[6:]])
    assert gone.hits_shortened == 0
    engine_counts = RunCoverage(("window", "full"))
    engine_counts.observe(events)
    assert engine_counts.hits_shortened == 0 and engine_counts.grouped_runs == 1


def test_slot_group_paths_are_read_from_the_judged_events() -> None:
    """``RunCoverage(kinds)`` with a slot group (SGLang's MAMBA states, ``spec/slots.py``; track
    slots, ``spec/tracks.py``): a slot group's hit is a state hit by copy; a ``snapshot`` into a
    block the request does not hold is a copy, of its own working slot (before the table's
    ``free``) a donation, of a slot a ``track`` effect wrote for it (also after the table's
    ``free``) a track donation; each ``track`` is a track write; ``groups_line`` prints them.
    A state group's hit stays a ``state_hits``, and a run without a slot group prints no slot
    figures. (Planted: a snapshot always counted as a copy, or the slot hits not fed, fails.)"""
    events: list[tuple[object, ...]] = [
        ("arrive", 0, (1, 2, 3, 4), 2, 0),
        ("schedule", 0, 4),
        ("hit", 0, ()),
        ("alloc", 0, 1, 0),
        ("alloc", 0, 10, 1),  # r0's working slot
        ("snapshot", 0, 3, 11, 1),  # a running insert: the slot copied into block 11
        ("finish", 0),
        ("snapshot", 0, 4, 10, 1),  # r0 donates its working slot
        ("free", 1),
        ("free", 10),
        ("arrive", 1, (1, 2, 3, 4, 5, 6), 2, 0),
        ("schedule", 1, 2),
        ("hit", 1, ()),
        ("hit", 1, (11,), 1),  # the state after 4 tokens, copied into r1's slot
        ("alloc", 1, 12, 1),
        ("alloc", 1, 13, 1),  # a track slot
        ("track", 1, 13, 6, 1),
        ("finish", 1),
        ("free", 12),
        ("free", 13),
        ("snapshot", 1, 5, 13, 1),  # the finish donates the slot it tracked
        ("evict", 11),
        ("snapshot", 1, 3, 11, 1),  # block 11 again, by copy: no one holds it
    ]
    run = RunCoverage(("full", "slot"))
    run.observe(events)
    assert (run.slot_hits, run.snapshots_copied, run.snapshots_donated) == (1, 2, 1)
    assert (run.track_writes, run.track_donations, run.slot_runs, run.state_hits) == (1, 1, 1, 0)
    total = Coverage()
    total.add(run)
    assert total.groups_line().endswith(
        "; slot groups: 1 states hit by copy, 2 snapshots by copy, 1 by donation, 1 track "
        "writes, 1 track slots donated"
    )
    state = RunCoverage(("full", "state"))
    state.observe([("arrive", 0, (1, 2), 1, 0), ("hit", 0, ()), ("hit", 0, (5,), 1)])
    assert (state.state_hits, state.slot_hits, state.slot_runs) == (1, 0, 0)
    assert "slot groups" not in state.groups_line()
