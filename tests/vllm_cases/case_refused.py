"""vLLM-style tests the plugin must refuse, not judge (run by tests/test_pytest_plugin.py): a
scheduler the spec does not model (a ``Scheduler`` subclass: its overrides are not vLLM's), one
with two such features at once (both must be listed, not only the first), and a test that edits
vLLM's state between calls. All pass, with and without the plugin."""

import case_seed
from case_seed import make_request, make_scheduler, runner_output, step
from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler


class CustomScheduler(Scheduler):
    pass


def test_a_scheduler_subclass_is_refused(monkeypatch):
    monkeypatch.setattr(case_seed, "Scheduler", CustomScheduler)
    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], priority=0, arrival=0.0))
    while scheduler.has_requests():
        step(scheduler)


def test_every_feature_seen_at_construction_is_listed(monkeypatch):
    def async_config(**kwargs):
        config = VllmConfig(**kwargs)
        config.scheduler_config.async_scheduling = True  # and not an AsyncScheduler
        return config

    monkeypatch.setattr(case_seed, "Scheduler", CustomScheduler)
    monkeypatch.setattr(case_seed, "VllmConfig", async_config)
    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    assert type(scheduler) is CustomScheduler and scheduler.scheduler_config.async_scheduling


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
