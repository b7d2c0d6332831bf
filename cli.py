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

from kvspec import flow
from kvspec.spec import (
    DISCIPLINES,
    INVARIANTS,
    OBSERVED_POLICIES,
    POLICIES,
    PREEMPTIONS,
    STALE_OUTPUTS,
    Config,
)


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


def _cell_arguments(p: argparse.ArgumentParser, policies: tuple[str, ...] = POLICIES) -> None:
    p.add_argument("--policy", required=True, choices=policies)
    p.add_argument("--discipline", default="vllm", choices=DISCIPLINES)
    p.add_argument("--preemption", default="fcfs", choices=PREEMPTIONS)
    p.add_argument("--depth", type=_positive(int), default=None, help="steps in flight (1..)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--async",
        dest="async_scheduling",
        action="store_true",
        help="async scheduling: schedule on placeholder tokens (vLLM's default; needs depth >= 2)",
    )
    p.add_argument(
        "--stale-output",
        default="drop",
        choices=STALE_OUTPUTS,
        help="a preempted request's output in a submitted step: drop (default) or deliver "
        "(vLLM's default; needs depth >= 2)",
    )


def _depth(args: argparse.Namespace) -> int:
    """--depth, or the smallest one at which --async / --stale-output deliver mean something;
    ValueError (exit 2) for an explicit depth below it."""
    overlap = args.async_scheduling or args.stale_output == "deliver"
    if args.depth is not None and args.depth < 2 and overlap:
        raise ValueError("--async and --stale-output deliver need --depth >= 2")
    return args.depth or (2 if overlap else 1)


def _format_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        default="v0",
        choices=("v0", "v1"),
        help="--out file format: v0 event file (default) or v1 trace (docs/trace-format.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    fuzz = sub.add_parser(
        "fuzz", help="lockstep-fuzz an engine (default: the reference) against the spec"
    )
    # engine-registers: for --target engines that register on their own (observed judging).
    _cell_arguments(fuzz, POLICIES + OBSERVED_POLICIES)
    fuzz.add_argument(
        "--target",
        metavar="MODULE:FACTORY",
        help="the engine's adapter factory (docs/adapters.md); default: the reference engine",
    )
    fuzz.add_argument("--seconds", type=_positive(float), default=60.0)
    fuzz.add_argument("--out", help="write the counterexample's events here")
    _format_argument(fuzz)
    fuzz.add_argument(
        "--loads", action="store_true", help="also external KV loads, some of which fail"
    )
    fuzz.add_argument(
        "--invariant",
        action="append",
        choices=tuple(INVARIANTS) + ("TablesAppendOnly",),
        help="look only for violations of this invariant (repeatable; default: all)",
    )

    sim = sub.add_parser("simulate", help="run the reference engine on a shared-prefix workload")
    _cell_arguments(sim)
    sim.add_argument("--requests", type=_positive(int), default=200)
    sim.add_argument("--blocks", type=_positive(int), default=512)
    sim.add_argument("--block-size", type=_positive(int), default=16)
    sim.add_argument("--out", required=True, help="event file to write")
    _format_argument(sim)

    rep = sub.add_parser(
        "replay", help="replay an event file on a paged KV cache, compare with dense attention"
    )
    rep.add_argument("trace", help="event file (kvspec fuzz --out, kvspec simulate --out)")
    rep.add_argument("--backend", default="triton", choices=("triton", "torch"))
    rep.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    rep.add_argument("--heads", type=_positive(int), default=4, help="query heads")
    rep.add_argument("--kv-heads", type=_positive(int), default=2)
    rep.add_argument("--head-dim", type=_positive(int), default=16)
    rep.add_argument("--layers", type=_positive(int), default=2)

    prove = sub.add_parser(
        "prove", help="Z3: inductive proof, else bounded model checking (shortest cex)"
    )
    prove.add_argument("--policy", required=True, choices=POLICIES)
    prove.add_argument("--discipline", default="vllm", choices=DISCIPLINES)
    prove.add_argument("--preemption", default="fcfs", choices=PREEMPTIONS)
    prove.add_argument("--blocks", type=_positive(int), default=4, help="N, with the null block")
    prove.add_argument("--requests", type=_positive(int), default=2)
    prove.add_argument("--depth", type=_positive(int), default=2, help="steps in flight")
    prove.add_argument("--bound", type=_positive(int), default=8, help="decisions on a path")
    prove.add_argument("--timeout", type=_positive(float), default=120.0, help="solver seconds")
    prove.add_argument("--out", help="write the counterexample's events here")
    prove.add_argument(
        "--method",
        default="auto",
        choices=("auto", "bmc"),
        help="auto: induction first, then bounded model checking; bmc: only the latter",
    )

    chk = sub.add_parser(
        "check", help="judge trace files with the spec: 0 holds, 1 violation, 2 unreadable"
    )
    chk.add_argument("traces", nargs="*", metavar="TRACE", help="trace files (v1, or v0 events)")
    chk.add_argument("--json", action="store_true", help="print a machine-readable report")
    chk.add_argument("--html", metavar="REPORT", help="write an HTML report with a picture")
    chk.add_argument(
        "--check-every",
        type=_positive(int),
        default=1,
        help="evaluate invariants every K decisions (default 1: every decision; see docs)",
    )
    chk.add_argument(
        "--engine",
        choices=("fast", "spec"),
        default="fast",
        help="fast: the fast model judges, the spec reports (default); spec: the spec judges all",
    )

    _kv_events_arguments(sub, chk)
    _generate_arguments(sub)

    demo = sub.add_parser("demo", help="fuzz every policy under every discipline; print verdicts")
    demo.add_argument("--seconds", type=_positive(float), default=12.0, help="budget per cell")
    demo.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {
            "fuzz": _fuzz,
            "simulate": _simulate,
            "replay": _replay,
            "prove": _prove,
            "check": _check,
            "demo": _demo,
            "generate": _generate,
            "watch": _watch,
        }
        return commands[args.command](args)
    except (ValueError, OSError) as err:
        sys.stderr.write(f"kvspec {args.command}: error: {err}\n")
        return 2


