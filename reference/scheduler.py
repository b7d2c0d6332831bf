"""The scheduler's state and the decisions it can carry out (vLLM ``Scheduler``).

Owns the request table, the waiting queue, the running list and the steps in flight (submitted
ones oldest first, plus the one being built). Each decision method appends its decision event,
then carries it out, the KV cache manager, block pool and registration policy appending the
effect events in the order they happen. *Which* decisions to take is ``disciplines.py``'s job;
``update_from_output`` processes a step's output (the commit).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterator

from .block_pool import Block, Event
from .config import EngineConfig
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
            ),
            0,
        )

    # -- queries -------------------------------------------------------------------------------

    def has_schedulable_work(self) -> bool:
        if self.waiting:
            return True
        for req in self.running:
            if req.loading is None and req.computed < len(req.tokens):
                return True
        return False

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
        self.policy.on_begin(step)
        return step

    def submit(self, step: Step) -> None:
        if self.events is not None:
            self.events.append(("submit", step.step_id))
        self.building = None
        self.in_flight.append(step)
        self.counters["computed_tokens"] += step.budget_used

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
            self.events.append(("schedule", req.rid, num_tokens, num_loaded))
        kv = self.kv
        kv.admit(req, hits)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RUNNING
        step.admitted = True
        start = len(hits) * kv.block_size
        counters = self.counters
        counters["hit_tokens" if req.admissions == 0 else "readmit_hit_tokens"] += start
        counters["lookup_tokens"] += len(req.tokens)
        req.admissions += 1
        self._extend(
            step, req, start, start + num_tokens + num_loaded * kv.block_size, num_loaded > 0
        )
        step.budget_used += num_tokens
        if num_loaded:
            req.loading = step.step_id
            self.counters["loaded_blocks"] += num_loaded

    def schedule_running(self, step: Step, req: Request, num_tokens: int) -> None:
        """Give a running request ``num_tokens`` more tokens to compute in the step."""
        if self.events is not None:
            self.events.append(("schedule", req.rid, num_tokens, 0))
        self._extend(step, req, req.computed, req.computed + num_tokens, False)
        step.budget_used += num_tokens

    def _extend(self, step: Step, req: Request, start: int, end: int, load: bool) -> None:
        kv = self.kv
        kv.grow(req, end)
        req.computed = end
        table = req.table
        step.entries[req.rid] = Entry(
            start, end, table, len(table), load, not load and end == len(req.tokens)
        )
        step.live.add(req.rid)
        self.policy.on_schedule(req, step, end)

    def preempt(self, req: Request) -> None:
        """Send a running request back to the front of the waiting queue, freeing its blocks."""
        step = self.building
        assert step is not None
        if self.events is not None:
            self.events.append(("preempt", req.rid))
        step.preempted = True
        self.leave(req)
        self.running.remove(req)
        self.waiting.push_front(req)
        req.status = WAITING
        self.counters["preemptions"] += 1

    def leave(self, req: Request) -> None:
        """The request gives up its blocks early (preempt, abort, failed load): withdrawn from
        the building step (its budget returned), its results no longer wanted from any step in
        flight (submitted steps still write), registrations rolled back per policy, blocks
        freed last first."""
        rid = req.rid
        steps = self.all_steps()
        building = self.building
        if building is not None:
            entry = building.entries.pop(rid, None)
            if entry is not None and not entry.load:
                building.budget_used -= entry.end - entry.start
        for step in steps:
            step.live.discard(rid)
        self.policy.on_remove(req, steps)
        req.loading = None
        self.kv.free(req)

    # -- between steps -------------------------------------------------------------------------

    def abort(self, req: Request) -> None:
        if self.events is not None:
            self.events.append(("abort", req.rid))
        self.leave(req)
        if req.status == RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, "abort")
        self.counters["aborts"] += 1

    def update_from_output(self, step: Step, sampled: tuple[tuple[int, int], ...]) -> None:
        """Commit the oldest step: load failures, then registrations, then sampled tokens."""
        assert self.in_flight[0] is step and self.building is None
        if self.events is not None:
            self.events.append(("commit", step.step_id, sampled))
        requests = self.requests
        self.policy.on_confirmed(step)
        failed = step.failed
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
        self.policy.on_written(step, requests)
        max_stop = self.config.stop_token
        for rid, token in sampled:
            req = requests[rid]
            req.append_token(token)
            if token == max_stop:
                reason: str | None = "stop"
            elif len(req.tokens) - req.prompt_len >= req.max_tokens:
                reason = "length"
            else:
                reason = None
            if reason is not None:
                self.kv.free(req)
                self.running.remove(req)
                self._finish(req, reason)
        self.in_flight.popleft()
        self.counters["steps"] += 1

    def _finish(self, req: Request, reason: str) -> None:
        req.status = FINISHED
        self.counters["requests_finished"] += 1
        if self.events is not None:
            self.events.append(("finish", req.rid, reason))
