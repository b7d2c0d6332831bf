"""Registration policies: when a block's hash becomes visible to prefix lookups, and what is
rolled back when the request that was to write it leaves (preemption, abort, failed load).

Hooks, called by the scheduler at fixed points:

* ``on_begin(step)``: a step starts being scheduled.
* ``on_schedule(req, step, end)``: the request was given tokens (or loaded blocks) up to ``end``.
* ``on_remove(req, steps)``: the request leaves while holding its blocks (``steps``: every
  step in flight, oldest first, the building one last).
* ``on_confirmed(step)``: top of the worker output handling, before load failures.
* ``on_written(step, requests)``: after load failures: what the step wrote may become visible.
* ``on_output(req, entry)``: async scheduling only: the running request's token sampled by
  ``entry``'s step was just appended; the eager policies and ``hide-uncommitted`` register what
  that step completed (vLLM's ``cache_blocks`` in ``update_from_output``), untracked for rollback.

A block is only ever registered under known tokens: registrations at schedule time stop at
them (``known_upto``), since under async scheduling an entry may run into placeholders.

A policy is its traits (``config.PolicyTraits``): ``TraitPolicy`` follows any combination of
the values in ``FOLLOWED``. The five named ones (``config.POLICIES``): ``eager-unsafe`` (vLLM
0.33.0), ``eager-rollback-single`` (PR 43569's first version: one dict cleared when a step
begins), ``eager-rollback-fifo`` (PR 43569: one bucket per step, popped when the worker's output
arrives), ``hide-uncommitted`` (eager bookkeeping, hidden until written) and ``deferred``
(publish at commit what the step wrote). The unsafe ones are implemented as they are, unsafe.
"""

from __future__ import annotations

from collections.abc import Iterable

from .config import PolicyTraits
from .kv_cache_manager import KVCacheManager
from .request import FINISHED, RUNNING, Entry, Request, Step


class Policy:
    """Base: never publishes; subclasses override the hooks they use."""

    __slots__ = ("kv", "block_size")

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.block_size = kv.block_size

    def register(self, req: Request, upto: int) -> range:
        """Publish the request's blocks ``cached .. upto - 1``."""
        indices = range(req.cached, upto)
        publish = self.kv.publish
        for i in indices:
            publish(req, i)
        if upto > req.cached:
            req.cached = upto
        return indices

    def on_begin(self, step: Step) -> None:
        pass

    def on_schedule(self, req: Request, step: Step, end: int) -> None:
        pass

    def on_remove(self, req: Request, steps: Iterable[Step]) -> None:
        pass

    def on_confirmed(self, step: Step) -> None:
        pass

    def on_written(self, step: Step, requests: dict[int, Request]) -> None:
        pass

    def on_output(self, req: Request, entry: Entry, rejected: int = 0) -> None:
        pass

    def on_committed(self, step: Step, requests: dict[int, Request]) -> None:
        """The end of the step's commit: every sampled token appended, every finish done."""

    def on_finish(self, req: Request, entry: Entry, later: bool) -> None:
        """The request finished at the commit of the step of ``entry`` (its tables given up);
        ``later``: a later submitted step still holds an entry of it (which will run)."""

    def known_upto(self, req: Request, end: int) -> int:
        """Leading blocks of tokens up to ``end`` that are full of known tokens."""
        tokens = len(req.tokens)
        return (end if end < tokens else tokens) // self.block_size


FOLLOWED: dict[str, tuple[str, ...]] = {
    "publish": ("at-schedule", "hidden-until-written", "at-written", "by-engine"),
    "track": ("nothing", "one-dict", "per-step"),
    "leave": ("nothing", "unpublish", "drop-hidden"),
    "clear": ("never", "on-begin", "on-confirmed", "on-written"),
}
"""The trait values this engine follows, per axis (``config.PolicyTraits``); any other is
refused by name when a policy is made."""


