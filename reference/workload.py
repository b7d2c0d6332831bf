"""Synthetic workloads: the shared-prefix workload used by the benchmark and ``kvspec simulate``."""

from __future__ import annotations

import random
from collections.abc import Iterator


def shared_prefix_workload(
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    max_tokens: int,
    seed: int,
) -> Iterator[tuple[int, tuple[int, ...], int, int]]:
    """Yield ``(rid, prompt, max_tokens, priority)``: each prompt is one of ``num_prefixes``
    random shared prefixes (chosen at random) followed by a random unique suffix. Token ids are
    in [0, 32000); priorities in [0, 4). Deterministic in ``seed``."""
    if min(num_requests, num_prefixes, max_tokens) < 1 or min(prefix_len, suffix_len) < 0:
        raise ValueError("need num_requests, num_prefixes, max_tokens >= 1, lengths >= 0")
    if prefix_len + suffix_len < 1:
        raise ValueError("prefix_len + suffix_len must be >= 1")
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(32000) for _ in range(prefix_len)) for _ in range(num_prefixes)]
    for rid in range(num_requests):
        suffix = tuple(rng.randrange(32000) for _ in range(suffix_len))
        yield rid, prefixes[rng.randrange(num_prefixes)] + suffix, max_tokens, rng.randrange(4)
