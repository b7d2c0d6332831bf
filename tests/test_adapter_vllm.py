"""vLLM 0.33.0's real scheduler and block pool through the adapter, judged by the spec.

These run in ``.venv-vllm`` (``make thirdparty``) as subprocesses, since vLLM's pins conflict with
ours; without that environment they are skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
TARGET = "kvspec.conformance.adapters.vllm_adapter:factory"

pytestmark = pytest.mark.skipif(
    not (VENV / ".stamp").exists(), reason="no .venv-vllm: run `make thirdparty` to build it"
)


def _run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run(
        [str(VENV / "bin" / "python"), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def test_the_seed_bug_in_vllm_and_a_clean_workload() -> None:
    """The shrunk counterexample, replayed on vLLM's own code: the victim's block 5 was published
    when it was scheduled and stays published after PRIORITY preempts it in the same step. And a
    shared-prefix workload under fcfs, on which vLLM and the spec agree event by event."""
    done = _run("tests/thirdparty_checks.py", "vllm", "seed", "clean")
    assert done.returncode == 0, done.stderr[-2000:]
    seed, clean = done.stdout.splitlines()
    assert seed.startswith("NoUnwrittenPublish: block 5 is published"), seed
    assert clean.startswith("none") and "publish" in clean and "hit" in clean, clean


def test_kvspec_fuzz_finds_the_seed_bug_in_vllm() -> None:
    argv = ["-m", "kvspec", "fuzz", "--target", TARGET, "--policy", "eager-unsafe"]
    argv += ["--preemption", "priority", "--depth", "1", "--seconds", "120", "--seed", "0"]
    done = _run(*argv)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "counterexample found" in done.stdout
    assert "NoUnwrittenPublish" in done.stdout or "NoUnwrittenRead" in done.stdout
    assert "preempt r" in done.stdout


def test_kvspec_fuzz_finds_nothing_in_vllm_under_fcfs() -> None:
    """No false alarm: vLLM's effects equal the spec's, block ids and free order included."""
    argv = ["-m", "kvspec", "fuzz", "--target", TARGET, "--policy", "eager-unsafe"]
    argv += ["--preemption", "fcfs", "--depth", "1", "--seconds", "10"]
    done = _run(*argv)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "no counterexample" in done.stdout


def test_a_cell_vllm_does_not_run_is_refused_in_one_line() -> None:
    argv = ["-m", "kvspec", "fuzz", "--target", TARGET, "--policy", "deferred", "--seconds", "1"]
    done = _run(*argv)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("kvspec fuzz: error: --target")
    assert "eager-unsafe" in done.stderr and "Traceback" not in done.stderr
