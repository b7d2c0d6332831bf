"""The KV-event stream as a router sees it: its state (the router's view), its actions and its
invariants, in the style of ``actions.py`` and ``invariants.py``.

Serving engines export their prefix cache as a stream of *batches* (one per engine step that had
events), each with a sequence number and a list of events: ``BlockStored`` (a chain of full blocks
was cached: their opaque hashes, the hash of the block before the first, their tokens),
``BlockRemoved`` (hashes no longer cached) and ``AllBlocksCleared``. KV-aware routers build their
index of "which engine holds which prefix" from this stream alone; this module says what the
stream must satisfy for that index to be right.

**State** (``View``): per announced block, keyed by ``(medium, group, hash)``, its parent hash, its
tokens, its LoRA name and extra keys, and a count: how many engine blocks the stream says hold it
(vLLM does not deduplicate equal blocks, so two blocks may be stored under one hash; each
``BlockRemoved`` then takes one away). Plus the next sequence number, the keys dropped by the last
clear, and whether the view joined a running stream (then it cannot know what came before).

**Actions**: ``apply_batch`` applies a ``Batch``'s events in order with ``store``, ``remove`` and
``clear``. They never raise: what a router cannot make sense of is an invariant's business.

**Invariants**: functions returning a ``Violation`` or None; each docstring's first sentence is
what holds. ``STREAM_INVARIANTS`` are judged from the stream alone, before each event (or batch)
is applied; ``ENGINE_INVARIANTS`` need the engine's real cache and are judged at step boundaries
(right after a batch was published) by whoever drives the engine (``conformance/kvevents/engine_stream.py``).
Which hold per medium and per group: ``docs/kv-events.md``.

Pure standard-library Python; it imports nothing of kvspec but ``Violation``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from .invariants import Violation

Hash = bytes | int
"""An engine's opaque block hash (vLLM: sha256 bytes, or 64-bit ints; SGLang: int64)."""
Key = tuple[str | None, int | None, Hash]
"""Where a block is announced: (medium, group, hash)."""
CHAINED_KINDS = (None, "full_attention", "mla_attention", "sink_full_attention")
"""Group kinds whose every cached block's parent is cached too. In the others (sliding window,
chunked local attention, Mamba) vLLM skips the null blocks that fell out of the window, so a
store's parent may be a hash it never announced."""


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: ``hashes[i]`` names tokens ``tokens[i*B:(i+1)*B]``, its parent is
    ``hashes[i-1]`` (``parent`` for the first; None: the chain's root)."""

    hashes: tuple[Hash, ...]
    parent: Hash | None
    tokens: tuple[int, ...]
    block_size: int
    medium: str | None = None
    group: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    """One entry per hash (LoRA, multimodal, cache salt), or None."""
    kind: str | None = None
    """The group's KV-cache kind (vLLM's ``kv_cache_spec_kind``: ``full_attention``,
    ``sliding_window``, ``mamba``, ...), or None when not said."""

    @property
    def placeholder(self) -> bool:
        """A hash announced without its tokens (vLLM's offloading connector does this when it
        lacks a block's metadata: ``block_size`` 0, no tokens, no parent)."""
        return self.block_size == 0 and not self.tokens


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: one engine block under each hash is no longer cached."""

    hashes: tuple[Hash, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: the engine dropped every cached block, in every medium and group."""


StreamEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    """One published batch: its sequence number and its events, in order."""

    seq: int
    events: tuple[StreamEvent, ...]
    ts: float = 0.0
    rank: int | None = None
    """The data-parallel rank that published it; each rank is its own engine."""


@dataclass(slots=True)
class Announced:
    """What the stream said about one announced block."""

    parent: Hash | None
    tokens: tuple[int, ...]
    lora_name: str | None
    extra: object
    count: int = 1
    """Engine blocks the stream says hold this hash (stores less removals)."""
    prefix: tuple[int, ...] | None = None
    """Every token from the chain's root to the end of this block, when the view keeps them
    and the chain was complete when the block was stored."""


@dataclass(slots=True)
class View:
    """The router's view of one engine (one publisher, one data-parallel rank)."""

    blocks: dict[Key, Announced] = field(default_factory=dict)
    next_seq: int | None = 0
    """The sequence number the next batch must carry; None: take the first one that comes."""
    cleared: set[Key] = field(default_factory=set)
    """Keys the last clear dropped (for ``ClearEmptiesView``)."""
    partial: bool = False
    """Joined a running stream: hashes announced before the first batch seen are unknown, so a
    removal or a parent naming an unknown hash is excused until the next clear."""
    keep_prefixes: bool = False
    """Keep each block's whole token prefix (``AnnouncedHoldsPrefix`` needs it)."""
    seq: int | None = None
    """The sequence number of the batch being applied (or last applied)."""
    batches: int = 0
    events: int = 0
    held: Counter[str | None] = field(default_factory=Counter)
    """Blocks announced per medium (the sum of the counts)."""
    present: Counter[tuple[int | None, Hash]] = field(default_factory=Counter)
    """(group, hash) -> in how many media it is announced."""
    cleared_pairs: set[tuple[int | None, Hash]] = field(default_factory=set)


def joined(keep_prefixes: bool = False) -> View:
    """A view that starts at whatever batch comes first: a subscriber that joined late."""
    return View(next_seq=None, partial=True, keep_prefixes=keep_prefixes)


# -- actions ------------------------------------------------------------------------------------


def chain(event: Stored) -> Iterator[tuple[Hash, Hash | None, tuple[int, ...], object]]:
    """The blocks of a store, each as (hash, parent, its tokens, its extra keys)."""
    parent, size = event.parent, event.block_size
    for i, block_hash in enumerate(event.hashes):
        extra = event.extra_keys[i] if event.extra_keys is not None else None
        yield block_hash, parent, event.tokens[i * size : (i + 1) * size], extra
        parent = block_hash


def store(v: View, event: Stored) -> None:
    medium, group = event.medium, event.group
    for block_hash, parent, tokens, extra in chain(event):
        key = (medium, group, block_hash)
        v.held[medium] += 1
        known = v.blocks.get(key)
        if known is not None:
            known.count += 1
            continue
        prefix = None
        if v.keep_prefixes:
            above = () if parent is None else parent_prefix(v, medium, group, parent)
            prefix = None if above is None else above + tokens
        v.blocks[key] = Announced(parent, tokens, event.lora_name, extra, 1, prefix)
        v.present[(group, block_hash)] += 1


def remove(v: View, event: Removed) -> None:
    medium, group = event.medium, event.group
    for block_hash in event.hashes:
        key = (medium, group, block_hash)
        known = v.blocks.get(key)
        if known is None:
            continue
        known.count -= 1
        v.held[medium] -= 1
        if known.count == 0:
            del v.blocks[key]
            v.present[(group, block_hash)] -= 1
            if not v.present[(group, block_hash)]:
                del v.present[(group, block_hash)]


def clear(v: View) -> None:
    v.cleared = set(v.blocks)
    v.cleared_pairs = set(v.present)
    v.blocks.clear()
    v.held.clear()
    v.present.clear()
    v.partial = False  # from here on the view knows everything the engine holds


def apply_event(v: View, event: StreamEvent) -> None:
    if isinstance(event, Stored):
        store(v, event)
    elif isinstance(event, Removed):
        remove(v, event)
    else:
        clear(v)
    v.events += 1


def begin_batch(v: View, batch: Batch) -> None:
    """Take the batch's sequence number (its events follow with ``apply_event``)."""
    v.seq = batch.seq
    v.next_seq = batch.seq + 1
    v.batches += 1


def apply_batch(v: View, batch: Batch) -> None:
    begin_batch(v, batch)
    for event in batch.events:
        apply_event(v, event)


def parent_prefix(
    v: View, medium: str | None, group: int | None, parent: Hash
) -> tuple[int, ...] | None:
    """The whole token prefix of an announced parent (same group; this medium first), or None."""
    for where in (medium, *(m for m in v.held if m != medium)):
        known = v.blocks.get((where, group, parent))
        if known is not None and known.prefix is not None:
            return known.prefix
    return None


def announced_in_group(v: View, group: int | None, block_hash: Hash) -> bool:
    """The hash is announced in this group, in some medium."""
    return (group, block_hash) in v.present


def counts(v: View, medium: str | None = None) -> Counter[tuple[int | None, Hash]]:
    """(group, hash) -> engine blocks announced, for one medium."""
    return Counter({(g, h): a.count for (m, g, h), a in v.blocks.items() if m == medium})


def show(block_hash: Hash | None) -> str:
    """A short, stable rendering of a hash for sentences."""
    if block_hash is None:
        return "the root"
    if isinstance(block_hash, bytes):
        return "0x" + block_hash[:6].hex() + ("…" if len(block_hash) > 6 else "")
    return f"{block_hash:#x}" if block_hash >= 0 else str(block_hash)


# -- invariants judged from the stream alone ----------------------------------------------------


def sequence_in_order(v: View, batch: Batch) -> Violation | None:
    """Batches arrive in sequence-number order, each number once, with no gap that the replay
    socket did not fill. Guards against a router silently missing stores and removals: after a
    lost batch its view is wrong and nothing later in the stream says so."""
    if v.next_seq is None or batch.seq == v.next_seq:
        return None
    if batch.seq < v.next_seq:
        what = (
            "the sequence restarted (a new publisher process?): the view of the old one is stale "
            "and no clear said so"
            if batch.seq == 0
            else f"batch {batch.seq} comes again after batch {v.next_seq - 1}"
        )
    else:
        missing = batch.seq - v.next_seq
        what = (
            f"batch {batch.seq} follows batch {v.next_seq - 1}: {missing} batch"
            f"{'es' if missing > 1 else ''} ({v.next_seq}..{batch.seq - 1}) never came and the "
            "replay socket did not return them"
        )
    return Violation("SequenceInOrder", what, step=batch.seq)


def removal_names_announced(v: View, event: StreamEvent) -> Violation | None:
    """A removal names a block the stream announced and did not remove yet. Guards against a
    router whose view and engine have parted: a removal of an unknown hash means a store was
    lost, reordered after its removal, or never sent."""
    if not isinstance(event, Removed):
        return None
    for block_hash in event.hashes:
        key = (event.medium, event.group, block_hash)
        if key in v.blocks or (v.partial and key not in v.cleared):
            continue
        return Violation(
            "RemovalNamesAnnounced",
            f"BlockRemoved names {show(block_hash)} (medium {event.medium}, group "
            f"{event.group}), which is not announced",
            step=v.seq,
        )
    return None


def parent_announced(v: View, event: StreamEvent) -> Violation | None:
    """A stored chain's parent is announced (in the same group, in some medium) or is the root,
    in groups of full attention (``CHAINED_KINDS``).
    Guards against orphans: a router keyed on chains drops, or misplaces, a child whose parent
    it does not know, so later lookups of that prefix miss."""
    if not isinstance(event, Stored) or event.parent is None or v.partial:
        return None
    if event.kind not in CHAINED_KINDS:
        return None
    if announced_in_group(v, event.group, event.parent):
        return None
    return Violation(
        "ParentAnnounced",
        f"BlockStored of {show(event.hashes[0] if event.hashes else None)} names parent "
        f"{show(event.parent)} (group {event.group}), which is not announced",
        step=v.seq,
    )


def clear_empties_view(v: View, event: StreamEvent) -> Violation | None:
    """After ``AllBlocksCleared`` nothing announced before it is named again unless it is stored
    anew: no removal of it and no child of it (a child only in groups of full attention,
    ``CHAINED_KINDS``: elsewhere a store's parent may be a skipped block, as for
    ``ParentAnnounced``). Guards against an engine that keeps blocks it told
    routers it cleared (a router that emptied its view then sees children of unknown parents and
    removals of unknown hashes)."""
    if not v.cleared:
        return None
    if isinstance(event, Removed):
        for block_hash in event.hashes:
            key = (event.medium, event.group, block_hash)
            if key in v.cleared and key not in v.blocks:
                return Violation(
                    "ClearEmptiesView",
                    f"BlockRemoved names {show(block_hash)}, which the last AllBlocksCleared "
                    "dropped: the engine still held it after saying it cleared everything",
                    step=v.seq,
                )
    if isinstance(event, Stored) and event.parent is not None and event.kind in CHAINED_KINDS:
        if announced_in_group(v, event.group, event.parent):
            return None
        if (event.group, event.parent) in v.cleared_pairs:
            return Violation(
                "ClearEmptiesView",
                f"BlockStored of {show(event.hashes[0] if event.hashes else None)} is a child "
                f"of {show(event.parent)}, which the last AllBlocksCleared dropped",
                step=v.seq,
            )
    return None


def store_consistent(v: View, event: StreamEvent) -> Violation | None:
    """A store is well formed (``block_size`` tokens per hash, one extra-key entry per hash; or
    a placeholder) and a hash announced again names the same parent, tokens, LoRA and extra keys. Guards against a
    router's token index disagreeing with the hashes: one hash for two prefixes is a wrong hit."""
    if not isinstance(event, Stored):
        return None
    n, size = len(event.hashes), event.block_size
    if event.placeholder and event.parent is None:
        return None
    if size < 1 or len(event.tokens) != n * size:
        return Violation(
            "StoreConsistent",
            f"BlockStored has {n} hashes of block size {size} but {len(event.tokens)} tokens",
            step=v.seq,
        )
    if event.extra_keys is not None and len(event.extra_keys) != n:
        return Violation(
            "StoreConsistent",
            f"BlockStored has {n} hashes but {len(event.extra_keys)} extra-key entries",
            step=v.seq,
        )
    for block_hash, parent, tokens, extra in chain(event):
        known = v.blocks.get((event.medium, event.group, block_hash))
        if known is None:
            continue
        said = (known.parent, known.tokens, known.lora_name, known.extra)
        if said != (parent, tokens, event.lora_name, extra):
            return Violation(
                "StoreConsistent",
                f"{show(block_hash)} is stored again with parent {show(parent)} and tokens "
                f"{list(tokens)}; it was announced with parent {show(known.parent)} and tokens "
                f"{list(known.tokens)}",
                step=v.seq,
            )
    return None


def store_names_new_hash(v: View, event: StreamEvent) -> Violation | None:
    """A store names a hash that is not announced already (in its medium and group). What a
    router that keeps a *set* of hashes needs: for it, the first removal of a hash stored twice
    drops the hash while the engine still holds a block under it. vLLM's design does not promise
    it (``BlockHashToBlockMap``: equal blocks are not deduplicated), so it is not judged by
    default (``SET_VIEW_INVARIANTS``)."""
    if not isinstance(event, Stored):
        return None
    for block_hash in event.hashes:
        if (event.medium, event.group, block_hash) in v.blocks:
            return Violation(
                "StoreNamesNewHash",
                f"BlockStored names {show(block_hash)} (medium {event.medium}, group "
                f"{event.group}), which is announced already: a set-based router loses it at "
                "the first of the two removals",
                step=v.seq,
            )
    return None


def view_within_capacity(v: View, capacity: int, medium: str | None = "GPU") -> Violation | None:
    """The view of a medium never announces more blocks than the engine has there (when each
    block holds one hash: full attention without partial-block entries). Guards against stale
    entries: a lost removal leaves a hash announced forever."""
    held = v.held[medium]
    if held <= capacity:
        return None
    return Violation(
        "ViewWithinCapacity",
        f"the view announces {held} {medium} blocks; the engine has {capacity}",
        step=v.seq,
    )


# -- invariants that need the engine's real cache -----------------------------------------------


def view_equals_cache(
    v: View, cache: Mapping[tuple[int | None, Hash], int], medium: str | None = "GPU"
) -> Violation | None:
    """At a step boundary (right after a batch was published) the view of a medium is the
    engine's cache there: every hash the engine can hit is announced, every announced hash can be
    hit, each with as many blocks. ``cache`` maps (group, hash) to the engine's blocks under it.
    Guards against routing by a view that is not the engine's: misses where the router expects
    hits, and prefixes the router never learns of."""
    mine = counts(v, medium)
    theirs = Counter({k: n for k, n in cache.items() if n})
    if mine == theirs:
        return None
    unannounced = sorted((k for k in theirs if k not in mine), key=repr)
    stale = sorted((k for k in mine if k not in theirs), key=repr)
    miscounted = sorted((k for k in mine if k in theirs and mine[k] != theirs[k]), key=repr)
    if unannounced:
        group, block_hash = unannounced[0]
        what = (
            f"the engine holds {show(block_hash)} (group {group}) but the stream never announced "
            f"it ({len(unannounced)} such hashes)"
        )
    elif stale:
        group, block_hash = stale[0]
        what = (
            f"{show(block_hash)} (group {group}) is announced but the engine no longer holds it "
            f"({len(stale)} such hashes)"
        )
    else:
        group, block_hash = miscounted[0]
        what = (
            f"{show(block_hash)} (group {group}) is announced for {mine[(group, block_hash)]} "
            f"blocks; the engine holds {theirs[(group, block_hash)]}"
        )
    return Violation("ViewEqualsCache", what, step=v.seq)


def announced_holds_prefix(
    v: View,
    blocks_of: Callable[[Key], Iterable[int]],
    bad_blocks: Callable[[tuple[int, ...], Iterable[int]], tuple[int, ...]],
) -> Violation | None:
    """Every announced block holds its prefix, or will once the writes in flight have run, while
    the engine still holds it under that hash. ``blocks_of(key)``: the engine's block ids that
    carried the hash at the last step boundary; ``bad_blocks(prefix, ids)``: those of them that
    still carry it and will never hold ``prefix`` (from the spec's block contents). The seed's
    zombie as a router sees it: a prefix it routes to, and the engine hits, was never written."""
    for key, known in v.blocks.items():
        if known.prefix is None:
            continue
        bad = bad_blocks(known.prefix, blocks_of(key))
        if bad:
            return Violation(
                "AnnouncedHoldsPrefix",
                f"{show(key[2])} is announced for a {len(known.prefix)}-token prefix that block "
                f"{bad[0]} will never hold",
                blocks=bad,
                step=v.seq,
            )
    return None


BatchInvariant = Callable[[View, Batch], Violation | None]
EventInvariant = Callable[[View, StreamEvent], Violation | None]

BATCH_INVARIANTS: dict[str, BatchInvariant] = {"SequenceInOrder": sequence_in_order}
EVENT_INVARIANTS: dict[str, EventInvariant] = {
    "StoreConsistent": store_consistent,
    "ClearEmptiesView": clear_empties_view,
    "RemovalNamesAnnounced": removal_names_announced,
    "ParentAnnounced": parent_announced,
}
"""Judged before each event is applied, in this order (the first that fails names the cause)."""
SET_VIEW_INVARIANTS: dict[str, EventInvariant] = {"StoreNamesNewHash": store_names_new_hash}
STREAM_INVARIANTS: dict[str, Callable[..., Violation | None]] = {
    **BATCH_INVARIANTS,
    **EVENT_INVARIANTS,
    **SET_VIEW_INVARIANTS,
    "ViewWithinCapacity": view_within_capacity,
}
ENGINE_INVARIANTS: dict[str, Callable[..., Violation | None]] = {
    "ViewEqualsCache": view_equals_cache,
    "AnnouncedHoldsPrefix": announced_holds_prefix,
}
INVARIANTS = {**STREAM_INVARIANTS, **ENGINE_INVARIANTS}


def sentence(name: str) -> str:
    """The first sentence of an invariant's docstring: what holds."""
    doc = " ".join((INVARIANTS[name].__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".") + "." if doc else ""


def judge_batch(
    v: View,
    batch: Batch,
    names: Iterable[str] | None = None,
    capacity: int | None = None,
) -> tuple[int, Violation] | None:
    """Apply a batch, judging each stream invariant (only those in ``names`` when given; the set
    view's only when named) before the event it is about. Returns (index of the event, or -1 for
    the batch itself, violation) at the first one that fails; the view is left as it was at that
    point."""
    chosen = None if names is None else set(names)
    found = None
    for name, batch_check in BATCH_INVARIANTS.items():
        if chosen is None or name in chosen:
            found = found or batch_check(v, batch)
    if found is not None:
        return -1, found
    begin_batch(v, batch)
    checks = [
        predicate
        for name, predicate in {**EVENT_INVARIANTS, **SET_VIEW_INVARIANTS}.items()
        if (name in chosen if chosen is not None else name in EVENT_INVARIANTS)
    ]
    for index, event in enumerate(batch.events):
        for predicate in checks:
            violation = predicate(v, event)
            if violation is not None:
                return index, violation
        apply_event(v, event)
        if capacity is not None and (chosen is None or "ViewWithinCapacity" in chosen):
            violation = view_within_capacity(v, capacity, getattr(event, "medium", "GPU"))
            if violation is not None:
                return index, violation
    return None