class TraitPolicy(Policy):
    """A policy made from its traits (``config.PolicyTraits``): each hook does what the traits
    say, with the decisions taken once, here, as flags."""

    __slots__ = (
        "at_schedule",
        "hidden",
        "at_written",
        "single",
        "per_step",
        "unpublish",
        "clear_begin",
        "clear_confirmed",
        "clear_written",
        "post_output",
        "pending",
        "pending_groups",
    )

    def __init__(self, kv: KVCacheManager, traits: PolicyTraits) -> None:
        for axis, value in zip(PolicyTraits._fields, traits, strict=True):
            if value not in FOLLOWED[axis]:
                raise ValueError(
                    f"the reference engine does not follow {axis}={value!r} "
                    f"(one of {', '.join(FOLLOWED[axis])})"
                )
        super().__init__(kv)
        self.at_schedule = traits.publish == "at-schedule"
        self.hidden = traits.publish == "hidden-until-written"
        self.at_written = traits.publish == "at-written"
        self.single = traits.track == "one-dict"
        self.per_step = traits.track == "per-step"
        self.unpublish = traits.leave == "unpublish"
        self.clear_begin = traits.clear == "on-begin"
        self.clear_confirmed = traits.clear == "on-confirmed"
        self.clear_written = traits.clear == "on-written"
        self.post_output = not self.at_written
        """Registers, at commit under async scheduling, the blocks the committed entry
        completed (every policy but ``at-written``, which does it in ``on_written``)."""
        self.pending: dict[int, list[int]] = {}
        """The one dict of ``one-dict`` tracking."""
        self.pending_groups: dict[int, list[tuple[int, int]]] = {}
        """Its (group, index) entries for groups 1 .. G - 1 (several KV-cache groups)."""

    def _clear(self, step: Step) -> None:
        if self.single:
            self.pending.clear()
            self.pending_groups.clear()
        elif self.per_step:
            step.registrations.clear()
            step.group_registrations.clear()

    def _groups(self, req: Request, step: Step, end: int) -> None:
        """Groups 1 .. G - 1 at schedule time (several KV-cache groups; ``groups.py``): what
        the step makes registrable is tracked as group 0's is, and published or hidden."""
        done = self.kv.group_pending(req, end, len(req.tokens))
        if not done:
            return
        if self.single:
            self.pending_groups.setdefault(req.rid, []).extend(done)
        elif self.per_step or self.hidden:
            step.group_registrations.setdefault(req.rid, []).extend(done)
        if self.at_schedule:
            for g, i in done:
                self.kv.publish_group(req, g, i)

    def on_begin(self, step: Step) -> None:
        if self.clear_begin:
            self._clear(step)

    def on_schedule(self, req: Request, step: Step, end: int) -> None:
        if self.at_schedule:
            indices = self.register(req, self.known_upto(req, end))
            if self.single:
                self.pending.setdefault(req.rid, []).extend(indices)
            elif self.per_step:
                step.registrations.setdefault(req.rid, []).extend(indices)
            if self.kv.grouped:
                self._groups(req, step, end)
        elif self.hidden:
            upto = self.known_upto(req, end)
            step.registrations.setdefault(req.rid, []).extend(range(req.cached, upto))
            if upto > req.cached:
                req.cached = upto
            if self.kv.grouped:
                self._groups(req, step, end)

    def on_remove(self, req: Request, steps: Iterable[Step]) -> None:
        tracked: list[int] = []
        tracked_groups: list[tuple[int, int]] = []
        if self.single:
            tracked = self.pending.pop(req.rid, [])
            tracked_groups = self.pending_groups.pop(req.rid, [])
        elif self.per_step:
            for step in steps:
                tracked += step.registrations.pop(req.rid, ())
                tracked_groups += step.group_registrations.pop(req.rid, ())
        if self.unpublish:  # else the hidden entries are dropped with the buckets
            unpublish_at = self.kv.unpublish_at
            for i in tracked:
                unpublish_at(req, i)
            for g, i in tracked_groups:
                self.kv.unpublish_group(req, g, i)

    def on_confirmed(self, step: Step) -> None:
        if self.clear_confirmed:
            self._clear(step)

    def on_written(self, step: Step, requests: dict[int, Request]) -> None:
        if self.hidden:
            publish = self.kv.publish
            for rid, indices in step.registrations.items():
                req = requests[rid]
                if req.status == FINISHED:  # finished at an earlier commit (async): it left
                    continue
                for i in indices:
                    publish(req, i)
                for g, i in step.group_registrations.get(rid, ()):
                    self.kv.publish_group(req, g, i)
        elif self.at_written:
            live, failed = step.live, step.failed
            for rid, entry in step.entries.items():
                if rid in live and rid not in failed:
                    req = requests[rid]
                    if req.status == RUNNING:  # not preempted with its stale output delivered
                        self.register(req, self.known_upto(req, entry.end))  # never a draft
                        for g, i in self.kv.group_pending(req, entry.end, len(req.tokens)):
                            self.kv.publish_group(req, g, i)
        if self.clear_written:
            self._clear(step)

    def on_output(self, req: Request, entry: Entry, rejected: int = 0) -> None:
        """vLLM's ``cache_blocks(request, num_computed_tokens - num_in_flight_tokens)``: the
        entry's end less its rejected drafts, and never the newest token (not computed yet)."""
        if self.post_output:
            end = entry.end - rejected
            known = len(req.tokens) - 1
            self.register(req, (end if end < known else known) // self.block_size)
            for g, i in self.kv.group_pending(req, end, known):
                self.kv.publish_group(req, g, i)


def make_policy(traits: PolicyTraits, kv: KVCacheManager) -> Policy:
    """The trait policy the traits describe (``EngineConfig.traits``). ``publish="by-engine"``
    is no trait policy but the engine's own registration (``own_registration.make_own``; the
    engine picks between the two)."""
    if traits.publish == "by-engine":
        raise ValueError(
            "publish=by-engine is the engine's own registration (own_registration.py), "
            "not a trait policy"
        )
    return TraitPolicy(kv, traits)
