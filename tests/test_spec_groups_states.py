"""A state group's registration rule (``Group.registers``, issue #36): ``at-its-step`` (only the
step ending at a boundary registers the state there) and ``when-known`` (vLLM's ``align``
``MambaManager``: a slot is registered as a full block is, once the known tokens reach its
boundary, at any later schedule or commit). Under async scheduling ``when-known`` registers
the state of a step that ended at a boundary on a placeholder at the request's next schedule,
as vLLM does; with prefill chunks that leave a slot inside a block and cross its boundary
next, it registers a state computed elsewhere, named by ``StateAtItsBoundary``. The rule is
validated and carried by the trace header."""

from __future__ import annotations

import json

import pytest

from kvspec.conformance import trace
from kvspec.spec import Config, apply, check, initial_state
from kvspec.spec.state import Group, State

Event = tuple[object, ...]


def _config(rule: str | None, block: int = 2, **kw: object) -> Config:
    groups = (Group("full", block), Group("state", block, registers=rule))
    base: dict[str, object] = dict(num_blocks=24, block_size=block, groups=groups)
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def _run(s: State, events: list[Event]) -> tuple[list[Event], str | None]:
    """Apply each decision; the effects, and the first invariant broken (None: all hold)."""
    out: list[Event] = []
    for event in events:
        out += apply(s, event)
        violation = check(s)
        if violation is not None:
            return out, violation.invariant
    return out, None


def _states(effects: list[Event]) -> list[Event]:
    return [e for e in effects if e[0] == "publish" and len(e) == 5]


# r0, prompt of 3 tokens at block size 2, async at depth 2: step 1 ends at 4 on a placeholder
ASYNC_HEAD: list[Event] = [
    ("arrive", 0, (1, 2, 3), 4, 0),
    ("begin", 0),
    ("schedule", 0, 3, 0),
    ("submit", 0),
    ("begin", 1),
    ("schedule", 0, 1, 0),
    ("submit", 1),
    ("execute", 0, ()),
    ("commit", 0, ((0, 7),)),
    ("begin", 2),
]


@pytest.mark.parametrize("policy", ["eager-unsafe", "eager-rollback-fifo", "hide-uncommitted"])
def test_when_known_registers_a_placeholder_boundary_state_at_the_next_schedule(
    policy: str,
) -> None:
    """Step 1 ends at the boundary 4 on a placeholder (token 3 is sampled by step 0): nothing
    can be registered at its schedule. At step 2's schedule the known tokens reach 4:
    ``when-known`` registers the state slot 1, whose writer (step 1) is submitted, as vLLM's
    ``cache_blocks`` does inside ``allocate_slots``; ``at-its-step`` never does (the request's
    count of registered slots passed 4 at that schedule). Every invariant holds throughout."""
    cfg = dict(policy=policy, depth=2, async_scheduling=True)
    tail: list[Event] = [
        ("submit", 2),
        ("execute", 1, ()),
        ("commit", 1, ((0, 8),)),
        ("execute", 2, ()),
        ("commit", 2, ((0, 9),)),
    ]
    s = initial_state(_config("when-known", **cfg))
    head, broken = _run(s, ASYNC_HEAD)
    assert broken is None and _states(head) == []
    at_schedule, broken = _run(s, [("schedule", 0, 1, 0)])
    slot = s.requests[0].group_tables[0][1]
    eager = policy.startswith("eager")
    assert _states(at_schedule) == ([("publish", 0, 1, slot, 1)] if eager else [])
    rest, broken = _run(s, tail)
    assert broken is None
    assert _states(rest) == ([] if eager else [("publish", 0, 1, slot, 1)])  # hidden: at written
    assert s.index_of(1).get((1, 2, 3, 7)) == [slot]

    t = initial_state(_config(None, **cfg))
    effects, broken = _run(t, [*ASYNC_HEAD, ("schedule", 0, 1, 0), *tail])
    assert broken is None and _states(effects) == []
    assert (1, 2, 3, 7) not in t.index_of(1)


def _two_chunks(first: int) -> list[Event]:
    """r1's 13-token prompt in two chunks at block size 4, synchronously."""
    prompt = tuple(range(1, 14))
    return [
        ("arrive", 1, prompt, 2, 0),
        ("begin", 0),
        ("schedule", 1, first, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ()),
        ("begin", 1),
        ("schedule", 1, len(prompt) - first, 0),
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, ((1, 50),)),
    ]


@pytest.mark.parametrize("policy", ["deferred", "eager-unsafe"])
def test_when_known_after_a_chunk_inside_a_block_is_state_at_its_boundary(policy: str) -> None:
    """A first chunk of 6 tokens leaves the state after 6 in slot 1; the next chunk crosses 8
    without ending there, so the slot never holds the state after 8. ``when-known`` registers
    it under the 8-token key (vLLM's scheduler never splits so: ``_mamba_block_aligned_split``):
    StateAtItsBoundary. ``at-its-step`` registers nothing there and holds; an aligned first
    chunk (8 tokens) holds under both rules, its state at 8 registered."""
    s = initial_state(_config("when-known", block=4, policy=policy))
    effects, broken = _run(s, _two_chunks(6))
    assert broken == "StateAtItsBoundary", effects
    assert _run(initial_state(_config(None, block=4, policy=policy)), _two_chunks(6))[1] is None
    for rule in (None, "when-known"):
        t = initial_state(_config(rule, block=4, policy=policy))
        effects, broken = _run(t, _two_chunks(8))
        assert broken is None
        assert [e[2] for e in _states(effects)] == [1]


