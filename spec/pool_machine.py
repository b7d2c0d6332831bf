"""The block pool on its own: the layer below the engine, as a state machine of its own.

``pool.py`` gives the engine's actions their pool mechanisms as helpers; here the same mechanisms
are the *actions*, for judging code that drives a pool directly, with no scheduler and no steps
(vLLM's ``BlockPool`` and ``KVCacheManager`` and the tests that call them). Nothing here knows
tokens or writes: a block's hash is an opaque key (the pool cannot tell which prefix it names),
and the properties are the pool's own bookkeeping, which the engine spec's safety rests on.

Variables: per block a refcount and the key it is cached under (or None); the free queue, head
first (block 0, the null block, is never in it); the index, key to blocks, oldest registration
first; the *holders* (who took each reference: a request at the ``KVCacheManager`` level, ``None``
for the anonymous caller of a bare ``BlockPool``); and the hits a ``KVCacheManager.allocate_slots``
call was handed and has not touched yet.

Decisions (``apply`` takes these; vLLM's names in brackets)::

    ("lookup", holder, keys)     the longest run of cached keys from the first  [get_computed_blocks]
    ("slots", holder, hits)      allocate_slots starts, handed these hit blocks [allocate_slots]
    ("touch", holder, blocks)    take a reference on each (out of the free queue) [touch]
    ("allocate", holder, n)      the free queue's first n blocks               [get_new_blocks]
    ("free", holder, blocks)     drop one reference each, in eviction order    [free_blocks]
    ("publish", holder, block, key)   register the block under the key [cache_full_blocks]
    ("evict", block)             drop the block's key, wherever it is [evict_blocks]
    ("reset",)                   drop every key; only with every block free     [reset_prefix_cache]
    ("slots_done", holder)       allocate_slots returns (its untouched hits expire)

Effects: ``("hit", holder, blocks)`` after a lookup; ``("evicted", block)`` (a cached free block's
key dropped as it is reused) and ``("alloc", holder, block)`` for each block an allocation takes.

``free`` is vLLM's batch semantics, not ``pool.release``'s one block at a time: of the blocks whose
refcount reaches 0, the unkeyed ones go to the queue's head *in the order given* (reused first), the
keyed ones to its tail in the order given (least recently used first); with caching off every block
counts as unkeyed. Pure standard-library Python, like the rest of ``kvspec.spec``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from .invariants import Violation
from .state import NULL_BLOCK, Illegal

TWIN_OF = "kvspec.spec.pool"
"""This module restates the spec's pool in another form (kvspec/twins.py says what it must equal)."""

Event = tuple[object, ...]
Holder = Hashable
"""Who holds a reference: a request id, or None (a bare pool's caller)."""
PoolKey = Hashable
"""A cached block's hash, opaque at this layer."""


@dataclass(slots=True)
class PoolBlock:
    refcount: int = 0
    key: PoolKey | None = None


@dataclass(slots=True)
class PoolState:
    blocks: list[PoolBlock]
    free: list[int]
    """The free queue, head (next to allocate) first."""
    index: dict[PoolKey, list[int]] = field(default_factory=dict)
    """Keys to blocks, oldest registration first; a lookup takes the first."""
    held: dict[Holder, list[int]] = field(default_factory=dict)
    """Each holder's references, in the order it took them."""
    pending: dict[Holder, dict[int, PoolKey]] = field(default_factory=dict)
    """Hits handed to an ``allocate_slots`` call and not touched yet: block -> its key then."""
    caching: bool = True
    """Prefix caching on: freed keyed blocks go to the tail and stay hittable."""


