"""Async scheduling in the spec: placeholder tokens, their resolution at commit, discarded samples
as garbage, stale output dropped or delivered, a request finishing while a later step holds it, and
registration capped at the known tokens (docs/model.md, "Async scheduling")."""

from __future__ import annotations

import pytest

from kvspec.spec import Config, Illegal, Placeholder, apply, check, initial_state
from kvspec.spec.observed import engine_effect
from kvspec.spec.state import State


def run(config: Config, *decisions: tuple[object, ...]) -> tuple[State, list[tuple[object, ...]]]:
    s = initial_state(config)
    effects: list[tuple[object, ...]] = []
    for decision in decisions:
        effects += apply(s, decision)
        assert check(s) is None, (decision, check(s))
    return s, effects


def cfg(**kw: object) -> Config:
    base: dict[str, object] = dict(
        num_blocks=8, block_size=2, depth=2, policy="deferred", async_scheduling=True
    )
    base.update(kw)
    return Config(**base)  # type: ignore[arg-type]


PREFILL = (("arrive", 0, (1, 2, 3), 4, 0), ("begin", 0), ("schedule", 0, 3, 0), ("submit", 0))
"""r0's prompt of 3 tokens computed in step 0, which samples its 4th token (position 3)."""


def test_a_decode_is_scheduled_on_the_placeholder_and_resolved_at_commit() -> None:
    s, _ = run(cfg(), *PREFILL, ("begin", 1), ("schedule", 0, 1, 0))
    second = s.requests[0].table[1]
    assert s.blocks[second].pending[-1].prefix == (1, 2, 3, Placeholder(0, 0))
    assert s.ahead(s.requests[0]) == [1, 2, 3, Placeholder(0, 0), Placeholder(1, 0)]
    s, _ = run(
        cfg(),
        *PREFILL,
        ("begin", 1),
        ("schedule", 0, 1, 0),
        ("submit", 1),
        ("execute", 0, ()),
        ("execute", 1, ()),
        ("commit", 0, ((0, 7),)),
    )
    assert s.blocks[second].written == (1, 2, 3, 7)  # resolved in the bytes step 1 wrote
    assert s.ahead(s.requests[0]) == [1, 2, 3, 7, Placeholder(1, 0)]


def test_without_async_scheduling_the_placeholder_is_refused() -> None:
    s, _ = run(Config(num_blocks=8, block_size=2, depth=2), *PREFILL, ("begin", 1))
    with pytest.raises(Illegal, match="token 3 is not known yet"):
        apply(s, ("schedule", 0, 1, 0))


def test_a_discarded_sample_leaves_its_placeholder_as_garbage() -> None:
    """Depth 3: steps 0 (prefill) and 1 (the placeholder decode) are submitted when r0 is
    preempted (fcfs, drop): step 1 still writes the placeholder, which nothing resolves; an engine
    that publishes that block for a request whose tokens are 1, 2, 3, 7 publishes garbage."""
    s, _ = run(
        cfg(depth=3, policy="engine-registers"),
        *PREFILL,
        ("begin", 1),
        ("schedule", 0, 1, 0),
        ("submit", 1),
        ("begin", 2),
        ("preempt", 0),
        ("submit", 2),
        ("execute", 0, ()),
        ("execute", 1, ()),
        ("commit", 0, ()),  # r0's sample is stale: dropped
        ("commit", 1, ()),
        ("execute", 2, ()),
        ("commit", 2, ()),
        ("arrive", 1, (1, 2, 3, 7, 1), 1, 0),
    )
    old = next(b for b, blk in enumerate(s.blocks) if blk.written == (1, 2, 3, Placeholder(0, 0)))
    engine_effect(s, ("publish", 1, 1, old))
    violation = check(s)
    assert violation is not None and violation.invariant == "NoUnwrittenPublish"
    assert violation.blocks == (old,)


def test_stale_output_delivered_to_a_preempted_request() -> None:
    """vLLM's default: the token a submitted step samples for a request preempted since is still
    appended when the step commits, and the request is not admitted again until then."""
    config = cfg(depth=2, async_scheduling=False, stale_output="deliver", preemption="fcfs")
    s, _ = run(config, *PREFILL, ("begin", 1), ("preempt", 0))
    with pytest.raises(Illegal, match="stale output"):
        apply(s, ("schedule", 0, 3, 0))
    s, effects = run(
        config,
        *PREFILL,
        ("begin", 1),
        ("preempt", 0),
        ("submit", 1),
        ("execute", 0, ()),
        ("commit", 0, ((0, 7),)),
    )
    assert s.requests[0].tokens == [1, 2, 3, 7] and s.requests[0].status == "waiting"
    apply(s, ("begin", 2))
    apply(s, ("schedule", 0, 4, 0))  # admissible now: its stale output is in
    assert check(s) is None


