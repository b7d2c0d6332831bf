"""TinyPaged: a small paged KV-cache block manager with prefix caching and a scheduler.

kvspec's example of "your engine" (docs/your-engine.md): written on its own, as a third party
would, and instrumented with one list, ``events``, where it records what it decides and what each
decision does to the blocks (kvspec's event vocabulary, docs/events.md). It does not import
kvspec. One step in flight; a full block is published (made findable by prefix lookups) when
the step that wrote it has run, never before (kvspec's policy ``deferred``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PUBLISH_WHEN = "written"
"""When a full block becomes findable: "written" (after the step that computes it has run), or
"scheduled" (at once: the bug of vLLM 0.33.0 that docs/your-engine.md plants)."""


@dataclass
class Request:
    rid: int
    tokens: list[int]
    max_tokens: int
    generated: int = 0
    computed: int = 0
    cached: int = 0  # leading table blocks already published
    table: list[int] = field(default_factory=list)


class BlockPool:
    """Blocks 1..N-1 (0 is the null block); free blocks in LRU order; a prefix index."""

    def __init__(self, num_blocks: int, block_size: int, events: list) -> None:
        self.size, self.events = block_size, events
        self.refcount = [0] * num_blocks
        self.key: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free = deque(range(1, num_blocks))
        self.index: dict[tuple[int, ...], list[int]] = {}

    def lookup(self, tokens: list[int]) -> list[int]:
        """The longest run of cached full blocks of ``tokens`` (the last token is recomputed)."""
        hits = []
        for i in range((len(tokens) - 1) // self.size):
            owners = self.index.get(tuple(tokens[: (i + 1) * self.size]))
            if not owners:
                break
            hits.append(owners[0])
        return hits

    def touch(self, block: int) -> None:
        if self.refcount[block] == 0:
            self.free.remove(block)
        self.refcount[block] += 1

    def allocate(self, req: Request) -> None:
        block = self.free.popleft()
        if self.key[block] is not None:  # reused: its old prefix is no longer here
            self.index[self.key[block]].remove(block)
            self.key[block] = None
            self.events.append(("evict", block))
        self.refcount[block] = 1
        req.table.append(block)
        self.events.append(("alloc", req.rid, block))

    def release(self, req: Request) -> None:
        """Drop the request's references, last block first; cached blocks go to the LRU tail."""
        for block in reversed(req.table):
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                (self.free.append if self.key[block] else self.free.appendleft)(block)
            self.events.append(("free", block))
        req.table, req.computed, req.cached = [], 0, 0

    def publish(self, req: Request, upto: int) -> None:
        """Make the request's full blocks before ``upto`` findable."""
        for i in range(req.cached, upto):
            block = req.table[i]
            if self.key[block] is None:
                self.key[block] = tuple(req.tokens[: (i + 1) * self.size])
                self.index.setdefault(self.key[block], []).append(block)
                self.events.append(("publish", req.rid, i, block))
        req.cached = max(req.cached, upto)


