"""The judge: one core for every way kvspec judges an engine's events (the arrow "the spec judges
the events").

A ``Judge`` composes three parts, none of them a subclass of another:

* a **model** of the state machine: ``SpecModel`` (the spec itself, ``spec_model.py``) or
  ``FastModel`` (its twin written for speed, ``fastmodel.py``). The model applies each decision
  and says which effects it causes, and checks the invariants on what the decision changed;
* a **matching**: *strict* (the engine's effects must be exactly the model's, in order) or
  *observed* (each decision is held until its effects are in; the engine's legal choices of
  allocated and hit blocks are steered into the model first, and the engine's own effects beyond
  the model's, an ``unpublish`` or under ``engine-registers`` a ``publish`` or ``dedup``, are
  applied where they come: for engines whose pool orders its choices differently, or that register
  on their own; ``docs/adapters.md``);
* a **recorder** (optional): what a report needs, the last events that touched each block and
  each request (``recorder.py``). Without one the judge keeps no history (the fast path).

Beside these the core checks what any stream must satisfy: every id was introduced (``ids.py``;
``UnknownId`` otherwise, the input is not a trace), and, when ``publish`` events carry the
engine's opaque hashes, one hash names one token prefix and one prefix one hash
(``HashChainConsistent``). The first problem found is kept as a ``Finding``:

* an invariant's name: the engine did what the spec allows and the resulting state is unsafe (a
  finding about its design: policy, discipline);
* ``Disagreement``: the engine's effects or observable state differ from the model's (a bug in the
  engine, or in the spec);
* ``Illegal``: the engine took a decision no action of the spec allows in that state;
* ``HashChainConsistent``: the engine's hashes disagree with its tokens.

``Judge.spec``, ``Judge.stream`` and ``Judge.fast`` are the usual compositions. This module is
compiled by mypyc together with the fast model (``fastbuild.py``): it is the hot path of
``kvspec check``, whose loop over a trace's lines (``FileFeed``: read, match the effect due or
decode, feed) is here too, so that no interpreted code runs per event. A judge over the fast
model calls it directly (``Judge.fast_model``: compiled, native calls), not through the ``Model``
protocol.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from typing import Final, Protocol, cast

from kvspec.judge.findings import HASH_CHAIN, Finding
from kvspec.spec import Config, Illegal, Violation
from kvspec.spec.events import DECISIONS, blocks_of, group_of, requests_of
from kvspec.spec.observed import refuse_strict
from kvspec.spec.state import State
from kvspec.twins import NotFollowed

from .fastmodel import FAST_INVARIANTS, FastModel
from .ids import IdSet, UnknownId, check_ids
from .recorder import Recorder as HistoryRecorder
from .spec_model import SpecModel

TRACK_REFUSAL: Final = (
    "a track write is the engine's own effect, judged only observed under engine-registers "
    "with a slot group (spec/tracks.py)"
)
"""Why a ``track`` effect is refused where the judge does not take the engine's own effects."""

Event = tuple[object, ...]
KINDS_DECIDED: Final = DECISIONS
"""``spec.events.DECISIONS``, Final here (compiled: read from a C static, not looked up)."""
Snapshot = tuple[tuple[int, ...], tuple[int, ...]]
LineParts = tuple[
    Callable[[bytes], object],
    dict[type, tuple[str, bool]],
    Callable[[object], tuple[object, ...]],
    object,
]
"""``fastread.parts``: decode a line to a struct; its kind and whether it has a hash; astuple (the
event, and the hash last when the kind has one); the value of an absent hash (a ``FileFeed``
decodes lines with them)."""


