"""What ``kvspec fuzz`` covers on vLLM 0.33.0: one cell of the vLLM adapter fuzzed for a time
budget, with the figures of the run (examples, engine steps, the first finding) and how often vLLM
went through each situation that async scheduling and stale output add (``loop.Coverage``:
placeholder decodes, preemptions of a request a submitted step holds, stale tokens delivered or
dropped, requests finishing while a later step holds them, post-output registrations).

Runs in ``.venv-vllm`` (``make thirdparty``); one JSON line per cell on stdout, then the shrunk
counterexample if one was found::

    .venv-vllm/bin/python bench/fuzz_vllm_coverage.py --factory factory --preemption fcfs \\
        --depth 2 --seconds 600 --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factory", default="factory", help="a factory of vllm_adapter")
    parser.add_argument("--preemption", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--depth", type=int, default=None, help="default: Hypothesis draws 1-3")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from kvspec.conformance.adapters import vllm_adapter
    from kvspec.conformance.adapters.vllm_adapter.loop import Coverage
    from kvspec.conformance.fuzz import run_cell
    from kvspec.conformance.report import format_counterexample

    chosen = getattr(vllm_adapter, args.factory)
    runs: list[tuple[int, Coverage]] = []

    def counting(config, choices):  # type: ignore[no-untyped-def]
        adapter = chosen(config, choices)
        runs.append((config.depth, adapter.coverage))
        return adapter

    counting.__name__ = args.factory
    result = run_cell(
        "eager-unsafe",
        "vllm",
        args.preemption,
        args.depth,
        seconds=args.seconds,
        seed_value=args.seed,
        factory=counting,
    )
    totals = {name: 0 for name in Coverage.__dataclass_fields__}
    for _, coverage in runs:
        for name, value in dataclasses.asdict(coverage).items():
            totals[name] += value
    depths = {
        str(d): sum(1 for depth, _ in runs if depth == d) for d in sorted({d for d, _ in runs})
    }
    failure = result.failure
    line = {
        "factory": args.factory,
        "preemption": args.preemption,
        "depth": args.depth or "1-3",
        "seed": args.seed,
        "seconds": round(result.seconds, 1),
        "runs": result.runs,
        "engine_steps": result.commits,
        "runs_per_depth": depths,
        "finding": None if failure is None else str(failure.finding.invariant),
        "found_after_s": None
        if result.seconds_to_failure is None
        else round(result.seconds_to_failure, 1),
        **totals,
    }
    print(json.dumps(line), flush=True)
    if failure is not None:
        print(format_counterexample(failure.program, failure.finding, failure.config))
    return 1 if failure is not None else 0


if __name__ == "__main__":
    sys.exit(main())
