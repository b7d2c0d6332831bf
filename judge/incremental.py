"""Incremental forms of the invariants: the same predicates, evaluated only where a decision changed
the state.

``invariants.py`` holds THE definitions; each scans the whole state, which costs O(blocks + table
entries + in-flight reads) per decision and dominates the checking of a long trace. This module is
an optimization that decides exactly the same thing after every decision, given that every
invariant held before it. The argument, by induction over decisions:

1. Each invariant is a conjunction over *items*: a block (its refcount, hash, place in the free
   queue, holders), a request (its table, computed tokens, status), a read of a block by a step
   entry, a published (hash, block) pair. If every conjunct held before a decision, only those
   whose inputs the decision changed can be false after it.
2. ``State.touched`` (``state.Touched``) names those inputs: the pool mechanisms (``pool.py``)
   record every block whose refcount, hash or free-queue place they change and every request whose
   table they change; the actions record every block whose *content* (``written``, ``pending``)
   changes (``schedule``: the entry's write blocks; ``execute``: the step's; a request leaving a
   building step: its entry's blocks; a committed step's failed loads, no longer excused; under
   async scheduling with drafts, a later decode moved back over rejected drafts: its old and new
   write blocks), every new entry (a moved-back entry counts as new: all its reads are), every
   request that stops running, and every step transition.
3. ``Incremental.check`` re-evaluates, invariant by invariant in ``INVARIANTS`` order, the conjuncts
   over the footprint; the rest are unchanged. Two facts of the spec make some conjuncts stable:
   a request's tokens only grow (so the prefixes read or published for its full blocks never
   change) and, while a request holds its table, its computed tokens only grow, but for rejected
   draft tokens, which never take them below the tokens known when the drafts were scheduled (so
   a shared block, full of known tokens and computed, stays so). A read by a live entry is of a block in the request's
   current table at the same position (tables only grow while running; a request that leaves is
   no longer live), so the readers of a block are found among its holders.

When a conjunct fails, the full predicate of that invariant is evaluated for the message, so a
report is word for word the full check's; if the full predicate disagrees, that is a bug here and
``AssertionError`` is raised. ``tests/test_incremental.py`` checks on fuzzed traces that the
first violation (event and invariant) is the full check's, and that a planted bug is caught.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from kvspec.spec.invariants import (
    INVARIANTS,
    Violation,
    full_in,
    table_fits,
    tables_append_only,
)
from kvspec.spec.pool import eventual_content, holds
from kvspec.spec.state import NULL_BLOCK, Config, Content, State, Touched
from kvspec.twins import follows, refuse

TWIN_OF = "kvspec.spec"
"""This module restates the spec in another form (kvspec/twins.py says what it must equal)."""

TABLES_APPEND_ONLY = "TablesAppendOnly"
FORM = "kvspec.judge.incremental"
"""This module's row in kvspec/twins.py: the features it follows, the invariants it restates."""


def restates(config: Config) -> bool:
    """Whether these checks follow ``config`` (kvspec/twins.py); ``SpecModel`` judges any other
    configuration with the full definitions."""
    return follows(FORM, config)


