"""vLLM-style tests (vLLM's objects only, no kvspec import) of synchronous KV loads at admission
under a sliding window, as vLLM's
``test_prefix_hit_is_capped_at_retained_auxiliary_outputs[external-sliding-window]`` has one:
``case_window_connector.py``'s ``AsyncScheduler`` (window 5, blocks of 2) beside vLLM's
``ExampleConnector``, whose store now holds tokens past the local hit, loaded in the step that
computes the rest. Loads long enough that the window of the token after them skips loaded
positions (which hold the null block, never allocated nor loaded), beside hits and decodes past
the window; no request finishes (a finish beside a connector stays refused).
``tests/test_vllm_plugin_winconn.py`` runs them in every supported release's environment, with
and without the plugin. Planted: a window manager that pads only the local hit with nulls, so
the loaded positions before the window get blocks of their own."""

from case_window import BLOCK
from case_window_connector import make_scheduler, workload
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

LOADS = {"r0": 8, "r1": 6, "r3": 2}  # tokens past the local hit the store holds


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
