"""The worker protocol, and the fake worker: runs a submitted step and samples tokens; no model,
no K/V bytes.

``execute`` decides which external loads fail (``choices.pick(2, "load-fails")`` per load
entry, in scheduling order) and, when recording, logs each step's entries for replay (one
record per entry, O(1)); ``StepLog.writes``/``reads`` expand them into the token slots
``[lo, hi)`` of each block written (from the entry's first new token) and read (every block up
to its last token; loads read nothing). ``sample`` is a deterministic function of
the request's whole token sequence: ``crc32(tokens as int64 LE) % vocab``.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import NamedTuple, Protocol

from .block_pool import Block
from .choices import Choices
from .hashing import pack_token
from .memory import GroupMemory
from .request import Request, Step


class Access(NamedTuple):
    """One request's access to one block: token positions ``[lo, hi)`` of the request."""

    rid: int
    block: int
    lo: int
    hi: int
    load: bool
    """Written by an external KV load rather than by the model."""
    live: bool
    """The request's result is still wanted (it was not preempted or aborted since)."""


class EntryLog(NamedTuple):
    """A request's part in an executed step; ``table[:num_blocks]`` are the blocks it used (the
    request's table object at scheduling time: append-only, so this is cheap and exact)."""

    rid: int
    table: list[Block]
    num_blocks: int
    start: int
    end: int
    load: bool
    live: bool

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(b.block_id for b in self.table[: self.num_blocks])


class StepLog(NamedTuple):
    step: int
    entries: list[EntryLog]
    failed: tuple[int, ...]
    """Requests whose load failed: their writes did not happen."""

    def writes(self, block_size: int) -> list[Access]:
        """Every block slot range written, from each entry's first new token."""
        out = []
        for e in self.entries:
            for i, block in enumerate(e.blocks):
                lo, hi = i * block_size, min(e.end, (i + 1) * block_size)
                if hi > e.start:
                    out.append(Access(e.rid, block, max(lo, e.start), hi, e.load, e.live))
        return out

    def reads(self, block_size: int) -> list[Access]:
        """Every block slot range read by the model: each computing entry's whole prefix."""
        out = []
        for e in self.entries:
            if not e.load:
                for i, block in enumerate(e.blocks):
                    lo, hi = i * block_size, min(e.end, (i + 1) * block_size)
                    out.append(Access(e.rid, block, lo, hi, False, e.live))
        return out


class Worker(Protocol):
    """What the engine needs from a worker. ``execute`` runs a submitted step, every entry of it,
    live or not (a device runs what was submitted; only the results of live entries are used),
    and returns the requests whose external load failed. ``sample`` is then asked, for each live
    entry of that step that samples, the token it produced; it is called in scheduling order,
    right after ``execute`` of the same step."""

    def execute(self, step: Step, requests: Mapping[int, Request]) -> tuple[int, ...]: ...

    def sample(self, step: Step, req: Request) -> int: ...


class FakeWorker:
    __slots__ = ("choices", "block_size", "vocab", "log", "memory")

    def __init__(self, choices: Choices, block_size: int, vocab: int, record: bool) -> None:
        self.choices = choices
        self.block_size = block_size
        self.vocab = vocab
        self.log: list[StepLog] | None = [] if record else None
        self.memory: GroupMemory | None = None
        """Several KV-cache groups: the fake device memory that checks each step's reads."""

    def execute(self, step: Step, requests: Mapping[int, Request]) -> tuple[int, ...]:
        """Run the step; return the requests whose external load failed."""
        failed = tuple(
            rid
            for rid, entry in step.entries.items()
            if entry.load and self.choices.pick(2, "load-fails") == 1
        )
        step.failed = failed
        if self.memory is not None:
            self.memory.execute(step, requests)
        if self.log is not None:
            live = step.live
            entries = [
                EntryLog(rid, e.table, e.num_blocks, e.start, e.end, e.load, rid in live)
                for rid, e in step.entries.items()
            ]
            self.log.append(StepLog(step.step_id, entries, failed))
        return failed

    def sample(self, step: Step, req: Request) -> int:
        return req.crc % self.vocab

    def sample_after(self, req: Request, first: int, more: int) -> list[int]:
        """``first`` and the ``more`` tokens the model samples after it (accepted draft tokens
        equal them), each the fake model's sample of the tokens so far."""
        tokens, crc = [first], req.crc
        for _ in range(more):
            crc = zlib.crc32(pack_token(tokens[-1]), crc)
            tokens.append(crc % self.vocab)
        return tokens
