"""Sliding window, one KV-cache group (``Config.sliding_window``, vLLM's ``SlidingWindowManager``
alone): a hit needs the ``ceil((W - 1) / B)`` blocks just before its end and the table holds the
null block before them; a running request's blocks wholly before the window of its next
*processed* token are freed and replaced by the null block when it is next scheduled; a step
reads only its window. The scenarios are those of vLLM 0.33.0's
``tests/v1/core/test_swa_inflight_window_free.py`` and of ``SlidingWindowManager``'s hit rule,
at small sizes; the planted bugs (a free on the optimistic count, a hit that ignores the
window's contiguity rule) are caught by ``NoUnwrittenRead``; random walks of the spec under a
window hold every invariant; full attention is unchanged; the fast and Z3 models refuse a
window by name and the judge falls back to the full invariant definitions."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from spec_walks import spec_runs

from kvspec.spec import Config, apply, check, initial_state
from kvspec.spec import actions as spec_actions
from kvspec.spec import pool as spec_pool
from kvspec.spec.invariants import running_tables, tables_append_only
from kvspec.spec.state import NULL_BLOCK, State

PROMPT = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)  # two full blocks of 4 and two tokens


def _config(**kw: object) -> Config:
    base: dict[str, object] = dict(
        num_blocks=12, block_size=4, depth=1, sliding_window=4, policy="deferred"
    )
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def _run(s: State, events: list[tuple[object, ...]]) -> list[list[tuple[object, ...]]]:
    """Apply each decision, every invariant (TablesAppendOnly too) checked after it."""
    out = []
    for event in events:
        before = running_tables(s)
        out.append(apply(s, event))
        assert check(s) is None, (event, check(s))
        assert tables_append_only(before, s) is None, event
    return out


def test_sync_frees_the_skipped_blocks_at_the_first_decode() -> None:
    """vLLM's ``test_swa_free_immediate_when_sync``: with no step in flight, the next schedule
    frees the blocks wholly before the window ((10 - 4 + 1) // 4 = 1 block) and puts the null
    block in their place."""
    s = initial_state(_config())
    _run(
        s,
        [
            ("arrive", 1, PROMPT, 5, 0),
            ("begin", 0),
            ("schedule", 1, 10, 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((1, 11),)),
        ],
    )
    table = list(s.requests[1].table)
    _, effects = _run(s, [("begin", 1), ("schedule", 1, 1, 0)])
    assert effects[0] == ("free", table[0])
    assert s.requests[1].table == [NULL_BLOCK] + table[1:]
    assert s.blocks[table[0]].refcount == 0 and table[0] in s.free
    # cached (published at commit): to the tail, where a later hit may still find it
    assert s.free[-1] == table[0] and s.blocks[table[0]].key is not None
    _run(s, [("submit", 1), ("execute", 1, ()), ("commit", 1, ((1, 12),))])


def test_async_keeps_the_blocks_a_step_in_flight_reads() -> None:
    """vLLM's ``test_swa_free_waits_for_in_flight_step``: a decode scheduled while the prefill
    is in flight frees nothing (processed tokens: 10 - 10 = 0); after the prefill's output the
    next schedule frees the skipped block, and the one after it the next one (never block 0
    twice)."""
    s = initial_state(_config(depth=2, async_scheduling=True))
    _run(
        s,
        [
            ("arrive", 1, PROMPT, 5, 0),
            ("begin", 0),
            ("schedule", 1, 10, 0),
            ("submit", 0),
            ("begin", 1),
            ("schedule", 1, 1, 0),
            ("submit", 1),
        ],
    )
    table = list(s.requests[1].table)
    assert NULL_BLOCK not in table
    _run(s, [("execute", 0, ()), ("commit", 0, ((1, 11),))])
    (_, effects) = _run(s, [("begin", 2), ("schedule", 1, 1, 0)])  # processed: 12 - 1 = 11
    assert effects[:1] == [("free", table[0])]
    assert s.requests[1].table[:2] == [NULL_BLOCK, table[1]]
    _run(s, [("submit", 2), ("execute", 1, ()), ("commit", 1, ((1, 12),))])
    (_, effects) = _run(s, [("begin", 3), ("schedule", 1, 1, 0)])  # processed 11: block 1
    assert [e for e in effects if e[0] == "free"] == [("free", table[1])]  # not block 0 again
    assert s.requests[1].table[:3] == [NULL_BLOCK, NULL_BLOCK, table[2]]


def _shared_prefix(cfg: Config, prompt: tuple[int, ...]) -> State:
    """Request 1 computes ``prompt`` (its full blocks published at commit) and finishes."""
    s = initial_state(cfg)
    _run(
        s,
        [
            ("arrive", 1, prompt, 1, 0),
            ("begin", 0),
            ("schedule", 1, len(prompt), 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((1, 99),)),
        ],
    )
    return s


def test_a_hit_needs_the_window_s_blocks_and_holds_null_before_them() -> None:
    """W = 6, B = 4: a hit ending at block 4 needs blocks 2 and 3 (ceil(5 / 4) = 2); the table
    holds the null block at 0 and 1, which nobody references."""
    prompt = tuple(range(1, 18))  # four full blocks and one token
    s = _shared_prefix(_config(sliding_window=6), prompt)
    published = [s.index[tuple(prompt[: 4 * (i + 1)])][0] for i in range(4)]
    (_, _, effects) = _run(s, [("arrive", 2, prompt, 2, 0), ("begin", 1), ("schedule", 2, 1, 0)])
    assert effects[0] == ("hit", 2, (NULL_BLOCK, NULL_BLOCK, published[2], published[3]))
    assert s.requests[2].table[:4] == [NULL_BLOCK, NULL_BLOCK] + published[2:]
    assert [s.blocks[b].refcount for b in published] == [0, 0, 1, 1]
    assert s.blocks[NULL_BLOCK].refcount == 0
    _run(s, [("submit", 1), ("execute", 1, ()), ("commit", 1, ((2, 5),))])


def test_without_the_window_s_run_the_hit_is_the_run_from_block_zero() -> None:
    """W = 9, B = 4 needs 2 blocks; with only block 0 published there is no such run and the
    hit is block 0 alone (nothing before it skipped)."""
    prompt = tuple(range(1, 6))  # one full block and one token
    s = _shared_prefix(_config(sliding_window=9), prompt)
    longer = prompt[:4] + (50, 51, 52, 53, 54)
    (_, _, effects) = _run(s, [("arrive", 2, longer, 2, 0), ("begin", 1), ("schedule", 2, 5, 0)])
    assert effects[0] == ("hit", 2, (s.index[prompt[:4]][0],))


def test_full_attention_is_unchanged() -> None:
    """Without a window the same decode frees nothing and the hit is the run from block 0."""
    s = initial_state(_config(sliding_window=None))
    _run(
        s,
        [
            ("arrive", 1, PROMPT, 5, 0),
            ("begin", 0),
            ("schedule", 1, 10, 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((1, 11),)),
        ],
    )
    (_, effects) = _run(s, [("begin", 1), ("schedule", 1, 1, 0)])
    assert effects == [] and NULL_BLOCK not in s.requests[1].table


def test_planted_free_on_the_optimistic_count_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec that frees skipped blocks on the computed tokens, ignoring the steps in flight:
    step 1's schedule frees block 0, which the prefill in flight still reads (and step 2's
    block 1, which step 1's decode at position 10, window 7..10, reads). NoUnwrittenRead names
    it; the correct spec frees nothing there."""
    events = [
        ("arrive", 1, PROMPT, 5, 0),
        ("begin", 0),
        ("schedule", 1, 10, 0),
        ("submit", 0),
        ("begin", 1),
        ("schedule", 1, 1, 0),
        ("submit", 1),
        ("begin", 2),
        ("schedule", 1, 1, 0),
    ]
    cfg = _config(depth=3, async_scheduling=True)
    _run(initial_state(cfg), events)
    monkeypatch.setattr(spec_actions, "_in_flight", lambda s, rid: 0)
    s = initial_state(cfg)
    found = []
    for event in events:
        apply(s, event)
        found.append(check(s))
    # step 1's schedule frees block 0 while the prefill in flight still reads it
    assert found[:5] == [None] * 5
    assert found[5] is not None and found[5].invariant == "NoUnwrittenRead", found[5]
    assert "window skipped it" in found[5].sentence and found[5].step == 0


def test_planted_free_past_a_decode_in_flight_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bug once the prefill has committed: step 2's schedule frees block 1 (12 tokens
    computed), which step 1's decode in flight (position 10, window 7..10) still reads; the
    correct spec frees block 0 only (10 tokens processed)."""
    first = [
        ("arrive", 1, PROMPT, 5, 0),
        ("begin", 0),
        ("schedule", 1, 10, 0),
        ("submit", 0),
        ("begin", 1),
        ("schedule", 1, 1, 0),
        ("submit", 1),
        ("execute", 0, ()),
        ("commit", 0, ((1, 11),)),
        ("begin", 2),
    ]
    cfg = _config(depth=3, async_scheduling=True)
    s = initial_state(cfg)
    _run(s, first)
    table = list(s.requests[1].table)
    (effects,) = _run(s, [("schedule", 1, 1, 0)])
    assert [e for e in effects if e[0] == "free"] == [("free", table[0])]
    s = initial_state(cfg)
    _run(s, first)
    monkeypatch.setattr(spec_actions, "_in_flight", lambda s, rid: 0)
    apply(s, ("schedule", 1, 1, 0))
    found = check(s)
    assert found is not None and found.invariant == "NoUnwrittenRead", found
    assert found.step == 1 and found.blocks == (table[1],) and "window skipped" in found.sentence


def test_planted_hit_that_ignores_the_window_rule_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup that takes one published block as enough (W = 6, B = 4 needs two) puts the null
    block inside the window of the first token computed: the step reads it, and NoUnwrittenRead
    names block 0."""
    prompt = tuple(range(1, 18))
    cfg = _config(sliding_window=6)
    real = spec_pool.window_lookup

    def short(s: State, req: object, cap: int) -> list[int]:
        hits = real(s, req, cap)  # type: ignore[arg-type]
        return [NULL_BLOCK] * (len(hits) - 1) + hits[-1:]

    monkeypatch.setattr(spec_pool, "window_lookup", short)
    s = _shared_prefix(cfg, prompt)
    found = None
    for event in [("arrive", 2, prompt, 2, 0), ("begin", 1), ("schedule", 2, 1, 0)]:
        apply(s, event)
        found = found or check(s)
    assert found is not None and found.invariant == "NoUnwrittenRead", found
    assert found.blocks == (NULL_BLOCK,)


