"""Before/after table of #33: block-manager bugs planted in each engine kvspec drives (the
reference engine, nano-vllm-fork, vLLM 0.33.0 and 0.34.0), each fuzzed with a fixed seed by a
tree's kvspec in a child process of that engine's interpreter (``bench/planted_child.py``, which
patches the engine's own classes there: ``tests/planted*.py``), and what the report names.

    python bench/planted_findings.py BEFORE_TREE AFTER_TREE [ENGINE ...]

ENGINE: ``reference``, ``nano``, ``vllm-0.33.0``, ``vllm-0.34.0``, ``vllm-hybrid-0.33.0``,
``vllm-hybrid-0.34.0`` (vLLM's hybrid code through ``hybrid.swa_factory``, issue #36),
``vllm-mamba-0.33.0``, ``vllm-mamba-0.34.0`` (vLLM's Mamba ``align`` code through
``hybrid.mamba_factory``, fcfs), ``vllm-window-0.33.0``, ``vllm-window-0.34.0`` (vLLM's window
manager through ``hybrid.swa_full_first_factory``, the window in group 1) (default:
every one whose interpreter AFTER_TREE has: its own ``.venv-nano`` / ``.venv-vllm`` /
``.venv-vllm-0.34.0``; the reference engine runs in this interpreter). Each tree is a checkout whose ``.pp`` makes ``import
kvspec`` import it (a tree without one: the interpreter's own install of kvspec). The bugs and the
child come from AFTER_TREE. Prints, per engine, a Markdown table (``docs/findings-explained.md``):
first the engine with nothing planted under the same seed (a bug whose finding is that one is
masked by the engine's own), then each bug; and a summary line over all engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENGINES = {
    "reference": ("reference", None),
    "nano": ("nano", ".venv-nano"),
    "vllm-0.33.0": ("vllm", ".venv-vllm"),
    "vllm-0.34.0": ("vllm", ".venv-vllm-0.34.0"),
    "vllm-hybrid-0.33.0": ("vllm-hybrid", ".venv-vllm"),
    "vllm-hybrid-0.34.0": ("vllm-hybrid", ".venv-vllm-0.34.0"),
    "vllm-mamba-0.33.0": ("vllm-mamba", ".venv-vllm"),
    "vllm-mamba-0.34.0": ("vllm-mamba", ".venv-vllm-0.34.0"),
    "vllm-window-0.33.0": ("vllm-window", ".venv-vllm"),
    "vllm-window-0.34.0": ("vllm-window", ".venv-vllm-0.34.0"),
}
"""Engine -> (the child's engine, the interpreter's venv in AFTER_TREE; None: this one)."""
GENERIC = ("Disagreement", "Illegal", "EngineError", "EngineHung", "EngineNeverIdle", None)
"""Findings that name no property."""
SECONDS = 30


def run(tree: Path, after: Path, engine: str, baseline: bool) -> list[dict[str, object]]:
    """The child's rows for ``engine`` under ``tree``'s kvspec."""
    child_engine, venv = ENGINES[engine]
    python = sys.executable if venv is None else str(after / venv / "bin" / "python")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # a tree without .pp: the interpreter's own install
    if (tree / ".pp").exists():
        env["PYTHONPATH"] = str(tree / ".pp")
    argv = [python, str(after / "bench" / "planted_child.py"), child_engine, str(after / "tests")]
    argv += [str(SECONDS)]
    if not baseline:
        argv.insert(2, "--no-baseline")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        rows.append({"name": "(child failed)", "kind": "none", "finding": f"crash: {last}"})
    return rows


def verdict(row: dict[str, object], base: dict[str, object] | None) -> str:
    """What the report names: the invariant (or book check) the bug was planted for, another
    one, efficiency with its lost hits, the engine's own finding that masks the bug, or
    nothing."""
    named = row.get("named") or (row["finding"] if row.get("finding") not in GENERIC else None)
    if named and row.get("expect") not in (None, named):
        return f"other ({named}; planted for {row['expect']})"
    if named:
        return f"yes ({named})"
    if row.get("headline"):
        return f"efficiency ({row.get('lost_hits')} hits lost)"
    if base is not None and base.get("finding") is not None:
        if (base.get("finding"), base.get("message")) == (row.get("finding"), row.get("message")):
            return "masked (the engine's own finding)"
    return "no"


def text(row: dict[str, object], width: int) -> str:
    said = row.get("headline") or f"{row.get('finding')}: {row.get('message')}"
    said = str(said).replace("|", "/")
    return said if len(said) <= width else said[: width - 3] + "..."


def main() -> None:
    before, after = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    engines = sys.argv[3:] or [
        name for name, (_, venv) in ENGINES.items() if venv is None or (after / venv).exists()
    ]
    unknown = [name for name in engines if name not in ENGINES]
    if unknown:
        sys.exit(f"unknown engine {unknown[0]!r}: one of {', '.join(ENGINES)}")
    tally = {"safety": [0, 0], "efficiency": [0, 0]}
    slowest = 0.0
    for engine in engines:
        print(f"\n**{engine}**\n")
        print("| bug | class | before | after | named | report (s) |")
        print("|---|---|---|---|---|---|")
        old = {str(r["name"]): r for r in run(before, after, engine, baseline=False)}
        rows = run(after, after, engine, baseline=True)
        base = next((r for r in rows if r["name"] == "baseline"), None)
        for row in rows:
            said = verdict(row, base if row is not base else None)
            b = old.get(str(row["name"]), {"finding": "-", "message": "-"})
            seconds = float(row.get("total") or 0)  # type: ignore[arg-type]
            print(
                f"| {row['name']} | {row['kind']} | {text(b, 90)} | {text(row, 200)} | {said} "
                f"| {seconds:.1f} |"
            )
            kind = str(row["kind"])
            if kind in tally and not said.startswith("masked"):
                slowest = max(slowest, seconds)
                tally[kind][1] += 1
                good = said.startswith("yes") if kind == "safety" else said.startswith("eff")
                tally[kind][0] += good
    (s_named, s_all), (e_named, e_all) = tally["safety"], tally["efficiency"]
    print(
        f"\nSafety bugs named by their invariant: {s_named} of {s_all}; efficiency bugs "
        f"reported as efficiency: {e_named} of {e_all} (bugs masked by the engine's own finding "
        f"left out); slowest report {slowest:.1f} s."
    )


if __name__ == "__main__":
    main()
