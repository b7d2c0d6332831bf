"""Z3 bounded model checking of every cell, and how its cost grows with the sizes.

For each cell (policy, discipline, preemption) prints the verdict of ``kvspec prove`` at the given
sizes and bound: ``FAILS`` with the invariant and the length (in decisions) of Z3's shortest
counterexample, confirmed by replaying it through the executable spec; ``holds<=K`` for a bounded
proof (no violation reachable in <= K decisions, for these sizes: not an inductive proof); or
``unknown`` on a solver timeout. Then a scaling table: the time to prove one safe cell up to a fixed
bound against the number of blocks N and the depth D.

    .venv/bin/python bench/bench_prove.py [--bound 8] [--blocks 4] [--requests 2] [--depth 2]
        [--tokens 3] [--timeout 300] [--scaling-bound 6] [--skip-scaling]
"""

from __future__ import annotations

import argparse
import time

from kvspec.conformance.prove import DEFAULTS, bmc, make_fragment
from kvspec.spec import POLICIES

CELLS = (("vllm", "fcfs"), ("vllm", "priority"), ("general", "fcfs"))


def row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bound", type=int, default=DEFAULTS["bound"])
    ap.add_argument("--blocks", type=int, default=DEFAULTS["blocks"])
    ap.add_argument("--requests", type=int, default=DEFAULTS["requests"])
    ap.add_argument("--depth", type=int, default=DEFAULTS["depth"])
    ap.add_argument("--tokens", type=int, default=DEFAULTS["tokens"])
    ap.add_argument("--block-size", type=int, default=DEFAULTS["block_size"])
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--scaling-bound", type=int, default=6)
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
    print(f"fragment: {fragment.describe()}; bound K={args.bound} decisions")
    widths = [22, 14, 10, 20, 10, 8]
    print(row(["policy", "cell", "verdict", "invariant", "Z3 cex", "time s"], widths))
    total = 0.0
    for policy in args.policies:
        for discipline, preemption in CELLS:
            f = make_fragment(policy, discipline, preemption, **sizes)
            r = bmc(f, args.bound, timeout_s=args.timeout)
            total += r.seconds
            verdict = {
                "counterexample": "FAILS",
                "bounded-proof": f"holds<={args.bound}",
                "unknown": f"unknown>{r.depth_reached}",
            }[r.verdict]
            length = str(len(r.decisions)) if r.decisions else "-"
            cell = f"{discipline}/{preemption}"
            print(
                row(
                    [policy, cell, verdict, r.invariant or "-", length, f"{r.seconds:.1f}"],
                    widths,
                ),
                flush=True,
            )
    print(f"total {total:.1f} s")
    if args.skip_scaling:
        return
    k = args.scaling_bound
    print(
        f"\nscaling: deferred, vllm/fcfs, bounded proof to K={k}, R={args.requests}, T={args.tokens}"
    )
    depths = (1, 2, 3)
    print(row(["N \\ D"] + [f"D={d}" for d in depths], [8] + [10] * len(depths)))
    for n in (3, 4, 5, 6):
        cells = [f"N={n}"]
        for d in depths:
            f = make_fragment(
                "deferred", "vllm", "fcfs", n, args.requests, d, args.block_size, args.tokens
            )
            started = time.monotonic()
            r = bmc(f, k, timeout_s=args.timeout)
            took = time.monotonic() - started
            cells.append(f"{took:.1f}" if r.verdict == "bounded-proof" else r.verdict)
        print(row(cells, [8] + [10] * len(depths)), flush=True)


if __name__ == "__main__":
    main()
