"""The block pool (vLLM ``BlockPool``): blocks, the free queue and the prefix-cache hash index.

* ``Block``: id, reference count, published hash (None when not in the index) and the links of
  the intrusive free list.
* ``FreeBlockQueue``: an intrusive doubly linked list with two sentinels; pop from the head,
  push to either end and removal from the middle (a touched cached block) are all O(1).
* ``BlockPool``: allocation from the head (evicting the hash the block was cached under),
  touch, free (unhashed blocks to the head, hashed ones to the tail), and the hash index
  ``hash -> {block_id: Block}``, insertion ordered, several blocks per hash, lookups taking the
  first. Block 0 is the null block: never queued, allocated, freed or published.

The pool appends its effect events (``evict``, ``alloc``, ``free``, ``publish``, ``unpublish``)
to ``events`` unless it is None.
"""

from __future__ import annotations

from collections.abc import Iterator

Event = tuple[object, ...]


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next", "generation")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.generation = 0
        """How many times it was allocated: which use of its memory a step's table names."""
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # Free-list links; a block outside the queue links to itself.
        self.prev: Block = self
        self.next: Block = self

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of blocks between a head and a tail sentinel."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next
        if block is self._tail:
            raise IndexError("the free queue is empty")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = block
        self.num_free -= 1

    def appendleft(self, block: Block) -> None:
        first = self._head.next
        block.prev, block.next = self._head, first
        self._head.next = first.prev = block
        self.num_free += 1

    def append(self, block: Block) -> None:
        last = self._tail.prev
        block.prev, block.next = last, self._tail
        self._tail.prev = last.next = block
        self.num_free += 1

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next


class BlockPool:
    __slots__ = (
        "blocks",
        "free_queue",
        "index",
        "events",
        "n_allocated",
        "n_touched",
        "n_freed",
        "n_evicted",
        "n_published",
    )

    def __init__(self, num_blocks: int, events: list[Event] | None = None) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])  # block 0 is the null block
        self.index: dict[bytes, dict[int, Block]] = {}
        self.events = events
        self.n_allocated = self.n_touched = self.n_freed = self.n_evicted = self.n_published = 0

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def cached_block(self, block_hash: bytes) -> Block | None:
        """The first block registered under the hash that is still registered, or None."""
        owners = self.index.get(block_hash)
        if not owners:
            return None
        return next(iter(owners.values()))

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on each block, out of the free queue if it was unreferenced."""
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1
        self.n_touched += len(blocks)

    def allocate(self, rid: int, group: int | None = None) -> Block:
        """Pop the free queue's head for request ``rid``, evicting its cached hash; ``group``
        (several KV-cache groups) is appended to the ``alloc`` event."""
        block = self.free_queue.popleft()
        events = self.events
        if block.block_hash is not None:
            self._drop_hash(block)
            self.n_evicted += 1
            if events is not None:
                events.append(("evict", block.block_id))
        block.ref_cnt = 1
        block.generation += 1
        self.n_allocated += 1
        if events is not None:
            if group is None:
                events.append(("alloc", rid, block.block_id))
            else:
                events.append(("alloc", rid, block.block_id, group))
        return block

    def free_reversed(self, blocks: list[Block]) -> None:
        """Drop one reference on each block, last first; an unreferenced block goes to the head
        of the free queue if it has no hash and to the tail (LRU) if it is cached."""
        events = self.events
        for block in reversed(blocks):
            self.let_go(block)
            if events is not None:
                events.append(("free", block.block_id))

    def let_go(self, block: Block) -> None:
        """Drop one reference on ``block`` with no ``free`` event (``free_reversed``'s step for
        one block; alone, the engine's own giving up of a block, ``GroupedKV.let_go_windows``,
        whose event names the table position)."""
        if block.ref_cnt <= 0:
            raise RuntimeError(f"double free of block {block.block_id}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)
        self.n_freed += 1

    def free_batch(self, blocks: list[Block]) -> None:
        """vLLM's ``free_blocks``: drop one reference on each block, last first, put those left
        unreferenced without a hash at the queue's head as one batch in that order, so the
        table's last block ends up first (``prepend_n``), and the cached ones at its tail in
        that order (without prefix caching no block has a hash)."""
        queue, events = self.free_queue, self.events
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if events is not None:
                events.append(("free", block.block_id))
        for block in blocks:  # the first pushed to the head ends up last of the batch
            if block.ref_cnt == 0 and block.block_hash is None:
                queue.appendleft(block)
        for block in reversed(blocks):
            if block.ref_cnt == 0 and block.block_hash is not None:
                queue.append(block)
        self.n_freed += len(blocks)

    def publish(
        self, block: Block, block_hash: bytes, rid: int, index: int, group: int | None = None
    ) -> None:
        """Register the block under ``block_hash`` unless it already carries a hash; ``group``
        (several KV-cache groups) is appended to the ``publish`` event."""
        if block.block_hash is not None:
            return
        if block.block_id == 0:
            raise RuntimeError("publish of the null block")
        block.block_hash = block_hash
        owners = self.index.get(block_hash)
        if owners is None:
            self.index[block_hash] = {block.block_id: block}
        else:
            owners[block.block_id] = block
        self.n_published += 1
        if self.events is not None:
            if group is None:
                self.events.append(("publish", rid, index, block.block_id))
            else:
                self.events.append(("publish", rid, index, block.block_id, group))

    def cache_free(self, block: Block, block_hash: bytes) -> None:
        """A free block the engine caches a copy in (a slot group's snapshot, ``slots.py``):
        its hash evicted first (an ``evict`` event), registered under ``block_hash`` and moved
        to the free queue's tail, unreferenced; the caller emits the ``snapshot``."""
        if block.ref_cnt or block.block_id == 0:
            raise RuntimeError(f"cache_free of block {block.block_id}: it is not free")
        if block.block_hash is not None:
            self._drop_hash(block)
            self.n_evicted += 1
            if self.events is not None:
                self.events.append(("evict", block.block_id))
        self.free_queue.remove(block)
        self.free_queue.append(block)
        block.block_hash = block_hash
        self.index.setdefault(block_hash, {})[block.block_id] = block
        self.n_published += 1

    def first_free(self) -> Block | None:
        """The free queue's head (the next block an allocation takes), or None."""
        return next(iter(self.free_queue), None)

    def unpublish(self, block: Block) -> None:
        """Roll back the block's registration, if it has one."""
        if block.block_hash is None:
            return
        self._drop_hash(block)
        if self.events is not None:
            self.events.append(("unpublish", block.block_id))

    def in_use(self) -> bool:
        """True when some block but the null block is referenced."""
        return self.free_queue.num_free != len(self.blocks) - 1

    def reset(self) -> None:
        """Drop every registration (in block id order); the free queue is left as it is."""
        cached = sorted(b.block_id for owners in self.index.values() for b in owners.values())
        for block_id in cached:
            self.blocks[block_id].block_hash = None
        self.index.clear()
        if self.events is not None:
            self.events.extend(("unpublish", block_id) for block_id in cached)

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(refcount of every block by id, free queue ids head first)."""
        return (
            tuple(b.ref_cnt for b in self.blocks),
            tuple(b.block_id for b in self.free_queue),
        )

    def _drop_hash(self, block: Block) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        owners = self.index[block_hash]
        del owners[block.block_id]
        if not owners:
            del self.index[block_hash]
        block.block_hash = None
