"""Block-manager bugs planted in vLLM 0.33.0's ``BlockPool`` (inside ``.venv-vllm``), as
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
