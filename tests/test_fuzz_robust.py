"""Fuzzing a third-party engine that misbehaves (issue #34): a hung call, an engine that never
goes idle, shrinking bounded by ``--seconds``, Ctrl-C while shrinking. Each runs ``kvspec fuzz``
as a user does, with a tiny faulty engine of ``fake_engines.py`` as ``--target``."""

from __future__ import annotations

import os
import signal
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


def _sigint_as_python_starts_it() -> None:
    """In the child, before Python starts: SIGINT's default action, whatever this test process
    inherited. A shell's background job (``.ci/run &``, ``nohup ... &``) ignores SIGINT, the
    children inherit that, and Python then installs no KeyboardInterrupt handler: Ctrl-C would
    not reach kvspec at all, and the Ctrl-C tests would test the shell."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def fuzz(target: str, seconds: float, *argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = run(["fuzz", "--policy", "deferred", "--target", f"fake_engines:{target}",
                "--seconds", str(seconds), *argv], cwd=TESTS,
               preexec_fn=_sigint_as_python_starts_it)  # fmt: skip
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


def test_an_engine_slow_to_finish_a_long_workload_is_not_called_livelocked() -> None:
    """More than ``RUN_OUT_STEPS`` steps in all to finish a run's requests, one finishing every
    few hundred: no ``EngineNeverIdle`` (it was a false alarm on a thrashing reference engine)."""
    from kvspec.conformance.fuzz import RUN_OUT_STEPS

    done, _ = fuzz("slow_but_finishing", 8, "--seed", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    longest = int(done.stderr.split("longest busy stretch")[1].split()[0])
    assert longest > RUN_OUT_STEPS, done.stderr  # a run did outlast the old bound


def test_seconds_bounds_shrinking_too() -> None:
    done, took = fuzz("miscounts_slowly", 3)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "shrinking stopped at the --seconds 3 budget" in done.stdout
    assert "Disagreement" in done.stdout
    assert took < 3 + STARTUP


def test_ctrl_c_while_shrinking_prints_and_saves_the_best_so_far(tmp_path: Path) -> None:
    out = tmp_path / "cex.jsonl"
    done, _ = fuzz("miscounts_then_ctrl_c", 60, "--out", str(out), "--format", "v1")
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "shrinking interrupted (the shortest so far)" in done.stdout, said
    assert "Disagreement" in done.stdout, said
    assert orjson.loads(out.read_bytes().splitlines()[0])["format"] == "kvspec-trace"


def test_ctrl_c_before_any_finding_is_still_an_interruption() -> None:
    """Nothing found yet: Ctrl-C ends the command as before (130), with no verdict. The SIGINT
    comes from the tenth engine's factory, inside the fuzz loop, whatever the machine's load (a
    timer here once fired while a loaded machine was still importing kvspec)."""
    done, _ = fuzz("ctrl_c_on_the_tenth_engine", 600)
    said = done.stdout + done.stderr
    assert done.returncode == 130 and "kvspec fuzz: interrupted" in done.stderr, said
    assert "counterexample" not in done.stdout and "No counterexample" not in done.stdout, said


def test_ctrl_c_while_python_starts_is_an_interruption_not_a_traceback() -> None:
    """Ctrl-C before ``main`` runs (a slow import): exit 130 and one line, as inside a command."""
    process = subprocess.Popen(
        [*__import__("edges").KVSPEC, "fuzz", "--policy", "deferred", "--seconds", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=TESTS,
        env=dict(os.environ, PYTHONPROFILEIMPORTTIME="1"), preexec_fn=_sigint_as_python_starts_it,
    )  # fmt: skip
    for line in process.stderr:  # type: ignore[union-attr]
        module = line.split("|")[-1].strip()
        if module == "kvspec.flow":  # inside the command line's imports
            process.send_signal(2)
            break
        if module == "kvspec.cli":  # past them: this test no longer knows where the imports are
            process.kill()
            pytest.fail("kvspec.cli imported without kvspec.flow")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] in ("kvspec: interrupted", "kvspec fuzz: interrupted"), err


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
