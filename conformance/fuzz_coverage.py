"""What a lockstep fuzzing run reached: the rare situations the unsafe policies fail in, counted.

A fuzzer that runs many engine steps but never preempts a request out of the step being built,
never hits a block whose write has not run yet, or never fails a load, has not tested what the
safe policies exist for. ``RunCoverage`` watches one run's event stream (the decisions and
effects of ``docs/events.md``, in order) and counts those situations; ``Coverage`` sums them over
the runs of a machine (``fuzz.Tally.coverage``, printed by ``kvspec fuzz`` and
``bench/bench_fuzz.py``). The counters read the events alone, so any engine's stream can be
counted, and the benchmark counts an older fuzzer's runs the same way.

Counters:

* ``preempt_building``: a ``preempt`` of a request that the step being built has scheduled
  (its entry is withdrawn: under eager policies, the blocks it published will not be written);
* ``hit_same_step``: a ``hit`` of a block allocated by the step being built (its write runs only
  when that step executes); ``hit_in_flight``: of a block allocated by a submitted step that has
  not executed yet;
* ``zombies_past_step``: a block published for an entry that was then withdrawn from the step
  being built, still published when that step is submitted (a zombie a later request can hit;
  under the vLLM discipline the preemptor usually takes it at once, since a victim's blocks are
  freed last block first and its last full block is the one the step was to write);
* ``zombie_hits``: a ``hit`` of a block allocated or published for an entry that was then
  withdrawn from the step being built (its write never runs; an eager policy published it); a
  block a ``snapshot`` fills since (a slot group's state, copied or donated: it takes a free
  block with no ``alloc``) is no zombie;
* ``unwritten_reads``: reads of the wrong bytes when a step executed (the spec's ``bad_reads``,
  added by the caller from the model's state at the end of the run: a zombie read);
* ``load_failures``: ``load_failed`` effects (an external KV load that failed);
* ``loads``: ``schedule`` decisions with loaded blocks (external KV loads), of which
  ``sync_loads`` computed tokens after them in the same step (synchronous);
* ``preempt_at_depth``: preemptions by the number of submitted steps in flight at that moment
  (0: none, as in a synchronous engine between steps; up to the cell's depth);
* ``accepted_drafts``: draft tokens accepted (speculative decoding: a ``commit`` lists a request
  once per token it samples, so each listing past its first is an accepted draft);
* ``window_frees``: blocks freed by a ``schedule`` decision (a sliding window's blocks before
  its window, freed when their request is scheduled);
* several KV-cache groups (``RunCoverage(kinds)``, the groups' kinds in group order; events as
  docs/hybrid.md fixes them): ``state_hits``, state blocks hit (a state group's ``hit`` naming
  a block); ``window_nulled_shared``, window-group (or chunked-group) blocks freed by a ``schedule`` decision
  while the request holds a block of another group that someone else holds too;
  ``hits_shortened``, admissions whose hit a group shortened below what the first group alone
  would serve (the reference engine counts its own, ``fuzz_groups``; for any other engine,
  ``RunCoverage(kinds, sizes)`` reads it from the events: an admission whose hit is shorter
  than the longest prefix a full-attention group has published for the request, up to the
  last token a hit may cover, as vLLM's coordinator iterates from its full-attention group);
* slot groups (``kinds`` naming ``slot``: SGLang's MAMBA states, ``spec/slots.py``, and their
  track slots, ``spec/tracks.py``), read from the judged events alone: ``slot_hits``, states hit
  by copy (a slot group's ``hit`` naming a block: its state is copied into the request's own
  slot); ``snapshots_copied``, ``snapshot`` effects whose block the request does not hold (the
  engine copied the slot into a fresh block); ``snapshots_donated``, ``snapshot`` effects of a
  block the request's table holds (allocated to it, not freed yet) that no ``track`` effect
  named (the working slot itself, given to the cache at a finish); ``track_writes``, ``track`` effects (a step also leaves a
  boundary state in a track slot); ``track_donations``, ``snapshot`` effects of a track slot
  (a block a ``track`` effect named for that request); ``slot_runs``, runs with a slot group
  (``groups_line`` then prints these);
* cross groups (``kinds`` naming ``cross``: an encoder-decoder model's cross-attention,
  ``docs/model.md``): ``cross_blocks``, blocks allocated in a cross group (the encoder tokens'
  tables, at admissions); ``cross_preempt_frees``, those freed by a ``preempt`` decision (to be
  allocated and written again at the re-admission); ``cross_runs``, runs with a cross group;
* ``grouped_runs``: runs with several KV-cache groups (``kvspec fuzz`` then prints
  ``Coverage.groups_line`` too);
* ``refused_runs``: runs ended by the adapter's refusal (a feature the spec does not model, seen
  mid-run: ``fuzz.RunRefused``), counted by the fuzzer, not read from the events.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from kvspec.spec.events import DECISIONS

Event = tuple[object, ...]

WITHDRAWN = -1
"""The writer of a block whose allocating entry left the step being built."""

MAX_DEPTH = 3
"""The deepest cell the fuzzer draws; deeper preemptions count in the last bucket."""


@dataclass
class Coverage:
    """Counts summed over runs (``add``)."""

    preempt_building: int = 0
    zombies_past_step: int = 0
    hit_same_step: int = 0
    hit_in_flight: int = 0
    zombie_hits: int = 0
    unwritten_reads: int = 0
    load_failures: int = 0
    loads: int = 0
    sync_loads: int = 0
    accepted_drafts: int = 0
    window_frees: int = 0
    state_hits: int = 0
    window_nulled_shared: int = 0
    hits_shortened: int = 0
    refused_runs: int = 0
    grouped_runs: int = 0
    slot_hits: int = 0
    snapshots_copied: int = 0
    snapshots_donated: int = 0
    track_writes: int = 0
    track_donations: int = 0
    slot_runs: int = 0
    cross_blocks: int = 0
    cross_preempt_frees: int = 0
    cross_runs: int = 0
    preempt_at_depth: list[int] = field(default_factory=lambda: [0] * (MAX_DEPTH + 1))

    def add(self, other: Coverage) -> None:
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for depth, count in enumerate(other.preempt_at_depth):
            self.preempt_at_depth[depth] += count

    def as_dict(self) -> dict[str, object]:
        counts: dict[str, object] = {name: getattr(self, name) for name in COUNTERS}
        counts["preempt_at_depth"] = list(self.preempt_at_depth)
        return counts

    def line(self) -> str:
        """One line for ``kvspec fuzz``."""
        depths = "/".join(str(n) for n in self.preempt_at_depth)
        return (
            f"coverage: {self.preempt_building} preemptions from the step being built "
            f"({self.zombies_past_step} zombie blocks outlived their step), "
            f"{self.hit_same_step} same-step and {self.hit_in_flight} in-flight hits of unwritten "
            f"blocks, {self.zombie_hits} zombie hits, {self.unwritten_reads} unwritten reads, {self.load_failures} load failures; "
            f"preemptions with 0/1/2/3 steps in flight: {depths}"
            + (f"; {self.loads} loads ({self.sync_loads} synchronous)" if self.loads else "")
            + (f"; {self.accepted_drafts} accepted draft tokens" if self.accepted_drafts else "")
            + (f"; {self.window_frees} blocks freed before a window" if self.window_frees else "")
            + (f"; {self.refused_runs} runs ended by a refusal" if self.refused_runs else "")
        )

    def groups_line(self) -> str:
        """One more line for ``kvspec fuzz --groups`` (and any engine whose runs had several
        groups): what the hybrid paths reached."""
        return (
            f"groups: {self.hits_shortened} hits shortened by a group, {self.state_hits} state "
            f"blocks hit, {self.window_nulled_shared} window/chunk blocks nulled while the request "
            "shared others"
            + (
                f"; slot groups: {self.slot_hits} states hit by copy, {self.snapshots_copied} "
                f"snapshots by copy, {self.snapshots_donated} by donation, {self.track_writes} "
                f"track writes, {self.track_donations} track slots donated"
                if self.slot_runs
                else ""
            )
            + (
                f"; cross groups: {self.cross_blocks} blocks allocated for encoder tokens, "
                f"{self.cross_preempt_frees} freed by a preemption"
                if self.cross_runs
                else ""
            )
        )


COUNTERS = tuple(f.name for f in fields(Coverage) if f.name != "preempt_at_depth")
"""The scalar counts of ``Coverage``, summed field by field."""


class RunCoverage(Coverage):
    """One run's counts, and what it needs to know of the stream so far."""

    def __init__(self, kinds: tuple[str, ...] = (), sizes: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.kinds = kinds
        self.grouped_runs = int(bool(kinds))
        """Several KV-cache groups: each group's kind, in group order (empty: one group)."""
        self.slot_runs = int("slot" in kinds)
        self.cross_runs = int("cross" in kinds)
        self.own_slot: dict[int, int] = {}
        """Slot groups: block -> the request its table holds it for (an ``alloc``; gone at its
        ``free`` or ``evict``)."""
        self.donor: dict[int, int] = {}
        """Slot groups: block -> the request whose ``finish`` freed it as its slot, until the
        next decision (the reference engine frees a finished request's tables, then donates its
        slot in the same decision: ``reference/own_registration.py``)."""
        self.track_of: dict[int, int] = {}
        """Slot groups: block -> the request a ``track`` effect wrote it for (kept past the
        table's ``free``: a finish frees the table, then donates the slot it tracked; gone at
        its next ``alloc`` or its ``evict``)."""
        self.sizes = sizes
        """Several groups: each group's block size, where ``hits_shortened`` is read from the
        events (empty: the engine counts it)."""
        self.tokens: dict[int, list[int]] = {}
        """Several groups, with ``sizes``: request -> its tokens (prompt, then committed)."""
        self.group_published: dict[int, tuple[int, tuple[int, ...]]] = {}
        """Several groups, with ``sizes``: published block -> (its group, its prefix)."""
        self.prefixes: set[tuple[int, tuple[int, ...]]] = set()
        """Several groups, with ``sizes``: the (group, prefix) pairs published now."""
        self.group_of: dict[int, int] = {}
        """Several groups: block -> the group it was last allocated or hit in."""
        self.holders: dict[int, int] = {}
        """Several groups: block -> how many tables hold it."""
        self.held: dict[int, set[int]] = {}
        """Several groups: request -> the blocks its tables hold."""
        self.scheduling = -1
        """The request of the last ``schedule`` decision."""
        self.building: int | None = None
        self.scheduled: dict[int, list[int]] = {}
        """Requests the step being built has scheduled -> the blocks it allocated or published
        for them (the blocks their entries would write)."""
        self.writer: dict[int, int] = {}
        """Block -> the step that allocated it and has not executed yet (``WITHDRAWN``: its
        entry was withdrawn, nothing will write it until it is allocated again)."""
        self.in_flight = 0
        self.published: set[int] = set()
        """Blocks published now."""
        self.zombies: set[int] = set()
        """Published blocks of entries withdrawn from the step being built."""
        self.decision: object = None
        """The kind of the last decision while a step is built (``window_frees``)."""

    def observe(self, events: Iterable[Event]) -> None:
        for event in events:
            kind = event[0]
            if self.kinds:
                self._observe_groups(event)
                if self.sizes:
                    self._observe_shortened(event)
            if kind in ("schedule", "preempt", "abort", "finish", "begin", "submit"):
                self.decision = kind
            if kind == "alloc":
                block = event[2]
                if self.building is not None:
                    self.writer[block] = self.building  # type: ignore[index]
                    self.scheduled.setdefault(event[1], []).append(block)  # type: ignore[arg-type]
                else:
                    self.writer.pop(block, None)  # type: ignore[call-overload]
            elif kind == "hit":
                for block in event[2]:  # type: ignore[attr-defined]
                    step = self.writer.get(block)
                    if step is None:
                        continue
                    if step == WITHDRAWN:
                        self.zombie_hits += 1
                    elif step == self.building:
                        self.hit_same_step += 1
                    else:
                        self.hit_in_flight += 1
            elif kind == "publish":
                self.published.add(event[3])  # type: ignore[arg-type]
                if self.building is not None and event[1] in self.scheduled:
                    self.scheduled[event[1]].append(event[3])  # type: ignore[index,arg-type]
            elif kind == "schedule":
                self.scheduled.setdefault(event[1], [])  # type: ignore[arg-type]
                if len(event) > 3 and event[3]:
                    self.loads += 1
                    self.sync_loads += bool(event[2])
            elif kind == "preempt":
                withdrawn = self.scheduled.pop(event[1], None)  # type: ignore[call-overload]
                if withdrawn is not None:
                    self.preempt_building += 1
                    for block in withdrawn:
                        self.writer[block] = WITHDRAWN
                        if block in self.published:
                            self.zombies.add(block)
                self.preempt_at_depth[min(self.in_flight, MAX_DEPTH)] += 1
            elif kind == "begin":
                self.building = event[1]  # type: ignore[assignment]
                self.scheduled = {}
            elif kind == "submit":
                self.zombies_past_step += sum(
                    1
                    for block in self.zombies
                    if block in self.published and self.writer.get(block) == WITHDRAWN
                )
                self.zombies = set()
                self.building = None
                self.scheduled = {}
                self.in_flight += 1
            elif kind == "execute":
                step = event[1]
                self.writer = {b: s for b, s in self.writer.items() if s != step}
            elif kind == "commit":
                self.in_flight -= 1
                sampled = event[2]
                self.accepted_drafts += len(sampled) - len({r for r, _ in sampled})  # type: ignore[arg-type,misc]
            elif kind == "free" and self.building is not None and self.decision == "schedule":
                self.window_frees += 1
            elif kind == "snapshot":
                self.writer.pop(event[3], None)  # type: ignore[call-overload]
            elif kind == "evict":
                self.writer.pop(event[1], None)  # type: ignore[call-overload]
                self.published.discard(event[1])  # type: ignore[arg-type]
            elif kind == "unpublish":
                self.published.discard(event[1])  # type: ignore[arg-type]
            elif kind == "load_failed":
                self.load_failures += 1

    def _observe_groups(self, event: Event) -> None:
        """The group counters: tables' holders by the events, state hits, window frees."""
        kind, holders, fields_ = event[0], self.holders, _ints(event)
        if kind in DECISIONS:
            self.donor.clear()
        if kind == "schedule":
            self.scheduling = fields_[0]
        elif kind == "alloc":
            rid, block = fields_[0], fields_[1]
            self.group_of[block] = fields_[2] if len(fields_) > 2 else 0
            holders[block] = 1
            self.held.setdefault(rid, set()).add(block)
            self.track_of.pop(block, None)
            if self.kinds[self.group_of[block]] == "slot":
                self.own_slot[block] = rid
            self.cross_blocks += self.kinds[self.group_of[block]] == "cross"
        elif kind == "hit":
            blocks = event[2]
            assert isinstance(blocks, tuple)
            group = int(str(event[3])) if len(event) > 3 else 0
            for block in blocks:
                if block == 0:
                    continue
                self.group_of[block] = group
                holders[block] = holders.get(block, 0) + 1
                self.held.setdefault(fields_[0], set()).add(block)
                if self.kinds[group] == "state":
                    self.state_hits += 1
                elif self.kinds[group] == "slot":
                    self.slot_hits += 1
        elif kind == "track" and len(fields_) == 4:
            self.track_writes += 1
            self.track_of[fields_[1]] = fields_[0]
        elif kind == "snapshot" and len(fields_) == 4 and self.kinds[fields_[3]] == "slot":
            rid, block = fields_[0], fields_[2]
            if self.track_of.get(block) == rid:
                self.track_donations += 1
            elif self.own_slot.get(block) == rid or self.donor.get(block) == rid:
                self.snapshots_donated += 1
            else:
                self.snapshots_copied += 1
        elif kind == "evict" and fields_:
            self.own_slot.pop(fields_[0], None)
            self.track_of.pop(fields_[0], None)
        elif kind == "free":
            block = fields_[0]
            holders[block] = holders.get(block, 1) - 1
            owner = self.own_slot.pop(block, None)
            if owner is not None and self.decision == "finish":
                self.donor[block] = owner
            if self.decision == "preempt" and self.kinds[self.group_of.get(block, 0)] == "cross":
                self.cross_preempt_frees += 1
            if self.building is not None and self.decision == "schedule":
                mine = self.held.get(self.scheduling, set())
                mine.discard(block)
                group = self.group_of.get(block, 0)
                if self.kinds[group] in ("window", "chunked") and any(
                    holders.get(b, 0) > 1 and self.group_of.get(b) != group for b in mine
                ):
                    self.window_nulled_shared += 1
        elif kind in ("finish", "preempt", "abort", "load_failed"):
            self.held.pop(fields_[0], None)

    def _observe_shortened(self, event: Event) -> None:
        """``hits_shortened`` from the events: the published prefixes per group, each
        admission's hit (its group-0 ``hit``) against what a full group alone would serve."""
        kind = event[0]
        if kind == "arrive":
            self.tokens[int(str(event[1]))] = list(event[2])  # type: ignore[call-overload]
        elif kind == "commit":
            for rid, token in event[2]:  # type: ignore[attr-defined]
                self.tokens.setdefault(rid, []).append(token)
        elif kind == "publish":
            rid, index, block = (int(str(x)) for x in event[1:4])
            group = int(str(event[4])) if len(event) > 4 else 0
            end = (index + 1) * self.sizes[group]
            prefix = tuple(self.tokens.get(rid, ())[:end])
            if len(prefix) == end:
                self.group_published[block] = (group, prefix)
                self.prefixes.add((group, prefix))
        elif kind in ("evict", "unpublish"):
            gone = self.group_published.pop(int(str(event[1])), None)
            if gone is not None and gone not in self.group_published.values():
                self.prefixes.discard(gone)
        elif kind == "hit" and len(event) == 3:  # group 0's: the admission's first
            tokens = self.tokens.get(int(str(event[1])), [])
            hit = len(event[2]) * self.sizes[0]  # type: ignore[arg-type]
            cap = len(tokens) - 1  # a hit leaves the last token to compute
            for group, kind_ in enumerate(self.kinds):
                size, alone = self.sizes[group], 0
                while (
                    kind_ == "full"
                    and alone + size <= cap
                    and (group, tuple(tokens[: alone + size])) in self.prefixes
                ):
                    alone += size
                if alone > hit:
                    self.hits_shortened += 1
                    break


def _ints(event: Event) -> list[int]:
    """The event's int fields after its kind, in order (block ids, request ids, groups)."""
    return [x for x in event[1:] if isinstance(x, int) and not isinstance(x, bool)]
