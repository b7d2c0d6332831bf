"""Run TinyPaged on a fixed workload and write its events as a kvspec trace (format v1,
docs/trace-format.md): ``python -m tinypaged.record trace.jsonl``. Plain JSON, no kvspec import:
what an engine's own tracing would write, for ``kvspec check trace.jsonl``."""

from __future__ import annotations

import json
import sys

from tinypaged.engine import TinyPaged

NUM_BLOCKS, BLOCK_SIZE, TOKEN_BUDGET, MAX_RUNNING = 12, 4, 16, 3

HEADER = {
    "format": "kvspec-trace",
    "version": 1,
    "engine": {"name": "tinypaged", "version": "0.1"},
    "num_blocks": NUM_BLOCKS,  # with the null block 0
    "block_size": BLOCK_SIZE,
    "null_block": 0,
    "guarantees": {  # what the engine promises about execution (docs/trace-format.md)
        "writes_before_reads": True,
        "steps_execute_in_order": True,
        "submitted_steps_write": True,
    },
    "model": {  # what the spec judges it as
        "policy": "deferred",  # publishes a block after the step that wrote it
        "discipline": "general",  # its own scheduling order, not vLLM's
        "preemption": "fcfs",
        "depth": 1,  # one step in flight
        "token_budget": TOKEN_BUDGET,
        "max_running": MAX_RUNNING,
        "stop_token": None,  # it stops by length only
    },
    "judging": "strict",  # its pool takes blocks in the spec's order: compare everything
}

FIELDS = {  # each event's fields, in the engine's tuple order (docs/events.md)
    "arrive": ("req", "tokens", "max_tokens", "priority"),
    "begin": ("step",), "schedule": ("req", "tokens", "loaded"), "preempt": ("req",),
    "submit": ("step",), "execute": ("step", "failed"), "commit": ("step", "sampled"),
    "abort": ("req",), "reset": (), "hit": ("req", "blocks"), "evict": ("block",),
    "alloc": ("req", "block"), "publish": ("req", "index", "block"), "unpublish": ("block",),
    "free": ("block",), "finish": ("req", "reason"),
}  # fmt: skip


def main(path: str) -> None:
    engine = TinyPaged(NUM_BLOCKS, BLOCK_SIZE, TOKEN_BUDGET, MAX_RUNNING)
    system = [7, 7, 1, 2, 3, 4, 5, 6]  # a shared system prompt: later requests hit its blocks
    for rid in range(6):
        engine.add_request(rid, system + [rid + 1] * (3 + rid), max_tokens=4 + rid % 3, priority=0)
        engine.step()
    while engine.step():
        pass
    with open(path, "w") as out:
        out.write(json.dumps(HEADER) + "\n")
        for kind, *values in engine.events:
            out.write(
                json.dumps({"ev": kind, **dict(zip(FIELDS[kind], values, strict=True))}) + "\n"
            )
    print(f"wrote {len(engine.events)} events to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
