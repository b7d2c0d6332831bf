"""Observed choices: the orderings the spec leaves to its pool, taken from an engine's trace.

The spec's pool is deterministic: an allocation takes the free queue's head, a lookup the first
block registered under a hash. Another engine may order its free blocks or its duplicate
registrations differently and be just as safe. ``steer`` puts the engine's choices where the
spec's actions will take them, after checking that they are legal (an allocated block is free, a
hit block is registered under the request's chained hash at that position); it reorders, and
never changes which blocks are free or registered, so every action keeps its meaning. ``drop``
applies a registration the engine dropped on its own, which is always safe (a lost hit at worst).
Used by the judge's observed matching (``judge/core.py``; docs/adapters.md, "Judging
modes").

Under the policy ``engine-registers`` the engine also registers on its own, at points of its
choosing, and may deduplicate: ``engine_effect`` applies its ``publish`` and ``dedup`` effects. Their
guards check only what an effect *names* (a known request, a full block of its known tokens, a
block published under the right key); whether the registration or the swap is *safe* is left to
the invariants, so that a premature publish shows as a NoUnwrittenPublish violation, not as an
illegal event.
"""

from __future__ import annotations

from . import groups, slots, tracks
from .events import group_of
from .pool import Event, add_key, release, unpublish
from .state import NULL_BLOCK, OBSERVED_POLICIES, Config, Illegal, Request, State


def steer(s: State, decision: Event, effects: list[Event]) -> None:
    """Before ``decision`` is applied: make the spec's pool choose what the engine chose in
    ``effects`` (the engine's effect events of that decision). Raises ``Illegal`` for a choice no
    pool may make. An allocated block free now is moved to the free queue's head; one the
    engine freed earlier in the same decision (a schedule frees a window's or a state group's
    skipped blocks before it allocates, ``remove_skipped``, and may allocate one of them again)
    is steered when it is allocated (``State.steered_allocs``, ``pool.take_free``)."""
    s.steered_allocs = []
    if decision[0] != "schedule":
        return
    rid = decision[1]
    req = s.requests.get(rid) if isinstance(rid, int) else None
    if req is None:
        return  # the action itself reports the unknown request
    if s.config.hybrid and req.status == "waiting":
        _steer_groups(s, req, [effect for effect in effects if effect[0] == "hit"])
    for effect in effects:
        if effect[0] == "hit" and req.status == "waiting" and not s.config.hybrid:
            hits: tuple[int, ...] = tuple(effect[2])  # type: ignore[arg-type]
            skips = s.config.window is not None or s.config.chunk is not None
            for i, block in enumerate(hits):
                if block == NULL_BLOCK and skips:
                    continue  # a skipped position: where the hit rule puts nulls is the effect's
                owners = s.index.get(s.key(req, i), [])
                if block not in owners:
                    raise Illegal(
                        f"r{rid} hits block {block} as its block {i}, but that block is not "
                        f"published under r{rid}'s {(i + 1) * s.config.block_size}-token prefix"
                    )
                owners.remove(block)
                owners.insert(0, block)
    allocated: list[int] = []
    freed_first: set[int] = set()  # blocks the decision frees before the engine allocates them
    for effect in effects:
        if effect[0] == "free" and _is_block(s, effect[1]):
            freed_first.add(effect[1])  # type: ignore[arg-type]
        elif effect[0] == "alloc":
            chosen = effect[2]
            free = chosen in s.free or chosen in freed_first
            if not _is_block(s, chosen) or chosen == NULL_BLOCK or chosen in allocated or not free:
                raise Illegal(f"r{rid} is allocated block {chosen}, which is not free")
            assert isinstance(chosen, int)
            allocated.append(chosen)
    now = [b for b in allocated if b in s.free]
    s.free[:] = now + [b for b in s.free if b not in now]
    s.steered_allocs = [None if b in now else b for b in allocated]


