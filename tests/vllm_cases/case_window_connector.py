"""vLLM-style tests (vLLM's objects only, no kvspec import) of a sliding-window group beside a
KV connector that loads nothing, as vLLM's
``test_prefix_hit_is_capped_at_retained_auxiliary_outputs[external-sliding-window-dropped]``
has it (its aux output connector drops the external hit): ``case_window.py``'s
``AsyncScheduler`` (window 5, blocks of 2) and batch queue of two steps, with vLLM's
``ExampleConnector`` whose store holds nothing past the local hit. Long shared prompts that hit
past the window and decodes past it; a finish beside the connector frees the blocks before
the window first (the spec's ``WindowFinish``; loads: ``case_winconn.py``). ``tests/test_vllm_plugin_window_connector.py`` runs them in every supported release's
environment, with and without the plugin. Planted: a hit that takes one cached block as enough
where the window needs two."""

import pytest
import torch
from case_connector import transfer
from case_window import BLOCK, WINDOW, EngineCore, make_request
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.structured_output import StructuredOutputManager


@pytest.fixture(autouse=True)
def runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.33.0's default on a GPU


def make_scheduler(tmp_path, num_blocks=60):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=16,
        max_num_seqs=4,
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
        kv_transfer_config=transfer(tmp_path),
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
    scheduler.connector.get_num_new_matched_tokens = lambda request, computed: (0, False)
    scheduler.connector.build_connector_meta = lambda output: KVConnectorMetadata()
    return scheduler


def workload(scheduler, max_tokens=30, steps=12):
    core = EngineCore(scheduler, stops={})
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    scheduler.add_request(make_request("r0", base + [12], 0.0, max_tokens=max_tokens))
    for _ in range(steps):
        core.step()
    for i, prompt in enumerate((base + [13, 13], base[:9] + [40], [20, 21, 22]), 1):
        scheduler.add_request(make_request(f"r{i}", prompt, float(i), max_tokens=max_tokens))
    for _ in range(steps):
        core.step()
    if max_tokens < steps:
        return  # every request finished
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    nulls = sum(1 for blocks in manager.req_to_blocks.values() for b in blocks if b.is_null)
    assert nulls > 4  # blocks before the window were freed and nulled, hits held nulls


def test_a_window_beside_a_connector_holds(tmp_path):
    workload(make_scheduler(tmp_path))


def test_a_hit_short_of_the_window_beside_a_connector_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(  # planted: one cached block is taken as enough
        SlidingWindowManager, "_contiguous_blocks_for_hit", classmethod(lambda cls, *a, **kw: 1)
    )
    workload(make_scheduler(tmp_path))


def test_a_finish_beside_a_connector_holds(tmp_path):
    workload(make_scheduler(tmp_path), max_tokens=3, steps=8)
