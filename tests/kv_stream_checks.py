"""The engine's own KV-event stream, judged in process on fixed workloads; run inside the engine's
venv by ``tests/test_kv_stream_vllm.py``.

``python tests/kv_stream_checks.py ENGINE CASE...`` prints one line per case: the stream's first
finding, or ``none`` with the batches and stream events judged and the step boundaries passed.
ENGINE is ``vllm`` or ``sglang``. Cases: ``clean`` (a shared-prefix workload with evictions and a
reset; for vLLM under every factory: ``factory`` (vLLM's defaults: the synchronous scheduler at
depth 1, async scheduling from 2) at depths 1 and 2, ``drop_factory`` at 3, ``sync_factory`` at 2,
``async_drop_factory`` at 3; for SGLang its overlap loop, ``factory`` at depth 2, and
``sync_factory`` at depth 1, and its other tree caches: ``legacy_factory`` and
``python_core_factory``), ``drop-removal`` (the publisher loses
the first ``BlockRemoved``: ``ViewEqualsCache``), ``duplicate`` (vLLM: a block-aligned prompt
twice, judged as a set-based router would: ``StoreNamesNewHash``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from thirdparty_checks import ADAPTERS, CLEAN, Ones  # noqa: E402

from kvspec.judge import Judge  # noqa: E402
from kvspec.spec import Config  # noqa: E402

BIG = dict(num_blocks=12, block_size=4, token_budget=16, max_running=4)
SMALL = dict(num_blocks=6, block_size=2, token_budget=8, max_running=2)
WORKLOAD = CLEAN + [  # more prompts than the pool holds: evictions; then a reset and one more
    ("arrive", (3, (2, 1, 2, 1, 2, 1, 2, 1, 2), 3, 0)),
    ("step", (30,)),
    ("arrive", (4, (3, 3, 3, 3, 1, 1, 1, 1, 3), 3, 0)),
    ("step", (30,)),
    ("reset", ()),
    ("arrive", (5, (1, 2, 3, 4, 5, 6, 7, 8, 1), 3, 0)),
    ("step", (30,)),
]
SHORT = [  # the same for 5 blocks of 2 tokens
    ("arrive", (0, (1, 2, 3, 4, 1), 2, 0)),
    ("arrive", (1, (1, 2, 3, 4, 2), 2, 0)),
    ("step", (20,)),
    ("arrive", (2, (2, 1, 2, 1, 2), 2, 0)),
    ("step", (20,)),
    ("arrive", (3, (3, 3, 1, 1, 3), 2, 0)),
    ("step", (20,)),
    ("reset", ()),
    ("arrive", (4, (1, 2, 3, 4, 3), 2, 0)),
    ("step", (20,)),
]
DEPTH = {"vllm": 1, "sglang": 2}
"""The depth of ``drop-removal`` and ``duplicate``: SGLang's ``factory`` is its overlap loop."""
TWICE = [
    ("arrive", (0, (1, 2, 3, 4), 1, 0)),
    ("step", (6,)),
    ("arrive", (1, (1, 2, 3, 4), 1, 0)),
    ("step", (6,)),
]


def drop_first_removal(adapter: Any) -> None:
    """Plant a fault in what the engine's publisher sends: the first ``BlockRemoved`` is lost."""
    forward = getattr(getattr(adapter, "scheduler", None), "kv_event_publisher", None)
    if forward is not None:  # vLLM: the scheduler's publisher is the adapter's forwarder
        publish = forward.publish

        def publish_(batch: Any) -> None:
            removals = [i for i, e in enumerate(batch.events) if type(e).__name__ == "BlockRemoved"]
            if removals and not getattr(forward, "dropped", False):
                del batch.events[removals[0]]
                forward.dropped = True
            publish(batch)

        forward.publish = publish_
        return
    stream = adapter.kv_stream  # SGLang: the tree's recorder feeds the adapter's publish
    take = stream.tree.take_events

    def take_events() -> list[Any]:
        events = take()
        removals = [i for i, e in enumerate(events) if type(e).__name__ == "BlockRemoved"]
        if removals and not getattr(stream, "dropped", False):
            del events[removals[0]]
            stream.dropped = True
        return events

    stream.tree.take_events = take_events


def drive(adapter: Any, judge: Any, workload: list[Any], to_end: bool = False) -> Any:
    """Runs the workload on the adapter, judging its events and its KV-event stream after each
    item; the first finding (None if it holds). ``to_end``: the whole workload runs after a
    finding, so that a capture holds what the engine published after it."""
    first = None
    for what, args in workload:
        start = len(adapter.events)
        if what == "arrive":
            adapter.add_request(*args)
        elif what == "reset":
            adapter.reset_prefix_cache()
        else:
            for _ in range(args[0]):
                adapter.step()
        finding = judge.feed_all(adapter.events[start:]) or adapter.check_kv_stream(judge)
        first = first or finding
        if first is not None and not to_end:
            return first
    return first


def run(engine: str, workload: list[Any], factory: str = "factory", fault: str | None = None, **cell: Any) -> None:  # fmt: skip
    module = importlib.import_module(f"kvspec.conformance.adapters.{ADAPTERS[engine]}")
    defaults = {"policy": "eager-unsafe"} if engine == "vllm" else {"policy": "engine-registers", "discipline": "general"}  # fmt: skip
    config = Config(**{**defaults, "stop_token": 0, **cell})
    adapter = getattr(module, factory)(config, Ones())
    if fault == "drop-removal":
        drop_first_removal(adapter)
    observed = getattr(adapter, "judging", "strict") == "observed"
    judge = Judge.spec(adapter.config, observed)
    finding = drive(adapter, judge, workload)
    stream = adapter.kv_stream.engine
    totals = stream.judge.stats
    where = f"{factory} depth {config.depth}"
    if finding is not None:
        print(f"{finding.invariant}: {finding.message} [{where}]")
    else:
        print(f"none {totals.batches} batches {totals.events} events {totals.boundaries} boundaries {totals.cleared} clears [{where}]")  # fmt: skip


if __name__ == "__main__":
    engine = sys.argv[1]
    for case in sys.argv[2:]:
        if case == "clean" and engine == "vllm":
            run(engine, WORKLOAD, preemption="fcfs", depth=1, **BIG)
            run(engine, SHORT, preemption="fcfs", depth=2, **SMALL)
            run(engine, SHORT, "drop_factory", preemption="priority", depth=3, **SMALL)
            run(engine, WORKLOAD, "sync_factory", preemption="fcfs", depth=2, **BIG)
            run(engine, SHORT, "async_drop_factory", preemption="priority", depth=3, **SMALL)
        elif case == "clean":  # SGLang: its overlap loop (depth 2) and the loop without it
            run(engine, WORKLOAD, depth=2, **BIG)
            run(engine, SHORT, depth=2, **SMALL)
            run(engine, WORKLOAD, "sync_factory", **BIG)
            run(engine, WORKLOAD, "legacy_factory", depth=2, **BIG)  # the legacy RadixCache
            run(engine, SHORT, "python_core_factory", depth=2, **SMALL)  # the Python TreeCore
        elif case == "drop-removal":
            run(engine, SHORT, fault="drop-removal", depth=DEPTH[engine], **SMALL)
        elif case == "duplicate":
            os.environ["KVSPEC_KV_STREAM_INVARIANTS"] = "RemovalNamesAnnounced,StoreNamesNewHash"
            run(engine, TWICE, depth=DEPTH[engine], **SMALL)
            del os.environ["KVSPEC_KV_STREAM_INVARIANTS"]