def _fuzz(args: argparse.Namespace) -> int:
    from kvspec.conformance.report import format_counterexample

    _depth(args)  # --async with --depth 1 is bad input
    cell = flow.Cell(
        args.policy,
        args.discipline,
        args.preemption,
        args.depth,
        args.loads,
        args.async_scheduling,
        args.stale_output,
    )
    result, judging = flow.fuzz(cell, args.seconds, args.seed, args.invariant, args.target)
    if result.failure is None:
        timing = ", async" if args.async_scheduling else ""
        timing += ", stale output delivered" if args.stale_output == "deliver" else ""
        print(
            f"no counterexample for {args.policy} ({args.discipline}/{args.preemption}{timing}) in "
            f"{result.seconds:.1f} s: {result.runs} runs, {result.commits} engine steps, "
            f"{result.lost_hits_per_1000_steps:.1f} lost hits per 1,000 steps"
        )
        return 0
    failure = result.failure
    print(f"counterexample found after {result.seconds_to_failure:.1f} s, shrunk:")
    print(format_counterexample(failure.program, failure.finding, failure.config))
    if args.out:
        version = 1 if args.format == "v1" else 0
        count = flow.write(args.out, failure.config, failure.events, version, judging)
        print(f"wrote {count} events to {args.out}")
    return 1


def _simulate(args: argparse.Namespace) -> int:
    config = Config(
        num_blocks=args.blocks,
        block_size=args.block_size,
        depth=_depth(args),
        policy=args.policy,
        discipline=args.discipline,
        preemption=args.preemption,
        token_budget=max(2048, args.block_size),
        max_running=64,
        async_scheduling=args.async_scheduling,
        stale_output=args.stale_output,
    )
    events, stats, seconds = flow.simulate(config, args.requests, args.seed)
    count = flow.write(args.out, config, events, 1 if args.format == "v1" else 0)
    hit_rate = stats["hit_tokens"] / max(1, stats["prompt_tokens"])
    print(
        f"{args.requests} requests, {stats['steps']} steps in {seconds:.2f} s; prefix hit rate "
        f"{hit_rate:.1%}; wrote {count} events to {args.out}"
    )
    return 0


