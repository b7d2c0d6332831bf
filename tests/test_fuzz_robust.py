"""Fuzzing a third-party engine that misbehaves (issue #34): a hung call, an engine that never
goes idle, shrinking bounded by ``--seconds``, Ctrl-C while shrinking. Each runs ``kvspec fuzz``
as a user does, with a tiny faulty engine of ``fake_engines.py`` as ``--target``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import orjson
import pytest
from edges import run

from kvspec.conformance.watchdog import GRACE

TESTS = Path(__file__).resolve().parent
STARTUP = 20.0
"""Seconds a loaded machine may take to start Python, import kvspec and finish the output."""


def fuzz(target: str, seconds: float, *argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = run(["fuzz", "--policy", "deferred", "--target", f"fake_engines:{target}",
                "--seconds", str(seconds), *argv], cwd=TESTS)  # fmt: skip
    return done, time.monotonic() - started


@pytest.mark.parametrize("target", ["hangs", "hangs_sleeping"])
def test_a_hung_step_is_a_finding_with_the_engines_stack_within_the_budget(
    target: str, tmp_path: Path
) -> None:
    out = tmp_path / "hung.jsonl"
    done, took = fuzz(target, 3, "--out", str(out), "--format", "v1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert took < 3 + GRACE + STARTUP
    assert "EngineHung" in done.stdout and "not shrunk" in done.stdout
    assert "fake_engines.py" in done.stdout and ", in step" in done.stdout  # the engine's frames
    assert "hypothesis" not in done.stdout  # not the fuzzer's
    assert len(out.read_bytes().splitlines()) > 1


def test_an_engine_that_never_goes_idle_is_a_finding() -> None:
    done, _ = fuzz("never_idle", 20)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "EngineNeverIdle" in done.stdout


def test_seconds_bounds_shrinking_too() -> None:
    done, took = fuzz("miscounts_slowly", 3)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "shrinking stopped at the --seconds 3 budget" in done.stdout
    assert "Disagreement" in done.stdout
    assert took < 3 + STARTUP


def test_ctrl_c_while_shrinking_prints_and_saves_the_best_so_far(tmp_path: Path) -> None:
    out = tmp_path / "cex.jsonl"
    done, _ = fuzz("miscounts_then_ctrl_c", 60, "--out", str(out), "--format", "v1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "shrinking interrupted (the shortest so far)" in done.stdout
    assert "Disagreement" in done.stdout
    assert orjson.loads(out.read_bytes().splitlines()[0])["format"] == "kvspec-trace"


def test_ctrl_c_before_any_finding_is_still_an_interruption() -> None:
    """Nothing found yet: Ctrl-C ends the command as before (130), with no verdict."""
    process = subprocess.Popen(
        [*__import__("edges").KVSPEC, "fuzz", "--policy", "deferred", "--seconds", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=TESTS,
    )  # fmt: skip
    time.sleep(6)
    process.send_signal(2)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in err, out + err


def test_a_slow_engine_call_at_the_deadline_is_not_called_hung() -> None:
    """Each example builds its engine in 3 s: one is under way when the budget ends. It is given
    ``HUNG_AFTER`` to return, and the cell holds."""
    done, took = fuzz("slow_factory", 4)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "EngineHung" not in done.stdout


def test_a_budget_beyond_the_clock_arms_no_impossible_alarm() -> None:
    """``--seconds 1e308`` is a valid budget: the alarm is set at most ``MAX_ALARM`` ahead
    (``setitimer`` refuses a time past ``time_t``: exit 4 before)."""
    from kvspec.conformance.watchdog import watching

    with watching(time.monotonic() + 1e308) as dog:
        assert dog is not None
    done = run(["fuzz", "--policy", "eager-unsafe", "--discipline", "general",
                "--seconds", "1e308"], cwd=TESTS)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
