"""kvspec's pytest plugin on a sliding-window group beside a KV connector that loads nothing
(``tests/vllm_cases/case_window_connector.py``), on every supported vLLM, with and without the
plugin: the workload is judged and holds, and so do finishes beside the connector (vLLM frees
the blocks before the window first: the spec's ``WindowFinish``); the planted bug on that path
(a hit that takes one cached block as enough where the window needs two) fails with kvspec's
finding; without the plugin every test passes. Skipped where a release's environment is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_window_connector.py")
HOLDS = ("test_a_window_beside_a_connector_holds", "test_a_finish_beside_a_connector_holds")
PLANTED = {  # test -> what kvspec's finding must say
    "test_a_hit_short_of_the_window_beside_a_connector_is_caught": "Disagreement: engine "
    "emitted ('hit', 1, (0, 0, 0, 0, 5)), but the spec expects ('hit', 1, (0, 0, 0, 4, 5))",
}
REFUSED: dict[str, str] = {}  # test -> its one refusal's start (a finish: WindowFinish now)


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_a_window_beside_a_connector(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, (*HOLDS, *REFUSED), PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 100, entry
    for name, refusal in REFUSED.items():
        entry = tests[name]
        assert entry["outcome"] == "run", entry
        assert len(entry["refusals"]) == 1 and entry["refusals"][0].startswith(refusal), entry
