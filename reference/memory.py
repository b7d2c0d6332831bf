"""The fake device memory of several KV-cache groups: what each block holds, and every read of
the wrong thing, named by the invariant of docs/hybrid.md it breaks.

With one group the spec replays the worker's log and finds the bad reads itself. With several,
the fake worker keeps this memory (``FakeWorker`` with ``groups``) so that the engine's own run
says what a step read: a K/V slot holds the identity of the prefix up to its position, a state
block the identity of the prefix after which the recurrence was computed (its length and a crc
of its tokens). Each write is stamped with the block's generation (``Block.generation``, one
per allocation), so memory left by an earlier use of a recycled block reads as unwritten.

A step writes its K/V, then reads (as the spec's ``execute``: every K/V write of the batch,
then every read), each entry through the tables it was scheduled with (``Entry.tables``): K/V
slots before its first new token (a window group's only those inside the window of that token),
and the state block it starts from as it was before any write of the step (a recurrence starts
from its initial state: a state the same step writes, its own in place or another request's,
is not there yet; the spec's ``groups.read_states``). A slot group's one block is read and
written as a state block is, and the step's copies of whole states (``slots.SlotCopies``) run
before all of it. An entry that read the wrong thing wrote garbage. The names:

* ``NoReadOfRecycled``: the block read is the null block (nulled while the step was in flight)
  or was allocated again since the step was scheduled (its bytes may still be the right ones
  if no one wrote it since: then what the entry computes is right, though the read is named);
* ``NoUnwrittenStateRead``, ``NoUnwrittenRead``: nothing was written there in this use of the
  block (its writer never ran: preempted, aborted), or what was written is garbage;
* ``StateAtItsBoundary``: the state read was computed after another number of tokens.

A cross group (an encoder-decoder model's cross-attention) holds the request's encoder output:
block ``i`` the K/V of encoder tokens ``i * B_g ..``, identified as (request, ``i``). Only the
encoder pass of the entry that allocated them writes there (``Entry.encoded``, every block at
admission); every computing entry then reads the whole table (each decoder token attends to
every encoder token), after the step's writes, and a table of another size than the request's
encoder tokens need is named ``TableMatchesComputed``. An entry that read wrong bytes does not
spoil its cross blocks: the encoder's output does not depend on the decoder's reads.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from .block_pool import Block
from .config import GroupSpec
from .hashing import pack_token
from .request import RUNNING, Entry, Request, Step
from .slots import SlotCopies

Content = tuple[int, int]
"""(tokens, crc32 of those tokens): the prefix a K/V slot closes or a state follows."""


class BadRead(NamedTuple):
    """One read of the wrong thing by a live entry."""

    invariant: str
    step: int
    rid: int
    group: int
    block: int
    position: int
    """The K/V slot's token position, or the state's boundary."""


class GroupMemory:
    """Block contents per group kind; ``execute`` checks a step's reads, then does its writes."""

    __slots__ = ("groups", "blocks", "kv", "state", "cross", "prefixes", "bad_reads", "copies")

    def __init__(self, groups: Sequence[GroupSpec], blocks: Sequence[Block]) -> None:
        self.groups = tuple(groups)
        self.blocks = blocks
        self.kv: dict[tuple[int, int], tuple[int, Content | None]] = {}
        """(block, slot) -> (generation, content) of K/V groups."""
        self.state: dict[int, tuple[int, Content | None]] = {}
        """block -> (generation, content) of state groups."""
        self.cross: dict[int, tuple[int, tuple[int, int]]] = {}
        """block -> (generation, (request, position)) of cross groups: that request's encoder
        output of its cross table's position."""
        self.prefixes: dict[int, list[int]] = {}
        """Per request, the crc32 of its first n tokens at index n (kept as tokens grow)."""
        self.bad_reads: list[BadRead] = []
        self.copies: SlotCopies | None = None
        """Slot groups: the coordinator's copies of whole states, run first in their step."""

    def _slot_of(self, g: int, table: Sequence[tuple[int, int]], n: int) -> tuple[int, int]:
        """The (block, generation) of a state or slot group's table holding the state after
        ``n`` tokens: a state group's slot ``n`` falls in, a slot group's one block."""
        if self.groups[g].kind == "slot":
            return table[0]
        return table[-(-n // self.groups[g].block_size) - 1]

    def run_copies(self, step: Step) -> None:
        """The step's copies of whole states, in the order they were made: each target takes
        its source's bytes as they are now, stamped with the target's use the copy was made
        for."""
        if self.copies is None:
            return
        for copy in self.copies.take(step.step_id):
            held = self.state.get(copy.source.block_id)
            self.state[copy.target.block_id] = (copy.gen, None if held is None else held[1])

    def _content(self, req: Request, n: int) -> Content | None:
        """The identity of the request's first ``n`` tokens; None past its known tokens."""
        if n > len(req.tokens):
            return None
        crcs = self.prefixes.setdefault(req.rid, [0])
        tokens = req.tokens
        while len(crcs) <= n:
            crcs.append(zlib.crc32(pack_token(tokens[len(crcs) - 1]), crcs[-1]))
        return (n, crcs[n])

    def forget(self, rid: int) -> None:
        """A finished request's prefixes are not needed any more."""
        self.prefixes.pop(rid, None)

    def execute(self, step: Step, requests: Mapping[int, Request]) -> None:
        self.run_copies(step)
        plans = []
        for rid, entry in step.entries.items():
            if entry.load or entry.tables is None:
                continue
            req = requests[rid]
            kv_writes: list[tuple[int, int, int, Content | None]] = []
            state_writes: list[tuple[int, int, Content | None]] = []
            for g, pos in entry.encoded:  # the encoder pass (never spoiled)
                block, gen = entry.tables[g][pos]
                self.cross[block] = (gen, (rid, pos))
            for g, spec in enumerate(self.groups):
                table, size = entry.tables[g], spec.block_size
                if spec.kind == "cross":
                    continue
                if spec.kind in ("state", "slot"):
                    block, gen = self._slot_of(g, table, entry.end)
                    state_writes.append((block, gen, self._content(req, entry.end)))
                    continue
                for p in range(entry.start, entry.end):
                    block, gen = table[p // size]
                    kv_writes.append((block, p % size, gen, self._content(req, p + 1)))
            plans.append((req, entry, kv_writes, state_writes))
        before = {block: self.state.get(block) for p in plans for block, _, _ in p[3]}
        for _, _, kv_writes, state_writes in plans:
            for block, slot, gen, content in kv_writes:
                self.kv[(block, slot)] = (gen, content)
            for block, gen, content in state_writes:
                self.state[block] = (gen, content)
        wrong: dict[int, bool] = {}
        for req, entry, kv_writes, state_writes in plans:
            wrong[req.rid] = self._reads_bad(step, req, entry, before, req.rid in step.live)
            if wrong[req.rid]:
                for block, slot, gen, _ in kv_writes:  # computed from wrong inputs
                    self.kv[(block, slot)] = (gen, None)
                for block, gen, _ in state_writes:
                    self.state[block] = (gen, None)
        if self.copies is not None:  # extra_buffer's track writes land after the reads
            for w in self.copies.take_tracks(step.step_id):
                bad = wrong.get(w.rid, True)
                content = None if bad else self._content(requests[w.rid], w.t)
                self.state[w.block.block_id] = (w.gen, content)

    def _reads_bad(
        self,
        step: Step,
        req: Request,
        entry: Entry,
        before: dict[int, tuple[int, Content | None] | None],
        live: bool,
    ) -> bool:
        """Check the entry's reads (recorded when ``live``); True when what it read was wrong
        (a recycled block whose bytes are still the right ones is named, but reads right). A
        request no longer running (preempted, its stale output delivered: still live) holds no
        table a block could have left: as the spec's, only its wrong bytes are named (unwritten
        reads), a recycled block whose bytes are right is not."""
        start, wrong = entry.start, False
        scratch: list[BadRead] = []
        running = req.status == RUNNING

        def note(name: str, g: int, block: int, at: int, bytes_wrong: bool, unwritten: str) -> None:
            if name == "NoReadOfRecycled" and not running:
                if not bytes_wrong:
                    return
                name = unwritten
            scratch.append(BadRead(name, step.step_id, req.rid, g, block, at))

        assert entry.tables is not None
        for g, spec in enumerate(self.groups):
            table, size = entry.tables[g], spec.block_size
            if spec.kind == "cross":
                for fault, at, block, bytes_wrong in self._cross_faults(req, table, size):
                    wrong |= bytes_wrong
                    note(fault, g, block, at, bytes_wrong, "NoUnwrittenRead")
                continue
            if spec.kind in ("state", "slot"):
                if start:
                    block, gen = self._slot_of(g, table, start)
                    held = before[block] if block in before else self.state.get(block)
                    name, bytes_wrong = self._state_fault(req, block, gen, held, start)
                    wrong |= bytes_wrong
                    if name:
                        note(name, g, block, start, bytes_wrong, "NoUnwrittenStateRead")
                continue
            lo = 0 if spec.window is None else max(0, start - spec.window + 1)
            if spec.chunk is not None:  # a chunked group reads its first token's chunk
                lo = start - start % spec.chunk
            for p in range(lo, start):
                block, gen = table[p // size]
                name, bytes_wrong = self._kv_fault(req, block, gen, p, size)
                wrong |= bytes_wrong
                if name:
                    note(name, g, block, p, bytes_wrong, "NoUnwrittenRead")
        if live:
            self.bad_reads += scratch
        return wrong

    def _state_fault(
        self,
        req: Request,
        block: int,
        gen: int,
        held: tuple[int, Content | None] | None,
        start: int,
    ) -> tuple[str | None, bool]:
        """(the invariant the read breaks or None, whether the bytes read are wrong)."""
        expected = self._content(req, start)
        right = block != 0 and held is not None and held[1] is not None and held[1] == expected
        if block == 0 or self.blocks[block].generation != gen:
            return "NoReadOfRecycled", not right
        if held is None or held[0] != gen or held[1] is None:
            return "NoUnwrittenStateRead", True
        if held[1][0] != start:
            return "StateAtItsBoundary", True
        if not right:
            return "NoUnwrittenStateRead", True
        return None, False

    def _cross_faults(
        self, req: Request, table: tuple[tuple[int, int], ...], size: int
    ) -> list[tuple[str, int, int, bool]]:
        """(invariant, position, block, whether the bytes read are wrong) of each wrong read of
        a cross table, which is read whole: a table of another size than ``ceil(encoder / B_g)``
        (``TableMatchesComputed``, at its first missing or extra position), a block recycled
        under the step (its bytes may still be right), or one that does not hold the request's
        encoder output of its position (``NoUnwrittenRead``)."""
        out: list[tuple[str, int, int, bool]] = []
        count = -(-req.encoder // size)
        if len(table) != count:
            at = min(len(table), count)
            block = table[at][0] if at < len(table) else 0
            out.append(("TableMatchesComputed", at, block, True))
        for at, (block, gen) in enumerate(table):
            held = self.cross.get(block)
            right = block != 0 and held is not None and held[1] == (req.rid, at)
            if block == 0 or self.blocks[block].generation != gen:
                out.append(("NoReadOfRecycled", at, block, not right))
            elif held is None or held[0] != gen or not right:
                out.append(("NoUnwrittenRead", at, block, True))
        return out

    def _kv_fault(
        self, req: Request, block: int, gen: int, pos: int, size: int
    ) -> tuple[str | None, bool]:
        """(the invariant the read breaks or None, whether the bytes read are wrong)."""
        held = self.kv.get((block, pos % size))
        right = block != 0 and held is not None and held[1] == self._content(req, pos + 1)
        if block == 0 or self.blocks[block].generation != gen:
            return "NoReadOfRecycled", not right
        if held is None or held[0] != gen or not right:
            return "NoUnwrittenRead", True
        return None, False
