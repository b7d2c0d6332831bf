"""Block-manager bugs planted in nano-vllm-fork's ``BlockManager`` (inside ``.venv-nano``), as
``planted.py`` plants them in the reference engine: each patches one method of the class before
the adapter builds its engine."""

# ruff: noqa: I001 (the adapter, which installs nanovllm without its CUDA __init__, first)
from __future__ import annotations

from typing import Any

from kvspec.conformance.adapters import nano_vllm_adapter  # its nanovllm package without CUDA
from nanovllm.engine.block_manager import BlockManager
from planted import Plant, _patched


def _allocate_no_ref(self: Any, seq: Any) -> None:
    """A hit on a block in use takes no reference (``allocate`` without its ``+= 1``)."""
    assert not seq.block_table
    h, cache_miss = -1, False
    for i in range(seq.num_blocks):
        token_ids = seq.block(i)
        h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
        block_id = self.hash_to_block_id.get(h, -1)
        if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
            cache_miss = True
        if cache_miss:
            block = self._allocate_block(self.free_block_ids[0])
            block_id = block.block_id
        else:
            seq.num_cached_tokens += self.block_size
            if block_id in self.used_block_ids:
                block = self.blocks[block_id]  # the planted bug: no reference taken
            else:
                block = self._allocate_block(block_id)
        if h != -1:
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block_id
        seq.block_table.append(block_id)


def _deallocate_forward(self: Any, seq: Any) -> None:
    """A sequence's blocks are freed first block first (nano frees the last first)."""
    seq.block_table.reverse()
    BlockManager.__dict__["_kvspec_deallocate"](self, seq)


def _deallocate_leak(self: Any, seq: Any) -> None:
    """A sequence's first block is never freed."""
    seq.block_table.pop(0)
    BlockManager.__dict__["_kvspec_deallocate"](self, seq)


def _deallocate_block_stays_used(self: Any, block_id: int) -> None:
    """A freed block goes back on the free list but stays in the set of used blocks (which the
    hit path asks whether a block is free)."""
    assert self.blocks[block_id].ref_count == 0
    self.free_block_ids.append(block_id)


BlockManager._kvspec_deallocate = BlockManager.deallocate  # type: ignore[attr-defined]

BOOKS = (
    Plant(
        "nano-used-left-behind",
        "safety",
        "FreeCountExact",
        lambda: _patched(BlockManager, "_deallocate_block", _deallocate_block_stays_used),
        "a freed block stays in the set of used blocks",
    ),
)
"""Bugs in nano-vllm's own books, found by comparing its ``pool_view``."""

PLANTS = (
    Plant(
        "nano-refcount-not-taken",
        "safety",
        "RefcountIsOwnership",
        lambda: _patched(BlockManager, "allocate", _allocate_no_ref),
        "a hit on a block in use takes no reference",
    ),
    Plant(
        "nano-leak",
        "safety",
        "RefcountIsOwnership",
        lambda: _patched(BlockManager, "deallocate", _deallocate_leak),
        "a sequence's first block is never freed",
    ),
    Plant(
        "nano-free-order",
        "efficiency",
        None,
        lambda: _patched(BlockManager, "deallocate", _deallocate_forward),
        "blocks freed first block first",
    ),
)
assert nano_vllm_adapter
