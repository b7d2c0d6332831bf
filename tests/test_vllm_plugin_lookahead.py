"""kvspec's pytest plugin on requests whose block hasher looks ahead (the spec's
``Config.hash_lookahead``; ``tests/vllm_cases/case_lookahead.py``), on every supported vLLM, with
and without the plugin: the correct workload is judged and holds; the planted bug on that path
(blocks cached at ``update_from_output``, one ``schedule()`` before vLLM caches a block whose
lookahead token was just sampled) fails with kvspec's finding; two mutants of vLLM's hasher that
the spec's keys cannot follow (more hashes than keys, a collision) and two lookaheads in one
scheduler are refused by name; without
the plugin every test passes. Skipped where a release's environment is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_lookahead.py")
HOLDS = ("test_lookahead_hashes_hold",)
PLANTED = {  # test -> what kvspec's finding must say
    "test_blocks_cached_at_the_output_are_caught": "Disagreement: engine emitted ('publish'",
}
REFUSED = {  # test -> its one refusal's start
    "test_a_hasher_mutant_is_refused[early]": "no block hasher: 2 block hashes for 1 full "
    "blocks with 1 tokens after each",
    "test_a_hasher_mutant_is_refused[blind]": "block hash collision: ",
    "test_a_request_hashed_otherwise_is_refused": "lookahead hashing: r1's hashes cover 0 tokens "
    "after each block, the configuration's 1",
}


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_lookahead_hashes(vllm_case_sessions: CaseSessions, venv: Path) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, (*HOLDS, *REFUSED), PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 50, entry
    for name, refusal in REFUSED.items():
        entry = tests[name]
        assert entry["outcome"] == "run", entry
        assert len(entry["refusals"]) == 1 and entry["refusals"][0].startswith(refusal), entry
