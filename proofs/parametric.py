"""The parametric model: the block lifecycle over unbounded sorts, for proofs at every size.

``symbolic.py`` encodes the spec at fixed sizes (N blocks, R requests, D steps, T tokens). This
module restates the part of it that the safety invariants depend on with **no sizes at all**:
requests (``Req``), blocks (``Blk``) and hashes (``Hash``) are uninterpreted sorts, step ids are
integers, and the state is a set of functions over them (the Ivy/EPR style: refcounts as a
holder relation, the free queue as a set, the index as each block's key). An inductive
invariant stated with quantifiers over those sorts, proved by Z3, holds in every state reachable
from the initial one for any number of blocks, requests, steps in flight and tokens
(``all_sizes.py`` runs the proof; ``docs/proofs.md``, "Every size", has the argument).

What is modelled, and how it relates to the spec (the twin: ``tests/test_parametric_twin.py``
checks that every spec transition is one of this model's, on random reachable states):

* **Fragment**: any block size, synchronous or async scheduling with stale output dropped or
  delivered, external loads (asynchronous, which may fail, and synchronous, a computation
  here; at any block size, the block of the last known token included, which the request
  then computes again: ``schedule``'s ``back``), draft tokens (``commit``'s ``rej``; under async scheduling, with
  stale output dropped, a rejection moves the request's later entries back: ``_move_back``),
  prefix caching on, no sliding window, no deferred frees. Under async
  scheduling a byte computed on a placeholder is modelled as the token it resolves to (``hk``
  is rigid), and the bytes of a leaving request's unpublished blocks with no pending write may
  turn to garbage (a discarded sample's placeholder never resolves: ``lost``). A preemption
  either drops the request's stale output (its entries in submitted steps stop being live) or
  delivers it (they stay live, reading the table it had, ``stab``; nothing is discarded, so
  nothing turns to garbage); the request is admitted again only once none is live. The policies
  ``deferred`` and ``hide-uncommitted`` both refine ``commit_publish``: under that fragment
  each publishes at a step's commit, after its writes, only blocks of live entries at positions
  the entry covers (the param model lets a commit publish *any* such set).
* **Over-approximation.** Every guard the safety argument does not need is dropped: any waiting
  request may be admitted and any running one preempted (so both disciplines and both
  preemption orders are covered), a lookup may hit any published blocks under the request's
  hashes, an allocation may take any free blocks (the queue's order is not modelled), any
  depth of steps in flight, no token budget, no ``max_running``, any finish at a commit, and
  every token sequence (``hk(r, i)``, the hash of request r's tokens 0..i, is a rigid
  uninterpreted function: any prompts and any sampled tokens; a run's final tokens fix it). A
  withdrawn entry may garble any of its writes, each slot's on its own (the spec garbles them
  when the read is bad, and those holding a discarded draft or placeholder); a live entry's garbles only if a read was bad, which the invariant rules
  out. Since the spec's transitions are among the model's, an invariant of the model is one of
  the spec (through the abstraction ``tests/test_parametric_twin.py`` computes).
* **Blocks of several positions.** A model block is one position (a slot); a spec block of B
  positions is B slots, which the abstraction keeps together. An allocation may take slots at
  positions past the scheduled tokens (the rest of a partial tail block: held ahead, written
  by nothing yet, ``reserved``); a later schedule of the same request computing those
  positions writes them (a pending write of its step, no allocation). A commit publishes any
  slots of covered positions, which includes publishing a full block's B slots at once (a
  partial block's later slots are past the entry's end, so never). So one proof covers every
  block size.
* **Refcounts as holders.** ``ref(r, b)``: request r holds a reference on block b (the spec's
  refcount is the number of holders, ``RefcountIsOwnership``); the pool adds a holder at a hit
  or an allocation and drops one at a free. The proof shows each added holder is new and each
  dropped one present, so the integer refcount of the spec is the holder count.

``planted`` names a deliberate bug (``PLANTS``), for the tests that require the proof or the
twin test to fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import z3

TWIN_OF = "kvspec.spec"

ABSENT, WAITING, RUNNING, FINISHED = 0, 1, 2, 3
"""A request's status (ABSENT: not arrived yet)."""
BUILDING, SUBMITTED, EXECUTED = 0, 1, 2
"""A step's phase."""

PLANTS = (
    "eager-publish",
    "no-evict",
    "lemma-too-strong",
    "hit-any-block",
    "publish-failed-load",
    "placeholders-resolve",
    "admit-while-stale",
    "garbage-on-deliver",
    "stale-dropped",
    "stale-samples-resolve",
    "publish-partial-block",
    "skip-reserved-write",
    "one-position-blocks",
    "publish-rejected-drafts",
    "drafts-resolve",
    "move-back-keeps-writes",
    "recompute-rewrites-published",
)
"""Planted bugs: ``eager-publish`` publishes the blocks a schedule allocates at once (the seed
bug, ``eager-unsafe``'s publish at schedule time, with no rollback); ``no-evict`` reuses a
cached block without dropping its hash; ``lemma-too-strong`` states a false lemma (every
published block is held by someone); ``hit-any-block`` lets a lookup hit a block published
under another hash; ``publish-failed-load`` lets a commit publish the blocks of a load that
failed (``deferred`` without its ``rid not in step.failed``); ``placeholders-resolve`` keeps
a leaving request's bytes valid (as if a discarded sample's placeholder resolved: a model that
is not the spec under async scheduling, which the twin test refuses). With stale output
delivered: ``admit-while-stale`` admits a preempted request again while its stale entries are
still live (the spec's ``admissible`` dropped); ``garbage-on-deliver`` lets a preemption that
delivers turn the leaver's bytes to garbage (as if its delivered samples never resolved);
``stale-dropped`` never keeps a preempted request's entries live (a model of dropped stale
output only, which the twin test refuses on delivered cells); ``stale-samples-resolve`` keeps
the bytes valid that a waiting request's stale entries computed on a sample discarded when it
leaves (the twin test refuses it too). Blocks of several positions: ``publish-partial-block``
lets a commit publish a slot past the entry's end (a partial tail block published whole, its
later positions still unwritten); ``skip-reserved-write`` lets a schedule compute positions
whose slots its request holds ahead without writing them (a step that writes only the blocks
it allocates, not the partial tail block it already holds); ``one-position-blocks`` allocates
only at computed positions (the block size 1 model, which the twin test refuses at block size
2). Drafts: ``publish-rejected-drafts`` lets a commit publish positions its rejection rolled
back; ``drafts-resolve`` keeps rejected drafts' bytes valid (the twin test refuses it);
``move-back-keeps-writes`` moves a rejecting request's later entries back under async
scheduling but leaves their pending writes where they were (none laid at the new positions).
Loads of the last token's block: ``recompute-rewrites-published`` lets the recomputation of
that token write its slot although the load's commit published it."""

Term = Any
"""A Z3 term (z3's stubs are untyped)."""


