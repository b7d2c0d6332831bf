"""kvspec: an executable specification of the KV-cache block lifecycle, with conformance checks.

``kvspec.LLM`` and ``kvspec.SamplingParams`` (the reference LLM engine, ``impl/llm/engine.py``) are
imported on first use, so ``import kvspec`` stays light (no torch, no transformers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvspec.impl.llm.engine import LLM
    from kvspec.impl.llm.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvspec.impl.llm.engine import LLM

        return LLM
    if name == "SamplingParams":
        from kvspec.impl.llm.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvspec' has no attribute {name!r}")
