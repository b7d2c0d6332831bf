"""``kvspec fuzz`` judges vLLM's Mamba path (``hybrid:mamba_factory``: Qwen3-Next, a full group
and a gated-delta-net state group in ``align`` mode) on every supported release, now that the
spec registers states as vLLM's ``MambaManager`` does (``Group.registers == "when-known"``) and
has vLLM's free-before-preempt (``trim``): the factory holds under fcfs, and a planted bug in
vLLM's ``MambaManager`` (``tests/vllm_mamba_targets.py``: the same-step deferral forgotten) is
found and named ``NoUnwrittenStateRead``, not a bare disagreement."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import preforked
import pytest
from vllm_venvs import VENVS

TESTS = Path(__file__).resolve().parent
HYBRID = "kvspec.conformance.adapters.vllm_adapter.hybrid"

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("venv", VENVS)]


def _fuzz(venv: Path, target: str, seconds: int, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = ["fuzz", "--target", target, "--policy", "eager-unsafe"]
    argv += ["--seed", "0", "--seconds", str(seconds), *extra]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    return preforked.run_console(venv, "kvspec", argv, cwd=TESTS, env=env, timeout=seconds + 300)


def test_the_mamba_model_holds_under_fcfs(venv: Path) -> None:
    done = _fuzz(venv, f"{HYBRID}:mamba_factory", 20, "--preemption", "fcfs")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "no counterexample" in done.stdout, done.stdout[-2000:]


def test_a_forgotten_same_step_deferral_is_named_no_unwritten_state_read(venv: Path) -> None:
    target = "vllm_mamba_targets:same_step_factory"
    done = _fuzz(venv, target, 30, "--depth", "1", "--no-shrink")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "violated: NoUnwrittenStateRead" in done.stdout, done.stdout[-3000:]