class Domains:
    """How quantifiers are made: over the unbounded sorts (no constants given: ``z3.ForAll`` /
    ``Exists``) or, for a finite instance (the twin test, a CTI search at small sizes), expanded
    over the finite sorts' constants and the given step ids, which keeps its queries
    quantifier-free."""

    def __init__(
        self, consts: dict[Any, Sequence[Term]] | None = None, steps: Sequence[int] = ()
    ) -> None:
        self.finite = consts is not None
        self.consts = consts or {}
        self.steps = steps
        self._fresh = itertools.count()

    def forall(self, sorts: Sequence[Any], body: Callable[..., Term]) -> Term:
        if not self.finite:
            xs = [z3.Const(f"q{next(self._fresh)}", s) for s in sorts]
            return z3.ForAll(xs, body(*xs))
        return z3.And([body(*xs) for xs in itertools.product(*(self._of(s) for s in sorts))])

    def exists(self, sorts: Sequence[Any], body: Callable[..., Term]) -> Term:
        if not self.finite:
            xs = [z3.Const(f"q{next(self._fresh)}", s) for s in sorts]
            return z3.Exists(xs, body(*xs))
        return z3.Or([body(*xs) for xs in itertools.product(*(self._of(s) for s in sorts))])

    def _of(self, sort: Any) -> Sequence[Term]:
        if sort == z3.IntSort():
            return [z3.IntVal(t) for t in self.steps]
        return self.consts[sort]


_instances = itertools.count()


class Vocab:
    """The sorts and the rigid functions: ``hk(r, i)`` is the hash of request r's tokens 0..i
    (slot i's key: a block of B positions is B slots, ``Model.schedule``); ``hlen(h)`` the number of tokens a hash names, so hashes of
    different positions differ (a key is the token prefix itself in the spec).

    ``Vocab()``: requests and blocks are uninterpreted sorts (every size). ``Vocab(reqs, blks,
    steps)``: a finite instance, requests and blocks enumerated (``req[i]``, ``blk[i]``), step
    ids ``steps``; ``dom`` expands quantifiers over them."""

    def __init__(self, reqs: int = 0, blks: int = 0, steps: Sequence[int] = ()) -> None:
        I = z3.IntSort()  # noqa: E741
        self.Hash = z3.DeclareSort("Hash")
        if reqs:
            n = next(_instances)
            self.Req, self.req = z3.EnumSort(f"Req{n}", [f"r{i}" for i in range(reqs)])
            self.Blk, self.blk = z3.EnumSort(f"Blk{n}", [f"b{i}" for i in range(blks)])
            self.dom = Domains({self.Req: self.req, self.Blk: self.blk}, steps)
        else:
            self.Req, self.Blk = z3.DeclareSort("Req"), z3.DeclareSort("Blk")
            self.req, self.blk = [], []
            self.dom = Domains()
        self.hk = z3.Function("hk", self.Req, I, self.Hash)
        self.hlen = z3.Function("hlen", self.Hash, I)

    def axioms(self) -> Term:
        """Hashes of different positions differ (``hlen(hk(r, i)) = i``). A finite instance
        encoding a spec state fixes ``hk`` by the tokens (distinct prefixes, distinct
        constants), which implies it where the state names a hash."""
        if self.dom.finite:
            return z3.BoolVal(True)
        r, i = z3.Const("ax_r", self.Req), z3.Int("ax_i")
        return z3.ForAll([r, i], self.hlen(self.hk(r, i)) == i, patterns=[self.hk(r, i)])


@dataclass
class PState:
    """A state of the parametric model: each field a callable returning a Z3 term (a symbolic
    pre-state's are uninterpreted functions; a successor's are terms over the pre-state's).

    A model block is one position: a spec block of B positions is B of them (slots), taken,
    freed and published together (``abstraction.py``).

    status(r), comp(r): the request's status and computed tokens (its table may hold slots
    past them, taken ahead with their block: ``reserved``);
    tab(r, b), pos(r, b): b is in r's table, at position pos; ref(r, b): r holds a reference on
    b (the refcount as a holder relation); free(b): b is on the free queue; pub(b), key(b): b
    is published, under key; wv(b), wh(b): b's bytes are valid and hold the prefix hashed wh;
    pw(t, b), pwr(t, b), pwh(t, b): step t has a pending write on b, for request pwr, of the
    prefix hashed pwh (at most one per step and slot); hw(b): a ghost, the step
    of the pending write of b's holder; live(t, r), estart(t, r), eend(t, r): r has a live entry
    in step t computing tokens estart..eend-1; phase(t); lo, hi: the steps in flight are
    lo..hi-1 (the building one, if any, is hi-1); bad: a live read found the wrong bytes.
    External loads: loading(r), r waits for an asynchronous load; eload(t, r), r's entry in
    step t is such a load (it writes the loaded blocks, computes and reads nothing);
    failed(t, r), that load failed when step t executed (its writes did not happen).
    Stale output delivered: a request preempted while its entries in submitted steps stay
    live (they read and sample for it while it waits) keeps ``stab(r, b)``/``spos(r, b)``, its
    table when it was preempted (what those entries read), and the ghost ``shw(r, b)``, the
    step of its own pending write on b then (``hw(b)`` at that moment)."""

    status: Callable[[Term], Term]
    comp: Callable[[Term], Term]
    tab: Callable[[Term, Term], Term]
    pos: Callable[[Term, Term], Term]
    ref: Callable[[Term, Term], Term]
    free: Callable[[Term], Term]
    pub: Callable[[Term], Term]
    key: Callable[[Term], Term]
    wv: Callable[[Term], Term]
    wh: Callable[[Term], Term]
    pw: Callable[[Term, Term], Term]
    pwr: Callable[[Term, Term], Term]
    pwh: Callable[[Term, Term], Term]
    hw: Callable[[Term], Term]
    live: Callable[[Term, Term], Term]
    estart: Callable[[Term, Term], Term]
    eend: Callable[[Term, Term], Term]
    phase: Callable[[Term], Term]
    loading: Callable[[Term], Term]
    eload: Callable[[Term, Term], Term]
    failed: Callable[[Term, Term], Term]
    stab: Callable[[Term, Term], Term]
    spos: Callable[[Term, Term], Term]
    shw: Callable[[Term, Term], Term]
    lo: Term
    hi: Term
    bad: Term


FIELDS = tuple(f for f in PState.__dataclass_fields__)


