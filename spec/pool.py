"""The block pool's mechanisms (vLLM ``BlockPool``): lookup, touch, allocate, free, publish, unpublish.

Each function changes the state and returns the effect events it caused, in order. They check the
pool's own guards (no double free, no allocation from an empty queue) and raise ``Illegal`` when
one fails; *when* they are called is decided by ``actions.py`` and ``policies.py``.

Effect events are plain tuples (see ``docs/events.md``)::

    ("hit", req, blocks)        lookup result, the blocks then touched
    ("evict", block)            a cached free block's hash dropped because the block is reused
    ("alloc", req, block)       the free queue's head given to a request
    ("publish", req, index, block)   block registered under the request's index-th hash
    ("unpublish", block)        a registration rolled back (or dropped by a prefix-cache reset)
    ("free", block)             one reference dropped
"""

from __future__ import annotations

from .state import NULL_BLOCK, Content, Draft, Illegal, Key, Placeholder, Request, State

Event = tuple[object, ...]


def eventual_content(s: State, block: int, upto_step: int | None = None) -> Content | None:
    """What the block will hold once every pending write of a step <= ``upto_step`` (all steps if
    None) has run: the last such write wins, since writes only ever extend a prefix or start one
    afresh in a newly allocated block."""
    b = s.blocks[block]
    content = b.written
    for w in b.pending:
        if upto_step is None or w.step <= upto_step:
            content = w.prefix
    return content


def holds(content: Content | None, prefix: Content) -> bool:
    """True when bytes holding ``content`` are valid for a reader of ``prefix``."""
    return content is not None and content[: len(prefix)] == prefix and len(content) >= len(prefix)


