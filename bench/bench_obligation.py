"""Where one inductive-step obligation of a cell spends its time (issue #15), per conjunct.

``kvspec.proofs.induction`` checks one obligation (action instance, case) by one query over all
the conjuncts the step may change (commit past the default sizes: one query per conjunct); this
script takes the obligations whose instance name starts with ``--action`` (and at most
``--limit`` of them), builds each on a fresh ``Prover`` and times, in this process (process
CPU): the build, the queries as the prover asks them, and, with ``--per-conjunct``, each changed
conjunct alone on a one-shot solver (``--one-query``: every action's obligation starts with one
query for all its changed conjuncts, as before ``induction.ASKED_ALONE``). Every answer must be
unsat for an inductive cell; any other is printed as such and the run exits 1.

    PYTHONPATH=... python bench/bench_obligation.py --sizes 6,3,3 --policy deferred \\
        --cell vllm/fcfs --action execute --limit 1 [--per-conjunct]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import z3


def main() -> int:
    from kvspec.proofs import induction, prove

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="6,3,3", help="N,R,D")
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--policy", default="deferred")
    ap.add_argument("--cell", default="vllm/fcfs", help="discipline/preemption")
    ap.add_argument("--action", default="execute", help="instance name prefix")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--skip", type=int, default=0, help="skip the first SKIP matching")
    ap.add_argument("--per-conjunct", action="store_true")
    ap.add_argument("--conjuncts", nargs="*", help="only these, with --per-conjunct")
    ap.add_argument("--one-query", action="store_true", help="no action asks its conjuncts alone")
    args = ap.parse_args()
    try:
        n, r, d = (int(x) for x in args.sizes.split(","))
        discipline, preemption = args.cell.split("/")
        fragment = prove.make_fragment(
            args.policy, discipline, preemption, n, r, d, block_size=1, tokens=args.tokens
        )
    except ValueError as exc:
        print(f"bench_obligation: bad --sizes/--cell/--policy: {exc}", file=sys.stderr)
        return 2
    if args.one_query:
        induction.ASKED_ALONE = {}
    print(f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {fragment.describe()}")
    c0 = time.process_time()
    prover = induction.Prover(fragment)
    print(f"prover (pre-state terms): {time.process_time() - c0:.1f} s")
    chosen = [
        (i, c)
        for i, c in induction.obligations(prover.model)
        if induction._name(prover.model.instances[i]).startswith(args.action)
    ][args.skip : args.skip + args.limit]
    bad = False
    total = 0.0
    for i, c in chosen:
        inst = prover.model.instances[i]
        label = f"{induction._name(inst)} [{induction.case_name(prover.model.cases(inst)[c])}]"
        out = prover.check(i, c, None)
        total += out["cpu"]
        print(
            f"{label}: {out['answer']} cpu {out['cpu']:.1f} s (build {out['build_cpu']:.1f}); "
            + ", ".join(f"{q.conjunct} {q.answer} {q.cpu:.1f}" for q in out["queries"]),
            flush=True,
        )
        bad |= out["answer"] != "unsat"
        if args.per_conjunct:
            guard, succ, changed = prover.step(i, c)
            for name, cond in prover.changed_conjuncts(succ, changed):
                if args.conjuncts and name not in args.conjuncts:
                    continue
                one = induction.one_shot_solver()
                one.add(*prover.pre.values())
                one.add(guard, z3.Not(cond))
                t = time.process_time()
                verdict = one.check()
                print(f"    {name}: {verdict} {time.process_time() - t:.2f} s", flush=True)
                bad |= verdict != z3.unsat
    print(f"total obligation cpu {total:.1f} s over {len(chosen)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
