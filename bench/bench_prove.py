"""Z3 verdicts of every cell beside the fuzzer's, and how proof time grows with the sizes.

For each cell (policy, discipline, preemption), ``kvspec prove``'s verdict at the given sizes:
``PROVED`` (the invariants and lemmas are inductive: every path length), ``FAILS`` with the
invariant and the length in decisions of Z3's shortest counterexample (confirmed by the executable
spec, and ``engine`` says whether the reference engine forced through it violates the same
invariant), ``holds<=K`` (bounded proof only) or ``unknown``. Beside it, the fuzzer's result on
the same cell (``kvspec fuzz``, seed 0, a time budget): its shrunk counterexample's length in
decisions (the fuzzer also picks pool sizes and block sizes, so the lengths are not of the same
model) and the time to its first failure.

``--readme README.md`` rewrites the table between the ``<!-- prove-table -->`` markers there.
Then a scaling table: the time of the inductive proof of ``deferred`` vllm/fcfs against the
number of blocks N and the depth D.

    .venv/bin/python bench/bench_prove.py [--bound 8] [--blocks 4] [--requests 2] [--depth 2]
        [--tokens 3] [--timeout 300] [--fuzz-seconds 20] [--readme README.md] [--skip-scaling]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvspec.conformance.fuzz import run_cell
from kvspec.proofs.induction import prove_inductive
from kvspec.proofs.prove import DEFAULTS, make_fragment, prove_cell
from kvspec.spec import POLICIES
from kvspec.spec.events import EFFECTS

CELLS = (("vllm", "fcfs"), ("vllm", "priority"), ("general", "fcfs"))
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


def fuzz_length(result) -> str:  # type: ignore[no-untyped-def]
    """Decisions in the fuzzer's shrunk counterexample, up to the violating one."""
    failure = result.failure
    if failure is None:
        return "-"
    events = failure.events[: failure.finding.event + 1]
    return str(sum(1 for e in events if e[0] not in EFFECTS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bound", type=int, default=DEFAULTS["bound"])
    ap.add_argument("--blocks", type=int, default=DEFAULTS["blocks"])
    ap.add_argument("--requests", type=int, default=DEFAULTS["requests"])
    ap.add_argument("--depth", type=int, default=DEFAULTS["depth"])
    ap.add_argument("--tokens", type=int, default=DEFAULTS["tokens"])
    ap.add_argument("--block-size", type=int, default=DEFAULTS["block_size"])
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--fuzz-seconds", type=float, default=20.0)
    ap.add_argument("--readme", type=Path)
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    args = ap.parse_args()

    sizes = dict(
        blocks=args.blocks,
        requests=args.requests,
        depth=args.depth,
        block_size=args.block_size,
        tokens=args.tokens,
    )
    fragment = make_fragment(POLICIES[0], "vllm", "fcfs", **sizes)
    title = f"Z3 at {fragment.describe()}; BMC bound K={args.bound}; fuzzer {args.fuzz_seconds:g} s"
    print(title)
    print(" | ".join(HEADER), flush=True)
    rows, z3_total, proved_total = [], 0.0, 0.0
    for policy in args.policies:
        for discipline, preemption in CELLS:
            f = make_fragment(policy, discipline, preemption, **sizes)
            out = prove_cell(f, args.bound, args.timeout)
            z3_total += out.seconds
            if out.verdict == "proved":
                proved_total += out.seconds
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
                f"{out.seconds:.1f}",
                engine,
                fverdict,
                fuzz_length(fz),
                first,
            ]
            rows.append(row)
            print(" | ".join(row), flush=True)
    print(f"Z3 total {z3_total:.1f} s, of which inductive proofs {proved_total:.1f} s")
    if args.readme is not None:
        write_readme(args.readme, title, rows, z3_total, proved_total)
    if args.skip_scaling:
        return
    print(f"\nscaling: inductive proof of deferred, vllm/fcfs, R={args.requests}, T={args.tokens}")
    depths = (1, 2, 3)
    print("N \\ D | " + " | ".join(f"D={d}" for d in depths))
    for n in (3, 4, 5):
        cells = [f"N={n}"]
        for d in depths:
            f = make_fragment(
                "deferred", "vllm", "fcfs", n, args.requests, d, args.block_size, args.tokens
            )
            started = time.monotonic()
            r = prove_inductive(f, args.timeout)
            took = time.monotonic() - started
            cells.append(f"{took:.1f}" if r.verdict == "inductive" else r.verdict)
        print(" | ".join(cells), flush=True)


def write_readme(
    path: Path, title: str, rows: list[list[str]], z3_total: float, proved: float
) -> None:
    text = path.read_text()
    if text.count(MARK) != 2:
        raise SystemExit(f"{path}: expected two {MARK} markers around the table")
    table = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    body = "\n".join(
        [
            MARK,
            f"Made by `python bench/bench_prove.py --readme README.md` ({title}; Z3 total "
            f"{z3_total:.0f} s, inductive proofs {proved:.0f} s):",
            "",
            *table,
            MARK,
        ]
    )
    before, _, rest = text.partition(MARK)
    _, _, after = rest.partition(MARK)
    path.write_text(before + body + after)
    print(f"wrote the table to {path}")


if __name__ == "__main__":
    main()
