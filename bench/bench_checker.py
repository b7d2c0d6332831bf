"""Benchmark of the streaming checker (``kvspec check``) and of the in-process ``Monitor``, on
both engines side by side: ``fast`` (the default: a judge over the fast model of
``judge/fastmodel.py`` finds, the spec judge reports) and ``spec`` (the spec judge
judges everything).

1. Writes a long v1 trace from the reference engine (policy ``deferred``, vLLM discipline, depth
   2, 256 blocks of 16 tokens, shared-prefix requests arriving in waves of 100), streaming: the
   engine's event list is drained after every step (the engine itself keeps every request it saw,
   so this runs in a child process). The trace goes to a temporary folder unless ``--trace`` says
   where (``--reuse`` keeps an existing one).
2. Throughput on one core, in events/s over the first ``--sample`` events of the trace (copied
   to a file of their own), median of ``--rounds`` rounds; the modes run interleaved in each
   round, so a load on the machine hits them alike: the readers alone (``parse_line`` validating
   every field; the fast reader, which falls back to it only on a bad line), the spec's actions
   alone (the floor of any checker built on the executable spec), ``kvspec check`` with each
   engine (``check_file``: reading included), and the spec engine with invariants every k
   decisions (``--every``). The fast engine runs twice, on each build of the hot path: the
   package mypyc compiled (``judge/fastbuild.py``; what ``kvspec check`` uses when
   it is built) and the source modules; so does the fast judge alone, on events read beforehand.
   ``--baseline REF``: ``kvspec check`` (fast, compiled) of this tree and of git revision REF
   (checked out and compiled in a temporary folder), each in a fresh process, in the same
   interleaved rounds: before and after, side by side in one run.
3. Peak memory: a fresh process checks the first L events (``--memory``, default 1M, 3M, 10M)
   with the fast engine (``--spec-memory``: with the spec engine, default 1M) and reports its
   peak resident set size (``VmHWM``, interpreter included) and its throughput over those L
   events: memory must stay flat as L grows.
4. The monitor's overhead on the reference engine: the engine alone (recording its events) versus
   the engine feeding every event to a ``Monitor`` as it runs (synchronous with each engine;
   ``BackgroundMonitor``, with the default queue and a deeper one), and two rows that split a
   ``BackgroundMonitor``'s cost: its capture alone (encoding and writes, no judge) and a busy
   process beside the engine (what any neighbour costs it on this machine). Each run is a fresh
   process after a warm-up run, rounds interleaved; each figure is the median over ``--rounds``,
   its added share the median of each round's ratio to that round's engine alone, with the least
   and greatest: the engine thread's time, the wall-clock to ``close()``'s verdict, the CPU time
   of the engine's process and of it and the background judge together. The header names the
   judge's build (a fast model judging from source is about a third of the speed, and the engine
   then waits on it). ``--step-ms`` sleeps after each engine step (a model's forward pass);
   ``--monitor-only`` runs this part alone (no trace); with ``--baseline REF`` it runs the
   engine alone, the two ``BackgroundMonitor`` rows and ``Monitor.fast`` of this tree and of REF,
   interleaved.

    .venv/bin/python bench/bench_checker.py [--events 10000000] [--sample 300000] [--rounds 3]
        [--every 16 64] [--memory 1000000 3000000 10000000] [--spec-memory 1000000]
        [--requests 600] [--step-ms 0] [--trace F --reuse] [--monitor-only] [--baseline REF]
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import orjson

from kvspec.conformance.background import BackgroundMonitor
from kvspec.conformance.check import check_file
from kvspec.conformance.monitor import Monitor
from kvspec.conformance.trace import iter_trace, write_trace
from kvspec.judge import Judge, core, fastbuild
from kvspec.reference import Engine, EngineConfig
from kvspec.reference.workload import shared_prefix_workload
from kvspec.spec import ACTIONS, Config, apply, initial_state
from kvspec.spec.events import Event

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


def read_only(path: Path, sample: int) -> int:
    _, lines = iter_trace(path)
    return sum(1 for _ in itertools.islice(lines, sample))


def read_fast(path: Path, sample: int) -> int:
    _, lines = iter_trace(path, fast=True)
    return sum(1 for _ in itertools.islice(lines, sample))


def check_engine(engine: str) -> Callable[[Path, int], int]:
    """``kvspec check --engine ENGINE`` on the sample file (which holds ``sample`` events)."""

    def run(path: Path, sample: int) -> int:
        report = check_file(path, engine=engine)
        if report.exit_code != 0:
            raise SystemExit(f"unexpected verdict: {report.text()}")
        return report.events

    return run


def check_fast(build: ModuleType) -> Callable[[Path, int], int]:
    """``kvspec check --engine fast`` with the judge and fast model of ``build``."""

    def run(path: Path, sample: int) -> int:
        report = check_file(path, build=build)
        if report.exit_code != 0:
            raise SystemExit(f"unexpected verdict: {report.text()}")
        return report.events

    return run


def model_only(build: ModuleType, events: list[tuple[Event, str | None]], config: Config):
    """The fast judge alone, on events read beforehand."""

    def run(path: Path, sample: int) -> int:
        fast = build.Judge.fast(config)
        feed = fast.feed
        for event, hash_ in events:
            if feed(event, hash_) is not None:
                raise SystemExit(f"unexpected finding: {fast.finding}")
        return len(events)

    return run


def spec_only(path: Path, sample: int) -> int:
    config, lines = iter_trace(path)
    s, count = initial_state(config), 0
    for _, event, _ in itertools.islice(lines, sample):
        if event[0] in ACTIONS:
            apply(s, event)
        count += 1
    return count


def checked(every: int) -> Callable[[Path, int], int]:
    def run(path: Path, sample: int) -> int:
        config, lines = iter_trace(path)
        checker, count = Judge.stream(config, check_every=every), 0
        for line, event, hash_ in itertools.islice(lines, sample):
            if checker.feed(event, hash_, line) is not None:
                raise SystemExit(f"unexpected finding: {checker.finding}")
            count += 1
        return count

    return run


def memory_child(path: Path, length: int, engine: str) -> None:
    """In a fresh process: check the first ``length`` events, print peak RSS and speed."""
    started = time.perf_counter()
    if engine == "fast":
        report = check_file(path, limit=length)
        assert report.exit_code == 0 and report.note is None, report.text()
        count = report.events
    else:
        count = checked(1)(path, length)
    seconds = time.perf_counter() - started
    print(json.dumps({"events": count, "seconds": seconds, "peak_kib": peak_rss_kib()}))


def peak_rss_kib() -> int:
    """This process's peak resident set size. ``VmHWM`` where Linux has it: ``ru_maxrss`` would
    carry over the parent's peak across fork and exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


