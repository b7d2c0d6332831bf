"""kvspec's pytest plugin on ``reset_prefix_cache(reset_running_requests=True)`` beside a step in
flight (``tests/vllm_cases/case_reset.py``), on every supported vLLM, with and without the
plugin: the correct workload is judged and holds (the spec's ``("reset", True)``: the victims'
output in flight dropped); two mutants of vLLM's own reset fail with kvspec's finding (its
victims' output delivered; a block left published); in-flight counts zeroed by hand before the
reset, then the scheduler driven on, is refused by name at the next call. Without the plugin
every test passes. Skipped where a release's environment is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_reset.py")
HOLDS = tuple(f"test_a_reset_beside_a_step_in_flight_holds[{at}]" for at in (2, 3, 5))
PLANTED = {  # test -> what kvspec's finding must say
    "test_a_reset_delivering_its_victims_output_is_caught": "Illegal: commit step",
    "test_a_reset_keeping_a_block_published_is_caught": "Disagreement",
}
REFUSED = {  # test -> its one refusal's start
    "test_in_flight_counts_zeroed_before_the_reset_then_driven_on_is_refused": (
        "state edited between calls: r0's num_in_flight_tokens 0, its steps in flight schedule"
    ),
}


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_a_reset_beside_steps_in_flight(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, (*HOLDS, *REFUSED), PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 50, entry
    for name, refusal in REFUSED.items():
        entry = tests[name]
        assert entry["outcome"] == "run", entry
        assert len(entry["refusals"]) == 1 and entry["refusals"][0].startswith(refusal), entry
