"""SGLang 0.5.23's own KV-event publisher over loopback, its stream judged against its radix tree.

SGLang 0.5.23 has a publisher of its own (``sglang.srt.disaggregation.kv_events``:
``ZmqEventPublisher``, vLLM's wire format and replay protocol) fed by its tree's event recorder
(``BlockStored`` for new tree pages, ``BlockRemoved`` for evicted ones, ``AllBlocksCleared`` at a
reset): the Rust ``TreeCore``'s queue under ``UnifiedRadixCache`` (SGLang's default), a
``KVCacheEventRecorder`` (``sglang.srt.mem_cache.events``) under the Python ``TreeCore`` and the
legacy ``RadixCache``. The adapter builds its tree with the recorder on (``build.memory``:
``enable_kv_cache_events``) and calls ``attach`` here, which publishes what the recorder took
where SGLang's scheduler does, in either event loop (``loops.py``): at the end of processing a
batch's result (``report_prefill_stats`` / ``report_decode_stats`` call ``publish_kv_events``;
under overlap this also carries what forming the next batch inserted and evicted, since that ran
before the result was processed), and when fully idle (``on_idle``), i.e. after a cache flush.
One publisher (bound to 127.0.0.1, a port the system picks) and one subscriber per process serve
the fuzzer's engines in turn.

The engine's cache, as the stream names it: every page of the tree under the hash SGLang
publishes for it: for the legacy tree its recorder's own ``_node_event_hash_values``; for the
unified tree, whose Rust core exposes no nodes, SGLang's ``get_hash_str`` over the tokens of the
page's key up to its end (``record.UnifiedRecorder.tokens``), then ``hash_str_to_int64`` and
``namespaced_block_hash``. SGLang publishes no group index (None) and medium ``GPU``.

The hybrid sliding-window tree (``swa_factory``, ``swa_sync_factory``: FULL and SWA) publishes the
same events for its nodes' keys, and nothing for the SWA component: a request's window frees are
outside the tree, and an SWA value evicted from a node whose FULL value stays (a tombstone) sends no
``BlockRemoved``. So its cache as the stream names it is the tree's FULL pages alone, and whether
an announced page can serve a hit (SGLang cuts a hit back to the last boundary whose window the SWA
component holds) is not judged: the stream does not say (``docs/kv-events.md``, "Hybrid models").
``count_tombstones`` counts the boundaries where the view announced tombstoned pages.

The hybrid linear-attention tree (``mamba_factory``: FULL and MAMBA, ``mamba.py``) publishes the
same events for its nodes' keys too, and nothing for the MAMBA component: SGLang's ``TreeCore``
records a store when a node is made (or its FULL value restored) and a removal when a node's FULL
value goes; a state copied into a node (an insert over a node that had none), a state evicted from
an inner node whose FULL pages stay (``MambaComponent``'s tombstone), a state donated by a
finished request: none of these is an event, and a BlockStored carries no group (None) and medium
``GPU``, as for the other trees. So its cache as the stream names it is again the tree's FULL
pages alone. What a router cannot read from it: SGLang cuts a hit back to the deepest node that
holds a state (``no_buffer``: ``best_match_node``), so an announced page that no tree state's key
extends serves no hit at all. ``count_stateless`` counts the boundaries where the view announced
such pages (the states' keys read at each insert, ``note_states``).
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

from sglang.srt.disaggregation.kv_events import (
    KVEventBatch,
    ZmqEventPublisher,
    namespaced_block_hash,
)

from kvspec.conformance.kvevents.engine_stream import (
    TOTALS,
    Cache,
    EngineStream,
    chosen_invariants,
)
from kvspec.conformance.kvevents.watch import Loopback as SharedLoopback
from kvspec.judge.findings import Finding

from .build import core_backend, get_hash_str, hash_str_to_int64

TOPIC = "kvspec"


def enabled() -> bool:
    return os.environ.get("KVSPEC_SGLANG_KV_STREAM", "1") != "0"


class Loopback(SharedLoopback):
    """SGLang's ``ZmqEventPublisher`` and a subscriber on it, one pair per process."""

    def __init__(self) -> None:
        publisher = ZmqEventPublisher(
            0,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            topic=TOPIC,
            bind=True,
        )
        endpoint, replay = publisher._local_pub_endpoint, publisher._local_replay_endpoint
        super().__init__(publisher, endpoint, replay, TOPIC)

    def publish(self, events: list[Any]) -> int:  # type: ignore[override]
        return super().publish(KVEventBatch(ts=time.time(), events=events))


_loopback: Loopback | None = None


def loopback() -> Loopback:
    global _loopback
    if _loopback is None:
        _loopback = Loopback()
        atexit.register(_loopback.subscriber.close)
    return _loopback