class Model(Protocol):
    """What the judge needs of a model of the state machine (``SpecModel``, ``FastModel``)."""

    config: Config

    def apply(self, decision: Event) -> list[Event]:
        """Take the decision (``Illegal`` when its guard fails); the effects it causes."""
        ...

    def check(self, names: Collection[str] | None) -> Violation | None:
        """The first invariant the decisions since the last check broke, or None."""
        ...

    def steer(self, decision: Event, effects: list[Event]) -> None:
        """Observed matching: make the model choose what the engine chose in ``effects``."""
        ...

    def engine_effect(self, effect: Event) -> None:
        """Observed matching: an effect of the engine's own (``Illegal`` if not legal)."""
        ...

    def hold(self, keys: Collection[Hashable]) -> None:
        """The judge keeps these keys (a live view of its hash-chain tables): a model that
        recycles its keys must not recycle these."""
        ...

    def has_request(self, rid: object) -> bool: ...

    def prune(self) -> list[int]:
        """Forget finished requests no step in flight references; the ones forgotten."""
        ...

    def chain_key(self, rid: int, index: int) -> Hashable:
        """The request's chained prefix of block ``index``, comparable by equality."""
        ...

    def prefix_length(self, key: Hashable) -> int:
        """How many tokens a ``key`` names."""
        ...

    def spec_key(self, key: Hashable) -> tuple[int, ...]:
        """A ``key`` as the spec's token tuple."""
        ...

    def snapshot(self) -> Snapshot:
        """(refcount of every block, the free queue head first)."""
        ...

    def export(self) -> State:
        """The spec state the model stands for now (between decisions)."""
        ...


class Follower(Protocol):
    """What observed matching asks of a follower (``consequence.Follower``): the engine's effects
    of a decision, around the model's ``steer`` and ``apply``."""

    def before(self, model: Model, decision: Event, effects: list[Event], index: int) -> None:
        """Before the engine's choices are steered into the model."""
        ...

    def after(
        self, model: Model, decision: Event, expected: list[Event], effects: list[tuple[Event, int]]
    ) -> None:
        """After the decision is applied: the model made to have the engine's effects."""
        ...


class Recorder(Protocol):
    """What a judge tells its recorder (``recorder.Recorder``, ``plan.PlanRecorder``)."""

    def decision(self, line: int, event: Event, model: Model) -> None:
        """Before the decision is applied (the model's state is the one it acts on)."""
        ...

    def effect(self, line: int, event: Event) -> None: ...

    def pruned(self, rid: int) -> None: ...


