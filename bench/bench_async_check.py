"""``kvspec check`` on async traces against synchronous ones (issue #12's target: async traces
judged at no less than 90% of the synchronous events/s).

Three v1 traces of the same workload from the reference engine (waves of shared-prefix requests,
policy ``deferred``, vLLM discipline, 64 blocks of 16 tokens so that requests are preempted):

* ``sync-d1``: synchronous, one step in flight: vLLM's ``Scheduler`` as ``vllm serve`` runs it
  with async scheduling off (no pipeline parallelism, so one batch at a time);
* ``sync-d2``: synchronous, two steps in flight (a pipelined batch queue). A step built while
  the one before is in flight can only take new prefill chunks (every running request waits for
  its token), so about every other step is nearly empty and cheap to judge;
* ``async-d2``: vLLM's defaults: async scheduling, two steps in flight, stale output delivered.

Each check runs in a fresh process (``check_file``, timed in CPU seconds inside it, start-up
excluded): judged in one long-lived process, a check's speed depended on what that process had
judged before (the spec engine's garbage). The modes run interleaved in every
round; each round's async speed is divided by the same round's synchronous speeds, and the
median of those ratios is printed beside the medians of the speeds, with every round's ratio
(on a shared machine one round can differ widely from the next), and so are the best round of
each mode and their ratio, since interference only ever slows a run down. Engines: ``fast`` (the
compiled fast model, what ``kvspec check`` uses; ``source`` when it is not built) and ``spec``.

Then the fast judge (``fastbuild.fast_judge``) on each synchronous trace in lockstep with the
async one: one event to each judge in turn, each timed, so a slow spell of the machine falls on
both alike, and the rounds agree far more closely than those above. Twice: reading each
event from its file as ``kvspec check`` does (what a check costs, less its report and its
checkpoints), and judging alone on events read beforehand (what async judging costs).

    .venv/bin/python bench/bench_async_check.py [--events 200000] [--rounds 7] [--spec-events 30000]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvspec.conformance.check import FREEZE_EVERY
from kvspec.conformance.trace import iter_trace, write_trace
from kvspec.judge import fastbuild
from kvspec.reference import Engine, EngineConfig
from kvspec.reference.workload import shared_prefix_workload
from kvspec.spec import Config

COMMON = dict(
    num_blocks=64,
    block_size=16,
    policy="deferred",
    discipline="vllm",
    preemption="fcfs",
    token_budget=1024,
    max_running=16,
)
MODES: dict[str, dict[str, object]] = {
    "sync-d1": dict(depth=1),
    "sync-d2": dict(depth=2),
    "async-d2": dict(depth=2, async_scheduling=True, stale_output="deliver"),
}
ASYNC = "async-d2"
CHILD = """
import json, sys, time
from kvspec.conformance.check import check_file
started = time.process_time()
report = check_file(sys.argv[1], engine=sys.argv[2])
seconds = time.process_time() - started
if report.exit_code != 0:
    sys.exit(report.text())
print(json.dumps({"events": report.events, "seconds": seconds}))
"""
"""A fresh process: ``kvspec check`` of one trace, its CPU seconds (start-up excluded)."""


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
    _, lines = iter_trace(path)
    kinds: dict[str, int] = {}
    for _, event, _ in lines:
        kinds[str(event[0])] = kinds.get(str(event[0]), 0) + 1
    return kinds


def rate(path: Path, engine: str) -> float:
    """Events/s of ``kvspec check --engine ENGINE`` on ``path``, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), engine], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"{path.name} ({engine}): {done.stderr.strip()[-2000:]}")
    got = json.loads(done.stdout.splitlines()[-1])
    return float(got["events"]) / float(got["seconds"])


