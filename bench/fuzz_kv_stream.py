"""Fuzz a third-party engine with its own KV-event stream judged, one cell, and print figures.

Run in the engine's environment (``make thirdparty``)::

    .venv-vllm/bin/python bench/fuzz_kv_stream.py --preemption priority --depth 2 --seconds 600

The lockstep fuzzer drives the engine (``conformance/fuzz.py``); the adapter runs the engine's
own publisher over loopback and, at every step boundary, judges the frames it sent with the
stream's invariants and against the engine's cache (``conformance/kvevents/engine_stream.py``). By default the
spec's two end-to-end invariants (``NoUnwrittenPublish``, ``NoUnwrittenRead``) are left out, so
that a zombie block is found by the stream's own ``AnnouncedHoldsPrefix`` (what a router sees) and
not earlier by the spec; ``--all-spec`` keeps them. Prints runs, engine steps (commits), stream
batches and events judged, events judged per second, and the shrunk counterexample, whose stream
is written as a capture file with ``--capture`` (re-judge it with ``kvspec check --kv-events``).
"""

from __future__ import annotations

import argparse
import importlib
import time

from kvspec.conformance.fuzz import run_cell
from kvspec.conformance.kvevents import engine_stream as kv_stream
from kvspec.conformance.report import format_counterexample
from kvspec.spec import INVARIANTS

TARGETS = {
    "vllm": ("kvspec.conformance.adapters.vllm_adapter", "eager-unsafe", "vllm"),
    "sglang": ("kvspec.conformance.adapters.sglang_adapter", "engine-registers", "general"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=TARGETS, default="vllm")
    p.add_argument(
        "--factory", default="factory", help="a name in the engine's adapter, or MODULE:NAME"
    )
    p.add_argument("--preemption", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--all-spec", action="store_true", help="keep the spec's end-to-end invariants")
    p.add_argument("--capture", help="write the counterexample's stream here")
    args = p.parse_args()
    module_name, policy, discipline = TARGETS[args.engine]
    if ":" in args.factory:  # e.g. kvspec.conformance.adapters.vllm_adapter.hybrid:mamba_factory
        module_name, args.factory = args.factory.split(":")
    module = importlib.import_module(module_name)
    factory = getattr(module, args.factory)
    failing: list[object] = []

    def recording(config: object, choices: object) -> object:
        adapter = factory(config, choices)
        check = adapter.check_kv_stream

        def check_kv_stream(judge: object) -> object:
            found = check(judge)
            if found is not None:
                failing.append(adapter)
            return found

        adapter.check_kv_stream = check_kv_stream
        return adapter

    recording.__name__ = args.factory
    invariants = None if args.all_spec else [n for n in INVARIANTS if n not in ("NoUnwrittenPublish", "NoUnwrittenRead")]  # fmt: skip
    started = time.perf_counter()
    result = run_cell(
        policy,
        discipline,
        args.preemption,
        args.depth,
        seconds=args.seconds,
        seed_value=args.seed,
        invariants=invariants,
        factory=recording,  # type: ignore[arg-type]
    )
    seconds = time.perf_counter() - started
    totals = kv_stream.TOTALS
    print(
        f"{args.engine}:{args.factory} {discipline}/{args.preemption} depth {args.depth}: "
        f"{result.runs} runs, {result.commits} engine steps, {totals['boundaries']} step "
        f"boundaries, {totals['batches']} batches and {totals['events']} stream events judged in "
        f"{seconds:.0f} s ({totals['events'] / seconds:.0f} events/s, "
        f"{totals['boundaries'] / seconds:.0f} boundaries/s)"
    )
    extra = {
        k: v for k, v in sorted(totals.items()) if k not in ("boundaries", "batches", "events")
    }
    if extra:  # known findings read by name, coverage of the engine's stream
        print(", ".join(f"{k}: {v}" for k, v in extra.items()))
    if result.failure is None:
        print("no violation")
        return
    failure = result.failure
    print(
        f"found after {result.seconds_to_failure:.1f} s ({result.unshrunk_length} steps unshrunk)"
    )
    print(format_counterexample(failure.program, failure.finding, failure.config))
    if failing and args.capture:
        adapter = failing[-1]
        stream = adapter.kv_stream.engine  # type: ignore[attr-defined]
        count = stream.write_capture(args.capture)
        print(f"wrote {count} frames of its stream to {args.capture}")


if __name__ == "__main__":
    main()
