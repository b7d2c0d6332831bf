"""The parametric model (``proofs/parametric.py``) is a twin of the spec: every spec step is one
of its steps, and every reachable spec state is inside its invariant.

Random walks of the executable spec in the parametric fragment (block sizes 1 to 3, synchronous
and async, the safe policies, both disciplines and preemption orders, depths 1 to 3; external
loads at block size 1); at every visited state,
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
import functools
import random
from typing import Any

import pytest
from test_symbolic import ASYNC_WEIGHT, WEIGHT, candidate_decisions

from kvspec.proofs import abstraction as ab
from kvspec.spec import INVARIANTS, Config, Illegal, State, apply, initial_state
from kvspec.spec.actions import loadable
from kvspec.spec.pool import lookup
from kvspec.spec.state import Placeholder

CELLS = [
    # policy, discipline, preemption, blocks, depth, requests, tokens, vocabulary, async, stale
    ("deferred", "vllm", "fcfs", 5, 2, 3, 4, 2, False, "drop"),
    ("deferred", "general", "priority", 5, 3, 2, 4, 1, False, "drop"),
    ("hide-uncommitted", "general", "fcfs", 4, 2, 3, 4, 1, False, "drop"),
    ("hide-uncommitted", "vllm", "priority", 5, 1, 2, 4, 2, False, "drop"),
    ("deferred", "general", "fcfs", 5, 3, 2, 4, 2, True, "drop"),
    ("hide-uncommitted", "vllm", "priority", 5, 3, 2, 4, 1, True, "drop"),
    ("deferred", "general", "priority", 5, 2, 2, 4, 1, False, "deliver"),
    ("hide-uncommitted", "general", "fcfs", 5, 3, 2, 4, 2, True, "deliver"),
    # blocks of several positions: partial tail blocks, written by several steps
    ("deferred", "vllm", "fcfs", 4, 2, 3, 6, 2, False, "drop", 2),
    ("deferred", "general", "fcfs", 4, 3, 2, 6, 1, True, "drop", 2),
    ("hide-uncommitted", "general", "priority", 4, 2, 2, 6, 1, False, "drop", 3),
    ("hide-uncommitted", "general", "fcfs", 4, 3, 2, 6, 2, True, "deliver", 2),
    # draft tokens (synchronous): drafts computed past the known tokens, rejected ones rolled back
    ("deferred", "general", "fcfs", 5, 2, 2, 5, 1, False, "drop", 1, 2),
    ("hide-uncommitted", "vllm", "fcfs", 4, 2, 2, 6, 1, False, "drop", 2, 2),
    # draft tokens under async scheduling: a rejection moves later entries back (_move_back);
    # the last field, the walks' seed, is one whose walks reach such a move
    ("deferred", "general", "fcfs", 5, 2, 2, 5, 1, True, "drop", 1, 2, 19),
    ("hide-uncommitted", "general", "fcfs", 4, 3, 2, 6, 1, True, "drop", 2, 2, 15),
]
WALKS, WALK_LENGTH = 2, 24


@functools.cache
def checker_for(
    requests: int, blocks: int, steps: int, planted: str | None, block_size: int
) -> ab.Checker:
    """One finite instance per shape and plant, shared by the cells and paths of that shape
    (building the model's terms over an instance is most of a query's cost)."""
    return ab.Checker(requests, blocks, steps, planted, block_size=block_size)


def with_loads(s: State, rng: random.Random, decisions: list[Any]) -> list[Any]:
    """The decisions, and admissions that load blocks (asynchronously: no tokens computed;
    synchronously: one computed after them) and executions where loads fail."""
    out = list(decisions)
    bsz = s.config.block_size
    for rid in s.waiting:
        req = s.requests[rid]
        hits = len(lookup(s, req))
        for computed, asynchronous in ((0, True), (1, False)):
            k = loadable(len(req.tokens), bsz, asynchronous) - hits
            if k >= 1:
                out.append(("schedule", rid, computed, rng.randint(1, k)))
    oldest = next((st for st in s.steps if st.phase == "submitted"), None)
    if oldest is not None:
        loads = tuple(r for r, e in oldest.entries.items() if e.load)
        if loads:
            out.append(("execute", oldest.id, loads))
    return out


def with_drafts(s: State, rng: random.Random, decisions: list[Any], k: int, bsz: int) -> list[Any]:
    """The decisions, and schedules that reach 1 .. k draft slots past a running request's
    known tokens (under async scheduling, past its placeholders), and commits that accept a random number of each entry's drafts."""
    out = list(decisions)
    for rid in [*s.running, *s.waiting]:
        req = s.requests[rid]
        start = req.computed if req.status == "running" else len(lookup(s, req)) * bsz
        known = s.ahead(req) if s.config.async_scheduling else req.tokens  # async: placeholders
        left = len(known) - start
        if left > 0:
            out += [("schedule", rid, left + j, 0) for j in range(1, k + 1)]
    if s.steps and s.steps[0].phase == "executed":
        st = s.steps[0]
        for accepted in ("none", "some"):  # every draft rejected; a random number accepted
            sampled = []
            for r, e in st.entries.items():
                if e.samples and r in st.live:
                    n = 1 if accepted == "none" else 1 + rng.randint(0, e.drafts)
                    sampled += [(r, rng.randint(1, 2)) for _ in range(n)]
            out.append(("commit", st.id, tuple(sampled)))
    return out


