"""vLLM-style tests (vLLM's objects only, no kvspec import) of two things vLLM's own tests do that
kvspec once refused and now judges (``tests/test_vllm_plugin_answered.py`` runs them in every
supported release's environment, with and without the plugin):

* the test answers a KV-cache manager call itself, in vLLM's place: ``allocate_slots`` replaced
  by a ``Mock`` or a spy that fails one allocation (vLLM's scheduler takes its own failure path:
  an admission given up, a running request's preemption of the tail), ``reset_prefix_cache``
  answered by a ``Mock``; planted: a ``running`` list whose ``pop()`` takes the head, so the
  failure path preempts the wrong request; refused: an answer that changed the pool;
* a runner output with no token for a request at the end of its tokens, as the last thing the
  test does (judged up to it; that output must change no block); planted: an
  ``update_from_output`` that drops a reference of the request's block beneath the pool on such
  an output; refused: a scheduler driven past it, and one whose output frees blocks."""

from unittest.mock import Mock, patch

import pytest
from case_seed import make_request, make_scheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput


def runner_output(output, empty=False):
    """One token (or none, ``empty``) per request at the end of its known tokens, in a
    ``ModelRunnerOutput`` of either release (0.34.0 has no ``req_id_to_index``)."""
    ids = list(output.num_scheduled_tokens)
    sampled = [[] if empty or r in PREFILLS else [1] for r in ids]
    fields = ModelRunnerOutput.__dataclass_fields__
    index = {r: i for i, r in enumerate(ids)}
    extra = {"req_id_to_index": index} if "req_id_to_index" in fields else {}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra)


PREFILLS: set = set()  # the requests of the step being processed still mid-prefill


def step(scheduler):
    output = scheduler.schedule()
    PREFILLS.clear()
    PREFILLS.update(
        r for r in output.num_scheduled_tokens if scheduler.requests[r].is_prefill_chunk
    )
    scheduler.update_from_output(output, runner_output(output))
    return output


class HeadFirst(list):
    """A ``running`` list whose ``pop()`` takes the head (planted: the wrong victim)."""

    def pop(self, index=-1):
        return super().pop(0)


def drain(scheduler, limit=60):
    for _ in range(limit):
        if not scheduler.has_requests():
            return
        step(scheduler)
    raise AssertionError("requests left")


def fail_first(scheduler):
    """``patch.object`` with a side effect, as vLLM's tests fail the Nth allocation."""
    real = scheduler.kv_cache_manager.allocate_slots
    calls = []

    def allocate(*args, **kwargs):
        calls.append(1)
        return None if len(calls) == 1 else real(*args, **kwargs)

    return patch.object(scheduler.kv_cache_manager, "allocate_slots", side_effect=allocate)


def answered_workload(plant=False):
    scheduler = make_scheduler(policy="fcfs", num_blocks=16)
    if plant:
        scheduler.running = HeadFirst()
    kv = scheduler.kv_cache_manager
    own = kv.allocate_slots
    kv.allocate_slots = Mock(return_value=None)  # every admission fails: nothing admitted
    for i, prompt in enumerate(([1, 2, 3], [1, 2, 4], [7, 8])):
        scheduler.add_request(make_request(f"r{i}", prompt, 0, float(i), max_tokens=8))
    assert not step(scheduler).num_scheduled_tokens
    kv.allocate_slots.assert_called_once()
    kv.allocate_slots = own  # put back
    step(scheduler)
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["r0", "r1", "r2"]
    with fail_first(scheduler) as allocate:  # r0's decode fails: the tail is preempted
        output = step(scheduler)
    assert allocate.call_count >= (1 if plant else 2)  # planted: r0 preempted itself
    assert output.preempted_req_ids == ({"r0"} if plant else {"r2"})
    own_reset = kv.reset_prefix_cache
    kv.reset_prefix_cache = Mock(return_value=True)  # the manager's reply, by the test
    assert scheduler.reset_prefix_cache()
    kv.reset_prefix_cache.assert_called_once()
    kv.reset_prefix_cache = own_reset
    drain(scheduler)


def test_allocations_answered_by_the_test_hold():
    answered_workload()


def test_a_failure_path_preempting_the_head_is_caught():
    answered_workload(plant=True)


def test_an_answer_that_changed_the_pool_is_refused():
    scheduler = make_scheduler(policy="fcfs", num_blocks=16)
    pool = scheduler.kv_cache_manager.block_pool

    def allocate(*args, **kwargs):
        pool.get_new_blocks(1)  # taken beneath the manager, then "failed"
        return None

    scheduler.kv_cache_manager.allocate_slots = allocate
    scheduler.add_request(make_request("r0", [1, 2, 3], 0, 0.0))
    step(scheduler)


def unsampled(then_step=False):
    scheduler = make_scheduler(policy="fcfs", num_blocks=16)
    scheduler.add_request(make_request("r0", [1, 2, 3], 0, 0.0, max_tokens=4))
    scheduler.add_request(make_request("r1", [1, 2, 4, 5], 0, 1.0, max_tokens=4))
    step(scheduler)
    step(scheduler)
    before = {r.request_id: r.num_output_tokens for r in scheduler.running}
    output = scheduler.schedule()
    assert set(output.num_scheduled_tokens) == {"r0", "r1"}
    scheduler.update_from_output(output, runner_output(output, empty=True))  # nobody sampled
    assert {r.request_id: r.num_output_tokens for r in scheduler.running} == before
    if then_step:
        step(scheduler)
    return scheduler


def test_an_empty_output_at_the_end_holds():
    unsampled()


def test_driven_past_an_empty_output_is_refused():
    unsampled(then_step=True)


@pytest.mark.parametrize("how", ["beneath", "freed"])
def test_an_empty_output_that_changes_blocks(monkeypatch, how):
    """beneath (planted): a reference of the request's first block dropped beneath the pool;
    freed: its blocks freed through the manager (refused: the spec has no commit to place it)."""
    real = Scheduler.update_from_output

    def update_from_output(self, scheduler_output, model_runner_output):
        result = real(self, scheduler_output, model_runner_output)
        if all(not t for t in model_runner_output.sampled_token_ids):
            request = self.requests["r0"]
            if how == "beneath":
                self.kv_cache_manager.get_blocks("r0").blocks[0][0].ref_cnt -= 1
            else:
                self.kv_cache_manager.free(request)
        return result

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    unsampled()
