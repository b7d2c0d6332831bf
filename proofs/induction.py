"""Inductive proofs of the invariants for paths of any length, at fixed sizes (issue #3).

The claim for a cell (policy, discipline, preemption) and a fragment's sizes: every state reachable
from the initial state, by any number of decisions, satisfies every invariant of
``invariants.py``. The method is plain induction on an inductive strengthening: let I be the
conjunction of the ten invariants' Z3 forms and the lemmas of ``kvspec.proofs.lemmas`` stated for the
policy. Then

* **base**: the initial state satisfies I (evaluated directly: it is concrete);
* **step**: for every action instance, I(S) and the instance's guard imply I(successor), for a
  fully symbolic pre-state S and symbolic parameters (any prompt tokens, priorities, sampled
  tokens, token counts). ``unsat`` of "guard and not I(successor)" is the proof, ``sat`` a
  *counterexample to induction* (CTI): a state satisfying I that steps out of it.

A CTI is not a bug report: its pre-state may be unreachable, and then a lemma is missing. This is
why ``kvspec prove`` runs bounded model checking after a failed induction: the shortest real
counterexample, or a bounded proof. A solver ``unknown`` is never a proof.

**How the step is checked.** The work is split into *obligations*, one per action instance and case
(``Model.cases``: execute gets two cases, its reads good or bad, and commit one per scheduling
order of its step; an instance's cases' guards together cover its guard), in a fixed canonical
order. Each obligation asks whether the successor can break any conjunct of I that the step can
change: first one query for all of them on a one-shot solver that preprocesses
(``one_shot_solver``), or for commit past the default sizes (``ASKED_ALONE``) one such query per
conjunct, some part by part (``ASKED_BY_PARTS``); from the first conjunct not shown unsat on, one
query per conjunct, in order, pushed and popped over a solver that holds I(S) once (a worker
keeps that solver for all its obligations of the cell). A conjunct is not rebuilt for the
successor unless it reads a variable the step changed (its read set is traced once on the
pre-state), and it is skipped when its term is literally the pre-state's (then the step leaves
what it reads alone). Obligations run in parallel processes (``parallel.Pool``); the verdict is
that of the first obligation in canonical order that is not unsat, so it does not depend on the
number of workers or their timing, and the CTI is then recomputed alone in a fresh process, so
that its values do not either.

Sizes are fixed (N, R, D, T, B of the fragment): the proof is unbounded in path length, not in the
sizes. ``bench/bench_prove.py`` runs it over a range of sizes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import z3

from . import lemmas as lm
from . import symbolic as sy
from .parallel import Pool

SOLVER_PARAMS: dict[str, Any] = {"arith.solver": 2}
"""Z3 settings of every proof solver, the bounded model checker's included (``prove.Unroller``):
the older arithmetic solver (``arith.solver=2``) decides this model's linear integer queries
faster than the default (bench_prove.py)."""


PREPROCESS = ("simplify", "propagate-values", "solve-eqs", "elim-uncnstr")
"""Z3 tactics run before the search in a one-shot solver (``one_shot_solver``): they substitute
away the variables that equations define (the successor's, the unrolled states'), which Z3's
incremental solver keeps (after a ``push`` it skips this preprocessing)."""


def new_solver() -> Any:
    """An incremental solver (push/pop) with ``SOLVER_PARAMS``."""
    solver = z3.Solver()
    solver.set(**SOLVER_PARAMS)
    return solver


def one_shot_solver(timeout_s: float | None = None) -> Any:
    """A solver for one query: ``PREPROCESS``, then Z3's SMT core with ``SOLVER_PARAMS``.
    Each ``check`` preprocesses all its assertions again, so it suits one check per solver;
    verdicts are those of ``new_solver`` (a model may differ)."""
    tactic = z3.Then(*PREPROCESS, z3.With("smt", **SOLVER_PARAMS))
    solver = tactic.solver()
    if timeout_s is not None:
        solver.set("timeout", max(1, int(timeout_s * 1000)))
    return solver


@dataclass
class Cti:
    """A counterexample to induction: an instance that leaves the strengthening."""

    instance: sy.Instance
    broken: list[str]
    """The conjuncts (invariants or lemmas) false after the step."""
    pre: dict[str, str]
    """The pre-state's non-default variables, for a reader."""
    case: sy.Case = ()
    """The case of the instance (``Model.cases``) the step was checked in."""


