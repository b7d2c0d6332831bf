"""vLLM-style tests of ``defer_block_free`` (vLLM's objects only, no kvspec import), run by
tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. An
``AsyncScheduler`` with the flag set after construction (as vLLM's own tests do), driven by a
batch queue of two steps as vLLM's engine core does: requests share prefixes, stop early on a
stop token while their next decode is in flight, are aborted with steps in flight, and arrive
late onto the blocks the deferred frees return. The first holds. Two plant scheduler bugs: the
blocks of a request leaving with a step in flight are freed at once (the per-request gate always
says yes), and the deferred frees are drained at any output, before their fence step's."""

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 2
STOP = 42


@pytest.fixture(autouse=True)
def runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.33.0's default on a GPU


def make_scheduler(num_blocks=24, budget=16, max_seqs=4, kv_transfer_config=None):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=True,
        async_scheduling=True,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        parallel_config=ParallelConfig(pipeline_parallel_size=1),
        kv_transfer_config=kv_transfer_config,
    )
    config.scheduler_config.async_scheduling = True  # vLLM's CPU platform turns it off
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    scheduler = AsyncScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    scheduler.defer_block_free = True  # production turns it on only with a KV consumer
    return scheduler


def make_request(request_id, prompt, arrival, max_tokens=6):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[STOP]
        ),
        pooling_params=None,
        arrival_time=arrival,
        priority=0,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


class EngineCore:
    """A batch queue of two steps over the scheduler; the runner samples token 7, or the stop
    token for a request named in ``stops`` at its n-th sample."""

    def __init__(self, scheduler, stops):
        self.scheduler = scheduler
        self.queue = []
        self.stops = dict(stops)
        self.samples = {}

    def schedule(self):
        output = self.scheduler.schedule()
        requests = self.scheduler.requests
        samples = {r for r in output.num_scheduled_tokens if not requests[r].is_prefill_chunk}
        self.queue.append((output, samples))
        return output

    def token(self, rid):
        self.samples[rid] = self.samples.get(rid, 0) + 1
        return STOP if self.stops.get(rid) == self.samples[rid] else 7

    def process_oldest(self):
        output, samples = self.queue.pop(0)
        ids = list(output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[self.token(r)] if r in samples else [] for r in ids],
        )
        self.scheduler.update_from_output(output, runner)

    def step(self):
        if len(self.queue) < 2 and self.scheduler.has_requests():
            self.schedule()
        if len(self.queue) == 2 or (self.queue and not self.scheduler.has_requests()):
            self.process_oldest()


def workload(core):
    """Shared prefixes, two early stops with a decode in flight, an abort with two steps in
    flight, late arrivals onto the returned blocks; everything finishes and the pool is whole."""
    scheduler = core.scheduler
    prompts = ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 6], [1, 2, 3, 7], [9, 9, 9, 9, 9])
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"req-{i}", prompt, float(i)))
    for _ in range(2):
        core.step()
    assert scheduler.deferred_frees  # req-3 stopped while its next decode was in flight
    for _ in range(3):
        core.step()
    scheduler.finish_requests("req-2", RequestStatus.FINISHED_ABORTED)
    assert scheduler.deferred_frees  # aborted while a step computing for it is in flight
    scheduler.add_request(make_request("late", [1, 2, 3, 4, 5, 1], 9.0))
    scheduler.add_request(make_request("later", [8, 8, 8, 8, 8, 8, 8], 10.0))
    for _ in range(40):
        core.step()
    assert not scheduler.has_requests() and not core.queue and not scheduler.deferred_frees
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert scheduler.kv_cache_manager.reset_prefix_cache()


def test_deferred_frees_hold():
    workload(EngineCore(make_scheduler(), stops={"req-1": 2, "req-3": 1}))


def test_a_free_at_once_is_caught():
    scheduler = make_scheduler()
    scheduler._request_blocks_can_be_freed = lambda request: True  # planted: never deferred
    core = EngineCore(scheduler, stops={"req-1": 2, "req-3": 1})
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 6])):
        scheduler.add_request(make_request(f"req-{i}", prompt, float(i)))
    for _ in range(30):
        core.step()
    assert not scheduler.has_requests()


def test_a_drain_before_the_fence_is_caught():
    scheduler = make_scheduler()

    def drain_everything():  # planted: the fence is not waited for
        pool = scheduler.kv_cache_manager.block_pool
        while scheduler.deferred_frees:
            _, blocks = scheduler.deferred_frees.popleft()
            pool.free_blocks(list(reversed(blocks)))

    scheduler._drain_deferred_frees = drain_everything
    core = EngineCore(scheduler, stops={})
    scheduler.add_request(make_request("req-0", [1, 2, 3, 4], 0.0, max_tokens=10))
    for _ in range(3):
        core.schedule()  # three steps in flight
    scheduler.finish_requests("req-0", RequestStatus.FINISHED_ABORTED)
    while core.queue:
        core.process_oldest()  # the first output frees what the third step still writes
