"""Benchmark of the streaming checker (``kvspec check``) and of the in-process ``Monitor``.

1. Writes a long v1 trace from the reference engine (policy ``deferred``, vLLM discipline, depth
   2, 256 blocks of 16 tokens, shared-prefix requests arriving in waves of 100), streaming: the
   engine's event list is drained after every step, so nothing grows with the trace.
2. Throughput in events/s on one core, each mode stopped after ``--seconds``: the reader alone
   (parse and validate every line), the checker with every invariant after every decision (the
   default: finds everything the Judge finds, at the same event), and the incremental mode
   (invariants every ``--every`` decisions).
3. Peak memory (tracemalloc: reader + checker, streaming from the file) checking the first L and
   the first 4 L events in the incremental mode (the state kept is the same for every k): it must
   stay flat. L should cover more than 256 finished requests (the report keeps the rings of the
   last 256 finished requests, so memory rises until then).
4. The monitor's overhead on the reference engine: the engine alone (recording its events) versus
   the engine feeding every event to a ``Monitor`` as it runs.

    .venv/bin/python bench/bench_checker.py [--events 10000000] [--seconds 60] [--every 64]
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

from kvspec.conformance.checker import Checker, Monitor
from kvspec.conformance.trace import iter_trace, write_trace
from kvspec.reference import Engine, EngineConfig
from kvspec.reference.workload import shared_prefix_workload
from kvspec.spec import Config

COMMON = dict(
    num_blocks=256,
    block_size=16,
    depth=2,
    policy="deferred",
    discipline="vllm",
    preemption="fcfs",
    token_budget=2048,
    max_running=32,
)


def engine_events(limit: int, seed: int = 0) -> Iterator[tuple[object, ...]]:
    """The reference engine's events on waves of shared-prefix requests, stopping after the
    engine step (or arrival) at which ``limit`` events are reached: a decision is never cut from
    its effects, so the trace is complete (a little over ``limit`` events)."""
    engine = Engine(EngineConfig(**COMMON))  # type: ignore[arg-type]
    sink = engine.events
    produced, next_id = 0, 0
    for wave in itertools.count():
        for _, prompt, max_tokens, priority in shared_prefix_workload(
            100, 4, 128, 16, 16, seed + wave
        ):
            engine.add_request(next_id, prompt, max_tokens, priority)
            next_id += 1
        more = True
        while more:
            more = engine.step()
            yield from sink
            produced += len(sink)
            sink.clear()
            if produced >= limit:
                return


def throughput(path: Path, seconds: float, every: int | None) -> tuple[int, float]:
    """(events, seconds) for the reader alone (``every`` None) or the checker."""
    config, lines = iter_trace(path)
    checker = Checker(config, every) if every else None
    count = 0
    started = time.perf_counter()
    for _, event, hash_ in lines:
        if checker is not None and checker.feed(event, None, hash_) is not None:
            raise SystemExit(f"unexpected finding: {checker.finding}")
        count += 1
        if count % 4096 == 0 and time.perf_counter() - started > seconds:
            break
    return count, time.perf_counter() - started


def peak_memory(path: Path, events: int, every: int) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        config, lines = iter_trace(path)
        checker = Checker(config, every)
        for _, event, hash_ in itertools.islice(lines, events):
            checker.feed(event, None, hash_)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def monitor_overhead(requests: int, every: int | None) -> float:
    """Seconds to run the engine on ``requests`` requests, with a monitor unless ``every`` is
    None."""
    engine = Engine(EngineConfig(**COMMON))  # type: ignore[arg-type]
    monitor = Monitor(Config(**COMMON), every) if every else None  # type: ignore[arg-type]
    sink = engine.events
    started = time.perf_counter()
    for rid, prompt, max_tokens, priority in shared_prefix_workload(requests, 4, 128, 16, 16, 7):
        engine.add_request(rid, prompt, max_tokens, priority)
    while engine.step():
        if monitor is not None:
            monitor.feed_all(sink)
        sink.clear()
    if monitor is not None:
        monitor.feed_all(sink)
        monitor.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--seconds", type=float, default=60.0, help="cap per throughput mode")
    parser.add_argument("--every", type=int, default=64, help="incremental mode's k")
    parser.add_argument("--memory-events", type=int, default=50_000, help="L")
    parser.add_argument("--requests", type=int, default=600, help="monitor overhead workload")
    parser.add_argument("--trace", help="keep the trace here (default: a temporary file)")
    parser.add_argument("--reuse", action="store_true", help="reuse an existing --trace file")
    args = parser.parse_args()

    folder = tempfile.mkdtemp()
    path = Path(args.trace or os.path.join(folder, "bench.jsonl"))
    started = time.perf_counter()
    if args.reuse and path.exists():
        count = sum(1 for _ in iter_trace(path)[1])
    else:
        count = write_trace(path, Config(**COMMON), engine_events(args.events), hashes=True)  # type: ignore[arg-type]
    print(
        f"trace: {count:,} events, {path.stat().st_size / 2**20:.0f} MiB, written in "
        f"{time.perf_counter() - started:.0f} s (reference engine, {COMMON['num_blocks']} blocks "
        f"of {COMMON['block_size']}, depth {COMMON['depth']}, policy {COMMON['policy']})"
    )
    print(f"throughput on one core (each mode stopped after {args.seconds:g} s):")
    for label, every in (
        ("reader only (parse + validate)", None),
        ("checker, invariants every decision", 1),
        (f"checker, invariants every {args.every} decisions", args.every),
    ):
        n, seconds = throughput(path, args.seconds, every)
        print(f"  {label:45s} {n / seconds:>12,.0f} events/s ({n:,} events in {seconds:.1f} s)")
    length = args.memory_events
    for every in (args.every,):  # the state kept does not depend on k; k = 1 is just slower
        small = peak_memory(path, length, every)
        large = peak_memory(path, 4 * length, every)
        print(
            f"peak memory, invariants every {every}: {small / 2**20:.2f} MiB at {length:,} events, "
            f"{large / 2**20:.2f} MiB at {4 * length:,} events (ratio {large / small:.2f})"
        )
    alone = min(monitor_overhead(args.requests, None) for _ in range(3))
    print(f"monitor overhead on the reference engine ({args.requests} requests):")
    print(f"  engine alone (recording events)              {alone:.3f} s")
    for every in (1, args.every):
        monitored = min(monitor_overhead(args.requests, every) for _ in range(2))
        print(
            f"  engine + monitor, invariants every {every:<4d}      {monitored:.3f} s "
            f"(overhead {100 * (monitored / alone - 1):,.0f}%)"
        )


if __name__ == "__main__":
    main()
