"""Building vLLM's own objects (0.33.0 and 0.34.0, ``versions.py``) for one fuzzed cell: its ``VllmConfig`` (kept per
construction key, ``reuse.py``: it costs many times the rest of an engine's construction), the
KV-cache config of one full-attention group, the ``Scheduler`` or ``AsyncScheduler``, and the
request block hasher (built fresh for every example).

A batch queue of D steps is what ``VllmConfig.max_concurrent_batches`` makes of the parallel and
scheduler configs: the synchronous ``Scheduler`` keeps ``pipeline_parallel_size`` steps in flight;
async scheduling with Model Runner V2 (vLLM 0.33.0's default runner on a GPU, 0.34.0's only one)
keeps ``pipeline_parallel_size + 1``. So a synchronous cell of depth D gets ``pipeline_parallel_size = D``
and an async one ``D - 1``, with Model Runner V2 (whose pipeline-parallel decode cadence, one decode
of a request every ``pipeline_parallel_size`` steps, lives in ``AsyncScheduler``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from . import versions  # noqa: E402

try:
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
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
        f"the vLLM adapter needs vLLM ({', '.join(versions.SUPPORTED)}) ({err}); run "
        "`make thirdparty` and use .venv-vllm/bin/kvspec (or .venv-vllm-0.34.0/bin/kvspec)"
    ) from None

import torch

from kvspec.conformance.adapters import tiny_model_folder
from kvspec.spec import Config

from . import cpu_platform
from . import reuse as reuse_

cpu_platform.install()


@lru_cache(maxsize=1)
def _model_folder() -> str:
    """A local folder holding only a tiny ``config.json``: all ``ModelConfig`` reads."""
    return tiny_model_folder("vllm")


@contextmanager
def runner_v2(on: bool) -> Iterator[None]:
    """Model Runner V2 while vLLM reads which runner it has (``VllmConfig.use_v2_model_runner``
    reads ``VLLM_USE_V2_MODEL_RUNNER`` each time): on a GPU it is vLLM 0.33.0's default; on this
    CPU-only build vLLM falls back to V1 for want of Triton's GPU backend, though the scheduler
    does not depend on the device. 0.34.0 has no other runner: nothing to set."""
    name = "VLLM_USE_V2_MODEL_RUNNER"
    before = os.environ.get(name)
    if on and versions.installed().runner_v2_flag:
        os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def new_vllm_config(
    num_blocks: int,
    block_size: int,
    budget: int,
    max_running: int,
    policy: str,
    depth: int,
    async_scheduling: bool,
    long_prefill_token_threshold: int = 0,
    prefix_caching: bool = True,
    spec_tokens: int = 0,
    model_folder: str | None = None,
    kv_transfer: Any = None,
) -> VllmConfig:
    """vLLM's config of the cell, built now (its arguments are ``reuse.py``'s construction key).
    ``spec_tokens`` K > 0: speculative decoding with n-gram drafts, K per decode (vLLM's
    ``SpeculativeConfig(method="ngram")``, as vLLM's own CPU tests set it; ``drafts.py``).
    ``model_folder``: the ``config.json`` of another model (``hybrid.py``'s), else the plain one.
    ``kv_transfer``: a ``KVTransferConfig`` (a KV connector, ``loads.py``), else none."""
    model = ModelConfig(
        model=model_folder or _model_folder(),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=1024,
    )
    scheduler = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=budget,
        max_num_seqs=max_running,
        enable_chunked_prefill=True,
        policy=policy,
        async_scheduling=async_scheduling,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    cache.num_gpu_blocks = num_blocks
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    # A batch queue of `depth` steps (module docstring).
    parallel = ParallelConfig(pipeline_parallel_size=depth - 1 if async_scheduling else depth)
    with runner_v2(async_scheduling):
        config = VllmConfig(
            model_config=model,
            scheduler_config=scheduler,
            cache_config=cache,
            kv_events_config=events,
            parallel_config=parallel,
            speculative_config=(
                SpeculativeConfig(model="ngram", num_speculative_tokens=spec_tokens)
                if spec_tokens
                else None
            ),
            kv_transfer_config=kv_transfer,
        )
        # vLLM's CPU platform turns async scheduling off (a GPU one keeps it); the scheduler
        # itself does not depend on the device.
        config.scheduler_config.async_scheduling = async_scheduling
        assert config.max_concurrent_batches == depth, config.max_concurrent_batches
    return config


def build_scheduler(
    config: Config,
    async_scheduling: bool,
    long_prefill_token_threshold: int = 0,
    reuse: bool = True,
) -> Any:
    """vLLM's ``Scheduler`` (or ``AsyncScheduler``, with Model Runner V2) for the cell: one
    KV-cache group of full attention over ``config.num_blocks`` blocks, prefix caching as
    ``config.prefix_caching`` says (on by default, as in vLLM), chunked prefill on, a batch
    queue of ``config.depth`` steps; prefill chunks capped at ``long_prefill_token_threshold``
    tokens once two requests are eligible (0, vLLM's default: no cap). ``reuse``: on the
    ``VllmConfig`` kept for the cell (``reuse.py``), else on one built for it now."""
    bsz = config.block_size
    key = (config.num_blocks, bsz, config.token_budget, config.max_running, config.preemption)
    key += (config.depth, async_scheduling, long_prefill_token_threshold, config.prefix_caching)
    key += (config.spec_tokens,)
    built = lambda: new_vllm_config(*key)  # noqa: E731
    vconfig = reuse_.configs.get(key, built) if reuse else built()
    return scheduler_on(vconfig, config, async_scheduling)


def scheduler_on(vconfig: VllmConfig, config: Config, async_scheduling: bool) -> Any:
    """The scheduler of ``build_scheduler`` on a ``VllmConfig`` the caller has (tests set
    scheduler options the factories never do on a fresh one)."""
    bsz = config.block_size
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
    with runner_v2(async_scheduling):
        scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
            vllm_config=vconfig,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vconfig),
            block_size=bsz,
        )
    assert versions.uses_runner_v2(scheduler) or not async_scheduling
    return scheduler


def block_hasher(block_size: int) -> Any:
    """vLLM's chained request block hasher (sha256), as the engine core sets it up."""
    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)
