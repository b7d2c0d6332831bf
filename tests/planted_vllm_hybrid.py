"""Bugs planted in vLLM's own hybrid KV-cache code (``HybridKVCacheCoordinator``,
``SlidingWindowManager``, ``FullAttentionManager``; inside ``.venv-vllm`` or
``.venv-vllm-0.34.0``), fuzzed through ``vllm_adapter.hybrid:swa_factory`` (a sliding-window
group beside a full-attention one) by ``bench/planted_child.py vllm-hybrid``; each should be named
by one of the invariants of several groups (``spec/invariants.py``), not a bare disagreement.

Each plant patches one attribute of vLLM's class while the run lasts (restored on exit), as
``planted_vllm.py`` does for the pool: no vLLM code is copied.

What the swa model cannot plant, and why (the lead's table says so too):

* ``StateAtItsBoundary``, ``NoUnwrittenStateRead``: they judge state groups; their plants in
  vLLM's Mamba code are ``planted_vllm_mamba.py``'s (``hybrid.mamba_factory``);
* ``NoReadOfRecycled``: it judges groups 1 .. G-1, and vLLM puts the swa model's window in
  group 0 (its layers' order), whose form is ``NoUnwrittenRead``'s window clause; its plant is
  ``planted_vllm_window.py``'s (``hybrid.swa_full_first_factory``: the window in group 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from planted import Plant
from vllm.v1.core import block_pool as _block_pool
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager

_MISSING = object()


@contextlib.contextmanager
def _set(cls: Any, name: str, value: Any) -> Iterator[None]:
    """``cls.name = value`` (a class or a module) while the block runs, even where ``cls``
    inherits ``name``."""
    own = cls.__dict__.get(name, _MISSING)
    setattr(cls, name, value)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


_find_window_hit = SlidingWindowManager.find_longest_cache_hit.__func__  # type: ignore[attr-defined]


def _window_hit_last_nulled(
    cls: Any, block_hashes: Any, max_length: int, *args: Any, **kw: Any
) -> Any:
    """The window's hit with its last block (the one the next token's window reads) handed out
    as the null block: a hit the window group cannot serve."""
    hit, length = _find_window_hit(cls, block_hashes, max_length, *args, **kw)
    block_pool = args[1] if len(args) > 1 else kw["block_pool"]
    for blocks in hit:
        if blocks:
            blocks[-1] = block_pool.null_block
    return hit, length


PLANTS = (
    Plant(
        "vllm-full-hit-not-cut",
        "safety",
        "HitServedByEveryGroup",
        lambda: _set(FullAttentionManager, "retains_longer_hit", True),
        "the coordinator leaves the full-attention group's hit longer than the window group's",
    ),
    Plant(
        "vllm-window-hit-last-nulled",
        "safety",
        "HitServedByEveryGroup",
        lambda: _set(
            SlidingWindowManager, "find_longest_cache_hit", classmethod(_window_hit_last_nulled)
        ),
        "the window's hit hands out its last block as the null block",
    ),
)


# -- bugs in vLLM's KV-event stream of several groups (judged by kv_stream.py) ---------------------


def _other_hash(block_hash: Any) -> Any:
    """A hash no block was stored under: the same hash with one more byte (or bit)."""
    return block_hash + b"\x00" if isinstance(block_hash, bytes) else block_hash ^ (1 << 62)


def _stored_with_unknown_parent(**fields: Any) -> Any:
    """``BlockStored`` naming, as its parent, a hash the stream never announced."""
    if fields.get("parent_block_hash") is not None:
        fields["parent_block_hash"] = _other_hash(fields["parent_block_hash"])
    return _BlockStored(**fields)


def _removed_in_other_group(**fields: Any) -> Any:
    """``BlockRemoved`` of a block of group g named in group 1 - g (two groups)."""
    if fields.get("group_idx") is not None:
        fields["group_idx"] = 1 - int(fields["group_idx"])
    return _BlockRemoved(**fields)


_BlockStored = _block_pool.BlockStored
_BlockRemoved = _block_pool.BlockRemoved

STREAM = (
    Plant(
        "vllm-stream-parent-unannounced",
        "safety",
        "ParentAnnounced",
        lambda: _set(_block_pool, "BlockStored", _stored_with_unknown_parent),
        "a stored block's parent is a hash the stream never announced",
    ),
    Plant(
        "vllm-stream-removal-wrong-group",
        "safety",
        "ViewEqualsCache",
        lambda: _set(_block_pool, "BlockRemoved", _removed_in_other_group),
        "a removal names the block's hash in the other group",
    ),
)
"""Bugs in the per-group KV-event stream vLLM's ``BlockPool`` makes (both releases build
``BlockStored`` and ``BlockRemoved`` by these module names). A removal named in the wrong group is
``ViewEqualsCache``'s, not ``RemovalNamesAnnounced``'s: the swa model's two groups have one block
size, so the same hash is announced in both, and the removal takes the other group's live entry
out of the view, which then lacks a block the engine still caches there."""
