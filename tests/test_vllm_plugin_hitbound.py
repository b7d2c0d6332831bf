"""kvspec's pytest plugin on prefix-cache hits bounded by what vLLM was told
(``tests/vllm_cases/case_hitbound.py``; ``docs/model.md``, "Bounded hits"), on every supported
vLLM, with and without the plugin: a hit capped by the aux output connector and a skipped read
(both releases), a bounded read (0.34.0's ``prefix_cache_hit_limit``) are judged and hold; the
planted mutants of vLLM's own lookup (the connector's bound dropped, a bound one block short, a
request's own limit ignored) fail with kvspec's finding on the hit. Without the plugin every test
passes. Skipped where a release's environment is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_hitbound.py")
HOLDS = (
    "test_a_hit_capped_by_the_aux_output_connector_holds[2]",
    "test_a_hit_capped_by_the_aux_output_connector_holds[3]",
    "test_a_hit_capped_by_the_aux_output_connector_holds[0]",
    "test_a_skipped_read_that_would_hit_holds",
)
PLANTED = {  # test -> what kvspec's finding must say (the hit rule: a Disagreement on the hit)
    "test_a_lookup_ignoring_the_cap_is_caught": "Disagreement: engine emitted ('hit', 1, (",
    "test_a_lookup_one_block_short_of_the_cap_is_caught": "Disagreement: engine emitted ('hit', 1,",
    "test_a_skipped_read_looked_up_is_caught": "Disagreement: engine emitted ('hit', 1, (",
}
HOLDS_034 = ("test_a_bounded_read_holds",)
PLANTED_034 = {"test_a_bounded_read_ignored_is_caught": "Disagreement: engine emitted ('hit', 1, ("}


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_bounded_hits(vllm_case_sessions: CaseSessions, venv: Path) -> None:
    later = venv.name.endswith("0.34.0")
    holds = HOLDS + (HOLDS_034 if later else ())
    planted = PLANTED | (PLANTED_034 if later else {})
    skipped = () if later else (*HOLDS_034, *PLANTED_034)  # JUnit counts a skip as passed
    tests = judge_case(vllm_case_sessions, CASE, venv, holds + skipped, planted)
    for name in holds:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 20, entry
    for name in planted:
        assert tests[name]["finding"].startswith("kvspec: Disagreement"), tests[name]
