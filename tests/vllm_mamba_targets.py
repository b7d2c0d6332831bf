"""Planted bugs in vLLM's ``MambaManager`` for ``kvspec fuzz --target`` (run from ``tests/``,
``tests/test_vllm_hybrid_mamba.py``): each factory patches the manager class of this process,
then builds the ``mamba`` hybrid model as ``hybrid.mamba_factory`` does."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from kvspec.conformance.adapters.vllm_adapter import hybrid
from kvspec.reference.choices import Choices
from kvspec.spec import Config

_PLANTED: set[str] = set()


def same_step_factory(config: Config, choices: Choices) -> Any:
    """The manager forgets the states it registered in the step being scheduled
    (``cached_blocks_this_step`` emptied after each ``cache_blocks``), so an admission in the
    same step may start from a state that step has not written yet: NoUnwrittenStateRead."""
    if "same-step" not in _PLANTED:
        _PLANTED.add("same-step")
        cache_blocks = MambaManager.cache_blocks

        def planted(self: Any, *args: Any, **kw: Any) -> None:
            cache_blocks(self, *args, **kw)
            self.cached_blocks_this_step.clear()

        MambaManager.cache_blocks = planted  # type: ignore[method-assign]
    return hybrid.mamba_factory(config, choices)
