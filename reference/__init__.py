"""kvspec.reference: a fast, independent implementation of the KV-cache block lifecycle.

An engine built like a real one (O(1) block pool with an intrusive free list and a hash index,
chained sha256 block hashes, a KV cache manager, five registration policies, a vLLM-like and a
general scheduler, an engine loop with D steps in flight, a fake worker) that emits the same
event stream as ``kvspec.spec``, against which it is checked. It imports nothing of kvspec.

Modules: ``config`` (EngineConfig), ``choices`` (nondeterminism), ``hashing``, ``block_pool``,
``request`` (request and step records), ``kv_cache_manager``, ``groups`` (several KV-cache
groups: the coordinator), ``memory`` (the fake device memory of several groups, naming wrong
reads), ``policies``, ``scheduler`` (state and decisions), ``disciplines`` (which decisions),
``worker`` (the worker protocol, the fake worker), ``engine``, ``workload``.
"""

from .choices import Choices, DefaultChoices, RandomChoices
from .config import (
    DISCIPLINES,
    GROUP_KINDS,
    POLICIES,
    PREEMPTIONS,
    STALE_OUTPUTS,
    EngineConfig,
    GroupSpec,
)
from .engine import Engine
from .worker import FakeWorker, Worker
from .workload import shared_prefix_workload

TWIN_OF = "kvspec.spec"
"""This module restates the spec in another form (kvspec/twins.py says what it must equal)."""

__all__ = [
    "DISCIPLINES",
    "GROUP_KINDS",
    "POLICIES",
    "PREEMPTIONS",
    "STALE_OUTPUTS",
    "Choices",
    "DefaultChoices",
    "Engine",
    "EngineConfig",
    "FakeWorker",
    "GroupSpec",
    "RandomChoices",
    "Worker",
    "shared_prefix_workload",
]