class Incremental:
    """Checks the invariants after each decision from its footprint. Keeps, besides the spec's
    state, what the full definitions recompute every time: each request's table and whether it
    was running, the holders of each block (request -> table position) and each block's hash, as
    of the last check. Memory: O(blocks + live table entries)."""

    def __init__(self, s: State) -> None:
        """Start from ``s``, which must satisfy every invariant (e.g. an initial state).
        Raises ``twins.NotFollowed`` for a configuration its row refuses."""
        refuse(FORM, s.config)
        self.tables: dict[int, tuple[int, ...]] = {}
        self.running: set[int] = set(s.running)
        self.holders: dict[int, dict[int, int]] = {}
        self.keys = [b.key for b in s.blocks]
        self.verified: dict[int, set[int]] = {}
        """Block -> holders whose read of it as a full block was found valid while the block had
        no pending write; valid until its content changes or the holder lets go of it (a
        request's full-block prefix never changes: tokens only grow)."""
        for rid, req in s.requests.items():
            if req.table:
                self.tables[rid] = tuple(req.table)
                for i, block in enumerate(req.table):
                    self.holders.setdefault(block, {})[rid] = i
        self._old: dict[int, tuple[int, ...]] = {}
        """At a check: the old tables of the requests whose table changed."""
        self._added: list[tuple[int, int, int]] = []
        """At a check: the new (block, request, position) table occurrences."""
        self._order = (
            # (invariant, "a conjunct over the footprint is false", that answer is exact)
            ("NoUnwrittenRead", self._reads, True),
            ("NoUnwrittenPublish", self._published, True),
            ("RefcountIsOwnership", self._refcounts, True),
            ("SharedImpliesSamePrefix", self._shared, True),
            ("FreeQueueExact", self._free_queue, True),
            ("FreedAfterWrites", self._freed_writes, True),
            ("HashIndexConsistent", self._index, True),
            ("NullBlockPinned", self._null_block, False),
            ("TableMatchesComputed", self._tables_match, True),
            ("StepsInOrder", self._steps, False),
            ("NoLeakAtQuiescence", self._maybe_leak, False),
        )

    def check(
        self, s: State, fp: Touched, names: Collection[str] | None = None
    ) -> Violation | None:
        """The first invariant (``INVARIANTS`` order, then ``TablesAppendOnly``) that fails, or
        None; only those in ``names`` when given. ``fp``: what changed since the previous check
        (``s.touched``, or several decisions' records merged). The full check's answer, provided
        every invariant held at the previous check."""
        self._old, self._added = self._update_tables(s, fp)
        try:
            for name, may_fail, exact in self._order:
                if (names is None or name in names) and may_fail(s, fp):
                    violation = INVARIANTS[name](s)
                    if violation is not None:
                        return violation
                    if exact:
                        raise AssertionError(f"incremental {name} disagrees with its definition")
            if self._old and (names is None or TABLES_APPEND_ONLY in names):
                before = {
                    rid: table
                    for rid, table in self._old.items()
                    if rid in self.running and rid not in fp.left and rid in s.requests
                }
                for rid, index, block in fp.swapped:  # an engine's sanctioned dedup
                    table = before.get(rid)
                    if table is not None and index < len(table):
                        before[rid] = table[:index] + (block,) + table[index + 1 :]
                return tables_append_only(before, s)
            return None
        finally:
            keys, blocks = self.keys, s.blocks
            for block in fp.blocks:
                keys[block] = blocks[block].key
            for rid in fp.requests:
                req = s.requests.get(rid)
                if req is not None and req.status == "running":
                    self.running.add(rid)
                else:
                    self.running.discard(rid)

    # -- derived state ------------------------------------------------------------------------

    def _update_tables(
        self, s: State, fp: Touched
    ) -> tuple[dict[int, tuple[int, ...]], list[tuple[int, int, int]]]:
        """Bring tables and holders up to date for the footprint's requests; every block that
        gained or lost a holder joins ``fp.blocks``. Returns the changed requests' old tables and
        the new (block, request, position) occurrences."""
        old_tables: dict[int, tuple[int, ...]] = {}
        added: list[tuple[int, int, int]] = []
        holders, verified = self.holders, self.verified
        for block in fp.content:
            verified.pop(block, None)
        for rid in fp.requests:
            req = s.requests.get(rid)
            new = tuple(req.table) if req is not None else ()
            old = self.tables.get(rid, ())
            if new == old:
                continue
            old_tables[rid] = old
            keep = len(old) if new[: len(old)] == old else 0
            for i in range(keep, len(old)):
                block = old[i]
                mine = holders.get(block)
                if mine is not None and mine.get(rid) == i:
                    del mine[rid]
                    if not mine:
                        del holders[block]
                    if block in verified:
                        verified[block].discard(rid)
                fp.blocks.add(block)
            for i in range(keep, len(new)):
                block = new[i]
                holders.setdefault(block, {})[rid] = i
                fp.blocks.add(block)
                added.append((block, rid, i))
            if new:
                self.tables[rid] = new
            else:
                self.tables.pop(rid, None)
        return old_tables, added

    # -- one method per invariant: True when a conjunct over the footprint may fail ---------------

    def _reads(self, s: State, fp: Touched) -> bool:
        if s.bad_reads:
            return True
        if not fp.entries and not fp.content:
            return False
        steps = [st for st in s.steps if st.phase != "executed"]
        for step_id, rid in fp.entries:
            for st in steps:
                if st.id == step_id:
                    e = st.entries.get(rid)
                    if e is not None and not e.load and rid in st.live:
                        if not self._entry_ok(s, st.id, rid, e.start, e.blocks):
                            return True
        bsz = s.config.block_size
        for st in steps:  # stale output still delivered: live readers that hold no blocks now
            for rid, e in st.entries.items():
                if rid not in st.live or e.load or s.requests[rid].status == "running":
                    continue
                if (st.id, rid) in fp.entries:
                    continue
                for i, block in enumerate(e.blocks[: -(-e.start // bsz)]):
                    if block in fp.content and not _read_ok(s, st.id, rid, e.start, i, block):
                        return True
        for block in fp.content:
            mine = self.holders.get(block)
            if mine is None:
                continue
            for rid, i in mine.items():
                for st in steps:
                    e = st.entries.get(rid)
                    if (
                        e is not None
                        and i * bsz < e.start
                        and not e.load
                        and rid in st.live
                        and (st.id, rid) not in fp.entries  # checked whole above
                        and not _read_ok(s, st.id, rid, e.start, i, block)
                    ):
                        return True
        return False

    def _entry_ok(
        self, s: State, step_id: int, rid: int, start: int, blocks: tuple[int, ...]
    ) -> bool:
        """Every read of a new entry; a full block read before by the same holder, with no
        content change since and no pending write, is known to hold the prefix."""
        bsz, verified = s.config.block_size, self.verified
        tokens: Content | None = None
        for i in range(-(-start // bsz)):
            block = blocks[i]
            stable = (i + 1) * bsz <= start and not s.blocks[block].pending
            if stable and rid in verified.get(block, ()):
                continue
            if tokens is None:
                tokens = tuple(s.ahead(s.requests[rid])[:start])
            if not holds(eventual_content(s, block, upto_step=step_id), tokens[: (i + 1) * bsz]):
                return False
            if stable:
                verified.setdefault(block, set()).add(rid)
        return True

    def _published(self, s: State, fp: Touched) -> bool:
        if not fp.blocks and not fp.content:
            return False
        unreported: set[int] = set()
        for step in s.steps:
            for rid in step.failed:
                e = step.entries[rid]
                unreported.update(e.blocks[e.start // s.config.block_size :])
        index, keys, blocks = s.index, self.keys, s.blocks
        for changed in (fp.blocks, fp.content):
            for block in changed:
                key, before = blocks[block].key, keys[block]
                if key is None and before is None or block in unreported:
                    continue
                for k in (key, before) if key != before else (key,):
                    if k is not None and block in index.get(k, ()):
                        if not holds(eventual_content(s, block), k):
                            return True
        return False

    def _refcounts(self, s: State, fp: Touched) -> bool:
        for rid in self._old:
            table = self.tables.get(rid, ())
            if len(set(table)) != len(table):
                return True
        held: Counter[int] = Counter()
        for deferred in s.deferred:  # Config.defer_free: few, and short-lived
            if len(set(deferred.blocks)) != len(deferred.blocks):
                return True
            held.update(deferred.blocks)
        return any(
            block != NULL_BLOCK
            and s.blocks[block].refcount != len(self.holders.get(block, ())) + held[block]
            for block in fp.blocks
        )

    def _freed_writes(self, s: State, fp: Touched) -> bool:
        """A block that became free, or gained a write, while free (``Config.defer_free``)."""
        if not s.config.defer_free:
            return False
        for changed in (fp.blocks, fp.content):
            for block in changed:
                b = s.blocks[block]
                if b.refcount == 0 and any(not w.load for w in b.pending) and block in s.free:
                    return True
        return False

    def _shared(self, s: State, fp: Touched) -> bool:
        bsz = s.config.block_size
        for block, rid, i in self._added:
            mine = self.holders.get(block, {})
            if len(mine) < 2:
                continue
            other, j = next((o, j) for o, j in mine.items() if o != rid)
            req, o = s.requests[rid], s.requests[other]
            full = full_in(req, i, bsz) and full_in(o, j, bsz)
            if i != j or not full or s.key(req, i) != s.key(o, j):
                return True
        return False

    def _null_block(self, s: State, fp: Touched) -> bool:
        return NULL_BLOCK in fp.blocks

    def _steps(self, s: State, fp: Touched) -> bool:
        return fp.steps

    def _maybe_leak(self, s: State, fp: Touched) -> bool:
        """``no_leak_at_quiescence``'s cheap conjuncts first; its scan of requests if needed."""
        return not s.steps and len(s.free) != len(s.blocks) - 1

    def _free_queue(self, s: State, fp: Touched) -> bool:
        for block in fp.blocks:
            want = 1 if block != NULL_BLOCK and s.blocks[block].refcount == 0 else 0
            if s.free.count(block) != want:
                return True
        return False

    def _index(self, s: State, fp: Touched) -> bool:
        for block in fp.blocks:
            key, before = s.blocks[block].key, self.keys[block]
            if key is not None:
                owners = s.index.get(key)
                if not owners or owners.count(block) != 1:
                    return True
            if before is not None and before != key:
                owners = s.index.get(before)
                if owners is not None and (not owners or block in owners):
                    return True
        return False

    def _tables_match(self, s: State, fp: Touched) -> bool:
        for rid in fp.requests:
            req = s.requests.get(rid)
            if req is not None and not table_fits(s, req):
                return True
        return False


def _read_ok(s: State, step_id: int, rid: int, start: int, i: int, block: int) -> bool:
    """One conjunct of ``no_unwritten_read``: the step's read of the request's block ``i``."""
    prefix = tuple(s.ahead(s.requests[rid])[: min(start, (i + 1) * s.config.block_size)])
    return holds(eventual_content(s, block, upto_step=step_id), prefix)