def lookup(s: State, req: Request, bound: int | None = None) -> list[int]:
    """The longest run of published blocks for the request's hashes, from its first block,
    stopping at the first miss and capped so the last known token is always recomputed (and at
    the blocks that have a key, ``State.hashed``). None without prefix caching. With a sliding
    window the rule is ``window_lookup``'s. ``bound``: the engine's bound on this hit in tokens
    (the admission's ``schedule`` decision carries it; None: unbounded): the hit is at most its
    whole blocks, so exactly min(the longest cached prefix, ``bound // block_size``) blocks
    (the bounded-hit rule; 0 skips the read)."""
    if not s.config.prefix_caching:
        return []
    cap = min((len(req.tokens) - 1) // s.config.block_size, s.hashed(req))
    if bound is not None:
        cap = min(cap, bound // s.config.block_size)
    if s.config.window is not None:
        return window_lookup(s, req, cap)
    if s.config.chunk is not None:
        return chunk_lookup(s, req, cap)
    hits: list[int] = []
    for i in range(cap):
        blocks = s.index.get(s.key(req, i))
        if not blocks:
            break
        hits.append(blocks[0])
    return hits


def window_lookup(s: State, req: Request, cap: int) -> list[int]:
    """Sliding window W (vLLM's ``SlidingWindowManager.find_longest_cache_hit``): searching from
    the rightmost block a hit may end at (``cap``), the first run of ``ceil((W - 1) / B)``
    consecutive published blocks ends the hit there; the blocks before the run are the null
    block (the tokens they hold are outside the window of the first token computed). With no
    such run, the hit is the run of published blocks from block 0 (shorter than the window
    needs, so nothing before it is skipped)."""
    need = -(-((s.config.window or 1) - 1) // s.config.block_size)
    run = 0
    found: dict[int, int] = {}
    for i in range(cap - 1, -1, -1):
        blocks = s.index.get(s.key(req, i))
        if not blocks:
            run = 0
            continue
        found[i] = blocks[0]
        run += 1
        if run >= need:
            return [NULL_BLOCK] * i + [found[j] for j in range(i, i + run)]
    return [found[j] for j in range(run)]


def chunk_lookup(s: State, req: Request, cap: int) -> list[int]:
    """A chunked group 0 of chunk C (vLLM's ``ChunkedLocalAttentionManager.find_longest_cache_hit``):
    the next token computed after a hit of ``L`` tokens attends to its chunk from
    ``(L // C) * C`` on only, so the positions of the whole chunks before the chunk of the
    cap's end hold the null block (taken as computed whatever is published), and the hit goes
    on with the run of published blocks from that chunk's first block, up to the cap. Every
    hit ends in the cap's chunk: a shorter one would need more blocks, not fewer."""
    chunk, bsz = s.config.chunk or 1, s.config.block_size
    lo = cap * bsz // chunk * chunk // bsz
    hits = [NULL_BLOCK] * lo
    for i in range(lo, cap):
        blocks = s.index.get(s.key(req, i))
        if not blocks:
            break
        hits.append(blocks[0])
    return hits


def touch(s: State, req: Request, blocks: list[int]) -> list[Event]:
    """Take a reference on each hit block (out of the free queue if it was unreferenced) and
    append it to the request's table. A null block (a position a sliding window skips) is
    appended to the table without a reference."""
    touch_counted(s, req, blocks, req.table, 0)
    return [("hit", req.id, tuple(blocks))]


def touch_counted(s: State, req: Request, blocks: list[int], table: list[int], group: int) -> None:
    """``touch``'s references, into ``table`` (the request's table of group ``group``)."""
    for block in blocks:
        if block == NULL_BLOCK:
            table.append(block)
            continue
        b = s.blocks[block]
        if b.refcount == 0:
            s.free.remove(block)
        b.refcount += 1
        table.append(block)
    s.touched.blocks.update(b for b in blocks if b != NULL_BLOCK)
    s.touched.requests.add(req.id)


def take_free(s: State, rid: int, where: str) -> int:
    """The block an allocation takes off the free queue: its head, or under observed judging a
    block the engine allocated that this decision freed first (``State.steered_allocs``), which
    must be free now."""
    if not s.free:
        raise Illegal(f"allocate for {where}: the free queue is empty")
    block = s.steered_allocs.pop(0) if s.steered_allocs else None
    if block is None:
        return s.free.pop(0)
    if block not in s.free:
        raise Illegal(f"r{rid} is allocated block {block}, which is not free")
    s.free.remove(block)
    return block


def allocate(s: State, req: Request) -> list[Event]:
    """Give the free queue's head to the request, dropping the hash it was cached under."""
    block = take_free(s, req.id, f"r{req.id}")
    b = s.blocks[block]
    events: list[Event] = []
    if b.key is not None:
        drop_key(s, block)
        events.append(("evict", block))
    b.refcount = 1
    if b.group:  # it last served another KV-cache group
        b.group = 0
    req.table.append(block)
    s.touched.blocks.add(block)
    s.touched.requests.add(req.id)
    events.append(("alloc", req.id, block))
    return events


def free_table(s: State, req: Request) -> list[Event]:
    """Drop the request's references in reverse table order, so a chain's tail is evicted before
    its ancestors. Without prefix caching, and with speculative decoding, the table is freed as
    one batch (``free_batch``)."""
    events = free_blocks(s, req.id, req.table)
    clear_table(s, req)
    return events


def clear_table(s: State, req: Request) -> None:
    """The request holds no blocks and has computed nothing (its references are dropped, or
    handed to a ``Deferred`` holder)."""
    req.table = []
    req.computed = 0
    req.loaded_last = False
    req.cached = 0
    s.touched.requests.add(req.id)


def free_blocks(s: State, rid: int, table: list[int] | tuple[int, ...]) -> list[Event]:
    """Drop one reference on each block of ``table`` (request ``rid``'s, in table order) as a
    table is freed: last block first, one at a time (``release``), or as one batch
    (``free_batch``) without prefix caching or with speculative decoding. The null blocks a
    sliding window left at the table's head hold no reference: they are not freed."""
    table = [block for block in table if block != NULL_BLOCK]
    if s.config.prefix_caching and not s.config.spec_tokens:
        for block in reversed(table):
            release(s, block, rid)
    else:
        free_batch(s, rid, table)
    return [("free", block) for block in reversed(table)]


def remove_skipped(s: State, req: Request, processed: int) -> list[Event]:
    """Sliding window: free the blocks of the request's table wholly before the window of the
    token after its ``processed`` tokens (computed less those of its steps in flight, so no
    step in flight still reads them), and put the null block in their place (vLLM's
    ``remove_skipped_blocks`` from ``allocate_slots``). Walks back from the last such block to
    the first null one; the blocks are freed as one batch in that order (``free_batch``, as
    ``BlockPool.free_blocks`` is handed them). Nothing under full attention."""
    last = min(s.skipped(processed), len(req.table))
    freed: list[int] = []
    for i in range(last - 1, -1, -1):
        if req.table[i] == NULL_BLOCK:
            break
        freed.append(req.table[i])
        req.table[i] = NULL_BLOCK
    if not freed:
        return []
    free_batch(s, req.id, freed[::-1])
    s.touched.requests.add(req.id)
    return [("free", block) for block in freed]


def release(s: State, block: int, rid: int) -> None:
    """Request ``rid`` drops its reference; an unreferenced block goes to the queue's head when it
    has no hash (reused first) and to its tail when it is cached (least recently used last)."""
    if drop_reference(s, block, rid):
        if s.blocks[block].key is None:
            s.free.insert(0, block)
        else:
            s.free.append(block)


def drop_reference(s: State, block: int, rid: int) -> bool:
    """Request ``rid`` drops its reference on ``block``; whether that was the last one."""
    b = s.blocks[block]
    if b.refcount <= 0:
        raise Illegal(f"free of block {block} by r{rid}: refcount is {b.refcount}")
    b.refcount -= 1
    s.touched.blocks.add(block)
    return b.refcount == 0


def free_batch(s: State, rid: int, table: list[int] | tuple[int, ...]) -> None:
    """Without prefix caching, vLLM 0.33.0 frees a table as one batch: ``single_type_kv_cache_
    manager.free`` hands ``BlockPool.free_blocks`` the table reversed, which drops a reference on
    each, collects the blocks reaching 0 in that order and puts the whole list at the queue's
    head at once (``prepend_n``, every block counting as unhashed when caching is off). So the
    head becomes the table's *last* block, then the one before it, down to its first, ahead of
    the old head; ``release`` one block at a time would leave the table's first block at the
    head instead. Nothing is cached, so no block goes to the tail.

    With prefix caching on, ``free_blocks`` does the same with the unhashed blocks and appends
    the hashed ones to the tail, in the same order (as ``release`` does). The spec follows that
    with speculative decoding (``Config.spec_tokens``), where a table routinely ends in several
    unhashed blocks (the slots of rejected drafts past the partial one); elsewhere it keeps the
    one-at-a-time rule, which the fast and Z3 models restate (``docs/model.md``, difference 9)."""
    first: list[int] = []
    last: list[int] = []
    for block in reversed(table):
        if drop_reference(s, block, rid):
            cached = s.config.prefix_caching and s.blocks[block].key is not None
            (last if cached else first).append(block)
    s.free[0:0] = first
    s.free += last


def publish(s: State, req: Request, index: int) -> list[Event]:
    """Register the request's block ``index`` under its hash (several blocks may share one).
    Illegal without prefix caching: such a pool publishes nothing. Nothing for a position a
    window or chunk skipped and nulled before its registration point came (a chunked group's
    block completed by a step whose registration waits for the next commit can be skipped by a
    schedule in between; vLLM's ``cache_full_blocks`` skips null blocks)."""
    if not s.config.prefix_caching:
        raise Illegal(f"publish of r{req.id}'s block {index}: prefix caching is off")
    block = req.table[index]
    if block == NULL_BLOCK and s.config.local:
        return []
    if block == NULL_BLOCK:
        raise Illegal("publish of the null block")
    if (index + 1) * s.config.block_size > len(req.tokens):
        raise Illegal(f"publish of r{req.id}'s block {index}: its tokens are not all known")
    b = s.blocks[block]
    if b.key is not None:
        return []
    add_key(s, block, s.key(req, index))
    s.touched.requests.add(req.id)
    return [("publish", req.id, index, block)]


def unpublish(s: State, block: int, leaving: Request | None = None) -> list[Event]:
    """Roll back a registration. When nobody but the leaving request references the block and
    its bytes will be valid anyway, a future hit is thrown away: count it as a lost hit."""
    b = s.blocks[block]
    if b.key is None:
        return []
    count_if_lost(s, block, b.key, leaving)
    drop_key(s, block)
    return [("unpublish", block)]


def count_if_lost(s: State, block: int, key: Key, leaving: Request | None) -> None:
    """Count a lost hit when ``key`` is dropped although the block will hold it and nobody but
    the leaving request references the block."""
    own = 1 if leaving is not None and block in leaving.table else 0
    if s.blocks[block].refcount - own == 0 and holds(eventual_content(s, block), key):
        s.lost_hits += 1


def resolve(s: State, placeholder: Placeholder | Draft, token: int) -> None:
    """The sampling step committed: every byte holding ``placeholder`` (or an accepted draft)
    now holds ``token``."""
    for block, b in enumerate(s.blocks):
        if b.written is not None and placeholder in b.written:
            b.written = tuple(token if x == placeholder else x for x in b.written)
            s.touched.content.add(block)
        for w in b.pending:
            if placeholder in w.prefix:
                w.prefix = tuple(token if x == placeholder else x for x in w.prefix)
                s.touched.content.add(block)


def add_key(s: State, block: int, key: Key, group: int = 0) -> None:
    """Publish ``block`` under ``key`` in group ``group``'s index (the block is that group's)."""
    s.blocks[block].key = key
    (s.index if group == 0 else s.index_of(group)).setdefault(key, []).append(block)
    s.touched.blocks.add(block)


def drop_key(s: State, block: int) -> None:
    """The block loses its published key, in its group's index."""
    b = s.blocks[block]
    assert b.key is not None
    index = s.index if b.group == 0 else s.index_of(b.group)
    owners = index[b.key]
    owners.remove(block)
    if not owners:
        del index[b.key]
    b.key = None
    s.touched.blocks.add(block)
