"""The invariants: named predicates over the state that every reachable state must satisfy.

Each is a function ``(state) -> Violation | None``: None when it holds, else the first
counterexample found, as data (the blocks, requests and step it is about, and one sentence).
``INVARIANTS`` lists them in the order they are checked; the first two are the end-to-end safety
properties, the rest are the bookkeeping that keeps them true. ``REGISTRY`` holds each once,
with what can break it. ``tables_append_only`` is a
property of a transition, so it compares two snapshots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from itertools import chain

from . import groups, slots
from .pool import eventual_content, holds
from .state import NULL_BLOCK, OBSERVED_POLICIES, Request, State


@dataclass(frozen=True, slots=True)
class Violation:
    """A counterexample to an invariant, as data: which invariant, the blocks, requests and step
    it is about, and one sentence saying what is wrong. Renderers (text, ``--json``, the HTML
    picture) read the fields; nothing parses the sentence."""

    invariant: str
    sentence: str
    blocks: tuple[int, ...] = ()
    requests: tuple[int, ...] = ()
    step: int | None = None


def no_unwritten_read(s: State) -> Violation | None:
    """Every block a step reads as computed prefix holds that prefix, or will once this step's and
    earlier in-flight steps' writes have run. Guards against the zombie hit: plausible but wrong
    tokens computed from K/V that was never written (the seed bug's end-to-end symptom). With a
    sliding window (``Config.sliding_window``) a step reads only the blocks of its window, and
    none of them may have left its running request's table (skipped and freed) before the step
    runs: a freed block can be handed out and overwritten under the step's read."""
    if s.bad_reads:
        step_id, rid, block = s.bad_reads[0]
        return Violation(
            "NoUnwrittenRead",
            f"step {step_id} read block {block} for r{rid} but it does not hold r{rid}'s prefix",
            (block,),
            (rid,),
            step_id,
        )
    bsz = s.config.block_size
    for step in s.steps:
        if step.phase == "executed":
            continue
        for rid, e in step.entries.items():
            if e.load or rid not in step.live:
                continue
            req = s.requests[rid]
            tokens = s.ahead(req)
            lo = s.first_read(e.start + e.loaded * bsz)  # a window reads from its first block
            for i in range(lo, len(e.blocks)):  # its own blocks too: the step reads them
                block = e.blocks[i]
                gone = i < len(req.table) and req.table[i] == NULL_BLOCK != block
                if req.status == "running" and gone:
                    return Violation(
                        "NoUnwrittenRead",
                        f"step {step.id} will read block {block} as r{rid}'s block {i}, but "
                        f"r{rid}'s table gave it up (the window skipped it) before the step ran",
                        (block,),
                        (rid,),
                        step.id,
                    )
                if i * bsz >= e.start:  # written by the step itself: execute checks it
                    continue
                prefix = tuple(tokens[: min(e.start, (i + 1) * bsz)])
                if not holds(eventual_content(s, block, upto_step=step.id), prefix):
                    return Violation(
                        "NoUnwrittenRead",
                        f"step {step.id} will read block {block} as r{rid}'s tokens "
                        f"0..{len(prefix) - 1}, but no write that runs first puts them there",
                        (block,),
                        (rid,),
                        step.id,
                    )
    return None


def no_unwritten_publish(s: State) -> Violation | None:
    """A published hash names a block that holds its prefix, or will once in-flight writes run.
    Guards against publishing memory nobody will write (a preempted or aborted writer, a failed
    load): the hit that follows reads garbage. A load that failed in an executed step the
    scheduler has not processed yet is excused until that commit: nothing could have told it."""
    unreported = {
        block
        for step in s.steps
        for rid in step.failed
        for block in step.entries[rid].blocks[step.entries[rid].start // s.config.block_size :]
    }
    for key, blocks in s.index.items():
        for block in blocks:
            held = key[: len(key) - s.config.hash_lookahead]  # the lookahead is not held
            if block not in unreported and not holds(eventual_content(s, block), held):
                return Violation(
                    "NoUnwrittenPublish",
                    f"block {block} is published for a {len(held)}-token prefix it will never hold",
                    (block,),
                    tuple(r.id for r in s.requests.values() if block in r.table),
                )
    for g, index in s.group_index.items():  # several groups: full and window ones alike
        if groups.kind(s, g) in ("state", "slot"):  # a state's publish is StateAtItsBoundary's
            continue
        for key, blocks in index.items():
            for block in blocks:
                if not holds(eventual_content(s, block), key):
                    return Violation(
                        "NoUnwrittenPublish",
                        f"group {g}'s block {block} is published for a {len(key)}-token prefix "
                        "it will never hold",
                        (block,),
                        _holders(s, block),
                    )
    return None


def _holders(s: State, block: int) -> tuple[int, ...]:
    """The requests whose tables of any group hold ``block``."""
    return tuple(r.id for r in s.requests.values() if block in r.table or block in groups.held(r))


def refcount_is_ownership(s: State) -> Violation | None:
    """A block's refcount equals the number of live requests whose table holds it, plus the
    deferred holders (``Config.defer_free``) that hold it. Guards against leaks (never freed)
    and early reuse (freed while still read)."""
    owners: Counter[int] = Counter()
    for held in s.deferred:
        if len(set(held.blocks)) != len(held.blocks):
            return Violation(
                "RefcountIsOwnership",
                f"a deferred free of r{held.req} holds a block twice: {list(held.blocks)}",
                held.blocks,
                (held.req,),
            )
        owners.update(held.blocks)
    for req in s.requests.values():
        table = req.table
        if s.config.local:  # a window's (chunked group's) skipped positions hold nothing
            table = [b for b in table if b != NULL_BLOCK]
        if req.group_tables:  # several groups: every table the request holds
            table = [b for b in table if b != NULL_BLOCK] + groups.held(req)
        if len(set(table)) != len(table):
            twice = tuple(sorted({b for b in table if table.count(b) > 1}))
            return Violation(
                "RefcountIsOwnership",
                f"r{req.id}'s table holds a block twice: {req.table}",
                twice,
                (req.id,),
            )
        owners.update(table)
    for block, b in enumerate(s.blocks):
        if block != NULL_BLOCK and b.refcount != owners[block]:
            return Violation(
                "RefcountIsOwnership",
                f"block {block} has refcount {b.refcount} but {owners[block]} owners",
                (block,),
                tuple(r.id for r in s.requests.values() if block in r.table),
            )
    return None


def full_in(req: Request, i: int, bsz: int) -> bool:
    """Block ``i`` of the request's table holds all its tokens for the request: they are computed,
    or (``Request.loaded_last``) an asynchronous load wrote the block whole and only its last
    token is left to recompute over it. That recomputation writes the K/V of the same prefix
    (what the loaded bytes already hold), so another request may share the block meanwhile, as
    vLLM lets it (``_update_waiting_for_remote_kv`` caches the loaded blocks, then steps
    ``num_computed_tokens`` back by one); whether the load landed is judged where the block is
    read (``NoUnwrittenRead``) and published (``NoUnwrittenPublish``)."""
    return (i + 1) * bsz <= req.computed + (1 if req.loaded_last else 0)


def shared_implies_same_prefix(s: State) -> Violation | None:
    """A block in two tables sits at the same position in both, is full in both (``full_in``:
    computed, or loaded whole with its last token left to recompute), and both requests'
    chained hashes agree there. Guards against sharing a partial block or a block under two
    different prefixes."""
    seen: dict[int, tuple[int, int]] = {}
    bsz = s.config.block_size
    for req in s.requests.values():
        for i, block in enumerate(req.table):
            if block == NULL_BLOCK and s.config.local:  # skipped
                continue
            if block not in seen:
                seen[block] = (req.id, i)
                continue
            other, j = seen[block]
            o = s.requests[other]
            full = full_in(req, i, bsz) and full_in(o, j, bsz)
            if i != j or not full or s.key(req, i) != s.key(o, j):
                return Violation(
                    "SharedImpliesSamePrefix",
                    f"block {block} is shared by r{other}[{j}] and r{req.id}[{i}] unequally",
                    (block,),
                    (other, req.id),
                )
    return _shared_in_groups(s, {block: (rid, 0, i) for block, (rid, i) in seen.items()})


def _shared_in_groups(s: State, seen: dict[int, tuple[int, int, int]]) -> Violation | None:
    """``SharedImpliesSamePrefix`` in groups 1 .. G - 1: a block in two tables is in the same
    group at the same position of both, full in both, under the same chained prefix."""
    for req in s.requests.values():
        for g, table in enumerate(req.group_tables, 1):
            bs = groups.size(s, g)
            for i, block in enumerate(table):
                if block == NULL_BLOCK:
                    continue
                if block not in seen:
                    seen[block] = (req.id, g, i)
                    continue
                other, h, j = seen[block]
                o = s.requests[other]
                full = full_in(req, i, bs) and full_in(o, j, bs)
                same = groups.key(req, (i + 1) * bs) == groups.key(o, (j + 1) * bs)
                if (h, j) != (g, i) or not full or not same:
                    return Violation(
                        "SharedImpliesSamePrefix",
                        f"block {block} is shared by r{other}'s group {h}[{j}] and "
                        f"r{req.id}'s group {g}[{i}] unequally",
                        (block,),
                        (other, req.id),
                    )
    return None


def free_queue_exact(s: State) -> Violation | None:
    """The free queue holds exactly the unreferenced blocks but the null block, each once.
    Guards against double free (a block handed out twice) and lost blocks."""
    expected = {blk for blk, b in enumerate(s.blocks) if blk != NULL_BLOCK and b.refcount == 0}
    if len(s.free) != len(set(s.free)) or set(s.free) != expected:
        wrong = {b for b in s.free if s.free.count(b) > 1} | (set(s.free) ^ expected)
        return Violation(
            "FreeQueueExact",
            f"free queue {s.free} but unreferenced blocks {sorted(expected)}",
            tuple(sorted(wrong)),
        )
    return None


def freed_after_writes(s: State) -> Violation | None:
    """With deferred freeing (``Config.defer_free``), no block on the free queue still has a
    write of a step in flight to run (an external load's excepted: vLLM fences only the steps
    that compute for a request). Guards against handing a block out while a step still writes
    it for its last owner: the new owner's fill (a connector's load, not ordered with the
    step's writes) can be overwritten by those stale writes, which is what vLLM's
    ``defer_block_free`` exists to prevent. Holds vacuously without deferred freeing, where
    such a free is vLLM's normal behaviour."""
    if not s.config.defer_free:
        return None
    for block in s.free:
        stale = [w for w in s.blocks[block].pending if not w.load]
        if stale:
            return Violation(
                "FreedAfterWrites",
                f"block {block} is free while step {stale[0].step} will still write it "
                f"for r{stale[0].req}",
                (block,),
                (stale[0].req,),
                stale[0].step,
            )
    return None


def hash_index_consistent(s: State) -> Violation | None:
    """The index and the blocks' own hashes agree: every indexed block carries that hash, every
    hashed block is indexed once. Guards against stale entries that outlive an eviction."""
    indexes = [(0, s.index), *s.group_index.items()]  # several groups: one index each
    indexed = [blk for _, index in indexes for blocks in index.values() for blk in blocks]
    if len(indexed) != len(set(indexed)) or any(
        not blocks for _, index in indexes for blocks in index.values()
    ):
        twice = tuple(sorted({b for b in indexed if indexed.count(b) > 1}))
        return Violation(
            "HashIndexConsistent", "a block is indexed twice, or an index entry is empty", twice
        )
    for g, key, blocks in ((g, k, v) for g, index in indexes for k, v in index.items()):
        for block in blocks:
            if s.blocks[block].key != key or s.blocks[block].group != g:
                return Violation(
                    "HashIndexConsistent",
                    f"block {block} is indexed under a hash it does not carry",
                    (block,),
                )
    hashed = {blk for blk, b in enumerate(s.blocks) if b.key is not None}
    if hashed != set(indexed):
        wrong = sorted(hashed ^ set(indexed))
        return Violation(
            "HashIndexConsistent",
            f"blocks {wrong} carry a hash but are not indexed, or vice versa",
            tuple(wrong),
        )
    return None


def null_block_pinned(s: State) -> Violation | None:
    """Block 0 is never allocated, freed, published or queued. It is in no table, but with a
    sliding window at a running request's positions wholly before the window of its next
    token (``State.skipped`` of its computed tokens), as a leading run."""
    b = s.blocks[NULL_BLOCK]
    in_table = any(misplaced_null(s, r) for r in s.requests.values())
    if b.refcount or b.key is not None or NULL_BLOCK in s.free or in_table:
        holders = tuple(r.id for r in s.requests.values() if misplaced_null(s, r))
        return Violation(
            "NullBlockPinned",
            "the null block was allocated, published or queued, or is in a table where no "
            "sliding window skips",
            (NULL_BLOCK,),
            holders,
        )
    return None


def misplaced_null(s: State, req: Request) -> bool:
    """The request's table holds the null block where no sliding window skips: anywhere under
    full attention; with one, in the table of a request not running, or anywhere but a leading
    run of positions wholly before the window of the token after its processed ones (computed,
    less those its live entries in flight schedule)."""
    nulls = [i for i, b in enumerate(req.table) if b == NULL_BLOCK]
    if not nulls:
        return False
    if not s.config.local or req.status != "running":
        return True
    bsz = s.config.block_size
    flying = sum(  # a load's tokens are computed at once (WindowLoad)
        st.entries[req.id].end - st.entries[req.id].start - st.entries[req.id].loaded * bsz
        for st in s.steps
        if req.id in st.entries and req.id in st.live
    )
    processed = max(0, req.computed - flying)
    return nulls != list(range(len(nulls))) or len(nulls) > s.skipped(processed)


def table_fits(s: State, req: Request) -> bool:
    """The request's table covers exactly its computed tokens (a running one) or nothing; with
    speculative decoding a running table may also keep the blocks of up to K rejected drafts
    past them (vLLM keeps them for the next decode's slots), and under async scheduling of up
    to K per step that can be in flight at once (D steps scheduled as if every draft were
    accepted may each reject K of them before the request is scheduled again)."""
    if req.status != "running":
        return not req.table and not req.computed
    cfg = s.config
    bsz, n = cfg.block_size, len(req.table)
    slack = cfg.spec_tokens * (cfg.depth if cfg.async_scheduling else 1)
    return -(-req.computed // bsz) <= n <= -(-(req.computed + slack) // bsz)


def table_matches_computed(s: State) -> Violation | None:
    """A running request's table covers exactly its computed tokens (and at most the slots of K
    rejected drafts beyond them); a waiting or finished one holds nothing. Guards against blocks
    kept past a preemption and tokens without a block."""
    for req in s.requests.values():
        if s.config.hybrid and not groups.tables_fit(s, req):
            return Violation(
                "TableMatchesComputed",
                f"r{req.id} ({req.status}) has group tables {req.group_tables} for "
                f"{req.computed} tokens",
                tuple(groups.held(req)),
                (req.id,),
            )
        if not table_fits(s, req):
            return Violation(
                "TableMatchesComputed",
                f"r{req.id} ({req.status}) has {len(req.table)} blocks for {req.computed} tokens",
                tuple(req.table),
                (req.id,),
            )
    return None


def steps_in_order(s: State) -> Violation | None:
    """At most D submitted steps are in flight, at most one is building and it is the newest, and
    steps execute and commit oldest first."""
    phases = [st.phase for st in s.steps]
    submitted = [p for p in phases if p != "building"]
    if len(submitted) > s.config.depth or "building" in phases[:-1]:
        return Violation("StepsInOrder", f"steps in flight {phases} with depth {s.config.depth}")
    if submitted != sorted(submitted, key=lambda p: p != "executed"):
        return Violation("StepsInOrder", f"a step executed before an older one: {phases}")
    return None


def no_leak_at_quiescence(s: State) -> Violation | None:
    """With no live request and no step in flight, every block but the null block is free (so
    every deferred free has been drained)."""
    live = any(r.status != "finished" for r in s.requests.values())
    if not live and not s.steps and len(s.free) != len(s.blocks) - 1:
        leaked = tuple(b for b in range(1, len(s.blocks)) if b not in s.free)
        return Violation(
            "NoLeakAtQuiescence",
            f"idle, yet only {len(s.free)} of {len(s.blocks) - 1} blocks are free",
            leaked,
        )
    return None


def hit_served_by_every_group(s: State) -> Violation | None:
    """Several groups: an admission's hit is one length ``L`` that every group serves by its
    own rule: ``L / B_g`` positions in each group, full attention every one a block published
    under the request's chained prefix there, a window the blocks of the window before ``L``
    (the null block before them), a state group the state published at exactly ``L`` (the null
    block before it), a cross group none (it caches nothing, whatever ``L``). Guards against a
    hit one group can serve and another cannot: the step then computes from ``L`` with a
    group's K/V or state missing or from another boundary."""
    if s.admission is None:
        return None
    rid, length, hits = s.admission
    req = s.requests[rid]
    for g, blocks in enumerate(hits):
        bs = groups.size(s, g)
        rule = groups.hit_positions(s, g, length)
        if groups.kind(s, g) == "slot":  # one state, published at exactly ``length``
            wrong = "" if _slot_hit(s, req, g, length, blocks) else f"blocks {list(blocks)}"
        elif groups.kind(s, g) == "cross":  # caches nothing: no block, whatever ``length``
            wrong = f"blocks {list(blocks)}" if blocks else ""
        elif length % bs or len(blocks) != length // bs:
            wrong = f"{len(blocks)} blocks of {bs} tokens"
        else:
            wrong = ""
            for i, block in enumerate(blocks):
                published = block != NULL_BLOCK and s.blocks[block].group == g
                published = published and s.blocks[block].key == groups.key(req, (i + 1) * bs)
                if (i in rule) != published or (i not in rule and block != NULL_BLOCK):
                    wrong = f"block {block} at position {i}"
                    break
        if wrong:
            return Violation(
                "HitServedByEveryGroup",
                f"r{rid}'s hit of {length} tokens is not served by group {g} "
                f"({groups.kind(s, g)}): {wrong}",
                tuple(b for b in blocks if b != NULL_BLOCK),
                (rid,),
            )
    return None


def _slot_hit(s: State, req: Request, g: int, length: int, blocks: tuple[int, ...]) -> bool:
    """A slot group's hit of ``length`` tokens: no block for 0, else the one block it copies,
    published in group ``g`` under the request's first ``length`` tokens."""
    if length % groups.size(s, g):
        return False
    if not length:
        return not blocks
    return len(blocks) == 1 and slots.published_state(s, req, g, blocks[0]) == length


def no_unwritten_state_read(s: State) -> Violation | None:
    """Several groups: a step that starts from a state block (the recurrence after its first
    ``start`` tokens) finds there the state after exactly those tokens, written by an earlier
    step (committed or in flight): not by its own step, whose recurrence reads the state once,
    before any of the step's writes (another request's state written in the same step is not
    there yet). A slot group's slot (``spec/slots.py``) may also have it from a copy run
    first thing in the step: the admission's copy of its hit, which brings what the source
    holds then (a source not at its boundary yet, or overwritten, is found here). The state
    form of ``NoUnwrittenRead``: a
    state written at another boundary, or never written, makes every later token silently
    wrong with no K/V involved."""
    if s.bad_state_reads:
        step_id, rid, block = s.bad_state_reads[0]
        return Violation(
            "NoUnwrittenStateRead",
            f"step {step_id} read block {block} as r{rid}'s state but it does not hold the state "
            "after the step's start",
            (block,),
            (rid,),
            step_id,
        )
    if not s.config.hybrid:
        return None
    for step, rid, e, g, at, block, tokens in groups.reads_in_flight(s, None):
        if groups.kind(s, g) not in ("state", "slot"):
            continue
        wanted = groups.read_content(s, g, e.start, at, tokens)
        if groups.kind(s, g) == "slot":  # its own step's copies run before its read
            before = slots.before_forward(s, block, step.id)
        else:
            before = eventual_content(s, block, upto_step=step.id - 1)  # not its own step's
        if not groups.valid(s, g, before, wanted):
            copied = tuple(w.source for w in s.blocks[block].pending if w.source is not None)
            return Violation(
                "NoUnwrittenStateRead",
                f"step {step.id} will read block {block} as r{rid}'s state after "
                f"{e.start} tokens, but no write that runs first puts that state there"
                + (f" (copied from block {copied[-1]})" if copied else ""),
                (block, *copied),
                (rid,),
                step.id,
            )
    return None


def no_read_of_recycled(s: State) -> Violation | None:
    """Several groups: no block a step in flight still reads, in groups 1 .. G - 1, has left
    its running request's table (skipped and nulled, freed, handed to another) before the step
    runs: a freed block can be handed out and overwritten under the step's read. A window
    group's step reads its own blocks too (its later tokens attend to its earlier ones:
    ``groups.window_blocks_in_flight``). Group 0's form is ``NoUnwrittenRead``'s window clause
    (so every one-group verdict reads as before). Under an
    observed policy a step already submitted reads what it was handed, whatever the engine's own
    ``dedup`` or let-go did to the table since (``observed.dedup``: on one stream a block given
    up is overwritten only by a step launched later); whether its bytes survive until it runs
    is ``NoUnwrittenRead``'s to judge, at execute. A slot group's slot (``spec/slots.py``) is no
    block the engine gives up on its own: every live entry of a step not executed yet, submitted
    or building, reads and writes the slot its request holds (``recycled_slot``). A track
    slot (``spec/tracks.py``) is written and never read by a step, and one let go under a
    submitted writer takes that write before any later step's copy or write (steps execute in
    order): no clause here (``docs/model.md``, "Track slots"); a writer withdrawn while
    building drops its track write (``tracks.withdraw``)."""
    if not s.config.hybrid:
        return None
    found = recycled_slot(s)
    if found is not None:
        return found
    observed = s.config.policy in OBSERVED_POLICIES
    read = (
        (step, rid, g, at, block)
        for step, rid, _, g, at, block, _ in groups.reads_in_flight(s, None)
    )
    for step, rid, g, at, block in chain(read, groups.window_blocks_in_flight(s)):
        if observed and step.phase != "building":
            continue
        req = s.requests[rid]
        table = s.table_of(req, g) if req.group_tables else []
        if req.status == "running" and (at >= len(table) or table[at] != block):
            return Violation(
                "NoReadOfRecycled",
                f"step {step.id} will read block {block} as r{rid}'s group {g} block {at}, but "
                f"r{rid}'s table gave it up before the step ran",
                (block,),
                (rid,),
                step.id,
            )
    return None


def recycled_slot(s: State) -> Violation | None:
    """``NoReadOfRecycled`` of a slot group: the first live entry of a step not executed yet
    whose request no longer holds the slot the entry reads or writes (it let go of its tables:
    preempted with its output still delivered; the slot may be handed out and rewritten
    under the step)."""
    if not s.config.slots:
        return None
    for step, rid, e in groups.live_group_entries(s):
        req = s.requests[rid]
        for g, blocks in enumerate(e.group_blocks, 1):
            if groups.kind(s, g) != "slot" or not blocks:
                continue
            table = s.table_of(req, g) if req.group_tables else []
            if not table or table[0] != blocks[0]:
                return Violation(
                    "NoReadOfRecycled",
                    f"step {step.id} will read and write block {blocks[0]} as r{rid}'s slot in "
                    f"group {g}, but r{rid} let go of it before the step ran",
                    (blocks[0],),
                    (rid,),
                    step.id,
                )
    return None


def state_at_its_boundary(s: State) -> Violation | None:
    """Several groups: a published state block holds, or will once the writes in flight run,
    the state after exactly the tokens of its key: it was written by a step that ended at its
    boundary, of the same chained prefix. Guards against publishing a state computed at
    another boundary, or never written (its writer preempted before it ran under an eager
    policy): the hit that follows resumes the recurrence from it. A slot group's state is
    published by the engine's ``snapshot`` (``spec/slots.py``): in place, or in a block that
    takes a copy of the slot as the steps submitted by then leave it."""
    for g, index in s.group_index.items():
        if groups.kind(s, g) not in ("state", "slot"):
            continue
        for key, blocks in index.items():
            for block in blocks:
                if eventual_content(s, block) != key:
                    return Violation(
                        "StateAtItsBoundary",
                        f"group {g}'s block {block} is published as the state after {len(key)} "
                        "tokens, which it will never hold",
                        (block,),
                        _holders(s, block),
                    )
    return None


def cross_blocks_private(s: State) -> Violation | None:
    """Several groups: a block of a cross-attention group's table (``docs/model.md``,
    "Cross-attention") is held by that table alone, at one position, and never published: it
    holds one request's encoder output, which no other request's tokens name. Guards against a
    cross block handed to a second table (a hit, a block allocated twice) or registered as
    cached: its next reader would attend to another request's encoder output."""
    found = groups.private_cross_blocks(s)
    if found is None:
        return None
    rid, g, block = found
    return Violation(
        "CrossBlocksPrivate",
        f"block {block} of r{rid}'s cross-attention group {g} is shared or published",
        (block,),
        _holders(s, block),
    )


@dataclass(frozen=True)
class Invariant:
    """One invariant, once: its name, its definition, why it matters and what can break it."""

    name: str
    definition: Callable[[State], Violation | None]
    broken_by: tuple[str, ...] = ()
    """The policy traits (``axis=value``, ``policies.AXES``) and configuration features
    (``features.FEATURES``) under which the spec's own actions reach a state that violates it:
    a form that follows any of them must evaluate it. Empty: only a wrong effect an engine
    applies by itself (observed judging) or a bug of the spec can break it, so a form whose
    state only the spec's actions change may leave it out, saying so (``kvspec/twins.py``)."""

    @property
    def explanation(self) -> str:
        """The definition's docstring, on one line."""
        return " ".join((self.definition.__doc__ or "").split())


REGISTRY: dict[str, Invariant] = {
    inv.name: inv
    for inv in (
        Invariant("HitServedByEveryGroup", hit_served_by_every_group, ("groups",)),
        Invariant("NoUnwrittenStateRead", no_unwritten_state_read, ("groups",)),
        Invariant("NoReadOfRecycled", no_read_of_recycled, ("groups",)),
        Invariant("StateAtItsBoundary", state_at_its_boundary, ("groups",)),
        Invariant("CrossBlocksPrivate", cross_blocks_private),
        Invariant("NoUnwrittenRead", no_unwritten_read, ("publish=at-schedule",)),
        Invariant("NoUnwrittenPublish", no_unwritten_publish, ("publish=at-schedule",)),
        Invariant("RefcountIsOwnership", refcount_is_ownership),
        Invariant("SharedImpliesSamePrefix", shared_implies_same_prefix),
        Invariant("FreeQueueExact", free_queue_exact),
        Invariant("FreedAfterWrites", freed_after_writes, ("defer_free",)),
        Invariant("HashIndexConsistent", hash_index_consistent),
        Invariant("NullBlockPinned", null_block_pinned),
        Invariant("TableMatchesComputed", table_matches_computed),
        Invariant("StepsInOrder", steps_in_order),
        Invariant("NoLeakAtQuiescence", no_leak_at_quiescence),
    )
}
"""Every invariant, in the order they are checked: THE list. The incremental checks, the fast
model's and the Z3 model's sets are checked against it (``tests/test_twins.py``, through
``kvspec/twins.py``'s table)."""

INVARIANTS: dict[str, Callable[[State], Violation | None]] = {
    name: inv.definition for name, inv in REGISTRY.items()
}
"""The definitions by name, in ``REGISTRY`` order."""


def check(s: State, names: Collection[str] | None = None) -> Violation | None:
    """The first invariant that fails, or None; only those in ``names`` when given."""
    for name, predicate in INVARIANTS.items():
        if names is not None and name not in names:
            continue
        violation = predicate(s)
        if violation is not None:
            return violation
    return None


def tables_append_only(before: dict[int, tuple[int, ...]], s: State) -> Violation | None:
    """TablesAppendOnly: while a request stays running, its table only grows at the end (with
    a sliding window, but for skipped positions replaced by the null block, which
    NullBlockPinned places). ``before`` maps running requests to their tables in the previous state."""
    for rid, table in before.items():
        req = s.requests[rid]
        now = tuple(req.table[: len(table)])
        if s.config.local:  # skipped positions may turn null, from the head
            now = tuple(b if b != NULL_BLOCK else table[i] for i, b in enumerate(now))
        if req.status == "running" and now != table:
            changed = tuple(sorted(set(table) ^ set(req.table[: len(table)])))
            return Violation(
                "TablesAppendOnly",
                f"r{rid}'s table changed from {list(table)} to {req.table} while running",
                changed,
                (rid,),
            )
    return None


def running_tables(s: State) -> dict[int, tuple[int, ...]]:
    return {rid: tuple(s.requests[rid].table) for rid in s.running}
