"""vLLM-style tests (vLLM's objects only, no kvspec import) of requests whose block hasher looks
ahead (``get_request_block_hasher(..., num_hash_lookahead_tokens=1)`` beside a scheduler whose
own lookahead is 0, as vLLM's ``test_scheduler_publishes_lookahead_blocks_at_allocation`` and
``test_finished_spec_request_caches_completed_blocks[prefill-1-*]`` build them): a block's hash
covers the token after it, so it is cached only once that token exists, and a request whose
block matches but whose next token differs misses it. ``tests/test_vllm_plugin_lookahead.py``
runs them in every supported release's environment, with and without the plugin.

Planted: ``Scheduler.update_from_output`` caching the running requests' blocks after their
tokens are appended (a no-op without lookahead, where every computed block was cached at its
allocation; with it, the block ending at the first sampled token cached at the output, one
``schedule()`` before vLLM caches it). Refused by name, never judged: two one-line mutants of
vLLM's own ``get_request_block_hasher`` (recompiled from its source in its module), ``early``
(a block's hash emitted once the block is full, its lookahead read one token early: more hashes
than the spec's keys) and ``blind`` (0 where the lookahead token goes: one hash for two
lookaheads, a collision)."""

import inspect
from unittest.mock import patch

import pytest
from case_answered import step
from case_seed import BLOCK, make_scheduler
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

MUTANTS = {
    "early": (
        (
            "num_tokens = request.num_tokens - num_hash_lookahead_tokens",
            "num_tokens = request.num_tokens",
        ),
        ("request.all_token_ids[end_token_idx])", "request.all_token_ids[end_token_idx - 1])"),
    ),
    "blind": (("request.all_token_ids[end_token_idx])", "0)"),),
}


def hasher_factory(plant=None):
    """vLLM's ``get_request_block_hasher``, or its mutant ``plant`` (each edit must apply)."""
    if plant is None:
        return get_request_block_hasher
    source = inspect.getsource(get_request_block_hasher)
    for old, new in MUTANTS[plant]:
        assert source.count(old) == 1, (plant, old)
        source = source.replace(old, new)
    scope = dict(vars(kv_cache_utils))
    exec(compile(source, kv_cache_utils.__file__, "exec"), scope)
    return scope["get_request_block_hasher"]


def make_request(request_id, prompt, hasher, max_tokens=3):
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=hasher,
    )


def drain(scheduler, limit=60):
    for _ in range(limit):
        if not scheduler.has_requests():
            return
        step(scheduler)
    raise AssertionError("requests left")


def cached_tokens(scheduler, prompt, hasher):
    return scheduler.kv_cache_manager.get_computed_blocks(make_request("probe", prompt, hasher))[1]


OWN_UPDATE = Scheduler.update_from_output


def cache_at_output(self, *args, **kwargs):
    """Planted: ``update_from_output``, then every running request's computed blocks cached."""
    result = OWN_UPDATE(self, *args, **kwargs)
    for request in self.running:
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
    return result


def lookahead_workload(plant=None):
    init_none_hash(sha256)
    if plant == "at-output":
        with patch.object(Scheduler, "update_from_output", cache_at_output):
            scheduler = make_scheduler(policy="fcfs", num_blocks=16)
            return workload(scheduler, get_request_block_hasher(BLOCK, sha256, 1), plant)
    scheduler = make_scheduler(policy="fcfs", num_blocks=16)
    return workload(scheduler, hasher_factory(plant)(BLOCK, sha256, 1), plant)


def workload(scheduler, hasher, plant):
    scheduler.add_request(make_request("r0", [1, 2, 3, 4], hasher))
    step(scheduler)  # the prompt computed; block [3, 4) waits for its lookahead, the token 1
    # sampled now: cached at r0's next allocation (early: cached already)
    published = cached_tokens(scheduler, [1, 2, 3, 4, 1, 9], hasher)
    assert published == (2 if plant in ("early", "at-output") else 1) * BLOCK
    drain(scheduler)
    # r1 shares r0's two blocks and the token after them; r2 block 0 and the token after it;
    # r3 block 0's tokens but not the token after it: a miss (blind: a hit)
    for i, prompt in enumerate(([1, 2, 3, 4, 1, 9], [1, 2, 3, 7, 8], [1, 2, 6, 6, 6]), 1):
        scheduler.add_request(make_request(f"r{i}", prompt, hasher))
    drain(scheduler)
    assert cached_tokens(scheduler, [1, 2, 6, 6, 6, 7], hasher) == 2 * BLOCK


def test_lookahead_hashes_hold():
    lookahead_workload()


def test_blocks_cached_at_the_output_are_caught():
    lookahead_workload("at-output")


@pytest.mark.parametrize("plant", ["early", "blind"])
def test_a_hasher_mutant_is_refused(plant):
    lookahead_workload(plant)


def test_a_request_hashed_otherwise_is_refused():
    """Two lookaheads in one scheduler, both added before anything is scheduled (under the
    priority policy kvspec holds them until then): the spec has one."""
    init_none_hash(sha256)
    scheduler = make_scheduler(policy="priority", num_blocks=16)
    for i, lookahead in enumerate((1, 0)):
        hasher = get_request_block_hasher(BLOCK, sha256, lookahead)
        request = make_request(f"r{i}", [1, 2, 3, 4, 5], hasher)
        request.arrival_time = float(i)
        scheduler.add_request(request)
    drain(scheduler)
