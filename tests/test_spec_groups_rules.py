"""Several KV-cache groups (issue #36), the semantics: the hit rule across groups (the largest
length every group's own rule accepts, and vLLM's fixed-point iteration reaching it), a state
group's blocks (written only by a step ending at their boundary, published under it, read by
the step starting there), a window group's skipped frees, and the four invariants of several
groups, each broken by a trace that ``kvspec check`` names by it (or, where only an engine's
own effect can break it, by a planted bug of the spec). Hand-written hybrid traces
(full + window, full + state) hold."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvspec.conformance.check import check_file
from kvspec.conformance.trace import write_trace
from kvspec.spec import Config, apply, check, initial_state
from kvspec.spec import groups as spec_groups
from kvspec.spec.invariants import Violation, running_tables, tables_append_only
from kvspec.spec.state import NULL_BLOCK, Group, Request, State

B = 4
FULL_STATE = (Group("full", B), Group("state", B))
FULL_WINDOW = (Group("full", B), Group("window", B, window=6))
PROMPT = tuple(range(1, 14))  # 13 tokens: three full blocks and one


def _config(groups: tuple[Group, ...] = FULL_STATE, **kw: object) -> Config:
    base: dict[str, object] = dict(num_blocks=24, block_size=B, policy="deferred", groups=groups)
    return Config(**{**base, **kw})  # type: ignore[arg-type]


Event = tuple[object, ...]


def _run(s: State, events: list[Event]) -> list[Event]:
    """Apply each decision, every invariant (TablesAppendOnly too) checked after it; the trace
    (decisions and effects)."""
    trace: list[Event] = []
    for event in events:
        before = running_tables(s)
        effects = apply(s, event)
        assert check(s) is None, (event, check(s))
        assert tables_append_only(before, s) is None, event
        trace += [event, *effects]
    return trace


def _prefill_in_two(rid: int, prompt: tuple[int, ...], first: int, step: int) -> list[Event]:
    """The request's prompt computed in two chunks (``first`` tokens, then the rest), steps
    ``step`` and ``step + 1``, synchronously."""
    return [
        ("arrive", rid, prompt, 2, 0),
        ("begin", step),
        ("schedule", rid, first, 0),
        ("submit", step),
        ("execute", step, ()),
        ("commit", step, ()),
        ("begin", step + 1),
        ("schedule", rid, len(prompt) - first, 0),
        ("submit", step + 1),
        ("execute", step + 1, ()),
        ("commit", step + 1, ((rid, 50),)),
    ]


def test_a_state_is_published_only_at_the_boundary_a_step_ended_at_and_hit_there() -> None:
    """Full + state: r1's prefill ends at 8 then at 13: its state at 8 is published (a step
    ended there), none at 12 (no step ended there). r2, sharing 13 tokens, could take 12 tokens
    of full attention but the state group serves 8 only: the hit is 8 tokens in both groups,
    the state block at position 1 and the null block before it."""
    s = initial_state(_config())
    trace = _run(s, _prefill_in_two(1, PROMPT, 8, 0))
    states = [e for e in trace if e[0] == "publish" and len(e) == 5]
    state_block = s.requests[1].group_tables[0][1]
    assert states == [("publish", 1, 1, state_block, 1)], states
    assert [e for e in trace if e[0] == "publish" and len(e) == 4] == [
        ("publish", 1, i, s.requests[1].table[i]) for i in range(3)
    ]
    effects = _run(s, [("arrive", 2, (*PROMPT, 7), 2, 0), ("begin", 2), ("schedule", 2, 6, 0)])
    hits = [e for e in effects if e[0] == "hit"]
    assert hits == [
        ("hit", 2, tuple(s.requests[1].table[:2])),
        ("hit", 2, (NULL_BLOCK, state_block), 1),
    ], hits
    assert s.requests[2].computed == 14 and s.requests[2].group_tables[0][:2] == [0, state_block]


def test_a_state_group_writes_only_the_block_its_step_ends_in() -> None:
    """A decode inside a block rewrites that block in place (the recurrence moves on); crossing
    a boundary takes a new block; the state blocks before the one the next step reads are freed
    and nulled when the request is next scheduled."""
    s = initial_state(_config())
    _run(s, _prefill_in_two(1, PROMPT, 8, 0))
    table = list(s.requests[1].group_tables[0])
    assert table[0] == table[2] == NULL_BLOCK != table[1]  # states at 8 and 13 only
    effects = _run(s, [("begin", 2), ("schedule", 1, 1, 0)])
    assert effects[2:] == [("free", table[1])], effects  # position 1: no step reads 8 again
    assert s.requests[1].group_tables[0] == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, table[3]]
    _run(s, [("submit", 2), ("execute", 2, ()), ("commit", 2, ((1, 51),))])
    assert s.blocks[table[3]].written == (*PROMPT, 50)  # the state after 14 tokens, in place


def test_a_window_group_frees_its_skipped_blocks_after_group_zero() -> None:
    """Full + window (W = 6): a decode at 13 frees the window group's blocks 0 and 1 (wholly
    before the window 8..13), last first, and nothing of the full group."""
    s = initial_state(_config(FULL_WINDOW))
    _run(s, _prefill_in_two(1, PROMPT, 8, 0))
    window = list(s.requests[1].group_tables[0])
    effects = _run(s, [("begin", 2), ("schedule", 1, 1, 0)])
    assert effects[2:] == [("free", window[1]), ("free", window[0])], effects
    assert s.requests[1].group_tables[0][:2] == [NULL_BLOCK, NULL_BLOCK]


def test_a_window_group_hit_needs_only_its_window() -> None:
    """r1 ran long enough that its window group's first blocks were freed (still published,
    cached); r2's hit of 12 tokens takes the full group's three blocks and the window group's
    two blocks before 12 (W = 6, B = 4), the null block before them."""
    s = initial_state(_config(FULL_WINDOW))
    _run(s, _prefill_in_two(1, PROMPT, 8, 0))
    window = list(s.requests[1].group_tables[0])
    effects = _run(s, [("arrive", 2, (*PROMPT, 7), 2, 0), ("begin", 2), ("schedule", 2, 2, 0)])
    hits = [e for e in effects if e[0] == "hit"]
    assert hits == [
        ("hit", 2, tuple(s.requests[1].table[:3])),
        ("hit", 2, (NULL_BLOCK, window[1], window[2]), 1),
    ], hits


# -- the hit rule: the spec's maximum is vLLM's fixed point ----------------------------------------


def _vllm_fixed_point(s: State, req: Request) -> int:
    """A re-statement of vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``: each
    group's manager searches for its own longest hit no longer than the candidate (full
    attention: the run of published blocks from block 0; sliding window: right to left, the
    first run of ``ceil((W - 1) / B)`` published blocks, else the run from block 0; Mamba in
    align mode: right to left, the first published state), at ends aligned to every group's
    block size; a group that shortens the candidate restarts the loop, until none does."""
    unit = spec_groups.alignment(s)
    length = (len(req.tokens) - 1) // unit * unit

    def published(g: int, i: int) -> bool:
        return spec_groups.first_hit(s, req, g, i) is not None

    def longest(g: int, cap: int) -> int:
        bs, kind = spec_groups.size(s, g), spec_groups.kind(s, g)
        ends = [e for e in range(cap, 0, -1) if e % unit == 0]
        if kind == "full":
            n = 0
            while (n + 1) * bs <= cap and published(g, n):
                n += 1
            return n * bs // unit * unit
        if kind == "state":
            return next((e for e in ends if published(g, e // bs - 1)), 0)
        need = spec_groups.need(s, g)
        for e in ends:
            n = e // bs
            if n >= need and all(published(g, i) for i in range(n - need, n)):
                return e
        n = 0
        while (n + 1) * bs <= cap and n < need and published(g, n):
            n += 1
        return max((e for e in ends if e <= n * bs), default=0)

    while True:
        for g in range(len(s.config.groups)):
            shorter = longest(g, length)
            if shorter < length:
                length = shorter
                break
        else:
            return length


@pytest.mark.parametrize(
    "groups",
    [
        FULL_STATE,
        FULL_WINDOW,
        (Group("full", 4), Group("window", 4, window=9), Group("state", 8)),
        (Group("window", 4, window=5), Group("full", 8), Group("state", 4)),
    ],
)
def test_the_spec_s_maximum_is_vllm_s_fixed_point_on_random_indexes(groups) -> None:
    """On random published indexes (each group's blocks of one token chain published at
    random), the spec's hit length (the largest every group accepts) is the length vLLM's
    iteration stops at. Planted: a state rule that also accepts the boundary before a published
    state (``accepts`` off by one block) makes them differ within these seeds."""
    rng = random.Random(36)
    tokens = list(range(1, 42))
    for _ in range(300):
        s = initial_state(_config(groups))
        req = Request(0, tokens[: rng.randrange(2, len(tokens))], 1, 1, 0, 0)
        block = 1
        for g, group in enumerate(groups):
            for i in range(len(tokens) // group.block_size):
                if rng.random() < 0.7:
                    key = tuple(tokens[: (i + 1) * group.block_size])
                    s.index_of(g)[key] = [block]
                    block += 1
        assert spec_groups.hit_length(s, req) == _vllm_fixed_point(s, req)


# -- the invariants, each named by kvspec check ----------------------------------------------------


def _judged(tmp_path: Path, config: Config, trace: list[Event], judging: str = "strict"):
    path = tmp_path / "t.jsonl"
    write_trace(path, config, trace, engine=("test", "0"), judging=judging)
    return check_file(path)


def _spec_trace(config: Config, events: list[Event]) -> list[Event]:
    """The decisions with the spec's own effects, stopping at nothing (illegal decisions
    raise)."""
    s = initial_state(config)
    out: list[Event] = []
    for event in events:
        out += [event, *apply(s, event)]
    return out


def test_hybrid_traces_hold_under_kvspec_check(tmp_path: Path) -> None:
    """Hand-written full + state and full + window traces, two requests sharing a prefix,
    judged by the spec (the fast model and the incremental checks refuse several groups by
    name): they hold (exit 0)."""
    for groups, after_hit in ((FULL_STATE, 6), (FULL_WINDOW, 2)):
        events = [
            *_prefill_in_two(1, PROMPT, 8, 0),
            ("arrive", 2, (*PROMPT, 7), 2, 0),
            ("begin", 2),
            ("schedule", 1, 1, 0),
            ("schedule", 2, after_hit, 0),
            ("submit", 2),
            ("execute", 2, ()),
            ("commit", 2, ((1, 51), (2, 52))),
        ]
        config = _config(groups)
        result = _judged(tmp_path, config, _spec_trace(config, events))
        assert result.exit_code == 0, result


def _seed_events() -> list[Event]:
    """Priority preemption under an eager policy: r1 (priority 5) is scheduled up to the block
    boundary 8, which publishes its blocks and its state there at schedule time; then the
    step preempts r1 for r2 (priority 0), so the step will never write them."""
    return [
        ("arrive", 1, PROMPT, 2, 5),
        ("arrive", 2, (9, 9, 9, 9, 9), 2, 0),
        ("begin", 0),
        ("schedule", 2, 4, 0),
        ("schedule", 1, 4, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ()),
        ("begin", 1),
        ("schedule", 2, 1, 0),
        ("schedule", 1, 4, 0),
        ("preempt", 1),
    ]


def test_the_seed_question_a_state_published_at_schedule_whose_writer_is_preempted(
    tmp_path: Path,
) -> None:
    """The seed's question for a state group: under ``eager-unsafe`` a state published at
    schedule whose writer is preempted before its step runs is named ``StateAtItsBoundary`` at
    the preemption (the block is published as the state after 8 tokens, and nothing will ever
    write it); a later request that hits it is ``NoUnwrittenStateRead``'s. ``deferred``
    publishes at the commit, so the same decisions hold."""
    events = _seed_events()
    eager = _config(policy="eager-unsafe", preemption="priority")
    result = _judged(tmp_path, eager, _spec_trace(eager, events))
    assert result.exit_code == 1 and result.invariant is not None
    assert result.invariant == "StateAtItsBoundary", result
    safe = _config(policy="deferred", preemption="priority")
    assert _judged(tmp_path, safe, _spec_trace(safe, events)).exit_code == 0
    # the later hit, had nothing named the publish: NoUnwrittenStateRead
    s = initial_state(eager)
    for event in events:
        apply(s, event)
    s.group_index[1].clear()  # hide the state's bad publish from StateAtItsBoundary
    s.blocks[s.requests[2].group_tables[0][-1]].key = None  # (r2's own state, unpublished)
    assert check(s) is None or check(s).invariant != "StateAtItsBoundary"


def test_a_window_block_published_at_schedule_whose_writer_is_preempted(tmp_path: Path) -> None:
    """The seed's question for a window group: the window block published at schedule is a
    K/V block, named ``NoUnwrittenPublish`` (per group) at the preemption."""
    events = _seed_events()
    eager = _config(FULL_WINDOW, policy="eager-unsafe", preemption="priority")
    result = _judged(tmp_path, eager, _spec_trace(eager, events))
    assert result.exit_code == 1 and result.invariant is not None
    assert result.invariant == "NoUnwrittenPublish", result


def test_a_same_step_hit_of_an_eagerly_published_state_is_an_unwritten_state_read(
    tmp_path: Path,
) -> None:
    """Under ``eager-unsafe`` r1's prefill to 8 publishes its state at schedule; r2, admitted
    in the same step, hits it: its recurrence starts from a state the same step has not
    written yet (vLLM's ``MambaManager`` defers such an admission to the next step:
    ``cached_blocks_this_step``). ``kvspec check`` names ``NoUnwrittenStateRead``; the full
    group's K/V of the same step is there (writes before reads)."""
    events = [
        ("arrive", 1, PROMPT, 2, 0),
        ("arrive", 2, (*PROMPT[:8], 7, 7), 2, 0),
        ("begin", 0),
        ("schedule", 1, 8, 0),
        ("schedule", 2, 2, 0),
    ]
    eager = _config(policy="eager-unsafe")
    trace = _spec_trace(eager, events)
    assert ("hit", 2, (NULL_BLOCK, 10), 1) in trace or any(
        e[0] == "hit" and len(e) == 4 and e[2] for e in trace
    ), trace
    result = _judged(tmp_path, eager, trace)
    assert result.exit_code == 1 and result.invariant is not None
    assert result.invariant == "NoUnwrittenStateRead", result


