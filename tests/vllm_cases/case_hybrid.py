"""vLLM-style tests of a hybrid model's KV-cache groups (vLLM's objects only, no kvspec import),
run by tests/test_vllm_plugin_hybrid.py on every supported vLLM, with and without kvspec's
plugin. A scheduler over two KV-cache groups of blocks of 2 under vLLM's
``HybridKVCacheCoordinator``: group 0 full attention, group 1 sliding-window attention (window 5),
as a Gemma-style model's layers are grouped, driven by ``case_window.py``'s workload (long shared
prompts whose hits every group must serve, decodes past the window whose blocks before it are
freed and nulled in group 1 only, an early stop, an abort with steps in flight, late arrivals).

``test_full_and_window_groups_hold`` (synchronous ``Scheduler``) and
``test_full_and_window_groups_hold_async`` (``AsyncScheduler``, a batch queue of two steps) hold.
Two plant bugs in vLLM's window manager: a hit that takes one cached block as enough where the
window needs two (the coordinator then hands out a hit group 1 cannot serve), and blocks before
the window freed on the optimistic count (the tokens of steps in flight counted as processed:
blocks a step in flight still reads are recycled). ``test_full_and_mamba_groups``: full attention
beside a Mamba state group (align mode), refused by name this round (its docstring)."""

import pytest
import torch
from case_window import BLOCK, WINDOW, EngineCore, runner_v2  # noqa: F401 (a fixture)
from case_window import workload as window_workload
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import (
    SlidingWindowManager,
    register_all_kvcache_specs,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.structured_output import StructuredOutputManager


def make_scheduler(asynchronous, num_blocks=60, budget=16, max_seqs=4, second="window"):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=True,
        async_scheduling=asynchronous,
    )
    mamba = {"mamba_cache_mode": "align"} if second == "mamba" else {}
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, **mamba)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        parallel_config=ParallelConfig(pipeline_parallel_size=1),
    )
    config.scheduler_config.async_scheduling = asynchronous  # vLLM's CPU platform turns it off
    common = dict(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if second == "mamba":  # a state at each block boundary a step ends at (vLLM's "align")
        state = MambaSpec(
            block_size=BLOCK, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
        )
        groups = [
            KVCacheGroupSpec(["full"], FullAttentionSpec(**common)),
            KVCacheGroupSpec(["mamba"], state),
        ]
        register_all_kvcache_specs(config)
    else:
        groups = [
            KVCacheGroupSpec(["full"], FullAttentionSpec(**common)),
            KVCacheGroupSpec(["window"], SlidingWindowSpec(**common, sliding_window=WINDOW)),
        ]
    kind = AsyncScheduler if asynchronous else Scheduler
    scheduler = kind(
        vllm_config=config,
        kv_cache_config=KVCacheConfig(num_blocks, [], groups),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    assert isinstance(scheduler.kv_cache_manager.coordinator, HybridKVCacheCoordinator)
    return scheduler


def workload(scheduler, depth):
    """``case_window.py``'s workload under a batch queue of ``depth`` steps (1: synchronous);
    everything finishes and the pool is whole."""
    return window_workload(EngineCore(scheduler, stops={"req-3": 2}, depth=depth))


def _nulls(scheduler):
    window = scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    return sum(1 for blocks in window.req_to_blocks.values() for b in blocks if b.is_null)


def _spy_nulls(scheduler):
    """Count the window group's nulls each time vLLM frees skipped blocks (calling through)."""
    seen = []
    coordinator = scheduler.kv_cache_manager.coordinator
    original = coordinator.remove_skipped_blocks

    def spy(*args, **kw):
        original(*args, **kw)
        seen.append(_nulls(scheduler))

    coordinator.remove_skipped_blocks = spy
    return seen


def _hits(scheduler):
    """Record every admission's hit length, per group (calling through)."""
    hits = []
    manager = scheduler.kv_cache_manager
    original = manager.get_computed_blocks

    def spy(*args, **kw):
        found = original(*args, **kw)  # (blocks, ...): its other fields differ by release
        hits.append(tuple(len(group) for group in found[0].blocks))
        return found

    manager.get_computed_blocks = spy
    return hits


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_full_and_window_groups_hold(asynchronous):
    scheduler = make_scheduler(asynchronous)
    seen, hits = _spy_nulls(scheduler), _hits(scheduler)
    workload(scheduler, depth=2 if asynchronous else 1)
    assert max(seen) > 2  # blocks before the window were freed and nulled in group 1
    assert any(h[0] >= 4 and h[0] == h[1] for h in hits)  # both groups served a long hit


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_full_and_mamba_groups(asynchronous):
    """Full attention beside a Mamba state group (vLLM's align mode): states hit at block
    boundaries. Refused by name while kvspec's state groups register where vLLM's do not
    (``Mamba state publication``), judged once they do."""
    scheduler = make_scheduler(asynchronous, second="mamba")
    hits = _hits(scheduler)
    workload(scheduler, depth=2 if asynchronous else 1)
    assert any(h[0] >= 2 and h[1] for h in hits)  # a state was hit beside the full blocks


def test_a_window_hit_short_of_the_window_is_caught(monkeypatch):
    monkeypatch.setattr(  # planted: one cached block is taken as enough for the window group
        SlidingWindowManager, "_contiguous_blocks_for_hit", classmethod(lambda cls, *a, **kw: 1)
    )
    workload(make_scheduler(asynchronous=False), depth=1)


def test_a_window_free_on_the_optimistic_count_is_caught():
    scheduler = make_scheduler(asynchronous=True)
    coordinator = scheduler.kv_cache_manager.coordinator
    original = coordinator.remove_skipped_blocks

    def optimistic(request_id, processed, *args, **kw):  # planted
        request = scheduler.requests[request_id]
        original(request_id, processed + request.num_in_flight_tokens, *args, **kw)

    coordinator.remove_skipped_blocks = optimistic
    workload(scheduler, depth=2)
