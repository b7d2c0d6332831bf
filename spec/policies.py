"""Registration policies: when a block's hash becomes visible to prefix lookups, and what is undone
when the request that was to write it leaves (preemption, abort, failed KV load).

A policy is a record of *traits* (``Traits``), one value per axis; the five policies are named
combinations in one registry (``POLICIES``). The engine calls six hooks at fixed points, and each
hook branches on the traits, never on a policy's name, so a new policy that combines existing
traits is one line in ``POLICIES``. The other forms of the spec (the fast model, the Z3 model)
branch on the same traits and refuse a trait value they do not follow (``kvspec/twins.py``); the
reference engine owns its own copy of the table (``reference/policies.py``), checked against this
one by ``tests/test_policy_traits.py``.

The axes (``AXES``):

* ``publish``, when a block becomes visible: ``at-schedule`` (as soon as a step is scheduled to
  write it), ``hidden-until-written`` (recorded at schedule in the step's bucket, hidden from
  lookups, made visible once the step's writes are confirmed: ``on_written``), ``at-written``
  (decided at commit from what the step really wrote);
* ``track``, what is remembered for a rollback: ``nothing``, ``one-dict`` (one dict of the
  registrations since it was last cleared, ``State.single``), ``per-step`` (one bucket per
  in-flight step, ``Step.registrations``);
* ``leave``, what happens to the tracked entries when their request leaves: ``nothing``,
  ``unpublish`` (roll the registrations back), ``drop-hidden`` (forget the hidden entries);
* ``clear``, when the tracking is "committed" (forgotten): ``never``, ``on-begin`` (a step
  begins), ``on-confirmed`` (top of the worker's output handling, before load failures),
  ``on-written`` (after load failures).

``upto`` is a number of leading table blocks: "register blocks cached .. upto - 1". A block is
only ever registered under known tokens: under async scheduling a step's entry may run into
placeholders, so the registrations at schedule time stop at the known tokens, and the blocks
such a step completes are registered when it commits (``on_output``, vLLM's ``cache_blocks`` in
``update_from_output``: a no-op without placeholders), by every policy that does not publish
``at-written`` (which registers them at the next commit instead). Draft tokens (speculative
decoding) are never hashed: registration stops at the known tokens, and after a commit it covers
the accepted drafts only (the rejected ones left the computed tokens). Without prefix caching
(``Config.prefix_caching`` off) every policy is the same: nothing is registered, tracked or
rolled back (``on_schedule``, ``on_written`` and ``on_output`` do nothing, so ``on_remove`` finds
nothing), and ``Request.cached`` stays 0, as vLLM's ``num_cached_block`` does.

============================  =================================================================
policy                        meaning
============================  =================================================================
eager-unsafe                  vLLM 0.33.0: publish at schedule time, never roll back.
eager-rollback-single         PR 43569's first version: remember this schedule's registrations
                              in one dict, cleared ("committed") when the next step begins;
                              roll back what is still there on preempt/abort/failure.
eager-rollback-fifo           PR 43569 as posted: one bucket per in-flight step; the oldest is
                              popped ("committed") at the top of the worker's output handling;
                              roll back the request's entries in every bucket.
hide-uncommitted              eager bookkeeping, but the entries stay invisible to lookups until
                              their step is confirmed (after load failures are handled); entries
                              of a leaving request are dropped.
deferred                      publish only at commit, and only what the step wrote.
============================  =================================================================

Under ``engine-registers`` (``state.OBSERVED_POLICIES``) the engine registers on its own
(``observed.py``): its record (``BY_ENGINE``) publishes ``by-engine``, which no hook follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import groups
from .pool import Event, count_if_lost, publish, unpublish
from .state import OBSERVED_POLICIES, Config, Entry, Request, State, Step

AXES: dict[str, tuple[str, ...]] = {
    "publish": ("at-schedule", "hidden-until-written", "at-written", "by-engine"),
    "track": ("nothing", "one-dict", "per-step"),
    "leave": ("nothing", "unpublish", "drop-hidden"),
    "clear": ("never", "on-begin", "on-confirmed", "on-written"),
}
"""Every trait axis and its values, in the order of the module's docstring."""


@dataclass(frozen=True, slots=True)
class Traits:
    """One registration policy as data: a value per axis of ``AXES``. Construction refuses a
    value outside its axis and a combination with no meaning (e.g. rolling back what nothing
    tracks), naming it."""

    publish: str
    track: str
    leave: str
    clear: str

    def __post_init__(self) -> None:
        for axis, values in AXES.items():
            value = getattr(self, axis)
            if value not in values:
                raise ValueError(f"unknown {axis} trait {value!r}; one of {', '.join(values)}")
        problem = incoherent(self)
        if problem:
            raise ValueError(f"traits {self.describe()} have no meaning: {problem}")

    def values(self) -> tuple[str, str, str, str]:
        """The traits as plain strings, in ``AXES`` order (what the reference engine takes)."""
        return (self.publish, self.track, self.leave, self.clear)

    def describe(self) -> str:
        return ", ".join(f"{axis}={getattr(self, axis)}" for axis in AXES)


