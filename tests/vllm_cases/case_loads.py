"""vLLM-style tests of a scheduler whose KV connector loads blocks, at the edges the vLLM
attachment used to refuse (vLLM's objects only, no kvspec import), run by
tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. The connector is
vLLM's ``ExampleConnector`` scripted as in ``case_connector.py``: ``script`` says how many
tokens past its local hit the store holds for each request.

Preemption beside asynchronous loads: the spec runs a request from its load's admission on,
vLLM appends it to ``running`` only when it is scheduled after landing. Where both rank the
running requests alike the preemption is judged (and a victim vLLM picks against its own rule
is caught); where they rank them differently it is refused.

Loads not of whole blocks: a synchronous one lands before its step's forward pass, so the tail
of its partial block is to the spec computed in that step (a registration past what the step
wrote is caught; a tail that overruns the spec's token budget is refused); an asynchronous one
is refused.

Whole-prompt loads (the decode side of prefill/decode disaggregation): an asynchronous load of
every block of a prompt of whole blocks, the last token recomputed over the loaded block, is
judged; a landing that recomputes the whole last block instead is caught.

Deferred loads (``defer_async_loads`` beside ``defer_block_free``): a request whose load waits
for the steps in flight, aborted, is held until the newest step commits; freed at once, caught.

Speculative decoding beside loads (``case_spec_decode``'s drafter and runner, a store holding
each prompt's first block): synchronous and asynchronous loads, the single token of a request
admitted over a load padded with drafts, drafts accepted and rejected; ``case_spec_decode``'s
planted bug (a block over a rejected draft registered) is caught beside them."""

import case_spec_decode as sd
from case_connector import make_scheduler, transfer
from case_seed import BLOCK, make_request, runner_output
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus


def script(scheduler, loads, is_async=True):
    """The store holds ``loads[request id]`` tokens past the local hit, where they end short of
    the last token's block (else nothing); loaded asynchronously or not."""

    def matched(request, num_computed_tokens):
        tokens = loads.get(request.request_id, 0)
        room = (request.num_tokens - 1) // BLOCK * BLOCK - num_computed_tokens
        tokens = tokens if room >= tokens else 0
        return tokens, is_async and tokens > 0

    scheduler.connector.get_num_new_matched_tokens = matched


