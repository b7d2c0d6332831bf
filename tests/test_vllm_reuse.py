"""Engine reuse (``conformance/adapters/vllm_adapter/reuse.py``): engines built on kept
``VllmConfig``s emit the events and reach the pools of engines built from scratch, example after
example, and the kept configs stay equal to fresh ones. Runs where vLLM imports (``.venv-vllm``)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from kvspec.conformance.adapters.vllm_adapter import build, factory, fresh_factory, reuse  # noqa: E402
from kvspec.spec import Config  # noqa: E402


class Tokens:
    def __init__(self) -> None:
        self.n = 0

    def pick(self, n: int, label: str) -> int:
        self.n += 1
        return 1 + self.n % (n - 1)


PROMPT = (1, 2, 3, 1, 2, 3, 1, 2)
EXAMPLES = [  # (geometry, workload): preemption, abort, prefix hits, mid-flight ends
    (dict(num_blocks=5, block_size=2, depth=1, token_budget=6, max_running=3),
     [("arrive", PROMPT, 4), ("arrive", PROMPT[:6] + (3,), 4), ("step", 6), ("arrive", (2, 2, 1), 3), ("step", 20)]),
    (dict(num_blocks=5, block_size=2, depth=2, token_budget=6, max_running=3),
     [("arrive", PROMPT, 5), ("step", 3), ("arrive", PROMPT, 3), ("abort", 0), ("step", 3)]),
    (dict(num_blocks=5, block_size=2, depth=2, token_budget=4, max_running=3),
     [("arrive", PROMPT, 5), ("arrive", PROMPT, 5), ("step", 5)]),
    (dict(num_blocks=5, block_size=2, depth=1, token_budget=6, max_running=2),
     [("arrive", PROMPT, 4), ("arrive", PROMPT[:6] + (3,), 4), ("arrive", (2, 2, 1), 3), ("step", 9)]),
]


def _run(make) -> list:
    seen = []
    for geometry, workload in EXAMPLES:
        config = Config(policy="eager-unsafe", stop_token=0, **geometry)  # type: ignore[arg-type]
        adapter = make(config, Tokens())
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
            seen.append((list(adapter.events), adapter.snapshot(), adapter.self_check()))
    return seen


def test_a_reused_engine_equals_a_fresh_one() -> None:
    reuse.configs.clear()
    fresh = _run(fresh_factory)
    reused = _run(factory)
    assert reuse.configs.hits == 0 and reuse.configs.misses == len(EXAMPLES)
    reused_again = _run(factory)  # now every config is a kept one
    assert reuse.configs.hits == len(EXAMPLES)
    kinds = {str(e[0]) for events, _, _ in fresh for e in events}
    assert {"preempt", "abort", "hit", "publish", "evict"} <= kinds, kinds
    assert reused == fresh and reused_again == fresh
    for key, kept in reuse.configs.kept.items():  # vLLM never wrote the configs it was given
        new = build.new_vllm_config(*key)
        for f in dataclasses.fields(kept):
            if f.name != "instance_id":
                assert getattr(kept, f.name) == getattr(new, f.name), f.name