def _replay(args: argparse.Namespace) -> int:
    """Exit 0 when every step's attention matches dense attention, 1 at the first mismatch."""
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    from kvspec.impl.paged.replay import use_interpreter_without_gpu

    if args.backend == "triton":
        use_interpreter_without_gpu()  # before anything imports triton
    from kvspec.impl.paged.kv_cache import DTYPES
    from kvspec.impl.paged.replay import TOLERANCES, Options

    options = Options(
        backend=args.backend,
        dtype=DTYPES[args.dtype],
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
    )
    started = time.perf_counter()
    config, result = flow.replay(args.trace, options)
    atol, rtol = TOLERANCES[options.dtype]
    print(
        f"{args.trace}: {config.policy}, {config.num_blocks} blocks of {config.block_size}; "
        f"{args.backend} {args.dtype}, {args.layers} layers, {args.heads}/{args.kv_heads} "
        f"heads of {args.head_dim}"
    )
    print(
        f"replayed {result.steps} steps in {time.perf_counter() - started:.1f} s: "
        f"{result.queries} queries compared with dense attention, max error "
        f"{result.max_error:.3g} (tolerance atol {atol:g}, rtol {rtol:g})"
    )
    if result.mismatch is None:
        print("every step matches dense attention")
        return 0
    print(f"MISMATCH at {result.mismatch}")
    return 1


def _prove(args: argparse.Namespace) -> int:
    """Exit 0 bounded proof, 1 counterexample, 2 bad arguments, 3 unknown (solver timeout)."""
    from kvspec.proofs.prove import run_prove

    return run_prove(
        args.policy,
        args.discipline,
        args.preemption,
        args.blocks,
        args.requests,
        args.depth,
        args.bound,
        args.out,
        args.timeout,
        method=args.method,
    )


def _check(args: argparse.Namespace) -> int:
    """Exit 0 every trace holds, 1 a violation in one, 2 one is unreadable."""
    import orjson

    if not args.traces and not args.kv_events:
        raise ValueError("name a TRACE file or --kv-events FILE")
    reports = list(flow.check(args.traces, args.check_every, args.engine))
    reports += flow.check_kv_events(args.kv_events, _stream_invariants(args), args.blocks)
    for report in reports:
        if report.exit_code == 2:
            sys.stderr.write(f"{report.error}\n")
    if args.json:
        code = max(r.exit_code for r in reports)
        document = {"exit": code, "reports": [r.as_dict() for r in reports]}
        print(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
    else:
        for report in reports:
            if report.exit_code != 2:
                print(report.text())
    if args.html:
        from kvspec.conformance.html import write_html

        write_html(reports, args.html)
    return max(r.exit_code for r in reports)


def _kv_events_arguments(sub: argparse._SubParsersAction, chk: argparse.ArgumentParser) -> None:
    """``kvspec check --kv-events`` and ``kvspec watch`` (conformance/kvevents/)."""
    from kvspec.spec.stream import STREAM_INVARIANTS

    names = tuple(STREAM_INVARIANTS)
    chk.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="FILE",
        help="a capture of an engine's KV-event stream (kvspec watch --capture): judge the stream",
    )
    for p in (chk, watch := sub.add_parser("watch", help="judge a live KV-event stream over ZMQ")):
        p.add_argument(
            "--stream-invariant",
            action="append",
            choices=names,
            help="judge only this stream invariant (repeatable; default: all but StoreNamesNewHash)",
        )
        p.add_argument(
            "--blocks",
            type=_positive(int),
            help="the engine's GPU blocks: also judge ViewWithinCapacity",
        )
    watch.add_argument("endpoint", help="the publisher's endpoint, e.g. tcp://127.0.0.1:5557")
    watch.add_argument("--replay", metavar="ENDPOINT", help="its replay endpoint (fills gaps)")
    watch.add_argument("--topic", default="", help="the publisher's topic (default: all)")
    watch.add_argument("--capture", metavar="FILE", help="write every frame received here")
    watch.add_argument("--seconds", type=_positive(float), help="stop after this long (exit 0)")
    watch.add_argument("--json", action="store_true", help="print the report as JSON")


