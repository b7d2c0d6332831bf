"""kvspec's pytest plugin on synchronous KV loads under a sliding window (the spec's
``WindowLoad``; ``tests/vllm_cases/case_winconn.py``), on every supported vLLM, with and without
the plugin: loads whose window skips loaded positions are judged and hold; the planted bug on
that path (vLLM's ``SlidingWindowManager`` padding only the local hit with nulls, so loaded
positions before the window get blocks) fails with kvspec's finding; without the plugin every
test passes. Skipped where a release's environment is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_winconn.py")
HOLDS = ("test_synchronous_loads_under_a_window_hold", "test_finishes_beside_a_connector_hold")
PLANTED = {  # test -> what kvspec's finding must say
    "test_a_load_given_blocks_before_the_window_is_caught": "Disagreement",
    "test_a_finish_freeing_the_table_whole_is_caught": "Disagreement",
    "test_a_finish_freeing_what_a_step_in_flight_reads_is_caught": "Disagreement",
}


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_loads_under_a_window(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, HOLDS, PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 200, entry
        assert not entry.get("refusals"), entry
