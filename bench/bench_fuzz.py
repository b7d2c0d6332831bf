"""Benchmark of lockstep fuzzing (``kvspec fuzz``, ``conformance/fuzz.py``): throughput, depth,
where the time goes and what the runs reach, before and after side by side in one run.

"Before" is git revision ``--before`` of this repository (default: ``BEFORE``, the main commit
this fuzzer's rewrite started from), checked out in a temporary worktree; "after" is this tree.
Each is run in a fresh process with its tree first on ``PYTHONPATH``, in interleaved rounds (the
order alternates), so a load on the machine hits both alike; medians over ``--rounds``.

For each cell (``deferred``, vllm/fcfs, synchronous; the same with ``--async``, depth drawn,
stale output dropped; and ``deferred`` general/priority with external loads, where preemptions
from the step being built, hits of unwritten blocks and failed loads happen) and each tree, one round is ``run_cell`` for ``--seconds`` (seeded by the
round): engine steps (commits) per wall-clock second and per CPU second of the fuzzing process,
runs, the steps per run (median, p90, max over the round's runs) and the coverage counters of
``conformance/fuzz_coverage.py`` (for the older tree, the same counters computed from its
judges' event streams by wrapping ``Judge.spec``: the module is loaded from this tree by path).
One more round per tree and cell runs under cProfile: the share of the profiled time spent in the
tree's own code (functions defined in its files, and the methods of its mypyc-compiled
classes, which cProfile sees as C calls), in Hypothesis, and elsewhere (builtins, the standard
library). cProfile slows small functions most, so the shares are indicative.

``--bugs``: the seeded bugs (the cells of the tests that expect a finding, and the seed bug as a
read) once per tree and seed (``--bug-seeds``, default 1; e.g. ``1-20``; ``--bug-seconds``
budget each, default 300): seconds to the first counterexample, its length before shrinking and
after (program entries), the invariant; with several seeds, per bug and tree the shrunk lengths
seed by seed and their mean (the seed sweep of docs/fuzzing.md), and the mean over all bugs.
``--only-bugs`` skips the throughput cells.

    .venv/bin/python bench/bench_fuzz.py [--seconds 15] [--rounds 3] [--before REF] [--bugs]
        [--bug-seconds 300] [--bug-seeds 1-20] [--only-bugs] [--skip-bugs 'as a read']
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "8b842fb5c9e54bffb36a09593f8f9b8e1b90bb58"
"""main's HEAD when the fuzzer's draws were reworked (issue #15, the fuzzing row)."""

CELLS = {
    "deferred": dict(policy="deferred"),
    "deferred --async": dict(policy="deferred", async_scheduling=True, stale_output="drop"),
    "deferred --discipline general --preemption priority --loads": dict(
        policy="deferred", discipline="general", preemption="priority", loads=True
    ),
}

BUGS = {
    "seed (eager-unsafe vllm/priority)": dict(
        policy="eager-unsafe", discipline="vllm", preemption="priority"
    ),
    "seed as a read (--invariant NoUnwrittenRead)": dict(
        policy="eager-unsafe",
        discipline="vllm",
        preemption="priority",
        invariants=("NoUnwrittenRead",),
    ),
    "async eager-unsafe general/priority": dict(
        policy="eager-unsafe",
        discipline="general",
        preemption="priority",
        async_scheduling=True,
        stale_output=None,
    ),
    "async eager-rollback-fifo deliver": dict(
        policy="eager-rollback-fifo",
        discipline="general",
        preemption="priority",
        async_scheduling=True,
        stale_output="deliver",
    ),
    "eager-rollback-fifo general/priority": dict(
        policy="eager-rollback-fifo", discipline="general", preemption="priority"
    ),
    "eager-rollback-fifo vllm/fcfs --loads": dict(
        policy="eager-rollback-fifo", discipline="vllm", preemption="fcfs", loads=True
    ),
    "eager-rollback-single vllm/fcfs --loads": dict(
        policy="eager-rollback-single", discipline="vllm", preemption="fcfs", loads=True
    ),
    "eager-unsafe general/priority": dict(
        policy="eager-unsafe", discipline="general", preemption="priority"
    ),
}
"""The seeded bugs: the seed bug (``kvspec fuzz``'s, ``conftest.seed_bug_run``), as a read, and
the cells of ``tests/test_fuzz.py``'s and ``tests/test_checker.py``'s counterexamples."""

CHILD = r"""
import cProfile, importlib.util, json, sys, time, types
from pathlib import Path

cell, seconds, seed, profile, coverage_file, own_prefix = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("bench_fuzz_coverage", coverage_file)
coverage_module = importlib.util.module_from_spec(spec)
sys.modules["bench_fuzz_coverage"] = coverage_module
spec.loader.exec_module(coverage_module)
import kvspec.conformance.fuzz as fuzz

native = hasattr(fuzz, "Coverage")  # the tree counts its own coverage
judges = []
if not native:
    original = fuzz.Judge

    def judge_spec(config, *args, **kwargs):
        judge = original.spec(config, *args, **kwargs)
        run = coverage_module.RunCoverage()
        judges.append((judge, run))
        feed_all = judge.feed_all

        def counted(events):
            events = list(events)
            run.observe(events)
            return feed_all(events)

        judge.feed_all = counted
        return judge

    fuzz.Judge = types.SimpleNamespace(spec=judge_spec)
profiler = cProfile.Profile() if profile else None
started_cpu = time.process_time()
if profiler is not None:
    profiler.enable()
result = fuzz.run_cell(seconds=seconds, seed_value=seed, **cell)
if profiler is not None:
    profiler.disable()
cpu = time.process_time() - started_cpu
if native:
    steps, coverage = result.steps_per_run, result.coverage.as_dict()
else:
    total = coverage_module.Coverage()
    steps = []
    for judge, run in judges:
        run.unwritten_reads = len(judge.model.state.bad_reads)
        total.add(run)
        steps.append(judge.model.state.commits)
    coverage = total.as_dict()
shares = None
if profiler is not None:
    import pstats

    own = hypothesis = other = 0.0
    compiled = {  # the tree's mypyc-compiled classes: cProfile sees their methods as C calls
        f"of '{name}' objects"
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("kvspec_fast")
        for name, value in vars(module).items()
        if isinstance(value, type)
    }
    for (path, _, func), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        if (path.startswith(own_prefix) and "/.venv" not in path) or (
            path == "~" and any(func.endswith(c + ">") for c in compiled)
        ):
            own += tottime
        elif "/hypothesis/" in path:
            hypothesis += tottime
        else:
            other += tottime
    whole = own + hypothesis + other
    shares = {"own": own / whole, "hypothesis": hypothesis / whole, "other": other / whole}
failure = result.failure
print(json.dumps({
    "runs": result.runs, "commits": result.commits, "seconds": result.seconds, "cpu": cpu,
    "steps": steps, "coverage": coverage, "shares": shares,
    "found": failure.finding.invariant if failure else None,
    "shrunk": len(failure.program) if failure else None,
    "unshrunk": result.unshrunk_length, "to_failure": result.seconds_to_failure,
}))
"""


def tree_link(tree: Path) -> Path:
    """A folder whose ``kvspec`` is ``tree`` (for ``PYTHONPATH``)."""
    link = Path(tempfile.mkdtemp(prefix="kvspec-tree-"))
    (link / "kvspec").symlink_to(tree)
    return link


def checkout(ref: str) -> Path:
    tree = Path(tempfile.mkdtemp(prefix="kvspec-fuzz-before-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
        check=True,
        capture_output=True,
    )
    return tree


def child(link: Path, cell: dict, seconds: float, seed: int, profile: bool) -> dict:
    own = str(link / "kvspec") + "/"
    coverage = str(ROOT / "conformance" / "fuzz_coverage.py")
    argument = json.dumps([cell, seconds, seed, profile, coverage, own])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, argument],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(link)},
        cwd=tempfile.gettempdir(),
    )
    if done.returncode != 0:
        raise SystemExit(f"{link}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0


def summary(rounds: list[dict], profiled: dict) -> dict[str, float]:
    """Medians over the rounds of each figure (the profiled round gives the shares)."""

    def med(get) -> float:  # type: ignore[no-untyped-def]
        return float(statistics.median(get(r) for r in rounds))

    row = {
        "engine steps/s (wall)": med(lambda r: r["commits"] / r["seconds"]),
        "engine steps/s (CPU)": med(lambda r: r["commits"] / r["cpu"]),
        "runs": med(lambda r: r["runs"]),
        "engine steps": med(lambda r: r["commits"]),
        "steps/run median": med(lambda r: percentile(r["steps"], 0.5)),
        "steps/run p90": med(lambda r: percentile(r["steps"], 0.9)),
        "steps/run max": med(lambda r: max(r["steps"], default=0)),
    }
    for name in (
        "preempt_building",
        "hit_same_step",
        "hit_in_flight",
        "zombie_hits",
        "unwritten_reads",
    ):
        row[name] = med(lambda r, n=name: r["coverage"][n])
    row["load_failures"] = med(lambda r: r["coverage"]["load_failures"])
    for depth in range(4):
        row[f"preempt, {depth} in flight"] = med(
            lambda r, d=depth: r["coverage"]["preempt_at_depth"][d]
        )
    shares = profiled["shares"]
    row["time in kvspec (cProfile)"] = shares["own"]
    row["time in Hypothesis (cProfile)"] = shares["hypothesis"]
    return row


def show(title: str, before: dict[str, float], after: dict[str, float]) -> None:
    print(f"\n{title}")
    print(f"  {'':34s} {'before':>12s} {'after':>12s} {'after/before':>13s}")
    for name, old in before.items():
        new = after[name]
        ratio = f"{new / old:.2f}x" if old else ("=" if new == old else "new")
        if "(cProfile)" in name:
            print(f"  {name:34s} {old:>12.0%} {new:>12.0%} {ratio:>13s}")
        else:
            print(f"  {name:34s} {old:>12,.0f} {new:>12,.0f} {ratio:>13s}")


def seeds(text: str) -> list[int]:
    """``"1-20"`` or ``"1,3,5"`` (or a mix): the seeds, in order."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def bug_sweep(
    trees: dict[str, Path], budget: float, bug_seeds: list[int], skip: list[str] | None = None
) -> None:
    """Each seeded bug under each tree and seed: the first counterexample and its shrinking.
    ``skip``: leave out the bugs whose title holds one of these strings."""
    print(
        f"\nseeded bugs (seeds {bug_seeds[0]}..{bug_seeds[-1]}, budget {budget:g} s each): "
        "seconds to the first counterexample, its length (program entries) unshrunk -> shrunk"
    )
    totals: dict[str, list[int]] = {name: [] for name in trees}
    for title, cell in BUGS.items():
        if any(word in title for word in skip or ()):
            continue
        shrunk: dict[str, list[int | None]] = {name: [] for name in trees}
        for seed in bug_seeds:
            line = []
            for name in trees:
                r = child(trees[name], cell, budget, seed, False)
                shrunk[name].append(r["shrunk"])
                if r["found"] is None:
                    line.append(f"{name}: not found in {r['seconds']:.0f} s")
                else:
                    line.append(
                        f"{name}: {r['found']} after {r['to_failure']:.1f} s, "
                        f"{r['unshrunk']} -> {r['shrunk']}"
                    )
            print(f"  {title}, seed {seed}: " + "; ".join(line), flush=True)
        if len(bug_seeds) > 1:
            for name in trees:
                found = [n for n in shrunk[name] if n is not None]
                totals[name].extend(found)
                mean = f"mean {sum(found) / len(found):.1f}" if found else "none found"
                lengths = " ".join("-" if n is None else str(n) for n in shrunk[name])
                print(f"    {name}: shrunk {lengths}; {mean}")
    if len(bug_seeds) > 1:
        for name in trees:
            found = totals[name]
            print(f"  mean shrunk length, all bugs, {name}: {sum(found) / max(1, len(found)):.2f} "
                  f"({len(found)} found)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default=BEFORE, help="git revision of 'before'")
    parser.add_argument("--bugs", action="store_true", help="also the seeded bugs, once each")
    parser.add_argument("--bug-seconds", type=float, default=300.0, help="budget per bug")
    parser.add_argument("--bug-seeds", type=seeds, default=[1], help="e.g. 1-20 (--bugs)")
    parser.add_argument("--only-bugs", action="store_true", help="no throughput cells")
    parser.add_argument(
        "--skip-bugs",
        nargs="*",
        default=[],
        help="leave out the bugs whose title holds one of these (e.g. 'as a read': it is "
        "never found within a short budget, and takes all of it)",
    )
    parser.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS))
    args = parser.parse_args()
    if args.only_bugs:
        args.bugs, args.cells = True, []
    trees = {"before": tree_link(checkout(args.before)), "after": tree_link(ROOT)}
    load = os.getloadavg()
    print(
        f"lockstep fuzzing, {args.seconds:g} s per run; before = {args.before[:12]}, after = "
        f"this tree; median of {args.rounds} interleaved rounds (+1 profiled); "
        f"load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on "
        f"{os.cpu_count()} cores"
    )
    for title in args.cells:
        cell = CELLS[title]
        got: dict[str, list[dict]] = {"before": [], "after": []}
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for name in order:
                got[name].append(child(trees[name], cell, args.seconds, r, False))
        profiled = {name: child(trees[name], cell, args.seconds, 0, True) for name in trees}
        before = summary(got["before"], profiled["before"])
        after = summary(got["after"], profiled["after"])
        show(f"kvspec fuzz --policy {title} --seconds {args.seconds:g}", before, after)
    if args.bugs:
        bug_sweep(trees, args.bug_seconds, args.bug_seeds, args.skip_bugs)
    load = os.getloadavg()
    print(f"\nload average at end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")


if __name__ == "__main__":
    main()
