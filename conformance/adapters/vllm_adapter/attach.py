"""vLLM's block lifecycle as kvspec events: wrappers on one ``Scheduler``'s own methods.

``Attachment(scheduler, events, block_size, on_preempt)`` wraps, on that instance only, the
methods where the block lifecycle happens and appends the events they cause to ``events``:

==================================  ==========================================================
vLLM method                         events
==================================  ==========================================================
``KVCacheManager.allocate_slots``   ``schedule`` (and ``hit`` on admission) when it succeeds,
                                    then the effects recorded inside it
``BlockPool.touch``                 (cross-checks ``hit``: the blocks vLLM touched)
``BlockPool.get_new_blocks``        ``evict`` (from ``_maybe_evict_cached_block``), ``alloc``
``BlockPool._insert_block_hash``    ``publish`` (hash insertion)
``Scheduler._preempt_request``      ``preempt``
``BlockPool.free_blocks``           ``free``, one per block, in the order vLLM frees them
``Scheduler._free_request``         ``finish`` with vLLM's own finish reason
``KVCacheManager.cache_blocks``     (names the request whose blocks a post-output registration
                                    publishes)
==================================  ==========================================================

vLLM's native KV events (``BlockStored``/``BlockRemoved``, from ``take_events``) are kept in
``native`` and cross-checked by ``self_check``; disagreements between the wrappers land in
``problems``. The engine-core decisions around these (``arrive``, ``begin``/``submit``,
``execute``/``commit``, ``abort``, ``reset``) are the driving loop's (``loop.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.request import Request, RequestStatus

Event = tuple[object, ...]

REASONS = {
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Attachment:
    def __init__(
        self,
        scheduler: Any,
        events: list[Event],
        block_size: int,
        on_preempt: Callable[[str], None] = lambda request_id: None,
    ) -> None:
        self.scheduler = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        self.events = events
        self.block_size = block_size
        self.on_preempt = on_preempt
        self.native: list[Any] = []
        self._current: int | None = None  # request whose slots are being allocated
        self._owner: int | None = None  # request whose blocks cache_blocks registers
        self._pending: list[Event] = []  # effects recorded inside allocate_slots
        self._evicted: set[int] = set()
        self._touched: list[int] = []  # blocks vLLM touched inside the current allocate_slots
        self.problems: list[str] = []  # disagreements between the wrappers, for self_check
        self._wrap()

    def self_check(self) -> str | None:
        """Cross-check the wrapped methods against vLLM's own KV events: as many blocks stored
        as ``publish`` events, as many removed as ``evict`` events."""
        if self.problems:
            return self.problems[0]
        # Peek at the events vLLM has not taken yet: taking them would keep them from its publisher.
        native = self.native + list(self.pool.kv_event_queue)
        stored = sum(len(e.block_hashes) for e in native if isinstance(e, BlockStored))
        removed = sum(len(e.block_hashes) for e in native if isinstance(e, BlockRemoved))
        published = sum(1 for e in self.events if e[0] == "publish")
        dropped = sum(1 for e in self.events if e[0] == "evict")
        if stored != published or removed != dropped:
            return (
                f"vLLM's KV events stored {stored} and removed {removed} blocks; the wrapped "
                f"methods saw {published} publications and {dropped} evictions"
            )
        return None

    def _wrap(self) -> None:
        sched, kv, pool = self.scheduler, self.scheduler.kv_cache_manager, self.pool
        allocate_slots, get_new_blocks = kv.allocate_slots, pool.get_new_blocks
        evict, insert, free_blocks = (
            pool._maybe_evict_cached_block,
            pool._insert_block_hash,
            pool.free_blocks,
        )
        preempt, free_request, touch = sched._preempt_request, sched._free_request, pool.touch
        take_events, cache_blocks = kv.take_events, kv.cache_blocks

        def cache_blocks_(request: Request, num_computed_tokens: int) -> None:
            self._owner = int(request.request_id)  # async scheduling, after the output
            try:
                cache_blocks(request, num_computed_tokens)
            finally:
                self._owner = None

        def take_events_() -> list[Any]:
            events = take_events()
            self.native += events
            return events

        def allocate_slots_(request: Request, num_new_tokens: int, *args: Any, **kw: Any) -> Any:
            admission = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            hits = kw.get("new_computed_blocks", args[1] if len(args) > 1 else None)
            self._current, self._pending, self._touched = int(request.request_id), [], []
            try:
                result = allocate_slots(request, num_new_tokens, *args, **kw)
            finally:
                rid, pending, self._current, self._pending = self._current, self._pending, None, []
            if result is None:
                if pending:
                    raise AssertionError(f"allocate_slots failed after effects {pending}")
                return None
            self.events.append(("schedule", rid, num_new_tokens, 0))
            if admission:
                blocks = hits.blocks[0] if hits is not None else []
                hit = tuple(b.block_id for b in blocks)
                self.events.append(("hit", rid, hit))
                if tuple(self._touched) != hit:
                    self.problems.append(f"r{rid} hit {hit} but vLLM touched {self._touched}")
            self.events.extend(pending)
            return result

        def get_new_blocks_(num_blocks: int) -> list[Any]:
            self._evicted = set()
            blocks = get_new_blocks(num_blocks)
            for block in blocks:
                if block.block_id in self._evicted:
                    self._effect(("evict", block.block_id))
                self._effect(("alloc", self._current, block.block_id))
            return blocks

        def touch_(blocks: Any) -> None:
            self._touched += [b.block_id for b in blocks if not b.is_null]
            touch(blocks)

        def evict_(block: Any) -> bool:
            evicted = evict(block)
            if evicted:
                self._evicted.add(block.block_id)
            return evicted

        def insert_(key: Any, block: Any, num_tokens: int | None) -> None:
            before = block.block_hash
            insert(key, block, num_tokens)
            if before is None and block.block_hash is not None:
                index = (num_tokens or 0) // self.block_size - 1
                owner = self._current if self._current is not None else self._owner
                self._effect(("publish", owner, index, block.block_id))

        def free_blocks_(ordered_blocks: Iterable[Any]) -> None:
            blocks = list(ordered_blocks)
            self.events.extend(("free", b.block_id) for b in blocks if not b.is_null)
            free_blocks(blocks)

        def preempt_(request: Request, *args: Any, **kw: Any) -> None:
            self.events.append(("preempt", int(request.request_id)))
            self.on_preempt(request.request_id)
            preempt(request, *args, **kw)

        def free_request_(request: Request, *args: Any, **kw: Any) -> Any:
            result = free_request(request, *args, **kw)
            reason = REASONS.get(request.status, str(request.status))
            self.events.append(("finish", int(request.request_id), reason))
            return result

        kv.allocate_slots = allocate_slots_
        pool.get_new_blocks = get_new_blocks_
        pool.touch = touch_
        pool._maybe_evict_cached_block = evict_
        pool._insert_block_hash = insert_
        pool.free_blocks = free_blocks_
        sched._preempt_request = preempt_
        sched._free_request = free_request_
        kv.take_events = take_events_
        kv.cache_blocks = cache_blocks_

    def _effect(self, event: Event) -> None:
        """Effects inside ``allocate_slots`` wait for its ``schedule`` decision."""
        if self._current is None:
            self.events.append(event)
        else:
            self._pending.append(event)
