"""Engine reuse (``conformance/adapters/vllm_adapter/reuse.py``): engines built on kept
``VllmConfig``s emit the events (compared alone first), reach the pools and pass the self-checks
of engines built from scratch, after every action, example after example (a construction key
repeated within a run, once after an example that left a step unprocessed), and the kept configs
stay equal to fresh ones. Runs where vLLM imports (``.venv-vllm``)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest

pytest.importorskip("vllm")

from kvspec.conformance.adapters.vllm_adapter import (  # noqa: E402
    build,
    factory,
    fresh_factory,
    reuse,
)
from kvspec.spec import Config  # noqa: E402


class Tokens:
    def __init__(self) -> None:
        self.n = 0

    def pick(self, n: int, label: str) -> int:
        self.n += 1
        return 1 + self.n % (n - 1)


PROMPT = (1, 2, 3, 1, 2, 3, 1, 2)
FIRST = dict(num_blocks=5, block_size=2, depth=1, token_budget=6, max_running=3)
SECOND = dict(num_blocks=5, block_size=2, depth=2, token_budget=6, max_running=3)
EXAMPLES = [  # (geometry, workload): preemption, abort, prefix hits, mid-flight ends
    (
        FIRST,
        [
            ("arrive", PROMPT, 4),
            ("arrive", PROMPT[:6] + (3,), 4),
            ("step", 6),
            ("arrive", (2, 2, 1), 3),
            ("step", 20),
        ],
    ),
    (
        SECOND,
        [("arrive", PROMPT, 5), ("step", 3), ("arrive", PROMPT, 3), ("abort", 0), ("step", 3)],
    ),
    (
        dict(num_blocks=5, block_size=2, depth=2, token_budget=4, max_running=3),
        [("arrive", PROMPT, 5), ("arrive", PROMPT, 5), ("step", 5)],
    ),
    (
        dict(num_blocks=5, block_size=2, depth=1, token_budget=6, max_running=2),
        [
            ("arrive", PROMPT, 4),
            ("arrive", PROMPT[:6] + (3,), 4),
            ("arrive", (2, 2, 1), 3),
            ("step", 9),
        ],
    ),
    # The first example's construction key again, within one run: the prompt it cached would
    # be a hit here if anything of that engine (its pool's hash index) carried over.
    (FIRST, [("arrive", PROMPT, 3), ("step", 8)]),
    # An example that ends with a step scheduled and not processed (its blocks' KV events still
    # queued in the pool), then another on that construction key.
    (SECOND, [("arrive", PROMPT, 5), ("step", 1)]),
    (SECOND, [("arrive", (2, 1, 2, 1), 3), ("step", 6)]),
]
KEYS = 4
"""Construction keys among the examples (the last three repeat earlier ones)."""


class Seen(NamedTuple):
    """What one example's engine showed after one action of its workload."""

    events: list[Any]
    snapshot: Any
    check: str | None


def _run(make) -> list[list[Seen]]:
    """Per example, what its engine showed after each action."""
    examples = []
    for geometry, workload in EXAMPLES:
        config = Config(policy="eager-unsafe", stop_token=0, **geometry)  # type: ignore[arg-type]
        adapter = make(config, Tokens())
        seen = []
        rid = 0
        for action in workload:
            if action[0] == "arrive":
                adapter.add_request(rid, action[1], action[2], 0)
                rid += 1
            elif action[0] == "abort":
                adapter.abort(action[1])
            else:
                for _ in range(action[1]):
                    adapter.step()
            seen.append(Seen(list(adapter.events), adapter.snapshot(), adapter.self_check()))
        examples.append(seen)
    return examples


SHOWN = {"events": "events", "snapshot": "pools (refcounts, free queue)", "check": "self-checks"}


def _same(name: str, got: list[list[Seen]], fresh: list[list[Seen]]) -> None:
    """The events alone first (what the fuzzer judges), then the pools and the self-checks."""
    for field in Seen._fields:
        for i, (ours, theirs) in enumerate(zip(got, fresh, strict=True)):
            for j, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                assert getattr(a, field) == getattr(b, field), (
                    f"{name}: example {i}, after action {j} ({EXAMPLES[i][1][j]}): the engine "
                    f"on a kept config and a fresh one differ in their {SHOWN[field]}"
                )


def test_a_reused_engine_equals_a_fresh_one() -> None:
    reuse.configs.clear()
    fresh = _run(fresh_factory)
    assert reuse.configs.hits == reuse.configs.misses == 0  # fresh_factory keeps nothing
    assert all(s.check is None for seen in fresh for s in seen)
    kinds = {str(e[0]) for seen in fresh for e in seen[-1].events}
    assert {"preempt", "abort", "hit", "publish", "evict"} <= kinds, kinds
    reused = _run(factory)  # the last three examples are on configs kept by earlier ones
    assert (reuse.configs.hits, reuse.configs.misses) == (len(EXAMPLES) - KEYS, KEYS)
    _same("reused", reused, fresh)
    reused_again = _run(factory)  # now every config is a kept one
    assert reuse.configs.hits == 2 * len(EXAMPLES) - KEYS
    _same("reused again", reused_again, fresh)
    for key, kept in reuse.configs.kept.items():  # vLLM never wrote the configs it was given
        new = build.new_vllm_config(*key)
        for f in dataclasses.fields(kept):
            if f.name != "instance_id":
                assert getattr(kept, f.name) == getattr(new, f.name), f.name
