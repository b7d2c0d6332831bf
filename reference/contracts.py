"""CrossHair contracts for the reference ``BlockPool`` (issue #3, see ``docs/proofs.md``).

The same flat pool description as ``kvspec.proofs.contracts`` (the reference never imports the spec,
so the few helpers are repeated here): ``n`` blocks counting the null block, the free queue
``free`` head first, ``refs`` by block id, and ``keys`` by block id (0 for no hash, ``k`` for the
hash ``bytes([k])``; blocks sharing ``k`` share the hash, registered in id order). Each wrapper
builds a ``BlockPool`` in that state, runs one operation and returns a flat ``Pool`` snapshot
whose ``links_ok`` records the pool's own consistency (``links_ok``): the intrusive free list
walked forward and backward agree, ``num_free`` is its length, no block is in it twice, blocks
outside it link to themselves, it holds exactly the unreferenced non-null blocks, and the hash
index agrees with the blocks' hashes.

``free_then_allocate`` is the reference half of a ``crosshair diffbehavior`` pair with
``kvspec.proofs.contracts.free_then_allocate``.
"""

from __future__ import annotations

from typing import NamedTuple

from .block_pool import Block, BlockPool, FreeBlockQueue

TWIN_OF = "kvspec.spec"
"""This module restates the spec in another form (kvspec/twins.py says what it must equal)."""

MAX_BLOCKS = 5
MAX_REF = 3
MAX_KEY = 3


class Pool(NamedTuple):
    """A flat snapshot of the pool after an operation."""

    free: list[int]
    refs: list[int]
    keys: list[int]
    owners: list[tuple[int, list[int]]]
    links_ok: bool


def hash_of(k: int) -> bytes | None:
    return bytes([k]) if k > 0 else None


def distinct(xs: list[int]) -> bool:
    return all(xs[i] != xs[j] for i in range(len(xs)) for j in range(i))


def consistent(n: int, free: list[int], refs: list[int], keys: list[int]) -> bool:
    """A reachable pool state: sizes in range, the null block unreferenced and unpublished, the
    free queue exactly the unreferenced non-null blocks, each once."""
    if not (2 <= n <= MAX_BLOCKS and len(refs) == n and len(keys) == n):
        return False
    if refs[0] != 0 or keys[0] != 0:
        return False
    if not all(0 <= r <= MAX_REF for r in refs) or not all(0 <= k <= MAX_KEY for k in keys):
        return False
    unreferenced = [b for b in range(1, n) if refs[b] == 0]
    return (
        len(free) == len(unreferenced)
        and all(0 < b < n and refs[b] == 0 for b in free)
        and all(b in free for b in unreferenced)
    )


def table_ok(n: int, refs: list[int], table: list[int]) -> bool:
    """A request's blocks: distinct, non-null, each referenced."""
    return distinct(table) and all(0 < b < n and refs[b] >= 1 for b in table)


def build(n: int, free: list[int], refs: list[int], keys: list[int]) -> BlockPool:
    bp = BlockPool(n)
    for b, block in enumerate(bp.blocks):
        block.ref_cnt = refs[b]
        block.prev = block.next = block
    bp.free_queue = FreeBlockQueue([bp.blocks[b] for b in free])
    for b in range(n):
        h = hash_of(keys[b])
        if h is not None:
            bp.publish(bp.blocks[b], h, rid=-1, index=0)
    return bp


def walk(bp: BlockPool) -> tuple[list[int], list[int]] | None:
    """The free list's ids walked head to tail and tail to head, or None if either walk does not
    reach the other sentinel within ``len(blocks)`` steps (a cycle or a broken link)."""
    q = bp.free_queue
    forward: list[int] = []
    node: Block = q._head.next
    while node is not q._tail:
        if len(forward) >= len(bp.blocks) or node.next.prev is not node:
            return None
        forward.append(node.block_id)
        node = node.next
    backward: list[int] = []
    node = q._tail.prev
    while node is not q._head:
        if len(backward) >= len(bp.blocks) or node.prev.next is not node:
            return None
        backward.append(node.block_id)
        node = node.prev
    return forward, backward


