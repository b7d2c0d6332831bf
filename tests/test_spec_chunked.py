"""Chunked local attention (``Group("chunked", B, chunk=C)``, vLLM's
``ChunkedLocalAttentionManager``): token ``t`` attends to tokens ``(t // C) * C .. t`` only. As
group 0 alone (the layout vLLM's ``test_swa_inflight_window_free.py`` builds) and as a group
beside full attention: a hit of ``L`` tokens needs the blocks of ``L``'s chunk before ``L`` (the
null block before them); a running request's blocks of the whole chunks before the chunk of
its next *processed* token are freed and nulled when it is next scheduled; a step reads its
first token's chunk and its own blocks. The planted bugs (a skipped count one chunk too far, a
hit that nulls its own chunk) are named by ``NoUnwrittenRead`` (group 0) and
``NoReadOfRecycled`` (a later group); random walks hold every invariant; the fast, incremental
and Z3 models refuse the kind by name (the reference engine follows it:
``tests/test_reference_groups.py``)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_spec_groups_rules import _walk

from kvspec.conformance import trace
from kvspec.conformance.check import check_file
from kvspec.conformance.trace import write_trace
from kvspec.spec import Config, apply, check, initial_state
from kvspec.spec import actions as spec_actions
from kvspec.spec import groups as spec_groups
from kvspec.spec import pool as spec_pool
from kvspec.spec.invariants import Violation, running_tables, tables_append_only
from kvspec.spec.state import NULL_BLOCK, Group, State

B, C = 4, 8
CHUNKED = (Group("chunked", B, chunk=C),)
FULL_CHUNKED = (Group("full", B), Group("chunked", B, chunk=C))
PROMPT = tuple(range(1, 11))  # 10 tokens: two full blocks of 4 (one whole chunk) and two

Event = tuple[object, ...]


def _config(groups: tuple[Group, ...] = CHUNKED, **kw: object) -> Config:
    base: dict[str, object] = dict(num_blocks=16, block_size=B, policy="deferred", groups=groups)
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def _run(s: State, events: list[Event]) -> list[list[Event]]:
    """Apply each decision, every invariant (TablesAppendOnly too) checked after it."""
    out = []
    for event in events:
        before = running_tables(s)
        out.append(apply(s, event))
        assert check(s) is None, (event, check(s))
        assert tables_append_only(before, s) is None, event
    return out


IN_FLIGHT = [  # vLLM's test_chunked_local_free_waits_for_in_flight_step, at B = 4, C = 8
    ("arrive", 1, PROMPT, 5, 0),
    ("begin", 0),
    ("schedule", 1, 10, 0),
    ("submit", 0),
    ("begin", 1),
    ("schedule", 1, 1, 0),
    ("submit", 1),
]


def test_the_chunk_is_validated_and_read_per_group() -> None:
    assert _config().chunk == C and _config().local and _config().window is None
    assert _config(FULL_CHUNKED).chunk is None and _config(FULL_CHUNKED).hybrid
    with pytest.raises(ValueError, match="group 0 of several must be full or window"):
        _config((Group("chunked", B, chunk=C), Group("full", B)))
    with pytest.raises(ValueError, match="multiple of its block_size 4"):
        _config((Group("chunked", B, chunk=6),))


def test_async_frees_the_chunks_before_only_once_the_step_reading_them_settles() -> None:
    """vLLM's ``test_chunked_local_free_waits_for_in_flight_step``: the decode scheduled while
    the prefill is in flight frees nothing (processed 10 - 10 = 0); once the prefill commits,
    the next schedule frees the whole chunk before token 10's (blocks 0 and 1: (10 // 8) * 8 /
    4 = 2), last first, and the one after it frees nothing twice."""
    s = initial_state(_config(depth=3, async_scheduling=True, prefix_caching=False))
    _run(s, IN_FLIGHT)
    table = list(s.requests[1].table)
    assert NULL_BLOCK not in table
    _run(s, [("execute", 0, ()), ("commit", 0, ((1, 11),))])
    (_, effects) = _run(s, [("begin", 2), ("schedule", 1, 1, 0)])  # processed 11 - 1 = 10
    assert [e for e in effects if e[0] == "free"] == [("free", table[1]), ("free", table[0])]
    assert s.requests[1].table == [NULL_BLOCK, NULL_BLOCK, table[2]]
    _run(s, [("submit", 2), ("execute", 1, ()), ("commit", 1, ((1, 12),))])
    (_, effects) = _run(s, [("begin", 3), ("schedule", 1, 1, 0)])
    assert not [e for e in effects if e[0] == "free"]


def _shared_prefix(cfg: Config, prompt: tuple[int, ...], hit: int = 0) -> State:
    """Request 1 computes ``prompt`` past its hit of ``hit`` tokens (its full blocks published
    at commit) and finishes."""
    s = initial_state(cfg)
    _run(
        s,
        [
            ("arrive", 1, prompt, 1, 0),
            ("begin", 0),
            ("schedule", 1, len(prompt) - hit, 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((1, 99),)),
        ],
    )
    return s


def test_a_hit_takes_its_chunk_s_blocks_and_nulls_before_them() -> None:
    """vLLM's hit rule: 15 tokens, B = 4, C = 8: the cap is block 3 (12 tokens), whose chunk
    starts at block 2; the hit is nulls at 0 and 1 (taken as computed: request 1 itself
    computed only tokens 8..14), then block 2 published (12 tokens)."""
    prompt = tuple(range(1, 16))
    s = _shared_prefix(_config(), prompt, hit=8)
    assert prompt[:4] not in s.index and prompt[:8] not in s.index
    published = s.index[prompt[:12]][0]
    (_, _, effects) = _run(s, [("arrive", 2, prompt, 2, 0), ("begin", 1), ("schedule", 2, 3, 0)])
    assert effects[0] == ("hit", 2, (NULL_BLOCK, NULL_BLOCK, published))
    assert s.blocks[published].refcount == 1
    _run(s, [("submit", 1), ("execute", 1, ()), ("commit", 1, ((2, 5),))])


def test_a_hit_at_a_chunk_boundary_needs_nothing_published() -> None:
    """vLLM's docstring example 2: with 17 tokens the cap ends at 16, a chunk boundary: token
    16 attends to itself alone, so the hit is four null blocks (16 tokens) with nothing
    published at all."""
    s = initial_state(_config())
    (_, _, effects) = _run(
        s, [("arrive", 1, tuple(range(1, 18)), 2, 0), ("begin", 0), ("schedule", 1, 1, 0)]
    )
    assert effects[0] == ("hit", 1, (NULL_BLOCK,) * 4)
    assert s.requests[1].computed == 17
    _run(s, [("submit", 0), ("execute", 0, ()), ("commit", 0, ((1, 5),))])


def test_beside_full_attention_the_hit_is_one_length_both_serve() -> None:
    """Full + chunked: a hit of 12 tokens needs blocks 0..2 in the full group and block 2 in
    the chunked one (its chunk 8..15), nulls at 0 and 1."""
    prompt = tuple(range(1, 16))
    s = _shared_prefix(_config(FULL_CHUNKED), prompt)
    (_, _, effects) = _run(s, [("arrive", 2, prompt, 2, 0), ("begin", 1), ("schedule", 2, 3, 0)])
    assert effects[0][2] == tuple(s.index[prompt[: 4 * (i + 1)]][0] for i in range(3))
    chunked = effects[1]
    assert chunked[0] == "hit" and chunked[-1] == 1
    assert chunked[2][:2] == (NULL_BLOCK, NULL_BLOCK) and NULL_BLOCK not in chunked[2][2:]
    _run(s, [("submit", 1), ("execute", 1, ()), ("commit", 1, ((2, 5),))])


def test_beside_full_attention_the_chunked_group_frees_after_its_step_settles() -> None:
    """Full + chunked, async: the decode scheduled over the prefill in flight frees nothing;
    the schedule after the prefill's commit frees the chunked group's blocks 0 and 1 only."""
    s = initial_state(_config(FULL_CHUNKED, depth=3, async_scheduling=True))
    _run(s, IN_FLIGHT)
    full, chunked = list(s.requests[1].table), list(s.requests[1].group_tables[0])
    _run(s, [("execute", 0, ()), ("commit", 0, ((1, 11),))])
    (_, effects) = _run(s, [("begin", 2), ("schedule", 1, 1, 0)])
    assert [e for e in effects if e[0] == "free"] == [("free", chunked[1]), ("free", chunked[0])]
    assert s.requests[1].table == full and s.requests[1].group_tables[0][:2] == [0, 0]


# -- planted bugs ------------------------------------------------------------------------------


def _first_violation(cfg: Config, events: list[Event]) -> Violation | None:
    s = initial_state(cfg)
    found = None
    for event in events:
        apply(s, event)
        found = found or check(s)
    return found


def test_planted_skip_one_chunk_too_far_is_named_by_no_unwritten_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A skipped count one chunk past vLLM's (``(processed // C + 1) * C``): the decode
    scheduled over the prefill in flight (processed 0) already frees blocks 0 and 1, which the
    prefill (step 0) writes and its later tokens read. The spec's own rule holds on the whole
    scenario (checked first); the planted one is named at that schedule."""
    events = [*IN_FLIGHT, ("execute", 0, ()), ("commit", 0, ((1, 11),)), ("begin", 2)]
    cfg = _config(depth=3, async_scheduling=True, prefix_caching=False)
    _run(initial_state(cfg), [*events, ("schedule", 1, 1, 0)])
    real = spec_actions.remove_skipped
    monkeypatch.setattr(spec_actions, "remove_skipped", lambda s, req, n: real(s, req, n + C))
    found = _first_violation(cfg, [*events, ("schedule", 1, 1, 0)])
    assert found is not None and found.invariant == "NoUnwrittenRead", found
    assert found.step == 0 and "skipped it" in found.sentence


