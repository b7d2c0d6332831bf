"""Observed choices: the orderings the spec leaves to its pool, taken from an engine's trace.

The spec's pool is deterministic: an allocation takes the free queue's head, a lookup the first
block registered under a hash. Another engine may order its free blocks or its duplicate
registrations differently and be just as safe. ``steer`` puts the engine's choices where the
spec's actions will take them, after checking that they are legal (an allocated block is free, a
hit block is registered under the request's chained hash at that position); it reorders, and
never changes which blocks are free or registered, so every action keeps its meaning. ``drop``
applies a registration the engine dropped on its own, which is always safe (a lost hit at worst).
Used by ``kvspec.conformance.observed`` (docs/adapters.md, "Judging modes").
"""

from __future__ import annotations

from .pool import Event, unpublish
from .state import NULL_BLOCK, Illegal, State


def steer(s: State, decision: Event, effects: list[Event]) -> None:
    """Before ``decision`` is applied: make the spec's pool choose what the engine chose in
    ``effects`` (the engine's effect events of that decision). Raises ``Illegal`` for a choice no
    pool may make."""
    if decision[0] != "schedule":
        return
    rid = decision[1]
    req = s.requests.get(rid) if isinstance(rid, int) else None
    if req is None:
        return  # the action itself reports the unknown request
    for effect in effects:
        if effect[0] == "hit" and req.status == "waiting":
            hits: tuple[int, ...] = tuple(effect[2])  # type: ignore[arg-type]
            for i, block in enumerate(hits):
                owners = s.index.get(s.key(req, i), [])
                if block not in owners:
                    raise Illegal(
                        f"r{rid} hits block {block} as its block {i}, but that block is not "
                        f"published under r{rid}'s {(i + 1) * s.config.block_size}-token prefix"
                    )
                owners.remove(block)
                owners.insert(0, block)
    allocated: list[int] = [effect[2] for effect in effects if effect[0] == "alloc"]  # type: ignore[misc]
    for block in allocated:
        if block == NULL_BLOCK or block not in s.free or allocated.count(block) > 1:
            raise Illegal(f"r{rid} is allocated block {block}, which is not free")
    rest = [block for block in s.free if block not in allocated]
    s.free[:] = allocated + rest


def drop(s: State, effect: Event) -> list[Event]:
    """An ``unpublish`` the engine did on its own (outside the spec's policy): legal for any
    published block."""
    if effect[0] != "unpublish" or not isinstance(effect[1], int):
        raise Illegal(f"unexpected effect {effect}")
    block = effect[1]
    if not 0 <= block < len(s.blocks) or s.blocks[block].key is None:
        raise Illegal(f"unpublish of block {block}, which is not published")
    return unpublish(s, block)