def run(scheduler, steps=60):
    """Step until every request is done; a load lands in the output of the step after the one
    that started it. The steps taken."""
    started: set[str] = set()
    taken = 0
    while scheduler.has_requests() and taken < steps:
        output = scheduler.schedule()
        runner = runner_output(scheduler, output)
        loading = {
            r.request_id
            for r in scheduler.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        if loading & started:
            runner.kv_connector_output = KVConnectorOutput(finished_recving=loading & started)
        started |= loading
        scheduler.update_from_output(output, runner)
        taken += 1
    assert not scheduler.has_requests()
    return taken


class HeadFirst(list):
    """A ``running`` list whose ``pop()`` takes the head: the planted bug preempts the oldest
    running request instead of the newest."""

    def pop(self, index=-1):
        return super().pop(0)


def two_loads(tmp_path, plant=False):
    """r0 and r1 load two blocks each, land together and are scheduled in that order (as the
    spec admitted them); then r0 needs a block the pool no longer has."""
    scheduler = make_scheduler(tmp_path, is_async=True, num_blocks=7)
    if plant:
        scheduler.running = HeadFirst()
    script(scheduler, {"r0": 2 * BLOCK, "r1": 2 * BLOCK})
    scheduler.add_request(make_request("r0", [1, 2, 3, 4, 5, 6], 0, 0.0, max_tokens=6))
    scheduler.add_request(make_request("r1", [11, 12, 13, 14, 15], 0, 1.0, max_tokens=6))
    return scheduler


def test_preemption_beside_landed_loads_holds(tmp_path):
    scheduler = two_loads(tmp_path)
    r0, r1 = (scheduler.requests[r] for r in ("r0", "r1"))
    assert run(scheduler) > 8
    assert (r0.num_preemptions, r1.num_preemptions) == (0, 1)  # the tail, by either rule


def test_preempting_the_head_beside_loads_is_caught(tmp_path):
    run(two_loads(tmp_path, plant=True))


def test_preemption_beside_a_load_ranked_otherwise_is_refused(tmp_path):
    """r1 loads while r2, admitted after it, runs at once: vLLM's running order is r0, r2, r1
    once r1 lands, the spec's r0, r1, r2; vLLM then preempts r1, the spec would take r2."""
    scheduler = make_scheduler(tmp_path, is_async=True, num_blocks=10)
    script(scheduler, {"r1": 2 * BLOCK})
    scheduler.add_request(make_request("r0", [1, 2, 3], 0, 0.0, max_tokens=6))
    scheduler.add_request(make_request("r1", [11, 12, 13, 14, 15], 0, 1.0, max_tokens=6))
    scheduler.add_request(make_request("r2", [21, 22, 23], 0, 2.0, max_tokens=8))
    run(scheduler)


def spec_decode_scheduler(tmp_path, is_async, num_blocks):
    """``case_spec_decode``'s scheduler (n-gram drafts, three per decode) beside a KV connector
    whose store holds the first block of every prompt."""
    scheduler = sd.build(num_blocks, kv_transfer_config=transfer(tmp_path))

    def matched(request, num_computed_tokens):  # the first block, when the local hit lacks it
        tokens = sd.BLOCK if num_computed_tokens == 0 and request.num_tokens > sd.BLOCK else 0
        return tokens, is_async and tokens > 0

    scheduler.connector.get_num_new_matched_tokens = matched
    scheduler.connector.build_connector_meta = lambda output: KVConnectorMetadata()
    return scheduler


def spec_decode_workload(tmp_path, is_async, num_blocks=24):
    """Requests of five tokens and more, each admitted over a load of its first block (the
    five-token ones then compute one token, padded with three drafts); drafts accepted and
    rejected until every request is done. (drafts scheduled, rejected, padded admissions)."""
    scheduler = spec_decode_scheduler(tmp_path, is_async, num_blocks)
    prompts = ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7], [8, 8, 8, 8, 9], [2, 2, 2, 2, 2, 2])
    for i, prompt in enumerate(prompts):
        scheduler.add_request(sd.request(f"q{i}", prompt, max_tokens=10))
    drafted = rejected = padded = 0
    started: set[str] = set()
    for round_ in range(80):
        if not scheduler.has_requests():
            break
        output = scheduler.schedule()
        runner = sd.run_model(scheduler, output)
        sd.REJECTING.clear()
        for rid, drafts in output.scheduled_spec_decode_tokens.items():
            got = runner.sampled_token_ids[runner.req_id_to_index[rid]]
            drafted += len(drafts)
            rejected += len(drafts) - (len(got) - 1)
            padded += drafts == [-1] * sd.DRAFTS
            if len(got) <= len(drafts):
                sd.REJECTING.add(rid)
        loading = {
            r.request_id
            for r in scheduler.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        if loading & started:
            runner.kv_connector_output = KVConnectorOutput(finished_recving=loading & started)
        started |= loading
        scheduler.update_from_output(output, runner)
        sd.propose(scheduler, round_)
    assert not scheduler.has_requests()
    return drafted, rejected, padded


def test_spec_decode_beside_synchronous_loads_holds(tmp_path):
    drafted, rejected, padded = spec_decode_workload(tmp_path, is_async=False)
    assert drafted > 20 and rejected > 5 and padded >= 2


def test_spec_decode_beside_asynchronous_loads_holds(tmp_path):
    drafted, rejected, padded = spec_decode_workload(tmp_path, is_async=True)
    assert drafted > 20 and rejected > 5 and padded >= 2


def test_spec_decode_beside_loads_cached_past_the_computed_tokens(tmp_path, monkeypatch):
    """``case_spec_decode``'s planted bug beside loads: after an output that rejected drafts,
    the registration counts every known token, publishing a block over a rejected draft."""
    original = KVCacheManager.cache_blocks

    def cache_blocks(self, request, num_computed_tokens):
        if request.request_id in sd.REJECTING:
            num_computed_tokens = request.num_tokens
        original(self, request, num_computed_tokens)

    monkeypatch.setattr(KVCacheManager, "cache_blocks", cache_blocks)
    spec_decode_workload(tmp_path, is_async=True)


def partial_loads(tmp_path, is_async=False, prompts=None, plant=False):
    """Prompts sharing prefixes; the store holds three tokens (a block and a half) of each past
    its local hit; long prefills are chunked at four tokens. Run to the end."""
    scheduler = make_scheduler(tmp_path, is_async=is_async, num_blocks=24)
    scheduler.scheduler_config.long_prefill_token_threshold = 4
    prompts = prompts or ([1, 2, 3, 4, 5, 6, 7], list(range(1, 12)), [9, 8, 7, 6, 5])
    script(scheduler, {f"p{i}": 3 for i in range(len(prompts))}, is_async=is_async)
    if plant:  # registration counts the external tokens twice
        coordinator = scheduler.kv_cache_manager.coordinator
        cache = coordinator.cache_blocks

        def cache_blocks(request, num_tokens):
            if request.num_computed_tokens == 0:  # an admission's allocate_slots
                num_tokens = min(num_tokens + 3, request.num_tokens)
            cache(request, num_tokens)

        coordinator.cache_blocks = cache_blocks
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"p{i}", prompt, 0, float(i), max_tokens=3))
    return run(scheduler)


