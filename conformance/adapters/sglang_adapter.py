"""SGLang 0.5.23's real ``RadixCache``, paged token-to-KV allocator and req-to-token pool through
the adapter protocol (``kvspec fuzz --target kvspec.conformance.adapters.sglang_adapter:factory``).

Importable only where SGLang 0.5.23 is installed (``make thirdparty`` builds ``.venv-sglang``).
SGLang's scheduler needs a model worker, a tokenizer process and ZMQ sockets, so the adapter runs
a small scheduler loop of its own that calls SGLang's memory objects, and SGLang's own helper
functions over them, in the order SGLang's ``Scheduler`` does with overlap scheduling off (depth
1, one token per request per step; the adapter plays the model runner and draws the token from
``choices``):

==========================================  ====================================================
SGLang call (``sglang.srt.mem_cache``)      when (SGLang's scheduler)
==========================================  ====================================================
``common.checkpoint_kv_cache``              start of a step, for the request being chunked
                                            (``Scheduler.stash_chunked_request``)
``common.match_kv_cache``, ``tree.lock``    admission of a waiting request (``PrefillAdder``);
                                            the match is capped at ``len - 1`` tokens
``allocator.evict_to_free_tokens``,         the batch's allocation (``alloc_for_extend``,
``allocator.alloc_extend`` / ``_decode``    ``alloc_for_decode``): evict, then allocate pages
``common.release_kv_cache(checkpoint=0)``   retraction (``retract_decode``: fewest output
                                            tokens first), then ``evict_from_tree_cache``; abort
``common.checkpoint_kv_cache``              a prefill's result when the request goes on
``common.release_kv_cache(checkpoint=1)``   a request's last result (``cache_finished_req``)
==========================================  ====================================================

Events come from wrapping methods of the real objects on the instance: the tree's KV-event
recorder (``record_store``: a new tree node, ``publish`` of each of its pages at their position in
the request's key; ``record_remove``: an evicted node, ``evict`` of a page allocated again in the
same decision, else ``unpublish``) and ``RadixCache.checkpoint`` (row positions it repointed at the
tree's pages: ``dedup`` while the request runs; at finish its copies are simply freed). ``hit`` is
the path ``match_kv_cache`` locked, ``alloc`` the pages SGLang's allocator wrote into a row past
what it held, ``free`` the row's pages that ``release_kv_cache`` gave back (in reverse order, as
the spec frees a table). Nothing of SGLang's logic is reimplemented: which pages are matched,
allocated, evicted, inserted or deduplicated is SGLang's. ``self_check`` (run by the fuzzer after
every rule) compares the pages the events registered with the pages in SGLang's tree. The request
record (``_Req``) is the adapter's: the fields SGLang's functions read from a ``Req``
(``schedule_batch.Req`` needs a server's arguments to build); its ``kv`` is SGLang's own
``ReqKvInfo``.

How SGLang maps onto the spec (``docs/adapters.md``): policy ``engine-registers`` (SGLang inserts
into its tree after a prefill's result and at finish, and deduplicates on insert), discipline
``general`` (its retraction order is not vLLM's), depth 1, judged in *observed* mode. SGLang's page
0 is its padding slot, so its pages 1..N-1 are the spec's blocks 1..N-1 (page 0 is the null block).
A page's reference count is its tree node's ``lock_ref`` (the requests whose locked path holds it)
or, for a page outside the tree, the number of requests whose row holds it; the free set is the
allocator's free pages and the unlocked tree pages (evictable, like the spec's cached free blocks).

Simplifications, each the adapter's and none SGLang's memory logic: admission follows
``PrefillAdder``'s memory budget in a reduced form (the free and evictable tokens, less the running
requests' remaining ``max_new_tokens`` times SGLang's initial ``new_token_ratio``, must hold the new
request's prompt, its ``max_new_tokens`` and a page); a request's ``max_tokens`` is clipped at
arrival as SGLang's ``max_new_tokens_for_memory`` does; an abort of a request in the step in
flight is refused (SGLang defers it to the step's result). When even the last decoding request
does not fit, SGLang aborts it while building the batch, which the spec cannot say (its ``abort``
is illegal while a step is building): the adapter emits that abort just before the step's
``begin`` (``docs/adapters.md``).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from array import array
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

_found = importlib.util.find_spec("sglang")
if _found is None or not _found.submodule_search_locations:
    raise ImportError(
        "the SGLang adapter needs sglang==0.5.23: run `make thirdparty` and use .venv-sglang/bin/kvspec"
    )


class _Absent(types.ModuleType):
    """A module that is not installed: any attribute is another absent module, a call fails."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.__name__}: torchvision is not installed")


