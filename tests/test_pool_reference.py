"""The pool judge over the reference engine's own block pool (``planted_reference_pool.py``):
random legal calls of ``reference.block_pool.BlockPool`` hold under the pool machine, and bugs
planted in that pool are named by the pool invariant they break (``EvictionDropsEveryKey``,
``FreeQueueExact``), not a bare ``Disagreement``, within the first seeds."""

from __future__ import annotations

import time

import pytest
from planted_reference_pool import PLANTS, drive


def test_the_reference_pool_holds_under_the_pool_machine() -> None:
    for seed in range(100):
        assert drive(seed) is None, seed


@pytest.mark.parametrize("plant", PLANTS, ids=[p.name for p in PLANTS])
def test_a_planted_reference_pool_bug_is_named_by_its_pool_invariant(plant: object) -> None:
    started = time.monotonic()
    with plant.patch():  # type: ignore[attr-defined]
        found = next(f for f in map(drive, range(20)) if f is not None)
    assert found.invariant == plant.expect, found  # type: ignore[attr-defined]
    assert time.monotonic() - started < 30