def _stream_invariants(args: argparse.Namespace) -> list[str] | None:
    if not args.stream_invariant:
        return None
    return list(args.stream_invariant) + (["ViewWithinCapacity"] if args.blocks else [])


def _watch(args: argparse.Namespace) -> int:
    """Exit 0 interrupted with nothing found, 1 a violation, 2 a malformed frame."""
    from kvspec.conformance.kvevents.watch import watch

    return watch(
        args.endpoint,
        args.replay,
        args.topic,
        args.capture,
        args.blocks,
        _stream_invariants(args),
        args.seconds,
        args.json,
    )


def _demo(args: argparse.Namespace) -> int:
    """Exit 0 with the table; 4 when a cell's fuzzing raised (its traceback saved to a file)."""
    import tempfile

    from kvspec.conformance.verdicts import CellError, print_table, scheduling

    results = []
    started = time.monotonic()
    errors = []
    for result in flow.demo(args.seconds, args.seed):
        if isinstance(result, CellError):
            verdict = "ERROR"
            errors.append(result)
        else:
            verdict = "FAILS" if result.failure else "holds"
        loads = "kv-load failures" if result.loads else "preempt/abort"
        timing = scheduling(result.async_scheduling, result.stale_output)
        print(
            f"  {result.policy:22s} {result.discipline}/{result.preemption:9s} {loads:17s} "
            f"{timing:20s} {verdict}"
        )
        results.append(result)
    print_table(results)
    print(f"{len(results)} cells in {time.monotonic() - started:.0f} s")
    if errors:
        with tempfile.NamedTemporaryFile(
            "w", prefix="kvspec-demo-crash-", suffix=".txt", delete=False
        ) as crash:
            crash.write("\n".join(e.details for e in errors))
        sys.stderr.write(
            f"kvspec demo: internal error in {len(errors)} cell(s), first: {errors[0].error}; "
            f"tracebacks in {crash.name}\n"
        )
        return 4
    return 0


def _generate_arguments(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate", help="generate text with a Llama model served through the reference engine"
    )
    gen.add_argument(
        "--model", required=True, help="a Hugging Face folder, a .gguf file, or smollm2"
    )
    gen.add_argument("--prompt", required=True, action="append", help="text (repeatable)")
    gen.add_argument("--max-tokens", type=_positive(int), default=32)
    gen.add_argument("--policy", default="deferred", choices=POLICIES)
    gen.add_argument("--depth", type=_positive(int), default=1, help="steps in flight")
    gen.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "triton", "torch"),
        help="attention: auto = triton on a GPU, torch (paged, same cache) on a CPU",
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature)")


def _generate(args: argparse.Namespace) -> int:
    """Print each prompt followed by its completion; progress goes to stderr."""
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    from kvspec.impl.paged.replay import use_interpreter_without_gpu

    if args.backend == "triton":
        use_interpreter_without_gpu()  # before anything imports triton
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvspec.impl.llm.engine import LLM
    from kvspec.impl.llm.sampling import SamplingParams

    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())  # fmt: skip
    quiet = not console.is_terminal  # no bar (nor its last newline) when stderr is not a tty
    with Progress(*columns, console=console, transient=True, disable=quiet) as bar:
        stages = ("weights", "tokenizer", "cache")
        load = bar.add_task(f"loading {args.model}", total=len(stages))
        llm = LLM(
            args.model,
            policy=args.policy,
            depth=args.depth,
            backend=args.backend,
            seed=args.seed,
            on_load=lambda stage: bar.update(load, completed=stages.index(stage)),
        )
        bar.update(load, completed=len(stages))
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        started = time.perf_counter()
        gen = bar.add_task("generating", total=args.max_tokens * len(args.prompt))
        outs = llm.generate(
            args.prompt, params, on_step=lambda done, total: bar.update(gen, completed=done)
        )
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    cfg = llm.weights.config
    console.print(
        f"{cfg.num_layers} layers, {llm.weights.num_parameters / 1e6:.1f}M parameters; "
        f"attention {llm.backend} on {llm.model.cache.device}; policy {args.policy}; "
        f"{tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s)",
        highlight=False,
    )
    for prompt, out in zip(args.prompt, outs, strict=True):
        print(f"{prompt}{out.text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
