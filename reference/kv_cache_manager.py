"""The KV cache manager (vLLM ``KVCacheManager``): a request's view of the block pool.

Prefix lookup over the request's chained hashes, admission (touching hits before anything is
allocated), growing a table to cover new tokens, publishing a table block under the request's
hash (only a block whose tokens are all known: under async scheduling a table may cover
placeholder positions), and freeing a table in reverse order. *When* blocks are published is the registration
policy's business (``policies.py``).
"""

from __future__ import annotations

from .block_pool import Block, BlockPool
from .hashing import extend_hashes
from .request import Request


class KVCacheManager:
    grouped = False
    """Several KV-cache groups (``groups.GroupedKV``, a subclass) or one (this class)."""

    __slots__ = ("pool", "block_size", "prefix_caching", "batch_free", "window")

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        prefix_caching: bool = True,
        batch_free: bool = False,
        window: int | None = None,
    ) -> None:
        self.pool = pool
        self.window = window
        """A sliding window of this many tokens (one group), or None: full attention."""
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.batch_free = batch_free or not prefix_caching
        """Free a table as one batch (``BlockPool.free_batch``): without prefix caching, and
        with speculative decoding (the spec's ``pool.free_table``)."""

    def block_hash(self, req: Request, index: int) -> bytes:
        """The chained hash of the request's full block ``index``."""
        hashes = req.block_hashes
        if index >= len(hashes):
            extend_hashes(hashes, req.tokens, self.block_size, index + 1)
        return hashes[index]

    def lookup(self, req: Request) -> list[Block]:
        """The longest run of cached blocks for the request's prefix, from its first block,
        capped so that the last known token is always computed (none without prefix caching),
        and at the whole blocks of the request's ``read_limit`` (the spec's bounded hit)."""
        if not self.prefix_caching:
            return []
        cap = (len(req.tokens) - 1) // self.block_size
        if req.read_limit is not None:
            cap = min(cap, req.read_limit // self.block_size)
        hashes = req.block_hashes
        if len(hashes) < cap:
            extend_hashes(hashes, req.tokens, self.block_size, cap)
        index = self.pool.index
        hits: list[Block] = []
        if self.window is not None:
            return self._window_hits(hashes, cap)
        for i in range(cap):
            owners = index.get(hashes[i])
            if not owners:
                break
            hits.append(next(iter(owners.values())))
        return hits

    def _window_hits(self, hashes: list[bytes], cap: int) -> list[Block]:
        """Sliding window: scanning back from block ``cap - 1``, the first run of
        ``ceil((W - 1) / B)`` cached blocks ends the hit, null blocks standing before it;
        without such a run, the cached run from block 0."""
        assert self.window is not None
        need = -(-(self.window - 1) // self.block_size)
        pool, null = self.pool, self.pool.blocks[0]
        run: list[Block] = []  # the current run, rightmost first
        for i in range(cap - 1, -1, -1):
            block = pool.cached_block(hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= need:
                hits = [null] * i + run[::-1]
                pad = min(self.skipped(len(hits) * self.block_size), len(hits))
                return [null] * pad + hits[pad:]  # (only W = 1 skips the run's own block)
        return run[::-1]

    def hit_length(self, hits: list[Block]) -> int:
        """A lookup's hit in tokens."""
        return len(hits) * self.block_size

    def blocks_short_running(self, req: Request, end: int, processed: int) -> bool:
        """A running request cannot cover ``end`` tokens, even with the blocks its sliding
        window would free first (``processed``: what no step in flight still reads below)."""
        if self.window is None:
            return self.blocks_short(req, end)
        freed = self.skippable(req, processed)
        return -(-end // self.block_size) - len(req.table) > self.pool.num_free + freed

    def new_step(self) -> None:
        """A step starts being scheduled (several groups: ``groups.GroupedKV``); nothing here."""

    def group_pending(self, req: Request, end: int, limit: int) -> list[tuple[int, int]]:
        """Several groups: the (group, index) of groups 1 .. G - 1 a step ending at ``end``
        makes registrable (``groups.GroupedKV``); none here."""
        return []

    def publish_group(self, req: Request, group: int, index: int) -> None:
        """Several groups: register group ``group``'s block ``index`` (``groups.GroupedKV``)."""
        raise NotImplementedError("one KV-cache group")

    def unpublish_group(self, req: Request, group: int, index: int) -> None:
        """Several groups: roll back group ``group``'s block ``index`` (``groups.GroupedKV``)."""
        raise NotImplementedError("one KV-cache group")

    def unpublish_at(self, req: Request, index: int) -> None:
        """Roll back the registration of the request's block ``index``, if it has one."""
        self.pool.unpublish(req.table[index])

    def skipped(self, processed: int) -> int:
        """Leading blocks wholly before the window of the token after ``processed`` tokens."""
        if self.window is None:
            return 0
        return max(0, processed - self.window + 1) // self.block_size

    def skippable(self, req: Request, processed: int) -> int:
        """Blocks ``remove_skipped`` would put back on the free queue now."""
        table = req.table[: min(self.skipped(processed), len(req.table))]
        return sum(1 for b in table if b.block_id != 0 and b.ref_cnt == 1)

    def remove_skipped(self, req: Request, processed: int) -> None:
        """Free the blocks before the window (the last first, down to the first null one) as
        one batch, and put the null block in their places."""
        table, null = req.table, self.pool.blocks[0]
        last = min(self.skipped(processed), len(table))
        freed: list[Block] = []
        for i in range(last - 1, -1, -1):
            if table[i] is null:
                break
            freed.append(table[i])
            table[i] = null
        if freed:
            self.pool.free_batch(freed[::-1])

    def blocks_short(self, req: Request, end: int, hits: list[Block] | None = None) -> bool:
        """True when covering tokens up to ``end`` needs more blocks than are free. On
        admission, ``hits`` are about to be touched: the unreferenced ones count as consumed."""
        need = -(-end // self.block_size) - len(req.table)
        free = self.pool.free_queue.num_free
        if hits is not None:
            need -= len(hits)
            for block in hits:
                if block.ref_cnt == 0 and block.block_id != 0:
                    free -= 1
        return need > free

    def admit(self, req: Request, hits: list[Block]) -> None:
        """Touch the hit blocks and make them the start of the request's table (with a sliding
        window, the null block in place of those before the window of its first computed
        token, touched not)."""
        pad = min(self.skipped(len(hits) * self.block_size), len(hits))
        if pad:
            hits[:pad] = [self.pool.blocks[0]] * pad
        self.pool.touch([b for b in hits if b.block_id != 0])
        req.table.extend(hits)
        req.cached = len(hits)
        events = self.pool.events
        if events is not None:
            events.append(("hit", req.rid, tuple(b.block_id for b in hits)))

    def grow(self, req: Request, end: int) -> None:
        """Allocate blocks from the free queue's head until the table covers ``end`` tokens."""
        table, bsz, pool = req.table, self.block_size, self.pool
        while len(table) * bsz < end:
            table.append(pool.allocate(req.rid))

    def publish(self, req: Request, index: int) -> None:
        """Register the request's block ``index`` under its chained hash; its tokens must all be
        known (under async scheduling a block may be computed, up to its last slot, from tokens
        that in-flight steps have not sampled yet: it is registered once they have)."""
        if (index + 1) * self.block_size > len(req.tokens):
            raise RuntimeError(
                f"publish of r{req.rid}'s block {index}: its tokens are not all known "
                f"({len(req.tokens)} known)"
            )
        block = req.table[index]
        if block.block_hash is None:
            self.pool.publish(block, self.block_hash(req, index), req.rid, index)

    def free(self, req: Request) -> None:
        """Drop the request's blocks (last first; hashes kept) and forget what it computed;
        without prefix caching or with speculative decoding as one batch (``free_batch``)."""
        self.free_blocks(self.pop_table(req))

    def pop_table(self, req: Request) -> list[Block]:
        """Take the request's table away without dropping its references (vLLM's
        ``pop_blocks_for_free``); the caller frees them later with ``free_blocks``."""
        table = req.table
        req.table = []
        req.computed = 0
        req.cached = 0
        if self.window is not None:  # the null blocks before the window hold no reference
            return [b for b in table if b.block_id != 0]
        return table

    def free_blocks(self, table: list[Block]) -> None:
        """Drop one reference on each block of a table popped by ``pop_table``, last first."""
        if self.batch_free:
            self.pool.free_batch(table)
        else:
            self.pool.free_reversed(table)
