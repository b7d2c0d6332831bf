"""``docs/findings/vllm_load_failure_stays_cached.py`` (vLLM's objects only) on every supported
release (``tests/vllm_venvs.py``): a synchronous load that failed after its request was aborted
stays in the prefix cache and a later request hits it (exit 1), as ``docs/findings/README.md``
says; with the request still running vLLM evicts the blocks (exit 0). The same script over a
vLLM whose ``_handle_invalid_blocks`` also evicts failed blocks no running request holds exits 0,
so the check can tell a fixed vLLM from this one."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_venvs import VENVS, run_script

SCRIPT = "docs/findings/vllm_load_failure_stays_cached.py"

# A vLLM that, under the `fail` policy, evicts every reported invalid block from the prefix
# cache whoever holds it (the fix the finding suggests): what the script must accept.
EVICTS_ALL = f"""
import runpy, sys
from vllm.v1.core.sched.scheduler import Scheduler

shipped = Scheduler._handle_invalid_blocks

def evicting(self, invalid_block_ids, num_scheduled_tokens):
    failed = shipped(self, invalid_block_ids, num_scheduled_tokens)
    if not self.recompute_kv_load_failures:
        self.kv_cache_manager.evict_blocks(set(invalid_block_ids))
    return failed

Scheduler._handle_invalid_blocks = evicting
sys.argv = [{SCRIPT!r}]
runpy.run_path({SCRIPT!r}, run_name="__main__")
"""


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_a_failed_load_of_an_aborted_request_is_hit_later(venv: Path) -> None:
    done = run_script(venv, SCRIPT)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "r0's blocks still registered after the output: [1, 2, 3, 4]" in done.stdout
    assert "BUG: r1 hits block(s) [1, 2, 3, 4]" in done.stdout, done.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_a_failed_load_of_a_running_request_is_evicted(venv: Path) -> None:
    done = run_script(venv, SCRIPT, "stay")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "r0's blocks still registered after the output: []" in done.stdout, done.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_script_passes_a_vllm_that_evicts_every_failed_block(venv: Path) -> None:
    done = run_script(venv, "-c", EVICTS_ALL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "r1 hits no block of the failed load" in done.stdout, done.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_a_bad_argument_is_exit_2(venv: Path) -> None:
    done = run_script(venv, SCRIPT, "preempt")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