def symbolic_state(v: Vocab, tag: str) -> PState:
    """A fully symbolic state: every field an uninterpreted function named ``tag.field``."""
    R, B, H, I, Bo = v.Req, v.Blk, v.Hash, z3.IntSort(), z3.BoolSort()  # noqa: E741
    sig: dict[str, tuple[Any, ...]] = {
        "status": (R, I),
        "comp": (R, I),
        "tab": (R, B, Bo),
        "pos": (R, B, I),
        "ref": (R, B, Bo),
        "free": (B, Bo),
        "pub": (B, Bo),
        "key": (B, H),
        "wv": (B, Bo),
        "wh": (B, H),
        "pw": (I, B, Bo),
        "pwr": (I, B, R),
        "pwh": (I, B, H),
        "hw": (B, I),
        "live": (I, R, Bo),
        "estart": (I, R, I),
        "eend": (I, R, I),
        "phase": (I, I),
        "loading": (R, Bo),
        "eload": (I, R, Bo),
        "failed": (I, R, Bo),
        "stab": (R, B, Bo),
        "spos": (R, B, I),
        "shw": (R, B, I),
    }
    fns = {name: z3.Function(f"{tag}.{name}", *s) for name, s in sig.items()}
    return PState(
        **fns,
        lo=z3.Int(f"{tag}.lo"),
        hi=z3.Int(f"{tag}.hi"),
        bad=z3.Bool(f"{tag}.bad"),
    )


def initial_state(v: Vocab) -> PState:
    """No request has arrived, every block is free, unpublished and unwritten, no step."""
    false = z3.BoolVal(False)
    zero = z3.IntVal(0)
    anyh = z3.Const("init.h", v.Hash)
    anyr = z3.Const("init.r", v.Req)
    return PState(
        status=lambda r: z3.IntVal(ABSENT),
        comp=lambda r: zero,
        tab=lambda r, b: false,
        pos=lambda r, b: zero,
        ref=lambda r, b: false,
        free=lambda b: z3.BoolVal(True),
        pub=lambda b: false,
        key=lambda b: anyh,
        wv=lambda b: false,
        wh=lambda b: anyh,
        pw=lambda t, b: false,
        pwr=lambda t, b: anyr,
        pwh=lambda t, b: anyh,
        hw=lambda b: zero,
        live=lambda t, r: false,
        estart=lambda t, r: zero,
        eend=lambda t, r: zero,
        phase=lambda t: zero,
        loading=lambda r: false,
        eload=lambda t, r: false,
        failed=lambda t, r: false,
        stab=lambda r, b: false,
        spos=lambda r, b: zero,
        shw=lambda r, b: zero,
        lo=zero,
        hi=zero,
        bad=false,
    )


@dataclass
class Transition:
    """One action: its parameters (fresh constants and functions), guard and successor."""

    name: str
    guard: Term
    post: PState
    params: dict[str, Any]