def test_partial_synchronous_loads_hold(tmp_path):
    assert partial_loads(tmp_path) > 3


def test_a_partial_load_registered_past_what_was_written_is_caught(tmp_path):
    partial_loads(tmp_path, prompts=(list(range(1, 12)), [5, 5, 5]), plant=True)


def test_a_partial_load_overrunning_the_budget_is_refused(tmp_path):
    partial_loads(tmp_path, prompts=(list(range(1, 22)),))  # alone: its tail and 16 computed


def test_a_partial_asynchronous_load_is_refused(tmp_path):
    partial_loads(tmp_path, is_async=True)


def deferring_scheduler(tmp_path, num_blocks=24):
    """``case_defer``'s ``AsyncScheduler`` (``defer_block_free`` set after construction) beside
    ``ExampleConnector``, with ``defer_async_loads`` set too (as vLLM's tests do; production
    sets it only for HiSparse); the store holds two blocks of imp0 and one of imp1 (a table of
    unregistered blocks freed at once would be refused: ``a batch of unhashed blocks
    freed``)."""
    from case_defer import make_scheduler as make_deferring

    scheduler = make_deferring(num_blocks, kv_transfer_config=transfer(tmp_path))
    scheduler.connector.build_connector_meta = lambda output: KVConnectorMetadata()
    script(scheduler, {"imp0": 2 * BLOCK, "imp1": BLOCK})
    scheduler.defer_async_loads = True
    return scheduler


class LoadingCore:
    """``case_defer.EngineCore`` (a batch queue of two steps) whose runner also reports the
    loads the connector started (their deferral drained) at an earlier output as landed."""

    def __init__(self, scheduler):
        from case_defer import EngineCore

        self.core = EngineCore(scheduler, stops={})
        self.scheduler = scheduler
        self.started: set[str] = set()

    def step(self):
        core, scheduler = self.core, self.scheduler
        if len(core.queue) < 2 and scheduler.has_requests():
            core.schedule()
        if len(core.queue) == 2 or (core.queue and not scheduler.has_requests()):
            self.process_oldest()

    def process_oldest(self):
        output, samples = self.core.queue.pop(0)
        ids = list(output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if r in samples else [] for r in ids],
        )
        started = {
            r.request_id
            for r in self.scheduler.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and r.request_id not in self.scheduler.deferred_loads
        }
        if started & self.started:
            runner.kv_connector_output = KVConnectorOutput(finished_recving=started & self.started)
        self.started |= started
        self.scheduler.update_from_output(output, runner)


