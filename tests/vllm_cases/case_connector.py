"""vLLM-style tests of a scheduler with a KV connector (vLLM's objects only, no kvspec import),
run by tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. The connector
is vLLM's ``ExampleConnector``; each test scripts what its external store holds by setting the
connector's ``get_num_new_matched_tokens`` on the instance (how many tokens past the local hit,
and whether the load is asynchronous), and its ``build_connector_meta`` plans nothing (no worker
runs). Synchronous loads compute the rest of the prompt in the
load's step; asynchronous ones leave the request waiting for remote KV until a runner output
names it in ``finished_recving``, and later requests hit the loaded blocks once they are cached.
One plants a bug: blocks allocated for an asynchronous load are cached at once, before the load
has landed."""

import torch
from case_seed import BLOCK, make_request, runner_output
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

LOADED = 2 * BLOCK
"""Tokens each scripted store holds past a request's local hit: two full blocks."""


def make_scheduler(tmp_path, is_async, num_blocks=24):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_chunked_prefill=True,
        policy="fcfs",
        watermark=0.0,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=transfer(tmp_path),
    )
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )

    def matched(request, num_computed_tokens):
        # the store holds two more blocks, unless they would reach the last prompt token
        room = (request.num_tokens - 1) // BLOCK * BLOCK - num_computed_tokens
        tokens = LOADED if room >= LOADED else 0
        return tokens, is_async and tokens > 0

    scheduler.connector.get_num_new_matched_tokens = matched
    # its metadata would plan file reads for the worker; these steps run no worker
    scheduler.connector.build_connector_meta = lambda output: KVConnectorMetadata()
    return scheduler


def transfer(tmp_path):
    """vLLM's ``ExampleConnector`` as producer and consumer, its store under ``tmp_path``."""
    return KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "store")},
    )


def landed(ids):
    """A runner output that computed nothing and reports the loads of ``ids`` finished."""
    return ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        sampled_token_ids=[],
        kv_connector_output=KVConnectorOutput(finished_recving=set(ids)),
    )


def run(scheduler, prompts):
    """Add the requests, step until every one is done; the steps taken. Loading requests get
    their ``finished_recving`` in the output of the step after the one that started the load."""
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, 0, float(i), max_tokens=3))
    steps = 0
    started: set[str] = set()
    while scheduler.has_requests() and steps < 100:
        output = scheduler.schedule()
        loading = {
            r.request_id
            for r in scheduler.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        runner = runner_output(scheduler, output)
        if loading & started:
            runner.kv_connector_output = KVConnectorOutput(finished_recving=loading & started)
        started |= loading
        scheduler.update_from_output(output, runner)
        steps += 1
    assert not scheduler.has_requests()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    return steps


PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9],  # loads blocks (1 2) (3 4), computes 5 .. 9
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # hits what r0 left, loads two more
    [7, 7, 7, 7, 7, 7, 7],
]


def test_synchronous_loads_hold(tmp_path):
    scheduler = make_scheduler(tmp_path, is_async=False)
    assert run(scheduler, PROMPTS[:1]) > 2
    assert run(scheduler, PROMPTS[1:]) > 2


def test_asynchronous_loads_hold(tmp_path):
    scheduler = make_scheduler(tmp_path, is_async=True)
    assert run(scheduler, PROMPTS[:1]) > 3
    assert run(scheduler, PROMPTS[1:]) > 3


def test_a_load_cached_before_it_lands(tmp_path):
    scheduler = make_scheduler(tmp_path, is_async=True)
    coordinator = scheduler.kv_cache_manager.coordinator
    allocate = coordinator.allocate_new_blocks

    def allocate_new_blocks(request_id, *args, **kw):
        blocks = allocate(request_id, *args, **kw)
        request = scheduler.requests[request_id]
        if request.num_computed_tokens == 0 and request.status == RequestStatus.WAITING:
            coordinator.cache_blocks(request, LOADED)  # the planted bug: before it has landed
        return blocks

    coordinator.allocate_new_blocks = allocate_new_blocks
    run(scheduler, PROMPTS[:1])
