"""The fast model: the spec's state machine again, written for speed, to *find* violations.

``spec/`` is THE definition and stays written to be read (a block's hash is its token tuple,
actions rebuild prefixes block by block). ``FastModel`` is a judge's model (``core.Model``) that
decides the same things by the same rules several times faster. It is an optimization whose
equality with the spec is tested, not argued (``tests/test_fastmodel.py``; declared in
``kvspec/twins.py``): on fuzzed traces of every policy (the unsafe ones included) a judge over it
must give the spec judge's verdict (none, or the same invariant at the same event), and after every
decision ``export`` must give the spec's state, field by field.

What it does differently (how, not what):

* token prefixes are *interned*: a full block's chained prefix is an int id (its parent's id and
  its own tokens, like an engine's chained hash but exact: equal ids are equal prefixes); a
  partial prefix is ``(parent id, the block's tokens)``. A hash or a content compares in O(1) or
  O(B) instead of O(prefix). Ids nothing refers to any more are collected (their ancestors are
  kept), so memory stays flat;
* the free queue is an ``OrderedDict`` (O(1) removal anywhere); records have slots;
* invariants: ``NoUnwrittenRead`` and ``NoUnwrittenPublish`` are evaluated after every decision,
  incrementally as in ``incremental.py`` (the new entry's reads, the readers and the hash of every
  block whose content or hash changed; a request's full blocks once read valid are not read again
  until their content changes). The bookkeeping invariants (refcounts, free queue, index, tables,
  steps, leaks, append-only tables) are not evaluated: the model's state is the state the spec's
  actions reach on the trace's decisions (an engine's effects are only compared, by the judge),
  and on those states they hold (proved inductive at small sizes, ``docs/proofs.md``; fuzzed in
  ``tests/test_incremental.py``). The differential tests check that claim with the rest;
* every guard of ``spec/actions.py`` raises ``kvspec.spec.Illegal`` without a message.

A finding is only ``(invariant, event index)``: the message, explanation, minimal history and
picture are the spec judge's, which the trace is handed over to from a checkpoint (``export``,
``handover.py``) when this model finds something. Compiled with the judge's core by mypyc
(``fastbuild.py``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import Final, cast

from kvspec.spec import Config, Illegal, Placeholder, Violation
from kvspec.spec.observed import refuse_strict
from kvspec.spec.policies import registers_after_output, traits
from kvspec.spec.state import Block, Content, Entry, Request, State, Step, Write
from kvspec.twins import follows, refuse, refused

TWIN_OF = "kvspec.spec"
"""This module restates the spec in another form (kvspec/twins.py says what it must equal)."""

Event = tuple[object, ...]
FastContent = "int | tuple[int, tuple[int, ...]] | None"
"""A prefix or a block's content: a full block's interned chain id, or (parent id, tokens) for
a partial block, or, under async scheduling, (parent id, tail) with the tail from the first block
that holds a placeholder; None for garbage. A placeholder is a negative int (``placeholder``):
token ids are >= 0, so tails stay tuples of ints and compare in C."""

# Final: compiled, a constant is inlined or read from a C static, not looked up by name
WAITING: Final = 0
RUNNING: Final = 1
FINISHED: Final = 2
STATUS: Final = ("waiting", "running", "finished")
BUILDING: Final = 0
SUBMITTED: Final = 1
EXECUTED: Final = 2
PHASE: Final = ("building", "submitted", "executed")
READ: Final = "NoUnwrittenRead"
PUBLISH: Final = "NoUnwrittenPublish"
FAST_INVARIANTS: Final = frozenset((READ, PUBLISH))
"""The invariants this model evaluates; the others hold on every state its actions reach."""
ROOT: Final = 0
"""The id of the empty prefix."""
ARITY: Final = {
    "arrive": (4, 4),
    "begin": (1, 1),
    "schedule": (2, 4),
    "preempt": (1, 1),
    "submit": (1, 1),
    "execute": (1, 2),
    "commit": (2, 2),
    "abort": (1, 1),
    "reset": (0, 1),
}
"""Each decision's count of values after its kind: the least and the most its action takes."""


