"""Partial prefix-cache hits in the pool machine (``spec/pool_machine.py``): a block under several
keys (``alias``), keys moved to a copy (``move``), blocks released while read (``unpin``),
references handed over (``give``), and the invariants that guard them.

Each new decision is shown doing what vLLM's pool does, each guard refusing its decision, each
new invariant failing on the state it guards against, and the judge naming a pool whose
observable state breaks one (a key kept past an eviction or a move, a reused block whose reader
was not told, an unpinned block not queued); random legal runs keep every invariant.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.conformance.pool_judge import PoolJudge
from kvspec.spec import Illegal
from kvspec.spec.pool_machine import (
    POOL_INVARIANTS,
    PoolState,
    apply_pool,
    cached_keys,
    check_pool,
    initial_pool,
)


def play(num_blocks: int, *decisions: tuple[object, ...]) -> tuple[PoolState, list[object]]:
    s = initial_pool(num_blocks)
    effects: list[object] = []
    for decision in decisions:
        effects += apply_pool(s, decision)
        assert check_pool(s) is None, decision
    return s, effects


def test_a_block_under_two_keys_is_found_by_each_and_an_eviction_drops_both() -> None:
    s, _ = play(5, ("allocate", 0, 2), ("publish", 0, 1, "full"), ("alias", 0, 1, "half"))
    assert cached_keys(s) == {1: frozenset({"full", "half"})}
    assert apply_pool(s, ("lookup", 1, ("half",))) == [("hit", 1, (1,))]
    apply_pool(s, ("alias", 0, 1, "half"))  # a key it carries: unchanged
    assert s.blocks[1].keys() == ["full", "half"]
    apply_pool(s, ("evict", 1))
    assert cached_keys(s) == {} and s.index == {} and s.dropped[1] == {"full", "half"}
    assert check_pool(s) is None


def test_a_move_repoints_every_key_and_registers_the_copy_last() -> None:
    s, _ = play(
        6,
        ("allocate", 0, 3),
        ("publish", 0, 1, "a"),
        ("alias", 0, 1, "b"),
        ("publish", 0, 2, "a"),  # a duplicate under "a": block 1 first
        ("move", 0, 1, 3),
    )
    assert cached_keys(s) == {2: "a", 3: frozenset({"a", "b"})}
    assert s.index["a"] == [2, 3] and s.moved[1] == {"a", "b"}
    assert apply_pool(s, ("lookup", 0, ("b",))) == [("hit", 0, (3,))]


def test_an_unpinned_block_joins_the_tail_and_is_read_until_an_allocation_reuses_it() -> None:
    s, _ = play(5, ("allocate", 0, 2), ("unpin", 0, (1,)))
    assert s.free == [3, 4, 1] and s.watched == {1: 0} and s.blocks[1].refcount == 0
    apply_pool(s, ("allocate", 1, 2))
    assert s.watched == {1: 0}  # not reused yet
    apply_pool(s, ("allocate", 1, 1))
    assert s.watched == {} and s.reused == {1}
    assert check_pool(s) is None


def test_a_reset_tells_every_reader() -> None:
    s, _ = play(4, ("allocate", 0, 1), ("publish", 0, 1, "k"), ("unpin", 0, (1,)), ("reset",))
    assert s.watched == {} and cached_keys(s) == {} and s.dropped[1] == {"k"}


def test_a_reference_given_to_the_caller_is_freed_by_the_caller() -> None:
    s, _ = play(4, ("allocate", 7, 2), ("give", 7, (1, 2), None))
    assert s.held[7] == [] and s.held[None] == [1, 2]
    with pytest.raises(Illegal):
        apply_pool(s, ("free", 7, (1,)))
    apply_pool(s, ("free", None, (2, 1)))
    assert s.free == [2, 1, 3] and check_pool(s) is None


@pytest.mark.parametrize(
    "decision",
    [
        ("alias", 0, 2, "k2"),  # not cached
        ("alias", 0, 0, "k2"),  # the null block
        ("move", 0, 1, 1),  # onto itself
        ("move", 0, 2, 1),  # onto a cached block
        ("move", 0, 0, 2),  # the null block
        ("unpin", 0, (3,)),  # unreferenced
        ("unpin", 5, (1,)),  # held by someone else
        ("give", 5, (1,), None),  # held by someone else
        ("give", 0, (9,), None),  # no such block
        ("move", 0, 1),  # malformed
    ],
)
def test_each_new_guard_refuses_its_decision(decision: tuple[object, ...]) -> None:
    s, _ = play(5, ("allocate", 0, 2), ("publish", 0, 1, "k"))
    with pytest.raises(Illegal):
        apply_pool(s, decision)


@pytest.mark.parametrize(
    "name, setup, break_it",
    [
        (
            "EvictionDropsEveryKey",
            [("evict", 1)],
            lambda s: setattr(s.blocks[1], "key", "k") or s.index.update(k=[1]),
        ),
        (
            "MoveLeavesNoKey",
            [("allocate", 0, 1), ("move", 0, 1, 3)],
            lambda s: setattr(s.blocks[1], "key", "h") or s.index["h"].insert(0, 1),
        ),
        (
            "ReadUntilReuse",
            [("unpin", 0, (2,)), ("allocate", 0, 3)],
            lambda s: s.watched.update({2: 0}),
        ),
        (
            "HashIndexConsistent",
            [],
            lambda s: s.blocks[1].also.append("unindexed"),
        ),
    ],
)
def test_each_new_invariant_fails_on_the_state_it_guards_against(
    name: str, setup: list[tuple[object, ...]], break_it: object
) -> None:
    s, _ = play(5, ("allocate", 0, 2), ("publish", 0, 1, "k"), ("alias", 0, 1, "h"), *setup)
    assert POOL_INVARIANTS[name](s) is None
    break_it(s)  # type: ignore[operator]
    violation = POOL_INVARIANTS[name](s)
    assert violation is not None and violation.invariant == name


# -- the judge names a pool whose observable state breaks one ------------------------------------


def judged(*decisions: tuple[object, ...]) -> PoolJudge:
    judge = PoolJudge(5)
    for decision in decisions:
        assert judge.feed(decision) is None
        for effect in list(judge.expected):
            assert judge.feed(effect) is None
    return judge


def test_the_judge_holds_a_pool_that_does_what_the_machine_does() -> None:
    judge = judged(
        ("allocate", None, 2),
        ("publish", None, 1, 0),
        ("alias", None, 1, 1),
        ("move", None, 1, 2),
        ("unpin", None, (1,)),
    )
    assert judge.compare((0, 0, 1, 0, 0), (3, 4, 1), {2: frozenset({0, 1})}, (1,)) is None


@pytest.mark.parametrize(
    "name, decisions, engine",
    [
        (  # a move that leaves the old key on its source
            "MoveLeavesNoKey",
            [("allocate", None, 2), ("publish", None, 1, 0), ("move", None, 1, 2)],
            ((0, 1, 1, 0, 0), (3, 4), {1: 0, 2: 0}, ()),
        ),
        (  # an eviction that keeps one of the block's two keys
            "EvictionDropsEveryKey",
            [("allocate", None, 1), ("publish", None, 1, 0), ("alias", None, 1, 1), ("evict", 1)],
            ((0, 1, 0, 0, 0), (2, 3, 4), {1: 1}, ()),
        ),
        (  # an allocation that reuses an unpinned block without telling its reader
            "ReadUntilReuse",
            [("allocate", None, 1), ("unpin", None, (1,)), ("allocate", None, 4)],
            ((0, 1, 1, 1, 1), (), {}, (1,)),
        ),
        (  # an unpin that drops the reference but does not queue the block
            "FreeQueueExact",
            [("allocate", None, 1), ("unpin", None, (1,))],
            ((0, 0, 0, 0, 0), (2, 3, 4), {}, (1,)),
        ),
    ],
)
def test_the_judge_names_the_pool_bug(
    name: str, decisions: list[tuple[object, ...]], engine: tuple[object, ...]
) -> None:
    judge = judged(*decisions)
    finding = judge.compare(*engine)  # type: ignore[arg-type]
    assert finding is not None and finding.invariant == name, finding


# -- random legal runs -----------------------------------------------------------------------


@st.composite
def legal_runs(draw: st.DrawFn) -> list[tuple[object, ...]]:
    """Random legal decisions, the new ones among the old, on 7 blocks, holders 0..2 and None."""
    s = initial_pool(7)
    run: list[tuple[object, ...]] = []
    for _ in range(draw(st.integers(1, 40))):
        holder = draw(st.sampled_from([0, 1, 2, None]))
        held = s.held.get(holder, [])
        keyed = [i for i, b in enumerate(s.blocks) if b.key is not None]
        unkeyed = [i for i in range(1, 7) if s.blocks[i].key is None]
        options = ["lookup", "evict"]
        if s.free:
            options.append("allocate")
        if held:
            options += ["free", "publish", "unpin", "give"]
        if any(b.key is not None and b.refcount == 0 for b in s.blocks):
            options.append("touch")
        if keyed:
            options.append("alias")
            if unkeyed:
                options.append("move")
        kind = draw(st.sampled_from(options))
        if kind == "allocate":
            decision: tuple[object, ...] = ("allocate", holder, draw(st.integers(1, len(s.free))))
        elif kind in ("free", "unpin"):
            decision = (kind, holder, tuple(draw(st.permutations(held))[:2]))
        elif kind == "give":
            decision = (
                "give",
                holder,
                (draw(st.sampled_from(held)),),
                draw(st.sampled_from([0, None])),
            )
        elif kind == "publish":
            block = draw(st.sampled_from(held))
            key = s.blocks[block].key
            key = draw(st.integers(0, 4)) if key is None else key
            decision = ("publish", holder, block, key)
        elif kind == "alias":
            decision = ("alias", holder, draw(st.sampled_from(keyed)), draw(st.integers(0, 4)))
        elif kind == "move":
            src, dst = draw(st.sampled_from(keyed)), draw(st.sampled_from(unkeyed))
            decision = ("move", holder, src, dst)
        elif kind == "evict":
            decision = ("evict", draw(st.integers(1, 6)))
        elif kind == "touch":
            cached = [i for i, b in enumerate(s.blocks) if b.key is not None and b.refcount == 0]
            decision = ("touch", holder, (draw(st.sampled_from(cached)),))
        else:
            decision = ("lookup", holder, tuple(range(draw(st.integers(0, 3)))))
        apply_pool(s, decision)
        run.append(decision)
    return run


@settings(max_examples=80, deadline=None)
@given(legal_runs())
def test_legal_decisions_with_partial_hits_keep_every_invariant(
    run: list[tuple[object, ...]],
) -> None:
    s = initial_pool(7)
    for decision in run:
        apply_pool(s, decision)
        assert check_pool(s) is None, decision
