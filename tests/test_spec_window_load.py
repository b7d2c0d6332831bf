"""``WindowLoad``: a synchronous KV load at an admission under a sliding window
(``Config.sliding_window``), as vLLM's ``SlidingWindowManager`` makes it. The hits and the
loaded blocks count as computed at once, so the positions wholly before the window of the token
after all of them hold the null block: a hit there is not touched, a loaded block there is
neither allocated nor loaded, and the step reads from the window of its first computed token.
An asynchronous load under a window stays outside the model (``Illegal``, refused by name by
the vLLM adapter). Each test below fails with the rule undone (``spec_actions.window_head``
returning the hits alone: the loaded positions get blocks, and the table holds no null)."""

from __future__ import annotations

import pytest
from window_cases import PROMPT
from window_cases import run_checked as _run
from window_cases import window_config as _config

from kvspec.spec import Illegal, apply, initial_state
from kvspec.spec.state import NULL_BLOCK


def test_a_load_before_the_window_leaves_its_position_null() -> None:
    """Two loaded blocks (8 tokens) and 6 computed: (8 - 4 + 1) // 4 = 1 position is before
    the window of token 8, so it holds the null block and only three blocks are allocated;
    the step writes positions 1 .. 3 and reads from position 1, and every invariant holds."""
    s = initial_state(_config())
    out = _run(s, [("arrive", 1, PROMPT, 3, 0), ("begin", 0), ("schedule", 1, 6, 2)])
    table = list(s.requests[1].table)
    assert table[0] == NULL_BLOCK and NULL_BLOCK not in table[1:] and len(table) == 4
    assert sum(1 for e in out[-1] if e[0] == "alloc") == 3
    _run(s, [("submit", 0), ("execute", 0, ()), ("commit", 0, ((1, 99),))])
    assert s.bad_reads == []
    # the next schedule frees what the window left behind: (14 - 4 + 1) // 4 = 2 positions
    freed = _run(s, [("begin", 1), ("schedule", 1, 1, 0)])[-1]
    assert [e for e in freed if e[0] == "free"] == [("free", table[1])]
    assert s.requests[1].table[:2] == [NULL_BLOCK, NULL_BLOCK]


def test_a_load_inside_the_window_is_loaded_whole() -> None:
    """With a window wider than the load (W = 12) no loaded position is skipped: the load
    writes every block, as under full attention."""
    s = initial_state(_config(sliding_window=12))
    _run(s, [("arrive", 1, PROMPT, 3, 0), ("begin", 0), ("schedule", 1, 6, 2)])
    assert NULL_BLOCK not in s.requests[1].table


def test_a_hit_before_the_window_of_the_loaded_tokens_is_not_touched() -> None:
    """A cached block that ends before the window of the token after the hit and the load is
    nulled as well: the window is counted from the loaded tokens' end, not the hit's."""
    s = initial_state(_config())
    first = PROMPT[:9]
    _run(
        s,
        [
            ("arrive", 1, first, 1, 0),
            ("begin", 0),
            ("schedule", 1, 9, 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((1, 99),)),
        ],
    )
    assert s.requests[1].status == "finished"
    cached = [b for b in range(len(s.blocks)) if s.blocks[b].key is not None]
    assert cached, "the first request published its full blocks"
    _run(s, [("arrive", 2, PROMPT, 3, 0), ("begin", 1)])
    out = _run(s, [("schedule", 2, 2, 1)])[-1]  # hits 2 blocks, loads 1: 12 tokens computed
    table = s.requests[2].table
    assert table[:2] == [NULL_BLOCK, NULL_BLOCK]  # (12 - 4 + 1) // 4 = 2: both hits nulled
    hit = next(e for e in out if e[0] == "hit")
    assert all(b == NULL_BLOCK for b in hit[2])


def test_an_asynchronous_load_under_a_window_is_not_modelled() -> None:
    s = initial_state(_config())
    _run(s, [("arrive", 1, PROMPT, 3, 0), ("begin", 0)])
    with pytest.raises(Illegal, match="asynchronous loads under a window"):
        apply(s, ("schedule", 1, 0, 3))
