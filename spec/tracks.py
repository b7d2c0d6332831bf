"""Track slots of a slot group (``docs/model.md``, "Track slots"): SGLang's MAMBA
``extra_buffer`` strategy, where a request holds, beside its working slot, a ping-pong pair of
track slots that a step also writes a boundary state into, and an insert donates the tracked
slot to the tree and takes a fresh one.

Why a module of its own: the working slot (``spec/slots.py``) is the spec's; the track slots are
the engine's choice through and through (how many, which one a step writes, at which boundary,
which one an insert donates), so all three are the engine's own effects under
``engine-registers``, judged by the invariants that already name each failure:

* ``("alloc", r, b, g)`` past the slot group's first: a track slot (``alloc_track``), appended
  to ``r``'s slot table, or into the position a donation left empty.
* ``("track", r, b, t, g)`` right after the schedule decision of ``r``: its entry in the step
  being built also leaves the state after exactly ``t`` tokens in track slot ``b`` (``track``;
  a pending ``Write`` with ``track`` set, landed by ``run_tracks`` after the step's reads, so a
  step that read a wrong state writes a wrong one there too).
* ``("snapshot", r, i, b, g)`` of a track slot: its donation (``donate``, from
  ``slots.snapshot``): published in place, it leaves ``r``'s table (refcount 0, cached, at the
  free queue's tail) and its position is empty until the next track ``alloc``.

None of the spec's own policies makes these: anywhere the spec schedules, ``track`` is refused
by name (``observed.engine_effect``)."""

from __future__ import annotations

from .events import group_of
from .pool import Event, add_key
from .state import NULL_BLOCK, Illegal, State, Step, Write


def _slot_group(s: State, g: int) -> bool:
    return (
        bool(s.config.groups)
        and 0 < g < len(s.config.groups)
        and (s.config.groups[g].kind == "slot")
    )


def is_track_alloc(s: State, effect: Event) -> bool:
    """``effect`` is an ``alloc`` in a slot group (the judge's own effect: a track slot)."""
    return effect[0] == "alloc" and _slot_group(s, group_of(effect))


def alloc_track(s: State, effect: Event) -> list[Event]:
    """``("alloc", r, b, g)`` of slot group ``g`` beyond the one the schedule makes: free block
    ``b`` (unpublished: a cached one is evicted by its own ``evict`` first) joins running ``r``'s
    slot table as a track slot, at the first position a donation left empty, else at its end."""
    if len(effect) != 4 or not all(type(x) is int for x in effect[1:]):
        raise Illegal(f"malformed effect {effect}")
    _, rid, block, g = effect
    assert isinstance(rid, int) and isinstance(block, int) and isinstance(g, int)
    where = f"track slot alloc of block {block} for r{rid} in group {g}"
    req = s.requests.get(rid)
    if req is None or req.status != "running" or not req.group_tables:
        raise Illegal(f"{where}: r{rid} is not running")
    table = s.table_of(req, g)
    if not table:
        raise Illegal(f"{where}: r{rid} holds no working slot there yet")
    if not 0 < block < len(s.blocks) or block not in s.free:
        raise Illegal(f"{where}: the block is not free")
    b = s.blocks[block]
    if b.key is not None:
        raise Illegal(f"{where}: the block is published (an evict comes first)")
    s.free.remove(block)
    b.refcount, b.group = 1, g
    req.tracks.setdefault(g, []).append(block)
    hole = next((i for i in range(1, len(table)) if table[i] == NULL_BLOCK), None)
    if hole is None:
        table.append(block)
    else:
        table[hole] = block
    s.touched.blocks.add(block)
    s.touched.requests.add(rid)
    return [effect]


def track(s: State, effect: Event) -> list[Event]:
    """``("track", r, b, t, g)``: ``r``'s entry in the step being built also writes the state
    after exactly ``t`` tokens into ``b``, one of ``r``'s track slots in slot group ``g``
    (``start < t <= end`` of the entry, ``t`` a multiple of ``B_g``). Whether the state lands
    where a snapshot publishes it is ``StateAtItsBoundary``'s to judge."""
    if len(effect) != 5 or not all(type(x) is int for x in effect[1:]):
        raise Illegal(f"malformed effect {effect}")
    _, rid, block, t, g = effect
    assert isinstance(rid, int) and isinstance(block, int) and isinstance(t, int)
    assert isinstance(g, int)
    where = f"track write of r{rid}'s state after {t} tokens into block {block}"
    if not _slot_group(s, g):
        raise Illegal(f"{where}: group {g} is no slot group")
    req, step = s.requests.get(rid), s.building
    if req is None or step is None or rid not in step.entries:
        raise Illegal(f"{where}: r{rid} has no entry in a step being built")
    table = s.table_of(req, g) if req.group_tables else []
    if block == NULL_BLOCK or block not in table[1:]:
        raise Illegal(f"{where}: the block is not one of r{rid}'s track slots")
    e = step.entries[rid]
    if e.load or not e.start < t <= e.end or t % s.config.groups[g].block_size:
        raise Illegal(
            f"{where}: {t} is not a boundary of group {g} in the entry's tokens "
            f"{e.start}..{e.end - 1}"
        )
    tokens = tuple(s.seen(req, step.id, e)[:t])
    s.blocks[block].pending.append(Write(step.id, rid, tokens, track=True))
    s.touched.content.add(block)
    return [effect]


def donate(s: State, rid: int, block: int, g: int, key: tuple) -> None:
    """``slots.snapshot`` of running ``r``'s track slot ``block``: published under ``key`` in
    place; it leaves the table (its position empty until the next track ``alloc``) with
    refcount 0, at the free queue's tail (cached), its pending track write still to land."""
    req = s.requests[rid]
    table = s.table_of(req, g)
    table[table.index(block)] = NULL_BLOCK
    req.tracks[g].remove(block)
    b = s.blocks[block]
    b.refcount = 0
    s.free.append(block)
    add_key(s, block, key, g)
    s.touched.blocks.add(block)
    s.touched.requests.add(rid)


def withdraw(s: State, step: Step, rid: int) -> None:
    """``rid``'s entry left the step being built (``actions._leave``): its track writes go with
    it, as its other pending writes do. Left pending, a write no step will make would vouch for
    whatever the slot is published as next: a track slot the next owner donates unwritten, of
    the same tokens, would hold (``docs/model.md``, "Track slots")."""
    for block, b in enumerate(s.blocks):
        if any(w.track and w.step == step.id and w.req == rid for w in b.pending):
            b.pending = [
                w for w in b.pending if not (w.track and w.step == step.id and w.req == rid)
            ]
            s.touched.content.add(block)


def is_track_slot(s: State, rid: int, block: int, g: int) -> bool:
    """``block`` is one of running ``r``'s track slots in slot group ``g``."""
    req = s.requests.get(rid)
    if req is None or req.status != "running" or not req.group_tables:
        return False
    return block != NULL_BLOCK and block in s.table_of(req, g)[1:]


def run_tracks(s: State, step: Step, rid: int, bad: bool) -> None:
    """``execute``'s track writes of ``rid``'s entry, after the step's reads: each track slot
    takes the state its write names, or garbage when the entry read a wrong state (its
    recurrence is wrong from the start)."""
    for block, b in enumerate(s.blocks):
        mine = [w for w in b.pending if w.track and w.step == step.id and w.req == rid]
        if not mine:
            continue
        b.pending = [w for w in b.pending if not (w.track and w.step == step.id and w.req == rid)]
        b.written = None if bad else mine[-1].prefix
        s.touched.content.add(block)
