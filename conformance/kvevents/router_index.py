"""The reference router index: what a KV-aware router should know, built from the streams alone.

A router (llm-d's KV-cache indexer, Dynamo's KV router, LMCache, AIBrix) subscribes to every
engine's KV events and answers "which engine holds the longest prefix of these tokens". This is
the obviously-correct version of that index, meant to be diffed against: its state per engine is
the stream spec's ``View`` (``spec/stream.py``, updated by the spec's own actions, so it never
rejects an event: a removal of an unknown hash is ignored, as a tolerant router would), and a
lookup walks the announced chains block by block.

API::

    index = RouterIndex()
    index.apply(engine, batch)                 # engine: any hashable name, e.g. (endpoint, rank)
    index.lookup(engine, tokens)               # leading full blocks of `tokens` the engine holds
    index.best(tokens)                         # [(engine, blocks), ...], longest first
    index.snapshot(engine)                     # {(medium, group, hash): blocks}
    index.diff(engine, theirs)                 # what another index disagrees on

A lookup matches block ``i`` of ``tokens`` (``block_size`` tokens, learned from the stream's
stores) to an announced hash whose parent is the hash matched for block ``i - 1`` (the root for
block 0) and whose tokens, LoRA name and extra keys are the block's. Media: by default any medium
counts (a block offloaded to CPU is still a prefix the engine can load); ``medium=`` restricts it.
Groups: one group is looked up at a time (``group``, default the first announced); a hybrid
model's router must combine its groups by its own rule (``docs/kv-events.md``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvspec.spec import stream as spec
from kvspec.spec.stream import Batch, Cleared, Hash, Key, Stored, View

Child = tuple[Hash | None, tuple[int, ...], str | None, object]
"""(parent hash, the block's tokens, LoRA name, extra keys)."""


@dataclass(frozen=True)
class Diff:
    """Where another index's view of one engine differs from the reference's."""

    missing: tuple[Key, ...]
    """Announced, and absent from theirs."""
    extra: tuple[Key, ...]
    """In theirs, not announced (stale entries)."""
    miscounted: tuple[tuple[Key, int, int], ...]
    """(key, reference's count, theirs)."""

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra or self.miscounted)


class _Engine:
    def __init__(self) -> None:
        self.view = View(next_seq=None)
        self.block_size: int | None = None
        self.children: dict[tuple[str | None, int | None], dict[Child, set[Hash]]] = defaultdict(
            dict
        )
        self.child_of: dict[Key, Child] = {}
        self.groups: list[int | None] = []

    def apply(self, batch: Batch) -> None:
        spec.begin_batch(self.view, batch)
        for event in batch.events:
            spec.apply_event(self.view, event)
            if isinstance(event, Cleared):
                self.children.clear()
                self.child_of.clear()
            elif isinstance(event, Stored):
                self._stored(event)
            else:
                for block_hash in event.hashes:
                    self._update(event.medium, event.group, block_hash)

    def _stored(self, event: Stored) -> None:
        if self.block_size is None:
            self.block_size = event.block_size
        if event.group not in self.groups:
            self.groups.append(event.group)
        for block_hash, _, _, _ in spec.chain(event):
            self._update(event.medium, event.group, block_hash)

    def _update(self, medium: str | None, group: int | None, block_hash: Hash) -> None:
        """Make the children map agree with the view for one key."""
        key = (medium, group, block_hash)
        known = self.view.blocks.get(key)
        children = self.children[(medium, group)]
        if known is not None:
            child = (known.parent, known.tokens, known.lora_name, known.extra)
            children.setdefault(child, set()).add(block_hash)
            self.child_of[key] = child
            return
        child = self.child_of.pop(key, None)
        if child is not None:
            hashes = children[child]
            hashes.discard(block_hash)
            if not hashes:
                del children[child]

    def lookup(
        self,
        tokens: Sequence[int],
        lora_name: str | None,
        extra_keys: Sequence[object] | None,
        medium: str | None,
        group: int | None,
        any_medium: bool,
    ) -> int:
        size = self.block_size
        if size is None:
            return 0
        if group is None and self.groups:
            group = self.groups[0]
        media = [m for m, g in self.children if g == group and (any_medium or m == medium)]
        parents: set[Hash | None] = {None}
        matched = 0
        for i in range(len(tokens) // size):
            block = tuple(tokens[i * size : (i + 1) * size])
            extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
            found: set[Hash | None] = set()
            for m in media:
                children = self.children[(m, group)]
                for parent in parents:
                    found |= children.get((parent, block, lora_name, extra), set())
            if not found:
                break
            parents = found
            matched += 1
        return matched


class RouterIndex:
    """The reference index over any number of engines (module docstring)."""

    def __init__(self) -> None:
        self.engines: dict[Hashable, _Engine] = {}

    def apply(self, engine: Hashable, batch: Batch) -> None:
        """Apply one batch of an engine's stream, in order; nothing is judged or refused."""
        self.engines.setdefault(engine, _Engine()).apply(batch)

    def apply_all(self, engine: Hashable, batches: Iterable[Batch]) -> None:
        for batch in batches:
            self.apply(engine, batch)

    def lookup(
        self,
        engine: Hashable,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[object] | None = None,
        medium: str | None = None,
        group: int | None = None,
        any_medium: bool = True,
    ) -> int:
        """How many leading full blocks of ``tokens`` the engine announced (0 if unknown).
        ``extra_keys``: one entry per block, as the engine publishes them (None: none)."""
        state = self.engines.get(engine)
        if state is None:
            return 0
        return state.lookup(tokens, lora_name, extra_keys, medium, group, any_medium)

    def best(self, tokens: Sequence[int], **options: object) -> list[tuple[Hashable, int]]:
        """Every engine with its matched blocks, longest first (ties in insertion order)."""
        found = [(engine, self.lookup(engine, tokens, **options)) for engine in self.engines]  # type: ignore[arg-type]
        return sorted(found, key=lambda item: -item[1])

    def snapshot(self, engine: Hashable) -> dict[Key, int]:
        """(medium, group, hash) -> blocks announced."""
        state = self.engines.get(engine)
        return {} if state is None else {k: a.count for k, a in state.view.blocks.items()}

    def diff(self, engine: Hashable, theirs: Mapping[Key, int]) -> Diff:
        """Compare another index's view of one engine with the reference's. ``theirs`` maps keys
        to counts; a set-based index passes 1 for each key it holds."""
        mine = self.snapshot(engine)
        return Diff(
            tuple(k for k in mine if k not in theirs),
            tuple(k for k in theirs if k not in mine and theirs[k]),
            tuple((k, n, theirs[k]) for k, n in mine.items() if k in theirs and theirs[k] != n),
        )