def deferred_loads(tmp_path):
    """r0 prefills and decodes with two steps in flight; imp0, then imp1, are admitted over
    loads deferred behind those steps; imp1 is aborted while its load waits (its blocks held
    until the newest step commits), imp0's load starts, lands and it runs to the end."""
    scheduler = deferring_scheduler(tmp_path)
    core = LoadingCore(scheduler)
    scheduler.add_request(make_request("r0", [1, 2, 3, 4, 5], 0, 0.0, max_tokens=8))
    for _ in range(3):
        core.step()
    scheduler.add_request(make_request("imp0", [5, 5, 5, 5, 6, 6, 6], 0, 1.0, max_tokens=4))
    scheduler.add_request(make_request("imp1", [8, 8, 8, 8, 9, 9], 0, 2.0, max_tokens=4))
    core.core.schedule()  # a second step in flight, admitting both over deferred loads
    assert set(scheduler.deferred_loads) == {"imp0", "imp1"}
    scheduler.finish_requests("imp1", RequestStatus.FINISHED_ABORTED)
    held = bool(scheduler.deferred_frees)  # the step that may still read them is in flight
    for _ in range(60):
        core.step()
    assert not scheduler.has_requests() and not scheduler.deferred_frees
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    return held


def test_deferred_loads_hold(tmp_path):
    assert deferred_loads(tmp_path)


def test_a_deferred_load_freed_at_once_is_caught(tmp_path, monkeypatch):
    """Planted: a request aborted before it computed anything (imp1, its load deferred) is
    freed at once, as if its load-only admission fenced nothing."""
    from vllm.v1.core.sched.scheduler import Scheduler as Base

    gate = Base._request_blocks_can_be_freed

    def can_be_freed(self, request):
        never_ran = (
            request.status == RequestStatus.FINISHED_ABORTED and not request.num_output_tokens
        )
        return never_ran or gate(self, request)

    monkeypatch.setattr(Base, "_request_blocks_can_be_freed", can_be_freed)
    deferred_loads(tmp_path)


def whole_loads(tmp_path, plant=False):
    """Prompts of whole blocks whose store holds all of them (the decode side of prefill/decode
    disaggregation): loaded entirely, asynchronously, the last token recomputed over the
    loaded block; a later request hits them. Planted: the landing recomputes the whole last
    block, not the last token."""
    scheduler = make_scheduler(tmp_path, is_async=True, num_blocks=24)

    def matched(request, num_computed_tokens):  # everything past the local hit
        tokens = request.num_tokens - num_computed_tokens if request.request_id != "w2" else 0
        return tokens, tokens > 0

    scheduler.connector.get_num_new_matched_tokens = matched
    if plant:
        land = scheduler._update_waiting_for_remote_kv

        def update_waiting_for_remote_kv(request):
            land(request)
            request.num_computed_tokens -= BLOCK - 1

        scheduler._update_waiting_for_remote_kv = update_waiting_for_remote_kv
    scheduler.add_request(make_request("w0", [1, 2, 3, 4], 0, 0.0, max_tokens=3))
    scheduler.add_request(make_request("w1", [5, 6, 7, 8, 9, 10], 0, 1.0, max_tokens=3))
    steps = run(scheduler)
    scheduler.add_request(make_request("w2", [1, 2, 3, 4, 5], 0, 2.0, max_tokens=2))
    return steps + run(scheduler)


def test_whole_prompt_loads_hold(tmp_path):
    assert whole_loads(tmp_path) > 4


def test_a_whole_load_recomputing_its_last_block_is_caught(tmp_path):
    whole_loads(tmp_path, plant=True)
