"""CrossHair contracts for the spec's block-pool mechanisms (issue #3, see ``docs/proofs.md``).

CrossHair builds a class's ``self`` only through ``__init__``, so a pool state that needs a
sequence of calls would never be explored. Each mechanism of ``pool.py`` is therefore wrapped as a
pure function of a small *flat* pool description that CrossHair can make symbolic:

* ``n``: blocks, counting the null block 0 (2 .. ``MAX_BLOCKS``);
* ``free``: the free queue, head first, as block ids;
* ``refs``: the refcount of every block, by id;
* ``keys``: the published hash of every block, by id: 0 for none, ``k`` for the key
  ``(1, 2, .., k)`` (``key_of``). Several blocks may share a key; the index lists them in id order.

The wrapper builds a consistent ``State`` (block size 1), calls the spec function and returns a
flat ``Pool`` snapshot. ``pre:`` says the input is a consistent pool (``consistent``) plus the
action's guard; ``post:`` says the pool invariants still hold (``pool_ok``: FreeQueueExact,
HashIndexConsistent, NullBlockPinned, refcounts >= 0) and states the action's exact effect.

Run with ``crosshair check kvspec.proofs.contracts`` (``make contracts``).
``free_then_allocate`` is the spec half of a ``crosshair diffbehavior`` pair with
``kvspec.reference.contracts.free_then_allocate``; ``diffbehavior`` ignores ``pre:``, so it checks
its own precondition and returns None when it fails.
"""

from __future__ import annotations

from typing import NamedTuple

from kvspec.spec import pool
from kvspec.spec.invariants import free_queue_exact, hash_index_consistent, null_block_pinned
from kvspec.spec.state import Block, Config, Key, Request, State

TWIN_OF = "kvspec.spec"
"""This module restates the spec in another form (kvspec/twins.py says what it must equal)."""

MAX_BLOCKS = 5
MAX_REF = 3
MAX_KEY = 3


class Pool(NamedTuple):
    """A flat snapshot of the pool after an action."""

    free: list[int]
    refs: list[int]
    keys: list[Key | None]
    owners: list[tuple[Key, list[int]]]


def key_of(k: int) -> Key | None:
    """The key a flat key number stands for: None for 0, else ``(1, 2, .., k)``."""
    return tuple(range(1, k + 1)) if k > 0 else None


def distinct(xs: list[int]) -> bool:
    return all(xs[i] != xs[j] for i in range(len(xs)) for j in range(i))


def consistent(n: int, free: list[int], refs: list[int], keys: list[int]) -> bool:
    """A pool state the spec can reach: sizes in range, the null block unreferenced and
    unpublished, and the free queue exactly the unreferenced non-null blocks, each once."""
    if not (2 <= n <= MAX_BLOCKS and len(refs) == n and len(keys) == n):
        return False
    if refs[0] != 0 or keys[0] != 0:
        return False
    if not all(0 <= r <= MAX_REF for r in refs) or not all(0 <= k <= MAX_KEY for k in keys):
        return False
    unreferenced = [b for b in range(1, n) if refs[b] == 0]
    # Every queued block is unreferenced, every unreferenced block is queued, and the lengths
    # agree: so the queue is a permutation of them (no block twice).
    return (
        len(free) == len(unreferenced)
        and all(0 < b < n and refs[b] == 0 for b in free)
        and all(b in free for b in unreferenced)
    )


def table_ok(n: int, refs: list[int], table: list[int]) -> bool:
    """A request's table: distinct non-null blocks it holds a reference on."""
    return distinct(table) and all(0 < b < n and refs[b] >= 1 for b in table)


def build(n: int, free: list[int], refs: list[int], keys: list[int]) -> State:
    blocks = [Block(refcount=refs[b], key=key_of(keys[b])) for b in range(n)]
    index: dict[Key, list[int]] = {}
    for b in range(n):
        key = blocks[b].key
        if key is not None:
            index.setdefault(key, []).append(b)
    config = Config(num_blocks=n, block_size=1)
    return State(config=config, blocks=blocks, free=list(free), index=index)


def snapshot(s: State) -> Pool:
    return Pool(
        free=list(s.free),
        refs=[b.refcount for b in s.blocks],
        keys=[b.key for b in s.blocks],
        owners=[(key, list(blocks)) for key, blocks in s.index.items()],
    )


