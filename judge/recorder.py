"""What a report needs of a stream: for each block and each live request, a bounded ring of the
last events that touched it, so a finding comes with its *minimal history* (only the earlier
events that touched the blocks and requests involved), in bounded memory.

An executed step is one record per block it touches (``step-io``), expanded into its writes and
reads of that block for a report (``step_accesses``). A finished request's ring is kept among the
last ``retired`` ones after the judge's model forgets the request.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from kvspec.spec.events import blocks_of, request_of, requests_of

if TYPE_CHECKING:
    from .core import Model

Event = tuple[object, ...]
Ring = deque[tuple[int, Event]]


class Recorder:
    def __init__(
        self, num_blocks: int, history: int = 50, retired: int = 256, live: Iterable[int] = ()
    ) -> None:
        """``live``: requests already alive when recording starts (a judge forked mid-stream).
        Their rings are made when an event first names them, so that a fork costs nothing per
        request that is only waiting."""
        self.history = history
        self.retired_requests = retired
        self.block_rings: list[Ring] = [deque(maxlen=history) for _ in range(num_blocks)]
        self.request_rings: dict[int, Ring] = {}
        self.unringed: set[int] = set(live)
        """Requests alive at the fork that no event has named since (no ring yet)."""
        self.retired: OrderedDict[int, Ring] = OrderedDict()

    def _ring(self, rid: int) -> Ring | None:
        """The request's ring, made on its first event if it was alive at the fork."""
        ring = self.request_rings.get(rid)
        if ring is None and rid in self.unringed:
            self.unringed.discard(rid)
            ring = self.request_rings[rid] = deque(maxlen=self.history)
        return ring

    def decision(self, line: int, event: Event, model: Model) -> None:
        kind = event[0]
        if kind == "arrive":
            self.request_rings.setdefault(event[1], deque(maxlen=self.history))  # type: ignore[arg-type]
        elif kind == "execute":
            self._step_io(line, model)
        for rid in requests_of(event):
            ring = self._ring(rid)
            if ring is not None:
                ring.append((line, event))

    def effect(self, line: int, event: Event) -> None:
        for block in blocks_of(event):
            self.block_rings[block].append((line, event))
        rid = request_of(event)
        if rid is not None:
            ring = self._ring(rid)
            if ring is not None:
                ring.append((line, event))

    def pruned(self, rid: int) -> None:
        self.unringed.discard(rid)
        ring = self.request_rings.pop(rid, None)
        if ring is not None:
            self.retired[rid] = ring
            if len(self.retired) > self.retired_requests:
                self.retired.popitem(last=False)

    def _step_io(self, line: int, model: Model) -> None:
        """The oldest submitted step is about to execute: one record of its writes and reads goes
        to the ring of every block it touches."""
        state = model.export()
        step = next((st for st in state.steps if st.phase == "submitted"), None)
        if step is None:
            return
        bsz = state.config.block_size
        accesses = tuple((rid, e.start // bsz, e.blocks) for rid, e in step.entries.items())
        record = (line, ("step-io", step.id, accesses))
        for block in {block for _, _, blocks in accesses for block in blocks}:
            self.block_rings[block].append(record)

    def minimal_history(
        self, blocks: Iterable[int], requests: Iterable[int], last: tuple[int, Event] | None
    ) -> list[tuple[int, Event]]:
        """The remembered events that touched these blocks and requests (and ``last``, the
        violating event), in file order."""
        seen: dict[tuple[int, str], tuple[int, Event]] = {}
        rings: list[Iterable[tuple[int, Event]]] = [
            step_accesses(self.block_rings[b], b) for b in sorted(blocks)
        ]
        for rid in sorted(requests):
            ring = self.request_rings.get(rid) or self.retired.get(rid)
            if ring is not None:
                rings.append(ring)
        for ring in rings:
            for line, event in ring:
                seen.setdefault((line, repr(event)), (line, event))
        if last is not None:
            seen.setdefault((last[0], repr(last[1])), last)
        return sorted(seen.values(), key=lambda item: item[0])


def step_accesses(ring: Iterable[tuple[int, Event]], block: int) -> Iterator[tuple[int, Event]]:
    """A block's ring with each step's record expanded into that step's writes and reads of the
    block: ``("wrote" | "read", request, block, step)``."""
    for line, event in ring:
        if event[0] != "step-io":
            yield line, event
            continue
        _, step, accesses = event
        for rid, first, blocks in accesses:  # type: ignore[attr-defined]
            for i, b in enumerate(blocks):
                if b == block:
                    yield line, ("wrote" if i >= first else "read", rid, block, step)
