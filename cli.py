"""The ``kvspec`` command line: parses arguments and calls into the subpackages, nothing more.

Exit codes, the same for every command (``main`` is the one place that enforces them):

  0  holds, or done
  1  a finding: a violation, a counterexample, a replay mismatch
  2  bad input or arguments: one line on stderr naming the place (also: a size beyond the
     memory budget, --max-memory)
  3  undecided: the solver gave no answer, the budget was too small to check anything, a
     replay had nothing to compare
  4  an internal error of kvspec: one line on stderr naming the crash report saved
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kvspec import __version__, flow
from kvspec.cell import FUZZ, SIMULATE, Cell, add_arguments
from kvspec.cell import number as _number
from kvspec.conformance import budget
from kvspec.outputs import output_path, reader_safe_stdout
from kvspec.spec import (
    DISCIPLINES,
    INVARIANTS,
    OBSERVED_POLICIES,
    POLICIES,
    PREEMPTIONS,
    STALE_OUTPUTS,
    Config,
)

if TYPE_CHECKING:
    from kvspec.conformance.fuzz import CellResult

HOLDS, FINDING, BAD_INPUT, UNDECIDED, INTERNAL = 0, 1, 2, 3, 4
INTERRUPTED = 130
DOCS = Path(__file__).resolve().parent / "docs"
PROVE_LIMITS = {"blocks": (2, 8), "requests": (1, 3), "depth": (1, 3), "bound": (1, 40)}
"""The sizes the symbolic model of ``kvspec prove`` is built for (``proofs/symbolic.py``)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())}\n")
        raise SystemExit(BAD_INPUT)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help with every option's default, unless the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or "%(default)" in text
            or default is None
            or isinstance(default, bool)  # a flag: its help says what it does, not True/False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


_positive = _number

MAX_DEPTH = budget.MAX_DEPTH
"""The most steps in flight a command takes (engines run 1 to 3; more only costs memory)."""


