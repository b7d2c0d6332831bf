"""vLLM-style tests of speculative decoding (vLLM's objects only, no kvspec import), run by
tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. A synchronous
scheduler with n-gram drafts (three per decode): between steps a drafter proposes tokens of
which a varying number are right, the model runner accepts the right ones and adds its bonus
token, and vLLM rolls the rejected ones back. Requests share a prefix and the pool is small
enough to preempt. One plants a scheduler bug: after an output that rejected drafts, the
registration counts every known token (the bonus token too) instead of the computed ones, so a
block whose last slot holds a rejected draft's K/V is published under the real tokens."""

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 4
DRAFTS = 3
PREFIX = [1, 2, 3, 4, 5]
REJECTING = set()
"""The requests whose drafts the output being processed rejects (at least one)."""


def build(num_blocks, kv_transfer_config=None):
    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=256)
    sched = SchedulerConfig(
        max_model_len=256,
        is_encoder_decoder=False,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_chunked_prefill=True,
        watermark=0.0,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    drafts = SpeculativeConfig(model="ngram", num_speculative_tokens=DRAFTS)
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        speculative_config=drafts,
        kv_transfer_config=kv_transfer_config,
    )
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def request(request_id, prompt, max_tokens):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=0.0,
        priority=0,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def truth(position):
    """The token the model samples at a position, whatever the request."""
    return 10 + position % 7


def run_model(scheduler, output):
    """The runner's output: for a request past its prefill, the leading drafts that equal the
    model's tokens, then the model's own token where the first wrong draft was (or after all)."""
    ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = scheduler.requests[rid]
        drafts = output.scheduled_spec_decode_tokens.get(rid, [])
        if req.num_computed_tokens - len(drafts) < req.num_tokens:
            sampled.append([])  # a prefill chunk samples nothing
            continue
        tokens, at = [], req.num_tokens
        for draft in [*drafts, None]:
            tokens.append(truth(at))
            if draft != tokens[-1]:
                break
            at += 1
        sampled.append(tokens)
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )


def propose(scheduler, round_):
    """The drafter: three tokens per running decode, the first ``right`` of them correct."""
    ids, drafts = [], []
    for req in scheduler.running:
        right = (round_ + len(req.request_id)) % (DRAFTS + 1)
        n = req.num_tokens
        ids.append(req.request_id)
        drafts.append([truth(n + j) if j < right else 99 for j in range(DRAFTS)])
    scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))


def run_workload(num_blocks=24):
    scheduler = build(num_blocks)
    for i, tail in enumerate(([6], [7, 8], [6, 9, 9, 9])):
        scheduler.add_request(request("r" * (i + 1), PREFIX + tail, max_tokens=14))
    accepted = rejected = preempted = 0
    for round_ in range(60):
        if not scheduler.has_requests():
            break
        output = scheduler.schedule()
        preempted += len(output.preempted_req_ids or ())
        runner = run_model(scheduler, output)
        REJECTING.clear()
        for rid, drafts in output.scheduled_spec_decode_tokens.items():
            got = runner.sampled_token_ids[runner.req_id_to_index[rid]]
            accepted += len(got) - 1
            rejected += len(drafts) - (len(got) - 1)
            if len(got) <= len(drafts):
                REJECTING.add(rid)
        scheduler.update_from_output(output, runner)
        propose(scheduler, round_)
    assert not scheduler.has_requests()
    return accepted, rejected, preempted


def test_spec_decode_shared_prefixes_hold():
    accepted, rejected, preempted = run_workload()
    assert accepted > 5 and rejected > 5 and not preempted


def test_spec_decode_preempted_holds():
    accepted, rejected, preempted = run_workload(num_blocks=9)
    assert accepted > 5 and rejected > 5 and preempted


def test_spec_decode_cached_past_the_computed_tokens(monkeypatch):
    original = KVCacheManager.cache_blocks

    def cache_blocks(self, request, num_computed_tokens):
        if request.request_id in REJECTING:  # the newest token's slot holds a rejected draft
            num_computed_tokens = request.num_tokens
        original(self, request, num_computed_tokens)

    monkeypatch.setattr(KVCacheManager, "cache_blocks", cache_blocks)
    run_workload()