def test_a_null_block_inside_the_window_is_misplaced() -> None:
    """NullBlockPinned: the null block may stand only before the window of the next token."""
    s = _shared_prefix(_config(sliding_window=6), tuple(range(1, 18)))
    _run(s, [("arrive", 2, tuple(range(1, 18)), 2, 0), ("begin", 1), ("schedule", 2, 1, 0)])
    assert check(s) is None
    s.requests[2].table[2] = NULL_BLOCK  # position 2 is inside the window of token 17
    found = check(s, ["NullBlockPinned"])
    assert found is not None and found.requests == (2,)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(run=spec_runs(max_steps=200, window=True))
def test_walks_under_a_window_hold_every_invariant(
    run: tuple[Config, list[tuple[object, ...]]],
) -> None:
    """Random walks of the spec with a sliding window and the safe policy: every state holds
    every invariant, and tables change only at their end or to the null block at their head."""
    from kvspec.spec.events import DECISIONS

    config, events = run
    s = initial_state(config)
    for event in events:
        if event[0] not in DECISIONS:
            continue
        before = running_tables(s)
        apply(s, event)
        assert check(s) is None, (event, check(s))
        assert tables_append_only(before, s) is None, event


def test_the_fast_and_z3_models_refuse_a_window() -> None:
    """Declared out of their scope (kvspec/twins.py): refused by name; the judge checks a window
    with the full invariant definitions, not the incremental ones."""
    from kvspec.conformance.monitor import Monitor
    from kvspec.judge.fastmodel import FastModel, restates
    from kvspec.judge.spec_model import SpecModel
    from kvspec.proofs.symbolic import Fragment

    assert not restates(_config()) and restates(_config(sliding_window=None))
    with pytest.raises(ValueError, match="sliding_window"):
        FastModel(_config())
    with pytest.raises(ValueError, match="sliding window"):
        Fragment(Config(4, 1, sliding_window=2))
    assert Monitor.fast(_config()).run is None  # the spec judges
    assert SpecModel(_config()).incremental is None
    assert SpecModel(_config(sliding_window=None)).incremental is not None


