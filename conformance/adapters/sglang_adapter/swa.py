"""The SWA component of SGLang's ``UnifiedRadixCache`` (a hybrid sliding-window model: FULL and
SWA on one radix tree) as the events of two KV-cache groups (``docs/hybrid.md``, "Events and
trace"): group 0 the FULL pool's pages, group 1 the SWA pool's.

SGLang keeps one token key per tree node and two values: FULL page indices and SWA indices. The
SWA index of a FULL slot is ``SWATokenToKVPoolAllocator.full_to_swa_index_mapping[slot]``, set when
both are allocated together (``alloc_extend``/``alloc_decode``) and cleared (to its padding slot
0) when the SWA slot is freed: behind a running request's window (``free_swa_out_of_window_slots``,
from ``ScheduleBatch.maybe_evict_swa`` and at insert), or as a tree node's SWA value is evicted
while its FULL value stays (a *tombstone*, ``SWAComponent.evict_component``). So a request's SWA
table is its req-to-token row read through the mapping, null where cleared, and the tree's SWA
pages are the FULL slots SGLang reports SWA-resident (``walk_for_kv_canary(..., swa_resident_only
=True)``) read through it.

Block ids are global (one id space, as the spec's shared pool): FULL pages keep their ids
1..F, SWA page ``q`` (1..S, SGLang's page 0 the SWA pool's padding slot) is block ``F + q``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .build import Req, swa_layers
from .record import Event, UnifiedRecorder, rid

SWA_GROUP = 1
"""The SWA component's group (FULL is group 0: ``create_unified_radix_cache`` lists FULL first)."""