def _size(text: str) -> int:
    try:
        return budget.parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _groups(text: str) -> tuple[tuple[str, int | None, int | str | None], ...]:
    """--groups: the groups it names (``fuzz_groups.parse_groups``); bad syntax is exit 2."""
    from kvspec.conformance.fuzz_groups import parse_groups

    try:
        return parse_groups(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _path(text: str) -> str:
    """An input file's path: not empty (whether it can be read is the reader's to say)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-memory",
        type=_size,
        metavar="SIZE",
        default=None,
        help="memory budget: every size a file or a flag claims is priced against it before "
        f"anything is allocated, e.g. 4G, 512M (default: ${budget.ENV}, else half of the "
        "machine's memory)",
    )


def _cell_arguments(
    p: argparse.ArgumentParser, command: str, policies: Collection[str] = POLICIES
) -> None:
    """The options of a ``Cell`` that ``command`` offers (``cell.add_arguments``), and --seed."""
    add_arguments(p, command, policies)
    p.add_argument("--seed", type=int, default=0, help="random seed (a run repeats from it)")


def _junit_argument(p: argparse.ArgumentParser, cases: str) -> None:
    p.add_argument(
        "--junit",
        metavar="FILE",
        type=output_path,
        help=f"also write a JUnit XML report here for CI ({cases}; a finding is a failure)",
    )


def _format_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        default="v0",
        choices=("v0", "v1"),
        help="--out file format: v0 event file or v1 trace (docs/trace-format.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvspec",
        description="kvspec: the KV-cache block lifecycle, specified, fuzzed, proved and checked."
        + __doc__[__doc__.index("\n\nExit codes") :],
        formatter_class=_Help,
        epilog=f"documentation: {DOCS}",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvspec {__version__} (Python {sys.version.split()[0]})",
        help="print kvspec's version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text, formatter_class=_Help)
        return p

    fuzz = command("fuzz", "lockstep-fuzz an engine (default: the reference) against the spec")
    # engine-registers: for --target engines that register on their own (observed judging).
    _cell_arguments(fuzz, FUZZ, (*POLICIES, *OBSERVED_POLICIES))
    fuzz.add_argument(
        "--target",
        metavar="MODULE:FACTORY",
        help="the engine's adapter factory, imported as python -m would (the current folder "
        "first; docs/adapters.md); default: the reference engine",
    )
    fuzz.add_argument(
        "--seconds",
        type=_positive(float),
        default=60.0,
        help="time budget of the whole command, searching and shrinking (a counterexample "
        "found late is shrunk less); an engine call still running 2 s past it (and for 10 s) is "
        "reported as hung, with its stack (exit 1)",
    )
    fuzz.add_argument(
        "--out",
        type=output_path,
        help="write the counterexample's events here (with the witness that reads a "
        "NoUnwrittenPublish zombie)",
    )
    _format_argument(fuzz)
    fuzz.add_argument(
        "--groups",
        metavar="KINDS",
        type=_groups,
        default=None,
        help="several KV-cache groups in the reference engine, "
        "KIND[:WINDOW|:RULE|:CHUNK][@BLOCK_SIZE] comma separated (KIND full, window, state, "
        "cross, chunked or slot, a cross or slot group never first; RULE a state's at-its-step "
        "or when-known, vLLM's; CHUNK a chunked group's attention chunk; e.g. "
        "full,window:8,state:when-known, full,cross@4 or full,chunked:8; a slot group with "
        "prefix caching under --policy engine-registers, the engine's own registration, judged "
        "observed), judged by the spec in lockstep (docs/reference-groups.md; default: one "
        "group, no flag)",
    )
    fuzz.add_argument(
        "--invariant",
        action="append",
        choices=tuple(INVARIANTS) + ("TablesAppendOnly",),
        help="look only for violations of this invariant (repeatable; default: all)",
    )
    fuzz.add_argument(
        "--check-protocol",
        action="store_true",
        help="check every adapter call's result and every event against the protocol as the "
        "runs go (a mistake is bad input, exit 2; slower)",
    )
    fuzz.add_argument(
        "--no-shrink",
        dest="shrink",
        action="store_false",
        help="report the first counterexample as found, unshrunk (faster, longer)",
    )
    fuzz.add_argument(
        "--db",
        metavar="DIR",
        help="a Hypothesis example database here: failing examples are saved and tried "
        "first next time, and --seed no longer fixes the run (default: none; Hypothesis's own "
        "files go to the user cache folder)",
    )
    _junit_argument(fuzz, "one test case for the cell")
    fuzz.add_argument(
        "--engine-log",
        action="store_true",
        help="show the --target engine's own log output (default: silenced)",
    )
    _common(fuzz)

    ach = command(
        "adapter-check",
        "check an engine's adapter against the protocol: 0 it follows it, 2 a mistake (named)",
    )
    ach.add_argument("target", metavar="MODULE:FACTORY", help="the adapter factory")
    ach.add_argument(
        "--policy",
        choices=(*POLICIES, *OBSERVED_POLICIES),
        help="registration policy the adapter is built for (default: the first the factory "
        "does not refuse)",
    )
    _common(ach)

    sim = command("simulate", "run the reference engine on a shared-prefix workload")
    _cell_arguments(sim, SIMULATE)
    sim.add_argument("--requests", type=_positive(int), default=200, help="requests")
    sim.add_argument("--blocks", type=_positive(int), default=512, help="blocks, with the null")
    sim.add_argument("--block-size", type=_positive(int), default=16, help="tokens per block")
    sim.add_argument("--out", type=output_path, required=True, help="event file to write")
    _format_argument(sim)
    _common(sim)

    rep = command(
        "replay", "replay an event file on a paged KV cache, compare with dense attention"
    )
    rep.add_argument(
        "trace", type=_path, help="event file or trace (kvspec fuzz --out, simulate --out)"
    )
    rep.add_argument(
        "--backend", default="triton", choices=("triton", "torch"), help="attention kernels"
    )
    rep.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="KV cache dtype",
    )
    rep.add_argument("--heads", type=_positive(int), default=4, help="query heads")
    rep.add_argument("--kv-heads", type=_positive(int), default=2, help="K/V heads")
    rep.add_argument("--head-dim", type=_positive(int), default=16, help="head size")
    rep.add_argument("--layers", type=_positive(int), default=2, help="layers")
    _common(rep)

    prove = command("prove", "Z3: inductive proof, else bounded model checking (shortest cex)")
    prove.add_argument("--policy", required=True, choices=POLICIES, help="registration policy")
    prove.add_argument(
        "--discipline", default="vllm", choices=DISCIPLINES, help="scheduling discipline"
    )
    prove.add_argument("--preemption", default="fcfs", choices=PREEMPTIONS, help="preemption order")

    def limited(name: str, default: int, text: str) -> None:
        low, high = PROVE_LIMITS[name]
        prove.add_argument(
            f"--{name}",
            type=_number(int, low, high),
            default=default,
            help=f"{text}, {low}..{high}",
        )

    limited("blocks", 4, "N, blocks with the null block")
    limited("requests", 2, "requests")
    limited("depth", 2, "steps in flight")
    limited("bound", 8, "decisions on a path (bounded model checking)")
    prove.add_argument(
        "--timeout", type=_positive(float), default=120.0, help="solver time limit, seconds"
    )
    prove.add_argument(
        "--out",
        type=output_path,
        help="write the counterexample's events here (with the witness that reads a "
        "NoUnwrittenPublish zombie)",
    )
    prove.add_argument(
        "--method",
        default="auto",
        choices=("auto", "bmc"),
        help="auto: induction first, then bounded model checking; bmc: only the latter",
    )
    prove.add_argument(
        "--all-sizes",
        action="store_true",
        help="prove for every number of blocks, requests and steps (the parametric model; "
        "unsafe cells: the shortest counterexample at the smallest sizes)",
    )
    prove.add_argument(
        "--spec-tokens",
        metavar="K",
        type=_number(int, 0, 64),
        default=0,
        help="speculative decoding: up to K draft tokens per decode, some rejected (with "
        "--all-sizes; not with --async and --stale-output deliver together; the per-size "
        "proofs do not model drafts)",
    )
    _prove_scheduling(prove)
    _common(prove)

    chk = command("check", "judge trace files with the spec: 0 holds, 1 violation, 2 unreadable")
    chk.add_argument(
        "traces", nargs="*", metavar="TRACE", type=_path, help="trace files (v1, or v0 events)"
    )
    chk.add_argument("--json", action="store_true", help="print a machine-readable report")
    chk.add_argument(
        "--trace-events",
        metavar="FILE",
        type=output_path,
        help="write the trace as Chrome trace-event JSON (Perfetto, chrome://tracing): a track "
        "per step, request and block, the finding marked (one TRACE)",
    )
    chk.add_argument(
        "--observed",
        action="store_true",
        help="judge with observed matching whatever the trace's header says: the engine's own "
        "legal choices of free and hit blocks accepted (docs/adapters.md)",
    )
    chk.add_argument(
        "--html",
        metavar="REPORT",
        type=output_path,
        help="write an HTML report with a picture (needs matplotlib: kvspec[html])",
    )
    chk.add_argument(
        "--witness",
        metavar="FILE",
        type=output_path,
        help="on a NoUnwrittenPublish, write the trace extended with a consumer that reads the "
        "zombie block, for kvspec replay (one TRACE only)",
    )
    chk.add_argument(
        "--check-every",
        type=_positive(int),
        default=1,
        help="evaluate invariants every K decisions (1: every decision; see docs)",
    )
    _junit_argument(chk, "one test case per trace")
    chk.add_argument(
        "--engine",
        choices=("fast", "spec"),
        default="fast",
        help="fast: the fast model judges, the spec reports; spec: the spec judges all",
    )
    _common(chk)
    _kv_events_arguments(chk, command("watch", "judge a live KV-event stream over ZMQ"))

    which = command(
        "which-policy", "judge a trace under every policy and discipline; say which it fits"
    )
    which.add_argument("trace", type=_path, metavar="TRACE", help="a trace file (v1, or v0)")
    _junit_argument(which, "one test case per policy and discipline")
    _common(which)

    _generate_arguments(
        command("generate", "generate text with a Llama model through the reference engine")
    )

    demo = command("demo", "fuzz every policy under every discipline; print verdicts")
    demo.add_argument(
        "--seconds",
        type=_positive(float),
        default=None,
        help="budget per cell (default: 10, with --full 12)",
    )
    demo.add_argument(
        "--full",
        action="store_true",
        help="every cell, async scheduling and stale output too (45; default: the 20 "
        "synchronous ones, under two minutes on two cores)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    _common(demo)
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code under the contract of the module docstring. Called
    without ``argv`` (the console script), the process also gets the memory ceiling
    (``budget.ceiling``)."""
    words = list(sys.argv[1:] if argv is None else argv)
    with reader_safe_stdout():
        return _main(words, entry=argv is None)


def _main(words: list[str], entry: bool) -> int:
    try:
        args = build_parser().parse_args(words)
    except SystemExit as done:  # --help, --version (0) or a bad argument (2, said already)
        return done.code if isinstance(done.code, int) else BAD_INPUT
    name = f"kvspec {args.command}"
    previous = budget.set_limit(args.max_memory)
    try:
        with budget.ceiling() if entry else contextlib.nullcontext():
            code = COMMANDS[args.command](args)
        if code not in (HOLDS, FINDING, BAD_INPUT, UNDECIDED):
            raise AssertionError(f"{name} returned exit code {code!r}")
        return code
    except (ValueError, OSError) as err:
        return _say(f"{name}: error: {err}", BAD_INPUT)
    except MemoryError:
        return _say(
            f"{name}: error: out of memory within the budget of {budget.fmt(budget.limit())}: "
            f"the input needs more than kvspec estimated (raise it with --max-memory)",
            BAD_INPUT,
        )
    except KeyboardInterrupt:
        return _say(f"{name}: interrupted", INTERRUPTED)
    except Exception as err:  # an internal error of kvspec: never 1, never a bare traceback
        return _crashed(name, err, words)
    finally:
        budget.set_limit(previous)


def _say(line: str, code: int) -> int:
    sys.stderr.write(" ".join(line.split()) + "\n")
    return code


def _crashed(name: str, err: BaseException, words: list[str]) -> int:
    from kvspec.crash import save_report

    what = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    try:
        where = f"a report is saved in {save_report(err, words)}"
    except Exception as why:  # the report is a courtesy; the one line and exit 4 are not
        where = f"no report could be saved ({type(why).__name__}: {why})"
    return _say(f"{name}: internal error of kvspec ({what}); {where}", INTERNAL)


def _command(function: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    COMMANDS[function.__name__.lstrip("_").replace("_", "-")] = function
    return function


def _requires(module: str, extra: str, what: str = "this command") -> None:
    """Bad input, before any work, when an optional dependency the command needs is missing."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"{what} needs {module}, which is not installed: pip install 'kvspec[{extra}]'"
        )


def _write_late(code: int, write: Callable[[], object], path: str, name: str) -> int:
    """Write an output after the verdict: a failure is one line, and a finding stays 1."""
    try:
        write()
    except OSError as err:
        _say(f"{name}: error: could not write {path}: {err}", BAD_INPUT)
        return code if code == FINDING else BAD_INPUT
    return code


def _write(
    args: argparse.Namespace,
    config: Config,
    events: list[tuple[object, ...]],
    judging: str = "strict",
) -> int:
    return flow.write(args.out, config, events, 1 if args.format == "v1" else 0, judging)


def _database_folder(path: str) -> str:
    """``--db DIR``: a folder that exists or can be made, and that kvspec can write (Hypothesis's
    database would otherwise drop every example it cannot save, silently); ValueError if not."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--db {path}: not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--db {path}: cannot make the folder: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--db {path}: the folder is not writable")
    return path


@contextlib.contextmanager
def _hypothesis_home() -> Iterator[None]:
    """Hypothesis's own files (its constants cache) in the user cache folder, not in ``.``."""
    from hypothesis import configuration

    from kvspec.crash import cache_dir

    # Older Hypothesis returns a Path, newer a StorageDirectory whose home is the folder itself.
    try:
        previous = configuration.storage_directory(intent_to_write=False)
    except TypeError:
        previous = configuration.storage_directory()
    home = getattr(previous, "home_directory", previous)
    configuration.set_hypothesis_home_dir(str(cache_dir() / "hypothesis"))
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(str(home))


@_command
def _fuzz(args: argparse.Namespace) -> int:
    from kvspec.conformance.enginelog import engine_logs
    from kvspec.conformance.report import format_counterexample, observed_hint

    if args.groups is not None:
        flow.admissible(Cell.from_args(args), args.target, groups=True)
        return _fuzz_groups(args)
    database = None
    if args.db:
        from hypothesis.database import DirectoryBasedExampleDatabase

        database = DirectoryBasedExampleDatabase(_database_folder(args.db))
    cell = Cell.from_args(args)
    with engine_logs(shown=args.engine_log), _hypothesis_home():
        result, judging = flow.fuzz(
            cell,
            args.seconds,
            args.seed,
            args.invariant,
            args.target,
            database,
            args.shrink,
            args.check_protocol,
            bounded=True,
            from_cwd=True,
            strict_only="--format v0" if args.out and args.format == "v0" else None,
        )
    name = cell.name()
    if result.failure is None and result.refusal is not None:
        return _fuzz_refused(args, result)
    if result.failure is None and result.runs == 0:
        text = (
            f"nothing checked for {name} in {result.seconds:.1f} s: no example ran (the time "
            "budget is too small, or the engine refused every configuration drawn)"
        )
        print(text)
        return _fuzz_junit(args, name, result.seconds, "undecided", text, UNDECIDED)
    if result.failure is None:
        print(
            f"no counterexample for {name} in "
            f"{result.seconds:.1f} s: {result.runs} runs, {result.commits} engine steps, "
            f"{result.lost_hits_per_1000_steps:.1f} lost hits per 1,000 steps"
        )
        _fuzz_depth(result)
        return _fuzz_junit(args, name, result.seconds, "holds", "", HOLDS)
    failure = result.failure
    text = f"counterexample found after {result.seconds_to_failure:.1f} s, {_shrunk(result, args)}:"
    text += "\n" + format_counterexample(
        failure.program, failure.finding, failure.config, failure.consequence
    )
    hint = observed_hint(
        failure.config, failure.events, failure.finding, judging, failure.snapshots
    )
    if hint is not None:
        text += "\n" + hint
        text += f" FILE (e.g. {args.out})" if args.out else " FILE (write it with --out)"
    print(text)
    _fuzz_junit(args, name, result.seconds, "finding", text, FINDING)
    if args.out:
        shown = flow.witness(failure, judging)
        count = _write(args, failure.config, shown.events, judging)
        print(f"wrote {count} events to {args.out}" + (f"; {shown.note}" if shown.note else ""))
        try:
            _fuzz_trace_events(args.out, failure, shown.events, judging)
        except OSError as err:  # the finding stays 1; its picture is a courtesy
            _say(f"kvspec fuzz: error: cannot write {args.out}.perfetto.json: {err}", FINDING)
    return FINDING


def _fuzz_groups(args: argparse.Namespace) -> int:
    """``kvspec fuzz --groups``: the reference engine's hybrid runs (``fuzz_groups``)."""
    from kvspec.conformance.fuzz_groups import run_groups_cell

    others = {
        "--target": args.target,
        "--loads": args.loads,
        "--spec-tokens": args.spec_tokens,
        "--sliding-window": args.sliding_window is not None,
        "--invariant": args.invariant,
        "--out": args.out,
        "--db": args.db,
    }
    given = [flag for flag, value in others.items() if value]
    if given:
        raise ValueError(f"--groups does not combine with {', '.join(given)} yet")
    depth = args.depth
    result = run_groups_cell(
        args.groups,
        args.policy,
        args.discipline,
        args.preemption,
        depth,
        args.async_scheduling,
        args.stale_output,
        args.prefix_caching,
        args.seconds,
        args.seed,
    )
    text = ",".join(
        kind + (f":{window}" if window else "") + (f"@{size}" if size else "")
        for kind, size, window in args.groups
    )
    name = f"{args.policy} ({args.discipline}/{args.preemption}, groups {text})"
    finding = result.finding
    if finding is None and result.runs == 0:
        line = f"nothing checked for {name} in {result.seconds:.1f} s: no run finished"
        print(line)
        return _fuzz_junit(args, name, result.seconds, "undecided", line, UNDECIDED)
    if finding is None:
        print(
            f"no counterexample for {name} in {result.seconds:.1f} s: {result.runs} runs, "
            f"{result.steps} engine steps"
        )
        print(result.coverage.line())
        print(result.coverage.groups_line())
        return _fuzz_junit(args, name, result.seconds, "holds", "", HOLDS)
    line = (
        f"counterexample found after {finding.seconds:.1f} s (run {finding.run} of seed "
        f"{args.seed}, {finding.steps} engine calls, not shrunk): {finding.invariant}: "
        f"{finding.detail}\n{finding.config}"
    )
    print(line)
    return _fuzz_junit(args, name, result.seconds, "finding", line, FINDING)


def _fuzz_trace_events(out: str, failure: object, events: list, judging: str) -> None:  # type: ignore[type-arg]
    """Beside ``--out``'s trace, its timeline as Chrome trace-event JSON (``OUT.perfetto.json``)."""
    from kvspec.conformance.trace_events import timeline, write_chrome_trace

    finding = failure.finding  # type: ignore[attr-defined]
    line = timeline(
        failure.config,  # type: ignore[attr-defined]
        events,
        finding.event,
        finding.invariant,
        finding.message,
        finding.blocks,
        judging,
    )
    path = f"{out}.perfetto.json"
    write_chrome_trace(path, line, out)
    print(f"wrote its timeline to {path} (open it in ui.perfetto.dev or chrome://tracing)")


def _fuzz_junit(
    args: argparse.Namespace, name: str, seconds: float, outcome: str, text: str, code: int
) -> int:
    """``--junit``: the cell as one test case; ``code``, or 2 when the file cannot be written
    (a finding stays 1)."""
    if not args.junit:
        return code
    from kvspec.conformance.junit import fuzz_suite, write_junit

    suite = fuzz_suite(f"kvspec fuzz {name}", seconds, outcome, text)
    return _write_late(code, lambda: write_junit(args.junit, [suite]), args.junit, "kvspec fuzz")


def _shrunk(result: CellResult, args: argparse.Namespace) -> str:
    """How far the counterexample printed was shrunk (``CellResult.stopped``)."""
    if result.stopped == "hung":
        return "not shrunk (an engine call hung: each try would hang again)"
    if result.stopped == "budget":
        return f"shrinking stopped at the --seconds {args.seconds:g} budget (the shortest so far)"
    if result.stopped == "interrupted":
        return "shrinking interrupted (the shortest so far)"
    return "shrunk" if args.shrink else "not shrunk (--no-shrink)"


def _fuzz_refused(args: argparse.Namespace, result: CellResult) -> int:
    """A run ended by the adapter's refusal mid-run: the search ends as at a factory's refusal
    (bad input, the feature named), after the coverage line counting runs ended so."""
    print(result.coverage.line())
    if str(result.refusal).startswith("kvspec internal error"):  # kvspec's bug: exit 4
        raise RuntimeError(f"while attached: {result.refusal}")
    raise ValueError(
        f"--target {args.target or 'the reference engine'}: the engine refused mid-run, "
        f"after {result.runs} runs: {result.refusal}"
    )


def _fuzz_depth(result: CellResult) -> None:
    """Two lines after a fuzzing verdict: how deep the runs went and what they reached."""
    steps = sorted(result.steps_per_run)
    if steps:
        p90 = steps[min(len(steps) - 1, int(0.9 * len(steps)))]
        print(f"engine steps per run: median {steps[len(steps) // 2]}, p90 {p90}, max {steps[-1]}")
    print(result.coverage.line())
    if result.coverage.grouped_runs:  # an engine's hybrid groups (vLLM's swa_factory)
        print(result.coverage.groups_line())


@_command
def _adapter_check(args: argparse.Namespace) -> int:
    """0 the adapter follows the protocol; 2 (one line, the method and the field) it does not."""
    from kvspec.conformance.enginelog import engine_logs

    with engine_logs(shown=False):
        count, cell = flow.adapter_check(args.target, args.policy)
    print(
        f"{args.target}: follows the adapter protocol ({count} events checked, policy "
        f"{cell.policy}, discipline {cell.discipline}, depth {cell.depth})"
    )
    return HOLDS


@_command
def _simulate(args: argparse.Namespace) -> int:
    config = Cell.from_args(args).config(  # a bad combination: one line, before any allocation
        num_blocks=args.blocks,
        block_size=args.block_size,
        token_budget=max(2048, args.block_size),
        max_running=64,
    )
    events, stats, seconds = flow.simulate(config, args.requests, args.seed)
    count = _write(args, config, events)
    hit_rate = stats["hit_tokens"] / max(1, stats["prompt_tokens"])
    print(
        f"{args.requests} requests, {stats['steps']} steps in {seconds:.2f} s; prefix hit rate "
        f"{hit_rate:.1%}; wrote {count} events to {args.out}"
    )
    return HOLDS


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@_command
def _replay(args: argparse.Namespace) -> int:
    """0 when every compared attention output matches dense attention, 1 at the first
    mismatch, 3 when nothing was compared."""
    _requires("torch", "tensors")
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
    config, result = flow.replay(args.trace, options)  # every size priced before allocation
    atol, rtol = TOLERANCES[options.dtype]
    layers = max(args.layers, len(config.groups))  # flow.replay: at least one layer a group
    groups = ", ".join(g.kind + (f" {g.window}" if g.window else "") for g in config.groups)
    print(
        f"{args.trace}: {config.policy}, {config.num_blocks} blocks of {config.block_size}; "
        + (f"groups {groups} (layer i in group i % {len(config.groups)}); " if groups else "")
        + f"{args.backend} {args.dtype}, {layers} layers, {args.heads}/{args.kv_heads} "
        f"heads of {args.head_dim}"
    )
    print(
        f"replayed {result.steps} steps in {time.perf_counter() - started:.1f} s: "
        f"{result.queries} queries compared with dense attention, max error "
        f"{result.max_error:.3g} (tolerance atol {atol:g}, rtol {rtol:g})"
    )
    if result.mismatch is not None:
        print(f"MISMATCH at {result.mismatch}")
        return FINDING
    if result.queries == 0:
        print(
            "nothing to compare: no executed step reads attention whose result is used "
            "(a NoUnwrittenPublish needs its witness: kvspec fuzz --out and kvspec check "
            "--witness write one)"
        )
        return UNDECIDED
    print("every step matches dense attention")
    return HOLDS


def _prove_scheduling(prove: argparse.ArgumentParser) -> None:
    """``kvspec prove --async / --stale-output``, as ``kvspec fuzz``'s (they need --depth >= 2:
    exit 2 below it)."""
    prove.add_argument(
        "--async",
        dest="async_scheduling",
        action="store_true",
        help="async scheduling: schedule on placeholder tokens (needs depth >= 2)",
    )
    prove.add_argument(
        "--stale-output",
        default="drop",
        choices=STALE_OUTPUTS,
        help="a preempted request's output in a submitted step: drop or deliver (needs depth >= 2)",
    )


@_command
def _prove(args: argparse.Namespace) -> int:
    """0 proof, 1 counterexample, 2 bad arguments, 3 unknown (solver timeout)."""
    _requires("z3", "proofs")
    if args.spec_tokens and not args.all_sizes:
        raise ValueError(
            "--spec-tokens needs --all-sizes: the per-size proofs do not model draft tokens"
        )
    cell = Cell(
        args.policy,
        args.discipline,
        args.preemption,
        args.depth,
        async_scheduling=args.async_scheduling,
        stale_output=args.stale_output,
        spec_tokens=args.spec_tokens,
    )
    sizes = flow.ProveSizes(args.blocks, args.requests, args.bound)
    return flow.prove(cell, sizes, args.out, args.timeout, args.method, args.all_sizes)


@_command
def _check(args: argparse.Namespace) -> int:
    """0 every trace holds, 1 a violation in one, 2 one is unreadable."""
    import orjson

    if not args.traces and not args.kv_events:
        raise ValueError("name a TRACE file or --kv-events FILE")
    if args.html:
        _requires("matplotlib", "html", "--html")
    if args.trace_events and len(args.traces) != 1:
        raise ValueError(f"--trace-events takes one TRACE, got {len(args.traces)}")
    if args.witness and (len(args.traces) != 1 or args.kv_events):
        raise ValueError(f"--witness takes one TRACE and no --kv-events, got {len(args.traces)}")
    outputs = {
        "--html": args.html,
        "--witness": args.witness,
        "--junit": args.junit,
        "--trace-events": args.trace_events,
    }
    _inputs_kept(args.traces + args.kv_events, outputs)
    reports = flow.check_all(
        args.traces,
        args.kv_events,
        args.check_every,
        args.engine,
        args.observed,
        _stream_invariants(args),
        args.blocks,
        known=args.known or (),
    )
    for report in reports:
        if report.exit_code == 2:
            sys.stderr.write(f"{report.error}\n")
    code = max(r.exit_code for r in reports)
    if args.json:
        document = {"exit": code, "reports": [r.as_dict() for r in reports]}
        print(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
    else:
        for report in reports:
            if report.exit_code != 2:
                print(report.text())
    if args.junit:
        from kvspec.conformance.junit import check_suite, write_junit

        code = _write_late(
            code,
            lambda: write_junit(args.junit, [check_suite(reports)]),
            args.junit,
            "kvspec check",
        )
    if args.html:
        from kvspec.conformance.html import write_html
        from kvspec.conformance.trace_events import of_file

        for report, path in zip(reports, args.traces, strict=False):  # the traces come first
            if report.exit_code != 2 and report.path == path:
                report.lanes = of_file(path, report)

        code = _write_late(code, lambda: write_html(reports, args.html), args.html, "kvspec check")
    if args.trace_events and reports[0].exit_code != 2:
        from kvspec.conformance.trace_events import of_file, write_chrome_trace

        line = of_file(args.traces[0], reports[0])
        code = _write_late(
            code,
            lambda: write_chrome_trace(args.trace_events, line, args.traces[0]),
            args.trace_events,
            "kvspec check",
        )
    if args.witness and reports[0].exit_code == 1:
        print(flow.witness_file(reports[0], args.witness))
    return code


def _inputs_kept(inputs: list[str], outputs: dict[str, str | None]) -> None:
    """ValueError (exit 2, before any work) for an output that would overwrite an input, and for
    ``--witness`` of a stream (it reads its TRACE again)."""
    from kvspec.conformance.inputs import STDIN, is_stream, same_file

    if inputs.count(STDIN) > 1:
        raise ValueError("standard input (-) can be read once: name it once")
    for option, output in outputs.items():
        for path in inputs if output else ():
            if same_file(path, output):  # type: ignore[arg-type]
                raise ValueError(f"{option} {output} would overwrite the input {path}")
    if outputs.get("--witness") and inputs and is_stream(inputs[0]):
        raise ValueError("--witness reads its TRACE again: give a file, not a stream")


def _kv_events_arguments(chk: argparse.ArgumentParser, watch: argparse.ArgumentParser) -> None:
    """``kvspec check --kv-events`` and ``kvspec watch`` (conformance/kvevents/)."""
    from kvspec.conformance.kvevents.known_findings import KNOWN
    from kvspec.spec.stream import STREAM_INVARIANTS

    names = tuple(STREAM_INVARIANTS)
    chk.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="FILE",
        type=_path,
        help="a capture of an engine's KV-event stream (kvspec watch --capture): judge the stream",
    )
    for p in (chk, watch):
        p.add_argument(
            "--known",
            action="append",
            choices=tuple(KNOWN),
            help="a known engine finding to read as the engine means it, counted and named in "
            "the report, judging the rest of the stream (repeatable; default: a violation)",
        )
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
    watch.add_argument(
        "--capture", metavar="FILE", type=output_path, help="write every frame received here"
    )
    watch.add_argument(
        "--seconds", type=_positive(float), help="stop after this long (default: until stopped)"
    )
    watch.add_argument("--json", action="store_true", help="print the report as JSON")
    _common(watch)


def _stream_invariants(args: argparse.Namespace) -> list[str] | None:
    if not args.stream_invariant:
        return None
    return list(args.stream_invariant) + (["ViewWithinCapacity"] if args.blocks else [])


@_command
def _watch(args: argparse.Namespace) -> int:
    """0 stopped with nothing found, 1 a violation, 2 a malformed frame or a bad endpoint."""
    return flow.watch(
        args.endpoint,
        args.replay,
        args.topic,
        args.capture,
        args.blocks,
        _stream_invariants(args),
        args.seconds,
        args.json,
        known=args.known or (),
    )


@_command
def _demo(args: argparse.Namespace) -> int:
    """0 with the table; 4 when a cell's fuzzing raised (its traceback in the crash report)."""
    from kvspec.conformance.verdicts import CellError, columns, print_table, verdict

    results = []
    errors: list[CellError] = []
    started = time.monotonic()
    from kvspec.conformance.verdicts import FULL_SECONDS, QUICK_SECONDS

    if args.seconds is None:
        args.seconds = FULL_SECONDS if args.full else QUICK_SECONDS
    with _hypothesis_home():
        for result in flow.demo(args.seconds, args.seed, args.full):
            if isinstance(result, CellError):
                shown = "ERROR"
                errors.append(result)
            else:
                shown = verdict(result)
            policy, _, loads, timing = columns(result.cell)
            print(
                f"  {policy:22s} {result.discipline}/{result.preemption:9s} {loads:17s} "
                f"{timing:20s} {shown}"
            )
            results.append(result)
    print_table(results)
    print(f"{len(results)} cells in {time.monotonic() - started:.0f} s")
    if not args.full:
        print("the async scheduling and stale-output cells: kvspec demo --full")
    if errors:
        raise CellsFailed(errors)
    empty = sum(1 for r in results if verdict(r) == "undecided")
    if empty:
        print(f"{empty} cell(s) undecided: no example ran in {args.seconds:g} s (raise --seconds)")
        return UNDECIDED
    return HOLDS


@_command
def _which_policy(args: argparse.Namespace) -> int:
    """0 the trace conforms to some (policy, discipline), 1 to none, 2 unreadable."""
    _inputs_kept([args.trace], {"--junit": args.junit})
    cells, unreadable = flow.which_policy(args.trace)
    if unreadable is not None:
        sys.stderr.write(f"{unreadable.error}\n")
        return BAD_INPUT
    width = max(len(c.policy) for c in cells)
    for cell in cells:
        mark = "  (declared)" if cell.declared else ""
        print(f"  {cell.policy:{width}s}  {cell.discipline:8s}  {cell.verdict()}{mark}")
    fits = [f"{c.policy} ({c.discipline})" for c in cells if c.holds]
    if args.junit:
        from kvspec.conformance.junit import which_suite, write_junit

        write_junit(args.junit, [which_suite(args.trace, cells)])
    if not fits:
        print(f"{args.trace}: conforms to no policy and discipline (each finding above)")
        return FINDING
    print(f"{args.trace}: conforms to {', '.join(fits)}")
    return HOLDS


class CellsFailed(Exception):
    """Fuzzing raised in some of ``demo``'s cells: an internal error (exit 4), with every
    cell's traceback in the crash report."""

    def __init__(self, errors: list) -> None:  # type: ignore[type-arg]
        super().__init__(f"{len(errors)} cell(s) raised, first: {errors[0].error}")
        self.details = "\n".join(e.details for e in errors)


def _generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument(
        "--model", required=True, help="a Hugging Face folder, a .gguf file, or smollm2"
    )
    gen.add_argument("--prompt", required=True, action="append", help="text (repeatable)")
    gen.add_argument("--max-tokens", type=_positive(int), default=32, help="tokens per prompt")
    gen.add_argument("--policy", default="deferred", choices=POLICIES, help="registration policy")
    gen.add_argument(
        "--depth",
        type=_number(int, 1, MAX_DEPTH),
        default=1,
        help=f"steps in flight (1..{MAX_DEPTH})",
    )
    gen.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "triton", "torch"),
        help="attention: auto = triton on a GPU, torch (paged, same cache) on a CPU",
    )
    gen.add_argument("--temperature", type=_number(float, 0.0, 1e6), default=0.0, help="0: greedy")
    gen.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed (with --temperature): each prompt gets its own stream from it",
    )
    gen.add_argument(
        "--same-seed",
        action="store_true",
        help="sample every prompt with --seed itself (the same prompt gives the same text)",
    )
    _common(gen)