class Judge:
    """Feed events with ``feed``; ``finish`` (or ``settle``) at the end; ``compare`` the engine's
    observable state. A judge stops at its first finding and returns it from then on.

    ``invariants``: check only these (None: all; empty: none, only the matching and the guards);
    ``check_every``: check the invariants every k decisions (the state at those points, not the
    ones between; a violation found there says after which line it arose). An event naming an id
    that never existed is an ``Illegal`` finding, or with ``unknown_ids="raise"`` (a file: the
    input is not a trace) ``UnknownId`` is raised."""

    def __init__(
        self,
        model: Model,
        observed: bool = False,
        recorder: Recorder | None = None,
        invariants: Collection[str] | None = None,
        check_every: int = 1,
        unknown_ids: str = "finding",
    ) -> None:
        if isinstance(model, Config):
            raise TypeError("Judge takes a model: Judge.spec(config) judges with the spec itself")
        if unknown_ids not in ("finding", "raise"):
            raise ValueError(f"unknown_ids must be 'finding' or 'raise', not {unknown_ids!r}")
        if check_every < 1:
            raise ValueError("check_every must be >= 1")
        if observed and check_every != 1:
            raise ValueError("observed judging checks after every decision")
        if not observed:
            refuse_strict(model.config)
        self.model = model
        self.fast_model: FastModel | None = model if isinstance(model, FastModel) else None
        """The model when it is the fast one: called directly (compiled: a native call)."""
        self.config = model.config
        self.raise_unknown = unknown_ids == "raise"
        self.observed = observed
        self.recorder = recorder
        self.invariants: frozenset[str] | None = (
            None if invariants is None else frozenset(invariants)
        )
        self.check_every = check_every
        self.own_effects: tuple[str, ...] = (
            ("unpublish", "publish", "dedup")
            if model.config.policy == "engine-registers"
            else ("unpublish",)
        )
        if model.config.policy == "engine-registers" and model.config.slots:
            self.own_effects += ("snapshot", "evict", "track")  # spec/slots.py, spec/tracks.py
        self.finding: Finding | None = None
        self.events_seen = 0
        self.decisions = 0
        self.expected: list[Event] = []
        self.epos = 0
        self.ids = IdSet()
        self.max_step = -1
        self.line = 0
        self.last: Event | None = None
        """The last event fed (or, observed, the one being judged): the violating event."""
        self.last_check_line = 0
        self.held: list[tuple[Event, int, str | None, int]] = []
        """Observed: the held decision and its effects so far, (event, line, hash, index)."""
        self.block_hash: dict[int, str] = {}
        self.hash_key: dict[str, tuple[Hashable, int]] = {}
        """Opaque hash -> (the prefix key it names, how many blocks carry it)."""
        self.key_hash: dict[Hashable, tuple[str, int]] = {}
        model.hold(self.key_hash)
        self.follower: Follower | None = None
        """Observed matching only: judging a deviation's consequence (``consequence.py``), the
        engine's effects the spec would not have are followed instead of reported."""

    # -- compositions ---------------------------------------------------------------------------

    @classmethod
    def spec(
        cls,
        config: Config,
        observed: bool = False,
        invariants: Collection[str] | None = None,
        check_every: int = 1,
        incremental: bool = True,
    ) -> Judge:
        """The spec judging an engine's events in-process (the lockstep fuzzer, enactment)."""
        return cls(SpecModel(config, incremental), observed, None, invariants, check_every)

    @classmethod
    def stream(
        cls,
        config: Config,
        observed: bool = False,
        check_every: int = 1,
        history: int = 50,
        retired_requests: int = 256,
        incremental: bool = True,
        unknown_ids: str = "finding",
        invariants: Collection[str] | None = None,
    ) -> Judge:
        """The spec judging an unbounded stream (a trace file, a Monitor) for a report: the
        recorder keeps the last ``history`` events per block and per live request, and those of
        the last ``retired_requests`` finished ones."""
        recorder = HistoryRecorder(config.num_blocks, history, retired_requests)
        model = SpecModel(config, incremental)
        return cls(model, observed, recorder, invariants, check_every, unknown_ids)

    @classmethod
    def fast(
        cls,
        config: Config,
        unknown_ids: str = "finding",
        invariants: Collection[str] | None = None,
    ) -> Judge:
        """The fast model judging a strict stream: it finds (invariant, event); the spec makes
        the report (``handover.py``). ``invariants``: a subset of ``FAST_INVARIANTS`` (None:
        all of them), the only ones the fast model evaluates (ValueError otherwise)."""
        if invariants is not None and not FAST_INVARIANTS.issuperset(invariants):
            other = sorted(set(invariants) - FAST_INVARIANTS)
            raise ValueError(f"the fast model does not evaluate {', '.join(other)}")
        return cls(FastModel(config), invariants=invariants, unknown_ids=unknown_ids)

    def fork(self, model: Model, recorder: Recorder | None) -> Judge:
        """A judge over ``model`` (standing for the same state as this one's, between decisions,
        no effect outstanding) that judges the rest of the stream as this one would: ids, step
        numbers, hashes and counts carried over; the recorder starts afresh."""
        unknown = "raise" if self.raise_unknown else "finding"
        judge = Judge(model, self.observed, recorder, self.invariants, self.check_every, unknown)
        judge.events_seen, judge.decisions = self.events_seen, self.decisions
        judge.ids = self.ids.copy()
        judge.max_step, judge.line = self.max_step, self.line
        spec_key = self.model.spec_key
        judge.block_hash = dict(self.block_hash)
        judge.hash_key = {h: (spec_key(k), n) for h, (k, n) in self.hash_key.items()}
        judge.key_hash = {spec_key(k): (h, n) for k, (h, n) in self.key_hash.items()}
        model.hold(judge.key_hash)
        return judge

    # -- feeding --------------------------------------------------------------------------------

    def feed(self, event: Event, hash_: str | None = None, line: int = 0) -> Finding | None:
        """Judge one event (``line``: where it is in its file; default its index + 1; ``hash_``:
        a publish's opaque hash)."""
        try:
            return self._feed(event, hash_, line)
        except UnknownId as err:
            return self._unknown(err)

    def _feed(self, event: Event, hash_: str | None, line: int) -> Finding | None:
        if self.finding is not None:
            return self.finding
        index = self.events_seen
        self.events_seen = index + 1
        if line == 0:
            line = index + 1
        self.line = line
        self.last = event
        if self.observed:
            return self._hold(event, hash_, line, index)
        expected, pos = self.expected, self.epos
        if pos < len(expected) and event == expected[pos]:  # the effect the model computed
            self.epos = pos + 1
            kind = cast(str, expected[pos][0])  # the model's own, equal to the event's
            if self.recorder is not None:
                self.recorder.effect(line, event)
            if hash_ is not None and kind == "publish":
                return self._check_hash(event, hash_, index)
            if (kind == "unpublish" or kind == "evict") and self.block_hash:
                self._drop_hash(event[1])  # type: ignore[arg-type]
            return None
        if event and event[0] in KINDS_DECIDED:
            return self._decide(event, index)
        check_ids(event[0] if event else None, event, self.ids, self.max_step)
        want = expected[pos] if pos < len(expected) else None
        return self._mismatch(event, want, index)

    def effect_due(self, event: Event, pos: int, line: int) -> None:
        """``_feed`` of the effect the model computed at ``pos`` (strict, no recorder, no
        finding yet, no hash): what ``FileFeed`` feeds without decoding its line."""
        self.events_seen += 1
        self.line = line
        self.last = event
        self.epos = pos + 1
        kind = event[0]
        if (kind == "unpublish" or kind == "evict") and self.block_hash:
            self._drop_hash(event[1])  # type: ignore[arg-type]

    def file_feed(
        self,
        lines: Iterator[bytes],
        number: int,
        parts: LineParts | None,
        slow: Callable[[bytes, int], tuple[Event, str | None]],
        freeze_every: int,
    ) -> FileFeed:
        """A loop that reads, decodes and feeds a file's lines to this judge (``FileFeed``)."""
        return FileFeed(self, lines, number, parts, slow, freeze_every)

    def feed_all(self, events: Iterable[Event]) -> Finding | None:
        for event in events:
            if self.feed(event) is not None:
                break
        return self.finding

    def _unknown(self, err: UnknownId) -> Finding:
        """An event named an id that never existed."""
        if self.raise_unknown:
            raise err
        return self._found(
            "Illegal", str(err), self.events_seen - 1, (self.last,) if self.last else ()
        )

    def settle(self) -> Finding | None:
        """At a point where the engine has emitted everything so far: no effect is missing (the
        held decision judged, observed)."""
        if self.finding is None and self.held:
            try:
                self._flush()
            except UnknownId as err:
                self._unknown(err)
        if self.finding is None and self.epos < len(self.expected):
            missing = self.expected[self.epos]
            self._found("Disagreement", f"missing effect {missing}", self.events_seen, (missing,))
        return self.finding

    def finish(self, line: int = 0) -> Finding | None:
        """End of the stream (``line``: one past the last line): no effect may be missing; the
        last invariant check runs."""
        self.line = line or self.events_seen + 1
        if self.settle() is None and self.check_every > 1:
            self._check(self.events_seen)
        return self.finding

    def compare(self, refcounts: tuple[int, ...], free: tuple[int, ...]) -> Finding | None:
        """Check the engine's refcounts and free queue against the model's (the free queue's
        order too, strictly; observed, only which blocks are free)."""
        if self.settle() is not None:
            return self.finding
        mine, queue = self.model.snapshot()
        at = self.events_seen
        if refcounts != mine:
            return self._found("Disagreement", f"refcounts {refcounts}, spec {mine}", at)
        if not self.observed and free != queue:
            return self._found("Disagreement", f"free queue {free}, spec {list(queue)}", at)
        if sorted(free) != sorted(queue) or len(set(free)) != len(free):
            return self._found(
                "Disagreement", f"free blocks {sorted(free)}, spec {sorted(queue)}", at
            )
        return None

    # -- decisions ------------------------------------------------------------------------------

    def _decide(self, event: Event, index: int) -> Finding | None:
        """A decision, strictly: its effects become the expected ones; check every k."""
        self.max_step = check_ids(event[0], event, self.ids, self.max_step)
        if self.epos < len(self.expected):
            missing = self.expected[self.epos]
            return self._found("Disagreement", f"missing effect {missing}", index, (missing,))
        effects = self._apply(event, index)
        if effects is None:
            return self.finding
        self.expected, self.epos = effects, 0
        return self._maybe_check(index)

    def _apply(self, event: Event, index: int) -> list[Event] | None:
        """The guards every stream has, then the model's (the ids checked already); None at a
        finding."""
        kind = event[0] if isinstance(event[0], str) else ""  # a str: compared natively
        model, fast = self.model, self.fast_model
        if fast is None:
            for rid in model.prune():
                if self.recorder is not None:
                    self.recorder.pruned(rid)
        elif fast.prunable:  # else nothing to prune (and no list made)
            for rid in fast.prune():
                if self.recorder is not None:
                    self.recorder.pruned(rid)
        if kind == "arrive":
            if cast(int, event[1]) in self.ids and not self._has_request(event[1]):
                self._illegal(f"arrive r{event[1]}: the id is taken", event, index)
                return None
        elif kind == "schedule" or kind == "preempt" or kind == "abort":
            if not self._has_request(event[1]):
                self._illegal(f"{kind} r{event[1]}: it has finished", event, index)
                return None
        if self.recorder is not None:
            self.recorder.decision(self.line, event, model)
        try:
            effects = model.apply(event) if fast is None else fast.apply(event)
        except Illegal as err:
            self._illegal(str(err), event, index)
            return None
        except TypeError as err:  # a malformed decision, as spec.apply says
            self._illegal(f"malformed decision {event!r}: {err}", event, index)
            return None
        self.decisions += 1
        if kind == "arrive":
            self.ids.add(event[1])  # type: ignore[arg-type]
        return effects

    def _has_request(self, rid: object) -> bool:
        fast = self.fast_model
        return self.model.has_request(rid) if fast is None else fast.has_request(rid)

    def _maybe_check(self, index: int) -> Finding | None:
        if self.invariants is not None and not self.invariants:
            return None
        if self.check_every == 1 or self.decisions % self.check_every == 0:
            return self._check(index)
        return None

    def _check(self, index: int) -> Finding | None:
        fast = self.fast_model
        if fast is None:
            violation = self.model.check(self.invariants)
        else:
            violation = fast.check(self.invariants)
        if violation is None:
            self.last_check_line = self.line
            return None
        return self._found(
            violation.invariant,
            violation.sentence,
            index,
            violation.blocks,
            violation.requests,
            self.last_check_line if self.check_every > 1 else None,
        )

    # -- observed matching ------------------------------------------------------------------------

    def _hold(self, event: Event, hash_: str | None, line: int, index: int) -> Finding | None:
        if event and event[0] in DECISIONS:
            if self.held and self._flush() is not None:
                return self.finding
            self.held = [(event, line, hash_, index)]
            return None
        if not self.held:
            check_ids(event[0] if event else None, event, self.ids, self.max_step)
            return self._found(
                "Disagreement", f"effect {event} before any decision", index, blocks_of(event)
            )
        self.held.append((event, line, hash_, index))
        return None

    def _flush(self) -> Finding | None:
        """Judge the held decision with its effects: the engine's legal choices steered into the
        model, the decision applied, each effect the model's or one of the engine's own, then the
        invariants."""
        (decision, line, _, index), effects = self.held[0], self.held[1:]
        self.held = []
        self.line, self.last = line, decision
        model = self.model
        self.max_step = check_ids(decision[0], decision, self.ids, self.max_step)
        follower = self.follower
        if follower is not None:
            follower.before(model, decision, [effect for effect, _, _, _ in effects], index)
        try:
            model.steer(decision, [effect for effect, _, _, _ in effects])
        except Illegal as err:
            return self._illegal(str(err), decision, index)
        expected = self._apply(decision, index)
        if expected is None:
            return self.finding
        if follower is not None:
            follower.after(model, decision, expected, [(e, i) for e, _, _, i in effects])
            self.line, self.last = line, decision
            return self._maybe_check(index)
        pos = 0
        for effect, at, hash_, eindex in effects:
            self.line, self.last = at, effect
            kind = effect[0]
            if pos < len(expected) and effect == expected[pos]:
                pos += 1
            elif kind in self.own_effects or self._track_alloc(effect):
                check_ids(kind, effect, self.ids, self.max_step)
                try:
                    model.engine_effect(effect)
                except Illegal as err:
                    return self._illegal(str(err), effect, eindex)
            else:
                check_ids(kind, effect, self.ids, self.max_step)
                return self._mismatch(
                    effect, expected[pos] if pos < len(expected) else None, eindex
                )
            if self.recorder is not None:
                self.recorder.effect(at, effect)
            if hash_ is not None and kind == "publish":
                if self._check_hash(effect, hash_, eindex) is not None:
                    return self.finding
            elif kind == "unpublish" or kind == "evict":
                self._drop_hash(effect[1])  # type: ignore[arg-type]
        self.line, self.last = line, decision
        if pos < len(expected):
            return self._found(
                "Disagreement", f"missing effect {expected[pos]}", index, (expected[pos],)
            )
        return self._maybe_check(index)

    # -- opaque hashes ----------------------------------------------------------------------------

    def _check_hash(self, event: Event, hash_: str, index: int) -> Finding | None:
        rid, i, block = event[1], event[2], event[3]
        model = self.model
        key = model.chain_key(rid, i)  # type: ignore[arg-type]
        named = self.hash_key.get(hash_)
        if named is not None and named[0] != key:
            length = model.prefix_length(key)
            return self._found(
                HASH_CHAIN,
                f"block {block} is published under hash {hash_!r} for r{rid}'s tokens "
                f"0..{length - 1}, but that hash names a different "
                f"{model.prefix_length(named[0])}-token prefix",
                index,
                (event,),
            )
        other = self.key_hash.get(key)
        if other is not None and other[0] != hash_:
            return self._found(
                HASH_CHAIN,
                f"block {block} is published under hash {hash_!r}, but the same token prefix "
                f"(r{rid}'s tokens 0..{model.prefix_length(key) - 1}) is published under "
                f"{other[0]!r}",
                index,
                (event,),
            )
        self._drop_hash(block)  # type: ignore[arg-type]
        self.block_hash[block] = hash_  # type: ignore[index]
        self.hash_key[hash_] = (key, 1 if named is None else named[1] + 1)
        self.key_hash[key] = (hash_, 1 if other is None else other[1] + 1)
        return None

    def _drop_hash(self, block: int) -> None:
        block_hash = self.block_hash
        hash_ = block_hash.get(block)  # get and del: native dict operations (pop is not)
        if hash_ is None:
            return
        del block_hash[block]
        key, n = self.hash_key[hash_]
        if n == 1:
            del self.hash_key[hash_]
        else:
            self.hash_key[hash_] = (key, n - 1)
        h, m = self.key_hash[key]
        if m == 1:
            del self.key_hash[key]
        else:
            self.key_hash[key] = (h, m - 1)

    # -- findings ---------------------------------------------------------------------------------

    def _track_alloc(self, effect: Event) -> bool:
        """An ``alloc`` in a slot group the spec did not make: the engine's track slot, its own
        effect under engine-registers (``spec/tracks.py``)."""
        config = self.model.config
        if effect[0] != "alloc" or config.policy != "engine-registers" or not config.slots:
            return False
        g = group_of(effect)
        return 0 < g < len(config.groups) and config.groups[g].kind == "slot"

    def _mismatch(self, event: Event, want: Event | None, index: int) -> Finding:
        if event and event[0] == "track":  # never the spec's own effect (spec/tracks.py)
            return self._illegal(TRACK_REFUSAL, event, index)
        named = (event,) if want is None else (event, want)
        if want is None:
            message = (
                f"engine emitted {event}, but the spec computes no further effect of the decision"
            )
        else:
            message = f"engine emitted {event}, but the spec expects {want}"
        return self._found("Disagreement", message, index, named)

    def _illegal(self, message: str, event: Event, index: int) -> Finding:
        return self._found("Illegal", message, index, (event,))

    def _found(
        self,
        invariant: str,
        message: str,
        index: int,
        about: tuple[Event, ...] | tuple[int, ...] = (),
        requests: tuple[int, ...] = (),
        arose_after: int | None = None,
    ) -> Finding:
        """Keep the finding; ``about`` is the events it is about (their blocks and requests are
        its own), or, for an invariant, the violation's blocks."""
        if about and isinstance(about[0], tuple):
            events: tuple[Event, ...] = about  # type: ignore[assignment]
            blocks = tuple(sorted({b for e in events for b in blocks_of(e)}))
            requests = tuple(sorted({r for e in events for r in requests_of(e)}))
        else:
            blocks = about  # type: ignore[assignment]
        self.finding = Finding(invariant, message, index, blocks, requests, self.line, arose_after)
        return self.finding