ASKED_ALONE: dict[str, int] = {"commit": 17}
"""Per action, the model size (``model_size``) from which its obligations ask each changed
conjunct on its own one-shot solver, in order, with no query for all of them
(``Prover.check``; actions not named always ask the one query first). Commit's one query
grows far faster with the sizes than its parts and loses at every size measured past the
defaults (model size 16); at the defaults, over all cells, it is the faster (figures:
docs/proofs.md, "Commit's conjuncts asked alone")."""


def model_size(model: sy.Model) -> int:
    """Blocks (the null block counted) x requests x step slots: 16 at the default sizes."""
    return model.config.num_blocks * len(model.R) * model.D


def asks_alone(model: sy.Model, action: str) -> bool:
    """Whether the action's obligations ask their changed conjuncts alone (``ASKED_ALONE``)."""
    least = ASKED_ALONE.get(action)
    return least is not None and model_size(model) >= least


ASKED_BY_PARTS: dict[str, frozenset[str]] = {
    "commit": frozenset({"FreeQueueExact", "DeadEntriesReadWell", "NoUnwrittenPublish"})
}
"""Per action, the conjuncts asked part by part when it asks them alone (``ASKED_ALONE``): one
one-shot query per part of the conjunct's top-level ``And`` (the conjunct is unsat exactly when
every part is). Each is a conjunction over blocks or entries whose parts share nothing the
solver needs to see at once, and under commit past the default sizes its parts cost less than
it does whole; splitting every conjunct costs more, a query having a fixed cost (figures:
docs/proofs.md, "Commit's conjuncts asked alone")."""

ALL = "(all changed)"
"""The conjunct name of an obligation's first query, which asks all the changed conjuncts at
once (``Prover.check``)."""


@dataclass
class QueryTime:
    """One solver query of the step: which instance, case and conjunct, its answer, its time."""

    instance: str
    case: str
    conjunct: str
    answer: str
    seconds: float
    cpu: float
    """CPU seconds of the worker (on a loaded machine, wall ``seconds`` can be far more)."""


@dataclass
class InductionResult:
    verdict: str
    """``inductive``, ``cti``, ``base-fails`` or ``unknown``."""
    fragment: sy.Fragment
    invariants: list[str]
    lemmas: list[str]
    instances: int = 0
    """Instances checked, up to and including the one that decided a failure."""
    cti: Cti | None = None
    seconds: float = 0.0
    """Wall time from the start to the verdict."""
    per_instance: list[tuple[str, str, float]] = field(default_factory=list)
    """Per instance checked: its name, its answer, and the solver time of its queries."""
    queries: list[QueryTime] = field(default_factory=list)
    """Every query of the obligations checked (in canonical order), for profiling."""
    obligations: int = 0
    """Obligations (instance, case) checked."""
    work_seconds: float = 0.0
    """Time the workers spent on this cell's obligations (build and solve), all workers added."""
    work_cpu: float = 0.0
    """CPU seconds of the same."""
    build_cpu: float = 0.0
    """Of which building the successors' terms (Python)."""
    workers: int = 1


# -- the strengthening ---------------------------------------------------------------------------


def conjuncts(model: sy.Model) -> dict[str, Callable[[sy.SState], Any]]:
    """The invariants and the policy's lemmas, each as a builder of its predicate on a state."""
    out: dict[str, Callable[[sy.SState], Any]] = {}
    for name, fn in sy.Z3_INVARIANTS.items():
        out[name] = functools.partial(fn, model)
    for lem in lm.LEMMAS:
        if lem.applies_to(model):
            out[lem.name] = functools.partial(lem.predicate, model)
    return out


def strengthening(model: sy.Model, S: sy.SState) -> dict[str, Any]:
    """The invariants and the policy's lemmas as named predicates on S."""
    return {name: build(S) for name, build in conjuncts(model).items()}


class _Reads(dict[Any, Any]):
    """A state that records which variables are read."""

    def __init__(self, S: sy.SState) -> None:
        super().__init__(S)
        self.seen: set[sy.SKey] = set()

    def __getitem__(self, key: sy.SKey) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)


def read_sets(
    builders: dict[str, Callable[[sy.SState], Any]], S: sy.SState
) -> tuple[dict[str, Any], dict[str, frozenset[sy.SKey]]]:
    """Each conjunct's predicate on the symbolic state S, and the variables it reads (on a
    state of variables every branch on a term's value reads the most, so the set covers the
    successor's reads too)."""
    terms, reads = {}, {}
    for name, build in builders.items():
        traced = _Reads(S)
        terms[name] = build(traced)
        reads[name] = frozenset(traced.seen)
    return terms, reads


# -- obligations (run in the workers) ------------------------------------------------------------


def obligations(model: sy.Model) -> list[tuple[int, int]]:
    """(instance index, case index) in canonical order."""
    return [(i, c) for i, inst in enumerate(model.instances) for c in range(len(model.cases(inst)))]