def placeholder(step: int, rid: int) -> int:
    """``spec.Placeholder(step, rid)`` as a negative int: -1 minus the Cantor pairing of the two
    (one-to-one, no bound on either, and never a token id, which is >= 0)."""
    w = step + rid
    return -1 - (w * (w + 1) // 2 + rid)


def spec_placeholder(code: int) -> Placeholder:
    """The inverse of ``placeholder``."""
    k = -1 - code
    w = (math.isqrt(8 * k + 1) - 1) // 2
    rid = k - w * (w + 1) // 2
    return Placeholder(w - rid, rid)


def _negative(tokens: tuple[object, ...]) -> bool:
    """``min(tokens) < 0`` for a non-empty tuple: ints compared natively (compiled), and for
    anything else ``min`` itself, which compares (or refuses) them as before."""
    negative = False
    for t in tokens:
        if not isinstance(t, int):
            return min(tokens) < 0  # type: ignore[type-var,operator]
        if t < 0:
            negative = True
    return negative


FORM: Final = "kvspec.judge.fastmodel"
"""This module's row in kvspec/twins.py: the features and policy traits it follows."""


def restates(config: Config) -> bool:
    """Whether this model restates ``config`` (its row in kvspec/twins.py follows every feature
    and trait ``config`` has). ``kvspec check`` and ``Monitor.fast`` judge any other
    configuration by the spec throughout."""
    return follows(FORM, config)


def refuse_drafts(config: Config) -> None:
    """Raise ``twins.NotFollowed`` (a ``ValueError``) for a configuration this model does not
    restate (``restates``), naming what its row refuses."""
    refuse(FORM, config)


class Req:
    __slots__ = (
        "id",
        "tokens",
        "plen",
        "max_tokens",
        "priority",
        "arrival",
        "status",
        "table",
        "computed",
        "cached",
        "loading",
        "loaded_last",
        "chain",
        "verified",
        "ahead",
        "partial_len",
        "partial",
    )

    def __init__(self, rid: int, prompt: tuple[int, ...], max_tokens: int, priority: int) -> None:
        self.id = rid
        self.tokens = list(prompt)
        self.plen = len(prompt)
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival = 0
        self.status = WAITING
        self.table: list[int] = []
        self.computed = 0
        self.cached = 0
        self.loading: int | None = None
        self.loaded_last = False
        """``spec.Request.loaded_last``: kept only for ``export``."""
        self.chain: list[int] = []
        """Interned ids of the full blocks' prefixes known so far (tokens only grow)."""
        self.verified = 0
        """Table positions below this were read valid as full blocks with no pending write, and
        their content has not changed since (reset when the table is freed)."""
        self.ahead: list[int] = []
        """Async scheduling: the placeholders of the steps in flight that sample for the request
        and whose sample will be used, oldest first (``spec.State.ahead`` past the known tokens),
        kept as entries are scheduled, withdrawn, committed and discarded."""
        self.partial_len = 0
        self.partial: object = None
        """The last partial prefix ``_prefix`` made within the known tokens, and its length: a
        decoding request's last block is read and written at several decisions of a step (its
        tokens 0 .. length - 1 never change, so neither does the content)."""


class Ent:
    __slots__ = ("req", "start", "end", "blocks", "nb", "load", "samples", "ph", "loaded", "live")

    def __init__(
        self,
        req: Req,
        start: int,
        end: int,
        blocks: list[int],
        load: bool,
        samples: bool,
        ph: int,
        loaded: int = 0,
    ):
        self.req = req
        """The request (``requests[rid]`` while the entry exists: an id never arrives twice, and
        a request is pruned only once no step references it), without a lookup."""
        self.start, self.end, self.load, self.samples = start, end, load, samples
        self.blocks = blocks
        self.nb = len(blocks)
        """The entry's blocks (``spec.Entry.blocks``) are ``blocks[:nb]``: ``blocks`` is the
        request's table itself, not a copy. A table only grows (``append``) until it is freed,
        and a freed table is replaced by a new list (``_free_table``), so its first ``nb`` items
        stay what they were when the entry was scheduled."""
        self.live = True
        """``spec.Step.live`` holds the request: its output is used (a flag here, not a set of
        the step's: the entries are the step's dict already)."""
        self.ph = ph
        """The placeholder of the token this entry samples (``placeholder``); 0 if none."""
        self.loaded = loaded
        """``spec.Entry.loaded``: full blocks an external load writes from ``start`` on."""


class Stp:
    __slots__ = (
        "id",
        "phase",
        "entries",
        "registrations",
        "failed",
        "budget_used",
        "preempted",
        "victims",
        "admitted",
    )

    def __init__(self, step_id: int) -> None:
        self.id = step_id
        self.phase = BUILDING
        self.entries: dict[int, Ent] = {}
        self.registrations: dict[int, list[int]] = {}
        self.failed: tuple[int, ...] = ()
        self.budget_used = 0
        self.preempted = False
        self.victims: list[int] = []  # spec.state.Step.victims (read only by a reset it refuses)
        self.admitted = False


class Wr:
    """A pending write (``spec.state.Write``): a native record, not a tuple, so that its step and
    request compare as machine ints (compiled) and a resolved placeholder is written in place."""

    __slots__ = ("step", "rid", "content", "load")

    def __init__(self, step: int, rid: int, content: object, load: bool) -> None:
        self.step = step
        self.rid = rid
        self.content = content
        self.load = load


class FastModel:
    """The spec's state machine for speed, as a judge's model (``core.Model``): ``apply`` takes a
    decision (raising ``kvspec.spec.Illegal``, without a message, when a guard fails) and returns
    its effects; ``check`` evaluates NoUnwrittenRead and NoUnwrittenPublish on what that decision
    changed (a ``Violation`` with the invariant's name only: the spec-based judge writes the
    report, ``handover.py``). Strict judging only."""

    def __init__(self, config: Config) -> None:
        refuse_strict(config)
        refuse_drafts(config)
        self.config = config
        self.async_scheduling = config.async_scheduling
        self.deliver = config.stale_output == "deliver"
        self.caching = config.prefix_caching
        self.delay_loads = config.delay_load_registration
        # the registration policy as flags, from its traits (``spec.policies``); nothing is
        # registered, tracked or rolled back without prefix caching
        t, caching = traits(config), config.prefix_caching
        self.at_schedule = caching and t.publish == "at-schedule"
        self.hidden = caching and t.publish == "hidden-until-written"
        self.at_written = caching and t.publish == "at-written"
        self.post_output = caching and registers_after_output(t)
        self.track_single = t.track == "one-dict"
        self.track_step = t.track == "per-step"
        self.leave_unpublish = t.leave == "unpublish"
        self.leave_drop = t.leave == "drop-hidden"
        self.clear_begin = t.clear == "on-begin"
        self.clear_confirmed = t.clear == "on-confirmed"
        self.clear_written = t.clear == "on-written"
        n = config.num_blocks
        self.bsz = config.block_size
        # the configuration's fields the actions read, as native attributes (a Config is a
        # Python object: each of its attributes is a dictionary lookup)
        self.num_blocks = n
        self.depth = config.depth
        self.token_budget = config.token_budget
        self.max_running = config.max_running
        self.vllm = config.discipline == "vllm"
        self.preemption = config.preemption
        self.stop_token = config.stop_token
        self.refcount = [0] * n
        self.key: list[int | None] = [None] * n
        self.written: list[object] = [None] * n
        self.pending: list[list[Wr]] = [[] for _ in range(n)]
        self.holders: list[dict[Req, int]] = [{} for _ in range(n)]
        """Per block, the requests whose table holds it and where (keyed by the record itself,
        hashed by identity: no lookup in ``requests`` to reach a holder, no id boxed)."""
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, n))
        self.index: dict[int, list[int]] = {}
        self.requests: dict[int, Req] = {}
        self.waiting: OrderedDict[int, None] = OrderedDict()
        """The waiting requests in order (an ordered set: O(1) removal anywhere, however many)."""
        self.running: list[int] = []
        self.steps: list[Stp] = []
        self.next_step = 0
        self.single: dict[int, list[int]] = {}
        self.bad_reads: list[tuple[int, int, int]] = []
        self.commits = 0
        self.lost_hits = 0
        """``State.lost_hits``: a statistic of the rollback policies, not part of any verdict."""
        self.arrivals = 0
        self.finished: set[int] = set()
        self.prunable = False
        """A commit, abort or preemption since the last ``prune``."""
        # interned prefixes
        self.intern: dict[tuple[int, tuple[int, ...]], int] = {}
        self.node: dict[int, tuple[int, tuple[int, ...], int]] = {ROOT: (ROOT, (), 0)}
        self.next_id = 1
        self.collect_floor = 4096
        self.collect_at = self.collect_floor
        """Collect interned prefixes when there are more than this many (4 times the live ones)."""
        self.expected: list[Event] = []
        """The effects of the decision being applied, in order."""
        self.held: Collection[Hashable] = ()
        """Prefix ids the judge holds (its hash-chain tables): never collected."""
        # what the current decision changed
        self.changed: list[int] = []
        """Blocks whose content (written or pending) changed, by a write of the building step (or
        a failed load stopped being excused). A list, repeats allowed (a repeat is checked again,
        to the same result): an append and a native loop, where a set hashed and boxed."""
        self.rewritten: list[int] = []
        """Blocks whose content an execution changed other than by writing what was pending (a
        failed load; K/V computed from wrong inputs): every later step's reads may change."""
        self.published: list[int] = []
        self.new_step: Stp | None = None
        self.new_rid = -1
        """The entry the decision scheduled (``new_step.entries[new_rid]``), if any."""

    # -- the model's side of the judge (core.Model) ---------------------------------------------

    def apply(self, decision: Event) -> list[Event]:
        kind = decision[0]
        if not isinstance(kind, str):
            raise Illegal()
        arity = ARITY.get(kind)
        if arity is None:
            raise Illegal()
        low, high = arity
        if not low <= len(decision) - 1 <= high:  # as a call with the decision's values would
            raise TypeError(f"{kind} takes {low} to {high} values, got {len(decision) - 1}")
        self.expected = []
        if self.changed:  # cleared, not made anew: nothing outside a decision holds them
            self.changed.clear()
        if self.rewritten:
            self.rewritten.clear()
        if self.published:
            self.published.clear()
        self.new_step = None
        self._act(kind, decision)
        if kind == "arrive":
            self.requests[cast(int, decision[1])].arrival = self.arrivals
            self.arrivals += 1
        elif kind == "commit" or kind == "abort" or kind == "preempt":
            self.prunable = True  # the requests they finish are in ``finished`` already
        return self.expected

    def _act(self, kind: str, d: Event) -> None:
        """The action of ``kind`` on the decision's values (their count checked), each called
        directly: a value of the wrong type raises ``TypeError`` as the call would."""
        if kind == "schedule":
            if len(d) == 3:
                self.schedule(cast(int, d[1]), cast(int, d[2]))
            elif len(d) == 4:
                self.schedule(cast(int, d[1]), cast(int, d[2]), cast(int, d[3]))
            else:  # an admission's bounded hit (spec.events.WHEN_SET)
                bound = cast(int, d[4])
                if bound < 0:  # -1 is ``schedule``'s "no bound": never a decision's value
                    raise Illegal()
                self.schedule(cast(int, d[1]), cast(int, d[2]), cast(int, d[3]), bound)
        elif kind == "begin":
            self.begin(cast(int, d[1]))
        elif kind == "submit":
            self.submit(cast(int, d[1]))
        elif kind == "execute":
            if len(d) == 2:
                self.execute(cast(int, d[1]))
            else:
                self.execute(cast(int, d[1]), cast("tuple[int, ...]", d[2]))
        elif kind == "commit":
            self.commit(cast(int, d[1]), cast("tuple[tuple[int, int], ...]", d[2]))
        elif kind == "arrive":
            self.arrive(
                cast(int, d[1]), cast("tuple[int, ...]", d[2]), cast(int, d[3]), cast(int, d[4])
            )
        elif kind == "preempt":
            self.preempt(cast(int, d[1]))
        elif kind == "abort":
            self.abort(cast(int, d[1]))
        elif len(d) > 1:  # a reset preempting running requests: the spec judges it
            raise refused(FORM, "reset_running")
        else:
            self.reset()

    def check(self, names: Collection[str] | None) -> Violation | None:
        if (names is None or READ in names) and (self.bad_reads or not self._reads_hold()):
            return Violation(READ, "")
        if (names is None or PUBLISH in names) and (self.changed or self.published):
            if not self._publications_hold():
                return Violation(PUBLISH, "")
        return None

    def steer(self, decision: Event, effects: list[Event]) -> None:
        raise ValueError("the fast model judges strict streams only")

    def engine_effect(self, effect: Event) -> None:
        raise ValueError("the fast model judges strict streams only")

    def hold(self, keys: Collection[Hashable]) -> None:
        self.held = keys

    def has_request(self, rid: object) -> bool:
        return rid in self.requests

    def prune(self) -> list[int]:
        """Drop finished requests no in-flight step references any more (as ``SpecModel``).
        Only a commit, an abort or a preemption finishes a request or drops a step's reference
        to one, so between them there is nothing new to drop."""
        if not self.finished or not self.prunable:
            return []
        self.prunable = False
        gone: list[int] = []
        for rid in list(self.finished):
            if any(rid in st.entries or rid in st.registrations for st in self.steps):
                continue
            self.finished.discard(rid)
            self.requests.pop(rid, None)
            gone.append(rid)
        return gone

    def chain_key(self, rid: int, index: int) -> Hashable:
        return self._chain(self.requests[rid], index)

    def prefix_length(self, key: Hashable) -> int:
        return self.node[cast(int, key)][2] * self.bsz

    def spec_key(self, key: Hashable) -> tuple[int, ...]:
        return cast("tuple[int, ...]", self._tokens(key))  # a key never holds a placeholder

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(self.refcount), tuple(self.free)

    # -- prefixes -----------------------------------------------------------------------------

    def _chain(self, req: Req, i: int) -> int:
        """The id of the request's tokens 0 .. (i + 1) * B - 1 (block ``i`` must be full)."""
        chain = req.chain
        if i < len(chain):
            return chain[i]
        bsz, tokens, intern = self.bsz, req.tokens, self.intern
        while len(chain) <= i:
            j = len(chain)
            parent = chain[j - 1] if j else ROOT
            k = (parent, tuple(tokens[j * bsz : (j + 1) * bsz]))
            cid = intern.get(k)
            if cid is None:
                cid = self.next_id
                self.next_id += 1
                intern[k] = cid
                self.node[cid] = (parent, k[1], self.node[parent][2] + 1)
            chain.append(cid)
        return chain[i]

    def _prefix(self, req: Req, length: int) -> object:
        """The request's tokens 0 .. length - 1 (length >= 1) as a content; past its known
        tokens, its placeholders (``spec.State.ahead``), as ``(parent id, tail)`` with the tail
        from the first block that holds one (unique, so contents compare by equality)."""
        bsz, known = self.bsz, len(req.tokens)
        if length > known:
            q = known // bsz
            base = q * bsz
            tail = tuple(req.tokens[base:] + req.ahead[: length - known])
            return (self._chain(req, q - 1) if q else ROOT, tail)
        i = (length - 1) // bsz
        if length == (i + 1) * bsz:
            return self._chain(req, i)
        if length == req.partial_len:
            return req.partial
        content = (self._chain(req, i - 1) if i else ROOT, tuple(req.tokens[i * bsz : length]))
        req.partial_len, req.partial = length, content
        return content

    def _canonical(self, parent: int, tail: tuple[int, ...]) -> object:
        """A content ``(parent, tail)`` after a placeholder in its tail was resolved: its leading
        full blocks without placeholders interned into the parent chain."""
        bsz = self.bsz
        while len(tail) >= bsz and min(tail[:bsz]) >= 0:
            block = tail[:bsz]
            k = (parent, block)
            cid = self.intern.get(k)
            if cid is None:
                cid = self.next_id
                self.next_id += 1
                self.intern[k] = cid
                self.node[cid] = (parent, block, self.node[parent][2] + 1)
            parent, tail = cid, tail[bsz:]
        return (parent, tail) if tail else parent

    def _resolve(self, rid: int, ph: int, token: int) -> None:
        """A step committed the sample ``token`` of request ``rid``: its placeholder ``ph``
        becomes the token in every content that holds it (a sample discarded stays garbage:
        nothing calls this for it).

        Where it is: a placeholder of a request enters a content only through the request's own
        entries scheduled after the step that samples it (``_prefix`` past the known tokens), so
        only in the blocks those entries write. Those entries are in the steps still in flight
        after the committing one (``steps[1:]``: every later step commits after it; an entry
        withdrawn from the building step took its write with it), so their blocks are searched,
        nothing is tracked.

        A resolution does not count as a content change (``_content_changed``): it renames one
        placeholder to its token in every content and, through ``Req.tokens``, in every reader's
        prefix at once. A renaming keeps every equality and every prefix relation, so each
        ``holds`` of NoUnwrittenRead and NoUnwrittenPublish that was true stays true (it may
        make a false one true: the token can equal a real token elsewhere), and the reads
        verified before stay verified."""
        pending, written, bsz, substitute = self.pending, self.written, self.bsz, self._substitute
        steps = self.steps
        for k in range(1, len(steps)):
            st = steps[k]
            w = st.entries.get(rid)
            if w is None:
                continue
            blocks, sid = w.blocks, st.id
            if st.phase == EXECUTED:  # its writes are the blocks' contents, unless overwritten
                for i in range(w.start // bsz, w.nb):
                    block = blocks[i]
                    written[block] = substitute(written[block], ph, token)
                continue
            for i in range(w.start // bsz, w.nb):
                writes = pending[blocks[i]]
                for j in range(len(writes) - 1, -1, -1):  # its write, usually the newest
                    wr = writes[j]
                    if wr.step == sid and wr.rid == rid:
                        wr.content = substitute(wr.content, ph, token)
                        break

    def _substitute(self, content: object, ph: int, token: int) -> object:
        """``content`` with placeholder ``ph`` (at most once in it: one position) as ``token``."""
        if not isinstance(content, tuple):
            return content
        parent, tail = cast("tuple[int, tuple[int, ...]]", content)
        if tail and tail[-1] == ph:  # the usual case: the last position written is the sampled one
            tail = tail[:-1] + (token,)
        elif ph in tail:
            at = tail.index(ph)
            tail = tail[:at] + (token,) + tail[at + 1 :]
        else:
            return content
        return self._canonical(parent, tail) if len(tail) >= self.bsz else (parent, tail)

    def _holds(self, content: object, prefix: object) -> bool:
        """``spec.pool.holds``: bytes holding ``content`` are valid for a reader of ``prefix``."""
        if content == prefix:
            return content is not None
        if content is None:
            return False
        cp, ct = self._split(content)
        pp, pt = self._split(prefix)
        if cp == pp:
            return ct[: len(pt)] == pt
        if self.node[cp][2] <= self.node[pp][2]:  # same depth, other tokens; or shorter
            return False
        full, want = self._tokens(content), self._tokens(prefix)
        return full[: len(want)] == want

    def _split(self, content: object) -> tuple[int, tuple[object, ...]]:
        """(parent id, the block's tokens) of a content (not None)."""
        if isinstance(content, int):
            entry = self.node[content]
            return entry[0], entry[1]
        return cast("tuple[int, tuple[object, ...]]", content)

    def tokens_of(self, content: object) -> tuple[object, ...] | None:
        """A content (or None) as the spec's token tuple (placeholders as ``spec.Placeholder``)."""
        if content is None:
            return None
        return tuple(
            spec_placeholder(x) if x < 0 else x
            for x in cast("tuple[int, ...]", self._tokens(content))
        )

    def _tokens(self, content: object) -> tuple[object, ...]:
        parent, tail = self._split(content)
        parts: list[tuple[object, ...]] = [tail]
        while parent != ROOT:
            parent, toks, _ = self.node[parent]
            parts.append(toks)
        return tuple(t for part in reversed(parts) for t in part)

    def _eventual(self, block: int, upto: int | None = None) -> object:
        content = self.written[block]
        for w in self.pending[block]:
            if upto is None or w.step <= upto:
                content = w.content
        return content

    def _collect(self) -> None:
        """Forget interned prefixes nothing refers to (keeping every ancestor of one that is)."""
        live: set[int] = set()
        for req in self.requests.values():
            live.update(req.chain)
        live.update(k for k in self.key if k is not None)
        live.update(cast(int, k) for k in self.held)
        for content in self.written + [w.content for ws in self.pending for w in ws]:
            if content is not None:
                live.add(
                    self._split(content)[0] if isinstance(content, tuple) else cast(int, content)
                )
        node = self.node
        todo = list(live)
        while todo:
            parent = node[todo.pop()][0]
            if parent not in live:
                live.add(parent)
                todo.append(parent)
        live.add(ROOT)
        self.node = {cid: node[cid] for cid in live}
        self.intern = {(p, toks): cid for cid, (p, toks, _) in self.node.items() if cid != ROOT}
        self.collect_at = max(self.collect_floor, 4 * len(self.node))

    # -- the pool (spec/pool.py) ----------------------------------------------------------------

    def _content_changed(self, block: int) -> None:
        self.changed.append(block)
        holders = self.holders[block]
        if holders:
            for req, i in holders.items():
                if req.verified > i:
                    req.verified = i

    def _lookup(self, req: Req, bound: int) -> list[int]:
        """``spec.pool.lookup``; ``bound`` the hit's bound in tokens, -1 for none."""
        if not self.caching:
            return []
        cap = (len(req.tokens) - 1) // self.bsz
        if bound >= 0:
            cap = min(cap, bound // self.bsz)
        hits: list[int] = []
        index = self.index
        for i in range(cap):
            blocks = index.get(self._chain(req, i))
            if not blocks:
                break
            hits.append(blocks[0])
        return hits

    def _allocate(self, req: Req) -> None:
        if not self.free:
            raise Illegal()
        block = self.free.popitem(last=False)[0]
        if self.key[block] is not None:
            self._drop_key(block)
            self.expected.append(("evict", block))
        self.refcount[block] = 1
        self.holders[block][req] = len(req.table)
        req.table.append(block)
        self.expected.append(("alloc", req.id, block))

    def _free_table(self, req: Req) -> None:
        refcount, key, free, holders = self.refcount, self.key, self.free, self.holders
        expected = self.expected
        caching, table = self.caching, req.table
        for j in range(len(table) - 1, -1, -1):
            block = table[j]
            count = refcount[block]
            if count <= 0:
                raise Illegal()
            refcount[block] = count - 1
            if count == 1:
                free[block] = None
                if key[block] is None and caching:
                    free.move_to_end(block, last=False)
            mine = holders[block]
            if req in mine:
                del mine[req]
            expected.append(("free", block))
        if not caching:  # spec.pool.free_batch: the batch at the head, the table's last first
            for block in req.table:
                if refcount[block] == 0:
                    free.move_to_end(block, last=False)
        req.table = []
        req.computed = 0
        req.loaded_last = False
        req.cached = 0
        req.verified = 0

    def _publish(self, req: Req, i: int) -> None:
        block = req.table[i]
        if block == 0:
            raise Illegal()
        if self.key[block] is not None:
            return
        k = self._chain(req, i)
        self.key[block] = k
        owners = self.index.get(k)
        if owners is None:
            self.index[k] = [block]
        else:
            owners.append(block)
        self.published.append(block)
        self.expected.append(("publish", req.id, i, block))

    def _unpublish(self, block: int, leaving: Req) -> None:
        """``spec.pool.unpublish`` of a leaving request's block."""
        k = self.key[block]
        if k is None:
            return
        self._count_if_lost(block, k, leaving)
        self._drop_key(block)
        self.expected.append(("unpublish", block))

    def _count_if_lost(self, block: int, k: int, leaving: Req) -> None:
        """``spec.pool.count_if_lost``: the key dropped although the block will hold it and
        nobody but the leaving request references it."""
        own = 1 if block in leaving.table else 0
        if self.refcount[block] - own == 0 and self._holds(self._eventual(block), k):
            self.lost_hits += 1

    def _drop_key(self, block: int) -> None:
        k = self.key[block]
        assert k is not None
        owners = self.index[k]
        owners.remove(block)
        if not owners:
            del self.index[k]
        self.key[block] = None

    def _register_upto(self, req: Req, upto: int) -> None:
        """``_register`` when the indices are not needed."""
        for i in range(req.cached, upto):
            self._publish(req, i)
        if upto > req.cached:
            req.cached = upto

    def _register(self, req: Req, upto: int) -> list[int]:
        indices = list(range(req.cached, upto))
        for i in indices:
            self._publish(req, i)
        if upto > req.cached:
            req.cached = upto
        return indices

    # -- the actions (spec/actions.py, spec/policies.py) -------------------------------------------

    def arrive(self, rid: int, prompt: tuple[int, ...], max_tokens: int, priority: int) -> None:
        if rid in self.requests or not prompt or max_tokens < 1:
            raise Illegal()
        if _negative(prompt):
            raise ValueError(f"token ids must be >= 0, got {min(prompt)} in request {rid}'s prompt")
        self.requests[rid] = Req(rid, prompt, max_tokens, priority)
        self.waiting[rid] = None
        if len(self.node) > self.collect_at:
            self._collect()

    def begin(self, step_id: int) -> None:
        steps = self.steps
        if (
            (steps and steps[-1].phase == BUILDING)
            or len(steps) >= self.depth
            or step_id != self.next_step
        ):
            raise Illegal()
        self.next_step += 1
        step = Stp(step_id)
        steps.append(step)
        if self.clear_begin:  # policies.on_begin
            self._clear(step)

    def _clear(self, step: Stp) -> None:
        """The policy's tracking is forgotten (``policies._clear``)."""
        if self.track_single:
            self.single.clear()
        elif self.track_step:
            step.registrations.clear()

    def _building(self) -> Stp:
        steps = self.steps
        if not steps or steps[-1].phase != BUILDING:
            raise Illegal()
        return steps[-1]

    def _request(self, rid: int) -> Req:
        req = self.requests.get(rid)
        if req is None:
            raise Illegal()
        return req

    def schedule(self, rid: int, num_tokens: int, num_loaded: int = 0, bound: int = -1) -> None:
        steps, req = self.steps, self.requests.get(rid)
        if not steps or steps[-1].phase != BUILDING or req is None:
            raise Illegal()
        if bound != -1 and (bound < 0 or req.status != WAITING):
            raise Illegal()  # spec.actions.schedule: a bound on an admission only
        step, bsz = steps[-1], self.bsz
        if rid in step.entries or req.loading is not None or req.status == FINISHED:
            raise Illegal()
        if num_tokens < 0 or num_loaded < 0 or step.budget_used + num_tokens > self.token_budget:
            raise Illegal()
        if num_tokens == 0 and num_loaded == 0:
            raise Illegal()
        table = req.table
        if req.status == WAITING:
            if len(self.running) >= self.max_running:
                raise Illegal()
            deliver = self.deliver
            if deliver and not self._admissible(rid):
                raise Illegal()
            if self.vllm:
                if step.preempted:
                    raise Illegal()
                if self.preemption == "priority":
                    order = [r for r in self.waiting if not deliver or self._admissible(r)]
                    head = min(order, key=self._rank)
                else:  # the first admissible one (we know rid is)
                    head = rid
                    for r in self.waiting:
                        if not deliver or self._admissible(r):
                            head = r
                            break
                if rid != head:
                    raise Illegal()
            hits = self._lookup(req, bound)
            known = len(req.tokens)  # spec.actions.loadable
            loadable = (known if num_tokens == 0 and bsz > 1 else known - 1) // bsz
            if len(hits) + num_loaded > loadable:
                raise Illegal()
            start = len(hits) * bsz
            end = start + num_tokens + num_loaded * bsz
            refcount = self.refcount
            held_free = sum(1 for b in hits if refcount[b] == 0)
            if -(-end // bsz) - len(hits) > len(self.free) - held_free:
                raise Illegal()
            free, holders = self.free, self.holders
            for block in hits:
                if refcount[block] == 0:
                    del free[block]
                refcount[block] += 1
                holders[block][req] = len(table)
                table.append(block)
            self.expected.append(("hit", rid, tuple(hits)))
            req.cached = len(hits)
            del self.waiting[rid]
            self.running.append(rid)
            req.status = RUNNING
            step.admitted = True
        else:
            if num_loaded:
                raise Illegal()
            if self.vllm and step.admitted:
                raise Illegal()
            start, end = req.computed, req.computed + num_tokens
            if -(-end // bsz) - len(table) > len(self.free):
                raise Illegal()
        known = len(req.tokens)
        limit = known + len(req.ahead) if self.async_scheduling else known
        if end > limit:
            raise Illegal()
        while len(table) * bsz < end:
            self._allocate(req)
        load = num_loaded > 0 and num_tokens == 0  # asynchronous: the request waits for it
        pending, sid = self.pending, step.id
        for i in range(start // bsz, len(table)):
            block = table[i]
            content = self._prefix(req, min(end, (i + 1) * bsz))
            pending[block].append(Wr(sid, rid, content, load))
            self._content_changed(block)
        req.loaded_last = load and end == known
        req.computed = end - 1 if req.loaded_last else end  # recomputed over the load
        samples = not load and end == limit
        ph = 0
        if samples and self.async_scheduling:
            ph = placeholder(sid, rid)
            req.ahead.append(ph)
        step.entries[rid] = Ent(req, start, end, table, load, samples, ph, num_loaded)
        step.budget_used += num_tokens
        if load:
            req.loading = sid
        self.new_step, self.new_rid = step, rid
        # policies.on_schedule
        upto = min(end, known) // bsz
        if load and self.delay_loads:
            pass  # registered when the request is next scheduled
        elif self.at_schedule:
            indices = self._register(req, upto)
            if self.track_single:
                self.single.setdefault(rid, []).extend(indices)
            elif self.track_step:
                step.registrations.setdefault(rid, []).extend(indices)
        elif self.hidden:
            step.registrations.setdefault(rid, []).extend(range(req.cached, upto))
            if upto > req.cached:
                req.cached = upto

    def _wait_first(self, rid: int) -> None:
        """The request waits at the head of the queue."""
        self.waiting[rid] = None
        self.waiting.move_to_end(rid, last=False)

    def _admissible(self, rid: int) -> bool:
        """``spec.actions.admissible``: with stale output delivered, not while a step in flight
        holds the request."""
        if self.deliver:
            for st in self.steps:
                if rid in st.entries:
                    return False
        return True

    def _rank(self, rid: int) -> tuple[int, int]:
        req = self.requests[rid]
        return (req.priority, req.arrival)

    def preempt(self, rid: int) -> None:
        step, req = self._building(), self._request(rid)
        if req.status != RUNNING:
            raise Illegal()
        if self.vllm:
            if step.admitted:
                raise Illegal()
            if self.preemption == "fcfs" and (rid != self.running[-1] or rid in step.entries):
                raise Illegal()
            if self.preemption == "priority" and rid != max(self.running, key=self._rank):
                raise Illegal()
        step.preempted = True
        step.victims.append(rid)
        self._leave(req, self.deliver)
        self.running.remove(rid)
        self._wait_first(rid)
        req.status = WAITING

    def submit(self, step_id: int) -> None:
        step = self._building()
        if step.id != step_id:
            raise Illegal()
        step.phase = SUBMITTED

    def execute(self, step_id: int, failed: tuple[int, ...] = ()) -> None:
        step: Stp | None = None
        for st in self.steps:
            if st.phase != EXECUTED:
                step = st
                break
        if step is None or step.id != step_id or step.phase != SUBMITTED:
            raise Illegal()
        entries = step.entries
        for rid in failed:
            if rid not in entries or not entries[rid].load:
                raise Illegal()
        bsz, sid = self.bsz, step.id
        pending, written = self.pending, self.written
        step.failed = tuple(failed)
        for rid, e in entries.items():
            blocks, landed = e.blocks, rid not in failed
            for k in range(e.start // bsz, e.nb):
                block = blocks[k]
                writes = pending[block]
                head = writes[0]
                if (
                    head.step == sid
                    and head.rid == rid
                    and (len(writes) == 1 or writes[1].step != sid)
                ):  # the usual case: this write first (the oldest step's), the only one of it
                    content = head.content
                    del writes[0]
                else:
                    content = [w for w in writes if w.step == sid and w.rid == rid][-1].content
                    pending[block] = [w for w in writes if not (w.step == sid and w.rid == rid)]
                if landed:
                    # What was pending lands: no step's eventual content changes (this step is
                    # the oldest in flight, its write the first pending), and no holder had
                    # verified a block with a pending write.
                    written[block] = content
                else:
                    self._content_changed(block)
                    self.rewritten.append(block)
        for rid, e in entries.items():
            if e.load:  # a load reads nothing
                continue
            req = e.req
            blocks, end, alive = e.blocks, e.end, e.live
            first = req.verified if alive else 0  # reads known valid (unchanged since)
            bad: list[int] = []
            for i in range(first, e.nb):
                block = blocks[i]
                if not self._holds(written[block], self._prefix(req, min(end, (i + 1) * bsz))):
                    bad.append(block)
            if bad and alive:
                self.bad_reads += [(sid, rid, block) for block in bad]
            if bad:  # K/V computed from wrong inputs is wrong too
                for block in blocks[e.start // bsz : e.nb]:
                    written[block] = None
                    self._content_changed(block)
                    self.rewritten.append(block)
        step.phase = EXECUTED

    def commit(self, step_id: int, sampled: tuple[tuple[int, int], ...]) -> None:
        steps = self.steps
        if (
            not steps
            or steps[-1].phase == BUILDING
            or steps[0].id != step_id
            or steps[0].phase != EXECUTED
        ):
            raise Illegal()
        step = steps[0]
        entries = step.entries
        expected = [e for e in entries.values() if e.samples and e.live]
        tokens = dict(sampled)
        # the sampled requests are exactly the expected ones (both without repeats)
        if len(tokens) != len(sampled) or len(tokens) != len(expected):
            raise Illegal()
        for e in expected:
            if e.req.id not in tokens:
                raise Illegal()
        requests = self.requests
        if self.clear_confirmed:  # policies.on_confirmed
            self._clear(step)
        if step.failed:
            for rid, e in entries.items():
                req = requests[rid]
                loading = req.loading
                if e.load and loading is not None and loading == step.id:
                    req.loading = None
                    if rid in step.failed:
                        self._leave(req)
                        self.expected.append(("load_failed", rid))
                        self.running.remove(rid)
                        self._wait_first(rid)
                        req.status = WAITING
        else:
            for rid, e in entries.items():
                if e.load:
                    req = requests[rid]
                    loading = req.loading
                    if loading is not None and loading == step.id:
                        req.loading = None
        # policies.on_written
        if self.hidden:
            for rid, indices in step.registrations.items():
                req = requests[rid]
                for i in indices:
                    self._publish(req, i)
        elif self.at_written:
            bsz, failed = self.bsz, step.failed
            for rid, e in entries.items():
                req = e.req
                if e.live and rid not in failed and req.status == RUNNING:
                    self._register_upto(req, e.end // bsz)
        if self.clear_written:
            self._clear(step)
        stop, output = self.stop_token, self.async_scheduling and self.post_output
        for e in expected:
            req = e.req
            rid = req.id
            token = tokens[rid]
            if token < 0:
                raise ValueError(f"token ids must be >= 0, got {token} for request {rid}")
            ph = e.ph
            if ph:  # this step's placeholder, the oldest, is now the token
                if not req.ahead or req.ahead[0] != ph:
                    raise RuntimeError(f"fast model: request {rid}'s placeholders out of order")
                del req.ahead[0]
                if len(steps) > 1:  # later steps in flight may hold the placeholder
                    self._resolve(rid, ph, token)
            req.tokens.append(token)
            running = req.status == RUNNING  # else preempted, its stale output delivered
            if running and output:  # policies.on_output
                self._register_upto(req, e.end // self.bsz)
            reason = "length" if len(req.tokens) - req.plen >= req.max_tokens else None
            if stop is not None and token == stop:
                reason = "stop"
            if reason:
                self._free_table(req)
                self.expected.append(("finish", rid, reason))
                self.finished.add(rid)
                if running:
                    self.running.remove(rid)
                else:
                    del self.waiting[rid]
                req.status = FINISHED
                for later in steps[1:]:  # their output for it is stale: discarded
                    stale = later.entries.get(rid)
                    if stale is not None:
                        stale.live = False
                    later.registrations.pop(rid, None)
                req.ahead = []
        steps.pop(0)
        self.commits += 1
        if step.failed:  # its failed loads stop being excused by NoUnwrittenPublish
            for rid in step.failed:
                e = entries[rid]
                self.changed.extend(e.blocks[e.start // self.bsz : e.nb])

    def abort(self, rid: int) -> None:
        req = self._request(rid)
        steps = self.steps
        if (steps and steps[-1].phase == BUILDING) or req.status == FINISHED:
            raise Illegal()
        self._leave(req)
        if req.status == RUNNING:
            self.running.remove(rid)
        else:
            del self.waiting[rid]
        req.status = FINISHED
        self.expected.append(("finish", rid, "abort"))
        self.finished.add(rid)

    def reset(self) -> None:
        if self.steps or any(self.refcount):
            raise Illegal()
        key = self.key
        for block in sorted(b for blocks in self.index.values() for b in blocks):
            key[block] = None
            self.expected.append(("unpublish", block))
        self.index.clear()

    def _leave(self, req: Req, deliver: bool = False) -> None:
        """``spec.actions._leave``; ``deliver``: the submitted steps' output for the request is
        still used (a preemption with stale output delivered)."""
        steps, rid = self.steps, req.id
        if steps and steps[-1].phase == BUILDING and rid in steps[-1].entries:
            step = steps[-1]
            entry = step.entries.pop(rid)
            if entry.ph and entry.live:
                req.ahead.pop()  # the building step's placeholder is the newest
            step.budget_used -= entry.end - entry.start - entry.loaded * self.bsz
            sid, pending = step.id, self.pending
            for k in range(entry.nb):
                block = entry.blocks[k]
                writes = pending[block]
                if writes:
                    pending[block] = [w for w in writes if not (w.step == sid and w.rid == rid)]
                self._content_changed(block)
        for st in steps:
            if not deliver or st.phase == BUILDING:
                e = st.entries.get(rid)
                if e is not None:
                    e.live = False
        if not deliver:
            req.ahead = []
        tracked: list[int] = []
        if self.track_single:
            tracked = self.single.pop(rid, [])
        elif self.track_step:
            for st in steps:
                tracked += st.registrations.pop(rid, [])
        for i in tracked:
            if self.leave_drop:
                self._count_if_lost(req.table[i], self._chain(req, i), req)
            elif self.leave_unpublish:
                self._unpublish(req.table[i], req)
        req.loading = None
        self._free_table(req)

    # -- invariants ---------------------------------------------------------------------------

    def _reads_hold(self) -> bool:
        """NoUnwrittenRead's conjuncts the decision may have made false: the new entry's reads of
        blocks it does not write (it reads what it writes as it writes it), the building step's
        reads of blocks the decision wrote or withdrew a write from (older steps' eventual
        contents do not see the building step's writes), and every pending read of a block an
        execution rewrote."""
        bsz = self.bsz
        step, rid = self.new_step, self.new_rid
        if step is not None:
            e = step.entries.get(rid)
            if e is not None and not e.load and e.live:
                req, pending, blocks = e.req, self.pending, e.blocks
                contiguous, known = True, len(req.tokens) // bsz
                for i in range(req.verified, e.start // bsz):
                    block = blocks[i]
                    want = self._chain(req, i) if i < known else self._prefix(req, (i + 1) * bsz)
                    if not self._holds(self._eventual(block, step.id), want):
                        return False
                    if contiguous and not pending[block]:
                        req.verified = i + 1
                    else:
                        contiguous = False
        if self.changed:
            steps = self.steps
            if steps and steps[-1].phase == BUILDING:
                skip = -1 if step is None else rid
                if not self._step_readers_hold(self.changed, steps[-1], skip):
                    return False
        if self.rewritten:
            steps = [st for st in self.steps if st.phase != EXECUTED]
            if steps and not self._readers_hold(self.rewritten, steps, -1):
                return False
            if self.deliver and not self._stale_readers_hold(self.rewritten, steps):
                return False
        return True

    def _stale_readers_hold(self, blocks: list[int], steps: list[Stp]) -> bool:
        """Stale output still delivered: the reads of ``blocks`` by live entries of requests
        preempted since (they hold no blocks now, so ``holders`` does not find them)."""
        bsz, requests = self.bsz, self.requests
        for st in steps:
            for rid, e in st.entries.items():
                req = requests[rid]
                if not e.live or e.load or req.status == RUNNING:
                    continue
                for i, block in enumerate(e.blocks[: min(e.nb, -(-e.start // bsz))]):
                    if block in blocks and not self._holds(
                        self._eventual(block, st.id), self._prefix(req, min(e.start, (i + 1) * bsz))
                    ):
                        return False
        return True

    def _readers_hold(self, blocks: list[int], steps: list[Stp], skip: int) -> bool:
        """The reads of ``blocks`` by the live entries of ``steps`` (but ``skip``'s)."""
        for st in steps:
            if not self._step_readers_hold(blocks, st, skip):
                return False
        return True

    def _step_readers_hold(self, blocks: list[int], st: Stp, skip: int) -> bool:
        """The reads of ``blocks`` by the live entries of step ``st`` (but ``skip``'s)."""
        bsz = self.bsz
        holders = self.holders
        for block in blocks:
            for req, i in holders[block].items():
                rid = req.id
                if rid == skip:
                    continue
                e = st.entries.get(rid)
                if (
                    e is not None
                    and i * bsz < e.start
                    and not e.load
                    and e.live
                    and not self._holds(
                        self._eventual(block, st.id),
                        self._prefix(req, min(e.start, (i + 1) * bsz)),
                    )
                ):
                    return False
        return True

    def _publications_hold(self) -> bool:
        """NoUnwrittenPublish's conjuncts over the blocks whose hash or content changed."""
        key = self.key
        excused: set[int] | None = None
        for blocks in (self.published, self.changed):
            for block in blocks:
                k = key[block]
                if k is None:
                    continue
                if excused is None:
                    excused = self._excused()
                if block not in excused and not self._holds(self._eventual(block), k):
                    return False
        return True

    def _excused(self) -> set[int]:
        """Blocks of loads that failed in steps not committed yet (NoUnwrittenPublish)."""
        excused: set[int] = set()
        bsz = self.bsz
        for st in self.steps:
            for rid in st.failed:
                e = st.entries[rid]
                excused.update(e.blocks[e.start // bsz : e.nb])
        return excused

    # -- export -------------------------------------------------------------------------------

    def export(self) -> State:
        """The spec's state this model stands for."""
        seq = self.tokens_of
        key = self.spec_key
        blocks = [
            Block(
                self.refcount[b],
                None if self.key[b] is None else key(self.key[b]),
                cast("Content | None", seq(self.written[b])),
                [
                    Write(w.step, w.rid, cast(Content, seq(w.content)), w.load)
                    for w in self.pending[b]
                ],
            )
            for b in range(self.config.num_blocks)
        ]
        requests = {
            rid: Request(
                rid,
                list(r.tokens),
                r.plen,
                r.max_tokens,
                r.priority,
                r.arrival,
                STATUS[r.status],
                list(r.table),
                r.computed,
                r.cached,
                r.loading,
                r.loaded_last,
            )
            for rid, r in self.requests.items()
        }
        steps = []
        for st in self.steps:
            step = Step(st.id, PHASE[st.phase])
            step.entries = {
                rid: Entry(
                    e.start, e.end, tuple(e.blocks[: e.nb]), e.load, e.samples, loaded=e.loaded
                )
                for rid, e in st.entries.items()
            }
            step.live = {rid for rid, e in st.entries.items() if e.live}
            step.registrations = {rid: list(ix) for rid, ix in st.registrations.items()}
            step.failed = st.failed
            step.budget_used, step.preempted, step.admitted = (
                st.budget_used,
                st.preempted,
                st.admitted,
            )
            step.victims = list(st.victims)
            steps.append(step)
        return State(
            config=self.config,
            blocks=blocks,
            free=list(self.free),
            index={key(k): list(v) for k, v in self.index.items()},
            requests=requests,
            waiting=list(self.waiting),  # its keys, in order
            running=list(self.running),
            steps=steps,
            next_step=self.next_step,
            single={rid: list(ix) for rid, ix in self.single.items()},
            bad_reads=list(self.bad_reads),
            commits=self.commits,
            arrivals=self.arrivals,
            lost_hits=self.lost_hits,
        )
