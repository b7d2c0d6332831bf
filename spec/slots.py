"""Slot groups (``Group.kind == "slot"``, ``docs/model.md``, "Slot groups"): a recurrent state
held in ONE private slot per request, rewritten in place by every step, cached and hit by
copying whole states (SGLang's MAMBA component, ``no_buffer``).

This module owns what the other kinds have no use for: the *copy* (a block taking another
block's bytes when a step executes, before that step's reads and writes), the engine's own
``snapshot`` effect that publishes a state, and the hit of a slot group (one published state,
copied into the request's fresh slot, no reference taken). ``groups.py`` calls it where a slot
group's rule differs from a ``state`` group's; the invariants (``NoUnwrittenStateRead``,
``StateAtItsBoundary``, ``NoReadOfRecycled``) judge what it records.

The model of a copy. A copy made for step ``S`` (an admission's hit in the building step ``S``;
a snapshot made while step ``S`` is building, or, with none building, before the next step
``S`` begins) runs first thing in ``S``'s execute, in the order the copies were made
(``State.copies``): it sees every write of the steps before ``S`` and every copy of ``S`` made
before it, and none of ``S``'s own writes. So a snapshot copies the slot "as it will be once the
steps submitted so far have run" (a building step's writes are not in it), and an admission's
copy brings the source's state as it is just before the admitting step's forward pass (SGLang
copies in the batch's preparation). The copy is laid on the target as a ``Write`` with
``source`` set, whose ``prefix`` is what the source is foreseen to hold then
(``before_forward``), so the invariants that look ahead (``eventual_content``) see it; at
execute the real bytes are copied (``run_copies``), so a source spoiled since is found by the
read that follows.
"""

from __future__ import annotations

from . import tracks
from .events import group_of
from .pool import Event, add_key, drop_key
from .state import NULL_BLOCK, Content, Illegal, Request, State, Step, Write


def is_slot(s: State, g: int) -> bool:
    """Group ``g`` is a slot group."""
    return bool(s.config.groups) and s.config.groups[g].kind == "slot"


def hit_block(s: State, req: Request, g: int, length: int) -> list[int]:
    """The one block of slot group ``g`` whose state a hit of ``length`` tokens copies: the
    oldest published under the request's first ``length`` tokens; none for ``length`` 0."""
    if length == 0:
        return []
    blocks = s.index_of(g).get(tuple(req.tokens[:length]))
    if not blocks:
        raise Illegal(f"r{req.id}: slot group {g} holds no state after {length} tokens")
    return [blocks[0]]


def published_state(s: State, req: Request, g: int, block: int) -> int | None:
    """The hit length a slot group's hit block stands for: the length of its key when it is
    published in group ``g`` under a prefix of the request's tokens, a multiple of the group's
    block size; None otherwise."""
    b = s.blocks[block]
    key = b.key
    if key is None or b.group != g or block not in s.index_of(g).get(key, []):
        return None
    size = s.config.groups[g].block_size
    if not key or len(key) % size or tuple(req.tokens[: len(key)]) != key:
        return None
    return len(key)


def copy_step(s: State) -> int:
    """The step a copy made now runs in: the building step, or the next to begin."""
    building = s.building
    return building.id if building is not None else s.next_step


def before_forward(s: State, block: int, step_id: int) -> Content | None:
    """What ``block`` is foreseen to hold when step ``step_id``'s forward pass starts: its bytes
    after the writes of the steps before it, then the copies of that step made so far."""
    b = s.blocks[block]
    content = b.written
    for w in b.pending:
        if w.step < step_id or (w.step == step_id and w.source is not None):
            content = w.prefix
    return content


def copy(s: State, step_id: int, source: int, target: int, rid: int) -> None:
    """Make a copy of ``source`` into ``target`` for step ``step_id`` (``State.copies``): laid on
    the target after the writes of earlier steps and the copies of that step made before,
    before that step's own writes."""
    foreseen = before_forward(s, source, step_id)
    pending = s.blocks[target].pending
    at = next(
        (
            j
            for j, w in enumerate(pending)
            if w.step > step_id or (w.step == step_id and w.source is None)
        ),
        len(pending),
    )
    pending.insert(at, Write(step_id, rid, foreseen if foreseen is not None else (), source=source))
    s.copies.append((step_id, source, target))
    s.touched.content.add(target)


