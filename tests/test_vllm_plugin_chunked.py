"""kvspec's pytest plugin on chunked local attention (the spec's ``chunked`` group kind;
``tests/vllm_cases/case_chunked.py``), on every supported vLLM, with and without the plugin: a
scheduler whose one group is a ``ChunkedLocalAttentionSpec``, or whose groups are full attention
then chunked, is judged and holds (hits with the null block before their chunk, chunks before
the processed token's freed); the planted bugs in
vLLM's ``ChunkedLocalAttentionManager`` (a skipped count one chunk too far, a hit that takes the
block before its chunk) fail with kvspec's finding; without the plugin every test passes.
Skipped where a release's environment is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_chunked.py")
HOLDS = ("test_chunked_local_attention_holds", "test_chunked_beside_full_attention_holds")
PLANTED = {  # test -> what kvspec's finding must say
    "test_a_skip_one_chunk_too_far_is_caught": "Disagreement",
    "test_a_hit_taking_the_block_before_its_chunk_is_caught": "Disagreement",
}


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_chunked_local_attention(
    vllm_case_sessions: CaseSessions, venv: Path
) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, HOLDS, PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 200, entry
        assert not entry.get("refusals"), entry
