"""Proofs for every size: the parametric model's invariant is inductive (``kvspec prove --all-sizes``).

``parametric.py`` states the block lifecycle over unbounded sorts and the invariant I (the five
safety predicates and the lemmas) with quantifiers. This module discharges the proof's
obligations with Z3, one query each:

* **base**, per conjunct c of I: ``not c(initial)`` is unsat;
* **step**, per action a and conjunct c: ``axioms and I(S) and guard_a and not c(post_a(S))`` is
  unsat, for a symbolic pre-state S (uninterpreted functions over the sorts) and symbolic
  parameters (which request, which blocks hit and allocated, which step executes, what a commit
  publishes and finishes, ...);
* **fresh holders**: a schedule adds a holder only where there was none (``ref(r, b)`` false),
  so the spec's integer refcount, raised by one per added holder and lowered by one per dropped
  one, stays the number of holders (``RefcountIsOwnership`` as the spec counts it).

``unsat`` of all of them proves that every reachable state of the model satisfies I, for every
number of blocks, requests, tokens and steps in flight; since every spec transition (in the
fragment) is a transition of the model (the twin test), every reachable spec state of the
fragment satisfies the five invariants. ``sat`` is a counterexample to induction (the obligation
and the solver's model are reported); ``unknown`` is never a proof.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import z3

from kvspec import twins
from kvspec.spec.policies import POLICIES
from kvspec.spec.state import Config

from . import parametric as pm

FORM = "kvspec.proofs.parametric"
"""This form's row of ``kvspec/twins.py``: the features and policy traits it follows."""


ASYNC_DRAFTS = (
    "the parametric model does not follow speculative decoding (draft tokens) under async "
    "scheduling with stale output delivered (spec_tokens with async_scheduling and "
    "stale_output=deliver): a rejection in a step committing for a preempted request moves its "
    "later stale entries back (the spec's _move_back) onto the table it gave up, whose blocks "
    "may be another request's by then; its commits move a running request's later entries "
    "back only (docs/proofs.md, 'Every size')"
)
"""The one combination the row of ``twins.py`` cannot say (it follows each feature alone)."""


def refusal(config: Config) -> twins.NotFollowed | None:
    """What the parametric model does not follow of ``config``: its row of the table decides,
    then the combination it cannot state (drafts under async scheduling with stale output
    delivered)."""
    problem = twins.refusal(FORM, config)
    late = config.stale_output == "deliver"
    if problem is None and config.spec_tokens and config.async_scheduling and late:
        return twins.NotFollowed(FORM, "spec_tokens", ASYNC_DRAFTS)
    return problem


def admit(config: Config) -> None:
    """Raise ``twins.NotFollowed`` for what the parametric model does not follow of ``config``."""
    problem = refusal(config)
    if problem is not None:
        raise problem


def admit_decision(decision: tuple[Any, ...]) -> None:
    """Raise ``twins.NotFollowed`` for a decision the parametric model has no action for: a
    reset preempting running requests (``("reset", True)``)."""
    if decision[0] == "reset" and decision[1:]:
        raise twins.refused(FORM, "reset_running")


SAFE_POLICIES = tuple(name for name in POLICIES if twins.follows(FORM, Config(4, 1, policy=name)))
"""The policies whose traits the parametric model follows: the ones it proves for every size,
synchronous or async, stale output dropped or delivered (both refine its commit-time publish,
``parametric.py``)."""

QUERY_TIMEOUT_MS = 60_000


@dataclass
class Obligation:
    action: str
    conjunct: str
    verdict: str
    """``unsat`` (discharged), ``sat`` (a CTI) or ``unknown``."""
    seconds: float
    model: str | None = None


@dataclass
class AllSizesResult:
    verdict: str
    """``proved``, ``cti`` or ``unknown``."""
    obligations: list[Obligation] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> Obligation | None:
        return next((o for o in self.obligations if o.verdict != "unsat"), None)


class _Asker:
    """One solver holding an obligation group's hypotheses (the axioms, the invariant of the
    pre-state and one action's guard), asked each goal of the group in a push/pop scope: the
    hypotheses are stated to Z3 once per action, not once per conjunct."""

    def __init__(self, hyps: list[Any], timeout_ms: int) -> None:
        self.solver = z3.Solver()
        self.solver.set("timeout", timeout_ms)
        self.solver.add(*hyps)

    def ask(self, goal: Any) -> tuple[str, str | None]:
        """``unsat`` when the hypotheses imply ``goal``; ``sat`` with the solver's model (a
        counterexample), else ``unknown`` with its reason."""
        solver = self.solver
        solver.push()
        try:
            solver.add(z3.Not(goal))
            answer = solver.check()
            if answer == z3.sat:
                return "sat", str(solver.model())[:4000]
            return ("unsat", None) if answer == z3.unsat else ("unknown", solver.reason_unknown())
        finally:
            solver.pop()