def walk(
    cell: tuple[Any, ...],
    seed: int,
    planted: str | None = None,
    stop_at_drift: bool = False,
    weight: dict[str, float] | None = None,
    loads: bool = False,
) -> dict[str, int]:
    policy, discipline, preemption, blocks, depth, requests, tokens, vocab, overlap, stale = cell[
        :10
    ]
    bsz = cell[10] if len(cell) > 10 else 1
    drafts = cell[11] if len(cell) > 11 else 0
    weight = weight or (ASYNC_WEIGHT if overlap or stale == "deliver" else WEIGHT)
    config = Config(
        async_scheduling=overlap,
        stale_output=stale,
        num_blocks=blocks,
        block_size=bsz,
        spec_tokens=drafts,
        depth=depth,
        policy=policy,
        discipline=discipline,
        preemption=preemption,
        token_budget=tokens + 1,
        max_running=2,
    )
    rng = random.Random(seed)
    checker = checker_for(requests, blocks, depth + 2, planted, bsz)
    tally = {
        "ahead": 0,
        "two_writers": 0,
        "rejected": 0,
        "moved": 0,
        "states": 0,
        "steps": 0,
        "drift": 0,
        "shared": 0,
        "dead_writes": 0,
        "failed": 0,
        "loaded_last": 0,
        "placeholders": 0,
        "stale_entries": 0,
    }
    for _ in range(WALKS):
        s: State = initial_state(config)
        for _ in range(WALK_LENGTH):
            assert ab.in_fragment(s)
            tally["states"] += 1
            tally["shared"] += any(b.refcount > 1 for b in s.blocks)
            tally["loaded_last"] += any(q.loaded_last for q in s.requests.values())
            tally["ahead"] += any(  # a running request holds positions it has not computed
                len(q.table) * bsz > q.computed for q in s.requests.values() if q.table
            )
            tally["two_writers"] += any(  # one block written by two steps of one request
                len({w.step for w in b.pending if w.req == w0.req}) > 1
                for b in s.blocks
                for w0 in b.pending
            )
            tally["placeholders"] += any(
                isinstance(x, Placeholder)
                for b in s.blocks
                for c in [b.written or (), *(w.prefix for w in b.pending)]
                for x in c
            )
            tally["dead_writes"] += any(
                w.req not in st.live
                for st in s.steps
                for b in s.blocks
                for w in b.pending
                if w.step == st.id
            )
            tally["stale_entries"] += any(
                s.requests[r].status == "waiting" for st in s.steps for r in st.live
            )
            if planted is None:
                assert checker.invariant_holds(s), f"outside the invariant: {s}"
                spec = {n: INVARIANTS[n](s) is None for n in checker.safety}
                assert checker.safety_values(s) == spec
            successors = []
            decisions = candidate_decisions(s, requests, tokens, rng, vocab)
            if (bsz == 1 or loads) and not drafts:  # external loads (B > 1: ``LOAD_CELLS``)
                decisions = with_loads(s, rng, decisions)
            if drafts:
                decisions = with_drafts(s, rng, decisions, drafts, bsz)
            for decision in decisions:
                post = copy.deepcopy(s)
                try:
                    apply(post, decision)
                except Illegal:
                    continue
                tally["steps"] += 1
                tally["failed"] += decision[0] == "execute" and bool(decision[2])
                tally["rejected"] += decision[0] == "commit" and any(
                    s.steps[0].entries[r].drafts + 1 > sum(1 for x, _ in decision[2] if x == r)
                    for r, _ in decision[2]
                )
                tally["moved"] += decision[0] == "commit" and any(
                    e.start != s.steps[i + 1].entries[r].start
                    for i, st in enumerate(post.steps)
                    for r, e in st.entries.items()
                    if r in st.live and r in s.steps[i + 1].live
                )
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


