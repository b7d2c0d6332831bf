"""The observed judge, measured: events per second of ``Judge.spec(config, observed=True)`` (what
``kvspec check`` runs on a trace whose header says ``judging: observed``) on traces of the
reference engine, this tree beside git revision ``--baseline REF``.

Stop 46 moved the observed judge's steering of allocations from before a decision (the engine's
allocated blocks moved to the head of the free queue) into each allocation (``spec/pool.py``'s
``take_free``); this prints what that costs. Each trace is written once by this tree's reference
engine; each figure is a fresh process that imports ``kvspec`` from one tree, judges the whole
trace and reports its own time (start-up and loading excluded); rounds interleave the trees and
the medians are printed side by side. A tree that judges a trace other than as holding says so
(the baseline finds ``Illegal`` where a decision allocates a block it freed first).

    python bench/bench_observed.py [--requests 400] [--rounds 3] [--baseline REF]
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import checkout

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import importlib.util, json, pickle, sys, time
root, path = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location(
    "kvspec", root + "/__init__.py", submodule_search_locations=[root]
)
module = importlib.util.module_from_spec(spec)
sys.modules["kvspec"] = module
spec.loader.exec_module(module)
from kvspec.judge import Judge
from kvspec.spec import Config
from kvspec.spec.state import Group
fields, events = pickle.load(open(path, "rb"))
fields["groups"] = tuple(Group(*g) for g in fields["groups"])
judge = Judge.spec(Config(**fields), observed=True)
began = time.perf_counter()
found = judge.feed_all(events) or judge.settle()
took = time.perf_counter() - began
verdict = "holds" if found is None else f"{found.invariant} at event {found.event}"
judged = len(events) if found is None else found.event + 1
print(json.dumps({"seconds": took, "events": judged, "verdict": verdict}))
"""

TRACES = {
    "deferred, one group (64 blocks of 4)": dict(
        num_blocks=64, block_size=4, policy="deferred", groups=()
    ),
    "engine-registers, full + slot (64 blocks of 2)": dict(
        num_blocks=64, block_size=2, policy="engine-registers", groups=(("full", 2), ("slot", 2))
    ),
    "deferred, full + window 4 (24 blocks of 2)": dict(
        num_blocks=24, block_size=2, policy="deferred", groups=(("full", 2), ("window", 2, 4))
    ),
}
"""Each trace's pool and groups; all run at depth 2, general discipline, fcfs. The last pool is
short: its schedules free window blocks and allocate them again."""


def write_trace(name: str, requests: int, folder: Path) -> Path:
    """This tree's reference engine on ``requests`` requests sharing prefixes: the spec's config
    fields and the events, pickled."""
    checkout.import_kvspec()
    from kvspec.reference import Engine, EngineConfig, GroupSpec, RandomChoices

    shape = TRACES[name]
    groups = tuple(GroupSpec(*g) for g in shape["groups"])  # type: ignore[attr-defined]
    prefix_caching = True
    cfg = EngineConfig(
        num_blocks=shape["num_blocks"],  # type: ignore[arg-type]
        block_size=shape["block_size"],  # type: ignore[arg-type]
        depth=2,
        policy=shape["policy"],  # type: ignore[arg-type]
        discipline="general",
        token_budget=16,
        max_running=4,
        stop_token=0,
        vocab=3,
        prefix_caching=prefix_caching,
        groups=groups,
    )
    rng = random.Random(0)
    engine = Engine(cfg, RandomChoices(1))
    prefixes = [tuple(rng.randrange(3) for _ in range(rng.randint(3, 9))) for _ in range(4)]
    added = 0
    while added < requests or engine.has_unfinished():
        if added < requests and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + tuple(rng.randrange(3) for _ in range(rng.randrange(4)))
            engine.add_request(added, prompt, rng.randint(1, 5), rng.randrange(3))
            added += 1
        engine.step()
    fields = dict(
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size,
        depth=cfg.depth,
        policy=cfg.policy,
        discipline=cfg.discipline,
        token_budget=cfg.token_budget,
        max_running=cfg.max_running,
        stop_token=cfg.stop_token,
        prefix_caching=cfg.prefix_caching,
        groups=tuple(tuple(g) for g in cfg.groups),
    )
    path = folder / f"trace{list(TRACES).index(name)}.pickle"
    with path.open("wb") as f:
        pickle.dump((fields, list(engine.events)), f)
    return path


def judge(tree: Path, path: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(path)],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", metavar="REF", help="also judge with git revision REF")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kvspec-observed-"))
    trees = {"this tree": ROOT}
    if args.baseline:
        from bench_checker import checkout as checkout_ref

        trees[args.baseline] = checkout_ref(args.baseline)
    for name in TRACES:
        path = write_trace(name, args.requests, folder)
        rates: dict[str, list[float]] = {tree: [] for tree in trees}
        verdicts: dict[str, str] = {}
        judged: dict[str, int] = {}
        for _ in range(args.rounds):
            for label, tree in trees.items():
                got = judge(tree, path)
                judged[label] = int(got["events"])  # type: ignore[call-overload]
                rates[label].append(judged[label] / float(got["seconds"]))  # type: ignore[arg-type]
                verdicts[label] = str(got["verdict"])
        print(f"{name}: {judged['this tree']:,} events, median of {args.rounds}")
        for label in trees:
            rate = statistics.median(rates[label])
            print(
                f"  {label:12s} {rate:12,.0f} events/s over {judged[label]:,} events  "
                f"{verdicts[label]}"
            )
        if args.baseline and len(set(verdicts.values())) == 1:
            this, then = (
                statistics.median(rates["this tree"]),
                statistics.median(rates[args.baseline]),
            )
            print(f"  this tree / {args.baseline}: {this / then:.2f} x")


if __name__ == "__main__":
    main()
