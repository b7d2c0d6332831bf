"""kvspec's pytest plugin on a bare BlockPool call that vLLM rejects
(``tests/vllm_cases/case_rejected.py``), on every supported vLLM, with and without the plugin: a
call that raises leaving the pool as it was (``cache_partial_block`` off the hash boundary, as
vLLM's own ``test_cache_partial_block_requires_hash_boundary`` does) is judged, and the pool's
later calls with it; a call that raises after changing the pool is refused as "vLLM raised"
(``pool_attach.PoolAttachment._rejected``). Planted: with ``_rejected`` ignoring the pool's
state, the second test is judged ("pool"), so this test fails. Skipped where a release's
environment is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_rejected.py")
JUDGED = "test_a_partial_entry_off_the_hash_boundary_is_rejected_and_the_pool_goes_on"
REFUSED = "test_a_touch_that_fails_after_taking_a_block_off_the_free_queue_is_refused"


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_a_rejected_call_only_where_it_changed_nothing(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, (JUDGED, REFUSED), {})
    judged = tests[JUDGED]
    assert judged["outcome"] == "pool" and judged["refusals"] == [], judged
    assert judged["events"] >= 3, judged  # the allocations and the free after the rejection
    refused = tests[REFUSED]
    assert refused["outcome"] == "pool-refused", refused
    assert refused["refusals"] == ["vLLM raised: RuntimeError in touch()"], refused