def fresh_holders(model: pm.Model, t: pm.Transition, s: pm.PState) -> Any:
    """The schedule's new table blocks had no holder r (so the refcount's +1 is a new holder)."""
    v = model.v
    hit, alloc, r = t.params["hit"], t.params["alloc"], t.params["r"]
    return model.fa([v.Blk], lambda b: z3.Implies(z3.Or(hit(b), alloc(b)), z3.Not(s.ref(r, b))))


def prove(
    planted: str | None = None, stop_at_first: bool = True, timeout_ms: int = QUERY_TIMEOUT_MS
) -> AllSizesResult:
    """Discharge every obligation (each query limited to ``timeout_ms``); stop at the first
    that is not unsat (``stop_at_first``)."""
    began = time.perf_counter()
    v = pm.Vocab()
    model = pm.Model(v, planted=planted)
    axioms = v.axioms()
    result = AllSizesResult("proved")

    def record(action: str, conjunct: str, asker: _Asker, goal: Any) -> bool:
        t0 = time.perf_counter()
        verdict, info = asker.ask(goal)
        result.obligations.append(
            pm_obligation(action, conjunct, verdict, time.perf_counter() - t0, info)
        )
        return verdict == "unsat"

    init = pm.initial_state(v)
    asker = _Asker([axioms], timeout_ms)
    for name, term in model.invariant(init).items():
        if not record("initial", name, asker, term) and stop_at_first:
            return _finish(result, began)
    pre = pm.symbolic_state(v, "S")
    inv_pre = list(model.invariant(pre).values())
    for action in pm.Model.ACTIONS:
        t = model.transition(action, pre)
        asker = _Asker([axioms, *inv_pre, t.guard], timeout_ms)
        goals = model.invariant(t.post)
        if action == "schedule":
            goals = {**goals, "FreshHolders": fresh_holders(model, t, pre)}
        for name, term in goals.items():
            if not record(action, name, asker, term) and stop_at_first:
                return _finish(result, began)
    return _finish(result, began)


def pm_obligation(
    action: str, conjunct: str, verdict: str, seconds: float, info: str | None
) -> Obligation:
    return Obligation(action, conjunct, verdict, seconds, info)


def _finish(result: AllSizesResult, began: float) -> AllSizesResult:
    failed = result.failed
    if failed is not None:
        result.verdict = "cti" if failed.verdict == "sat" else "unknown"
    result.seconds = time.perf_counter() - began
    return result


def find_cti(
    action: str, conjunct: str, planted: str | None = None, reqs: int = 2, blks: int = 2
) -> str | None:
    """A counterexample to induction of one obligation at small sizes (``reqs`` requests,
    ``blks`` blocks, step ids 0..3, at most 3 tokens computed before the step), quantifier-free, so that Z3 answers ``sat`` with a state
    where the unbounded query may only say ``unknown``: the pre-state and the parameters, as
    text, or None when there is none at those sizes."""
    v = pm.Vocab(reqs, blks, range(4))
    model = pm.Model(v, planted=planted)
    pre = pm.symbolic_state(v, "S")
    axioms = z3.And([v.hlen(v.hk(q, i)) == i for q in v.req for i in range(-1, 8)])
    frame = [0 <= pre.lo, pre.lo <= pre.hi, pre.hi <= 3]
    frame += [z3.And(0 <= pre.comp(q), pre.comp(q) <= 3) for q in v.req]
    frame += [z3.And(0 <= pre.hw(b), pre.hw(b) <= 3) for b in v.blk]
    frame += [z3.And(0 <= pre.shw(q, b), pre.shw(q, b) <= 3) for q in v.req for b in v.blk]
    if action == "initial":
        state, guard, goal_of = pm.initial_state(v), z3.BoolVal(True), model.invariant
        hyps: list[Any] = [axioms]
    else:
        t = model.transition(action, pre)
        state, guard, goal_of = t.post, t.guard, model.invariant
        hyps = [axioms, *frame, *model.invariant(pre).values(), guard]
        if "t" in t.params:
            hyps.append(z3.And(0 <= t.params["t"], t.params["t"] <= 3))
        if "n" in t.params:  # positions stay where the hashes' lengths are stated
            hyps.append(z3.And(t.params["n"] <= 3, t.params["h"] <= 3))
    goals = goal_of(state)
    if conjunct not in goals:
        return None
    solver = z3.Solver()
    solver.set("timeout", QUERY_TIMEOUT_MS)
    solver.add(*hyps, z3.Not(goals[conjunct]))
    answer = solver.check()
    if answer != z3.sat:
        return None if answer == z3.unsat else f"undecided: {solver.reason_unknown()}"
    m = solver.model()
    shown = []
    for name in ("status", "comp"):
        shown.append(
            f"{name}: " + ", ".join(f"{q}={m.eval(getattr(pre, name)(q), True)}" for q in v.req)
        )
    for name in ("tab", "pos", "ref", "stab", "spos"):
        cells = [f"{q}/{b}={m.eval(getattr(pre, name)(q, b), True)}" for q in v.req for b in v.blk]
        shown.append(f"{name}: " + ", ".join(cells))
    for name in ("free", "pub", "wv", "hw"):
        shown.append(
            f"{name}: " + ", ".join(f"{b}={m.eval(getattr(pre, name)(b), True)}" for b in v.blk)
        )
    shown.append(f"steps in flight: {m.eval(pre.lo, True)}..{m.eval(pre.hi, True)} (exclusive)")
    return "; ".join(shown)


