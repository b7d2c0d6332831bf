"""vLLM-style tests of a bare KVCacheManager (vLLM's objects only, no kvspec import), run by
tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. One plants a pool
bug: allocate_slots allocates its new blocks before it touches its hits."""

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

BLOCK = 4


def make_manager(num_blocks):
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    return KVCacheManager(
        config, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )


def make_request(request_id, prompt):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def admit(manager, request):
    hits, num_hits, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits)
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    return num_hits


def test_a_shared_prefix_is_hit_after_its_request_leaves():
    manager = make_manager(num_blocks=6)
    first = make_request("first", list(range(9)))
    assert admit(manager, first) == 0
    manager.free(first)
    second = make_request("second", list(range(8)) + [50, 51, 52, 53, 54])
    assert admit(manager, second) == 2 * BLOCK
    manager.free(second)
    assert manager.reset_prefix_cache()


def test_touch_after_allocate(monkeypatch):
    """The planted bug: a hit joins the request's table at once but is touched only after the
    new blocks are allocated, so a hit block still in the free queue can be handed out as a new
    block (the single-type manager's two steps, swapped)."""
    manager = make_manager(num_blocks=8)
    single = manager.coordinator.single_type_managers[0]
    untouched = []
    allocate = single.allocate_new_blocks

    def add_hits_untouched(request_id, blocks, num_local, num_external):
        single.req_to_blocks[request_id].extend(blocks)
        single.num_cached_block[request_id] = len(blocks)
        untouched.extend(blocks)

    def allocate_then_touch(request_id, *args, **kwargs):
        new = allocate(request_id, *args, **kwargs)
        manager.block_pool.touch(untouched)
        untouched.clear()
        return new

    monkeypatch.setattr(single, "add_local_computed_blocks", add_hits_untouched)
    monkeypatch.setattr(single, "allocate_new_blocks", allocate_then_touch)
    first = make_request("first", list(range(9)))  # blocks 1, 2 (cached) and 3
    admit(manager, first)
    manager.free(first)  # free queue: 3 4 5 6 7, then the cached 2 1
    other = make_request("other", list(range(100, 109)))  # blocks 3, 4 (cached) and 5
    admit(manager, other)
    manager.free(other)  # free queue: 5 6 7 2 1 4 3
    second = make_request("second", list(range(8)) + list(range(50, 63)))
    # Hits blocks 1 and 2; its 4 new blocks are the queue's head: 5, 6, 7 and 2, a hit.
    assert admit(manager, second) == 2 * BLOCK
