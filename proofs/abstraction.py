"""The abstraction from a spec state to a finite instance of the parametric model.

``parametric.py`` proves its invariant for every size; the proof speaks of the spec only through
this map and the twin test built on it (``tests/test_parametric_twin.py``): for a spec state s
of the fragment, ``encode`` gives the constraints saying that a parametric state, over finite
sorts holding the state's requests and blocks, *is* s (tables, holders, the free queue as a set,
published keys, written and pending contents as hashes, the live entries, the steps in flight);
``Checker.step_agrees`` asks Z3 whether the model's action of the same kind takes the encoding
of s to the encoding of the spec's successor, for some parameters (the model is an
over-approximation, so *some* is the refinement: every spec step is a model step), and
``Checker.invariant_holds`` whether the encoding satisfies the model's invariant for some value of
the ghost ``hw`` (so every reachable spec state the walks visit is inside it).

Hashes are the spec's keys themselves: each distinct token prefix gets a distinct ``Hash``
constant, and ``hk(r, i)`` is r's prefix of i + 1 tokens.

**Block size B > 1: each spec block is B one-position blocks ("slots").** Spec block k > 0 is
the instance's blocks ``(k - 1) * B + j``, j = 0 .. B - 1: slot j of the block at table index i
is at position ``i * B + j``, held, freed and published with its block (a published key of
(i + 1) * B tokens gives slot j the key of its first i * B + j + 1). A spec content (the prefix
a block's bytes hold, tokens 0 .. the last slot written) makes the slots it covers valid, each
holding its own prefix; the slots past it are left free in the encoding (the spec claims nothing
of those bytes: no reader is served by them). A pending write of step t covers the slots of the
positions its entry computes (from the entry's start, or the block's first slot, to the
prefix's end). So the abstraction at B > 1 is a relation, not a function: the twin test asks
for *some* encoding of the pre-state and of the successor, as it already does for the ghosts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import z3

from kvspec.spec.state import NULL_BLOCK, Draft, Placeholder, State

from . import all_sizes
from . import parametric as pm

STATUS = {"waiting": pm.WAITING, "running": pm.RUNNING, "finished": pm.FINISHED}
PHASE = {"building": pm.BUILDING, "submitted": pm.SUBMITTED, "executed": pm.EXECUTED}

TWIN_KINDS = pm.Model.ACTIONS
"""Every action of the parametric model: each spec step must be one of them."""


def in_fragment(s: State) -> bool:
    """The parametric model's fragment: any block size, synchronous or async scheduling (stale
    output dropped or delivered), drafts (under async scheduling with stale output dropped
    only), no window, no deferred frees; prefix caching on; a safe policy (external loads are
    in, at every block size: a load of the last known token's block, ``loaded_last``, too)."""
    c = s.config
    return (
        c.prefix_caching
        and not (c.spec_tokens and c.async_scheduling and c.stale_output == "deliver")
        and c.sliding_window is None
        and not c.defer_free
        and c.policy in ("deferred", "hide-uncommitted")
    )


class Checker:
    """A finite instance: ``requests`` request ids, the config's blocks (``block_size`` slots
    each), step ids 0 .. ``steps`` - 1; a pre- and a post-state over it, and the model's actions
    and invariant over them, each built once."""

    def __init__(
        self,
        requests: int,
        blocks: int,
        steps: int,
        planted: str | None = None,
        block_size: int = 1,
    ):
        self.v = v = pm.Vocab(requests, (blocks - 1) * block_size, range(steps))
        self.model = pm.Model(v, planted=planted)
        self.steps = steps
        self.bsz = block_size
        self.pre, self.post = pm.symbolic_state(v, "A"), pm.symbolic_state(v, "B")
        self.hashes: dict[tuple[Any, ...], Any] = {}
        self.axioms = v.axioms()
        self._actions: dict[str, pm.Transition] = {}
        self._moves: dict[str, Any] = {}
        self._at: tuple[State, Any] | None = None

    # The model's terms over the instance are most of a query's cost: each is built when first
    # asked for (a walk of a planted model asks for no invariant), then kept.
    @functools.cached_property
    def safety(self) -> dict[str, Any]:
        return self.model.safety(self.pre)

    @functools.cached_property
    def invariant(self) -> Any:
        """The safety predicates, then the lemmas (``Model.invariant``)."""
        return z3.And([*self.safety.values(), *self.model.lemmas(self.pre).values()])

    def action(self, kind: str) -> pm.Transition:
        if kind not in self._actions:
            self._actions[kind] = self.model.transition(kind, self.pre)
        return self._actions[kind]

    def move(self, kind: str) -> Any:
        """The action's guard and its successor equal to ``post``, pointwise."""
        if kind not in self._moves:
            t = self.action(kind)
            self._moves[kind] = z3.And(t.guard, *self.same(t.post, self.post))
        return self._moves[kind]

    def solver_at(self, s: State) -> Any:
        """A solver holding the axioms and the encoding of s as the pre-state: every query about
        s (its invariant, its safety values, each step from it) is pushed on it and popped, so
        s is encoded once. Kept for the last state asked about (the walks ask about one state,
        then its successors, never going back to a state mutated in between)."""
        if self._at is None or self._at[0] is not s:
            solver = z3.Solver()
            solver.set("timeout", 30_000)
            solver.add(self.axioms, *self.encode(self.pre, s, _base(s)))
            self._at = (s, solver)
        return self._at[1]

    def h(self, prefix: Sequence[Any]) -> Any:
        key = tuple(prefix)
        if key not in self.hashes:
            self.hashes[key] = z3.Const(f"h{len(self.hashes)}", self.v.Hash)
        return self.hashes[key]

    def content(self, s: State, c: Sequence[Any]) -> tuple[bool, Any]:
        """Whether bytes holding ``c`` are valid, and the hash they hold. Known tokens: the
        prefix's own constant. Placeholders (async scheduling) and drafts: valid while every one is
        the sample of a live entry of a step in flight (it will resolve to the request's token
        there: ``hk`` of that position, not fixed yet), garbage once one was discarded."""
        marks = [x for x in c if isinstance(x, (Placeholder, Draft))]
        if not marks:
            return True, self.h(c)
        live = {(st.id, r) for st in s.steps for r in st.live if st.entries[r].samples}
        if any((p.step, p.req) not in live for p in marks):
            return False, None
        return True, self.v.hk(self.v.req[marks[0].req], len(c) - 1)

    def slots(self, block: int) -> list[Any]:
        """The instance's blocks standing for spec block ``block`` (> 0), slot 0 first."""
        first = (block - 1) * self.bsz
        return list(self.v.blk[first : first + self.bsz])

    def bytes_of(self, s: State, x: pm.PState, block: int, c: Any) -> list[Any]:
        """The written bytes of ``block`` (content ``c``) on its slots. Block size 1: valid or
        not, exactly. Larger: the slots the content covers, each its own prefix (valid while
        every placeholder in it may still resolve); the others free."""
        slots = self.slots(block)
        if c is None or len(c) == 0:
            return [] if self.bsz > 1 else [x.wv(slots[0]) == False]  # noqa: E712
        first = (len(c) - 1) // self.bsz * self.bsz
        out = []
        for j, b in enumerate(slots):
            if first + j >= len(c):
                continue
            valid, held = self.content(s, c[: first + j + 1])
            if valid:
                out += [x.wv(b), x.wh(b) == held]
            elif self.bsz == 1:
                out.append(z3.Not(x.wv(b)))
        return out

    def distinct_hashes(self) -> Any:
        hs = list(self.hashes.values())
        return z3.Distinct(*hs) if len(hs) > 1 else z3.BoolVal(True)

    def encode(self, x: pm.PState, s: State, base: int) -> list[Any]:
        """Constraints saying that x is s (the parts the model gives a meaning to); step id t
        of the spec is ``t - base`` in the instance (ids only matter by their order)."""
        v, out = self.v, []
        req = v.req
        lo = s.steps[0].id if s.steps else s.next_step
        out += [x.lo == lo - base, x.hi == s.next_step - base, x.bad == bool(s.bad_reads)]
        if not 0 <= lo - base <= s.next_step - base < self.steps:
            raise ValueError(f"steps {lo}..{s.next_step} are beyond the instance's ids")
        for i, r in enumerate(req):
            q = s.requests.get(i)
            out.append(x.status(r) == (STATUS[q.status] if q else pm.ABSENT))
            # a load that took the last token's block whole: computed stops one short (that
            # token is computed again over it), the model's comp counts it (``loaded_last``)
            out.append(x.comp(r) == (q.computed + q.loaded_last if q else 0))
            out.append(x.loading(r) == (q is not None and q.loading is not None))
            tokens = q.tokens if q is not None else []
            for j in range(len(tokens)):
                out.append(v.hk(r, j) == self.h(tokens[: j + 1]))
            out += self.snapshot(x, s, i)
            for block in range(1, len(s.blocks)):
                held = q is not None and block in q.table
                for j, b in enumerate(self.slots(block)):
                    out += [x.tab(r, b) == held, x.ref(r, b) == held]
                    if held:
                        assert q is not None
                        out.append(x.pos(r, b) == q.table.index(block) * self.bsz + j)
        bsz = self.bsz
        for block in range(1, len(s.blocks)):
            kv = s.blocks[block]
            for j, b in enumerate(self.slots(block)):
                out.append(x.free(b) == (block in s.free))
                out.append(x.pub(b) == (kv.key is not None))
                if kv.key is not None:
                    out.append(x.key(b) == self.h(kv.key[: len(kv.key) - bsz + j + 1]))
                by_step: dict[int, Any] = {}
                for w in kv.pending:
                    writer = next(st for st in s.steps if st.id == w.step)
                    first = (len(w.prefix) - 1) // bsz * bsz
                    at = first + j
                    if max(writer.entries[w.req].start, first) <= at < len(w.prefix):
                        if rewrite(kv, w, writer.entries[w.req].start, first):
                            continue
                        if w.step - base in by_step:
                            raise ValueError(f"block {block} has two pending writes of one step")
                        by_step[w.step - base] = (w, at)
                for t in range(self.steps):
                    found = by_step.get(t)
                    out.append(x.pw(t, b) == (found is not None))
                    if found is not None:
                        w, at = found
                        out.append(x.pwr(t, b) == req[w.req])
                        valid, held = self.content(s, w.prefix[: at + 1])
                        if valid:  # else a withdrawn write of garbage: its execution garbles
                            out.append(x.pwh(t, b) == held)
            out += self.bytes_of(s, x, block, kv.written)
        for t in range(self.steps):
            st = next((st for st in s.steps if st.id - base == t), None)
            if st is not None:
                out.append(x.phase(t) == PHASE[st.phase])
            for i, r in enumerate(req):
                e = st.entries.get(i) if st is not None else None
                live = e is not None and st is not None and i in st.live
                out.append(x.live(t, r) == live)
                out.append(x.failed(t, r) == (st is not None and i in st.failed))
                if live:
                    assert e is not None
                    out += [x.estart(t, r) == e.start, x.eend(t, r) == e.end]
                    out.append(x.eload(t, r) == e.load)
        assert NULL_BLOCK == 0
        return out

    def snapshot(self, x: pm.PState, s: State, i: int) -> list[Any]:
        """A waiting request with live entries (preempted, its stale output delivered): the
        table those entries read (the longest entry's blocks, a prefix of its table when it
        was preempted) is its snapshot ``stab``/``spos``; any further snapshot block lies past
        every live entry's end (allocated in the step that preempted it, withdrawn)."""
        q = s.requests.get(i)
        if q is None or q.status != "waiting":
            return []
        entries = [st.entries[i] for st in s.steps if i in st.live]
        if not entries:
            return []
        r, seen = self.v.req[i], max(entries, key=lambda e: len(e.blocks)).blocks
        end = max(e.end for e in entries)
        out = []
        for block in range(1, len(s.blocks)):
            for j, b in enumerate(self.slots(block)):
                if block in seen:
                    out += [x.stab(r, b), x.spos(r, b) == seen.index(block) * self.bsz + j]
                else:
                    out.append(z3.Implies(x.stab(r, b), x.spos(r, b) >= end))
        return out

    def same(self, a: pm.PState, b: pm.PState) -> list[Any]:
        """a and b agree everywhere on the instance (every field, pointwise)."""
        v, out = self.v, []
        ints = [z3.IntVal(t) for t in range(self.steps)]
        out += [a.lo == b.lo, a.hi == b.hi, a.bad == b.bad]
        for r in v.req:
            out += [a.status(r) == b.status(r), a.comp(r) == b.comp(r)]
            out.append(a.loading(r) == b.loading(r))
            for x in v.blk:
                out += [a.tab(r, x) == b.tab(r, x), a.ref(r, x) == b.ref(r, x)]
                out.append(z3.Implies(a.tab(r, x), a.pos(r, x) == b.pos(r, x)))
            for t in ints:
                read = z3.And(a.status(r) == pm.WAITING, a.live(t, r))
                for x in v.blk:
                    seen_a = z3.And(a.stab(r, x), a.spos(r, x) < a.eend(t, r))
                    seen_b = z3.And(b.stab(r, x), b.spos(r, x) < b.eend(t, r))
                    out.append(z3.Implies(read, seen_a == seen_b))
                    out.append(z3.Implies(z3.And(read, seen_a), a.spos(r, x) == b.spos(r, x)))
                out.append(a.live(t, r) == b.live(t, r))
                out.append(a.failed(t, r) == b.failed(t, r))
                out.append(z3.Implies(a.live(t, r), a.eload(t, r) == b.eload(t, r)))
                out.append(
                    z3.Implies(
                        a.live(t, r),
                        z3.And(a.estart(t, r) == b.estart(t, r), a.eend(t, r) == b.eend(t, r)),
                    )
                )
        for x in v.blk:
            out += [a.free(x) == b.free(x), a.pub(x) == b.pub(x), a.wv(x) == b.wv(x)]
            out.append(z3.Implies(a.pub(x), a.key(x) == b.key(x)))
            out.append(z3.Implies(a.wv(x), a.wh(x) == b.wh(x)))
            for t in ints:
                out.append(a.pw(t, x) == b.pw(t, x))
                out.append(
                    z3.Implies(
                        a.pw(t, x), z3.And(a.pwr(t, x) == b.pwr(t, x), a.pwh(t, x) == b.pwh(t, x))
                    )
                )
        for t in ints:
            out.append(z3.Implies(z3.And(a.lo <= t, t < a.hi), a.phase(t) == b.phase(t)))
        return out

    def step_agrees(self, s: State, decision: tuple[Any, ...], post: State) -> bool:
        """Whether the model's action of the decision's kind (its request or step fixed) takes
        the encoding of s to the encoding of the spec's successor ``post``."""
        all_sizes.admit_decision(decision)
        kind = str(decision[0])
        t = self.action(kind)
        solver = self.solver_at(s)
        solver.push()
        try:
            solver.add(*self.encode(self.post, post, _base(s)))
            solver.add(self.move(kind), self.distinct_hashes())
            if kind in ("arrive", "schedule", "preempt", "abort"):
                solver.add(t.params["r"] == self.v.req[int(str(decision[1]))])
            if kind == "execute":
                solver.add(t.params["t"] == int(str(decision[1])) - _base(s))
            return bool(_decided(solver) == z3.sat)
        finally:
            solver.pop()

    def invariant_holds(self, s: State) -> bool:
        """Whether the encoding of s satisfies the model's invariant (for some ghost ``hw``)."""
        solver = self.solver_at(s)
        solver.push()
        try:
            solver.add(self.distinct_hashes(), self.invariant)
            return bool(_decided(solver) == z3.sat)
        finally:
            solver.pop()

    def safety_values(self, s: State) -> dict[str, bool]:
        """Each safety predicate's value on the encoding of s (it does not read the ghost, so
        the encoding fixes it). Two queries for all of them: a model of the encoding gives
        each predicate a value, and no model of the encoding gives any predicate the other."""
        solver = self.solver_at(s)
        solver.push()
        try:
            solver.add(self.distinct_hashes())
            if _decided(solver) != z3.sat:
                raise AssertionError(f"the encoding of {s} has no model")
            found = solver.model()
            out = {
                name: z3.is_true(found.eval(term, model_completion=True))
                for name, term in self.safety.items()
            }
            solver.add(z3.Or([term != z3.BoolVal(out[n]) for n, term in self.safety.items()]))
            if _decided(solver) == z3.sat:
                other = solver.model()
                loose = [
                    n
                    for n, term in self.safety.items()
                    if z3.is_true(other.eval(term, model_completion=True)) != out[n]
                ]
                raise AssertionError(f"{', '.join(loose)} not fixed by the encoding of {s}")
            return out
        finally:
            solver.pop()


def rewrite(kv: Any, w: Any, start: int, first: int) -> bool:
    """Whether pending write ``w`` (of an entry starting at ``start``, on a block whose first
    position is ``first``) rewrites bytes the block holds already: the oldest pending write,
    of exactly the written prefix, from an entry that starts inside the block. That is the
    recomputation of a loaded last token (``loaded_last``): its block, loaded whole and
    published, gets the same prefix again. It is not encoded (nothing changes when it runs;
    the model's ``schedule`` writes no published slot), and stays so when the block is evicted
    meanwhile (its bytes and its pending writes do not change then)."""
    return start > first and kv.pending[0] is w and kv.written == w.prefix


def _base(s: State) -> int:
    return s.steps[0].id if s.steps else s.next_step


def _decided(solver: Any) -> Any:
    answer = solver.check()
    if answer == z3.unknown:
        raise AssertionError(f"the twin query is undecided: {solver.reason_unknown()}")
    return answer
