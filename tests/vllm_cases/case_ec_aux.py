"""vLLM-style tests of a scheduler with an EC connector (an encoder cache: vLLM's
``ECExampleConnector``) and with an aux output connector (vLLM's ``AuxOutputSchedulerConnector``,
set after construction as vLLM's tests do), vLLM's objects only, no kvspec import; run by
tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. Text-only requests
share prefixes, so later ones hit blocks earlier ones left. One is refused, not judged: an EC
connector that delays a finished request's free; an aux output connector whose
``max_cache_hit`` (stubbed, as vLLM's own test does) caps a hit below the cached prefix is
judged (the admission's decision carries the bound: tests/vllm_cases/case_hitbound.py). One
plants a pool bug under the aux output connector: a finished request's blocks freed head first
instead of tail first."""

import numpy as np
import torch
from case_seed import BLOCK, make_request, runner_output
from vllm.config import CacheConfig, ECTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.aux_output_connector.connector import (
    AuxOutputSchedulerConnector,
    AuxRequestOutput,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 5, 6, 8],  # hits r0's first three blocks once r0 has left them
    [1, 2, 3, 4, 9],
    [7, 7, 7, 7, 7],
]


def make_scheduler(tmp_path=None, num_blocks=16):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        enable_chunked_prefill=True,
        policy="fcfs",
        watermark=0.0,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    ec = None
    if tmp_path is not None:
        ec = ECTransferConfig(
            ec_connector="ECExampleConnector",
            ec_role="ec_consumer",
            ec_connector_extra_config={"shared_storage_path": str(tmp_path / "ec")},
        )
    config = VllmConfig(
        model_config=model, scheduler_config=sched, cache_config=cache, ec_transfer_config=ec
    )
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def with_aux(scheduler):
    scheduler.aux_output_connector = AuxOutputSchedulerConnector(scheduler.kv_cache_manager)
    return scheduler


def run(scheduler, prompts=PROMPTS):
    """Add the requests one step apart, step until every one is done; the steps taken. With an
    aux output connector the runner reports a row per token of every scheduled request."""
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, 0, float(i), max_tokens=3))
        if i == 0:
            for _ in range(4):
                step(scheduler)  # r0 finishes first: later prompts hit what it left
    steps = 0
    while scheduler.has_requests() and steps < 100:
        step(scheduler)
        steps += 1
    return steps


def step(scheduler):
    output = scheduler.schedule()
    runner = runner_output(scheduler, output)
    if scheduler.aux_output_connector is not None:
        runner.aux_output_connector_output = {
            r: AuxRequestOutput(0, np.zeros((scheduler.requests[r].num_tokens + 1, 1, 1), np.uint8))
            for r in output.num_scheduled_tokens
        }
    scheduler.update_from_output(output, runner)
    return output


def test_ec_connector_text_only_holds(tmp_path):
    scheduler = make_scheduler(tmp_path)
    assert scheduler.ec_connector is not None
    assert run(scheduler) > 4
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_ec_connector_delaying_a_free_is_refused(tmp_path):
    scheduler = make_scheduler(tmp_path)
    scheduler.ec_connector.request_finished = lambda request: (True, None)
    run(scheduler, PROMPTS[:1])
    assert "r0" in scheduler.requests  # finished, its blocks held for the connector


def test_aux_output_connector_holds():
    scheduler = with_aux(make_scheduler())
    assert run(scheduler) > 4
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_aux_output_connector_capping_a_hit_holds():
    scheduler = with_aux(make_scheduler())
    scheduler.aux_output_connector.max_cache_hit = lambda request: BLOCK  # one block at most
    run(scheduler, PROMPTS[:2])


def test_aux_output_connector_blocks_freed_head_first():
    """The planted bug: a finished request's blocks go to the free queue head first, so its
    first block is evicted first (vLLM frees the tail first)."""
    scheduler = with_aux(make_scheduler())
    single = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    single.free = lambda request_id: single.block_pool.free_blocks(
        single.pop_blocks_for_free(request_id)
    )
    assert run(scheduler) > 4
