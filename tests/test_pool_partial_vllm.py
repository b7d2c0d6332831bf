"""Planted bugs in vLLM's own ``BlockPool``, each named by the pool invariant it breaks, on every
supported release (``tests/vllm_cases/pool_plants.py`` run with the release's python).

The unplanted pool, driven through partial prefix-cache entries (a block under two keys, its
duplicates evicted), a move to a copy, a free, an eviction, an unpin and allocations that reuse
the unpinned block, holds; a move that leaves its source's keys is named MoveLeavesNoKey, an
eviction that keeps a partial entry EvictionDropsEveryKey, an unpin that never queues its block
FreeQueueExact, an allocation that does not tell an unpinned block's reader ReadUntilReuse.
"""

from __future__ import annotations

import os
from pathlib import Path

import preforked
import pytest

pytestmark = pytest.mark.e2e  # a process of each vLLM release (make test-e2e)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "vllm_cases" / "pool_plants.py"
RELEASES = [
    pytest.param(ROOT / name, id=name)
    for name in (".venv-vllm", ".venv-vllm-0.34.0")
    if (ROOT / name / "bin" / "python").exists()
]
EXPECTED = {
    "BlockPool": "holds",
    "MoveKeepsTheSource": "MoveLeavesNoKey",
    "EvictionKeepsAPartialKey": "EvictionDropsEveryKey",
    "UnpinKeepsTheBlockOut": "FreeQueueExact",
    "ReuseTellsNoReader": "ReadUntilReuse",
}


@pytest.mark.skipif(not RELEASES, reason="no vLLM venv: run `make thirdparty` to build one")
@pytest.mark.parametrize("venv", RELEASES)
def test_each_planted_pool_bug_is_named_by_its_invariant(venv: Path) -> None:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = preforked.run(venv / "bin" / "python", [str(SCRIPT)], cwd=os.getcwd(), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert found == EXPECTED