def lockstep(sync: Path, asyn: Path, reading: bool) -> tuple[float, float]:
    """CPU seconds of the fast judge on each trace, fed in lockstep (one event each in turn),
    with the reading of each event (``reading``: the file parsed as ``kvspec check`` does) or
    alone (events read beforehand). As in ``kvspec check``, what the judges hold is frozen out
    of the collector every ``FREEZE_EVERY`` events (outside the timing)."""
    judges, streams = [], []
    for path in (sync, asyn):
        config, lines = iter_trace(path, fast=True)
        streams.append(lines if reading else iter(list(lines)))
        judges.append(fastbuild.fast_judge(config, "raise")[0])
    (feed_s, feed_a), (next_s, next_a) = [j.feed for j in judges], [s.__next__ for s in streams]
    clock, spent, count = time.process_time_ns, [0, 0], 0
    try:
        while True:
            if count % FREEZE_EVERY == 0:
                gc.freeze()
            count += 1
            t0 = clock()
            ls, es, hs = next_s()
            feed_s(es, hs, ls)
            t1 = clock()
            la, ea, ha = next_a()
            feed_a(ea, ha, la)
            t2 = clock()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
    except StopIteration:  # the shorter trace ended (the last pair is not counted)
        pass
    finally:
        gc.unfreeze()
    for path, judge in zip((sync, asyn), judges, strict=True):
        if judge.finding is not None:
            raise SystemExit(f"{path.name}: unexpected finding: {judge.finding}")
    return spent[0] / 1e9, spent[1] / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="events per trace (fast)")
    parser.add_argument("--spec-events", type=int, default=30_000, help="events per trace (spec)")
    parser.add_argument("--rounds", type=int, default=7)
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
        steps = kinds.get("commit", 0)
        print(
            f"{mode:8s} trace: {sum(kinds.values()):,} events, {steps:,} steps"
            f" ({kinds.get('schedule', 0) / max(steps, 1):.1f} entries each),"
            f" {kinds.get('preempt', 0):,} preemptions, {kinds.get('finish', 0):,} finishes,"
            f" {kinds.get('publish', 0):,} publishes"
        )
    built = fastbuild.compiled()[0] is not None
    print(f"fast engine: {'compiled (mypyc)' if built else 'from source (not built)'}")
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in traces}
    for _ in range(args.rounds):
        for key, path in traces.items():
            rates[key].append(rate(path, key[1]))
    print(f"\nkvspec check, CPU events/s, fresh processes, {args.rounds} interleaved rounds:")
    print("the median of the rounds, and in brackets the best round (interference only slows)")
    syncs = [mode for mode in MODES if mode != ASYNC]
    print(f"{'engine':7s}" + "".join(f"{mode:>20s}" for mode in MODES))
    for engine in ("fast", "spec"):
        print(
            f"{engine:7s}"
            + "".join(
                f"{statistics.median(rates[mode, engine]):11,.0f} [{max(rates[mode, engine]):6,.0f}]"
                for mode in MODES
            )
        )
    print("\nasync/sync: the median of the rounds' ratios, and in brackets best against best")
    for engine in ("fast", "spec"):
        line = f"{engine:7s}"
        for mode in syncs:
            ratios = [a / s for a, s in zip(rates[ASYNC, engine], rates[mode, engine], strict=True)]
            best = max(rates[ASYNC, engine]) / max(rates[mode, engine])
            line += f"   async/{mode} {statistics.median(ratios):4.0%} [{best:4.0%}]"
        print(line)
    print("\nevery round's ratio (fast):")
    for mode in syncs:
        ratios = [a / s for a, s in zip(rates[ASYNC, "fast"], rates[mode, "fast"], strict=True)]
        print(f"  async/{mode:8s} " + " ".join(f"{r:.0%}" for r in ratios))
    print(
        f"\nthe fast judge in lockstep, {args.rounds} rounds: async/sync speed, median and per round"
    )
    for reading in (True, False):
        what = "reading and judging" if reading else "judging alone      "
        for mode in syncs:
            ratios = []
            for _ in range(args.rounds):
                sync_s, async_s = lockstep(traces[mode, "fast"], traces[ASYNC, "fast"], reading)
                ratios.append(sync_s / async_s)  # as many events of each
            print(
                f"  {what} async/{mode:8s} {statistics.median(ratios):4.0%}   "
                + " ".join(f"{r:.0%}" for r in ratios)
            )


if __name__ == "__main__":
    main()
