"""``kvspec fuzz`` targets for ``tests/test_vllm_loads.py`` (imported in a vLLM environment,
from this folder): vLLM's loads factory with one bug planted in its load handling, as
``tests/vllm_cases/case_connector.py`` plants it for the pytest plugin: the blocks allocated for
an asynchronous load are registered at once, before the load has landed (vLLM registers them
when the landed request is next scheduled, ``_update_waiting_for_remote_kv``); and vLLM's
``fail`` policy with a failed load's blocks registered before they are freed."""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

from kvspec.conformance.adapters.vllm_adapter.loads import fail_loads_factory, loads_factory
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


def failed_load_cached_factory(config: Config, choices: Choices) -> Any:
    """``fail_loads_factory`` whose failure handling registers a failed load's blocks before
    it frees them (a failed load left in the prefix cache: ``docs/findings/README.md``'s
    finding, planted on the asynchronous path the fuzzer draws)."""
    adapter = fail_loads_factory(config, choices)
    scheduler = adapter.scheduler
    finished = scheduler._update_from_kv_xfer_finished

    def update_from_kv_xfer_finished(kv_connector_output: Any) -> Any:
        for req_id in kv_connector_output.failed_recving or ():
            request = scheduler.requests.get(req_id)
            if request is not None and request.is_finished():
                scheduler.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        return finished(kv_connector_output)

    scheduler._update_from_kv_xfer_finished = update_from_kv_xfer_finished
    return adapter


class _EveryLoadOneBlock(dict):  # type: ignore[type-arg]
    """``LoadsAdapter.sizes`` that reports every load as of one block."""

    def get(self, key: Any, default: Any = None) -> Any:
        return 1


def fail_any_size_factory(config: Config, choices: Choices) -> Any:
    """``fail_loads_factory`` that lets loads of several blocks fail too: vLLM frees their
    unregistered blocks as one batch, in an order the spec does not follow, which the
    attachment refuses by name instead of judging."""
    adapter = fail_loads_factory(config, choices)
    adapter.sizes = _EveryLoadOneBlock()
    return adapter