def pool_ok(p: Pool) -> bool:
    """The spec's pool invariants on a snapshot: refcounts >= 0, FreeQueueExact,
    HashIndexConsistent, NullBlockPinned."""
    blocks = [Block(refcount=r, key=k) for r, k in zip(p.refs, p.keys, strict=True)]
    config = Config(num_blocks=len(blocks), block_size=1)
    s = State(config=config, blocks=blocks, free=list(p.free), index=dict(p.owners))
    return (
        all(r >= 0 for r in p.refs)
        and len(s.index) == len(p.owners)
        and free_queue_exact(s) is None
        and hash_index_consistent(s) is None
        and null_block_pinned(s) is None
    )


def first_with_key(keys: list[int], k: int) -> int:
    """The block a lookup of flat key ``k`` finds: the lowest id carrying it, or -1."""
    for b, kb in enumerate(keys):
        if kb == k:
            return b
    return -1


# The effects each action promises, as predicates on (inputs, outputs). They are postconditions
# (one CrossHair condition each); tests call them on concrete runs too.


def allocate_effect(
    n: int, free: list[int], refs: list[int], keys: list[int], block: int, evicted: bool, p: Pool
) -> bool:
    """The old head is given out with one reference and no hash (evicted if it had one); the
    queue loses its head; every other block is unchanged."""
    head = free[0]
    return (
        block == head
        and evicted == (keys[head] != 0)
        and p.free == free[1:]
        and p.refs[head] == 1
        and p.keys[head] is None
        and all(
            p.refs[b] == refs[b] and p.keys[b] == key_of(keys[b]) for b in range(n) if b != head
        )
    )


def free_table_effect(
    n: int, free: list[int], refs: list[int], keys: list[int], table: list[int], p: Pool
) -> bool:
    """Each table block loses one reference. The blocks that become unreferenced join the
    queue: uncached ones at its head (so in table order, freeing runs last first), cached ones at
    its tail in reverse table order. Hashes are unchanged."""
    dropped = [b for b in table if refs[b] == 1]
    return (
        p.free
        == [b for b in dropped if keys[b] == 0]
        + free
        + [b for b in reversed(dropped) if keys[b] != 0]
        and all(p.refs[b] == refs[b] - (1 if b in table else 0) for b in range(n))
        and p.keys == [key_of(k) for k in keys]
    )


def touch_effect(
    n: int,
    free: list[int],
    refs: list[int],
    keys: list[int],
    blocks: list[int],
    table: list[int],
    p: Pool,
) -> bool:
    """The blocks are appended to the table and gain a reference; the touched ones leave the free
    queue, whose other blocks keep their order; hashes are unchanged."""
    return (
        table == blocks
        and p.free == [b for b in free if b not in blocks]
        and all(p.refs[b] == refs[b] + (1 if b in blocks else 0) for b in range(n))
        and p.keys == [key_of(k) for k in keys]
    )


def publish_effect(
    n: int,
    free: list[int],
    refs: list[int],
    keys: list[int],
    block: int,
    key: Key,
    registered: bool,
    p: Pool,
) -> bool:
    """An unpublished block is registered under the request's key, last among that key's blocks;
    an already published one keeps its hash. Nothing else changes."""
    if registered != (keys[block] == 0):
        return False
    if registered and (p.keys[block] != key or dict(p.owners)[key][-1] != block):
        return False
    if not registered and p.keys[block] != key_of(keys[block]):
        return False
    return (
        all(p.keys[b] == key_of(keys[b]) for b in range(n) if b != block)
        and p.free == free
        and p.refs == refs
    )


def unpublish_effect(
    n: int, free: list[int], refs: list[int], keys: list[int], block: int, p: Pool
) -> bool:
    """The block loses its hash and leaves the index; nothing else changes."""
    return (
        p.keys[block] is None
        and all(block not in blocks for _, blocks in p.owners)
        and all(p.keys[b] == key_of(keys[b]) for b in range(n) if b != block)
        and p.free == free
        and p.refs == refs
    )


def lookup_effect(keys: list[int], tokens: list[int], hits: list[int]) -> bool:
    """The hits are the lowest-id blocks published under tokens[:1], tokens[:2], ..; at most
    len(tokens) - 1 of them; and the run stops only at the cap or at a prefix nobody publishes."""
    m = len(hits)
    return (
        m <= len(tokens) - 1
        and all(
            tuple(tokens[: i + 1]) == key_of(i + 1) and h == first_with_key(keys, i + 1)
            for i, h in enumerate(hits)
        )
        and (
            m == len(tokens) - 1
            or first_with_key(keys, m + 1) < 0
            or tuple(tokens[: m + 1]) != key_of(m + 1)
        )
    )


def _request(table: list[int], tokens: list[int] | None = None) -> Request:
    toks = list(tokens) if tokens is not None else [1]
    return Request(
        id=0, tokens=toks, prompt_len=len(toks), max_tokens=1, priority=0, arrival=0, table=table
    )


