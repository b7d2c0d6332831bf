"""The actions of the specification: one function per *decision* an engine makes.

Each action is a guard followed by an effect, as in a TLA+ module: the guard raises ``Illegal``
when the decision is not allowed in the current state (under the configured discipline and
preemption policy), the effect changes the state and returns the effect events it caused, in
order. The effects are deterministic, so a trace of decisions fixes everything else: which blocks
a lookup hits, which block id an allocation gets, what is published, freed and evicted.

Decision events (``apply`` takes these; see ``docs/events.md``)::

    ("arrive", req, prompt, max_tokens, priority)
    ("begin", step)                    start scheduling a step
    ("schedule", req, tokens, loaded)  give the request tokens to compute and/or blocks to load
    ("preempt", req)                   free a running request's blocks, send it back to waiting
    ("submit", step)                   hand the step to the worker
    ("execute", step, failed)          the worker writes, then reads; listed loads fail
    ("commit", step, sampled)          the worker's output: ((req, token), ...), a request
                                       listed once per token sampled (with draft tokens, 1 .. K + 1)
    ("abort", req)
    ("reset",)                         reset the prefix cache
    ("reset", True)                    reset it in the building step that preempted every
                                       running request, beside steps in flight

With ``Config.defer_free`` a request that leaves while a submitted step still computes for it
hands its blocks to a ``Deferred`` holder (``_give_up``), freed when the fence step commits
(``_drain``, first thing in ``commit``).
"""

from __future__ import annotations

from collections.abc import Callable

from . import admission, groups, policies, slots, tracks
from .pool import (
    Event,
    allocate,
    clear_table,
    free_blocks,
    free_table,
    holds,
    lookup,
    remove_skipped,
    resolve,
    touch,
)
from .state import (
    NULL_BLOCK,
    Deferred,
    Draft,
    Entry,
    Illegal,
    Placeholder,
    Request,
    State,
    Step,
    Touched,
    Write,
)


def arrive(
    s: State, rid: int, prompt: tuple[int, ...], max_tokens: int, priority: int, encoder: int = 0
) -> list[Event]:
    """A request arrives; ``encoder``: its encoder tokens, which a ``cross`` group's table holds
    (``groups.cross_blocks``; only where the model has such a group)."""
    if rid in s.requests:
        raise Illegal(f"arrive r{rid}: the id is taken")
    if not prompt or max_tokens < 1:
        raise Illegal(f"arrive r{rid}: empty prompt or max_tokens < 1")
    if encoder and not groups.has_cross(s):
        raise Illegal(f"arrive r{rid}: {encoder} encoder tokens but no cross-attention group")
    s.requests[rid] = Request(rid, list(prompt), len(prompt), max_tokens, priority, s.arrivals)
    s.requests[rid].encoder = encoder
    s.arrivals += 1
    s.waiting.append(rid)
    s.touched.requests.add(rid)
    return []


def begin(s: State, step_id: int) -> list[Event]:
    in_flight = len(s.steps)
    if s.building is not None or in_flight >= s.config.depth or step_id != s.next_step:
        raise Illegal(f"begin step {step_id}: {in_flight} in flight, depth {s.config.depth}")
    s.next_step += 1
    step = Step(step_id)
    s.steps.append(step)
    s.touched.steps = True
    return policies.on_begin(s, step)


