"""Known engine findings in a KV-event stream, read as the engine means them when a judge is told
to (``kvspec check --kv-events --known NAME``, ``StreamJudge(known=...)``), so that one finding
already reported does not stop the judging of everything else in the stream.

A known finding is never silenced: each event of it is counted and the report names it
(``Known.notes``), and an event that cannot be read soundly is left as it is, for the stream's
invariants to report. Without the name the finding is a violation, as before.

``vllm-mamba-store-tokens`` (``docs/findings/README.md``, "vLLM: a Mamba group's ``BlockStored``
has more tokens than hashes"): in a Mamba ``align`` group vLLM's ``BlockStored`` lists the hashes
of the blocks it keeps but the tokens of every block of the range, the null blocks it skipped
included, with no offsets. vLLM computes one hash per block of the request
(``request.block_hashes``) for every group whose block size is the hash block size, and caches
the full-attention group first in the same call (``KVCacheCoordinator.cache_blocks``), so each
kept hash is announced in a full-attention group with its tokens and parent. Such a store is
read as one dense store per hash: the tokens and parent the full-attention group announced under
that hash, where those tokens are chunks of the store's span in the hashes' order, and a block
placed right after the last one placed (or at the span's start) names that one (or the store's
parent) as its parent. A store where some hash has no such place, or no full-attention group
announced it, is left as vLLM sent it (``StoreConsistent`` reports it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TypeGuard

from kvspec.spec.stream import CHAINED_KINDS, Batch, Hash, Stored, StreamEvent, View, chain

MAMBA_STORE_TOKENS = "vllm-mamba-store-tokens"
KNOWN = {
    MAMBA_STORE_TOKENS: (
        "vLLM's Mamba align-group BlockStored lists more tokens than hashes "
        "(docs/findings/README.md): each hash is read as the full-attention group's block"
    ),
}
"""Every known finding a judge can be told of, with what it reads."""
STATE_KINDS = ("mamba",)
"""vLLM's ``kv_cache_spec_kind`` of a Mamba state group."""


class Known:
    """The known findings a judge reads (``names``), and how often each was met."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.names = set(names)
        unknown = self.names - set(KNOWN)
        if unknown:
            raise ValueError(f"unknown known finding(s) {sorted(unknown)}: one of {sorted(KNOWN)}")
        self.seen: Counter[str] = Counter()
        self.first: dict[str, int] = {}
        """The batch where each was first met."""
        self.kinds: dict[int | None, str | None] = {}
        """The kind each group's stores said."""

    def read(self, view: View, batch: Batch) -> Batch:
        """The batch as the judge reads it: each event of a known finding rewritten as the
        engine means it."""
        for event in batch.events:
            if isinstance(event, Stored):
                self.kinds.setdefault(event.group, event.kind)
        if MAMBA_STORE_TOKENS not in self.names or not any(map(sparse, batch.events)):
            return batch
        events: list[StreamEvent] = []
        for event in batch.events:
            read = self._dense(view, events, event) if sparse(event) else None
            if read is None:
                events.append(event)
                continue
            self.seen[MAMBA_STORE_TOKENS] += 1
            self.first.setdefault(MAMBA_STORE_TOKENS, batch.seq)
            events += read
        return Batch(batch.seq, tuple(events), batch.ts, batch.rank)

    def _dense(
        self, view: View, before: list[StreamEvent], event: Stored
    ) -> list[StreamEvent] | None:
        """One dense store per hash of a sparse Mamba store, or None where it cannot be read."""
        size = event.block_size
        chunks = [event.tokens[i : i + size] for i in range(0, len(event.tokens), size)]
        announced = self._full_blocks(view, before, event.medium)
        out: list[StreamEvent] = []
        at, previous = -1, event.parent
        for i, block_hash in enumerate(event.hashes):
            block = announced.get(block_hash)
            if block is None:
                return None
            parent, tokens = block
            # the first chunk of the span after the last one placed that holds the block's
            # tokens, and whose place agrees with its parent: right after the last placed
            # block (or at the span's start) only if its parent is that block (the store's)
            at = next(
                (
                    j
                    for j in range(at + 1, len(chunks))
                    if chunks[j] == tokens and (j != at + 1 or parent == previous)
                ),
                -1,
            )
            if at < 0:
                return None
            extra = None if event.extra_keys is None else (event.extra_keys[i],)
            out.append(
                Stored(
                    (block_hash,),
                    parent,
                    tokens,
                    size,
                    event.medium,
                    event.group,
                    event.lora_name,
                    extra,
                    event.kind,
                )
            )
            previous = block_hash
        return out

    def _full_blocks(
        self, view: View, before: list[StreamEvent], medium: str | None
    ) -> dict[Hash, tuple[Hash | None, tuple[int, ...]]]:
        """hash -> (parent, tokens) of the blocks full-attention groups announced in ``medium``:
        the view's, then the stores earlier in this batch."""
        chained = {g for g, kind in self.kinds.items() if kind in CHAINED_KINDS}
        out = {
            h: (block.parent, block.tokens)
            for (m, g, h), block in view.blocks.items()
            if m == medium and g in chained
        }
        for event in before:
            if isinstance(event, Stored) and event.medium == medium and event.group in chained:
                out.update({h: (p, t) for h, p, t, _ in chain(event)})
        return out

    def notes(self) -> list[str]:
        return [
            f"known finding {name} met {count} times, first in batch {self.first[name]}: "
            f"{KNOWN[name]}"
            for name, count in sorted(self.seen.items())
        ]


def sparse(event: StreamEvent) -> TypeGuard[Stored]:
    """A Mamba group's store with more block-size chunks of tokens than hashes."""
    if not isinstance(event, Stored) or event.kind not in STATE_KINDS:
        return False
    size = event.block_size
    return (
        size >= 1 and len(event.tokens) % size == 0 and len(event.tokens) > len(event.hashes) * size
    )