class TinyPaged:
    """The scheduler: running requests first (preempting the newest when blocks run out), then
    admissions in arrival order, within a token budget; one step in flight."""

    def __init__(self, num_blocks: int, block_size: int, token_budget: int, max_running: int):
        self.events: list[tuple] = []
        self.pool = BlockPool(num_blocks, block_size, self.events)
        self.budget, self.max_running = token_budget, max_running
        self.requests: dict[int, Request] = {}
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        self.in_flight: tuple[int, dict[int, int]] | None = None  # (step, {rid: end})
        self.next_step = 0

    def add_request(self, rid: int, prompt: list[int], max_tokens: int, priority: int) -> None:
        self.events.append(("arrive", rid, tuple(prompt), max_tokens, priority))
        self.requests[rid] = Request(rid, list(prompt), max_tokens)
        self.waiting.append(rid)

    def step(self) -> bool:
        """Run the step in flight, or build and submit the next one; False when idle."""
        if self.in_flight is not None:
            self._run_and_commit()
            return True
        if not self.running and not self.waiting:
            return False
        step, plan = self.next_step, {}
        self.next_step += 1
        self.events.append(("begin", step))
        left = self.budget
        for rid in list(self.running):
            req = self.requests[rid]
            if rid not in self.running or left == 0:
                continue
            n = min(len(req.tokens) - req.computed, left)
            while self._blocks_for(req, req.computed + n) > len(self.pool.free):
                self._preempt(self.running[-1])
                if rid not in self.running:
                    break
            else:
                self._schedule(req, n, plan)
                left -= n
        while self.waiting and left and len(self.running) < self.max_running:
            req = self.requests[self.waiting[0]]
            hits = self.pool.lookup(req.tokens)
            n = min(len(req.tokens) - len(hits) * self.pool.size, left)
            held = sum(1 for b in hits if self.pool.refcount[b] == 0)
            need = -(-(len(hits) * self.pool.size + n) // self.pool.size) - len(hits)
            if need > len(self.pool.free) - held:
                break
            self.waiting.popleft()
            self.running.append(req.rid)
            req.computed = len(hits) * self.pool.size
            self.events.append(("schedule", req.rid, n, 0))
            for block in hits:
                self.pool.touch(block)
            req.table, req.cached = list(hits), len(hits)
            self.events.append(("hit", req.rid, tuple(hits)))
            self._allocated(req, n, plan)
            left -= n
        self.events.append(("submit", step))
        self.in_flight = (step, plan)
        return True

    def _blocks_for(self, req: Request, end: int) -> int:
        return max(0, -(-end // self.pool.size) - len(req.table))

    def _allocate(self, req: Request, end: int) -> None:
        while len(req.table) * self.pool.size < end:
            self.pool.allocate(req)

    def _schedule(self, req: Request, n: int, plan: dict[int, int]) -> None:
        self.events.append(("schedule", req.rid, n, 0))
        self._allocated(req, n, plan)

    def _allocated(self, req: Request, n: int, plan: dict[int, int]) -> None:
        self._allocate(req, req.computed + n)
        plan[req.rid] = req.computed = req.computed + n
        if PUBLISH_WHEN == "scheduled":
            self.pool.publish(req, min(req.computed, len(req.tokens)) // self.pool.size)

    def _preempt(self, rid: int) -> None:
        self.events.append(("preempt", rid))
        self.pool.release(self.requests[rid])
        self.running.remove(rid)
        self.waiting.appendleft(rid)

    def _run_and_commit(self) -> None:
        step, plan = self.in_flight  # type: ignore[misc]
        self.in_flight = None
        self.events.append(("execute", step, ()))  # (the model would run here)
        live = {r: end for r, end in plan.items() if r in self.running}
        sampled = [(r, 1 + len(self.requests[r].tokens) % 3) for r, end in live.items()
                   if end == len(self.requests[r].tokens)]  # fmt: skip
        self.events.append(("commit", step, tuple(sampled)))
        for rid, end in live.items():  # what the step wrote may now be found
            req = self.requests[rid]
            self.pool.publish(req, min(end, len(req.tokens)) // self.pool.size)
        for rid, token in sampled:
            req = self.requests[rid]
            req.tokens.append(token)
            req.generated += 1
            if req.generated >= req.max_tokens:
                self.pool.release(req)
                self.running.remove(rid)
                self.events.append(("finish", rid, "length"))

    def abort(self, rid: int) -> bool:
        if rid not in self.running and rid not in self.waiting:
            return False
        self.events.append(("abort", rid))
        if rid in self.running:
            self.pool.release(self.requests[rid])
            self.running.remove(rid)
        else:
            self.waiting.remove(rid)
        self.events.append(("finish", rid, "abort"))
        return True

    def reset_prefix_cache(self) -> bool:
        if self.in_flight is not None or any(self.pool.refcount):
            return False
        self.events.append(("reset",))
        for block in sorted(b for owners in self.pool.index.values() for b in owners):
            self.pool.key[block] = None
            self.events.append(("unpublish", block))
        self.pool.index.clear()
        return True