def test_stale_output_dropped_by_default() -> None:
    s, _ = run(cfg(depth=2), *PREFILL, ("begin", 1), ("preempt", 0), ("submit", 1))
    apply(s, ("execute", 0, ()))
    with pytest.raises(Illegal, match="expected"):
        apply(s, ("commit", 0, ((0, 7),)))
    apply(s, ("commit", 0, ()))
    assert s.requests[0].tokens == [1, 2, 3]


def test_a_delivered_stop_token_finishes_the_waiting_request() -> None:
    config = cfg(depth=2, stale_output="deliver", stop_token=0)
    s, effects = run(
        config,
        *PREFILL,
        ("begin", 1),
        ("preempt", 0),
        ("submit", 1),
        ("execute", 0, ()),
        ("commit", 0, ((0, 0),)),
    )
    assert s.requests[0].status == "finished" and 0 not in s.waiting
    assert effects[-1] == ("finish", 0, "stop")


def test_a_request_finishing_while_a_later_step_holds_it_leaves_that_step() -> None:
    decisions = (*PREFILL, ("begin", 1), ("schedule", 0, 1, 0), ("submit", 1))
    s, _ = run(cfg(stop_token=0), *decisions, ("execute", 0, ()), ("commit", 0, ((0, 0),)))
    assert s.requests[0].status == "finished" and 0 not in s.steps[0].live
    apply(s, ("execute", 1, ()))
    with pytest.raises(Illegal, match="expected"):
        apply(s, ("commit", 1, ((0, 5),)))
    apply(s, ("commit", 1, ()))
    assert check(s) is None


def test_a_request_finishing_while_a_later_step_holds_it_drops_that_steps_hidden_entries() -> None:
    """hide-uncommitted, depth 3 (found by the reference engine's async runs): step 3 hides r0's
    block 3 (its token became known at step 0's commit); r0 finishes at step 1's commit while
    steps 2 and 3 hold it. Step 3's commit must not publish from the finished request's table."""
    decisions = (
        ("arrive", 0, (1, 2, 3), 10, 0),
        *(
            d
            for i in range(3)
            for d in (("begin", i), ("schedule", 0, 3 if i == 0 else 1, 0), ("submit", i))
        ),
        ("execute", 0, ()),
        ("commit", 0, ((0, 5),)),
        ("begin", 3),
        ("schedule", 0, 1, 0),
        ("submit", 3),
        ("execute", 1, ()),
        ("commit", 1, ((0, 0),)),  # the stop token: r0 finishes while steps 2 and 3 hold it
    )
    config = cfg(num_blocks=10, block_size=1, depth=3, policy="hide-uncommitted", stop_token=0)
    s, _ = run(config, *decisions)
    assert s.requests[0].status == "finished"
    assert all(0 not in st.registrations for st in s.steps)
    _, effects = run(config, *decisions, ("execute", 2, ()), ("commit", 2, ()), ("execute", 3, ()), ("commit", 3, ()))  # fmt: skip
    assert not any(e[0] == "publish" and e[3] == 3 for e in effects[-4:])


def test_registration_waits_for_known_tokens_and_comes_at_commit() -> None:
    """Eager registration at schedule stops at the known tokens; the block a placeholder decode
    completes is registered when the step that wrote it commits (vLLM's post-output
    cache_blocks)."""
    config = cfg(depth=3, policy="eager-unsafe")
    decisions = (
        *PREFILL,
        ("begin", 1),
        ("schedule", 0, 1, 0),  # position 3: block 1 full, but its last token is a placeholder
        ("submit", 1),
        ("begin", 2),
        ("schedule", 0, 1, 0),  # position 4
        ("submit", 2),
        ("execute", 0, ()),
        ("commit", 0, ((0, 5),)),
        ("execute", 1, ()),
    )
    s, effects = run(config, *decisions)
    table = s.requests[0].table
    assert [e for e in effects if e[0] == "publish"] == [("publish", 0, 0, table[0])]
    effects = apply(s, ("commit", 1, ((0, 6),)))
    assert ("publish", 0, 1, table[1]) in effects  # written by step 1, registered at its commit
    assert check(s) is None


def test_the_synchronous_cells_keep_their_meaning() -> None:
    """With async scheduling off nothing is registered at commit beyond what the policies did
    before: the eager policies' publications all come at schedule time."""
    config = Config(num_blocks=8, block_size=2, depth=2, policy="eager-unsafe")
    decisions = (*PREFILL, ("execute", 0, ()), ("commit", 0, ((0, 5),)), ("begin", 1))
    s, effects = run(config, *decisions, ("schedule", 0, 1, 0), ("submit", 1), ("execute", 1, ()))
    assert all(e[0] != "publish" for e in apply(s, ("commit", 1, ((0, 6),))))
