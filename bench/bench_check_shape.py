"""``kvspec check`` as traces grow: events/s on ``kvspec simulate`` traces of 10k, 30k and 60k
requests (issue #15: flat in queue depth, trace length and request count).

These traces put every arrival first, so the judge holds every request from the start. Two modes
run interleaved in each round, in one process:

* ``frozen``: what ``kvspec check`` does (``check.FREEZE_EVERY``). The collector skips the state
  that is already alive (``gc.freeze``).
* ``collected``: the same check with the freezing turned off (``FREEZE_EVERY`` past the trace's
  length), the way it ran before.

For each size it prints the median of ``--rounds`` rounds, in CPU events/s (``process_time``: a
load on the machine changes it less than wall time), and the share of CPU time spent in Python's
garbage collector (``gc.callbacks``). It ends with the ratio of the largest trace's rate to the
smallest's (1.0 is flat).

``--baseline REF`` adds, to the same interleaved rounds, ``kvspec check`` (fast, compiled) of
this tree and of git revision REF, each in a fresh process of its own with its own compiled build
(``bench_checker.worker``), timed in CPU seconds without the start-up: before and after, side by
side in one run, with their ratio at each size and each one's flatness.

    .venv/bin/python bench/bench_check_shape.py [--requests 10000 30000 60000] [--rounds 3]
        [--baseline REF]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvspec.conformance import check

MODES = {"frozen": check.FREEZE_EVERY, "collected": 1 << 62}

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_checker  # noqa: E402  (its fresh-process check of a tree or a revision)


class GcClock:
    """CPU seconds spent in the cyclic garbage collector since ``reset``."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._start = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.spent += time.process_time() - self._start


def simulate(requests: int, folder: Path) -> Path:
    path = folder / f"simulate-{requests}.jsonl"
    command = [sys.executable, "-m", "kvspec", "simulate", "--policy", "deferred"]
    command += ["--format", "v1", "--requests", str(requests), "--out", str(path)]
    subprocess.run(command, check=True, capture_output=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000, 30_000, 60_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", metavar="REF", help="also kvspec check of git revision REF")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kvspec-shape-"))
    traces = {n: simulate(n, folder) for n in args.requests}
    clock = GcClock()
    rates: dict[tuple[str, int], list[float]] = {}
    shares: dict[tuple[str, int], list[float]] = {}
    events: dict[int, int] = {}
    trees = {}
    if args.baseline:
        some = next(iter(traces.values()))
        trees = {
            "this tree": bench_checker.worker(bench_checker.ROOT, some),
            args.baseline: bench_checker.baseline(args.baseline, some),
        }
    fresh: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for n, path in traces.items():
            for label, run in trees.items():
                count = run(path, 0)
                fresh.setdefault((label, n), []).append(count / run.took)  # type: ignore[attr-defined]
            for mode, every in MODES.items():
                check.FREEZE_EVERY = every
                gc.collect()
                clock.spent = 0.0
                started = time.process_time()
                report = check.check_file(path)
                seconds = time.process_time() - started
                if report.exit_code != 0:
                    raise SystemExit(f"{path}: unexpected verdict: {report.text()}")
                events[n] = report.events
                rates.setdefault((mode, n), []).append(report.events / seconds)
                shares.setdefault((mode, n), []).append(clock.spent / seconds)
    check.FREEZE_EVERY = MODES["frozen"]
    print(f"kvspec check on simulate traces, CPU events/s, median of {args.rounds} rounds")
    print(f"{'requests':>9s} {'events':>10s}  " + "  ".join(f"{m:>21s}" for m in MODES) + "  ratio")
    for n in traces:
        cells = []
        for mode in MODES:
            rate = statistics.median(rates[mode, n])
            share = statistics.median(shares[mode, n])
            cells.append(f"{rate:>11,.0f} ({share:4.0%} gc)")
        ratio = statistics.median(rates["frozen", n]) / statistics.median(rates["collected", n])
        print(
            f"{n:>9,d} {events[n]:>10,d}  "
            + "  ".join(f"{c:>21s}" for c in cells)
            + f"  {ratio:4.2f}"
        )
    small, large = min(traces), max(traces)
    for mode in MODES:
        flat = statistics.median(rates[mode, large]) / statistics.median(rates[mode, small])
        print(f"{mode}: {large:,} requests / {small:,} requests: {flat:.2f} (1.0 is flat)")
    if not trees:
        return
    this, then = trees
    print(f"\nkvspec check, fresh processes, CPU events/s, median of {args.rounds} rounds [each]")
    print(f"{'requests':>9s}  {this:>28s}  {then:>28s}  ratio")
    for n in traces:
        cells = [
            f"{statistics.median(fresh[label, n]):>9,.0f} ["
            + ", ".join(f"{r / 1000:.0f}k" for r in fresh[label, n])
            + "]"
            for label in trees
        ]
        ratio = statistics.median(fresh[this, n]) / statistics.median(fresh[then, n])
        print(f"{n:>9,d}  {cells[0]:>28s}  {cells[1]:>28s}  {ratio:4.2f}")
    for label in trees:
        flat = statistics.median(fresh[label, large]) / statistics.median(fresh[label, small])
        print(f"{label}: {large:,} requests / {small:,} requests: {flat:.2f} (1.0 is flat)")


if __name__ == "__main__":
    main()
