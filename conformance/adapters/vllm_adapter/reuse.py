"""Engine reuse between the fuzzer's examples: which of vLLM's objects outlive an example, and
why only those.

The lockstep fuzzer calls the factory once per Hypothesis example, and an example is short (some
twenty engine steps), so what construction costs weighs on fuzzing throughput. Measured per
construction (``bench/bench_vllm_fuzz.py`` prints both, beside the fuzzer's engine steps per
second with reuse off and on and vLLM's bare scheduler's): vLLM's ``VllmConfig`` (pydantic
validation of its model, scheduler, cache and parallel configs, and the platform's checks) costs
many times everything else together: the ``Scheduler`` with its ``KVCacheManager`` and
``BlockPool``, the KV-cache config, the structured-output manager, the block hasher, ``attach``'s
wrappers and the KV-event stream. So what is reused is the ``VllmConfig`` alone, kept per
*construction key*; everything that holds state while an example runs is built fresh for each
one.

We chose that over keeping a live ``Scheduler`` and resetting it between examples. A reset would
have to restore everything a fresh one has (its requests, waiting and running queues, finished
ids, the block pool's blocks, free-queue order, hash index and KV-event queue, the manager's
per-request tables and stats, the encoder-cache and structured-output state, the wrappers'
and the adapter's own maps and event lists), each a place where one example leaks into the
next, and would save well under a millisecond per example. Built fresh, no mutable object
crosses an example, so there is nothing to forget to reset. What is shared must stay unchanged:
vLLM reads a ``VllmConfig`` and never writes it, and ``tests/test_vllm_reuse.py`` checks that the
configs kept equal fresh ones after a workload, and that engines built on kept configs emit the
events and reach the pools of engines built from scratch, example after example.

The key is every argument of ``build.new_vllm_config`` (the cell's pool, block size, token
budget, admission limit, preemption policy and depth, and the factory's async scheduling, prefill
threshold, prefix caching and draft tokens per decode): two examples share a config only where
vLLM would build the same one. ``KVSPEC_VLLM_REUSE=0`` (or ``VllmAdapter(reuse=False)``, or the factory
``fresh_factory``) builds a config per example. The KV-event publisher over loopback
(``kv_stream.py``) is one per process either way.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

ENV = "KVSPEC_VLLM_REUSE"

CAPACITY = 1024
"""Configs kept at most (least recently used dropped first): a campaign over every cell and
geometry the fuzzer draws stays within it."""


def enabled() -> bool:
    """Whether the factories reuse configs (on unless ``KVSPEC_VLLM_REUSE=0``)."""
    return os.environ.get(ENV, "1") != "0"


class ConfigCache:
    """Built objects by construction key, least recently used dropped past ``capacity``."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.kept: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        if key in self.kept:
            self.hits += 1
            self.kept.move_to_end(key)
            return self.kept[key]
        self.misses += 1
        built = self.kept[key] = build()
        if len(self.kept) > self.capacity:
            self.kept.popitem(last=False)
        return built

    def clear(self) -> None:
        self.kept.clear()
        self.hits = self.misses = 0


configs = ConfigCache()
"""The process's ``VllmConfig`` per construction key (``build.build_scheduler``)."""
