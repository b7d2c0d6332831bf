"""A bug planted in vLLM's own sliding-window manager (``SlidingWindowManager``, inside
``.venv-vllm`` or ``.venv-vllm-0.34.0``), fuzzed through ``vllm_adapter.hybrid:swa_full_first_factory``
(the window is group 1 there: ``NoReadOfRecycled``'s group) by ``bench/planted_child.py
vllm-window``; it should be named ``NoReadOfRecycled``, not a bare disagreement nor
``RefcountIsOwnership``: judging on past the deviation (``judge/consequence.py``) applies vLLM's
extra free of a window block as that window table giving the block up, as vLLM's
``remove_skipped_blocks`` does.

The plant patches one attribute of vLLM's class while the run lasts (restored on exit), as
``planted_vllm_hybrid.py`` does: no vLLM code is copied.
"""

from __future__ import annotations

from typing import Any

from planted import Plant
from planted_vllm_hybrid import _set
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

_skipped = SlidingWindowManager.get_num_skipped_tokens


def _skipped_one_token_late(self: Any, num_computed_tokens: int) -> int:
    """The window measured for the token after the next one (an off-by-one): once in a block's
    worth of decodes, the block the next token's window still starts in is freed under it."""
    return _skipped(self, num_computed_tokens + 1)


PLANTS = (
    Plant(
        "vllm-window-skips-one-token-late",
        "safety",
        "NoReadOfRecycled",
        lambda: _set(SlidingWindowManager, "get_num_skipped_tokens", _skipped_one_token_late),
        "the window's skipped tokens counted for the token after the next, freeing a block the "
        "step being scheduled reads",
    ),
)
