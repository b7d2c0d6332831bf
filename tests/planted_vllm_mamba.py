"""Bugs planted in vLLM's own Mamba ``align`` code (the scheduler's aligned prefill split,
``MambaManager``; inside ``.venv-vllm`` or ``.venv-vllm-0.34.0``), fuzzed through
``vllm_adapter.hybrid:mamba_factory`` (a gated-delta-net state group beside a full-attention one)
under fcfs by ``bench/planted_child.py vllm-mamba``; each should be named by the state group's
invariant it breaks (``spec/invariants.py``), not a bare disagreement.

Each plant patches one attribute of vLLM's class while the run lasts (restored on exit), as
``planted_vllm_hybrid.py`` does: no vLLM code is copied.
"""

from __future__ import annotations

from typing import Any

from planted import Plant
from planted_vllm_hybrid import _set
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import MambaManager


def _split_not_aligned(self: Any, request: Any, num_new_tokens: int, *args: Any, **kw: Any) -> int:
    """The aligned split disabled: a prefill chunk ends wherever the token budget ends it, so
    a chunk stops inside a block and the next crosses the block's boundary, where ``align``
    ``MambaManager`` registers the state slot the crossing chunk ends in, as if computed at the
    boundary."""
    return num_new_tokens


_cache_blocks = MambaManager.cache_blocks


def _same_step_forgotten(self: Any, *args: Any, **kw: Any) -> None:
    """``cache_blocks``, then the states it registered this step forgotten
    (``cached_blocks_this_step`` emptied), so an admission in the same step may start from a
    state that step has not written yet."""
    _cache_blocks(self, *args, **kw)
    self.cached_blocks_this_step.clear()


PLANTS = (
    Plant(
        "vllm-mamba-split-unaligned",
        "safety",
        "StateAtItsBoundary",
        lambda: _set(Scheduler, "_mamba_block_aligned_split", _split_not_aligned),
        "the scheduler's aligned prefill split disabled: a chunk stops inside a state block",
    ),
    Plant(
        "vllm-mamba-same-step-forgotten",
        "safety",
        "NoUnwrittenStateRead",
        lambda: _set(MambaManager, "cache_blocks", _same_step_forgotten),
        "MambaManager forgets the states it registered in the step being scheduled",
    ),
)
