"""Several KV-cache groups over one shared pool (vLLM ``HybridKVCacheCoordinator`` and its
per-kind managers): ``GroupedKV`` stands where ``KVCacheManager`` stands when
``EngineConfig.grouped``, with the same methods, so the scheduler and the registration policies
are the ones a single group uses. docs/hybrid.md fixes what it does and emits.

* A request's table is one table per group (``Request.tables``; ``Request.table`` is group 0's).
  Tokens are chained in hash blocks (``EngineConfig.block_size``); a group's block of ``k`` hash
  blocks is registered under the hash of its last one, keyed by ``(hash, group)``. The policies
  speak hash-block indices: registering index ``i`` registers, in each group, the block that
  hash block ``i`` completes.
* The hit is the longest length, a multiple of every group's block size and short of the last
  known token, that every group accepts: full (every block before it cached), window (the blocks
  inside the window of the token after it cached, nulls before), state (a state registered at
  exactly that boundary). It is found as vLLM does, each group shortening a candidate until none
  does; that this is the largest length all accept is the spec's statement, checked in lockstep.
* A window group frees (and nulls) its blocks wholly before the window of a running request's
  next processed token when it is scheduled; a state group frees its states before the one the
  oldest step in flight starts from (vLLM's align mode retires them).
* A state group's table has one slot per block: the block a step's entry ends in holds the
  state after that entry; the slots in between stay null. A hit on a state registered while
  the current step is being scheduled waits for a later step (vLLM's
  ``cached_blocks_this_step``: a recurrence cannot start from a state its own batch computes).
* Registration: the policies register group 0 as a single group's table (hash-block indices:
  group 0 is at the hash block size, as the spec requires of several groups); groups 1 .. G - 1
  register what a step ending at ``end`` makes registrable (``group_pending``, from each
  group's own count of registered blocks): full and window blocks wholly inside the known
  tokens; a state block only when ``end`` is its boundary (the step writes the state there),
  or, for a state group that registers ``when-known`` (vLLM's ``align`` ``MambaManager``), every
  slot as full blocks, once the known tokens reach its boundary (a null slot registers nothing;
  the scheduler's aligned prefill chunks, ``Scheduler.clip``, keep each slot at its boundary).
* A cross group (never group 0) holds the request's encoder tokens (``Request.encoder``):
  ``ceil(E / B_g)`` blocks, allocated whole by the schedule that admits it (``grow_cross``; the
  positions go to the entry's encoder pass, ``Entry.encoded``), never hit (it accepts every
  length with no block) nor registered, freed with the other tables.
* A slot group (SGLang's MAMBA ``no_buffer``, ``slots.py``) holds one block per request, its
  slot, allocated at admission after group 0's blocks and rewritten in place by every step; a
  hit names one published state, takes no reference on it, and is copied into the fresh slot
  first thing in the admitting step (``slots.SlotCopies``). Nothing registers it but the
  engine's own snapshots (``slots.py``, under ``engine-registers``).
"""

from __future__ import annotations

from .block_pool import Block, BlockPool
from .config import GroupSpec
from .hashing import extend_hashes
from .kv_cache_manager import KVCacheManager
from .request import Request
from .slots import SlotCopies


class GroupHits(list[Block]):
    """A lookup's answer: group 0's hit blocks as the list, every group's in ``groups``, and the
    hit's length in tokens (``length``)."""

    __slots__ = ("length", "groups")

    def __init__(self, length: int, groups: list[list[Block]]) -> None:
        super().__init__(groups[0])
        self.length = length
        self.groups = groups


