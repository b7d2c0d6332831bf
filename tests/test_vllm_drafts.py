"""``kvspec fuzz --spec-tokens K`` reaches vLLM's speculative decoding
(``vllm_adapter:drafts_factory``, ``conformance/adapters/vllm_adapter/drafts.py``), on every
supported release: vLLM's drafts hold with drafts accepted and rejected; a registration bug
after rejected drafts (``tests/vllm_drafts_targets.py``) is found; the other factories refuse
``--spec-tokens`` instead of running without drafts."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import preforked
import pytest
from vllm_venvs import VENVS

TESTS = Path(__file__).resolve().parent
ADAPTER = "kvspec.conformance.adapters.vllm_adapter"

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("venv", VENVS)]


def _fuzz(venv: Path, target: str, seconds: int, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = ["fuzz", "--target", target, "--policy", "eager-unsafe"]
    argv += ["--depth", "1", "--seed", "0", "--seconds", str(seconds), *extra]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    return preforked.run_console(venv, "kvspec", argv, cwd=TESTS, env=env, timeout=seconds + 240)


def test_drafts_reach_vllm_and_hold(venv: Path) -> None:
    done = _fuzz(venv, f"{ADAPTER}:drafts_factory", 15, "--spec-tokens", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    accepted = re.search(r"(\d+) accepted draft tokens", done.stdout)
    assert accepted and int(accepted.group(1)) > 0, done.stdout


def test_a_registration_past_rejected_drafts_is_found(venv: Path) -> None:
    target = "vllm_drafts_targets:cached_past_rejection_factory"
    done = _fuzz(venv, target, 60, "--spec-tokens", "2", "--no-shrink")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NoUnwrittenPublish" in done.stdout, done.stdout


def test_the_other_factories_refuse_drafts(venv: Path) -> None:
    done = _fuzz(venv, f"{ADAPTER}:factory", 10, "--spec-tokens", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "drafts_factory" in done.stderr and "Traceback" not in done.stderr, done.stderr
