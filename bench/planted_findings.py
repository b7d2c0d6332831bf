"""Before/after table of #33: each bug of ``tests/planted.py`` planted in the reference engine,
fuzzed with a fixed seed (``run_cell("deferred", seed_value=0)``) by a tree's kvspec in a child
process, and what the report names: the finding, and (where the tree has it) the deviation's
consequence; with the seconds to the first failure and to the shrunk report.

    python bench/planted_findings.py BEFORE_TREE AFTER_TREE

Each tree is a checkout whose ``.pp`` (or parent folder) makes ``import kvspec`` import it.
Prints a Markdown table (docs/findings-explained.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[2])
from planted import CRASHING, PLANTS
from kvspec.conformance.fuzz import run_cell
plant = {p.name: p for p in PLANTS + CRASHING}[sys.argv[1]]
started = time.monotonic()
with plant.patch():
    r = run_cell("deferred", seconds=30, seed_value=0)
total = time.monotonic() - started
f = r.failure
c = getattr(f, "consequence", None) if f else None
print(json.dumps({
    "finding": None if f is None else f.finding.invariant,
    "message": None if f is None else f.finding.message,
    "named": None if c is None else c.invariant,
    "headline": None if c is None else c.headline(),
    "lost_hits": None if c is None else c.lost_hits,
    "first": r.seconds_to_failure,
    "total": total,
}))
"""


def run(tree: Path, plant: str, tests: Path) -> dict[str, object]:
    pp = tree / ".pp"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # a tree without .pp: the interpreter's own install
    if pp.exists():
        env["PYTHONPATH"] = str(pp)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, plant, str(tests)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode != 0:
        return {"finding": f"crash: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    before, after = Path(sys.argv[1]), Path(sys.argv[2])
    tests = after / "tests"
    sys.path.insert(0, str(tests))
    from planted import CRASHING, PLANTS

    print("| bug | class | before (main) | after | named | report (s) |")
    print("|---|---|---|---|---|---|")
    for plant in PLANTS + CRASHING:
        b = run(before, plant.name, tests)
        a = run(after, plant.name, tests)
        after_text = a.get("headline") or f"{a.get('finding')}: {a.get('message')}"
        named = a.get("named") or (
            a["finding"]
            if a.get("finding") not in ("Disagreement", "Illegal", "EngineError")
            else None
        )
        verdict = f"yes ({named})" if named else ("efficiency" if a.get("headline") else "no")
        print(
            f"| {plant.name} | {plant.kind} | {b.get('finding')}: {str(b.get('message'))[:90]} "
            f"| {str(after_text)[:220]} | {verdict} | {a.get('total', 0):.1f} |"
        )


if __name__ == "__main__":
    main()