ROOT = Path(__file__).resolve().parents[1]
CHECK_CHILD = """
import json, sys, time
from pathlib import Path
path, folder = Path(sys.argv[1]), Path(sys.argv[2])
if len(sys.argv) > 3:  # mypy reads the package from sys.prefix/mypy-path (this tree's, not the venv's)
    sys.prefix = sys.argv[3]
try:  # this layout: the judge's hot path compiled as a group
    from kvspec.judge import fastbuild
    from kvspec.conformance.check import check_file as check
except ImportError:  # the layout before the judge's core (one compiled fast model)
    from kvspec.conformance import fastbuild
    from kvspec.conformance.checker import _check_path_fast as check
fastbuild.FOLDER = folder
fastbuild._compiled = None
found = fastbuild.compiled()[0]
if found is None:
    fastbuild.build(folder)
    fastbuild._compiled = None
    found = fastbuild.compiled()[0]
assert found is not None, fastbuild.compiled()
started = time.process_time()
report = check(path)
assert report.exit_code == 0 and report.note is None, report.text()
print(json.dumps({"events": report.events, "seconds": time.process_time() - started}))
"""
"""A fresh process: ``kvspec check`` (fast, compiled) of the tree on its ``PYTHONPATH``, built
into a folder of its own, timed without the start-up, in CPU seconds (``process_time``: time the
machine gives to other work, or to no one, is not counted; these machines vary by 2x in wall
time from one run to the next)."""


