"""vLLM-style tests the plugin must refuse, not judge (run by tests/test_pytest_plugin.py): a
feature the spec does not model (prefix caching off) and a test that edits vLLM's state between
calls. Both pass, with and without the plugin."""

from case_seed import make_request, make_scheduler, runner_output, step
from vllm.config import CacheConfig


def test_prefix_caching_off_is_refused(monkeypatch):
    original = CacheConfig.__init__

    def caching_off(self, *args, **kwargs):
        original(self, *args, **dict(kwargs, enable_prefix_caching=False))

    monkeypatch.setattr(CacheConfig, "__init__", caching_off)
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