def incoherent(t: Traits) -> str:
    """Why the combination means nothing, or "" when it is a policy."""
    if (t.track == "nothing") != (t.clear == "never"):
        return "tracking is cleared exactly when something is tracked"
    if (t.track == "nothing") != (t.leave == "nothing"):
        return "a leaving request's entries are undone exactly when something is tracked"
    if t.publish in ("at-written", "by-engine") and t.track != "nothing":
        return f"publish={t.publish} registers nothing before the commit to track"
    if t.publish == "hidden-until-written" and (
        t.track != "per-step" or t.leave != "drop-hidden" or t.clear != "on-written"
    ):
        return "hidden entries live in their step's bucket until it is written, dropped on leave"
    if t.leave == "drop-hidden" and t.publish != "hidden-until-written":
        return "only hidden entries can be dropped on leave"
    if t.track == "per-step" and t.clear == "on-begin":
        return "a step's bucket is cleared when that step is confirmed or written"
    return ""


POLICIES: dict[str, Traits] = {
    "eager-unsafe": Traits("at-schedule", "nothing", "nothing", "never"),
    "eager-rollback-single": Traits("at-schedule", "one-dict", "unpublish", "on-begin"),
    "eager-rollback-fifo": Traits("at-schedule", "per-step", "unpublish", "on-confirmed"),
    "hide-uncommitted": Traits("hidden-until-written", "per-step", "drop-hidden", "on-written"),
    "deferred": Traits("at-written", "nothing", "nothing", "never"),
}
"""The registration policies a strict judge follows, by name: THE registry (``Config.policy``,
the CLI's choices, the trace schema's enum and the reference engine's table are checked against
it)."""

BY_ENGINE = Traits("by-engine", "nothing", "nothing", "never")
"""The record of every policy in ``state.OBSERVED_POLICIES``: the engine registers by itself."""


def traits(config: Config) -> Traits:
    """The configuration's policy as traits; ``ValueError`` for a name in no registry."""
    found = POLICIES.get(config.policy)
    if found is not None:
        return found
    if config.policy in OBSERVED_POLICIES:
        return BY_ENGINE
    raise ValueError(f"unknown policy {config.policy!r}; one of {', '.join(POLICIES)}")


def eager(t: Traits) -> bool:
    """Blocks become visible when their step is scheduled: the policies that can publish what
    nobody will write (the unsafe ones, ``docs/model.md``)."""
    return t.publish == "at-schedule"


def registers_after_output(t: Traits) -> bool:
    """``on_output`` registers what a committed step completed (every policy that registers at
    schedule time, hidden or not; ``at-written`` does it at the next commit)."""
    return t.publish in ("at-schedule", "hidden-until-written")


def register(s: State, req: Request, upto: int) -> tuple[list[Event], list[int]]:
    """Publish the request's blocks ``cached .. upto - 1`` that have a key (``State.hashed``:
    with ``hash_lookahead`` a computed block waits for the tokens after it); return the events
    and the indices."""
    events: list[Event] = []
    upto = min(upto, s.hashed(req))
    indices = list(range(req.cached, upto))
    for i in indices:
        events += publish(s, req, i)
    req.cached = max(req.cached, upto)
    return events, indices


def _track(s: State, t: Traits, step: Step, rid: int, indices: list[int] | range) -> None:
    if t.track == "one-dict":
        s.single.setdefault(rid, []).extend(indices)
    elif t.track == "per-step":
        step.registrations.setdefault(rid, []).extend(indices)


def _track_groups(s: State, t: Traits, step: Step, rid: int, done: list[tuple[int, int]]) -> None:
    """``_track`` for groups 1 .. G - 1: (group, index) entries."""
    if t.track == "one-dict":
        s.group_single.setdefault(rid, []).extend(done)
    elif t.track == "per-step":
        step.group_registrations.setdefault(rid, []).extend(done)


def _clear(s: State, t: Traits, step: Step, hook: str) -> None:
    if t.clear != hook:
        return
    if t.track == "one-dict":
        s.single.clear()
        s.group_single.clear()
    elif t.track == "per-step":
        step.registrations.clear()
        step.group_registrations.clear()


def _groups_on_schedule(s: State, t: Traits, req: Request, step: Step, end: int) -> list[Event]:
    """``on_schedule`` for groups 1 .. G - 1: each group's blocks up to ``end``, under the same
    traits as group 0's (``groups.pending`` says which blocks a group makes registrable)."""
    if t.publish not in ("at-schedule", "hidden-until-written"):
        return []
    done = groups.pending(s, req, end, len(req.tokens))
    _track_groups(s, t, step, req.id, done)
    if t.publish == "hidden-until-written":
        return []
    return [e for g, i in done for e in groups.publish(s, req, g, i)]


def on_begin(s: State, step: Step) -> list[Event]:
    _clear(s, traits(s.config), step, "on-begin")
    return []