def initial_pool(num_blocks: int, caching: bool = True) -> PoolState:
    """Every block but the null block free, in id order; nothing cached, held or pending."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is null), got {num_blocks}")
    blocks = [PoolBlock() for _ in range(num_blocks)]
    return PoolState(blocks=blocks, free=list(range(1, num_blocks)), caching=caching)


def lookup(s: PoolState, holder: Holder, keys: tuple[PoolKey, ...]) -> list[Event]:
    """The first block cached under each key, stopping at the first miss. Pure: it takes no
    reference (the caller touches what it keeps)."""
    hits: list[int] = []
    for key in keys if s.caching else ():
        owners = s.index.get(key)
        if not owners:
            break
        hits.append(owners[0])
    return [("hit", holder, tuple(hits))]


def slots(s: PoolState, holder: Holder, hits: tuple[int, ...]) -> list[Event]:
    """An ``allocate_slots`` call begins with these hit blocks: each must be cached now, and
    stays pending (TouchBeforeAllocate) until it is touched or the call returns."""
    pending: dict[int, PoolKey] = {}
    for block in hits:
        key = _block(s, block, "slots").key
        if block == NULL_BLOCK or key is None:
            raise Illegal(f"allocate_slots for {_who(holder)}: hit block {block} is not cached")
        pending[block] = key
    s.pending[holder] = pending
    return []


def slots_done(s: PoolState, holder: Holder) -> list[Event]:
    s.pending.pop(holder, None)
    return []


def touch(s: PoolState, holder: Holder, blocks: tuple[int, ...]) -> list[Event]:
    """Take a reference on each block, out of the free queue if it was unreferenced."""
    for block in blocks:
        b = _block(s, block, "touch")
        if block == NULL_BLOCK:
            raise Illegal("touch of the null block")
        if b.refcount == 0:
            if block not in s.free:
                raise Illegal(f"touch of block {block}: unreferenced but not in the free queue")
            s.free.remove(block)
        b.refcount += 1
        s.held.setdefault(holder, []).append(block)
        s.pending.get(holder, {}).pop(block, None)
    return []


def allocate(s: PoolState, holder: Holder, n: int) -> list[Event]:
    """The free queue's first ``n`` blocks, each losing the key it was cached under."""
    if not isinstance(n, int) or n < 0 or n > len(s.free):
        raise Illegal(f"allocate {n} blocks for {_who(holder)}: {len(s.free)} free")
    events: list[Event] = []
    for _ in range(n):
        block = s.free.pop(0)
        b = s.blocks[block]
        if b.key is not None:
            _drop_key(s, block)
            events.append(("evicted", block))
        b.refcount += 1
        s.held.setdefault(holder, []).append(block)
        events.append(("alloc", holder, block))
    return events


def free(s: PoolState, holder: Holder, blocks: tuple[int, ...]) -> list[Event]:
    """Drop one reference on each block (the null block is skipped); those that reach 0 rejoin
    the queue: unkeyed ones at its head in the order given, keyed ones at its tail."""
    first: list[int] = []
    last: list[int] = []
    for block in blocks:
        b = _block(s, block, "free")
        if block == NULL_BLOCK:
            continue
        if b.refcount <= 0:
            raise Illegal(f"free of block {block} by {_who(holder)}: refcount is {b.refcount}")
        mine = s.held.get(holder, [])
        if block not in mine:
            raise Illegal(f"free of block {block} by {_who(holder)}, which holds no reference")
        mine.remove(block)
        b.refcount -= 1
        if b.refcount == 0:
            (last if b.key is not None and s.caching else first).append(block)
    s.free[:0] = first
    s.free.extend(last)
    return []


def publish(s: PoolState, holder: Holder, block: int, key: PoolKey) -> list[Event]:
    """Register the block under the key (a block already under that key is left as it is)."""
    b = _block(s, block, "publish")
    if block == NULL_BLOCK:
        raise Illegal("publish of the null block")
    if b.key == key:
        return []
    if b.key is not None:
        raise Illegal(f"publish of block {block} under a second key")
    b.key = key
    s.index.setdefault(key, []).append(block)
    return []


def evict(s: PoolState, block: int) -> list[Event]:
    """Drop the block's key (if any), whether it is free or held."""
    if _block(s, block, "evict").key is not None:
        _drop_key(s, block)
    return []


def reset(s: PoolState) -> list[Event]:
    """Drop every key: only when no block is referenced."""
    used = [blk for blk, b in enumerate(s.blocks) if b.refcount]
    if used:
        raise Illegal(f"reset: blocks {used[:8]} are referenced")
    for b in s.blocks:
        b.key = None
    s.index.clear()
    return []


POOL_ACTIONS: dict[str, Callable[..., list[Event]]] = {
    "lookup": lookup,
    "slots": slots,
    "touch": touch,
    "allocate": allocate,
    "free": free,
    "publish": publish,
    "evict": evict,
    "reset": reset,
    "slots_done": slots_done,
}


def apply_pool(s: PoolState, event: Event) -> list[Event]:
    """Take one pool decision; return the effect events it causes."""
    action = POOL_ACTIONS.get(str(event[0])) if event else None
    if action is None:
        raise Illegal(f"unknown pool decision {event!r}")
    try:
        return action(s, *event[1:])
    except TypeError as err:
        raise Illegal(f"malformed pool decision {event!r}: {err}") from None


# -- invariants ---------------------------------------------------------------------------------