def cell_id(c: tuple[Any, ...]) -> str:
    size = f"-B{c[10]}" if len(c) > 10 else ""
    size += f"-K{c[11]}" if len(c) > 11 else ""
    return f"{c[0]}-{c[1]}-{c[2]}-N{c[3]}D{c[4]}{size}" + ("-async" if c[8] else "") + f"-{c[9]}"


@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_every_spec_step_is_a_parametric_step(cell: tuple[Any, ...]) -> None:
    tally = walk(cell, seed=cell[12] if len(cell) > 12 else CELLS.index(cell))
    assert tally["drift"] == 0
    if cell[8]:  # async: bytes holding placeholders reached
        assert tally["placeholders"] > 0
    if cell[9] == "deliver":  # a preempted request's entries stayed live (the reads of its old
        assert tally["stale_entries"] > 0  # table after a reallocation: the scripted path)
    assert tally["steps"] >= 20 * WALKS
    if len(cell) > 11:  # drafts rejected (rolled back) and accepted
        assert tally["rejected"] > 0
        assert tally["moved"] > 0 or not cell[8]  # async: later entries moved back
    elif len(cell) > 10:  # blocks held ahead of computation; async: a block written by two steps
        assert tally["ahead"] > 0  # of one request in flight at once
        assert tally["two_writers"] > 0 or not cell[8]


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


SHARING_AND_LOADS = [
    ("arrive", 0, (1, 1, 1), 3, 0),
    ("begin", 0),
    ("schedule", 0, 3, 0),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ((0, 1),)),  # r0's three blocks published; r0 runs on
    ("arrive", 1, (1, 1, 2), 1, 0),
    ("begin", 1),
    ("schedule", 1, 1, 0),  # hits r0's first two blocks: shared
    ("submit", 1),
    ("execute", 1, ()),
    ("commit", 1, ((1, 1),)),  # r1 finishes
    ("arrive", 2, (2, 2, 2), 1, 0),
    ("begin", 2),
    ("schedule", 2, 0, 2),  # an asynchronous load of two blocks
    ("submit", 2),
    ("execute", 2, (2,)),  # it fails
    ("commit", 2, ()),  # r2 waits again, its blocks freed, nothing published
    ("begin", 3),
    ("schedule", 2, 0, 2),  # loaded again
    ("submit", 3),
    ("execute", 3, ()),
    ("commit", 3, ()),  # it landed: published
    ("begin", 4),
    ("schedule", 2, 1, 0),
    ("submit", 4),
    ("execute", 4, ()),
    ("commit", 4, ((2, 1),)),
]
"""A scripted path (deferred, general, D = 2, 6 blocks): a block shared through a hit, an
asynchronous load that fails, then one that lands."""


