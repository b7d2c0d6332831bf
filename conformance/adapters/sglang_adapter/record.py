"""SGLang's own memory operations as kvspec effect events, by wrapping methods of the real objects
on the instance (no file of SGLang is changed), and the views of SGLang's state that the events and
``snapshot`` read.

* ``RadixCache.kv_events.record_store`` (a new tree node): ``publish`` of each of its pages at its
  position in the request's key (the request whose insert runs is ``Recorder.acting``);
* ``record_remove`` (an evicted node): its pages, held in ``evicted`` until the decision they belong
  to says whether each is allocated again at once (``evict`` before its ``alloc``) or left free
  (``unpublish``);
* ``RadixCache.checkpoint`` (an insert of a running request): ``dedup`` for each row position it
  repointed at the tree's page; at a request's final insert (``Recorder.finishing``) its copies
  are simply freed, which its ``free`` events say.

SGLang's page 0 is its padding slot, so its pages 1..N-1 are the spec's blocks 1..N-1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .build import RadixCache, Req, TreeNode

Event = tuple[object, ...]


def rid(req: Req) -> int:
    """The kvspec id of a request (SGLang's ``rid`` is its string)."""
    return int(req.rid)


class Recorder:
    def __init__(self, tree: RadixCache, pool: Any, page_size: int, events: list[Event]) -> None:
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

    def tree_pages(self) -> list[tuple[int, TreeNode]]:
        pages, stack = [], [self.tree.root_node]
        while stack:
            node = stack.pop()
            if node is not self.tree.root_node and node.value is not None:
                pages += [(int(s) // self.page_size, node) for s in node.value[:: self.page_size]]
            stack += list(node.children.values())
        return pages

    def _depth(self, node: TreeNode) -> int:
        """Tokens on the path above ``node``."""
        tokens = 0
        node = node.parent
        while node is not None and node is not self.tree.root_node:
            tokens += len(node.key)
            node = node.parent
        return tokens

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
        tree, recorder = self.tree, self.tree.kv_events
        record_store, record_remove, checkpoint = (
            recorder.record_store,
            recorder.record_remove,
            tree.checkpoint,
        )

        def record_store_(node: TreeNode, *args: Any, **kw: Any) -> None:
            req = self.acting
            if req is None:
                raise AssertionError("SGLang inserted into its tree outside a request's insert")
            first = self._depth(node) // self.page_size
            for i, slot in enumerate(node.value[:: self.page_size].tolist()):
                self.events.append(("publish", rid(req), first + i, int(slot) // self.page_size))
            record_store(node, *args, **kw)

        def record_remove_(node: TreeNode, *args: Any, **kw: Any) -> None:
            self.evicted += [int(s) // self.page_size for s in node.value[:: self.page_size]]
            record_remove(node, *args, **kw)

        def checkpoint_(req: Req, *args: Any, **kw: Any) -> Any:
            before = self.row(req)
            result = checkpoint(req, *args, **kw)
            if not self.finishing:
                after = self.row(req)
                for index, (old, new) in enumerate(zip(before, after, strict=True)):
                    if old != new:
                        self.events.append(("dedup", rid(req), index, new))
            return result

        recorder.record_store = record_store_
        recorder.record_remove = record_remove_
        tree.checkpoint = checkpoint_
