"""The fast model (judge/fastmodel.py) judges exactly as the spec does.

Differential (lockstep) tests, as for the reference engine: on fuzzed reference-engine traces
(every policy, the unsafe ones included; both disciplines and preemptions; depth 1 to 3; external
loads that fail; aborts; prefix-cache resets) a judge over the fast model must reach the spec
judge's verdict (none, or the same invariant at the same event, or the same unknown id) and, after
every decision, its model must stand for the spec's state field by field; so must it on traces
with planted bugs and on corrupted files, where ``kvspec check`` must print the same through both
engines. Breaking the fast model must make these tests fail.

The differential tests run on both builds of the hot path: the source modules and the package
mypyc compiled from them (``judge/fastbuild.py``, built by ``make venv``). Planted
bugs are monkeypatched into the source ``FastModel`` (compiled classes cannot be patched), and the
tests that go through ``check_file`` then ask for the source build (``KVSPEC_FAST_MODEL``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import ModuleType

import orjson
import pytest
from edges import with_effects
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from spec_walks import spec_runs
from test_checker import _corrupt, safe_run
from test_incremental import CONSUMER_RUN, SEED_RUN, engine_runs

from kvspec.cli import main
from kvspec.conformance.background import BackgroundMonitor, JudgeDied
from kvspec.conformance.check import check_file
from kvspec.conformance.monitor import Monitor, Violation
from kvspec.conformance.report import Report
from kvspec.conformance.trace import write_trace
from kvspec.judge import UnknownId, core, fastbuild, handover
from kvspec.judge.fastmodel import FastModel, spec_placeholder
from kvspec.judge.handover import FastPathDisagrees
from kvspec.judge.recorder import Recorder
from kvspec.spec import ACTIONS, POLICIES, Config
from kvspec.spec.events import Event
from kvspec.spec.policies import eager
from kvspec.spec.pool import holds
from kvspec.spec.state import State

Verdict = tuple[str, object] | None

COMPILED, NOT_COMPILED = fastbuild.compiled()
MODELS = [
    pytest.param(core, id="source"),
    pytest.param(
        COMPILED,
        id="compiled",
        marks=pytest.mark.skipif(COMPILED is None, reason=str(NOT_COMPILED)),
    ),
]
"""Both builds of the judge's core and the fast model; the compiled one is required by the next
test."""


def test_the_compiled_fast_model_is_built_from_this_source() -> None:
    """``make venv`` compiles the hot path; a missing or stale build fails here (and only slows
    ``kvspec check`` down, with a note, elsewhere)."""
    assert COMPILED is not None, NOT_COMPILED
    assert sys.modules[fastbuild.NAME].SOURCE_SHA256 == fastbuild.source_hash()
    assert COMPILED.Judge is not core.Judge
    judge, note = fastbuild.fast_judge(Config(8, 4))
    assert type(judge) is COMPILED.Judge and note is None


def verdict(judge: core.Judge) -> Verdict:
    found = judge.finding
    return None if found is None else (found.invariant, found.event)


def spec_verdict(config: Config, events: list[Event]) -> Verdict:
    judge = core.Judge.stream(config)
    try:
        for event in events:
            if judge.feed(event) is not None:
                break
        else:
            judge.finish()
    except UnknownId as err:
        return ("UnknownId", str(err))
    return verdict(judge)


def lockstep(
    config: Config, events: list[Event], collect: bool, model: ModuleType = core
) -> Verdict:
    """Both judges side by side: the fast model's state, exported, must be the spec's before
    every decision; the verdicts must be equal."""
    spec, fast = core.Judge.stream(config), model.Judge.fast(config)
    for event in events:
        if event[0] in ACTIONS and spec.epos == len(spec.expected) and spec.finding is None:
            if collect:
                fast.model._collect()
            mine, want = fast.model.export(), spec.model.state
            assert mine == want, event
            for a, b in zip(mine.steps, want.steps, strict=True):
                assert list(a.entries) == list(b.entries)  # scheduling order
            verified_reads_still_hold(fast.model, want, event)
            for rid, req in fast.model.requests.items() if config.async_scheduling else ():
                # placeholders, kept incrementally (the synchronous fast model keeps none)
                spec_req = want.requests[rid]
                ahead = want.ahead(spec_req)[len(spec_req.tokens) :]
                assert [spec_placeholder(x) for x in req.ahead] == ahead, (event, rid)
        try:
            got = spec.feed(event)
        except UnknownId as err:
            with pytest.raises(UnknownId, match=str(err)):
                fast.feed(event)
            return ("UnknownId", str(err))
        fast.feed(event)
        if got is not None:
            assert verdict(fast) == (got.invariant, got.event)
            return verdict(fast)
        assert fast.finding is None, event
    spec.finish()
    fast.finish()
    want = verdict(spec)
    assert verdict(fast) == want
    return want


def verified_reads_still_hold(model: FastModel, s: State, event: Event) -> None:
    """What the fast model's ``Req.verified`` promises, and what lets it skip those positions
    when reads are checked again: each table block below it has no pending write and holds the
    request's prefix (in the spec's state ``s``, equal to the model's)."""
    bsz = s.config.block_size
    for rid, req in model.requests.items():
        for i in range(req.verified):
            block = s.blocks[req.table[i]]
            prefix = tuple(s.requests[rid].tokens[: (i + 1) * bsz])
            assert not block.pending and holds(block.written, prefix), (event, rid, i)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(run=engine_runs(), collect=st.booleans())
