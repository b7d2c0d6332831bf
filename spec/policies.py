"""Registration policies: when a block's hash becomes visible to prefix lookups, and what is undone
when the request that was to write it leaves (preemption, abort, failed KV load).

The engine calls six hooks at fixed points; each policy is the few lines below that say what it
does there. ``upto`` is a number of leading table blocks: "register blocks cached .. upto - 1".
A block is only ever registered under known tokens: under async scheduling a step's entry may run
into placeholders, so the registrations at schedule time stop at the known tokens, and the blocks
such a step completes are registered when it commits (``on_output``, vLLM's ``cache_blocks`` in
``update_from_output``: a no-op without placeholders). Draft tokens (speculative decoding) are
never hashed: registration stops at the known tokens, and after a commit it covers the accepted
drafts only (the rejected ones left the computed tokens). Without prefix caching
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
"""

from __future__ import annotations

from .pool import Event, count_if_lost, publish, unpublish
from .state import Entry, Request, State, Step

EAGER = ("eager-unsafe", "eager-rollback-single", "eager-rollback-fifo")


def register(s: State, req: Request, upto: int) -> tuple[list[Event], list[int]]:
    """Publish the request's blocks ``cached .. upto - 1``; return the events and the indices."""
    events: list[Event] = []
    indices = list(range(req.cached, upto))
    for i in indices:
        events += publish(s, req, i)
    req.cached = max(req.cached, upto)
    return events, indices


def on_begin(s: State, step: Step) -> list[Event]:
    if s.config.policy == "eager-rollback-single":
        s.single.clear()
    return []


def on_schedule(s: State, req: Request, step: Step, end: int) -> list[Event]:
    """The request was just given tokens up to ``end`` (computed or loaded) in ``step``. With
    ``delay_load_registration`` an asynchronous load registers nothing: its blocks are registered
    from ``req.cached`` on when the request is next scheduled, after the load has landed."""
    if not s.config.prefix_caching:
        return []
    if s.config.delay_load_registration and step.entries[req.id].load:
        return []
    policy, upto = s.config.policy, min(end, len(req.tokens)) // s.config.block_size
    if policy in EAGER:
        events, indices = register(s, req, upto)
        if policy == "eager-rollback-single":
            s.single.setdefault(req.id, []).extend(indices)
        elif policy == "eager-rollback-fifo":
            step.registrations.setdefault(req.id, []).extend(indices)
        return events
    if policy == "hide-uncommitted":
        step.registrations.setdefault(req.id, []).extend(range(req.cached, upto))
        req.cached = max(req.cached, upto)
    return []


def on_remove(s: State, req: Request) -> list[Event]:
    """The request leaves while it still holds its blocks: roll back what the policy tracks."""
    policy, events = s.config.policy, []
    tracked: list[int] = []
    if policy == "eager-rollback-single":
        tracked = s.single.pop(req.id, [])
    elif policy in ("eager-rollback-fifo", "hide-uncommitted"):
        for step in s.steps:
            tracked += step.registrations.pop(req.id, [])
    for i in tracked:
        if policy == "hide-uncommitted":
            count_if_lost(s, req.table[i], s.key(req, i), leaving=req)
        else:
            events += unpublish(s, req.table[i], leaving=req)
    return events


def on_confirmed(s: State, step: Step) -> list[Event]:
    """Top of the worker's output handling, before load failures (where PR 43569 commits)."""
    if s.config.policy == "eager-rollback-fifo":
        step.registrations.clear()
    return []


def on_written(s: State, step: Step) -> list[Event]:
    """After load failures are handled: what the step really wrote may become visible."""
    if not s.config.prefix_caching:
        return []
    events: list[Event] = []
    if s.config.policy == "hide-uncommitted":
        for rid, indices in step.registrations.items():
            req = s.requests[rid]
            for i in indices:
                events += publish(s, req, i)
        step.registrations.clear()
    elif s.config.policy == "deferred":
        for rid, entry in step.entries.items():
            req = s.requests[rid]
            if rid in step.live and rid not in step.failed and req.status == "running":
                upto = min(entry.end, len(req.tokens))  # never a draft token
                events += register(s, req, upto // s.config.block_size)[0]
    return events


def on_output(s: State, req: Request, entry: Entry, rejected: int = 0) -> list[Event]:
    """Async scheduling or speculative decoding: the running request's tokens sampled by
    ``entry``'s step were just appended; what that step wrote may become visible (vLLM's
    post-output ``cache_blocks``, capped at ``num_computed_tokens - num_in_flight_tokens``: the
    end of this entry less its ``rejected`` drafts, and never the last known token, whose K/V no
    step has computed yet: at a stop inside the accepted drafts vLLM trims to that). Not tracked
    for rollback: the step has written it. ``deferred`` registers at the next commit instead."""
    cfg = s.config
    if not cfg.prefix_caching or not (cfg.async_scheduling or cfg.spec_tokens):
        return []
    if cfg.policy not in EAGER + ("hide-uncommitted",):
        return []
    upto = min(entry.end - rejected, len(req.tokens) - 1)  # vLLM: num_computed_tokens
    return register(s, req, upto // cfg.block_size)[0]
