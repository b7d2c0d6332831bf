"""Block-manager bugs planted in vLLM's ``BlockPool`` (inside ``.venv-vllm``, 0.33.0, or
``.venv-vllm-0.34.0``), as
``planted.py`` plants them in the reference engine: each patches one method of the class before
the adapter builds its engine. ``bench/planted_findings.py --engine vllm`` fuzzes each."""

from __future__ import annotations

from typing import Any

from planted import Plant, _patched
from vllm.v1.core.block_pool import BlockPool

_touch = BlockPool.touch
_free_blocks = BlockPool.free_blocks


def _touch_no_ref(self: Any, blocks: Any) -> None:
    """A hit on a block in use takes no reference."""
    for block in blocks:
        if block.is_null:
            continue
        if block.ref_cnt == 0:
            self.free_block_queue.remove(block)
            block.ref_cnt += 1


def _free_double(self: Any, ordered_blocks: Any) -> None:
    """A shared block loses two references when one request frees it."""
    blocks = list(ordered_blocks)
    for block in blocks:
        if not block.is_null and block.ref_cnt >= 2:
            block.ref_cnt -= 1
    _free_blocks(self, blocks)


def _free_reversed(self: Any, ordered_blocks: Any) -> None:
    """Blocks are freed in the opposite eviction order."""
    _free_blocks(self, list(ordered_blocks)[::-1])


_remove_cached_block_hashes = BlockPool._remove_cached_block_hashes


def _remove_hashes_keeps_entries(self: Any, block: Any) -> Any:
    """An evicted block loses its hash, but its entries stay in the hash index (left behind)."""
    removed = _remove_cached_block_hashes(self, block)
    for key in removed:
        self.cached_block_hash_to_block.insert(key, block)
    return removed


def _free_counts_twice(self: Any, ordered_blocks: Any, *args: Any, **kw: Any) -> None:
    """Freeing a table counts its first block free twice (the free queue's counter, which
    ``get_num_free_blocks()`` and admission read, drifts above the queue's length)."""
    blocks = list(ordered_blocks)
    _free_blocks(self, blocks, *args, **kw)
    if blocks and not blocks[0].is_null and blocks[0].ref_cnt == 0:
        self.free_block_queue.num_free_blocks += 1


BOOKS = (
    Plant(
        "vllm-index-left-behind",
        "safety",
        "HashIndexConsistent",
        lambda: _patched(BlockPool, "_remove_cached_block_hashes", _remove_hashes_keeps_entries),
        "an evicted block's entry stays in the hash index",
    ),
    Plant(
        "vllm-free-miscount",
        "safety",
        "FreeCountExact",
        lambda: _patched(BlockPool, "free_blocks", _free_counts_twice),
        "a freed table's first block is counted free twice",
    ),
)
"""Bugs in vLLM's own books, found by comparing its ``pool_view`` (both releases)."""

PLANTS = (
    Plant(
        "vllm-refcount-not-taken",
        "safety",
        "RefcountIsOwnership",
        lambda: _patched(BlockPool, "touch", _touch_no_ref),
        "a hit on a block in use takes no reference",
    ),
    Plant(
        "vllm-double-free",
        "safety",
        "RefcountIsOwnership",
        lambda: _patched(BlockPool, "free_blocks", _free_double),
        "a shared block loses two references when one request frees it",
    ),
    Plant(
        "vllm-free-order",
        "efficiency",
        None,
        lambda: _patched(BlockPool, "free_blocks", _free_reversed),
        "blocks freed in the opposite eviction order",
    ),
)
assert _touch
