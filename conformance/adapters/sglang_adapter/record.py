"""SGLang's own memory operations as kvspec effect events, by wrapping methods of the real objects
on the instance (no file of SGLang is changed), and the views of SGLang's state that the events and
``snapshot`` read. One recorder per kind of tree (``build.TREES``), the same events from each:

* a tree insert by a running or finishing request (``Recorder.acting``): ``publish`` of each new
  page at its position in the request's key. ``LegacyRecorder`` hooks ``RadixCache``'s
  ``kv_events.record_store`` (a new node); ``UnifiedRecorder`` compares the tree's pages before
  and after ``UnifiedRadixCache.insert``, read through SGLang's backend-neutral
  ``TreeCore.walk_for_kv_canary`` (every FULL slot with its position), since the Rust
  ``TreeCore``, SGLang's default, exposes no nodes;
* an eviction (``RadixCache``'s ``record_remove``; ``UnifiedRadixCache._evict``, which both
  ``evict`` and ``evict_for_alloc`` run): its pages, held in ``evicted`` until the decision they
  belong to says whether each is allocated again at once (``evict`` before its ``alloc``) or
  left free (``unpublish``);
* ``checkpoint`` (an insert of a running request): ``dedup`` for each row position it repointed
  at the tree's page; at a request's final insert (``Recorder.finishing``) its copies are simply
  freed, which its ``free`` events say.

Lock state: ``locks`` gives each tree page's ``lock_ref`` where SGLang keeps it on a node that
Python can read (``RadixCache``, the Python ``TreeCore``); the Rust ``TreeCore`` says only which
pages are unlocked (``walk_for_kv_canary(unlocked_only=True)``), and ``snapshot`` counts the others
(``loops.py``). SGLang's page 0 is its padding slot, so its pages 1..N-1 are the spec's blocks
1..N-1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .build import ComponentType, Req, core_backend

Event = tuple[object, ...]


def rid(req: Req) -> int:
    """The kvspec id of a request (SGLang's ``rid`` is its string)."""
    return int(req.rid)


class Recorder:
    """What every tree's recorder shares: the views of the rows, the acting request, the
    evictions to report, the ``checkpoint`` wrapper (``dedup``)."""

    def __init__(self, tree: Any, pool: Any, page_size: int, events: list[Event]) -> None:
        self.tree, self.pool, self.page_size, self.events = tree, pool, page_size, events
        self.acting: Req | None = None
        """The request whose insert or release runs (``record_store`` names it)."""
        self.finishing = False
        """A final insert (``release_kv_cache``): no ``dedup``, the copies are freed."""
        self.evicted: list[int] = []
        """Pages of evicted nodes, not reported yet."""
        self._wrap()

    # -- views of SGLang's state ----------------------------------------------------------------

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def row(self, req: Req) -> list[int]:
        """The pages of the request's req-to-token row, in order: its block table."""
        if not req.kv.holds_kv:
            return []
        slots = self.pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len]
        return [int(s) // self.page_size for s in slots[:: self.page_size].tolist()]

    def tables(self, req: Req) -> list[list[int]]:
        """The request's block table per KV-cache group (one group: its row)."""
        return [self.row(req)]

    def repointed(self, req: Req, group: int, before: list[int], after: list[int]) -> list[Event]:
        """The events of an insert that changed a running request's table: ``dedup`` where a
        position now names the tree's page (the group after the fields of a group above 0),
        ``free`` where SGLang dropped the request's page and left the position null (an SWA slot
        behind the window, freed at insert), last block first."""
        out: list[Event] = []
        frees: list[Event] = []
        for index, (old, new) in enumerate(zip(before, after, strict=True)):
            if old == new:
                continue
            if new == 0:
                frees.insert(0, ("free", old))
                continue
            event: Event = ("dedup", rid(req), index, new)
            out.append(event + (group,) if group else event)
        return frees + out

    def cached_pages(self) -> dict[int, int]:
        """Every page of the tree, with its position in its key (in pages)."""
        raise NotImplementedError

    def unlocked(self) -> set[int]:
        """The tree's pages no request holds (evictable)."""
        raise NotImplementedError

    def locks(self) -> dict[int, int] | None:
        """Each tree page's ``lock_ref``, or None where SGLang keeps it out of Python's reach."""
        raise NotImplementedError

    # -- reporting ------------------------------------------------------------------------------

    @contextmanager
    def acting_for(self, req: Req, finishing: bool = False) -> Iterator[None]:
        self.acting, self.finishing = req, finishing
        try:
            yield
        finally:
            self.acting, self.finishing = None, False

    def report_evictions(self, allocated: list[tuple[int, int]] = ()) -> None:  # type: ignore[assignment]
        """Report the evicted pages: each one allocated again in ``allocated`` ((request, page)
        in allocation order) as ``evict`` right before its ``alloc``, the allocations, then the
        rest as ``unpublish`` (an eviction left free)."""
        evicted, self.evicted = self.evicted, []
        for owner, page in allocated:
            if page in evicted:
                evicted.remove(page)
                self.events.append(("evict", page))
            self.events.append(("alloc", owner, page))
        self.events += [("unpublish", page) for page in evicted]

    def _wrap(self) -> None:
        checkpoint = self.tree.checkpoint

        def checkpoint_(req: Req, *args: Any, **kw: Any) -> Any:
            before = self.tables(req)
            result = checkpoint(req, *args, **kw)
            if not self.finishing:
                for group, (old_table, new_table) in enumerate(
                    zip(before, self.tables(req), strict=True)
                ):
                    self.events += self.repointed(req, group, old_table, new_table)
            return result

        self.tree.checkpoint = checkpoint_

    def _publish(self, index: int, page: int) -> None:
        req = self.acting
        if req is None:
            raise AssertionError("SGLang inserted into its tree outside a request's insert")
        self.events.append(("publish", rid(req), index, page))


class LegacyRecorder(Recorder):
    """``RadixCache``: its nodes, and its recorder's ``record_store``/``record_remove``."""

    def _nodes(self) -> list[Any]:
        nodes, stack = [], [self.tree.root_node]
        while stack:
            node = stack.pop()
            if node is not self.tree.root_node and node.value is not None:
                nodes.append(node)
            stack += list(node.children.values())
        return nodes

    def _node_pages(self, node: Any) -> list[int]:
        return [int(s) // self.page_size for s in node.value[:: self.page_size].tolist()]

    def cached_pages(self) -> dict[int, int]:
        out = {}
        for node in self._nodes():
            first = self._depth(node) // self.page_size
            out.update({page: first + i for i, page in enumerate(self._node_pages(node))})
        return out

    def locks(self) -> dict[int, int] | None:
        return {page: node.lock_ref for node in self._nodes() for page in self._node_pages(node)}

    def unlocked(self) -> set[int]:
        return {page for page, refs in (self.locks() or {}).items() if refs == 0}

    def _depth(self, node: Any) -> int:
        """Tokens on the path above ``node``."""
        tokens = 0
        node = node.parent
        while node is not None and node is not self.tree.root_node:
            tokens += len(node.key)
            node = node.parent
        return tokens

    def _wrap(self) -> None:
        super()._wrap()
        recorder = self.tree.kv_events
        record_store, record_remove = recorder.record_store, recorder.record_remove

        def record_store_(node: Any, *args: Any, **kw: Any) -> None:
            first = self._depth(node) // self.page_size
            for i, page in enumerate(self._node_pages(node)):
                self._publish(first + i, page)
            record_store(node, *args, **kw)

        def record_remove_(node: Any, *args: Any, **kw: Any) -> None:
            self.evicted += self._node_pages(node)
            record_remove(node, *args, **kw)

        recorder.record_store = record_store_
        recorder.record_remove = record_remove_


class UnifiedRecorder(Recorder):
    """``UnifiedRadixCache`` (FULL component) over either ``TreeCore``: the tree's pages read
    through ``walk_for_kv_canary`` around each ``insert`` and ``_evict``; ``tokens`` keeps, per
    tree page, the tokens of its key up to its end (the KV stream's names, ``kv_stream.py``)."""

    def __init__(self, tree: Any, pool: Any, page_size: int, events: list[Event]) -> None:
        self.tokens: dict[int, tuple[int, ...]] = {}
        super().__init__(tree, pool, page_size, events)

    def _walk(self, unlocked_only: bool, swa: bool = False) -> dict[int, int]:
        """The tree's pages (its SWA component's with ``swa``) to their page positions."""
        walk = self.tree.tree_core.walk_for_kv_canary(unlocked_only, swa)
        ps = self.page_size
        return {
            int(slot) // ps: int(position) // ps
            for slot, position in zip(
                walk.slot_indices.tolist(), walk.positions.tolist(), strict=True
            )
            if int(position) % ps == 0
        }

    def cached_pages(self) -> dict[int, int]:
        return self._walk(False)

    def page_values(self) -> dict[int, int]:
        """The tree's values an insert publishes page by page and an eviction drops (all of
        ``cached_pages``; a state slot, ``mamba.py``, is not a page)."""
        return self.cached_pages()

    def unlocked(self) -> set[int]:
        return set(self._walk(True))

    def locks(self) -> dict[int, int] | None:
        if core_backend(self.tree) != "python":
            return None
        out, stack = {}, [self.tree.tree_core.root_node]
        while stack:
            node = stack.pop()
            stack += list(node.children.values())
            full = node.component_data[ComponentType.FULL]
            if node is self.tree.tree_core.root_node or full.value is None:
                continue
            for slot in full.value[:: self.page_size].tolist():
                out[int(slot) // self.page_size] = full.lock_ref
        return out

    def _wrap(self) -> None:
        super()._wrap()
        tree = self.tree
        insert, evict = tree.insert, tree._evict

        def insert_(params: Any) -> Any:
            before = self.page_values()
            result = insert(params)
            after = self.page_values()
            tokens = tuple(int(t) for t in params.key.raw_token_ids())
            # A hybrid tree's insert may replace a node's value: a tombstoned node's FULL pages
            # give way to the inserting request's (SWAComponent.update_component_on_insert_overlap).
            self.events += [("unpublish", page) for page in before if page not in after]
            for page, index in sorted(after.items(), key=lambda item: item[1]):
                if page not in before:
                    self._publish(index, page)
                    self.tokens[page] = tokens[: (index + 1) * self.page_size]
            return result

        def evict_(*args: Any, **kw: Any) -> Any:
            before = self.page_values()
            result = evict(*args, **kw)
            after = self.page_values()
            self.evicted += [page for page in before if page not in after]
            return result

        tree.insert = insert_
        tree._evict = evict_
