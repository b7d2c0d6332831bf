"""Block-manager bugs planted in the reference engine, each a context manager that patches one
method of ``reference.block_pool.BlockPool`` or ``reference.kv_cache_manager.KVCacheManager``
(restored on exit), with the class of bug and what it should break.

Used by ``tests/test_consequence.py`` (a fixed-seed fuzz run of each gives the invariant its
deviation breaks, or says it is an efficiency difference) and by ``bench/planted_findings.py``
(the before/after table of ``docs/findings-explained.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvspec.reference import block_pool, kv_cache_manager
from kvspec.reference.block_pool import Block, BlockPool
from kvspec.reference.kv_cache_manager import KVCacheManager


@dataclass(frozen=True)
class Plant:
    name: str
    kind: str
    """``safety`` or ``efficiency``."""
    expect: str | None
    """The invariant its deviation should break (None: efficiency, none)."""
    patch: Callable[[], contextlib.AbstractContextManager[None]]
    what: str


@contextlib.contextmanager
def _patched(cls: type, name: str, function: Callable[..., object]) -> Iterator[None]:
    original = cls.__dict__[name]
    setattr(cls, name, function)
    try:
        yield
    finally:
        setattr(cls, name, original)


def _free_reversed_double(self: BlockPool, blocks: list[Block]) -> None:
    """A shared block (refcount >= 2) loses two references when one request frees it."""
    queue, events = self.free_queue, self.events
    for block in reversed(blocks):
        twice = block.ref_cnt >= 2
        for _ in range(2 if twice else 1):
            block.ref_cnt -= 1
            if events is not None:
                events.append(("free", block.block_id))
        if block.ref_cnt == 0:
            queue.appendleft(block) if block.block_hash is None else queue.append(block)
    self.n_freed += len(blocks)


def _free_double_checked(self: BlockPool, blocks: list[Block]) -> None:
    """The double free of ``_free_reversed_double``, then the pool's own check (an assertion
    with no message) that nothing lost two references in the call: the engine crashes right
    after emitting the double free's events, in the same call."""
    before = [block.ref_cnt for block in blocks]
    _free_reversed_double(self, blocks)
    assert all(b.ref_cnt >= n - 1 for b, n in zip(blocks, before, strict=True))


def _free_crashes(self: BlockPool, blocks: list[Block]) -> None:
    """Freeing a table of three or more blocks raises (no event is wrong before it)."""
    if len(blocks) >= 3:
        raise KeyError(blocks[0].block_id)
    BlockPool.__dict__["_original_free_reversed"](self, blocks)


def _touch_no_ref(self: BlockPool, blocks: list[Block]) -> None:
    """A hit on a block another request holds takes no reference."""
    for block in blocks:
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            block.ref_cnt += 1
    self.n_touched += len(blocks)


def _free_queues_shared(self: BlockPool, blocks: list[Block]) -> None:
    """A block freed by one of its holders goes on the free queue although another request
    still holds it (where it can then be handed out again)."""
    queue, events = self.free_queue, self.events
    for block in reversed(blocks):
        block.ref_cnt -= 1
        if block.prev is block:  # not queued yet
            queue.appendleft(block) if block.block_hash is None else queue.append(block)
        if events is not None:
            events.append(("free", block.block_id))
    self.n_freed += len(blocks)


def _free_forward(self: BlockPool, blocks: list[Block]) -> None:
    """A table is freed first block first (the spec frees the last first: the tail of a chain
    is evicted before its ancestors)."""
    queue, events = self.free_queue, self.events
    for block in blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            queue.appendleft(block) if block.block_hash is None else queue.append(block)
        if events is not None:
            events.append(("free", block.block_id))
    self.n_freed += len(blocks)


def _free_cached_to_head(self: BlockPool, blocks: list[Block]) -> None:
    """A cached block freed goes to the queue's head (evicted first) instead of its tail."""
    queue, events = self.free_queue, self.events
    for block in reversed(blocks):
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            queue.appendleft(block)
        if events is not None:
            events.append(("free", block.block_id))
    self.n_freed += len(blocks)


def _free_leaks_first(self: BlockPool, blocks: list[Block]) -> None:
    """A table's first block is never freed (a leak)."""
    queue, events = self.free_queue, self.events
    for block in reversed(blocks[1:]):
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            queue.appendleft(block) if block.block_hash is None else queue.append(block)
        if events is not None:
            events.append(("free", block.block_id))
    self.n_freed += len(blocks)


