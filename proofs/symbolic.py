"""A symbolic model of the spec's state machine in Z3, bounded, hand-written (issue #3).

One meaning, two forms: ``actions.py`` is the meaning; this module restates it as Z3 terms so that
a solver can search every behaviour up to a bound. ``tests/test_symbolic.py`` checks, over
thousands of random concrete (state, decision) pairs, that this relation admits exactly the
executable spec's successor; a drifting model fails that test. Only this module of ``spec/`` imports
z3: the executable spec stays standard-library Python.

The fragment (``Fragment``): N <= 8 blocks counting the null block, block size 1 or 2, depth
<= 3, R <= 3 requests arriving in id order (request r is the r-th to arrive), at most T tokens per
request (prompt + generated), no external KV loads; synchronous or async scheduling (placeholders:
a content's known tokens, then one cell per placeholder naming its sampling step), stale output
dropped or delivered. Everything has a static size:

* a state is a dict from a key such as ``("ref", b)`` or ``("tok", r, j)`` to a Z3 term;
* token sequences live once, in the requests (``tok``, padded with 0); a block's published hash and
  its written content are (request, length) references to a prefix of a request's tokens (requests
  keep their tokens after finishing and tokens only ever append, so a reference never goes stale);
* orders are integer positions: the free queue (``qpos`` with head/tail counters ``qlo``/``qhi``:
  a head insert takes ``qlo - 1``, a tail insert ``qhi + 1``, allocation takes the smallest), the
  waiting and running queues (``wpos``, ``rpos``), the index's "oldest registration first"
  (``pub``, a publication counter) and a step's scheduling order (``eo``);
* in-flight steps are D slots, oldest first (commit shifts them down); a block's pending writes
  are one slot per in-flight step (a step writes a block at most once);
* the index is not a separate variable: it is the set of blocks whose ``hk`` is set, each under
  its own key, ordered by ``pub``.

An *instance* is an action with its request and step slot fixed (``("schedule", r, k)``); its other
parameters (tokens to schedule, sampled tokens, step ids, a prompt) are Z3 terms, symbolic in
bounded model checking and concrete in the agreement test. ``Model.apply`` builds an instance's
guard and successor; ``Model.invariants`` the invariants as predicates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import z3

from kvspec import twins
from kvspec.spec.policies import registers_after_output, traits
from kvspec.spec.state import NULL_BLOCK, Config, Placeholder, State

from .terms import And, If, Implies, Not, Or

TWIN_OF = "kvspec.spec"
"""This module restates the spec in another form (kvspec/twins.py says what it must equal)."""

Term = Any
"""A Z3 expression (z3 ships no type information)."""
SKey = Any
"""A state variable's key: a name (global) or a tuple such as ``("ref", b)``."""
SState = dict[SKey, Term]
Instance = tuple[Any, ...]
Case = tuple[tuple[Any, Any], ...]
"""Choices at named decision points of an instance (``Model.cases``): (point, choice) pairs."""
Params = dict[str, Any]

NONE, WAITING, RUNNING, FINISHED = 0, 1, 2, 3
BUILDING, SUBMITTED, EXECUTED = 0, 1, 2
STATUS = {"waiting": WAITING, "running": RUNNING, "finished": FINISHED}
PHASE = {"building": BUILDING, "submitted": SUBMITTED, "executed": EXECUTED}


FORM = "kvspec.proofs.symbolic"


class OutsideFragment(ValueError):
    """A concrete state or decision the symbolic model does not represent."""


class LoadsNotFollowed(OutsideFragment, twins.NotFollowed):
    """A load decision (or a bounded hit's): the refusal kvspec/twins.py declares for ``loads``
    (``bounded_hits``)."""


class ResetNotFollowed(OutsideFragment, twins.NotFollowed):
    """A reset preempting running requests: the refusal kvspec/twins.py declares for
    ``reset_running``."""


def refuse_loads(what: str = "loads") -> LoadsNotFollowed:
    declared = twins.refused(FORM, what)
    return LoadsNotFollowed(declared.form, declared.what, str(declared))