class SwaRecorder(UnifiedRecorder):
    """``UnifiedRecorder`` over a tree with FULL and SWA: every view covers both groups, SWA pages
    as global ids ``full_pages + q``; an insert's new SWA values are published in group 1, an
    eviction of either value (a leaf, or an SWA tombstone) reported like any eviction."""

    def __init__(
        self, tree: Any, pool: Any, page_size: int, events: list[Event], full_pages: int
    ) -> None:
        self.full_pages = full_pages
        self.window = swa_layers()[0]
        self.allocator = tree.token_to_kv_pool_allocator
        self.nulls: dict[int, set[int]] = {}
        """Per request: the positions of its SWA table that are null (``tables``)."""
        self.extents: dict[int, tuple[Any, int, int]] = {}
        """Per tree lock (``id``): the lock, and the tokens ``[start, end)`` whose SWA values it
        holds (``lock_extent``)."""
        self.paths: Counter[str] = Counter()
        """How often the hybrid paths ran (``count_hit``, ``window_frees``, the evictions):
        the coverage a fuzz run reports (``bench/fuzz_sglang_coverage.py --swa``)."""
        super().__init__(tree, pool, page_size, events)

    # -- ids ------------------------------------------------------------------------------------

    def group_of(self, block: int) -> int:
        return SWA_GROUP if block > self.full_pages else 0

    def swa_block(self, full_page: int) -> int:
        """The SWA block paired with a FULL page, or 0 (null) where SGLang cleared the pair."""
        slot = int(self.allocator.full_to_swa_index_mapping[full_page * self.page_size])
        return 0 if slot <= 0 else self.full_pages + slot // self.page_size

    # -- views ----------------------------------------------------------------------------------

    def tables(self, req: Req) -> list[list[int]]:
        """The request's table per group: its FULL row, and the SWA pages it holds, paired with
        it: its own pages past ``cache_protected_len`` until SGLang frees them behind the
        window, and the tree's pages before it only where its tree lock holds their SWA values
        (``held_tree_pages``); null elsewhere (and where a hit took a tombstoned node's FULL
        page). A position once null stays null while the request holds its row: SGLang's
        window lock only moves on, and when an insert later gives a tombstoned node another
        request's SWA value, SGLang's mapping pairs the FULL page with it, but this request
        never took that page (it is not among its references)."""
        row = self.row(req)
        key = int(req.rid)
        if not row:
            self.nulls.pop(key, None)
            return [row, []]
        nulls = self.nulls.setdefault(key, set())
        tree = req.kv.cache_protected_len // self.page_size
        held = self.held_tree_pages(req)
        window = []
        for i, page in enumerate(row):
            block = 0 if i in nulls or (i < tree and i not in held) else self.swa_block(page)
            if block == 0:
                nulls.add(i)
            window.append(block)
        return [row, window]

    def lock_extent(self, node: Any) -> tuple[int, int]:
        """The tokens whose SWA values a tree lock on ``node`` holds: SGLang's
        ``SWAComponent.acquire_component_lock`` locks the nodes from ``node`` up, each whole,
        until they cover the window (to the root if they never do). Node boundaries from the
        backend-neutral ``TreeCore.collect_path_info``; a later split moves the boundary's
        marker to the older half, so the extent in tokens holds until the lock is released."""
        (path,) = self.tree.tree_core.collect_path_info([node])
        if not path:
            return 0, 0
        end, covered, start = path[-1].path_end, 0, 0
        for info in reversed(path):
            covered += info.path_end - info.path_start
            start = info.path_start
            if covered >= self.window:
                break
        return start, end

    def held_tree_pages(self, req: Req) -> set[int]:
        """The positions of the request's row whose tree SWA values its lock holds (none once
        SGLang released the lock's SWA part early: ``release_swa_prefix_lock``)."""
        lock = getattr(req, "lock", None)
        known = self.extents.get(id(lock)) if lock is not None else None
        if known is None or known[0] is not lock or lock.swa_released:
            return set()
        ps = self.page_size
        return set(range(known[1] // ps, -(-known[2] // ps)))

    def cached_pages(self) -> dict[int, int]:
        """The tree's FULL pages and its SWA-resident pages (global ids), with their positions."""
        full = self._walk(False)
        resident = self._walk_swa(False)
        out = dict(full)
        for page, position in resident.items():
            block = self.swa_block(page)
            if block:
                out[block] = position
        return out

    def unlocked(self) -> set[int]:
        out = set(self._walk(True))
        for page in self._walk_swa(True):
            block = self.swa_block(page)
            if block:
                out.add(block)
        return out

    def locks(self) -> dict[int, int] | None:
        return None  # the Rust core's lock counts are out of Python's reach

    def free_pages(self) -> set[int]:
        """Both pools' free pages, as global ids."""
        full = self.allocator.full_attn_allocator.get_all_free_pages().tolist()
        swa = self.allocator.swa_attn_allocator.get_all_free_pages().tolist()
        return {int(p) for p in full} | {self.full_pages + int(q) for q in swa}

    def _walk_swa(self, unlocked_only: bool) -> dict[int, int]:
        return self._walk(unlocked_only, swa=True)

    # -- reporting ------------------------------------------------------------------------------

    def _publish(self, index: int, page: int) -> None:
        req = self.acting
        if req is None:
            raise AssertionError("SGLang inserted into its tree outside a request's insert")
        group = self.group_of(page)
        event: Event = ("publish", int(req.rid), index, page)
        self.events.append(event + (group,) if group else event)

    def repointed(self, req: Req, group: int, before: list[int], after: list[int]) -> list[Event]:
        """``Recorder.repointed``; in the SWA group a position SGLang left null (freed behind
        the window, or a tree page its window lock no longer holds) is the request letting go
        of that block: ``dedup`` to the null block (``spec.observed.let_go``)."""
        events = [
            ("dedup", rid(req), before.index(e[1]), 0, group)
            if group == SWA_GROUP and e[0] == "free"
            else e
            for e in super().repointed(req, group, before, after)
        ]
        if group == SWA_GROUP:
            frees = [e for e in events if e[0] == "dedup" and e[3] == 0]
            self.paths["window frees"] += len(frees)
            cached = self._walk(False)
            shared = [
                i
                for i, (old, new) in enumerate(zip(before, after, strict=True))
                if old and not new and self.row(req)[i] in cached
            ]
            self.paths["window frees beside a cached FULL page"] += len(shared)
            tree_swa = {self.swa_block(page) for page in self._walk_swa(False)}
            self.paths["window frees of an SWA page in the tree (shared)"] += sum(
                1 for e in frees if before[e[2]] in tree_swa
            )
            # the next forward computes the token at seqlen - 1, reading the W tokens up to it
            first_read = max(0, req.seqlen - self.window) // self.page_size
            read = [
                i
                for i, (old, new) in enumerate(zip(before, after, strict=True))
                if old and not new and i >= first_read
            ]
            self.paths["window frees of a block the next forward reads"] += len(read)
        return events

    def count_hit(self, req: Req) -> None:
        """An admission's hit: whether SGLang cut the FULL hit back to the last boundary whose
        window the SWA component holds (``swa_branching_seqlen``: how far FULL went)."""
        self.paths["hits"] += 1
        if req.swa_branching_seqlen is not None:
            self.paths["hits cut by the SWA window"] += 1
        hit = self.tables(req)[SWA_GROUP][: req.prefix_len // self.page_size]
        if 0 in hit:
            self.paths["hits with null window blocks"] += 1
        read = -(-(self.window - 1) // self.page_size)  # the blocks the next token's window reads
        if 0 in hit[-read:]:
            self.paths["hits with a null block inside the window"] += 1

    def _wrap(self) -> None:
        super()._wrap()
        lock, unlock, evict = self.tree.lock, self.tree.unlock, self.tree._evict

        def lock_(node: Any, *args: Any, **kw: Any) -> Any:
            result = lock(node, *args, **kw)
            if result is not None:
                self.extents[id(result)] = (result, *self.lock_extent(node))
            return result

        def unlock_(held: Any) -> Any:
            self.extents.pop(id(held), None)
            return unlock(held)

        self.tree.lock, self.tree.unlock = lock_, unlock_

        def evict_(*args: Any, **kw: Any) -> Any:
            full, swa = self._walk(False), self._walk_swa(False)
            result = evict(*args, **kw)
            full_gone = len(full) - len(self._walk(False))
            swa_gone = len(swa) - len(self._walk_swa(False))
            self.paths["SWA tombstones"] += max(0, swa_gone - full_gone)
            return result

        self.tree._evict = evict_
