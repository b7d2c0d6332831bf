"""vLLM's own books of its ``BlockPool``, read for ``conformance/engine_view.py``: the hash index
(``cached_block_hash_to_block``, read through ``versions.cached_block_ids``: 0.33.0 and 0.34.0
store it differently), the free count (``get_num_free_blocks()``, the free queue's own counter,
which admission and ``get_usage()`` read) and the evictable blocks (unreferenced, still cached).

Only for one KV-cache group: with several, the index's keys carry a group and the spec's state
has per-group tables (``docs/hybrid.md``), so no view is given (None)."""

from __future__ import annotations

from typing import Any

from kvspec.conformance.engine_view import PoolView

from . import versions


def read_pool_view(pool: Any, groups: int = 1) -> PoolView | None:
    """The pool's books as a ``PoolView``; None with more than one KV-cache group."""
    if groups != 1:
        return None
    blocks = versions.read(pool, "blocks")
    return PoolView(
        free_count=int(pool.get_num_free_blocks()),
        evictable=tuple(
            b.block_id
            for b in blocks
            if not b.is_null and b.ref_cnt == 0 and b.block_hash is not None
        ),
        index=tuple(versions.cached_block_ids(pool).values()),
    )