def run_copies(s: State, step: Step) -> None:
    """``execute``'s first act under slot groups: step ``step``'s copies, in the order they were
    made, each target taking its source's bytes as they are then (a copy withdrawn since, its
    request preempted in the building step, does not run)."""
    mine = [c for c in s.copies if c[0] == step.id]
    if not mine:
        return
    s.copies = [c for c in s.copies if c[0] != step.id]
    for _, source, target in mine:
        b = s.blocks[target]
        at = next(
            (j for j, w in enumerate(b.pending) if w.step == step.id and w.source == source),
            None,
        )
        if at is None:
            continue
        del b.pending[at]
        b.written = s.blocks[source].written
        s.touched.content.add(target)


def snapshot(s: State, effect: Event) -> list[Event]:
    """``("snapshot", req, index, block, group)``: the engine caches request ``req``'s state in
    ``block``, published in slot group ``group`` at the boundary ``(index + 1) * B_g`` (key: the
    request's first that many tokens). ``block`` is the request's own slot, held while it runs
    (published in place) or left by it when it finished (SGLang's finished request donates its
    slot: it stays cached, refcount 0); or a free block, which takes a copy of the slot as the
    steps submitted so far leave it (``copy``, for ``copy_step``) and is published with
    refcount 0, at the free queue's tail (cached, evictable like any cached free block). A free
    block that is published is evicted first by its own ``evict`` effect. The guard checks what
    the effect names; whether the state is the one at its boundary is ``StateAtItsBoundary``'s
    to judge, and a hit of it ``NoUnwrittenStateRead``'s."""
    if len(effect) != 5 or not all(type(x) is int for x in effect[1:]):
        raise Illegal(f"malformed effect {effect}")
    _, rid, index, block, g = effect
    assert isinstance(rid, int) and isinstance(index, int) and isinstance(block, int)
    g = group_of(effect)
    where = f"snapshot of r{rid}'s state at block {block}"
    if not 0 < g < len(s.config.groups) or not is_slot(s, g):
        raise Illegal(f"{where}: group {g} is no slot group")
    if not s.config.prefix_caching:
        raise Illegal(f"{where}: prefix caching is off")
    req = s.requests.get(rid)
    if req is None or req.status == "waiting" or g not in req.slots:
        raise Illegal(f"{where}: r{rid} is not running or finished with a slot in group {g}")
    if index < 0 or (index + 1) * s.config.groups[g].block_size > len(req.tokens):
        raise Illegal(f"{where}: index {index} is beyond r{rid}'s known tokens")
    if block == NULL_BLOCK or not 0 <= block < len(s.blocks):
        raise Illegal(f"{where}: no such block")
    b, slot = s.blocks[block], req.slots[g]
    key = tuple(req.tokens[: (index + 1) * s.config.groups[g].block_size])
    if b.key is None and tracks.is_track_slot(s, rid, block, g):  # extra_buffer's donation
        tracks.donate(s, rid, block, g, key)
        return [effect]
    table = s.table_of(req, g) if req.status == "running" else []
    held = bool(table) and table[0] == block
    if not held and b.refcount:
        raise Illegal(
            f"{where}: the block is held (refcount {b.refcount}) and is not r{rid}'s own slot"
        )
    if b.key is not None:
        raise Illegal(f"{where}: the block is published already (an evict comes first)")
    left = req.status == "finished" and block in req.tracks.get(g, ())
    if left:  # a finished request donates a track slot it left (spec/tracks.py)
        req.tracks[g].remove(block)
    if not held:
        if block != slot and not left:
            copy(s, copy_step(s), slot, block, rid)
        b.group = g
        s.free.remove(block)
        s.free.append(block)
    add_key(s, block, key, g)
    s.touched.blocks.add(block)
    s.touched.requests.add(rid)
    return [effect]


def evict(s: State, effect: Event) -> list[Event]:
    """``("evict", block)`` on its own, under slot groups: the engine reuses a cached free block
    for a ``snapshot`` and drops its hash first (as an allocation would)."""
    block = effect[1] if len(effect) == 2 else None
    if type(block) is not int or not 0 < block < len(s.blocks):
        raise Illegal(f"malformed effect {effect}")
    b = s.blocks[block]
    if b.refcount or b.key is None:
        raise Illegal(f"evict of block {block}: it is not a cached free block")
    drop_key(s, block)
    s.touched.blocks.add(block)
    return [effect]
