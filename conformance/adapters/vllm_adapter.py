"""vLLM 0.33.0's real ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` through the adapter
protocol (``kvspec fuzz --target kvspec.conformance.adapters.vllm_adapter:factory``).

Importable only where vLLM 0.33.0 is installed (``make thirdparty`` builds ``.venv-vllm``). Nothing
of vLLM is reimplemented here: the adapter builds vLLM's own objects (one KV-cache group, full
attention, prefix caching on, chunked prefill, the synchronous ``Scheduler``), plays the engine
core's loop and the model runner (one sampled token per request that reached the end of its known
tokens, the token drawn by Hypothesis through ``choices``), and turns what vLLM does into kvspec
events by wrapping, on each instance, the methods where the block lifecycle happens.

**Depth.** Depth D is vLLM's batch queue of D steps: ``pipeline_parallel_size = D`` (so
``VllmConfig.max_concurrent_batches == D``) and ``step`` replays ``EngineCore.step_with_batch_queue``
call for call: schedule a step and submit it, return at once while the queue has room and something
was scheduled or is schedulable, else pop the oldest step and ``update_from_output`` it. Aborts may
come between a step's scheduling and the processing of the oldest output (vLLM's aborts queue is
drained just before ``update_from_output``). At D = 1 this is ``EngineCore.step``. ``async_factory``
runs async scheduling instead (``AsyncScheduler``, a queue of 2, the same loop), whose decodes
are scheduled before their token is known (placeholders): the spec cannot judge that yet
(``docs/adapters.md``).

**Stale output.** With several steps in flight a request may be preempted while a submitted step
still holds it. The worker still computes it; vLLM 0.33.0 by default *delivers* the token sampled
there to the preempted request (``num_stale_output_tokens``) and does not re-admit the request
until that output is in; in its *drop* mode (``requires_kv_delivery``, set by KV connectors that
need it) it drops that output and may re-admit at once. The spec discards such a token and admits
in queue order, which is vLLM's drop mode. ``drop_factory`` runs vLLM in drop mode (a faithful
model runner). ``factory`` keeps vLLM's default, and its model runner *withholds* the stale token
(an empty sample, as for a prefill chunk): the one place where the adapter departs from a real
runner, so that the spec can judge the rest; at depth >= 3 vLLM's deferral of such a request's
re-admission still differs from the spec's queue order (an ``Illegal`` admission, not a safety
finding). ``self_check`` verifies that vLLM appended exactly the tokens the ``commit`` reports, each
at the position it was sampled for.

==================================  ==========================================================
vLLM method                         events
==================================  ==========================================================
``Scheduler.schedule``              ``begin`` before, ``submit`` after
``KVCacheManager.allocate_slots``   ``schedule`` (and ``hit`` on admission) when it succeeds,
                                    then the effects recorded inside it
``BlockPool.touch``                 (cross-checks ``hit``: the blocks vLLM touched)
``BlockPool.get_new_blocks``        ``evict`` (from ``_maybe_evict_cached_block``), ``alloc``
``BlockPool._insert_block_hash``    ``publish`` (hash insertion)
``Scheduler._preempt_request``      ``preempt``
``BlockPool.free_blocks``           ``free``, one per block, in the order vLLM frees them
``Scheduler._free_request``         ``finish`` with vLLM's own finish reason
``Scheduler.update_from_output``    ``execute`` and ``commit`` before
``BlockPool.reset_prefix_cache``    ``reset``, ``unpublish`` per cached block
==================================  ==========================================================

vLLM's native KV events (``BlockStored``/``BlockRemoved``) are kept and cross-checked:
``self_check`` (run by the fuzzer after every rule) says whether vLLM stored as many blocks as
the wrappers saw ``publish`` events and removed as many as they saw ``evict`` events, and whether
the blocks vLLM touched on each admission are the ``hit`` reported.

Judging is strict (``docs/adapters.md``): the spec models vLLM 0.33.0, so vLLM's effects must be
the spec's exactly, block ids and free-queue order included. One known difference cannot show
here: vLLM puts a freed batch of *unhashed* blocks at the head of its free queue in the order they
were freed, the spec one at a time (reversed); with eager registration only a table's last block
can be unhashed, so a free never holds two.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"the vLLM adapter needs vLLM 0.33.0 ({err}); run `make thirdparty` and use "
        ".venv-vllm/bin/kvspec"
    ) from None

import torch

from kvspec.conformance.adapters import tiny_model_folder
from kvspec.reference.choices import Choices
from kvspec.spec import Config

Event = tuple[object, ...]
VOCAB = 4
"""Sampled tokens are 0 .. VOCAB - 1; token 0 is a stop token (``Config.stop_token``)."""

MAX_DEPTH = 4
"""Batch queues of 1 (``EngineCore.step``) to MAX_DEPTH steps (pipeline parallelism)."""

_REASONS = {
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def supported(config: Config) -> str | None:
    """Why vLLM cannot run this cell, or None."""
    if config.policy != "eager-unsafe":
        return f"vLLM 0.33.0 registers eagerly and never rolls back: policy eager-unsafe, not {config.policy}"
    if config.discipline != "vllm":
        return f"vLLM's scheduler is the vllm discipline, not {config.discipline}"
    if config.depth > MAX_DEPTH:
        return f"the adapter runs vLLM at depth 1 to {MAX_DEPTH}, not depth {config.depth}"
    if config.stop_token not in (None, 0):
        return f"the fake model runner's stop token is 0, not {config.stop_token}"
    return None


def factory(config: Config, choices: Choices) -> VllmAdapter:
    """The adapter factory named on the command line: vLLM's defaults (stale output of a
    preempted request is delivered; the runner withholds it)."""
    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return VllmAdapter(config, choices)


def drop_factory(config: Config, choices: Choices) -> VllmAdapter:
    """vLLM in its drop mode: the stale output of a preempted request is dropped by vLLM
    and the request may resume at once (``requires_kv_delivery``)."""
    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return VllmAdapter(config, choices, drop_stale=True)


def async_factory(config: Config, choices: Choices) -> VllmAdapter:
    """vLLM's async scheduling (``AsyncScheduler``, a batch queue of 2): depth 2 only. The spec
    cannot judge its placeholder decodes yet (``docs/adapters.md``)."""
    why = supported(config)
    if why is None and config.depth != 2:
        why = f"async scheduling keeps 2 steps in flight: depth 2, not {config.depth}"
    if why is not None:
        raise ValueError(why)
    return VllmAdapter(config, choices, async_scheduling=True)


@lru_cache(maxsize=1)
def _model_folder() -> str:
    """A local folder holding only a tiny ``config.json``: all ``ModelConfig`` reads."""
    return tiny_model_folder("vllm")


@lru_cache(maxsize=64)
def _vllm_config(
    num_blocks: int,
    block_size: int,
    budget: int,
    max_running: int,
    policy: str,
    depth: int,
    async_scheduling: bool,
) -> VllmConfig:
    model = ModelConfig(
        model=_model_folder(), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=1024
    )
    scheduler = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=budget,
        max_num_seqs=max_running,
        enable_chunked_prefill=True,
        policy=policy,
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    # A batch queue of `depth` steps: pipeline parallelism, or async scheduling's 2.
    parallel = ParallelConfig(pipeline_parallel_size=1 if async_scheduling else depth)
    config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_events_config=events,
        parallel_config=parallel,
    )
    # vLLM's CPU platform turns async scheduling off (a GPU one keeps it); the scheduler itself
    # does not depend on the device.
    config.scheduler_config.async_scheduling = async_scheduling
    assert config.max_concurrent_batches == depth, config.max_concurrent_batches
    return config


@dataclass
class InFlight:
    """A submitted step in the batch queue: vLLM's output, the requests the model runner
    samples (their chunk reaches the last known token) and those preempted since."""

    step: int
    output: Any
    samples: dict[str, int]
    """Request id -> the position of the token the runner samples for it."""
    left: set[str] = field(default_factory=set)


class VllmAdapter:
    supports_loads = False

    def __init__(
        self,
        config: Config,
        choices: Choices,
        drop_stale: bool = False,
        async_scheduling: bool = False,
    ) -> None:
        self.config = config
        self.choices = choices
        self.events: list[Event] = []
        bsz = config.block_size
        vllm_config = _vllm_config(
            config.num_blocks,
            bsz,
            config.token_budget,
            config.max_running,
            config.preemption,
            config.depth,
            async_scheduling,
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=config.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(bsz, num_kv_heads=1, head_size=1, dtype=torch.float32),
                )
            ],
        )
        self.scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=bsz,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(bsz, sha256)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.arrived: list[int] = []
        self.queue: list[InFlight] = []  # EngineCore's batch queue, oldest first
        self._process_next = False  # the current step_with_batch_queue call goes on to output
        self.drop_stale = drop_stale
        self.stale_outputs = 0  # sampled outputs of requests preempted since their step began
        self.scheduler.requires_kv_delivery = drop_stale  # vLLM's drop mode (module docstring)
        self.next_step = 0
        self.native: list[Any] = []
        self._current: int | None = None  # request whose slots are being allocated
        self._owner: int | None = None  # request whose blocks cache_blocks registers
        self._pending: list[Event] = []  # effects recorded inside allocate_slots
        self._evicted: set[int] = set()
        self._touched: list[int] = []  # blocks vLLM touched inside the current allocate_slots
        self.problems: list[str] = []  # disagreements between the wrappers, for self_check
        self._wrap()

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
            raise ValueError("the vLLM adapter has no external KV loads")
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[0])
        request = Request(
            request_id=str(rid),
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(len(self.arrived)),
            priority=priority,
            block_hasher=self.hasher,
        )
        self.events.append(("arrive", rid, tuple(prompt), max_tokens, priority))
        self.arrived.append(rid)
        self.scheduler.add_request(request)

    def step(self) -> bool:
        """Half of one ``EngineCore.step_with_batch_queue`` call (``step`` at depth 1, whose
        queue of one behaves the same): schedule and submit a step, returning at once while the
        queue has room; else (or on the next call, if this one scheduled) take the oldest step
        and process its output. Aborts between the halves are vLLM's ``_process_aborts_queue``."""
        if self._process_next or (self.queue and not self.scheduler.has_requests()):
            self._process_next = False
            self._process_oldest()
            return True
        if not self.scheduler.has_requests():
            return False
        step = self.next_step
        self.next_step += 1
        self.events.append(("begin", step))
        output = self.scheduler.schedule()
        self.events.append(("submit", step))
        requests = self.scheduler.requests
        samples = {  # the runner samples where the chunk reaches the last known token: there
            r: requests[r].num_computed_tokens  # (the sampled token's position)
            for r in output.num_scheduled_tokens
            if not requests[r].is_prefill_chunk
        }
        self.queue.append(InFlight(step, output, samples))
        executed = output.total_num_scheduled_tokens > 0
        full = len(self.queue) >= self.config.depth
        self._process_next = full or not (executed or self.scheduler.has_requests())
        return True

    def _process_oldest(self) -> None:
        """The worker's output of the oldest step, then ``update_from_output``. The runner
        samples a token for every request whose chunk reached its last known token; vLLM skips
        the output of requests aborted since. A request preempted since has *stale* output:
        with ``drop_stale`` vLLM drops it itself; otherwise the runner withholds the token, as
        the spec discards it (vLLM would deliver it; module docstring)."""
        oldest = self.queue.pop(0)
        self.events.append(("execute", oldest.step, ()))
        sampled: list[tuple[int, int]] = []
        tokens: dict[str, list[int]] = {}
        before: dict[str, int] = {}
        for req_id, position in oldest.samples.items():
            request = self.scheduler.requests.get(req_id)
            stale = req_id in oldest.left
            self.stale_outputs += stale
            if request is None or request.is_finished() or (stale and not self.drop_stale):
                continue
            tokens[req_id] = [self.choices.pick(VOCAB, "vllm-token")]
            before[req_id] = request.num_tokens
            if not stale:
                sampled.append((int(req_id), tokens[req_id][0]))
                if request.num_tokens != position:
                    self.problems.append(
                        f"r{req_id}'s token of step {oldest.step} was sampled for position "
                        f"{position}, vLLM appends it at {request.num_tokens}"
                    )
        self.events.append(("commit", oldest.step, tuple(sampled)))
        req_ids = list(oldest.output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[tokens.get(r, []) for r in req_ids],
        )
        self.scheduler.update_from_output(oldest.output, runner)
        used = {str(rid) for rid, _ in sampled}
        for req_id, count in before.items():  # vLLM appended exactly the tokens reported used
            request = self.scheduler.requests.get(req_id)
            grown = (request.num_tokens if request is not None else count + 1) - count
            if grown != (req_id in used):
                self.problems.append(
                    f"step {oldest.step}: vLLM appended {grown} tokens to r{req_id}, the "
                    f"adapter reported {int(req_id in used)}"
                )

    def abort(self, rid: int) -> bool:
        if rid not in self.live_requests():
            return False
        self.events.append(("abort", rid))
        self.scheduler.finish_requests(str(rid), RequestStatus.FINISHED_ABORTED)
        return True

    def reset_prefix_cache(self) -> bool:
        if self.queue:
            return False
        cached = sorted(b.block_id for b in self.pool.blocks if b.block_hash is not None)
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():
            return False
        self.events.append(("reset",))
        self.events.extend(("unpublish", block) for block in cached)
        return True

    def live_requests(self) -> list[int]:
        requests = self.scheduler.requests
        return [
            rid
            for rid in self.arrived
            if str(rid) in requests and not requests[str(rid)].is_finished()
        ]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        refcounts = (0,) + tuple(b.ref_cnt for b in self.pool.blocks[1:])
        free = tuple(b.block_id for b in self.pool.free_block_queue.get_all_free_blocks())
        return refcounts, free

    def self_check(self) -> str | None:
        """Cross-check the wrapped methods against vLLM's own KV events: as many blocks stored
        as ``publish`` events, as many removed as ``evict`` + ``unpublish`` events."""
        if self.problems:
            return self.problems[0]
        self.native += self.pool.take_events()
        stored = sum(len(e.block_hashes) for e in self.native if isinstance(e, BlockStored))
        removed = sum(len(e.block_hashes) for e in self.native if isinstance(e, BlockRemoved))
        published = sum(1 for e in self.events if e[0] == "publish")
        dropped = sum(1 for e in self.events if e[0] == "evict")
        if stored != published or removed != dropped:
            return (
                f"vLLM's KV events stored {stored} and removed {removed} blocks; the wrapped "
                f"methods saw {published} publications and {dropped} evictions"
            )
        return None

    # -- the wrapped methods --------------------------------------------------------------------

    def _wrap(self) -> None:
        sched, kv, pool = self.scheduler, self.scheduler.kv_cache_manager, self.pool
        allocate_slots, get_new_blocks = kv.allocate_slots, pool.get_new_blocks
        evict, insert, free_blocks = (
            pool._maybe_evict_cached_block,
            pool._insert_block_hash,
            pool.free_blocks,
        )
        preempt, free_request, touch = sched._preempt_request, sched._free_request, pool.touch
        take_events, cache_blocks = kv.take_events, kv.cache_blocks

        def cache_blocks_(request: Request, num_computed_tokens: int) -> None:
            self._owner = int(request.request_id)  # async scheduling, after the output
            try:
                cache_blocks(request, num_computed_tokens)
            finally:
                self._owner = None

        def take_events_() -> list[Any]:
            events = take_events()
            self.native += events
            return events

        def allocate_slots_(request: Request, num_new_tokens: int, *args: Any, **kw: Any) -> Any:
            admission = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            hits = kw.get("new_computed_blocks", args[1] if len(args) > 1 else None)
            self._current, self._pending, self._touched = int(request.request_id), [], []
            try:
                result = allocate_slots(request, num_new_tokens, *args, **kw)
            finally:
                rid, pending, self._current, self._pending = self._current, self._pending, None, []
            if result is None:
                if pending:
                    raise AssertionError(f"allocate_slots failed after effects {pending}")
                return None
            self.events.append(("schedule", rid, num_new_tokens, 0))
            if admission:
                blocks = hits.blocks[0] if hits is not None else []
                hit = tuple(b.block_id for b in blocks)
                self.events.append(("hit", rid, hit))
                if tuple(self._touched) != hit:
                    self.problems.append(f"r{rid} hit {hit} but vLLM touched {self._touched}")
            self.events.extend(pending)
            return result

        def get_new_blocks_(num_blocks: int) -> list[Any]:
            self._evicted = set()
            blocks = get_new_blocks(num_blocks)
            for block in blocks:
                if block.block_id in self._evicted:
                    self._effect(("evict", block.block_id))
                self._effect(("alloc", self._current, block.block_id))
            return blocks

        def touch_(blocks: Any) -> None:
            self._touched += [b.block_id for b in blocks if not b.is_null]
            touch(blocks)

        def evict_(block: Any) -> bool:
            evicted = evict(block)
            if evicted:
                self._evicted.add(block.block_id)
            return evicted

        def insert_(key: Any, block: Any, num_tokens: int | None) -> None:
            before = block.block_hash
            insert(key, block, num_tokens)
            if before is None and block.block_hash is not None:
                index = (num_tokens or 0) // self.config.block_size - 1
                owner = self._current if self._current is not None else self._owner
                self._effect(("publish", owner, index, block.block_id))

        def free_blocks_(ordered_blocks: Iterable[Any]) -> None:
            blocks = list(ordered_blocks)
            self.events.extend(("free", b.block_id) for b in blocks if not b.is_null)
            free_blocks(blocks)

        def preempt_(request: Request, *args: Any, **kw: Any) -> None:
            self.events.append(("preempt", int(request.request_id)))
            for in_flight in self.queue:
                in_flight.left.add(request.request_id)
            preempt(request, *args, **kw)

        def free_request_(request: Request, *args: Any, **kw: Any) -> Any:
            result = free_request(request, *args, **kw)
            reason = _REASONS.get(request.status, str(request.status))
            self.events.append(("finish", int(request.request_id), reason))
            return result

        kv.allocate_slots = allocate_slots_
        pool.get_new_blocks = get_new_blocks_
        pool.touch = touch_
        pool._maybe_evict_cached_block = evict_
        pool._insert_block_hash = insert_
        pool.free_blocks = free_blocks_
        sched._preempt_request = preempt_
        sched._free_request = free_request_
        kv.take_events = take_events_
        kv.cache_blocks = cache_blocks_

    def _effect(self, event: Event) -> None:
        """Effects inside ``allocate_slots`` wait for its ``schedule`` decision."""
        if self._current is None:
            self.events.append(event)
        else:
            self._pending.append(event)