BLOCK_EFFECTS: Final = ("free", "evict", "unpublish")
"""Effects whose only value is a block: ``FileFeed`` makes each one's line once per block."""
END: Final = 0
FOUND: Final = 1
DUE: Final = 2
CRASH: Final = 3
EFFECT_FIRST: Final = 4
"""Why ``FileFeed.run`` returned: the lines ran out; the judge found something; a decision is due
for a checkpoint (not fed yet: ``pending``); the judge raised (``crash``); an effect came before
any decision (``pending``)."""


class FileFeed:
    """The loop of ``kvspec check`` on the fast path (``check.py``), compiled with the judge: it
    reads a trace's raw lines, decodes each (msgspec's structs through ``parts``, as
    ``fastread.decoder`` does; a line they refuse, or every line without ``parts``, through
    ``slow``, which accepts it or raises ``TraceError``) and feeds the events to the judge, until
    something the caller handles: ``run`` says what (``END`` ... ``EFFECT_FIRST``). Every
    ``freeze_every`` events what is alive is frozen (``gc.freeze``: the judge's state so far is
    long-lived; ``check.long_lived``).

    Most lines of a trace are effects the model computed already. Judging strictly, a line is
    first compared with the line of the effect due, as ``trace.write_trace`` writes it
    (``due_line``: a free, evict, unpublish, alloc or finish); an equal line is that effect and
    is fed as it (``Judge.effect_due``) without being decoded. Any other line (another form, a
    different effect, a decision) is decoded and fed as before."""

    def __init__(
        self,
        judge: Judge,
        lines: Iterator[bytes],
        number: int,
        parts: LineParts | None,
        slow: Callable[[bytes, int], tuple[Event, str | None]],
        freeze_every: int,
    ) -> None:
        self.judge = judge
        self.lines = lines
        self.number = number
        """The number of the last line read."""
        self.parts = parts
        self.slow = slow
        self.freeze_every = freeze_every
        self.frozen_at = freeze_every
        self.pending: tuple[Event, str | None] | None = None
        """The event of line ``number``, read but not fed (``DUE``, ``EFFECT_FIRST``)."""
        self.block_lines: dict[str, list[bytes | None]] = {
            kind: [None] * judge.model.config.num_blocks for kind in BLOCK_EFFECTS
        }
        """Per kind of ``BLOCK_EFFECTS``, the line of the effect on each block (``due_line``),
        made once."""
        self.crash = ""
        """``repr`` of what the judge raised (``CRASH``): a bug in the model, or (``refused``)
        a decision it does not follow."""
        self.refused = False
        """The crash was a ``twins.NotFollowed``: the spec judges on (``handover.FastRun``)."""

    def run(self, due: int) -> int:
        """Feed events until the lines run out, a finding, a crash, an effect before any
        decision, or a decision once ``due`` events were seen (the pending one is fed first)."""
        judge, slow, parts = self.judge, self.slow, self.parts
        number, pending = self.number, self.pending
        self.pending = None
        if parts is not None:
            decode, kinds, astuple, unset = parts
        if pending is not None:
            why = self._feed_one(pending[0], pending[1], number)
            if why != -1:
                return why
        # the effect due compared as a line (``due_line``): strict judging, no history
        bytewise = parts is not None and not judge.observed and judge.recorder is None
        for raw in self.lines:
            number += 1
            if bytewise:
                pos, expected = judge.epos, judge.expected
                if pos < len(expected) and judge.finding is None:
                    want = expected[pos]
                    if raw == self.due_line(want):
                        self.number = number
                        seen = judge.events_seen
                        if seen >= self.frozen_at:
                            gc.freeze()
                            self.frozen_at = seen + self.freeze_every
                        judge.effect_due(want, pos, number)
                        continue
            if parts is None:
                event, hash_ = slow(raw, number)
            else:
                try:
                    obj = decode(raw)
                except Exception:  # what msgspec refuses: parse_line decides
                    event, hash_ = slow(raw, number)
                else:
                    values = astuple(obj)  # the event (``fastread.KIND_FIELD``)
                    if kinds[type(obj)][1]:
                        last = values[-1]
                        event = values[:-1]
                        hash_ = None if last is unset else cast(str, last)
                    else:
                        event, hash_ = values, None
            self.number = number
            seen = judge.events_seen
            if seen >= self.frozen_at:  # the judge's state so far: long-lived
                gc.freeze()
                self.frozen_at = seen + self.freeze_every
            decision = event[0] in KINDS_DECIDED
            if seen >= due and decision:
                self.pending = (event, hash_)
                return DUE
            if judge.decisions == 0 and not decision:
                self.pending = (event, hash_)
                return EFFECT_FIRST
            why = self._feed_one(event, hash_, number)
            if why != -1:
                return why
        return END

    def due_line(self, want: Event) -> bytes:
        """The line an engine's trace holds for the effect ``want`` (the form
        ``trace.write_trace`` writes, without a hash), for the kinds it is made for; else
        ``b""``, which no line equals. A line equal to it decodes to ``want``
        (``tests/test_checker.py``), so it is fed as ``want`` without being decoded."""
        kind = want[0]
        if kind == "free" or kind == "evict" or kind == "unpublish":
            block = cast(int, want[1])
            lines = self.block_lines[cast(str, kind)]
            line = lines[block]
            if line is None:
                line = f'{{"ev":"{kind}","block":{block}}}\n'.encode()
                lines[block] = line
            return line
        if kind == "alloc":
            return f'{{"ev":"alloc","req":{want[1]},"block":{want[2]}}}\n'.encode()
        if kind == "finish":
            return f'{{"ev":"finish","req":{want[1]},"reason":"{want[2]}"}}\n'.encode()
        return b""

    def _feed_one(self, event: Event, hash_: str | None, number: int) -> int:
        """Feed one event: -1, or why ``run`` returns."""
        try:
            found = self.judge.feed(event, hash_, number)
        except UnknownId:
            raise
        except Exception as err:  # a bug in the fast model: the spec decides, loudly
            self.crash = repr(err)
            self.refused = isinstance(err, NotFollowed)  # or a decision it refuses: quietly
            return CRASH
        return -1 if found is None else FOUND
