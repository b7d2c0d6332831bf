"""kvspec's pytest plugin on a hybrid model's KV-cache groups (``tests/vllm_cases/case_hybrid.py``:
full attention beside a sliding window under vLLM's ``HybridKVCacheCoordinator``), on every
supported vLLM, with and without the plugin: the correct tests are judged event by event
(several groups, ``Config.groups``) and hold, under the synchronous and the async scheduler; the
two bugs planted in vLLM's window manager (a window hit one block short, blocks before the window
freed on the optimistic count) fail with kvspec's finding; full attention beside a Mamba state
group (align mode) is refused by that one name, ``Mamba state publication``, and nothing else
(so it is judged as soon as the spec's state groups register where vLLM's do and
``vllm_adapter/groups.py`` drops the refusal); without the plugin every test passes.
Skipped where a release's environment is not built (``make thirdparty``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_hybrid.py")
HOLDS = ("test_full_and_window_groups_hold[sync]", "test_full_and_window_groups_hold[async]")
MAMBA = ("test_full_and_mamba_groups[sync]", "test_full_and_mamba_groups[async]")
PLANTED = {  # test -> what kvspec's finding must say
    # group 1's hit (the window's) is one block short of the spec's
    "test_a_window_hit_short_of_the_window_is_caught": "1), but the spec expects ('hit', 1, (",
    # a block freed while a step in flight still reads it
    "test_a_window_free_on_the_optimistic_count_is_caught": "Disagreement: engine emitted ('free'",
}


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_full_and_window_groups(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, (*HOLDS, *MAMBA), PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 300, entry
    for name in MAMBA:  # refused by that name alone while it stands (groups.STATE_PUBLICATION)
        entry = tests[name]
        refused = entry["outcome"] == "construction"
        assert entry["features"] == (["Mamba state publication"] if refused else []), entry
        assert entry["outcome"] in ("construction", "judged") and entry["events"] > 300, entry
