"""The engine's own view of its pool, compared with the spec's state: its hash index and its
free / evictable accounting.

The strict judge compares an engine's refcounts and free queue (``Adapter.snapshot``) after every
fuzzing action. That leaves out two books an engine keeps beside them and acts on: its hash index
(hash -> blocks: a lookup trusts it) and its accounting (the count of free blocks its admission
control reads, the set of blocks it counts as evictable). An index entry left behind after an
eviction, or a free block counted twice, shows in the refcounts only when a later lookup or
admission goes wrong, if ever. An adapter that can read these books offers the optional
``pool_view() -> PoolView | None``; the fuzzer compares it with the spec's state after the
snapshot matched (``compare_view``), so the engine's refcounts and free queue are the spec's and a
difference is in the book itself.

What a difference is named:

* ``HashIndexConsistent`` (the spec's invariant, ``spec/invariants.py``), from the engine's side:
  with the engine's blocks and free queue equal to the spec's, its index holds a block the events
  never published (or that they evicted), loses one they published, or files under one hash
  blocks of different prefixes: the engine's state breaks the invariant the spec's keeps.
* ``FreeCountExact`` and ``EvictableExact``, conformance checks declared here (``VIEW_CHECKS``),
  not invariants of the spec (whose state has one free queue, no second count): the engine's free
  count equals its free queue's length, and the blocks it counts as evictable are exactly its free
  blocks that still carry a hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvspec.judge.findings import Finding

HASH_INDEX = "HashIndexConsistent"
FREE_COUNT = "FreeCountExact"
EVICTABLE = "EvictableExact"

VIEW_CHECKS = {
    FREE_COUNT: "The engine's count of free blocks (what its admission control reads) equals the "
    "length of its free queue. A count above it admits a request the pool cannot hold (an "
    "allocation from an empty queue); one below it refuses work it could run.",
    EVICTABLE: "The blocks the engine counts as evictable are exactly its free blocks that still "
    "carry a hash: a cached block missing from the set is never reused, one in use in it can be "
    "evicted under its holder.",
}
"""The conformance checks of an engine's own accounting (not invariants of the spec, whose
state has no second count): name -> what it guards against (``judge/findings.explanation``)."""


@dataclass(frozen=True)
class PoolView:
    """What an engine's own books say; a field is None where the engine keeps no such book."""

    free_count: int | None = None
    """The engine's count of free blocks (vLLM's ``get_num_free_blocks()``)."""
    evictable: tuple[int, ...] | None = None
    """The blocks the engine counts as evictable: free, and still cached."""
    index: tuple[tuple[int, ...], ...] | None = None
    """The engine's hash index, one tuple per hash: the blocks registered under it."""


@dataclass(frozen=True)
class SpecView:
    """The same books of the spec's state."""

    free: tuple[int, ...]
    hashed: dict[int, object]
    """Block -> the key it carries (the spec's prefix, or the fast model's id of it)."""
    index: tuple[tuple[int, ...], ...]


def spec_view(model: Any) -> SpecView | None:
    """The books of a judge's model: the spec's ``State`` (``spec_model.SpecModel.state``) or the
    fast model's arrays (``fastmodel.FastModel``: ``free``, ``key``, ``index``); None for a model
    with neither (no comparison)."""
    state = getattr(model, "state", None)
    if state is not None and hasattr(state, "index"):
        hashed = {i: b.key for i, b in enumerate(state.blocks) if b.key is not None}
        return SpecView(tuple(state.free), hashed, _groups(state.index.values()))
    keys, index, free = (getattr(model, name, None) for name in ("key", "index", "free"))
    if isinstance(keys, list) and isinstance(index, dict) and free is not None:
        hashed = {i: k for i, k in enumerate(keys) if k is not None}
        return SpecView(tuple(free), hashed, _groups(index.values()))
    return None


def _groups(index: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(sorted(tuple(sorted(int(b) for b in blocks)) for blocks in index if blocks))


def compare_view(view: PoolView | None, model: Any, at: int) -> Finding | None:
    """The first difference between the engine's books and the spec's state, named; None if they
    agree (or either side keeps no book). ``at``: the events judged so far."""
    if len(getattr(model.config, "groups", ()) or ()) > 1:
        return None  # several KV-cache groups (docs/hybrid.md): per-group books, not compared yet
    spec = spec_view(model)
    if view is None or spec is None:
        return None
    if view.index is not None:
        found = _index_difference(view.index, spec, at)
        if found is not None:
            return found
    if view.free_count is not None and view.free_count != len(spec.free):
        return Finding(
            FREE_COUNT,
            f"the engine counts {view.free_count} free blocks; its free queue (the spec's) holds "
            f"{len(spec.free)}",
            at,
        )
    if view.evictable is not None:
        mine = sorted(b for b in spec.free if b in spec.hashed)
        if sorted(view.evictable) != mine:
            wrong = tuple(sorted(set(view.evictable) ^ set(mine)))
            return Finding(
                EVICTABLE,
                f"the engine counts blocks {sorted(view.evictable)} as evictable; the free blocks "
                f"that carry a hash are {mine}",
                at,
                wrong,
            )
    return None


def _index_difference(
    engine: tuple[tuple[int, ...], ...], spec: SpecView, at: int
) -> Finding | None:
    indexed = [b for blocks in engine for b in blocks]
    twice = sorted({b for b in indexed if indexed.count(b) > 1})
    if twice:
        message = f"the engine's hash index holds blocks {twice} under more than one hash"
        return Finding(HASH_INDEX, message, at, tuple(twice))
    stale = sorted(set(indexed) - set(spec.hashed))
    if stale:
        return Finding(
            HASH_INDEX,
            f"the engine's hash index holds blocks {stale}, which carry no hash by the events "
            "(never published, or evicted since): a lookup can hit a block holding other tokens",
            at,
            tuple(stale),
        )
    lost = sorted(set(spec.hashed) - set(indexed))
    if lost:
        return Finding(
            HASH_INDEX,
            f"blocks {lost} were published and not evicted, but the engine's hash index has "
            "lost them: their prefix is never hit again",
            at,
            tuple(lost),
        )
    groups = _groups(engine)
    if groups != spec.index:
        mixed = [g for g in groups if len({spec.hashed[b] for b in g}) > 1]
        split = [g for g in spec.index if g not in groups]
        blocks = (mixed or split)[0]
        what = (
            "under one hash in the engine's index, of different prefixes"
            if mixed
            else ("of one prefix, under different hashes in the engine's index")
        )
        return Finding(HASH_INDEX, f"blocks {list(blocks)} are {what}", at, blocks)
    return None
