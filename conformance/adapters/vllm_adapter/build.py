"""Building vLLM 0.33.0's own objects for one fuzzed cell: its ``VllmConfig`` (cached per
geometry: construction dominates a short example), the KV-cache config of one full-attention
group, the ``Scheduler`` or ``AsyncScheduler``, and the request block hasher."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"the vLLM adapter needs vLLM 0.33.0 ({err}); run `make thirdparty` and use "
        ".venv-vllm/bin/kvspec"
    ) from None

import torch

from kvspec.conformance.adapters import tiny_model_folder
from kvspec.spec import Config


@lru_cache(maxsize=1)
def _model_folder() -> str:
    """A local folder holding only a tiny ``config.json``: all ``ModelConfig`` reads."""
    return tiny_model_folder("vllm")


@lru_cache(maxsize=64)
def vllm_config(
    num_blocks: int,
    block_size: int,
    budget: int,
    max_running: int,
    policy: str,
    depth: int,
    async_scheduling: bool,
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
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    # A batch queue of `depth` steps: pipeline parallelism, or async scheduling's 2.
    parallel = ParallelConfig(pipeline_parallel_size=1 if async_scheduling else depth)
    config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_events_config=events,
        parallel_config=parallel,
    )
    # vLLM's CPU platform turns async scheduling off (a GPU one keeps it); the scheduler itself
    # does not depend on the device.
    config.scheduler_config.async_scheduling = async_scheduling
    assert config.max_concurrent_batches == depth, config.max_concurrent_batches
    return config


def build_scheduler(config: Config, async_scheduling: bool) -> Any:
    """vLLM's ``Scheduler`` (or ``AsyncScheduler``) for the cell: one KV-cache group of full
    attention over ``config.num_blocks`` blocks, prefix caching and chunked prefill on."""
    bsz = config.block_size
    vconfig = vllm_config(
        config.num_blocks,
        bsz,
        config.token_budget,
        config.max_running,
        config.preemption,
        config.depth,
        async_scheduling,
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
    return (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=vconfig,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vconfig),
        block_size=bsz,
    )


def block_hasher(block_size: int) -> Any:
    """vLLM's chained request block hasher (sha256), as the engine core sets it up."""
    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)