def links_ok(bp: BlockPool) -> bool:
    """The reference's own consistency (see the module docstring)."""
    walked = walk(bp)
    if walked is None:
        return False
    forward, backward = walked
    n = len(bp.blocks)
    unreferenced = [b for b in range(1, n) if bp.blocks[b].ref_cnt == 0]
    if forward != backward[::-1] or bp.free_queue.num_free != len(forward) or not distinct(forward):
        return False
    if sorted(forward) != unreferenced:
        return False
    if any(bp.blocks[b].ref_cnt < 0 for b in range(n)):
        return False
    outside = [block for block in bp.blocks if block.block_id not in forward]
    if any(block.prev is not block or block.next is not block for block in outside):
        return False
    indexed: list[int] = []
    for h, owners in bp.index.items():
        if not owners:
            return False
        for bid, block in owners.items():
            if block is not bp.blocks[bid] or block.block_hash != h:
                return False
            indexed.append(bid)
    hashed = [b for b in range(n) if bp.blocks[b].block_hash is not None]
    return distinct(indexed) and sorted(indexed) == hashed and bp.blocks[0].block_hash is None


def snapshot(bp: BlockPool) -> Pool:
    return Pool(
        free=[b.block_id for b in bp.free_queue],
        refs=[b.ref_cnt for b in bp.blocks],
        keys=[b.block_hash[0] if b.block_hash is not None else 0 for b in bp.blocks],
        owners=[(h[0], list(owners)) for h, owners in bp.index.items()],
        links_ok=links_ok(bp),
    )


def allocate(n: int, free: list[int], refs: list[int], keys: list[int]) -> tuple[int, Pool]:
    """``BlockPool.allocate``: pop the head, evicting its hash (block given, pool after).

    pre: consistent(n, free, refs, keys)
    pre: len(free) > 0
    post: __return__[1].links_ok
    post: allocate_effect(n, free, refs, keys, *__return__)
    """
    bp = build(n, free, refs, keys)
    block = bp.allocate(rid=0)
    return block.block_id, snapshot(bp)


def allocate_effect(
    n: int, free: list[int], refs: list[int], keys: list[int], block: int, p: Pool
) -> bool:
    """The head is given out with one reference and no hash; it leaves the index (evicted);
    the rest of the queue keeps its order; other blocks are unchanged."""
    head = free[0]
    return (
        block == head
        and p.free == free[1:]
        and p.refs[head] == 1
        and p.keys[head] == 0
        and all(head not in owners for _, owners in p.owners)
        and all(p.refs[b] == refs[b] and p.keys[b] == keys[b] for b in range(n) if b != head)
    )


def free_reversed(
    n: int, free: list[int], refs: list[int], keys: list[int], table: list[int]
) -> Pool:
    """``BlockPool.free_reversed``: one reference off each block, last first; an unreferenced
    block goes to the head when it has no hash, to the tail when cached.

    pre: consistent(n, free, refs, keys)
    pre: table_ok(n, refs, table)
    post: __return__.links_ok
    post: free_reversed_effect(n, free, refs, keys, table, __return__)
    """
    bp = build(n, free, refs, keys)
    bp.free_reversed([bp.blocks[b] for b in table])
    return snapshot(bp)


def free_reversed_effect(
    n: int, free: list[int], refs: list[int], keys: list[int], table: list[int], p: Pool
) -> bool:
    dropped = [b for b in table if refs[b] == 1]
    return (
        p.free
        == [b for b in dropped if keys[b] == 0]
        + free
        + [b for b in reversed(dropped) if keys[b] != 0]
        and all(p.refs[b] == refs[b] - (1 if b in table else 0) for b in range(n))
        and p.keys == keys
    )


