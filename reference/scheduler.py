"""The scheduler's state and the decisions it can carry out (vLLM ``Scheduler``).

Owns the request table, the waiting queue, the running list and the steps in flight (submitted
ones oldest first, plus the one being built). Each decision method appends its decision event,
then carries it out, the KV cache manager, block pool and registration policy appending the
effect events in the order they happen. *Which* decisions to take is ``disciplines.py``'s job;
``update_from_output`` processes a step's output (the commit).

Async scheduling (``EngineConfig.async_scheduling``, vLLM's ``AsyncScheduler``): a running
request may be scheduled up to ``schedulable_end``, its known tokens plus one placeholder per
step in flight that samples for it (``Request.placeholders``, kept by ``_extend``, ``leave`` and
the commit in O(1) each); the blocks a committed step completed are registered after its sampled
token is appended (``Policy.on_output``); a request finishing at a commit leaves the later steps
that hold it (their output for it is discarded). Stale output (``stale_output``): a request
preempted while a submitted step holds it is dropped from those steps' results, or with
``deliver`` stays live there (its sample is appended at commit, possibly finishing it while it
waits) and is kept in ``held``, not admissible, until the last step holding it has committed.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Iterator

from .block_pool import Block, Event
from .config import EngineConfig
from .groups import GroupedKV
from .kv_cache_manager import KVCacheManager
from .policies import Policy
from .request import FINISHED, RUNNING, WAITING, Entry, Request, Step


class WaitingQueue:
    """The waiting requests in queue order (preempted ones go to the front, arrivals to the
    back); with priority scheduling, also kept sorted by ``(priority, arrival)`` (a sorted list:
    insertion and removal are a bisect and a memmove)."""

    __slots__ = ("_order", "_sorted", "by_priority")

    def __init__(self, by_priority: bool) -> None:
        self._order: OrderedDict[int, Request] = OrderedDict()
        self._sorted: list[tuple[int, int, Request]] = []
        self.by_priority = by_priority

    def push_back(self, req: Request) -> None:
        self._order[req.rid] = req
        if self.by_priority:
            bisect.insort(self._sorted, (req.priority, req.arrival, req))

    def push_front(self, req: Request) -> None:
        self._order[req.rid] = req
        self._order.move_to_end(req.rid, last=False)
        if self.by_priority:
            bisect.insort(self._sorted, (req.priority, req.arrival, req))

    def remove(self, req: Request) -> None:
        del self._order[req.rid]
        if self.by_priority:
            i = bisect.bisect_left(self._sorted, (req.priority, req.arrival))
            del self._sorted[i]

    def head(self) -> Request | None:
        """The request to admit next: queue head (fcfs) or least (priority, arrival)."""
        if not self._order:
            return None
        if self.by_priority:
            return self._sorted[0][2]
        return next(iter(self._order.values()))

    def in_order(self) -> Iterator[Request]:
        """All waiting requests in admission order."""
        if self.by_priority:
            return (entry[2] for entry in self._sorted)
        return iter(self._order.values())

    def __len__(self) -> int:
        return len(self._order)

    def __bool__(self) -> bool:
        return bool(self._order)


class Scheduler:
    __slots__ = (
        "config",
        "kv",
        "policy",
        "events",
        "requests",
        "waiting",
        "running",
        "in_flight",
        "building",
        "next_step_id",
        "counters",
        "async_scheduling",
        "deliver",
        "held",
        "defer_free",
        "sched_seq",
        "processed_seq",
        "last_seq",
        "deferred",
        "state_align",
    )

    def __init__(
        self, config: EngineConfig, kv: KVCacheManager, policy: Policy, events: list[Event] | None
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.events = events
        self.requests: dict[int, Request] = {}
        self.waiting = WaitingQueue(config.preemption == "priority")
        self.running: list[Request] = []
        self.in_flight: deque[Step] = deque()
        """Submitted, uncommitted steps, oldest first."""
        self.building: Step | None = None
        self.next_step_id = 0
        self.async_scheduling = config.async_scheduling
        self.deliver = config.stale_output == "deliver"
        self.held: set[int] = set()
        """Waiting requests that are not admissible yet: preempted with stale output delivered
        while a submitted step still holds them (always empty in drop mode)."""
        self.defer_free = config.defer_free
        self.sched_seq = 0
        """Deferred freeing: submitted steps that compute any token (empty ones and steps that
        only load are not counted)."""
        self.processed_seq = 0
        """Deferred freeing: how many of those have been committed."""
        self.last_seq: dict[int, int] = {}
        """Deferred freeing: request -> the sequence number of the last counted step that
        computes for it."""
        self.deferred: deque[tuple[int, list[Block]]] = deque()
        """Deferred freeing: (sequence number to wait for, a table given up), oldest first."""
        self.state_align = math.lcm(*(g.block_size for g in config.groups if g.kind == "state"))
        """Several KV-cache groups with a state group: the boundary prefill chunks stop at
        (``clip``); 1 (no clipping) without one."""
        self.counters = dict.fromkeys(
            (
                "steps",
                "requests_finished",
                "prompt_tokens",
                "hit_tokens",
                "readmit_hit_tokens",
                "lookup_tokens",
                "computed_tokens",
                "loaded_blocks",
                "preemptions",
                "aborts",
                "load_failures",
                "placeholder_tokens",
                "stale_delivered",
                "draft_tokens",
                "rejected_drafts",
            ),
            0,
        )

    # -- queries -------------------------------------------------------------------------------

    def has_schedulable_work(self) -> bool:
        """A waiting request is admissible, or a running one has tokens to compute (under async
        scheduling, placeholders included): a step built now would have something to try."""
        if len(self.waiting) > len(self.held):
            return True
        end_of = self.schedulable_end
        for req in self.running:
            if req.loading is None and req.computed < end_of(req):
                return True
        return False

    def schedulable_end(self, req: Request) -> int:
        """How far a running request may be scheduled: its known tokens, plus under async
        scheduling one placeholder per step in flight sampling for it; none further once the
        oldest of those samples reaches ``max_tokens`` (vLLM skips that decode: with one token
        per step, ``num_computed_tokens + 2 - num_output_placeholders >= prompt + max_tokens``)."""
        placeholders = req.placeholders
        if placeholders and len(req.tokens) + 1 - req.prompt_len >= req.max_tokens:
            return req.computed
        return len(req.tokens) + placeholders + req.drafts

    def all_steps(self) -> list[Step]:
        """Every step in flight, oldest first, the building one last."""
        steps = list(self.in_flight)
        if self.building is not None:
            steps.append(self.building)
        return steps

    # -- step boundaries -----------------------------------------------------------------------

    def begin(self) -> Step:
        step = Step(self.next_step_id)
        self.next_step_id += 1
        self.building = step
        if self.events is not None:
            self.events.append(("begin", step.step_id))
        self.kv.new_step()
        self.policy.on_begin(step)
        if isinstance(self.kv, GroupedKV) and self.kv.windows_let_go:
            for req in self.running:
                self.kv.let_go_windows(req, self.processed(req))
        return step

    def submit(self, step: Step) -> None:
        if self.events is not None:
            self.events.append(("submit", step.step_id))
        self.building = None
        if isinstance(self.kv, GroupedKV):  # a slot group's copies made now run in the next step
            self.kv.copies.submitted()
        self.in_flight.append(step)
        self.counters["computed_tokens"] += step.budget_used
        if self.defer_free and step.budget_used > 0:
            self.sched_seq += 1
            bsz = self.kv.block_size
            for rid, entry in step.entries.items():
                if not entry.load and entry.end - entry.start - entry.loaded * bsz > 0:
                    self.last_seq[rid] = self.sched_seq

    # -- decisions while building a step -------------------------------------------------------

    def add(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.waiting.push_back(req)
        self.counters["prompt_tokens"] += req.prompt_len

    def admit(
        self, step: Step, req: Request, hits: list[Block], num_tokens: int, num_loaded: int
    ) -> None:
        """Admit a waiting request: its hits are touched, then blocks allocated for
        ``num_tokens`` computed (or ``num_loaded`` full blocks loaded) tokens after them."""
        if self.events is not None:
            decision = ("schedule", req.rid, num_tokens, num_loaded)
            bound = req.read_limit  # the bound its lookup took (spec.events.WHEN_SET)
            self.events.append(decision if bound is None else (*decision, bound))
        kv = self.kv
        kv.admit(req, hits)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RUNNING
        step.admitted = True
        start = kv.hit_length(hits)
        counters = self.counters
        counters["hit_tokens" if req.admissions == 0 else "readmit_hit_tokens"] += start
        counters["lookup_tokens"] += len(req.tokens)
        req.admissions += 1
        end = start + num_tokens + num_loaded * kv.block_size
        self._extend(step, req, start, end, num_loaded > 0 and num_tokens == 0, num_loaded)
        step.budget_used += num_tokens
        if num_loaded:
            if not num_tokens:  # asynchronous: the request waits for the step's commit
                req.loading = step.step_id
                if self.config.defer_loads and self.sched_seq > self.processed_seq:
                    self.last_seq[req.rid] = self.sched_seq  # started once that step commits
            self.counters["loaded_blocks"] += num_loaded

    def clip(self, req: Request, start: int, num_tokens: int) -> int:
        """A prefill chunk from ``start`` clipped to end where a state can be kept (vLLM's align
        mode, ``_mamba_block_aligned_split``, simplified): a chunk that starts inside a block
        at the next boundary (so a state slot a chunk left mid-block is next written at its
        boundary, which a state group registering ``when-known`` relies on), at the last state
        boundary before the request's last known token when it crosses it, else at the last
        boundary it reaches (unless that leaves nothing); decodes and models without a state
        group unclipped."""
        align = self.state_align
        known = len(req.tokens)
        if align == 1 or start >= known - 1:
            return num_tokens
        end = start + num_tokens
        following = (start // align + 1) * align
        if start % align and following < end:
            return following - start
        last = (known - 1) // align * align
        if start < last < end:
            return last - start
        if end < known and end // align * align > start:
            return end // align * align - start
        return num_tokens

    def processed(self, req: Request) -> int:
        """Its computed tokens less those its entries in uncommitted steps schedule (vLLM's
        ``num_computed_tokens - num_in_flight_tokens``): what no step in flight still reads
        below the window of."""
        rid, flying = req.rid, 0
        for step in self.all_steps():
            entry = step.entries.get(rid)
            if entry is not None:
                flying += entry.end - entry.start
        return max(0, req.computed - flying)

    def blocks_short(self, req: Request, end: int) -> bool:
        """A running request cannot cover ``end`` tokens, even with the blocks its sliding
        window would free first."""
        if self.kv.window is None and not self.kv.grouped:
            return self.kv.blocks_short(req, end)
        return self.kv.blocks_short_running(req, end, self.processed(req))

    def schedule_running(self, step: Step, req: Request, num_tokens: int) -> None:
        """Give a running request ``num_tokens`` more tokens to compute in the step (a sliding
        window first frees the blocks before the window of its next processed token)."""
        if self.events is not None:
            self.events.append(("schedule", req.rid, num_tokens, 0))
        if self.kv.window is not None or self.kv.grouped:
            self.kv.remove_skipped(req, self.processed(req))
        self._extend(step, req, req.computed, req.computed + num_tokens, False)
        step.budget_used += num_tokens

    def _extend(
        self, step: Step, req: Request, start: int, end: int, load: bool, loaded: int = 0
    ) -> None:
        kv = self.kv
        kv.grow(req, end)
        req.computed = end - 1 if load and end == len(req.tokens) else end  # recomputed after
        table = req.table
        drafts = max(0, end - len(req.tokens) - req.placeholders)
        req.drafts = 0  # used, or dropped by the budget (vLLM clears them either way)
        samples = not load and end - drafts == len(req.tokens) + req.placeholders
        step.entries[req.rid] = entry = Entry(
            start, end, table, len(table), load, samples, drafts=drafts, loaded=loaded
        )
        if isinstance(kv, GroupedKV):
            entry.tables = kv.snapshot(req)
            entry.encoded = kv.encoding.pop(req.rid, ())  # a cross group's encoder pass
        step.live.add(req.rid)
        if self.async_scheduling:
            if end > len(req.tokens):
                self.counters["placeholder_tokens"] += end - max(start, len(req.tokens))
            if samples:
                req.placeholders += 1 + drafts
        if self.deliver:
            req.holding += 1
        if not (load and self.config.delay_load_registration):  # else at its next schedule
            self.policy.on_schedule(req, step, end)

    def preempt(self, req: Request) -> None:
        """Send a running request back to the front of the waiting queue, freeing its blocks."""
        step = self.building
        assert step is not None
        if self.events is not None:
            self.events.append(("preempt", req.rid))
        step.preempted = True
        self.leave(req, keep_stale=self.deliver)
        self.running.remove(req)
        self.waiting.push_front(req)
        req.status = WAITING
        if req.holding:
            self.held.add(req.rid)
        self.counters["preemptions"] += 1

    def leave(self, req: Request, keep_stale: bool = False) -> None:
        """The request gives up its blocks early (preempt, abort, failed load): withdrawn from
        the building step (its budget returned), its results no longer wanted from any step in
        flight (submitted steps still write; with ``keep_stale``, a preemption with stale output
        delivered, the submitted steps' results for it are still used), registrations rolled
        back per policy, blocks freed last first."""
        rid = req.rid
        steps = self.all_steps()
        building = self.building
        if building is not None:
            entry = building.entries.pop(rid, None)
            if entry is not None:
                computed = entry.end - entry.start - entry.loaded * self.kv.block_size
                building.budget_used -= computed
                if entry.samples and self.async_scheduling:
                    req.placeholders -= 1 + entry.drafts
                if self.deliver:
                    req.holding -= 1
                if isinstance(self.kv, GroupedKV):  # its admission's copies do not run
                    self.kv.withdraw_copies(building.step_id, req)
            building.live.discard(rid)
        if not keep_stale:
            for step in steps:
                step.live.discard(rid)
            req.placeholders = 0
        self.policy.on_remove(req, steps)
        req.loading = None
        req.drafts = 0
        self.release(req)

    def frees_later(self, req: Request) -> bool:
        """Deferred freeing: a counted step not yet committed computes for the request, so
        what it gives up now waits for the newest counted step."""
        return self.defer_free and self.last_seq.get(req.rid, 0) > self.processed_seq

    def release(self, req: Request) -> None:
        """The request gives up its table: freed now, or (``frees_later``) held until the
        newest counted step submitted so far has been committed."""
        if not self.frees_later(req):
            self.kv.free(req)
            return
        table = self.kv.pop_table(req)
        if table:
            self.deferred.append((self.sched_seq, table))

    def _drain(self) -> None:
        """Deferred freeing: a counted step was committed; free the held tables whose step it
        was, oldest first, stopping at the first still waiting."""
        deferred, kv = self.deferred, self.kv
        while deferred and deferred[0][0] <= self.processed_seq:
            kv.free_blocks(deferred.popleft()[1])

    # -- between steps -------------------------------------------------------------------------

    def abort(self, req: Request) -> None:
        if self.events is not None:
            self.events.append(("abort", req.rid))
        self.leave(req)
        if req.status == RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
            self.held.discard(req.rid)
        self._finish(req, "abort")
        self.counters["aborts"] += 1

    def update_from_output(self, step: Step, sampled: tuple[tuple[int, int], ...]) -> None:
        """Commit the oldest step: load failures, then registrations, then sampled tokens (each
        followed, under async scheduling or with draft tokens, by the registration of what the
        step completed, and by the finish of its request at max_tokens or the stop token). A
        request with draft tokens is listed once per token (accepted drafts, then the bonus);
        its rejected drafts leave its computed tokens first."""
        in_flight = self.in_flight
        assert in_flight[0] is step and self.building is None
        if self.events is not None:
            self.events.append(("commit", step.step_id, sampled))
        requests = self.requests
        policy = self.policy
        if self.defer_free and step.budget_used > 0:
            self.processed_seq += 1
            self._drain()
        policy.on_confirmed(step)
        failed = step.failed
        if self.deliver:
            self._release_holds(step)
        for rid, entry in step.entries.items():
            if entry.load:
                req = requests[rid]
                if req.loading == step.step_id:
                    req.loading = None
                    if rid in failed:  # recompute the request from scratch, without a load
                        self.leave(req)
                        if self.events is not None:
                            self.events.append(("load_failed", rid))
                        self.running.remove(req)
                        self.waiting.push_front(req)
                        req.status = WAITING
                        req.external = False
                        self.counters["load_failures"] += 1
        policy.on_written(step, requests)
        stop = self.config.stop_token
        async_scheduling = self.async_scheduling
        post_output = async_scheduling or self.config.spec_tokens > 0
        for rid, tokens in _per_request(sampled):
            req = requests[rid]
            entry = step.entries[rid]
            running = req.status == RUNNING  # else preempted, its stale output delivered
            rejected = entry.drafts - (len(tokens) - 1)
            if running and rejected:
                req.computed -= rejected
                self.counters["rejected_drafts"] += rejected
            reason: str | None = None
            for token in tokens:
                req.append_token(token)
                if token == stop:
                    reason = "stop"
                elif len(req.tokens) - req.prompt_len >= req.max_tokens:
                    reason = "length"
                if reason is not None:
                    break
            if not running:
                self.counters["stale_delivered"] += 1
            if async_scheduling:
                req.placeholders -= 1 + entry.drafts
            if post_output and running:
                policy.on_output(req, entry, rejected)
            if reason is not None:
                self.release(req)
                if running:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                    self.held.discard(rid)
                self._finish(req, reason)
                if running:  # (a request finishing while it waits gave its tables up before)
                    later = any(rid in st.entries for st in itertools.islice(in_flight, 1, None))
                    policy.on_finish(req, entry, later)
                if len(in_flight) > 1:
                    self._leave_later_steps(req)
            elif rejected and async_scheduling and len(in_flight) > 1:
                self._move_back(req, rejected)
        policy.on_committed(step, requests)
        in_flight.popleft()
        self.counters["steps"] += 1

    def drafting(self, step: Step) -> list[Request]:
        """The running requests that sampled in ``step`` (just committed): their drafter
        proposes their next decode's draft tokens (``Request.drafts``)."""
        requests = self.requests
        return [
            requests[rid]
            for rid, entry in step.entries.items()
            if entry.samples and rid in step.live and requests[rid].status == RUNNING
        ]

    def drafting_scheduled(self, step: Step) -> list[Request]:
        """Async scheduling: the running requests whose decode in ``step`` (just built) samples;
        their drafter proposes the draft tokens of their next decode now, which is scheduled as
        if all of this one's were accepted (vLLM's ``AsyncScheduler`` sets ``spec_token_ids``
        after each such schedule)."""
        requests = self.requests
        return [
            requests[rid]
            for rid, entry in step.entries.items()
            if entry.samples and requests[rid].status == RUNNING
        ]

    def _move_back(self, req: Request, rejected: int) -> None:
        """Async scheduling with draft tokens: the oldest step just rejected ``rejected`` of the
        request's drafts, and the later steps in flight were scheduled as if it had accepted
        them all; their entries for it (those whose output is still used) move back by that many
        positions, as vLLM's model runner moves them on the device. None of them has executed
        (a step executes just before its commit)."""
        rid, bsz = req.rid, self.kv.block_size
        for later in itertools.islice(self.in_flight, 1, None):
            entry = later.entries.get(rid)
            if entry is not None and rid in later.live:
                entry.start -= rejected
                entry.end -= rejected
                entry.num_blocks = min(entry.num_blocks, -(-entry.end // bsz))

    def _leave_later_steps(self, req: Request) -> None:
        """The request finished at the oldest step's commit while later steps hold it (async
        scheduling): its output there is stale, discarded."""
        rid = req.rid
        for later in itertools.islice(self.in_flight, 1, None):
            later.live.discard(rid)
        req.placeholders = 0

    def _release_holds(self, step: Step) -> None:
        """Stale output delivered: the committing step stops holding its requests; a waiting
        request held by no step in flight any more becomes admissible."""
        requests, held = self.requests, self.held
        for rid in step.entries:
            req = requests[rid]
            req.holding -= 1
            if not req.holding and rid in held:
                held.discard(rid)

    def _finish(self, req: Request, reason: str) -> None:
        req.status = FINISHED
        self.counters["requests_finished"] += 1
        if self.events is not None:
            self.events.append(("finish", req.rid, reason))


def _per_request(sampled: tuple[tuple[int, int], ...]) -> list[tuple[int, list[int]]]:
    """A commit's (request, token) pairs as each request's tokens, in order."""
    out: dict[int, list[int]] = {}
    for rid, token in sampled:
        out.setdefault(rid, []).append(token)
    return list(out.items())
