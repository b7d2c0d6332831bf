"""kvspec's pytest plugin where a vLLM test answers a KV-cache manager call itself and where a
runner output samples no token (``tests/vllm_cases/case_answered.py``), on every supported vLLM,
with and without the plugin: the correct tests are judged and hold; the planted bugs on those
paths (a failure path that preempts the head of ``running``; an empty output that drops a block's
reference beneath the pool) fail with kvspec's finding; an answer that changed the pool, an
empty output that freed blocks and a scheduler driven past an empty output are refused by name;
without the plugin every test passes. Skipped where a release's environment is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_answered.py")
HOLDS = ("test_allocations_answered_by_the_test_hold", "test_an_empty_output_at_the_end_holds")
PLANTED = {  # test -> what kvspec's finding must say
    "test_a_failure_path_preempting_the_head_is_caught": "fcfs preempts the unscheduled tail",
    "test_an_empty_output_that_changes_blocks[beneath]": "Disagreement",
}
REFUSED = {  # test -> its one refusal's start
    "test_an_answer_that_changed_the_pool_is_refused": "vLLM method patched by the test: "
    "KVCacheManager.allocate_slots answered by the test, with vLLM's state changed",
    "test_driven_past_an_empty_output_is_refused": "no token sampled: ",
    "test_an_empty_output_that_changes_blocks[freed]": "no token sampled: ",
}


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_answered_calls_and_empty_outputs(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, (*HOLDS, *REFUSED), PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 20, entry
    for name, refusal in REFUSED.items():
        entry = tests[name]
        assert entry["outcome"] == "run", entry
        assert len(entry["refusals"]) == 1 and entry["refusals"][0].startswith(refusal), entry
