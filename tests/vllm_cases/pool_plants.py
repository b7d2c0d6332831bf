"""Planted bugs in vLLM's own ``BlockPool`` (a subclass overriding one method each), driven through
partial prefix-cache entries, moves and unpins under ``pool_attach`` and the ``PoolJudge``.

Run with a vLLM release's python (``tests/test_pool_partial_vllm.py`` does, for each release):
prints one line per pool, ``NAME FINDING`` (``holds`` where the judge found nothing). The
unplanted pool must hold; each planted one must be named by the invariant it breaks.
"""

from __future__ import annotations

import sys

import torch  # noqa: F401  (vLLM's pool imports it; keeps import order as vLLM's tests)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvspec.conformance.adapters.vllm_adapter.pool_attach import attach_pool
from kvspec.conformance.pool_judge import PoolJudge

HASH_BLOCK = 4
BLOCK = 8
BLOCKS = 8


class MoveKeepsTheSource(BlockPool):
    """``move_block_hashes`` registers the copy but leaves the source under its keys."""

    def move_block_hashes(self, src_block, dst_block):  # type: ignore[no-untyped-def]
        keys = [
            src_block.block_hash,
            *self.cached_block_hashes_by_block.get(src_block.block_id, ()),
        ]
        for key in keys:
            self.cached_block_hash_to_block.insert(key, dst_block)
        dst_block.set_block_hash(keys[0], src_block.block_hash_num_tokens)
        if keys[1:]:
            self.cached_block_hashes_by_block[dst_block.block_id] = set(keys[1:])


class EvictionKeepsAPartialKey(BlockPool):
    """An eviction drops the block's first key but leaves its partial entries in the map."""

    def _remove_cached_block_hashes(self, block):  # type: ignore[no-untyped-def]
        if block.block_hash is None:
            return []
        first = block.block_hash
        self.cached_block_hashes_by_block.pop(block.block_id, None)
        self.cached_block_hash_to_block.pop(first, block.block_id)
        block.reset_hash()
        return [first]


class UnpinKeepsTheBlockOut(BlockPool):
    """``unpin_blocks`` drops the reference but never queues the block."""

    def unpin_blocks(self, blocks, on_reuse):  # type: ignore[no-untyped-def]
        for block in blocks:
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse


class ReuseTellsNoReader(BlockPool):
    """An allocation hands out an unpinned block without telling its reader."""

    def _notify_reuse(self, blocks):  # type: ignore[no-untyped-def]
        return None


def drive(cls: type[BlockPool]) -> str:
    init_none_hash(sha256)
    request = Request(
        request_id="r",
        prompt_token_ids=list(range(2 * BLOCK)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(HASH_BLOCK, sha256),
    )
    pool = cls(BLOCKS, enable_caching=True, hash_block_size=HASH_BLOCK)
    attachment = attach_pool(pool)
    judge = PoolJudge(attachment.num_blocks, attachment.caching)
    seen = 0

    def check() -> str | None:
        nonlocal seen
        for event in attachment.events[seen:]:
            judge.feed(event)
        seen = len(attachment.events)
        finding = judge.compare(*attachment.snapshot())
        if attachment.refusal is not None:
            return f"refused {attachment.refusal}"
        return None if finding is None else finding.invariant

    reused: list[int] = []
    steps = [
        lambda: pool.get_new_blocks(3),
        # block 1 under the 8-token prefix, then also under the 4-token one (an alias)
        lambda: pool.cache_partial_block(request, pool.blocks[1], BLOCK, 0, BLOCK),
        lambda: pool.cache_partial_block(request, pool.blocks[1], HASH_BLOCK, 0, BLOCK),
        # block 3 under the same two keys (duplicates), then evicted
        lambda: pool.cache_partial_block(request, pool.blocks[3], BLOCK, 0, BLOCK),
        lambda: pool.cache_partial_block(request, pool.blocks[3], HASH_BLOCK, 0, BLOCK),
        lambda: pool.evict_blocks({3}),
        # block 1's keys to its copy, block 2 (copy-on-write of a partially hit block)
        lambda: pool.move_block_hashes(pool.blocks[1], pool.blocks[2]),
        lambda: pool.free_blocks([pool.blocks[2]]),
        lambda: pool.evict_blocks({2}),
        lambda: pool.unpin_blocks([pool.blocks[3]], lambda b: reused.append(b.block_id)),
        lambda: pool.get_new_blocks(pool.get_num_free_blocks()),
    ]
    for step in steps:
        step()
        finding = check()
        if finding is not None:
            return finding
    assert reused == [3] or cls is ReuseTellsNoReader, reused
    return "holds"


def main() -> int:
    pools = (BlockPool, MoveKeepsTheSource, EvictionKeepsAPartialKey, UnpinKeepsTheBlockOut)
    for cls in (*pools, ReuseTellsNoReader):
        print(cls.__name__, drive(cls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
