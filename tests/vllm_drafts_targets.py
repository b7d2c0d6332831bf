"""``kvspec fuzz`` targets for ``tests/test_vllm_drafts.py`` (imported in a vLLM environment,
from this folder): vLLM's drafts factory with one bug planted in the registration that follows
an output with rejected drafts, as ``tests/vllm_cases/case_spec_decode.py`` plants it for the
pytest plugin."""

from __future__ import annotations

from typing import Any

from kvspec.conformance.adapters.vllm_adapter import drafts_factory
from kvspec.reference.choices import Choices
from kvspec.spec import Config


def cached_past_rejection_factory(config: Config, choices: Choices) -> Any:
    """``drafts_factory`` whose KV-cache manager, after an output that rejected some of a
    request's drafts, registers every known token of it (the bonus token too) instead of the
    computed ones: a block whose last slot holds a rejected draft's K/V is published under the
    real tokens."""
    adapter = drafts_factory(config, choices)
    manager = adapter.scheduler.kv_cache_manager
    original = manager.cache_blocks

    def cache_blocks(request: Any, num_computed_tokens: int) -> None:
        if request.request_id in adapter.rejecting:
            num_computed_tokens = request.num_tokens
        original(request, num_computed_tokens)

    manager.cache_blocks = cache_blocks
    return adapter