def test_planted_hit_that_nulls_its_own_chunk_is_named_by_no_unwritten_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup that takes the chunk of the cap's end as skipped too (every position null):
    the step from 12 reads position 2 of its chunk, which holds the null block."""
    prompt = tuple(range(1, 16))
    real = spec_pool.chunk_lookup

    def too_far(s: State, req: object, cap: int) -> list[int]:
        return [NULL_BLOCK] * len(real(s, req, cap))  # type: ignore[arg-type]

    s = _shared_prefix(_config(), prompt, hit=8)
    monkeypatch.setattr(spec_pool, "chunk_lookup", too_far)
    found = None
    for event in [("arrive", 2, prompt, 2, 0), ("begin", 1), ("schedule", 2, 3, 0)]:
        apply(s, event)
        found = found or check(s)
    assert found is not None and found.invariant == "NoUnwrittenRead", found
    assert found.blocks == (NULL_BLOCK,)


def test_planted_group_skip_one_chunk_too_far_is_named_by_no_read_of_recycled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Full + chunked: the chunked group's skipped count one chunk past vLLM's frees that
    group's blocks 0 and 1 at the decode scheduled over the prefill in flight, which writes and
    reads them (``groups.window_blocks_in_flight`` covers chunked groups): ``NoReadOfRecycled``."""
    events = [*IN_FLIGHT, ("execute", 0, ()), ("commit", 0, ((1, 11),)), ("begin", 2)]
    cfg = _config(FULL_CHUNKED, depth=3, async_scheduling=True)
    _run(initial_state(cfg), [*events, ("schedule", 1, 1, 0)])
    real = spec_groups.remove_skipped
    monkeypatch.setattr(spec_groups, "remove_skipped", lambda s, req, n: real(s, req, n + C))
    found = _first_violation(cfg, [*events, ("schedule", 1, 1, 0)])
    assert found is not None and found.invariant == "NoReadOfRecycled", found
    assert found.step == 0 and "group 1 block 0" in found.sentence


