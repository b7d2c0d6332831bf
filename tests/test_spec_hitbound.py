"""Bounded prefix-cache hits (``docs/model.md``, "Bounded hits"): an admission's ``schedule``
decision may carry ``bound``, the engine's bound on the hit in tokens (an aux output connector's
cap, a request's bounded or skipped read); the spec's hit is then exactly min(the longest cached
prefix, ``bound // block_size``) blocks, the blocks past it are allocated fresh and recomputed,
and their publish registers a second block under a hash already cached (as vLLM's
``BlockHashToBlockMap.insert`` keeps duplicates), later lookups hitting the first.

Each form that follows the rule shows it here: the spec, the fast model (source, not the compiled
build), the trace format, and the reference engine in lockstep; a planted engine that ignores the
bound, or bounds one block short, is a finding."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvspec.conformance.monitor import Monitor
from kvspec.conformance.report import describe
from kvspec.conformance.trace import event_error, parse_object, to_json
from kvspec.judge.fastmodel import FastModel
from kvspec.reference import DefaultChoices, Engine, EngineConfig
from kvspec.reference.request import Request as EngineRequest
from kvspec.spec import Config, Illegal, apply, initial_state
from kvspec.spec.state import State

BSZ = 4
PROMPT = tuple(range(1, 14))  # 13 tokens: three full blocks before the last token's block


def config(**kw: Any) -> Config:
    return Config(num_blocks=16, block_size=BSZ, token_budget=64, **kw)


def cached_then(bound: int | None, cfg: Config | None = None) -> tuple[State, list[object]]:
    """r0 computes PROMPT and finishes (its three full blocks stay cached); r1, the same prompt,
    is admitted with ``bound``: the effects of r1's admission."""
    s = initial_state(cfg or config())
    for decision in (
        ("arrive", 0, PROMPT, 1, 0),
        ("begin", 0),
        ("schedule", 0, len(PROMPT)),
        ("submit", 0),
        ("execute", 0),
        ("commit", 0, ((0, 99),)),
        ("arrive", 1, PROMPT, 2, 0),
        ("begin", 1),
    ):
        apply(s, decision)
    decision: tuple[object, ...] = ("schedule", 1, 1)
    if bound is not None:
        decision = ("schedule", 1, len(PROMPT) - (min(bound // BSZ, 3)) * BSZ, 0, bound)
    else:
        decision = ("schedule", 1, 1, 0)
    return s, apply(s, decision)


def hit_of(effects: list[object]) -> tuple[int, ...]:
    (hit,) = [e for e in effects if isinstance(e, tuple) and e[0] == "hit"]
    return tuple(hit[2])


@pytest.mark.parametrize(
    ("bound", "blocks"),
    [(None, 3), (100, 3), (12, 3), (11, 2), (8, 2), (5, 1), (4, 1), (3, 0), (0, 0)],
)
def test_the_hit_is_the_longest_cached_prefix_under_the_bound(
    bound: int | None, blocks: int
) -> None:
    s, effects = cached_then(bound)
    cached = [s.index[s.key(s.requests[0], i)][0] for i in range(3)]
    assert hit_of(effects) == tuple(cached[:blocks])
    assert s.requests[1].table[:blocks] == cached[:blocks]
    assert s.requests[1].cached == blocks


def test_blocks_past_the_bound_are_fresh_and_publish_a_second_copy() -> None:
    """The bounded request recomputes blocks 1 and 2 into fresh blocks; publishing them puts a
    second block under each hash already cached (vLLM keeps both), and a later lookup hits the
    first one published."""
    s, effects = cached_then(4)
    r0_table = [s.index[s.key(s.requests[0], i)][0] for i in range(3)]
    r1 = s.requests[1]
    assert hit_of(effects) == (r0_table[0],)
    assert not set(r1.table[1:3]) & set(r0_table)  # fresh blocks past the bound
    for decision in (("submit", 1), ("execute", 1), ("commit", 1, ((1, 99),))):
        apply(s, decision)
    for i in (1, 2):
        assert s.index[s.key(r1, i)] == [r0_table[i], r1.table[i]], i
    apply(s, ("arrive", 2, PROMPT, 1, 0))
    apply(s, ("begin", 2))
    assert hit_of(apply(s, ("schedule", 2, 1))) == tuple(r0_table)


def test_a_bound_on_a_running_request_is_illegal() -> None:
    s, _ = cached_then(None)
    apply(s, ("submit", 1))
    apply(s, ("execute", 1))
    apply(s, ("commit", 1, ((1, 99),)))
    apply(s, ("begin", 2))
    with pytest.raises(Illegal, match="hit bound"):
        apply(s, ("schedule", 1, 1, 0, 4))


def test_the_fast_model_takes_the_same_bound() -> None:
    """The fast model's expected effects equal the spec's for bounded admissions."""
    for bound in (0, 3, 4, 8, 12, 40, None):
        cfg = config()
        s, spec_effects = cached_then(bound, cfg)
        fast = FastModel(cfg)
        decisions: list[tuple[object, ...]] = [
            ("arrive", 0, PROMPT, 1, 0),
            ("begin", 0),
            ("schedule", 0, len(PROMPT), 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((0, 99),)),
            ("arrive", 1, PROMPT, 2, 0),
            ("begin", 1),
        ]
        for d in decisions:
            fast.apply(d)
        last: tuple[object, ...] = (
            ("schedule", 1, 1, 0)
            if bound is None
            else ("schedule", 1, len(PROMPT) - min(bound // BSZ, 3) * BSZ, 0, bound)
        )
        assert [tuple(e) for e in fast.apply(last)] == spec_effects, bound


@pytest.mark.parametrize("bound", [0, 7])
def test_the_trace_format_keeps_a_bound_of_zero_and_drops_none(bound: int) -> None:
    bounded = ("schedule", 1, 5, 0, bound)
    line = to_json(bounded)
    assert line["bound"] == bound
    assert parse_object(line, 16)[0] == bounded
    unbounded = ("schedule", 1, 5, 0)
    assert "bound" not in to_json(unbounded)
    assert parse_object(to_json(unbounded), 16)[0] == unbounded
    assert event_error(bounded, 16) is None
    assert event_error(("schedule", 1, 5, 0, -1), 16) is not None
    assert describe(bounded) == f"schedule r1 for 5 tokens, its hit bounded to {bound} tokens"


# -- the reference engine in lockstep, and planted engines -----------------------------------


def _engine(limits: dict[int, int | None]) -> Engine:
    cfg = EngineConfig(num_blocks=24, block_size=BSZ, token_budget=16, depth=1)
    eng = Engine(cfg, DefaultChoices())
    rng = random.Random(7)
    prefixes = [tuple(rng.randrange(50) for _ in range(10)) for _ in range(2)]
    for rid in range(12):
        prompt = prefixes[rid % 2] + tuple(rng.randrange(50) for _ in range(rng.randrange(1, 6)))
        eng.add_request(rid, prompt, 3, 0, read_limit=limits.get(rid))
        eng.step()
    eng.run(max_steps=2000)
    assert not eng.has_unfinished()
    return eng


LIMITS: dict[int, int | None] = {2: 0, 3: 4, 5: 7, 6: 9, 8: 100, 9: 0, 11: 5}


def _judge(events: list[tuple[object, ...]]) -> object:
    cfg = Config(num_blocks=24, block_size=BSZ, token_budget=16, depth=1)
    monitor = Monitor.on_spec(cfg, raise_on_finding=False)
    for event in events:
        finding = monitor.feed(event)
        if finding is not None:
            return finding
    return monitor.close()


def test_the_reference_engine_with_bounded_reads_conforms() -> None:
    eng = _engine(LIMITS)
    bounded = [e for e in eng.events if e[0] == "schedule" and len(e) == 5]
    assert {e[4] for e in bounded} >= {0, 4, 7}  # the bounds were given
    assert _judge(list(eng.events)) is None


def _lookup_ignoring_bound(self: Any, req: EngineRequest) -> list[Any]:
    limit, req.read_limit = req.read_limit, None
    try:
        return ORIGINAL_LOOKUP(self, req)  # type: ignore[no-any-return]
    finally:
        req.read_limit = limit


def _lookup_one_block_short(self: Any, req: EngineRequest) -> list[Any]:
    hits = ORIGINAL_LOOKUP(self, req)
    return hits[:-1] if req.read_limit is not None and hits else hits  # type: ignore[no-any-return]


from kvspec.reference.kv_cache_manager import KVCacheManager  # noqa: E402

ORIGINAL_LOOKUP = KVCacheManager.lookup


@pytest.mark.parametrize("planted", [_lookup_ignoring_bound, _lookup_one_block_short])
def test_a_lookup_that_does_not_take_the_bound_is_a_finding(
    planted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(KVCacheManager, "lookup", planted)
    eng = _engine(LIMITS)
    finding = _judge(list(eng.events))
    assert finding is not None
    assert "hit" in str(finding).lower()


def test_kvspec_check_judges_a_trace_with_bounds(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvspec check`` reads the trace's ``bound`` (the fast reader hands such lines to the
    full parser) and judges it: the reference engine's trace holds, a planted engine's does
    not."""
    from kvspec.conformance.check import check_file
    from kvspec.conformance.trace import write_trace

    cfg = Config(num_blocks=24, block_size=BSZ, token_budget=16, depth=1)
    path = tmp_path / "t.jsonl"
    write_trace(path, cfg, list(_engine(LIMITS).events), engine=("test", "0"))
    assert '"bound":0' in path.read_text().replace(" ", "")
    assert check_file(path).exit_code == 0
    monkeypatch.setattr(KVCacheManager, "lookup", _lookup_ignoring_bound)
    write_trace(path, cfg, list(_engine(LIMITS).events), engine=("test", "0"))
    assert check_file(path).exit_code == 1
