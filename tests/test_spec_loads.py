"""External KV loads in the spec, the two kinds vLLM's connector API has: an asynchronous load
(``schedule`` with loaded blocks and no tokens: the request waits for the step's commit, and the
load may fail) and a synchronous one (loaded blocks and tokens computed after them in the same
step: landed before the forward pass reads it, never failing); and when an asynchronous load's
blocks are registered (``Config.delay_load_registration``: at the load, or when the request is
next scheduled, as vLLM's ``delay_cache_blocks`` does). The invariants catch an engine that
lets a block be hit before its load has landed."""

from __future__ import annotations

import pytest

from kvspec.spec import INVARIANTS, Config, Illegal, apply, initial_state
from kvspec.spec.state import State

PROMPT = (1, 2, 3, 4, 5)
"""Five tokens in blocks of 2: two full blocks may be loaded, the fifth token is computed."""


def run(config: Config, decisions: list[tuple[object, ...]]) -> tuple[State, list[object]]:
    """Apply the decisions; the state and every effect, in order."""
    s = initial_state(config)
    effects: list[object] = []
    for decision in decisions:
        effects += apply(s, decision)
    return s, effects


def violations(s: State) -> list[str]:
    return [name for name, check in INVARIANTS.items() if check(s) is not None]


def config(delay: bool = False, depth: int = 1) -> Config:
    return Config(
        num_blocks=8,
        block_size=2,
        depth=depth,
        policy="eager-unsafe",
        discipline="general",
        delay_load_registration=delay,
    )


def test_a_synchronous_load_computes_the_rest_of_the_prompt_in_its_step() -> None:
    s, effects = run(
        config(),
        [
            ("arrive", 0, PROMPT, 2, 0),
            ("begin", 0),
            ("schedule", 0, 1, 2),  # two blocks loaded, the fifth token computed after them
        ],
    )
    entry = s.steps[0].entries[0]
    assert (entry.start, entry.end, entry.load, entry.samples, entry.loaded) == (
        0,
        5,
        False,
        True,
        2,
    )
    assert s.steps[0].budget_used == 1  # only the computed token counts
    assert s.requests[0].loading is None  # nothing to wait for
    assert [e for e in effects if e[0] == "publish"] == [("publish", 0, 0, 1), ("publish", 0, 1, 2)]
    for decision in [("submit", 0), ("execute", 0, ()), ("commit", 0, ((0, 7),))]:
        apply(s, decision)
    assert s.requests[0].tokens == [*PROMPT, 7] and not violations(s)


def test_a_synchronous_load_never_fails_and_returns_only_its_tokens_to_the_budget() -> None:
    s, _ = run(config(), [("arrive", 0, PROMPT, 2, 0), ("begin", 0), ("schedule", 0, 1, 2)])
    apply(s, ("preempt", 0))  # withdrawn from the building step
    assert s.steps[0].budget_used == 0
    s, _ = run(
        config(),
        [("arrive", 0, PROMPT, 2, 0), ("begin", 0), ("schedule", 0, 1, 2), ("submit", 0)],
    )
    with pytest.raises(Illegal, match="only external loads can fail"):
        apply(s, ("execute", 0, (0,)))


def test_neither_tokens_nor_blocks_is_still_illegal() -> None:
    s, _ = run(config(), [("arrive", 0, PROMPT, 2, 0), ("begin", 0)])
    with pytest.raises(Illegal, match="either compute tokens"):
        apply(s, ("schedule", 0, 0, 0))
    with pytest.raises(Illegal, match="last known token must be computed"):
        apply(s, ("schedule", 0, 1, 3))  # three blocks would hold the last token


def test_a_delayed_registration_publishes_the_loaded_blocks_at_the_next_schedule() -> None:
    s, effects = run(
        config(delay=True),
        [
            ("arrive", 0, PROMPT, 2, 0),
            ("begin", 0),
            ("schedule", 0, 0, 2),  # an asynchronous load: nothing published yet
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ()),
        ],
    )
    assert not [e for e in effects if e[0] == "publish"] and not s.index
    later = []
    for decision in [("begin", 1), ("schedule", 0, 1, 0)]:
        later += apply(s, decision)
    assert [e for e in later if e[0] == "publish"] == [("publish", 0, 0, 1), ("publish", 0, 1, 2)]
    assert not violations(s)


HIT_BEFORE_LANDING = [
    ("arrive", 0, PROMPT, 2, 0),
    ("arrive", 1, (1, 2, 3, 4, 9), 2, 0),
    ("begin", 0),
    ("schedule", 0, 0, 2),  # r0 loads two blocks asynchronously
    ("submit", 0),
    ("begin", 1),
    ("schedule", 1, 1, 0),  # r1 is admitted while the load is in flight
    ("submit", 1),
    ("execute", 0, (0,)),  # the load fails
    ("execute", 1, ()),
]