@_command
def _generate(args: argparse.Namespace) -> int:
    """Print each prompt followed by its completion; progress goes to stderr."""
    _requires("torch", "tensors")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvspec.impl.llm.sampling import SamplingParams

    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())  # fmt: skip
    quiet = not console.is_terminal  # no bar (nor its last newline) when stderr is not a tty
    with Progress(*columns, console=console, transient=True, disable=quiet) as bar:
        stages = ("weights", "tokenizer", "cache")
        load = bar.add_task(f"loading {args.model}", total=len(stages))
        gen = bar.add_task("generating", total=args.max_tokens * len(args.prompt), visible=False)
        # seed None: the worker derives each request's seed from --seed and the request's id
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed if args.same_seed else None,
        )
        llm, outs, seconds = flow.generate(
            args.model,
            args.prompt,
            params,
            flow.LlmSetup(args.policy, args.depth, args.backend, args.seed),
            on_load=lambda stage: bar.update(load, completed=stages.index(stage)),
            on_step=lambda done, total: bar.update(gen, completed=done, visible=True),
        )
    tokens = sum(len(o.token_ids) for o in outs)
    cfg = llm.weights.config
    console.print(
        f"{cfg.num_layers} layers, {llm.weights.num_parameters / 1e6:.1f}M parameters; "
        f"attention {llm.backend} on {llm.model.cache.device}; policy {args.policy}; "
        f"{tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s)",
        highlight=False,
    )
    for number, (prompt, out) in enumerate(zip(args.prompt, outs, strict=True), 1):
        if len(outs) > 1:
            print(f"=== {number}/{len(outs)} ===")
        print(f"{prompt}{out.text}")
    return HOLDS


if __name__ == "__main__":
    raise SystemExit(main())
