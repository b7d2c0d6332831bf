"""vLLM-style tests (vLLM's objects only, no kvspec import) of
``reset_prefix_cache(reset_running_requests=True)`` while a step is in flight under
``AsyncScheduler`` (``case_async``'s batch queue of two steps): vLLM preempts every running
request with ``drop_stale_output=True`` (their output in flight is dropped, whatever the
scheduler's stale-output mode), resets the cache, and admits them again in the next step.
``tests/test_vllm_plugin_reset.py`` runs them in every supported release's environment, with
and without the plugin.

Planted, each a mutant of vLLM's own method (both pass without the plugin): ``deliver``,
``Scheduler.reset_prefix_cache`` recompiled from its source with ``drop_stale_output=False``
(the victims' output in flight delivered); ``kept``, ``BlockPool.reset_prefix_cache`` leaving
the first cached block under its hash. Refused by name: in-flight counts zeroed by hand before
the reset (as vLLM's ``test_scheduler_reset_prefix_cache`` does) and the scheduler driven on
after it."""

import inspect
import textwrap
from unittest.mock import patch

import pytest
from case_async import EngineCore, make_request, make_scheduler, runner_v2  # noqa: F401
from vllm.v1.core import block_pool
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched import scheduler as scheduler_module
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

BLOCK = 2
INDEXED = "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters  # 0.33.0


class Core(EngineCore):
    """``case_async``'s batch queue of two steps, its runner's output built as each release
    takes it (0.34.0's has no ``req_id_to_index``)."""

    def process_oldest(self):
        output, samples = self.queue.pop(0)
        ids = list(output.num_scheduled_tokens)
        index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if INDEXED else {}
        runner = ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[[7] if r in samples else [] for r in ids], **index
        )
        self.scheduler.update_from_output(output, runner)


PROMPTS = ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 6], [1, 2, 3, 7])


def deliver_mutant():
    """vLLM's ``Scheduler.reset_prefix_cache`` delivering its victims' output in flight."""
    source = textwrap.dedent(inspect.getsource(Scheduler.reset_prefix_cache))
    old = "drop_stale_output=True"
    assert source.count(old) == 1
    scope = dict(vars(scheduler_module))
    exec(
        compile(source.replace(old, "drop_stale_output=False"), scheduler_module.__file__, "exec"),
        scope,
    )
    return scope["reset_prefix_cache"]


OWN_POOL_RESET = BlockPool.reset_prefix_cache


def reset_keeping_a_block(self):
    """Planted: the reset leaves the first cached block under its hash."""
    cached = [b for b in self.blocks if b.block_hash is not None][:1]
    kept = [(b, b.block_hash, b.block_hash_num_tokens) for b in cached]
    done = OWN_POOL_RESET(self)
    for block, key, tokens in kept if done else ():
        block.set_block_hash(key, tokens)
        self.cached_block_hash_to_block.insert(key, block)
    return done


def reset_workload(at=3, max_tokens=6):
    core = Core(make_scheduler("fcfs", BLOCK, num_blocks=16, budget=8, max_seqs=3))
    requests = [
        make_request(f"r{i}", prompt, BLOCK, arrival=float(i), max_tokens=max_tokens)
        for i, prompt in enumerate(PROMPTS)
    ]
    for request in requests:
        core.scheduler.add_request(request)
    for _ in range(at):
        core.step()
    assert core.queue and core.scheduler.running  # a step in flight, requests running
    assert core.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert not core.scheduler.running
    for _ in range(60):
        core.step()
    assert not core.scheduler.has_requests() and not core.queue
    for request in requests:
        assert request.num_output_tokens == max_tokens


@pytest.mark.parametrize("at", [2, 3, 5])
def test_a_reset_beside_a_step_in_flight_holds(at):
    reset_workload(at)


def test_a_reset_delivering_its_victims_output_is_caught():
    with patch.object(Scheduler, "reset_prefix_cache", deliver_mutant()):
        reset_workload()


def test_a_reset_keeping_a_block_published_is_caught():
    with patch.object(block_pool.BlockPool, "reset_prefix_cache", reset_keeping_a_block):
        reset_workload()


def test_in_flight_counts_zeroed_before_the_reset_then_driven_on_is_refused():
    core = Core(make_scheduler("fcfs", BLOCK, num_blocks=16, budget=8, max_seqs=3))
    for i, prompt in enumerate(PROMPTS):
        core.scheduler.add_request(make_request(f"r{i}", prompt, BLOCK, arrival=float(i)))
    core.schedule()  # its output is never processed
    for request in core.scheduler.running:
        request.num_in_flight_tokens = 0
    assert core.scheduler.reset_prefix_cache(reset_running_requests=True)
    core.queue.clear()
    core.scheduler.schedule()