@pytest.mark.parametrize("discipline", ["vllm", "general"])
def test_the_reference_engine_with_a_window_conforms(discipline: str) -> None:
    """Lockstep: the reference engine (its own window hit rule, skipped-block frees on its own
    count of the tokens in flight) emits the spec's effects event by event, and its refcounts
    and free queue are the spec's before every decision; hits with null blocks and skipped
    frees happen."""
    import random
    from collections import Counter

    from test_reference import drive, recording_engine, replay

    from kvspec.reference import EngineConfig

    seen: Counter[str] = Counter()
    for depth in (1, 2, 3):
        for asynchronous in (False, True):
            for seed in range(4):
                if asynchronous and depth == 1:
                    continue
                rng = random.Random(f"window-{discipline}-{depth}-{asynchronous}-{seed}")
                cfg = EngineConfig(
                    num_blocks=rng.randint(6, 12),
                    block_size=rng.randint(1, 3),
                    depth=depth,
                    policy="deferred",
                    discipline=discipline,
                    preemption=rng.choice(["fcfs", "priority"]),
                    token_budget=rng.randint(3, 10),
                    max_running=rng.randint(1, 4),
                    stop_token=0,
                    vocab=3,
                    async_scheduling=asynchronous,
                    stale_output=rng.choice(["drop", "deliver"]) if depth > 1 else "drop",
                    defer_free=rng.random() < 0.3,
                    sliding_window=rng.randint(1, 5),
                )
                eng, rec = recording_engine(cfg, seed, fail_rate=0.3)
                drive(eng, rng, num_requests=rng.randint(4, 10))
                rec.snapshots.append(eng.snapshot())
                s = replay(cfg, rec, rec.snapshots)
                assert check(s) is None
                events = list(rec)
                seen["null hits"] += sum(1 for e in events if e[0] == "hit" and 0 in e[2])
                seen["skipped frees"] += sum(
                    1
                    for e, nxt in zip(events, events[1:], strict=False)
                    if e[0] == "schedule" and nxt[0] == "free"  # before any alloc: skipped
                )
    assert seen["null hits"] > 5 and seen["skipped frees"] > 5, seen


