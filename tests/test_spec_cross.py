"""Cross-attention as a KV-cache group kind (``Group("cross", B)``, ``docs/model.md``,
"Cross-attention"): the table sized by the request's encoder tokens (``arrive``'s ``encoder``),
allocated whole and written by the encoder pass of the schedule that admits the request, read
whole by each of its steps, never hashed, published nor hit, freed with the rest; its invariants
named (``NoUnwrittenRead`` for a read before the encoder pass wrote it, ``NoReadOfRecycled`` for
one freed under a step in flight, ``CrossBlocksPrivate`` for one shared or published,
``TableMatchesComputed`` for a table of another size); and the trace's ``encoder`` field."""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import replace

import pytest

from kvspec.conformance import trace
from kvspec.conformance.check import check_file
from kvspec.spec import Config, apply, check, initial_state
from kvspec.spec import groups as spec_groups
from kvspec.spec.state import Encoded, Group, Illegal, State

B = 4
CROSS = (Group("full", B), Group("cross", B))
PROMPT = (1, 2, 3, 4, 5, 6)

Event = tuple[object, ...]


def _config(**kw: object) -> Config:
    base: dict[str, object] = dict(
        num_blocks=16, block_size=B, policy="deferred", groups=CROSS, prefix_caching=False
    )
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def _run(s: State, events: list[Event]) -> list[Event]:
    """Apply each decision, every invariant checked after it; the trace."""
    out: list[Event] = []
    for event in events:
        effects = apply(s, event)
        assert check(s) is None, (event, check(s))
        out += [event, *effects]
    return out


def _admit(encoder: int, max_tokens: int = 2) -> list[Event]:
    return [
        ("arrive", 1, PROMPT, max_tokens, 0, encoder),
        ("begin", 0),
        ("schedule", 1, len(PROMPT), 0),
        ("submit", 0),
    ]


@pytest.mark.parametrize("encoder, blocks", [(1, 1), (3, 1), (4, 1), (5, 2), (9, 3), (0, 0)])
def test_the_cross_table_is_sized_by_the_encoder_tokens_alone(encoder: int, blocks: int) -> None:
    """At admission group 1 allocates ceil(E / B) blocks (none for a request without encoder
    input) after group 0's, whatever the decoder prompt's length; a decode allocates none."""
    s = initial_state(_config())
    out = _run(s, _admit(encoder))
    allocs = [e for e in out if e[0] == "alloc"]
    cross = [e for e in allocs if len(e) == 4]
    assert len(cross) == blocks and all(e[3] == 1 for e in cross)
    assert allocs[len(allocs) - blocks :] == cross  # after group 0's, in group order
    assert len(s.requests[1].group_tables[0]) == blocks
    out = _run(
        s, [("execute", 0, ()), ("commit", 0, ((1, 9),)), ("begin", 1), ("schedule", 1, 1, 0)]
    )
    assert not [e for e in out if e[0] == "alloc" and len(e) == 4], out


def test_the_encoder_pass_writes_each_block_and_every_step_reads_them_all() -> None:
    """The admitting step writes block i with the encoder output i; the decode reads every block
    (reads_of) and no cross block is ever published, even with prefix caching on."""
    s = initial_state(_config(prefix_caching=True))
    _run(s, [*_admit(9), ("execute", 0, ()), ("commit", 0, ((1, 9),))])
    table = s.requests[1].group_tables[0]
    assert [s.blocks[b].written for b in table] == [(Encoded(1, i),) for i in range(3)]
    assert spec_groups.reads_of(s, 1, 7, tuple(table)) == list(enumerate(table))
    assert all(s.blocks[b].key is None for b in table) and not s.group_index.get(1)
    out = _run(s, [("begin", 1), ("schedule", 1, 1, 0), ("submit", 1), ("execute", 1, ())])
    assert not s.bad_reads, out
    out = _run(s, [("commit", 1, ((1, 9),))])
    assert [e for e in out if e[0] == "free"][-3:] == [("free", b) for b in reversed(table)]


