"""vLLM-style tests of a bare BlockPool whose call vLLM rejects (vLLM's objects only, no kvspec
import), run by tests/test_vllm_plugin_rejected.py with and without kvspec's plugin. A call that
raises leaving the pool as it was is a no-op the plugin judges; one that raises after changing
the pool (vLLM's free queue patched to fail after removing its block: a mutant of vLLM's own
object) leaves a state the spec cannot know, and stays refused as "vLLM raised"."""

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

HASH_BLOCK = 2
BLOCK = 4


def make_request(request_id, prompt):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(HASH_BLOCK, sha256),
    )


def make_pool(num_blocks):
    return BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=HASH_BLOCK)


def test_a_partial_entry_off_the_hash_boundary_is_rejected_and_the_pool_goes_on():
    pool = make_pool(4)
    request = make_request("0", [5, 6, 7, 8])
    block = pool.get_new_blocks(1)[0]
    with pytest.raises(AssertionError):  # 3 tokens: not a whole number of 2-token hashes
        pool.cache_partial_block(
            request=request, block=block, num_tokens=3, kv_cache_group_id=0, block_size=BLOCK
        )
    assert block.block_hash is None
    more = pool.get_new_blocks(2)
    pool.free_blocks([block, *more])
    assert pool.get_num_free_blocks() == 3


def test_a_touch_that_fails_after_taking_a_block_off_the_free_queue_is_refused():
    pool = make_pool(4)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    queue = pool.free_block_queue
    shipped = queue.remove

    def remove_then_fail(b):
        shipped(b)
        raise RuntimeError("planted: the free queue fails after removing the block")

    queue.remove = remove_then_fail
    with pytest.raises(RuntimeError):
        pool.touch([block])
    assert block.ref_cnt == 0  # off the free queue, held by no one: a state no spec reaches
