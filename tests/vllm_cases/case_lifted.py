"""vLLM-style tests of features the attachment once refused outright and now judges where the
spec covers them (vLLM's objects only, no kvspec import), run by tests/test_pytest_plugin.py in
.venv-vllm with and without kvspec's plugin:

* requests added out of ``arrival_time`` order under the priority policy (held until the next
  other entry point, then arriving in vLLM's rank order); planted: a request order that ignores
  ``arrival_time``; refused: two equal arrival times of one priority;
* ``reset_prefix_cache(reset_running_requests=True)`` (a step of preemptions, tail first, then
  the reset), under fcfs and priority; planted: a reset that preempts from the head;
* a request that skips the prefix-cache read (prompt logprobs), where the read would hit nothing
  and where it would have hit (its admission's bound 0: ``docs/model.md``, "Bounded hits");
* LoRA adapters within ``max_loras``; refused where a request is passed over for ``max_loras``,
  and where one prompt hashes differently under two adapters;
* multi-module MTP's prefill lookahead (``num_prefill_lookahead``, set after construction as
  vLLM's tests do): its shortened chunks; refused where it makes vLLM pass over a waiting
  request;
* structured output whose grammar is ready (a stand-in grammar and manager), one passed over
  while its grammar compiles (kept from the spec until compiled), one whose grammar fails;
  refused where the grammar is compiled while requests that arrived after it wait behind it;
  a request passed over in an earlier pass, still queued behind one admitted later;
* a preemption by the test itself, between a ``schedule()`` and its output (the tail of
  ``running`` popped, then ``_preempt_request``, as ``schedule()`` does; also with two decodes
  of an ``AsyncScheduler`` in flight); refused where the test
  pops another request than the one ``schedule()`` would preempt;
* multimodal inputs (an image's part in the hashes, its encoder scheduled); refused where the
  encoder's budget makes vLLM pass over a waiting request, and where one prompt carries two
  different images (its hashes are not a function of the tokens)."""

from unittest.mock import Mock

import case_async
import case_seed
import pytest
from case_seed import BLOCK, make_request, make_scheduler, runner_output, step
from vllm.config import LoRAConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus


def hasher():
    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


def drain(scheduler, limit=60):
    for _ in range(limit):
        if not scheduler.has_requests():
            return
        step(scheduler)
    raise AssertionError("requests left")


# -- arrival times out of order (priority) ---------------------------------------------------


def arrivals_workload():
    """Equal priorities added in the order 3.0, 1.0, 2.0, a more urgent one later; the pool is
    small enough that priority preempts the latest arrival among equals."""
    scheduler = make_scheduler(policy="priority", num_blocks=9)
    for name, t in (("c", 3.0), ("a", 1.0), ("b", 2.0)):
        scheduler.add_request(make_request(name, [1, 2, 3, 4, 5], priority=1, arrival=t))
    output = step(scheduler)
    admitted = [new.req_id for new in output.scheduled_new_reqs]
    assert admitted[0] == "a", admitted  # vLLM ranks by arrival_time, not by add order
    scheduler.add_request(make_request("u", [1, 2, 3, 9, 9, 9, 9], priority=0, arrival=4.0))
    drain(scheduler)
    return admitted


def test_priority_arrivals_out_of_order_hold():
    admitted = arrivals_workload()
    assert admitted == ["a", "b", "c"][: len(admitted)]


def test_priority_order_ignoring_arrival_time(monkeypatch):
    """Planted: the waiting queue ranks equal priorities by request id alone."""

    def lt(self, other):
        return (self.priority, self.request_id[::-1]) < (other.priority, other.request_id[::-1])

    monkeypatch.setattr(Request, "__lt__", lt)
    scheduler = make_scheduler(policy="priority", num_blocks=9)
    for name, t in (("x1", 3.0), ("x2", 1.0)):  # by id: x1 first; by arrival_time: x2 first
        scheduler.add_request(make_request(name, [1, 2, 3, 4, 5], priority=1, arrival=t))
    output = step(scheduler)
    assert [new.req_id for new in output.scheduled_new_reqs][0] == "x1"
    drain(scheduler)


def test_equal_arrival_times_are_refused():
    scheduler = make_scheduler(policy="priority", num_blocks=9)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, [1, 2, 3], priority=1, arrival=1.0))
    drain(scheduler)


