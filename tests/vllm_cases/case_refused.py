"""vLLM-style tests the plugin must refuse, not judge (run by tests/test_pytest_plugin.py): a
scheduler the spec does not model (a ``Scheduler`` subclass: its overrides are not vLLM's) and a
test that edits vLLM's state between calls. Both pass, with and without the plugin."""

import case_seed
from case_seed import make_request, make_scheduler, runner_output, step
from vllm.v1.core.sched.scheduler import Scheduler


class CustomScheduler(Scheduler):
    pass


def test_a_scheduler_subclass_is_refused(monkeypatch):
    monkeypatch.setattr(case_seed, "Scheduler", CustomScheduler)
    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], priority=0, arrival=0.0))
    while scheduler.has_requests():
        step(scheduler)


def test_a_test_that_edits_vllm_state_is_refused():
    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    request = make_request("a", [1, 2, 3, 4, 5], priority=0, arrival=0.0, max_tokens=5)
    scheduler.add_request(request)
    step(scheduler)
    request.max_tokens = 2  # the spec was told 5 at arrival
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner_output(scheduler, output))
    assert request.is_finished()


def test_nothing_built():
    assert make_request("x", [1], priority=0, arrival=0.0).num_tokens == 1
