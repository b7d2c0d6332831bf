"""Trace format v1 and the streaming checker: 0 holds, 1 violation, 2 unreadable, never a crash."""

from __future__ import annotations

import importlib.resources
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvspec.cli import main
from kvspec.conformance import fastread
from kvspec.conformance.check import check_file
from kvspec.conformance.fuzz import run_cell
from kvspec.conformance.monitor import MalformedEvent, Monitor, Violation
from kvspec.conformance.trace import (
    FIELDS,
    MODEL_FIELDS,
    SPEC_DEFAULTS,
    TraceError,
    iter_trace,
    read_trace,
    to_json,
    write_events,
    write_trace,
)
from kvspec.judge import Judge, core, fastbuild
from kvspec.reference import Engine, EngineConfig
from kvspec.reference.workload import shared_prefix_workload
from kvspec.spec import Config
from kvspec.spec.events import WHEN_SET

KVSPEC = [sys.executable, "-m", "kvspec"]
SAFE = dict(
    num_blocks=24,
    block_size=4,
    depth=2,
    policy="deferred",
    discipline="vllm",
    preemption="priority",
    token_budget=24,
    max_running=6,
)


def safe_run(requests: int = 40, seed: int = 0, **overrides: object) -> tuple[Config, list]:
    common = {**SAFE, **overrides}
    engine = Engine(EngineConfig(**common))  # type: ignore[arg-type]
    for rid, prompt, max_tokens, priority in shared_prefix_workload(requests, 3, 8, 3, 5, seed):
        engine.add_request(rid, prompt, max_tokens, priority)
    engine.run()
    return Config(**common), engine.events  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def counterexample() -> tuple[Config, list]:
    result = run_cell("eager-unsafe", "general", "priority", None, False, 30, 1)
    assert result.failure is not None
    return result.failure.config, result.failure.events


@pytest.fixture(scope="module")
def good_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("t") / "good.jsonl"
    config, events = safe_run()
    write_trace(path, config, events, hashes=True)
    return path


def test_round_trip_and_schema_ships(good_trace: Path) -> None:
    config, events = safe_run()
    assert read_trace(good_trace) == (config, [tuple(e) for e in events])
    schema = json.loads(
        importlib.resources.files("kvspec.conformance").joinpath("trace-v1.schema.json").read_text()
    )
    assert set(FIELDS) <= set(schema["$defs"])
    for kind, fields in FIELDS.items():
        assert schema["$defs"][kind]["required"] == ["ev"] + [name for name, _ in fields]
    # every header model field the reader takes, the schema allows (its model is closed)
    model = schema["$defs"]["header"]["properties"]["model"]
    assert model["additionalProperties"] is False and set(MODEL_FIELDS) <= set(model["properties"])


def test_safe_trace_holds_and_the_checker_agrees_with_the_judge(good_trace: Path) -> None:
    assert main(["check", str(good_trace)]) == 0
    config, events = read_trace(good_trace)
    judge = Judge.spec(config)
    assert judge.feed_all(events) is None and judge.settle() is None
    assert check_file(good_trace, check_every=25).exit_code == 0


def test_v0_event_files_are_checked_too(tmp_path: Path) -> None:
    config, events = safe_run(10)
    write_events(tmp_path / "v0.jsonl", config, events)
    assert check_file(tmp_path / "v0.jsonl").exit_code == 0