@example(run=SEED_RUN, collect=False)
@example(run=CONSUMER_RUN, collect=True)
def test_fast_model_and_spec_agree_on_engine_traces(
    model: ModuleType, run: tuple[Config, list[Event]], collect: bool
) -> None:
    config, events = run
    lockstep(config, events, collect, model)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(run=spec_runs(drafts=False), collect=st.booleans())
def test_fast_model_and_spec_agree_on_spec_walks(
    model: ModuleType, run: tuple[Config, list[Event]], collect: bool
) -> None:
    """Walks of the spec itself: every configuration, async scheduling with its placeholders and
    delivered stale output included (no engine of kvspec's produces those traces yet)."""
    config, events = run
    lockstep(config, events, collect, model)


def test_a_fast_model_that_does_not_resolve_placeholders_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(FastModel, "_resolve", lambda self, step, sampled: None)

    @settings(max_examples=300, deadline=None, phases=[Phase.generate], database=None)
    @given(run=spec_runs(drafts=False))
    def lockstep_walks(run: tuple[Config, list[Event]]) -> None:
        lockstep(*run, collect=False)

    with pytest.raises(AssertionError):  # found while generating; not shrunk (it is planted)
        lockstep_walks()


def leftovers(config: Config, events: list[Event], model: ModuleType) -> list[tuple[str, int]]:
    """Finished requests a judge still holds although no step in flight references them, just
    before a decision would prune (each judge prunes before it applies a decision), for the spec
    judge and the fast one; the definition of pruning, restated from the states."""
    found: list[tuple[str, int]] = []
    judges = {"spec": core.Judge.stream(config), "fast": model.Judge.fast(config)}
    end: Event = ("end of trace",)
    for event in [*events, end]:
        for name, judge in judges.items():
            if (event is end or event[0] in ACTIONS) and judge.finding is None:
                judge.model.prune()
                s = judge.model.state if name == "spec" else judge.model.export()
                for rid, req in s.requests.items():
                    held = any(rid in st.entries or rid in st.registrations for st in s.steps)
                    if req.status == "finished" and not held:
                        found.append((name, rid))
            if event is not end:
                judge.feed(event)
    return found


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(run=spec_runs(drafts=False))
def test_finished_requests_are_pruned_once_no_step_holds_them(
    model: ModuleType, run: tuple[Config, list[Event]]
) -> None:
    """Both judges forget a finished request before the first decision after the last step that
    referenced it left (``prune``, skipped between commits, aborts and preemptions)."""
    assert leftovers(*run, model) == []


def test_a_judge_that_skips_pruning_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FastModel, "prune", lambda self: [])

    @settings(max_examples=200, deadline=None, phases=[Phase.generate], database=None)
    @given(run=spec_runs(drafts=False))
    def pruned(run: tuple[Config, list[Event]]) -> None:
        assert leftovers(*run, core) == []

    with pytest.raises(AssertionError):  # found while generating; not shrunk (it is planted)
        pruned()


MUTATIONS = ("drop", "duplicate", "swap", "block", "token", "request", "step", "decision")


