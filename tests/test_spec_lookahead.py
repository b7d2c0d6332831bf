"""The spec's lookahead hashing (``Config.hash_lookahead``; ``docs/model.md``, "Lookahead
hashing"): a block's key names the tokens after it, so the block is published only once they
are known and hit only by a request that has them too; its ``NoUnwrittenPublish`` reads the
key less the lookahead. Every other form refuses it by name (``tests/test_twins.py``)."""

from __future__ import annotations

import pytest

from kvspec import twins
from kvspec.conformance.adapter import ReferenceAdapter
from kvspec.reference.choices import DefaultChoices
from kvspec.spec import INVARIANTS, Config, apply, initial_state
from kvspec.spec.state import Group

PROMPT = (1, 2, 3, 4)
"""Four tokens in blocks of 2: block [3, 4) waits for the token after it."""


def run(config: Config, second: tuple[int, ...]) -> tuple[list[list[object]], object]:
    """Request 0 (``PROMPT``) prefilled, its first token 9 committed, scheduled again; then
    request 1 (``second``) admitted. Each decision's effects, and the state."""
    s = initial_state(config)
    effects = []
    for decision in [
        ("arrive", 0, PROMPT, 3, 0),
        ("begin", 0),
        ("schedule", 0, 4, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ((0, 9),)),
        ("begin", 1),
        ("schedule", 0, 1, 0),
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, ((0, 8),)),
        ("arrive", 1, second, 1, 0),
        ("begin", 2),
        ("schedule", 1, 1, 0),
    ]:
        effects.append(apply(s, decision))
        for name, invariant in INVARIANTS.items():
            assert invariant(s) is None, (name, decision)
    return effects, s


def publishes(effects: list[object]) -> list[int]:
    return [e[2] for e in effects if e[0] == "publish"]  # type: ignore[index]


def test_a_block_is_published_once_the_token_after_it_is_known() -> None:
    plain, _ = run(Config(12, 2, policy="eager-unsafe"), (1, 2, 3, 4, 9, 5))
    assert publishes(plain[2]) == [0, 1]  # both prompt blocks at the prefill
    ahead, _ = run(Config(12, 2, policy="eager-unsafe", hash_lookahead=1), (1, 2, 3, 4, 9, 5))
    assert publishes(ahead[2]) == [0]  # block [3, 4) waits for 9
    assert publishes(ahead[7]) == [1]  # ... published by the next schedule after 9 is known


def test_a_hit_needs_the_tokens_after_each_block() -> None:
    same, _ = run(Config(12, 2, policy="eager-unsafe", hash_lookahead=1), (1, 2, 3, 4, 9, 5))
    assert same[-1][0][:3] == ("hit", 1, (1, 2))
    other, _ = run(Config(12, 2, policy="eager-unsafe", hash_lookahead=1), (1, 2, 3, 4, 7, 5))
    assert other[-1][0][:3] == ("hit", 1, (1,))  # block [3, 4) was keyed with 9 after it
    plain, _ = run(Config(12, 2, policy="eager-unsafe"), (1, 2, 3, 4, 7, 5))
    assert plain[-1][0][:3] == ("hit", 1, (1, 2))


def test_the_lookahead_is_validated_and_refused_elsewhere() -> None:
    with pytest.raises(ValueError, match="hash_lookahead must be an integer >= 0"):
        Config(8, 2, hash_lookahead=-1)
    with pytest.raises(ValueError, match="one group only"):
        Config(8, 2, hash_lookahead=1, groups=(Group("full", 2), Group("window", 2, 4)))
    with pytest.raises(twins.NotFollowed, match="hash_lookahead"):
        ReferenceAdapter(Config(8, 2, hash_lookahead=1), DefaultChoices())
