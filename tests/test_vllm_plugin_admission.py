"""kvspec's pytest plugin on vLLM 0.34.0's cache-aware admission
(``tests/vllm_cases/case_admission.py``), with and without the plugin: the correct tests
(synchronous, async under a batch queue, with preemptions, below the threshold) are judged and
hold, the spec reordering its own queue by its rule (``spec/admission.py``); the planted bugs in
vLLM's reorder (the shallowest prefix first, the window ignored, the threshold ignored) fail
with kvspec's finding, the spec's admission rule naming the head it expected; without the plugin
every test passes. vLLM 0.33.0 has no such setting: its ``SchedulerConfig`` rejects it at
construction, so the case is skipped there, saying so. Skipped where a release's environment is
not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_admission.py")
HOLDS = (
    "test_cache_aware_admission_holds[sync]",
    "test_cache_aware_admission_holds[async]",
    "test_cache_aware_admission_with_preemptions_holds",
    "test_cache_aware_admission_below_the_threshold_holds",
)
PLANTED = {  # test -> what kvspec's finding must say
    "test_a_reorder_sorting_the_wrong_way_is_caught": "admits the head of the waiting queue",
    "test_a_reorder_past_the_window_is_caught": "admits the head of the waiting queue",
    "test_a_reorder_below_the_threshold_is_caught": "admits the head of the waiting queue",
}
NEWER = [venv for venv in VENVS if "0.33.0" not in str(venv.id)]  # type: ignore[attr-defined]
OLDER = [venv for venv in VENVS if "0.33.0" in str(venv.id)]  # type: ignore[attr-defined]


@pytest.mark.e2e
@pytest.mark.parametrize("venv", NEWER)
def test_the_plugin_judges_cache_aware_admission(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, HOLDS, PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 40, entry


@pytest.mark.e2e
@pytest.mark.parametrize("venv", OLDER)
def test_vllm_0_33_0_has_no_cache_aware_admission(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    for part in vllm_case_sessions.parts(venv, "case_admission.py"):  # the file skipped whole
        assert list(part.outcomes) == list(part.skipped) == ["case_admission"], part.outcomes
        reason = part.skipped["case_admission"]
        assert "has no cache_aware_admission_window" in reason, part.out[-3000:]