class Model:
    """The actions (``transitions``), the invariant (``invariant``: the five safety predicates
    and the lemmas, each named), and the safety predicates alone (``SAFETY``)."""

    def __init__(self, vocab: Vocab, planted: str | None = None):
        if planted is not None and planted not in PLANTS:
            raise ValueError(f"unknown plant {planted!r}; one of {', '.join(PLANTS)}")
        self.v, self.dom, self.planted = vocab, vocab.dom, planted
        self._n = itertools.count()

    # -- helpers ---------------------------------------------------------------------------
    def fa(self, sorts: Sequence[Any], body: Callable[..., Term]) -> Term:
        return self.dom.forall(sorts, body)

    def ex(self, sorts: Sequence[Any], body: Callable[..., Term]) -> Term:
        return self.dom.exists(sorts, body)

    def building(self, s: PState) -> Term:
        return z3.And(s.lo < s.hi, s.phase(s.hi - 1) == BUILDING)

    def stale_garbage(self, s: PState, leaving: Callable[[Term], Term], b: Term) -> Term:
        """b, in the old table of a leaving request that waits (preempted, its stale output
        delivered), may hold bytes one of its later stale entries computed on the placeholder
        of an earlier one, a sample now discarded (it leaves before that step commits). Such
        bytes are read by no one before they are rewritten: every holder of b has its own
        write pending (it took b after the preemption), and every other waiting request whose
        stale entry reads b has a write on b due before that read."""
        v, I = self.v, z3.IntSort()  # noqa: E741
        owner = self.ex(
            [v.Req],
            lambda q: z3.And(leaving(q), s.status(q) == WAITING, s.stab(q, b)),
        )
        holders = self.fa([v.Req], lambda x: z3.Implies(s.tab(x, b), s.pw(s.hw(b), b)))
        readers = self.fa(
            [I, v.Req],
            lambda t, r: z3.Implies(
                z3.And(
                    z3.Not(leaving(r)),
                    s.status(r) == WAITING,
                    s.live(t, r),
                    z3.Not(s.eload(t, r)),
                    s.phase(t) != EXECUTED,
                    s.stab(r, b),
                    0 <= s.spos(r, b),
                    s.spos(r, b) < s.estart(t, r),
                ),
                self.ex([I], lambda u: z3.And(s.pw(u, b), u <= t)),
            ),
        )
        return z3.And(owner, holders, readers)

    def reads(self, s: PState, r: Term, b: Term) -> Term:
        """A live entry of r reads b: b is in r's table, or, r waiting (preempted, its stale
        output delivered), in the table it had then."""
        return z3.If(s.status(r) == WAITING, s.stab(r, b), s.tab(r, b))

    def rpos(self, s: PState, r: Term, b: Term) -> Term:
        return z3.If(s.status(r) == WAITING, s.spos(r, b), s.pos(r, b))

    def fresh(self, name: str, *sig: Any) -> Any:
        n = f"p{next(self._n)}.{name}"
        return z3.Function(n, *sig) if len(sig) > 1 else z3.Const(n, sig[0])

    def _release(
        self, s: PState, leaving: Callable[[Term], Term]
    ) -> tuple[dict[str, Any], Term, Any]:
        """The leaving requests (``leaving(r)``) drop their tables: a block none of its other
        holders keeps goes to the free queue (refcount reaches 0). Under async scheduling the
        bytes of their unpublished blocks may hold a placeholder that now never resolves
        (a discarded sample): ``lost`` says which turn to garbage (any of them with no pending
        write may: a pending write means the bytes are still the previous owner's; the spec's
        are those whose placeholder's step was discarded), and so may blocks of a leaving
        waiting request's old table (``stale_garbage``). Returns the changed fields, the
        condition on ``lost`` and ``lost``."""
        v = self.v
        lost = self.fresh("lost", v.Blk, z3.BoolSort())
        lost_ok = self.fa(
            [v.Blk],
            lambda b: (
                z3.Not(lost(b))
                if self.planted == "placeholders-resolve"
                else z3.Implies(
                    lost(b),
                    z3.And(
                        z3.Not(s.pub(b)),
                        z3.Or(
                            z3.And(
                                self.ex(
                                    [v.Req],
                                    lambda q: z3.And(
                                        leaving(q), s.tab(q, b), s.pos(q, b) < s.comp(q)
                                    ),
                                ),
                                self.fa([z3.IntSort()], lambda u: z3.Not(s.pw(u, b))),
                            ),
                            self.stale_garbage(s, leaving, b)
                            if self.planted != "stale-samples-resolve"
                            else z3.BoolVal(False),
                        ),
                    ),
                )
            ),
        )

        def kept(b: Term) -> Term:
            return self.ex([v.Req], lambda q: z3.And(s.ref(q, b), z3.Not(leaving(q))))

        def dropped(b: Term) -> Term:
            return self.ex([v.Req], lambda q: z3.And(s.ref(q, b), leaving(q)))

        changed = {
            "wv": lambda b: z3.And(s.wv(b), z3.Not(lost(b))),
            "tab": lambda r, b: z3.And(s.tab(r, b), z3.Not(leaving(r))),
            "ref": lambda r, b: z3.And(s.ref(r, b), z3.Not(leaving(r))),
            "free": lambda b: z3.Or(s.free(b), z3.And(dropped(b), z3.Not(kept(b)))),
            "comp": lambda r: z3.If(leaving(r), 0, s.comp(r)),
            "loading": lambda r: z3.And(s.loading(r), z3.Not(leaving(r))),
        }
        return changed, lost_ok, lost

    # -- actions ---------------------------------------------------------------------------
    def arrive(self, s: PState) -> Transition:
        r = self.fresh("r", self.v.Req)
        post = replace(
            s,
            status=lambda q: z3.If(q == r, WAITING, s.status(q)),
            comp=lambda q: z3.If(q == r, 0, s.comp(q)),
        )
        return Transition("arrive", s.status(r) == ABSENT, post, {"r": r})

    def begin(self, s: PState) -> Transition:
        post = replace(s, hi=s.hi + 1, phase=lambda t: z3.If(t == s.hi, BUILDING, s.phase(t)))
        return Transition("begin", z3.Not(self.building(s)), post, {})

    def schedule(self, s: PState) -> Transition:
        """Give request r tokens start..end-1 in the building step; a waiting r is admitted
        first with hits (``hit``: published blocks under its hashes, at positions below
        start). Blocks are allocated (``alloc``: free blocks, their hashes evicted) at
        positions from start on, possibly past end (the rest of a partial tail block, held
        ahead); every slot of r at positions start..end-1, allocated now or held ahead since an
        earlier schedule (``fill``), gets the step's pending write of r's prefix there. An
        admission may instead load them (``load``: an asynchronous external load; r waits for
        it; a synchronous load, landed before the step computes, is a computation here). A
        load may end at the last known token (its block full): r's ``comp`` counts that token
        (the spec's ``computed`` plus ``loaded_last``), and r's next schedule, with nothing of r
        in flight, starts one position back (``back``) to compute it again; that write of a
        slot the load's commit published is the same prefix again, so it is not made (``fill``
        skips published slots; ``abstraction.rewrite`` leaves the spec's out)."""
        v = self.v
        R, B, I, Bo = v.Req, v.Blk, z3.IntSort(), z3.BoolSort()  # noqa: E741
        r, n, h = self.fresh("r", R), self.fresh("n", I), self.fresh("h", I)
        load = self.fresh("load", Bo)
        hit, alloc = self.fresh("hit", B, Bo), self.fresh("alloc", B, Bo)
        np_ = self.fresh("np", B, I)
        back = self.fresh("back", I)
        tb = s.hi - 1
        admit = s.status(r) == WAITING
        start = z3.If(admit, h, s.comp(r) - back)
        end = start + n

        def new(b: Term) -> Term:
            return z3.Or(hit(b), alloc(b))

        def fill(b: Term) -> Term:  # r's own slots allocated ahead, now computed
            if self.planted == "skip-reserved-write":
                return z3.BoolVal(False)
            return z3.And(
                s.tab(r, b),
                start <= s.pos(r, b),
                s.pos(r, b) < end,
                z3.Not(s.pub(b)) if self.planted != "recompute-rewrites-published" else True,
            )

        def writes(b: Term) -> Term:
            return z3.Or(z3.And(alloc(b), np_(b) < end), fill(b))

        def wpos(b: Term) -> Term:
            return z3.If(alloc(b), np_(b), s.pos(r, b))

        hit_ok = self.fa(
            [B],
            lambda b: z3.Implies(
                hit(b),
                z3.And(
                    admit,
                    s.pub(b),
                    0 <= np_(b),
                    np_(b) < start,
                    s.key(b) == (v.hk(r, np_(b)) if self.planted != "hit-any-block" else s.key(b)),
                ),
            ),
        )
        alloc_ok = self.fa(
            [B],
            lambda b: z3.Implies(
                alloc(b),
                z3.And(
                    s.free(b),
                    z3.Not(hit(b)),
                    start <= np_(b),
                    np_(b) < end if self.planted == "one-position-blocks" else z3.BoolVal(True),
                ),
            ),
        )
        injective = self.fa(
            [B, B],
            lambda b1, b2: z3.And(
                z3.Implies(z3.And(new(b1), new(b2), np_(b1) == np_(b2)), b1 == b2),
                z3.Implies(z3.And(s.tab(r, b1), new(b2)), s.pos(r, b1) != np_(b2)),
            ),
        )
        guard = z3.And(
            self.building(s),
            z3.Or(admit, s.status(r) == RUNNING),
            z3.Not(s.live(tb, r)),
            z3.Implies(admit, self.fa([I], lambda u: z3.Not(s.live(u, r))))
            if self.planted != "admit-while-stale"
            else z3.BoolVal(True),
            z3.Not(s.loading(r)),
            z3.Implies(load, admit),
            n >= 1,
            h >= 0,
            back >= 0,
            back <= 1,
            z3.Implies(  # a recomputation (the last token over a load): r has nothing in flight
                back > 0,
                z3.And(
                    z3.Not(admit),
                    back <= s.comp(r),
                    self.fa([I], lambda u: z3.Not(s.live(u, r))),
                ),
            ),
            hit_ok,
            alloc_ok,
            injective,
        )
        written = (lambda b: z3.Or(s.pub(b), alloc(b))) if self.planted == "eager-publish" else None
        evict = self.planted != "no-evict"
        post = replace(
            s,
            status=lambda q: z3.If(q == r, RUNNING, s.status(q)),
            comp=lambda q: z3.If(q == r, end, s.comp(q)),
            tab=lambda q, b: z3.Or(s.tab(q, b), z3.And(q == r, new(b))),
            pos=lambda q, b: z3.If(z3.And(q == r, new(b)), np_(b), s.pos(q, b)),
            ref=lambda q, b: z3.Or(s.ref(q, b), z3.And(q == r, new(b))),
            free=lambda b: z3.And(s.free(b), z3.Not(new(b))),
            pub=written or (lambda b: z3.And(s.pub(b), z3.Not(alloc(b))) if evict else s.pub(b)),
            key=(lambda b: z3.If(alloc(b), v.hk(r, np_(b)), s.key(b)))
            if self.planted == "eager-publish"
            else s.key,
            pw=lambda t, b: z3.Or(s.pw(t, b), z3.And(t == tb, writes(b))),
            pwr=lambda t, b: z3.If(z3.And(t == tb, writes(b)), r, s.pwr(t, b)),
            pwh=lambda t, b: z3.If(z3.And(t == tb, writes(b)), v.hk(r, wpos(b)), s.pwh(t, b)),
            hw=lambda b: z3.If(writes(b), tb, s.hw(b)),
            live=lambda t, q: z3.Or(s.live(t, q), z3.And(t == tb, q == r)),
            estart=lambda t, q: z3.If(z3.And(t == tb, q == r), start, s.estart(t, q)),
            eend=lambda t, q: z3.If(z3.And(t == tb, q == r), end, s.eend(t, q)),
            eload=lambda t, q: z3.If(z3.And(t == tb, q == r), load, s.eload(t, q)),
            failed=lambda t, q: z3.And(s.failed(t, q), z3.Not(z3.And(t == tb, q == r))),
            loading=lambda q: z3.Or(s.loading(q), z3.And(q == r, load)),
        )
        params = {"r": r, "n": n, "h": h, "hit": hit, "alloc": alloc, "np": np_, "load": load}
        params["back"] = back
        return Transition("schedule", guard, post, params)

    def preempt(self, s: PState) -> Transition:
        """A running request leaves in the building step: its entry there and that entry's
        pending writes are withdrawn, and its table is freed. Its entries in submitted steps
        (their writes still run) stop being live (stale output dropped), or, when ``deliver``,
        stay live with the table as it was (``stab``/``spos``, the ghost ``shw``): their
        samples will be delivered, so no placeholder is discarded and no bytes turn to
        garbage. Either may happen (one model for both ``stale_output`` settings)."""
        v = self.v
        r = self.fresh("r", v.Req)
        deliver = (
            self.fresh("deliver", z3.BoolSort())
            if self.planted != "stale-dropped"
            else z3.BoolVal(False)
        )
        tb = s.hi - 1
        rel, lost_ok, lost = self._release(s, lambda q: q == r)
        kept = lambda q: z3.And(q == r, deliver)  # noqa: E731
        post = replace(
            s,
            status=lambda q: z3.If(q == r, WAITING, s.status(q)),
            pw=lambda t, b: z3.And(s.pw(t, b), z3.Not(z3.And(t == tb, s.pwr(t, b) == r))),
            live=lambda t, q: z3.And(s.live(t, q), z3.Or(q != r, z3.And(deliver, t != tb))),
            stab=lambda q, b: z3.If(kept(q), s.tab(r, b), s.stab(q, b)),
            spos=lambda q, b: z3.If(kept(q), s.pos(r, b), s.spos(q, b)),
            shw=lambda q, b: z3.If(kept(q), s.hw(b), s.shw(q, b)),
            **rel,
        )
        no_garbage = z3.Implies(deliver, self.fa([v.Blk], lambda b: z3.Not(lost(b))))
        if self.planted == "garbage-on-deliver":
            no_garbage = z3.BoolVal(True)
        guard = z3.And(self.building(s), s.status(r) == RUNNING, lost_ok, no_garbage)
        return Transition("preempt", guard, post, {"r": r, "lost": lost, "deliver": deliver})

    def abort(self, s: PState) -> Transition:
        r = self.fresh("r", self.v.Req)
        rel, lost_ok, lost = self._release(s, lambda q: q == r)
        post = replace(
            s,
            status=lambda q: z3.If(q == r, FINISHED, s.status(q)),
            live=lambda t, q: z3.And(s.live(t, q), q != r),
            **rel,
        )
        guard = z3.And(
            z3.Not(self.building(s)),
            z3.Or(s.status(r) == WAITING, s.status(r) == RUNNING),
            lost_ok,
        )
        return Transition("abort", guard, post, {"r": r, "lost": lost})

    def submit(self, s: PState) -> Transition:
        tb = s.hi - 1
        post = replace(s, phase=lambda t: z3.If(t == tb, SUBMITTED, s.phase(t)))
        return Transition("submit", self.building(s), post, {})

    def execute(self, s: PState) -> Transition:
        """The oldest submitted step t: every write, then every read. A live entry whose read
        finds the wrong bytes sets ``bad``; ``garble`` says which writes turn to garbage (a
        withdrawn entry's may, any of them: the spec's do after a bad read, and those holding
        a draft or placeholder of a step whose sample was discarded; a live entry's only after
        a bad read)."""
        v = self.v
        t = self.fresh("t", z3.IntSort())
        garble = self.fresh("garble", v.Blk, z3.BoolSort())
        fail = self.fresh("fail", v.Req, z3.BoolSort())
        lands = lambda b: z3.And(s.pw(t, b), z3.Not(fail(s.pwr(t, b))))  # noqa: E731
        wv1 = lambda b: z3.Or(lands(b), s.wv(b))  # noqa: E731
        wh1 = lambda b: z3.If(lands(b), s.pwh(t, b), s.wh(b))  # noqa: E731

        def bad_read(q: Term) -> Term:
            return self.ex(
                [v.Blk],
                lambda b: z3.And(
                    z3.Not(s.eload(t, q)),  # a load reads nothing
                    self.reads(s, q, b),
                    self.rpos(s, q, b) < s.estart(t, q),
                    z3.Not(z3.And(wv1(b), wh1(b) == v.hk(q, self.rpos(s, q, b)))),
                ),
            )

        older_done = self.fa(
            [z3.IntSort()],
            lambda u: z3.Implies(z3.And(s.lo <= u, u < t), s.phase(u) == EXECUTED),
        )
        loads_fail = self.fa([v.Req], lambda q: z3.Implies(fail(q), s.eload(t, q)))
        live_garbles = self.fa(
            [v.Blk],
            lambda b: z3.Implies(
                z3.And(garble(b), s.pw(t, b)),
                z3.And(
                    z3.Not(s.eload(t, s.pwr(t, b))),
                    z3.Implies(s.live(t, s.pwr(t, b)), bad_read(s.pwr(t, b))),
                ),
            ),
        )
        guard = z3.And(
            s.lo <= t, t < s.hi, s.phase(t) == SUBMITTED, older_done, loads_fail, live_garbles
        )
        any_bad = self.ex([v.Req], lambda q: z3.And(s.live(t, q), bad_read(q)))
        post = replace(
            s,
            wv=lambda b: z3.And(wv1(b), z3.Not(z3.And(s.pw(t, b), garble(b)))),
            wh=wh1,
            pw=lambda u, b: z3.And(s.pw(u, b), u != t),
            phase=lambda u: z3.If(u == t, EXECUTED, s.phase(u)),
            failed=lambda u, q: z3.Or(s.failed(u, q), z3.And(u == t, fail(q))),
            bad=z3.Or(s.bad, any_bad),
        )
        return Transition("execute", guard, post, {"t": t, "garble": garble, "fail": fail})

    def commit(self, s: PState) -> Transition:
        """The oldest step, executed, with no step building: a request whose load failed there
        leaves and waits again; publish (``publish``, by request ``publisher``: unpublished
        blocks of live entries, not failed, at positions the entry covers), then sample;
        ``finish`` says which live requests finish (their tables are freed and their entries
        in later steps stop being live). Drafts: ``rej(q)`` of q's drafts are rejected (q
        running, its later live entries not executed): comp drops by it, publication stays
        below the entry's end less ``rej(q)``, the rolled-back slots' bytes may be garbage
        (``rolled``: a rejected draft never resolves), and q's later live entries move back
        (``_move_back``)."""
        v = self.v
        B, R, Bo = v.Blk, v.Req, z3.BoolSort()
        t = s.lo
        publish, publisher = self.fresh("publish", B, Bo), self.fresh("publisher", B, R)
        finish = self.fresh("finish", R, Bo)
        publish_ok = self.fa(
            [B],
            lambda b: z3.Implies(
                publish(b),
                z3.And(
                    z3.Not(s.pub(b)),
                    s.live(t, publisher(b)),
                    z3.Not(s.failed(t, publisher(b)))
                    if self.planted != "publish-failed-load"
                    else z3.BoolVal(True),
                    s.tab(publisher(b), b),
                    s.pos(publisher(b), b) < s.eend(t, publisher(b))
                    if self.planted != "publish-partial-block"
                    else z3.BoolVal(True),
                ),
            ),
        )
        finish_ok = self.fa(
            [R], lambda q: z3.Implies(finish(q), z3.And(s.live(t, q), z3.Not(s.eload(t, q))))
        )
        guard = z3.And(
            s.lo < s.hi,
            s.phase(t) == EXECUTED,
            z3.Not(self.building(s)),
            publish_ok,
            finish_ok,
        )
        if self.planted == "eager-publish":  # eager publishes at schedule, not here
            guard = z3.And(guard, self.fa([B], lambda b: z3.Not(publish(b))))

        def back(q: Term) -> Term:  # a failed load: the request goes back to waiting
            return z3.And(s.live(t, q), s.failed(t, q))

        rel, lost_ok, lost = self._release(s, lambda q: z3.Or(finish(q), back(q)))
        unpublished = self.fa([B], lambda b: z3.Implies(lost(b), z3.Not(publish(b))))
        guard = z3.And(guard, lost_ok, unpublished)
        landed = rel.pop("loading")
        rej = self.fresh("rej", R, z3.IntSort())
        rolled = self.fresh("rolled", B, Bo)
        I = z3.IntSort()  # noqa: E741
        rej_ok = self.fa(
            [R],
            lambda q: z3.And(
                rej(q) >= 0,
                z3.Implies(
                    rej(q) > 0,
                    z3.And(
                        s.live(t, q),
                        z3.Not(s.eload(t, q)),
                        s.status(q) == RUNNING,
                        rej(q) < s.eend(t, q) - s.estart(t, q),
                        self.fa(  # async: later entries wait for this commit (``_unverified``)
                            [I],
                            lambda u: z3.Implies(
                                z3.And(s.live(u, q), u != t), s.phase(u) != EXECUTED
                            ),
                        ),
                    ),
                ),
            ),
        )
        rolled_ok = self.fa(
            [B],
            lambda b: z3.Implies(
                rolled(b),
                self.ex(
                    [R],
                    lambda q: z3.And(
                        rej(q) > 0,
                        s.tab(q, b),
                        s.pos(q, b) >= s.eend(t, q) - rej(q),
                        s.pos(q, b) < s.eend(t, q),
                    ),
                ),
            ),
        )
        moves, moved_ok = self._move_back(s, t, rej, finish)

        def verified(q: Term) -> Term:  # the entry's end less its rejected drafts
            if self.planted == "publish-partial-block":  # past the entry's end: up to comp
                return s.comp(q) - rej(q)
            return s.eend(t, q) - rej(q)

        pub_verified = self.fa(
            [B], lambda b: z3.Implies(publish(b), s.pos(publisher(b), b) < verified(publisher(b)))
        )
        if self.planted == "publish-rejected-drafts":
            pub_verified = z3.BoolVal(True)
        if self.planted == "drafts-resolve":
            rolled_ok = self.fa([B], lambda b: z3.Not(rolled(b)))
        guard = z3.And(guard, rej_ok, rolled_ok, pub_verified, moved_ok)
        wv0 = rel.pop("wv")
        rel.pop("comp")
        post = replace(
            s,
            wv=lambda b: z3.And(wv0(b), z3.Not(rolled(b))),
            comp=lambda q: z3.If(z3.Or(finish(q), back(q)), 0, s.comp(q) - rej(q)),
            status=lambda q: z3.If(finish(q), FINISHED, z3.If(back(q), WAITING, s.status(q))),
            loading=lambda q: z3.And(landed(q), z3.Not(z3.And(s.live(t, q), s.eload(t, q)))),
            pub=lambda b: z3.Or(s.pub(b), publish(b)),
            key=lambda b: z3.If(publish(b), v.hk(publisher(b), s.pos(publisher(b), b)), s.key(b)),
            live=lambda u, q: z3.And(s.live(u, q), u != t, z3.Not(finish(q)), z3.Not(back(q))),
            failed=lambda u, q: z3.And(s.failed(u, q), u != t),
            lo=s.lo + 1,
            **rel,
            **moves,
        )
        params = {"publish": publish, "publisher": publisher, "finish": finish, "lost": lost}
        params["rej"] = rej
        return Transition("commit", guard, post, params)

    def _move_back(self, s: PState, t: Term, rej: Any, finish: Any) -> tuple[dict[str, Any], Term]:
        """Drafts under async scheduling: the commit of step t rejected ``rej(q)`` of q's drafts
        (q running, not finishing), and q's later live entries, scheduled as if all were
        accepted, move back by that many positions (the spec's ``_move_back``): their pending
        writes are withdrawn and laid again at the new positions. ``mover(b)`` is the request
        whose moved entries now cover slot b (a slot at a position from the first rolled-back
        one, ``eend(t, q) - rej(q)``, to the lowered computed tokens), ``mstep(b)`` the step
        whose entry covers it (the guard: it is one of q's later live entries, moved). Returns
        the changed fields and the guard."""
        v = self.v
        R, B, I = v.Req, v.Blk, z3.IntSort()  # noqa: E741
        mover, mstep = self.fresh("mover", B, R), self.fresh("mstep", B, I)

        def moving(q: Term) -> Term:
            return z3.And(rej(q) > 0, z3.Not(finish(q)))

        def relaid_by(q: Term, b: Term) -> Term:
            return z3.And(
                moving(q),
                s.tab(q, b),
                s.pos(q, b) >= s.eend(t, q) - rej(q),
                s.pos(q, b) < s.comp(q) - rej(q),
            )

        def relaid(b: Term) -> Term:
            return relaid_by(mover(b), b)

        q_of = lambda b: mover(b)  # noqa: E731
        covered = self.fa(
            [R, B],
            lambda q, b: z3.Implies(
                relaid_by(q, b),
                z3.And(
                    mover(b) == q,
                    s.live(mstep(b), q),
                    mstep(b) != t,
                    s.estart(mstep(b), q) - rej(q) <= s.pos(q, b),
                    s.pos(q, b) < s.eend(mstep(b), q) - rej(q),
                ),
            ),
        )

        def withdrawn(u: Term, b: Term) -> Term:  # a moved entry's old write
            return z3.And(s.pw(u, b), u != t, s.live(u, s.pwr(u, b)), moving(s.pwr(u, b)))

        def laid(u: Term, b: Term) -> Term:
            return z3.And(relaid(b), u == mstep(b))

        def shifted(u: Term, q: Term) -> Term:
            return z3.And(s.live(u, q), u != t, moving(q))

        if self.planted == "move-back-keeps-writes":  # entries move, their writes stay put
            changes: dict[str, Any] = {}
        else:
            changes = {
                "pw": lambda u, b: z3.Or(z3.And(s.pw(u, b), z3.Not(withdrawn(u, b))), laid(u, b)),
                "pwr": lambda u, b: z3.If(laid(u, b), q_of(b), s.pwr(u, b)),
                "pwh": lambda u, b: z3.If(
                    laid(u, b), v.hk(q_of(b), s.pos(q_of(b), b)), s.pwh(u, b)
                ),
                "hw": lambda b: z3.If(relaid(b), mstep(b), s.hw(b)),
            }
        changes["estart"] = lambda u, q: z3.If(
            shifted(u, q), s.estart(u, q) - rej(q), s.estart(u, q)
        )
        changes["eend"] = lambda u, q: z3.If(shifted(u, q), s.eend(u, q) - rej(q), s.eend(u, q))
        return changes, covered

    def reset(self, s: PState) -> Transition:
        v = self.v
        idle = self.fa([v.Req, v.Blk], lambda r, b: z3.Not(s.ref(r, b)))
        guard = z3.And(s.lo == s.hi, idle)
        post = replace(s, pub=lambda b: z3.BoolVal(False))
        return Transition("reset", guard, post, {})

    ACTIONS = (
        "arrive",
        "begin",
        "schedule",
        "preempt",
        "submit",
        "execute",
        "commit",
        "abort",
        "reset",
    )

    def transition(self, name: str, s: PState) -> Transition:
        action: Callable[[PState], Transition] = getattr(self, name)
        return action(s)

    # -- predicates ------------------------------------------------------------------------
    def ev_holds(self, s: PState, b: Term, t: Term | None, h: Term) -> Term:
        """Once every pending write of a step <= t (every step if t is None) has run, b holds
        the prefix hashed h: the newest such write's prefix, else the written bytes (the spec's
        ``eventual_content``, then ``holds``)."""
        I = z3.IntSort()  # noqa: E741

        def upto(u: Term) -> Term:
            return z3.BoolVal(True) if t is None else u <= t

        newest = self.ex(
            [I],
            lambda u: z3.And(
                s.pw(u, b),
                upto(u),
                s.pwh(u, b) == h,
                self.fa([I], lambda w: z3.Implies(z3.And(s.pw(w, b), upto(w)), w <= u)),
            ),
        )
        none = self.fa([I], lambda u: z3.Not(z3.And(s.pw(u, b), upto(u))))
        return z3.Or(newest, z3.And(none, s.wv(b), s.wh(b) == h))

    def safety(self, s: PState) -> dict[str, Term]:
        """The five safety invariants in the model's terms (``docs/proofs.md`` says how each
        is the spec's)."""
        v = self.v
        R, B, I = v.Req, v.Blk, z3.IntSort()  # noqa: E741
        nur = self.fa(
            [I, R, B],
            lambda t, r, b: z3.Implies(
                z3.And(
                    s.live(t, r),
                    z3.Not(s.eload(t, r)),
                    s.phase(t) != EXECUTED,
                    self.reads(s, r, b),
                    self.rpos(s, r, b) < s.estart(t, r),
                ),
                self.ev_holds(s, b, t, v.hk(r, self.rpos(s, r, b))),
            ),
        )
        nup = self.fa([B], lambda b: z3.Implies(s.pub(b), self.ev_holds(s, b, None, s.key(b))))
        rio = self.fa([R, B], lambda r, b: s.ref(r, b) == s.tab(r, b))
        tab_once = self.fa(
            [R, B, B],
            lambda r, b1, b2: z3.Implies(
                z3.And(s.tab(r, b1), s.tab(r, b2), s.pos(r, b1) == s.pos(r, b2)), b1 == b2
            ),
        )
        shared = self.fa(
            [R, R, B],
            lambda r1, r2, b: z3.Implies(
                z3.And(s.tab(r1, b), s.tab(r2, b), r1 != r2),
                z3.And(
                    s.pos(r1, b) == s.pos(r2, b),
                    s.pos(r1, b) < s.comp(r1),
                    s.pos(r2, b) < s.comp(r2),
                    v.hk(r1, s.pos(r1, b)) == v.hk(r2, s.pos(r2, b)),
                ),
            ),
        )
        fqe = self.fa([B], lambda b: s.free(b) == z3.Not(self.ex([R], lambda r: s.ref(r, b))))
        return {
            "NoUnwrittenRead": z3.And(z3.Not(s.bad), nur),
            "NoUnwrittenPublish": nup,
            "RefcountIsOwnership": z3.And(rio, tab_once),
            "SharedImpliesSamePrefix": shared,
            "FreeQueueExact": fqe,
        }

    def lemmas(self, s: PState) -> dict[str, Term]:
        """The strengthening: each a fact of every reachable state, named, with why it holds
        in ``docs/proofs.md``."""
        v = self.v
        R, B, I = v.Req, v.Blk, z3.IntSort()  # noqa: E741

        def in_flight(t: Term) -> Term:
            return z3.And(s.lo <= t, t < s.hi)

        own_write = lambda r, b: z3.And(  # noqa: E731
            s.pw(s.hw(b), b),
            s.pwr(s.hw(b), b) == r,
            s.pwh(s.hw(b), b) == v.hk(r, s.pos(r, b)),
            s.live(s.hw(b), r),
            s.estart(s.hw(b), r) <= s.pos(r, b),
            s.pos(r, b) < s.eend(s.hw(b), r),
            self.fa([I], lambda u: z3.Implies(s.pw(u, b), u <= s.hw(b))),
        )
        load_failed = lambda r, b: z3.And(  # noqa: E731
            s.live(s.hw(b), r),
            s.failed(s.hw(b), r),
            s.estart(s.hw(b), r) <= s.pos(r, b),
            s.pos(r, b) < s.eend(s.hw(b), r),
            self.fa([I], lambda u: z3.Not(s.pw(u, b))),
        )
        reserved = lambda r, b: s.pos(r, b) >= s.comp(r)  # noqa: E731
        written_ok = lambda r, b: z3.And(  # noqa: E731
            s.wv(b),
            s.wh(b) == v.hk(r, s.pos(r, b)),
            self.fa([I], lambda u: z3.Not(s.pw(u, b))),
        )
        out = {
            "StepsInOrder": z3.And(
                s.lo <= s.hi,
                self.fa(
                    [I],
                    lambda t: z3.Implies(
                        in_flight(t),
                        z3.And(
                            s.phase(t) >= BUILDING,
                            s.phase(t) <= EXECUTED,
                            z3.Implies(s.phase(t) == BUILDING, t == s.hi - 1),
                        ),
                    ),
                ),
                self.fa(
                    [I, I],
                    lambda t1, t2: z3.Implies(
                        z3.And(s.lo <= t1, t1 < t2, t2 < s.hi, s.phase(t2) == EXECUTED),
                        s.phase(t1) == EXECUTED,
                    ),
                ),
            ),
            "LiveEntries": self.fa(
                [I, R],
                lambda t, r: z3.Implies(
                    s.live(t, r),
                    z3.And(
                        in_flight(t),
                        0 <= s.estart(t, r),
                        s.estart(t, r) < s.eend(t, r),
                        z3.Or(
                            z3.And(s.status(r) == RUNNING, s.eend(t, r) <= s.comp(r)),
                            z3.And(s.status(r) == WAITING, s.phase(t) != BUILDING),
                        ),
                    ),
                ),
            ),
            "ChunksInOrder": self.fa(
                [I, I, R],
                lambda t1, t2, r: z3.Implies(
                    z3.And(s.live(t1, r), s.live(t2, r), t1 < t2),
                    s.eend(t1, r) <= s.estart(t2, r),
                ),
            ),
            "PendingInFlight": self.fa(
                [I, B],
                lambda t, b: z3.Implies(s.pw(t, b), z3.And(in_flight(t), s.phase(t) != EXECUTED)),
            ),
            "ComputedNonNegative": self.fa([R], lambda r: s.comp(r) >= 0),
            "LoadsAlone": self.fa(
                [I, I, R],
                lambda t, u, r: z3.Implies(
                    z3.And(s.live(t, r), s.eload(t, r)),
                    z3.And(
                        z3.Or(s.loading(r), s.status(r) == WAITING),
                        z3.Implies(s.live(u, r), u == t),
                    ),
                ),
            ),
            "FailedLoads": self.fa(
                [I, R],
                lambda t, r: z3.Implies(
                    s.failed(t, r), z3.And(in_flight(t), s.eload(t, r), s.phase(t) == EXECUTED)
                ),
            ),
            "TablesOfRunning": self.fa(
                [R, B],
                lambda r, b: z3.Implies(
                    s.tab(r, b), z3.And(s.status(r) == RUNNING, 0 <= s.pos(r, b))
                ),
            ),
            "ReservedUnpublished": self.fa(
                [R, B],
                lambda r, b: z3.Implies(z3.And(s.tab(r, b), reserved(r, b)), z3.Not(s.pub(b))),
            ),
            "HeldBlocksHold": self.fa(
                [R, B],
                lambda r, b: z3.Implies(
                    s.tab(r, b),
                    z3.Or(own_write(r, b), written_ok(r, b), load_failed(r, b), reserved(r, b)),
                ),
            ),
            "PublishedWritten": self.fa(
                [B],
                lambda b: z3.Implies(
                    s.pub(b),
                    z3.And(
                        s.wv(b),
                        s.wh(b) == s.key(b),
                        self.fa([I], lambda u: z3.Not(s.pw(u, b))),
                    ),
                ),
            ),
            "HeldKeysMatch": self.fa(
                [R, B],
                lambda r, b: z3.Implies(
                    z3.And(s.pub(b), s.tab(r, b)), s.key(b) == v.hk(r, s.pos(r, b))
                ),
            ),
            "SharedIsPublished": self.fa(
                [R, R, B],
                lambda r1, r2, b: z3.Implies(
                    z3.And(s.tab(r1, b), s.tab(r2, b), r1 != r2), s.pub(b)
                ),
            ),
        }

        def stale(t: Term, r: Term, b: Term) -> Term:
            """r waits with its stale output delivered, and its live entry of step t, not yet
            executed, reads b (in its table when it was preempted) as computed."""
            return z3.And(
                s.status(r) == WAITING,
                s.live(t, r),
                z3.Not(s.eload(t, r)),
                s.phase(t) != EXECUTED,
                s.stab(r, b),
                0 <= s.spos(r, b),
                s.spos(r, b) < s.estart(t, r),
            )

        def stale_own_write(t: Term, r: Term, b: Term) -> Term:
            w, p = s.shw(r, b), s.spos(r, b)
            return z3.And(
                s.pw(w, b),
                s.pwr(w, b) == r,
                s.pwh(w, b) == v.hk(r, p),
                s.live(w, r),
                s.estart(w, r) <= p,
                p < s.eend(w, r),
                self.fa([I], lambda u: z3.Implies(z3.And(s.pw(u, b), u <= t), u <= w)),
            )

        def stale_written(t: Term, r: Term, b: Term) -> Term:
            return z3.And(
                s.wv(b),
                s.wh(b) == v.hk(r, s.spos(r, b)),
                self.fa([I], lambda u: z3.Implies(s.pw(u, b), u > t)),
            )

        out["PublishedBelowEntries"] = self.fa(
            [I, R, B],
            lambda t, r, b: z3.Implies(
                z3.And(s.tab(r, b), s.pub(b), s.live(t, r), s.status(r) == RUNNING),
                s.pos(r, b) <= s.estart(t, r),
            ),
        )
        out["SnapshotPositions"] = self.fa(
            [R, B], lambda r, b: z3.Implies(s.stab(r, b), s.spos(r, b) >= 0)
        )
        out["StaleReadsHold"] = self.fa(
            [I, R, B],
            lambda t, r, b: z3.Implies(
                stale(t, r, b), z3.Or(stale_own_write(t, r, b), stale_written(t, r, b))
            ),
        )
        out["StaleBlocksReallocated"] = self.fa(
            [I, R, B, R],
            lambda t, r, b, q: z3.Implies(
                z3.And(stale(t, r, b), s.tab(q, b), z3.Not(s.pub(b))),
                z3.Or(z3.And(s.pw(s.hw(b), b), s.hw(b) > t), reserved(q, b)),
            ),
        )
        if self.planted == "lemma-too-strong":
            out["PublishedIsHeld"] = self.fa(
                [B], lambda b: z3.Implies(s.pub(b), self.ex([R], lambda r: s.tab(r, b)))
            )
        return out

    def invariant(self, s: PState) -> dict[str, Term]:
        """The inductive invariant: the safety predicates, then the lemmas."""
        return {**self.safety(s), **self.lemmas(s)}


SAFETY = (
    "NoUnwrittenRead",
    "NoUnwrittenPublish",
    "RefcountIsOwnership",
    "SharedImpliesSamePrefix",
    "FreeQueueExact",
)