def case_name(case: sy.Case) -> str:
    return " ".join(
        f"{point[0]}={choice if isinstance(choice, str) else ','.join(map(str, choice))}"
        for point, choice in case
    )


class Prover:
    """One cell's strengthening over a symbolic pre-state, asserted once in a solver."""

    def __init__(self, fragment: sy.Fragment) -> None:
        self.model = m = sy.Model(fragment)
        self.S = m.fresh("pre")
        self.builders = conjuncts(m)
        self.pre, self.reads = read_sets(self.builders, self.S)
        self.solver = new_solver()
        self.solver.add(*self.pre.values())

    def step(self, i: int, c: int) -> tuple[Any, sy.SState, set[sy.SKey]]:
        m = self.model
        inst = m.instances[i]
        params = m.fresh_params(inst, f"p{i}")
        guard, succ = m.apply(inst, self.S, params, m.cases(inst)[c])
        changed = {key for key, _ in m.schema if succ[key] is not self.S[key]}
        return guard, succ, changed

    def changed_conjuncts(self, succ: sy.SState, changed: set[sy.SKey]) -> list[tuple[str, Any]]:
        """The conjuncts on the successor that the step may have changed, in order."""
        out = []
        for name, build in self.builders.items():
            if not self.reads[name] & changed:
                continue  # reads nothing the step changed: the very term of the pre-state
            cond = build(succ)
            if not cond.eq(self.pre[name]):
                out.append((name, cond))
        return out

    def check(
        self, i: int, c: int, deadline: float | None, combined: bool = True
    ) -> dict[str, Any]:
        """Check one obligation: its answer (``unsat`` proves it), the conjunct that is not
        unsat if any, and the time of every query. ``combined`` asks all the changed conjuncts
        in one query first (``combined=False``, one query per conjunct only, is what the tests
        compare it with)."""
        started, cpu = time.monotonic(), time.process_time()
        inst = self.model.instances[i]
        where = (_name(inst), case_name(self.model.cases(inst)[c]))
        answer, failing = "unsat", None
        times: list[QueryTime] = []
        guard, succ, changed = self.step(i, c)
        todo = self.changed_conjuncts(succ, changed)
        built = time.process_time() - cpu
        if todo and combined:
            # unsat of the one query for all the conjuncts the step may change proves the
            # obligation; an action that asks them alone (``ASKED_ALONE``) asks each on its own one-shot
            # solver instead, in order. From the first conjunct not shown unsat on, the
            # incremental solver below asks them one by one (the same answer and failing
            # conjunct as asking them all one by one there).
            if asks_alone(self.model, inst[0]):
                todo = todo[self._alone(inst[0], guard, todo, where, times, deadline) :]
            else:
                left = None if deadline is None else deadline - time.monotonic()
                if left is None or left > 0:
                    goal = z3.Or([z3.Not(c) for _, c in todo])
                    verdict = self._one_shot(guard, goal, left)
                    times.append(QueryTime(*where, ALL, str(verdict[0]), *verdict[1:]))
                    if verdict[0] == z3.unsat:
                        todo = []
        solver = self.solver
        solver.push()
        solver.add(guard)
        for name, cond in todo:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    answer, failing = "unknown", name
                    break
                solver.set("timeout", max(1, int(left * 1000)))
            solver.push()
            solver.add(z3.Not(cond))
            t0, c0 = time.monotonic(), time.process_time()
            verdict = solver.check()
            t1, c1 = time.monotonic(), time.process_time()
            times.append(QueryTime(*where, name, str(verdict), t1 - t0, c1 - c0))
            solver.pop()
            if verdict != z3.unsat:
                answer, failing = str(verdict), name
                break
        solver.pop()
        if deadline is not None:
            solver.set("timeout", 0)
        return {
            "answer": answer,
            "failing": failing,
            "queries": times,
            "seconds": time.monotonic() - started,
            "cpu": time.process_time() - cpu,
            "build_cpu": built,
        }

    def _alone(
        self,
        action: str,
        guard: Any,
        todo: list[tuple[str, Any]],
        where: tuple[str, str],
        times: list[QueryTime],
        deadline: float | None,
    ) -> int:
        """Ask the conjuncts of ``todo`` in order, each on its own one-shot solver (by parts,
        ``ASKED_BY_PARTS``), and return how many of them came out unsat before the first that
        did not (or before the deadline)."""
        by_parts = ASKED_BY_PARTS.get(action, frozenset())
        for n, (name, cond) in enumerate(todo):
            parts = cond.children() if name in by_parts and z3.is_and(cond) else [cond]
            answer, seconds, cpu = "unsat", 0.0, 0.0
            for part in parts:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return n
                verdict = self._one_shot(guard, z3.Not(part), left)
                seconds, cpu = seconds + verdict[1], cpu + verdict[2]
                if verdict[0] != z3.unsat:
                    answer = str(verdict[0])
                    break
            times.append(QueryTime(*where, name, answer, seconds, cpu))
            if answer != "unsat":
                return n
        return len(todo)

    def _one_shot(self, guard: Any, goal: Any, timeout_s: float | None) -> tuple[Any, float, float]:
        """I(S), the guard and ``goal`` on a one-shot solver: the answer, wall and CPU seconds."""
        one = one_shot_solver(timeout_s)
        one.add(*self.pre.values())
        one.add(guard, goal)
        t0, c0 = time.monotonic(), time.process_time()
        verdict = one.check()
        return verdict, time.monotonic() - t0, time.process_time() - c0


