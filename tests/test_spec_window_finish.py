"""``WindowFinish`` (``Config.trim_at_finish``, with ``sliding_window``): a request that finishes
or is aborted first frees, as one batch, its blocks wholly before the window of the token after
its *processed* ones, then the rest of its table, as vLLM's ``_connector_finished`` does beside
a KV connector. The free effects' order and the free queue show the two batches; the processed
basis counts the committing step's tokens and not those of a later step in flight. Each test
fails with the rule undone (``_trim_at_finish`` returning nothing: one reversed table) or with
the basis changed (the committing step's tokens left out: nothing trimmed)."""

from __future__ import annotations

import pytest
from window_cases import PROMPT
from window_cases import run_checked as _run
from window_cases import window_config as _config

from kvspec.spec import initial_state


def _finish(trim: bool) -> tuple[list[int], list[tuple[object, ...]], list[int]]:
    s = initial_state(_config(trim_at_finish=trim))
    _run(s, [("arrive", 1, PROMPT, 1, 0), ("begin", 0), ("schedule", 1, 14, 0), ("submit", 0)])
    table = list(s.requests[1].table)
    out = _run(s, [("execute", 0, ()), ("commit", 0, ((1, 99),))])[-1]
    assert s.requests[1].status == "finished"
    return table, [e for e in out if e[0] == "free"], list(s.free)


def test_a_finish_frees_the_blocks_before_the_window_first() -> None:
    """14 processed tokens: (14 - 4 + 1) // 4 = 2 blocks before the window, freed first (the
    batch's events last block first, as ``remove_skipped``'s), then the table's other two,
    last first; without the field the table's four, last first."""
    table, frees, queue = _finish(trim=True)
    assert frees == [("free", b) for b in (table[1], table[0], table[3], table[2])]
    plain_table, plain, plain_queue = _finish(trim=False)
    assert plain == [("free", b) for b in reversed(plain_table)]
    assert queue != plain_queue  # the two batches reach the free queue in another order


def test_an_abort_frees_the_blocks_before_the_window_first() -> None:
    s = initial_state(_config(trim_at_finish=True))
    _run(s, [("arrive", 1, PROMPT, 5, 0), ("begin", 0), ("schedule", 1, 14, 0), ("submit", 0)])
    _run(s, [("execute", 0, ()), ("commit", 0, ((1, 99),))])
    table = list(s.requests[1].table)
    out = _run(s, [("abort", 1)])[-1]
    frees = [e for e in out if e[0] == "free"]
    assert frees == [("free", b) for b in (table[1], table[0], table[3], table[2])]


def test_a_later_step_in_flight_does_not_count_as_processed() -> None:
    """Under async scheduling a decode scheduled before the prefill commits is in flight when
    the request finishes there: its token is not processed, the prefill's are (vLLM drains the
    committing step's share first), so the same two blocks are trimmed."""
    s = initial_state(_config(trim_at_finish=True, depth=2, async_scheduling=True))
    _run(s, [("arrive", 1, PROMPT, 1, 0), ("begin", 0), ("schedule", 1, 14, 0), ("submit", 0)])
    _run(s, [("begin", 1), ("schedule", 1, 1, 0), ("submit", 1), ("execute", 0, ())])
    table = list(s.requests[1].table)
    out = _run(s, [("commit", 0, ((1, 99),))])[-1]
    frees = [e for e in out if e[0] == "free"]
    assert frees[:2] == [("free", table[1]), ("free", table[0])]


def test_the_field_needs_a_window() -> None:
    with pytest.raises(ValueError, match="trim_at_finish"):
        _config(sliding_window=None, trim_at_finish=True)