def on_schedule(s: State, req: Request, step: Step, end: int) -> list[Event]:
    """The request was just given tokens up to ``end`` (computed or loaded) in ``step``. With
    ``delay_load_registration`` an asynchronous load registers nothing: its blocks are registered
    from ``req.cached`` on when the request is next scheduled, after the load has landed."""
    if not s.config.prefix_caching:
        return []
    if s.config.delay_load_registration and step.entries[req.id].load:
        return []
    t, upto = traits(s.config), min(end, len(req.tokens)) // s.config.block_size
    if t.publish == "at-schedule":
        events, indices = register(s, req, upto)
        _track(s, t, step, req.id, indices)
        if s.config.hybrid:
            events += _groups_on_schedule(s, t, req, step, end)
        return events
    if t.publish == "hidden-until-written":
        upto = min(upto, s.hashed(req))
        _track(s, t, step, req.id, range(req.cached, upto))
        req.cached = max(req.cached, upto)
        if s.config.hybrid:
            _groups_on_schedule(s, t, req, step, end)
    return []


def on_remove(s: State, req: Request) -> list[Event]:
    """The request leaves while it still holds its blocks: undo what the policy tracks."""
    t, events = traits(s.config), []
    tracked: list[int] = []
    if t.track == "one-dict":
        tracked = s.single.pop(req.id, [])
    elif t.track == "per-step":
        for step in s.steps:
            tracked += step.registrations.pop(req.id, [])
    for i in tracked:
        if t.leave == "drop-hidden":
            count_if_lost(s, req.table[i], s.key(req, i), leaving=req)
        elif t.leave == "unpublish":
            events += unpublish(s, req.table[i], leaving=req)
    if s.config.hybrid:
        events += _groups_on_remove(s, t, req)
    return events


def _groups_on_remove(s: State, t: Traits, req: Request) -> list[Event]:
    """``on_remove`` for groups 1 .. G - 1 (a tracked position nulled since holds nothing)."""
    tracked: list[tuple[int, int]] = []
    if t.track == "one-dict":
        tracked = s.group_single.pop(req.id, [])
    elif t.track == "per-step":
        for step in s.steps:
            tracked += step.group_registrations.pop(req.id, [])
    events: list[Event] = []
    for g, i in tracked:
        block = s.table_of(req, g)[i]
        if block == groups.NULL_BLOCK:
            continue
        if t.leave == "drop-hidden":
            count_if_lost(s, block, groups.key(req, (i + 1) * groups.size(s, g)), leaving=req)
        elif t.leave == "unpublish":
            events += unpublish(s, block, leaving=req)
    return events


def on_confirmed(s: State, step: Step) -> list[Event]:
    """Top of the worker's output handling, before load failures (where PR 43569 commits)."""
    _clear(s, traits(s.config), step, "on-confirmed")
    return []


def on_written(s: State, step: Step) -> list[Event]:
    """After load failures are handled: what the step really wrote may become visible."""
    if not s.config.prefix_caching:
        return []
    t, events = traits(s.config), []
    if t.publish == "hidden-until-written":
        for rid, indices in step.registrations.items():
            req = s.requests[rid]
            for i in indices:
                events += publish(s, req, i)
            for g, i in step.group_registrations.get(rid, []):
                events += groups.publish(s, req, g, i)
    elif t.publish == "at-written":
        for rid, entry in step.entries.items():
            req = s.requests[rid]
            if rid in step.live and rid not in step.failed and req.status == "running":
                upto = min(entry.end, len(req.tokens))  # never a draft token
                events += register(s, req, upto // s.config.block_size)[0]
                if s.config.hybrid:
                    for g, i in groups.pending(s, req, entry.end, len(req.tokens)):
                        events += groups.publish(s, req, g, i)
    _clear(s, t, step, "on-written")
    return events


def on_output(s: State, req: Request, entry: Entry, rejected: int = 0) -> list[Event]:
    """Async scheduling or speculative decoding: the running request's tokens sampled by
    ``entry``'s step were just appended; what that step wrote may become visible (vLLM's
    post-output ``cache_blocks``, capped at ``num_computed_tokens - num_in_flight_tokens``: the
    end of this entry less its ``rejected`` drafts, and never the last known token, whose K/V no
    step has computed yet: at a stop inside the accepted drafts vLLM trims to that). Not tracked
    for rollback: the step has written it. ``at-written`` registers at the next commit instead."""
    cfg = s.config
    if not cfg.prefix_caching or not (cfg.async_scheduling or cfg.spec_tokens):
        return []
    if not registers_after_output(traits(cfg)):
        return []
    upto = min(entry.end - rejected, len(req.tokens) - 1)  # vLLM: num_computed_tokens
    events = register(s, req, upto // cfg.block_size)[0]
    if cfg.hybrid:
        for g, i in groups.pending(s, req, entry.end - rejected, len(req.tokens) - 1):
            events += groups.publish(s, req, g, i)
    return events
