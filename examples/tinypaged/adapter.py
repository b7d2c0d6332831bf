"""TinyPaged through kvspec's adapter protocol (docs/your-engine.md, conformance/adapter.py):
``kvspec fuzz --target tinypaged.adapter:factory`` builds one per fuzzed example."""

from __future__ import annotations

from kvspec.spec import Config
from tinypaged.engine import TinyPaged


class Adapter:
    def __init__(self, config: Config, choices: object) -> None:
        if config.depth != 1 or config.async_scheduling or not config.prefix_caching:
            raise ValueError("TinyPaged runs one step in flight, synchronously, with caching")
        self.config = config
        self.engine = TinyPaged(
            config.num_blocks, config.block_size, config.token_budget, config.max_running
        )
        self.events = self.engine.events

    def add_request(self, rid, prompt, max_tokens, priority, external=False) -> None:  # type: ignore[no-untyped-def]
        self.engine.add_request(rid, list(prompt), max_tokens, priority)

    def step(self) -> bool:
        return self.engine.step()

    def abort(self, rid: int) -> bool:
        return self.engine.abort(rid)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def live_requests(self) -> list[int]:
        return sorted([*self.engine.running, *self.engine.waiting])  # arrival order

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(self.engine.pool.refcount), tuple(self.engine.pool.free)


def factory(config: Config, choices: object) -> Adapter:
    return Adapter(config, choices)