def _import_sglang() -> None:
    """Import SGLang's memory modules on a CPU machine without patching a file of SGLang:

    * the package ``sglang`` as a bare package object, without its ``__init__`` (which imports the
      frontend language, its HTTP backends and Hugging Face patches), as for nano-vllm;
    * ``torchvision`` absent for the time of the import: ``memory_pool`` imports
      ``sglang.srt.configs``, whose ``__init__`` imports every model's config, two of which
      (InternVL, DeepSeek-OCR) import ``torchvision.transforms`` at module level. PyPI's torchvision
      is built against CUDA torch and cannot load next to the CPU build, and nothing on the
      memory path calls it; transformers has decided torchvision is missing before the stand-in
      exists, and the stand-in is removed from ``sys.modules`` afterwards."""
    if "sglang" not in sys.modules:
        package = types.ModuleType("sglang")
        package.__path__ = list(_found.submodule_search_locations or [])
        sys.modules["sglang"] = package
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached: False (a real torchvision is never used)
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    absent = {name: _Absent(name) for name in names if name not in sys.modules}
    sys.modules.update(absent)
    try:
        import sglang.srt.managers.schedule_batch  # noqa: F401
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
    finally:
        for name in absent:
            sys.modules.pop(name, None)


_import_sglang()


def _publish_server_args() -> None:
    """SGLang's helpers read process-wide settings (``runtime_context``: the speculative
    algorithm, thinking-cache stripping, retraction backups) that a server publishes from its
    ``ServerArgs`` at start. Publish the defaults of a CPU server, whose model folder holds only a
    tiny ``config.json`` (nothing is loaded from it)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    from kvspec.conformance.adapters import tiny_model_folder

    if runtime_context.get_context().is_config_namespace_published("spec"):
        return
    folder = tiny_model_folder("sglang")
    args = ServerArgs(model_path=folder, device="cpu", skip_tokenizer_init=True)
    runtime_context.publish(args, role="scheduler")


_publish_server_args()

import torch  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.managers.schedule_batch import ReqKvInfo  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import (  # noqa: E402
    checkpoint_kv_cache,
    evict_from_tree_cache,
    match_kv_cache,
    release_kv_cache,
)
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode  # noqa: E402

from kvspec.reference.choices import Choices  # noqa: E402
from kvspec.spec import Config  # noqa: E402

Event = tuple[object, ...]
VOCAB = 4
"""Sampled tokens are 0 .. VOCAB - 1; token 0 is a stop token (``Config.stop_token``)."""
MAX_CONTEXT = 256
"""Columns of the req-to-token pool: longer than any fuzzed request (prompt + max tokens)."""


def supported(config: Config) -> str | None:
    """Why the SGLang adapter cannot run this cell, or None."""
    if config.policy != "engine-registers":
        return (
            "SGLang inserts pages into its radix tree after a prefill's result and at finish, and "
            f"deduplicates: policy engine-registers, not {config.policy}"
        )
    if config.discipline != "general":
        return f"SGLang retracts the request with the fewest outputs: discipline general, not {config.discipline}"
    if config.preemption != "fcfs":
        return "SGLang's default scheduling and retraction ignore priorities: preemption fcfs"
    if config.depth != 1:
        return f"the adapter runs SGLang's scheduler without overlap (depth 1), not {config.depth}"
    if config.stop_token not in (None, 0):
        return f"the fake model runner's stop token is 0, not {config.stop_token}"
    return None


def factory(config: Config, choices: Choices) -> SglangAdapter:
    """The adapter factory named on the command line."""
    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return SglangAdapter(config, choices)


class _Req:
    """What SGLang's memory functions read from a request (``schedule_batch.Req``'s fields)."""

    def __init__(self, rid: int, prompt: tuple[int, ...], max_tokens: int) -> None:
        self.id = rid
        self.rid = str(rid)
        self.origin_input_ids = array("q", prompt)
        self.output_ids = array("q")
        self.max_tokens = max_tokens
        self.kv = ReqKvInfo()
        self.extra_key: str | None = None
        self.cache_salt: str | None = None
        self.priority = 0
        self.lock: Any = None
        self.last_node: Any = None
        self.best_match_node: Any = None
        self.last_host_node: Any = None
        self.prefix_len = 0
        self.extend_end = 0
        self.skip_radix_cache_insert = False
        self.finished_len: int | None = None
        self.return_logprob = False
        self.logprob_start_len = -1
        self.dllm_config = None
        self.status = "waiting"  # waiting, running, finished

    @property
    def full_untruncated_fill_ids(self) -> array[int]:
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_len is not None

    def owned_kv_len(self) -> int:
        return int(self.kv.kv_committed_len)

    def refresh_fill_ids(self) -> None:
        pass

    def _compute_max_prefix_len(self, input_len: int) -> int:
        return input_len - 1  # SGLang: the last known token is computed (its logits are needed)

    def is_dllm(self) -> bool:
        return False


class SglangAdapter:
    judging = "observed"
    supports_loads = False

    def __init__(self, config: Config, choices: Choices) -> None:
        budget = max(config.token_budget, config.max_running, config.block_size)
        self.config = replace(config, token_budget=budget)
        self.choices = choices
        self.events: list[Event] = []
        ps, pages = config.block_size, config.num_blocks - 1
        self.page_size = ps
        self.pool = ReqToTokenPool(
            size=config.max_running + 1,
            max_context_len=MAX_CONTEXT,
            device="cpu",
            enable_memory_saver=False,
        )
        self.allocator = PagedTokenToKVPoolAllocator(
            pages * ps, ps, torch.float32, "cpu", None, need_sort=False
        )
        self.tree = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=ps,
                enable_kv_cache_events=True,  # its KV events (sglang_kv_stream.py)
            )
        )
        self.requests: dict[int, _Req] = {}
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []  # prefill done, decoding
        self.chunked: _Req | None = None  # mid-prefill (SGLang's chunked_req)
        self.in_flight: tuple[int, str, list[_Req]] | None = None
        self.next_step = 0
        self._current: _Req | None = None  # whose insert or allocation is running
        self._evicted: list[int] = []  # pages of nodes evicted, not yet reported
        self._finishing = False
        self._aborted: list[Event] = []  # an out-of-memory abort, emitted before the step
        self._published: set[int] = set()  # for self_check: pages the events registered
        self._seen = 0
        self._wrap()
        from .sglang_kv_stream import attach

        self.kv_stream = attach(self)

    # -- the protocol ---------------------------------------------------------------------------

    def add_request(
        self,
        rid: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        priority: int,
        external: bool = False,
    ) -> None:
        if external:
            raise ValueError("the SGLang adapter has no external KV loads")
        capacity = (self.config.num_blocks - 1) * self.page_size
        clipped = self.allocator.max_new_tokens_for_memory(
            len(prompt),
            max_tokens,
            token_capacity=capacity,
            sliding_window_size=None,
            chunk_size=None,
        )
        if not clipped:
            return  # SGLang rejects a prompt with no room to generate: no request
        req = _Req(rid, tuple(prompt), int(clipped))
        self.requests[rid] = req
        self.events.append(("arrive", rid, tuple(prompt), req.max_tokens, priority))
        self.waiting.append(req)

    def step(self) -> bool:
        if self.in_flight is not None:
            self._finish_step()
            return True
        if not (self.waiting or self.running or self.chunked):
            return False
        step, begin = self.next_step, len(self.events)
        self.events.append(("begin", step))
        if self.chunked is not None:  # Scheduler.stash_chunked_request
            with self._acting(self.chunked):
                checkpoint_kv_cache(self.chunked, self.tree)
        self._aborted = []
        batch, kind = self._prefill(), "prefill"
        if not batch:
            batch, kind = self._decode(), "decode"
        self.events[begin:begin] = self._aborted  # see _decode: an abort is not a step's
        begin += len(self._aborted)
        if not batch and len(self.events) == begin + 1:
            del self.events[begin]  # nothing could be scheduled
            return bool(self._aborted)
        self.next_step += 1
        self.events.append(("submit", step))
        self.in_flight = (step, kind, batch)
        return True

    def abort(self, rid: int) -> bool:
        req = self.requests.get(rid)
        if req is None or req.status == "finished":
            return False
        if self.in_flight is not None and req in self.in_flight[2]:
            return False  # SGLang finishes it at the step's result; see the module docstring
        self.events.append(("abort", rid))
        if req.kv.holds_kv:
            self._release(req, checkpoint=False)
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
        if self.chunked is req:
            self.chunked = None
        req.status = "finished"
        self.events.append(("finish", rid, "abort"))
        return True

    def reset_prefix_cache(self) -> bool:
        """SGLang's ``flush_cache``: only when no request holds KV and nothing is in flight."""
        if self.in_flight is not None or any(r.kv.holds_kv for r in self.requests.values()):
            return False
        cached = sorted(page for page, _ in self._tree_pages())
        self.tree.reset()
        self.allocator.clear()
        self.events.append(("reset",))
        self.events += [("unpublish", page) for page in cached]
        return True

    def live_requests(self) -> list[int]:
        return [rid for rid, req in self.requests.items() if req.status != "finished"]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        refcounts = [0] * self.config.num_blocks
        free = set(int(p) for p in self.allocator.get_all_free_pages().tolist())
        for page, node in self._tree_pages():
            refcounts[page] = node.lock_ref
            if node.lock_ref == 0:
                free.add(page)
        for req in self.requests.values():
            if req.kv.holds_kv:
                for page in self._row(req)[req.kv.cache_protected_len // self.page_size :]:
                    refcounts[page] += 1
        return tuple(refcounts), tuple(sorted(free))

    def self_check(self) -> str | None:
        """Cross-check the wrappers with SGLang's tree: the pages the events registered and did
        not drop (``publish`` less ``evict``, ``unpublish``, ``reset``) are the tree's pages."""
        for event in self.events[self._seen :]:
            if event[0] == "publish":
                self._published.add(event[3])  # type: ignore[arg-type]
            elif event[0] in ("evict", "unpublish"):
                self._published.discard(event[1])  # type: ignore[arg-type]
            elif event[0] == "reset":
                self._published.clear()
        self._seen = len(self.events)
        tree = {page for page, _ in self._tree_pages()}
        if tree != self._published:
            return (
                f"SGLang's tree holds pages {sorted(tree)}; the events registered "
                f"{sorted(self._published)}"
            )
        return None

    def check_kv_stream(self, judge: Any) -> Any:
        """The stream SGLang's publisher sent, judged (``sglang_kv_stream.py``)."""
        return None if self.kv_stream is None else self.kv_stream.check(judge)

    # -- the scheduler loop (SGLang's order) ----------------------------------------------------

    def _prefill(self) -> list[_Req]:
        """``get_new_batch_prefill``: the chunked request first, then waiting ones in order, while
        the token budget, the running limit and ``PrefillAdder``'s memory budget allow: the free
        and evictable tokens, less what running requests may still decode (their remaining
        ``max_new_tokens`` times SGLang's initial ``new_token_ratio``), must hold a new request's
        prompt, its own ``max_new_tokens`` and a page of alignment overhead."""
        budget, batch, ps = self.config.token_budget, [], self.page_size
        ratio = envs.SGLANG_INIT_NEW_TOKEN_RATIO.get()
        room = self.allocator.available_size() + self.tree.evictable_size()
        room -= sum((r.max_tokens - len(r.output_ids)) * ratio for r in self.running)
        candidates = ([self.chunked] if self.chunked is not None else []) + list(self.waiting)
        self.chunked = None
        for req in candidates:
            admission = req.status == "waiting"
            if admission and len(self.running) + len(batch) >= self.config.max_running:
                break
            fill = len(req.full_untruncated_fill_ids)
            if admission:
                match_kv_cache(req, self.tree, max_prefix_len=fill - 1)
                req.kv.cache_protected_len = req.prefix_len  # Req.init_next_round_input
                req.lock = self.tree.lock(req.last_node)
            prefix = req.prefix_len
            extend = fill - prefix
            if extend > budget:  # chunk at a page boundary (PrefillAdder)
                extend = (prefix + budget) // ps * ps - prefix
            new_tokens = (self._pages(prefix + extend) - self._pages(prefix)) * ps
            free = self.allocator.available_size() + self.tree.evictable_size()
            need = fill - prefix + req.max_tokens - len(req.output_ids) + ps if admission else 0
            used = sum(self._pages(r.extend_end) - self._pages(r.prefix_len) for r in batch) * ps
            if extend <= 0 or new_tokens > free - used or need > room:
                if admission:
                    self.tree.unlock(req.lock)
                    req.lock = None
                else:
                    self.chunked = req  # it keeps its row and goes on in a later step
                break
            room -= need
            if admission:
                self.waiting.remove(req)
                req.status = "running"
            req.extend_end = prefix + extend
            if req.extend_end < fill:
                self.chunked = req
            budget -= extend
            batch.append(req)
        if batch:
            self._alloc_extend(batch)
        return batch

    def _alloc_extend(self, batch: list[_Req]) -> None:
        """``alloc_for_extend``: rows, eviction, ``alloc_extend``, the rows written."""
        new = [r for r in batch if not r.kv.holds_kv]
        if new:
            self.pool.alloc(new)
        prefix_lens = torch.tensor([r.prefix_len for r in batch], dtype=torch.int64)
        seq_lens = torch.tensor([r.extend_end for r in batch], dtype=torch.int64)
        last_loc = torch.tensor(
            [self._slot(r, r.prefix_len - 1) if r.prefix_len else -1 for r in batch],
            dtype=torch.int64,
        )
        extend = int((seq_lens - prefix_lens).sum())
        demand = self.allocator.get_extend_allocation_demand(
            prefix_lens,
            seq_lens,
            conservative_num_tokens=extend + len(batch) * self.page_size,
            shard_size=1,
        )
        pieces: list[Event] = [("schedule", r.id, r.extend_end - r.prefix_len, 0) for r in batch]
        hits = {r.id: self._hit(r) for r in batch if r.kv.kv_allocated_len == 0}
        evict_from_tree_cache(self.tree, demand)
        out = self.allocator.alloc_extend(
            prefix_lens, prefix_lens, seq_lens, seq_lens, last_loc, extend
        )
        if out is None:
            raise AssertionError("SGLang's allocator refused an extend the adapter admitted")
        at = 0
        evicted, self._evicted = self._evicted, []
        for req, decision in zip(batch, pieces, strict=True):
            count = req.extend_end - req.prefix_len
            if req.id in hits and req.prefix_len:  # the matched prefix: the tree's pages
                prefix = self.tree.prefix_device_indices(req)
                self.pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
            self.pool.write(
                (req.kv.req_pool_idx, slice(req.prefix_len, req.extend_end)), out[at : at + count]
            )
            at += count
            before = self._pages(max(req.kv.kv_allocated_len, req.prefix_len))
            req.kv.kv_allocated_len = req.extend_end
            self.events.append(decision)
            if req.id in hits:
                self.events.append(("hit", req.id, hits[req.id]))
            for page in self._row(req)[before:]:
                if page in evicted:
                    evicted.remove(page)
                    self.events.append(("evict", page))
                self.events.append(("alloc", req.id, page))
        self.events += [("unpublish", page) for page in evicted]

    def _decode(self) -> list[_Req]:
        """``update_running_batch``: retract while the step's pages do not fit, then
        ``alloc_for_decode``."""
        batch = list(self.running)
        if not batch:
            return []
        order = sorted(
            batch, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True
        )
        while len(order) > 1 and self._decode_pages(order) * self.page_size > (
            self.allocator.available_size() + self.tree.evictable_size()
        ):
            victim = order.pop()  # SGLang's retract_decode: fewest outputs, longest prompt
            self.events.append(("preempt", victim.id))
            self._release(victim, checkpoint=False)
            evict_from_tree_cache(self.tree, len(order) * envs.SGLANG_RETRACT_DECODE_STEPS.get())
            self.events += [("unpublish", page) for page in self._evicted]
            self._evicted = []
            self.running.remove(victim)
            victim.status = "waiting"
            victim.kv = ReqKvInfo()
            victim.prefix_len, victim.lock, victim.last_node = 0, None, None
            self.waiting.insert(0, victim)
        batch = [r for r in batch if r in order]
        if self._decode_pages(batch) * self.page_size > (
            self.allocator.available_size() + self.tree.evictable_size()
        ):  # retract_decode aborts the last request: out of memory even alone
            victim, start = batch.pop(), len(self.events)
            self.events.append(("abort", victim.id))
            self._release(victim, checkpoint=False)
            self.running.remove(victim)
            victim.status = "finished"
            self.events.append(("finish", victim.id, "abort"))
            self._aborted = self.events[start:]
            del self.events[start:]
        if not batch:
            return []
        seq_lens = torch.tensor([r.kv.kv_allocated_len + 1 for r in batch], dtype=torch.int64)
        last_loc = torch.tensor([self._slot(r, r.kv.kv_allocated_len - 1) for r in batch])
        evict_from_tree_cache(self.tree, self._decode_pages(batch) * self.page_size)
        out = self.allocator.alloc_decode(seq_lens, seq_lens, last_loc)
        if out is None:
            raise AssertionError("SGLang's allocator refused a decode the adapter scheduled")
        evicted, self._evicted = self._evicted, []
        for req, slot in zip(batch, out.tolist(), strict=True):
            position = req.kv.kv_allocated_len
            self.pool.write((req.kv.req_pool_idx, position), slot)
            before = self._pages(position)
            req.kv.kv_allocated_len = position + 1
            req.extend_end = position + 1
            self.events.append(("schedule", req.id, 1, 0))
            for page in self._row(req)[before:]:
                if page in evicted:
                    evicted.remove(page)
                    self.events.append(("evict", page))
                self.events.append(("alloc", req.id, page))
        self.events += [("unpublish", page) for page in evicted]
        return batch

    def _finish_step(self) -> None:
        """The model runner, then ``process_batch_result_prefill`` / ``_decode``."""
        assert self.in_flight is not None
        step, kind, batch = self.in_flight
        self.in_flight = None
        self.events.append(("execute", step, ()))
        done = [r for r in batch if r.extend_end == len(r.full_untruncated_fill_ids)]
        sampled = [(r, self.choices.pick(VOCAB, "sglang-token")) for r in done]
        self.events.append(("commit", step, tuple((r.id, t) for r, t in sampled)))
        for req in batch:
            req.kv.kv_committed_len = req.extend_end
        tokens = dict((r.id, t) for r, t in sampled)
        for req in batch:
            if req.id not in tokens:
                continue  # a chunk: stashed at the next step
            token = tokens[req.id]
            req.output_ids.append(token)
            reason = "stop" if token == 0 else None
            if reason is None and len(req.output_ids) >= req.max_tokens:
                reason = "length"
            if reason is not None:
                req.finished_len = len(req.output_ids)
                self._release(req, checkpoint=True)
                if req in self.running:
                    self.running.remove(req)
                req.status = "finished"
                self.events.append(("finish", req.id, reason))
                continue
            if kind == "prefill":
                with self._acting(req):
                    checkpoint_kv_cache(req, self.tree)
                self.running.append(req)

    def _release(self, req: _Req, checkpoint: bool) -> None:
        """``release_kv_cache``: (at finish) insert, then free the row and unlock. The request's
        references are dropped in reverse table order (``free``), its table as it was before."""
        table = self._row(req)
        self._finishing = True
        try:
            with self._acting(req):
                release_kv_cache(req, self.tree, checkpoint=checkpoint)
        finally:
            self._finishing = False
        self.events += [("free", page) for page in reversed(table)]

    # -- reading SGLang's state -----------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _decode_pages(self, batch: list[_Req]) -> int:
        return sum(1 for r in batch if r.kv.kv_allocated_len % self.page_size == 0)

    def _slot(self, req: _Req, position: int) -> int:
        return int(self.pool.req_to_token[req.kv.req_pool_idx, position])

    def _row(self, req: _Req) -> list[int]:
        """The pages of the request's row: its table, in order."""
        if not req.kv.holds_kv:
            return []
        slots = self.pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len]
        return [int(s) // self.page_size for s in slots[:: self.page_size].tolist()]

    def _hit(self, req: _Req) -> tuple[int, ...]:
        path = self.tree.path_device_indices(req.last_node)[: req.prefix_len]
        return tuple(int(s) // self.page_size for s in path[:: self.page_size].tolist())

    def _tree_pages(self) -> list[tuple[int, TreeNode]]:
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

    # -- the wrapped methods --------------------------------------------------------------------

    @contextmanager
    def _acting(self, req: _Req) -> Any:
        self._current = req
        try:
            yield
        finally:
            self._current = None

    def _wrap(self) -> None:
        tree, recorder = self.tree, self.tree.kv_events
        record_store, record_remove, checkpoint = (
            recorder.record_store,
            recorder.record_remove,
            tree.checkpoint,
        )

        def record_store_(node: TreeNode, *args: Any, **kw: Any) -> None:
            req = self._current
            if req is None:
                raise AssertionError("SGLang inserted into its tree outside a request's insert")
            first = self._depth(node) // self.page_size
            for i, slot in enumerate(node.value[:: self.page_size].tolist()):
                self.events.append(("publish", req.id, first + i, int(slot) // self.page_size))
            record_store(node, *args, **kw)

        def record_remove_(node: TreeNode, *args: Any, **kw: Any) -> None:
            self._evicted += [int(s) // self.page_size for s in node.value[:: self.page_size]]
            record_remove(node, *args, **kw)

        def checkpoint_(req: _Req, *args: Any, **kw: Any) -> Any:
            before = self._row(req)
            result = checkpoint(req, *args, **kw)
            if not self._finishing:
                after = self._row(req)
                for index, (old, new) in enumerate(zip(before, after, strict=True)):
                    if old != new:
                        self.events.append(("dedup", req.id, index, new))
            return result

        recorder.record_store = record_store_
        recorder.record_remove = record_remove_
        tree.checkpoint = checkpoint_
