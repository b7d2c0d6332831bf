"""Strengthening lemmas for the inductive proofs of ``symbolic.py``'s model (issue #3).

The invariants of ``invariants.py`` are true in every reachable state, but they are not
*inductive*: a state that satisfies them can still step into one that does not, if that state is
itself unreachable (a pending write naming a request that never arrived, a free-queue position
outside the queue's bounds, ...). A lemma rules such states out. Each lemma here is a predicate
on a symbolic state with a name and one sentence on why it holds in every reachable state; the
proof (``kvspec.proofs.induction``) shows that the conjunction of the invariants and the
lemmas holds initially and is preserved by every action instance, which proves every one of them
for paths of any length (for the fragment's sizes).

The first groups say how the encoding's variables fit together (what TLA+ calls ``TypeOK``): ranges,
requests, references, the entries of in-flight steps and their pending writes. The *content
lemmas* carry the safety argument: a running request's table will hold its computed prefix
(``TablesEventuallyHold``), and per family of policies why nobody can come to depend on a write
that is then withdrawn: the deferring policies never let anyone share a block being written; the
eager ones record what they published in the building step, so that a preemption can roll it
back before anyone could have hit it (vLLM's discipline admits nothing in a step before a
preemption). A lemma can be limited to a family of policies, named by their traits
(``spec.policies.Traits``, never by name); the proof lists the lemmas it used.

The lemmas were found the usual way: run the proof, read the counterexample to induction (an
unreachable state that steps out), state the fact that rules it out, repeat. 26 lemmas make all
eleven cells the fuzzer finds safe inductive; the four unsafe cells stay non-inductive, and bounded
model checking finds their real counterexamples. Under async scheduling (placeholders) and with
stale output delivered some lemmas take another form (``Lemma.scheduling``, ``_holds_its_blocks``;
docs/proofs.md, "The async lemmas of the per-size proofs"), which makes the safe cells there
inductive too; the synchronous cells' terms are unchanged. The rollback policies add lemmas there
on what a withdrawn entry's bad read may garble (the last group; docs/proofs.md, "The rollback
policies under async scheduling").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import z3

from kvspec.spec.policies import POLICIES, Traits

from .symbolic import (
    BUILDING,
    EXECUTED,
    FINISHED,
    NONE,
    RUNNING,
    WAITING,
    Model,
    SState,
    Term,
    conj,
    count,
    disj,
    reads_hold,
    zmin,
)
from .terms import And, If, Implies, Not, Or

TWIN_OF = "kvspec.spec"
"""This module restates the spec in another form (kvspec/twins.py says what it must equal)."""


@dataclass(frozen=True)
class Lemma:
    name: str
    why: str
    """One sentence: why every reachable state satisfies it."""
    predicate: Callable[[Model, SState], Term]
    family: Callable[[Traits], bool] | None = None
    """The policies it is stated for, by their traits (``spec.policies``; None: all)."""
    scheduling: str = "any"
    """``sync``: stated only for models without placeholders; ``async``: only with them;
    ``in-flight-output``: with placeholders or with stale output delivered."""

    def applies(self, policy: str) -> bool:
        return self.family is None or self.family(POLICIES[policy])

    def applies_to(self, m: Model) -> bool:
        """Stated for the model's policy and its scheduling (placeholders or not)."""
        timing = self.scheduling == "any" or (self.scheduling == "async") == m.async_
        if self.scheduling == "in-flight-output":  # placeholders, or stale output delivered
            timing = m.async_ or m.deliver
        return timing and self.applies(m.config.policy)


LEMMAS: list[Lemma] = []


def lemma(
    why: str, family: Callable[[Traits], bool] | None = None, scheduling: str = "any"
) -> Callable:
    def register(fn: Callable[[Model, SState], Term]) -> Callable[[Model, SState], Term]:
        name = "".join(part.title() for part in fn.__name__.split("_"))
        LEMMAS.append(Lemma(name, why, fn, family, scheduling))
        return fn

    return register


def lemmas(m: Model, S: SState, names: list[str] | None = None) -> dict[str, Term]:
    """The lemmas that apply to the model's policy, as predicates on S."""
    return {
        lem.name: lem.predicate(m, S)
        for lem in LEMMAS
        if lem.applies_to(m) and (names is None or lem.name in names)
    }


def _in(term: Term, lo: int, hi: int) -> Term:
    """lo <= term <= hi."""
    return And(term >= lo, term <= hi)


def _live_after(m: Model, S: SState, k: int, r: int) -> Term:
    """Request r has a live entry in a step newer than slot k."""
    return disj([S["elive", kk, r] for kk in range(k + 1, m.D)])


