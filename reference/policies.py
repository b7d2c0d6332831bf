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

The five policies: ``eager-unsafe`` (vLLM 0.33.0), ``eager-rollback-single`` (PR 43569's first
version: one dict cleared when a step begins), ``eager-rollback-fifo`` (PR 43569: one bucket per
step, popped when the worker's output arrives), ``hide-uncommitted`` (eager bookkeeping, hidden
until written) and ``deferred`` (publish at commit what the step wrote). The unsafe ones are
implemented as they are, unsafe.
"""

from __future__ import annotations

from collections.abc import Iterable

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

    def known_upto(self, req: Request, end: int) -> int:
        """Leading blocks of tokens up to ``end`` that are full of known tokens."""
        tokens = len(req.tokens)
        return (end if end < tokens else tokens) // self.block_size


class PostOutput(Policy):
    """Registers, at commit under async scheduling, the blocks the committed entry completed
    (the eager policies and ``hide-uncommitted``; ``deferred`` does it in ``on_written``)."""

    __slots__ = ()

    def on_output(self, req: Request, entry: Entry, rejected: int = 0) -> None:
        """vLLM's ``cache_blocks(request, num_computed_tokens - num_in_flight_tokens)``: the
        entry's end less its rejected drafts, and never the newest token (not computed yet)."""
        end = entry.end - rejected
        known = len(req.tokens) - 1
        self.register(req, (end if end < known else known) // self.block_size)


class EagerUnsafe(PostOutput):
    __slots__ = ()

    def on_schedule(self, req: Request, step: Step, end: int) -> None:
        self.register(req, self.known_upto(req, end))


class EagerRollbackSingle(PostOutput):
    __slots__ = ("pending",)

    def __init__(self, kv: KVCacheManager) -> None:
        super().__init__(kv)
        self.pending: dict[int, list[int]] = {}

    def on_begin(self, step: Step) -> None:
        self.pending.clear()

    def on_schedule(self, req: Request, step: Step, end: int) -> None:
        indices = self.register(req, self.known_upto(req, end))
        self.pending.setdefault(req.rid, []).extend(indices)

    def on_remove(self, req: Request, steps: Iterable[Step]) -> None:
        table, unpublish = req.table, self.kv.pool.unpublish
        for i in self.pending.pop(req.rid, ()):
            unpublish(table[i])


class EagerRollbackFifo(PostOutput):
    __slots__ = ()

    def on_schedule(self, req: Request, step: Step, end: int) -> None:
        indices = self.register(req, self.known_upto(req, end))
        step.registrations.setdefault(req.rid, []).extend(indices)

    def on_remove(self, req: Request, steps: Iterable[Step]) -> None:
        table, unpublish = req.table, self.kv.pool.unpublish
        for step in steps:
            for i in step.registrations.pop(req.rid, ()):
                unpublish(table[i])

    def on_confirmed(self, step: Step) -> None:
        step.registrations.clear()


class HideUncommitted(PostOutput):
    __slots__ = ()

    def on_schedule(self, req: Request, step: Step, end: int) -> None:
        upto = self.known_upto(req, end)
        step.registrations.setdefault(req.rid, []).extend(range(req.cached, upto))
        if upto > req.cached:
            req.cached = upto

    def on_remove(self, req: Request, steps: Iterable[Step]) -> None:
        for step in steps:
            step.registrations.pop(req.rid, None)

    def on_written(self, step: Step, requests: dict[int, Request]) -> None:
        publish = self.kv.publish
        for rid, indices in step.registrations.items():
            req = requests[rid]
            if req.status == FINISHED:  # finished at an earlier commit (async): it left
                continue
            for i in indices:
                publish(req, i)
        step.registrations.clear()


class Deferred(Policy):
    __slots__ = ()

    def on_written(self, step: Step, requests: dict[int, Request]) -> None:
        live, failed = step.live, step.failed
        for rid, entry in step.entries.items():
            if rid in live and rid not in failed:
                req = requests[rid]
                if req.status == RUNNING:  # not preempted with its stale output delivered
                    self.register(req, self.known_upto(req, entry.end))  # never a draft


_POLICIES: dict[str, type[Policy]] = {
    "eager-unsafe": EagerUnsafe,
    "eager-rollback-single": EagerRollbackSingle,
    "eager-rollback-fifo": EagerRollbackFifo,
    "hide-uncommitted": HideUncommitted,
    "deferred": Deferred,
}


def make_policy(name: str, kv: KVCacheManager) -> Policy:
    return _POLICIES[name](kv)