def schedule(
    s: State, rid: int, num_tokens: int, num_loaded: int = 0, bound: int | None = None
) -> list[Event]:
    """Give a request ``num_tokens`` tokens to compute in the building step; a waiting request is
    admitted first (prefix lookup, hits touched before anything is allocated). An admission may
    instead load ``num_loaded`` full blocks from an external KV store after its hits: with no
    tokens to compute the load is asynchronous (the request waits for the step's commit, and the
    load may fail at ``execute``); with tokens computed after the loaded blocks it is synchronous
    (the worker lands it before the forward pass reads it, in the same step; it never fails).
    An asynchronous load may end at the last known token when that token's block is full: the
    request then recomputes that token over the loaded block (``loadable``).
    With async scheduling the tokens may run past the known ones into placeholders, one per step
    in flight that samples for the request (``State.ahead``); the step's writes there hold the
    placeholder until its sampling step commits. With speculative decoding
    (``Config.spec_tokens``) an entry that computes the last known token (under async
    scheduling the last of ``ahead``: the placeholders of a step in flight include its drafts,
    as if all were accepted) may also reach up to K draft slots past it (``Draft``; vLLM pads
    an admission's single token with K drafts too); they are computed, never hashed.
    An admission's decision may carry ``bound``, the engine's bound on its prefix-cache hit in
    tokens (an input it observed: an aux output connector's cap, a request's bounded or skipped
    read): the hit is then ``lookup``'s under that bound (the bounded-hit rule); a bound on a
    running request, which looks nothing up, is illegal."""
    step, req, cfg = _building(s, f"schedule r{rid}"), _request(s, rid), s.config
    bsz = cfg.block_size
    where = f"schedule r{rid} in step {step.id}"
    if rid in step.entries or req.loading is not None or req.status == "finished":
        raise Illegal(f"{where}: already scheduled, loading, or finished")
    if num_tokens < 0 or num_loaded < 0 or step.budget_used + num_tokens > cfg.token_budget:
        raise Illegal(f"{where}: {num_tokens} tokens exceed the budget or are negative")
    if num_tokens == 0 and num_loaded == 0:
        raise Illegal(
            f"{where}: either compute tokens or (on admission) load blocks; neither given"
        )
    if bound is not None and (type(bound) is not int or bound < 0 or req.status != "waiting"):
        raise Illegal(f"{where}: a hit bound {bound!r} on no admission, or not a count >= 0")
    events: list[Event] = []
    if req.status == "waiting":
        admission.reorder_once(s, step)
        _admission_guard(s, step, req, where)
        if num_loaded and (
            cfg.hybrid or cfg.chunk is not None or (cfg.window is not None and num_tokens == 0)
        ):
            raise Illegal(
                f"{where}: asynchronous loads under a window, and loads under groups or a "
                "chunked group, are not modelled"
            )
        if bound is not None and cfg.hybrid:
            raise Illegal(f"{where}: a bounded hit across groups is not modelled")
        others: list[list[int]] = []
        if cfg.hybrid and s.steered_hits is not None:  # observed: the engine's own hits
            hits, *others = s.steered_hits
            s.steered_hits = None
        elif cfg.hybrid:  # the hit every group serves (groups.hit_length), each by its own rule
            length = groups.hit_length(s, req)
            hits = groups.hits_at(s, req, 0, length)
            others = [groups.hits_at(s, req, g, length) for g in range(1, len(cfg.groups))]
        else:
            hits = lookup(s, req, bound)
        if len(hits) + num_loaded > loadable(len(req.tokens), bsz, num_tokens == 0):
            raise Illegal(f"{where}: the last known token must be computed, not loaded")
        start = len(hits) * bsz
        end = start + num_tokens + num_loaded * bsz
        head = window_head(s, hits, num_loaded)
        hits, skipped_loads = head[: len(hits)], head[len(hits) :]
        touched = groups.referenced(s, others) if cfg.hybrid else []  # a slot's hit is copied
        hit = [b for h in [hits, *touched] for b in h if b != NULL_BLOCK]
        held_free = sum(1 for b in set(hit) if s.blocks[b].refcount == 0)
        more = groups.needed(s, others, end, req.encoder) if cfg.hybrid else 0
        if -(-end // bsz) - len(head) + more > len(s.free) - held_free:
            raise Illegal(f"{where}: not enough free blocks")
        events += touch(s, req, hits)
        req.table += skipped_loads  # null blocks: nothing to touch, nothing hit
        if cfg.hybrid:
            events += groups.admit(s, req, others)
            s.admission = (rid, start, (tuple(hits), *map(tuple, others)))
        req.cached = len(head)
        s.waiting.remove(rid)
        s.running.append(rid)
        req.status, step.admitted = "running", True
        req.preempted = False
    else:
        if num_loaded:
            raise Illegal(f"{where}: only an admission may load blocks")
        if cfg.discipline == "vllm" and step.admitted:
            raise Illegal(f"{where}: vllm schedules running requests before admitting any")
        start, end = req.computed, req.computed + num_tokens
        processed = max(0, req.computed - _in_flight(s, rid))
        skipped = req.table[: min(s.skipped(processed), len(req.table))]
        gone = sum(1 for b in skipped if b != NULL_BLOCK and s.blocks[b].refcount == 1)
        more = 0
        if cfg.hybrid:
            gone += groups.gone(s, req, processed)
            more = groups.needed(s, req.group_tables, end, req.encoder)
        if -(-end // bsz) - len(req.table) + more > len(s.free) + gone:
            raise Illegal(f"{where}: not enough free blocks")
        events += remove_skipped(s, req, processed)
        if cfg.hybrid:
            events += groups.remove_skipped(s, req, processed)
    tokens: list[int | Placeholder | Draft] = list(
        s.ahead(req) if cfg.async_scheduling else req.tokens
    )
    drafts = end - len(tokens) if cfg.spec_tokens else 0
    if 0 < drafts <= cfg.spec_tokens and start < len(tokens):  # its last sample is not pending
        tokens += [Draft(step.id, rid, j) for j in range(drafts)]
    if end > len(tokens):
        known = "known yet" if not cfg.async_scheduling else "known nor a step's placeholder"
        raise Illegal(f"{where}: token {end - 1} is not {known}, nor one of its draft slots")
    while len(req.table) * bsz < end:
        events += allocate(s, req)
    prefixes: tuple[tuple[int, ...], ...] = ()
    if cfg.hybrid:
        more_events, prefixes = groups.schedule(s, req, step, start, end, tokens)
        events += more_events
    load = num_loaded > 0 and num_tokens == 0  # asynchronous: the request waits for it
    span = -(-end // bsz)  # after rejected drafts the table may reach further: not written
    for i in range(start // bsz, span):
        if req.table[i] == NULL_BLOCK:  # a loaded position before the window: not loaded
            continue
        prefix = tuple(tokens[: min(end, (i + 1) * bsz)])
        s.blocks[req.table[i]].pending.append(Write(step.id, rid, prefix, load))
        s.touched.content.add(req.table[i])
    s.touched.requests.add(rid)
    s.touched.entries.add((step.id, rid))
    req.loaded_last = load and end == len(tokens)
    req.computed = end - 1 if req.loaded_last else end  # recomputed over the load
    samples = not load and end == len(tokens)
    step.entries[rid] = Entry(
        start, end, tuple(req.table[:span]), load, samples, max(drafts, 0), num_loaded, prefixes
    )
    step.live.add(rid)
    step.budget_used += num_tokens
    if load:
        req.loading = step.id
    return events + policies.on_schedule(s, req, step, end)


def preempt(s: State, rid: int) -> list[Event]:
    step, req, cfg = _building(s, f"preempt r{rid}"), _request(s, rid), s.config
    where = f"preempt r{rid} in step {step.id}"
    if req.status != "running":
        raise Illegal(f"{where}: not running")
    if cfg.discipline == "vllm":
        if step.admitted:
            raise Illegal(f"{where}: vllm never preempts after admitting in the same step")
        if cfg.preemption == "fcfs" and (rid != s.running[-1] or rid in step.entries):
            raise Illegal(f"{where}: fcfs preempts the unscheduled tail of running")
        if cfg.preemption == "priority" and rid != max(s.running, key=lambda r: _rank(s, r)):
            raise Illegal(f"{where}: priority preempts the max (priority, arrival)")
        if _fence(s, rid, None) is not None:
            raise Illegal(f"{where}: vllm never preempts a request whose free would be deferred")
    step.preempted = True
    step.victims.append(rid)
    s.touched.left.add(rid)
    events = _leave(s, req, stale=_stale_mode(s, rid))
    s.running.remove(rid)
    s.waiting.insert(0, rid)
    req.status = "waiting"
    req.preempted = bool(cfg.admission_window)  # its one reader: spec/admission.py
    return events


def trim(s: State, rid: int) -> list[Event]:
    """The running request's skipped blocks (a window's before the window of its next processed
    token, a state group's before the state it resumes from) are freed and nulled, the frees
    its next schedule in the building step would make first (``remove_skipped``): vLLM's
    ``allocate_slots`` makes them, then finds no room and preempts, so they come before the
    preemption's frees. Its schedule then frees nothing more. Only with a window or groups."""
    step, req, cfg = _building(s, f"trim r{rid}"), _request(s, rid), s.config
    where = f"trim r{rid} in step {step.id}"
    if not cfg.local and not cfg.hybrid:
        raise Illegal(f"{where}: no window or state group (nor a chunked one) has blocks to trim")
    if req.status != "running" or rid in step.entries:
        raise Illegal(f"{where}: not running, or already scheduled in this step")
    processed = max(0, req.computed - _in_flight(s, rid))
    events = remove_skipped(s, req, processed)
    if cfg.hybrid:
        events += groups.remove_skipped(s, req, processed)
    return events


def submit(s: State, step_id: int) -> list[Event]:
    step = _building(s, f"submit step {step_id}")
    if step.id != step_id:
        raise Illegal(f"submit step {step_id}: step {step.id} is building")
    admission.reorder_once(s, step)  # a step that admitted nothing reorders all the same
    step.phase = "submitted"
    s.touched.steps = True
    return []


def execute(s: State, step_id: int, failed: tuple[int, ...] = ()) -> list[Event]:
    """The worker runs the oldest unexecuted step: every write of the batch, then every read."""
    step = next((st for st in s.steps if st.phase != "executed"), None)
    if step is None or step.id != step_id or step.phase != "submitted":
        raise Illegal(f"execute step {step_id}: not the oldest submitted step")
    if any(rid not in step.entries or not step.entries[rid].load for rid in failed):
        raise Illegal(f"execute step {step_id}: only external loads can fail")
    waits = _unverified(s, step)
    if waits is not None:
        raise Illegal(
            f"execute step {step_id}: r{waits[1]}'s positions wait for step {waits[0]}'s "
            "accepted drafts (commit it first)"
        )
    bsz = s.config.block_size
    step.failed = tuple(failed)
    s.touched.steps = True
    if s.copies:  # slot groups: the step's copies run first (spec/slots.py)
        slots.run_copies(s, step)
    stale = groups.read_states(s, step) if s.config.hybrid else ()  # before the step's writes
    for rid, e in step.entries.items():
        for block in e.blocks[e.start // bsz :]:
            if block == NULL_BLOCK:  # WindowLoad: a loaded position before the window
                continue
            s.touched.content.add(block)
            b = s.blocks[block]
            mine = [w for w in b.pending if w.step == step.id and w.req == rid]
            b.pending = [w for w in b.pending if not (w.step == step.id and w.req == rid)]
            if rid not in failed:
                b.written = mine[-1].prefix
        if e.group_blocks:
            groups.write(s, step, rid, e)
    for rid, e in step.entries.items():
        if e.load:  # a load reads nothing
            continue
        tokens = tuple(s.seen(s.requests[rid], step.id, e)[: e.end])
        lo = s.first_read(e.start + e.loaded * bsz)  # a window reads only from there
        bad = [
            block
            for i, block in enumerate(e.blocks)
            if i >= lo and not holds(s.blocks[block].written, tokens[: (i + 1) * bsz])
        ]
        if bad and rid in step.live:
            s.bad_reads += [(step.id, rid, block) for block in bad]
        if e.group_blocks and (groups.read(s, step, rid, e, tokens) or rid in stale):
            bad.append(NULL_BLOCK)  # a group read the wrong bytes (recorded there)
        if bad:  # K/V computed from wrong inputs is wrong too
            for block in e.blocks[e.start // bsz :]:
                if block != NULL_BLOCK:
                    s.blocks[block].written = None
            if e.group_blocks:
                groups.spoil(s, e)
        if s.config.slots:  # a slot group's track writes land after the reads (spec/tracks.py)
            tracks.run_tracks(s, step, rid, bool(bad))
    step.phase = "executed"
    return []


def commit(s: State, step_id: int, sampled: tuple[tuple[int, int], ...]) -> list[Event]:
    """Process the oldest step's output: load failures, then registrations, then each request's
    sampled token (finishing it at max_tokens or the stop token, which frees its blocks)."""
    if (
        s.building is not None
        or not s.steps
        or s.steps[0].id != step_id
        or s.steps[0].phase != "executed"
    ):
        raise Illegal(f"commit step {step_id}: not the oldest executed step, or a step is building")
    step = s.steps[0]
    s.touched.steps = True
    s.touched.requests.update(step.entries)
    for rid in step.failed:  # its blocks stop being excused by NoUnwrittenPublish
        e = step.entries[rid]
        s.touched.content.update(e.blocks[e.start // s.config.block_size :])
    expected = [rid for rid, e in step.entries.items() if e.samples and rid in step.live]
    tokens: dict[int, list[int]] = {}
    for rid, token in sampled:
        tokens.setdefault(rid, []).append(token)
    if sorted(tokens) != sorted(expected) or any(
        len(got) > 1 + step.entries[rid].drafts for rid, got in tokens.items()
    ):
        raise Illegal(
            f"commit step {step_id}: samples for {sorted(tokens)}, expected {sorted(expected)}"
            " (one each, or up to one more than its draft tokens)"
        )
    events = _drain(s, step) + policies.on_confirmed(s, step)
    moved: list[tuple[int, int]] = []  # (request, rejected drafts) with later steps holding it
    for rid, e in step.entries.items():
        req = s.requests[rid]
        if e.load and req.loading == step.id:
            req.loading = None
            if rid in step.failed:  # simplification: recompute the request from scratch
                events += _leave(s, req, committing=step) + [("load_failed", rid)]
                s.touched.left.add(rid)
                s.running.remove(rid)
                s.waiting.insert(0, rid)
                req.status = "waiting"
    events += policies.on_written(s, step)
    for rid in expected:
        req, entry, got = s.requests[rid], step.entries[rid], tokens[rid]
        running = req.status == "running"  # else preempted, its stale output delivered
        rejected = entry.drafts - (len(got) - 1)
        if running:  # rejected drafts leave the computed tokens (vLLM's num_rejected)
            req.computed -= rejected
        for slot, token in enumerate(got[:-1]):  # accepted drafts: the guess was the token
            resolve(s, Draft(step.id, rid, slot), token)
        if not rejected:  # else its own token is not where later steps placed it: re-laid
            resolve(s, Placeholder(step.id, rid), got[-1])
        elif any(rid in later.entries for later in s.steps[1:]):
            moved.append((rid, rejected))
        reason = None
        for token in got:  # appended up to a stop (the rest of the list is dropped)
            req.tokens.append(token)
            reason = "length" if req.output_len >= req.max_tokens else None
            if token == s.config.stop_token:
                reason = "stop"
            if reason:
                break
        if running:
            events += policies.on_output(s, req, entry, rejected)
        if reason:
            events += _give_up(s, req, committing=step, finishing=True)
            events.append(("finish", rid, reason))
            (s.running if running else s.waiting).remove(rid)
            req.status = "finished"
            s.touched.left.add(rid)
            for later in s.steps[1:]:  # their output for it is stale: discarded, and what
                later.live.discard(rid)  # they were to publish for it is dropped (it left)
                later.registrations.pop(rid, None)
                later.group_registrations.pop(rid, None)
    s.steps.pop(0)
    s.commits += 1
    for rid, rejected in moved:
        _move_back(s, s.requests[rid], rejected)
    return events


def _unverified(s: State, step: Step) -> tuple[int, int] | None:
    """Drafts under async scheduling: (earlier step, request) when an earlier step in flight
    samples for one of ``step``'s requests with drafts whose acceptance the spec learns only at
    that step's commit; ``step``'s positions for the request depend on it (vLLM's model runner
    moves them back over the rejected drafts on the device), so it executes after that commit.
    None when nothing holds it back."""
    if not (s.config.async_scheduling and s.config.spec_tokens):
        return None
    for earlier in s.steps:
        if earlier is step:
            break
        for rid, e in earlier.entries.items():
            if e.drafts and e.samples and rid in earlier.live and rid in step.entries:
                return earlier.id, rid
    return None


def _move_back(s: State, req: Request, rejected: int) -> None:
    """Drafts under async scheduling: the step that just committed rejected ``rejected`` of
    ``req``'s drafts, and the later steps in flight were scheduled as if it had accepted all of
    them. Their entries for the request (live ones: the others' output is discarded) move back
    by that many positions, as vLLM's model runner moves them on the device (and its scheduler
    rolls back ``num_computed_tokens`` and ``num_output_placeholders``): each computes its first
    position from the token just sampled, where the first rejected draft was. Their writes are
    laid again at the new positions, over the same table prefix; none has executed yet
    (``execute`` waits for this commit)."""
    bsz = s.config.block_size
    for st in s.steps:
        e = st.entries.get(req.id)
        if e is None or req.id not in st.live:
            continue
        for block in e.blocks:
            b = s.blocks[block]
            b.pending = [w for w in b.pending if not (w.step == st.id and w.req == req.id)]
            s.touched.content.add(block)
        e.start -= rejected
        e.end -= rejected
        span = -(-e.end // bsz)
        e.blocks = e.blocks[:span]
        tokens = s.seen(req, st.id, e)
        for i in range(e.start // bsz, span):
            prefix = tuple(tokens[: min(e.end, (i + 1) * bsz)])
            pending = s.blocks[e.blocks[i]].pending  # oldest step first
            at = next((j for j, w in enumerate(pending) if w.step > st.id), len(pending))
            pending.insert(at, Write(st.id, req.id, prefix, e.load))
        s.touched.entries.add((st.id, req.id))
    s.touched.requests.add(req.id)


def abort(s: State, rid: int) -> list[Event]:
    req = _request(s, rid)
    if s.building is not None or req.status == "finished":
        raise Illegal(f"abort r{rid}: finished already, or a step is building")
    events = _leave(s, req, finishing=True)
    (s.running if req.status == "running" else s.waiting).remove(rid)
    req.status = "finished"
    s.touched.left.add(rid)
    return events + [("finish", rid, "abort")]


def reset(s: State, preempting: bool = False) -> list[Event]:
    """Reset the prefix cache: only when no block is in use and no step is in flight. With
    ``preempting`` (vLLM's ``reset_prefix_cache(reset_running_requests=True)``), in the building
    step that preempted every running request and scheduled nothing, beside steps in flight: a
    reset discards the output in flight of the requests it preempts (their later resume
    resamples those positions), then unpublishes as ever."""
    if preempting is True:
        step = _building(s, "reset preempting running requests")
        if step.entries or s.running or any(b.refcount for b in s.blocks):
            raise Illegal(
                f"reset preempting running requests in step {step.id}: it scheduled something, "
                "requests still run or blocks are in use"
            )
        for st in s.steps:  # the rule: the victims' output in flight is dropped
            st.live.difference_update(step.victims)
        s.touched.steps = True
        s.touched.requests.update(step.victims)
    elif preempting is not False:
        raise Illegal(f"malformed decision ('reset', {preempting!r})")
    elif s.steps or any(b.refcount for b in s.blocks):
        raise Illegal("reset: blocks are in use or steps in flight")
    events: list[Event] = []
    indexes = [s.index, *s.group_index.values()]
    for block in sorted(b for index in indexes for blocks in index.values() for b in blocks):
        s.blocks[block].key = None
        s.touched.blocks.add(block)
        events.append(("unpublish", block))
    for index in indexes:
        index.clear()
    return events


ACTIONS: dict[str, Callable[..., list[Event]]] = {
    "arrive": arrive,
    "begin": begin,
    "schedule": schedule,
    "preempt": preempt,
    "trim": trim,
    "submit": submit,
    "execute": execute,
    "commit": commit,
    "abort": abort,
    "reset": reset,
}


def apply(s: State, event: tuple[object, ...]) -> list[Event]:
    """Take one decision event; return the effect events it causes."""
    action = ACTIONS.get(str(event[0])) if event else None
    if action is None:
        raise Illegal(f"unknown decision {event!r}")
    s.touched = Touched()
    if s.admission is not None:
        s.admission = None
    try:
        return action(s, *event[1:])
    except TypeError as err:
        raise Illegal(f"malformed decision {event!r}: {err}") from None


def waiting_order(s: State) -> list[int]:
    """The order vLLM admits waiting requests in: queue order (fcfs), or (priority, arrival),
    skipping those not admissible yet (vLLM skips them and goes on down the queue)."""
    order = [rid for rid in s.waiting if admissible(s, rid)]
    if s.config.preemption == "priority":
        return sorted(order, key=lambda r: _rank(s, r))
    return order


def admissible(s: State, rid: int) -> bool:
    """Whether a waiting request may be admitted: with stale output delivered, not while a step
    in flight still holds it with its output used (yet to be appended to its tokens; output a
    reset dropped is not)."""
    return s.config.stale_output != "deliver" or not any(
        rid in st.entries and rid in st.live for st in s.steps
    )


def _stale_mode(s: State, rid: int) -> str:
    """What a preemption does with the request's output in flight: the configured mode, except
    that output already dropped stays dropped, and with it the rest (vLLM's sticky
    ``drop_stale_output`` while a dropped share is undrained): only after a reset dropped it."""
    dropped = any(rid in st.entries and rid not in st.live for st in s.steps)
    return "drop" if dropped else s.config.stale_output


def _admission_guard(s: State, step: Step, req: Request, where: str) -> None:
    if len(s.running) >= s.config.max_running:
        raise Illegal(f"{where}: {len(s.running)} requests already running")
    if not admissible(s, req.id):
        raise Illegal(f"{where}: its stale output of a step in flight is still to be delivered")
    if s.config.discipline == "vllm":
        if step.preempted:
            raise Illegal(f"{where}: vllm admits nothing in a step that preempted")
        if req.id != waiting_order(s)[0]:
            raise Illegal(f"{where}: vllm admits the head of the waiting queue first")


def _in_flight(s: State, rid: int) -> int:
    """Tokens the request's entries in steps not yet committed schedule (vLLM's
    ``num_in_flight_tokens``: counted at schedule, drained at each step's output, stale
    entries of a preempted request included). A load's tokens are not scheduled tokens: vLLM
    counts them computed at once (``WindowLoad``)."""
    bsz = s.config.block_size
    return sum(
        st.entries[rid].end - st.entries[rid].start - st.entries[rid].loaded * bsz
        for st in s.steps
        if rid in st.entries
    )


def window_head(s: State, hits: list[int], num_loaded: int) -> list[int]:
    """``WindowLoad``: the head of an admitted request's table under a sliding window. Its
    ``hits`` and ``num_loaded`` loaded blocks count as computed at once, so the positions wholly
    before the window of the token after all of them hold the null block (vLLM's
    ``add_local_computed_blocks`` pads ``get_num_skipped_tokens(local + external)``): hits
    there are not touched, and loaded blocks there are neither allocated nor loaded (its
    ``allocate_external_computed_blocks`` allocates only those after). The returned head is
    the hits, nulled in front, and nulls for the skipped loaded positions after them (no
    part of the hit: the ``hit`` event names the hits' positions only)."""
    pad = min(s.skipped((len(hits) + num_loaded) * s.config.block_size), len(hits) + num_loaded)
    return [NULL_BLOCK] * pad + hits[pad:]


def _leave(
    s: State,
    req: Request,
    stale: str = "drop",
    committing: Step | None = None,
    finishing: bool = False,
) -> list[Event]:
    """The request gives up its blocks early (preempt, abort, failed load). Its part in the
    building step is withdrawn, so that step will not write it; submitted steps still will, and
    their output for it is dropped, or with ``stale="deliver"`` (a preemption, vLLM's default)
    still used: its reads matter and its sampled token is appended when the step commits."""
    step = s.building
    if step is not None and req.id in step.entries:
        entry = step.entries.pop(req.id)
        step.budget_used -= entry.end - entry.start - entry.loaded * s.config.block_size
        for block in (*entry.blocks, *(b for blocks in entry.group_blocks for b in blocks)):
            b = s.blocks[block]
            b.pending = [w for w in b.pending if not (w.step == step.id and w.req == req.id)]
            s.touched.content.add(block)
        if s.config.slots:  # and its track writes (spec/tracks.py)
            tracks.withdraw(s, step, req.id)
    for st in s.steps:
        if stale == "drop" or st is step:
            st.live.discard(req.id)
    events = policies.on_remove(s, req)
    req.loading = None
    return events + _give_up(s, req, committing, finishing)


def _give_up(
    s: State, req: Request, committing: Step | None = None, finishing: bool = False
) -> list[Event]:
    """The request lets go of its table (it leaves, or finishes at ``committing``'s commit).
    Freed at once, unless ``Config.defer_free`` and a submitted step other than ``committing``
    still computes for it: then the table's blocks keep their references in a ``Deferred``
    holder fenced by the newest submitted step that computes anything, and the request holds
    nothing from now on (vLLM's ``pop_blocks_for_free`` and ``deferred_frees``). A fence is
    never older than an earlier one, so the holders drain in order. ``WindowFinish``
    (``Config.trim_at_finish``, a request ``finishing``): its skipped blocks are freed first,
    at once (``_trim_at_finish``)."""
    events = _trim_at_finish(s, req, committing) if finishing else []
    fence = _fence(s, req.id, committing)
    if fence is None:
        if s.config.hybrid:  # group by group (groups.free_groups)
            return events + free_table(s, req) + groups.free_groups(s, req)
        return events + free_table(s, req)
    held = tuple(b for b in req.table if b != NULL_BLOCK)  # a window's nulls hold nothing
    if held:  # nothing to hold for a request that holds nothing (vLLM appends no entry)
        s.deferred.append(Deferred(fence, req.id, held))
        s.touched.blocks.update(req.table)
    clear_table(s, req)
    return events


def _trim_at_finish(s: State, req: Request, committing: Step | None) -> list[Event]:
    """``WindowFinish``: with ``Config.trim_at_finish`` a finishing request's blocks wholly before
    the window of the token after its processed ones are freed, as one batch, before the rest of
    its table (vLLM's ``_connector_finished``: ``remove_skipped_blocks`` on
    ``num_computed_tokens - num_in_flight_tokens``, the committing step's tokens drained
    already). No step in flight reads them. Nothing without the field, or for a request that
    holds no table (waiting)."""
    if not s.config.trim_at_finish or req.status != "running":
        return []
    bsz = s.config.block_size
    own = committing.entries.get(req.id) if committing is not None else None
    settled = own.end - own.start - own.loaded * bsz if own is not None else 0
    return remove_skipped(s, req, max(0, req.computed - _in_flight(s, req.id) + settled))


def _fence(s: State, rid: int, committing: Step | None) -> int | None:
    """``Config.defer_free``: the step whose commit frees what request ``rid`` gives up now, or
    None to free it at once. None unless a submitted step in flight (``committing`` aside: its
    writes have run) computes tokens for the request (vLLM's ``last_sched_seq`` past
    ``processed_step_seq``; a load-only entry computes none), or, with ``Config.defer_loads``,
    its asynchronous load still waits to start: a submitted step older than the load's that
    computes is in flight (vLLM's ``deferred_loads``: the load was deferred at admission, and
    ``last_sched_seq`` set to that step's sequence number); then the newest submitted step
    that computes any (vLLM's ``sched_step_seq``, which steps with no tokens do not advance)."""
    if not s.config.defer_free:
        return None
    bsz = s.config.block_size
    submitted = [st for st in s.steps if st.phase != "building" and st is not committing]
    writers = [st for st in submitted if st.budget_used > 0]
    for st in submitted:
        e = st.entries.get(rid)
        if e is None:
            continue
        if not e.load and e.end - e.start - e.loaded * bsz > 0:
            return writers[-1].id
        if e.load and s.config.defer_loads and writers and writers[0].id < st.id:
            return writers[-1].id
    return None


def _drain(s: State, step: Step) -> list[Event]:
    """``Config.defer_free``: the committing step's writes, and every older step's, have run:
    free the deferred holders whose fence it is or was, oldest first, each as its table would
    have been freed (vLLM's ``_drain_deferred_frees`` at the top of ``update_from_output``)."""
    events: list[Event] = []
    while s.deferred and s.deferred[0].fence <= step.id:
        held = s.deferred.pop(0)
        events += free_blocks(s, held.req, held.blocks)
    return events


def loadable(known: int, bsz: int, asynchronous: bool) -> int:
    """How many leading blocks an admission of a request with ``known`` tokens may take from
    hits and a load: those before the block of the last known token, which must be computed to
    sample the next; an asynchronous load may also take that block when it is full and holds
    more than that token (vLLM's whole-prompt load, the decode side of prefill/decode
    disaggregation): its request then recomputes the last token over the loaded block
    (``_update_waiting_for_remote_kv``), so its computed tokens stop one short of the load."""
    return (known if asynchronous and bsz > 1 else known - 1) // bsz


def _building(s: State, where: str) -> Step:
    step = s.building
    if step is None:
        raise Illegal(f"{where}: no step is being scheduled")
    return step


def _request(s: State, rid: int) -> Request:
    req = s.requests.get(rid)
    if req is None:
        raise Illegal(f"unknown request r{rid}")
    return req


def _rank(s: State, rid: int) -> tuple[int, int]:
    req = s.requests[rid]
    return (req.priority, req.arrival)
