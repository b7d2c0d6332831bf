"""The exit-code contract (cli.py's docstring), case by case as issue #14 lists them.

0 holds/done, 1 a finding, 2 bad input (one line naming the place), 3 undecided, 4 an internal
error of kvspec (one line naming a saved crash report). Each case runs kvspec as a user does (its
own process) unless it needs a planted fault, which only an in-process call can plant.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
from edges import KVSPEC, one_line, run, seed_counterexample

from kvspec import cli
from kvspec.cli import main
from kvspec.conformance.kvevents.frames import Frame, encode_batch, write_capture
from kvspec.conformance.trace import write_events, write_trace
from kvspec.spec.stream import Batch, Removed, Stored


@pytest.fixture
def zombie(tmp_path: Path) -> Path:
    """The seed bug's counterexample (a NoUnwrittenPublish), as kvspec check reads it."""
    config, events = seed_counterexample()
    path = tmp_path / "zombie.jsonl"
    write_trace(path, config, events)
    return path


def test_engine_registers_without_a_target_is_bad_input_not_a_traceback() -> None:
    done = run(["fuzz", "--policy", "engine-registers", "--seconds", "5"])
    assert done.returncode == 2 and one_line(done.stderr), done.stderr
    assert "--target" in done.stderr and "--groups" in done.stderr


@pytest.mark.parametrize("seconds", ["nan", "inf", "-1", "0"])
def test_fuzz_budgets_that_are_not_a_duration_are_refused(seconds: str) -> None:
    done = run(["fuzz", "--policy", "deferred", "--seconds", seconds])
    assert done.returncode == 2 and one_line(done.stderr) and "--seconds" in done.stderr


def test_a_fuzz_that_ran_nothing_is_undecided_not_holds() -> None:
    done = run(["fuzz", "--policy", "deferred", "--seconds", "1e-9"])
    assert done.returncode == 3, done.stdout + done.stderr
    assert "nothing checked" in done.stdout


def test_fuzz_output_path_is_checked_before_fuzzing(tmp_path: Path) -> None:
    started = time.monotonic()
    for out in ("/nonexistent/x", str(tmp_path)):
        done = run(["fuzz", "--policy", "eager-unsafe", "--seconds", "600", "--out", out])
        assert done.returncode == 2 and one_line(done.stderr) and "--out" in done.stderr
    assert time.monotonic() - started < 120  # not after 600 s of fuzzing


def test_replay_with_huge_shapes_says_what_it_would_take(zombie: Path) -> None:
    done = run(["replay", str(zombie), "--heads", "100000", "--head-dim", "4096"])
    assert done.returncode == 2 and one_line(done.stderr), done.stderr
    assert "would take about" in done.stderr and "--max-memory" in done.stderr


def test_simulate_with_a_huge_pool_says_what_it_would_take(tmp_path: Path) -> None:
    argv = ["simulate", "--policy", "deferred", "--blocks", "1000000000"]
    done = run(argv + ["--out", str(tmp_path / "e.jsonl")])
    assert done.returncode == 2 and one_line(done.stderr), done.stderr
    assert "would take about" in done.stderr and "--max-memory" in done.stderr
    assert not (tmp_path / "e.jsonl").exists()


