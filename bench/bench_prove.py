"""How long the Z3 proofs take, before and after (issue #15), and Z3's verdicts beside the fuzzer's.

**Speed (the default).** Every cell (policy, discipline, preemption) is proved as ``kvspec
prove`` does it (induction; bounded model checking if that fails; the counterexample confirmed
by the spec and the engine), at the default sizes, by two builds of kvspec in interleaved
rounds, each round in fresh processes:

* *before*: the code of ``--baseline`` (a git revision, by default the commit this work started
  from; ``git archive`` unpacks it under ``--cache``), which proves the cells one after the other
  on one core;
* *after*: this tree, which proves all cells on one pool of ``--workers`` processes.

The table gives each cell's verdicts side by side (they must agree: same verdict, same invariant,
same counterexample length; a difference is printed as such and makes the run exit 1) and the
medians of wall and CPU time (CPU of all processes). Then ``--profile``: where the after-build's
solver spent its time (per action instance, per conjunct: invariant or lemma), and the larger
sizes (``--large``: N=6, R=3, D=3 by default; ``--large-baseline`` runs the before-build there
too, with ``--large-timeout``). The machine is shared: the run prints the load average before and
after, and figures measured under load are noisy.

**The README table** (``--table``, or ``--readme README.md`` to rewrite it between the
``<!-- prove-table -->`` markers): Z3's verdict of each cell beside the fuzzer's (``kvspec fuzz``,
seed 0, ``--fuzz-seconds``), then the scaling of the inductive proof of ``deferred`` vllm/fcfs
with N and D (``--skip-scaling`` leaves it out).

    .venv/bin/python bench/bench_prove.py [--rounds 3] [--workers 2] [--baseline REV] [--profile]
        [--large] [--large-sizes 6,3,3] [--large-baseline] [--large-timeout 900]
    .venv/bin/python bench/bench_prove.py --table [--readme README.md] [--fuzz-seconds 20]
    .venv/bin/python bench/bench_prove.py --all-sizes [--rounds 3] [--baseline REV]

**Every size** (``--all-sizes``): ``kvspec prove --all-sizes`` per policy (and, for the safe
ones, async, stale output delivered and synchronous drafts), each a fresh process, ``--rounds`` times, by this tree
and by ``--baseline``'s (interleaved; ``--no-baseline`` for this tree alone): exit code,
verdict, medians of wall and CPU (the command's process and its children), and the load after
each run.

**Solver work** (``--work``): the same cells, each proved in one process (no pool) by both builds,
counting Z3's own resource counter (``rlimit count``, summed over every ``check``) beside CPU
seconds. The counter is deterministic: it does not move with the machine's load, so two builds
whose counts agree cell by cell gave the solver the same queries and the same work, and a time
difference between them is the machine's. Use it where the machine is shared. The cells share
one process (and Z3's context), so a cell's count depends on the cells proved before it: compare
runs of the same ``--policies`` only.

    .venv/bin/python bench/bench_prove.py --work [--sizes 6,3,3] [--policies P ...] [--baseline REV]

``--emit`` is the worker mode the speed runs use (one build, all cells, one JSON line each).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "91e8406"
"""The integration branch (ref-async) this work was merged onto (issue #15)."""
CELLS = (("vllm", "fcfs"), ("vllm", "priority"), ("general", "fcfs"))
POLICY_ORDER = (
    "eager-unsafe",
    "eager-rollback-single",
    "eager-rollback-fifo",
    "hide-uncommitted",
    "deferred",
)
HEADER = [
    "policy",
    "cell",
    "Z3 verdict",
    "invariant",
    "Z3 cex",
    "Z3 s",
    "engine",
    "fuzzer",
    "fuzzer cex",
    "fuzzer s",
]
MARK = "<!-- prove-table -->"


def cpu_seconds() -> float:
    """CPU of this process and of its children that have ended."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# -- worker mode: one build of kvspec proves the cells -------------------------------------------


def verdict_fields(policy: str, discipline: str, preemption: str, out: Any) -> dict[str, Any]:
    """A cell's row as both worker modes print it: the cell, and what ``same_result`` compares."""
    return {
        "policy": policy,
        "cell": f"{discipline}/{preemption}",
        "verdict": out.verdict,
        "invariant": out.bmc.invariant if out.bmc is not None else None,
        "length": len(out.bmc.decisions) if out.bmc and out.bmc.decisions else None,
        "engine": out.engine_confirms if out.verdict == "counterexample" else None,
    }


def emit(args: argparse.Namespace) -> None:
    """Prove every cell with whichever kvspec is importable, print one JSON line per cell
    and one for the run."""
    from kvspec.proofs import prove

    sizes = dict(zip(("blocks", "requests", "depth"), args.sizes, strict=True))
    sizes |= {"block_size": 1, "tokens": args.tokens}
    cells = [(p, d, q) for p in args.policies for d, q in CELLS]
    fragments = [prove.make_fragment(p, d, q, **sizes) for p, d, q in cells]
    started, cpu = time.monotonic(), cpu_seconds()
    if hasattr(prove, "prove_cells"):
        outcomes = prove.prove_cells(fragments, args.bound, args.timeout, workers=args.workers)
    else:  # the build before: one cell after the other, in this process
        outcomes = [prove.prove_cell(f, args.bound, args.timeout) for f in fragments]
    wall, cpu = time.monotonic() - started, cpu_seconds() - cpu
    for (policy, discipline, preemption), out in zip(cells, outcomes, strict=True):
        row: dict[str, Any] = {
            **verdict_fields(policy, discipline, preemption, out),
            "seconds": getattr(out, "work_seconds", out.seconds),
            "cti": list(out.induction.cti.broken) if out.induction and out.induction.cti else None,
        }
        if args.profile and out.induction is not None and hasattr(out.induction, "queries"):
            per_instance: Counter[str] = Counter()
            per_conjunct: Counter[str] = Counter()
            for q in out.induction.queries:
                per_instance[q.instance.split(" ")[0]] += q.cpu
                per_conjunct[q.conjunct] += q.cpu
            row["profile"] = {
                "instance": dict(per_instance),
                "conjunct": dict(per_conjunct),
                "build": out.induction.build_cpu,
                "cpu": out.induction.work_cpu,
                "queries": len(out.induction.queries),
                "obligations": out.induction.obligations,
                "bmc": out.bmc.seconds if out.bmc is not None else 0.0,
            }
        print(json.dumps(row), flush=True)
    print(json.dumps({"total": True, "wall": wall, "cpu": cpu}), flush=True)


def emit_work(args: argparse.Namespace) -> None:
    """Prove every cell alone, in this process, counting Z3's resource counter; one JSON line
    per cell (``--work``)."""
    import z3

    from kvspec.proofs import prove

    counted = {"rlimit": 0, "checks": 0}
    check = z3.Solver.check

    def used(solver: Any) -> int:
        return int(solver.statistics().get_key_value("rlimit count"))

    def counting_check(self: Any, *a: Any, **kw: Any) -> Any:
        before = used(self)
        result = check(self, *a, **kw)
        counted["rlimit"] += used(self) - before
        counted["checks"] += 1
        return result

    z3.Solver.check = counting_check  # type: ignore[method-assign]
    sizes = dict(zip(("blocks", "requests", "depth"), args.sizes, strict=True))
    sizes |= {"block_size": 1, "tokens": args.tokens}
    for policy, discipline, preemption in [(p, d, q) for p in args.policies for d, q in CELLS]:
        fragment = prove.make_fragment(policy, discipline, preemption, **sizes)
        counted.update(rlimit=0, checks=0)
        cpu = time.process_time()
        out = prove.prove_cells([fragment], args.bound, args.timeout, workers=0)[0]
        row = {
            **verdict_fields(policy, discipline, preemption, out),
            "cpu": time.process_time() - cpu,
            **counted,
        }
        print(json.dumps(row), flush=True)


def work(args: argparse.Namespace) -> int:
    """``--work``: each build once (the counter is deterministic), cell by cell."""
    base = None if args.no_baseline else baseline_tree(args.baseline, args.cache)
    print(f"solver work at N,R,D = {tuple(args.sizes)}, T={args.tokens}; load {load()}")
    rows: dict[str, list[dict[str, Any]]] = {}
    for label, path in (("before", base), ("after", None)):
        if label == "before" and base is None:
            continue
        env = build_env(path)
        command = [sys.executable, str(Path(__file__).resolve()), "--emit-work"]
        command += ["--sizes", ",".join(map(str, args.sizes)), "--tokens", str(args.tokens)]
        command += ["--bound", str(args.bound), "--timeout", str(args.timeout)]
        command += ["--policies", *args.policies]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd="/")
        if done.returncode != 0:
            raise SystemExit(f"bench_prove: the {label} run failed:\n{done.stderr[-3000:]}")
        rows[label] = [json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{"]
        print(f"{label}: done (load {load()})", flush=True)
    after, before = rows["after"], rows.get("before")
    print(
        "policy | cell | verdict | same | before rlimit | after rlimit | ratio | before cpu | after cpu"
    )
    differs = False
    for i, row in enumerate(after):
        old = before[i] if before else None
        same = same_result(old, row) if old else None
        differs |= same is False
        cells = [
            row["policy"],
            row["cell"],
            verdict_text(row),
            {True: "yes", False: "NO", None: "-"}[same],
            f"{old['rlimit']:,}" if old else "-",
            f"{row['rlimit']:,}",
            f"{old['rlimit'] / row['rlimit']:.3f}" if old and row["rlimit"] else "-",
            f"{old['cpu']:.1f}" if old else "-",
            f"{row['cpu']:.1f}",
        ]
        print(" | ".join(cells))
    total = sum(r["rlimit"] for r in after)
    if before:
        old_total = sum(r["rlimit"] for r in before)
        print(
            f"total rlimit: before {old_total:,}, after {total:,}, ratio {old_total / total:.3f}; "
            f"cpu before {sum(r['cpu'] for r in before):.1f} s, after "
            f"{sum(r['cpu'] for r in after):.1f} s (load {load()})"
        )
    else:
        print(f"total rlimit: {total:,}; cpu {sum(r['cpu'] for r in after):.1f} s")
    return 1 if differs else 0


# -- the speed comparison ------------------------------------------------------------------------


def baseline_tree(rev: str, cache: Path) -> Path:
    """A directory holding ``kvspec`` as of ``rev`` (unpacked once with ``git archive``)."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=12", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    where = cache / f"kvspec-{sha}"
    package = where / "kvspec"
    if not (package / "proofs" / "prove.py").exists():
        package.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", sha], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)
    return where


def build_env(path: Path | None) -> dict[str, str]:
    """The environment of a worker process: this tree's kvspec (None), or ``path``'s first."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = str(path) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_build(
    path: Path | None, args: argparse.Namespace, sizes: tuple[int, int, int], timeout: float
) -> dict[str, Any]:
    """One run of ``--emit`` in a fresh process: this tree (path None) or the baseline's."""
    env = build_env(path)
    command = [sys.executable, str(Path(__file__).resolve()), "--emit"]
    command += ["--sizes", ",".join(map(str, sizes)), "--tokens", str(args.tokens)]
    command += ["--bound", str(args.bound), "--timeout", str(args.timeout)]
    command += ["--workers", str(args.workers), "--policies", *args.policies]
    if args.profile:
        command.append("--profile")
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, cwd="/"
        )
    except subprocess.TimeoutExpired:
        return {"timeout": True, "wall": time.monotonic() - started, "rows": []}
    if done.returncode != 0:
        raise SystemExit(
            f"bench_prove: the {'baseline' if path else 'new'} run failed:\n{done.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    total = rows.pop()
    return {"timeout": False, "wall": total["wall"], "cpu": total["cpu"], "rows": rows}


def same_result(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("verdict", "invariant", "length", "engine")
    return all(a[k] == b[k] for k in keys)


def verdict_text(row: dict[str, Any]) -> str:
    if row["verdict"] == "proved":
        return "PROVED"
    if row["verdict"] == "counterexample":
        engine = "engine confirms" if row["engine"] else "engine NO"
        return f"FAILS {row['invariant']} in {row['length']} ({engine})"
    return row["verdict"]


def speed(args: argparse.Namespace) -> int:
    sizes = tuple(args.sizes)
    print(f"load average before: {load()} (on {os.cpu_count()} cores)")
    base = None if args.no_baseline else baseline_tree(args.baseline, args.cache)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for n in range(args.rounds):
        for label, path in (("before", base), ("after", None)):
            if label == "before" and base is None:
                continue
            result = run_build(path, args, sizes, args.round_timeout)
            runs[label].append(result)
            print(
                f"round {n + 1} {label}: wall {result['wall']:.1f} s, cpu "
                f"{result.get('cpu', float('nan')):.1f} s (load {load()})",
                flush=True,
            )
    differs = report(runs, args)
    if args.profile:
        for label in ("before", "after"):
            if runs[label]:
                profile(label, runs[label])
    if args.large:
        large(args, base)
    print(f"load average after: {load()}")
    return 1 if differs else 0


ALL_SIZES_RUNS = (
    ("deferred",),
    ("hide-uncommitted",),
    ("deferred", "--discipline", "general", "--preemption", "priority"),
    ("deferred", "--depth", "2", "--async"),
    ("hide-uncommitted", "--depth", "2", "--async"),
    ("hide-uncommitted", "--depth", "2", "--stale-output", "deliver"),
    ("deferred", "--depth", "2", "--async", "--stale-output", "deliver"),
    ("deferred", "--spec-tokens", "2"),
    ("hide-uncommitted", "--discipline", "general", "--spec-tokens", "3"),
    ("deferred", "--depth", "2", "--async", "--spec-tokens", "2"),
    (
        "hide-uncommitted",
        "--discipline",
        "general",
        "--depth",
        "3",
        "--async",
        "--spec-tokens",
        "3",
    ),
    ("deferred", "--depth", "2", "--async", "--stale-output", "deliver", "--spec-tokens", "2"),
    ("eager-unsafe", "--discipline", "general"),
    ("eager-rollback-single", "--discipline", "general"),
    ("eager-rollback-fifo",),
)
"""``kvspec prove --all-sizes --policy`` and its options, one run each per round."""
VERDICTS = (
    "PROVED FOR EVERY SIZE",
    "NOT PROVED FOR EVERY SIZE",
    "NOT DECIDED FOR EVERY SIZE",
    "COUNTEREXAMPLE",
)


def all_sizes_run(
    policy: str, rest: list[str], base: Path | None
) -> tuple[int, str, float, float, float]:
    """One ``kvspec prove --all-sizes`` in a fresh process, of this tree (``base`` None) or the
    baseline's: exit code, verdict, wall and CPU seconds, the 1-minute load average after it."""
    env = dict(os.environ)
    if base is not None:
        env["PYTHONPATH"] = str(base) + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, "-m", "kvspec.cli", "prove", "--all-sizes"]
    command += ["--policy", policy, *rest]
    started, cpu = time.monotonic(), cpu_seconds()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    wall, cpu = time.monotonic() - started, cpu_seconds() - cpu
    lines = done.stdout.splitlines()
    verdict = next((v for v in reversed(VERDICTS) for line in lines if line.startswith(v)), "?")
    return done.returncode, verdict, wall, cpu, os.getloadavg()[0]


def all_sizes_times(args: argparse.Namespace) -> int:
    """Time ``kvspec prove --all-sizes`` per policy, this tree and (unless ``--no-baseline``)
    the baseline's, interleaved; 1 when a run's exit code changes between rounds or builds."""
    print(f"load average before: {load()} (on {os.cpu_count()} cores)")
    base = None if args.no_baseline else baseline_tree(args.baseline, args.cache)
    builds = {"after": None, **({"before": base} if base is not None else {})}
    runs: dict[tuple[str, tuple[str, ...]], list[tuple[int, str, float, float, float]]] = {}
    for _ in range(args.rounds):
        for policy, *rest in ALL_SIZES_RUNS:
            if args.policies != list(POLICY_ORDER) and policy not in args.policies:
                continue
            for label, path in builds.items():
                result = all_sizes_run(policy, rest, path)
                runs.setdefault((label, (policy, *rest)), []).append(result)
    print(
        "policy and options | build | exit | verdict | wall s (median) | CPU s (median) | "
        "load (1 min) after each run"
    )
    unstable = False
    for policy, *rest in ALL_SIZES_RUNS:
        codes = set()
        for label in builds:
            results = runs.get((label, (policy, *rest)))
            if not results:
                continue
            if label == "before" and all(r[0] == 2 for r in results):
                print(
                    f"{' '.join((policy, *rest))} | {label} | 2 | bad input (not an option of "
                    "that build) | - | - | -"
                )
                continue
            codes |= {r[0] for r in results}
            print(
                f"{' '.join((policy, *rest))} | {label} | "
                f"{'/'.join(map(str, sorted({r[0] for r in results})))} | {results[0][1]} | "
                f"{median([r[2] for r in results]):.1f} | {median([r[3] for r in results]):.1f}"
                f" | {', '.join(f'{r[4]:.1f}' for r in results)}"
            )
        unstable |= len(codes) > 1
    print(f"load average after: {load()}")
    return 1 if unstable else 0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> bool:
    after = runs["after"]
    before = [r for r in runs["before"] if not r["timeout"]]
    print(
        f"\nall cells at N,R,D = {tuple(args.sizes)}, T={args.tokens}, bound {args.bound}; "
        f"medians of {len(after)} interleaved rounds; after: {args.workers} workers"
    )
    print("policy | cell | before | after | same | before s | after s (work)")
    differs = False
    for i, row in enumerate(after[0]["rows"]):
        mine = [r["rows"][i] for r in after]
        old = [r["rows"][i] for r in before]
        same = all(same_result(o, m) for o in old for m in mine) if old else None
        consistent = all(same_result(mine[0], m) for m in mine)
        differs |= same is False or not consistent
        cells = [
            row["policy"],
            row["cell"],
            verdict_text(old[0]) if old else "-",
            verdict_text(row),
            {True: "yes", False: "NO", None: "-"}[same] + ("" if consistent else " (runs differ)"),
            f"{median([o['seconds'] for o in old]):.1f}" if old else "-",
            f"{median([m['seconds'] for m in mine]):.1f}",
        ]
        print(" | ".join(cells))
    for what in ("wall", "cpu"):
        b = median([r[what] for r in before])
        a = median([r[what] for r in after])
        print(
            f"total {what}: before {b:.1f} s, after {a:.1f} s, ratio {b / a:.2f}x "
            f"(before runs {[round(r[what], 1) for r in before]}, after "
            f"{[round(r[what], 1) for r in after]})"
        )
    return differs


def profile(label: str, rounds: list[dict[str, Any]]) -> None:
    """Where a build's solver time went, summed over the cells, median over the rounds (a build
    whose induction records no queries prints nothing)."""
    per_round = [profile_sums(r["rows"]) for r in rounds]
    per_round = [p for p in per_round if p is not None]
    if not per_round:
        return
    med = lambda key: statistics.median(p[key] for p in per_round)  # noqa: E731
    print(
        f"\nprofile ({label}, median of {len(per_round)} rounds, CPU s): induction "
        f"{med('cpu'):.1f} = building terms {med('build'):.1f} + {med('queries'):.0f} solver "
        f"queries {med('solve'):.1f} + other {med('cpu') - med('build') - med('solve'):.1f}; "
        f"bounded model checking {med('bmc'):.1f} (wall)"
    )
    for what, most in (("instance", 20), ("conjunct", 12)):
        keys = set().union(*(p[what] for p in per_round))
        medians = {k: statistics.median(p[what].get(k, 0.0) for p in per_round) for k in keys}
        top = sorted(medians.items(), key=lambda kv: -kv[1])[:most]
        name = "per action" if what == "instance" else "per conjunct"
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in top))