def mutate(events: list[Event], data: st.DataObject, num_blocks: int) -> list[Event]:
    """One or two planted bugs: an engine that skips, repeats or reorders an event, names
    another block, request or step, samples another token, or takes another decision."""
    events = list(events)
    for _ in range(data.draw(st.integers(1, 2))):
        if not events:
            break
        i = data.draw(st.integers(0, len(events) - 1))
        event = list(events[i])
        kind = event[0]
        how = data.draw(st.sampled_from(MUTATIONS))
        if how == "drop":
            del events[i]
            continue
        if how == "duplicate":
            events.insert(i, events[i])
            continue
        if how == "swap" and i + 1 < len(events):
            events[i], events[i + 1] = events[i + 1], events[i]
            continue
        if how == "block" and kind in ("alloc", "publish", "free", "evict", "unpublish"):
            event[-1] = data.draw(st.integers(0, num_blocks - 1))
        elif how == "block" and kind == "hit" and event[2]:
            event[2] = (data.draw(st.integers(0, num_blocks - 1)),) + tuple(event[2][1:])  # type: ignore[index]
        elif how == "token" and kind == "commit" and event[2]:
            (rid, token), *rest = event[2]  # type: ignore[misc]
            event[2] = ((rid, token + data.draw(st.integers(0, 3))), *rest)
        elif how == "token" and kind == "arrive":
            event[2] = tuple(event[2][:-1]) + (data.draw(st.integers(0, 3)),)  # type: ignore[index]
        elif how == "request" and len(event) > 1 and kind not in ("begin", "submit", "reset"):
            if kind in ("execute", "commit"):
                continue
            event[1] = data.draw(st.integers(0, 9))
        elif how == "step" and kind in ("begin", "submit", "execute", "commit"):
            event[1] = event[1] + data.draw(st.sampled_from((-1, 1)))  # type: ignore[operator]
        elif how == "decision" and kind == "schedule":
            event[2] = event[2] + data.draw(st.sampled_from((-1, 1)))  # type: ignore[operator]
        else:
            continue
        events[i] = tuple(event)
    return events


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(run=engine_runs(), data=st.data())
def test_fast_model_and_spec_agree_on_traces_with_planted_bugs(
    model: ModuleType, run: tuple[Config, list[Event]], data: st.DataObject
) -> None:
    config, events = run
    lockstep(config, mutate(events, data, config.num_blocks), False, model)


WHOLE_PROMPT_LOAD = (
    Config(4, 2, depth=1, policy="eager-unsafe", token_budget=3, max_running=2),
    [("reset",)]
    + [("arrive", rid, prompt, 1, 0) for rid, prompt in enumerate([(1,), (1,), (1, 2), (1, 2, 3)])]
    + [("begin", 0), ("schedule", 0, 1, 0), ("hit", 0, ()), ("alloc", 0, 1)]
    + [("schedule", 1, 1, 0), ("hit", 1, ()), ("alloc", 1, 2), ("submit", 0), ("execute", 0, ())]
    + [("commit", 0, ((0, 3), (1, 3))), ("free", 1), ("finish", 0, "length"), ("free", 2)]
    + [("finish", 1, "length"), ("begin", 1), ("schedule", 2, 0, 1), ("hit", 2, ())]
    + [("alloc", 2, 2), ("publish", 2, 0, 2), ("schedule", 3, 1, 0), ("hit", 3, (2,))]
    + [("alloc", 3, 1), ("submit", 1), ("execute", 1, ()), ("commit", 1, ((3, 3),))]
    + [("free", 1), ("free", 2), ("finish", 3, "length")],
)
"""A reference-engine run (found by ``test_fast_model_and_spec_agree_on_traces_with_planted_bugs``
on 2026-12-03): r2 loads its whole 2-token prompt (``spec.actions.loadable``: its computed
tokens stop one short, the last recomputed over the load), eager publication registers the block
at once, and r3 hits it in the same step (the run's first 30 events, then its last commit's
effects). The spec's ``SharedImpliesSamePrefix`` counted the block as full only by computed
tokens and failed at r3's schedule, while the fast model, which leaves that invariant out as
holding on every state its actions reach, found nothing; the spec now counts a block loaded
whole as full (``spec.invariants.full_in``, ``Request.loaded_last``), and both hold. The spec's
side of it: ``tests/test_spec_loads.py``."""


@pytest.mark.parametrize("model", MODELS)
def test_fast_model_and_spec_agree_after_a_whole_prompt_load_under_eager_publication(
    model: ModuleType,
) -> None:
    config, events = WHOLE_PROMPT_LOAD
    assert lockstep(config, events, False, model) is None


GENERAL = Config(num_blocks=8, block_size=2, depth=1, policy="deferred", discipline="general")
RECOMPUTE_OVER_A_SHARED_LOAD = with_effects(
    GENERAL,
    [("arrive", 0, (1, 2), 2, 0), ("arrive", 1, (1, 2, 5), 2, 0), ("begin", 0)]
    + [("schedule", 0, 0, 1), ("submit", 0), ("execute", 0, ()), ("commit", 0, ())]
    + [("begin", 1), ("schedule", 1, 1, 0), ("schedule", 0, 1, 0), ("submit", 1)]
    + [("execute", 1, ()), ("commit", 1, ((0, 7), (1, 8)))],
)
"""r0 loads its whole prompt (one block); r1 hits that block and reads it, with no write pending:
the fast model marks it verified for r1. Then r0 recomputes its last token over the block, a
pending write into a block r1 verified, which must take the mark back
(``FastModel._content_changed``; ``verified_reads_still_hold`` in ``lockstep`` fails without)."""