_PROVERS: dict[sy.Fragment, Prover] = {}
"""A worker's provers, one per cell (a worker lives for one ``Pool``)."""


def check_obligation(
    fragment: sy.Fragment, i: int, c: int, deadline: float | None
) -> dict[str, Any]:
    """Pooled job: one obligation of a cell, on the worker's prover for that cell."""
    if deadline is not None and time.monotonic() >= deadline:
        return {"answer": "unknown", "failing": None, "queries": [], "seconds": 0.0, "cpu": 0.0}
    prover = _PROVERS.get(fragment)
    if prover is None:
        prover = _PROVERS[fragment] = Prover(fragment)
    return prover.check(i, c, deadline)


def base_case(fragment: sy.Fragment) -> list[str]:
    """Pooled job: the conjuncts false in the initial state (a concrete state)."""
    model = sy.Model(fragment)
    initial = strengthening(model, model.initial())
    return [n for n, c in initial.items() if not z3.is_true(z3.simplify(c))]


def counterexample_to_induction(
    fragment: sy.Fragment, i: int, c: int, conjunct: str, timeout_s: float | None
) -> Cti | None:
    """Fresh job: the CTI of obligation (i, c) breaking ``conjunct``, solved alone in a fresh
    solver (so its values are the same for any workers); None if Z3 gives no model."""
    prover = Prover(fragment)
    guard, succ, _ = prover.step(i, c)
    solver = new_solver()
    if timeout_s is not None:
        solver.set("timeout", max(1, int(timeout_s * 1000)))
    solver.add(*prover.pre.values())
    solver.add(guard, z3.Not(prover.builders[conjunct](succ)))
    if solver.check() != z3.sat:
        return None
    mz = solver.model()
    post = strengthening(prover.model, succ)
    broken = [n for n, cond in post.items() if z3.is_false(mz.eval(cond, True))]
    inst = prover.model.instances[i]
    return Cti(
        inst, broken, _describe_state(prover.model, prover.S, mz), prover.model.cases(inst)[c]
    )


# -- one cell's induction, driven from the caller ------------------------------------------------