def test_a_hit_one_group_cannot_serve_is_named_by_hit_served_by_every_group(
    tmp_path: Path,
) -> None:
    """Observed judging takes an engine's own hits (each block published where it hits): an
    engine that hits 12 tokens of full attention but the state at 8 (its state group cannot
    serve 12) is named ``HitServedByEveryGroup``; the hit the spec computes (8 in both) holds."""
    config = _config(policy="deferred")
    before = _prefill_in_two(1, PROMPT, 8, 0)
    s = initial_state(config)
    _run(s, before)
    table, state = s.requests[1].table, s.requests[1].group_tables[0]
    admit = [("arrive", 2, (*PROMPT, 7), 2, 0), ("begin", 2), ("schedule", 2, 2, 0)]
    good = _spec_trace(config, before + admit)
    assert _judged(tmp_path, config, good, judging="observed").exit_code == 0
    engine = initial_state(config)  # an engine that takes its hits group by group
    bad = _spec_trace(config, before) + admit[:2]
    for event in before + admit[:2]:
        apply(engine, event)
    engine.steered_hits = [list(table[:3]), [NULL_BLOCK, state[1]]]
    bad += [admit[2], *apply(engine, admit[2])]
    assert bad[-4:-2] == [("hit", 2, tuple(table[:3])), ("hit", 2, (NULL_BLOCK, state[1]), 1)]
    result = _judged(tmp_path, config, bad, judging="observed")
    assert result.exit_code == 1 and result.invariant is not None
    assert result.invariant == "HitServedByEveryGroup", result