def test_a_cross_block_read_before_the_encoder_wrote_it_is_an_unwritten_read() -> None:
    """The rule undone for one block (the encoder pass's write of block 1 dropped, as an engine
    that allocated it after the pass would leave it): the step's read of it is
    ``NoUnwrittenRead``. With the read rule off (``reads_of`` reading no cross block) this test
    fails: nothing is named."""
    s = initial_state(_config())
    _run(s, _admit(9))
    block = s.requests[1].group_tables[0][1]
    s.blocks[block].pending.clear()
    apply(s, ("execute", 0, ()))
    violation = check(s)
    assert violation is not None and violation.invariant == "NoUnwrittenRead", violation
    assert violation.blocks == (block,)


def test_a_cross_block_freed_under_a_step_in_flight_is_named() -> None:
    """A cross block leaving the table while a submitted step still reads it (freed early):
    ``NoReadOfRecycled``."""
    s = initial_state(_config())
    _run(s, [*_admit(9), ("execute", 0, ()), ("commit", 0, ((1, 9),))])
    _run(s, [("begin", 1), ("schedule", 1, 1, 0), ("submit", 1)])
    table = s.requests[1].group_tables[0]
    table[2] = 0
    violation = check(s)
    assert violation is not None and violation.invariant in (
        "NoReadOfRecycled",
        "TableMatchesComputed",
        "RefcountIsOwnership",
    ), violation
    assert spec_groups.private_cross_blocks(s) is None


@pytest.mark.parametrize("how", ["shared", "published"])
def test_a_cross_block_shared_or_published_is_cross_blocks_private(how: str) -> None:
    s = initial_state(_config())
    _run(s, [*_admit(5), ("execute", 0, ()), ("commit", 0, ((1, 9),))])
    block = s.requests[1].group_tables[0][0]
    if how == "shared":
        _run(s, [("arrive", 2, (7, 8), 2, 0, 1), ("begin", 1), ("schedule", 2, 2, 0)])
        s.requests[2].group_tables[0][0] = block
    else:
        s.blocks[block].key = tuple(PROMPT[:B])
    violation = spec_groups.private_cross_blocks(s)
    assert violation == ((1, 1, block) if how == "published" else (1, 1, block))
    named = check(s, ["CrossBlocksPrivate"])
    assert named is not None and named.blocks == (block,), named


def test_a_cross_table_one_block_short_is_table_matches_computed() -> None:
    s = initial_state(_config())
    _run(s, _admit(9))
    s.requests[1].group_tables[0].pop()
    violation = check(s, ["TableMatchesComputed"])
    assert violation is not None, violation


def test_encoder_tokens_need_a_cross_group() -> None:
    s = initial_state(replace(_config(), groups=(Group("full", B), Group("full", B))))
    with pytest.raises(Illegal, match="no cross-attention group"):
        apply(s, ("arrive", 1, PROMPT, 2, 0, 3))


def test_the_encoder_field_round_trips_in_a_trace(tmp_path) -> None:
    """``arrive``'s trailing ``encoder``: there when not 0, read back as the tuple's last field."""
    config = _config()
    events: list[Event] = [("arrive", 0, PROMPT, 2, 0, 5), ("arrive", 1, PROMPT, 2, 0)]
    path = tmp_path / "t.jsonl"
    trace.write_trace(path, config, events)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[1]["encoder"] == 5 and "encoder" not in lines[2]
    assert lines[0]["model"]["groups"][1] == {"kind": "cross", "block_size": B, "window": None}
    assert trace.read_trace(path) == (config, events)


def test_the_schema_names_the_encoder_and_the_cross_kind() -> None:
    schema = json.loads(
        importlib.resources.files("kvspec.conformance").joinpath("trace-v1.schema.json").read_text()
    )
    assert schema["$defs"]["arrive"]["properties"]["encoder"]["minimum"] == 0
    assert "encoder" not in schema["$defs"]["arrive"]["required"]
    model = schema["$defs"]["header"]["properties"]["model"]["properties"]
    assert "cross" in model["groups"]["items"]["properties"]["kind"]["enum"]