def test_when_known_registers_a_decode_boundary_like_at_its_step_when_synchronous() -> None:
    """Synchronously a step's tokens are known when it is scheduled: a decode ending at the
    boundary 8 registers its state at its schedule under both rules, with the same effects."""
    prompt = tuple(range(1, 8))  # 7 tokens: the first decode ends at 8
    events: list[Event] = [
        ("arrive", 1, prompt, 3, 0),
        ("begin", 0),
        ("schedule", 1, 7, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ((1, 50),)),
        ("begin", 1),
        ("schedule", 1, 1, 0),
    ]
    got = []
    for rule in (None, "when-known"):
        s = initial_state(_config(rule, block=4, policy="eager-unsafe"))
        effects, broken = _run(s, events)
        assert broken is None
        got.append(effects)
    assert got[0] == got[1] and [e[2] for e in _states(got[0])] == [1]


def test_a_same_step_hit_of_a_when_known_state_is_an_unwritten_state_read() -> None:
    """r1's step ends at 8 and registers its state there at schedule; r2, sharing the 8
    tokens, admitted in the same step, starts from that state before the step writes it:
    NoUnwrittenStateRead (vLLM defers such an admission: ``cached_blocks_this_step``)."""
    prefix = tuple(range(1, 9))
    s = initial_state(_config("when-known", block=4, policy="eager-unsafe"))
    events: list[Event] = [
        ("arrive", 1, (*prefix, 20), 2, 0),
        ("arrive", 2, (*prefix, 30), 2, 0),
        ("begin", 0),
        ("schedule", 1, 8, 0),
        ("schedule", 2, 1, 0),
        ("submit", 0),
        ("execute", 0, ()),
    ]
    effects, broken = _run(s, events)
    assert broken == "NoUnwrittenStateRead", effects


def test_the_registration_rule_is_validated_and_carried_by_the_header(tmp_path) -> None:
    with pytest.raises(ValueError, match="only a state group"):
        Config(8, 4, groups=(Group("full", 4, registers="when-known"), Group("state", 4)))
    with pytest.raises(ValueError, match="unknown state registration"):
        Config(8, 4, groups=(Group("full", 4), Group("state", 4, registers="later")))
    config = _config("when-known", block=4)
    path = tmp_path / "t.jsonl"
    trace.write_trace(path, config, [("arrive", 0, (1, 2, 3), 1, 0)])
    groups = json.loads(path.read_text().splitlines()[0])["model"]["groups"]
    assert groups[1] == {
        "kind": "state",
        "block_size": 4,
        "window": None,
        "registers": "when-known",
    }
    assert "registers" not in groups[0]
    assert trace.read_trace(path)[0] == config
    plain = tmp_path / "p.jsonl"
    trace.write_trace(plain, _config(None, block=4), [("arrive", 0, (1, 2, 3), 1, 0)])
    assert "registers" not in plain.read_text()


def test_a_trim_frees_the_skipped_state_before_a_preemption_and_the_schedule_none() -> None:
    """vLLM's ``allocate_slots`` frees a state group's state two boundaries back, then finds no
    room and preempts: ``trim`` is that first part. r1 (state slots at 4 and 8 after two
    steps) is trimmed in step 2: the slot at 4 is freed and nulled, before r1's schedule, which
    then frees nothing more; its effects are the schedule's without the trim's frees. Illegal
    without a window or groups, and for a request already scheduled in the building step."""
    prompt = tuple(range(1, 14))
    events: list[Event] = [
        ("arrive", 1, prompt, 3, 0),
        ("begin", 0),
        ("schedule", 1, 4, 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ()),
        ("begin", 1),
        ("schedule", 1, 4, 0),
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, ()),
        ("begin", 2),
    ]
    plain = initial_state(_config(None, block=4, policy="deferred"))
    trimmed = initial_state(_config(None, block=4, policy="deferred"))
    for s in (plain, trimmed):
        assert _run(s, events)[1] is None
    first = trimmed.requests[1].group_tables[0][0]
    freed, broken = _run(trimmed, [("trim", 1)])
    assert broken is None and freed == [("free", first)]
    assert trimmed.requests[1].group_tables[0][0] == 0 and trimmed.free[-1] == first
    after_trim, _ = _run(trimmed, [("schedule", 1, 4, 0)])
    at_once, _ = _run(plain, [("schedule", 1, 4, 0)])
    assert at_once == freed + after_trim
    assert trimmed.free == plain.free
    with pytest.raises(Exception, match="already scheduled"):
        apply(trimmed, ("trim", 1))
    one = initial_state(Config(num_blocks=8, block_size=4, policy="deferred"))
    _run(one, events[:3])
    with pytest.raises(Exception, match="no window or state group"):
        apply(one, ("trim", 1))