PLACEHOLDERS_RESOLVED_AND_DISCARDED = [
    ("arrive", 0, (1, 2), 6, 0),
    ("begin", 0),
    ("schedule", 0, 2, 0),  # to the end: step 0 samples token 2
    ("submit", 0),
    ("begin", 1),
    ("schedule", 0, 1, 0),  # position 2 on step 0's placeholder
    ("submit", 1),
    ("execute", 0, ()),
    ("execute", 1, ()),  # bytes holding the placeholder
    ("commit", 0, ((0, 1),)),  # resolved
    ("commit", 1, ((0, 2),)),
    ("begin", 2),
    ("schedule", 0, 1, 0),
    ("submit", 2),
    ("begin", 3),
    ("schedule", 0, 1, 0),  # on step 2's placeholder
    ("submit", 3),
    ("execute", 2, ()),
    ("execute", 3, ()),
    ("abort", 0),  # step 2's sample discarded: those bytes are garbage for good
    ("commit", 2, ()),
    ("commit", 3, ()),
]
"""A scripted path under async scheduling (deferred, general, D = 2, 6 blocks): bytes computed on a
placeholder, resolved at its step's commit; then bytes on a placeholder whose sample an abort
discards."""


STALE_OUTPUT_DELIVERED = [
    ("arrive", 0, (1, 2, 1), 3, 0),
    ("begin", 0),
    ("schedule", 0, 2, 0),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ()),
    ("begin", 1),
    ("schedule", 0, 1, 0),  # position 2, reading r0's blocks 0 and 1; it samples
    ("submit", 1),
    ("begin", 2),
    ("preempt", 0),  # delivered: step 1's entry stays live, r0's table is freed
    ("arrive", 1, (2, 2, 2), 1, 0),
    ("schedule", 1, 3, 0),  # r0's freed blocks reallocated: pending writes of step 2
    ("submit", 2),
    ("execute", 1, ()),  # r0's stale entry reads its old table: still r0's prefix
    ("commit", 1, ((0, 2),)),  # its sample delivered to the waiting r0
    ("execute", 2, ()),
    ("commit", 2, ((1, 1),)),
    ("begin", 3),
    ("schedule", 0, 1, 0),  # r0 admitted again, once its stale output is in
    ("submit", 3),
    ("execute", 3, ()),
]
"""A scripted path with stale output delivered (deferred, general, D = 2, 5 blocks): a preempted
request's live entry in a submitted step reads the blocks it gave up, after they were handed to
another request; the sample is delivered to the waiting request, which is admitted again."""


STALE_SAMPLE_DISCARDED = [
    ("arrive", 0, (1, 2), 6, 0),
    ("begin", 0),
    ("schedule", 0, 2, 0),  # samples token 2
    ("submit", 0),
    ("begin", 1),
    ("schedule", 0, 1, 0),  # position 2 on step 0's placeholder
    ("submit", 1),
    ("begin", 2),
    ("preempt", 0),  # delivered: steps 0 and 1 keep r0's entries live
    ("submit", 2),
    ("execute", 0, ()),
    ("execute", 1, ()),  # r0's old block 2 holds step 0's placeholder
    ("abort", 0),  # step 0's sample discarded: that block's bytes are garbage for good
    ("execute", 2, ()),
    ("commit", 0, ()),
    ("commit", 1, ()),
]
"""A scripted path under async scheduling with stale output delivered (deferred, general, D = 3,
6 blocks): a waiting request's stale entry computes on an earlier stale entry's placeholder,
then the request is aborted before that sample is delivered."""


