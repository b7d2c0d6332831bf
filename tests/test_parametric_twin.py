"""The parametric model (``proofs/parametric.py``) is a twin of the spec: every spec step is one
of its steps, and every reachable spec state is inside its invariant.

Random walks of the executable spec in the parametric fragment (block size 1, synchronous, the
safe policies, both disciplines and preemption orders, depths 1 to 3); at every visited state,
through the abstraction of ``proofs/abstraction.py`` on a finite instance:

* the model's invariant holds on the state's encoding (for some value of its ghost);
* each safety predicate of the model has the spec invariant's value there;
* for every legal decision tried, the model's action of that kind takes the state's encoding to
  the encoding of the spec's successor (the request or step fixed, the other parameters free).

A model that drifts from the spec (a planted publish at schedule time, a reuse of a cached
block that keeps its hash) fails it.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from test_symbolic import WEIGHT, candidate_decisions

from kvspec.proofs import abstraction as ab
from kvspec.spec import INVARIANTS, Config, Illegal, State, apply, initial_state

CELLS = [
    # policy, discipline, preemption, blocks, depth, requests, tokens, vocabulary
    ("deferred", "vllm", "fcfs", 5, 2, 3, 4, 2),
    ("deferred", "general", "priority", 5, 3, 2, 4, 1),
    ("hide-uncommitted", "general", "fcfs", 4, 2, 3, 4, 1),
    ("hide-uncommitted", "vllm", "priority", 5, 1, 2, 4, 2),
]
WALKS, WALK_LENGTH = 2, 24


def walk(
    cell: tuple[Any, ...],
    seed: int,
    planted: str | None = None,
    stop_at_drift: bool = False,
    weight: dict[str, float] = WEIGHT,
) -> dict[str, int]:
    policy, discipline, preemption, blocks, depth, requests, tokens, vocab = cell
    config = Config(
        num_blocks=blocks,
        block_size=1,
        depth=depth,
        policy=policy,
        discipline=discipline,
        preemption=preemption,
        token_budget=tokens + 1,
        max_running=2,
    )
    rng = random.Random(seed)
    checker = ab.Checker(requests, blocks, depth + 2, planted)
    tally = {"states": 0, "steps": 0, "drift": 0, "shared": 0, "dead_writes": 0}
    for _ in range(WALKS):
        s: State = initial_state(config)
        for _ in range(WALK_LENGTH):
            assert ab.in_fragment(s)
            tally["states"] += 1
            tally["shared"] += any(b.refcount > 1 for b in s.blocks)
            tally["dead_writes"] += any(
                w.req not in st.live
                for st in s.steps
                for b in s.blocks
                for w in b.pending
                if w.step == st.id
            )
            if planted is None:
                assert checker.invariant_holds(s), f"outside the invariant: {s}"
                spec = {n: INVARIANTS[n](s) is None for n in checker.safety}
                assert checker.safety_values(s) == spec
            successors = []
            for decision in candidate_decisions(s, requests, tokens, rng, vocab):
                post = copy.deepcopy(s)
                try:
                    apply(post, decision)
                except Illegal:
                    continue
                tally["steps"] += 1
                if not checker.step_agrees(s, decision, post):
                    tally["drift"] += 1
                    assert planted is not None, f"{decision} from {s} is not a model step"
                    if stop_at_drift:
                        return tally
                successors.append((decision, post))
            if not successors:
                break
            weights = [weight[str(d[0])] for d, _ in successors]
            s = rng.choices([p for _, p in successors], weights)[0]
    return tally


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-N{c[3]}D{c[4]}")
def test_every_spec_step_is_a_parametric_step(cell: tuple[Any, ...]) -> None:
    tally = walk(cell, seed=CELLS.index(cell))
    assert tally["drift"] == 0
    assert tally["steps"] >= 20 * WALKS


WITHDRAWN_WRITE_THEN_REUSE = [
    ("arrive", 0, (1, 2), 1, 0),
    ("begin", 0),
    ("schedule", 0, 2, 0),
    ("submit", 0),
    ("begin", 1),
    ("preempt", 0),  # step 0's writes for r0 stay pending, withdrawn; blocks 1, 2 freed
    ("arrive", 1, (2, 1), 1, 0),
    ("schedule", 1, 2, 0),  # takes blocks 1, 2 again: two pending writes on each
    ("submit", 1),
    ("execute", 0, ()),
    ("commit", 0, ()),
    ("execute", 1, ()),
    ("commit", 1, ((1, 2),)),  # publishes r1's blocks, r1 finishes: cached blocks to the tail
    ("arrive", 2, (1, 2), 1, 0),
    ("begin", 2),
    ("schedule", 2, 2, 0),  # no hit (other tokens); allocation reuses and evicts a cached block
    ("submit", 2),
    ("execute", 2, ()),
    ("commit", 2, ((2, 1),)),
    ("arrive", 3, (2, 1, 1), 1, 0),
    ("begin", 3),
    ("schedule", 3, 1, 0),  # a hit on r1's published block 0, if still there, then shared
]
"""A scripted path (deferred, general, D = 2, 4 blocks): a preempted request's withdrawn writes
on blocks that are reallocated at once, publication at commit, a finish, the reuse of a cached
block (its hash evicted) and a hit."""


def follow(decisions: list[tuple[Any, ...]], planted: str | None = None) -> dict[str, int]:
    config = Config(5, 1, depth=2, policy="deferred", discipline="general", token_budget=8)
    checker = ab.Checker(4, 5, 4, planted)
    s: State = initial_state(config)
    tally = {"drift": 0, "dead_writes": 0, "evictions": 0}
    for decision in decisions:
        post = copy.deepcopy(s)
        events = apply(post, decision)
        tally["evictions"] += sum(1 for e in events if e[0] == "evict")
        if planted is None:
            assert checker.invariant_holds(s)
        if not checker.step_agrees(s, decision, post):
            assert planted is not None, f"{decision} from {s} is not a model step"
            tally["drift"] += 1
        s = post
        tally["dead_writes"] += any(
            w.req not in st.live
            for st in s.steps
            for b in s.blocks
            for w in b.pending
            if w.step == st.id
        )
    return tally


def test_the_twin_covers_withdrawn_writes_reuse_and_eviction() -> None:
    tally = follow(WITHDRAWN_WRITE_THEN_REUSE)
    assert tally == {"drift": 0, "dead_writes": tally["dead_writes"], "evictions": 1}
    assert tally["dead_writes"] > 0


def test_the_walks_reach_shared_blocks() -> None:
    cell = ("deferred", "general", "fcfs", 5, 3, 3, 4, 1)
    tally = walk(cell, seed=3)
    assert tally["drift"] == 0
    assert tally["shared"] > 0


@pytest.mark.parametrize("planted", ["eager-publish", "no-evict"])
def test_a_drifting_model_fails_the_twin_test(planted: str) -> None:
    """A model that publishes at schedule time, or reuses a cached block without evicting its
    hash, is not the spec: some spec step is none of its steps. (A model that only allows
    more, as ``hit-any-block`` does, is a correct over-approximation for the twin test: the
    proof is what refuses it, ``tests/test_parametric.py``.)"""
    assert follow(WITHDRAWN_WRITE_THEN_REUSE, planted)["drift"] > 0