def _found_skipping_past_steps_in_flight(
    monkeypatch: pytest.MonkeyPatch, events: list[Event]
) -> Violation | None:
    """Full + window (W = 2), async, depth 3: ``events`` hold on the spec (checked here), then
    the first violation of a spec that skips the window group's blocks on the computed tokens,
    ignoring the steps in flight (None if none)."""
    narrow = (Group("full", B), Group("window", B, window=2))
    config = _config(narrow, depth=3, async_scheduling=True)
    s = initial_state(config)
    _run(s, events)
    assert check(s) is None
    real = spec_groups.remove_skipped
    monkeypatch.setattr(
        spec_groups, "remove_skipped", lambda s, req, processed: real(s, req, req.computed)
    )
    s = initial_state(config)
    found = None
    for event in events:
        apply(s, event)
        found = found or check(s)
    return found


def test_a_window_block_freed_under_a_read_in_flight_is_named_by_no_read_of_recycled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Async scheduling, full + window (W = 2): a spec that frees the window group's skipped
    blocks on the computed tokens, ignoring the steps in flight, frees at step 2 the block of
    positions 4..7, which step 1's prefill chunk from 8 in flight still reads (token 8's window
    is 7..8); ``NoReadOfRecycled`` names it (the correct spec frees nothing there). Only an
    engine's own frees can do this, which strict judging reports as a disagreement first."""
    events = [
        ("arrive", 1, PROMPT, 5, 0),
        ("begin", 0),
        ("schedule", 1, 8, 0),
        ("submit", 0),
        ("begin", 1),
        ("schedule", 1, 4, 0),
        ("submit", 1),
        ("begin", 2),
        ("schedule", 1, 1, 0),
    ]
    found = _found_skipping_past_steps_in_flight(monkeypatch, events)
    assert found is not None and found.invariant == "NoReadOfRecycled", found


