"""vLLM-style tests of cache-aware admission (vLLM 0.34.0's ``cache_aware_admission_window``;
vLLM's objects only, no kvspec import), run by tests/test_vllm_plugin_admission.py with and
without kvspec's plugin. A ``Scheduler`` (or an ``AsyncScheduler`` under a batch queue of two)
with prefix caching, fcfs, two requests running at most: seeds leave two prompts cached, then
cold and warm requests arrive interleaved and are admitted across steps, warm ones promoted
inside the window; a small pool adds preemptions (steps that do not reorder). Three plant bugs in
vLLM's reorder: the shallowest prefix first, the window ignored (the whole queue reordered), the
usage threshold ignored. On a vLLM without the setting (0.33.0) ``SchedulerConfig`` rejects it
at construction: every test is skipped there, saying so."""

import pytest
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 4

if "cache_aware_admission_window" not in SchedulerConfig.__dataclass_fields__:
    pytest.skip(
        "this vLLM has no cache_aware_admission_window (SchedulerConfig rejects it)",
        allow_module_level=True,
    )


@pytest.fixture(autouse=True)
def runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")


def make_scheduler(window=3, threshold=0.0, num_blocks=40, asynchronous=False):
    import torch

    model = ModelConfig(model="facebook/opt-125m", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_model_len=1024,
        is_encoder_decoder=False,
        max_num_batched_tokens=64,
        max_num_seqs=2,
        enable_chunked_prefill=True,
        async_scheduling=asynchronous,
        cache_aware_admission_window=window,
        cache_aware_admission_threshold=threshold,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        parallel_config=ParallelConfig(pipeline_parallel_size=1),
    )
    config.scheduler_config.async_scheduling = asynchronous  # the CPU platform turns it off
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    cls = AsyncScheduler if asynchronous else Scheduler
    scheduler = cls(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    assert scheduler.cache_aware_window == window
    return scheduler


def make_request(request_id, prompt, arrival, max_tokens=3):
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival,
        priority=0,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def runner_output(ids, sampled):
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


class EngineCore:
    """A batch queue of ``depth`` steps over the scheduler (1: synchronous); the runner samples
    token 7 for every request that finished its prefill; the admission order is recorded."""

    def __init__(self, scheduler, depth=1):
        self.scheduler, self.depth, self.queue, self.admitted = scheduler, depth, [], []

    def step(self):
        if len(self.queue) < self.depth and self.scheduler.has_requests():
            output = self.scheduler.schedule()
            self.admitted += [r.req_id for r in output.scheduled_new_reqs]
            requests = self.scheduler.requests
            samples = {r for r in output.num_scheduled_tokens if not requests[r].is_prefill_chunk}
            self.queue.append((output, samples))
        if len(self.queue) == self.depth or (self.queue and not self.scheduler.has_requests()):
            output, samples = self.queue.pop(0)
            ids = list(output.num_scheduled_tokens)
            sampled = [[7] if r in samples else [] for r in ids]
            self.scheduler.update_from_output(output, runner_output(ids, sampled))

    def drain(self):
        for _ in range(200):
            self.step()
        assert not self.scheduler.has_requests() and not self.queue


HOT = list(range(1, 13))  # 3 blocks
WARM = list(range(40, 52))


def workload(core, max_tokens=3):
    """Two seeds cache HOT and WARM; then cold and warm requests arrive interleaved (cold
    first), and more while they run. Returns the admission order after the seeds."""
    scheduler = core.scheduler
    scheduler.add_request(make_request("seed-a", HOT + [99], 0.0))
    scheduler.add_request(make_request("seed-b", WARM + [98], 1.0))
    core.drain()
    arrivals = [
        ("cold-1", [60 + i for i in range(13)]),
        ("hot-1", HOT + [5, 5]),
        ("cold-2", [80 + i for i in range(13)]),
        ("warm-1", WARM + [6]),
        ("cold-3", [100 + i for i in range(9)]),
        ("hot-2", HOT + [8, 8, 8]),
    ]
    for i, (rid, prompt) in enumerate(arrivals):
        scheduler.add_request(make_request(rid, prompt, 2.0 + i, max_tokens))
    core.step()
    scheduler.add_request(make_request("warm-2", WARM + [1, 2], 9.0, max_tokens))
    scheduler.add_request(make_request("cold-4", [120 + i for i in range(10)], 10.0, max_tokens))
    core.drain()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    return core.admitted[2:]


ARRIVAL = ["cold-1", "hot-1", "cold-2", "warm-1", "cold-3", "hot-2", "warm-2", "cold-4"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_cache_aware_admission_holds(asynchronous):
    scheduler = make_scheduler(asynchronous=asynchronous)
    order = workload(EngineCore(scheduler, depth=2 if asynchronous else 1))
    assert sorted(order) == sorted(ARRIVAL) and order != ARRIVAL  # warm ones were promoted


def test_cache_aware_admission_with_preemptions_holds():
    """A pool of 11 blocks and longer outputs: decodes preempt (those steps do not reorder) and
    preempted requests keep their place at the head."""
    scheduler = make_scheduler(window=4, num_blocks=11)
    preempted = []
    original = scheduler._preempt_request

    def spy(request, *args, **kw):
        preempted.append(request.request_id)
        return original(request, *args, **kw)

    scheduler._preempt_request = spy
    order = workload(EngineCore(scheduler), max_tokens=10)
    assert len(preempted) >= 3 and order[:2] != ARRIVAL[:2]


def test_cache_aware_admission_below_the_threshold_holds():
    order = workload(EngineCore(make_scheduler(threshold=1.0)))
    assert order == ARRIVAL


def _shallowest_first(self):  # planted: the reorder sorts the wrong way
    head = list(self.waiting)[: self.cache_aware_window]
    slots = [
        i
        for i, r in enumerate(head)
        if r.status == RequestStatus.WAITING and not r.num_computed_tokens
    ]
    probe = self.kv_cache_manager.get_num_cached_tokens
    ranked = sorted(slots, key=lambda i: (probe(head[i]), i))
    moved = list(head)
    for slot, source in zip(slots, ranked, strict=True):
        moved[slot] = head[source]
    self.waiting.remove_requests(head)
    for request in reversed(moved):
        self.waiting.prepend_request(request)


def test_a_reorder_sorting_the_wrong_way_is_caught(monkeypatch):
    monkeypatch.setattr(Scheduler, "_reorder_waiting_by_cached_prefix", _shallowest_first)
    workload(EngineCore(make_scheduler()))


def test_a_reorder_past_the_window_is_caught(monkeypatch):
    original = Scheduler._reorder_waiting_by_cached_prefix

    def whole_queue(self):  # planted: the window taken as the whole queue
        window, self.cache_aware_window = self.cache_aware_window, len(self.waiting)
        try:
            original(self)
        finally:
            self.cache_aware_window = window

    monkeypatch.setattr(Scheduler, "_reorder_waiting_by_cached_prefix", whole_queue)
    workload(EngineCore(make_scheduler(window=2)))


def test_a_reorder_below_the_threshold_is_caught(monkeypatch):
    original = Scheduler._reorder_waiting_by_cached_prefix

    def any_usage(self):  # planted: the threshold ignored
        threshold, self.cache_aware_threshold = self.cache_aware_threshold, 0.0
        try:
            original(self)
        finally:
            self.cache_aware_threshold = threshold

    monkeypatch.setattr(Scheduler, "_reorder_waiting_by_cached_prefix", any_usage)
    workload(EngineCore(make_scheduler(threshold=1.0)))
