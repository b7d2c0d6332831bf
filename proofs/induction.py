"""Inductive proofs of the invariants for paths of any length, at fixed sizes (issue #3).

The claim for a cell (policy, discipline, preemption) and a fragment's sizes: every state reachable
from the initial state, by any number of decisions, satisfies every invariant of
``invariants.py``. The method is plain induction on an inductive strengthening: let I be the
conjunction of the ten invariants' Z3 forms and the lemmas of ``kvspec.proofs.lemmas`` stated for the
policy. Then

* **base**: the initial state satisfies I (evaluated directly: it is concrete);
* **step**: for every action instance, I(S) and the instance's guard imply I(successor), for a
  fully symbolic pre-state S and symbolic parameters (any prompt tokens, priorities, sampled
  tokens, token counts). One solver per instance; ``unsat`` of "guard and not I(successor)" is the
  proof, ``sat`` a *counterexample to induction* (CTI): a state satisfying I that steps out of it.

A CTI is not a bug report: its pre-state may be unreachable, and then a lemma is missing. This is
why ``kvspec prove`` runs bounded model checking after a failed induction: the shortest real
counterexample, or a bounded proof. A solver ``unknown`` is never a proof.

Sizes are fixed (N, R, D, T, B of the fragment): the proof is unbounded in path length, not in the
sizes. ``bench/bench_prove.py`` runs it over a range of sizes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import z3

from . import lemmas as lm
from . import symbolic as sy


@dataclass
class Cti:
    """A counterexample to induction: an instance that leaves the strengthening."""

    instance: sy.Instance
    broken: list[str]
    """The conjuncts (invariants or lemmas) false after the step."""
    pre: dict[str, str]
    """The pre-state's non-default variables, for a reader."""


@dataclass
class InductionResult:
    verdict: str
    """``inductive``, ``cti``, ``base-fails`` or ``unknown``."""
    fragment: sy.Fragment
    invariants: list[str]
    lemmas: list[str]
    instances: int = 0
    cti: Cti | None = None
    seconds: float = 0.0
    per_instance: list[tuple[str, str, float]] = field(default_factory=list)


def strengthening(model: sy.Model, S: sy.SState) -> dict[str, Any]:
    """The invariants and the policy's lemmas as named predicates on S."""
    out = dict(model.invariants(S))
    out.update(lm.lemmas(model, S))
    return out


def prove_inductive(fragment: sy.Fragment, timeout_s: float | None = None) -> InductionResult:
    """Base case and one inductive step per action instance."""
    started = time.monotonic()
    model = sy.Model(fragment)
    S = model.fresh("pre")
    pre = strengthening(model, S)
    lemma_names = [name for name in pre if name not in sy.Z3_INVARIANTS]
    result = InductionResult("inductive", fragment, list(sy.Z3_INVARIANTS), lemma_names)
    initial = strengthening(model, model.initial())
    false_at_start = [n for n, c in initial.items() if not z3.is_true(z3.simplify(c))]
    if false_at_start:
        result.verdict = "base-fails"
        result.cti = Cti(("initial",), false_at_start, {})
        result.seconds = time.monotonic() - started
        return result
    solver = z3.Solver()
    solver.add(*pre.values())
    for i, inst in enumerate(model.instances):
        t0 = time.monotonic()
        if timeout_s is not None:
            left = timeout_s - (t0 - started)
            if left <= 0:
                result.verdict = "unknown"
                break
            solver.set("timeout", max(1, int(left * 1000)))
        params = model.fresh_params(inst, f"p{i}")
        guard, succ = model.apply(inst, S, params)
        post = strengthening(model, succ)
        solver.push()
        solver.add(guard)
        # One query per conjunct the step can change; a conjunct whose term is the very term it
        # was before the step (the action leaves everything it reads alone) is assumed, hence true.
        answer, broken, mz = z3.unsat, [], None
        for name, cond in post.items():
            if cond.eq(pre[name]):
                continue
            solver.push()
            solver.add(z3.Not(cond))
            verdict = solver.check()
            if verdict == z3.sat:
                mz = solver.model()
                broken = [n for n, c in post.items() if z3.is_false(mz.eval(c, True))]
            solver.pop()
            if verdict != z3.unsat:
                answer = verdict
                break
        solver.pop()
        result.instances += 1
        result.per_instance.append((_name(inst), str(answer), time.monotonic() - t0))
        if answer == z3.unsat:
            continue
        if answer == z3.unknown or mz is None:
            result.verdict = "unknown"
            break
        result.verdict = "cti"
        result.cti = Cti(inst, broken, _describe_state(model, S, mz))
        break
    result.seconds = time.monotonic() - started
    return result


def _name(inst: sy.Instance) -> str:
    return str(inst[0]) + "".join(f" {a}" for a in inst[1:])


def _describe_state(model: sy.Model, S: sy.SState, mz: Any) -> dict[str, str]:
    out = {}
    for key, _ in model.schema:
        value = str(mz.eval(S[key], model_completion=True))
        if value not in ("0", "False"):
            out[sy.key_name(key)] = value
    return out


def describe(result: InductionResult) -> str:
    """A few lines for a reader: the verdict, what was used, and a CTI if any."""
    f = result.fragment
    lines = []
    if result.verdict == "inductive":
        lines.append(
            f"INDUCTIVE: the {len(result.invariants)} invariants with {len(result.lemmas)} "
            f"lemmas hold initially and are preserved by all {result.instances} action "
            f"instances ({result.seconds:.1f} s): they hold in every reachable state, for paths "
            f"of any length, at these sizes ({f.describe()})."
        )
        lines.append(f"lemmas: {', '.join(result.lemmas)}")
    elif result.verdict == "unknown":
        lines.append(f"induction: UNKNOWN (solver timeout after {result.seconds:.1f} s)")
    else:
        cti = result.cti
        assert cti is not None
        what = "the initial state" if result.verdict == "base-fails" else _name(cti.instance)
        lines.append(
            f"induction: not inductive with these lemmas: {what} breaks "
            f"{', '.join(cti.broken)} from a state that satisfies them all (a counterexample to "
            f"induction; that state may be unreachable) ({result.seconds:.1f} s)"
        )
    return "\n".join(lines)