def test_a_block_hit_before_its_load_has_landed_is_caught() -> None:
    """An engine that publishes an asynchronous load's blocks at the load (eager registration, as
    vLLM without ``delay_cache_blocks``) lets r1 hit them while the load is in flight; the load
    fails and r1's step reads garbage: NoUnwrittenRead. Registered when r0 is next scheduled
    (vLLM's way), r1 misses them, computes its first token instead, and everything holds."""
    s, effects = run(config(depth=2), HIT_BEFORE_LANDING)
    assert ("hit", 1, (1, 2)) in effects
    assert "NoUnwrittenRead" in violations(s)
    s, effects = run(config(delay=True, depth=2), HIT_BEFORE_LANDING)
    assert ("hit", 1, ()) in effects
    assert not violations(s)
    done = apply(s, ("commit", 0, ()))
    assert ("load_failed", 0) in done and s.requests[0].status == "waiting"  # recomputed
    assert not violations(s)


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted", "eager-unsafe"])
def test_a_block_loaded_whole_may_be_shared_before_its_last_token_is_recomputed(
    policy: str,
) -> None:
    """r0's whole-prompt load lands and is published (at its commit, or at once when eager); the
    next step admits r1 first, which hits both loaded blocks while r0's computed tokens still stop
    one short of them. The loaded bytes hold the whole prefix and r0's recomputation writes the
    same K/V, so the sharing is sound and every invariant holds (``Request.loaded_last``, counted
    as full by ``SharedImpliesSamePrefix``); without that flag the same state is the violation
    the spec reported for every policy until 2026-12-03. After r0's recomputation the flag is
    gone and the block is full by its computed tokens."""
    cfg = Config(num_blocks=8, block_size=2, depth=1, policy=policy, discipline="general")
    s, effects = run(
        cfg,
        [
            ("arrive", 0, (1, 2, 3, 4), 2, 0),
            ("arrive", 1, (1, 2, 3, 4, 5), 2, 0),
            ("begin", 0),
            ("schedule", 0, 0, 2),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ()),
            ("begin", 1),
            ("schedule", 1, 1, 0),
        ],
    )
    r0 = s.requests[0]
    assert ("hit", 1, (1, 2)) in effects and (r0.computed, r0.loaded_last) == (3, True)
    assert not violations(s)
    r0.loaded_last = False
    assert violations(s) == ["SharedImpliesSamePrefix"]
    r0.loaded_last = True
    for decision in [("schedule", 0, 1, 0), ("submit", 1), ("execute", 1, ())]:
        apply(s, decision)
    assert (r0.computed, r0.loaded_last) == (4, False) and not violations(s)
    apply(s, ("commit", 1, ((0, 7), (1, 8))))
    assert not violations(s)


def test_an_asynchronous_load_may_end_at_the_last_token_which_is_then_recomputed() -> None:
    """vLLM's whole-prompt load (the decode side of prefill/decode disaggregation): a prompt of
    whole blocks loaded entirely; its request computes one token short of the load and, next
    scheduled, recomputes the last token over the loaded block, then samples. A synchronous
    load, or blocks of one token, may not end there."""
    whole = (1, 2, 3, 4)
    s, effects = run(
        config(delay=True),
        [
            ("arrive", 0, whole, 2, 0),
            ("begin", 0),
            ("schedule", 0, 0, 2),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ()),
        ],
    )
    assert s.requests[0].computed == 3 and len(s.requests[0].table) == 2 and not violations(s)
    later = []
    for decision in [("begin", 1), ("schedule", 0, 1, 0), ("submit", 1), ("execute", 1, ())]:
        later += apply(s, decision)
    entry = s.steps[0].entries[0]
    assert (entry.start, entry.end, entry.samples) == (3, 4, True)
    assert [e for e in later if e[0] == "publish"] == [("publish", 0, 0, 1), ("publish", 0, 1, 2)]
    assert not [e for e in later if e[0] == "alloc"] and not violations(s)
    apply(s, ("commit", 1, ((0, 7),)))
    assert s.requests[0].tokens == [*whole, 7] and not violations(s)
    for cfg, decision in (
        (config(), ("schedule", 0, 1, 2)),  # synchronous: the last token computed, not loaded
        (Config(8, 1, discipline="general"), ("schedule", 0, 0, 4)),  # blocks of one token
    ):
        s, _ = run(cfg, [("arrive", 0, whole, 2, 0), ("begin", 0)])
        with pytest.raises(Illegal, match="last known token must be computed"):
            apply(s, decision)
