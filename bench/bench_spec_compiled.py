"""The fast model, measured (issue #32): the spec judge (``SpecModel`` with the incremental checks)
compiled by mypyc, beside the fast model compiled as ``kvspec check`` uses it, on the two figures
users wait for: ``kvspec check`` of a reference trace, and lockstep fuzzing.

1. Copies this tree (the files git would ship) twice into a temporary folder, each as a package
   ``kvspec``: ``source`` as it is, and ``compiled``, where ``SPEC_JUDGE`` (the spec's modules, the
   incremental checks, the spec model and the judge's core) are compiled in place with mypyc
   (an extension module is imported before the ``.py`` beside it).
2. Writes a v1 trace from the reference engine (``bench_checker.py``'s configuration: policy
   ``deferred``, depth 2, 256 blocks of 16 tokens) of ``--events`` events.
3. In interleaved rounds (a fresh process per figure, the copy first on ``PYTHONPATH``), medians
   over ``--rounds``: ``kvspec check`` events/s with ``--engine fast`` (the compiled fast model,
   ``fastbuild``: it needs a current build, ``make venv``) and with ``--engine spec`` of each copy;
   lockstep fuzzing (``run_cell``, policy ``deferred``, vllm/fcfs, ``--seconds`` each) engine
   steps (commits) per second judged by the fast model (``how="fast"``, the default) and by the
   spec judge of each copy (``how="spec"``).

    python bench/bench_spec_compiled.py [--events 300000] [--rounds 3] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC_JUDGE = (
    "spec/state.py",
    "spec/pool.py",
    "spec/policies.py",
    "spec/actions.py",
    "spec/invariants.py",
    "spec/observed.py",
    "judge/incremental.py",
    "judge/spec_model.py",
)
"""The modules of the spec judge that are compiled (the rest stays Python)."""

CHECK = """
import json, sys, time
from kvspec.conformance.check import check_file
started = time.perf_counter()
report = check_file(sys.argv[1], engine=sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - started}))
"""
FUZZ = """
import json, sys
from kvspec.conformance.fuzz import run_cell
r = run_cell("deferred", seconds=float(sys.argv[1]), seed_value=int(sys.argv[2]), engine=sys.argv[3])
print(json.dumps({"commits": r.commits, "seconds": r.seconds, "failure": r.failure is not None}))
"""
WRITE = """
import sys
sys.path.insert(0, sys.argv[3])
import bench_checker
from kvspec.conformance.trace import write_trace
from kvspec.spec import Config
events = bench_checker.engine_events(int(sys.argv[2]))
print(write_trace(sys.argv[1], Config(**bench_checker.COMMON), events, hashes=True))
"""


def copy_tree(to: Path) -> None:
    """This tree's sources (no virtual environments, builds or git data) as the folder ``to``."""
    skip = shutil.ignore_patterns(".*", "build", "dist", "__pycache__", "*.so", "thirdparty")
    shutil.copytree(ROOT, to, ignore=skip, symlinks=True)


def compile_in_place(package: Path) -> float:
    """mypyc over ``SPEC_JUDGE`` in the copy ``package`` (a folder named ``kvspec``); seconds."""
    ini = package.parent / "mypy.ini"
    ini.write_text(
        "[mypy]\ncheck_untyped_defs = True\nignore_missing_imports = True\n"
        "[mypy-kvspec.impl,kvspec.impl.*,torch,torch.*,transformers,transformers.*]\n"
        "follow_imports = skip\n"
        "[mypy-kvspec.conformance.*,kvspec.cli,kvspec.flow]\nfollow_imports = silent\n"
    )
    started = time.perf_counter()
    files = [f"kvspec/{name}" for name in SPEC_JUDGE]
    subprocess.run(
        [sys.executable, "-m", "mypyc", "--config-file", str(ini), *files],
        cwd=package.parent,
        check=True,
        env={**os.environ, "PYTHONPATH": str(package.parent), "MYPYPATH": str(package.parent)},
        capture_output=True,
    )
    return time.perf_counter() - started


def child(tree: Path, code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=tree
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvspec-speccompiled-"))
    try:
        trees = {name: work / name for name in ("source", "compiled")}
        for tree in trees.values():
            copy_tree(tree / "kvspec")
        took = compile_in_place(trees["compiled"] / "kvspec")
        built = sorted(p.name for p in (trees["compiled"] / "kvspec" / "spec").glob("*.so"))
        print(f"compiled {len(SPEC_JUDGE)} modules in {took:.0f} s ({', '.join(built)})")
        trace = work / "trace.jsonl"
        count = subprocess.run(
            [sys.executable, "-c", WRITE, str(trace), str(args.events), str(ROOT / "bench")],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(trees["source"])},
        ).stdout.split()[-1]
        print(f"trace: {count} events (reference engine, bench_checker.py's configuration)")
        check: dict[str, list[float]] = {}
        fuzz: dict[str, list[float]] = {}
        events = int(count)
        for round_ in range(args.rounds):
            for label, tree, engine in (
                ("fast model (compiled)", trees["source"], "fast"),
                ("spec judge, source", trees["source"], "spec"),
                ("spec judge, compiled", trees["compiled"], "spec"),
            ):
                got = child(tree, CHECK, str(trace), engine)
                check.setdefault(label, []).append(events / got["seconds"])
                got = child(tree, FUZZ, str(args.seconds), str(round_), engine)
                fuzz.setdefault(label, []).append(got["commits"] / got["seconds"])
        print(f"median of {args.rounds} interleaved rounds [each round], one core:")
        print("  kvspec check, events/s")
        for label, rates in check.items():
            runs = ", ".join(f"{r:,.0f}" for r in rates)
            print(f"    {label:28s} {statistics.median(rates):>10,.0f}   [{runs}]")
        print(f"  lockstep fuzzing (deferred, vllm/fcfs, {args.seconds:g} s), engine steps/s")
        for label, rates in fuzz.items():
            runs = ", ".join(f"{r:,.0f}" for r in rates)
            print(f"    {label:28s} {statistics.median(rates):>10,.0f}   [{runs}]")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