def _window_trace(cfg: Config) -> list[tuple[object, ...]]:
    """The synchronous skipped-free scenario, decisions and effects, as the spec makes them."""
    s, trace = initial_state(cfg), []
    for event in [
        ("arrive", 1, PROMPT, 5, 0),
        ("begin", 0),
        ("schedule", 1, 10, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ((1, 11),)),
        ("begin", 1),
        ("schedule", 1, 1, 0),
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, ((1, 12),)),
    ]:
        trace.append(event)
        trace += apply(s, event)
    return trace


def test_the_trace_header_carries_the_window_and_old_traces_read_as_full_attention(
    tmp_path: Path,
) -> None:
    from kvspec.conformance.trace import read_trace, write_trace

    cfg = _config()
    trace = _window_trace(cfg)
    path = tmp_path / "t.jsonl"
    write_trace(path, cfg, trace, engine=("test", "0"))
    header = json.loads(path.read_text().splitlines()[0])
    assert header["model"]["sliding_window"] == 4
    read = read_trace(path)
    assert read[0] == cfg and list(read[1]) == trace
    lines = path.read_text().splitlines()
    header["model"]["sliding_window"] = "4"
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(Exception, match="sliding_window"):
        read_trace(path)
    del header["model"]["sliding_window"]  # a trace written before the field: full attention
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert read_trace(path)[0] == replace(cfg, sliding_window=None)
    write_trace(path, replace(cfg, sliding_window=None), [], engine=("test", "0"))
    assert "sliding_window" not in json.loads(path.read_text().splitlines()[0])["model"]


def test_kvspec_check_judges_a_window_by_the_spec(tmp_path: Path) -> None:
    """``kvspec check`` judges a window trace by the spec: it holds, and the same events judged
    as full attention do not (the skipped block's free is not a full-attention effect)."""
    from kvspec.conformance.check import check_file
    from kvspec.conformance.trace import write_trace

    cfg = _config()
    trace = _window_trace(cfg)
    path = tmp_path / "t.jsonl"
    write_trace(path, cfg, trace, engine=("test", "0"))
    assert check_file(path).exit_code == 0
    write_trace(path, replace(cfg, sliding_window=None), trace, engine=("test", "0"))
    assert check_file(path).exit_code == 1
