"""``kvspec check`` on async traces against synchronous ones (issue #12's target: async traces
judged at no less than 90% of the synchronous events/s).

Two v1 traces of the same workload from the reference engine (waves of shared-prefix requests,
policy ``deferred``, vLLM discipline, depth 2, 64 blocks of 16 tokens so that requests are
preempted): one synchronous (``async_scheduling=False``, stale output dropped), one with vLLM's
defaults (async scheduling, stale output delivered). Each run of ``check_file`` judges one whole
trace; the modes run interleaved in every round, so a load on the machine hits them alike; the
medians of ``--rounds`` rounds and their ratios are printed. Engines: ``fast`` (the compiled fast
model, what ``kvspec check`` uses; ``source`` when it is not built) and ``spec``.

    .venv/bin/python bench/bench_async_check.py [--events 200000] [--rounds 5] [--spec-events 30000]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvspec.conformance.check import check_file
from kvspec.conformance.judge import fastbuild
from kvspec.conformance.trace import write_trace
from kvspec.reference import Engine, EngineConfig
from kvspec.reference.workload import shared_prefix_workload
from kvspec.spec import Config

COMMON = dict(
    num_blocks=64,
    block_size=16,
    depth=2,
    policy="deferred",
    discipline="vllm",
    preemption="fcfs",
    token_budget=1024,
    max_running=16,
)
MODES = {"sync": dict(), "async": dict(async_scheduling=True, stale_output="deliver")}


def events(extra: dict[str, object], limit: int) -> Iterator[tuple[object, ...]]:
    """The engine's events, stopping after the step at which ``limit`` events are reached."""
    engine = Engine(EngineConfig(**COMMON, **extra))  # type: ignore[arg-type]
    produced, next_id = 0, 0
    for wave in itertools.count():
        for _, prompt, max_tokens, priority in shared_prefix_workload(100, 4, 128, 16, 16, wave):
            engine.add_request(next_id, prompt, max_tokens, priority)
            next_id += 1
        while engine.step():
            yield from engine.events
            produced += len(engine.events)
            engine.events.clear()
            if produced >= limit:
                return


def counts(path: Path) -> dict[str, int]:
    from kvspec.conformance.trace import iter_trace

    _, lines = iter_trace(path)
    kinds: dict[str, int] = {}
    for _, event, _ in lines:
        kinds[str(event[0])] = kinds.get(str(event[0]), 0) + 1
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="events per trace (fast)")
    parser.add_argument("--spec-events", type=int, default=30_000, help="events per trace (spec)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kvspec-async-bench-"))
    traces: dict[tuple[str, str], Path] = {}
    for mode, extra in MODES.items():
        config = Config(**COMMON, **extra)  # type: ignore[arg-type]
        for engine, limit in (("fast", args.events), ("spec", args.spec_events)):
            path = folder / f"{mode}-{engine}.jsonl"
            write_trace(path, config, events(extra, limit), hashes=True)
            traces[mode, engine] = path
    for mode in MODES:
        kinds = counts(traces[mode, "fast"])
        print(
            f"{mode:5s} trace: {sum(kinds.values()):,} events, {kinds.get('preempt', 0):,} preemptions,"
            f" {kinds.get('finish', 0):,} finishes, {kinds.get('publish', 0):,} publishes"
        )
    built = fastbuild.compiled()[0] is not None
    print(f"fast engine: {'compiled (mypyc)' if built else 'from source (not built)'}")
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in traces}
    for _ in range(args.rounds):
        for key, path in traces.items():
            started = time.process_time()  # CPU time: wall time varies 2x on these machines
            report = check_file(path, engine=key[1])
            seconds = time.process_time() - started
            if report.exit_code != 0:
                raise SystemExit(f"{key}: unexpected verdict: {report.text()}")
            rates[key].append(report.events / seconds)
    print(f"\nkvspec check, CPU events/s, median of {args.rounds} interleaved rounds")
    print(f"{'engine':8s} {'sync':>12s} {'async':>12s} {'async/sync':>11s}")
    for engine in ("fast", "spec"):
        sync = statistics.median(rates["sync", engine])
        asyn = statistics.median(rates["async", engine])
        print(f"{engine:8s} {sync:12,.0f} {asyn:12,.0f} {asyn / sync:10.0%}")


if __name__ == "__main__":
    main()