def _allocate_keeps_hash(self: BlockPool, rid: int) -> Block:
    """A cached block reused for new tokens keeps its old hash (no evict)."""
    block = self.free_queue.popleft()
    block.ref_cnt = 1
    self.n_allocated += 1
    if self.events is not None:
        self.events.append(("alloc", rid, block.block_id))
    return block


def _publish_never(self: KVCacheManager, req: object, index: int) -> None:
    """Nothing is ever registered (no prefix is reused)."""


_original_lookup = KVCacheManager.lookup


def _lookup_first_only(self: KVCacheManager, req: object) -> list[Block]:
    """A lookup stops after its first hit."""
    return _original_lookup(self, req)[:1]  # type: ignore[arg-type]


def _drop_hash_keeps_entry(self: BlockPool, block: Block) -> None:
    """An evicted block loses its hash, but its entry stays in the hash index (left behind)."""
    block.block_hash = None


def _free_counts_twice(self: BlockPool, blocks: list[Block]) -> None:
    """Freeing a table counts its first block free twice (the free counter drifts above the
    queue's length)."""
    BlockPool.__dict__["_original_free_reversed"](self, blocks)
    if blocks and blocks[0].ref_cnt == 0:
        self.free_queue.num_free += 1


BlockPool._original_free_reversed = BlockPool.free_reversed  # type: ignore[attr-defined]

BOOKS = (
    Plant(
        "index-left-behind",
        "safety",
        "HashIndexConsistent",
        lambda: _patched(BlockPool, "_drop_hash", _drop_hash_keeps_entry),
        "an evicted block's entry stays in the hash index",
    ),
    Plant(
        "free-miscount",
        "safety",
        "FreeCountExact",
        lambda: _patched(BlockPool, "free_reversed", _free_counts_twice),
        "a freed table's first block is counted free twice",
    ),
)
"""Bugs in the engine's own books (its hash index, its free count) that its events and snapshot
do not show at once: found by comparing its ``pool_view`` (``conformance/engine_view.py``)."""

CRASHING = (
    Plant(
        "double-free-asserted",
        "safety",
        "RefcountIsOwnership",
        lambda: _patched(BlockPool, "free_reversed", _free_double_checked),
        "a double free, then the pool's own assertion fails in the same call",
    ),
    Plant(
        "crash",
        "crash",
        None,
        lambda: _patched(BlockPool, "free_reversed", _free_crashes),
        "freeing a long table raises KeyError",
    ),
)
"""Bugs that make the engine raise: ``EngineError`` unless an earlier event is the finding."""

PLANTS = (
    Plant(
        "double-free",
        "safety",
        "RefcountIsOwnership",
        lambda: _patched(BlockPool, "free_reversed", _free_reversed_double),
        "a shared block is freed twice by one request",
    ),
    Plant(
        "refcount-not-taken",
        "safety",
        "RefcountIsOwnership",
        lambda: _patched(BlockPool, "touch", _touch_no_ref),
        "a hit on a block in use takes no reference",
    ),
    Plant(
        "queued-in-use",
        "safety",
        "FreeQueueExact",
        lambda: _patched(BlockPool, "free_reversed", _free_queues_shared),
        "a block freed by one holder is queued while another holds it",
    ),
    Plant(
        "leak",
        "safety",
        "RefcountIsOwnership",
        lambda: _patched(BlockPool, "free_reversed", _free_leaks_first),
        "a table's first block is never freed",
    ),
    Plant(
        "stale-hash",
        "safety",
        "NoUnwrittenPublish",
        lambda: _patched(BlockPool, "allocate", _allocate_keeps_hash),
        "a reused cached block keeps its old hash",
    ),
    Plant(
        "free-order",
        "efficiency",
        None,
        lambda: _patched(BlockPool, "free_reversed", _free_forward),
        "a table is freed first block first",
    ),
    Plant(
        "cached-to-head",
        "efficiency",
        None,
        lambda: _patched(BlockPool, "free_reversed", _free_cached_to_head),
        "a freed cached block goes to the free queue's head",
    ),
    Plant(
        "no-publish",
        "efficiency",
        None,
        lambda: _patched(KVCacheManager, "publish", _publish_never),
        "nothing is ever registered",
    ),
    Plant(
        "short-lookup",
        "efficiency",
        None,
        lambda: _patched(KVCacheManager, "lookup", _lookup_first_only),
        "a lookup stops after its first hit",
    ),
)

assert block_pool and kv_cache_manager  # the modules patched