def describe(result: AllSizesResult) -> str:
    asked = len(result.obligations)
    slowest = max(result.obligations, key=lambda o: o.seconds, default=None)
    text = f"{asked} obligations discharged by Z3 in {result.seconds:.1f} s"
    if slowest is not None:
        text += f" (slowest: {slowest.action} / {slowest.conjunct}, {slowest.seconds:.2f} s)"
    return text


def run_all_sizes(
    policy: str,
    discipline: str = "vllm",
    preemption: str = "fcfs",
    *,
    async_scheduling: bool = False,
    stale_output: str = "drop",
    spec_tokens: int = 0,
    out: str | None = None,
    timeout_s: float = 120.0,
) -> int:
    """``kvspec prove --all-sizes``: 0 proved for every size, 1 a counterexample (an unsafe
    cell: the parametric eager model's counterexample to induction, then the shortest real
    counterexample at the smallest sizes, from the bounded model, confirmed by the spec and
    the reference engine), 3 not decided for every size (printed why)."""
    cell = f"{policy}, {discipline}/{preemption}" + (", async" if async_scheduling else "")
    cell += ", stale output delivered" if stale_output == "deliver" else ""
    cell += f", up to {spec_tokens} draft tokens" if spec_tokens else ""
    config = Config(
        4,
        1,
        depth=2 if async_scheduling or stale_output != "drop" else 1,
        policy=policy,
        discipline=discipline,
        preemption=preemption,
        async_scheduling=async_scheduling,
        stale_output=stale_output,
        spec_tokens=spec_tokens,
    )
    problem = refusal(config)
    if problem is not None and problem.what in twins.FEATURES:
        print(
            f"NOT PROVED FOR EVERY SIZE ({cell}): {problem}; docs/proofs.md, 'Every size'. "
            "Per-size results: kvspec prove without --all-sizes."
        )
        return 3
    if problem is None:
        result = prove()
        if result.verdict == "proved":
            invariant = pm.Model(pm.Vocab()).invariant(pm.symbolic_state(pm.Vocab(), "S"))
            lemmas = [n for n in invariant if n not in pm.SAFETY]
            print(
                f"PROVED FOR EVERY SIZE ({cell}; the proof covers both disciplines and both "
                f"preemption orders): {', '.join(pm.SAFETY)} hold in every reachable state, "
                "for any number of blocks, requests, tokens and steps in flight, and any block "
                "size."
            )
            print(f"inductive invariant: the five and {len(lemmas)} lemmas ({', '.join(lemmas)})")
            print(describe(result))
            print(
                "fragment: any block size (a block of B positions as B slots taken, freed and "
                "published together, held ahead of computation), synchronous or async "
                "scheduling, stale output dropped or delivered (one proof covers all of them), "
                "external loads (async and sync) and load failures (the last token's block too), draft "
                "tokens (rejected ones rolled back; under async scheduling, the later entries "
                "moved back; with stale output dropped), prefix caching on; the model "
                "over-approximates "
                "the scheduler (any admission, preemption, lookup hit, allocation, finish); its "
                "agreement with the spec: tests/test_parametric_twin.py"
            )
            return 0
        failed = result.failed
        assert failed is not None
        print(
            f"NOT PROVED FOR EVERY SIZE ({cell}): obligation {failed.action} / "
            f"{failed.conjunct} answered {failed.verdict}."
        )
        return 3
    result = prove(planted="eager-publish")
    failed = result.failed
    print(
        f"NOT INDUCTIVE ({cell}): the parametric model with publication at schedule time "
        + (
            f"fails obligation {failed.action} / {failed.conjunct} ({failed.verdict})."
            if failed is not None
            else "proved (unexpected)."
        )
    )
    if failed is not None:
        cti = find_cti(failed.action, failed.conjunct, "eager-publish")
        if cti is not None:
            print(f"counterexample to induction at 2 requests, 2 blocks: {cti}")
    print("the shortest real counterexample, at the smallest sizes (bounded model checking):")
    sys.stdout.flush()
    from .prove import run_prove

    code = run_prove(policy, discipline, preemption, out=out, timeout_s=timeout_s)
    if code == 1:
        return 1
    print(
        f"NOT DECIDED FOR EVERY SIZE ({cell}): no counterexample at the smallest sizes, and "
        f"nothing is claimed past those sizes: {problem}."
    )
    return 3
