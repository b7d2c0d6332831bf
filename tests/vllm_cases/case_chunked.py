"""vLLM-style tests of a chunked local attention KV-cache group (vLLM's objects only, no kvspec
import), run by ``tests/test_vllm_plugin_chunked.py`` in every supported release's environment
with and without kvspec's plugin. ``case_window.py``'s ``AsyncScheduler`` and workload (a batch
queue of two steps, shared long prefixes, an early stop with a decode in flight, an abort with
two steps in flight, late arrivals that hit), its one group a ``ChunkedLocalAttentionSpec``
(chunks of 4 tokens, blocks of 2) under vLLM's ``ChunkedLocalAttentionManager``: hits that hold
the null block before the chunk of their cap, blocks of the chunks before the next processed
token's freed and nulled. The first holds. Planted in vLLM's manager: a skipped count one chunk
too far (the block of the current chunk freed while a step in flight reads it), and a hit that
takes the block before the chunk as well (a block where vLLM's rule holds the null block)."""

import pytest
import torch
from case_window import BLOCK, EngineCore, make_request
from case_window import make_scheduler as window_scheduler
from case_window import workload as window_workload
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.structured_output import StructuredOutputManager

CHUNK = 4  # two blocks of 2: token t attends to (t // 4) * 4 .. t


@pytest.fixture(autouse=True)
def runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.33.0's default on a GPU


def make_scheduler(num_blocks=40, beside_full=False):
    """``case_window.py``'s scheduler, its group replaced by a chunked one (``beside_full``:
    after a full-attention group, as vLLM groups Llama 4's global and local layers)."""
    config = window_scheduler(num_blocks).vllm_config
    spec = ChunkedLocalAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        attention_chunk_size=CHUNK,
    )
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["local"], spec)]
    if beside_full:
        groups.insert(0, KVCacheGroupSpec(["global"], full))
    kv = KVCacheConfig(num_blocks, [], groups)
    return AsyncScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def workload(core):
    """A request that decodes past its prompt's chunk, then one whose prompt is its prefix and
    ends two tokens into a chunk (its hit: nulls, then the block its predecessor computed at
    that chunk's start), then ``case_window.py``'s workload."""
    base = list(range(1, 12))
    core.scheduler.add_request(make_request("first", [*base, 12], 0.0, max_tokens=6))
    for _ in range(12):
        core.step()
    core.scheduler.add_request(make_request("again", [*base, 12, 7, 7, 7], 1.0, max_tokens=3))
    for _ in range(12):
        core.step()
    window_workload(core)


def _nulls(scheduler, group):
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[group]
    return sum(1 for blocks in manager.req_to_blocks.values() for b in blocks if b.is_null)


def _holds(scheduler, kinds):
    """The workload, asserting vLLM's managers are ``kinds`` and that the chunked group (the
    last) freed and nulled blocks before the chunk and took hits past whole chunks."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [type(m).__name__ for m in managers] == kinds
    seen = []
    original = scheduler.kv_cache_manager.coordinator.remove_skipped_blocks

    def spy(*args, **kw):  # counts what the chunks freed, calling through
        original(*args, **kw)
        seen.append(_nulls(scheduler, len(managers) - 1))

    scheduler.kv_cache_manager.coordinator.remove_skipped_blocks = spy
    hits = []
    find = scheduler.kv_cache_manager.get_computed_blocks

    def hit_spy(request, *args, **kw):
        found = find(request, *args, **kw)  # (blocks, tokens, ...): its length per release
        hits.append(found[1])
        return found

    scheduler.kv_cache_manager.get_computed_blocks = hit_spy
    workload(EngineCore(scheduler, stops={"req-3": 2}))
    assert max(seen) > 2  # blocks before the chunk were freed and nulled
    return hits


def test_chunked_local_attention_holds():
    hits = _holds(make_scheduler(), ["ChunkedLocalAttentionManager"])
    assert max(hits) >= 2 * CHUNK  # hits past whole chunks (nulls before the cap's chunk)


def test_chunked_beside_full_attention_holds():
    hits = _holds(
        make_scheduler(num_blocks=80, beside_full=True),
        ["FullAttentionManager", "ChunkedLocalAttentionManager"],
    )
    assert max(hits) >= 2 * CHUNK  # hits both groups serve, past a whole chunk


def test_a_skip_one_chunk_too_far_is_caught(monkeypatch):
    original = ChunkedLocalAttentionManager.get_num_skipped_tokens

    def too_far(self, num_computed_tokens):  # planted: the current chunk skipped too
        return original(self, num_computed_tokens) + CHUNK

    monkeypatch.setattr(ChunkedLocalAttentionManager, "get_num_skipped_tokens", too_far)
    workload(EngineCore(make_scheduler(), stops={"req-3": 2}))


def test_a_hit_taking_the_block_before_its_chunk_is_caught(monkeypatch):
    original = ChunkedLocalAttentionManager.find_longest_cache_hit.__func__

    def one_more(cls, block_hashes, max_length, *args, **kw):
        # planted: the chunk starts one block early, so the hit holds the cached block (or
        # stops short at its miss) where vLLM's rule holds the null block
        blocks, length = original(cls, block_hashes, max_length, *args, **kw)
        start = max_length // CHUNK * CHUNK // BLOCK
        pool = args[1] if len(args) > 1 else kw["block_pool"]
        groups = args[0] if args else kw["kv_cache_group_ids"]
        if start and len(blocks[0]) > start:
            cached = pool.get_cached_block(block_hashes[start - 1], groups)
            if cached is not None:
                for mine, block in zip(blocks, cached, strict=True):
                    mine[start - 1] = block
        return blocks, length

    monkeypatch.setattr(
        ChunkedLocalAttentionManager, "find_longest_cache_hit", classmethod(one_more)
    )
    workload(EngineCore(make_scheduler(), stops={"req-3": 2}))
