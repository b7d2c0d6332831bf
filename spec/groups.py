"""Several KV-cache groups (``Config.groups``, ``docs/model.md``, "Hybrid groups"): what each
group adds to admission, scheduling, execution, publishing and freeing.

Group 0 is the table every one-group model has (``Request.table``, ``State.index``), handled by
``actions.py``, ``pool.py`` and ``policies.py`` as before; this module owns the cross-group hit
rule (``hit_length``, a function of the published indexes alone) and the tables of groups
1 .. G - 1 (``Request.group_tables``), each under its own kind's rule:

* ``full``: block ``i`` holds tokens ``i * B_g .. (i + 1) * B_g - 1``; a hit of ``L`` tokens
  needs blocks ``0 .. L / B_g - 1`` published.
* ``window`` (W): as ``full``, but a hit of ``L`` tokens needs only the ``ceil((W - 1) / B_g)``
  blocks before ``L`` (nulls before them), and the blocks wholly before the window of a
  running request's next processed token are freed and nulled when it is scheduled.
* ``state``: block ``i`` holds the recurrence *after* some number of tokens in
  ``i * B_g + 1 .. (i + 1) * B_g``; only the block of the position a step ends at is written
  (with the state after exactly ``end`` tokens: ``Write.prefix`` is that prefix), a step reads
  the block of the position it starts at, the other positions hold the null block. A hit of
  ``L`` tokens needs the state at exactly ``L`` published (nulls before it). Published keys are
  boundaries: a state block is published under ``tokens[:(i + 1) * B_g]``, by the group's
  registration rule (``Group.registers``, ``pending``): ``at-its-step``, only by the step that
  ends there; ``when-known`` (vLLM's ``align`` ``MambaManager``), as a full block is, at the
  first registration point whose known tokens reach the boundary, the slot's block whatever step
  last wrote it (right only where every step that writes the slot ends at its boundary or stops
  short of it: vLLM's aligned prefill chunks; else ``StateAtItsBoundary``).
* ``chunked`` (C, chunked local attention, ``docs/model.md``, "Chunked local attention"): as
  ``full``, but token ``t`` attends to tokens ``(t // C) * C .. t`` only. A hit of ``L``
  tokens needs the blocks of ``L``'s chunk before ``L`` published (``chunk_start``; nulls
  before them), the blocks of the whole chunks before the chunk of a running request's next
  processed token are freed and nulled when it is scheduled, and a step reads the blocks of
  its first token's chunk and its own.
* ``cross`` (an encoder-decoder model's cross-attention, ``docs/model.md``, "Cross-attention"):
  block ``i`` holds the K/V of the request's encoder tokens ``i * B_g .. (i + 1) * B_g - 1``
  (``Encoded``). The table is sized by the encoder input alone (``cross_blocks``: ``ceil(E /
  B_g)`` for the ``E`` of ``arrive``), allocated whole by the schedule that admits the request
  (the step whose encoder pass writes every block), never hashed, published nor hit, and read
  whole by every step of the request (each decoder token attends to every encoder token); it is
  freed with the rest of the request's tables. Its blocks are private (``CrossBlocksPrivate``).
* ``slot`` (SGLang's MAMBA component, ``spec/slots.py``, ``docs/model.md``, "Slot groups"): the
  table holds ONE block, the request's slot, allocated by its admission and held until it lets
  go of its tables; every step reads the state after exactly its start there (when it starts
  past 0) and writes the state after exactly its end there. A hit of ``L`` tokens needs a state
  published at exactly ``L`` (``accepts``, as ``state``), names that one block, takes no
  reference on it and copies it into the fresh slot when the admitting step executes. Nothing
  registers a slot group but the engine's own ``snapshot`` effects (``observed.engine_effect``).

Every effect of a group other than 0 carries its group (``events.grouped``). The effects come in
group order: hits, then skipped frees, then allocations (``actions.schedule``), a whole table's
frees group by group (``free_groups``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import lcm

from . import slots
from .events import grouped
from .pool import Event, add_key, drop_key, free_batch, free_blocks, take_free, touch_counted
from .state import (
    NULL_BLOCK,
    OBSERVED_POLICIES,
    Encoded,
    Entry,
    Illegal,
    Key,
    Request,
    State,
    Step,
    Write,
)


def size(s: State, g: int) -> int:
    """Group ``g``'s block size (``Config.block_size`` for a model without groups)."""
    return s.config.groups[g].block_size if s.config.groups else s.config.block_size