PARTIAL_BLOCKS = [
    ("arrive", 0, (1, 1, 1), 3, 0),
    ("begin", 0),
    ("schedule", 0, 1, 0),  # position 0: block 1 taken whole, its slot 1 held ahead
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ()),  # block 1 partial: not published
    ("begin", 1),
    ("schedule", 0, 2, 0),  # position 1 into block 1 (no allocation), position 2 into block 2
    ("submit", 1),
    ("execute", 1, ()),
    ("commit", 1, ((0, 1),)),  # block 1, written by two steps, full: published
    ("arrive", 1, (1, 1, 2), 1, 0),
    ("begin", 2),
    ("schedule", 1, 1, 0),  # hits block 1: shared
    ("submit", 2),
    ("execute", 2, ()),
    ("commit", 2, ((1, 1),)),  # r1 finishes
    ("begin", 3),
    ("preempt", 0),  # r0's partial block 2 freed, unpublished
    ("arrive", 2, (2, 2, 2), 1, 0),
    ("schedule", 2, 3, 0),  # reuses block 2 at once
    ("submit", 3),
    ("execute", 3, ()),
    ("commit", 3, ((2, 1),)),
    ("begin", 4),
    ("schedule", 0, 1, 0),  # r0 again: hits block 1, position 2 into a new block 3
    ("submit", 4),
    ("execute", 4, ()),
    ("commit", 4, ()),
    ("begin", 5),
    ("schedule", 0, 1, 0),  # position 3 into block 3's slot held ahead: a write, no allocation
    ("submit", 5),
    ("execute", 5, ()),
    ("commit", 5, ((0, 1),)),  # block 3, written by steps 4 and 5, published
    ("begin", 6),
    ("schedule", 0, 1, 0),
    ("submit", 6),
    ("execute", 6, ()),
    ("commit", 6, ((0, 1),)),  # r0 finishes
    ("arrive", 3, (2, 1, 2, 1, 2), 1, 0),
    ("begin", 7),
    ("schedule", 3, 5, 0),  # three blocks: cached ones evicted
]
"""A scripted path at block size 2 (deferred, general, D = 2, 4 blocks): a partial tail block
held ahead of computation, written by two steps and published once full, a hit on it, a
preempted request's partial block reused at once, and evictions."""


def follow(
    decisions: list[tuple[Any, ...]],
    planted: str | None = None,
    blocks: int = 5,
    overlap: bool = False,
    stale: str = "drop",
    depth: int = 2,
    block_size: int = 1,
) -> dict[str, int]:
    config = Config(
        blocks,
        block_size,
        depth=depth,
        policy="deferred",
        discipline="general",
        token_budget=8,
        async_scheduling=overlap,
        stale_output=stale,
    )
    checker = checker_for(4, blocks, 4, planted, block_size)
    s: State = initial_state(config)
    tally = {"drift": 0, "dead_writes": 0, "evictions": 0, "shared": 0, "failed": 0, "stale": 0}
    for decision in decisions:
        post = copy.deepcopy(s)
        events = apply(post, decision)
        tally["evictions"] += sum(1 for e in events if e[0] == "evict")
        if planted is None:
            assert checker.invariant_holds(s)
        if not checker.step_agrees(s, decision, post):
            assert planted is not None, f"{decision} from {s} is not a model step"
            tally["drift"] += 1
        tally["stale"] += any(
            s.requests[r].status == "waiting" and st.entries[r].start > 0
            for st in s.steps
            if st.phase != "executed"
            for r in st.live
        )
        s = post
        tally["shared"] += any(b.refcount > 1 for b in s.blocks)
        tally["failed"] += decision[0] == "execute" and bool(decision[2])
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
    assert tally["drift"] == 0 and tally["evictions"] == 1
    assert tally["dead_writes"] > 0


def test_the_twin_covers_placeholders_resolved_and_discarded() -> None:
    tally = follow(PLACEHOLDERS_RESOLVED_AND_DISCARDED, blocks=7, overlap=True)
    assert tally["drift"] == 0