# -- reset_prefix_cache(reset_running_requests=True) -----------------------------------------


def reset_workload(policy):
    scheduler = make_scheduler(policy=policy, num_blocks=12)
    for i, prompt in enumerate(([1, 2, 3], [1, 2, 4], [7, 8])):  # ranks in admission order
        request = make_request(f"r{i}", prompt, priority=i // 2, arrival=float(i), max_tokens=8)
        scheduler.add_request(request)
    step(scheduler)
    step(scheduler)
    assert len(scheduler.running) == 3
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert not scheduler.running
    drain(scheduler)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_reset_preempting_running_requests_holds(policy):
    reset_workload(policy)


def test_reset_preempting_from_the_head(monkeypatch):
    """Planted: the reset preempts the head of ``running`` first."""

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        while reset_running_requests and self.running:
            self._preempt_request(self.running.pop(0), 0.0, drop_stale_output=True)
        return self.kv_cache_manager.reset_prefix_cache()

    monkeypatch.setattr(Scheduler, "reset_prefix_cache", reset_prefix_cache)
    reset_workload("fcfs")


# -- a skipped prefix-cache read (prompt logprobs) -------------------------------------------


def logprobs_request(request_id, prompt, arrival):
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1),
        pooling_params=None,
        arrival_time=arrival,
        block_hasher=hasher(),
    )


def test_skipped_read_with_nothing_to_hit_holds():
    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], priority=0, arrival=0.0))
    drain(scheduler)
    request = logprobs_request("b", [6, 7, 8, 9, 1], 1.0)
    assert request.skip_reading_prefix_cache
    scheduler.add_request(request)
    drain(scheduler)
    scheduler.add_request(make_request("c", [6, 7, 8, 9, 2], priority=0, arrival=2.0))
    output = step(scheduler)  # c hits what b published
    assert output.scheduled_new_reqs[0].num_computed_tokens == 4
    drain(scheduler)


def test_skipped_read_that_would_hit_holds():
    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], priority=0, arrival=0.0))
    drain(scheduler)
    scheduler.add_request(logprobs_request("b", [1, 2, 3, 4, 6], 1.0))
    output = step(scheduler)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0  # vLLM reads nothing
    drain(scheduler)


# -- LoRA -------------------------------------------------------------------------------------


def lora_scheduler(monkeypatch, max_loras):
    def config(**kwargs):
        return VllmConfig(**kwargs, lora_config=LoRAConfig(max_loras=max_loras))

    monkeypatch.setattr(case_seed, "VllmConfig", config)
    return make_scheduler(policy="fcfs", num_blocks=16)


def lora_request(request_id, prompt, adapter, arrival):
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival,
        lora_request=LoRARequest(f"lora-{adapter}", adapter, f"/lora/{adapter}")
        if adapter
        else None,
        block_hasher=hasher(),
    )


def test_lora_within_max_loras_holds(monkeypatch):
    scheduler = lora_scheduler(monkeypatch, max_loras=2)
    for i, (prompt, adapter) in enumerate((([1, 2, 3, 4, 5], 1), ([1, 2, 3, 4, 6], 1))):
        scheduler.add_request(lora_request(f"a{i}", prompt, adapter, float(i)))
    scheduler.add_request(lora_request("b", [7, 8, 9, 7, 8], 2, 2.0))
    scheduler.add_request(lora_request("plain", [9, 9, 9], 0, 3.0))
    drain(scheduler)


def test_a_request_passed_over_for_max_loras_is_refused(monkeypatch):
    scheduler = lora_scheduler(monkeypatch, max_loras=1)
    scheduler.add_request(lora_request("a", [1, 2, 3, 4, 5], 1, 0.0))
    step(scheduler)
    scheduler.add_request(lora_request("b", [6, 7, 8], 2, 1.0))  # waits for a's adapter slot
    scheduler.add_request(lora_request("plain", [9, 9, 9], 0, 2.0))  # admitted past b
    output = step(scheduler)
    assert [new.req_id for new in output.scheduled_new_reqs] == ["plain"]
    assert scheduler.requests["b"].status == RequestStatus.WAITING
    drain(scheduler)


def test_one_prompt_under_two_adapters_is_refused(monkeypatch):
    scheduler = lora_scheduler(monkeypatch, max_loras=2)
    scheduler.add_request(lora_request("a", [1, 2, 3, 4, 5], 1, 0.0))
    scheduler.add_request(lora_request("b", [1, 2, 3, 4, 5], 2, 1.0))
    drain(scheduler)
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner_output(scheduler, output))