def kind(s: State, g: int) -> str:
    """Group ``g``'s kind (for a model without groups, its one group's)."""
    if s.config.groups:
        return s.config.groups[g].kind
    return "full" if s.config.window is None else "window"


def key(req: Request, end: int) -> Key:
    """The chained prefix of the request's first ``end`` tokens (a group's published key)."""
    return tuple(req.tokens[:end])


def has_cross(s: State) -> bool:
    """The model has a cross-attention group (``Group.kind == "cross"``)."""
    return any(group.kind == "cross" for group in s.config.groups)


def cross_blocks(s: State, g: int, encoder: int) -> int:
    """The blocks a cross group ``g``'s table holds for a request of ``encoder`` encoder tokens:
    one slot per encoder token, ``ceil(encoder / B_g)``."""
    return -(-encoder // size(s, g))


def when_known(s: State, g: int) -> bool:
    """Group ``g`` is a state group that registers its states when their boundary's tokens are
    known (``Group.registers == "when-known"``), not only in the step ending there."""
    return bool(s.config.groups) and s.config.groups[g].registers == "when-known"


def window(s: State, g: int) -> int | None:
    """Group ``g``'s window W, or None."""
    return s.config.groups[g].window if s.config.groups else s.config.window


def chunk(s: State, g: int) -> int:
    """A chunked group ``g``'s chunk C (``Group.chunk``; group 0's for a model of one group)."""
    return (s.config.groups[g].chunk if s.config.groups else None) or 1


def chunk_start(s: State, g: int, end: int) -> int:
    """The position of group ``g``'s table where the chunk of token ``end`` starts, a chunked
    group's: ``(end // C) * C // B_g``. The token at ``end`` (the first one computed after a
    hit of ``end`` tokens, or after ``end`` processed ones) attends to nothing before it
    (vLLM's ``get_num_skipped_tokens``, and ``local_attention_start_idx`` in
    ``find_longest_cache_hit``)."""
    return end // chunk(s, g) * chunk(s, g) // size(s, g)


def need(s: State, g: int) -> int:
    """A window group's blocks a hit needs before its end: ``ceil((W - 1) / B_g)``."""
    return -(-((window(s, g) or 1) - 1) // size(s, g))


def first_hit(s: State, req: Request, g: int, i: int) -> int | None:
    """The block group ``g`` publishes for the request's block ``i``, oldest first, or None."""
    blocks = s.index_of(g).get(key(req, (i + 1) * size(s, g)))
    return blocks[0] if blocks else None


def accepts(s: State, req: Request, g: int, length: int) -> bool:
    """Group ``g``'s own rule: whether it can serve a hit of the request's first ``length``
    tokens (a multiple of its block size) from what is published now."""
    if kind(s, g) == "cross":  # nothing cached: no hit asks anything of it
        return True
    n = length // size(s, g)
    if kind(s, g) in ("state", "slot"):  # the state after exactly ``length`` tokens
        return n == 0 or first_hit(s, req, g, n - 1) is not None
    lo = max(0, n - need(s, g)) if kind(s, g) == "window" else 0
    if kind(s, g) == "chunked":
        lo = chunk_start(s, g, length)
    return all(first_hit(s, req, g, i) is not None for i in range(lo, n))


def alignment(s: State) -> int:
    """The unit a hit length comes in: every group's block size divides it (but a cross group's,
    which hits nothing)."""
    return lcm(*(group.block_size for group in s.config.groups if group.kind != "cross"))


def hit_length(s: State, req: Request) -> int:
    """The hit rule across groups: the largest ``L`` below the request's last known token (which
    is always computed), aligned to every group's block size, that every group's own rule
    accepts (``accepts``). 0 without prefix caching. vLLM reaches it by iteration
    (``find_longest_cache_hit``); the spec states the maximum."""
    if not s.config.prefix_caching:
        return 0
    unit = alignment(s)
    for length in range((len(req.tokens) - 1) // unit * unit, 0, -unit):
        if all(accepts(s, req, g, length) for g in range(len(s.config.groups))):
            return length
    return 0


def hits_at(s: State, req: Request, g: int, length: int) -> list[int]:
    """Group ``g``'s hit blocks for a hit of ``length`` tokens (which it accepts): its table's
    first ``length / B_g`` positions, the null block where its rule needs nothing; none for a
    cross group (it caches nothing)."""
    if kind(s, g) == "cross":
        return []
    if kind(s, g) == "slot":  # the one state copied (slots.hit_block)
        return slots.hit_block(s, req, g, length)
    n = length // size(s, g)
    if kind(s, g) == "state":
        lo = max(0, n - 1)
    elif kind(s, g) == "window":
        lo = max(0, n - need(s, g))
    elif kind(s, g) == "chunked":
        lo = chunk_start(s, g, length)
    else:
        lo = 0
    blocks = [NULL_BLOCK] * lo
    for i in range(lo, n):
        block = first_hit(s, req, g, i)
        if block is None:
            raise Illegal(f"r{req.id}: group {g} cannot serve a {length}-token hit")
        blocks.append(block)
    return blocks


def admit(s: State, req: Request, hits: list[list[int]]) -> list[Event]:
    """Touch the hits of groups 1 .. G - 1 (``hits[g - 1]``) into the request's tables, one
    ``hit`` each, in group order (a slot group's hit is copied, not touched: ``referenced``)."""
    req.group_tables = [[] for _ in hits]
    req.group_cached = [len(h) for h in hits]
    events: list[Event] = []
    for g, blocks in enumerate(referenced(s, hits), 1):
        touch_counted(s, req, blocks, req.group_tables[g - 1], g)
    for g, blocks in enumerate(hits, 1):
        events.append(grouped(("hit", req.id, tuple(blocks)), g))
    return events


def referenced(s: State, hits: list[list[int]]) -> list[list[int]]:
    """The hit blocks of groups 1 .. G - 1 that join a table and take a reference: every one
    but a slot group's, whose state is copied into the request's own slot (no reference: the
    copy runs before the admitting step's writes, so nothing can overwrite it first)."""
    return [[] if kind(s, g) == "slot" else h for g, h in enumerate(hits, 1)]


def span(s: State, g: int, end: int) -> int:
    """The positions of group ``g``'s table a request computed up to ``end`` tokens has."""
    return -(-end // size(s, g))


def needed(s: State, tables: list[list[int]], end: int, encoder: int = 0) -> int:
    """The blocks groups 1 .. G - 1, with ``tables``, allocate to reach ``end`` tokens (a
    cross group: its ``encoder`` tokens' blocks)."""
    count = 0
    for g, table in enumerate(tables, 1):
        last = span(s, g, end)
        if kind(s, g) == "cross":
            count += max(0, cross_blocks(s, g, encoder) - len(table))
        elif kind(s, g) == "state":
            count += int(last > 0 and (len(table) < last or table[last - 1] == NULL_BLOCK))
        elif kind(s, g) == "slot":
            count += int(not table)
        else:
            count += max(0, last - len(table))
    return count


def engine_lets_go(s: State, g: int) -> bool:
    """Whether group ``g``'s skipped blocks are the engine's to let go of, not the spec's to free
    at schedule: a window group under an observed policy. An engine that registers on its own
    also gives up its window blocks on its own schedule (SGLang's SWA component: a request's
    window lock moves with each insert, its out-of-window slots are freed in batches), each an
    own effect (``observed.dedup`` to the null block); too early is the invariants' to judge."""
    return kind(s, g) == "window" and s.config.policy in OBSERVED_POLICIES


def gone(s: State, req: Request, processed: int) -> int:
    """The blocks ``remove_skipped`` will put back on the free queue (held by the request only)."""
    count = 0
    for g, table in enumerate(req.group_tables, 1):
        if engine_lets_go(s, g):
            continue
        for block in table[: skipped(s, g, processed)]:
            count += int(block != NULL_BLOCK and s.blocks[block].refcount == 1)
    return count


def skipped(s: State, g: int, processed: int) -> int:
    """Group ``g``'s leading positions no step will read again once ``processed`` tokens are
    processed: a window's blocks wholly before the window of the next token; a chunked group's
    blocks of the whole chunks before that token's; a state group's blocks before the one
    holding the state after ``processed`` tokens; none for full."""
    bs = size(s, g)
    if kind(s, g) == "chunked":
        return chunk_start(s, g, processed)
    if kind(s, g) == "window":
        return max(0, processed - (window(s, g) or 1) + 1) // bs
    if kind(s, g) == "state":
        return max(0, -(-processed // bs) - 1)
    return 0


def remove_skipped(s: State, req: Request, processed: int) -> list[Event]:
    """Free and null each group's skipped positions (``skipped``), group order, each group's
    last block first, as ``pool.remove_skipped`` does for group 0 (none where the engine lets
    go on its own: ``engine_lets_go``)."""
    events: list[Event] = []
    for g in range(1, len(s.config.groups)):
        if engine_lets_go(s, g):
            continue
        table = s.table_of(req, g)
        freed = []
        for i in range(min(skipped(s, g, processed), len(table)) - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                if kind(s, g) in ("window", "chunked"):
                    break  # a window's (a chunked group's) nulls are a leading run
                continue
            freed.append(table[i])
            table[i] = NULL_BLOCK
        if freed:
            free_batch(s, req.id, freed[::-1])
            s.touched.requests.add(req.id)
            events += [("free", block) for block in freed]
    return events


def schedule(
    s: State, req: Request, step: Step, start: int, end: int, tokens: Sequence[object]
) -> tuple[list[Event], tuple[tuple[int, ...], ...]]:
    """Allocate what groups 1 .. G - 1 need for tokens ``start .. end - 1`` and lay the step's
    writes there: every block of ``start / B_g .. `` for full and window, the block of the end
    position for a state group (the state after exactly ``end`` tokens). Returns the events and
    each group's table prefix the entry reads and writes. A cross group's table is allocated
    whole by the request's first schedule since admission, whose encoder pass writes each block
    (``Encoded``); its later steps read it and write nothing there."""
    events: list[Event] = []
    prefixes = []
    for g in range(1, len(s.config.groups)):
        table, bs, last = s.table_of(req, g), size(s, g), span(s, g, end)
        if kind(s, g) == "cross":
            first = len(table)
            while len(table) < cross_blocks(s, g, req.encoder):
                events += allocate(s, req, g)
            writes = list(range(first, len(table)))
            contents: list[tuple[object, ...]] = [(Encoded(req.id, i),) for i in writes]
            last = len(table)
        elif kind(s, g) == "slot":
            events += slot_schedule(s, req, step, g)
            writes, contents, last = [0], [tuple(tokens[:end])], 1
        elif kind(s, g) == "state":
            while len(table) < last - 1:
                table.append(NULL_BLOCK)
            if len(table) < last:
                events += allocate(s, req, g)
            elif table[last - 1] == NULL_BLOCK:
                table.pop()
                events += allocate(s, req, g)
            writes = [last - 1]
            contents = [tuple(tokens[:end])]
        else:
            while len(table) < last:
                events += allocate(s, req, g)
            writes = list(range(start // bs, last))
            contents = [tuple(tokens[: min(end, (i + 1) * bs)]) for i in writes]
        for i, content in zip(writes, contents, strict=True):
            if table[i] == NULL_BLOCK:  # given up by the engine (observed.let_go): nothing is
                continue  # written there, and a read of it finds nothing (NoUnwrittenRead)
            s.blocks[table[i]].pending.append(Write(step.id, req.id, content))  # type: ignore[arg-type]
            s.touched.content.add(table[i])
        prefixes.append(tuple(table[:last]))
    return events, tuple(prefixes)


def slot_schedule(s: State, req: Request, step: Step, g: int) -> list[Event]:
    """A slot group's part of a schedule, before its write is laid: the admission allocates the
    slot (``Request.slots`` remembers it) and, with a hit, copies the hit's state into it for
    the building step (``slots.copy``; the hit is the decision's ``State.admission``)."""
    table = s.table_of(req, g)
    if table:
        return []
    events = allocate(s, req, g)
    req.slots[g] = table[0]
    req.tracks[g] = []  # the engine's track slots follow (spec/tracks.py)
    admitted = s.admission
    if admitted is not None and admitted[0] == req.id and admitted[2][g]:
        slots.copy(s, step.id, admitted[2][g][0], table[0], req.id)
    return events


def allocate(s: State, req: Request, g: int) -> list[Event]:
    """The free queue's head joins group ``g``'s table (``pool.allocate``, for that group)."""
    block = take_free(s, req.id, f"r{req.id} in group {g}")
    b = s.blocks[block]
    events: list[Event] = []
    if b.key is not None:
        drop_key(s, block)
        events.append(("evict", block))
    b.refcount, b.group = 1, g
    s.table_of(req, g).append(block)
    s.touched.blocks.add(block)
    s.touched.requests.add(req.id)
    return [*events, grouped(("alloc", req.id, block), g)]


def write(s: State, step: Step, rid: int, entry: Entry) -> None:
    """``execute``'s writes of groups 1 .. G - 1 for the request's entry: each block takes the
    last content this step laid there for the request."""
    for g, blocks in enumerate(entry.group_blocks, 1):
        for block in writes_of(s, g, entry.start, blocks):
            b = s.blocks[block]
            mine = [w for w in b.pending if w.step == step.id and w.req == rid]
            b.pending = [w for w in b.pending if not (w.step == step.id and w.req == rid)]
            if mine:
                b.written = mine[-1].prefix
            s.touched.content.add(block)


def read_states(s: State, step: Step) -> set[int]:
    """``execute``'s reads of state blocks, before any write of the step: a state is read once,
    at the start of the step's recurrence, and a state the same step writes (its own in place,
    or another request's, eagerly published) is not there yet. Returns the requests whose read
    found the wrong state; a live one's read is recorded in ``State.bad_state_reads``
    (``NoUnwrittenStateRead``)."""
    bad: set[int] = set()
    for rid, e in step.entries.items():
        if e.load or not e.group_blocks:
            continue
        tokens = tuple(s.seen(s.requests[rid], step.id, e)[: e.end])
        for g, blocks in enumerate(e.group_blocks, 1):
            if kind(s, g) not in ("state", "slot"):
                continue
            for at, block in reads_of(s, g, e.start, blocks):
                if not valid(
                    s, g, s.blocks[block].written, read_content(s, g, e.start, at, tokens)
                ):
                    bad.add(rid)
                    if rid in step.live:
                        s.bad_state_reads.append((step.id, rid, block))
    return bad


def read(s: State, step: Step, rid: int, entry: Entry, tokens: tuple[object, ...]) -> bool:
    """``execute``'s reads of full and window blocks of groups 1 .. G - 1 for the request's
    entry, after every write of the step: whether one found the wrong bytes (a live one is
    recorded in ``State.bad_reads``, ``NoUnwrittenRead``)."""
    bad = False
    for g, blocks in enumerate(entry.group_blocks, 1):
        if kind(s, g) in ("state", "slot"):
            continue
        for at, block in reads_of(s, g, entry.start, blocks):
            wanted = read_content(s, g, entry.start, at, tokens, rid)
            if valid(s, g, s.blocks[block].written, wanted):
                continue
            bad = True
            if rid in step.live:
                s.bad_reads.append((step.id, rid, block))
    return bad


def spoil(s: State, entry: Entry) -> None:
    """A step that read wrong bytes computed wrong ones: its writes in groups 1 .. G - 1 hold
    garbage (not a cross group's: the encoder's output does not depend on the decoder's reads)."""
    for g, blocks in enumerate(entry.group_blocks, 1):
        if kind(s, g) == "cross":
            continue
        for block in writes_of(s, g, entry.start, blocks):
            s.blocks[block].written = None


def writes_of(s: State, g: int, start: int, blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The blocks of group ``g`` an entry from ``start`` writes (``schedule``'s; a cross group's:
    those its encoder pass writes, if any: ``write`` takes only the entry's own pending writes)."""
    if kind(s, g) == "cross":
        return blocks
    if kind(s, g) in ("state", "slot"):
        return blocks[-1:]
    return blocks[start // size(s, g) :]


def reads_of(s: State, g: int, start: int, blocks: tuple[int, ...]) -> list[tuple[int, int]]:
    """(position, block) of group ``g`` an entry from ``start`` reads as computed: a state
    group's block of the state after ``start`` tokens; a window's blocks of the window of token
    ``start``; a chunked group's blocks of token ``start``'s chunk; every earlier block under
    full attention; every block of a cross group (each
    decoder token attends to every encoder token)."""
    if kind(s, g) == "cross":
        return list(enumerate(blocks))
    if kind(s, g) == "slot":  # the one slot, holding the state after ``start`` tokens
        return [(0, blocks[0])] if start > 0 else []
    bs = size(s, g)
    if kind(s, g) == "state":
        at = -(-start // bs) - 1
        return [(at, blocks[at])] if start > 0 else []
    lo = skipped(s, g, start) if kind(s, g) in ("window", "chunked") else 0
    return [(i, blocks[i]) for i in range(lo, len(blocks)) if i * bs < start]


def read_content(
    s: State, g: int, start: int, position: int, tokens: tuple[object, ...], rid: int = -1
) -> tuple:
    """What group ``g``'s block at ``position`` must hold for a step from ``start``: the state
    after exactly ``start`` tokens, or the K/V of the block's tokens before ``start``, or (a
    cross group) the encoder output of request ``rid`` there."""
    if kind(s, g) == "cross":
        return (Encoded(rid, position),)
    if kind(s, g) in ("state", "slot"):
        return tuple(tokens[:start])
    return tuple(tokens[: min(start, (position + 1) * size(s, g))])


def valid(s: State, g: int, content: object, wanted: tuple) -> bool:
    """Bytes holding ``content`` serve a reader of ``wanted`` in group ``g``: a state only when
    it is the state after exactly those tokens, K/V when it holds them as a prefix."""
    if not isinstance(content, tuple):
        return False
    if kind(s, g) in ("state", "slot"):
        return content == wanted
    return content[: len(wanted)] == wanted


def pending(s: State, req: Request, end: int, limit: int) -> list[tuple[int, int]]:
    """The blocks of groups 1 .. G - 1 a step of the request ending at ``end`` makes registrable,
    as (group, index), from each group's ``group_cached`` on, which advances past them: full and
    window blocks wholly inside the first ``min(end, limit)`` tokens (``limit``: the known
    tokens, or the policy's cap); a state group's block only when ``end`` is its boundary and
    within ``limit`` (the step writes the state there, and only there), or, registering
    ``when-known``, every slot as full blocks (``publish`` skips a null one)."""
    out: list[tuple[int, int]] = []
    for g in range(1, len(s.config.groups)):
        if kind(s, g) in ("cross", "slot"):  # never hashed, or only by the engine's snapshots
            continue
        bs, cached = size(s, g), req.group_cached[g - 1]
        upto = min(end, limit) // bs
        if kind(s, g) == "state" and not when_known(s, g):
            if end % bs == 0 and end <= limit and end // bs > cached:
                out.append((g, end // bs - 1))
        else:
            out += [(g, i) for i in range(cached, upto)]
        req.group_cached[g - 1] = max(cached, upto)
    return out


def publish(s: State, req: Request, g: int, index: int) -> list[Event]:
    """Register group ``g``'s block ``index`` of the request under its key there (``pool.publish``
    for that group). Nothing for a null position (a window's skipped block, freed since)."""
    table = s.table_of(req, g)
    if index >= len(table) or table[index] == NULL_BLOCK:
        return []
    block = table[index]
    if s.blocks[block].key is not None:
        return []
    add_key(s, block, key(req, (index + 1) * size(s, g)), g)
    s.touched.requests.add(req.id)
    return [grouped(("publish", req.id, index, block), g)]


def free_groups(s: State, req: Request) -> list[Event]:
    """Drop the request's references in groups 1 .. G - 1, group by group, each last block
    first (``pool.free_blocks``), and empty those tables."""
    events: list[Event] = []
    for g in range(1, 1 + len(req.group_tables)):  # none for a request never admitted
        events += free_blocks(s, req.id, s.table_of(req, g))
    req.group_tables = []
    req.group_cached = []
    return events


def held(req: Request) -> list[int]:
    """Every block the request's tables of groups 1 .. G - 1 hold (nulls aside)."""
    return [b for table in req.group_tables for b in table if b != NULL_BLOCK]


def hit_positions(s: State, g: int, length: int) -> range:
    """The positions of group ``g``'s hit of ``length`` tokens that hold a published block
    (``hits_at``; the others hold the null block)."""
    n = length // size(s, g)
    if kind(s, g) == "cross":
        return range(0)
    if kind(s, g) == "state":
        return range(max(0, n - 1), n)
    if kind(s, g) == "window":
        return range(max(0, n - need(s, g)), n)
    if kind(s, g) == "chunked":
        return range(chunk_start(s, g, length), n)
    return range(n)


def reads_in_flight(
    s: State, only: str | None
) -> Iterator[tuple[Step, int, Entry, int, int, int, tuple[object, ...]]]:
    """(step, request, entry, group, position, block, tokens) of every read of groups
    1 .. G - 1 by a live entry of a step not executed yet (of groups of kind ``only`` if
    given); ``tokens`` as the step sees them."""
    for step, rid, e in live_group_entries(s):
        tokens = tuple(s.ahead(s.requests[rid]))
        for g, blocks in enumerate(e.group_blocks, 1):
            if only is not None and kind(s, g) != only:
                continue
            for at, block in reads_of(s, g, e.start, blocks):
                yield step, rid, e, g, at, block, tokens


def window_blocks_in_flight(s: State) -> Iterator[tuple[Step, int, int, int, int]]:
    """(step, request, group, position, block) of every block of a window (or chunked) group in groups
    1 .. G - 1 that a live entry of a step not executed yet attends: those of the window of its
    first token, and its own blocks, which the step writes and its later tokens read (group 0's
    form: ``NoUnwrittenRead``'s window clause, "its own blocks too")."""
    for step, rid, e in live_group_entries(s):
        for g, blocks in enumerate(e.group_blocks, 1):
            if kind(s, g) in ("window", "chunked"):
                for at in range(skipped(s, g, e.start), len(blocks)):
                    yield step, rid, g, at, blocks[at]


def live_group_entries(s: State) -> Iterator[tuple[Step, int, Entry]]:
    """(step, request, entry) of every live entry of a step not executed yet that holds blocks
    of groups 1 .. G - 1 (loads left out: they read nothing)."""
    for step in s.steps:
        if step.phase == "executed":
            continue
        for rid, e in step.entries.items():
            if not e.load and rid in step.live and e.group_blocks:
                yield step, rid, e


def tables_fit(s: State, req: Request) -> bool:
    """Groups 1 .. G - 1's tables cover the request's computed tokens (a running one: each as
    many positions as ``span``) or nothing (one not running)."""
    if req.status != "running":
        return not groups_held(req)
    return len(req.group_tables) == len(s.config.groups) - 1 and all(
        slot_table_ok(table) if kind(s, g) == "slot" else len(table) == positions(s, req, g)
        for g, table in enumerate(req.group_tables, 1)
    )


def slot_table_ok(table: list[int]) -> bool:
    """A running request's slot table: its working slot first, then the track slots the engine
    allocated (``spec/tracks.py``; a position a donation emptied holds the null block until the
    next track ``alloc``)."""
    return bool(table) and table[0] != NULL_BLOCK


def positions(s: State, req: Request, g: int) -> int:
    """The positions group ``g``'s table of a running request holds: ``span`` of its computed
    tokens, or a cross group's ``cross_blocks`` of its encoder tokens."""
    if kind(s, g) == "cross":
        return cross_blocks(s, g, req.encoder)
    if kind(s, g) == "slot":
        return 1
    return span(s, g, req.computed)


def private_cross_blocks(s: State) -> tuple[int, int, int] | None:
    """(request, group, block) of the first block of a cross group's table that is published
    or held anywhere else (another position, table or request), or None (``CrossBlocksPrivate``)."""
    holders: dict[int, int] = {}
    for req in s.requests.values():
        for b in req.table:
            holders[b] = holders.get(b, 0) + 1
        for table in req.group_tables:
            for b in table:
                holders[b] = holders.get(b, 0) + 1
    for req in s.requests.values():
        for g, table in enumerate(req.group_tables, 1):
            if kind(s, g) != "cross":
                continue
            for b in table:
                if b != NULL_BLOCK and (holders[b] > 1 or s.blocks[b].key is not None):
                    return req.id, g, b
    return None


def groups_held(req: Request) -> bool:
    return any(req.group_tables)
