"""The pool machine (``spec/pool_machine.py``) and the pool-level judge (``conformance/pool_judge.py``).

Each invariant is shown to fail on the state it guards against, each guard on the decision it
refuses, and the judge on the engine streams that break them; a run of random legal decisions
keeps every invariant.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.conformance.pool_judge import PoolJudge
from kvspec.spec import Illegal
from kvspec.spec.pool_machine import (
    POOL_INVARIANTS,
    apply_pool,
    check_pool,
    initial_pool,
)


def play(num_blocks: int, *decisions: tuple[object, ...]) -> tuple[object, list[object]]:
    s = initial_pool(num_blocks)
    effects: list[object] = []
    for decision in decisions:
        effects += apply_pool(s, decision)
    return s, effects


def test_allocate_takes_the_head_and_evicts_what_it_reuses() -> None:
    s, effects = play(
        4,
        ("allocate", 0, 2),
        ("publish", 0, 1, "k0"),
        ("free", 0, (2, 1)),  # 2 unkeyed: to the head; 1 keyed: to the tail
    )
    assert effects == [("alloc", 0, 1), ("alloc", 0, 2)]
    assert s.free == [2, 3, 1]
    s, effects = play(
        4, ("allocate", 0, 3), ("publish", 0, 1, "k"), ("free", 0, (1, 2, 3)), ("allocate", 1, 3)
    )
    assert s.free == [] and s.index == {}
    assert effects[-4:] == [("alloc", 1, 2), ("alloc", 1, 3), ("evicted", 1), ("alloc", 1, 1)]
    assert check_pool(s) is None


def test_a_freed_batch_of_unkeyed_blocks_keeps_its_order_at_the_head() -> None:
    s, _ = play(6, ("allocate", 0, 3), ("free", 0, (3, 1, 2)))
    assert s.free[:3] == [3, 1, 2]  # vLLM's prepend_n, not pool.release's one at a time


def test_lookup_takes_the_first_registration_and_stops_at_a_miss() -> None:
    s, _ = play(
        6,
        ("allocate", None, 3),
        ("publish", None, 1, "a"),
        ("publish", None, 2, "a"),
        ("publish", None, 3, "c"),
    )
    assert apply_pool(s, ("lookup", 7, ("a", "b", "c"))) == [("hit", 7, (1,))]


def test_touch_before_allocate_fails_when_a_pending_hit_is_reused() -> None:
    s, _ = play(
        4, ("allocate", 0, 3), ("publish", 0, 1, "k"), ("free", 0, (3, 2, 1)), ("slots", 1, (1,))
    )
    assert s.free == [3, 2, 1]
    apply_pool(s, ("allocate", 1, 3))  # the hit (block 1) is the third block handed out
    violation = POOL_INVARIANTS["TouchBeforeAllocate"](s)
    assert violation is not None and violation.blocks == (1,) and violation.requests == (1,)
    s, _ = play(  # touched first: the allocation cannot reach it
        4,
        ("allocate", 0, 3),
        ("publish", 0, 1, "k"),
        ("free", 0, (3, 2, 1)),
        ("slots", 1, (1,)),
        ("touch", 1, (1,)),
        ("allocate", 1, 2),
        ("slots_done", 1),
    )
    assert check_pool(s) is None


@pytest.mark.parametrize(
    "name, break_it",
    [
        ("RefcountIsHolders", lambda s: setattr(s.blocks[1], "refcount", 2)),
        ("FreeQueueExact", lambda s: s.free.append(1)),
        ("HashIndexConsistent", lambda s: setattr(s.blocks[1], "key", "stale")),
        ("NullBlockPinned", lambda s: s.free.append(0)),
    ],
)
def test_each_invariant_fails_on_the_state_it_guards_against(name: str, break_it: object) -> None:
    s, _ = play(4, ("allocate", 0, 1), ("publish", 0, 1, "k"))
    assert POOL_INVARIANTS[name](s) is None
    break_it(s)  # type: ignore[operator]
    violation = POOL_INVARIANTS[name](s)
    assert violation is not None and violation.invariant == name


@pytest.mark.parametrize(
    "decision",
    [
        ("free", 0, (1,)),  # not held: a double free
        ("free", 5, (2,)),  # held by someone else
        ("touch", 0, (0,)),  # the null block
        ("allocate", 0, 9),  # more than are free
        ("publish", 0, 0, "k"),  # the null block
        ("publish", 0, 2, "other"),  # a second key
        ("reset",),  # a block is referenced
        ("slots", 1, (3,)),  # a hit that is not cached
        ("evict", 99),  # no such block
        ("lookup",),  # malformed
        ("no-such-action",),
    ],
)
def test_each_guard_refuses_its_decision(decision: tuple[object, ...]) -> None:
    s, _ = play(4, ("allocate", 0, 2), ("publish", 0, 2, "k"), ("free", 0, (1,)))
    with pytest.raises(Illegal):
        apply_pool(s, decision)


def test_the_judge_finds_touch_after_allocate_in_an_engine_stream() -> None:
    judge = PoolJudge(4)
    stream = [
        ("allocate", 0, 3),
        ("alloc", 0, 1),
        ("alloc", 0, 2),
        ("alloc", 0, 3),
        ("publish", 0, 1, 7),
        ("free", 0, (3, 2, 1)),
        ("slots", 1, (1,)),
        ("allocate", 1, 3),  # before touching the hit
        ("alloc", 1, 3),
        ("alloc", 1, 2),
        ("evicted", 1),
        ("alloc", 1, 1),
    ]
    finding = judge.feed_all(stream)
    assert finding is not None and finding.invariant == "TouchBeforeAllocate"
    assert finding.event == 7 and "touched" in finding.explanation


def test_the_judge_reports_effects_and_state_that_differ() -> None:
    judge = PoolJudge(4)
    finding = judge.feed_all([("allocate", 0, 1), ("alloc", 0, 2)])  # not the queue's head
    assert finding is not None and finding.invariant == "Disagreement"
    judge = PoolJudge(4)
    assert judge.feed_all([("allocate", 0, 1), ("alloc", 0, 1), ("publish", 0, 1, "k")]) is None
    assert judge.compare((0, 1, 0, 0), (2, 3), {1: "k"}) is None
    finding = judge.compare((0, 2, 0, 0), (2, 3), {1: "k"})
    assert finding is not None and "refcounts" in finding.message
    judge = PoolJudge(4)
    judge.feed_all([("allocate", 0, 1), ("alloc", 0, 1)])
    finding = judge.compare((0, 1, 0, 0), (3, 2), {})
    assert finding is not None and "free queue" in finding.message
    judge = PoolJudge(4)
    finding = judge.feed_all([("free", 0, (1,))])
    assert finding is not None and finding.invariant == "Illegal"


@st.composite
def legal_runs(draw: st.DrawFn) -> list[tuple[object, ...]]:
    """Random legal decisions on a pool of 6 blocks, holders 0..2, keys 0..3."""
    s = initial_pool(6)
    run: list[tuple[object, ...]] = []
    for _ in range(draw(st.integers(1, 30))):
        holder = draw(st.integers(0, 2))
        held = s.held.get(holder, [])
        options = ["lookup"]
        if s.free:
            options.append("allocate")
        if held:
            options += ["free", "publish"]
        if any(b.key is not None and b.refcount == 0 for b in s.blocks):
            options.append("touch")
        kind = draw(st.sampled_from(options))
        if kind == "allocate":
            decision: tuple[object, ...] = ("allocate", holder, draw(st.integers(1, len(s.free))))
        elif kind == "free":
            decision = ("free", holder, tuple(draw(st.permutations(held))[:2]))
        elif kind == "publish":
            block = draw(st.sampled_from(held))
            key = s.blocks[block].key
            key = draw(st.integers(0, 3)) if key is None else key
            decision = ("publish", holder, block, key)
        elif kind == "touch":
            cached = [i for i, b in enumerate(s.blocks) if b.key is not None and b.refcount == 0]
            decision = ("touch", holder, (draw(st.sampled_from(cached)),))
        else:
            decision = ("lookup", holder, tuple(range(draw(st.integers(0, 3)))))
        apply_pool(s, decision)
        run.append(decision)
    return run


@settings(max_examples=60, deadline=None)
@given(legal_runs())
def test_legal_decisions_keep_every_invariant(run: list[tuple[object, ...]]) -> None:
    s = initial_pool(6)
    for decision in run:
        apply_pool(s, decision)
        assert check_pool(s) is None, decision