def tree_link(tree: Path) -> Path:
    """A temporary folder holding ``kvspec`` -> ``tree``: on ``PYTHONPATH``, it imports ``tree``."""
    link = Path(tempfile.mkdtemp(prefix="kvspec-tree-"))
    atexit.register(shutil.rmtree, link, True)
    (link / "kvspec").symlink_to(tree)
    return link


def own_build(tree: Path) -> tuple[Path, Path, dict[str, str]]:
    """For children that import ``tree`` and judge with a compiled build of its own: the folder
    to put on ``PYTHONPATH`` (with the ``mypy-path`` the build reads), an empty temporary folder
    for the build, and the children's environment."""
    link = tree_link(tree)
    (link / "mypy-path").mkdir()
    (link / "mypy-path" / "kvspec").symlink_to(tree)
    folder = Path(tempfile.mkdtemp(prefix="kvspec-mypyc-"))
    atexit.register(shutil.rmtree, folder, True)
    env = {**os.environ, "PYTHONPATH": str(link), "MYPYPATH": str(link / "mypy-path")}
    return link, folder, env


def worker(tree: Path, sample: Path) -> Callable[[Path, int], int]:
    """``kvspec check`` of ``tree`` in a fresh process (its own compiled build, in a temporary
    folder); its ``took`` is the child's own timing of the check, start-up excluded."""
    link, folder, env = own_build(tree)

    def run(path: Path, sample_size: int) -> int:
        done = subprocess.run(
            [sys.executable, "-c", CHECK_CHILD, str(path), str(folder), str(link)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        if done.returncode != 0:
            raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
        got = json.loads(done.stdout.splitlines()[-1])
        run.took = got["seconds"]  # type: ignore[attr-defined]
        return got["events"]

    return run


ASYNC_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(Config)
    if f.name in ("async_scheduling", "stale_output")
}
"""Header fields a trace of a synchronous engine may leave out (``Config``'s defaults)."""


def older_header(raw: bytes) -> bytes:
    """The sample's header without the async fields at their defaults, so that a baseline from
    before async scheduling (which refuses fields it does not know) reads the same file."""
    header = orjson.loads(raw)
    model = header.get("model", {})
    for name, default in ASYNC_DEFAULTS.items():
        if name in model and model[name] == default:
            del model[name]
    return orjson.dumps(header) + b"\n"


def baseline(ref: str, sample: Path) -> Callable[[Path, int], int]:
    """``worker`` on git revision ``ref`` of this repository, checked out in a temporary folder."""
    return worker(checkout(ref), sample)


def checkout(ref: str) -> Path:
    """Git revision ``ref`` of this repository in a temporary folder, removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="kvspec-baseline-"))
    tree = folder / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
        check=True,
        capture_output=True,
    )

    def remove() -> None:  # the checkout and git's record of it: nothing left behind
        git = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)]
        subprocess.run(git, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(remove)
    return tree


MONITORS: dict[str, dict[str, object] | None] = {
    "engine alone (recording events)": None,
    "engine, a busy process beside (not fed)": {"beside": True},
    "engine + capture only (no judge)": {"capture": True},
    "engine + BackgroundMonitor": {"background": True},
    "engine + BackgroundMonitor, depth 64": {"background": True, "queue_depth": 64},
    "engine + Monitor.fast (sync)": {"judging": "fast"},
    "engine + Monitor.on_spec (sync)": {"judging": "spec"},
}
"""Part 4's rows. Depth 64 holds most of a 3000-request run in its queue: its engine-thread time
is the cost of feeding while the judge keeps up. *Capture only* is the engine's side of a
``BackgroundMonitor`` without a judge (its encoding and its writes, to a reader that discards
them); *a busy process beside* is the engine alone next to a process spinning on another core
(not fed): what any busy neighbour costs the engine on this machine, whatever it runs. A
``BackgroundMonitor``'s added CPU is about the sum of the two."""


class CaptureOnly:
    """The engine's side of a ``BackgroundMonitor`` and nothing else: events encoded into batches
    as it encodes them (``background.Batch``), each full batch written to a child that discards
    it (``cat``, widened as the monitor's pipe is)."""

    def __init__(self) -> None:
        from kvspec.conformance import background

        self.batch, self.size, self.child = background.Batch(), background.BATCH_SIZE, None
        self.proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        background._widen(self.proc.stdin)

    def feed_all(self, events: list[tuple[object, ...]]) -> None:
        batch = self.batch
        batch.put(events, len(events))
        if batch.events >= self.size:
            with batch.frame() as frame:
                self.proc.stdin.write(frame)  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
            batch.clear()

    def close(self) -> None:
        with self.batch.frame() as frame:
            self.proc.stdin.write(frame)  # type: ignore[union-attr]
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait()


class Beside:
    """A process spinning beside the engine, fed nothing; killed at ``close`` (not reaped there:
    its CPU is not the run's)."""

    def __init__(self) -> None:
        self.child = None
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)  # running before the clock starts

    def feed_all(self, events: list[tuple[object, ...]]) -> None:
        pass

    def close(self) -> None:
        self.proc.kill()