class SglangKvStream:
    """One engine's stream: publish at SGLang's points, judge at each."""

    def __init__(self, adapter: Any) -> None:
        self.loop = loopback()
        scheduler = adapter.scheduler
        self.tree, self.page_size = scheduler.tree, scheduler.page_size
        self.record = scheduler.record
        self.swa = bool(scheduler.hybrid_swa)
        self.mamba = adapter.tree == "mamba"
        self.state_keys: dict[int, tuple[int, ...]] = {}
        """MAMBA: per tree state (global id), the tokens of the key it sits at the end of."""
        if self.mamba:
            self.note_states()
        self.first_seq = self.loop.published
        self.engine = EngineStream(self.first_seq, "GPU", chosen_invariants())
        process, reset = scheduler.process_batch_result, adapter.reset_prefix_cache

        def process_batch_result_(batch: Any, step: int) -> None:
            process(batch, step)
            self.publish()

        def reset_prefix_cache_() -> bool:
            done = bool(reset())
            if done:  # the engine is fully idle: SGLang's on_idle publishes
                self.publish()
            return done

        scheduler.process_batch_result = process_batch_result_
        adapter.reset_prefix_cache = reset_prefix_cache_

    def publish(self) -> None:
        """``SchedulerKvEventsPublisher.publish_kv_events``, then the step boundary."""
        events = self.tree.take_events()
        frames = self.loop.receive(self.loop.publish(events)) if events else []
        self.engine.at_boundary(frames, self.cache())
        if self.swa:
            self.count_tombstones()
        if self.mamba:
            self.count_stateless()

    def count_tombstones(self) -> None:
        """Coverage of a hybrid SWA tree's stream: the boundaries where the view announced a
        page whose SWA value SGLang had evicted (a tombstone: its FULL page stays in the tree
        and in the stream, which names no SWA component)."""
        record = self.record
        tombstoned = set(record._walk(False)) - set(record._walk_swa(False))
        if tombstoned:
            TOTALS["boundaries announcing SWA-tombstoned pages"] += 1
            TOTALS["SWA-tombstoned pages announced at a boundary"] += len(tombstoned)

    def note_states(self) -> None:
        """Wrap the tree's ``insert``: the key each state it took sits at the end of."""
        tree, record = self.tree, self.record
        insert = tree.insert

        def insert_(params: Any) -> Any:
            before = record.states()
            result = insert(params)
            tokens = tuple(int(t) for t in params.key.raw_token_ids())
            for block in record.states() - before:
                self.state_keys[block] = tokens
            return result

        tree.insert = insert_

    def count_stateless(self) -> None:
        """Coverage of a hybrid SSM tree's stream: the boundaries where the view announced a
        page that no tree state's key extends (a hit through it is cut back before it, so it
        serves none), and how many such pages."""
        record, page = self.record, self.page_size
        servable: set[tuple[int, ...]] = set()
        for block in record.states():
            key = self.state_keys.get(block, ())
            servable.update(key[:end] for end in range(page, len(key) + 1, page))
        stateless = [b for b in record._walk(False) if record.tokens[b] not in servable]
        if stateless:
            TOTALS["boundaries announcing pages no state extends"] += 1
            TOTALS["pages no state extends announced at a boundary"] += len(stateless)

    def cache(self) -> Cache:
        """Every tree page under the name SGLang's recorder publishes for it."""
        if core_backend(self.tree) == "legacy":
            return self._legacy_cache()
        record, page = self.record, self.page_size
        out: dict[tuple[int | None, Any], tuple[int, ...]] = {}
        for block in record._walk(False):  # FULL pages only: no SWA page is named
            tokens = list(record.tokens[block])
            value = get_hash_str(tokens, None, page_size=page)[-1]  # the page's chained hash
            name = (None, namespaced_block_hash(hash_str_to_int64(value), namespace_seed=None))
            out[name] = out.get(name, ()) + (block,)
        return out

    def _legacy_cache(self) -> Cache:
        """``RadixCache``: its nodes' hashes, as its ``KVCacheEventRecorder`` computes them."""
        recorder, page = self.tree.kv_events, self.page_size
        out: dict[tuple[int | None, Any], tuple[int, ...]] = {}
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            stack += list(node.children.values())
            if node is self.tree.root_node or node.value is None:
                continue
            values = recorder._node_event_hash_values(node)
            seed = recorder._namespace_seed(node)
            pages = [int(s) // page for s in node.value[::page].tolist()]
            for value, block in zip(values, pages, strict=False):
                name = (None, namespaced_block_hash(hash_str_to_int64(value), namespace_seed=seed))
                out[name] = out.get(name, ()) + (block,)
        return out

    def check(self, judge: Any) -> Finding | None:
        return self.engine.check(judge)


def attach(adapter: Any) -> SglangKvStream | None:
    return SglangKvStream(adapter) if enabled() else None