def profile_sums(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One round's profile, summed over its cells."""
    instance: Counter[str] = Counter()
    conjunct: Counter[str] = Counter()
    build = cpu = bmc = 0.0
    queries = 0
    seen = False
    for row in rows:
        p = row.get("profile")
        if p is None:
            continue
        seen = True
        instance.update(p["instance"])
        conjunct.update(p["conjunct"])
        build += p["build"]
        cpu += p["cpu"]
        bmc += p["bmc"]
        queries += p["queries"]
    if not seen:
        return None
    return {
        "instance": instance,
        "conjunct": conjunct,
        "build": build,
        "cpu": cpu,
        "bmc": bmc,
        "queries": queries,
        "solve": sum(instance.values()),
    }


def large(args: argparse.Namespace, base: Path | None) -> None:
    sizes = tuple(args.large_sizes)
    print(f"\nlarger sizes N,R,D = {sizes}, T={args.tokens}: all cells (after)")
    result = run_build(None, args, sizes, args.large_timeout)
    label = "after"
    show(label, result, args.large_timeout)
    if args.large_baseline and base is not None:
        show("before", run_build(base, args, sizes, args.large_timeout), args.large_timeout)


def show(label: str, result: dict[str, Any], timeout: float) -> None:
    if result["timeout"]:
        print(f"{label}: did not finish within {timeout:.0f} s (load {load()})")
        return
    for row in result["rows"]:
        print(
            f"{label} | {row['policy']} | {row['cell']} | {verdict_text(row)} | "
            f"{row['seconds']:.1f} s"
        )
    print(f"{label}: wall {result['wall']:.1f} s, cpu {result['cpu']:.1f} s (load {load()})")


# -- the README table ----------------------------------------------------------------------------


def fuzz_length(result) -> str:  # type: ignore[no-untyped-def]
    """Decisions in the fuzzer's shrunk counterexample, up to the violating one."""
    from kvspec.spec.events import EFFECTS

    failure = result.failure
    if failure is None:
        return "-"
    events = failure.events[: failure.finding.event + 1]
    return str(sum(1 for e in events if e[0] not in EFFECTS))


def table(args: argparse.Namespace) -> None:
    from kvspec.conformance.fuzz import run_cell
    from kvspec.proofs.induction import prove_inductive
    from kvspec.proofs.prove import make_fragment, prove_cells

    blocks, requests, depth = args.sizes
    sizes = dict(blocks=blocks, requests=requests, depth=depth, block_size=1, tokens=args.tokens)
    fragment = make_fragment(POLICY_ORDER[0], "vllm", "fcfs", **sizes)
    title = f"Z3 at {fragment.describe()}; BMC bound K={args.bound}; fuzzer {args.fuzz_seconds:g} s"
    print(title)
    cells = [(p, d, q) for p in args.policies for d, q in CELLS]
    started = time.monotonic()
    outcomes = prove_cells(
        [make_fragment(p, d, q, **sizes) for p, d, q in cells],
        args.bound,
        args.timeout,
        workers=args.workers,
    )
    z3_wall = time.monotonic() - started
    print(" | ".join(HEADER), flush=True)
    rows = []
    for (policy, discipline, preemption), out in zip(cells, outcomes, strict=True):
        verdict, invariant, length, engine = {
            "proved": ("PROVED (inductive)", "-", "-", "-"),
            "bounded-proof": (f"holds<={args.bound} (bounded)", "-", "-", "-"),
            "unknown": ("unknown", "-", "-", "-"),
            "counterexample": ("FAILS", "", "", "confirms" if out.engine_confirms else "NO"),
        }[out.verdict]
        if out.verdict == "counterexample":
            assert out.bmc is not None
            invariant = out.bmc.invariant or "?"
            length = str(len(out.bmc.decisions))
        fz = run_cell(policy, discipline, preemption, seconds=args.fuzz_seconds)
        fverdict = f"FAILS ({fz.failure.finding.invariant})" if fz.failure else "holds"
        first = f"{fz.seconds_to_failure:.1f}" if fz.seconds_to_failure is not None else "-"
        row = [
            policy,
            f"{discipline}/{preemption}",
            verdict,
            invariant,
            length,
            f"{out.work_seconds:.1f}",
            engine,
            fverdict,
            fuzz_length(fz),
            first,
        ]
        rows.append(row)
        print(" | ".join(row), flush=True)
    work = sum(o.work_seconds for o in outcomes)
    print(f"Z3 wall {z3_wall:.1f} s on {args.workers} workers; work of all cells {work:.1f} s")
    if args.readme is not None:
        write_readme(args.readme, title, rows, z3_wall, args.workers)
    if args.skip_scaling:
        return
    print(f"\nscaling: inductive proof of deferred, vllm/fcfs, R={requests}, T={args.tokens}")
    depths = (1, 2, 3)
    print("N \\ D | " + " | ".join(f"D={d}" for d in depths))
    for n in (3, 4, 5, 6):
        row = [f"N={n}"]
        for d in depths:
            f = make_fragment("deferred", "vllm", "fcfs", n, requests, d, 1, args.tokens)
            t0 = time.monotonic()
            r = prove_inductive(f, args.timeout, workers=args.workers)
            took = time.monotonic() - t0
            row.append(f"{took:.1f}" if r.verdict == "inductive" else r.verdict)
        print(" | ".join(row), flush=True)


def write_readme(path: Path, title: str, rows: list[list[str]], wall: float, workers: int) -> None:
    text = path.read_text()
    if text.count(MARK) != 2:
        raise SystemExit(f"{path}: expected two {MARK} markers around the table")
    table_lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    body = "\n".join(
        [
            MARK,
            f"Made by `python bench/bench_prove.py --readme README.md` ({title}; Z3 "
            f'{wall:.0f} s wall for all cells on {workers} processes; "Z3 s" is each cell\'s '
            "work):",
            "",
            *table_lines,
            MARK,
        ]
    )
    before, _, rest = text.partition(MARK)
    _, _, after = rest.partition(MARK)
    path.write_text(before + body + after)
    print(f"wrote the table to {path}")


# -- arguments -----------------------------------------------------------------------------------


def sizes_arg(text: str) -> list[int]:
    parts = [int(x) for x in text.split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("sizes are N,R,D (blocks, requests, depth)")
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=sizes_arg, default=[4, 2, 2], help="N,R,D (default 4,2,2)")
    ap.add_argument("--tokens", type=int, default=3, help="T, tokens per request")
    ap.add_argument("--bound", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per cell, solver seconds")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policies", nargs="*", default=list(POLICY_ORDER))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-timeout", type=float, default=3600.0)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the before-build")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/kvspec-bench-prove"))
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--large-sizes", type=sizes_arg, default=[6, 3, 3])
    ap.add_argument("--large-baseline", action="store_true")
    ap.add_argument("--large-timeout", type=float, default=900.0)
    ap.add_argument("--table", action="store_true", help="the README table (with the fuzzer)")
    ap.add_argument("--readme", type=Path)
    ap.add_argument("--fuzz-seconds", type=float, default=20.0)
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument(
        "--all-sizes", action="store_true", help="time kvspec prove --all-sizes per policy"
    )
    ap.add_argument(
        "--work", action="store_true", help="Z3's deterministic work per cell, both builds"
    )
    ap.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--emit-work", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.emit:
        emit(args)
        return 0
    if args.emit_work:
        emit_work(args)
        return 0
    if args.work:
        return work(args)
    if args.table or args.readme is not None:
        table(args)
        return 0
    if args.all_sizes:
        return all_sizes_times(args)
    return speed(args)


if __name__ == "__main__":
    sys.exit(main())