def test_a_window_block_freed_under_its_writer_in_flight_is_named_by_no_read_of_recycled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Async scheduling, full + window (W = 2): step 0's prefill chunk (tokens 0..7) is in
    flight when step 1 schedules 8..11; a spec that skips on the computed tokens, ignoring the
    steps in flight, frees the window group's block 0, which step 0 writes and whose tokens its
    own later tokens attend to (token 1's window is 0..1). ``NoReadOfRecycled`` names it: a
    window step reads its own blocks (``groups.window_blocks_in_flight``), as group 0's clause
    of ``NoUnwrittenRead`` says. Planted: with the invariant reading only the blocks before the
    step's start (``reads_in_flight``), nothing is named."""
    events = [
        ("arrive", 1, PROMPT, 5, 0),
        ("begin", 0),
        ("schedule", 1, 8, 0),
        ("submit", 0),
        ("begin", 1),
        ("schedule", 1, 4, 0),
    ]
    found = _found_skipping_past_steps_in_flight(monkeypatch, events)
    assert found is not None and found.invariant == "NoReadOfRecycled", found
    assert found.step == 0 and "group 1 block 0" in found.sentence, found


# -- random walks of the spec with several groups ---------------------------------------------------


def _walk(config: Config, rng: random.Random, decisions: int = 120) -> list[Event]:
    """A random walk of the spec: decisions drawn from the state, each kept if the spec takes
    it (tried on a copy), every state checked against every invariant by the caller."""
    import copy

    from kvspec.spec.state import Illegal

    s = initial_state(config)
    taken: list[Event] = []
    next_id = 0
    for _ in range(decisions):
        building = s.building
        kind = rng.choice(("arrive", "schedule", "schedule", "schedule", "preempt", "step", "step"))
        if kind == "arrive":
            prompt = tuple(rng.choice((1, 1, 1, 2)) for _ in range(rng.randrange(2, 14)))
            event: Event = ("arrive", next_id, prompt, rng.randrange(1, 4), rng.randrange(3))
            next_id += 1
        elif kind in ("schedule", "preempt") and building is not None:
            live = sorted(s.waiting) + sorted(s.running)
            if not live:
                continue
            rid = rng.choice(live)
            req = s.requests[rid]
            ahead = len(s.ahead(req) if config.async_scheduling else req.tokens)
            tokens = rng.choice((1, 3, 4, max(1, ahead - req.computed), 8))
            event = ("preempt", rid) if kind == "preempt" else ("schedule", rid, tokens, 0)
        elif building is not None:
            event = ("submit", building.id)
        elif s.steps and s.steps[0].phase == "executed" and rng.random() < 0.6:
            first = s.steps[0]
            sampled = tuple(
                (rid, rng.randrange(1, 3))
                for rid, e in first.entries.items()
                if e.samples and rid in first.live
            )
            event = ("commit", first.id, sampled)
        elif any(st.phase == "submitted" for st in s.steps) and rng.random() < 0.6:
            event = ("execute", next(st.id for st in s.steps if st.phase == "submitted"), ())
        else:
            event = ("begin", s.next_step)
        trial = copy.deepcopy(s)
        try:
            apply(trial, event)
        except Illegal:
            continue
        before = running_tables(s)
        apply(s, event)
        taken.append(event)
        found = check(s)
        assert found is None, (config, taken, found)
        assert tables_append_only(before, s) is None, (config, taken)
    return taken


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted"])
def test_walks_with_several_groups_hold_every_invariant(policy: str) -> None:
    """Random walks of the spec under the safe policies, with full + state, full + window and
    three groups of two block sizes, synchronous and under async scheduling: every state holds
    every invariant, group 0's table changes only at its end (or to the null block of a
    window), and the walks reach hits of several groups."""
    rng = random.Random(36)
    shapes = [
        FULL_STATE,
        FULL_WINDOW,
        (Group("full", 2), Group("window", 2, window=3), Group("state", 4)),
        (Group("window", 2, window=5), Group("state", 2)),
    ]
    hits = 0
    for walk in range(24):
        groups = shapes[walk % len(shapes)]
        async_scheduling = walk % 3 == 2
        config = _config(
            groups,
            block_size=groups[0].block_size,
            num_blocks=rng.randrange(12, 30),
            policy=policy,
            depth=2 if async_scheduling else rng.choice((1, 2)),
            async_scheduling=async_scheduling,
            token_budget=rng.choice((6, 16)),
            discipline=rng.choice(("vllm", "general")),
            preemption=rng.choice(("fcfs", "priority")),
        )
        s = initial_state(config)
        for event in _walk(config, rng):
            for effect in apply(s, event):
                hits += effect[0] == "hit" and len(effect) == 4 and any(effect[2])
    assert hits > 10, hits