def test_undoing_the_chunk_rule_for_the_window_s_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec's rule is the chunk's, not the window's: a spec that skips a chunked group 0's
    blocks as a sliding window of C does (``(processed - C + 1) // B``) frees nothing at step
    2 where vLLM frees blocks 0 and 1 (the count the vLLM test asserts,
    ``NUM_OUT_OF_CHUNK_BLOCKS``): the scenario's frees are no longer the spec's."""
    cfg = _config(depth=3, async_scheduling=True, prefix_caching=False)
    events = [*IN_FLIGHT, ("execute", 0, ()), ("commit", 0, ((1, 11),)), ("begin", 2)]

    def frees(s: State) -> list[Event]:
        for event in events:
            apply(s, event)
        return [e for e in apply(s, ("schedule", 1, 1, 0)) if e[0] == "free"]

    assert len(frees(initial_state(cfg))) == 2
    monkeypatch.setattr(State, "skipped", lambda self, n: max(0, n - C + 1) // B)
    assert frees(initial_state(cfg)) == []


# -- random walks ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted"])
def test_walks_with_a_chunked_group_hold_every_invariant(policy: str) -> None:
    """Random walks of the spec, a chunked group alone and beside full attention, chunks of
    one and two blocks, synchronous and under async scheduling: every state holds every
    invariant and tables change only at their end (or to the null block at a chunked head)."""
    rng = random.Random(43)
    shapes = [
        (Group("chunked", 2, chunk=4),),
        (Group("chunked", 2, chunk=2),),
        (Group("full", 2), Group("chunked", 2, chunk=4)),
        (Group("window", 2, window=3), Group("chunked", 2, chunk=6)),
    ]
    for walk in range(16):
        groups = shapes[walk % len(shapes)]
        async_scheduling = walk % 3 == 2
        config = _config(
            groups,
            block_size=2,
            num_blocks=rng.randrange(10, 24),
            policy=policy,
            depth=2 if async_scheduling else rng.choice((1, 2)),
            async_scheduling=async_scheduling,
            token_budget=rng.choice((6, 16)),
        )
        assert _walk(config, rng)


def test_the_other_forms_refuse_a_chunked_group_by_name() -> None:
    """Declared in kvspec/twins.py: the fast model, the incremental checks and the Z3 model
    refuse ``chunked_local`` by name; the judge falls back to the spec's full definitions. The
    reference engine follows it (``tests/test_reference_groups.py``, lockstep): its
    configuration carries the chunk."""
    from kvspec.conformance.adapter import engine_config
    from kvspec.conformance.monitor import Monitor
    from kvspec.judge.fastmodel import FastModel, restates
    from kvspec.judge.spec_model import SpecModel
    from kvspec.proofs.symbolic import Fragment

    assert not restates(_config())
    with pytest.raises(ValueError, match="chunked"):
        FastModel(_config())
    with pytest.raises(ValueError, match="chunked"):
        Fragment(Config(4, 1, groups=(Group("chunked", 1, chunk=2),)))
    assert engine_config(_config()).groups[0].chunk == C
    assert Monitor.fast(_config()).run is None
    assert SpecModel(_config()).incremental is None


# -- the trace -----------------------------------------------------------------------------------


def test_a_chunked_trace_round_trips_and_holds_under_kvspec_check(tmp_path: Path) -> None:
    """The header carries each chunked group's ``chunk``; ``kvspec check`` judges the vLLM
    scenario by the spec (exit 0), and the same trace with the planted frees one chunk too far
    (the spec's own effects under the plant) is a finding (exit 1)."""
    for groups in (CHUNKED, FULL_CHUNKED):
        config = _config(groups, depth=3, async_scheduling=True, prefix_caching=False)
        events = [*IN_FLIGHT, ("execute", 0, ()), ("commit", 0, ((1, 11),)), ("begin", 2)]
        events += [("schedule", 1, 1, 0), ("submit", 2)]
        path = tmp_path / "t.jsonl"
        write_trace(path, config, _spec_trace(config, events), engine=("test", "0"))
        header = json.loads(path.read_text().splitlines()[0])
        assert {"kind": "chunked", "block_size": B, "window": None, "chunk": C} in header["model"][
            "groups"
        ]
        assert trace.read_trace(path)[0] == config
        assert check_file(path).exit_code == 0
    bad = _spec_trace(config, IN_FLIGHT[:-1])
    bad += [("free", 5)]  # a free of a block the prefill in flight reads: not the spec's effect
    write_trace(path, config, bad, engine=("test", "0"))
    assert check_file(path).exit_code == 1


@pytest.mark.parametrize(
    "group, words",
    [
        ({"kind": "chunked", "block_size": 4}, "chunk must be a positive multiple"),
        ({"kind": "chunked", "block_size": 4, "chunk": 6}, "multiple of its block_size"),
        ({"kind": "chunked", "block_size": 4, "chunk": "8"}, '"chunk" must be an integer'),
        ({"kind": "full", "block_size": 4, "chunk": 8}, "only a chunked group has a chunk"),
    ],
)
def test_a_malformed_chunked_group_is_bad_input_exit_2(tmp_path: Path, group, words) -> None:
    header = trace.header_for(Config(8, 4), ("x", "1"))
    header["model"] = {"groups": [group]}  # type: ignore[index]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n")
    with pytest.raises(trace.TraceError, match=words):
        trace.read_trace(path)
    done = subprocess.run(
        [sys.executable, "-m", "kvspec", "check", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "chunk" in done.stderr


def _spec_trace(config: Config, events: list[Event]) -> list[Event]:
    s = initial_state(config)
    out: list[Event] = []
    for event in events:
        out += [event, *apply(s, event)]
    return out


def test_the_schema_takes_a_chunked_group_and_refuses_a_bad_chunk(tmp_path: Path) -> None:
    """``trace-v1.schema.json``: a written header with a chunked group validates; a chunk
    below 1 or an unknown kind does not."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(trace.__file__).parent / "trace-v1.schema.json").read_text())
    config = _config(FULL_CHUNKED)
    path = tmp_path / "t.jsonl"
    write_trace(path, config, _spec_trace(config, IN_FLIGHT[:3]), engine=("test", "0"))
    header = json.loads(path.read_text().splitlines()[0])
    jsonschema.validate(header, schema)
    for field, value in (("chunk", 0), ("kind", "local")):
        bad = json.loads(json.dumps(header))
        bad["model"]["groups"][1][field] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