WITHDRAWN_UNDER_A_READER = (
    Config(num_blocks=8, block_size=2, depth=1, policy="eager-unsafe", discipline="general"),
    [("arrive", 0, (1, 2, 3), 2, 0), ("arrive", 1, (1, 2, 5), 2, 0), ("begin", 0)]
    + [("schedule", 0, 3, 0), ("hit", 0, ()), ("alloc", 0, 1), ("alloc", 0, 2)]
    + [("publish", 0, 0, 1), ("schedule", 1, 1, 0), ("hit", 1, (1,)), ("alloc", 1, 3)]
    + [("preempt", 0), ("free", 2), ("free", 1)],
)
"""r0's first block is published as it is scheduled (eager), r1 hits it in the same step, and r0
is preempted: its write is withdrawn under r1, whose read in the building step is now of garbage
(NoUnwrittenRead at the preemption). r1 is then the block's first holder: a fast model that skips
any holder when reads are checked again misses it."""


@pytest.mark.parametrize("model", MODELS)
def test_a_verified_read_is_taken_back_when_its_block_is_rewritten(model: ModuleType) -> None:
    assert lockstep(GENERAL, RECOMPUTE_OVER_A_SHARED_LOAD, False, model) is None


@pytest.mark.parametrize("model", MODELS)
def test_a_write_withdrawn_under_a_reader_of_the_building_step_is_found(
    model: ModuleType,
) -> None:
    config, events = WITHDRAWN_UNDER_A_READER
    assert lockstep(config, events, False, model) == ("NoUnwrittenRead", 11)