def child_cpu(pid: int) -> float:
    """CPU seconds (user + system) a live child process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def monitored_run(
    requests: int, options: dict[str, object] | None, step_seconds: float = 0.0
) -> tuple[float, float, float, float]:
    """Run the engine on ``requests`` requests, feeding a Monitor (``options``) or not: (seconds
    of the engine's thread up to its last ``feed``, wall seconds up to the verdict of ``close``,
    CPU seconds of this process, and of this process and a background judge together). ``step_seconds``: a
    sleep after every engine step, standing for the model's forward pass (the GPU's time, when
    the engine's thread waits). The Monitor is made
    before the clock starts, as an engine makes it at start-up; a background judge's CPU time
    before the run (starting its interpreter) is not counted."""
    engine = Engine(EngineConfig(**COMMON))  # type: ignore[arg-type]
    watch = _monitor(options)
    bg = watch.child if isinstance(watch, BackgroundMonitor) else None
    judge_before = children_cpu() + (child_cpu(bg.proc.pid) if bg is not None else 0.0)
    sink = engine.events
    cpu = time.process_time()
    started = time.perf_counter()
    for rid, prompt, max_tokens, priority in shared_prefix_workload(requests, 4, 128, 16, 16, 7):
        engine.add_request(rid, prompt, max_tokens, priority)
    while engine.step():
        if watch is not None:
            watch.feed_all(sink)
        sink.clear()
        if step_seconds:
            time.sleep(step_seconds)
    if watch is not None:
        watch.feed_all(sink)
    engine_done = time.perf_counter()
    if watch is not None:
        watch.close()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu
    return engine_done - started, wall, cpu, cpu + children_cpu() - judge_before


def monitor_start_seconds(rounds: int) -> float:
    """Median wall seconds to make a background Monitor and close it at once."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        BackgroundMonitor(Config(**COMMON)).close()  # type: ignore[arg-type]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


COMPARED = (
    "engine alone (recording events)",
    "engine + BackgroundMonitor",
    "engine + BackgroundMonitor, depth 64",
    "engine + Monitor.fast (sync)",
)
"""The rows ``--monitor-only --baseline REF`` runs on both trees."""


