"""kvspec's pytest plugin on an encoder-decoder model's cross-attention
(``tests/vllm_cases/case_cross.py``: the decoder's full attention beside a
``CrossAttentionManager`` group, as vLLM's own encoder-decoder tests build it), on every
supported vLLM, with and without the plugin: the correct tests are judged event by event (a
``cross`` group, ``docs/model.md``, "Cross-attention") and hold, a preemption and re-admission
included; the two bugs planted in vLLM's ``CrossAttentionManager`` (a table one block short of
the encoder tokens, cross blocks freed while the decoder still reads them) fail with kvspec's
finding naming the cross group's missing block or the early free; without the plugin every
test passes. Skipped where a release's environment is not built (``make thirdparty``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pytest_plugin import CASES
from vllm_case_sessions import CaseSessions, judge_case
from vllm_venvs import VENVS

CASE = str(CASES / "case_cross.py")
HOLDS = ("test_cross_attention_holds", "test_cross_attention_under_preemption_holds")
PLANTED = {  # test -> what kvspec's finding must say
    # r0's 13 encoder tokens need 4 cross blocks (group 1); vLLM's manager allocated 3
    "test_a_cross_table_one_block_short_is_caught": "Disagreement: missing effect ('alloc', 0, ",
    # a cross block freed at a decode's allocate_slots while the request still reads it
    "test_cross_blocks_freed_while_read_are_caught": "Disagreement: engine emitted ('free', ",
}


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_plugin_judges_cross_attention(vllm_case_sessions: CaseSessions, venv: Path) -> None:
    tests = judge_case(vllm_case_sessions, CASE, venv, HOLDS, PLANTED)
    for name in HOLDS:
        entry = tests[name]
        assert entry["outcome"] == "judged" and entry["events"] > 100, entry
        assert not entry["features"], entry
    short = tests["test_a_cross_table_one_block_short_is_caught"]["finding"]
    assert short.split("missing effect ")[1].startswith("('alloc', 0, ") and ", 1)" in short