def _steer_groups(s: State, req: Request, hits: list[Event]) -> None:
    """Several groups: the engine's hit of each group (``("hit", req, blocks[, group])``, one
    per group) is the admission's (``State.steered_hits``), each block checked to be published
    in its group under the request's chained prefix at its position (the null block anywhere).
    Whether the groups' hits agree on one length, each by its own rule, is
    ``HitServedByEveryGroup``'s to judge, not a guard's."""
    chosen: list[list[int]] = [[] for _ in s.config.groups]
    for effect in hits:
        g = group_of(effect)
        if g >= len(chosen):
            raise Illegal(f"r{req.id} hits in group {g}, which the model does not have")
        blocks = list(effect[2])  # type: ignore[call-overload]
        size = s.config.groups[g].block_size
        if slots.is_slot(s, g):  # one published state, at the hit's length
            if len(blocks) > 1 or any(slots.published_state(s, req, g, b) is None for b in blocks):
                raise Illegal(
                    f"r{req.id}'s hit in slot group {g} names {blocks}: not one state published "
                    f"there under a prefix of r{req.id}'s tokens"
                )
            chosen[g] = blocks
            continue
        for i, block in enumerate(blocks):
            owners = s.index_of(g).get(tuple(req.tokens[: (i + 1) * size]), [])
            if block != NULL_BLOCK and block not in owners:
                raise Illegal(
                    f"r{req.id} hits block {block} as its group {g} block {i}, but that block "
                    f"is not published there under r{req.id}'s {(i + 1) * size}-token prefix"
                )
        chosen[g] = blocks
    s.steered_hits = chosen


def drop(s: State, effect: Event) -> list[Event]:
    """An ``unpublish`` the engine did on its own (outside the spec's policy): legal for any
    published block."""
    if effect[0] != "unpublish" or len(effect) != 2 or not _is_block(s, effect[1]):
        raise Illegal(f"unexpected effect {effect}")
    block: int = effect[1]  # type: ignore[assignment]
    if s.blocks[block].key is None:
        raise Illegal(f"unpublish of block {block}, which is not published")
    return unpublish(s, block)


def refuse_strict(config: Config) -> None:
    """Raise ``ValueError`` when ``config``'s policy can only be judged observed (a strict
    judge's constructor calls this)."""
    if config.policy in OBSERVED_POLICIES:
        raise ValueError(
            f"policy {config.policy} is judged by the observed judge only (docs/adapters.md)"
        )


def engine_effect(s: State, effect: Event) -> list[Event]:
    """An effect the engine had on its own, beyond the decision's effects in the spec: an
    ``unpublish`` (any policy); under ``engine-registers`` also a ``publish``, a ``dedup``, and
    with a slot group a ``snapshot`` and the ``evict`` of a cached free block before it
    (``spec/slots.py``).
    Raises ``Illegal`` for any other effect or one whose guard fails."""
    kind, engine_registers = effect[0], s.config.policy == "engine-registers"
    if kind == "publish" and engine_registers:
        return publish_own(s, effect)
    if kind == "dedup" and engine_registers:
        return dedup(s, effect)
    if kind == "snapshot" and engine_registers:
        return slots.snapshot(s, effect)
    if kind == "evict" and engine_registers and s.config.slots:
        return slots.evict(s, effect)
    if kind == "alloc" and engine_registers and tracks.is_track_alloc(s, effect):
        return tracks.alloc_track(s, effect)
    if kind == "track":
        if not (engine_registers and s.config.slots):
            raise Illegal(
                f"{effect}: a track write is the engine's own effect, judged only under "
                "engine-registers with a slot group (spec/tracks.py)"
            )
        return tracks.track(s, effect)
    return drop(s, effect)


def publish_own(s: State, effect: Event) -> list[Event]:
    """``("publish", req, index, block[, group])``: the engine registered ``block`` under the
    request's chained key for its ``index``-th block of group ``group`` (default 0), which must be
    a full block of its known tokens and a block of that group. The block need not be in the
    request's table any more (an engine may insert a finishing request's blocks as it releases
    them); that it holds, or will hold, that prefix is NoUnwrittenPublish's to judge."""
    req, index, block, g = _named(s, effect)
    if not s.config.prefix_caching:
        raise Illegal(f"publish of block {block}: prefix caching is off")
    end = (index + 1) * groups.size(s, g)
    if end > len(req.tokens):
        raise Illegal(f"publish r{req.id}'s block {index}: that block of its tokens is not full")
    if s.blocks[block].key is not None:
        raise Illegal(f"publish of block {block}, which is already published")
    if s.blocks[block].group != g:
        raise Illegal(f"publish of block {block} in group {g}: it is a block of another group")
    add_key(s, block, groups.key(req, end), g)
    s.touched.requests.add(req.id)
    return [effect]