def _holds_its_blocks(m: Model, S: SState, k: int, r: int) -> Term:
    """r's entry in slot k is live and r still holds the entry's blocks: with stale output
    delivered a preempted request's entries in submitted steps stay live (their output is
    delivered) while it waits with its table freed."""
    if m.deliver:
        return And(S["elive", k, r], S["st", r] == RUNNING)
    return S["elive", k, r]


def _sampling_before(m: Model, S: SState, k: int, r: int) -> Term:
    """How many of request r's live entries in steps older than slot k sample: under async
    scheduling each is a placeholder beyond r's known tokens."""
    return count(
        [
            conj([S["nst"] > kk, S["ea", kk, r], S["esam", kk, r], S["elive", kk, r]])
            for kk in range(k)
        ]
    )


def _fills(m: Model, S: SState, k: int, r: int, lo: Term, hi: Term) -> Term:
    """Table indices [lo, hi) are blocks that r's entry in slot k fills to their end, from the
    block the entry starts in (or the range is empty)."""
    es, ee = S["es", k, r], S["ee", k, r]
    if m.async_:  # or from an older block: registration stops at the known tokens
        return Implies(lo < hi, conj([hi <= m.floor_blocks(ee), lo >= 0]))
    return Implies(lo < hi, conj([m.floor_blocks(es) <= lo, hi <= m.floor_blocks(ee), lo >= 0]))


# -- globals and step slots -----------------------------------------------------------------------


@lemma("begin and commit move nst by one between 0 and D (begin needs nst == k < D).")
def slots_bounded(m: Model, S: SState) -> Term:
    return _in(S["nst"], 0, m.D)


@lemma(
    "commit shifts the slots down and blanks the top one, and begin starts a slot blank, so "
    "a slot beyond the steps in flight holds no entry, bucket or pending write."
)
def blank_slots(m: Model, S: SState) -> Term:
    parts = []
    for k in range(m.D):
        empty = [Not(S[name, k, r]) for r in m.R for name in ("ea", "elive", "ra")]
        empty += [Not(S["pa", b, k]) for b in m.blocks]
        parts.append(Implies(S["nst"] <= k, conj(empty)))
    return conj(parts)


@lemma("phases are only ever set to building, submitted or executed.")
def phase_domain(m: Model, S: SState) -> Term:
    return conj([Implies(S["nst"] > k, _in(S["ph", k], BUILDING, EXECUTED)) for k in range(m.D)])


@lemma("execute turns every pending write of its step into written content.")
def executed_has_no_pending(m: Model, S: SState) -> Term:
    return conj(
        [
            Implies(And(S["nst"] > k, S["ph", k] == EXECUTED), Not(S["pa", b, k]))
            for k in range(m.D)
            for b in m.blocks
        ]
    )


# -- requests -------------------------------------------------------------------------------------


@lemma("arrive sets the status to waiting; later actions only move it among the four values.")
def status_domain(m: Model, S: SState) -> Term:
    return conj([_in(S["st", r], NONE, FINISHED) for r in m.R])


@lemma("the fragment's requests arrive in id order.")
def arrival_order(m: Model, S: SState) -> Term:
    return conj([Implies(S["st", r] == NONE, S["st", r + 1] == NONE) for r in m.R if r + 1 in m.R])


