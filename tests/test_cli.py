"""The command line: exit codes, one-line errors, the fuzz and simulate round trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.conformance.trace import read_events
from kvspec.judge import Judge

KVSPEC = [sys.executable, "-m", "kvspec"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["fuzz"], "--policy"),
        (["fuzz", "--policy", "nope"], "invalid choice"),
        (["fuzz", "--policy", "deferred", "--depth", "0"], "must be 1..64"),
        (["fuzz", "--policy", "deferred", "--seconds", "soon"], "not a number"),
        (["simulate", "--policy", "deferred"], "--out"),
        (["teleport"], "invalid choice"),
        (["prove", "--policy", "deferred", "--blocks", "99"], "--blocks: must be 2..8"),
        (["prove", "--policy", "deferred", "--bound", "-1"], "--bound: must be 1..40"),
        (["fuzz", "--policy", "deferred", "--async", "--depth", "1"], "--depth >= 2"),
        (["fuzz", "--policy", "deferred", "--stale-output", "later"], "invalid choice"),
        (
            [
                "simulate",
                "--policy",
                "deferred",
                "--stale-output",
                "deliver",
                "--depth",
                "1",
                "--out",
                "x.jsonl",
            ],
            "--depth >= 2",
        ),  # fmt: skip
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: list[str], fragment: str) -> None:
    done = subprocess.run(KVSPEC + argv, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and fragment in done.stderr
    assert "Traceback" not in done.stderr


def test_simulate_impossible_config_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "e.jsonl"
    argv = ["simulate", "--policy", "deferred", "--blocks", "2", "--out", str(out)]
    done = subprocess.run(KVSPEC + argv, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_simulate_writes_events_the_spec_accepts(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    argv = ["simulate", "--policy", "deferred", "--requests", "30", "--blocks", "64"]
    assert main(argv + ["--block-size", "4", "--depth", "2", "--out", str(out)]) == 0
    config, events = read_events(out)
    assert config.depth == 2 and len(events) > 100
    judge = Judge.spec(config)
    assert judge.feed_all(events) is None and judge.settle() is None
    finished = {e[1] for e in events if e[0] == "finish"}
    assert finished == set(range(30))


def test_simulate_async_writes_events_the_spec_accepts(tmp_path: Path) -> None:
    """vLLM's defaults: async scheduling, stale output delivered, depth 2 unless given."""
    out = tmp_path / "events.jsonl"
    argv = ["simulate", "--policy", "eager-unsafe", "--requests", "30", "--blocks", "24"]
    argv += ["--block-size", "4", "--async", "--stale-output", "deliver", "--out", str(out)]
    assert main(argv) == 0
    config, events = read_events(out)
    assert (config.async_scheduling, config.stale_output, config.depth) == (True, "deliver", 2)
    judge = Judge.spec(config)
    assert judge.feed_all(events) is None and judge.settle() is None
    assert {e[1] for e in events if e[0] == "finish"} == set(range(30))
    assert any(e[0] == "preempt" for e in events)  # a small pool: stale output to deliver


def test_fuzz_async_of_a_safe_policy_exits_0(capsys) -> None:
    argv = ["fuzz", "--policy", "deferred", "--async", "--stale-output", "deliver"]
    assert main(argv + ["--seconds", "3"]) == 0
    out = capsys.readouterr().out
    assert "no counterexample" in out and "async, stale output delivered" in out


def test_fuzz_finds_the_seed_bug_and_writes_its_events(seed_bug_run) -> None:  # type: ignore[no-untyped-def]
    """``kvspec fuzz --policy eager-unsafe --preemption priority --seed 1 --out F`` (run once
    per session: ``conftest.seed_bug_run``): exit 1, the shrunk program printed, F re-judged."""
    assert seed_bug_run.returncode == 1, seed_bug_run.stderr
    text, out = seed_bug_run.stdout, seed_bug_run.path
    assert "violated: NoUnwritten" in text and "  1. " in text
    config, events = read_events(out)
    judge = Judge.spec(config)
    finding = judge.feed_all(events)
    assert finding is not None and finding.invariant.startswith("NoUnwritten")


def test_fuzz_of_a_safe_policy_exits_0(capsys) -> None:
    assert main(["fuzz", "--policy", "deferred", "--seconds", "3"]) == 0
    assert "no counterexample" in capsys.readouterr().out


def test_fuzz_writes_hypothesis_files_under_the_cache_and_restores_its_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing lands in the current folder (a stringified ``StorageDirectory`` once made a folder
    named ``<hypothesis.configuration.StorageDirectory object at 0x...>`` there)."""
    from hypothesis import configuration

    def home() -> Path:
        where = configuration.storage_directory()
        return Path(getattr(where, "home_directory", where))

    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("KVSPEC_CACHE_DIR", str(cache))
    before = home()
    assert main(["fuzz", "--policy", "deferred", "--seconds", "1"]) == 0
    assert "no counterexample" in capsys.readouterr().out
    assert sorted(p.name for p in work.iterdir()) == []
    assert home() == before


def test_read_events_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"format": "kvspec-events", "version": 0, "config": {"num_blocks": 4, "block_size": 4}}\n["begin", 0]\nnot json\n'
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not JSON"):
        read_events(bad)
    bad.write_text('{"format": "other"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a kvspec trace"):
        read_events(bad)
