"""vLLM-style tests (vLLM's own objects, no kvspec import) run by tests/test_pytest_plugin.py in
.venv-vllm, with and without kvspec's plugin. This one plays the seed's scenario: PRIORITY
preempts a request that was scheduled, and eagerly registered, in the same step (PR 43569)."""

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 2


def make_scheduler(policy="priority", num_blocks=8, caching=True):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=6,
        max_num_seqs=3,
        enable_chunked_prefill=True,
        policy=policy,
        watermark=0.0,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=caching)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def make_request(request_id, prompt, priority, arrival, max_tokens=2):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def runner_output(scheduler, output, token=1):
    """What a model runner returns: one token for each request that reached the end of its
    known tokens, none for a prefill chunk."""
    ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[] if scheduler.requests[r].is_prefill_chunk else [token] for r in ids],
    )


def step(scheduler):
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner_output(scheduler, output))
    return output


def test_priority_preempts_a_request_scheduled_in_the_same_step():
    scheduler = make_scheduler()
    victim = make_request("victim", [1, 2, 3, 1, 2, 3, 1, 2, 1], priority=1, arrival=0.0)
    scheduler.add_request(victim)
    step(scheduler)
    scheduler.add_request(make_request("A", [1], priority=0, arrival=1.0))
    scheduler.add_request(make_request("B", [1, 2], priority=0, arrival=2.0))
    step(scheduler)
    output = scheduler.schedule()  # the victim's block 5 is published, then it is preempted
    assert "victim" not in output.num_scheduled_tokens
    assert victim.status == RequestStatus.PREEMPTED
    # A later request with the victim's first 10 tokens hits the block nobody will write.
    scheduler.update_from_output(output, runner_output(scheduler, output))
    scheduler.add_request(
        make_request("C", [1, 2, 3, 1, 2, 3, 1, 2, 1, 1, 5], priority=0, arrival=3.0)
    )
    step(scheduler)


def test_fcfs_shared_prefixes_hold():
    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7])):
        scheduler.add_request(make_request(f"req-{i}", prompt, priority=0, arrival=float(i)))
    for _ in range(12):
        step(scheduler)
    scheduler.add_request(make_request("late", [1, 2, 3, 4, 5, 1], priority=0, arrival=9.0))
    scheduler.finish_requests("req-2", RequestStatus.FINISHED_ABORTED)
    while scheduler.has_requests():
        step(scheduler)
    assert scheduler.kv_cache_manager.reset_prefix_cache()


def test_a_request_id_reused_after_its_request_finished_holds():
    """vLLM forgets a finished request's id; a test (multi-turn) may add a new request under it."""
    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    for turn in range(3):
        prompt = [1, 2, 3, 4, 5] + [6] * turn
        scheduler.add_request(make_request("chat", prompt, priority=0, arrival=float(turn)))
        while scheduler.has_requests():
            step(scheduler)
    assert "chat" not in scheduler.requests
