"""vLLM-style tests of ``AsyncScheduler`` (vLLM's objects only, no kvspec import) run by
tests/test_pytest_plugin.py in .venv-vllm, with and without kvspec's plugin. Both drive a batch
queue of two steps as vLLM's engine core does under async scheduling (step N+1 is scheduled
before step N's output is processed). The first, shared prefixes under fcfs, holds. The second
plays the seed's scenario under async scheduling (docs/findings/vllm_async_chunked_prefill_zombie.py):
PRIORITY preempts a request whose next prefill chunk it scheduled, and registered, in the same
call; a later request hits the block no step writes."""

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


@pytest.fixture(autouse=True)
def runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.33.0's default on a GPU


def make_scheduler(policy, block, num_blocks, budget, threshold=0, max_seqs=8):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=threshold,
        policy=policy,
        async_scheduling=True,
    )
    cache = CacheConfig(block_size=block, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        parallel_config=ParallelConfig(pipeline_parallel_size=1),
    )
    config.scheduler_config.async_scheduling = True  # vLLM's CPU platform turns it off
    assert config.max_concurrent_batches == 2
    spec = FullAttentionSpec(block, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    return AsyncScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block,
    )


def make_request(request_id, prompt, block, priority=0, arrival=0.0, max_tokens=3):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival,
        priority=priority,
        block_hasher=get_request_block_hasher(block, sha256),
    )


class EngineCore:
    """A batch queue of two steps over the scheduler, and a runner that samples token 7 for
    every request whose chunk reaches the end of its tokens (known and placeholders)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.queue = []

    def schedule(self):
        output = self.scheduler.schedule()
        requests = self.scheduler.requests
        samples = {r for r in output.num_scheduled_tokens if not requests[r].is_prefill_chunk}
        self.queue.append((output, samples))
        return output

    def process_oldest(self):
        output, samples = self.queue.pop(0)
        ids = list(output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if r in samples else [] for r in ids],
        )
        self.scheduler.update_from_output(output, runner)

    def step(self):
        """One ``EngineCore.step_with_batch_queue`` round: schedule while the queue has room,
        then process the oldest output."""
        if len(self.queue) < 2 and self.scheduler.has_requests():
            self.schedule()
        if len(self.queue) == 2 or (self.queue and not self.scheduler.has_requests()):
            self.process_oldest()


def test_async_shared_prefixes_hold():
    block = 2
    core = EngineCore(make_scheduler("fcfs", block, num_blocks=16, budget=8, max_seqs=3))
    prompts = ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 6], [1, 2, 3, 7])
    for i, prompt in enumerate(prompts):
        core.scheduler.add_request(make_request(f"req-{i}", prompt, block, arrival=float(i)))
    for _ in range(6):
        core.step()
    core.scheduler.add_request(make_request("late", [1, 2, 3, 4, 5, 1], block, arrival=9.0))
    core.scheduler.finish_requests("req-2", RequestStatus.FINISHED_ABORTED)
    for _ in range(40):
        core.step()
    assert not core.scheduler.has_requests() and not core.queue
    assert core.scheduler.kv_cache_manager.reset_prefix_cache()


def test_async_chunked_prefill_preempted_in_flight():
    block = 16
    core = EngineCore(make_scheduler("priority", block, num_blocks=10, budget=64, threshold=32))
    prompt0 = [(i * 7 + 3) % 250 + 1 for i in range(144)]
    victim = make_request("r0", prompt0, block, priority=1, arrival=0.0, max_tokens=4)
    core.scheduler.add_request(victim)
    core.schedule()  # step 0: r0's tokens 0..64
    core.scheduler.add_request(make_request("r1", [200 + i % 50 for i in range(16)], block, 0, 1.0))
    core.schedule()  # step 1, step 0 in flight: r0's 64..96, r1 admitted
    core.process_oldest()
    output = core.schedule()  # step 2: r0's 96..128 registered, then r1's decode preempts r0
    assert "r0" in output.preempted_req_ids and "r0" not in output.num_scheduled_tokens
    core.process_oldest()
    core.process_oldest()
    # A request with r0's first 128 tokens hits the block no step wrote.
    late = make_request("r2", prompt0[:128] + [251, 252, 253], block, 0, 2.0)
    core.scheduler.add_request(late)
    num_hit = core.scheduler.kv_cache_manager.get_computed_blocks(late)[1]
    assert num_hit == 112  # seven cached blocks, the last one never written
