"""vLLM-style tests of a sliding-window KV-cache group (vLLM's objects only, no kvspec import),
run by tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. An
``AsyncScheduler`` over one ``SlidingWindowSpec`` group (window 5, blocks of 2), driven by a batch
queue of two steps as vLLM's engine core does: long prompts sharing prefixes (hits that hold the
null block before the window), decodes past the window (blocks before it freed on the
processed-token basis and nulled in the table), early stops and an abort with steps in flight,
late arrivals. The first holds. Two plant bugs: out-of-window blocks freed on the optimistic
count (the tokens of steps in flight counted as processed: the bug vLLM's
``test_swa_inflight_window_free.py`` guards against), and a hit that takes one cached block as
enough where the window needs two."""

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 2
WINDOW = 5  # a hit needs ceil(4 / 2) = 2 blocks before its end
STOP = 42


@pytest.fixture(autouse=True)
def runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.33.0's default on a GPU


def make_scheduler(num_blocks=40, budget=16, max_seqs=4):
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
    )
    config.scheduler_config.async_scheduling = True  # vLLM's CPU platform turns it off
    spec = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=WINDOW
    )
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    scheduler = AsyncScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
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


def runner_output(ids, sampled):
    """A ``ModelRunnerOutput`` of either release (0.34.0 has no ``req_id_to_index``)."""
    fields = ModelRunnerOutput.__dataclass_fields__
    index = {r: i for i, r in enumerate(ids)}
    extra = {"req_id_to_index": index} if "req_id_to_index" in fields else {}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra)


class EngineCore:
    """A batch queue of ``depth`` steps over the scheduler (1: synchronous); the runner samples
    token 7, or the stop token for a request named in ``stops`` at its n-th sample."""

    def __init__(self, scheduler, stops, depth=2):
        self.scheduler, self.stops, self.depth = scheduler, dict(stops), depth
        self.queue, self.samples = [], {}

    def token(self, rid):
        self.samples[rid] = self.samples.get(rid, 0) + 1
        return STOP if self.stops.get(rid) == self.samples[rid] else 7

    def step(self):
        if len(self.queue) < self.depth and self.scheduler.has_requests():
            output = self.scheduler.schedule()
            requests = self.scheduler.requests
            samples = {r for r in output.num_scheduled_tokens if not requests[r].is_prefill_chunk}
            self.queue.append((output, samples))
        if len(self.queue) == self.depth or (self.queue and not self.scheduler.has_requests()):
            output, samples = self.queue.pop(0)
            ids = list(output.num_scheduled_tokens)
            sampled = [[self.token(r)] if r in samples else [] for r in ids]
            self.scheduler.update_from_output(output, runner_output(ids, sampled))


def workload(core):
    """Shared long prefixes, an early stop with a decode in flight, an abort with two steps in
    flight, late arrivals that hit past the window; everything finishes and the pool is whole."""
    scheduler = core.scheduler
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    prompts = (base + [12], base + [13, 13], [20, 21, 22, 23, 24, 25, 26], base[:5])
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"req-{i}", prompt, float(i), max_tokens=8))
    for _ in range(6):
        core.step()
    scheduler.finish_requests("req-2", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("late", base + [12, 7, 7], 9.0))
    scheduler.add_request(make_request("later", base + [30], 10.0))
    for _ in range(100):  # a step with nothing scheduled or queued does nothing
        core.step()
    assert not scheduler.has_requests() and not core.queue
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert scheduler.kv_cache_manager.reset_prefix_cache()


def _nulls(scheduler):
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return sum(1 for blocks in manager.req_to_blocks.values() for b in blocks if b.is_null)


def test_sliding_window_holds():
    scheduler = make_scheduler()
    seen = []
    original = scheduler.kv_cache_manager.coordinator.remove_skipped_blocks

    def spy(*args, **kw):  # counts what the window freed, calling through
        original(*args, **kw)
        seen.append(_nulls(scheduler))

    scheduler.kv_cache_manager.coordinator.remove_skipped_blocks = spy
    workload(EngineCore(scheduler, stops={"req-3": 2}))
    assert max(seen) > 2  # blocks before the window were freed and nulled


def test_a_free_on_the_optimistic_count_is_caught():
    scheduler = make_scheduler()
    coordinator = scheduler.kv_cache_manager.coordinator
    original = coordinator.remove_skipped_blocks

    def optimistic(request_id, processed, num_prompt_tokens=None):  # planted
        request = scheduler.requests[request_id]
        original(request_id, processed + request.num_in_flight_tokens, num_prompt_tokens)

    coordinator.remove_skipped_blocks = optimistic
    workload(EngineCore(scheduler, stops={"req-3": 2}))


def test_a_hit_short_of_the_window_is_caught(monkeypatch):
    monkeypatch.setattr(  # planted: one cached block is taken as enough
        SlidingWindowManager, "_contiguous_blocks_for_hit", classmethod(lambda cls, *a, **kw: 1)
    )
    workload(EngineCore(make_scheduler(), stops={"req-3": 2}))
