"""``kvspec fuzz --loads`` reaches vLLM's KV connector loads
(``vllm_adapter.loads:loads_factory``, ``conformance/adapters/vllm_adapter/loads.py``), on every
supported release: synchronous and asynchronous loads hold; a registration of an asynchronous
load's blocks before it lands (``tests/vllm_loads_targets.py``) is found; load failures under
vLLM's ``fail`` policy (its default) are judged and hold, and a failed load's blocks registered
before they are freed (planted) is found; under ``recompute`` the first failure reaches vLLM's
failure handling and ends the fuzz run refused by name (exit 2, counted in the coverage line),
since that policy is not the spec's."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import preforked
import pytest
from vllm_venvs import VENVS

TESTS = Path(__file__).resolve().parent
LOADS = "kvspec.conformance.adapters.vllm_adapter.loads"

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("venv", VENVS)]


def _fuzz(venv: Path, target: str, seconds: int, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = ["fuzz", "--target", target, "--policy", "eager-unsafe"]
    argv += ["--loads", "--depth", "1", "--seed", "1", "--seconds", str(seconds), *extra]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    return preforked.run_console(venv, "kvspec", argv, cwd=TESTS, env=env, timeout=seconds + 240)


def test_loads_reach_vllm_and_hold(venv: Path) -> None:
    done = _fuzz(venv, f"{LOADS}:loads_factory", 15)
    assert done.returncode == 0, done.stdout + done.stderr
    counted = re.search(r"(\d+) loads \((\d+) synchronous\)", done.stdout)
    assert counted, done.stdout
    loads, synchronous = int(counted.group(1)), int(counted.group(2))
    assert loads > synchronous > 0, done.stdout  # both kinds reached vLLM


def test_a_load_registered_before_it_lands_is_found(venv: Path) -> None:
    target = "vllm_loads_targets:cached_before_landing_factory"
    done = _fuzz(venv, target, 60, "--no-shrink", "--seed", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"Disagreement: engine emitted \('publish'", done.stdout), done.stdout


def test_load_failures_under_vllms_fail_policy_hold(venv: Path) -> None:
    done = _fuzz(venv, f"{LOADS}:fail_loads_factory", 20)
    assert done.returncode == 0, done.stdout + done.stderr
    failures = re.search(r"(\d+) load failures", done.stdout)
    assert failures and int(failures.group(1)) > 0, done.stdout  # failures reached vLLM


def test_a_failed_load_registered_before_its_free_is_found(venv: Path) -> None:
    target = "vllm_loads_targets:failed_load_cached_factory"
    done = _fuzz(venv, target, 60, "--no-shrink", "--seed", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"Disagreement: engine emitted \('publish'", done.stdout), done.stdout


def test_a_failed_load_of_several_blocks_is_refused_not_judged(venv: Path) -> None:
    done = _fuzz(venv, "vllm_loads_targets:fail_any_size_factory", 60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "several unregistered blocks" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_load_failure_under_recompute_ends_the_run_refused(venv: Path) -> None:
    done = _fuzz(venv, f"{LOADS}:recompute_loads_factory", 60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "refused mid-run" in done.stderr and "KV connector: load failures" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "1 runs ended by a refusal" in done.stdout, done.stdout
