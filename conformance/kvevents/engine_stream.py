"""An engine's real KV-event stream judged while the fuzzer drives the engine.

An adapter that runs its engine's own publisher (``adapters/vllm_adapter/kv_stream.py``,
``adapters/sglang_adapter/kv_stream.py``) hands this module what a router would receive and what the
engine really holds:

* ``EngineStream.at_boundary(frames, cache)`` right after the engine published (its step
  boundary): the frames the subscriber received since, in order, and the engine's cache as
  ``{(group, hash): (block ids...)}``. The frames go through the stream's judge
  (``stream_judge.StreamJudge``), then ``ViewEqualsCache`` compares the view with the cache.
* ``EngineStream.check(judge)`` from the fuzzer after every rule (``fuzz.py`` calls an adapter's
  optional ``check_kv_stream(judge)``): the first violation found at a boundary, else
  ``AnnouncedHoldsPrefix`` over the blocks announced at the last boundary, judged on the fuzzer's
  spec state (``spec_state_of``), as a ``judge.findings.Finding`` named after the stream invariant.

The frames are kept (they are few per fuzzed example), also those after a violation, so that a
counterexample's whole stream can be written as a capture file (``write_capture``) and re-judged
with ``kvspec check --kv-events``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from kvspec.judge.findings import Finding
from kvspec.spec import State
from kvspec.spec.invariants import Violation
from kvspec.spec.pool import eventual_content, holds
from kvspec.spec.stream import Hash, Key

from .frames import Frame, FrameError, decode_batch, write_capture
from .known_findings import Known
from .stream_judge import StreamJudge

TOTALS: Counter[str] = Counter()
"""Over every ``EngineStream`` of the process: batches and stream events judged, boundaries."""

Cache = Mapping[tuple[int | None, Hash], tuple[int, ...]]
"""(group, hash) -> the engine's block ids cached under it."""


def chosen_invariants() -> list[str] | None:
    """``KVSPEC_KV_STREAM_INVARIANTS=A,B``: the stream invariants an adapter's stream judges
    (default: all but ``StoreNamesNewHash``)."""
    names = os.environ.get("KVSPEC_KV_STREAM_INVARIANTS")
    return None if not names else [n.strip() for n in names.split(",") if n.strip()]


def chosen_known(default: Collection[str] = ()) -> list[str]:
    """``KVSPEC_KV_STREAM_KNOWN=A,B``: the known findings (``known_findings.KNOWN``) an adapter's
    stream reads as the engine means them; ``KVSPEC_KV_STREAM_KNOWN=`` none; unset, the
    adapter's ``default``."""
    names = os.environ.get("KVSPEC_KV_STREAM_KNOWN")
    if names is None:
        return list(default)
    return [n.strip() for n in names.split(",") if n.strip()]


def spec_state_of(judge: Any) -> State:
    """The spec state of the fuzzer's judge (a ``judge.core.Judge`` over the spec's model keeps
    it in ``model.state``). The one place this module reads the judge."""
    return judge.model.state  # type: ignore[no-any-return]


def bad_blocks_in(state: State) -> Any:
    """``(prefix, ids) -> ids`` of the blocks that still carry ``prefix`` as their hash in the
    spec state and will never hold it (``spec.stream.announced_holds_prefix``)."""

    def bad(prefix: tuple[int, ...], ids: Iterable[int]) -> tuple[int, ...]:
        found = []
        for block in ids:
            if 0 <= block < len(state.blocks) and state.blocks[block].key == prefix:
                if not holds(eventual_content(state, block), prefix):
                    found.append(block)
        return tuple(found)

    return bad


class EngineStream:
    """One engine's stream and its judge, for the time of one fuzzed example."""

    def __init__(
        self,
        first_seq: int,
        medium: str | None = "GPU",
        invariants: Collection[str] | None = None,
        known: Collection[str] = (),
    ) -> None:
        self.first_seq = first_seq
        self.judge = StreamJudge(
            invariants, keep_prefixes=True, join=False, start=first_seq, known=known
        )
        self.medium = medium
        self.frames: list[Frame] = []
        self.blocks: dict[Key, tuple[int, ...]] = {}
        """The engine's block ids per announced key, at the last boundary."""
        self.violation: Violation | None = None

    def know(self, names: Collection[str]) -> None:
        """Before the first frame: read these known findings as the engine means them."""
        self.judge.known = Known(names)

    def at_boundary(self, frames: Iterable[tuple[int, bytes]], cache: Cache) -> None:
        frames = list(frames)  # every frame is kept for the capture, judged or not
        self.frames += [Frame("pub", seq, b"kvspec", payload) for seq, payload in frames]
        if self.violation is not None:
            return
        judge = self.judge
        TOTALS["boundaries"] += 1
        for seq, payload in frames:
            TOTALS["batches"] += 1
            try:
                batch = decode_batch(seq, payload)
            except FrameError as err:  # the engine's own publisher sent it: a finding
                self.violation = Violation("StoreConsistent", f"a malformed frame: {err}")
                return
            TOTALS["events"] += len(batch.events)
            met = sum(judge.known.seen.values())
            found = judge.feed(batch)
            TOTALS["known findings met"] += sum(judge.known.seen.values()) - met
            if found is not None:
                self.violation = judge.finding
                return
        counts = {key: len(ids) for key, ids in cache.items()}
        self.violation = judge.boundary(counts, self.medium)
        self.blocks = {(self.medium, g, h): ids for (g, h), ids in cache.items()}

    def check(self, fuzz_judge: Any) -> Finding | None:
        where = getattr(fuzz_judge, "events_seen", 0)
        if self.violation is None and self.judge.view is not None:
            state = spec_state_of(fuzz_judge)
            self.violation = self.judge.boundary(
                blocks_of=lambda key: self.blocks.get(key, ()), bad_blocks=bad_blocks_in(state)
            )
        if self.violation is None:
            return None
        violation = self.violation
        return Finding(violation.invariant, violation.sentence, where, violation.blocks)

    def write_capture(self, path: str | Path) -> int:
        """This engine's frames as a capture, numbered from 0 (the publisher served other
        engines before it). Only the stream invariants can be re-judged from it."""
        frames = [Frame(f.via, f.seq - self.first_seq, f.topic, f.payload) for f in self.frames]
        return write_capture(path, frames, "loopback", None)
