"""vLLM-style tests of speculative decoding under async scheduling (vLLM's objects only, no
kvspec import), run by tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's
plugin. An ``AsyncScheduler`` with n-gram drafts (three per decode) driven by a batch queue of
two steps, as vLLM's engine core does: step N+1 is scheduled before step N's output is
processed, so its decode is scheduled as if every draft of step N were accepted (on
placeholders), and the runner computes it where step N's output really ends (the device moves
it back over the rejected drafts). A varying number of drafts is right; requests share a
prefix; the small pool preempts requests whose output is still in flight (delivered, vLLM's
default). One plants a scheduler bug: the registration after an output that rejected drafts
counts the rejected ones as computed, so blocks past the verified tokens are published. Two
spy on the scheduler as vLLM's own tests do, replacing a method on the instance by a wrapper
around it: one that counts preemptions and calls through (judged), one that fails the first
allocation by itself (refused: what vLLM did then is not what the spec was told)."""

import pytest
import torch
from vllm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 4
DRAFTS = 3
PREFIX = [1, 2, 3, 4, 5]
REJECTED = {}
"""Request id -> drafts rejected by the output being processed (where at least one was)."""


@pytest.fixture(autouse=True)
def runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.33.0's default on a GPU


def build(num_blocks):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=256)
    sched = SchedulerConfig(
        max_model_len=256,
        is_encoder_decoder=False,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_chunked_prefill=True,
        watermark=0.0,
        async_scheduling=True,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    drafts = SpeculativeConfig(model="ngram", num_speculative_tokens=DRAFTS)
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        speculative_config=drafts,
        parallel_config=ParallelConfig(pipeline_parallel_size=1),
    )
    config.scheduler_config.async_scheduling = True  # vLLM's CPU platform turns it off
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    return AsyncScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def request(request_id, prompt, max_tokens):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=0.0,
        priority=0,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def truth(position):
    """The token the model samples at a position, whatever the request."""
    return 10 + position % 7


class EngineCore:
    """A batch queue of two steps over the scheduler, and a runner: a chunk that reaches the
    end of its request's tokens samples the tokens at the positions after the request's real
    end (the outputs processed so far): the right drafts' tokens, then the model's own where
    the first wrong draft was (or after all)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.queue = []
        self.round = 0
        self.accepted = self.rejected = self.preempted = self.stale = 0

    def schedule(self):
        output = self.scheduler.schedule()
        self.preempted += len(output.preempted_req_ids or ())
        requests = self.scheduler.requests
        samples = {r for r in output.num_scheduled_tokens if not requests[r].is_prefill_chunk}
        self.queue.append((output, samples))

    def process_oldest(self):
        output, samples = self.queue.pop(0)
        requests = self.scheduler.requests
        ids = list(output.num_scheduled_tokens)
        sampled = []
        REJECTED.clear()
        for rid in ids:
            req = requests.get(rid)
            if rid not in samples or req is None or req.is_finished():
                sampled.append([])
                continue
            drafts = len(output.scheduled_spec_decode_tokens.get(rid, ()))
            right = (self.round + len(rid)) % (drafts + 1)
            self.round += 1
            sampled.append([truth(req.num_tokens + j) for j in range(right + 1)])
            self.accepted += right
            if drafts > right:
                self.rejected += drafts - right
                REJECTED[rid] = drafts - right
            self.stale += req.num_stale_output_tokens > 0
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        self.scheduler.update_from_output(output, runner)

    def step(self):
        """One ``EngineCore.step_with_batch_queue`` round: schedule while the queue has room,
        then process the oldest output."""
        if len(self.queue) < 2 and self.scheduler.has_requests():
            self.schedule()
        if len(self.queue) == 2 or (self.queue and not self.scheduler.has_requests()):
            self.process_oldest()


def run_workload(num_blocks=32, spy=None):
    core = EngineCore(build(num_blocks))
    if spy is not None:
        spy(core.scheduler)
    for i, tail in enumerate(([6], [7, 8], [6, 9, 9, 9])):
        core.scheduler.add_request(request("r" * (i + 1), PREFIX + tail, max_tokens=14))
    for _ in range(200):
        if not core.scheduler.has_requests() and not core.queue:
            break
        core.step()
    assert not core.scheduler.has_requests() and not core.queue
    for req_tokens in core.scheduler.kv_cache_manager.block_pool.blocks[1:]:
        assert req_tokens.ref_cnt == 0
    return core


def test_async_spec_decode_shared_prefixes_hold():
    core = run_workload()
    assert core.accepted > 5 and core.rejected > 5 and not core.preempted


def test_async_spec_decode_preempted_in_flight_holds():
    core = run_workload(num_blocks=10)
    assert core.accepted > 5 and core.rejected > 5 and core.preempted and core.stale


def test_async_spec_decode_counting_preemptions_holds():
    counted = []

    def spy(scheduler):
        original = scheduler._preempt_request

        def counting(request, *args, **kwargs):
            counted.append(request.num_in_flight_tokens)
            return original(request, *args, **kwargs)

        scheduler._preempt_request = counting

    core = run_workload(num_blocks=10, spy=spy)
    assert core.preempted and len(counted) == core.preempted and any(counted)


def test_async_spec_decode_failing_an_allocation_by_itself():
    def spy(scheduler):
        manager = scheduler.kv_cache_manager
        original, calls = manager.allocate_slots, []

        def failing_once(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs) if len(calls) > 3 else None

        manager.allocate_slots = failing_once

    run_workload(spy=spy)


def test_async_spec_decode_registers_rejected_drafts(monkeypatch):
    original = KVCacheManager.cache_blocks

    def cache_blocks(self, request, num_computed_tokens):
        rejected = REJECTED.get(request.request_id, 0)  # the rollback forgotten here
        original(self, request, min(num_computed_tokens + rejected, request.num_tokens))

    monkeypatch.setattr(KVCacheManager, "cache_blocks", cache_blocks)
    run_workload()
