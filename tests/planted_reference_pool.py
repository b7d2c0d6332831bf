"""The pool judge (``conformance/pool_judge.py``) over the reference engine's own block pool
(``reference.block_pool.BlockPool``), and bugs planted in that pool which the judge names by the
pool machine's invariant they break.

The reference engine's pool is a one-key pool: a block is cached under at most one hash, a
freed block is reused only by an allocation, and nothing is copied or handed over. So of the pool
machine's decisions it takes ``allocate``, ``touch``, ``free``, ``publish``, ``evict`` and
``reset``; ``alias``, ``move``, ``unpin`` and ``give`` have no counterpart in it
(``docs/pool-machine.md`` says why ``MoveLeavesNoKey`` and ``ReadUntilReuse`` therefore have no
reference-engine plant). ``drive`` calls the pool with random legal calls of a seeded generator,
feeds each call's decision and the pool's own events (as the pool vocabulary's effects) to a
``PoolJudge``, and compares the pool's refcounts, free queue and index after every call.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator

from planted import Plant

from kvspec.conformance.pool_judge import PoolFinding, PoolJudge
from kvspec.reference.block_pool import Block, BlockPool


class ReferencePoolFeed:
    """One reference ``BlockPool`` and the judge that follows it, call by call."""

    def __init__(self, num_blocks: int) -> None:
        self.events: list[tuple[object, ...]] = []
        self.pool = BlockPool(num_blocks, self.events)
        self.judge = PoolJudge(num_blocks)
        self.held: dict[int, list[Block]] = {}

    def _effects(self) -> list[tuple[object, ...]]:
        """The pool's events since the last call, as the pool vocabulary's effects (its
        ``evict`` inside an allocation is the machine's ``evicted``; frees and publishes are
        the decisions themselves, not effects)."""
        out = []
        for event in self.events:
            if event[0] == "evict":
                out.append(("evicted", event[1]))
            elif event[0] == "alloc":
                out.append(("alloc", event[1], event[2]))
        self.events.clear()
        return out

    def _judge(self, decision: tuple[object, ...]) -> PoolFinding | None:
        judge = self.judge
        if judge.feed(decision) is not None:
            return judge.finding
        judge.feed_all(self._effects())
        refcounts, free = self.pool.snapshot()
        keys = {block_id: key for key, owners in self.pool.index.items() for block_id in owners}
        return judge.compare(refcounts, free, keys)

    def allocate(self, rid: int) -> PoolFinding | None:
        self.held.setdefault(rid, []).append(self.pool.allocate(rid))
        return self._judge(("allocate", rid, 1))

    def touch(self, rid: int, block: Block) -> PoolFinding | None:
        self.pool.touch([block])
        self.held.setdefault(rid, []).append(block)
        return self._judge(("touch", rid, (block.block_id,)))

    def free(self, rid: int) -> PoolFinding | None:
        """Every block ``rid`` holds, as the reference engine frees a table (``free_batch``:
        the last block first at the queue's head, so the decision lists them last first)."""
        blocks = self.held.pop(rid)
        self.pool.free_batch(blocks)
        return self._judge(("free", rid, tuple(b.block_id for b in reversed(blocks))))

    def publish(self, rid: int, block: Block, key: bytes) -> PoolFinding | None:
        self.pool.publish(block, key, rid, 0)
        self.events.clear()
        return self._judge(("publish", rid, block.block_id, key))

    def evict(self, block: Block) -> PoolFinding | None:
        self.pool.unpublish(block)
        self.events.clear()
        return self._judge(("evict", block.block_id))

    def reset(self) -> PoolFinding | None:
        self.pool.reset()
        self.events.clear()
        return self._judge(("reset",))


def drive(seed: int, calls: int = 200, num_blocks: int = 6) -> PoolFinding | None:
    """Random legal calls of the reference pool (seeded), judged after each: the first finding,
    or None."""
    rng = random.Random(seed)
    feed = ReferencePoolFeed(num_blocks)
    pool, keys = feed.pool, [bytes([k]) for k in range(4)]
    for _ in range(calls):
        live = [rid for rid, blocks in feed.held.items() if blocks]
        kind = rng.choice(("allocate", "allocate", "touch", "free", "publish", "evict", "reset"))
        finding: PoolFinding | None = None
        if kind == "allocate" and pool.num_free:
            finding = feed.allocate(rng.randrange(3))
        elif (
            kind == "touch"
        ):  # a cached block the request does not hold (a table holds a block once)
            rid = rng.randrange(3)
            mine = feed.held.get(rid, [])
            cached = [b for o in pool.index.values() for b in o.values() if b not in mine]
            if cached:
                finding = feed.touch(rid, rng.choice(cached))
        elif kind == "free" and live:
            finding = feed.free(rng.choice(live))
        elif kind == "publish" and live:
            rid = rng.choice(live)
            unkeyed = [b for b in feed.held[rid] if b.block_hash is None]
            key = rng.choice(keys)
            if unkeyed and pool.cached_block(key) is None:
                finding = feed.publish(rid, rng.choice(unkeyed), key)
        elif kind == "evict":
            cached = [b for owners in pool.index.values() for b in owners.values()]
            if cached:
                finding = feed.evict(rng.choice(cached))
        elif kind == "reset" and not pool.in_use():
            finding = feed.reset()
        if finding is not None:
            return finding
    return None


@contextlib.contextmanager
def _patched(name: str, function: Callable[..., object]) -> Iterator[None]:
    original = BlockPool.__dict__[name]
    setattr(BlockPool, name, function)
    try:
        yield
    finally:
        setattr(BlockPool, name, original)


_allocate = BlockPool.allocate


def _allocate_keeps_index(self: BlockPool, rid: int, group: int | None = None) -> Block:
    """An allocation that reuses a cached block clears the block's hash but leaves the index
    entry: a later lookup under the hash is handed a block now holding another prefix."""
    block = self.free_queue.popleft()
    self.free_queue.appendleft(block)
    key = block.block_hash
    if key is None:
        return _allocate(self, rid, group)
    owners = dict(self.index[key])
    allocated = _allocate(self, rid, group)
    self.index[key] = owners
    return allocated


def _free_batch_unqueued(self: BlockPool, blocks: list[Block]) -> None:
    """``free_batch`` that drops the references but queues none of the blocks reaching 0: they
    are lost to the pool (the free count too)."""
    for block in reversed(blocks):
        block.ref_cnt -= 1
        if self.events is not None:
            self.events.append(("free", block.block_id))
    self.n_freed += len(blocks)


PLANTS = (
    Plant(
        "ref-pool-eviction-keeps-index",
        "safety",
        "EvictionDropsEveryKey",
        lambda: _patched("allocate", _allocate_keeps_index),
        "an allocation reusing a cached block leaves its hash in the index",
    ),
    Plant(
        "ref-pool-free-unqueued",
        "safety",
        "FreeQueueExact",
        lambda: _patched("free_batch", _free_batch_unqueued),
        "free_batch queues none of the blocks it leaves unreferenced",
    ),
)