def test_the_twin_covers_stale_output_delivered() -> None:
    tally = follow(STALE_OUTPUT_DELIVERED, stale="deliver")
    assert tally["drift"] == 0 and tally["stale"] >= 3


def test_the_twin_covers_a_discarded_stale_sample() -> None:
    tally = follow(STALE_SAMPLE_DISCARDED, blocks=6, overlap=True, stale="deliver", depth=3)
    assert tally["drift"] == 0


def test_the_twin_covers_partial_blocks_written_by_two_steps() -> None:
    tally = follow(PARTIAL_BLOCKS, block_size=2)
    assert tally["drift"] == 0
    assert tally["shared"] > 0 and tally["evictions"] >= 2


def test_the_twin_covers_sharing_and_failed_loads() -> None:
    tally = follow(SHARING_AND_LOADS, blocks=7)
    assert tally["drift"] == 0
    assert tally["shared"] > 0 and tally["failed"] == 1


@pytest.mark.parametrize(
    "planted",
    [
        "eager-publish",
        "no-evict",
        "placeholders-resolve",
        "stale-dropped",
        "stale-samples-resolve",
        "one-position-blocks",
        "skip-reserved-write",
        "drafts-resolve",
    ],
)
def test_a_drifting_model_fails_the_twin_test(planted: str) -> None:
    """A model that publishes at schedule time, reuses a cached block without evicting its
    hash, keeps bytes on a discarded placeholder valid, or never keeps a preempted request's
    entries live (stale output delivered) or the bytes its stale entries computed on a sample it
    discards by leaving valid, is not the spec: some spec step is none of its steps. (A model that only allows
    more, as ``hit-any-block`` and ``publish-failed-load`` do, passes the twin test, which
    is one-directional by design: the proof is what refuses it, ``tests/test_parametric.py``.)
    At block size 2: a model whose allocations cover computed positions only (the block size 1
    model, ``one-position-blocks``) or whose schedule does not write the slots its request holds
    ahead (``skip-reserved-write``) misses the spec's partial tail blocks."""
    if planted == "drafts-resolve":  # rejected drafts' bytes kept valid
        cell = next(c for c in CELLS if len(c) > 11)
        assert walk(cell, CELLS.index(cell), planted, stop_at_drift=True)["drift"] > 0
        return
    if planted in ("one-position-blocks", "skip-reserved-write"):
        assert follow(PARTIAL_BLOCKS, planted, block_size=2)["drift"] > 0
        return
    if planted == "placeholders-resolve":
        path = follow(PLACEHOLDERS_RESOLVED_AND_DISCARDED, planted, blocks=7, overlap=True)
        assert path["drift"] > 0
        return
    if planted == "stale-dropped":
        assert follow(STALE_OUTPUT_DELIVERED, planted, stale="deliver")["drift"] > 0
        return
    if planted == "stale-samples-resolve":
        path = STALE_SAMPLE_DISCARDED
        tally = follow(path, planted, blocks=6, overlap=True, stale="deliver", depth=3)
        assert tally["drift"] > 0
        return
    assert follow(WITHDRAWN_WRITE_THEN_REUSE, planted)["drift"] > 0


ASYNC_DRAFTS_MOVED_BACK = [
    ("begin", 0),
    ("arrive", 0, (1, 1, 1), 3, 1),
    ("schedule", 0, 5, 0),  # the prompt's 3 positions and 2 drafts: samples at position 4
    ("submit", 0),
    ("begin", 1),
    ("schedule", 0, 1, 0),  # position 5, on step 0's placeholder past both drafts
    ("submit", 1),
    ("execute", 0, ()),
    ("commit", 0, ((0, 1),)),  # both drafts rejected: step 1's entry moves from 5..6 to 3..4
    ("execute", 1, ()),  # its write, laid again at position 3, lands where the drafts were
    ("commit", 1, ((0, 2),)),
    ("begin", 2),
    ("schedule", 0, 1, 0),  # position 4, held ahead since the rejection: written again
    ("submit", 2),
    ("execute", 2, ()),
    ("commit", 2, ((0, 1),)),  # r0 finishes
]
"""Drafts under async scheduling (deferred, general, D = 2, 8 blocks, K = 2): a commit that
rejects drafts moves a later step's entry and pending write back (the spec's ``_move_back``);
the moved write lands on the rolled-back slot, and the slot past it, held ahead, is computed
again by a later step."""