class GroupedTable(list[Block]):
    """A table popped for freeing (``pop_table``): all its blocks, and ``parts``, each group's
    non-null blocks in group order, freed group by group (vLLM frees manager by manager)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[list[Block]]) -> None:
        super().__init__(b for part in parts for b in part)
        self.parts = parts


class GroupedKV(KVCacheManager):
    """The coordinator: a ``KVCacheManager`` whose every method follows all the groups."""

    grouped = True

    __slots__ = (
        "groups",
        "align",
        "group_cached",
        "n_shortened",
        "states_this_step",
        "encoding",
        "copies",
        "slot_hits",
        "let_go",
        "tracks_per_request",
        "windows_let_go",
    )

    def __init__(
        self,
        pool: BlockPool,
        hash_block_size: int,
        groups: tuple[GroupSpec, ...],
        align: int,
        prefix_caching: bool = True,
    ) -> None:
        super().__init__(pool, hash_block_size, prefix_caching)
        self.groups = groups
        self.align = align
        self.n_shortened = 0
        """Lookups whose hit another group shortened below what group 0 alone would serve."""
        self.states_this_step: set[Block] = set()
        """State blocks registered while the step being built is scheduled: a hit ending on
        one waits for a later step (vLLM's ``MambaManager.cached_blocks_this_step``: a
        recurrence cannot start from a state the same batch computes)."""
        self.group_cached: dict[int, list[int]] = {}
        """Per request, each group's (1 .. G - 1) leading blocks registered or tracked."""
        self.encoding: dict[int, tuple[tuple[int, int], ...]] = {}
        """Per request, the cross groups' (group, position) its last ``grow`` allocated: what
        the encoder pass of the entry being scheduled writes (``Entry.encoded``)."""
        self.copies = SlotCopies()
        """Slot groups: the copies of whole states the device runs first in a step."""
        self.slot_hits: dict[tuple[int, int], Block] = {}
        """(request, slot group) -> the published state its admission hit, copied into its
        fresh slot when ``grow`` allocates it (in the same decision)."""
        self.tracks_per_request = 0
        """Track slots a request holds in each slot group beside its working slot (2 under
        ``extra_buffer``, allocated by the engine's own registration right after admission)."""
        self.windows_let_go = False
        """Whether the engine gives up window groups' skipped blocks on its own, at each
        step's begin (``let_go_windows``), instead of freeing them at schedule: an engine that
        registers on its own (``engine-registers``), as SGLang's SWA component does (the spec's
        ``groups.engine_lets_go``)."""
        self.let_go: dict[int, dict[int, Block]] = {}
        """Per request that gave up its tables, its slot of each slot group (for a donation,
        ``own_registration.py``; taken by the policy's ``on_finish``)."""

    # -- tables ------------------------------------------------------------------------------

    def tables(self, req: Request) -> list[list[Block]]:
        """The request's tables, group 0's being ``req.table``."""
        tables = req.tables
        if len(tables) != len(self.groups) or tables[0] is not req.table:
            tables = req.tables = [req.table] + [[] for _ in self.groups[1:]]
        return tables

    def snapshot(self, req: Request) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Every group's table as (block id, generation) pairs, as a step scheduled now reads
        and writes them (``worker.GroupMemory`` tells a recycled block by its generation)."""
        return tuple(tuple((b.block_id, b.generation) for b in t) for t in self.tables(req))

    def block_hash(self, req: Request, index: int) -> bytes:
        """The chained hash of the request's full hash block ``index``."""
        hashes = req.block_hashes
        if index >= len(hashes):
            extend_hashes(hashes, req.tokens, self.block_size, index + 1)
        return hashes[index]

    def _key(self, hashes: list[bytes], group: int, slot: int) -> bytes:
        """The index key of the group's block ``slot``: its last hash block's hash and the group."""
        k = self.groups[group].block_size // self.block_size
        return hashes[(slot + 1) * k - 1] + group.to_bytes(2, "little")

    # -- the hit -----------------------------------------------------------------------------

    def lookup(self, req: Request) -> GroupHits:
        """The longest hit every group serves, and each group's blocks for it."""
        n = len(self.groups)
        if not self.prefix_caching:
            return GroupHits(0, [[] for _ in range(n)])
        cap = (len(req.tokens) - 1) // self.align * self.align
        hashes = req.block_hashes
        need = (len(req.tokens) - 1) // self.block_size
        if len(hashes) < need:
            extend_hashes(hashes, req.tokens, self.block_size, need)
        length = first = self._accepts(hashes, 0, cap)
        shortened = True
        while shortened:  # vLLM's iteration: until no group shortens the candidate
            shortened = False
            for g in range(n):
                accepted = self._accepts(hashes, g, length)
                if accepted < length:
                    length, shortened = accepted, True
        self.n_shortened += length < first
        return GroupHits(length, [self._hit_blocks(hashes, g, length) for g in range(n)])

    def _cached(self, hashes: list[bytes], g: int, slot: int) -> Block | None:
        owners = self.pool.index.get(self._key(hashes, g, slot))
        return next(iter(owners.values())) if owners else None

    def _needed(self, g: int, length: int) -> range:
        """The group's slots a hit of ``length`` tokens must find cached."""
        spec = self.groups[g]
        size = spec.block_size
        if spec.kind == "full":
            return range(length // size)
        if spec.kind in ("window", "chunked"):  # a chunk's hit: its end's chunk, from its start
            return range(self._skipped(g, length), length // size)
        if spec.kind == "cross":  # nothing cached: any length, no block
            return range(0)
        return range(length // size - 1, length // size) if length else range(0)  # state, slot

    def _accepts(self, hashes: list[bytes], g: int, length: int) -> int:
        """The largest length ``<= length`` (a multiple of ``align``) the group accepts."""
        if self.groups[g].kind == "full":
            size, i = self.groups[g].block_size, 0
            while (i + 1) * size <= length and self._cached(hashes, g, i) is not None:
                i += 1
            return i * size // self.align * self.align
        while length > 0:
            if all(self._cached(hashes, g, s) is not None for s in self._needed(g, length)):
                return length
            length -= self.align
        return 0

    def _hit_blocks(self, hashes: list[bytes], g: int, length: int) -> list[Block]:
        null = self.pool.blocks[0]
        if self.groups[g].kind == "cross":  # a cross group hits nothing
            return []
        if self.groups[g].kind == "slot":  # the one state the hit copies
            found = self._cached(hashes, g, length // self.groups[g].block_size - 1)
            return [found] if length and found is not None else []
        out = [null] * (length // self.groups[g].block_size)
        for slot in self._needed(g, length):
            block = self._cached(hashes, g, slot)
            assert block is not None
            out[slot] = block
        return out

    def new_step(self) -> None:
        self.states_this_step.clear()
        self.copies.begin()

    def hit_length(self, hits: list[Block]) -> int:
        """The hit's length in tokens."""
        assert isinstance(hits, GroupHits)
        return hits.length

    # -- admission and growth ----------------------------------------------------------------

    def _skipped(self, g: int, processed: int) -> int:
        """A window group's leading slots wholly before the window of the token after
        ``processed`` tokens; a state group's slots before the state ``processed`` ends in."""
        spec = self.groups[g]
        if spec.kind == "window":
            assert spec.window is not None
            return max(0, processed - spec.window + 1) // spec.block_size
        if spec.kind == "chunked":  # the whole chunks before the next token's
            assert spec.chunk is not None
            return (processed - processed % spec.chunk) // spec.block_size
        if spec.kind == "state":
            return max(0, -(-processed // spec.block_size) - 1)
        return 0

    def _new_blocks(self, g: int, table: list[Block], end: int, encoder: int = 0) -> int:
        """Blocks the group allocates for its table to cover ``end`` tokens (a cross group: the
        request's ``encoder`` tokens, whatever ``end``)."""
        size = self.groups[g].block_size
        if self.groups[g].kind == "cross":
            return max(0, -(-encoder // size) - len(table))
        if self.groups[g].kind == "slot":  # its slot (and track slots), allocated at admission
            return 0 if table else 1 + self.tracks_per_request
        if self.groups[g].kind != "state":
            return max(0, -(-end // size) - len(table))
        slot = -(-end // size) - 1
        return int(slot >= 0 and (slot >= len(table) or table[slot].block_id == 0))

    def blocks_short(self, req: Request, end: int, hits: list[Block] | None = None) -> bool:
        """Admission (``hits``, about to be touched) or growth without frees: True when covering
        ``end`` tokens needs more blocks than are free."""
        if hits is not None:
            assert isinstance(hits, GroupHits)
            tables = [[] if self.groups[g].kind == "slot" else p for g, p in enumerate(hits.groups)]
            pinned = sum(  # a slot group's hit state is kept out of the admission's allocations
                1 for g, p in enumerate(hits.groups) if self.groups[g].kind == "slot" and p
            )
            for g, part in enumerate(tables):
                if self.groups[g].kind == "state" and part and part[-1] in self.states_this_step:
                    return True  # vLLM: num_gpu_blocks + 1, "not enough blocks" this step
            free = self.pool.free_queue.num_free - pinned
            for part in tables:
                free -= sum(1 for b in part if b.ref_cnt == 0 and b.block_id != 0)
        else:
            tables = self.tables(req)
            free = self.pool.free_queue.num_free
        need = sum(self._new_blocks(g, t, end, req.encoder) for g, t in enumerate(tables))
        return need > free

    def blocks_short_running(self, req: Request, end: int, processed: int) -> bool:  # noqa: D102
        """A running request cannot cover ``end`` tokens even with the blocks its window and
        state groups would free first."""
        tables = self.tables(req)
        free = self.pool.free_queue.num_free + self.skippable(req, processed)
        return sum(self._new_blocks(g, t, end, req.encoder) for g, t in enumerate(tables)) > free

    def admit(self, req: Request, hits: list[Block]) -> None:
        """Touch each group's hit blocks (not the nulls) and make them its table's start; one
        ``hit`` event per group, in group order (group 0's without the group field, as every
        event of group 0: the canonical form of docs/hybrid.md)."""
        assert isinstance(hits, GroupHits)
        tables, pool, events = self.tables(req), self.pool, self.pool.events
        self.let_go.pop(req.rid, None)  # (a preempted request's slots, not donated)
        for g, part in enumerate(hits.groups):
            if self.groups[g].kind == "slot":  # copied into the fresh slot, not touched
                if part:
                    self.slot_hits[(req.rid, g)] = part[0]
                    if part[0].ref_cnt == 0:  # out of the free queue until the slot is allocated
                        pool.free_queue.remove(part[0])
            else:
                pool.touch([b for b in part if b.block_id != 0])
                tables[g].extend(part)
            if events is not None:
                hit = ("hit", req.rid, tuple(b.block_id for b in part))
                events.append((*hit, g) if g else hit)  # group 0's field is left out
        req.cached = hits.length // self.block_size
        self.group_cached[req.rid] = [len(part) for part in hits.groups[1:]]

    def grow(self, req: Request, end: int) -> None:
        """Each group in order allocates what covering ``end`` tokens needs: full and window
        groups every block up to it, a state group the slot ``end`` falls in (nulls before)."""
        pool, rid, null = self.pool, req.rid, self.pool.blocks[0]
        encoded: list[tuple[int, int]] = []
        for g, table in enumerate(self.tables(req)):
            spec = self.groups[g]
            size = spec.block_size
            if spec.kind == "cross":
                encoded += self.grow_cross(req, g, table)
                continue
            if spec.kind == "slot":
                if not table:
                    self._slot(req, g, table)
                continue
            if spec.kind != "state":
                while len(table) * size < end:
                    table.append(pool.allocate(rid, g or None))
                continue
            slot = -(-end // size) - 1
            if slot < 0:
                continue
            while len(table) < slot:
                table.append(null)
            if len(table) == slot:
                table.append(pool.allocate(rid, g or None))
            elif table[slot].block_id == 0:
                table[slot] = pool.allocate(rid, g or None)
        self.encoding[rid] = tuple(encoded)

    def grow_cross(self, req: Request, g: int, table: list[Block]) -> list[tuple[int, int]]:
        """A cross group's table is allocated whole, ``ceil(encoder / B_g)`` blocks, by the
        schedule that admits the request (a running request's is whole already: none); the
        (group, position) allocated, which that step's encoder pass writes."""
        first, count = len(table), -(-req.encoder // self.groups[g].block_size)
        while len(table) < count:
            table.append(self.pool.allocate(req.rid, g))
        return [(g, i) for i in range(first, len(table))]

    def _slot(self, req: Request, g: int, table: list[Block]) -> None:
        """The admission allocates the request's slot in slot group ``g``; a hit's state is
        copied into it first thing in the step being built."""
        slot = self.pool.allocate(req.rid, g)
        table.append(slot)
        source = self.slot_hits.pop((req.rid, g), None)
        if source is not None:
            self.copies.make(self.copies.building, source, slot, req.rid)
            if source.ref_cnt == 0:  # back on the free queue (its tail: just used), still cached
                self.pool.free_queue.append(source)

    def withdraw_copies(self, step: int, req: Request) -> None:
        """The request left the building step ``step``: the copies into its slots made for it
        do not run (the spec withdraws the entry's pending writes, a copy among them)."""
        if self.copies.pending:
            self.copies.withdraw(step, req.rid, [b for t in self.tables(req) for b in t])

    def state_key(self, req: Request, g: int, end: int) -> bytes:
        """The key of slot group ``g``'s state after the request's first ``end`` tokens (a
        multiple of its block size)."""
        k = self.groups[g].block_size // self.block_size
        index = end // self.groups[g].block_size - 1
        return self._key(self._hashes(req, (index + 1) * k - 1), g, index)

    def snapshot_state(self, req: Request, g: int, end: int, source: Block | None) -> bool:
        """Cache the state after ``end`` tokens of slot group ``g`` (``snapshot`` event):
        ``source`` None, the request's finished slot itself (a donation: it must be free);
        else by copy of ``source`` into the free queue's head, the copy running in the step
        a copy made now runs in (``SlotCopies.now``). False when there is no free block."""
        key = self.state_key(req, g, end)
        index = end // self.groups[g].block_size - 1
        if source is None:
            block = self.let_go.get(req.rid, {}).get(g)
            if block is None or block.ref_cnt:
                return False
        else:
            found = self.pool.first_free()
            if found is None:
                return False
            block = found
        self.pool.cache_free(block, key)
        if source is not None:
            self.copies.make(self.copies.now, source, block, req.rid)
        if self.pool.events is not None:
            self.pool.events.append(("snapshot", req.rid, index, block.block_id, g))
        return True

    def alloc_track(self, req: Request, g: int) -> Block:
        """A track slot for the request in slot group ``g`` (the engine's own ``alloc``): into
        the first position a donation left empty, else at the table's end."""
        block = self.pool.allocate(req.rid, g)
        table = self.tables(req)[g]
        hole = next((i for i in range(1, len(table)) if table[i].block_id == 0), None)
        if hole is None:
            table.append(block)
        else:
            table[hole] = block
        return block

    def donate_track(self, req: Request, g: int, block: Block, t: int) -> None:
        """The request's track slot ``block`` holds its state after ``t`` tokens: published in
        place (``snapshot``), it leaves the table (the null block in its place), unreferenced,
        at the free queue's tail."""
        table = self.tables(req)[g]
        table[table.index(block)] = self.pool.blocks[0]
        block.ref_cnt -= 1
        assert block.ref_cnt == 0, block
        self.pool.free_queue.append(block)
        self.pool.cache_free(block, self.state_key(req, g, t))
        if self.pool.events is not None:
            index = t // self.groups[g].block_size - 1
            self.pool.events.append(("snapshot", req.rid, index, block.block_id, g))

    def _freed_at_schedule(self, g: int) -> bool:
        """Group ``g``'s skipped blocks are freed at schedule (``remove_skipped``): a window,
        chunked or state group's, unless the engine lets go of its windows itself."""
        kind = self.groups[g].kind
        if kind == "window" and g and self.windows_let_go:
            return False
        return kind in ("window", "chunked", "state")

    def skippable(self, req: Request, processed: int) -> int:
        """Blocks ``remove_skipped`` would put back on the free queue now."""
        count = 0
        for g, table in enumerate(self.tables(req)):
            if not self._freed_at_schedule(g):
                continue
            last = min(self._skipped(g, processed), len(table))
            count += sum(1 for b in table[:last] if b.block_id != 0 and b.ref_cnt == 1)
        return count

    def remove_skipped(self, req: Request, processed: int) -> None:
        """Each group in order frees (last first, as one batch) and nulls the slots no step in
        flight reads any more: a window group's down to its first null, a state group's all."""
        null = self.pool.blocks[0]
        for g, table in enumerate(self.tables(req)):
            if not self._freed_at_schedule(g):
                continue
            freed: list[Block] = []
            for i in self._skipped_held(g, table, processed):
                freed.append(table[i])
                table[i] = null
            if freed:
                self.pool.free_batch(freed[::-1])

    def _skipped_held(self, g: int, table: list[Block], processed: int) -> list[int]:
        """The positions of ``table`` (group ``g``'s) that ``_skipped`` gives up and that still
        hold a block, last first: a window's or a chunked group's down to its first null (its
        nulls are a leading run), a state group's all."""
        null, out = self.pool.blocks[0], []
        for i in range(min(self._skipped(g, processed), len(table)) - 1, -1, -1):
            if table[i] is null:
                if self.groups[g].kind in ("window", "chunked"):
                    break
                continue
            out.append(i)
        return out

    def let_go_windows(self, req: Request, processed: int) -> None:
        """``windows_let_go``: the running request gives up each window group's skipped blocks
        (last first, down to its first null), one ``dedup`` to the null block each, the spec's
        ``observed.let_go``. Called at a step's begin, when no entry of the step being built
        holds them; the steps in flight read from the window of their first token on, which
        ``processed`` (computed less the tokens in flight) already accounts for."""
        null, events = self.pool.blocks[0], self.pool.events
        for g, table in enumerate(self.tables(req)):
            if not g or self.groups[g].kind != "window":
                continue
            for i in self._skipped_held(g, table, processed):
                self.pool.let_go(table[i])
                table[i] = null
                if events is not None:
                    events.append(("dedup", req.rid, i, 0, g))

    # -- registration ------------------------------------------------------------------------

    def publish(self, req: Request, index: int) -> None:
        """Register group 0's block ``index`` (a single group's ``publish``)."""
        if (index + 1) * self.block_size > len(req.tokens):
            raise RuntimeError(
                f"publish of r{req.rid}'s block {index}: its tokens are not all known "
                f"({len(req.tokens)} known)"
            )
        k = self.groups[0].block_size // self.block_size
        if (index + 1) % k == 0:
            self.publish_group(req, 0, (index + 1) // k - 1)

    def unpublish_at(self, req: Request, index: int) -> None:
        """Roll back group 0's block ``index``."""
        k = self.groups[0].block_size // self.block_size
        if (index + 1) % k == 0:
            self.unpublish_group(req, 0, (index + 1) // k - 1)

    def group_pending(self, req: Request, end: int, limit: int) -> list[tuple[int, int]]:
        """The (group, index) of groups 1 .. G - 1 a step of the request ending at ``end`` makes
        registrable, each group's count of registered blocks moving past them: full and window
        blocks wholly inside the first ``min(end, limit)`` tokens, a state block only when
        ``end`` is its boundary and within ``limit`` (``limit``: the known tokens, or fewer), or
        as full blocks for a state group registering ``when-known``."""
        cached = self.group_cached.setdefault(req.rid, [0] * (len(self.groups) - 1))
        out: list[tuple[int, int]] = []
        for g in range(1, len(self.groups)):
            spec = self.groups[g]
            if spec.kind == "slot":  # only the engine's own snapshots (slots.py)
                continue
            size, done = spec.block_size, cached[g - 1]
            upto = min(end, limit) // size
            if spec.kind == "cross":  # never hashed nor registered
                continue
            if spec.kind == "state" and spec.registers != "when-known":
                if end % size == 0 and end <= limit and end // size > done:
                    out.append((g, end // size - 1))
            else:
                out += [(g, i) for i in range(done, upto)]
            cached[g - 1] = max(done, upto)
        return out

    def publish_group(self, req: Request, group: int, index: int) -> None:
        """Register group ``group``'s block ``index`` under the prefix up to its end, unless it
        is a null position (a skipped block, a state slot no step ended in) or registered."""
        table = self.tables(req)[group]
        if index >= len(table) or table[index].block_id == 0:
            return
        block = table[index]
        if block.block_hash is None:
            k = self.groups[group].block_size // self.block_size
            key = self._key(self._hashes(req, (index + 1) * k - 1), group, index)
            self.pool.publish(block, key, req.rid, index, group or None)
            if self.groups[group].kind == "state":
                self.states_this_step.add(block)

    def unpublish_group(self, req: Request, group: int, index: int) -> None:
        """Roll back group ``group``'s block ``index`` (nothing for a null position)."""
        table = self.tables(req)[group]
        if index < len(table) and table[index].block_id != 0:
            self.pool.unpublish(table[index])

    def _hashes(self, req: Request, index: int) -> list[bytes]:
        self.block_hash(req, index)
        return req.block_hashes

    # -- freeing -----------------------------------------------------------------------------

    def free(self, req: Request) -> None:
        self.free_blocks(self.pop_table(req))

    def pop_table(self, req: Request) -> list[Block]:
        """Take the request's tables away (their nulls left out) without dropping references."""
        parts = [[b for b in t if b.block_id != 0] for t in self.tables(req)]
        slots = {g: p[0] for g, p in enumerate(parts) if p and self.groups[g].kind == "slot"}
        if slots:
            self.let_go[req.rid] = slots
        req.table = []
        req.tables = [req.table] + [[] for _ in self.groups[1:]]
        req.computed = 0
        req.cached = 0
        self.group_cached.pop(req.rid, None)
        return GroupedTable(parts)

    def free_blocks(self, table: list[Block]) -> None:
        """Drop one reference on each block, group by group in group order, each last first."""
        assert isinstance(table, GroupedTable)
        for part in table.parts:
            if self.batch_free:
                self.pool.free_batch(part)
            else:
                self.pool.free_reversed(part)