# -- prefill lookahead (multi-module MTP), set after construction as vLLM's tests do ---------


def lookahead_scheduler():
    scheduler = make_scheduler(policy="fcfs", num_blocks=16)
    scheduler.num_prefill_lookahead = 3  # a chunk ends at the prompt's end or 3 before it
    return scheduler


def test_prefill_lookahead_chunks_hold():
    scheduler = lookahead_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5, 6, 7, 8], priority=0, arrival=0.0))
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 5}  # 6 would leave 2 < 3
    scheduler.add_request(make_request("b", [1, 2, 3, 4, 5, 6, 7, 9], priority=0, arrival=1.0))
    drain(scheduler)


def test_prefill_lookahead_passing_over_a_request_is_refused():
    scheduler = lookahead_scheduler()
    for name, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [6, 7, 8]), ("c", [9])):
        scheduler.add_request(make_request(name, prompt, priority=0, arrival=0.0))
    output = step(scheduler)  # 1 token left for b would leave 2 < 3: b passed over, c admitted
    assert output.num_scheduled_tokens == {"a": 5, "c": 1}
    drain(scheduler)


# -- structured output ------------------------------------------------------------------------


def structured_request(request_id, prompt, arrival, grammar):
    params = SamplingParams(
        max_tokens=3, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival,
        block_hasher=hasher(),
    )
    assert request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    request.structured_output_request = Mock(grammar=grammar)
    return request


def structured_scheduler():
    scheduler = make_scheduler(policy="fcfs", num_blocks=16)
    scheduler.structured_output_manager = Mock()  # no backend here: grammars are stand-ins
    scheduler.structured_output_manager.accept_tokens.return_value = True
    return scheduler


def test_structured_output_with_its_grammar_ready_holds():
    scheduler = structured_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], priority=0, arrival=0.0))
    scheduler.add_request(structured_request("s", [1, 2, 3, 4, 6], 1.0, grammar=object()))
    drain(scheduler)


def test_structured_output_passed_over_while_its_grammar_compiles_holds():
    scheduler = structured_scheduler()
    scheduler.add_request(make_request("a", [4, 5, 6], priority=0, arrival=0.0))
    s = structured_request("s", [1, 2, 3], 1.0, grammar=None)
    scheduler.add_request(s)
    output = step(scheduler)  # s passed over while its grammar compiles
    assert list(output.num_scheduled_tokens) == ["a"]
    s.structured_output_request.grammar = object()  # compiled: nothing waits behind s
    drain(scheduler)


def test_structured_output_whose_grammar_fails_holds():
    scheduler = structured_scheduler()
    s = structured_request("s", [1, 2, 3], 0.0, grammar=RuntimeError("no grammar"))
    scheduler.add_request(s)
    scheduler.add_request(make_request("a", [4, 5, 6], priority=0, arrival=1.0))
    drain(scheduler)  # s finishes in error without ever being scheduled
    assert s.status == RequestStatus.FINISHED_ERROR


def test_structured_output_ready_ahead_of_a_later_arrival_is_refused():
    scheduler = structured_scheduler()
    s = structured_request("s", [1, 2, 3, 4], 0.0, grammar=None)
    scheduler.add_request(s)
    scheduler.add_request(make_request("a", [5, 6, 7, 8], priority=0, arrival=1.0))
    scheduler.add_request(make_request("b", [9, 9, 9], priority=0, arrival=2.0))
    s.structured_output_request.grammar = object()  # compiled while a and b wait behind s
    output = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["s", "a"]  # vLLM: s first, at its place
    drain(scheduler)


def test_a_request_passed_over_earlier_and_queued_behind_holds():
    """s's grammar is ready but its admission finds no room (vLLM keeps it in
    ``deferred_waiting``, at the head of ``waiting``); b, preempted later, is put ahead of it and
    admitted while s is still there, behind b: not passed over in that pass."""
    scheduler = make_scheduler(policy="fcfs", num_blocks=6)
    scheduler.structured_output_manager = Mock()
    scheduler.structured_output_manager.accept_tokens.return_value = True
    for name, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7])):
        scheduler.add_request(make_request(name, prompt, priority=0, arrival=0.0, max_tokens=4))
    s = structured_request("s", [9, 9, 9, 9, 9], 1.0, grammar=object())
    scheduler.add_request(s)
    preempted = []
    for _ in range(40):
        if not scheduler.has_requests():
            break
        output = step(scheduler)
        if output.preempted_req_ids:
            preempted.append(s in scheduler.deferred_waiting)
    assert preempted == [True]  # b preempted while s waits in deferred_waiting