def follow_async_drafts(planted: str | None = None) -> dict[str, int]:
    config = Config(
        8,
        1,
        depth=2,
        policy="deferred",
        discipline="general",
        async_scheduling=True,
        spec_tokens=2,
        token_budget=6,
        max_running=2,
    )
    checker = checker_for(1, 8, 4, planted, 1)
    s: State = initial_state(config)
    tally = {"drift": 0, "moved": 0}
    for decision in ASYNC_DRAFTS_MOVED_BACK:
        post = copy.deepcopy(s)
        apply(post, decision)
        if planted is None:
            assert checker.invariant_holds(post)
            spec = {n: INVARIANTS[n](post) is None for n in checker.safety}
            assert checker.safety_values(post) == spec
        if decision == ("commit", 0, ((0, 1),)):
            old, new = s.steps[1].entries[0], post.steps[0].entries[0]
            assert (old.start, old.end, new.start, new.end) == (5, 6, 3, 4)
            tally["moved"] += 1
        if not checker.step_agrees(s, decision, post):
            assert planted is not None, f"{decision} from {s} is not a model step"
            tally["drift"] += 1
        s = post
    assert s.requests[0].status == "finished" and not s.bad_reads
    return tally


def test_the_twin_covers_an_async_draft_rejection() -> None:
    """A commit that rejects drafts under async scheduling moves the later step's entry and
    its pending write back (``Model._move_back``): every step of this path is a model step and
    every state is inside the invariant. A model whose move-back keeps the old slots' pending
    writes (``move-back-keeps-writes``) drifts at that commit; the proof refuses it too
    (``tests/test_parametric.py``)."""
    assert follow_async_drafts() == {"drift": 0, "moved": 1}
    assert follow_async_drafts("move-back-keeps-writes")["drift"] > 0


@pytest.mark.parametrize(
    "tokens, blocks, recomputed",
    [
        ((1, 1, 1, 1), 1, False),  # the first block only: computed 2 = the entry's end
        ((1, 1, 1, 1, 1), 2, False),  # two full blocks below the last token: computed 4
        ((1, 1, 1, 1), 2, True),  # the last token's block: computed 3, one below the end 4
    ],
)
def test_a_load_at_block_size_2_is_a_parametric_step(
    tokens: tuple[int, ...], blocks: int, recomputed: bool
) -> None:
    """An asynchronous load at block size 2 is a model step into the invariant, also a load of
    the block holding the last known token, which leaves the request's computed tokens one
    below the load entry's end (the last token is computed again: ``loaded_last``, which the
    model's ``comp`` counts)."""
    config = Config(5, 2, depth=1, policy="deferred", discipline="general", token_budget=7)
    checker = checker_for(2, 5, 3, None, 2)
    s: State = initial_state(config)
    for decision in [("arrive", 0, tokens, 2, 1), ("begin", 0), ("schedule", 0, 0, blocks)]:
        post = copy.deepcopy(s)
        apply(post, decision)
        assert checker.step_agrees(s, decision, post), decision
        s = post
    entry = s.steps[0].entries[0]
    assert entry.load and entry.end == blocks * 2
    assert s.requests[0].computed == entry.end - recomputed
    assert checker.invariant_holds(s)


