"""vLLM-style tests (vLLM's objects only, no kvspec import) of synchronous KV loads at admission
under a sliding window, as vLLM's
``test_prefix_hit_is_capped_at_retained_auxiliary_outputs[external-sliding-window]`` has one:
``case_window_connector.py``'s ``AsyncScheduler`` (window 5, blocks of 2) beside vLLM's
``ExampleConnector``, whose store now holds tokens past the local hit, loaded in the step that
computes the rest. Loads long enough that the window of the token after them skips loaded
positions (which hold the null block, never allocated nor loaded), beside hits and decodes past
the window; and the same with every request finishing (``_connector_finished`` frees the blocks
before the window first: the spec's ``WindowFinish``).
``tests/test_vllm_plugin_winconn.py`` runs them in every supported release's environment, with
and without the plugin. Planted: a window manager that pads only the local hit with nulls, so
the loaded positions before the window get blocks of their own; a finish that frees the table
whole (no trim first); a finish whose trim counts the tokens in flight as processed."""

from case_window import BLOCK, EngineCore
from case_window import workload as window_workload
from case_window_connector import make_scheduler, workload
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

LOADS = {"r0": 8, "r1": 6, "r3": 2, "req-0": 8, "req-2": 4, "late": 2}  # past the local hit


def loading(scheduler):
    """The store serves ``LOADS`` synchronously where they end short of the last token's
    block (vLLM's ``MockKVConnector`` with ``is_async=False``)."""

    def matched(request, num_computed_tokens):
        tokens = LOADS.get(request.request_id, 0)
        room = (request.num_tokens - 1) // BLOCK * BLOCK - num_computed_tokens
        return (tokens if room >= tokens else 0), False

    scheduler.connector.get_num_new_matched_tokens = matched
    return scheduler


def test_synchronous_loads_under_a_window_hold(tmp_path):
    scheduler = loading(make_scheduler(tmp_path))
    workload(scheduler)
    assert scheduler.connector is not None


def test_a_load_given_blocks_before_the_window_is_caught(tmp_path, monkeypatch):
    original = SlidingWindowManager.add_local_computed_blocks

    def local_only(self, request_id, new_computed_blocks, num_local, num_external):
        # planted: nulls only before the window of the local hit's end, so the loaded
        # positions before the window of the load's end are allocated (and loaded)
        return original(self, request_id, new_computed_blocks, num_local, 0)

    monkeypatch.setattr(SlidingWindowManager, "add_local_computed_blocks", local_only)
    workload(loading(make_scheduler(tmp_path)))


def finishing(tmp_path):
    """``case_window.py``'s workload (an early stop with a decode in flight, an abort with two
    steps in flight, late arrivals that hit past the window; everything finishes) beside the
    connector, with loads."""
    window_workload(EngineCore(loading(make_scheduler(tmp_path)), stops={"req-3": 2}))


def test_finishes_beside_a_connector_hold(tmp_path):
    finishing(tmp_path)


def test_a_finish_freeing_the_table_whole_is_caught(tmp_path, monkeypatch):
    original = Scheduler._connector_finished

    def untrimmed(self, request):
        # planted: the blocks before the window go back with the table, one reversed batch
        trim, self.kv_cache_manager.remove_skipped_blocks = (
            self.kv_cache_manager.remove_skipped_blocks,
            lambda *a, **kw: None,
        )
        try:
            return original(self, request)
        finally:
            self.kv_cache_manager.remove_skipped_blocks = trim

    monkeypatch.setattr(Scheduler, "_connector_finished", untrimmed)
    finishing(tmp_path)


def test_a_finish_freeing_what_a_step_in_flight_reads_is_caught(tmp_path, monkeypatch):
    original = Scheduler._connector_finished

    def optimistic(self, request):
        # planted: the finish's trim on the optimistic count, the tokens in flight included
        flying, request.num_in_flight_tokens = request.num_in_flight_tokens, 0
        try:
            return original(self, request)
        finally:
            request.num_in_flight_tokens = flying

    monkeypatch.setattr(Scheduler, "_connector_finished", optimistic)
    finishing(tmp_path)