def _whole_run() -> tuple[Config, list[Event]]:
    """Two requests (9 and 0 encoder tokens) to their finish, with a preemption and a
    re-admission of the first: the trace, decisions and effects."""
    s = initial_state(_config())
    events = _run(
        s,
        [
            *_admit(9, max_tokens=4),
            ("arrive", 2, (7, 8, 9), 1, 0),
            ("execute", 0, ()),
            ("commit", 0, ((1, 9),)),
            ("begin", 1),
            ("schedule", 1, 1, 0),
            ("schedule", 2, 3, 0),
            ("submit", 1),
            ("execute", 1, ()),
            ("commit", 1, ((1, 9), (2, 9))),
            ("begin", 2),
            ("preempt", 1),
            ("submit", 2),
            ("execute", 2, ()),
            ("commit", 2, ()),
            ("begin", 3),
            ("schedule", 1, 8, 0),
            ("submit", 3),
            ("execute", 3, ()),
            ("commit", 3, ((1, 9),)),
        ],
    )
    return s.config, events


def test_kvspec_check_judges_a_cross_trace_and_names_a_short_table(tmp_path) -> None:
    """A whole run holds under ``kvspec check``; the same trace with the admission's last cross
    alloc dropped (an engine one block short for the encoder tokens) is a finding (exit 1)."""
    config, events = _whole_run()
    path = tmp_path / "ok.jsonl"
    trace.write_trace(path, config, events)
    assert check_file(path).exit_code == 0
    last = max(i for i, e in enumerate(events) if e[0] == "alloc" and len(e) == 4)
    short = events[:last] + events[last + 1 :]
    bad = tmp_path / "short.jsonl"
    trace.write_trace(bad, config, short)
    assert check_file(bad).exit_code == 1


def test_an_encoder_output_survives_the_commit_of_a_placeholder_of_the_same_numbers() -> None:
    """Async scheduling: step 0's placeholder for r0 is resolved at its commit in every block;
    r0's cross block 0 holds ``Encoded(0, 0)``, which must not read as that placeholder (the
    two once compared equal as tuples, and the commit overwrote the encoder output)."""
    s = initial_state(_config(async_scheduling=True, depth=2))
    _run(
        s,
        [
            ("arrive", 0, PROMPT, 3, 0, 5),
            ("begin", 0),
            ("schedule", 0, len(PROMPT), 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((0, 9),)),
            ("begin", 1),
            ("schedule", 0, 1, 0),
            ("submit", 1),
            ("execute", 1, ()),
        ],
    )
    block = s.requests[0].group_tables[0][0]
    assert s.blocks[block].written == (Encoded(0, 0),) and not s.bad_reads


def test_a_prefix_cache_hit_beside_a_cross_group_is_served_by_every_group() -> None:
    """Prefix caching on (the spec allows it with a cross group; vLLM turns it off for these
    models): r2 shares r1's first block, its admission hits 4 tokens of group 0 and nothing of
    the cross group (``hit`` with no blocks), which allocates its whole table anyway; every
    invariant holds. (Planted: without ``hit_served_by_every_group``'s cross branch the empty
    cross hit is named HitServedByEveryGroup, "0 blocks of 4 tokens".)"""
    s = initial_state(_config(prefix_caching=True))
    prompt = (*PROMPT, 7, 8)
    out = _run(
        s,
        [
            ("arrive", 1, prompt, 1, 0, 5),
            ("begin", 0),
            ("schedule", 1, len(prompt), 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((1, 9),)),
            ("arrive", 2, prompt, 1, 0, 3),
            ("begin", 1),
            ("schedule", 2, 4, 0),
        ],
    )
    hits = [e for e in out if e[0] == "hit" and e[1] == 2]
    assert len(hits[0][2]) == 1 and hits[1] == ("hit", 2, (), 1), hits  # type: ignore[arg-type]
    assert len(s.requests[2].group_tables[0]) == 1