def touch(n: int, free: list[int], refs: list[int], keys: list[int], blocks: list[int]) -> Pool:
    """``BlockPool.touch``: one reference on each block, out of the queue if it had none.

    pre: consistent(n, free, refs, keys)
    pre: distinct(blocks) and all(0 < b < n for b in blocks)
    post: __return__.links_ok
    post: touch_effect(n, free, refs, keys, blocks, __return__)
    """
    bp = build(n, free, refs, keys)
    bp.touch([bp.blocks[b] for b in blocks])
    return snapshot(bp)


def touch_effect(
    n: int, free: list[int], refs: list[int], keys: list[int], blocks: list[int], p: Pool
) -> bool:
    return (
        p.free == [b for b in free if b not in blocks]
        and all(p.refs[b] == refs[b] + (1 if b in blocks else 0) for b in range(n))
        and p.keys == keys
    )


def publish(n: int, free: list[int], refs: list[int], keys: list[int], block: int, k: int) -> Pool:
    """``BlockPool.publish`` of a referenced block under hash ``bytes([k])``.

    pre: consistent(n, free, refs, keys)
    pre: 0 < block < n and refs[block] >= 1
    pre: 1 <= k <= MAX_KEY
    post: __return__.links_ok
    post: publish_effect(n, free, refs, keys, block, k, __return__)
    """
    bp = build(n, free, refs, keys)
    h = hash_of(k)
    assert h is not None
    bp.publish(bp.blocks[block], h, rid=0, index=0)
    return snapshot(bp)


def publish_effect(
    n: int, free: list[int], refs: list[int], keys: list[int], block: int, k: int, p: Pool
) -> bool:
    """An unhashed block is registered last under ``k``; a hashed one keeps its hash. Nothing
    else changes."""
    if keys[block] == 0:
        registered = p.keys[block] == k and dict(p.owners)[k][-1] == block
    else:
        registered = p.keys[block] == keys[block]
    return (
        registered
        and all(p.keys[b] == keys[b] for b in range(n) if b != block)
        and p.free == free
        and p.refs == refs
    )


def evict(n: int, free: list[int], refs: list[int], keys: list[int], block: int) -> Pool:
    """``BlockPool.unpublish`` (a rollback or a dropped registration) of one block.

    pre: consistent(n, free, refs, keys)
    pre: 0 <= block < n
    post: __return__.links_ok
    post: evict_effect(n, free, refs, keys, block, __return__)
    """
    bp = build(n, free, refs, keys)
    bp.unpublish(bp.blocks[block])
    return snapshot(bp)


def evict_effect(
    n: int, free: list[int], refs: list[int], keys: list[int], block: int, p: Pool
) -> bool:
    return (
        p.keys[block] == 0
        and all(block not in owners for _, owners in p.owners)
        and all(p.keys[b] == keys[b] for b in range(n) if b != block)
        and p.free == free
        and p.refs == refs
    )


def free_then_allocate(
    n: int, free: list[int], refs: list[int], keys: list[int], table: list[int], k: int
) -> tuple[list[int], list[int], list[int], list[bool]] | None:
    """Free ``table`` (in reverse), then allocate up to ``k`` blocks: (blocks allocated, free
    queue after, refcounts after, which blocks are cached after), or None when the input is not a
    consistent state. The reference half of a ``diffbehavior`` pair with
    ``kvspec.proofs.contracts.free_then_allocate``."""
    if not (consistent(n, free, refs, keys) and table_ok(n, refs, table) and 0 <= k <= n):
        return None
    bp = build(n, free, refs, keys)
    bp.free_reversed([bp.blocks[b] for b in table])
    allocated: list[int] = []
    for _ in range(k):
        if not bp.num_free:
            break
        allocated.append(bp.allocate(rid=0).block_id)
    after = [b.block_id for b in bp.free_queue]
    return (
        allocated,
        after,
        [b.ref_cnt for b in bp.blocks],
        [b.block_hash is not None for b in bp.blocks],
    )