class CellInduction:
    """The obligations of one cell and the verdict they give, for a ``Pool`` shared by cells.

    ``submit`` queues the base case and the obligations; ``take`` records a finished job (and
    queues the CTI's fresh job, or cancels obligations past a failure); ``done`` says whether the
    verdict is known; ``result`` gives it."""

    def __init__(
        self, fragment: sy.Fragment, tag: Any, timeout_s: float | None, workers: int
    ) -> None:
        self.fragment, self.tag, self.timeout_s = fragment, tag, timeout_s
        self.model = sy.Model(fragment)  # no Z3 terms: instances and cases only
        self.order = obligations(self.model)
        self.index = {ob: n for n, ob in enumerate(self.order)}
        self.answers: dict[int, dict[str, Any]] = {}
        self.base: list[str] | None = None
        self.cti: Cti | None = None
        self.cti_pending = False
        self.started = time.monotonic()
        self.finished: float | None = None
        self.deadline = None if timeout_s is None else self.started + timeout_s
        self.workers = workers
        self._cti_asked = False

    def submit(self, pool: Pool, rank: Any = 0) -> None:
        pool.submit((self.tag, "base"), base_case, self.fragment, priority=(rank, -1))
        for n, (i, c) in enumerate(self.order):
            pool.submit(
                (self.tag, "ob", n),
                check_obligation,
                self.fragment,
                i,
                c,
                self.deadline,
                priority=(rank, n),
            )

    def owns(self, key: Any) -> bool:
        return isinstance(key, tuple) and key[0] == self.tag

    def take(self, pool: Pool, key: Any, value: Any) -> None:
        kind = key[1]
        if kind == "base":
            self.base = value
            if value:
                pool.cancel(lambda k: self.owns(k) and k[1] == "ob")
        elif kind == "ob":
            self.answers[key[2]] = value
            if value["answer"] != "unsat":
                n = key[2]
                pool.cancel(lambda k: self.owns(k) and k[1] == "ob" and k[2] > n)
        elif kind == "cti":
            self.cti, self.cti_pending = value, False
        first = self._first_failure()
        if first is not None and self.base == [] and not self.cti_pending and self.cti is None:
            answer = self.answers[first]
            if answer["answer"] == "sat" and not self._cti_asked:
                self._cti_asked = True
                self.cti_pending = True
                i, c = self.order[first]
                left = None if self.deadline is None else max(1.0, self.deadline - time.monotonic())
                pool.submit(
                    (self.tag, "cti"),
                    counterexample_to_induction,
                    self.fragment,
                    i,
                    c,
                    answer["failing"],
                    left,
                    priority=(-1, 0),
                    fresh=True,
                )
        if self.finished is None and self.done():
            self.finished = time.monotonic()

    def _first_failure(self) -> int | None:
        """The first obligation in canonical order that is not unsat, once all before it are
        in; None while undecided or if all are unsat."""
        for n in range(len(self.order)):
            answer = self.answers.get(n)
            if answer is None:
                return None
            if answer["answer"] != "unsat":
                return n
        return None

    def failed(self) -> bool:
        """Known not to be inductive (or unknown), even before the verdict is complete."""
        return bool(self.base) or any(a["answer"] != "unsat" for a in self.answers.values())

    def done(self) -> bool:
        if self.base is None:
            return False
        if self.base:
            return True
        first = self._first_failure()
        if first is None:
            return len(self.answers) == len(self.order)
        return not self.cti_pending and (self.answers[first]["answer"] != "sat" or self._cti_asked)

    def result(self) -> InductionResult:
        model = self.model
        names = list(conjunct_names(model))
        lemma_names = [n for n in names if n not in sy.Z3_INVARIANTS]
        out = InductionResult("inductive", self.fragment, list(sy.Z3_INVARIANTS), lemma_names)
        out.workers = self.workers
        out.seconds = (self.finished or time.monotonic()) - self.started
        if self.base:
            out.verdict = "base-fails"
            out.cti = Cti(("initial",), list(self.base), {})
            return out
        first = self._first_failure()
        last = len(self.order) - 1 if first is None else first
        per: dict[int, list[Any]] = {}
        for n in range(last + 1):
            answer = self.answers[n]
            i, _ = self.order[n]
            out.obligations += 1
            out.work_seconds += answer["seconds"]
            out.work_cpu += answer["cpu"]
            out.build_cpu += answer.get("build_cpu", 0.0)
            out.queries += answer["queries"]
            entry = per.setdefault(i, [answer["answer"], 0.0])
            if entry[0] == "unsat":
                entry[0] = answer["answer"]
            entry[1] += sum(q.seconds for q in answer["queries"])
        out.instances = len(per)
        out.per_instance = [(_name(model.instances[i]), a, s) for i, (a, s) in per.items()]
        if first is None:
            return out
        answer = self.answers[first]
        if answer["answer"] == "sat" and self.cti is not None:
            out.verdict = "cti"
            out.cti = self.cti
        else:
            out.verdict = "unknown"
        return out


def conjunct_names(model: sy.Model) -> list[str]:
    names = list(sy.Z3_INVARIANTS)
    names += [lem.name for lem in lm.LEMMAS if lem.applies_to(model)]
    return names


def run_cells(
    cells: list[CellInduction], pool: Pool, on_result: Callable[[Any, Any], None] | None = None
) -> None:
    """Run the cells' jobs (and any the callback submits) until the pool is empty; results of
    jobs no cell owns go to ``on_result``."""
    for key, value in pool.results():
        for cell in cells:
            if cell.owns(key):
                cell.take(pool, key, value)
                break
        else:
            if on_result is not None:
                on_result(key, value)


def prove_inductive(
    fragment: sy.Fragment, timeout_s: float | None = None, workers: int | None = None
) -> InductionResult:
    """Base case and one inductive step per action instance (and case), on ``workers``
    processes (default: the cores available; 0 runs in this process)."""
    with Pool(workers) as pool:
        cell = CellInduction(fragment, "cell", timeout_s, pool.slots)
        cell.submit(pool)
        run_cells([cell], pool)
    return cell.result()


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