def same_report(path: Path, model: ModuleType) -> None:
    """``kvspec check`` through both engines: the same exit code, error, finding and report."""
    fast, spec = check_file(path, build=model), check_file(path, engine="spec")
    fast.seconds = spec.seconds = 0.0
    assert fast == spec


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(run=engine_runs(), data=st.data())
def test_check_prints_the_same_through_both_engines(
    model: ModuleType,
    run: tuple[Config, list[Event]],
    data: st.DataObject,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Planted bugs and corrupted lines, through the files, the readers and the hand-over."""
    config, events = run
    path = tmp_path_factory.getbasetemp() / "both.jsonl"
    events = mutate(events, data, config.num_blocks) if data.draw(st.booleans()) else events
    try:
        write_trace(path, config, events, hashes=data.draw(st.booleans()))
    except (KeyError, IndexError, TypeError):  # hashes of a mutant naming unknown requests
        write_trace(path, config, events)
    if data.draw(st.booleans()):
        lines = _corrupt(path.read_bytes().splitlines(), data)
        path.write_bytes(b"\n".join(lines) + b"\n")
    same_report(path, model)


@pytest.mark.parametrize("model", MODELS)
def test_hash_collisions_are_found_by_both(model: ModuleType, tmp_path: Path) -> None:
    config, events = safe_run(12)
    path = tmp_path / "hash.jsonl"
    write_trace(path, config, events, hashes=True)
    lines = path.read_bytes().splitlines()
    for i, raw in enumerate(lines):
        if b'"publish"' in raw:
            obj = orjson.loads(raw)
            obj["hash"] = "same"
            lines[i] = orjson.dumps(obj)
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert check_file(path).invariant == "HashChainConsistent"
    same_report(path, model)


@pytest.mark.parametrize("model", MODELS)
def test_x_fields_and_v0_files_read_the_same(model: ModuleType, tmp_path: Path) -> None:
    from kvspec.conformance.trace import write_events

    config, events = safe_run(8)
    path = tmp_path / "x.jsonl"
    write_trace(path, config, events, hashes=True)
    lines = path.read_bytes().splitlines()
    lines[3] = lines[3][:-1] + b',"x_note":"engine annotation"}'
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert check_file(path).exit_code == 0
    same_report(path, model)
    write_events(tmp_path / "v0.jsonl", config, events)
    same_report(tmp_path / "v0.jsonl", model)


BROKEN = {
    "publish-never-checked": ("_publications_hold", lambda self: True),
    "freed-blocks-to-the-tail": ("_free_table", None),
}


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_a_broken_fast_model_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The differential test can fail: a planted bug in the fast model makes it fail."""
    name, replacement = BROKEN[bug]
    if replacement is None:  # unreferenced uncached blocks go to the tail, not the head
        original = FastModel._free_table

        def replacement(self: FastModel, req: object) -> None:
            original(self, req)  # type: ignore[arg-type]
            for block in list(self.free):
                if self.key[block] is None:
                    self.free.move_to_end(block)

    monkeypatch.setattr(FastModel, name, replacement)
    with pytest.raises(AssertionError):
        test_fast_model_and_spec_agree_on_engine_traces(model=core)


def test_a_false_alarm_of_the_fast_model_is_a_loud_internal_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, events = safe_run(10)
    path = tmp_path / "good.jsonl"
    write_trace(path, config, events)
    monkeypatch.setattr(FastModel, "_publications_hold", lambda self: False)
    monkeypatch.setenv(fastbuild.ENV, "source")  # check_file judges with the patched class
    with pytest.raises(FastPathDisagrees, match="NoUnwrittenPublish.*spec judge None"):
        check_file(path)
    assert check_file(path, engine="spec").exit_code == 0
    assert main(["check", str(path), "--engine", "spec"]) == 0


def test_monitor_hands_over_from_a_checkpoint_with_bounded_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long run with a violation late: the fast Monitor keeps at most two windows of events,
    and its Violation carries the spec-based report of the same finding."""
    config, events = safe_run(80)
    late = next(i for i in range(len(events) - 60, 0, -1) if events[i][0] == "free")
    events = events[:late] + [("free", 0)] + events[late + 1 :]  # an engine bug, late
    expected = spec_verdict(config, events)
    assert expected == ("Disagreement", late)
    monkeypatch.setattr(handover, "EVENTS_PER_LIVE_REQUEST", 0)  # spaced by the window alone
    fast = Monitor.fast(config, window=100)
    most = 0
    with pytest.raises(Violation) as caught:
        for event in events:
            run = fast.run
            most = max(most, len(run.older_events) + len(run.newer_events))  # type: ignore[union-attr]
            fast.feed(event)
    assert most <= 2 * 100 + 50
    report = caught.value.report
    assert (report.invariant, report.line) == (expected[0], expected[1] + 1)  # type: ignore[index, operator]
    spec = Monitor.on_spec(config, raise_on_finding=False)
    spec.feed_all(events)
    assert report.message == spec.report().message
    assert report.history and set(report.history) <= set(spec.report().history)


def test_monitor_reports_as_the_spec_monitor_on_a_short_run() -> None:
    config, events = SEED_RUN
    reports = []
    for engine in ("fast", "spec"):
        with pytest.raises(Violation) as caught:
            with Monitor.fast(config) if engine == "fast" else Monitor.on_spec(config) as monitor:
                monitor.feed_all(events)
        reports.append(caught.value.report)
    assert reports[0] == reports[1]
    with Monitor(safe_run(10)[0]) as monitor:
        assert monitor.feed_all(safe_run(10)[1]) is None
    unknown = Monitor(config, raise_on_finding=False)
    found = unknown.feed(("abort", 5))
    assert found is not None and found.invariant == "Illegal" and "never arrived" in found.message


def test_fast_model_memory_stays_flat() -> None:
    """Peak memory of the fast model does not grow with the stream (interned prefixes are
    collected; finished requests dropped)."""
    peaks = []
    for requests in (60, 240):
        config, events = safe_run(requests, seed=3)
        judge = core.Judge.fast(config)
        fast = judge.model
        fast.collect_floor = fast.collect_at = 64
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            for event in events:
                assert judge.feed(event) is None
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
        finally:
            tracemalloc.stop()
        assert len(fast.node) <= 4 * 64 + 4 * len(fast.requests) * 8
    assert peaks[1] < 1.5 * peaks[0] + 100_000, peaks


@pytest.mark.parametrize("bug", ["engine", "hash"])
def test_check_hands_over_from_a_checkpoint_of_a_file(
    bug: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints every 50 events: a late finding is re-judged from a checkpoint (the state,
    ids and opaque-hash tables exported) to the same verdict as the spec engine's from the
    start, with a history drawn from the spec engine's."""
    monkeypatch.setattr(handover, "FILE_WINDOW", 50)
    monkeypatch.setattr(handover, "EVENTS_PER_LIVE_REQUEST", 0)  # spaced by the window alone
    config, events = safe_run(80)
    path = tmp_path / "late.jsonl"
    if bug == "engine":
        late = next(i for i in range(len(events) - 60, 0, -1) if events[i][0] == "free")
        events = events[:late] + [("free", 0)] + events[late + 1 :]
    write_trace(path, config, events, hashes=True)
    if bug == "hash":  # a late publication reuses the hash of a block published long before
        lines = path.read_bytes().splitlines()
        published: dict[int, tuple[int, str]] = {}  # block -> (line index, hash)
        for i, raw in enumerate(lines[1:], 1):
            obj = orjson.loads(raw)
            if obj["ev"] == "publish":
                old = [h for at, h in published.values() if at < i - 200 and h != obj["hash"]]
                if i > len(lines) // 2 and old:
                    obj["hash"] = old[0]
                    lines[i] = orjson.dumps(obj)
                    break
                published[obj["block"]] = (i, obj["hash"])
            elif obj["ev"] in ("unpublish", "evict"):
                published.pop(obj["block"], None)
        path.write_bytes(b"\n".join(lines) + b"\n")
    fast, spec = check_file(path), check_file(path, engine="spec")
    assert fast.exit_code == spec.exit_code == 1 and fast.line is not None
    assert fast.line > 200
    assert (fast.invariant, fast.line, fast.message) == (spec.invariant, spec.line, spec.message)
    assert fast.history and set(fast.history) <= set(spec.history)
    assert fast.invariant == ("Disagreement" if bug == "engine" else "HashChainConsistent")
    good = tmp_path / "good.jsonl"
    write_trace(good, *safe_run(80), hashes=True)
    assert check_file(good).exit_code == 0


def test_checkpoints_are_spaced_by_the_requests_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint exports every live request, so one is made only once
    ``EVENTS_PER_LIVE_REQUEST`` events per request alive have passed since the last, when that
    is more than the window (a bounded cost per event however many requests wait), and a late
    finding is still the spec engine's."""
    monkeypatch.setattr(handover, "FILE_WINDOW", 50)
    monkeypatch.setattr(handover, "EVENTS_PER_LIVE_REQUEST", 8)
    spacings: list[tuple[int, int]] = []  # (events since the last checkpoint, requests alive)
    checkpoint = handover.FastRun.checkpoint

    def spy(self: handover.FastRun, at: object = None) -> None:
        newer, last = self.newer, self.last
        checkpoint(self, at)
        if self.newer is not newer:
            alive = len(self.newer.model.state.requests)
            spacings.append((self.fast.events_seen - last, alive))

    monkeypatch.setattr(handover.FastRun, "checkpoint", spy)
    config, events = safe_run(80)  # every request arrives first
    late = next(i for i in range(len(events) - 60, 0, -1) if events[i][0] == "free")
    events = events[:late] + [("free", 0)] + events[late + 1 :]
    path = tmp_path / "late.jsonl"
    write_trace(path, config, events, hashes=True)
    fast, spec = check_file(path), check_file(path, engine="spec")
    assert (fast.invariant, fast.line, fast.message) == (spec.invariant, spec.line, spec.message)
    assert spacings and all(gap >= max(50, 8 * alive) for gap, alive in spacings), spacings
    assert len(spacings) >= 2 and any(gap > 50 for gap, _ in spacings), spacings


def test_a_forked_recorder_rings_the_requests_alive_at_the_fork_when_first_named() -> None:
    """The recorder of a checkpoint makes a live request's ring at its first event, not at the
    fork: the history is the same as with every ring made up front, and a request that was not
    alive at the fork and never arrived gets none."""
    recorder = Recorder(4, live=[1, 2])
    assert recorder.request_rings == {}
    recorder.decision(10, ("schedule", 1, 4, 0), None)  # type: ignore[arg-type]
    recorder.effect(11, ("alloc", 1, 3))
    recorder.effect(12, ("alloc", 7, 2))
    recorder.pruned(2)
    recorder.decision(13, ("schedule", 2, 1, 0), None)  # type: ignore[arg-type]
    assert recorder.minimal_history([], [1], None) == [
        (10, ("schedule", 1, 4, 0)),
        (11, ("alloc", 1, 3)),
    ]
    assert recorder.minimal_history([], [2, 7], None) == []
    assert set(recorder.request_rings) == {1}


# -- the background Monitor (conformance/background.py) ------------------------------------------


def background_verdict(
    config: Config, events: list[Event], batch: int, depth: int, one_by_one: bool
) -> tuple[Report, int | None]:
    """The background Monitor's report, and after how many events fed its Violation came (None:
    at close); the child must be gone afterwards, and at most ``depth`` batches waiting."""
    monitor = BackgroundMonitor(config, batch_size=batch, queue_depth=depth)
    bg = monitor.child
    assert bg.proc.poll() is None
    fed = None
    try:
        with monitor:
            if one_by_one:
                for fed, event in enumerate(events, 1):  # noqa: B007 - read after a Violation
                    monitor.feed(event)
                    assert bg.sent - bg.acked <= depth
                fed = None
            else:
                monitor.feed_all(events)
        report = monitor.report()
    except Violation as caught:
        report = caught.report
    assert bg.proc.poll() is not None, "the judge outlived close()"
    return report, fed


def sync_report(config: Config, events: list[Event]) -> Report:
    """The synchronous Monitor's report, as its Violation carries it (or of a clean close)."""
    try:
        with Monitor(config) as monitor:
            monitor.feed_all(events)
    except Violation as caught:
        return caught.report
    return monitor.report()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    run=engine_runs().filter(lambda run: eager(POLICIES[run[0].policy])),
    batch=st.integers(1, 6),
    depth=st.integers(1, 3),
    one_by_one=st.booleans(),
)
@example(run=SEED_RUN, batch=1, depth=1, one_by_one=True)
@example(run=SEED_RUN, batch=1024, depth=8, one_by_one=False)
def test_background_monitor_reports_as_the_synchronous_one(
    run: tuple[Config, list[Event]], batch: int, depth: int, one_by_one: bool
) -> None:
    """Fuzzed reference-engine traces of the unsafe policies (and the seed): the background
    Monitor's report equals the synchronous one's, and its Violation comes fewer than
    (depth + 1) * batch events after the offending event."""
    config, events = run
    want = sync_report(config, events)
    got, fed = background_verdict(config, events, batch, depth, one_by_one)
    assert got == want
    if fed is not None:
        assert want.line is not None and fed - want.line < (depth + 1) * batch
    elif one_by_one and want.line is not None:  # raised at close: the stream ended soon after
        assert len(events) - want.line < (depth + 1) * batch