LAST_TOKEN_LOADED_THEN_SHARED = [
    ("arrive", 0, (1, 1, 1, 1), 2, 0),
    ("begin", 0),
    ("schedule", 0, 0, 2),  # loads both blocks, the last token's too: computed 3
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ()),  # landed: both blocks published
    ("arrive", 1, (1, 1, 1, 1, 2), 1, 0),
    ("begin", 1),
    ("schedule", 1, 1, 0),  # hits both: the last one shared while r0 has computed 3
    ("schedule", 0, 1, 0),  # r0 computes token 3 again: its published block rewritten
    ("submit", 1),
    ("execute", 1, ()),
    ("commit", 1, ((0, 2), (1, 1))),
]
"""Block size 2 (D = 1, 5 blocks): a load of the block holding the last known token, a hit on
it by another request before the loading one computes that token again, then the
recomputation, a write of the published block's own prefix."""


RECOMPUTATION_WITHDRAWN_THEN_EVICTED = [
    ("arrive", 0, (1, 1, 1, 1), 2, 0),
    ("begin", 0),
    ("schedule", 0, 0, 2),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ()),
    ("begin", 1),
    ("schedule", 0, 1, 0),  # the recomputation of token 3, over the published block
    ("submit", 1),
    ("begin", 2),
    ("preempt", 0),  # its write is withdrawn, still pending; the blocks freed, cached
    ("arrive", 1, (2, 2, 2, 2, 2, 2, 2, 2), 1, 0),
    ("schedule", 1, 8, 0),  # every block: both cached ones evicted, the rewrite still pending
    ("submit", 2),
    ("execute", 1, ()),
    ("execute", 2, ()),
    ("commit", 1, ()),
    ("commit", 2, ((1, 1),)),
]
"""Block size 2 (D = 2, 5 blocks): the recomputation over a loaded block is withdrawn by a
preemption and its block evicted and reallocated before the withdrawn rewrite runs."""


@pytest.mark.parametrize(
    "path, policy, depth",
    [
        (LAST_TOKEN_LOADED_THEN_SHARED, "deferred", 1),
        (RECOMPUTATION_WITHDRAWN_THEN_EVICTED, "hide-uncommitted", 2),
    ],
    ids=["shared", "evicted"],
)
def test_the_twin_covers_the_last_tokens_block_loaded(
    path: list[tuple[Any, ...]], policy: str, depth: int
) -> None:
    """Every step a model step, every state inside the invariant with the spec's safety
    values; a model whose recomputation writes the published block again
    (``recompute-rewrites-published``) drifts."""
    config = Config(5, 2, depth=depth, policy=policy, discipline="general", token_budget=9)
    for planted in (None, "recompute-rewrites-published"):
        checker = checker_for(2, 5, 4, planted, 2)
        s: State = initial_state(config)
        drift = 0
        for decision in path:
            post = copy.deepcopy(s)
            apply(post, decision)
            if planted is None:
                assert checker.invariant_holds(post)
                spec = {n: INVARIANTS[n](post) is None for n in checker.safety}
                assert checker.safety_values(post) == spec
            drift += not checker.step_agrees(s, decision, post)
            s = post
        assert drift == 0 if planted is None else drift > 0, planted


LOAD_CELLS = [
    # loads at block sizes > 1 (the last token's block loaded, then computed again); seed
    (("hide-uncommitted", "vllm", "fcfs", 5, 2, 2, 5, 1, True, "drop", 2), 0),
    (("deferred", "general", "priority", 4, 2, 2, 7, 2, False, "drop", 3), 0),
]


@pytest.mark.parametrize("cell, seed", LOAD_CELLS, ids=[cell_id(c) for c, _ in LOAD_CELLS])
def test_every_spec_step_with_loads_at_larger_blocks_is_a_parametric_step(
    cell: tuple[Any, ...], seed: int
) -> None:
    """The walks of ``CELLS`` at block sizes 2 and 3 with loads too: each must reach a request
    whose last token's block was loaded (``loaded_last``) and a failed load."""
    tally = walk(cell, seed, loads=True)
    assert tally["drift"] == 0 and tally["steps"] >= 20 * WALKS
    assert tally["loaded_last"] > 0 and tally["failed"] > 0