@lemma(
    "a request that has not arrived has no tokens, no table and no entry in any step "
    "(the initial state, and no action but arrive touches it)."
)
def unarrived_is_empty(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        empty = [S["len", r] == 0, S["ntab", r] == 0, S["comp", r] == 0, S["cach", r] == 0]
        empty += [Not(S["son", r])]
        empty += [Not(S[name, k, r]) for k in range(m.D) for name in ("ea", "elive", "ra")]
        parts.append(Implies(S["st", r] == NONE, conj(empty)))
    return conj(parts)


@lemma(
    "a prompt has 1 .. T tokens and commit appends one token per sample until max_tokens, so "
    "plen <= len <= plen + max_tokens <= T, with len < plen + max_tokens until the request "
    "finishes; an entry samples exactly when it ends at the last known token, and only the "
    "oldest step's commit appends one."
)
def lengths(m: Model, S: SState) -> Term:
    T = len(m.T)
    parts = []
    for r in m.R:
        parts.append(
            Implies(
                S["st", r] != NONE,
                conj(
                    [
                        S["plen", r] >= 1,
                        S["maxt", r] >= 1,
                        S["plen", r] <= S["len", r],
                        S["len", r] <= S["plen", r] + S["maxt", r],
                        S["plen", r] + S["maxt", r] <= T,
                    ]
                ),
            )
        )
        unfinished = Or(S["st", r] == WAITING, S["st", r] == RUNNING)
        parts.append(Implies(unfinished, S["len", r] < S["plen", r] + S["maxt", r]))
        for k in range(m.D):
            ea, ee = S["ea", k, r], S["ee", k, r]
            if not m.async_:
                parts.append(Implies(ea, If(S["esam", k, r], ee == S["len", r], ee < S["len", r])))
                continue
            # async: a live entry ends at the known tokens plus the placeholders of r's older
            # live sampling entries (each commit turns one into a known token). Any entry ends
            # at most G placeholders beyond the tokens known when it was scheduled (fewer than
            # plen + maxt), and known tokens only grow; a withdrawn sampling entry ends at or
            # beyond them, since only r's older live sampling entries append to r meanwhile
            ahead = S["len", r] + _sampling_before(m, S, k, r)
            parts.append(Implies(S["elive", k, r], If(S["esam", k, r], ee == ahead, ee < ahead)))
            parts.append(Implies(ea, ee <= S["len", r] + m.G))
            parts.append(Implies(ea, ee <= S["plen", r] + S["maxt", r] - 1 + m.G))
            dead = conj([ea, Not(S["elive", k, r]), S["esam", k, r]])
            parts.append(Implies(dead, ee >= S["len", r]))
    return conj(parts)


@lemma(
    "a request computes at most the tokens it knows, and a table holds ceil(computed / B) "
    "blocks of the pool, of which the first cached ones are registered."
)
def progress_bounds(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        known = S["len", r] + m.ahead(S, r)[0] if m.async_ else S["len", r]
        parts += [S["comp", r] >= 0, S["comp", r] <= known, S["cach", r] >= 0]
        parts.append(S["cach", r] <= S["ntab", r])
        parts.append(_in(S["ntab", r], 0, len(m.M)))
        parts += [Implies(S["ntab", r] > i, _in(S["tab", r, i], 1, m.blocks[-1])) for i in m.M]
    return conj(parts)


@lemma(
    "a running request has computed at least one token: admission schedules at least one, "
    "and a request that leaves is no longer running."
)
def running_computed_something(m: Model, S: SState) -> Term:
    return conj([Implies(S["st", r] == RUNNING, S["comp", r] >= 1) for r in m.R])


# -- blocks: keys, contents, queue positions ------------------------------------------------------


def _names_prefix(m: Model, S: SState, req: Term, length: Term, least: int) -> Term:
    """(req, length) names a prefix of an arrived request's known tokens."""
    return conj(
        [
            disj([req == r for r in m.R]),
            disj([And(req == r, S["st", r] != NONE, S["len", r] >= length) for r in m.R]),
            length >= least,
        ]
    )


@lemma(
    "keys, contents and pending writes are references to prefixes of arrived requests' known "
    "tokens: they are set from the request that publishes or writes, at most its length, and "
    "tokens only append."
)
def references_valid(m: Model, S: SState) -> Term:
    parts = []
    for b in m.blocks:
        key = conj(
            [
                _names_prefix(m, S, S["kreq", b], S["klen", b], m.B),
                disj([S["klen", b] == (i + 1) * m.B for i in m.M]),
            ]
        )
        parts.append(Implies(S["hk", b], key))
        contents = [(S["wv", b], S["wreq", b], S["wlen", b], S["wk", b] if m.async_ else None)]
        contents += [
            (S["pa", b, k], S["preq", b, k], S["pl", b, k], S["pk", b, k] if m.async_ else None)
            for k in range(m.D)
        ]
        for valid, req, length, known in contents:
            if known is None:
                parts.append(Implies(valid, _names_prefix(m, S, req, length, 1)))
                continue
            # async: the known tokens name a prefix, the rest (at most G) are placeholders
            shape = [_names_prefix(m, S, req, known, 1), known <= length, length <= known + m.G]
            parts.append(Implies(valid, conj(shape)))
    return conj(parts)


@lemma(
    "free-queue positions lie between the head and tail counters: inserts take qlo - 1 or "
    "qhi + 1; publication times lie below the publication counter."
)
def counters_bound_positions(m: Model, S: SState) -> Term:
    parts = [S["qlo"] <= S["qhi"] + 1, S["pubc"] >= 0]
    for b in m.blocks:
        parts.append(Implies(S["inq", b], And(S["qlo"] <= S["qpos", b], S["qpos", b] <= S["qhi"])))
        parts.append(Implies(S["hk", b], And(S["pub", b] >= 0, S["pub", b] < S["pubc"])))
    return conj(parts)


# -- steps' entries and pending writes ------------------------------------------------------------


@lemma(
    "schedule records an entry [start, end) with 0 <= start < end <= len and the table's "
    "first ceil(end / B) blocks; a live entry's request is running, has computed at least end "
    "and still holds those blocks (preempt and abort clear liveness)."
)
def entries_match_tables(m: Model, S: SState) -> Term:
    parts = []
    for k in range(m.D):
        for r in m.R:
            ea, es, ee = S["ea", k, r], S["es", k, r], S["ee", k, r]
            known = S["len", r]
            if m.async_:  # placeholders beyond the known tokens (``Lengths``)
                known = known + m.G
            shape = conj([S["st", r] != NONE, es >= 0, es < ee, ee <= known])
            parts.append(Implies(ea, shape))
            parts.append(Implies(S["elive", k, r], ea))
            nblk = m.ceil_blocks(ee)
            same = [Implies(nblk > i, S["eblk", k, r, i] == S["tab", r, i]) for i in m.M]
            if m.deliver:  # live and waiting: preempted after its step was submitted, so
                # not in the building step, and not admitted again while it is in flight
                parts.append(
                    Implies(S["elive", k, r], Or(S["st", r] == RUNNING, S["st", r] == WAITING))
                )
                # only a finish or an abort withdraws an entry of a submitted step (a
                # preemption withdraws the building step's entry, which leaves the step)
                parts.append(Implies(And(ea, Not(S["elive", k, r])), S["st", r] == FINISHED))
                stale = And(S["elive", k, r], S["st", r] == WAITING)
                idle = [S["ph", k] != BUILDING, S["ntab", r] == 0, S["comp", r] == 0]
                parts.append(Implies(stale, conj(idle)))
                # its freed blocks go to others only through the building step, which is newer:
                # another request's write to them in this step or an older one (a withdrawn
                # entry's) is followed by its own, before this step, or (the rollback
                # policies) is the write of the entry it hit the block from, at that index
                for i in m.M:

                    def mine(b: int, k: int = k, r: int = r, i: int = i) -> Term:
                        parts = []
                        for kk in range(k + 1):
                            other = And(S["pa", b, kk], S["preq", b, kk] != r)
                            own = [
                                And(S["pa", b, j], S["preq", b, j] == r)
                                for j in range(kk + 1, k + 1)
                            ]
                            if _shares_written_blocks(m):  # or r hit it from that writer
                                own += [
                                    conj(
                                        [
                                            S["preq", b, kk] == q,
                                            S["ea", kk, q],
                                            S["eblk", kk, q, i] == b,
                                        ]
                                    )
                                    for q in m.R
                                    if q != r
                                ]
                            parts.append(Implies(other, disj(own)))
                        return conj(parts)

                    block = S["eblk", k, r, i]
                    used = And(stale, m.ceil_blocks(ee) > i)
                    parts.append(Implies(used, m.at_block(block, mine)))
                    # the blocks are a snapshot of its table then: distinct
                    parts += [
                        Implies(And(stale, m.ceil_blocks(ee) > j), block != S["eblk", k, r, j])
                        for j in m.M
                        if j > i
                    ]
            live = conj([S["st", r] == RUNNING, S["comp", r] >= ee] + same)
            parts.append(Implies(_holds_its_blocks(m, S, k, r), live))
            parts += [
                Implies(And(ea, nblk > i), _in(S["eblk", k, r, i], 1, m.blocks[-1])) for i in m.M
            ]
    return conj(parts)


@lemma(
    "schedule adds one pending write to slot k for each block its entry writes (from the "
    "block of start on), holding the entry's prefix up to that block's end; execute removes "
    "them all, and a withdrawn entry's writes are removed with it."
)
def pending_matches_entries(m: Model, S: SState) -> Term:
    parts = []
    B = m.B
    for k in range(m.D):
        open_ = And(S["nst"] > k, S["ph", k] != EXECUTED)
        for r in m.R:
            first = m.floor_blocks(S["es", k, r])
            nblk = m.ceil_blocks(S["ee", k, r])
            for i in m.M:
                writes = conj([open_, S["ea", k, r], first <= i, nblk > i])
                block = S["eblk", k, r, i]
                has = disj(
                    [
                        And(
                            block == b,
                            S["pa", b, k],
                            S["preq", b, k] == r,
                            S["pl", b, k] == zmin(S["ee", k, r], (i + 1) * B),
                        )
                        for b in m.blocks
                    ]
                )
                parts.append(Implies(writes, has))
        for b in m.blocks:
            owner = disj(
                [
                    conj(
                        [
                            S["preq", b, k] == r,
                            S["ea", k, r],
                            m.floor_blocks(S["es", k, r]) <= i,
                            m.ceil_blocks(S["ee", k, r]) > i,
                            S["eblk", k, r, i] == b,
                        ]
                    )
                    for r in m.R
                    for i in m.M
                ]
            )
            parts.append(Implies(S["pa", b, k], And(open_, owner)))
    return conj(parts)


@lemma(
    "under async scheduling a pending write knows every token its request knows up to its "
    "length: schedule writes min(length, known), a commit that appends a token of the writer "
    "resolves that placeholder in the pending write (an older step's, the oldest first), and "
    "no other commit appends to the writer while the write's step is in flight.",
    scheduling="async",
)
def pending_known_is_length(m: Model, S: SState) -> Term:
    parts = []
    for b in m.blocks:
        for k in range(m.D):
            pk, pl = S["pk", b, k], S["pl", b, k]
            knows = [And(S["preq", b, k] == r, pk == zmin(pl, S["len", r])) for r in m.R]
            parts.append(Implies(S["pa", b, k], disj(knows)))
            # a live writer's placeholders are its request's live sampling steps older than k
            for r in m.R:
                cells = _cells_before(m, S, k, r)
                live = conj([S["pa", b, k], S["preq", b, k] == r, S["elive", k, r]])
                same = [Implies(pl - pk > i, S["pc", b, k, i] == cells[i]) for i in range(m.G)]
                parts.append(Implies(live, conj(same)))
    return conj(parts)


def _cells_before(m: Model, S: SState, k: int, r: int) -> list[Term]:
    """The step ids of r's live sampling entries older than slot k, oldest first (``ahead``)."""
    active = [
        conj([S["nst"] > kk, S["ea", kk, r], S["esam", kk, r], S["elive", kk, r]])
        for kk in range(k)
    ]
    cells = []
    for i in range(m.G):
        out: Term = z3.IntVal(-1)
        for kk in reversed(range(k)):
            out = If(And(active[kk], count(active[:kk]) == i), S["sid", kk], out)
        cells.append(out)
    return cells


@lemma(
    "every entry of the building step is live: preempt withdraws the victim's entry from the "
    "building step, and abort waits until no step is building."
)
def building_entries_live(m: Model, S: SState) -> Term:
    return conj(
        [
            Implies(And(m.building(S, k), S["ea", k, r]), S["elive", k, r])
            for k in range(m.D)
            for r in m.R
        ]
    )


@lemma(
    "preempt and abort clear a request's liveness in every step at once, so if an older "
    "step's entry of a request is live, its entries in newer steps are live too."
)
def liveness_monotone(m: Model, S: SState) -> Term:
    return conj(
        [
            Implies(And(S["elive", k, r], S["ea", kk, r]), S["elive", kk, r])
            for r in m.R
            for k in range(m.D)
            for kk in range(k + 1, m.D)
        ]
    )


@lemma(
    "a request that left a submitted step and runs again was admitted again by a newer step, "
    "which is still in flight (steps commit oldest first), with a live entry."
)
def readmitted_in_newer_step(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        for k in range(m.D):
            dead = conj([S["ea", k, r], Not(S["elive", k, r]), S["st", r] == RUNNING])
            parts.append(Implies(dead, _live_after(m, S, k, r)))
    return conj(parts)


@lemma(
    "a running request is scheduled from its computed count on, so its live entries in "
    "successive steps are successive chunks: an older one ends where a newer one starts at "
    "the latest."
)
def live_chunks_in_order(m: Model, S: SState) -> Term:
    return conj(
        [
            Implies(And(S["elive", k, r], S["elive", kk, r]), S["ee", k, r] <= S["es", kk, r])
            for r in m.R
            for k in range(m.D)
            for kk in range(k + 1, m.D)
        ]
    )


@lemma(
    "a request's newest live entry ends at its computed count: schedule sets computed to the "
    "entry's end, and only a leave (which kills the entry) resets it."
)
def newest_entry_ends_at_computed(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        for k in range(m.D):
            newest = And(_holds_its_blocks(m, S, k, r), Not(_live_after(m, S, k, r)))
            parts.append(Implies(newest, S["ee", k, r] == S["comp", r]))
    return conj(parts)


# -- content lemmas, every policy: the safety argument --------------------------------------------


@lemma(
    "a running request's table block i will hold its computed prefix up to that block's end: "
    "hits hold it already (they are published, hence hold their key), and every block the "
    "request computes into gets a pending write of exactly that prefix, which nobody else "
    "writes over while the request holds the block."
)
def tables_eventually_hold(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        for i in m.M:
            block = S["tab", r, i]
            held = conj([S["st", r] == RUNNING, S["ntab", r] > i])
            prefix = m.reader_prefix(S, r, zmin(S["comp", r], (i + 1) * m.B))
            parts.append(Implies(held, m.holds_eventually(S, block, prefix)))
    return conj(parts)


@lemma(
    "a published block in a request's table at index i is published under that request's "
    "i-th chained hash: it got there as a hit on that hash, or the request registered it "
    "under that hash itself."
)
def held_keys_match(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        for i in m.M:
            held = conj([S["ntab", r] > i])
            for b in m.blocks:
                cond = And(held, S["tab", r, i] == b, S["hk", b])
                parts.append(Implies(cond, m.key_matches(S, b, r, i)))
    return conj(parts)


@lemma(
    "NoUnwrittenRead holds for withdrawn entries of submitted steps too: a submitted step "
    "still runs all its reads and writes, and nothing changes a block's content before it "
    "runs except the writes of older steps, which the reads already account for. Stated for "
    "synchronous cells only: under async scheduling the spec judges a withdrawn entry's read "
    "against its request's tokens as seen now (``State.seen``), whose placeholders are newer "
    "live steps', not those it was scheduled with, so this argument does not carry over, and "
    "the async proofs do not need it.",
    scheduling="sync",
)
def dead_entries_read_well(m: Model, S: SState) -> Term:
    return conj(reads_hold(m, S, live_only=False))


# -- the deferring policies (deferred, hide-uncommitted): nobody shares a block being written -----


def _deferring(t: Traits) -> bool:
    """deferred, hide-uncommitted: nothing is visible before its step is written."""
    return t.publish in ("at-written", "hidden-until-written")


@lemma(
    "under the deferring policies a block is published only by the commit of a step that "
    "wrote it to its end, after which no step writes it again: a block with a pending write "
    "is unpublished, and nobody else can hit it.",
    family=_deferring,
)
def pending_blocks_unpublished(m: Model, S: SState) -> Term:
    return conj([Implies(S["pa", b, k], Not(S["hk", b])) for b in m.blocks for k in range(m.D)])


@lemma(
    "under the deferring policies the blocks a live entry writes are its request's alone "
    "(refcount 1): they were allocated to it, and they are unpublished until written.",
    family=_deferring,
)
def written_blocks_unshared(m: Model, S: SState) -> Term:
    parts = []
    for k in range(m.D):
        open_ = And(S["nst"] > k, S["ph", k] != EXECUTED)
        for r in m.R:
            first = m.floor_blocks(S["es", k, r])
            nblk = m.ceil_blocks(S["ee", k, r])
            for i in m.M:
                writes = conj([open_, _holds_its_blocks(m, S, k, r), first <= i, nblk > i])
                parts.append(
                    Implies(writes, m.at_block(S["eblk", k, r, i], lambda b: S["ref", b] == 1))
                )
    return conj(parts)


@lemma(
    "under the deferring policies a block that a withdrawn entry will still write is held "
    "again only after being allocated anew, by a newer step that will write it later: the "
    "withdrawn write never is the block's last.",
    family=_deferring,
)
def dead_writes_overwritten(m: Model, S: SState) -> Term:
    parts = []
    for b in m.blocks:
        for k in range(m.D):
            live_writer = disj(
                [And(S["preq", b, k] == r, _holds_its_blocks(m, S, k, r)) for r in m.R]
            )
            newer = disj([S["pa", b, kk] for kk in range(k + 1, m.D)])
            cond = conj([S["pa", b, k], Not(live_writer), S["ref", b] >= 1])
            parts.append(Implies(cond, newer))
    return conj(parts)


# -- the policies that register at scheduling time: what a rollback must undo ---------------------


@lemma(
    "a step's bucket (hide-uncommitted, eager-rollback-fifo) is the range of table blocks the "
    "request's live entry there fills to their end, from the block its entry starts in; "
    "preempt and abort drop the request's buckets with its liveness.",
    family=lambda t: t.track == "per-step",  # hide-uncommitted, eager-rollback-fifo
)
def step_buckets_are_filled_blocks(m: Model, S: SState) -> Term:
    parts = []
    for k in range(m.D):
        for r in m.R:
            span = _fills(m, S, k, r, S["rlo", k, r], S["rhi", k, r])
            parts.append(Implies(S["ra", k, r], And(_holds_its_blocks(m, S, k, r), span)))
    return conj(parts)


@lemma(
    "the policies that register at scheduling time advance a running request's cached count "
    "to its full computed blocks at every schedule (hits are full blocks too).",
    family=lambda t: t.publish in ("at-schedule", "hidden-until-written"),  # all but deferred
)
def cached_tracks_computed(m: Model, S: SState) -> Term:
    if m.async_:  # registration stops at the known tokens: up to the full computed blocks
        return conj(
            [
                Implies(S["st", r] == RUNNING, S["cach", r] <= m.floor_blocks(S["comp", r]))
                for r in m.R
            ]
        )
    return conj(
        [Implies(S["st", r] == RUNNING, S["cach", r] == m.floor_blocks(S["comp", r])) for r in m.R]
    )


@lemma(
    "under vllm's discipline, until the building step admits someone, the blocks its live "
    "entries write are their requests' alone: the only way to share a block is a hit at "
    "admission, and a block is published (eagerly) no earlier than the step that writes it "
    "to its end (for the deferring policies WrittenBlocksUnshared says more, for every discipline)."
)
def building_writes_unshared_until_admission(m: Model, S: SState) -> Term:
    if m.config.discipline != "vllm":
        return z3.BoolVal(True)
    parts = []
    for k in range(m.D):
        quiet = And(m.building(S, k), Not(S["adm", k]))
        for r in m.R:
            first = m.floor_blocks(S["es", k, r])
            nblk = m.ceil_blocks(S["ee", k, r])
            for i in m.M:
                writes = conj([quiet, S["elive", k, r], first <= i, nblk > i])
                parts.append(
                    Implies(writes, m.at_block(S["eblk", k, r, i], lambda b: S["ref", b] == 1))
                )
    return conj(parts)


@lemma(
    "under the rollback policies a block that a live entry of the building step writes and "
    "that is published was published by that entry's own schedule (a block is published "
    "only once full, and this step is the one filling it), so it is in the request's record "
    "of this step's registrations, which a preemption rolls back.",
    family=lambda t: t.leave == "unpublish",  # eager-rollback-single, eager-rollback-fifo
)
def building_publications_recorded(m: Model, S: SState) -> Term:
    parts = []
    single = m.traits.track == "one-dict"
    for k in range(m.D):
        for r in m.R:
            first = m.floor_blocks(S["es", k, r])
            nblk = m.ceil_blocks(S["ee", k, r])
            if single:
                lo, hi, on = S["slo", r], S["shi", r], S["son", r]
            else:
                lo, hi, on = S["rlo", k, r], S["rhi", k, r], S["ra", k, r]
            for i in m.M:
                writes = conj([m.building(S, k), S["elive", k, r], first <= i, nblk > i])
                published = m.at_block(S["eblk", k, r, i], lambda b: S["hk", b])
                recorded = conj([on, lo <= i, hi > i])
                parts.append(Implies(And(writes, published), recorded))
    return conj(parts)


def _finish_in_flight(m: Model) -> bool:
    """A commit can finish a request while a newer step that scheduled it is in flight: under
    async scheduling (without it, nothing is in flight after a finishing commit)."""
    return m.async_


@lemma(
    "while steps are in flight, eager-rollback-single's record names only running requests "
    "scheduled in the newest step (begin clears it, preempt and abort drop the leaver), and "
    "covers blocks that request's entry there fills to their end; under async scheduling it "
    "may also name a request finished by a commit while that step is in flight (a finish "
    "does not touch the record).",
    family=lambda t: t.track == "one-dict",  # eager-rollback-single
)
def single_record_is_newest_step(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        lo, hi = S["slo", r], S["shi", r]
        options = []
        for k in range(m.D):
            span = _fills(m, S, k, r, lo, hi)
            options.append(conj([S["nst"] == k + 1, S["elive", k, r], span]))
        in_flight = And(S["son", r], S["nst"] > 0)
        named = And(S["st", r] == RUNNING, disj(options))
        if _finish_in_flight(m):  # a commit may finish it, its step in flight: begin clears it
            named = Or(named, S["st", r] == FINISHED)
        parts.append(Implies(in_flight, named))
    return conj(parts)


# -- the rollback policies under async scheduling: what a withdrawn entry's bad read may garble ---


def _rolls_back(t: Traits) -> bool:
    """eager-rollback-single, eager-rollback-fifo: a leaver's registrations are rolled back."""
    return t.leave == "unpublish"


def _entry_reads_hold(m: Model, S: SState, k: int, r: int) -> Term:
    """Request r's entry in slot k (live or withdrawn) finds its prefix, as seen now, in every
    block of its table, the ones it writes included, once the writes of that step and older
    ones have run: what ``Model._bad_read`` asks when the step executes."""
    end = S["ee", k, r]
    active = conj([S["nst"] > k, S["ph", k] != EXECUTED, S["ea", k, r]])
    parts = []
    for i in m.M:
        prefix = m.reader_prefix(S, r, zmin(end, (i + 1) * m.B))
        held = m.holds_eventually(S, S["eblk", k, r, i], prefix, upto=k)
        parts.append(Implies(And(active, m.ceil_blocks(end) > i), held))
    return conj(parts)


def _shares_written_blocks(m: Model) -> bool:
    """A block another request writes in a step can be in a stale entry's table by a hit on
    it (the rollback policies publish at schedule; ``EntriesMatchTables``, stale output
    delivered); the deferring policies share no block being written."""
    return _rolls_back(m.traits)


def _withdrawn(m: Model, S: SState, k: int, r: int) -> Term:
    """r has an entry in slot k that no longer holds its blocks (preempted, aborted, finished)."""
    return And(S["ea", k, r], Not(_holds_its_blocks(m, S, k, r)))


@lemma(
    "under the rollback policies with async scheduling a withdrawn entry that ends within its "
    "request's known tokens reads well: the spec judges its read against the known tokens "
    "(placeholders only begin past them), which its blocks were written with, and nothing "
    "changes a block's content before the step runs except older steps' writes, which land "
    "intact (NeededDeadWritesLand).",
    family=_rolls_back,
    scheduling="async",
)
def known_dead_entries_read_well(m: Model, S: SState) -> Term:
    return conj(
        [
            Implies(
                And(_withdrawn(m, S, k, r), S["ee", k, r] <= S["len", r]),
                _entry_reads_hold(m, S, k, r),
            )
            for k in range(m.D)
            for r in m.R
        ]
    )


@lemma(
    "under the rollback policies two entries of one step that list the same block list it at "
    "the same index: their tables were held together at the end of that step's building (an "
    "entry leaves a step it was built in only with its writes), and a block is shared only by "
    "a hit on its hash, which names its position. Stated where entries outlive their "
    "request's table (async scheduling, stale output delivered).",
    family=_rolls_back,
    scheduling="in-flight-output",
)
def step_entries_share_at_same_index(m: Model, S: SState) -> Term:
    parts = []
    for k in range(m.D):
        for r in m.R:
            for q in m.R:
                if q <= r:
                    continue
                for i in m.M:
                    for j in m.M:
                        if i == j:
                            continue
                        both = conj(
                            [
                                S["ea", k, r],
                                S["ea", k, q],
                                m.ceil_blocks(S["ee", k, r]) > i,
                                m.ceil_blocks(S["ee", k, q]) > j,
                            ]
                        )
                        parts.append(Implies(both, S["eblk", k, r, i] != S["eblk", k, q, j]))
    return conj(parts)


@lemma(
    "under async scheduling an entry that ends past its request's known tokens starts at or "
    "beyond them: a schedule starts at the computed count, which is the newest live sampling "
    "entry's end, at or past the known tokens, whenever a placeholder is ahead; known tokens "
    "grow one per commit, each resolving a placeholder, and the entry ends within them once "
    "its own placeholders resolve. Stated for the rollback policies, whose withdrawn entries "
    "need it.",
    family=_rolls_back,
    scheduling="async",
)
def placeholder_entries_start_past_known(m: Model, S: SState) -> Term:
    return conj(
        [
            Implies(And(S["ea", k, r], S["ee", k, r] > S["len", r]), S["es", k, r] >= S["len", r])
            for k in range(m.D)
            for r in m.R
        ]
    )


@lemma(
    "under the rollback policies with async scheduling an entry's write holding a placeholder "
    "(a block past its request's known tokens) is never a block's last write that someone "
    "else needs: such a block is unpublished (registration stops at the known tokens) and "
    "this request's alone, so another entry of this step or a newer one lists it only after "
    "a newer write to it, and once the entry is withdrawn (its read may then be bad, against a discarded "
    "sample's placeholder, and garble the write) whoever holds or hits the block got it by an "
    "allocation in a newer step, which writes it later.",
    family=_rolls_back,
    scheduling="async",
)
def needed_dead_writes_land(m: Model, S: SState) -> Term:
    parts = []
    for k in range(m.D):
        for r in m.R:
            gone = _withdrawn(m, S, k, r)
            for b in m.blocks:
                mine = conj([S["pa", b, k], S["preq", b, k] == r, S["pl", b, k] > S["len", r]])
                needed = Or(S["ref", b] >= 1, S["hk", b])
                newer = disj([S["pa", b, kk] for kk in range(k + 1, m.D)])
                parts.append(Implies(conj([mine, gone, needed]), newer))
                for kk in range(k, m.D):
                    rewritten = disj([S["pa", b, j] for j in range(k + 1, kk + 1)])
                    for q in m.R:
                        if (kk, q) == (k, r):
                            continue
                        # r's own newer entries list it again only as a new block: once r
                        # holds its blocks again, or when they end within the known tokens
                        reader = S["ea", kk, q]
                        if q == r:
                            again = And(gone, _holds_its_blocks(m, S, kk, q))
                            known = And(S["ea", kk, q], S["ee", kk, q] <= S["len", q])
                            reader = Or(again, known)
                        reads = m.ceil_blocks(S["ee", kk, q])
                        parts += [
                            Implies(
                                conj([mine, reader, reads > j, S["eblk", kk, q, j] == b]),
                                rewritten,
                            )
                            for j in m.M
                        ]
    return conj(parts)