def test_background_monitor_clean_run_and_a_late_bug() -> None:
    config, events = safe_run(30)
    report, fed = background_verdict(config, events, 64, 2, one_by_one=True)
    assert (report.status, report.exit_code, report.events, fed) == ("holds", 0, len(events), None)
    late = next(i for i in range(len(events) // 2, 0, -1) if events[i][0] == "free")
    bad = events[:late] + [("free", 0)] + events[late + 1 :]
    report, fed = background_verdict(config, bad, 16, 2, one_by_one=True)
    assert report == sync_report(config, bad) and report.invariant == "Disagreement"
    assert fed is not None and late < fed <= late + 3 * 16


def test_background_judge_dies_with_the_engine(tmp_path: Path) -> None:
    """An exception in the engine's code kills the child at the context exit; a parent killed
    outright leaves no child either (its stdin closes)."""
    config, events = safe_run(5)
    monitor = BackgroundMonitor(config, batch_size=4)
    with pytest.raises(KeyError):
        with monitor:
            monitor.feed_all(events[:10])
            raise KeyError("the engine broke")
    assert monitor.child.proc.poll() is not None
    with pytest.raises(JudgeDied, match="stopped"):
        monitor.close()
    script = tmp_path / "engine.py"
    script.write_text(
        "import os, signal, sys\n"
        "from kvspec.conformance.background import BackgroundMonitor\n"
        "from kvspec.spec import Config\n"
        "monitor = BackgroundMonitor(Config(6, 4))\n"
        "print(monitor.child.proc.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    with open(tmp_path / "stderr", "w") as err:  # not a pipe: the judge inherits it
        done = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err)
    assert done.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    child = int(done.stdout)
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)  # not ours: the grandchild is reaped by init
        if _is_zombie(child):  # exited; an init that does not reap leaves it listed
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the background judge {child} outlived its killed parent")
    with pytest.raises(ValueError, match="queue_depth must be a positive int"):
        BackgroundMonitor(config, queue_depth=0)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def test_a_stale_or_missing_build_is_noted_not_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An edited fastmodel.py (or no build at all): the source module judges, and the report
    says so (text and --json), while an unreadable file still gets one line on stderr."""
    config, events = safe_run(8)
    path = tmp_path / "good.jsonl"
    write_trace(path, config, events)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(path.read_bytes() + b"{not json\n")
    edited = tmp_path / "sources"
    edited.mkdir()
    for name in fastbuild.COMPILED:
        (edited / name).write_bytes((fastbuild.HERE / name).read_bytes())
    with open(edited / "fastmodel.py", "a") as f:
        f.write("# edited\n")
    for why, attribute, value in [
        ("older than its source", "HERE", edited),
        ("no compiled module", "FOLDER", tmp_path),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(fastbuild, attribute, value)
            patch.setattr(fastbuild, "_compiled", None)
            judge, note = fastbuild.fast_judge(config)
            assert type(judge) is core.Judge and note is not None and why in note
            report = check_file(path)
            assert report.exit_code == 0 and report.note == note
            assert report.text().endswith(f"[note: {note}]")
            assert report.as_dict()["note"] == note
            assert main(["check", str(bad)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(f"{bad}:"), err
            assert main(["check", "--json", str(path)]) == 0
            assert orjson.loads(capsys.readouterr().out)["reports"][0]["note"] == note
            with Monitor(config) as monitor:
                monitor.feed_all(events)
            assert monitor.report().note == note
    if COMPILED is not None:
        assert check_file(path).note is None


EDGE_LINES = [
    b'{"ev":"free","block":3}',
    b'{"ev":"free","block":3,"block":4}',  # duplicate keys: the last one, as orjson reads it
    b'{"ev":"free","ev":"alloc","req":1,"block":2}',
    b'{"ev":"fr\\u0065e","block":1}',
    b'{"ev":"free","block":true}',
    b'{"ev":"free","block":1.0}',
    b'{"ev":"free","block":-0}',
    b'{"ev":"free","block":24}',
    b'{"ev":"schedule","req":9223372036854775807,"tokens":1,"loaded":0}',
    b'{"ev":"schedule","req":9223372036854775808,"tokens":1,"loaded":0}',
    b'{"ev":"schedule","req":18446744073709551615,"tokens":1,"loaded":0}',
    b'{"ev":"schedule","req":18446744073709551616,"tokens":1,"loaded":0}',
    b'{"ev":"arrive","req":1,"tokens":[],"max_tokens":1,"priority":-9223372036854775808}',
    b'{"ev":"arrive","req":1,"tokens":[5],"max_tokens":1,"priority":-9223372036854775809}',
    b'{"ev":"publish","req":1,"index":0,"block":3,"hash":null}',
    b'{"ev":"publish","req":1,"index":0,"block":3,"hash":""}',
    b'{"ev":"publish","req":1,"index":0,"block":3,"hash":"ab"}',
    b'{"ev":"publish","req":1,"index":0,"block":3,"x_note":1}',
    b'{"ev":"commit","step":1,"sampled":[[1,2,3]]}',
    b'{"ev":"commit","step":1,"sampled":[[1,2]]}',
    b'{"ev":"finish","req":1,"reason":"done"}',
    b'{"ev":"reset"}',
    b'{"ev":"reset","x":1}',
    b"[1]",
    b"",
]


@pytest.mark.parametrize("raw", EDGE_LINES)
def test_the_fast_reader_accepts_exactly_what_parse_line_accepts(raw: bytes) -> None:
    """msgspec decodes a line to parse_line's result or refuses it (parse_line then decides)."""
    from kvspec.conformance.fastread import Error, decoder
    from kvspec.conformance.trace import parse_line

    try:
        want: object = parse_line(raw + b"\n", 24)
    except ValueError:
        want = None
    try:
        got: object = decoder(24)(raw + b"\n")
    except Error:
        return
    assert got == want


@given(step=st.integers(0, 2**40), rid=st.integers(0, 2**40))
def test_a_placeholder_is_a_negative_int_that_maps_back(step: int, rid: int) -> None:
    """The fast model's placeholders are negative ints (token ids are >= 0): one per
    ``spec.Placeholder``, and back."""
    from kvspec.judge.fastmodel import placeholder
    from kvspec.spec import Placeholder

    code = placeholder(step, rid)
    assert code < 0 and spec_placeholder(code) == Placeholder(step, rid)
    assert placeholder(step + 1, rid) != code != placeholder(step, rid + 1)


def test_the_fast_model_refuses_negative_token_ids() -> None:
    """They would read as placeholders; the trace format has none (its readers refuse them)."""
    model = FastModel(Config(8, 4))
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        model.arrive(0, (1, -2), 1, 0)


@pytest.mark.skipif(COMPILED is None, reason=f"no current compiled build: {NOT_COMPILED}")
def test_a_source_edited_after_a_check_is_still_noticed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fastbuild.compiled`` hashes the sources again only when one's modification time or size
    changed (the fuzzer asks once per run): an edit after a first check is still noticed."""
    for name in fastbuild.COMPILED:
        (tmp_path / name).write_bytes((fastbuild.HERE / name).read_bytes())
    monkeypatch.setattr(fastbuild, "HERE", tmp_path)
    assert fastbuild.compiled() == (COMPILED, None)
    assert fastbuild.compiled() == (COMPILED, None)  # from the cache
    with open(tmp_path / "core.py", "a") as f:
        f.write("# edited\n")
    module, why = fastbuild.compiled()
    assert module is None and why is not None and "older than its source" in why
