"""``kvspec check --trace-events`` (``conformance/trace_events.py``): the seed bug's trace as
Chrome trace-event JSON, in the shape Perfetto's JSON loader and chrome://tracing read, with the
partial write, the publish, the preemption, the violation and the zombie's witness read."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from edges import SEED_CONFIG, run, with_effects
from scenarios import SEED

from kvspec.conformance.trace import write_trace

PHASES = {"M", "X", "i", "B", "E"}


def seed_trace(tmp_path: Path) -> Path:
    path = tmp_path / "seed.jsonl"
    write_trace(path, SEED_CONFIG, with_effects(SEED_CONFIG, SEED))
    return path


def valid_shape(document: object) -> list[dict[str, object]]:
    """The trace-event format's shape: a ``traceEvents`` list of objects with ph, ts, pid, tid
    and name; complete events with a positive ``dur``; B and E balanced per track; instant
    events with a scope."""
    assert isinstance(document, dict) and isinstance(document["traceEvents"], list)
    events = document["traceEvents"]
    open_spans: dict[tuple[object, object], int] = {}
    for event in events:
        assert isinstance(event, dict)
        for key in ("ph", "ts", "pid", "tid", "name"):
            assert key in event, (key, event)
        assert event["ph"] in PHASES, event
        assert isinstance(event["ts"], int) and event["ts"] >= 0
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["dur"], int) and event["dur"] > 0
        if event["ph"] == "i":
            assert event["s"] in ("t", "p", "g")
        track = (event["pid"], event["tid"])
        if event["ph"] == "B":
            open_spans[track] = open_spans.get(track, 0) + 1
        if event["ph"] == "E":
            open_spans[track] -= 1
            assert open_spans[track] >= 0
    assert all(n == 0 for n in open_spans.values())
    return events  # type: ignore[return-value]


def test_the_seed_bug_as_a_perfetto_timeline(tmp_path: Path) -> None:
    out = tmp_path / "seed.perfetto.json"
    done = run(["check", str(seed_trace(tmp_path)), "--trace-events", str(out)])
    assert done.returncode == 1 and "NoUnwrittenPublish" in done.stdout
    events = valid_shape(json.loads(out.read_text()))
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}  # type: ignore[index]
    assert names[(2, 1)] == "r1" and names[(3, 4)] == "block 4"
    marks = [(e["ts"], e["pid"], e["tid"], e["name"]) for e in events if e["ph"] == "i"]
    at = {name: ts for ts, _, _, name in marks}
    publish = at["publish [1] as block 4"]  # r1 publishes block 4 ...
    assert at["PREEMPT"] > publish  # ... is preempted before its step writes it ...
    violation = at["VIOLATION NoUnwrittenPublish"]
    assert violation == at["PREEMPT"]
    witness = [m for m in marks if m[3].startswith("WITNESS read") and m[2] == 4]
    assert witness and witness[0][0] > violation  # ... and r3 reads the zombie later
    assert not [m for m in marks if m[2] == 4 and m[1] == 3 and m[3].startswith("write")]
    assert any(m[3].startswith("write partial") for m in marks)
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"step 0", "r1 (live)"}  # r1 never finishes


def test_a_holding_trace_has_a_timeline_without_a_violation(tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl"
    made = run(["simulate", "--policy", "deferred", "--requests", "12", "--blocks", "64",
                "--out", str(path)])  # fmt: skip
    assert made.returncode == 0, made.stderr
    out = tmp_path / "ok.perfetto.json"
    done = run(["check", str(path), "--trace-events", str(out)])
    assert done.returncode == 0, done.stderr
    events = valid_shape(json.loads(out.read_text()))
    assert not [e for e in events if str(e["name"]).startswith("VIOLATION")]
    assert [e for e in events if str(e["name"]).startswith("write full")]


def test_the_html_report_draws_the_same_lanes(tmp_path: Path) -> None:
    report = tmp_path / "seed.html"
    done = run(["check", str(seed_trace(tmp_path)), "--html", str(report)])
    assert done.returncode == 1, done.stderr
    text = report.read_text()
    assert "<svg" in text and "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "<script src" not in text  # one file: nothing fetched
    assert "data-name='r1'" in text and "data-name='block 4'" in text
    assert "class='mark preempt'" in text and "class='mark witness'" in text
    assert "class='mark write-partial'" in text and "class='violation'" in text


def test_a_holding_trace_gets_a_summary_page(tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl"
    made = run(["simulate", "--policy", "deferred", "--requests", "8", "--blocks", "64",
                "--out", str(path)])  # fmt: skip
    assert made.returncode == 0, made.stderr
    report = tmp_path / "ok.html"
    assert run(["check", str(path), "--html", str(report)]).returncode == 0
    text = report.read_text()
    assert "8 requests over" in text and "class='summary'" in text and "<svg" in text


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")
def test_the_html_timeline_renders_in_headless_chromium(tmp_path: Path) -> None:
    """The report opens in a real browser with no network: a screenshot of it is not blank, and
    the page's DOM after its script ran still holds the timeline's marks."""
    report = tmp_path / "seed.html"
    assert run(["check", str(seed_trace(tmp_path)), "--html", str(report)]).returncode == 1
    shot = tmp_path / "seed.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    subprocess.run(
        [str(CHROMIUM), *flags, f"--screenshot={shot}", "--window-size=1600,1400",
         report.as_uri()],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert shot.exists() and shot.stat().st_size > 10_000
    dom = subprocess.run(
        [str(CHROMIUM), *flags, "--dump-dom", report.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    ).stdout  # fmt: skip
    assert 'class="mark witness"' in dom or "class='mark witness'" in dom


def test_fuzz_out_writes_the_timeline_beside_the_trace(tmp_path: Path) -> None:
    out = tmp_path / "cex.jsonl"
    done = run(["fuzz", "--policy", "eager-unsafe", "--preemption", "priority", "--seconds",
                "60", "--out", str(out)])  # fmt: skip
    assert done.returncode == 1, done.stderr
    events = valid_shape(json.loads((tmp_path / "cex.jsonl.perfetto.json").read_text()))
    assert [e for e in events if str(e["name"]).startswith("VIOLATION ")]