def test_a_closed_pipe_keeps_the_verdict(zombie: Path) -> None:
    """``kvspec check f | head -1``: the reader leaves after one line; exit 1 stands. Enough
    copies of the file that the output overflows the pipe's buffer."""
    proc = subprocess.Popen(
        KVSPEC + ["check"] + [str(zombie)] * 300, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 1, err
    assert b"NoUnwrittenPublish" in first and b"Traceback" not in err and err == b""


def test_help_through_a_closed_pipe_exits_0() -> None:
    done = subprocess.run(
        ["bash", "-c", " ".join(KVSPEC) + " fuzz --help | head -1; exit ${PIPESTATUS[0]}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_check_html_into_a_folder_is_refused_before_judging(zombie: Path, tmp_path: Path) -> None:
    done = run(["check", str(zombie), "--html", str(tmp_path)])
    assert done.returncode == 2 and one_line(done.stderr) and "folder" in done.stderr


def test_a_report_that_cannot_be_written_late_keeps_the_finding(
    zombie: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from kvspec.conformance import html

    def full_disk(reports: object, path: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(html, "write_html", full_disk)
    assert main(["check", str(zombie), "--html", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err
    assert one_line(err) and "No space left" in err


def test_replay_with_nothing_to_compare_is_undecided(tmp_path: Path) -> None:
    from edges import SEED_CONFIG, with_effects

    path = tmp_path / "idle.jsonl"
    write_events(path, SEED_CONFIG, with_effects(SEED_CONFIG, [("arrive", 0, (1, 2), 1, 0)]))
    done = run(["replay", str(path), "--backend", "torch"])
    assert done.returncode == 3, done.stdout + done.stderr
    assert "nothing to compare" in done.stdout


@pytest.mark.parametrize(
    "lines",
    [
        [
            '{"format":"kvspec-events","version":0,"config":{"num_blocks":4,"block_size":4}}',
            '["teleport",1]',
        ],
        [
            '{"format":"kvspec-trace","version":1,"engine":{"name":"e","version":"1"},"num_blocks":4,"block_size":4,"null_block":0,"guarantees":{"writes_before_reads":true,"steps_execute_in_order":true,"submitted_steps_write":true},"model":{}}',
            '{"ev":"teleport"}',
        ],
    ],
    ids=["v0", "v1"],
)
def test_an_unknown_event_kind_is_bad_input_in_both_formats(
    tmp_path: Path, lines: list[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    for engine in ("fast", "spec"):
        done = run(["check", str(path), "--engine", engine])
        assert done.returncode == 2 and one_line(done.stderr), (engine, done.stderr)
        assert done.stderr.startswith(f"{path}:2: unknown event kind 'teleport'")


def test_an_internal_error_is_4_with_a_saved_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("KVSPEC_CACHE_DIR", str(tmp_path / "cache"))

    def broken(args: object) -> int:
        return {}["planted"]  # type: ignore[no-any-return]  # a KeyError: a bug of kvspec

    monkeypatch.setitem(cli.COMMANDS, "demo", broken)
    assert main(["demo", "--seconds", "1"]) == 4
    err = capsys.readouterr().err
    assert one_line(err) and "internal error" in err and "KeyError" in err
    (report,) = (tmp_path / "cache").glob("crash-*.txt")
    assert report.name in err
    text = report.read_text()
    for part in (
        "Traceback",
        "KeyError: 'planted'",
        "kvspec 0.",
        "command: kvspec demo --seconds 1",
        "python: 3.",
    ):
        assert part in text, part


def test_an_internal_error_is_never_1(
    monkeypatch: pytest.MonkeyPatch, zombie: Path, capsys: pytest.CaptureFixture
) -> None:
    """A fast model that disagrees with the spec (a planted bug) is kvspec's error, not a
    violation of the trace."""
    from kvspec.judge import handover

    def disagree(self: object, finding: object, name: str) -> None:
        raise handover.FastPathDisagrees(f"{name}: planted")

    monkeypatch.setattr(handover.FastRun, "agree", disagree)
    monkeypatch.setenv("KVSPEC_CACHE_DIR", str(Path(str(zombie)).parent / "cache"))
    assert main(["check", str(zombie)]) == 4
    assert "FastPathDisagrees" in capsys.readouterr().err


def test_running_out_of_memory_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def hungry(args: object) -> int:
        raise MemoryError

    monkeypatch.setitem(cli.COMMANDS, "demo", hungry)
    assert main(["demo", "--max-memory", "1G"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "1.0 GiB" in err and "--max-memory" in err


def test_version() -> None:
    import kvspec

    done = run(["--version"])
    assert done.returncode == 0 and done.stdout.startswith(f"kvspec {kvspec.__version__} ")


# -- the commands of the KV-event streams and the async flags, under the same contract ------------

STORE = Batch(0, (Stored((1, 2), None, (1, 2, 3, 4), 2, "GPU", 0),))
ORPHAN = Batch(1, (Removed((7,), "GPU", 0),))


def capture(path: Path, *batches: Batch) -> Path:
    write_capture(path, [Frame("pub", b.seq, b"", encode_batch(b)) for b in batches])
    return path


def test_check_kv_events_follows_the_contract(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    clean = capture(tmp_path / "clean.jsonl", STORE)
    bad = capture(tmp_path / "bad.jsonl", STORE, ORPHAN)
    assert main(["check", "--kv-events", str(clean)]) == 0
    assert main(["check", "--kv-events", str(bad)]) == 1
    capsys.readouterr()
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(clean.read_bytes() + b"not json\n")
    for path, where in ((broken, f"{broken}:3:"), (tmp_path / "missing.jsonl", "missing.jsonl")):
        assert main(["check", "--kv-events", str(path)]) == 2
        err = capsys.readouterr().err
        assert one_line(err) and where in err, err
    assert main(["check", "--kv-events", str(bad), "--html", str(tmp_path)]) == 2  # a folder
    assert one_line(capsys.readouterr().err)
    assert main(["check", "--kv-events", str(bad), "--witness", str(tmp_path / "w")]) == 2
    assert one_line(capsys.readouterr().err)
    from kvspec.conformance.kvevents import stream_judge

    def broken_judge(*args: object, **kw: object) -> object:
        raise KeyError("planted")

    monkeypatch.setenv("KVSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(stream_judge, "check_capture", broken_judge)
    assert main(["check", "--kv-events", str(clean)]) == 4
    err = capsys.readouterr().err
    assert one_line(err) and "internal error" in err and "KeyError" in err
    assert len(list((tmp_path / "cache").glob("crash-*.txt"))) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_watch_follows_the_contract(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("zmq")
    endpoint = f"tcp://127.0.0.1:{_free_port()}"  # nobody publishes there
    assert main(["watch", endpoint, "--seconds", "0.3"]) == 3  # nothing judged: undecided
    assert "nothing received" in capsys.readouterr().out
    for argv in (["foo"], [endpoint, "--capture", str(tmp_path)], [endpoint, "--seconds", "nan"]):
        assert main(["watch", *argv]) == 2
        assert one_line(capsys.readouterr().err)
    from kvspec.conformance.kvevents import watch

    def broken_judge(*args: object, **kw: object) -> object:
        raise KeyError("planted")

    monkeypatch.setenv("KVSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(watch, "StreamJudge", broken_judge)
    assert main(["watch", endpoint, "--seconds", "0.3"]) == 4
    err = capsys.readouterr().err
    assert one_line(err) and "internal error" in err and "KeyError" in err


def test_the_async_flags_follow_the_contract(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    flags = ["--policy", "deferred", "--async", "--stale-output", "deliver"]
    done = run(["simulate", *flags, "--requests", "20", "--format", "v1", "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert run(["check", str(out)]).returncode == 0
    for argv, words in (
        (["simulate", *flags, "--depth", "1", "--out", str(out)], "--depth >= 2"),
        (["simulate", *flags, "--blocks", "1000000000", "--out", str(out)], "would take about"),
        (["fuzz", *flags, "--seconds", "600", "--out", "/nonexistent/x"], "--out"),
    ):
        done = run(argv)
        assert done.returncode == 2 and one_line(done.stderr) and words in done.stderr, argv
    done = run(["fuzz", *flags, "--seconds", "1e-9"])
    assert done.returncode == 3 and "nothing checked" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("fmt", ["v0", "v1"])
def test_a_boolean_version_is_bad_input_not_version_0_or_1(zombie: Path, fmt: str) -> None:
    """Found by ``bench/hostile.py`` (101,000 cases): JSON ``true`` == 1 and ``false`` == 0 in
    Python, so a header claiming ``"version": true`` was read as version 1 (47 silent
    acceptances)."""
    config, events = seed_counterexample()
    path = zombie.with_name(f"bool-{fmt}.jsonl")
    (write_trace if fmt == "v1" else write_events)(path, config, events)
    head, rest = path.read_text().split("\n", 1)
    header = json.loads(head)
    header["version"] = header["version"] == 1  # the same value, as a boolean
    path.write_text(json.dumps(header) + "\n" + rest)
    for engine in ("fast", "spec"):
        done = run(["check", str(path), "--engine", engine])
        assert done.returncode == 2 and one_line(done.stderr), (engine, done.stderr)
        assert done.stderr.startswith(f"{path}:1: unsupported"), done.stderr


def test_a_depth_past_the_limit_is_bad_input_not_an_internal_error() -> None:
    """Found by ``bench/hostile.py``: ``fuzz --depth 10**30`` ended in Hypothesis's
    FlakyStrategyDefinition (exit 4)."""
    for argv in (
        ["fuzz", "--policy", "deferred"],
        ["simulate", "--policy", "deferred", "--out", "x"],
    ):
        done = run([*argv, "--depth", str(10**30)])
        assert done.returncode == 2 and one_line(done.stderr), done.stderr
        assert f"must be 1..{cli.MAX_DEPTH}" in done.stderr