@dataclass(frozen=True)
class Fragment:
    """The sizes the symbolic model is built for (all static)."""

    config: Config
    requests: int = 2
    """R: request ids 0 .. R - 1, arriving in id order."""
    max_len: int = 4
    """T: most tokens per request, prompt plus generated."""
    vocab: int = 2
    """Tokens 1 .. vocab in bounded model checking (the agreement test may use any ints)."""
    priorities: int = 2
    """Priorities 0 .. priorities - 1 in bounded model checking."""

    def __post_init__(self) -> None:
        c = self.config
        checks = [
            (2 <= c.num_blocks <= 8, f"blocks must be 2..8 here, got {c.num_blocks}"),
            (c.block_size in (1, 2), f"block size must be 1 or 2 here, got {c.block_size}"),
            (1 <= c.depth <= 3, f"depth must be 1..3 here, got {c.depth}"),
            (1 <= self.requests <= 3, f"requests must be 1..3 here, got {self.requests}"),
            (2 <= self.max_len <= 8, f"tokens per request must be 2..8, got {self.max_len}"),
            (self.vocab >= 1 and self.priorities >= 1, "vocab and priorities must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        twins.refuse(FORM, c)  # what the Z3 model does not follow: its row in kvspec/twins.py

    @property
    def slots(self) -> int:
        """Most table blocks a request can hold."""
        return -(-self.max_len // self.config.block_size)

    def describe(self) -> str:
        c = self.config
        timing = ", async scheduling" if c.async_scheduling else ""
        if c.async_scheduling or c.stale_output == "deliver":
            timing += f", stale output {c.stale_output}"
        return (
            f"N={c.num_blocks} blocks (incl. null) of B={c.block_size}, depth D={c.depth}, "
            f"R={self.requests} requests of <= {self.max_len} tokens (prompt + generated), "
            f"tokens 1..{self.vocab}, priorities 0..{self.priorities - 1}, "
            f"budget {c.token_budget}, max running {c.max_running}, no external loads{timing}"
        )


# ---------------------------------------------------------------------------------------------
# small helpers


def key_name(key: SKey) -> str:
    return key if isinstance(key, str) else ".".join(map(str, key))


def conj(parts: list[Term]) -> Term:
    parts = [p for p in parts if not (isinstance(p, bool) and p)]
    if any(isinstance(p, bool) and not p for p in parts):
        return z3.BoolVal(False)
    if not parts:
        return z3.BoolVal(True)
    return parts[0] if len(parts) == 1 else And(*parts)


def disj(parts: list[Term]) -> Term:
    parts = [p for p in parts if not (isinstance(p, bool) and not p)]
    if any(isinstance(p, bool) and p for p in parts):
        return z3.BoolVal(True)
    if not parts:
        return z3.BoolVal(False)
    return parts[0] if len(parts) == 1 else Or(*parts)


def total(parts: list[Term]) -> Term:
    return z3.Sum(*parts) if parts else z3.IntVal(0)


def count(conds: list[Term]) -> Term:
    return total([If(c, 1, 0) for c in conds])


def ite_state(cond: Term, then: SState, other: SState) -> SState:
    """``If(cond, then, other)`` key by key, sharing what both sides share."""
    out = dict(other)
    for key, value in then.items():
        if value is not other[key]:
            out[key] = If(cond, value, other[key])
    return out


def _flat(x: Any) -> list[Any]:
    """Terms and ints of nested tuples and lists, in order."""
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat(item)]
    return [x]


def _cell(cells: tuple[Term, ...] | list[Term], d: Term) -> Term:
    """``cells[d]`` for an index given as a term (the last cell beyond the end)."""
    out = cells[-1]
    for i in reversed(range(len(cells) - 1)):
        out = If(d == i, cells[i], out)
    return out


def _ids(terms: Any) -> tuple[int, ...]:
    """Z3 term ids of a flat or nested list of terms."""
    out: list[int] = []
    for t in terms:
        if isinstance(t, tuple):
            out += [x.get_id() for x in t]
        else:
            out.append(t.get_id())
    return tuple(out)


def zmax(a: Term, b: Term) -> Term:
    return If(a >= b, a, b)


def zmin(a: Term, b: Term) -> Term:
    return If(a <= b, a, b)


class Model:
    """The symbolic state machine for one fragment (config + sizes)."""

    def __init__(self, fragment: Fragment) -> None:
        self.fragment = fragment
        self.config = c = fragment.config
        self.B = c.block_size
        self.D = c.depth
        self.R = range(fragment.requests)
        self.T = range(fragment.max_len)
        self.M = range(fragment.slots)
        self.blocks = range(1, c.num_blocks)
        self.async_ = c.async_scheduling and c.depth >= 2
        """Placeholders exist (async scheduling with a step that can be in flight while another
        is built): contents then carry their placeholders (``wk``/``wc``, ``pk``/``pc``)."""
        self.G = c.depth - 1 if self.async_ else 0
        """Most placeholders in one content: one per other step in flight that samples."""
        self.deliver = c.stale_output == "deliver"
        self.traits = traits(c)
        """The registration policy as traits (``spec.policies``): every branch below reads
        them, never the policy's name."""
        self.schema = self._schema()
        self.instances = self._instances()
        self._case: dict[Any, Any] = {}
        self._case_guards: list[Term] = []
        self._terms: dict[Any, tuple[Term, Any]] = {}

    # -- state --------------------------------------------------------------------------------

    def _schema(self) -> list[tuple[SKey, bool]]:
        """Every state variable and whether it is Boolean."""
        out: list[tuple[SKey, bool]] = []
        for name in ("nst", "next", "qlo", "qhi", "wlo", "whi", "rhi", "pubc", "lost", "commits"):
            out.append((name, False))
        out.append(("bad", True))
        for r in self.R:
            for name in ("st", "len", "plen", "maxt", "prio", "ntab", "comp", "cach"):
                out.append(((name, r), False))
            for name in ("wpos", "rpos", "slo", "shi"):
                out.append(((name, r), False))
            out.append((("son", r), True))
            out += [(("tok", r, j), False) for j in self.T]
            out += [(("tab", r, m), False) for m in self.M]
        for b in self.blocks:
            for name in ("ref", "qpos", "kreq", "klen", "pub", "wreq", "wlen"):
                out.append(((name, b), False))
            for name in ("inq", "hk", "wv"):
                out.append(((name, b), True))
            for k in range(self.D):
                out += [(("pa", b, k), True), (("preq", b, k), False), (("pl", b, k), False)]
            if self.async_:
                # a content is its request's known tokens 0 .. known - 1, then placeholders,
                # one cell each (the sampling step's id); see ``content``
                out.append((("wk", b), False))
                out += [(("wc", b, i), False) for i in range(self.G)]
                for k in range(self.D):
                    out.append((("pk", b, k), False))
                    out += [(("pc", b, k, i), False) for i in range(self.G)]
        for k in range(self.D):
            for name in ("sid", "ph", "bud", "eoc"):
                out.append(((name, k), False))
            out += [(("pre", k), True), (("adm", k), True)]
            for r in self.R:
                for name in ("ea", "esam", "elive", "ra"):
                    out.append(((name, k, r), True))
                for name in ("es", "ee", "eo", "rlo", "rhi"):
                    out.append(((name, k, r), False))
                out += [(("eblk", k, r, m), False) for m in self.M]
        return out

    def fresh(self, prefix: str) -> SState:
        """A state of fresh constants named ``prefix|key``."""
        return {
            key: (z3.Bool if is_bool else z3.Int)(f"{prefix}|{key_name(key)}")
            for key, is_bool in self.schema
        }

    def lift(self, values: dict[SKey, int | bool]) -> SState:
        """Concrete values as Z3 constants."""
        return {
            key: z3.BoolVal(bool(values[key])) if is_bool else z3.IntVal(int(values[key]))
            for key, is_bool in self.schema
        }

    def initial_values(self) -> dict[SKey, int | bool]:
        values: dict[SKey, int | bool] = {
            key: (False if is_bool else 0) for key, is_bool in self.schema
        }
        for b in self.blocks:
            values["inq", b] = True
            values["qpos", b] = b - 1
        values["qhi"] = len(self.blocks) - 1
        values["whi"] = values["rhi"] = -1
        return values

    def initial(self) -> SState:
        return self.lift(self.initial_values())

    # -- derived terms ------------------------------------------------------------------------

    def tok(self, S: SState, req: Any, j: int) -> Term:
        """Token j of request ``req`` (an int or a term)."""
        if isinstance(req, int):
            return S["tok", req, j]
        out = S["tok", self.R[-1], j]
        for r in reversed(self.R[:-1]):
            out = If(req == r, S["tok", r, j], out)
        return out

    def blk(self, S: SState, name: str, block: Any) -> Term:
        """Per-block variable ``name`` of a block given as a term."""
        if isinstance(block, int):
            return S[name, block]
        out = S[name, self.blocks[-1]]
        for b in reversed(self.blocks[:-1]):
            out = If(block == b, S[name, b], out)
        return out

    def at_req(self, req: Any, fn: Callable[[int], Term]) -> Term:
        """``fn`` of the request ``req`` names (an int or a term): an ``If`` over the requests
        with the last as the default, the same choice as ``tok``'s."""
        if isinstance(req, int):
            return fn(req)
        if z3.is_int_value(req) and req.as_long() in self.R:
            return fn(req.as_long())
        out = fn(self.R[-1])
        for r in reversed(self.R[:-1]):
            out = If(req == r, fn(r), out)
        return out

    def at_block(self, block: Any, fn: Callable[[int], Term]) -> Term:
        """``fn`` of the block ``block`` names (an int or a term): an ``If`` over the blocks
        with the last as the default, the same choice as ``blk``'s and ``pick``'s."""
        if isinstance(block, int):
            return fn(block)
        if z3.is_int_value(block) and block.as_long() in self.blocks:
            return fn(block.as_long())
        out = fn(self.blocks[-1])
        for b in reversed(self.blocks[:-1]):
            out = If(block == b, fn(b), out)
        return out

    def same_prefix(self, S: SState, req_a: Any, req_b: Any, length: Any) -> Term:
        """Requests' tokens agree on their first ``length`` positions. A request given as a
        term is a case split over the requests (each case compares tokens directly)."""
        if not isinstance(req_a, int) and not isinstance(req_b, int) and req_a.eq(req_b):
            return z3.BoolVal(True)
        if not isinstance(req_a, int):
            return self.at_req(req_a, lambda a: self.same_prefix(S, a, req_b, length))
        if not isinstance(req_b, int):
            return self.at_req(req_b, lambda b: self.same_prefix(S, req_a, b, length))
        if req_a == req_b:
            return z3.BoolVal(True)
        toks = [(S["tok", req_a, j], S["tok", req_b, j]) for j in self.T]
        key = ("prefix", _ids(toks), length if isinstance(length, int) else length.get_id())
        return self._memo(key, (toks, length), lambda: self._same_prefix(toks, length))

    def _same_prefix(self, toks: list[tuple[Term, Term]], length: Any) -> Term:
        parts = []
        for j, (a, b) in enumerate(toks):
            if isinstance(length, int):
                if j < length:
                    parts.append(a == b)
            else:
                parts.append(Implies(length > j, a == b))
        return conj(parts)

    def _memo(self, key: Any, keep: Any, build: Callable[[], Term]) -> Term:
        """A term built once per key of Z3 term ids; ``keep`` holds the terms the ids are of
        (so that no id is reused while the entry lives)."""
        hit = self._terms.get(key)
        if hit is None:
            hit = self._terms[key] = (build(), keep)
        return hit[0]

    def holds(self, S: SState, content: tuple[Any, ...], prefix: tuple[Any, ...]) -> Term:
        """``pool.holds``: bytes holding ``content`` (valid, req, len) are valid for ``prefix``
        (req, len). Under async scheduling either may also carry (known, cells): its request's
        tokens 0 .. known - 1, then placeholders (``content``)."""
        valid, creq, clen = content[:3]
        preq, plen = prefix[:2]
        if len(content) == 3 and len(prefix) == 2:
            return conj([valid, clen >= plen, self.same_prefix(S, creq, preq, plen)])
        a, b = (creq, *content[3:]), (preq, *prefix[2:])
        return conj([valid, clen >= plen, self.seq_agree(S, a, b, plen)])

    def seq_agree(self, S: SState, a: tuple[Any, ...], b: tuple[Any, ...], length: Any) -> Term:
        """Two sequences agree on their first ``length`` positions. A sequence is (req,): that
        request's tokens, or (req, known, cells): its tokens 0 .. known - 1, then at position
        j >= known the placeholder ``cells[j - known]`` (a step id) of that request. A token is
        never a placeholder; two placeholders are equal when their step and request are."""
        if len(a) == 1 and len(b) == 1:
            return self.same_prefix(S, a[0], b[0], length)
        if len(a) == 1:
            a, b = b, a
        parts = []
        for j in self.T:
            ta, tb = self.tok(S, a[0], j), self.tok(S, b[0], j)
            ra, ka, ca = a
            if len(b) == 1:
                eq = And(ka > j, ta == tb)
            else:
                rb, kb, cb = b
                same_ph = And(a[0] == rb, _cell(ca, j - ka) == _cell(cb, j - kb))
                eq = If(ka > j, And(kb > j, ta == tb), And(Not(kb > j), same_ph))
            if isinstance(length, int):
                if j < length:
                    parts.append(eq)
            else:
                parts.append(Implies(length > j, eq))
        return conj(parts)

    def written(self, S: SState, b: int) -> tuple[Any, ...]:
        """Block b's written content: (valid, req, len), and (known, cells) under async."""
        out: tuple[Any, ...] = (S["wv", b], S["wreq", b], S["wlen", b])
        if self.async_:
            out += (S["wk", b], tuple(S["wc", b, i] for i in range(self.G)))
        return out

    def pending(self, S: SState, b: int, k: int) -> tuple[Any, ...]:
        """Block b's pending write of slot k: (active, req, len), and (known, cells) under async."""
        out: tuple[Any, ...] = (S["pa", b, k], S["preq", b, k], S["pl", b, k])
        if self.async_:
            out += (S["pk", b, k], tuple(S["pc", b, k, i] for i in range(self.G)))
        return out

    def ahead(self, S: SState, r: int) -> tuple[Term, list[Term]]:
        """``State.ahead`` beyond the known tokens: how many placeholders, and their step ids,
        oldest first (one per slot in flight whose live entry for r samples)."""
        active = [
            conj([S["nst"] > k, S["ea", k, r], S["esam", k, r], S["elive", k, r]])
            for k in range(self.D)
        ]
        cells = []
        for i in range(self.D):
            out: Term = z3.IntVal(-1)
            for k in reversed(range(self.D)):
                pos = count(active[:k])
                out = If(And(active[k], pos == i), S["sid", k], out)
            cells.append(out)
        return count(active), cells

    def reader_prefix(self, S: SState, r: int, length: Term) -> tuple[Any, ...]:
        """The prefix ``ahead(r)[:length]`` as a holds() prefix (capped at ahead's length)."""
        if not self.async_:
            return (r, length)
        n, cells = self.ahead(S, r)
        return (r, zmin(length, S["len", r] + n), S["len", r], tuple(cells))

    def holds_eventually(
        self, S: SState, block: Any, prefix: tuple[Any, Any], upto: int | None = None
    ) -> Term:
        """``holds(eventual(block, upto), prefix)`` for a block given as an int or a term, as a
        case split: over the blocks, then over the pending writes (the newest one wins)."""

        slots = range(self.D if upto is None else upto + 1)
        toks = [S["tok", r, j] for r in self.R for j in self.T]

        def at(b: int) -> Term:
            written = self.written(S, b)
            pending = [self.pending(S, b, k) for k in slots]
            terms = [t for t in _flat([written, pending, toks, prefix]) if not isinstance(t, int)]
            shape = tuple(t if isinstance(t, int) else -1 for t in _flat(prefix))
            key = ("holds", _ids(terms), shape, len(prefix))
            return self._memo(key, terms, lambda: built(written, pending))

        def built(written: tuple[Any, ...], pending: list[tuple[Any, ...]]) -> Term:
            out = self.holds(S, written, prefix)
            for p in pending:
                out = If(p[0], self.holds(S, (z3.BoolVal(True), *p[1:]), prefix), out)
            return out

        return self.at_block(block, at)

    def eventual(self, S: SState, b: int, upto: int | None = None) -> tuple[Term, Term, Term]:
        """``pool.eventual_content`` for block b: written, then pending writes of step slots
        0 .. upto in order (all slots if None); the last one wins."""
        valid, req, length = S["wv", b], S["wreq", b], S["wlen", b]
        for k in range(self.D if upto is None else upto + 1):
            a = S["pa", b, k]
            valid = Or(a, valid)
            req = If(a, S["preq", b, k], req)
            length = If(a, S["pl", b, k], length)
        return valid, req, length

    def eventual_of(self, S: SState, block: Any) -> tuple[Term, Term, Term]:
        return self.pick(block, {b: self.eventual(S, b) for b in self.blocks})

    def pick(
        self, block: Any, per_block: dict[int, tuple[Term, Term, Term]]
    ) -> tuple[Term, Term, Term]:
        """The triple of ``per_block`` for a block given as an int or a term."""
        if isinstance(block, int):
            return per_block[block]
        out = per_block[self.blocks[-1]]
        for b in reversed(self.blocks[:-1]):
            c = block == b
            out = (
                If(c, per_block[b][0], out[0]),
                If(c, per_block[b][1], out[1]),
                If(c, per_block[b][2], out[2]),
            )
        return out

    def ceil_blocks(self, tokens: Term) -> Term:
        return tokens if self.B == 1 else (tokens + (self.B - 1)) / self.B

    def floor_blocks(self, tokens: Term) -> Term:
        return tokens if self.B == 1 else tokens / self.B

    def key_matches(self, S: SState, b: int, req: int, index: int) -> Term:
        """Block b is published under request ``req``'s ``index``-th chained hash."""
        length = (index + 1) * self.B
        return conj(
            [S["hk", b], S["klen", b] == length, self.same_prefix(S, S["kreq", b], req, length)]
        )

    def lookup(self, S: SState, r: int) -> tuple[list[Term], list[Term], Term]:
        """``pool.lookup``: per table index whether it hits, the block (oldest registration)
        and the number of hits."""
        cap = self.floor_blocks(S["len", r] - 1)
        hit: list[Term] = []
        block: list[Term] = []
        still = z3.BoolVal(True)
        for i in range(min(len(self.M), (len(self.T) - 1) // self.B)):
            match = {b: self.key_matches(S, b, r, i) for b in self.blocks}
            still = conj([still, cap > i, disj(list(match.values()))])
            chosen: Term = z3.IntVal(0)
            for b in reversed(self.blocks):
                oldest = conj(
                    [match[b]]
                    + [Implies(match[o], S["pub", b] < S["pub", o]) for o in self.blocks if o != b]
                )
                chosen = If(oldest, b, chosen)
            hit.append(still)
            block.append(chosen)
        return hit, block, count(hit)

    def free_count(self, S: SState) -> Term:
        return count([S["inq", b] for b in self.blocks])

    def building(self, S: SState, k: int) -> Term:
        """Step slot k is the building step."""
        return conj([S["nst"] == k + 1, S["ph", k] == BUILDING])

    def no_building(self, S: SState) -> Term:
        return conj([Implies(S["nst"] > k, S["ph", k] != BUILDING) for k in range(self.D)])

    def rank_lt(self, S: SState, a: int, b: int) -> Term:
        """(priority, arrival) of a is smaller than b's; arrival is the request id."""
        return Or(S["prio", a] < S["prio", b], And(S["prio", a] == S["prio", b], z3.BoolVal(a < b)))

    def entry_rank(self, S: SState, k: int, r: int) -> Term:
        """Position of request r's entry in step slot k's scheduling order (ties, which no
        reachable state has, broken by request id, so positions are always distinct)."""
        return count(
            [
                And(S["ea", k, o], S["eo", k, o] <= S["eo", k, r])
                if o < r
                else And(S["ea", k, o], S["eo", k, o] < S["eo", k, r])
                for o in self.R
                if o != r
            ]
        )

    def in_order(
        self, S: SState, k: int, which: Callable[[int], Term], body: Callable[[SState, int], SState]
    ) -> SState:
        """Run ``body`` for each request r with ``which(r)`` in slot k's scheduling order: at
        position p, the one request whose entry is p-th (positions are distinct). Under a case
        that fixes slot k's order (``cases``), the bodies run one after the other in it."""
        order = self._case.get(("order", k))
        if order is not None:
            return self._in_fixed_order(S, k, order, which, body)
        ranks = {r: self.entry_rank(S, k, r) for r in self.R}
        pre = S
        for p in self.R:
            at = S
            for r in reversed(self.R):
                S = ite_state(And(pre["ea", k, r], which(r), ranks[r] == p), body(at, r), S)
        return S

    def _in_fixed_order(
        self,
        S: SState,
        k: int,
        order: tuple[int, ...],
        which: Callable[[int], Term],
        body: Callable[[SState, int], SState],
    ) -> SState:
        """``in_order`` for the states whose slot-k entries are scheduled in ``order`` (the
        case's condition joins the guard: ``precedes`` for every pair of entries)."""
        pre = S
        for i, a in enumerate(order):
            for b in order[i + 1 :]:
                both = And(pre["ea", k, a], pre["ea", k, b])
                self._case_guards.append(Implies(both, self.precedes(pre, k, a, b)))
        for r in order:
            S = ite_state(And(pre["ea", k, r], which(r)), body(S, r), S)
        return S

    def precedes(self, S: SState, k: int, a: int, b: int) -> Term:
        """a's entry comes before b's in slot k's order (``entry_rank``'s tie-break)."""
        if a < b:
            return S["eo", k, a] <= S["eo", k, b]
        return S["eo", k, a] < S["eo", k, b]

    def cases(self, inst: Instance) -> list[Case]:
        """A split of the instance into cases whose guards cover its guard, for the proofs.
        Execute: no entry's read is bad after the step's writes (then the reads change nothing,
        whatever the order: the successor is the writes alone), or some read is (the reads run
        in scheduling order, as without a case). Commit runs its step's entries in scheduling
        order, which a case fixes (one case per permutation of the requests), so that a case's
        successor has no branch on the order. (Splitting commit further, on which requests
        finish, was measured slower: docs/proofs.md.)"""
        if inst[0] == "execute":
            k = inst[1]
            return [((("reads", k), "good"),), ((("reads", k), "bad"),)]
        if inst[0] == "commit":
            return [((("order", 0), o),) for o in itertools.permutations(self.R)]
        return [()]

    # -- pool mechanisms ----------------------------------------------------------------------

    def register(self, S: SState, r: int, upto: Term) -> SState:
        """``policies.register``: publish table indices cached .. upto - 1 in order."""
        cached = S["cach", r]
        for i in self.M:
            cond = And(cached <= i, upto > i)
            before = S
            S = dict(S)
            block = before["tab", r, i]
            any_new = []
            for b in self.blocks:
                go = And(cond, block == b, Not(before["hk", b]))
                any_new.append(go)
                S["hk", b] = Or(before["hk", b], go)
                S["kreq", b] = If(go, r, before["kreq", b])
                S["klen", b] = If(go, (i + 1) * self.B, before["klen", b])
                S["pub", b] = If(go, before["pubc"], before["pub", b])
            S["pubc"] = If(disj(any_new), before["pubc"] + 1, before["pubc"])
        S["cach", r] = zmax(cached, upto)
        return S

    def count_if_lost(
        self,
        S: SState,
        block: Term,
        key: Callable[[int], tuple[Any, Any]],
        cond: Callable[[int], Term],
        own: int,
    ) -> Term:
        """1 when ``pool.count_if_lost`` counts a lost hit, else 0; ``key`` and ``cond`` are of
        the block (a case split over the blocks)."""

        def lost(b: int) -> Term:
            return And(cond(b), S["ref", b] - own == 0, self.holds_eventually(S, b, key(b)))

        return If(self.at_block(block, lost), 1, 0)

    def free_table(self, S: SState, r: int) -> SState:
        """``pool.free_table``: reverse table order; unhashed to the head, cached to the tail."""
        S = dict(S)
        for m in reversed(self.M):
            active = S["ntab", r] > m
            block = S["tab", r, m]
            to_head, to_tail = [], []
            lo, hi = S["qlo"], S["qhi"]
            for b in self.blocks:
                hit = And(active, block == b)
                ref = If(hit, S["ref", b] - 1, S["ref", b])
                zero = And(hit, ref == 0)
                head = And(zero, Not(S["hk", b]))
                tail = And(zero, S["hk", b])
                to_head.append(head)
                to_tail.append(tail)
                S["ref", b] = ref
                S["qpos", b] = If(head, lo - 1, If(tail, hi + 1, S["qpos", b]))
                S["inq", b] = Or(S["inq", b], zero)
            S["qlo"] = If(disj(to_head), lo - 1, lo)
            S["qhi"] = If(disj(to_tail), hi + 1, hi)
        for m in self.M:
            S["tab", r, m] = z3.IntVal(0)
        S["ntab", r] = S["comp", r] = S["cach", r] = z3.IntVal(0)
        return S

    def leave(self, S: SState, r: int, k: int | None, stale: str = "drop") -> SState:
        """``actions._leave``: withdraw from the building step (slot k), drop liveness (only in
        the building step when stale output is delivered), the policy's rollback, then free the
        table."""
        S = dict(S)
        t = self.traits
        if k is not None:
            was = S["ea", k, r]
            S["bud", k] = If(was, S["bud", k] - (S["ee", k, r] - S["es", k, r]), S["bud", k])
            nblk = self.ceil_blocks(S["ee", k, r])
            for b in self.blocks:
                listed = disj([And(nblk > m, S["eblk", k, r, m] == b) for m in self.M])
                drop = And(was, listed, S["pa", b, k], S["preq", b, k] == r)
                S["pa", b, k] = And(S["pa", b, k], Not(drop))
            S["ea", k, r] = z3.BoolVal(False)
        for kk in range(self.D):
            if stale == "drop" or kk == k:
                S["elive", kk, r] = z3.BoolVal(False)
        # on_remove: which table indices the policy tracks for r
        tracked: list[Term] = []
        if t.track == "one-dict":
            tracked = [And(S["son", r], S["slo", r] <= m, S["shi", r] > m) for m in self.M]
            S["son", r] = z3.BoolVal(False)
        elif t.track == "per-step":
            tracked = [
                disj(
                    [
                        And(
                            S["nst"] > kk, S["ra", kk, r], S["rlo", kk, r] <= m, S["rhi", kk, r] > m
                        )
                        for kk in range(self.D)
                    ]
                )
                for m in self.M
            ]
            for kk in range(self.D):
                S["ra", kk, r] = z3.BoolVal(False)
        if tracked:
            lost = []
            for m in self.M:
                block = S["tab", r, m]
                if t.leave == "drop-hidden":
                    own_key = (r, (m + 1) * self.B)
                    live = tracked[m]

                    def own_block_key(b: int, key: tuple[Any, Any] = own_key) -> tuple[Any, Any]:
                        return key

                    def kept(b: int, live: Term = live) -> Term:
                        return live

                    lost.append(self.count_if_lost(S, block, own_block_key, kept, own=1))
                else:
                    live = tracked[m]

                    def hashed(b: int) -> tuple[Any, Any]:
                        return (S["kreq", b], S["klen", b])

                    def kept_hashed(b: int, live: Term = live) -> Term:
                        return And(live, S["hk", b])

                    lost.append(self.count_if_lost(S, block, hashed, kept_hashed, own=1))
            S["lost"] = S["lost"] + total(lost)
            if t.leave == "unpublish":
                for b in self.blocks:
                    dropped = disj([And(tracked[m], S["tab", r, m] == b) for m in self.M])
                    S["hk", b] = And(S["hk", b], Not(dropped))
        return self.free_table(S, r)

    # -- actions ------------------------------------------------------------------------------

    def _instances(self) -> list[Instance]:
        out: list[Instance] = [("arrive", r) for r in self.R]
        out += [("begin", k) for k in range(self.D)]
        out += [("schedule", r, k) for k in range(self.D) for r in self.R]
        out += [("preempt", r, k) for k in range(self.D) for r in self.R]
        out += [("submit", k) for k in range(self.D)]
        out += [("execute", k) for k in range(self.D)]
        out += [("commit",)]
        out += [("abort", r) for r in self.R]
        out += [("reset",)]
        return out

    def fresh_params(self, inst: Instance, prefix: str) -> Params:
        """Symbolic parameters of an instance (tokens, step ids, a prompt)."""
        kind = inst[0]
        if kind == "arrive":
            r = inst[1]
            return {
                "ptok": [z3.Int(f"{prefix}|ptok.{r}.{j}") for j in self.T],
                "plen": z3.Int(f"{prefix}|plen.{r}"),
                "maxt": z3.Int(f"{prefix}|maxt.{r}"),
                "prio": z3.Int(f"{prefix}|prio.{r}"),
            }
        if kind in ("begin", "submit", "execute"):
            return {"sid": z3.Int(f"{prefix}|sid")}
        if kind == "schedule":
            return {"n": z3.Int(f"{prefix}|n")}
        if kind == "commit":
            return {
                "sid": z3.Int(f"{prefix}|sid"),
                "has": [z3.Bool(f"{prefix}|has.{r}") for r in self.R],
                "smp": [z3.Int(f"{prefix}|smp.{r}") for r in self.R],
            }
        return {}

    def apply(self, inst: Instance, S: SState, p: Params, case: Case = ()) -> tuple[Term, SState]:
        """The instance's guard and successor state; under a case (``cases``), the guard
        includes the case's condition."""
        guards: list[Term] = []
        handler = getattr(self, "_" + inst[0])
        self._case, self._case_guards = dict(case), guards
        try:
            succ = handler(S, guards, p, *inst[1:])
        finally:
            self._case, self._case_guards = {}, []
        return conj(guards), succ

    def _arrive(self, S: SState, g: list[Term], p: Params, r: int) -> SState:
        g += [S["st", r] == NONE, p["plen"] >= 1, p["maxt"] >= 1]
        g += [S["st", o] != NONE for o in self.R if o < r]  # fragment: arrival in id order
        g.append(p["plen"] + p["maxt"] <= len(self.T))  # fragment: at most T tokens
        S = dict(S)
        for j in self.T:
            S["tok", r, j] = If(p["plen"] > j, p["ptok"][j], 0)
        S["len", r] = S["plen", r] = p["plen"]
        S["maxt", r], S["prio", r] = p["maxt"], p["prio"]
        S["st", r] = z3.IntVal(WAITING)
        S["wpos", r] = S["whi"] + 1
        S["whi"] = S["whi"] + 1
        return S

    def _begin(self, S: SState, g: list[Term], p: Params, k: int) -> SState:
        g += [S["nst"] == k, p["sid"] == S["next"]]  # k steps in flight, k < D
        if k > 0:
            g.append(S["ph", k - 1] != BUILDING)
        S = dict(S)
        S["next"] = S["next"] + 1
        S["nst"] = z3.IntVal(k + 1)
        S["sid", k], S["ph", k] = p["sid"], z3.IntVal(BUILDING)
        S["bud", k] = S["eoc", k] = z3.IntVal(0)
        S["pre", k] = S["adm", k] = z3.BoolVal(False)
        for r in self.R:
            for name in ("ea", "esam", "elive", "ra"):
                S[name, k, r] = z3.BoolVal(False)
        if self.traits.clear == "on-begin":
            S = self.clear_tracking(S, k)
        return S

    def clear_tracking(self, S: SState, k: int) -> SState:
        """``policies._clear``: the one dict, or step slot ``k``'s bucket, is forgotten."""
        S = dict(S)
        for r in self.R:
            if self.traits.track == "one-dict":
                S["son", r] = z3.BoolVal(False)
            elif self.traits.track == "per-step":
                S["ra", k, r] = z3.BoolVal(False)
        return S

    def _schedule(self, S: SState, g: list[Term], p: Params, r: int, k: int) -> SState:
        c, B, n = self.config, self.B, p["n"]
        vllm = c.discipline == "vllm"
        waiting = S["st", r] == WAITING
        g += [self.building(S, k), S["st", r] != NONE, S["st", r] != FINISHED]
        g += [Not(S["ea", k, r]), n > 0, S["bud", k] + n <= c.token_budget]
        known = S["len", r]
        n_ahead, cells = self.ahead(S, r) if self.async_ else (z3.IntVal(0), [])
        # admission branch
        hit, hblock, nh = self.lookup(S, r)
        running = count([S["st", o] == RUNNING for o in self.R])
        adm = [running < c.max_running]
        if self.deliver:
            adm.append(self.admissible(S, r))
        if vllm:
            adm += [Not(S["pre", k]), self.is_waiting_head(S, r)]
        held_free = count(
            [
                And(hit[i], self.at_block(hblock[i], lambda b: S["ref", b] == 0))
                for i in range(len(hit))
            ]
        )
        end_w = nh * B + n
        adm.append(self.ceil_blocks(end_w) - nh <= self.free_count(S) - held_free)
        W = dict(S)
        for b in self.blocks:
            touched = disj([And(hit[i], hblock[i] == b) for i in range(len(hit))])
            W["ref", b] = If(touched, S["ref", b] + 1, S["ref", b])
            W["inq", b] = And(S["inq", b], Not(touched))
        for i in range(len(hit)):
            W["tab", r, i] = If(hit[i], hblock[i], S["tab", r, i])
        W["ntab", r] = W["cach", r] = nh
        W["st", r] = z3.IntVal(RUNNING)
        W["rpos", r] = S["rhi"] + 1
        W["rhi"] = S["rhi"] + 1
        W["adm", k] = z3.BoolVal(True)
        # running branch
        run = [Not(S["adm", k])] if vllm else []
        end_r = S["comp", r] + n
        run.append(self.ceil_blocks(end_r) - S["ntab", r] <= self.free_count(S))
        g.append(If(waiting, conj(adm), conj(run)))
        start = If(waiting, nh * B, S["comp", r])
        end = If(waiting, end_w, end_r)
        g.append(end <= known + n_ahead if self.async_ else end <= known)
        S = ite_state(waiting, W, S)
        # allocate: the free queue's head, need times
        ntab = S["ntab", r]
        need = self.ceil_blocks(end) - ntab
        rank = {
            b: count([And(S["inq", o], S["qpos", o] < S["qpos", b]) for o in self.blocks if o != b])
            for b in self.blocks
        }
        A = dict(S)
        for b in self.blocks:
            taken = And(S["inq", b], rank[b] < need)
            A["ref", b] = If(taken, 1, S["ref", b])
            A["inq", b] = And(S["inq", b], Not(taken))
            A["hk", b] = And(S["hk", b], Not(taken))  # evict
        for m in self.M:
            chosen: Term = S["tab", r, m]
            for b in self.blocks:
                fresh = And(S["inq", b], rank[b] == m - ntab, ntab <= m, m < ntab + need)
                chosen = If(fresh, b, chosen)
            A["tab", r, m] = chosen
        A["ntab", r] = ntab + need
        S = A
        # pending writes of slot k for table indices start // B ..
        first = self.floor_blocks(start)
        for b in self.blocks:
            for m in self.M:
                w = And(first <= m, S["ntab", r] > m, S["tab", r, m] == b)
                S["pa", b, k] = Or(S["pa", b, k], w)
                S["preq", b, k] = If(w, r, S["preq", b, k])
                S["pl", b, k] = If(w, zmin(end, (m + 1) * B), S["pl", b, k])
                if self.async_:
                    S["pk", b, k] = If(w, zmin(zmin(end, (m + 1) * B), known), S["pk", b, k])
                    for i in range(self.G):
                        S["pc", b, k, i] = If(w, cells[i], S["pc", b, k, i])
        S["comp", r] = end
        S["ea", k, r] = S["elive", k, r] = z3.BoolVal(True)
        S["es", k, r], S["ee", k, r] = start, end
        for m in self.M:
            S["eblk", k, r, m] = S["tab", r, m]
        S["esam", k, r] = end == known + n_ahead if self.async_ else end == known
        S["eo", k, r] = S["eoc", k]
        S["eoc", k] = S["eoc", k] + 1
        S["bud", k] = S["bud", k] + n
        # registration at schedule stops at the known tokens
        upto = self.floor_blocks(zmin(end, known) if self.async_ else end)
        return self.on_schedule(S, r, k, upto)

    def on_schedule(self, S: SState, r: int, k: int, upto: Term) -> SState:
        t = self.traits
        cached = S["cach", r]
        if t.publish not in ("at-schedule", "hidden-until-written"):
            return S
        if t.publish == "at-schedule":
            S = self.register(S, r, upto)
        if t.track == "one-dict":
            S["slo", r] = If(S["son", r], S["slo", r], cached)
            S["shi", r] = If(upto > cached, upto, If(S["son", r], S["shi", r], cached))
            S["son", r] = z3.BoolVal(True)
        elif t.track == "per-step":
            S["rlo", k, r] = If(S["ra", k, r], S["rlo", k, r], cached)
            S["rhi", k, r] = If(upto > cached, upto, If(S["ra", k, r], S["rhi", k, r], cached))
            S["ra", k, r] = z3.BoolVal(True)
        if t.publish == "hidden-until-written":
            S["cach", r] = zmax(cached, upto)
        return S

    def is_waiting_head(self, S: SState, r: int) -> Term:
        """r is the head of ``waiting_order`` (queue order, or (priority, arrival)), which
        skips the requests not admissible yet."""
        parts = []
        for o in self.R:
            if o == r:
                continue
            if self.config.preemption == "priority":
                better = self.rank_lt(S, r, o)
            else:
                better = S["wpos", r] < S["wpos", o]
            waiting = S["st", o] == WAITING
            if self.deliver:
                waiting = And(waiting, self.admissible(S, o))
            parts.append(Implies(waiting, better))
        return conj(parts)

    def admissible(self, S: SState, r: int) -> Term:
        """``actions.admissible`` with stale output delivered: no step in flight holds r."""
        return conj([Not(And(S["nst"] > k, S["ea", k, r])) for k in range(self.D)])

    def _preempt(self, S: SState, g: list[Term], p: Params, r: int, k: int) -> SState:
        c = self.config
        g += [self.building(S, k), S["st", r] == RUNNING]
        if c.discipline == "vllm":
            g.append(Not(S["adm", k]))
            others = [o for o in self.R if o != r]
            if c.preemption == "fcfs":
                g.append(Not(S["ea", k, r]))
                g += [Implies(S["st", o] == RUNNING, S["rpos", o] < S["rpos", r]) for o in others]
            else:
                g += [Implies(S["st", o] == RUNNING, self.rank_lt(S, o, r)) for o in others]
        S = dict(S)
        S["pre", k] = z3.BoolVal(True)
        S = self.leave(S, r, k, c.stale_output)
        S["st", r] = z3.IntVal(WAITING)
        S["wpos", r] = S["wlo"] - 1
        S["wlo"] = S["wlo"] - 1
        return S

    def _submit(self, S: SState, g: list[Term], p: Params, k: int) -> SState:
        g += [self.building(S, k), S["sid", k] == p["sid"]]
        S = dict(S)
        S["ph", k] = z3.IntVal(SUBMITTED)
        return S

    def _execute(self, S: SState, g: list[Term], p: Params, k: int) -> SState:
        g += [S["nst"] > k, S["ph", k] == SUBMITTED, S["sid", k] == p["sid"]]
        g += [S["ph", kk] == EXECUTED for kk in range(k)]
        pre = S
        S = dict(S)
        # writes: every entry's blocks from start // B, from the pending write of (k, r)
        for b in self.blocks:
            mine = []
            for r in self.R:
                first = self.floor_blocks(pre["es", k, r])
                nblk = self.ceil_blocks(pre["ee", k, r])
                listed = disj(
                    [And(first <= m, nblk > m, pre["eblk", k, r, m] == b) for m in self.M]
                )
                mine.append(And(pre["ea", k, r], listed, pre["pa", b, k], pre["preq", b, k] == r))
            w = disj(mine)
            S["wv", b] = Or(pre["wv", b], w)
            S["wreq", b] = If(w, pre["preq", b, k], pre["wreq", b])
            S["wlen", b] = If(w, pre["pl", b, k], pre["wlen", b])
            if self.async_:
                S["wk", b] = If(w, pre["pk", b, k], pre["wk", b])
                for i in range(self.G):
                    S["wc", b, i] = If(w, pre["pc", b, k, i], pre["wc", b, i])
            S["pa", b, k] = And(pre["pa", b, k], Not(w))

        # reads, entry by entry in scheduling order; a bad read garbles what the entry wrote
        reads = self._case.get(("reads", k))
        if reads is not None:
            # proofs only (``cases``): either no entry's read is bad (then the reads change
            # nothing, whatever the order) or one is (then they run as below)
            good = conj([Implies(S["ea", k, r], Not(self._bad_read(S, k, r))) for r in self.R])
            if reads == "good":
                self._case_guards.append(good)
                S["ph", k] = z3.IntVal(EXECUTED)
                return S
            self._case_guards.append(Not(good))

        def read(S: SState, r: int) -> SState:
            first = self.floor_blocks(S["es", k, r])
            nblk = self.ceil_blocks(S["ee", k, r])
            isbad = self._bad_read(S, k, r)
            S = dict(S)
            S["bad"] = Or(S["bad"], And(isbad, S["elive", k, r]))
            for b in self.blocks:
                mine = disj([And(first <= m, nblk > m, S["eblk", k, r, m] == b) for m in self.M])
                S["wv", b] = And(S["wv", b], Not(And(isbad, mine)))
            return S

        S = self.in_order(S, k, lambda r: z3.BoolVal(True), read)
        S["ph", k] = z3.IntVal(EXECUTED)
        return S

    def _bad_read(self, S: SState, k: int, r: int) -> Term:
        """Some block that request r's entry in slot k reads does not hold the entry's prefix
        up to that block's end (in state S, after the step's writes)."""
        nblk = self.ceil_blocks(S["ee", k, r])
        bad = []
        for m in self.M:
            block = S["eblk", k, r, m]
            prefix = self.reader_prefix(S, r, zmin(S["ee", k, r], (m + 1) * self.B))

            def holds_prefix(b: int, p: tuple[Any, ...] = prefix) -> Term:
                return self.holds(S, self.written(S, b), p)

            held = self.at_block(block, holds_prefix)
            bad.append(And(nblk > m, Not(held)))
        return disj(bad)

    def _commit(self, S: SState, g: list[Term], p: Params) -> SState:
        c, t = self.config, self.traits
        g += [S["nst"] >= 1, self.no_building(S), S["ph", 0] == EXECUTED, S["sid", 0] == p["sid"]]
        expected = {r: And(S["ea", 0, r], S["esam", 0, r], S["elive", 0, r]) for r in self.R}
        g += [p["has"][r] == expected[r] for r in self.R]
        S = dict(S)
        if t.clear == "on-confirmed":  # on_confirmed
            S = self.clear_tracking(S, 0)
        if t.publish == "hidden-until-written":  # on_written

            def reveal(S: SState, r: int) -> SState:
                lo, hi = S["rlo", 0, r], S["rhi", 0, r]
                for i in self.M:
                    before = S
                    S = dict(S)
                    cond = And(lo <= i, hi > i)
                    block = before["tab", r, i]
                    news = []
                    for b in self.blocks:
                        go = And(cond, block == b, Not(before["hk", b]))
                        news.append(go)
                        S["hk", b] = Or(before["hk", b], go)
                        S["kreq", b] = If(go, r, before["kreq", b])
                        S["klen", b] = If(go, (i + 1) * self.B, before["klen", b])
                        S["pub", b] = If(go, before["pubc"], before["pub", b])
                    S["pubc"] = If(disj(news), before["pubc"] + 1, before["pubc"])
                return S

            S = self.in_order(S, 0, lambda r: S["ra", 0, r], reveal)
        elif t.publish == "at-written":
            pre = S

            def registers(r: int) -> Term:
                if self.deliver:  # a preempted request's delivered output registers nothing
                    return And(pre["elive", 0, r], pre["st", r] == RUNNING)
                return pre["elive", 0, r]

            S = self.in_order(
                S,
                0,
                registers,
                lambda S, r: self.register(S, r, self.floor_blocks(S["ee", 0, r])),
            )
        if t.clear == "on-written":  # on_written, after the publications
            S = self.clear_tracking(S, 0)
        stop = c.stop_token
        sid0 = S["sid", 0]
        post_output = self.async_ and registers_after_output(t)

        def sample(S: SState, r: int) -> SState:
            S = dict(S)
            tok = p["smp"][r]
            length = S["len", r]
            for j in self.T:
                S["tok", r, j] = If(length == j, tok, S["tok", r, j])
            S["len", r] = length + 1
            if self.async_:
                S = self.resolve(S, r, sid0)
            if post_output:  # on_output: what this step completed, if r still runs
                R = self.register(S, r, self.floor_blocks(S["ee", 0, r]))
                S = ite_state(S["st", r] == RUNNING, R, S)
            done = length + 1 - S["plen", r] >= S["maxt", r]
            if stop is not None:
                done = Or(done, tok == stop)
            F = self.free_table(S, r)
            F["st", r] = z3.IntVal(FINISHED)
            if self.async_ or self.deliver:  # later steps' output for it is stale
                for kk in range(1, self.D):
                    F["elive", kk, r] = z3.BoolVal(False)
                    F["ra", kk, r] = z3.BoolVal(False)
            return ite_state(done, F, S)

        S = self.in_order(S, 0, lambda r: expected[r], sample)
        # the step leaves: shift slots down
        for k in range(self.D):
            src = k + 1
            for key, _ in self.schema:
                if isinstance(key, str):
                    continue
                if key[0] in _SLOT_FIRST and key[1] == k:
                    S[key] = S[(key[0], src) + key[2:]] if src < self.D else _blank(key)
                elif len(key) == 3 and key[0] in _SLOT_LAST and key[2] == k:
                    S[key] = S[(key[0], key[1], src)] if src < self.D else _blank(key)
                elif key[0] == "pc" and key[2] == k:
                    S[key] = S["pc", key[1], src, key[3]] if src < self.D else _blank(key)
        S["nst"] = S["nst"] - 1
        S["commits"] = S["commits"] + 1
        return S

    def resolve(self, S: SState, r: int, sid: Term) -> SState:
        """``pool.resolve``: step ``sid``'s placeholder for r becomes r's token just appended,
        in written contents and pending writes. It is a content's first placeholder (a
        request's placeholders resolve oldest first, and a discarded one is never followed by
        one that resolves), so its known tokens grow by one and its cells shift."""
        S = dict(S)
        contents: list[tuple[SKey, list[SKey], int, int | None]] = [
            (("wk", b), [("wc", b, i) for i in range(self.G)], b, None) for b in self.blocks
        ]
        contents += [
            (("pk", b, k), [("pc", b, k, i) for i in range(self.G)], b, k)
            for b in self.blocks
            for k in range(self.D)
        ]
        for known, cells, b, k in contents:
            req, length = (
                (("wreq", b), ("wlen", b)) if k is None else (("preq", b, k), ("pl", b, k))
            )
            go = conj([S[req] == r, S[length] > S[known], S[cells[0]] == sid])
            S[known] = If(go, S[known] + 1, S[known])
            for i in range(self.G - 1):
                S[cells[i]] = If(go, S[cells[i + 1]], S[cells[i]])
        return S

    def _abort(self, S: SState, g: list[Term], p: Params, r: int) -> SState:
        g += [self.no_building(S), S["st", r] != NONE, S["st", r] != FINISHED]
        S = self.leave(S, r, None)
        S["st", r] = z3.IntVal(FINISHED)
        return S

    def _reset(self, S: SState, g: list[Term], p: Params) -> SState:
        g += [S["nst"] == 0] + [S["ref", b] == 0 for b in self.blocks]
        S = dict(S)
        for b in self.blocks:
            S["hk", b] = z3.BoolVal(False)
        return S

    # -- invariants ---------------------------------------------------------------------------

    def invariants(self, S: SState) -> dict[str, Term]:
        """The invariants of ``invariants.py`` as predicates (True when they hold)."""
        return {name: fn(self, S) for name, fn in Z3_INVARIANTS.items()}


_SLOT_FIRST = frozenset(
    {"sid", "ph", "bud", "eoc", "pre", "adm", "ea", "esam", "elive", "ra", "es", "ee", "eo"}
    | {"rlo", "rhi", "eblk"}
)
"""Per-step-slot variables keyed (name, k, ...)."""
_SLOT_LAST = frozenset({"pa", "preq", "pl", "pk"})
"""Per-block pending-write variables keyed (name, b, k)."""
_BOOLS = frozenset({"pre", "adm", "ea", "esam", "elive", "ra", "pa"})


def _blank(key: SKey) -> Term:
    return z3.BoolVal(False) if key[0] in _BOOLS else z3.IntVal(0)


# ---------------------------------------------------------------------------------------------
# invariants


def reads_hold(m: Model, S: SState, live_only: bool = True) -> list[Term]:
    """Every read of a step not executed yet finds its prefix in the block's content once the
    writes of that step and older ones have run; only live entries' reads if ``live_only``."""
    parts = []
    for k in range(m.D):
        for r in m.R:
            started = S["es", k, r]
            reads = m.ceil_blocks(started)  # indices 0 .. ceil(start / B) - 1 are read
            active = [S["nst"] > k, S["ph", k] != EXECUTED, S["ea", k, r]]
            if live_only:
                active.append(S["elive", k, r])
            for i in m.M:
                prefix = m.reader_prefix(S, r, zmin(started, (i + 1) * m.B))
                held = m.holds_eventually(S, S["eblk", k, r, i], prefix, upto=k)
                parts.append(Implies(And(conj(active), reads > i), held))
    return parts


def z_no_unwritten_read(m: Model, S: SState) -> Term:
    return conj([Not(S["bad"]), *reads_hold(m, S)])


def z_no_unwritten_publish(m: Model, S: SState) -> Term:
    return conj(
        [
            Implies(S["hk", b], m.holds_eventually(S, b, (S["kreq", b], S["klen", b])))
            for b in m.blocks
        ]
    )


def z_refcount_is_ownership(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        for i in m.M:
            for j in m.M:
                if i < j:
                    both = And(S["ntab", r] > j)
                    parts.append(Implies(both, S["tab", r, i] != S["tab", r, j]))
    for b in m.blocks:
        owners = count([And(S["ntab", r] > i, S["tab", r, i] == b) for r in m.R for i in m.M])
        parts.append(S["ref", b] == owners)
    return conj(parts)


def z_shared_implies_same_prefix(m: Model, S: SState) -> Term:
    parts = []
    B = m.B
    for r in m.R:
        for o in m.R:
            if o < r:
                continue
            for i in m.M:
                for j in m.M:
                    if o == r and j <= i:
                        continue
                    shared = conj(
                        [S["ntab", r] > i, S["ntab", o] > j, S["tab", r, i] == S["tab", o, j]]
                    )
                    if i != j:
                        parts.append(Not(shared))
                        continue
                    full = And(S["comp", r] >= (i + 1) * B, S["comp", o] >= (j + 1) * B)
                    # keys: tokens 0 .. (i+1)B - 1 of both, and both requests hold that many
                    keys = conj(
                        [S["len", r] >= (i + 1) * B, S["len", o] >= (i + 1) * B]
                        + [m.same_prefix(S, r, o, (i + 1) * B)]
                    )
                    parts.append(Implies(shared, And(full, keys)))
    return conj(parts)


def z_free_queue_exact(m: Model, S: SState) -> Term:
    parts = [S["inq", b] == (S["ref", b] == 0) for b in m.blocks]
    for b in m.blocks:
        for o in m.blocks:
            if o > b:
                parts.append(Implies(And(S["inq", b], S["inq", o]), S["qpos", b] != S["qpos", o]))
    return conj(parts)


def z_hash_index_consistent(m: Model, S: SState) -> Term:
    """The index is represented by the blocks' own keys, so it agrees with them by construction;
    what remains checkable is that the registration order is a strict order (distinct
    publication times) and that every key names a whole number of blocks."""
    parts = []
    for b in m.blocks:
        parts.append(Implies(S["hk", b], And(S["klen", b] >= m.B, S["klen", b] <= len(m.T))))
        for o in m.blocks:
            if o > b:
                parts.append(Implies(And(S["hk", b], S["hk", o]), S["pub", b] != S["pub", o]))
    return conj(parts)


def z_null_block_pinned(m: Model, S: SState) -> Term:
    return conj([Implies(S["ntab", r] > i, S["tab", r, i] != NULL_BLOCK) for r in m.R for i in m.M])


def z_table_matches_computed(m: Model, S: SState) -> Term:
    parts = []
    for r in m.R:
        running = S["st", r] == RUNNING
        parts.append(
            If(
                running,
                S["ntab", r] == m.ceil_blocks(S["comp", r]),
                And(S["ntab", r] == 0, S["comp", r] == 0),
            )
        )
    return conj(parts)


def z_steps_in_order(m: Model, S: SState) -> Term:
    parts = [S["nst"] <= m.D]
    for k in range(m.D):
        for kk in range(k + 1, m.D):
            parts.append(Implies(S["nst"] > kk, S["ph", k] != BUILDING))
            later_done = And(S["nst"] > kk, S["ph", kk] == EXECUTED)
            parts.append(Implies(later_done, S["ph", k] == EXECUTED))
    return conj(parts)


def z_no_leak_at_quiescence(m: Model, S: SState) -> Term:
    idle = conj([S["nst"] == 0] + [Or(S["st", r] == NONE, S["st", r] == FINISHED) for r in m.R])
    return Implies(idle, conj([S["inq", b] for b in m.blocks]))


Z3_INVARIANTS: dict[str, Callable[[Model, SState], Term]] = {
    "NoUnwrittenRead": z_no_unwritten_read,
    "NoUnwrittenPublish": z_no_unwritten_publish,
    "RefcountIsOwnership": z_refcount_is_ownership,
    "SharedImpliesSamePrefix": z_shared_implies_same_prefix,
    "FreeQueueExact": z_free_queue_exact,
    "HashIndexConsistent": z_hash_index_consistent,
    "NullBlockPinned": z_null_block_pinned,
    "TableMatchesComputed": z_table_matches_computed,
    "StepsInOrder": z_steps_in_order,
    "NoLeakAtQuiescence": z_no_leak_at_quiescence,
}


# ---------------------------------------------------------------------------------------------
# the bridge between the two forms: concrete states and decisions of the executable spec


def _owner(s: State, prefix: tuple[object, ...], where: str) -> int:
    """A request whose tokens start with ``prefix`` (the reference a key or content uses)."""
    for rid in sorted(s.requests):
        if tuple(s.requests[rid].tokens[: len(prefix)]) == prefix:
            return rid
    raise OutsideFragment(f"{where}: prefix {prefix} is no request's")


def _content(
    model: Model, s: State, content: tuple[object, ...], writer: int | None, where: str
) -> tuple[int, int, list[int]]:
    """(request, known, cells) of a content: its request's known tokens, then placeholders of
    that request, one cell (the sampling step's id) each. ``writer``: the request it must be."""
    known = next((j for j, x in enumerate(content) if isinstance(x, Placeholder)), len(content))
    tail = content[known:]
    if not tail:
        req = writer if writer is not None else _owner(s, content, where)
        if tuple(s.requests[req].tokens[:known]) != content:
            raise OutsideFragment(f"{where} is not r{req}'s prefix")
        return req, known, []
    owners = {x.req for x in tail if isinstance(x, Placeholder)}
    if not model.async_ or len(tail) > model.G or len(owners) != 1:
        raise OutsideFragment(f"{where}: placeholders {tail} are outside the model")
    if not all(isinstance(x, Placeholder) for x in tail):
        raise OutsideFragment(f"{where}: a resolved token after a placeholder: {content}")
    (req,) = owners
    known_part = tuple(s.requests[req].tokens[:known])
    if (writer is not None and writer != req) or known_part != content[:known]:
        raise OutsideFragment(f"{where} is not r{req}'s tokens then its placeholders")
    return req, known, [x.step for x in tail if isinstance(x, Placeholder)]


def _range(indices: list[int], where: str) -> tuple[int, int]:
    if not indices:
        return 0, 0
    if indices != list(range(indices[0], indices[-1] + 1)):
        raise OutsideFragment(f"{where}: registrations {indices} are not one range")
    return indices[0], indices[-1] + 1


def encode(model: Model, s: State) -> dict[SKey, int | bool]:
    """The concrete values of the symbolic state that represents spec state ``s`` (orders as
    positions 0, 1, ...). Raises ``OutsideFragment`` for a state the model cannot represent."""
    c, B = model.config, model.B
    if s.config != c:
        raise OutsideFragment(f"config {s.config} is not the model's {c}")
    v = model.initial_values()
    v["nst"], v["next"], v["commits"], v["lost"] = len(s.steps), s.next_step, s.commits, s.lost_hits
    v["bad"] = bool(s.bad_reads)
    for b in model.blocks:
        v["inq", b] = b in s.free
        v["qpos", b] = s.free.index(b) if b in s.free else 0
    v["qlo"], v["qhi"] = 0, len(s.free) - 1
    v["wlo"], v["whi"], v["rhi"] = 0, len(s.waiting) - 1, len(s.running) - 1
    for rid, req in s.requests.items():
        if rid not in model.R or req.arrival != rid or len(req.tokens) > len(model.T):
            raise OutsideFragment(f"request r{rid} (arrival {req.arrival}) is outside the fragment")
        if req.loading is not None or req.loaded_last or len(req.table) > len(model.M):
            raise OutsideFragment(f"r{rid} loads, or holds too many blocks")
        v["st", rid] = STATUS[req.status]
        v["len", rid], v["plen", rid] = len(req.tokens), req.prompt_len
        v["maxt", rid], v["prio", rid] = req.max_tokens, req.priority
        for j, t in enumerate(req.tokens):
            v["tok", rid, j] = t
        v["ntab", rid] = len(req.table)
        for m, block_id in enumerate(req.table):
            v["tab", rid, m] = block_id
        v["comp", rid], v["cach", rid] = req.computed, req.cached
        if rid in s.waiting:
            v["wpos", rid] = s.waiting.index(rid)
        if rid in s.running:
            v["rpos", rid] = s.running.index(rid)
        if rid in s.single:
            v["son", rid] = True
            v["slo", rid], v["shi", rid] = _range(s.single[rid], f"single[r{rid}]")
    pub = 0
    for owners in s.index.values():
        for owner in owners:
            v["pub", owner] = pub
            pub += 1
    v["pubc"] = pub
    slot = {st.id: k for k, st in enumerate(s.steps)}
    for b in model.blocks:
        blk = s.blocks[b]
        v["ref", b] = blk.refcount
        if blk.key is not None:
            v["hk", b], v["klen", b] = True, len(blk.key)
            v["kreq", b] = _owner(s, blk.key, f"key of block {b}")
        if blk.written is not None:
            where = f"content of block {b}"
            owner, known, cells = _content(model, s, blk.written, None, where)
            v["wv", b], v["wlen", b], v["wreq", b] = True, len(blk.written), owner
            if model.async_:
                v["wk", b] = known
                for i, cell in enumerate(cells):
                    v["wc", b, i] = cell
        for w in blk.pending:
            k = slot.get(w.step)
            if k is None or v["pa", b, k] or w.load:
                raise OutsideFragment(f"block {b}: pending writes {blk.pending}")
            owner, known, cells = _content(model, s, w.prefix, w.req, f"block {b}: a pending write")
            v["pa", b, k], v["preq", b, k], v["pl", b, k] = True, owner, len(w.prefix)
            if model.async_:
                v["pk", b, k] = known
                for i, cell in enumerate(cells):
                    v["pc", b, k, i] = cell
    for k, st in enumerate(s.steps):
        if st.failed:
            raise OutsideFragment("failed loads are outside the fragment")
        v["sid", k], v["ph", k], v["bud", k] = st.id, PHASE[st.phase], st.budget_used
        v["pre", k], v["adm", k], v["eoc", k] = st.preempted, st.admitted, len(st.entries)
        for pos, (rid, e) in enumerate(st.entries.items()):
            if e.load or len(e.blocks) != -(-e.end // B):
                raise OutsideFragment(f"step {st.id}: entry of r{rid} is outside the fragment")
            v["ea", k, rid], v["es", k, rid], v["ee", k, rid] = True, e.start, e.end
            v["eo", k, rid], v["esam", k, rid] = pos, e.samples
            v["elive", k, rid] = rid in st.live
            for m, block_id in enumerate(e.blocks):
                v["eblk", k, rid, m] = block_id
        if not st.live <= set(st.entries):
            raise OutsideFragment(f"step {st.id}: live requests without an entry")
        for rid, indices in st.registrations.items():
            v["ra", k, rid] = True
            v["rlo", k, rid], v["rhi", k, rid] = _range(indices, f"step {st.id} bucket r{rid}")
    return v


def same(model: Model, S: SState, s: State) -> list[tuple[str, Term]]:
    """Named conditions, all true exactly when symbolic state S represents spec state ``s``:
    values compared exactly, queue and registration orders compared relationally, keys and
    contents compared by the tokens they name."""
    v = encode(model, s)
    out: list[tuple[str, Term]] = []

    def eq(key: SKey) -> None:
        out.append((key_name(key), S[key] == v[key]))

    def names(req: Term, prefix: tuple[object, ...], what: str) -> None:
        for j, t in enumerate(prefix):
            out.append((f"{what}[{j}]", model.tok(S, req, j) == t))

    def content(
        req: SKey, known: SKey, cells: tuple[Any, ...], spec: tuple[object, ...], what: str
    ) -> None:
        """Known tokens by the tokens they name, then the placeholders' request and steps."""
        eq(known)
        names(S[req], spec[: int(v[known])], what)
        for i in range(len(spec) - int(v[known])):
            eq(req)
            eq((*cells, i))

    def ordered(keys: list[SKey], what: str) -> None:
        for a, b in zip(keys, keys[1:], strict=False):
            out.append((f"{what}: {a} before {b}", S[a] < S[b]))

    for key in ("nst", "next", "commits", "lost", "bad"):
        eq(key)
    for r in model.R:
        for name in ("st", "len", "plen", "maxt", "prio", "ntab", "comp", "cach", "son"):
            eq((name, r))
        for j in model.T:
            eq(("tok", r, j))
        for m in range(int(v["ntab", r])):
            eq(("tab", r, m))
        if v["son", r]:
            out.append((f"single[r{r}]", _same_range(S, v, ("slo", r), ("shi", r))))
    ordered([("wpos", r) for r in s.waiting], "waiting order")
    ordered([("rpos", r) for r in s.running], "running order")
    ordered([("qpos", b) for b in s.free], "free queue order")
    for owners in s.index.values():
        ordered([("pub", b) for b in owners], "index order")
    for b in model.blocks:
        blk = s.blocks[b]
        for name in ("ref", "inq", "hk", "wv"):
            eq((name, b))
        if blk.key is not None:
            eq(("klen", b))
            names(S["kreq", b], blk.key, f"key of block {b}")
        if blk.written is not None:
            eq(("wlen", b))
            if model.async_:
                content(("wreq", b), ("wk", b), ("wc", b), blk.written, f"content of block {b}")
            else:
                names(S["wreq", b], blk.written, f"content of block {b}")
        for k in range(len(s.steps)):
            eq(("pa", b, k))
            if v["pa", b, k]:
                eq(("preq", b, k))
                eq(("pl", b, k))
                if model.async_:
                    w = next(w for w in blk.pending if w.step == s.steps[k].id)
                    content(("preq", b, k), ("pk", b, k), ("pc", b, k), w.prefix, "pending")
    for k, st in enumerate(s.steps):
        for name in ("sid", "ph", "bud", "pre", "adm"):
            eq((name, k))
        for r in model.R:
            eq(("ea", k, r))
            eq(("ra", k, r))
            if v["ea", k, r]:
                for name in ("es", "ee", "esam", "elive"):
                    eq((name, k, r))
                for m in range(-(-int(v["ee", k, r]) // model.B)):
                    eq(("eblk", k, r, m))
            if v["ra", k, r]:
                out.append((f"bucket {k} r{r}", _same_range(S, v, ("rlo", k, r), ("rhi", k, r))))
        ordered([("eo", k, r) for r in st.entries], f"step {st.id} scheduling order")
    return out


def _same_range(S: SState, v: dict[SKey, int | bool], lo: SKey, hi: SKey) -> Term:
    """Index ranges [lo, hi) are the same set."""
    if v[hi] <= v[lo]:
        return S[hi] <= S[lo]
    return And(S[lo] == v[lo], S[hi] == v[hi])


def instances_for(model: Model, decision: tuple[Any, ...]) -> tuple[list[Instance], Params]:
    """The instances that may take a decision event (one per step slot where the slot is not
    named by the event) and its parameters as Z3 constants. Raises ``OutsideFragment``."""
    kind, args = decision[0], decision[1:]
    D = range(model.D)
    iv = z3.IntVal
    if kind == "arrive":
        rid, prompt, max_tokens, priority = args
        if rid not in model.R or len(prompt) > len(model.T):
            raise OutsideFragment(f"{decision}: outside the fragment")
        ptok = [iv(prompt[j] if j < len(prompt) else 0) for j in model.T]
        params = {"ptok": ptok, "plen": iv(len(prompt)), "maxt": iv(max_tokens)}
        return [("arrive", rid)], {**params, "prio": iv(priority)}
    if kind in ("begin", "submit"):
        return [(kind, k) for k in D], {"sid": iv(args[0])}
    if kind == "execute":
        if args[1]:
            raise OutsideFragment("failed loads are outside the fragment")
        return [("execute", k) for k in D], {"sid": iv(args[0])}
    if kind == "schedule":
        rid, tokens, loaded, *bound = args
        if loaded:
            raise refuse_loads()
        if bound:  # spec.events.WHEN_SET
            raise refuse_loads("bounded_hits")
        if rid not in model.R:
            return [], {}
        return [("schedule", rid, k) for k in D], {"n": iv(tokens)}
    if kind == "preempt":
        return ([("preempt", args[0], k) for k in D] if args[0] in model.R else []), {}
    if kind == "commit":
        sid, sampled = args
        tokens = dict(sampled)
        if len(tokens) != len(sampled) or not set(tokens) <= set(model.R):
            return [], {}
        has = [z3.BoolVal(r in tokens) for r in model.R]
        return [("commit",)], {
            "sid": iv(sid),
            "has": has,
            "smp": [iv(tokens.get(r, 0)) for r in model.R],
        }
    if kind == "abort":
        return ([("abort", args[0])] if args[0] in model.R else []), {}
    if kind == "reset":
        if args:  # a reset preempting running requests
            declared = twins.refused(FORM, "reset_running")
            raise ResetNotFollowed(declared.form, declared.what, str(declared))
        return [("reset",)], {}
    raise OutsideFragment(f"unknown decision {decision!r}")


def in_fragment(model: Model, s: State, decision: tuple[Any, ...]) -> bool:
    """Whether the fragment's restrictions allow the decision: arrivals in id order within T."""
    if decision[0] == "arrive":
        rid, prompt, max_tokens = decision[1], decision[2], decision[3]
        if rid in s.requests:
            return True  # the spec refuses a taken id, and so does the model
        fits = len(prompt) + max_tokens <= len(model.T)
        return bool(rid == len(s.requests) and rid in model.R and fits)
    if decision[0] == "schedule":
        return bool(decision[3] == 0)
    if decision[0] == "execute":
        return not bool(decision[2])
    return True
