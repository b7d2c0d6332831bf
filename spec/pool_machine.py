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

Partial prefix-cache hits (vLLM's hybrid managers with a hash block size below the block size)
add a block published under *several* keys and four decisions::

    ("alias", holder, block, key)    one more key on a cached block      [cache_partial_block]
    ("move", holder, src, dst)       every key of src re-pointed to dst  [move_block_hashes]
    ("unpin", holder, blocks)        drop one reference each; those at 0 join the queue's tail,
                                     read until an allocation reuses them [unpin_blocks]
    ("give", holder, blocks, to)     one reference each handed to another holder
                                     [pop_blocks_for_free, copy-on-write retention]

``evict`` drops *every* key of the block (a promotion to a longer prefix or a replaced content
is an ``evict`` then a ``publish``). Their ghost variables (what each block lost at an eviction,
what a move took from it, the unpinned blocks an allocation reused) are what the invariants
``EvictionDropsEveryKey``, ``MoveLeavesNoKey`` and ``ReadUntilReuse`` read; they hold on the
machine by construction and are checked on the *engine's* pool (``observed``), so a pool that
keeps a key the machine dropped, or reuses a block without telling its reader, is named.

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
    also: list[PoolKey] = field(default_factory=list)
    """Keys beyond the first (partial prefix-cache entries), in registration order."""

    def keys(self) -> list[PoolKey]:
        return [] if self.key is None else [self.key, *self.also]


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
    watched: dict[int, Holder] = field(default_factory=dict)
    """Blocks released by ``unpin`` whose reader still reads them, until an allocation reuses
    them (vLLM's reuse watchers), in registration order."""
    dropped: dict[int, set[PoolKey]] = field(default_factory=dict)
    """Ghost: the keys each block lost at an eviction and was not published under since."""
    moved: dict[int, set[PoolKey]] = field(default_factory=dict)
    """Ghost: the keys a move took from each block and it was not published under since."""
    reused: set[int] = field(default_factory=set)
    """Ghost: watched blocks an allocation handed out (their reader must have been told)."""


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
        if s.watched.pop(block, _UNWATCHED) is not _UNWATCHED:
            s.reused.add(block)
        if b.key is not None:
            _drop_keys(s, block)
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
    _add_key(s, block, key)
    return []


def alias(s: PoolState, holder: Holder, block: int, key: PoolKey) -> list[Event]:
    """One more key on a block already cached (a partial prefix-cache entry on a cached block);
    a key it carries already is left as it is."""
    b = _block(s, block, "alias")
    if block == NULL_BLOCK or b.key is None:
        raise Illegal(f"alias of block {block}: it is not cached")
    if key not in b.keys():
        _add_key(s, block, key)
    return []


def move(s: PoolState, holder: Holder, src: int, dst: int) -> list[Event]:
    """Every key of ``src`` re-pointed to ``dst`` (uncached, not the null block): the index
    drops ``src`` and registers ``dst`` last under each."""
    a, b = _block(s, src, "move"), _block(s, dst, "move")
    if NULL_BLOCK in (src, dst) or src == dst:
        raise Illegal(f"move of the keys of block {src} to block {dst}")
    if b.key is not None:
        raise Illegal(f"move to block {dst}: it is cached already")
    keys = a.keys()
    _drop_keys(s, src, s.moved)
    for key in keys:
        _add_key(s, dst, key)
    return []


def unpin(s: PoolState, holder: Holder, blocks: tuple[int, ...]) -> list[Event]:
    """Drop one reference each; those that reach 0 join the queue's tail (keyed or not: last
    resort), and every block stays read until an allocation reuses it (``watched``)."""
    last: list[int] = []
    for block in blocks:
        b = _block(s, block, "unpin")
        mine = s.held.get(holder, [])
        if block == NULL_BLOCK or b.refcount <= 0 or block not in mine:
            raise Illegal(f"unpin of block {block} by {_who(holder)}, which holds no reference")
        mine.remove(block)
        b.refcount -= 1
        s.watched[block] = holder
        s.reused.discard(block)
        if b.refcount == 0:
            last.append(block)
    s.free.extend(last)
    return []


def give(s: PoolState, holder: Holder, blocks: tuple[int, ...], to: Holder) -> list[Event]:
    """One reference on each block passes from ``holder`` to ``to`` (a request's blocks popped
    for a deferred free; a copy-on-write endpoint retained for the copy): no refcount changes."""
    for block in blocks:
        _block(s, block, "give")
        mine = s.held.get(holder, [])
        if block not in mine:
            raise Illegal(f"give of block {block} by {_who(holder)}, which holds no reference")
        mine.remove(block)
        s.held.setdefault(to, []).append(block)
    return []


def evict(s: PoolState, block: int) -> list[Event]:
    """Drop every key of the block (if any), whether it is free or held."""
    if _block(s, block, "evict").key is not None:
        _drop_keys(s, block)
    return []


def reset(s: PoolState) -> list[Event]:
    """Drop every key: only when no block is referenced."""
    used = [blk for blk, b in enumerate(s.blocks) if b.refcount]
    if used:
        raise Illegal(f"reset: blocks {used[:8]} are referenced")
    for block, b in enumerate(s.blocks):
        if b.key is not None:
            s.dropped.setdefault(block, set()).update(b.keys())
        b.key = None
        b.also.clear()
    s.index.clear()
    s.watched.clear()  # every reader is told
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
    "alias": alias,
    "move": move,
    "unpin": unpin,
    "give": give,
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
    key a block carries indexes it once. Guards against a stale entry that outlives an eviction."""
    if any(not blocks or len(blocks) != len(set(blocks)) for blocks in s.index.values()):
        return Violation("HashIndexConsistent", "a block is indexed twice, or an entry is empty")
    for key, blocks in s.index.items():
        for block in blocks:
            if key not in s.blocks[block].keys():
                return Violation(
                    "HashIndexConsistent",
                    f"block {block} is indexed under a key it does not carry",
                    blocks=(block,),
                )
    for block, b in enumerate(s.blocks):
        if len(b.keys()) != len(set(b.keys())) or any(
            block not in s.index.get(key, ()) for key in b.keys()
        ):
            return Violation(
                "HashIndexConsistent", f"blocks {[block]} carry a key but are not indexed", (block,)
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


def eviction_drops_every_key(s: PoolState) -> Violation | None:
    """A block that lost its keys (evicted, reused as a new block, its content replaced, the
    cache reset) carries none of them until it is published under one again. Guards against a
    key that survives its block's eviction: a later lookup under it is handed a block whose
    content is another prefix's."""
    for block, gone in s.dropped.items():
        kept = gone & set(s.blocks[block].keys())
        if kept:
            return Violation(
                "EvictionDropsEveryKey",
                f"block {block} still carries {len(kept)} of the keys it lost at an eviction",
                blocks=(block,),
            )
    return None


def move_leaves_no_key(s: PoolState) -> Violation | None:
    """A block whose keys were moved to a copy carries none of them until it is published under
    one again. Guards against a moved key left behind: the source keeps being written (that is
    why the keys moved), so a hit on it reads a prefix that is no longer there."""
    for block, gone in s.moved.items():
        kept = gone & set(s.blocks[block].keys())
        if kept:
            return Violation(
                "MoveLeavesNoKey",
                f"block {block} still carries {len(kept)} of the keys moved off it",
                blocks=(block,),
            )
    return None


def read_until_reuse(s: PoolState) -> Violation | None:
    """A block released by ``unpin`` is read until an allocation reuses it, and its reader is
    told then: no block an allocation handed out is still watched. Guards against a reader that
    keeps reading a block the pool has handed to a new owner (it reads another request's
    writes)."""
    late = sorted(s.reused & set(s.watched))
    if late:
        return Violation(
            "ReadUntilReuse",
            f"blocks {late[:8]} were handed out while their reader was not told",
            blocks=tuple(late[:8]),
        )
    return None


OBSERVED_INVARIANTS: dict[str, Callable[[PoolState], Violation | None]] = {
    "EvictionDropsEveryKey": eviction_drops_every_key,
    "MoveLeavesNoKey": move_leaves_no_key,
    "ReadUntilReuse": read_until_reuse,
    "FreeQueueExact": pool_free_queue_exact,
}
"""The invariants the judge also checks on the engine's observable pool (``observed``): its
refcounts, free queue, keys and watchers with the machine's holders and ghost variables."""


POOL_INVARIANTS: dict[str, Callable[[PoolState], Violation | None]] = {
    "TouchBeforeAllocate": touch_before_allocate,
    "RefcountIsHolders": refcount_is_holders,
    "FreeQueueExact": pool_free_queue_exact,
    "HashIndexConsistent": pool_hash_index_consistent,
    "NullBlockPinned": pool_null_block_pinned,
    "EvictionDropsEveryKey": eviction_drops_every_key,
    "MoveLeavesNoKey": move_leaves_no_key,
    "ReadUntilReuse": read_until_reuse,
}


def check_pool(s: PoolState) -> Violation | None:
    """The first pool invariant that fails, or None."""
    for predicate in POOL_INVARIANTS.values():
        violated = predicate(s)
        if violated is not None:
            return violated
    return None


_UNWATCHED = object()


def cached_keys(s: PoolState) -> dict[int, PoolKey]:
    """Block -> its key, or the frozenset of its keys where it carries several (what
    ``PoolJudge.compare`` is given)."""
    out: dict[int, PoolKey] = {}
    for block, b in enumerate(s.blocks):
        if b.key is not None:
            out[block] = b.key if not b.also else frozenset(b.keys())
    return out


def observed(
    s: PoolState,
    refcounts: tuple[int, ...],
    free: tuple[int, ...],
    keys: dict[int, PoolKey],
    watched: tuple[int, ...] | None = None,
) -> PoolState:
    """The engine's observable pool (as ``cached_keys`` gives keys) with the machine's holders
    and ghost variables: what ``OBSERVED_INVARIANTS`` are checked on."""
    blocks = [PoolBlock(refcount=n) for n in refcounts]
    index: dict[PoolKey, list[int]] = {}
    for block, value in keys.items():
        many = sorted(value, key=repr) if isinstance(value, frozenset) else [value]
        blocks[block].key, blocks[block].also = many[0], many[1:]
        for key in many:
            index.setdefault(key, []).append(block)
    return PoolState(
        blocks=blocks,
        free=list(free),
        index=index,
        held=s.held,
        pending=s.pending,
        caching=s.caching,
        watched=dict.fromkeys(watched, None) if watched is not None else dict(s.watched),
        dropped=s.dropped,
        moved=s.moved,
        reused=s.reused,
    )


def _add_key(s: PoolState, block: int, key: PoolKey) -> None:
    b = s.blocks[block]
    if b.key is None:
        b.key = key
    else:
        b.also.append(key)
    s.index.setdefault(key, []).append(block)
    for ghost in (s.dropped, s.moved):
        ghost.get(block, set()).discard(key)


def _drop_keys(s: PoolState, block: int, ghost: dict[int, set[PoolKey]] | None = None) -> None:
    """Every key of the block leaves it and the index; the ghost (``dropped`` unless given)
    remembers them."""
    b = s.blocks[block]
    keys = b.keys()
    for key in keys:
        owners = s.index[key]
        owners.remove(block)
        if not owners:
            del s.index[key]
    (s.dropped if ghost is None else ghost).setdefault(block, set()).update(keys)
    b.key = None
    b.also.clear()


def _block(s: PoolState, block: object, what: str) -> PoolBlock:
    if not isinstance(block, int) or not 0 <= block < len(s.blocks):
        raise Illegal(f"{what}: no block {block!r}")
    return s.blocks[block]


def _who(holder: Holder) -> str:
    if holder is None:
        return "the caller"
    return f"r{holder}" if isinstance(holder, int) else str(holder)
