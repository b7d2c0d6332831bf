"""Several KV-cache groups (issue #36), the vocabulary: ``Config.groups`` validated up front, the
optional trailing ``group`` field of ``alloc``/``hit``/``publish``/``dedup``, the per-group
tables of the state, and the trace header's ``model.groups`` read and written."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvspec.conformance import trace
from kvspec.spec import Config
from kvspec.spec.events import canonical, group_of, grouped
from kvspec.spec.state import NULL_BLOCK, Group, State, initial_state

HYBRID = (Group("full", 4), Group("window", 4, window=6), Group("state", 8))


def test_groups_are_validated_up_front_naming_the_problem() -> None:
    assert Config(8, 4, groups=HYBRID).hybrid
    assert not Config(8, 4, groups=(Group("full", 4),)).hybrid
    cases = {
        (Group("chunked", 4),): "a chunked group's chunk must be a positive multiple",
        (Group("chunked", 4, chunk=6),): "multiple of its block_size 4",
        (Group("full", 4, chunk=8),): "only a chunked group has a chunk",
        (Group("full", 4), Group("chunked", 4, chunk=4), Group("chunked", 4, chunk=4))[1:]: (
            "group 0 of several must be full or window"
        ),
        (Group("mamba", 4),): "unknown group kind",
        (Group("full", 6),): "multiple of block_size 4",
        (Group("window", 4),): "needs an integer window",
        (Group("full", 4, window=3),): "only a window group",
    }
    for groups, words in cases.items():
        with pytest.raises(ValueError, match=words):
            Config(8, 4, groups=groups)
    with pytest.raises(ValueError, match="groups and sliding_window together"):
        Config(8, 4, groups=(Group("full", 4),), sliding_window=4)
    with pytest.raises(ValueError, match="tuple of Group"):
        Config(8, 4, groups=[Group("full", 4)])  # type: ignore[arg-type]


def test_a_one_group_window_reads_as_sliding_window() -> None:
    assert Config(8, 4, groups=(Group("window", 4, window=6),)).window == 6
    assert Config(8, 4, sliding_window=6).window == 6
    assert Config(8, 4).window is None


def test_the_state_keeps_one_table_and_one_index_per_group() -> None:
    s = initial_state(Config(8, 4, groups=HYBRID))
    assert s.index_of(0) is s.index
    assert s.index_of(2) is s.group_index[2] and s.index_of(2) is not s.index


def test_the_group_field_is_canonical_only_when_not_zero() -> None:
    assert grouped(("alloc", 1, 3), 0) == ("alloc", 1, 3)
    assert grouped(("alloc", 1, 3), 2) == ("alloc", 1, 3, 2)
    assert group_of(("alloc", 1, 3, 2)) == 2
    assert group_of(("alloc", 1, 3)) == 0
    assert group_of(("publish", 1, 0, 3, 1)) == 1
    assert group_of(("free", 3)) == 0
    assert canonical(("hit", 1, (2, 3), 0)) == ("hit", 1, (2, 3))
    assert canonical(("hit", 1, (2, 3), 1)) == ("hit", 1, (2, 3), 1)


def test_the_header_and_effects_of_a_hybrid_trace_round_trip(tmp_path) -> None:
    config = Config(8, 4, groups=HYBRID)
    events = [
        ("arrive", 0, (1, 2, 3, 4, 5), 2, 0),
        ("begin", 0),
        ("schedule", 0, 5, 0),
        ("hit", 0, ()),
        ("hit", 0, (), 1),
        ("alloc", 0, 1),
        ("alloc", 0, 2, 1),
        ("publish", 0, 0, 2, 1),
    ]
    path = tmp_path / "t.jsonl"
    trace.write_trace(path, config, events, hashes=True)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["model"]["groups"][1] == {"kind": "window", "block_size": 4, "window": 6}
    assert "group" not in json.loads(lines[6]) and json.loads(lines[7])["group"] == 1
    got_config, got = trace.read_trace(path)
    assert got_config == config and got == events
    v0 = tmp_path / "t.v0"
    trace.write_events(v0, config, events)
    assert trace.read_trace(v0) == (config, events)


def test_a_one_group_trace_carries_no_group(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    trace.write_trace(path, Config(8, 4), [("arrive", 0, (1,), 1, 0), ("begin", 0)])
    assert "groups" not in path.read_text()


def test_an_explicit_group_zero_reads_as_no_field() -> None:
    assert trace.parse_object({"ev": "alloc", "req": 0, "block": 1, "group": 0}, 4)[0] == (
        "alloc",
        0,
        1,
    )
    assert trace.event_error(("alloc", 0, 1, 1), 4) is None
    assert "group" in (trace.event_error(("alloc", 0, 1, -1), 4) or "")
    assert "group" in (trace.event_error(("alloc", 0, 1, 0), 4) or "")  # not canonical


@pytest.mark.parametrize(
    "groups, words",
    [
        ("full", "must be a list"),
        ([{"kind": "full"}], "block_size"),
        ([{"kind": "full", "block_size": 4, "colour": 1}], "unknown field"),
        ([{"kind": "chunked", "block_size": 4}], "chunked"),
        ([{"kind": "full", "block_size": 3}], "multiple"),
    ],
)
def test_a_bad_header_groups_is_bad_input_naming_it(tmp_path, groups, words) -> None:
    config = Config(8, 4)
    header = trace.header_for(config, ("x", "1"))
    header["model"] = {"groups": groups}  # type: ignore[index]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n")
    with pytest.raises(trace.TraceError, match=words):
        trace.read_trace(path)


# -- corrupting a state, one invariant at a time (tests/test_spec.py's test_each_invariant_can_fail)

GROUP_INVARIANTS = (
    "HitServedByEveryGroup",
    "NoUnwrittenStateRead",
    "NoReadOfRecycled",
    "StateAtItsBoundary",
    "CrossBlocksPrivate",
)


def corrupt_groups(name: str, s: State) -> None:
    """Break exactly what one invariant of several groups watches, in ``test_spec``'s state (r1
    and r2 running at block size 4, step 1 building with both): the configuration becomes a
    two-group one where the invariant needs it."""
    r1 = s.requests[1]
    if name == "HitServedByEveryGroup":
        s.admission = (2, 4, ((),))  # a 4-token hit with no block
    elif name == "NoUnwrittenStateRead":
        s.bad_state_reads.append((0, 1, 1))
    elif name == "NoReadOfRecycled":
        s.config = replace(s.config, groups=(Group("full", 4), Group("full", 4)))
        r1.group_tables = [[NULL_BLOCK, 6, 7]]  # block 5 left the table, step 1 reads it
        entry = s.steps[-1].entries[1]
        entry.group_blocks = ((5, 6, 7),)
    elif name == "StateAtItsBoundary":
        s.config = replace(s.config, groups=(Group("full", 4), Group("state", 4)))
        s.group_index[1] = {tuple(r1.tokens[:4]): [s.free[0]]}
        s.blocks[s.free[0]].key, s.blocks[s.free[0]].group = tuple(r1.tokens[:4]), 1
    elif name == "CrossBlocksPrivate":  # r1's block 0 in r2's cross table too
        s.config = replace(s.config, groups=(Group("full", 4), Group("cross", 4)))
        r1.encoder = 4
        r1.group_tables = [[s.free[0]]]
        s.requests[2].group_tables = [[s.free[0]]]
        s.blocks[s.free[0]].refcount = 2
    else:
        raise AssertionError(name)
