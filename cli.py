"""The ``kvspec`` command line: parses arguments and calls into the subpackages, nothing more.

Exit codes: 0 nothing found / success, 1 a counterexample or violation, 2 bad arguments or input
(one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from kvspec.spec import DISCIPLINES, POLICIES, PREEMPTIONS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
        return value

    return parse


def _cell_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", required=True, choices=POLICIES)
    p.add_argument("--discipline", default="vllm", choices=DISCIPLINES)
    p.add_argument("--preemption", default="fcfs", choices=PREEMPTIONS)
    p.add_argument("--depth", type=_positive(int), default=None, help="steps in flight (1..)")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    fuzz = sub.add_parser("fuzz", help="lockstep-fuzz the reference engine against the spec")
    _cell_arguments(fuzz)
    fuzz.add_argument("--seconds", type=_positive(float), default=60.0)
    fuzz.add_argument("--out", help="write the counterexample's events here")
    fuzz.add_argument(
        "--loads", action="store_true", help="also external KV loads, some of which fail"
    )

    sim = sub.add_parser("simulate", help="run the reference engine on a shared-prefix workload")
    _cell_arguments(sim)
    sim.add_argument("--requests", type=_positive(int), default=200)
    sim.add_argument("--blocks", type=_positive(int), default=512)
    sim.add_argument("--block-size", type=_positive(int), default=16)
    sim.add_argument("--out", required=True, help="event file to write")

    demo = sub.add_parser("demo", help="fuzz every policy under every discipline; print verdicts")
    demo.add_argument("--seconds", type=_positive(float), default=12.0, help="budget per cell")
    demo.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"fuzz": _fuzz, "simulate": _simulate, "demo": _demo}[args.command](args)
    except (ValueError, OSError) as err:
        sys.stderr.write(f"kvspec {args.command}: error: {err}\n")
        return 2


def _fuzz(args: argparse.Namespace) -> int:
    from kvspec.conformance.fuzz import run_cell
    from kvspec.conformance.report import format_counterexample, write_events

    result = run_cell(
        args.policy,
        args.discipline,
        args.preemption,
        args.depth,
        args.loads,
        args.seconds,
        args.seed,
    )
    if result.failure is None:
        print(
            f"no counterexample for {args.policy} ({args.discipline}/{args.preemption}) in "
            f"{result.seconds:.1f} s: {result.runs} runs, {result.commits} engine steps, "
            f"{result.lost_hits_per_1000_steps:.1f} lost hits per 1,000 steps"
        )
        return 0
    failure = result.failure
    print(f"counterexample found after {result.seconds_to_failure:.1f} s, shrunk:")
    print(format_counterexample(failure.program, failure.finding, failure.config))
    if args.out:
        count = write_events(args.out, failure.config, failure.events)
        print(f"wrote {count} events to {args.out}")
    return 1


def _simulate(args: argparse.Namespace) -> int:
    from kvspec.conformance.report import write_events
    from kvspec.reference import Engine, EngineConfig
    from kvspec.reference.workload import shared_prefix_workload
    from kvspec.spec import Config

    common = dict(
        num_blocks=args.blocks,
        block_size=args.block_size,
        depth=args.depth or 1,
        policy=args.policy,
        discipline=args.discipline,
        preemption=args.preemption,
        token_budget=max(2048, args.block_size),
        max_running=64,
    )
    engine = Engine(EngineConfig(**common))
    started = time.perf_counter()
    prefix_len = 8 * args.block_size
    workload = shared_prefix_workload(args.requests, 4, prefix_len, args.block_size, 8, args.seed)
    for rid, prompt, max_tokens, priority in workload:
        engine.add_request(rid, prompt, max_tokens, priority)
    while engine.step():
        pass
    seconds = time.perf_counter() - started
    count = write_events(args.out, Config(**common), engine.events)
    stats = engine.stats
    hit_rate = stats["hit_tokens"] / max(1, stats["prompt_tokens"])
    print(
        f"{args.requests} requests, {stats['steps']} steps in {seconds:.2f} s; prefix hit rate "
        f"{hit_rate:.1%}; wrote {count} events to {args.out}"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvspec.conformance.verdicts import all_cells, print_table

    results = []
    started = time.monotonic()
    for result in all_cells(args.seconds, args.seed):
        verdict = "FAILS" if result.failure else "holds"
        loads = "kv-load failures" if result.loads else "preempt/abort"
        print(
            f"  {result.policy:22s} {result.discipline}/{result.preemption:9s} {loads:17s} {verdict}"
        )
        results.append(result)
    print_table(results)
    print(f"{len(results)} cells in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