# -- a preemption by the test ------------------------------------------------------------------


def preempted_by_the_test(victim):
    scheduler = make_scheduler(policy="fcfs", num_blocks=16)
    for name, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        scheduler.add_request(make_request(name, prompt, priority=0, arrival=0.0, max_tokens=4))
    step(scheduler)
    output = scheduler.schedule()  # in flight while the test preempts
    request = scheduler.requests[victim]
    scheduler.running.remove(request)
    scheduler._preempt_request(request, 0.0)
    assert request.status == RequestStatus.PREEMPTED
    scheduler.update_from_output(output, runner_output(scheduler, output))
    assert request.num_stale_output_tokens == 0  # its output delivered to it, waiting
    drain(scheduler)


def test_a_preemption_by_the_test_holds():
    preempted_by_the_test("b")


def test_a_preemption_by_the_test_of_another_than_the_tail_is_refused():
    preempted_by_the_test("a")


def test_a_preemption_by_the_test_under_async_scheduling_holds():
    """Two decodes of an ``AsyncScheduler`` in flight while the test preempts the tail."""
    scheduler = case_async.make_scheduler("fcfs", block=4, num_blocks=32, budget=64)
    for name, prompt in (("a", list(range(1, 10))), ("b", list(range(20, 27)))):
        scheduler.add_request(case_async.make_request(name, prompt, 4, max_tokens=6))
    core = case_async.EngineCore(scheduler)
    core.schedule()
    core.process_oldest()
    core.schedule()
    core.schedule()
    request = scheduler.requests["b"]
    scheduler.running.remove(request)
    scheduler._preempt_request(request, 0.0)
    for _ in range(60):
        if not scheduler.has_requests() and not core.queue:
            break
        core.step()
    assert request.is_finished()


# -- multimodal inputs ------------------------------------------------------------------------


def image_request(request_id, prompt, arrival, offset, length, image):
    feature = MultiModalFeatureSpec(
        data=MultiModalKwargsItem.dummy(),
        mm_position=PlaceholderRange(offset=offset, length=length),
        identifier=image,
        modality="image",
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival,
        mm_features=[feature],
        block_hasher=hasher(),
    )


def encoder_scheduler(budget):
    scheduler = make_scheduler(policy="fcfs", num_blocks=16)
    scheduler.max_num_encoder_input_tokens = budget  # as vLLM's tests set them
    scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=64)
    return scheduler


def test_images_hold():
    scheduler = encoder_scheduler(budget=8)
    image = [5, 5, 5, 5]
    scheduler.add_request(image_request("a", [1, 2, *image, 3], 0.0, 2, 4, "cat"))
    drain(scheduler)
    scheduler.add_request(image_request("b", [1, 2, *image, 4], 1.0, 2, 4, "cat"))
    output = step(scheduler)  # the same image: b hits a's blocks over it
    assert output.scheduled_new_reqs[0].num_computed_tokens == 6
    drain(scheduler)


def test_a_request_passed_over_for_its_image_is_refused():
    scheduler = encoder_scheduler(budget=4)  # one image a step
    scheduler.add_request(image_request("a", [1, 5, 5, 5, 5], 0.0, 1, 4, "cat"))
    scheduler.add_request(image_request("b", [5, 5, 5, 5, 2], 1.0, 0, 4, "dog"))
    scheduler.add_request(make_request("plain", [7], priority=0, arrival=2.0))
    output = step(scheduler)  # b's image does not fit this step: plain is admitted past b
    assert sorted(output.num_scheduled_tokens) == ["a", "plain"]
    drain(scheduler)


def test_one_prompt_with_two_images_is_refused():
    scheduler = encoder_scheduler(budget=8)
    image = [5, 5, 5, 5]
    scheduler.add_request(image_request("a", [1, 2, *image, 3], 0.0, 2, 4, "cat"))
    scheduler.add_request(image_request("b", [1, 2, *image, 3], 1.0, 2, 4, "dog"))
    drain(scheduler)
