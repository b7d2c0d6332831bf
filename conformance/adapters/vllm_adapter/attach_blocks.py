"""The KV-cache manager's and the pool's calls: the part of ``Attachment`` (``attach.py``) that
wraps ``KVCacheManager.allocate_slots`` (the ``schedule`` decision, its ``hit`` at admission, the
effects recorded inside it), ``cache_blocks``, ``pop_blocks_for_free``, ``take_events`` and the
``BlockPool``'s ``get_new_blocks``, ``touch``, eviction, ``_insert_block_hash`` (``publish``)
and ``free_blocks``, and checks the request's block hashes against its tokens.

Effects recorded inside ``allocate_slots`` wait for its decision (``_effect``); a window's or a
state group's blocks freed there are the decision's effects too. The attachment's state lives in
``Attachment``; this class only groups its methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from vllm.v1.request import Request, RequestStatus

from kvspec.spec.actions import loadable

from . import groups as hybrid_groups
from .attach_steps import Event
from .features import hasher_lookahead, lora_skips, passed_over
from .methods import Method
from .versions import evict_first, max_cache_hit_length, prefix_read_limit, read

EVICT_FIRST = ("freed cached blocks to the free queue's head", "free_blocks(evict_first=True)")
"""vLLM 0.34.0's ``free_blocks(..., evict_first=True)``: not the spec's free order."""


class BlockCalls:
    """``Attachment``'s wrappers of the KV-cache manager's and the pool's calls."""

    def _pop_blocks_for_free(self, original: Method) -> Method:
        def pop_blocks_for_free(request: Request, *args: Any, **kw: Any) -> Any:
            """``defer_block_free``: the request's table is given up, its references kept (the
            spec's ``Deferred`` holder, made by the ``finish``/``preempt``/``abort`` around it);
            the ``free`` events come when ``_drain_deferred_frees`` frees the blocks."""
            self._inner("pop_blocks_for_free")
            if not self.config.defer_free:
                self.refuse("deferred block free", "pop_blocks_for_free() without defer_free")
            return original(request, *args, **kw)

        return pop_blocks_for_free

    def _cache_blocks(self, original: Method) -> Method:
        def cache_blocks(request: Request, num_computed_tokens: int, *args: Any, **kw: Any) -> None:
            self._inner("cache_blocks")
            self._owner = request  # async scheduling, after the output; a landed load
            before = len(self.events)
            try:
                original(request, num_computed_tokens, *args, **kw)
            finally:
                self._owner = None
            if request.request_id in self.loads.waiting:
                # _update_waiting_for_remote_kv: the spec registers these when the request's
                # schedule decision comes (Config.delay_load_registration), so they wait for it
                self.loads.landing[request.request_id] = self.events[before:]
                del self.events[before:]

        return cache_blocks

    def _take_events(self, original: Method) -> Method:
        def take_events(*args: Any, **kw: Any) -> list[Any]:
            events = original(*args, **kw)
            self.native += events
            return events  # type: ignore[no-any-return]

        return take_events

    def _allocate_slots(self, original: Method) -> Method:
        def allocate_slots(request: Request, num_new_tokens: int, *args: Any, **kw: Any) -> Any:
            self._inner("allocate_slots")
            landed = request.request_id in self.loads.waiting  # running, to the spec
            waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            admission = waiting and not landed
            hits = kw.get("new_computed_blocks", args[1] if len(args) > 1 else None)
            slots = self._safe(self._slots_features, request, num_new_tokens, args, kw)
            loaded, extra = slots or (0, 0)
            bound = self._hit_bounds.pop(request.request_id, None) if admission else None
            if admission:
                self._safe(self._admission_room, request)
                if self._safe(read, self.scheduler, "aux_output_connector") is not None:
                    self._safe(self._bounded_hit, request, hits)
                if bound is not None and self.hybrid:
                    self.refuse("bounded prefix-cache hit across groups", request.request_id)
                for feature in self._safe(lora_skips, self.scheduler, request) or ():
                    self.refuse(*feature)
                waiting_loads = self.loads.waiting
                for feature in (
                    self._safe(passed_over, self.scheduler, request, waiting_loads) or ()
                ):
                    self.refuse(*feature)
            rid = self.ids.get(request.request_id)
            self._current, self._current_request = rid, request
            self._pending, self._touched = [], []
            try:
                result = original(request, num_new_tokens, *args, **kw)
            finally:
                pending, self._current, self._current_request = self._pending, None, None
                self._pending = []
            if result is None:
                if pending and self._windowed and rid is not None:
                    # vLLM freed the blocks no step reads any more (a window's, a state
                    # group's), then found no room: the spec's trim, before the preemption
                    self.events.append(("trim", rid))
                    self.events.extend(pending)
                elif pending and self._windowed:
                    self.refuse("sliding window: skipped blocks freed by a failed allocation", "")
                    self.events.extend(pending)
                elif pending:
                    self.problems.append(f"allocate_slots failed after effects {pending}")
                return None
            decision = ("schedule", rid, num_new_tokens + extra, loaded)
            self.events.append(decision if bound is None else (*decision, bound))
            self._extra += extra
            if admission and self.hybrid:
                hit = hybrid_groups.hit_events(self, rid, hits)
            elif admission:
                blocks = hits.blocks[0] if hits is not None else []
                hit = tuple(b.block_id for b in blocks)
                self.events.append(("hit", rid, hit))
            if admission:
                if tuple(self._touched) != tuple(b for b in hit if b):  # a window's nulls
                    self.problems.append(f"r{rid} hit {hit} but vLLM touched {self._touched}")
                # every hash the lookup read, not only the hits: a hash that is not the
                # tokens' (LoRA, ...) may be what made it miss
                self._safe(self._check_hashes, request, len(request.block_hashes))
                if loaded and not num_new_tokens:
                    self.loads.start(request.request_id)
                self._admitted[request.request_id] = self._admissions
                if not (loaded and not num_new_tokens):  # else appended to running when landed
                    self._appended[request.request_id] = self._admissions
                self._admissions += 1
            if landed:
                self._appended[request.request_id] = self._admissions
                self._admissions += 1
            if landed:
                pending = self.loads.scheduled(request.request_id, pending)
            self.events.extend(pending)
            return result

        return allocate_slots

    def _slots_features(
        self, request: Request, num_new_tokens: int, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> tuple[int, int]:
        """Refuse what an ``allocate_slots`` call asks that the spec does not model; return the
        full blocks a KV load writes (0 without one: the ``schedule`` decision's last field)
        and the tokens past them a synchronous load writes into a block it does not fill. The
        spec's loads are of whole blocks; a synchronous one lands before the step's forward
        pass reads anything, so the tail of a partial block is to the spec computed in that
        step, as the tokens after it are (the decision's tokens count it; ``_submitted``
        refuses a step whose budget that would overrun). An asynchronous load not of whole
        blocks has no such reading: refused."""
        names = (
            "num_new_computed_tokens",
            "new_computed_blocks",
            "num_lookahead_tokens",
            "num_external_computed_tokens",
            "delay_cache_blocks",
            "num_encoder_tokens",
        )
        given = dict(zip(names, args, strict=False)) | kw
        for name, feature in (
            ("num_lookahead_tokens", "speculative decoding"),
            ("num_encoder_tokens", "encoder-decoder model"),
        ):
            if name == "num_encoder_tokens" and hybrid_groups.encoder_decoder(self.scheduler):
                self._encoder_slots(request, int(given.get(name) or 0))
            elif given.get(name):
                self.refuse(feature, f"allocate_slots({name}={given[name]})")
        external = int(given.get("num_external_computed_tokens") or 0)
        if self.config.sliding_window is not None and given.get("delay_cache_blocks"):
            # a synchronous load is the spec's (WindowLoad); an asynchronous one is not
            where = f"{request.request_id}: an asynchronous KV load under a window"
            self.refuse("sliding window", where)
        if not external:
            return 0, 0
        bsz, local = self.block_size, int(given.get("num_new_computed_tokens") or 0)
        where = f"{request.request_id}: {external} external tokens after {local} cached"
        synchronous = num_new_tokens > 0
        if bool(given.get("delay_cache_blocks")) == synchronous:
            self.refuse("KV connector: a load's registration not vLLM's", where)
        elif local % bsz or (external % bsz and not synchronous):
            self.refuse("KV connector: a load not of whole blocks", where)
        elif (local + external) // bsz > loadable(request.num_tokens, bsz, not synchronous):
            # an asynchronous load may end there (vLLM and the spec recompute the last token
            # over the loaded block) unless a block holds that token alone
            self.refuse("KV connector: a load over the last token's block", where)
        return external // bsz, external % bsz

    def _encoder_slots(self, request: Request, encoder: int) -> None:
        """An encoder-decoder scheduler's ``num_encoder_tokens`` (its cross-attention table's
        size, ``groups.encoder_decoder``): the spec allocates a request's whole cross table at
        its admission, for every encoder token it arrived with (``arrive``'s ``encoder``), and
        nothing later. vLLM passes the count with the encoder inputs it schedules: all of them,
        with an admission's first decoder token, or, when some input's embeddings fall past
        that chunk, fewer (judging would guess where the rest lands: refused). A scheduler with
        the groups but ``is_encoder_decoder`` off passes 0 (its inputs are a decoder-only
        model's): refused here too, before vLLM allocates nothing where the spec would."""
        admission = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        arrived = hybrid_groups.encoder_tokens(request)
        if encoder != (arrived if admission else 0):
            when = "at its admission" if admission else "after its admission"
            self.refuse(
                "cross-attention: encoder inputs scheduled in part",
                f"{request.request_id}: {encoder} of {arrived} encoder tokens {when}",
            )

    def _admission_room(self, request: Request) -> None:
        """The spec counts a request loading asynchronously as running, vLLM as waiting: an
        admission the spec's ``max_running`` forbids only because of it is refused."""
        running = len(self.scheduler.running) + len(self.loads.waiting)
        if self.loads.waiting and running >= self.config.max_running:
            self.refuse(
                "KV connector: loading requests counted as running",
                f"{request.request_id} admitted beside {len(self.loads.waiting)} loading",
            )

    def _get_computed_blocks(self, original: Method) -> Method:
        def get_computed_blocks(request: Request, *args: Any, **kw: Any) -> Any:
            """vLLM's lookup: the bound it was given (the aux output connector's
            ``max_cache_hit``) and the request's own read limit, kept for the admission's
            ``schedule`` decision (``_hit_bound``); what it hits is checked there."""
            given = kw.get("max_cache_hit_length", args[0] if args else None)
            bound = self._safe(self._hit_bound, request, given)
            self._hit_bounds[request.request_id] = bound
            return original(request, *args, **kw)

        return get_computed_blocks

    def _hit_bound(self, request: Request, given: int | None) -> int | None:
        """The bound on this lookup's hit in tokens, as the spec's ``schedule`` decision carries
        it (``docs/model.md``, "Bounded hits"): 0 where the request skips the read (0.33.0's
        ``skip_reading_prefix_cache``, 0.34.0's ``prefix_cache_hit_limit`` 0), else the least
        of the bound vLLM's lookup was given and the request's limit
        (``versions.max_cache_hit_length``); None where it cuts nothing the spec's own cap (the
        last token's block) does not, so an unbounded admission's decision stays as before."""
        if not self.config.prefix_caching:
            return None  # vLLM looks nothing up; nor does the spec
        if prefix_read_limit(request) == 0:
            return 0
        bound = max_cache_hit_length(request, given)
        bsz = self.block_size
        return None if bound // bsz >= (request.num_tokens - 1) // bsz else max(bound, 0)

    def _bounded_hit(self, request: Request, hits: Any) -> None:
        """An aux output connector's ``max_cache_hit`` bounds vLLM's lookup: the admission's
        decision carries the bound (``_hit_bound``) and the spec's hit is the longest cached
        prefix under it. A bound past the last token lets vLLM 0.33.0 hit the last token's
        block (a test's stub; vLLM's own connector stays under it), which the spec never
        does: refused."""
        if not self.config.prefix_caching:
            return  # vLLM looks nothing up
        got = len(hits.blocks[0]) if hits is not None else 0
        most = (request.num_tokens - 1) // self.block_size
        if got > most:
            where = f"{request.request_id}: {got} blocks hit"
            self.refuse("aux output connector: a hit over the last token's block", where)

    def _get_new_blocks(self, original: Method) -> Method:
        def get_new_blocks(num_blocks: int, *args: Any, **kw: Any) -> list[Any]:
            self._inner("get_new_blocks")
            self._evicted = set()
            blocks = original(num_blocks, *args, **kw)
            for block in blocks:
                if block.block_id in self._evicted:
                    self._effect(("evict", block.block_id))
                self._effect(("alloc", self._current, block.block_id) + self._group_field())
            return blocks  # type: ignore[no-any-return]

        return get_new_blocks

    def _touch(self, original: Method) -> Method:
        def touch(blocks: Any, *args: Any, **kw: Any) -> None:
            self._inner("touch")
            self._touched += [b.block_id for b in blocks if not b.is_null]
            original(blocks, *args, **kw)

        return touch

    def _evict(self, original: Method) -> Method:
        def evict(block: Any, *args: Any, **kw: Any) -> bool:
            evicted = original(block, *args, **kw)
            if evicted:
                self._evicted.add(block.block_id)
            return evicted  # type: ignore[no-any-return]

        return evict

    def _insert(self, original: Method) -> Method:
        def insert(block_hash_with_group_id: Any, block: Any, *args: Any, **kw: Any) -> None:
            self._inner("_insert_block_hash")
            key = block_hash_with_group_id
            num_tokens = kw.get("num_tokens", args[0] if args else None)
            before = block.block_hash
            original(key, block, *args, **kw)
            if before is not None and before != key:
                self.refuse("partial prefix-cache hits", f"a second hash on block {block.block_id}")
            if before is None and block.block_hash is not None:
                group = hybrid_groups.group_of_key(key) if self.hybrid else 0
                index = (num_tokens or 0) // self.group_sizes[group] - 1
                owner = self._current_request if self._current is not None else self._owner
                rid = self.ids.get(owner.request_id) if owner is not None else None
                if owner is not None:
                    self._safe(self._check_hashes, owner, index + 1)
                self._effect(("publish", rid, index, block.block_id) + ((group,) if group else ()))

        return insert

    def _free_blocks(self, original: Method) -> Method:
        def free_blocks(ordered_blocks: Iterable[Any], *args: Any, **kw: Any) -> None:
            self._inner("free_blocks")
            blocks = list(ordered_blocks)
            self._safe(self._free_features, blocks)
            if self._safe(evict_first, args, kw):
                self.refuse(*EVICT_FIRST)
            freed = [("free", b.block_id) for b in blocks if not b.is_null]
            if self._current is not None and self._windowed:
                self._pending += freed  # blocks before the window: effects of the schedule
            else:
                self.events.extend(freed)
            original(blocks, *args, **kw)

        return free_blocks

    def _free_features(self, blocks: list[Any]) -> None:
        pool = self.pool.blocks
        if any(not 0 <= b.block_id < len(pool) or pool[b.block_id] is not b for b in blocks):
            self.refuse("blocks that are not the pool's", "free_blocks")
        unhashed = [b for b in blocks if not b.is_null and b.ref_cnt == 1 and b.block_hash is None]
        if len(unhashed) > 1 and self.config.prefix_caching and not self.config.spec_tokens:
            self.refuse(
                "a batch of unhashed blocks freed",
                "vLLM keeps their order at the queue's head, the spec reverses it",
            )

    def _group_field(self) -> tuple[int, ...]:
        """An event's trailing ``group`` field: none for one group (``docs/hybrid.md``)."""
        if not self.hybrid:
            return ()
        if self._group is None:
            self.refuse("hybrid KV-cache groups", "a block allocated outside a group's manager")
            return ()
        return (self._group,) if self._group else ()  # canonical: no field for group 0

    def _effect(self, event: Event) -> None:
        """Effects inside ``allocate_slots`` wait for its ``schedule`` decision."""
        if self._current is None:
            self.events.append(event)
        else:
            self._pending.append(event)

    def _lookahead(self, request: Request) -> None:
        """The request's block hasher's lookahead (``features.hasher_lookahead``) is the
        configuration's ``hash_lookahead``: taken as it at the first arrival, before any
        event (the plugin then rebuilds the judge); a request hashed otherwise, later or held
        beside it (priority arrivals), is refused ("lookahead hashing"). Prefix caching off
        reads no hash."""
        lookahead = hasher_lookahead(request) or 0
        first, self._hashed_arrival = not self._hashed_arrival, True
        if lookahead == self.config.hash_lookahead or not self.config.prefix_caching:
            return
        if not first or self.events or self.config.groups:
            self.refuse(
                "lookahead hashing",
                f"{request.request_id}'s hashes cover {lookahead} tokens after each block, "
                f"the configuration's {self.config.hash_lookahead}",
            )
            return
        self.config = replace(self.config, hash_lookahead=lookahead)

    def _check_hashes(self, request: Request, upto: int) -> None:
        """Block hashes must be a function of the token prefix (with ``hash_lookahead`` L, of the
        prefix and the L tokens after it), and a prefix's alone: a hash
        collision (two prefixes, one hash) or a hash that is not (one prefix, two hashes) is
        a hashing the spec's keys cannot follow. Not on an encoder-decoder scheduler kvspec
        judges (``groups.encoder_decoder``): vLLM turns prefix caching off there, so no hash is
        ever read, and its requests' hashes name their encoder inputs beside their tokens."""
        if not self.config.prefix_caching and hybrid_groups.encoder_decoder(self.scheduler):
            return
        hashes, tokens, bsz = request.block_hashes, request.all_token_ids, self.block_size
        start = self._checked.get(request.request_id, 0)
        for i in range(start, min(upto, len(hashes))):
            end = (i + 1) * bsz + self.config.hash_lookahead  # and the tokens after it
            link = (hashes[i - 1] if i else None, tuple(tokens[i * bsz : end]))
            known = self._links.setdefault(link, hashes[i])
            if known != hashes[i]:
                self.refuse("block hashes not a function of the tokens", f"{request.request_id}")
            if self._hashes.setdefault(hashes[i], link) != link:
                self.refuse("block hash collision", f"{request.request_id}'s block {i}")
        self._checked[request.request_id] = max(start, min(upto, len(hashes)))
