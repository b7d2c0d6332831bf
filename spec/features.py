"""The configuration features: what a ``Config`` (or a stream's decisions) can turn on beyond the
plain synchronous pool, each once, with what it means and how to tell it is on.

Every other form of the spec follows a feature or refuses it by name (``kvspec/twins.py``'s
table, which ``tests/test_twins.py`` checks against this registry): a feature added here fails
that test until every form declares it. ``PARAMETERS`` are the ``Config`` fields that are sizes
and choices every form takes (and the policy, whose traits have their own registry,
``policies.POLICIES``); a field that is in neither fails ``tests/test_twins.py`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .state import Config, Group


@dataclass(frozen=True)
class Feature:
    name: str
    meaning: str
    """What it is, in a few words (a refusal's message names it so)."""
    on: Callable[[Config], bool] | None
    """Whether ``config`` turns it on; None for a feature of the decisions (a stream has it or
    not whatever the configuration), refused where such a decision is read."""
    example: dict[str, Any] = field(default_factory=dict)
    """``Config`` fields that turn it on (with what it needs), for the tests that ask each form
    to refuse it."""


FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature(
            "async_scheduling",
            "async scheduling (placeholders)",
            lambda c: c.async_scheduling,
            {"async_scheduling": True, "depth": 2},
        ),
        Feature(
            "stale_output_deliver",
            "stale output delivered",
            lambda c: c.stale_output == "deliver",
            {"stale_output": "deliver", "depth": 2},
        ),
        Feature(
            "prefix_caching_off",
            "a pool without prefix caching",
            lambda c: not c.prefix_caching,
            {"prefix_caching": False},
        ),
        Feature(
            "spec_tokens",
            "speculative decoding (draft tokens)",
            lambda c: c.spec_tokens > 0,
            {"spec_tokens": 1},
        ),
        Feature(
            "delay_load_registration",
            "loads registered when their request is next scheduled",
            lambda c: c.delay_load_registration,
            {"delay_load_registration": True},
        ),
        Feature(
            "defer_free",
            "deferred block freeing",
            lambda c: c.defer_free,
            {"defer_free": True},
        ),
        Feature(
            "defer_loads",
            "deferred asynchronous loads",
            lambda c: c.defer_loads,
            {"defer_free": True, "defer_loads": True},
        ),
        Feature(
            "sliding_window",
            "a sliding window (``sliding_window``, or a window group: alone, it is group 0's)",
            lambda c: (
                c.sliding_window is not None
                or any(g.kind == "window" for g in getattr(c, "groups", ()))
            ),
            {"sliding_window": 2},
        ),
        Feature(
            "groups",
            "several KV-cache groups",
            lambda c: len(getattr(c, "groups", ())) > 1,
            {"groups": (Group("full", 1), Group("state", 1))},
        ),
        Feature(
            "cross_attention",
            "a cross-attention group (encoder-decoder: tables sized by encoder tokens)",
            lambda c: any(g.kind == "cross" for g in getattr(c, "groups", ())),
            {"groups": (Group("full", 1), Group("cross", 1))},
        ),
        Feature(
            "slot_groups",
            "a slot group (a recurrent state in one slot per request, cached by copy)",
            lambda c: any(g.kind == "slot" for g in getattr(c, "groups", ())),
            {"groups": (Group("full", 1), Group("slot", 1)), "prefix_caching": False},
        ),
        Feature(
            "chunked_local",
            "a chunked local attention group (a token attends to its own chunk only)",
            lambda c: any(g.kind == "chunked" for g in getattr(c, "groups", ())),
            {"groups": (Group("chunked", 1, chunk=2),)},
        ),
        Feature(
            "track_slots",
            "a slot group's track slots (a step's track write, a track slot donated: "
            "SGLang's MAMBA extra_buffer, spec/tracks.py)",
            None,  # a feature of the engine's effects; it needs a slot group (the example)
            {"groups": (Group("full", 1), Group("slot", 1)), "prefix_caching": False},
        ),
        Feature(
            "hash_lookahead",
            "lookahead hashing (keys that name the tokens after a block)",
            lambda c: getattr(c, "hash_lookahead", 0) > 0,
            {"hash_lookahead": 1},
        ),
        Feature(
            "cache_aware_admission",
            "cache-aware admission (the waiting queue reordered by cached prefix)",
            lambda c: getattr(c, "admission_window", 0) > 0,
            {"admission_window": 2},
        ),
        Feature(
            "trim_at_finish",
            "a finish that frees the blocks before the window first (beside a KV connector)",
            lambda c: getattr(c, "trim_at_finish", False),
            {"sliding_window": 2, "trim_at_finish": True},
        ),
        Feature("loads", "external KV loads (and their failures)", None),
        Feature(
            "bounded_hits",
            "prefix-cache hits bounded by the engine (an admission's bound)",
            None,
        ),
        Feature(
            "reset_running",
            "a reset preempting the running requests beside steps in flight",
            None,
        ),
    )
}
"""Every feature, by name."""

PARAMETERS = (
    "num_blocks",
    "block_size",
    "depth",
    "policy",
    "discipline",
    "preemption",
    "token_budget",
    "max_running",
    "stop_token",
)
"""The ``Config`` fields that are no feature: sizes, limits and choices every form takes."""

FIELDS_OF: dict[str, str] = {
    "async_scheduling": "async_scheduling",
    "stale_output": "stale_output_deliver",
    "prefix_caching": "prefix_caching_off",
    "spec_tokens": "spec_tokens",
    "delay_load_registration": "delay_load_registration",
    "defer_free": "defer_free",
    "defer_loads": "defer_loads",
    "sliding_window": "sliding_window",
    "groups": "groups",
    "hash_lookahead": "hash_lookahead",
    "admission_window": "cache_aware_admission",
    "admission_threshold": "cache_aware_admission",
    "trim_at_finish": "trim_at_finish",
}
"""Each ``Config`` field that is a feature's, and the feature."""

GROUP_KIND_FEATURES: dict[str, str] = {
    "cross": "cross_attention",
    "slot": "slot_groups",
    "chunked": "chunked_local",
}
"""Group kinds (``Group.kind`` in ``Config.groups``) that are a feature of their own beside
``groups``: the field is ``groups``', the feature the kind's."""


def features_on(config: Config) -> list[str]:
    """The configuration features ``config`` turns on, in registry order."""
    return [f.name for f in FEATURES.values() if f.on is not None and f.on(config)]
