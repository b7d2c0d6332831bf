"""nano-vllm-fork's real scheduler and block manager through the adapter, judged (observed mode).

These run in ``.venv-nano`` (``make thirdparty``) as subprocesses; without it they are skipped.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-nano"
TARGET = "kvspec.conformance.adapters.nano_vllm_adapter:factory"

pytestmark = pytest.mark.skipif(
    not (VENV / ".stamp").exists(), reason="no .venv-nano: run `make thirdparty` to build it"
)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    python = str(VENV / "bin" / "python")
    return subprocess.run([python, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_prompt_cached_whole_is_scheduled_with_nothing_to_compute() -> None:
    """nano-vllm hits every full block, the last one included, so a prompt that is a whole number
    of cached blocks computes no token, and its first token is sampled from another sequence's
    position (its model runner takes ``cu_seqlens_q[1:] - 1``). Prompts that are not whole
    blocks run clean (and freed blocks leave its hash table: ``unpublish``)."""
    done = _run("tests/thirdparty_checks.py", "nano", "cached", "clean")
    assert done.returncode == 0, done.stderr[-2000:]
    cached, clean = done.stdout.splitlines()
    assert cached.startswith("Illegal: schedule r1 in step 0: either compute tokens"), cached
    assert clean.startswith("none") and "unpublish" in clean, clean
    assert clean.endswith("file 0"), clean  # the same events hold as an observed trace file


def test_a_preempted_sequence_stays_in_the_running_queue() -> None:
    """nano-vllm-fork's decode loop preempts from a copy of ``running`` and never removes the
    victim from ``running`` itself: the next step decodes it with an empty block table."""
    done = _run("tests/thirdparty_checks.py", "nano", "preempted")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("EngineError: IndexError"), done.stdout


def test_kvspec_fuzz_finds_the_cached_prompt_in_nano_vllm() -> None:
    argv = ["-m", "kvspec", "fuzz", "--target", TARGET, "--policy", "eager-unsafe"]
    argv += ["--discipline", "general", "--depth", "1", "--seconds", "60", "--seed", "0"]
    done = _run(*argv)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "either compute tokens" in done.stdout and "for 0 tokens" in done.stdout


def test_a_cell_nano_vllm_does_not_run_is_refused_in_one_line() -> None:
    argv = ["-m", "kvspec", "fuzz", "--target", TARGET, "--policy", "eager-unsafe"]
    done = _run(*argv, "--seconds", "1")  # discipline vllm by default
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]  # transformers may warn first (no torch here)
    assert last.startswith("kvspec fuzz: error: --target") and "discipline general" in last
    assert "Traceback" not in done.stderr
