"""``docs/findings/vllm_mamba_block_stored_tokens.py`` (vLLM's objects only) on every supported
release (``tests/vllm_venvs.py``): a Mamba ``align`` group's ``BlockStored`` lists one hash beside
three blocks' tokens (exit 1), as ``docs/findings/README.md`` says. The same script over a vLLM
whose ``cache_full_blocks`` keeps only the kept blocks' tokens exits 0, so the check can tell a
fixed vLLM from this one."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_venvs import VENVS, run_script

SCRIPT = "docs/findings/vllm_mamba_block_stored_tokens.py"

# A vLLM whose BlockStored token_ids cover only the blocks it lists hashes for (null blocks'
# tokens dropped): what the script must accept.
DENSE_STORES = f"""
import inspect, runpy, sys
from vllm.v1.core.block_pool import BlockPool

shipped = BlockPool.cache_full_blocks

def dense(self, *args, **kwargs):
    call = inspect.signature(shipped).bind(self, *args, **kwargs).arguments
    before = len(self.kv_event_queue) if self.enable_kv_cache_events else 0
    shipped(self, *args, **kwargs)
    if self.enable_kv_cache_events and len(self.kv_event_queue) > before:
        blocks, size = call["blocks"], call["block_size"]
        kept = [
            i for i in range(call["num_cached_blocks"], call["num_full_blocks"])
            if not blocks[i].is_null
        ]
        tokens = call["request"].all_token_ids
        self.kv_event_queue[-1].token_ids = [
            t for i in kept for t in tokens[i * size : (i + 1) * size]
        ]

BlockPool.cache_full_blocks = dense
sys.argv = [{SCRIPT!r}]
runpy.run_path({SCRIPT!r}, run_name="__main__")
"""


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_a_mamba_block_stored_has_more_tokens_than_hashes(venv: Path) -> None:
    done = run_script(venv, SCRIPT)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "BlockStored group 1: 1 hashes" in done.stdout, done.stdout[-2000:]
    assert "<- 6 tokens for 1 hashes of 2" in done.stdout, done.stdout[-2000:]
    assert "whose tokens do not match their hashes: 1" in done.stdout, done.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_the_script_passes_a_vllm_whose_stores_drop_the_null_blocks_tokens(venv: Path) -> None:
    done = run_script(venv, "-c", DENSE_STORES)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "BlockStored group 1: 1 hashes" in done.stdout, done.stdout[-2000:]
    assert "whose tokens do not match their hashes: 0" in done.stdout, done.stdout[-2000:]
