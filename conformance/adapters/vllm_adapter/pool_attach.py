"""A bare vLLM ``KVCacheManager`` or ``BlockPool`` as pool events (``kvspec.spec.pool_machine``).

For code that drives the pool layer directly, with no scheduler (vLLM's own
``test_prefix_caching.py`` and friends): ``attach_pool(manager_or_pool)`` wraps, on the instance,
the pool's state-changing methods and the manager's entry points, and appends the pool
vocabulary (``spec/pool_machine.py``) to ``events``:

========================================  ===================================================
vLLM method                               events
========================================  ===================================================
``KVCacheManager.get_computed_blocks``    ``lookup`` (the request's capped block hashes as
                                          keys), then ``hit``
``KVCacheManager.allocate_slots``         ``slots`` with the hits it is handed, the pool
                                          events inside, ``slots_done``
``BlockPool.touch``                       ``touch``
``BlockPool.get_new_blocks``              ``allocate``, then ``evicted``/``alloc`` per block
``BlockPool.free_blocks``                 ``free``
``BlockPool._insert_block_hash``          ``publish`` (``cache_full_blocks`` inserts each);
                                          ``alias`` for a second key on a cached block
                                          (``cache_partial_block``)
``BlockPool._remove_cached_block_hashes`` ``evict`` (outside an allocation: ``evict_blocks``,
                                          a partial entry promoted or replaced)
``BlockPool.move_block_hashes``           ``move`` (the removes and inserts inside unreported)
``BlockPool.unpin_blocks``                ``unpin``
``BlockPool.reset_prefix_cache``          ``reset`` when it succeeds
``KVCacheManager.pop_blocks_for_free``    ``give`` (the request's references to the caller)
copy-on-write retention                   ``give``/``touch`` to the caller (below)
========================================  ===================================================

Copy-on-write of a partially hit block (vLLM's ``_apply_cow`` and the Mamba "align" manager's
moved entry) takes one reference on each endpoint of the copy by editing ``ref_cnt`` inside
``allocate_slots``; the pairs it queues (``_pending_cow_copies``) say which: the endpoint the
request's table no longer holds passes to the caller (``give``), the other gets one more
reference for the caller (``touch``), who frees both once the copy has run
(``take_kv_cache_block_copies``).

Holders: under a manager, the request a manager method works for (its id mapped to the next
integer at first sight); a bare pool's caller is the anonymous holder ``None``. Keys: vLLM's
``BlockHashWithGroupId`` values, mapped to small integers at first sight. Lookups are judged where
they are plain prefix lookups (one full-attention group, hashes of the block size, no EAGLE
drop); elsewhere the manager's lookups are not reported and only the pool's actions are judged.

Refusals (``refusal``, as in ``attach.py``): blocks of another pool, a stale hit handed to ``allocate_slots``, a request's block freed beneath its
manager, state edited between calls, a wrapped method patched. ``listener(attachment)`` is called
whenever an outermost call returns; ``snapshot`` gives what a ``PoolJudge.compare`` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import FullAttentionSpec

from .attach import EVICT_FIRST, Refusal, guarded, internal_error
from .methods import Method, Wrappers
from .versions import MissingName, cached_block_ids, evict_first, max_cache_hit_length, read

_UNSEEN = object()

Event = tuple[object, ...]


@dataclass
class PoolAttachment:
    target: Any
    listener: Callable[[PoolAttachment], None] | None = None
    events: list[Event] = field(default_factory=list)
    refusal: Refusal | None = None
    error: str | None = None
    error_after_refusal: str | None = None
    """kvspec's first error once a feature was refused (``internal_error``): not counted."""
    ids: dict[str, int] = field(default_factory=dict)
    keys: dict[Hashable, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.manager = self.target if hasattr(self.target, "block_pool") else None
        self.pool = self.manager.block_pool if self.manager is not None else self.target
        self.num_blocks = self.pool.num_gpu_blocks
        self.caching = bool(self.pool.enable_caching)
        self.depth = 0
        self.holder: int | None = None
        self._allocating = False
        self._moving = False
        self._evicted: list[int] = []
        self.wrappers = Wrappers()
        self.wrappers.on_bypass = lambda why: self.refuse("vLLM method patched by the test", why)
        self.wrappers.on_error = lambda why: internal_error(self, why)
        try:
            self._wrap()
            try:
                self.lookups = self.manager is not None and _plain_lookups(self.manager)
                if self.manager is not None:
                    config = read(self.manager, "kv_cache_config")
                    if read(config, "hisparse_host_num_blocks") is not None:
                        self.refuse(
                            "HiSparse", "host-backed pages move beneath the manager", "construction"
                        )
                self._last = self.snapshot()
            except MissingName as err:  # a vLLM name kvspec reads moved (versions.py)
                self.lookups = False
                self.refuse(err.feature, err.detail, "construction")
                self._last = None  # type: ignore[assignment]
        except BaseException:  # no half-made attachment stays on vLLM's objects
            self.wrappers.uninstall()
            raise

    def refuse(self, feature: str, detail: str = "", at: str = "run") -> None:
        if self.refusal is None:
            self.refusal = Refusal(feature, detail, at)

    def detach(self) -> None:
        self.wrappers.uninstall()

    def key(self, value: Hashable) -> int:
        return self.keys.setdefault(value, len(self.keys))

    def snapshot(
        self,
    ) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, Hashable], tuple[int, ...]]:
        """(refcounts with the null block as 0, the free queue head first, block -> key of the
        cached blocks as vLLM's hash map holds them (the frozenset of its keys for a block under
        several), the unpinned blocks still read (vLLM's reuse watchers))."""
        pool = self.pool
        refcounts = (0,) + tuple(b.ref_cnt for b in pool.blocks[1:])
        free = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
        many: dict[int, set[int]] = {}
        for value, ids in cached_block_ids(pool).items():
            for block_id in ids:
                many.setdefault(block_id, set()).add(self.key(value))
        cached: dict[int, Hashable] = {
            block: next(iter(keys)) if len(keys) == 1 else frozenset(keys)
            for block, keys in many.items()
        }
        watched = tuple(read(pool, "_reuse_watchers"))
        return refcounts, free, cached, watched

    def self_check(self) -> str | None:
        """vLLM's blocks carry the hashes its map indexes them under (the first on the block,
        the others in ``cached_block_hashes_by_block``)."""
        mapped = {
            b: set(k) if isinstance(k, frozenset) else {k} for b, k in self.snapshot()[2].items()
        }
        more = read(self.pool, "cached_block_hashes_by_block")
        own = {
            b.block_id: {self.key(h) for h in (b.block_hash, *more.get(b.block_id, ()))}
            for b in self.pool.blocks
            if b.block_hash
        }
        if own != mapped:
            odd = sorted(set(own) ^ set(mapped) or {b for b in own if own[b] != mapped[b]})[:4]
            return f"vLLM's blocks and its hash map disagree at blocks {odd}"
        return None

    # -- calls --------------------------------------------------------------------------------

    def _call(self, name: str, holder: Any, body: Callable[[], Any]) -> Any:
        """An outermost call: check nothing changed since the last, run, tell the listener."""
        outer = self.depth == 0
        if outer:
            self._safe(self._enter, name)
        saved, emitted = self.holder, len(self.events)
        if holder is not None:
            self.holder = self._safe(self._holder, holder)
        self.depth += 1
        try:
            return body()
        except BaseException as err:
            if not (outer and self._rejected(emitted)):
                self.refuse("vLLM raised", f"{type(err).__name__} in {name}()")
            raise
        finally:
            self.depth -= 1
            self.holder = saved
            if outer:
                self._safe(self._exit)

    def _rejected(self, emitted: int) -> bool:
        """vLLM raised in an outermost call that emitted no event and left the pool as it was
        before the call (``snapshot``): a rejected call, a no-op the pool machine judges as
        such (vLLM's guard of ``cache_partial_block`` against a tail off the hash boundary,
        say). Anything else it left is unknown to the spec: refused."""
        if self.refusal is not None or len(self.events) != emitted:
            return False
        try:
            return bool(self.snapshot() == self._last)
        except Exception:  # vLLM's state unreadable after its exception
            return False

    def _enter(self, name: str) -> None:
        if self.refusal is not None:
            return
        why = self.wrappers.tampered()
        if why is not None:
            self.refuse("vLLM method patched by the test", why)
        elif self.manager is not None and self.manager.block_pool is not self.pool:
            self.refuse("block pool replaced", "after construction")
        elif self.snapshot() != self._last:
            self.refuse("state edited between calls", f"before {name}()")

    def _exit(self) -> None:
        if self.refusal is None:
            self._last = self.snapshot()
        if self.listener is not None:
            self.listener(self)

    def _holder(self, request: Any) -> int:
        request_id = request if isinstance(request, str) else request.request_id
        return self.ids.setdefault(request_id, len(self.ids))

    def _safe(self, fn: Callable[..., Any], *args: Any) -> Any:
        return guarded(self, fn, *args)

    # -- wrappers -----------------------------------------------------------------------------

    def _wrap(self) -> None:
        pool, w = self.pool, self.wrappers
        for name, make in (
            ("get_new_blocks", self._get_new_blocks),
            ("touch", self._touch),
            ("free_blocks", self._free_blocks),
            ("_insert_block_hash", self._insert),
            ("_remove_cached_block_hashes", self._evict),
            ("reset_prefix_cache", self._reset),
            ("move_block_hashes", self._move),
            ("unpin_blocks", self._unpin),
            ("cache_full_blocks", self._passing("cache_full_blocks")),
            ("cache_partial_block", self._passing("cache_partial_block")),
            ("evict_blocks", self._passing("evict_blocks")),
        ):
            w.install(pool, name, make)
        manager = self.manager
        if manager is None:
            return
        w.install(manager, "get_computed_blocks", self._get_computed_blocks)
        w.install(manager, "allocate_slots", self._allocate_slots)
        for name in ("free", "cache_blocks", "remove_skipped_blocks"):
            w.install(manager, name, self._for_request(name))
        w.install(manager, "pop_blocks_for_free", self._pop_blocks_for_free)

    def _passing(self, name: str) -> Callable[[Method], Method]:
        """A pool method whose effects the wrapped methods below it report: only an outermost
        call's boundaries."""

        def make(original: Method) -> Method:
            def wrapper(*args: Any, **kw: Any) -> Any:
                return self._call(name, None, lambda: original(*args, **kw))

            return wrapper

        return make

    def _for_request(self, name: str) -> Callable[[Method], Method]:
        def make(original: Method) -> Method:
            def wrapper(request: Any, *args: Any, **kw: Any) -> Any:
                return self._call(name, request, lambda: original(request, *args, **kw))

            return wrapper

        return make

    def _get_computed_blocks(self, original: Method) -> Method:
        def get_computed_blocks(request: Any, *args: Any, **kw: Any) -> Any:
            def body() -> Any:
                result = original(request, *args, **kw)
                if self.lookups:
                    self._safe(self._lookup, request, result, args, kw)
                return result

            return self._call("get_computed_blocks", request, body)

        return get_computed_blocks

    def _lookup(self, request: Any, result: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        manager = self.manager
        cap = max_cache_hit_length(
            request, kw.get("max_cache_hit_length", args[0] if args else None)
        )
        block_size = manager.coordinator.single_type_managers[0].block_size
        keys: tuple[int, ...] = ()
        if manager.prefix_cache_lookup_enabled(request):
            hashes = request.block_hashes[: cap // block_size]
            keys = tuple(self.key(make_block_hash_with_group_id(h, 0)) for h in hashes)
        hits = tuple(b.block_id for b in result[0].blocks[0]) if result[0].blocks else ()
        self.events.append(("lookup", self.holder, keys))
        self.events.append(("hit", self.holder, hits))

    def _allocate_slots(self, original: Method) -> Method:
        def allocate_slots(request: Any, *args: Any, **kw: Any) -> Any:
            names = ("num_new_tokens", "num_new_computed_tokens", "new_computed_blocks")
            given = dict(zip(names, args, strict=False)) | kw
            hits = given.get("new_computed_blocks")

            def body() -> Any:
                self._safe(self._slots, hits)
                copies = self._safe(self._pending_copies)
                try:
                    return original(request, *args, **kw)
                finally:
                    self._safe(self._retained, request, copies)
                    self.events.append(("slots_done", self.holder))

            return self._call("allocate_slots", request, body)

        return allocate_slots

    def _pending_copies(self) -> list[tuple[Any, int]]:
        """Each group's queue of copy-on-write pairs and its length now."""
        managers = self.manager.coordinator.single_type_managers
        return [(m, len(read(m, "_pending_cow_copies"))) for m in managers]

    def _retained(self, request: Any, before: list[tuple[Any, int]] | None) -> None:
        """The copy-on-write pairs this call queued: one reference on each endpoint is the
        caller's (the endpoint the request's table holds got a new one, the other is handed
        over from the request)."""
        for manager, length in before or ():
            queue = read(manager, "_pending_cow_copies")
            table = read(manager, "req_to_blocks").get(request.request_id, [])
            for pair in queue[length:]:
                for block in pair:
                    if any(b is block for b in table):
                        self.events.append(("touch", None, (block.block_id,)))
                    else:
                        self.events.append(("give", self.holder, (block.block_id,), None))

    def _pop_blocks_for_free(self, original: Method) -> Method:
        def pop_blocks_for_free(request: Any, *args: Any, **kw: Any) -> Any:
            def body() -> Any:
                blocks = original(request, *args, **kw)
                if self.depth == 1:  # the caller frees them later
                    ids = tuple(b.block_id for b in blocks if not b.is_null)
                    self.events.append(("give", self.holder, ids, None))
                return blocks

            return self._call("pop_blocks_for_free", request, body)

        return pop_blocks_for_free

    def _slots(self, hits: Any) -> None:
        blocks = [b for group in (hits.blocks if hits is not None else ()) for b in group]
        blocks = [b for b in blocks if not b.is_null]
        if any(b.block_hash is None for b in blocks):
            self.refuse("a stale hit handed to allocate_slots", "a hit block is not cached")
        self.events.append(("slots", self.holder, tuple(b.block_id for b in blocks)))

    def _get_new_blocks(self, original: Method) -> Method:
        def get_new_blocks(num_blocks: int, *args: Any, **kw: Any) -> Any:
            def body() -> Any:
                self._allocating, self._evicted = True, []
                try:
                    blocks = original(num_blocks, *args, **kw)
                finally:
                    self._allocating = False
                self.events.append(("allocate", self.holder, num_blocks))
                evicted = set(self._evicted)
                for block in blocks:
                    if block.block_id in evicted:
                        self.events.append(("evicted", block.block_id))
                    self.events.append(("alloc", self.holder, block.block_id))
                return blocks

            return self._call("get_new_blocks", None, body)

        return get_new_blocks

    def _touch(self, original: Method) -> Method:
        def touch(blocks: Any, *args: Any, **kw: Any) -> None:
            def body() -> None:
                blocks_ = list(blocks)
                self._safe(self._foreign, blocks_, "touch")
                original(blocks_, *args, **kw)
                ids = tuple(b.block_id for b in blocks_ if not b.is_null)
                self.events.append(("touch", self.holder, ids))

            return self._call("touch", None, body)  # type: ignore[no-any-return]

        return touch

    def _free_blocks(self, original: Method) -> Method:
        def free_blocks(ordered_blocks: Iterable[Any], *args: Any, **kw: Any) -> None:
            def body() -> None:
                blocks = list(ordered_blocks)
                self._safe(self._free_features, blocks)
                if self._safe(evict_first, args, kw):
                    self.refuse(*EVICT_FIRST)
                ids = tuple(b.block_id for b in blocks if not b.is_null)
                self.events.append(("free", self.holder, ids))
                original(blocks, *args, **kw)

            return self._call("free_blocks", None, body)  # type: ignore[no-any-return]

        return free_blocks

    def _foreign(self, blocks: Iterable[Any], where: str) -> None:
        """Blocks that are not this pool's own objects (another pool's, or built by the test)."""
        pool = self.pool.blocks
        for b in blocks:
            if not (0 <= b.block_id < len(pool)) or pool[b.block_id] is not b:
                self.refuse("blocks that are not the pool's", f"block {b.block_id} in {where}")
                return

    def _free_features(self, blocks: list[Any]) -> None:
        self._foreign(blocks, "free_blocks")
        if self.manager is not None and self.depth == 1:  # a direct call on a manager's pool
            held = {
                b.block_id
                for m in self.manager.coordinator.single_type_managers
                for table in m.req_to_blocks.values()
                for b in table
            }
            mine = self._caller_references()
            for b in blocks:
                if b.block_id in held and not mine.get(b.block_id):
                    self.refuse("pool driven beneath its manager", "a request's block freed")
                mine[b.block_id] = mine.get(b.block_id, 0) - 1

    def _caller_references(self) -> dict[int, int]:
        """The references the events give the caller (holder ``None``) and it has not freed."""
        count: dict[int, int] = {}
        for event in self.events:
            if event[0] in ("touch", "alloc", "free", "unpin", "give"):
                if event[0] == "give" and event[3] is None and event[1] is not None:
                    blocks, sign = event[2], 1
                elif event[1] is not None:
                    continue
                elif event[0] == "alloc":
                    blocks, sign = (event[2],), 1
                else:
                    blocks, sign = event[2], 1 if event[0] == "touch" else -1
                for block in blocks:  # type: ignore[attr-defined]
                    count[block] = count.get(block, 0) + sign
        return count

    def _insert(self, original: Method) -> Method:
        def insert(block_hash_with_group_id: Any, block: Any, *args: Any, **kw: Any) -> None:
            key = block_hash_with_group_id

            def body() -> None:
                self._safe(self._foreign, (block,), "_insert_block_hash")
                before = block.block_hash
                had = before == key or self._safe(self._carries, key, block)
                original(key, block, *args, **kw)
                if self._moving:
                    return
                if before is None and block.block_hash is not None:
                    self.events.append(("publish", self.holder, block.block_id, self.key(key)))
                elif before is not None and not had:
                    self.events.append(("alias", self.holder, block.block_id, self.key(key)))

            return self._call("_insert_block_hash", None, body)  # type: ignore[no-any-return]

        return insert

    def _carries(self, key: Any, block: Any) -> bool:
        return bool(read(self.pool, "cached_block_hash_to_block").contain(key, block.block_id))

    def _evict(self, original: Method) -> Method:
        def remove_cached_block_hashes(block: Any, *args: Any, **kw: Any) -> Any:
            def body() -> Any:
                cached = block.block_hash is not None
                removed = original(block, *args, **kw)
                if not cached or self._moving:
                    return removed
                if self._allocating:
                    self._evicted.append(block.block_id)
                else:
                    self.events.append(("evict", block.block_id))
                return removed

            return self._call("_remove_cached_block_hashes", None, body)

        return remove_cached_block_hashes

    def _move(self, original: Method) -> Method:
        def move_block_hashes(src: Any, dst: Any, *args: Any, **kw: Any) -> Any:
            def body() -> Any:
                self._safe(self._foreign, (src, dst), "move_block_hashes")
                self._moving = True
                try:
                    result = original(src, dst, *args, **kw)
                finally:
                    self._moving = False
                self.events.append(("move", self.holder, src.block_id, dst.block_id))
                return result

            return self._call("move_block_hashes", None, body)

        return move_block_hashes

    def _unpin(self, original: Method) -> Method:
        def unpin_blocks(blocks: Iterable[Any], *args: Any, **kw: Any) -> Any:
            def body() -> Any:
                blocks_ = list(blocks)
                self._safe(self._foreign, blocks_, "unpin_blocks")
                ids = tuple(b.block_id for b in blocks_)
                self.events.append(("unpin", self.holder, ids))
                return original(blocks_, *args, **kw)

            return self._call("unpin_blocks", None, body)

        return unpin_blocks

    def _reset(self, original: Method) -> Method:
        def reset_prefix_cache(*args: Any, **kw: Any) -> bool:
            def body() -> bool:
                done = bool(original(*args, **kw))
                if done:
                    self.events.append(("reset",))
                return done

            return self._call("reset_prefix_cache", None, body)  # type: ignore[no-any-return]

        return reset_prefix_cache


def _plain_lookups(manager: Any) -> bool:
    """Whether the manager's lookups are the pool machine's: a prefix run over one group."""
    coordinator = manager.coordinator
    if not isinstance(coordinator, UnitaryKVCacheCoordinator):
        return False
    single = coordinator.single_type_managers[0]
    return (
        type(single.kv_cache_spec) is FullAttentionSpec
        and manager.block_pool.hash_block_size == single.block_size
        and not read(coordinator, "drop_eagle_group_ids")
        and not read(coordinator, "enable_partial_hash_hits")
        and read(coordinator, "dcp_world_size") == 1
        and not read(manager.block_pool, "num_hash_lookahead_tokens")
    )


def attach_pool(
    target: Any, listener: Callable[[PoolAttachment], None] | None = None
) -> PoolAttachment:
    """Attach to a ``KVCacheManager`` or a ``BlockPool`` the caller built."""
    return PoolAttachment(target, listener)
