"""Benchmark of the reference engine on the anchor workload, plus fuzzing speed.

Anchor workload (comparable with vLLM 0.33.0 on the same machine): 10,000 requests, each prompt
one of 20 shared 512-token system prompts plus a unique 64-token suffix, 32 decoded tokens each, at
most 64 requests live at once, 4,096 blocks of 16 tokens, chained sha256 hashing of full blocks.

Prints, per policy, the median over ``--repeats`` runs (policies interleaved run by run, so they
share the machine's conditions): requests/s, engine steps/s, block-pool operations/s (blocks
allocated + touched + freed per second), prefix hit rate, and the ratio to ``eager-unsafe``. Then
lockstep fuzzing steps/s, and the time the fuzzer takes to find the seed bug over several seeds.

``--async`` adds rows of the same workload under async scheduling (depth ``max(2, --depth)``,
stale output dropped, and delivered). ``--baseline DIR`` adds rows of another checkout's
``reference/`` folder (it imports nothing of kvspec, so it loads as a package of its own), run
interleaved with this one: before and after side by side, with the ratio to the baseline.

    .venv/bin/python bench/bench_reference.py [--requests 10000] [--repeats 3] [--seeds 10]
        [--async] [--baseline ../main/reference] [--seeds 0 --fuzz-seconds 0]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

from kvspec import reference
from kvspec.conformance.fuzz import run_cell
from kvspec.reference.workload import shared_prefix_workload
from kvspec.spec import POLICIES


def load_baseline(folder: str) -> ModuleType:
    """Another checkout's ``reference/`` as the package ``baseline_reference``."""
    init = Path(folder) / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "baseline_reference", init, submodule_search_locations=[str(Path(folder))]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {folder}: no reference package there")
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_reference"] = module
    spec.loader.exec_module(module)
    return module


def run_anchor(
    policy: str, requests: int, depth: int, engine_module: ModuleType = reference, **mode: object
) -> dict[str, float]:
    config = engine_module.EngineConfig(
        num_blocks=4096,
        block_size=16,
        depth=depth,
        policy=policy,
        token_budget=8192,
        max_running=64,
        **mode,
    )
    engine = engine_module.Engine(config, record=False)
    workload = iter(shared_prefix_workload(requests, 20, 512, 64, 32, seed=0))
    live: set[int] = set()
    started = time.perf_counter()
    pending = True
    while pending or live:
        while pending and len(live) < 64:
            item = next(workload, None)
            if item is None:
                pending = False
                break
            rid, prompt, max_tokens, priority = item
            engine.add_request(rid, prompt, max_tokens, priority)
            live.add(rid)
        engine.step()
        live = {rid for rid in live if engine.requests[rid].status != "finished"}
    seconds = time.perf_counter() - started
    stats = engine.stats
    pool_ops = stats["blocks_allocated"] + stats["blocks_touched"] + stats["blocks_freed"]
    return {
        "seconds": seconds,
        "requests/s": requests / seconds,
        "steps/s": stats["steps"] / seconds,
        "pool ops/s": pool_ops / seconds,
        "hit rate": stats["hit_tokens"] / stats["prompt_tokens"],
    }


def fuzz_speed(seconds: float) -> float:
    """Engine steps per second in lockstep fuzzing of a safe policy (nothing to shrink)."""
    result = run_cell("deferred", "vllm", "priority", None, False, seconds, 0)
    return result.commits / result.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--fuzz-seconds", type=float, default=10.0)
    parser.add_argument("--async", dest="overlap", action="store_true", help="add async rows")
    parser.add_argument("--baseline", metavar="DIR", help="another checkout's reference/ folder")
    args = parser.parse_args()

    async_depth = max(2, args.depth)
    modes: list[tuple[str, ModuleType, int, dict[str, object]]] = [
        ("this", reference, args.depth, {})
    ]
    if args.baseline:
        modes.insert(0, ("baseline", load_baseline(args.baseline), args.depth, {}))
    if args.overlap:
        modes += [
            ("async, drop", reference, async_depth, {"async_scheduling": True}),
            (
                "async, deliver",
                reference,
                async_depth,
                {"async_scheduling": True, "stale_output": "deliver"},
            ),
        ]
    runs: dict[tuple[str, str], list[dict[str, float]]] = {
        (p, m[0]): [] for p in POLICIES for m in modes
    }
    for _ in range(args.repeats):
        for policy in POLICIES:
            for name, module, depth, mode in modes:
                runs[policy, name].append(run_anchor(policy, args.requests, depth, module, **mode))
    print(
        f"anchor workload: {args.requests} requests, 20 x 512-token shared prompts + 64 unique, "
        f"32 decoded, 64 live, 4096 blocks of 16, depth {args.depth} (async rows: depth "
        f"{async_depth}); median of {args.repeats}, modes interleaved run by run"
    )
    header = (
        f"{'policy':24s} {'engine':15s} {'req/s':>9s} {'steps/s':>9s} {'pool ops/s':>11s} "
        f"{'hit rate':>9s} {'vs eager-unsafe':>16s} {'vs first row':>13s}"
    )
    print(header)
    for policy in POLICIES:
        first = None
        for name, *_ in modes:
            rs = runs[policy, name]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            base = statistics.median(r["requests/s"] for r in runs["eager-unsafe", name])
            first = first or med["requests/s"]
            print(
                f"{policy:24s} {name:15s} {med['requests/s']:9.0f} {med['steps/s']:9.0f} "
                f"{med['pool ops/s']:11.0f} {med['hit rate']:9.1%} "
                f"{med['requests/s'] / base:15.2f}x {med['requests/s'] / first:12.2f}x"
            )
    if args.fuzz_seconds <= 0:
        return

    print(
        f"lockstep fuzzing (deferred, vllm/priority): {fuzz_speed(args.fuzz_seconds):.0f} engine steps/s"
    )

    times = []
    for seed_value in range(args.seeds):
        result = run_cell("eager-unsafe", "vllm", "priority", None, False, 120.0, seed_value)
        found = result.seconds_to_failure
        times.append(found if found is not None else float("inf"))
        invariant = result.failure.finding.invariant if result.failure else "not found"
        print(f"  seed {seed_value}: seed bug ({invariant}) found after {times[-1]:.2f} s")
    print(
        f"seed bug (eager-unsafe, vllm/priority): median {statistics.median(times):.2f} s over {args.seeds} seeds"
    )


if __name__ == "__main__":
    main()
