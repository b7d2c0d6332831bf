"""vLLM-style tests of a scheduler whose KV connector loads blocks, at the edges the vLLM
attachment used to refuse (vLLM's objects only, no kvspec import), run by
tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. The connector is
vLLM's ``ExampleConnector`` scripted as in ``case_connector.py``: ``script`` says how many
tokens past its local hit the store holds for each request.

Preemption beside asynchronous loads: the spec runs a request from its load's admission on,
vLLM appends it to ``running`` only when it is scheduled after landing. Where both rank the
running requests alike the preemption is judged (and a victim vLLM picks against its own rule
is caught); where they rank them differently it is refused."""

from case_connector import make_scheduler
from case_seed import BLOCK, make_request, runner_output
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus


def script(scheduler, loads):
    """The store holds ``loads[request id]`` tokens past the local hit (whole blocks, short of
    the last token's block); every load is asynchronous."""

    def matched(request, num_computed_tokens):
        tokens = loads.get(request.request_id, 0)
        room = (request.num_tokens - 1) // BLOCK * BLOCK - num_computed_tokens
        tokens = tokens if room >= tokens else 0
        return tokens, tokens > 0

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