def monitor_child(label: str, requests: int, step_ms: float, folder: Path, link: Path) -> None:
    """In a fresh process, with the kvspec on ``PYTHONPATH``: that tree's own compiled build, in
    ``folder`` (built there by the first child, as ``CHECK_CHILD`` does; ``link`` holds the
    ``mypy-path`` it builds with), a warm-up run (a tenth of the requests; first-run costs such
    as cold caches are not counted), then ``label``'s run; its figures as JSON, and the fast
    model's note (None: the compiled build judges)."""
    sys.prefix = str(link)
    fastbuild.FOLDER = folder
    fastbuild._compiled = None
    if fastbuild.compiled()[0] is None:
        fastbuild.build(folder)
        fastbuild._compiled = None
    options = MONITORS[label]
    monitored_run(max(requests // 10, 10), options)
    figures = monitored_run(requests, options, step_ms / 1000)
    note = Monitor.fast(Config(**COMMON)).note  # type: ignore[arg-type]
    print(json.dumps([*figures, note]))


def monitor_worker(tree: Path) -> Callable[[str, int, float], list[object]]:
    """``monitor_child`` of ``tree`` (this script, importing ``tree``'s package), judged by that
    tree's own compiled build in a temporary folder: a baseline whose judge's sources differ
    from this tree's would otherwise run from source, a third of the speed."""
    link, folder, env = own_build(tree)

    def run(label: str, requests: int, step_ms: float) -> list[object]:
        command = [sys.executable, __file__, "--monitor-child", label, str(requests)]
        command += [str(step_ms), str(folder), str(link)]
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir()
        )
        if done.returncode != 0:
            raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
        return list(json.loads(done.stdout.splitlines()[-1]))

    return run


FIGURES = ("engine thread", "wall to verdict", "CPU engine proc", "CPU all procs")


def monitor_rounds(
    trees: dict[str, Path], labels: tuple[str, ...], requests: int, rounds: int, step_ms: float
) -> None:
    """Part 4, for the plain table and ``--baseline`` alike: each (tree, row) run in a fresh
    process (a warm-up run first), rounds interleaved (the order of the rows and of the trees
    reversed every other round, so that a drift in the machine's load hits them alike). Each
    figure: the median over the rounds, and its added share against the engine alone of the
    same tree *paired by round* (each round's row against that round's engine alone): the
    median of those ratios, with their least and greatest. The same rows in one process (the
    former plain table) share a heap and a warm interpreter, and the judge's build: a figure
    from there is not one from here."""
    workers = {tree: monitor_worker(path) for tree, path in trees.items()}
    runs: dict[tuple[str, str], list[list[object]]] = {
        (tree, label): [] for tree in trees for label in labels
    }
    for round_ in range(rounds):
        step = 1 if round_ % 2 == 0 else -1
        for label in labels[::step]:
            for tree, run in list(workers.items())[::step]:
                runs[tree, label].append(run(label, requests, step_ms))
    events = engine_events_of(requests)
    model = f", a {step_ms} ms sleep per step for the model" if step_ms else ""
    notes = {str(r[4]) for rows in runs.values() for r in rows if r[4] is not None}
    judge = "compiled fast model" if not notes else "; ".join(sorted(notes))
    print(
        f"monitor overhead on the reference engine ({requests} requests, {len(events):,} events"
        f"{model}), each run a fresh process after a warm-up, {rounds} interleaved rounds; "
        f"judge: {judge}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores:"
    )
    print(
        f"  {'':58s}"
        + "".join(f" {name:>21s}" for name in FIGURES)
        + "   (median s, added: median of the rounds' ratios [least, greatest])"
    )
    for tree in trees:
        alone = runs[tree, labels[0]]
        for label in labels:
            rows = runs[tree, label]
            cells = []
            for i in range(4):
                med = statistics.median(float(r[i]) for r in rows)  # type: ignore[arg-type]
                added = [float(r[i]) / float(a[i]) - 1 for r, a in zip(rows, alone, strict=True)]  # type: ignore[arg-type]
                cells.append(
                    f"{med:6.3f} {100 * statistics.median(added):+5.1f}%"
                    if label != labels[0]
                    else f"{med:6.3f}      "
                )
                if i == 2 and label != labels[0]:
                    spread = f"[{100 * min(added):+.1f}, {100 * max(added):+.1f}]"
            name = label if len(trees) == 1 else f"{tree}: {label}"
            print(f"  {name:58s}" + "".join(f" {cell:>21s}" for cell in cells), end="")
            print(f"   CPU engine proc {spread}" if label != labels[0] else "")
    for label in labels[1:]:
        for tree in trees:
            rows = runs[tree, label]
            print(
                f"  {tree}: {label}, CPU engine proc each round: "
                f"[{', '.join(f'{float(r[2]):.3f}' for r in rows)}] "  # type: ignore[arg-type]
                f"(engine alone [{', '.join(f'{float(r[2]):.3f}' for r in runs[tree, labels[0]])}])"  # type: ignore[arg-type]
            )
    print(f"  load average after: {os.getloadavg()[0]:.2f}")


def monitor_overhead(requests: int, rounds: int, step_ms: float = 0.0) -> None:
    """Part 4: each row of ``MONITORS`` (this tree), then a background Monitor's start-up."""
    monitor_rounds({"this tree": ROOT}, tuple(MONITORS), requests, rounds, step_ms)
    print(
        f"  background Monitor: start-up and close with no events (once per engine): "
        f"{monitor_start_seconds(rounds):.3f} s"
    )


def monitor_compare(ref: str, requests: int, rounds: int, step_ms: float = 0.0) -> None:
    """``--monitor-only --baseline REF``: the rows of ``COMPARED``, of this tree and of git
    revision ``ref``, each tree against its own engine alone."""
    monitor_rounds({"this tree": ROOT, ref: checkout(ref)}, COMPARED, requests, rounds, step_ms)


def _monitor(options: dict[str, object] | None) -> object:
    config = Config(**COMMON)  # type: ignore[arg-type]
    if options is None:
        return None
    if options.get("background"):
        return BackgroundMonitor(config, queue_depth=options.get("queue_depth", 8))  # type: ignore[arg-type]
    if options.get("capture"):
        return CaptureOnly()
    if options.get("beside"):
        return Beside()
    return Monitor.fast(config) if options["judging"] == "fast" else Monitor.on_spec(config)


def engine_events_of(requests: int) -> list[tuple[object, ...]]:
    engine = Engine(EngineConfig(**COMMON))  # type: ignore[arg-type]
    for rid, prompt, max_tokens, priority in shared_prefix_workload(requests, 4, 128, 16, 16, 7):
        engine.add_request(rid, prompt, max_tokens, priority)
    engine.run()
    return engine.events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000, help="trace length")
    parser.add_argument("--sample", type=int, default=300_000, help="events per throughput run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--memory", type=int, nargs="*", default=[1_000_000, 3_000_000, 10_000_000])
    parser.add_argument("--spec-memory", type=int, nargs="*", default=[1_000_000])
    parser.add_argument("--requests", type=int, default=600, help="monitor overhead workload")
    parser.add_argument("--trace", help="keep the trace here (default: a temporary file)")
    parser.add_argument("--reuse", action="store_true", help="reuse an existing --trace file")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--write-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="monitor part: sleep per step (the model)"
    )
    parser.add_argument("--monitor-only", action="store_true", help="only part 4 (no trace needed)")
    parser.add_argument("--monitor-child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--baseline", metavar="REF", help="also kvspec check of git revision REF")
    parser.add_argument(
        "--compare-only",
        action="store_true",
        help="with --baseline: only kvspec check (fast, compiled) of this tree and of REF",
    )
    args = parser.parse_args()
    if args.monitor_child:
        label, requests, step_ms, folder, link = args.monitor_child
        monitor_child(label, int(requests), float(step_ms), Path(folder), Path(link))
        return
    if args.monitor_only:
        if args.baseline:
            monitor_compare(args.baseline, args.requests, args.rounds, args.step_ms)
        else:
            monitor_overhead(args.requests, args.rounds, args.step_ms)
        return
    if args.memory_child:
        memory_child(Path(args.memory_child[0]), int(args.memory_child[1]), args.memory_child[2])
        return
    if args.write_child:
        events = engine_events(int(args.write_child[1]))
        print(write_trace(args.write_child[0], Config(**COMMON), events, hashes=True))  # type: ignore[arg-type]
        return

    path = Path(args.trace or os.path.join(tempfile.mkdtemp(), "bench.jsonl"))
    started = time.perf_counter()
    if args.reuse and path.exists():
        count = read_fast(path, sys.maxsize)
    else:  # in a child process: the engine keeps every request it saw, which is big
        done = subprocess.run(
            [sys.executable, __file__, "--write-child", str(path), str(args.events)],
            capture_output=True,
            text=True,
            check=True,
        )
        count = int(done.stdout)
    print(
        f"trace: {count:,} events, {path.stat().st_size / 2**20:.0f} MiB, "
        f"{'counted' if args.reuse else 'written'} in {time.perf_counter() - started:.0f} s "
        f"(reference engine, {COMMON['num_blocks']} blocks of {COMMON['block_size']}, "
        f"depth {COMMON['depth']}, policy {COMMON['policy']})"
    )

    sample = path.with_name(path.stem + f"-first{args.sample}.jsonl")
    with open(path, "rb") as src, open(sample, "wb") as out:
        out.write(older_header(next(src)))
        out.writelines(itertools.islice(src, args.sample))  # the events
        for raw in src:  # up to the next decision: no effect cut from its decision
            if orjson.loads(raw)["ev"] in ACTIONS:
                break
            out.write(raw)
    compiled, why = fastbuild.compiled()
    if compiled is None:
        raise SystemExit(f"the compiled fast model is needed here: {why}")
    config, lines = iter_trace(sample, fast=True)
    read = [(event, hash_) for _, event, hash_ in lines]
    modes: list[tuple[str, Callable[[Path, int], int]]] = [
        ("reader only, validating (parse_line)", read_only),
        ("reader only, fast reader", read_fast),
        ("spec actions only (reader + apply)", spec_only),
        ("kvspec check --engine spec", check_engine("spec")),
        ("kvspec check --engine fast, compiled", check_fast(compiled)),
        ("kvspec check --engine fast, source module", check_fast(core)),
        ("fast model only, compiled", model_only(compiled, read, config)),
        ("fast model only, source module", model_only(core, read, config)),
    ] + [(f"spec engine, invariants every {k} decisions", checked(k)) for k in args.every]
    if args.compare_only:
        if not args.baseline:
            raise SystemExit("--compare-only needs --baseline REF")
        modes = [modes[4]]
    if args.baseline:
        modes += [
            ("kvspec check fast, this tree, fresh process", worker(ROOT, sample)),
            (f"kvspec check fast, {args.baseline}, fresh process", baseline(args.baseline, sample)),
        ]
    rates: dict[str, list[float]] = {label: [] for label, _ in modes}
    for _ in range(args.rounds):
        for label, run in modes:
            begun = time.perf_counter()
            n = run(sample, args.sample)
            took = getattr(run, "took", None) or time.perf_counter() - begun  # a child's own
            rates[label].append(n / took)
    print(
        f"throughput on one core, events/s over the first {min(args.sample, count):,} events, "
        f"median of {args.rounds} interleaved rounds [each round]:"
    )
    for label, _ in modes:
        runs = ", ".join(f"{r:,.0f}" for r in rates[label])
        print(f"  {label:45s} {statistics.median(rates[label]):>10,.0f}   [{runs}]")
    median = {label: statistics.median(rates[label]) for label in rates}
    if args.compare_only:
        this, then = (median[label] for label, _ in modes[-2:])
        print(f"  {'this tree / ' + args.baseline:45s} {this / then:10.2f} x")
        sample.unlink()
        return
    fast, source, spec = (
        median[f"kvspec check --engine {e}"]
        for e in ("fast, compiled", "fast, source module", "spec")
    )
    model = median["fast model only, compiled"] / median["fast model only, source module"]
    print(f"  {'kvspec check: fast compiled / spec':45s} {fast / spec:10.1f} x")
    print(f"  {'kvspec check: fast compiled / source module':45s} {fast / source:10.1f} x")
    print(f"  {'fast model only: compiled / source module':45s} {model:10.1f} x")
    del read
    sample.unlink()

    print(
        "peak memory, a fresh process per length and engine (RSS includes the interpreter; "
        "fast: the compiled fast model):"
    )
    for engine, lengths in (("fast", args.memory), ("spec", args.spec_memory)):
        peaks = []
        for length in lengths:
            done = subprocess.run(
                [sys.executable, __file__, "--memory-child", str(path), str(length), engine],
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(done.stdout)
            peaks.append(got["peak_kib"])
            print(
                f"  {engine}: first {got['events']:>12,} events: peak RSS "
                f"{got['peak_kib'] / 1024:7.1f} MiB, checked at "
                f"{got['events'] / got['seconds']:,.0f} events/s"
            )
        if len(peaks) > 1:
            print(f"  {engine}: largest / smallest peak: {max(peaks) / min(peaks):.3f}")

    monitor_overhead(args.requests, args.rounds, args.step_ms)


if __name__ == "__main__":
    main()
