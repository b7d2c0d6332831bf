"""The policy ``engine-registers``: an engine's own ``publish`` and ``dedup`` effects, judged by the
observed judge (``spec/observed.py``, ``conformance/observed.py``).

The engine's event streams below are written out by hand: the decisions, the spec's effects as an
engine following it emits them, and the engine's own registrations at the place it makes them.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvspec.conformance.check import check_file
from kvspec.conformance.report import Report
from kvspec.conformance.trace import TraceError, parse_header, write_trace
from kvspec.judge import Judge
from kvspec.spec import Config

ER = Config(num_blocks=8, block_size=4, policy="engine-registers", discipline="general")

# r0 and r1 share the 4-token prefix 1 2 3 4 and are admitted in the same step, so each computes
# its own copy of that block: r0 gets blocks 1, 2 and r1 gets blocks 3, 4.
BOTH_ADMITTED = [
    ("arrive", 0, (1, 2, 3, 4, 5), 2, 0),
    ("arrive", 1, (1, 2, 3, 4, 6), 2, 0),
    ("begin", 0),
    ("schedule", 0, 5, 0),
    ("hit", 0, ()),
    ("alloc", 0, 1),
    ("alloc", 0, 2),
    ("schedule", 1, 5, 0),
    ("hit", 1, ()),
    ("alloc", 1, 3),
    ("alloc", 1, 4),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ((0, 7), (1, 7))),
]
# After the step's result, as SGLang's insert does: r0's block is new to the tree; r1's copy is a
# duplicate, so r1 now points at r0's block and its own copy is freed.
INSERT_BOTH = [("publish", 0, 0, 1), ("dedup", 1, 0, 1)]
# The next step: both decode (reading block 0 of their tables), then finish.
DECODE_BOTH = [
    ("begin", 1),
    ("schedule", 0, 1, 0),
    ("schedule", 1, 1, 0),
    ("submit", 1),
    ("execute", 1, ()),
    ("commit", 1, ((0, 8), (1, 8))),
    ("free", 2),
    ("free", 1),
    ("finish", 0, "length"),
    ("free", 4),
    ("free", 1),
    ("finish", 1, "length"),
]


def judged(events: list[tuple[object, ...]], config: Config = ER) -> Judge:
    judge = Judge.spec(config, observed=True)
    judge.feed_all(events)
    judge.settle()
    return judge


def test_an_engine_registering_after_the_write_and_deduplicating_is_judged_safe() -> None:
    judge = judged(BOTH_ADMITTED + INSERT_BOTH + DECODE_BOTH)
    assert judge.finding is None, judge.finding
    assert judge.model.state.index == {(1, 2, 3, 4): [1]}


def test_a_dedup_moves_the_reference_from_the_copy_to_the_published_block() -> None:
    judge = judged(BOTH_ADMITTED + INSERT_BOTH)
    assert judge.finding is None, judge.finding
    assert judge.model.state.requests[1].table == [1, 4]
    refcounts = tuple(b.refcount for b in judge.model.state.blocks)
    assert refcounts == (0, 2, 1, 0, 1, 0, 0, 0)
    assert judge.compare(refcounts, (3, 5, 6, 7)) is None


def test_a_registration_before_the_write_whose_writer_leaves_is_caught() -> None:
    """The seed bug in an engine that registers on its own: published at schedule time, then the
    writer is preempted in the same step, so its write is withdrawn."""
    events = BOTH_ADMITTED[:7] + [("publish", 0, 0, 1), ("preempt", 0), ("free", 2), ("free", 1)]
    judge = judged(events)
    assert judge.finding is not None and judge.finding.invariant == "NoUnwrittenPublish"


def test_a_dedup_onto_a_block_that_will_never_hold_the_prefix_is_caught() -> None:
    # r0's block 1 is published before its step runs; r0 is preempted in that step, so block 1
    # stays garbage. r1 then dedups onto it and reads it in the next step.
    events = BOTH_ADMITTED[:11] + [("publish", 0, 0, 1), ("preempt", 0), ("free", 2), ("free", 1)]
    events += [("submit", 0), ("execute", 0, ()), ("commit", 0, ((1, 7),)), ("dedup", 1, 0, 1)]
    judge = Judge.spec(ER, True, ["NoUnwrittenRead"])
    judge.feed_all(events + [("begin", 1), ("schedule", 1, 1, 0), ("submit", 1)])
    judge.settle()
    assert judge.finding is not None and judge.finding.invariant == "NoUnwrittenRead"


@pytest.mark.parametrize(
    "effect, fragment",
    [
        (("dedup", 1, 0, 2), "not a published copy"),  # block 2 is not published
        (("dedup", 1, 1, 1), "not a published copy"),  # wrong position for block 1's key
        (("dedup", 1, 5, 1), "not running with a block 5"),
        (("dedup", 9, 0, 1), "never arrived"),
        (("publish", 1, 0, 1), "already published"),
        (("publish", 0, 1, 2), "not full"),
        (("publish", 0, 0, 0), "unknown request, index or block"),  # the null block
        (("publish", 0, 0), "malformed"),
    ],
)
def test_engine_effects_that_name_the_wrong_things_are_illegal(
    effect: tuple[object, ...], fragment: str
) -> None:
    judge = judged(BOTH_ADMITTED + [("publish", 0, 0, 1), effect])
    assert judge.finding is not None and judge.finding.invariant == "Illegal"
    assert fragment in judge.finding.message


def test_no_dedup_while_the_step_being_built_uses_the_copy() -> None:
    # r1 decodes in step 1, being built, on its block 3 when it dedups that block onto block 1.
    events = BOTH_ADMITTED + [("publish", 0, 0, 1), ("begin", 1), ("schedule", 1, 1, 0)]
    judge = judged(events + [("dedup", 1, 0, 1)])
    assert judge.finding is not None and judge.finding.invariant == "Illegal"
    assert "step 1, being built, uses block 3" in judge.finding.message


# SGLang's overlap scheduler, the shortest history kvspec fuzz found (5 blocks of 2 tokens): r0's
# block 1 is inserted when r0 finishes; r1, with the same two tokens, recomputes them into block 2
# (a match leaves the last token to compute); step 2 decodes r1 on the token step 1 samples; when
# step 1's result is processed SGLang inserts r1's block, finds block 1, frees block 2 and points
# r1's row at block 1 (dedup) while step 2, submitted, still reads block 2.
OVERLAP = Config(
    num_blocks=5,
    block_size=2,
    depth=2,
    policy="engine-registers",
    discipline="general",
    token_budget=3,
    max_running=2,
    stop_token=0,
    async_scheduling=True,
)
DEDUP_IN_FLIGHT = [
    ("arrive", 0, (3, 1), 1, 0),
    ("begin", 0),
    ("schedule", 0, 2, 0),
    ("hit", 0, ()),
    ("alloc", 0, 1),
    ("submit", 0),
    ("execute", 0, ()),
    ("commit", 0, ((0, 0),)),
    ("publish", 0, 0, 1),
    ("free", 1),
    ("finish", 0, "stop"),
    ("arrive", 1, (3, 1), 2, 0),
    ("begin", 1),
    ("schedule", 1, 2, 0),
    ("hit", 1, ()),
    ("alloc", 1, 2),
    ("submit", 1),
    ("begin", 2),
    ("schedule", 1, 1, 0),
    ("alloc", 1, 3),
    ("submit", 2),
    ("execute", 1, ()),
    ("commit", 1, ((1, 1),)),
    ("dedup", 1, 0, 1),
]


def test_a_submitted_step_keeps_the_copy_a_dedup_drops() -> None:
    """The copy keeps its bytes until a later step overwrites it: step 2 reads it safely."""
    judge = judged(DEDUP_IN_FLIGHT, OVERLAP)
    assert judge.finding is None, judge.finding
    assert judge.model.state.blocks[2].refcount == 0  # the copy is free; step 2 still reads it
    tail = [("execute", 2, ()), ("commit", 2, ((1, 1),)), ("free", 3), ("free", 1)]
    judge = judged(DEDUP_IN_FLIGHT + tail + [("finish", 1, "length")], OVERLAP)
    assert judge.finding is None, judge.finding


def test_the_dropped_copy_may_be_handed_out_while_the_submitted_step_reads_it() -> None:
    """Step 3 gives r2 the freed copy (block 2) while step 2 still reads it: step 2 executes
    first, so it reads r1's bytes, and r2's prefill overwrites them after."""
    events = DEDUP_IN_FLIGHT + [("arrive", 2, (2, 2), 1, 0), ("begin", 3), ("schedule", 2, 2, 0)]
    events += [("hit", 2, ()), ("alloc", 2, 2), ("submit", 3), ("execute", 2, ())]
    events += [("commit", 2, ((1, 1),)), ("free", 3), ("free", 1), ("finish", 1, "length")]
    judge = judged(events + [("execute", 3, ())], OVERLAP)
    assert judge.finding is None, judge.finding
    assert judge.model.state.blocks[2].refcount == 1  # r2's now
    events += [("execute", 3, ()), ("commit", 3, ((2, 1),)), ("free", 2), ("finish", 2, "length")]
    judge = judged(events, OVERLAP)
    assert judge.finding is None, judge.finding


def test_under_the_other_policies_an_engine_may_not_register_on_its_own() -> None:
    deferred = Config(num_blocks=8, block_size=4, policy="deferred", discipline="general")
    judge = judged(BOTH_ADMITTED[:11] + [("publish", 0, 0, 1)], deferred)
    assert judge.finding is not None and judge.finding.invariant == "Disagreement"


def test_only_the_observed_judge_takes_engine_registers() -> None:
    for strict in (Judge.spec, Judge.fast):
        with pytest.raises(ValueError, match="observed judge only"):
            strict(ER)
    header = (
        b'{"format":"kvspec-trace","version":1,"engine":{"name":"x","version":"1"},'
        b'"num_blocks":8,"block_size":4,"null_block":0,"guarantees":{"writes_before_reads":true,'
        b'"steps_execute_in_order":true,"submitted_steps_write":true},'
        b'"model":{"policy":"engine-registers"}}'
    )
    with pytest.raises(TraceError, match='needs "judging": "observed"'):
        parse_header(header, "t.jsonl")


# -- trace files: "judging": "observed" ---------------------------------------------------------


def _check(
    tmp_path: Path, events: list[tuple[object, ...]], config: Config, judging: str
) -> Report:
    path = tmp_path / f"{judging}.jsonl"
    write_trace(path, config, events, hashes=True, judging=judging)
    return check_file(path)


def test_kvspec_check_judges_an_engine_registers_trace_as_observed(tmp_path: Path) -> None:
    report = _check(tmp_path, BOTH_ADMITTED + INSERT_BOTH + DECODE_BOTH, ER, "observed")
    assert report.exit_code == 0, report.text()
    assert report.events == len(BOTH_ADMITTED + INSERT_BOTH + DECODE_BOTH)


def test_kvspec_check_reports_an_observed_violation_at_its_decision(tmp_path: Path) -> None:
    events = BOTH_ADMITTED[:7] + [("publish", 0, 0, 1), ("preempt", 0), ("free", 2), ("free", 1)]
    report = _check(tmp_path, events, ER, "observed")
    assert report.exit_code == 1 and report.invariant == "NoUnwrittenPublish"
    assert report.line == 2 + events.index(("preempt", 0))  # line 1 is the header
    assert (9, "publish r0[0] as block 1") in report.history


def test_an_engine_with_its_own_pool_order_needs_observed_judging(tmp_path: Path) -> None:
    """The engine hands out blocks 3 and 1 where the spec's queue head gives 1 and 2: strict
    judging calls it a disagreement, observed judging accepts the legal choice."""
    config = Config(num_blocks=6, block_size=4, policy="eager-unsafe", token_budget=16)
    events = [("arrive", 0, (1, 2, 3, 4, 5), 2, 0), ("begin", 0), ("schedule", 0, 5, 0)]
    events += [("hit", 0, ()), ("alloc", 0, 3), ("alloc", 0, 1), ("publish", 0, 0, 3)]
    events += [("submit", 0), ("execute", 0, ()), ("commit", 0, ((0, 7),))]
    strict = _check(tmp_path, events, config, "strict")
    assert strict.exit_code == 1 and strict.invariant == "Disagreement"
    assert _check(tmp_path, events, config, "observed").exit_code == 0


@pytest.mark.parametrize(
    "header_change, fragment",
    [
        ({"judging": "loose"}, '"judging" must be one of strict, observed'),
        ({"judging": "strict"}, 'needs "judging": "observed"'),
    ],
)
def test_bad_judging_headers_are_refused(
    tmp_path: Path, header_change: dict[str, str], fragment: str
) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, ER, BOTH_ADMITTED, judging="observed")
    lines = path.read_bytes().splitlines()
    header = orjson.loads(lines[0]) | header_change
    path.write_bytes(b"\n".join([orjson.dumps(header), *lines[1:]]) + b"\n")
    report = check_file(path)
    assert report.exit_code == 2 and report.error is not None
    assert report.error.startswith(f"{path}:1: ") and fragment in report.error


def test_an_unknown_request_in_an_engine_effect_names_its_line(tmp_path: Path) -> None:
    events = BOTH_ADMITTED + [("publish", 0, 0, 1), ("dedup", 7, 0, 1), ("begin", 1)]
    report = _check(tmp_path, events, ER, "observed")
    assert report.exit_code == 2 and report.error is not None
    assert report.error.startswith(f"{tmp_path / 'observed.jsonl'}:{2 + len(BOTH_ADMITTED) + 1}:")
    assert "r7 never arrived" in report.error