def test_eager_unsafe_counterexample_is_a_violation(
    counterexample: tuple[Config, list], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, events = counterexample
    path = tmp_path / "cex.jsonl"
    write_trace(path, config, events, hashes=True)
    judge = Judge.spec(config)
    finding = judge.feed_all(events)
    assert finding is not None
    html = tmp_path / "report.html"
    assert main(["check", str(path), "--json", "--html", str(html)]) == 1
    document = json.loads(capsys.readouterr().out)
    violation = document["reports"][0]["violation"]
    assert document["exit"] == 1 and violation["invariant"] == finding.invariant
    assert violation["line"] == finding.event + 2  # the header is line 1
    assert violation["where"] == f"{path}:{finding.event + 2}"
    assert violation["explanation"] and violation["history"]
    assert all(item["line"] <= violation["line"] for item in violation["history"])
    text = html.read_text()
    assert "<img" in text and "data:image/png;base64,iVBOR" in text
    # The incremental mode finds it too (possibly later).
    report = check_file(path, check_every=7)
    assert report.exit_code == 1 and report.line is not None and report.line >= violation["line"]


def test_monitor_in_process(counterexample: tuple[Config, list]) -> None:
    config, events = safe_run(15)
    with Monitor(config) as monitor:
        for event in events:
            monitor.feed(event)
    config, events = counterexample
    with pytest.raises(Violation, match="NoUnwritten"):
        with Monitor(config) as monitor:
            monitor.feed_all(events)


def _malformed(event: tuple) -> list[tuple]:
    """Ways an in-process event can be malformed: a field missing or extra, a field of the
    wrong type (a string, None, a fraction, a list for a number, a dict for a list)."""
    # an extra field; a kind with an optional last field (spec.events.WHEN_SET: a schedule's
    # bound) takes one, so its extra value is one that field never has
    out: list[tuple] = [(*event, -1 if event[0] in WHEN_SET else 0)]
    if len(event) > 1 and event[0] not in SPEC_DEFAULTS:  # else the short form is the default
        out.append(event[:-1])
    for i in range(1, len(event)):
        value = event[i]
        if isinstance(value, tuple):
            wrong: list[object] = [{}, ("x",), (-1,), list(value)]  # a list: not a tuple
        elif isinstance(value, str):  # a finish's reason
            wrong = ["nonsense", 1, None]
        else:
            wrong = ["x", None, value + 0.5, [value]]
        out += [(*event[:i], w, *event[i + 1 :]) for w in wrong]
    return out


MONITORS = {
    "fast": Monitor.fast,
    "fast_source": Monitor.fast,  # KVSPEC_FAST_MODEL=source: the uncompiled fast model
    "on_spec": Monitor.on_spec,
    "observed": Monitor.observed,
}


@pytest.mark.parametrize("kind", sorted(MONITORS))
def test_a_malformed_event_is_bad_input_naming_it_never_a_finding_or_a_crash(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every kind of event in a clean run, made malformed in each way at its place: the monitor
    raises ``MalformedEvent`` naming that event's number, never ``Violation`` or another error;
    the well-formed run holds. The fast model from source too (what runs where the compiled build
    is missing or stale): it takes some malformed values without raising (a list of failed loads),
    so the monitor must refuse them before it does."""
    if kind == "fast_source":
        monkeypatch.setenv(fastbuild.ENV, "source")
    config, events = safe_run(6)
    with MONITORS[kind](config) as monitor:
        monitor.feed_all(events)  # holds
    first: dict[str, int] = {}
    for i, event in enumerate(events):
        first.setdefault(event[0], i)
    assert {"arrive", "schedule", "commit", "execute", "alloc", "free", "hit"} <= set(first)
    tried = 0
    for at in sorted(first.values()):
        for bad in [*_malformed(events[at]), (), ("nope", 1), "schedule"]:
            monitor = MONITORS[kind](config)
            with pytest.raises(MalformedEvent) as raised:
                for event in [*events[:at], bad, *events[at + 1 :]]:
                    monitor.feed(event)  # type: ignore[arg-type]
                monitor.close()
            assert raised.value.number == at + 1, (bad, str(raised.value))
            assert str(raised.value).startswith(f"<monitor>:{at + 1}: ")
            assert "\n" not in str(raised.value)
            tried += 1
    assert tried > 100


def test_a_malformed_value_the_fast_model_keeps_is_refused_where_it_is_fed() -> None:
    """An arrival's or a commit's values stay in the model (a priority of 0.5 compares, a prompt
    token of 1.0 hashes like 1), so they may never raise or make a finding: the fast monitor
    checks these two kinds as they come, before its kept window (here 2 events) forgets them."""
    config, events = safe_run(40)
    arrival = next(i for i, e in enumerate(events) if e[0] == "arrive")
    commit = next(i for i, e in enumerate(events) if e[0] == "commit" and e[2])
    rid, prompt, max_tokens, priority = events[arrival][1:]
    step, sampled = events[commit][1:]
    for at, bad in [
        (arrival, ("arrive", rid, prompt, max_tokens, priority + 0.5)),
        (arrival, ("arrive", rid, (float(prompt[0]), *prompt[1:]), max_tokens, priority)),
        (commit, ("commit", step, ((sampled[0][0], float(sampled[0][1])), *sampled[1:]))),
    ]:
        monitor = Monitor.fast(config, window=2)
        with pytest.raises(MalformedEvent) as raised:
            monitor.feed_all([*events[:at], bad, *events[at + 1 :]])
            monitor.close()
        assert raised.value.number == at + 1


def test_hash_chain_mismatch_is_a_violation(good_trace: Path, tmp_path: Path) -> None:
    assert check_file(good_trace).exit_code == 0  # its hashes are consistent
    lines = good_trace.read_bytes().splitlines()
    for i, raw in enumerate(lines):
        if b'"publish"' in raw:  # one hash for every prefix: a collision
            obj = orjson.loads(raw)
            obj["hash"] = "same"
            lines[i] = orjson.dumps(obj)
    bad = tmp_path / "hash.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    report = check_file(bad)
    assert report.exit_code == 1 and report.invariant == "HashChainConsistent"
    assert "hash" in (report.explanation or "")


def _unknown_in_commit(lines: list[bytes]) -> list[bytes]:
    """The first commit also samples for r777, which never arrived (the judge checks a commit's
    requests one by one, not through ``requests_named``)."""
    at = next(i for i, raw in enumerate(lines) if b'"ev":"commit"' in raw)
    raw = lines[at].replace(b'"sampled":[', b'"sampled":[[777,1],', 1)
    return lines[:at] + [raw] + lines[at + 1 :]


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda ls: ls[:3] + [ls[3][:-5]] + ls[4:], "not JSON"),
        (lambda ls: ls[:3] + [b"[1, 2"] + ls[3:], "not JSON"),
        (lambda ls: ls[:3] + [b'{"ev": "teleport"}'] + ls[3:], "unknown event kind"),
        (lambda ls: [ls[0].replace(b'"version":1', b'"version":2')] + ls[1:], "version 2"),
        (lambda ls: ls[:2] + [b'{"ev": "begin"}'] + ls[2:], 'missing field "step"'),
        (lambda ls: ls[:2] + [b'{"ev": "begin", "step": "0"}'] + ls[2:], "must be an integer"),
        (lambda ls: ls[:2] + [b'{"ev": "begin", "step": true}'] + ls[2:], "a boolean"),
        (lambda ls: ls[:2] + [b'{"ev": "free", "block": 99}'] + ls[2:], "out of range"),
        (lambda ls: ls[:2] + [b'{"ev": "free", "block": -1}'] + ls[2:], ">= 0"),
        (lambda ls: ls[:2] + [b'{"ev": "abort", "req": 777}'] + ls[2:], "never arrived"),
        (_unknown_in_commit, "commit: request r777 never arrived"),
        (lambda ls: ls[:1] + [b'{"ev": "free", "block": 1}'] + ls[1:], "before any decision"),
        (lambda ls: [b""], "empty header line"),
        (lambda ls: [ls[0].replace(b'"format":"kvspec-trace"', b'"format":"x"')], "not a kvspec"),
        (lambda ls: [ls[0].replace(b"}}", b',"x":1}}')] + ls[1:], 'unknown "model" field'),
        (lambda ls: [ls[0][:-1] + b',"tokens":"private"}'] + ls[1:], "tokens-private"),
    ],
)
def test_corrupted_files_exit_2_with_file_and_line(
    good_trace: Path, tmp_path: Path, mutate, fragment: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(mutate(good_trace.read_bytes().splitlines())) + b"\n")
    done = subprocess.run(KVSPEC + ["check", str(bad)], capture_output=True, text=True)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"{bad}:") and done.stderr.count("\n") == 1
    assert fragment in done.stderr and "Traceback" not in done.stderr


def test_trace_error_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text("{}\n")
    with pytest.raises(TraceError) as caught:
        iter_trace(bad)
    assert str(caught.value).startswith(f"{bad}:1: ")


def _corrupt(lines: list[bytes], data: st.DataObject) -> list[bytes]:
    """One to three random corruptions of a valid trace."""
    for _ in range(data.draw(st.integers(1, 3))):
        n = len(lines)
        i = data.draw(st.integers(0, n - 1))
        how = data.draw(
            st.sampled_from(
                [
                    "truncate",
                    "delete",
                    "duplicate",
                    "swap",
                    "kind",
                    "drop",
                    "retype",
                    "range",
                    "noise",
                ]
            )
        )
        if how == "truncate":
            lines[i] = lines[i][: data.draw(st.integers(0, max(0, len(lines[i]) - 1)))]
        elif how == "delete" and n > 1:
            del lines[i]
        elif how == "duplicate":
            lines.insert(i, lines[i])
        elif how == "swap":
            j = data.draw(st.integers(0, n - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif how == "noise":
            lines[i] = data.draw(st.binary(max_size=20))
        else:
            try:
                obj = orjson.loads(lines[i])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(obj, dict) or not obj:
                continue
            key = data.draw(st.sampled_from(sorted(obj)))
            if how == "kind":
                obj["ev"] = data.draw(st.sampled_from(sorted(FIELDS) + ["nope", 3]))
            elif how == "drop":
                del obj[key]
            elif how == "retype":
                obj[key] = data.draw(
                    st.sampled_from([None, True, 1.5, "x", [], {}, [True], [[1]], -3, 10**18])
                )
            elif how == "range":
                obj[key] = data.draw(st.integers(-5, 10**6))
            lines[i] = orjson.dumps(obj)
    return lines


@pytest.fixture(scope="module")
def small_traces(
    tmp_path_factory: pytest.TempPathFactory, counterexample: tuple[Config, list]
) -> list[list[bytes]]:
    folder = tmp_path_factory.mktemp("small")
    out = []
    for name, (config, events) in {
        "safe": safe_run(6, num_blocks=10, max_running=3),
        "cex": counterexample,
    }.items():
        path = folder / f"{name}.jsonl"
        write_trace(path, config, events, hashes=True)
        out.append(path.read_bytes().splitlines())
    return out


@settings(max_examples=4000, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_corrupted_traces_never_crash_the_checker(
    small_traces: list[list[bytes]], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    lines = list(data.draw(st.sampled_from(small_traces)))
    lines = _corrupt(lines, data)
    path = tmp_path_factory.getbasetemp() / "corrupt.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    report = check_file(path)  # must not raise
    assert report.exit_code in (0, 1, 2)
    if report.exit_code == 2:
        assert report.error is not None and report.error.startswith(f"{path}:")
        line = report.error[len(str(path)) + 1 :].split(":", 1)[0]
        assert line.isdigit() and "\n" not in report.error
    if report.exit_code == 1:
        assert report.invariant and report.line is not None


def tracemalloc_peak(judge: Judge, events: list[tuple[object, ...]]) -> int:
    """Bytes allocated at peak (above what was live before) while ``judge`` judges ``events``."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for event in events:
            if judge.feed(event) is not None:
                break
        judge.finish()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_memory_stays_flat() -> None:
    """Peak memory while checking a stream does not grow with its length."""
    peaks = []
    for requests in (60, 240):
        config, events = safe_run(requests, seed=3)
        # Rings of up to 16 finished requests are kept for reports (256 by default).
        peaks.append(tracemalloc_peak(Judge.stream(config, retired_requests=16), events))
    assert peaks[1] < 1.5 * peaks[0] + 200_000, peaks


def test_simulate_writes_v1_that_check_and_replay_read(tmp_path: Path) -> None:
    out = tmp_path / "sim.jsonl"
    argv = ["simulate", "--policy", "eager-rollback-fifo", "--requests", "6", "--blocks", "32"]
    assert main(argv + ["--block-size", "4", "--format", "v1", "--out", str(out)]) == 0
    assert orjson.loads(out.read_bytes().splitlines()[0])["format"] == "kvspec-trace"
    assert main(["check", str(out)]) == 0
    assert main(["replay", str(out), "--backend", "torch", "--layers", "1"]) == 0


def test_the_fast_path_freezes_the_judges_state_and_unfreezes_it_at_the_end(
    good_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``check.long_lived``: the collector skips the long-lived state while a file is judged
    (``gc.freeze`` every ``FREEZE_EVERY`` events) and collects the youngest generation every
    ``YOUNG`` allocations; nothing stays frozen after, and the threshold is the caller's again."""
    import gc

    from kvspec.conformance import check

    calls: list[int] = []
    thresholds: list[tuple[int, int, int]] = []
    freeze = gc.freeze

    def counted() -> None:
        calls.append(1)
        thresholds.append(gc.get_threshold())
        freeze()

    monkeypatch.setattr(check, "FREEZE_EVERY", 50)
    monkeypatch.setattr(check.gc, "freeze", counted)
    assert gc.get_freeze_count() == 0
    before = gc.get_threshold()
    report = check_file(good_trace)
    assert report.exit_code == 0 and report.events > 200
    assert len(calls) >= report.events // 50 - 1
    assert gc.get_freeze_count() == 0
    assert {t[0] for t in thresholds} == {check.YOUNG} and gc.get_threshold() == before


FAST_BUILDS = [pytest.param(core, id="source")] + (
    [pytest.param(fastbuild.compiled()[0], id="compiled")] if fastbuild.compiled()[0] else []
)


@pytest.mark.parametrize("build", FAST_BUILDS)
def test_an_effects_line_is_the_writers_and_decodes_to_the_effect(build: object) -> None:
    """``FileFeed.due_line``: the line of each effect it makes is the one ``write_trace`` writes
    (else the effect due is never matched as a line) and decodes to that effect (else a line
    would be fed as another event than it is); ``b""`` for the kinds it does not make."""
    config = Config(**{**SAFE, "num_blocks": 300})  # type: ignore[arg-type]
    judge = build.Judge.fast(config)  # type: ignore[attr-defined]
    feed = judge.file_feed(iter(()), 1, fastread.parts(300), None, 1 << 20)
    decode = fastread.decoder(300)
    effects = [("free", 0), ("free", 299), ("evict", 17), ("unpublish", 12), ("alloc", 0, 1)]
    effects += [("alloc", 123_456, 299)] + [
        ("finish", 7, why) for why in ("length", "stop", "abort")
    ]
    for effect in effects:
        line = feed.due_line(effect)
        assert line == orjson.dumps(to_json(effect)) + b"\n"
        assert decode(line) == (effect, None)
        assert feed.due_line(effect) == line  # a block's line, once made, is kept
    for other in [("publish", 1, 0, 3), ("hit", 1, (2, 3)), ("load_failed", 4)]:
        assert feed.due_line(other) == b""


@pytest.mark.parametrize("build", FAST_BUILDS)
@pytest.mark.parametrize("spaced", [False, True], ids=["written", "spaced"])
def test_an_effect_matched_as_a_line_is_judged_as_decoded(
    tmp_path: Path, build: object, spaced: bool
) -> None:
    """The effect due matched as a line (``FileFeed``) or decoded (the same trace with spaces
    in every line, which no made line equals): the same verdicts, a wrong block at its line."""
    config, events = safe_run(40)
    kinds = {"free", "evict", "alloc", "finish"}
    assert kinds <= {e[0] for e in events}
    at = max(i for i, e in enumerate(events) if e[0] == "free")
    wrong = list(events)
    wrong[at] = ("free", (events[at][1] + 1) % config.num_blocks)
    for trace, exit_code in ((events, 0), (wrong, 1)):
        path = tmp_path / "t.jsonl"
        write_trace(path, config, trace)
        if spaced:
            lines = path.read_bytes().splitlines()
            path.write_bytes(
                b"\n".join(lines[:1] + [json.dumps(orjson.loads(x)).encode() for x in lines[1:]])
                + b"\n"
            )
        report = check_file(path, build=build)  # type: ignore[arg-type]
        assert report.exit_code == exit_code, report.text()
        if exit_code:
            assert (report.line, report.invariant) == (at + 2, "Disagreement"), report.text()


KIND_FIELD_LINES = [
    b'{"ev":"schedule","req":1,"tokens":2,"loaded":0,"x_kvspec_kind":"schedule"}',
    b'{"x_kvspec_kind":"schedule","ev":"schedule","req":1,"tokens":2,"loaded":0}',
    b'{"ev":"schedule","req":1,"tokens":2,"loaded":0,"x_kvspec_kind":"free"}',
    b'{"ev":"schedule","req":1,"tokens":2,"loaded":0,"x_kvspec_kind":null}',
    b'{"ev":"free","block":3,"x_kvspec_kind":"free","x_kvspec_kind":"alloc"}',
    b'{"ev":"publish","req":1,"index":0,"block":3,"hash":"ab","x_kvspec_kind":7}',
    b'{"ev":"reset","x_kvspec_kind":"reset"}',
]


@pytest.mark.parametrize("raw", KIND_FIELD_LINES)
def test_a_line_that_carries_the_readers_kind_field_reads_as_parse_line_reads_it(
    raw: bytes,
) -> None:
    """The fast reader's structs hold the kind in an ``x_`` field of their own
    (``fastread.KIND_FIELD``): a line that carries it (any value) is the event ``parse_line``
    reads, which ignores ``x_`` fields, or msgspec refuses it and ``parse_line`` decides."""
    from kvspec.conformance.trace import parse_line

    assert fastread.KIND_FIELD.encode() in raw
    want = parse_line(raw + b"\n", 24)
    try:
        got = fastread.decoder(24)(raw + b"\n")
    except fastread.Error:
        return
    assert got == want
