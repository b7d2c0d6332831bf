"""vLLM 0.33.0's real ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` through the adapter
protocol (``kvspec fuzz --target kvspec.conformance.adapters.vllm_adapter:factory``).

Importable only where vLLM 0.33.0 is installed (``make thirdparty`` builds ``.venv-vllm``). Nothing
of vLLM is reimplemented here: the adapter builds vLLM's own objects (one KV-cache group, full
attention, prefix caching on, chunked prefill, synchronous scheduling: depth 1), plays the model
runner (one sampled token per request that reached the end of its known tokens, the token drawn by
Hypothesis through ``choices``), and turns what vLLM does into kvspec events by wrapping, on each
instance, the methods where the block lifecycle happens:

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

import json
import os
import tempfile
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
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

from kvspec.reference.choices import Choices
from kvspec.spec import Config

Event = tuple[object, ...]
VOCAB = 4
"""Sampled tokens are 0 .. VOCAB - 1; token 0 is a stop token (``Config.stop_token``)."""

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
    if config.depth != 1:
        return f"the adapter drives vLLM synchronously (depth 1), not depth {config.depth}"
    if config.stop_token not in (None, 0):
        return f"the fake model runner's stop token is 0, not {config.stop_token}"
    return None


def factory(config: Config, choices: Choices) -> VllmAdapter:
    """The adapter factory named on the command line."""
    why = supported(config)
    if why is not None:
        raise ValueError(why)
    return VllmAdapter(config, choices)


@lru_cache(maxsize=1)
def _model_folder() -> str:
    """A local folder holding only a tiny ``config.json``: all ``ModelConfig`` reads."""
    folder = tempfile.mkdtemp(prefix="kvspec-vllm-model-")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


@lru_cache(maxsize=64)
def _vllm_config(
    num_blocks: int, block_size: int, budget: int, max_running: int, policy: str
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
        async_scheduling=False,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return VllmConfig(
        model_config=model, scheduler_config=scheduler, cache_config=cache, kv_events_config=events
    )


class VllmAdapter:
    supports_loads = False

    def __init__(self, config: Config, choices: Choices) -> None:
        self.config = config
        self.choices = choices
        self.events: list[Event] = []
        bsz = config.block_size
        vllm_config = _vllm_config(
            config.num_blocks, bsz, config.token_budget, config.max_running, config.preemption
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
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=bsz,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(bsz, sha256)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.arrived: list[int] = []
        self.in_flight: Any = None  # the SchedulerOutput of the step submitted, not committed
        self.next_step = 0
        self.native: list[Any] = []
        self._current: int | None = None  # request whose slots are being allocated
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
        if self.in_flight is None:
            if not self.scheduler.has_requests():
                return False
            step = self.next_step
            self.next_step += 1
            self.events.append(("begin", step))
            self.in_flight = (step, self.scheduler.schedule())
            self.events.append(("submit", step))
            return True
        step, output = self.in_flight
        self.in_flight = None
        self.events.append(("execute", step, ()))
        sampled: list[tuple[int, int]] = []
        req_ids: list[str] = []
        tokens: list[list[int]] = []
        for req_id in output.num_scheduled_tokens:
            request = self.scheduler.requests.get(req_id)  # None once aborted
            req_ids.append(req_id)
            if request is not None and request.num_computed_tokens >= request.num_tokens:
                token = self.choices.pick(VOCAB, "vllm-token")
                sampled.append((int(req_id), token))
                tokens.append([token])
            else:
                tokens.append([])
        self.events.append(("commit", step, tuple(sampled)))
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=tokens,
        )
        self.scheduler.update_from_output(output, runner)
        return True

    def abort(self, rid: int) -> bool:
        if rid not in self.live_requests():
            return False
        self.events.append(("abort", rid))
        self.scheduler.finish_requests(str(rid), RequestStatus.FINISHED_ABORTED)
        return True

    def reset_prefix_cache(self) -> bool:
        if self.in_flight is not None:
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
        take_events = kv.take_events

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
                self._effect(("publish", self._current, index, block.block_id))

        def free_blocks_(ordered_blocks: Iterable[Any]) -> None:
            blocks = list(ordered_blocks)
            self.events.extend(("free", b.block_id) for b in blocks if not b.is_null)
            free_blocks(blocks)

        def preempt_(request: Request, *args: Any, **kw: Any) -> None:
            self.events.append(("preempt", int(request.request_id)))
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

    def _effect(self, event: Event) -> None:
        """Effects inside ``allocate_slots`` wait for its ``schedule`` decision."""
        if self._current is None:
            self.events.append(event)
        else:
            self._pending.append(event)
