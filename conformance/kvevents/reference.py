"""The reference engine with a KV-event stream of vLLM's shape, judged like a real engine's.

``factory`` (``kvspec fuzz --target kvspec.conformance.kvevents.reference:factory``) is the reference
adapter (``adapter.ReferenceAdapter``) whose block pool also says what it does the way vLLM's
does: a ``BlockStored`` for every hash it registers (its chained sha256, the parent's hash, the
block's tokens), a ``BlockRemoved`` for every hash it drops (an eviction, a rollback), an
``AllBlocksCleared`` at a reset, queued as they happen and sent as one batch, in vLLM's wire form,
at the end of every ``update_from_output`` (vLLM's step boundary). The batches are judged in
process (``engine_stream.EngineStream``: no sockets) against the pool's index, and, after every rule,
``AnnouncedHoldsPrefix`` against the fuzzer's spec state. It is how the stream's engine
invariants are tested without a third-party engine: under ``eager-unsafe`` with the ``general``
discipline a zombie block outlives its step, and a router is told of it.

``fault`` plants a fault in what is sent (``drop-removal``: the first ``BlockRemoved`` is never
sent), for tests.
"""

from __future__ import annotations

import time
from typing import Any

from kvspec.judge.findings import Finding
from kvspec.reference.choices import Choices
from kvspec.spec import Config
from kvspec.spec.stream import Batch, Cleared, Removed, Stored, StreamEvent

from ..adapter import ReferenceAdapter
from .engine_stream import Cache, EngineStream
from .frames import encode_batch


class ReferenceStreamAdapter(ReferenceAdapter):
    def __init__(self, config: Config, choices: Choices, fault: str | None = None) -> None:
        super().__init__(config, choices)
        self.fault = fault
        self.queue: list[StreamEvent] = []
        self.seq = 0
        self.seen = 0
        self.hash_of: dict[int, bytes] = {}
        """The hash each block is registered under."""
        self.stream = EngineStream(0, "GPU")

    def step(self) -> bool:
        worked = super().step()
        committed = self._translate()
        if committed:  # the end of update_from_output: vLLM publishes here
            self.boundary()
        return worked

    def _translate(self) -> bool:
        """The pool's effects since the last call as stream events; True after a commit."""
        bsz, requests = self.config.block_size, self.engine.requests
        committed, resetting = False, False
        for event in self.events[self.seen :]:
            kind = event[0]
            if kind == "publish":
                _, rid, index, block = event
                req = requests[rid]  # type: ignore[index]
                hashes = req.block_hashes
                block_hash = hashes[index]  # type: ignore[index]
                parent = hashes[index - 1] if index else None  # type: ignore[operator, index]
                tokens = tuple(req.tokens[index * bsz : (index + 1) * bsz])  # type: ignore[operator]
                self.hash_of[block] = block_hash  # type: ignore[index]
                self.queue.append(Stored((block_hash,), parent, tokens, bsz, "GPU", 0))
            elif kind in ("evict", "unpublish"):
                block_hash = self.hash_of.pop(event[1], None)  # type: ignore[arg-type]
                if block_hash is None or resetting:
                    continue
                if self.fault == "drop-removal":
                    self.fault = None  # the first one is lost
                    continue
                self.queue.append(Removed((block_hash,), "GPU", 0))
            elif kind == "reset":
                resetting = True
                self.queue.append(Cleared())
            elif kind == "commit":
                committed = True
            if kind not in ("unpublish", "reset"):
                resetting = False
        self.seen = len(self.events)
        return committed

    def boundary(self) -> None:
        frames = []
        if self.queue:
            batch = Batch(self.seq, tuple(self.queue), time.time(), 0)
            frames.append((self.seq, encode_batch(batch)))
            self.seq += 1
            self.queue = []
        self.stream.at_boundary(frames, self.cache())

    def cache(self) -> Cache:
        pool = self.engine.pool
        return {(0, block_hash): tuple(owners) for block_hash, owners in pool.index.items()}

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:  # idle: no step follows to publish it (vLLM would, at its next step)
            self._translate()
            self.boundary()
        return done

    def check_kv_stream(self, judge: Any) -> Finding | None:
        return self.stream.check(judge)


def factory(config: Config, choices: Choices) -> ReferenceStreamAdapter:
    """``kvspec fuzz --target kvspec.conformance.kvevents.reference:factory``."""
    return ReferenceStreamAdapter(config, choices)


def dropping_factory(config: Config, choices: Choices) -> ReferenceStreamAdapter:
    """The same, with the first ``BlockRemoved`` lost (a planted fault)."""
    return ReferenceStreamAdapter(config, choices, fault="drop-removal")