def refcount_is_holders(s: PoolState) -> Violation | None:
    """A block's refcount equals the references its holders took and have not dropped. Guards
    against leaks and against a block reused while someone still reads it."""
    owners: Counter[int] = Counter()
    for blocks in s.held.values():
        owners.update(blocks)
    for block, b in enumerate(s.blocks):
        if block != NULL_BLOCK and b.refcount != owners[block]:
            return Violation(
                "RefcountIsHolders",
                f"block {block} has refcount {b.refcount} but {owners[block]} references held",
                blocks=(block,),
            )
    return None


def pool_free_queue_exact(s: PoolState) -> Violation | None:
    """The free queue holds exactly the unreferenced blocks but the null block, each once.
    Guards against a block handed out twice and against lost blocks."""
    expected = {blk for blk, b in enumerate(s.blocks) if blk != NULL_BLOCK and b.refcount == 0}
    if len(s.free) != len(set(s.free)) or set(s.free) != expected:
        odd = sorted(set(s.free) ^ expected) or sorted(
            b for b, n in Counter(s.free).items() if n > 1
        )
        return Violation(
            "FreeQueueExact",
            f"the free queue and the unreferenced blocks differ at blocks {odd[:8]}",
            blocks=tuple(odd[:8]),
        )
    return None


def pool_hash_index_consistent(s: PoolState) -> Violation | None:
    """The index and the blocks' own keys agree: every indexed block carries that key, every
    keyed block is indexed once. Guards against a stale entry that outlives an eviction."""
    indexed = [blk for blocks in s.index.values() for blk in blocks]
    if len(indexed) != len(set(indexed)) or any(not blocks for blocks in s.index.values()):
        return Violation("HashIndexConsistent", "a block is indexed twice, or an entry is empty")
    for key, blocks in s.index.items():
        for block in blocks:
            if s.blocks[block].key != key:
                return Violation(
                    "HashIndexConsistent",
                    f"block {block} is indexed under a key it does not carry",
                    blocks=(block,),
                )
    keyed = {blk for blk, b in enumerate(s.blocks) if b.key is not None}
    if keyed != set(indexed):
        odd = tuple(sorted(keyed ^ set(indexed))[:8])
        return Violation(
            "HashIndexConsistent", f"blocks {list(odd)} carry a key but are not indexed", odd
        )
    return None


def pool_null_block_pinned(s: PoolState) -> Violation | None:
    """Block 0 is never referenced, keyed, queued or held."""
    b = s.blocks[NULL_BLOCK]
    held = any(NULL_BLOCK in blocks for blocks in s.held.values())
    if b.refcount or b.key is not None or NULL_BLOCK in s.free or held:
        return Violation(
            "NullBlockPinned", "the null block was referenced, cached or queued", (NULL_BLOCK,)
        )
    return None


def touch_before_allocate(s: PoolState) -> Violation | None:
    """A hit handed to ``allocate_slots`` still carries its key until it is touched. Guards
    against allocating before touching: a hit block still in the free queue can be handed out as
    a "new" block (its key evicted), and the request then shares memory that is about to be
    overwritten with the request it was given to."""
    for holder, hits in s.pending.items():
        for block, key in hits.items():
            if s.blocks[block].key != key:
                return Violation(
                    "TouchBeforeAllocate",
                    f"block {block}, a hit of {_who(holder)} not touched yet, lost its key "
                    f"(reused as a new block) before {_who(holder)} touched it",
                    blocks=(block,),
                    requests=(holder,) if isinstance(holder, int) else (),
                )
    return None


POOL_INVARIANTS: dict[str, Callable[[PoolState], Violation | None]] = {
    "TouchBeforeAllocate": touch_before_allocate,
    "RefcountIsHolders": refcount_is_holders,
    "FreeQueueExact": pool_free_queue_exact,
    "HashIndexConsistent": pool_hash_index_consistent,
    "NullBlockPinned": pool_null_block_pinned,
}


def check_pool(s: PoolState) -> Violation | None:
    """The first pool invariant that fails, or None."""
    for predicate in POOL_INVARIANTS.values():
        violated = predicate(s)
        if violated is not None:
            return violated
    return None


def _drop_key(s: PoolState, block: int) -> None:
    b = s.blocks[block]
    owners = s.index[b.key]
    owners.remove(block)
    if not owners:
        del s.index[b.key]
    b.key = None


def _block(s: PoolState, block: object, what: str) -> PoolBlock:
    if not isinstance(block, int) or not 0 <= block < len(s.blocks):
        raise Illegal(f"{what}: no block {block!r}")
    return s.blocks[block]


def _who(holder: Holder) -> str:
    if holder is None:
        return "the caller"
    return f"r{holder}" if isinstance(holder, int) else str(holder)
