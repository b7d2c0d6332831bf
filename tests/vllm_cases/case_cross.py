"""vLLM-style tests of an encoder-decoder model's cross-attention (vLLM's objects only, no kvspec
import), run by tests/test_vllm_plugin_cross.py on every supported vLLM, with and without
kvspec's plugin. A scheduler over two KV-cache groups of blocks of 4, as vLLM's own
encoder-decoder tests build it: group 0 the decoder's full attention, group 1 cross-attention
(``CrossAttentionSpec`` under a ``CrossAttentionManager``), patched to behave as an
encoder-decoder model (prefix caching off). Requests of different encoder lengths (one with
none) run to their end on a pool small enough that one is preempted and re-admitted, its
encoder re-run.

``test_cross_attention_holds`` holds. Two plant bugs in vLLM's ``CrossAttentionManager``: its
table one block short of the encoder tokens (slots counted as if the last block were full),
and its blocks freed while the decoder still reads them (the manager skipping the tokens
already computed, as a sliding window would)."""

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 4
BUDGET = 64
ENCODERS = (13, 0, 7, 16, 5)
"""Each request's encoder tokens (the second has no encoder input)."""


def make_scheduler(num_blocks=24):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=BUDGET)
    sched = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        max_model_len=BUDGET,
        is_encoder_decoder=True,  # chunked prefill and prefix caching off
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    common = dict(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["self_attn"], FullAttentionSpec(**common)),
        KVCacheGroupSpec(["cross_attn"], CrossAttentionSpec(**common)),
    ]
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=KVCacheConfig(num_blocks, [], groups),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    # opt-125m is no encoder-decoder model: patched as vLLM's own tests patch it
    scheduler.is_encoder_decoder = True
    scheduler.max_num_encoder_input_tokens = BUDGET
    scheduler.encoder_cache_manager = EncoderDecoderCacheManager(cache_size=BUDGET)
    return scheduler


def make_request(i, encoder, prompt_len=6, max_tokens=6):
    features = [
        MultiModalFeatureSpec(
            data=MultiModalKwargsItem.dummy(),
            mm_position=PlaceholderRange(offset=0, length=encoder),
            identifier=f"audio-{i}",
            modality="audio",
        )
    ]
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=[i + 1] * prompt_len,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        mm_features=features if encoder else None,
        arrival_time=float(i),
    )


def cross_blocks(scheduler, request_id):
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        if isinstance(manager, CrossAttentionManager):
            return len(manager.req_to_blocks.get(request_id, []))
    raise AssertionError("no CrossAttentionManager")


def step(scheduler):
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    fields = ModelRunnerOutput.__dataclass_fields__  # 0.34.0 has no req_id_to_index
    extra = {"req_id_to_index": {r: i for i, r in enumerate(ids)}}
    runner = ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=[[1] for _ in ids],
        **(extra if "req_id_to_index" in fields else {}),
    )
    scheduler.update_from_output(output, runner)
    return output


def run_workload(num_blocks=24):
    scheduler = make_scheduler(num_blocks)
    for i, encoder in enumerate(ENCODERS):
        scheduler.add_request(make_request(i, encoder))
    seen = {}
    preempted = 0
    for _ in range(40):
        if not scheduler.has_requests():
            break
        output = step(scheduler)
        preempted += len(output.preempted_req_ids or ())
        for request_id in output.num_scheduled_tokens:
            if request_id in scheduler.requests:
                seen[request_id] = cross_blocks(scheduler, request_id)
    assert not scheduler.has_requests()
    return seen, preempted


def test_cross_attention_holds():
    seen, _ = run_workload()
    assert seen == {f"r{i}": -(-e // BLOCK) for i, e in enumerate(ENCODERS)}, seen


def test_cross_attention_under_preemption_holds():
    """A pool of 12 blocks: requests are preempted and re-admitted, each re-admission
    allocating its cross table again."""
    seen, preempted = run_workload(num_blocks=12)
    assert preempted > 0
    assert seen == {f"r{i}": -(-e // BLOCK) for i, e in enumerate(ENCODERS)}, seen


def test_a_cross_table_one_block_short_is_caught(monkeypatch):
    original = CrossAttentionManager.allocate_new_blocks

    def one_short(self, request_id, num_tokens, *args, **kw):
        return original(self, request_id, max(0, num_tokens - self.block_size), *args, **kw)

    monkeypatch.setattr(CrossAttentionManager, "allocate_new_blocks", one_short)
    seen, _ = run_workload()
    assert seen["r0"] == 3  # one short of the 4 its 13 encoder tokens need


def test_cross_blocks_freed_while_read_are_caught(monkeypatch):
    monkeypatch.setattr(
        CrossAttentionManager, "get_num_skipped_tokens", lambda self, computed: computed
    )
    run_workload()