def dedup(s: State, effect: Event) -> list[Event]:
    """``("dedup", req, index, block)``: the running request's table position ``index`` now names
    ``block``, a block published under the request's key there, instead of its own copy; the copy
    loses the request's reference and ``block`` gains one (SGLang, on inserting a request whose
    pages another request has inserted first). Not while the step being built uses the request's
    copy; a submitted step keeps the copy its entry names (the worker reads what it was handed:
    SGLang's overlap scheduler deduplicates while the batch launched next still reads the copy,
    which keeps its bytes until a batch launched later overwrites it). TablesAppendOnly treats the
    swap as sanctioned (the observed judge updates its snapshot); the invariants judge whether
    ``block`` holds what the request will read from it, and the submitted step's reads of the
    copy."""
    req, index, block, g = _named(s, effect, null_ok=True)
    where = f"dedup r{req.id}'s block {index} to block {block}"
    table = s.table_of(req, g) if g <= len(req.group_tables) else []
    if req.status != "running" or index >= len(table):
        raise Illegal(f"{where}: the request is not running with a block {index}")
    if block == NULL_BLOCK:
        return let_go(s, req, g, index, where)
    key = groups.key(req, (index + 1) * groups.size(s, g))
    if s.blocks[block].key != key or s.blocks[block].group != g or block in table:
        raise Illegal(f"{where}: not a published copy of r{req.id}'s block {index}")
    old = table[index]
    building = s.building
    entry = building.entries.get(req.id) if building is not None else None
    if building is not None and entry is not None and old in entry.blocks:
        raise Illegal(f"{where}: step {building.id}, being built, uses block {old}")
    b = s.blocks[block]
    if b.refcount == 0:
        s.free.remove(block)
    b.refcount += 1
    table[index] = block
    release(s, old, req.id)
    s.touched.blocks.add(block)
    s.touched.requests.add(req.id)
    if g == 0:  # TablesAppendOnly watches group 0's table
        s.touched.swapped.append((req.id, index, block))
    return [effect]


def let_go(s: State, req: Request, g: int, index: int, where: str) -> list[Event]:
    """``("dedup", req, index, 0, g)``: the running request gives up its block at ``index`` of
    window group ``g`` (``groups.engine_lets_go``), which holds the null block from then on; the
    block loses the request's reference. Not while the step being built uses it; a submitted
    step reads what it was handed (as for any ``dedup``: ``NoReadOfRecycled``), and a step built
    later reads the null block there, which ``NoUnwrittenRead`` judges."""
    table = s.table_of(req, g)
    old = table[index]
    if not groups.engine_lets_go(s, g) or old == NULL_BLOCK:
        raise Illegal(f"{where}: only a window block a request holds is given up")
    building = s.building
    entry = building.entries.get(req.id) if building is not None else None
    if building is not None and entry is not None and old in entry.group_blocks[g - 1]:
        raise Illegal(f"{where}: step {building.id}, being built, uses block {old}")
    table[index] = NULL_BLOCK
    release(s, old, req.id)
    s.touched.blocks.add(old)
    s.touched.requests.add(req.id)
    return [("dedup", req.id, index, NULL_BLOCK, g)]


def _named(s: State, effect: Event, null_ok: bool = False) -> tuple[Request, int, int, int]:
    """The request, table index, block and group an engine's ``publish`` or ``dedup`` names (the
    group a trailing field, present only for a group other than 0: ``events.group_of``); the
    null block only with ``null_ok`` in a group other than 0 (``let_go``)."""
    g = group_of(effect)
    short = effect[:4] if len(effect) == 5 else effect
    if len(short) != 4 or (len(effect) == 5 and g == 0):  # group 0 is never written
        raise Illegal(f"malformed effect {effect}")
    if not all(isinstance(x, int) for x in effect[1:]):
        raise Illegal(f"malformed effect {effect}")
    if not 0 <= g < max(1, len(s.config.groups)):
        raise Illegal(f"{effect[0]} names an unknown group: {effect}")
    rid, index, block = short[1], short[2], short[3]
    assert isinstance(rid, int) and isinstance(index, int) and isinstance(block, int)
    req = s.requests.get(rid)
    null = block == NULL_BLOCK and not (null_ok and g > 0)
    if req is None or index < 0 or not _is_block(s, block) or null:
        raise Illegal(f"{effect[0]} names an unknown request, index or block: {effect}")
    return req, index, block, g


def _is_block(s: State, value: object) -> bool:
    return isinstance(value, int) and 0 <= value < len(s.blocks)
