"""``kvspec fuzz`` targets for ``tests/test_vllm_loads.py`` (imported in a vLLM environment,
from this folder): vLLM's loads factory with one bug planted in its load handling, as
``tests/vllm_cases/case_connector.py`` plants it for the pytest plugin: the blocks allocated for
an asynchronous load are registered at once, before the load has landed (vLLM registers them
when the landed request is next scheduled, ``_update_waiting_for_remote_kv``)."""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

from kvspec.conformance.adapters.vllm_adapter.loads import loads_factory
from kvspec.reference.choices import Choices
from kvspec.spec import Config


def cached_before_landing_factory(config: Config, choices: Choices) -> Any:
    """``loads_factory`` whose KV-cache manager registers an asynchronous load's blocks as it
    allocates them."""
    adapter = loads_factory(config, choices)
    scheduler = adapter.scheduler
    coordinator = scheduler.kv_cache_manager.coordinator
    allocate = coordinator.allocate_new_blocks

    def allocate_new_blocks(request_id: str, *args: Any, **kw: Any) -> Any:
        blocks = allocate(request_id, *args, **kw)
        request = scheduler.requests[request_id]
        fresh = request.num_computed_tokens == 0 and request.status == RequestStatus.WAITING
        if fresh and request.request_id in adapter.external:
            loaded = len(coordinator.get_blocks(request_id)[0]) * scheduler.block_size
            coordinator.cache_blocks(request, min(loaded, request.num_tokens - 1))
        return blocks

    coordinator.allocate_new_blocks = allocate_new_blocks
    return adapter
