"""vLLM-style tests of a prefix-cache hit bounded by what the engine was told, vLLM's objects only,
no kvspec import; run by tests/test_vllm_plugin_hitbound.py in every supported release's venv with
and without kvspec's plugin. r0 leaves three cached blocks of its prompt; r1 repeats the prompt
with its hit bounded: by the aux output connector's ``max_cache_hit`` (stubbed, as vLLM's own test
does), by a skipped read (prompt logprobs) or, on 0.34.0, by a bounded read (prompt scoring from
``prompt_logprob_start``). The plants are mutants of vLLM's own lookup: one that ignores the bound
(the hit runs to the longest cached prefix) and one that stops a block short of it."""

import numpy as np
import pytest
import vllm
from case_ec_aux import PROMPTS, make_scheduler, with_aux
from case_seed import BLOCK, make_request
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

ON_034 = pytest.mark.skipif(vllm.__version__ != "0.34.0", reason="bounded reads are 0.34.0's")
LOOKUP = KVCacheManager.get_computed_blocks


def step(scheduler):
    """One step, a token sampled for each request at the end of its known tokens (a
    ``ModelRunnerOutput`` of either release: 0.34.0 has no ``req_id_to_index``), and with an aux
    output connector a row per token of every scheduled request."""
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].is_prefill_chunk else [1] for r in ids]
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}}
    extra = index if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {}
    runner = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra)
    if scheduler.aux_output_connector is not None:
        runner.aux_output_connector_output = {
            r: AuxRequestOutput(0, np.zeros((scheduler.requests[r].num_tokens + 1, 1, 1), np.uint8))
            for r in ids
        }
    scheduler.update_from_output(output, runner)
    return output


def run(scheduler, prompts):
    """Add the requests, then step until every one is done."""
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, 0, float(i), max_tokens=3))
    for _ in range(100):
        if not scheduler.has_requests():
            return
        step(scheduler)


def capped(scheduler, tokens):
    scheduler.aux_output_connector.max_cache_hit = lambda request: tokens
    return scheduler


LONG = list(range(1, 16))
"""Seven full blocks and a token: a hit one block short still leaves the step's budget (8 tokens)
to fill, so the spec meets the engine's hit before anything else (a Disagreement on it)."""


def hit_of(scheduler, second, first=PROMPTS[0]):
    """r0 (``first``) runs to its end and leaves its full blocks cached; then ``second`` (r1, the
    same prompt) is admitted: its hit in tokens, read from the scheduler's output."""
    run(scheduler, [first])
    scheduler.add_request(second)
    output = step(scheduler)
    (new,) = [r for r in output.scheduled_new_reqs if r.req_id == second.request_id]
    run(scheduler, [])
    return new.num_computed_tokens


def first_hit(scheduler, prompt=PROMPTS[0]):
    return hit_of(scheduler, make_request("r1", prompt, 0, 1.0, max_tokens=3), prompt)


@pytest.mark.parametrize("tokens", [BLOCK, BLOCK + 1, 0])
def test_a_hit_capped_by_the_aux_output_connector_holds(tokens):
    assert first_hit(capped(with_aux(make_scheduler()), tokens)) == tokens // BLOCK * BLOCK


def test_a_lookup_ignoring_the_cap_is_caught(monkeypatch):
    """Planted: vLLM's lookup drops the bound it is given (the hit runs to every cached block)."""
    monkeypatch.setattr(
        KVCacheManager,
        "get_computed_blocks",
        lambda self, request, bound=None: LOOKUP(self, request),
    )
    assert first_hit(capped(with_aux(make_scheduler()), BLOCK)) == 3 * BLOCK


def test_a_lookup_one_block_short_of_the_cap_is_caught(monkeypatch):
    """Planted: vLLM's lookup stops one block short of the bound it is given."""

    def short(self, request, bound=None):
        return LOOKUP(self, request, None if bound is None else max(bound - BLOCK, 0))

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", short)
    assert first_hit(capped(with_aux(make_scheduler()), 2 * BLOCK), LONG) == BLOCK


def scoring_request(request_id, prompt, arrival, **params):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=3, ignore_eos=True, **params),
        pooling_params=None,
        arrival_time=arrival,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def read_hit(scheduler, **params):
    return hit_of(scheduler, scoring_request("r1", PROMPTS[0], 1.0, **params))


def test_a_skipped_read_that_would_hit_holds():
    assert read_hit(make_scheduler(), prompt_logprobs=1) == 0


def ignore_read_limits(monkeypatch):
    """Planted: vLLM's lookup ignores the request's own limit (0.33.0: a skipped read is
    looked up; 0.34.0: ``prefix_cache_hit_limit`` left out of the hit's bound too)."""
    monkeypatch.setattr(
        KVCacheManager, "prefix_cache_lookup_enabled", lambda self, request: self.enable_caching
    )
    if hasattr(Request, "get_max_cache_hit_length"):
        monkeypatch.setattr(
            Request,
            "get_max_cache_hit_length",
            lambda self, bound=None: min(x for x in (self.num_tokens - 1, bound) if x is not None),
        )


def test_a_skipped_read_looked_up_is_caught(monkeypatch):
    ignore_read_limits(monkeypatch)
    assert read_hit(make_scheduler(), prompt_logprobs=1) == 3 * BLOCK


@ON_034
def test_a_bounded_read_holds():
    params = dict(
        prompt_logprobs=1, prompt_logprob_start=BLOCK + 1, skip_reading_prefix_cache=False
    )
    assert read_hit(make_scheduler(), **params) == BLOCK


@ON_034
def test_a_bounded_read_ignored_is_caught(monkeypatch):
    ignore_read_limits(monkeypatch)
    params = dict(
        prompt_logprobs=1, prompt_logprob_start=BLOCK + 1, skip_reading_prefix_cache=False
    )
    assert read_hit(make_scheduler(), **params) == 3 * BLOCK