def allocate(n: int, free: list[int], refs: list[int], keys: list[int]) -> tuple[int, bool, Pool]:
    """``pool.allocate``: (block given, whether a cached hash was evicted, the pool after).

    pre: consistent(n, free, refs, keys)
    pre: len(free) > 0
    post: pool_ok(__return__[2])
    post: allocate_effect(n, free, refs, keys, *__return__)
    """
    s = build(n, free, refs, keys)
    req = _request([])
    events = pool.allocate(s, req)
    return req.table[-1], events[0][0] == "evict", snapshot(s)


def free_table(n: int, free: list[int], refs: list[int], keys: list[int], table: list[int]) -> Pool:
    """``pool.free_table``: drop one reference per table block, last first. A block that becomes
    unreferenced goes to the queue's head when uncached, to its tail when cached.

    pre: consistent(n, free, refs, keys)
    pre: table_ok(n, refs, table)
    post: pool_ok(__return__)
    post: free_table_effect(n, free, refs, keys, table, __return__)
    """
    s = build(n, free, refs, keys)
    req = _request(list(table))
    pool.free_table(s, req)
    return snapshot(s)


def touch(
    n: int, free: list[int], refs: list[int], keys: list[int], blocks: list[int]
) -> tuple[list[int], Pool]:
    """``pool.touch``: (the request's table after, the pool after). Each block gains a
    reference; an unreferenced one leaves the free queue, the others keep their order.

    pre: consistent(n, free, refs, keys)
    pre: distinct(blocks) and all(0 < b < n for b in blocks)
    post: pool_ok(__return__[1])
    post: touch_effect(n, free, refs, keys, blocks, *__return__)
    """
    s = build(n, free, refs, keys)
    req = _request([])
    pool.touch(s, req, list(blocks))
    return req.table, snapshot(s)


def publish(
    n: int,
    free: list[int],
    refs: list[int],
    keys: list[int],
    table: list[int],
    tokens: list[int],
    index: int,
) -> tuple[bool, Pool]:
    """``pool.publish`` of the request's block ``index`` (block size 1, so its key is
    ``tokens[:index + 1]``): (whether it registered, the pool after).

    pre: consistent(n, free, refs, keys)
    pre: table_ok(n, refs, table)
    pre: 0 <= index < len(table) <= len(tokens)
    post: pool_ok(__return__[1])
    post: publish_effect(n, free, refs, keys, table[index], tuple(tokens[: index + 1]), *__return__)
    """
    s = build(n, free, refs, keys)
    req = _request(list(table), tokens)
    events = pool.publish(s, req, index)
    return bool(events), snapshot(s)


def unpublish(n: int, free: list[int], refs: list[int], keys: list[int], block: int) -> Pool:
    """``pool.unpublish`` of one block (no leaving request).

    pre: consistent(n, free, refs, keys)
    pre: 0 <= block < n
    post: pool_ok(__return__)
    post: unpublish_effect(n, free, refs, keys, block, __return__)
    """
    s = build(n, free, refs, keys)
    pool.unpublish(s, block)
    return snapshot(s)


def lookup(
    n: int, free: list[int], refs: list[int], keys: list[int], tokens: list[int]
) -> list[int]:
    """``pool.lookup`` (block size 1): the longest run of published prefixes of ``tokens``, the
    lowest-id block for each, capped so the last token is recomputed.

    pre: consistent(n, free, refs, keys)
    pre: 1 <= len(tokens) <= MAX_KEY + 1
    post: lookup_effect(keys, tokens, __return__)
    """
    s = build(n, free, refs, keys)
    return pool.lookup(s, _request([], tokens))


def free_then_allocate(
    n: int, free: list[int], refs: list[int], keys: list[int], table: list[int], k: int
) -> tuple[list[int], list[int], list[int], list[bool]] | None:
    """Free ``table`` (in reverse), then allocate up to ``k`` blocks for a new request:
    (blocks allocated, free queue after, refcounts after, which blocks are cached after), or
    None when the input is not a consistent state. The spec half of a ``diffbehavior`` pair with
    ``kvspec.reference.contracts.free_then_allocate``."""
    if not (consistent(n, free, refs, keys) and table_ok(n, refs, table) and 0 <= k <= n):
        return None
    s = build(n, free, refs, keys)
    pool.free_table(s, _request(list(table)))
    req = _request([])
    for _ in range(k):
        if not s.free:
            break
        pool.allocate(s, req)
    return req.table, s.free, [b.refcount for b in s.blocks], [b.key is not None for b in s.blocks]
