"""SGLang 0.5.23's ``Scheduler``, the parts that decide memory, over SGLang's own objects, with the
kvspec events each part causes.

SGLang's ``Scheduler`` needs a model worker, a tokenizer process and ZMQ sockets, so this class
holds what it holds (``waiting_queue``, ``running_batch``, ``chunked_req``, ``last_batch``,
``result_queue``, the radix tree, the pools, its ``SchedulePolicy`` and ``NewTokenRatioTracker``)
and runs its methods' memory path line for line, calling SGLang's objects (``Req``,
``ScheduleBatch``, ``PrefillAdder``) and helpers (``checkpoint_kv_cache``, ``release_kv_cache``),
which do all the deciding: admission, chunking, matching, allocation, eviction, retraction,
insertion, deduplication. What is left out is what has no memory effect (metrics, streaming,
grammar, logprobs, LoRA, hierarchical cache, disaggregation, speculative decoding, DP attention).
Line numbers are those of 0.5.23's ``managers/scheduler.py`` (``S``), ``managers/schedule_batch.py``
(``B``) and ``managers/scheduler_components/batch_result_processor.py`` (``R``).

Decision events: ``begin`` when a batch starts to be formed, ``schedule`` per request of the batch
(its ``hit`` and ``alloc`` effects read off the row after SGLang allocated it), ``preempt`` per
request ``retract_decode`` releases, ``submit`` at ``run_batch``, ``execute`` and ``commit`` when
the batch's result is processed, ``abort`` where SGLang aborts. The event loops that order these
calls are ``loops.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from .build import (
    FINISH_ABORT,
    MODEL,
    VOCAB,
    AddReqResult,
    ComponentType,
    NewTokenRatioTracker,
    PrefillAdder,
    Req,
    ScheduleBatch,
    SchedulePolicy,
    SpeculativeAlgorithm,
    checkpoint_kv_cache,
    core_backend,
    empty_batch,
    envs,
    memory,
    new_request,
    prepare_abort,
    release_kv_cache,
    swa_layers,
)
from .mamba import MambaRecorder, mamba_memory, slots_for
from .record import Event, LegacyRecorder, Recorder, UnifiedRecorder, rid
from .swa import SwaRecorder


def recorder(
    tree: Any, pool: Any, page_size: int, events: list[Event], full_pages: int = 0
) -> Recorder:
    """The recorder for the tree ``build.memory`` built (``full_pages``: the FULL pool's pages,
    after which a hybrid SWA tree's SWA pages, or a hybrid SSM tree's state slots, are
    numbered: ``swa.py``, ``mamba.py``)."""
    if ComponentType.SWA in getattr(tree, "components", {}):
        return SwaRecorder(tree, pool, page_size, events, full_pages)
    if ComponentType.MAMBA in getattr(tree, "components", {}):
        return MambaRecorder(tree, pool, page_size, events, full_pages)
    kind = LegacyRecorder if core_backend(tree) == "legacy" else UnifiedRecorder
    return kind(tree, pool, page_size, events)


class Scheduler:
    def __init__(
        self,
        config: Config,
        choices: Choices,
        overlap: bool,
        tree: str = "unified",
        test_retract: bool | None = None,
    ) -> None:
        self.config, self.choices, self.overlap = config, choices, overlap
        self.events: list[Event] = []
        ps = config.block_size
        self.page_size = ps
        self.hybrid_swa = tree == "swa"
        self.window = swa_layers()[0] if self.hybrid_swa else None
        """SGLang's ``sliding_window_size`` (the hybrid SWA model's), or None."""
        self.hybrid_ssm = tree in ("mamba", "mamba-extra")
        self.model = MODEL
        """The ``ModelConfig`` a batch carries (``extra.py``'s scheduler gives Qwen3-Next's)."""
        self.slots = self.state_slots(config.max_running) if self.hybrid_ssm else 0
        """State slots of a hybrid SSM model's ``MambaPool`` (``mamba.py``), or 0."""
        if self.hybrid_swa:
            self.full_pages = (config.num_blocks - 1) // 2
        else:
            self.full_pages = config.num_blocks - 1 - self.slots
        """Pages of the FULL pool; a hybrid SWA model's SWA pool has as many, numbered after them
        (``swa.py``), a hybrid SSM model's state slots too (``mamba.py``): the spec's blocks are
        all pools'."""
        # One req-to-token row per running request (Scheduler.max_running_requests): the spec's
        # max_running counts the chunked request too, and so do SGLang's rows.
        self.pool, self.allocator, self.tree = self.build_memory(tree)
        self.hook_tree()
        self.record = self.new_recorder()
        self.policy = SchedulePolicy("fcfs", self.tree, False, False, False)
        self.ratio = NewTokenRatioTracker.from_config()
        self.token_budget = config.token_budget
        """SGLang's ``chunked_prefill_size`` and ``max_prefill_tokens``."""
        self.requests: dict[int, Req] = {}
        self.gone: set[int] = set()
        """Requests SGLang no longer holds (finished or aborted)."""
        self.waiting: list[Req] = []
        self.running_batch: ScheduleBatch = empty_batch()
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.result_queue: deque[tuple[ScheduleBatch, int]] = deque()
        self.pending_chunked_abort: Req | None = None
        self.next_step = 0
        self.forward_ct = 0
        """Batches run (``run_batch``, S 4621: the loops count them)."""
        on = envs.SGLANG_TEST_RETRACT.get() if test_retract is None else test_retract
        self.test_retract = (
            (envs.SGLANG_TEST_RETRACT_INTERVAL.get(), envs.SGLANG_TEST_RETRACT_NO_PREFILL_BS.get())
            if on
            else None
        )
        """SGLang's own retraction test mode (``SGLANG_TEST_RETRACT``, read at S 399, off by
        default; ``test_retract`` overrides it): (interval, running batch size above which no
        prefill is formed), or None."""

    def state_slots(self, rows: int) -> int:
        """A hybrid SSM model's state slots for ``rows`` running requests (``mamba.slots_for``)."""
        return slots_for(rows)

    def build_memory(self, tree: str) -> tuple[Any, Any, Any]:
        """The pools and the tree (``build.memory``; a hybrid SSM model's, ``mamba.py``'s)."""
        ps, rows = self.page_size, self.config.max_running
        if self.hybrid_ssm:  # the hybrid SSM tree is mamba.py's to build (its pools, its model)
            return mamba_memory(ps, self.full_pages, self.slots, rows)
        return memory(ps, self.full_pages, rows, tree, swa_pages=self.full_pages)

    def new_recorder(self) -> Recorder:
        return recorder(self.tree, self.pool, self.page_size, self.events, self.full_pages)

    def tracked(self, batch: ScheduleBatch, index: int, extend: bool) -> list[Event]:
        """The track writes of the batch's request at ``index`` (``extra.py``), after its
        allocations: none without track slots."""
        return []

    def decode_result(self, batch: ScheduleBatch, req: Req) -> None:
        """R 1385: what a decode result updates before a finished request is released (the
        ping-pong flip of ``extra.py``); nothing without track slots."""

    def after_finish(self, req: Req) -> list[Event]:
        """Effects SGLang's finished insert made that come after the ``finish`` (``extra.py``:
        the donation of the track slot the request left)."""
        return []

    def hook_tree(self) -> None:
        """Called before the recorder wraps the tree (a mutant wraps SGLang's methods here)."""

    # -- arrivals and aborts --------------------------------------------------------------------

    def add_request(self, req_id: int, prompt: tuple[int, ...], max_tokens: int) -> None:
        capacity = self.full_pages * self.page_size
        clipped = self.allocator.max_new_tokens_for_memory(
            len(prompt),
            max_tokens,
            token_capacity=capacity,
            sliding_window_size=self.window,
            chunk_size=None,
        )
        if not clipped:
            return  # SGLang rejects a prompt with no room to generate: no request
        req = new_request(req_id, prompt, int(clipped))
        self.requests[req_id] = req
        self.events.append(("arrive", req_id, tuple(prompt), int(clipped), 0))
        self.waiting.append(req)  # _add_request_to_queue (S 3480)

    def abort_request(self, req_id: int) -> bool:
        """``abort_request`` (S 5675): a waiting request leaves at once; the chunked request is
        aborted at the next ``get_next_batch_to_run`` (``process_pending_chunked_abort``); a
        request of ``running_batch`` or ``last_batch`` gets ``to_finish`` ("abort method 3": it
        runs once more and finishes when that result is processed)."""
        req = self.requests.get(req_id)
        if req is None or req_id in self.gone:
            return False
        if self.chunked_req is req:
            self.pending_chunked_abort = req
        if req in self.waiting:
            self.waiting.remove(req)
            self._abort_now(req)
            return True
        inflight = self.running_batch.reqs + (self.last_batch.reqs if self.last_batch else [])
        if req in inflight and not req.finished():
            req.to_finish = FINISH_ABORT()
        return True

    def _abort_now(self, req: Req) -> None:
        """An abort the spec takes between steps: release without insert, then finished."""
        self.events.append(("abort", rid(req)))
        if req.kv.holds_kv:
            self._release(req, checkpoint=False)
        self.events.append(("finish", rid(req), "abort"))
        self.gone.add(rid(req))

    def process_pending_chunked_abort(self) -> None:
        """S 3778: the chunked request's deferred abort, before anything else is scheduled."""
        req, self.pending_chunked_abort = self.pending_chunked_abort, None
        if req is None:
            return
        if self.chunked_req is not req:
            if not (req.finished() or not req.kv.holds_kv):
                self.abort_request(rid(req))  # it moved on: abort it where it is now
            return
        prepare_abort(req, "Aborted")
        req.to_finish = None
        self._abort_now(req)
        self.chunked_req = None

    # -- forming a batch: get_next_batch_to_run (S 3894) ----------------------------------------

    def get_next_batch_to_run(self) -> tuple[ScheduleBatch | None, int | None]:
        """The batch to run and the spec step begun for it; (None, step) when nothing runs but
        forming it had effects (an empty step carries them), (None, None) when nothing happened."""
        self.process_pending_chunked_abort()
        step, begin = self.next_step, len(self.events)
        self.events.append(("begin", step))
        self._before_begin: list[Event] = []
        exclude: list[Req] = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                self.stash_chunked_request(self.chunked_req)
        running, last = self.running_batch, self.last_batch
        if last is not None and last.forward_mode.is_extend():  # merge the prefill batch
            if last.chunked_req is not None:
                exclude.append(last.chunked_req)
            last_bs = last.batch_size()
            last.filter_batch(reqs_to_exclude=exclude)
            if last.batch_size() < last_bs:
                running.batch_is_full = False
            if not last.is_empty() and last is not running:
                if running.is_empty():
                    running = last
                else:
                    running.merge_batch(last)
        running_bs = running.batch_size()
        running.filter_batch()
        if running.batch_size() < running_bs:
            running.batch_is_full = False
        self.running_batch = running
        batch = self.get_new_batch_prefill()
        if batch is None and not running.is_empty() and not running.is_prefill_only:
            decode = self.update_running_batch(running)
            batch = decode if decode is not None and not decode.is_empty() else None
        self.events[begin:begin] = self._before_begin  # see update_running_batch
        begin += len(self._before_begin)
        if batch is None and len(self.events) == begin + 1:
            del self.events[begin]
            return None, None
        self.next_step += 1
        return batch, step

    def stash_chunked_request(self, req: Req) -> None:
        """S 3772: insert the chunk the last prefill computed (``checkpoint_kv_cache``)."""
        with self.record.acting_for(req):
            checkpoint_kv_cache(req, self.tree)
        self._leftover()

    def _leftover(self) -> None:
        """A hybrid SSM tree's insert may evict a state to make room for its copy: what that
        left free is an ``unpublish`` (``MambaRecorder.report_leftover``)."""
        if self.hybrid_ssm:
            self.record.report_leftover()  # type: ignore[attr-defined]

    def get_num_allocatable_reqs(self, running_bs: int, num_held_rows: int = 0) -> int:
        """S 4027 (pipeline size 1: ``pp_max_micro_batch_size`` is ``max_running_requests``)."""
        rows = max(self.pool.available_size() + num_held_rows, 0)
        return min(self.config.max_running - running_bs, rows)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        """``_get_new_batch_prefill_raw`` (S 4079): the chunked request's next chunk, then waiting
        requests in the policy's order, as SGLang's ``PrefillAdder`` admits and chunks them;
        ``ScheduleBatch.prepare_for_extend`` (B 2847) matches, evicts and allocates."""
        running = self.running_batch
        if self.hybrid_swa or running.is_empty():  # S 4090: a hybrid SWA model retries
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        if self.get_num_allocatable_reqs(running_bs) <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting, running)
        if self.test_retract is not None and running_bs > self.test_retract[1]:
            return None  # S 4135: keep the requests waiting while testing retraction
        adder = PrefillAdder(
            self.page_size,
            self.tree,
            self.allocator,
            running,
            self.ratio.current,
            self.token_budget,
            self.token_budget,
            0,
            0,
            max_prefill_bs=0,
            max_running_requests=self.config.max_running,
            waiting_queue_len=len(self.waiting),
        )
        continuing = self.chunked_req
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        mamba_allocator = getattr(self.pool, "mamba_allocator", None)
        if mamba_allocator is not None:  # S 4199
            mamba_allocator.alloc_group_begin(len(self.waiting))
        for req in self.waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            running_bs = len(running.reqs)
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self.get_num_allocatable_reqs(running_bs, held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree)
            res = adder.add_one_req(
                req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None
            )
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                added = len(adder.can_run_list) > 0 and req is adder.can_run_list[-1]
                if not added:  # S 4285: give back the state slot the match took for it
                    req.kv.mamba_cow_src_index = None
                    req.kv.mamba_needs_clear = False
                    if req.kv.holds_mamba:
                        mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
                        req.kv.mamba_pool_idx = None
                break
        if mamba_allocator is not None:  # S 4302
            mamba_allocator.alloc_group_end()
        can_run: list[Req] = adder.can_run_list
        if not can_run:
            self._leftover()  # a match evicted a state for a request left waiting
            return None
        admitted = set(can_run) - {continuing}
        self.waiting = [r for r in self.waiting if r not in admitted]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(
            can_run,
            self.pool,
            self.allocator,
            self.tree,
            self.model,
            self.overlap,
            SpeculativeAlgorithm.NONE,
            chunked_req=self.chunked_req,
        )
        held = [self.record.tables(r) for r in can_run]
        if self.hybrid_ssm:
            self.record.note_cow(can_run)  # type: ignore[attr-defined]
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        evicted, self.record.evicted = self.record.evicted, []
        for i, (req, before) in enumerate(zip(can_run, held, strict=True)):
            self.events.append(("schedule", rid(req), req.extend_end - req.prefix_len, 0))
            tables = self.record.tables(req)
            if req in admitted:
                if self.hybrid_swa:
                    self.record.count_hit(req)  # type: ignore[attr-defined]
                hit = req.prefix_len // self.page_size
                hits = [table[:hit] for table in tables]
                if self.hybrid_ssm:
                    hits = self.record.admitted(req, tables, hit)  # type: ignore[attr-defined]
                for group, table in enumerate(hits):
                    event: Event = ("hit", rid(req), tuple(table))
                    self.events.append(event + (group,) if group else event)
                before = [table[:hit] for table in tables]
                if self.hybrid_ssm:
                    before = [before[0], []]
            self._scheduled(req, before, tables, evicted)
            self.events += self.tracked(batch, i, True)
        self.events += [("unpublish", page) for page in evicted]
        return batch

    def _scheduled(
        self, req: Req, before: list[list[int]], after: list[list[int]], evicted: list[int]
    ) -> None:
        """A scheduled request's effects, from its tables before and after SGLang allocated:
        ``free`` for the window blocks SGLang freed behind the window (``maybe_evict_swa``),
        then ``alloc`` per new block of each group."""
        for group in range(1, len(after)):
            self.events += self.record.repointed(
                req, group, before[group], after[group][: len(before[group])]
            )
        for group, table in enumerate(after):
            self._allocated(req, table[len(before[group]) :], evicted, group)

    def _allocated(self, req: Req, pages: list[int], evicted: list[int], group: int = 0) -> None:
        """``alloc`` per new page of the row, ``evict`` first for a page SGLang evicted for it."""
        for page in pages:
            if page in evicted:
                evicted.remove(page)
                self.events.append(("evict", page))
            event: Event = ("alloc", rid(req), page)
            self.events.append(event + (group,) if group else event)

    # -- decoding: update_running_batch (S 4459) ------------------------------------------------

    def _reqs_finishing_inflight(self, batch: ScheduleBatch) -> list[Req]:
        """S 4444: with overlap, the requests whose queued result finishes them by length."""
        if not self.overlap or not self.result_queue:
            return []
        queued = set(self.result_queue[0][0].reqs)
        return [r for r in batch.reqs if r in queued and r.next_output_finishes_by_length()]

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        initial_bs = batch.batch_size()
        finishing = self._reqs_finishing_inflight(batch)
        batch.filter_batch(reqs_to_exclude=finishing)
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        kv_full = not batch.check_decode_mem()  # evicts what the decode needs
        self.record.report_evictions()
        if kv_full and finishing:
            batch.batch_is_full = False
            return None  # the queued result frees the finishing requests' pages
        forced = self.test_retract is not None and self.forward_ct % self.test_retract[0] == 0
        if kv_full or forced:  # S 4477: out of memory, or SGLang's test mode
            retracted, ratio = self._retract_decode(batch)
            self.ratio.current = ratio
            self.waiting += retracted  # _add_request_to_queue(req, is_retracted=True)
        else:
            self.ratio.decay_step()
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if batch.is_empty():
            return batch
        held = [self.record.tables(r) for r in batch.reqs]
        batch.prepare_for_decode()  # B 3736: alloc_for_decode evicts, allocates, writes rows
        evicted, self.record.evicted = self.record.evicted, []
        for i, (req, before) in enumerate(zip(batch.reqs, held, strict=True)):
            self.events.append(("schedule", rid(req), 1, 0))
            self._scheduled(req, before, self.record.tables(req), evicted)
            self.events += self.tracked(batch, i, False)
        self.events += [("unpublish", page) for page in evicted]
        return batch

    def _retract_decode(self, batch: ScheduleBatch) -> tuple[list[Req], float]:
        """``ScheduleBatch.retract_decode`` (B 3451), SGLang's own, with each ``release_req``
        (B 3582) reported as it happens: ``preempt``, the row's frees, then what
        ``evict_from_tree_cache`` evicted. When even the last request does not fit, SGLang aborts
        it (``release_req(..., offload_kv=False)``); the spec's ``abort`` is illegal while a step
        is building, so those events go just before the step's ``begin`` (``docs/adapters.md``)."""
        original = batch.release_req

        def release_req(idx: int, remaining: int, offload_kv: bool = True) -> bool:
            req = batch.reqs[idx]
            table = self._held(req)
            aborting = not offload_kv
            events = self._before_begin if aborting else self.events
            self.record.report_evictions()  # what check_decode_mem evicted before this
            events.append(("abort" if aborting else "preempt", rid(req)))
            with self.record.acting_for(req), self.retracting(req):
                ok = original(idx, remaining, offload_kv=offload_kv)
            events += [("free", page) for page in table]
            evicted, self.record.evicted = self.record.evicted, []
            events += [("unpublish", page) for page in evicted]
            if aborting:
                events.append(("finish", rid(req), "abort"))
                self.gone.add(rid(req))
            return bool(ok)

        batch.release_req = release_req  # type: ignore[method-assign]
        try:
            retracted, ratio, _aborted = batch.retract_decode()
        finally:
            del batch.release_req
        self.record.report_evictions()
        return retracted, ratio

    @contextmanager
    def retracting(self, req: Req) -> Iterator[None]:
        """Around ``release_req`` of a request ``retract_decode`` retracts (a mutant's hook)."""
        yield

    # -- processing a batch's result ------------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, step: int) -> None:
        """The model runner (the adapter draws each sampled token from ``choices``), then
        ``process_batch_result_prefill`` (R 258) or ``process_batch_result_decode`` (R 952):
        each request that uses its token appends it and, finished, is released with insert
        (``release_kv_cache``, R 387 and 1466), or, a prefill that goes on, inserted
        (``checkpoint_kv_cache``); a chunk only counts down ``inflight_middle_chunks``.
        A client abort (``to_finish``) finishes its request here; the spec takes it as an
        ``abort`` after the ``commit``, so such requests are processed after the others."""
        extend = batch.forward_mode.is_extend()
        self.result_batch = batch
        self.before_result(step)
        self.events.append(("execute", step, ()))
        users = [r for r in batch.reqs if self._uses_output(r, extend)]
        sampled = [(r, self.choices.pick(VOCAB, "sglang-token")) for r in users]
        self.events.append(("commit", step, tuple((rid(r), t) for r, t in sampled)))
        self.allocator.free_group_begin()
        for req in batch.reqs:
            if extend and req.inflight_middle_chunks > 0 and not req.is_retracted:
                req.inflight_middle_chunks -= 1  # a middle chunk: nothing to commit
        aborting = [(r, t) for r, t in sampled if r.to_finish is not None and not self._ends(r, t)]
        for req, token in sampled:
            if (req, token) not in aborting:
                self._commit_output(req, token, extend)
        for req, token in aborting:
            self.events.append(("abort", rid(req)))
            self._commit_output(req, token, extend)
        self.allocator.free_group_end()

    def before_result(self, step: int) -> None:
        """Called when step ``step``'s result comes back, before anything of it is processed."""

    def _uses_output(self, req: Req, extend: bool) -> bool:
        if req.finished() or req.is_retracted:
            return False
        return not extend or req.inflight_middle_chunks <= 0

    def _ends(self, req: Req, token: int) -> bool:
        """Whether the spec finishes the request at this commit (stop token or length)."""
        return token == 0 or len(req.output_ids) + 1 >= req.sampling_params.max_new_tokens

    def _commit_output(self, req: Req, token: int, extend: bool) -> None:
        aborted = req.to_finish is not None and not self._ends(req, token)
        req.output_ids.append(token)
        req.update_finish_state()
        if not extend:
            self.decode_result(self.result_batch, req)
        if req.finished():
            self._release(req, checkpoint=True)
            reason = "abort" if aborted else "stop" if token == 0 else "length"
            self.events.append(("finish", rid(req), reason))
            self.events += self.after_finish(req)
            self.gone.add(rid(req))
        elif extend:
            self.insert_unfinished(req)

    def insert_unfinished(self, req: Req) -> None:
        """R 394: a prefill that goes on is inserted up to what it computed
        (``checkpoint_kv_cache``: ``extend_end``)."""
        with self.record.acting_for(req):
            checkpoint_kv_cache(req, self.tree)
        self._leftover()

    def _release(self, req: Req, checkpoint: bool) -> None:
        """``release_kv_cache``: (with ``checkpoint``) insert, then free the row and unlock. The
        request's references drop in reverse table order (``free``), its table as it was."""
        table = self._held(req)
        with self.record.acting_for(req, finishing=True):
            release_kv_cache(req, self.tree, checkpoint=checkpoint)
        self.events += [("free", page) for page in table]
        self._leftover()

    def _held(self, req: Req) -> list[int]:
        """The blocks a release frees: each group's table, last block first, group order."""
        return [page for table in self.record.tables(req) for page in reversed(table) if page]

    # -- idle and flush -------------------------------------------------------------------------

    def is_fully_idle(self) -> bool:
        """S 5337."""
        return (
            self.running_batch.is_empty()
            and self.chunked_req is None
            and (self.last_batch is None or self.last_batch.is_empty())
            and not self.result_queue
        )

    def on_idle(self) -> None:
        """S 5241: the new-token ratio goes back to its initial value once fully idle."""
        if self.is_fully_idle():
            self.ratio.reset()

    def flush_cache(self) -> bool:
        """S 5518: only when fully idle (and nothing waits)."""
        if self.waiting or not self.is_fully_idle():
            return False
        cached = sorted(self.record.cached_pages())
        self.last_batch = None
        self.tree.reset()
        self.pool.clear()
        self.allocator.clear()
        self.events.append(("reset",))
        self.events += [("unpublish", page) for page in cached]
        return True

    def holders(self) -> list[Any]:
        return [r for r in self.requests.values() if r.kv.holds_kv]
