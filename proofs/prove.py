"""Bounded model checking of the symbolic model (``kvspec.proofs.symbolic``), and ``kvspec prove``.

``kvspec prove`` first tries an inductive proof (``induction.py``: every path length, at the
fragment's sizes); if the invariants and lemmas are not inductive for the cell, it runs bounded
model checking, described here, for the shortest counterexample or a bounded proof.

``bmc`` unrolls the Z3 transition relation from the initial state, one decision per step, and asks
at each depth k = 1, 2, ... whether some invariant can fail after exactly k decisions. Each depth's
question is one query on a fresh one-shot solver (``induction.one_shot_solver``: Z3's
preprocessing substitutes away the states' equations, which an incremental solver keeps; measured
faster, ``docs/proofs.md``). The first
depth that is satisfiable gives a *shortest* counterexample (in decisions, for these sizes): the
solver's path is turned into decision events (with the prompts, priorities and sampled tokens Z3
chose) and replayed through the executable spec, which must confirm it, state by state. If no
depth up to the bound is satisfiable, that is a *bounded* proof: no violation is reachable in <= K
decisions for these sizes; it says nothing about longer paths or larger sizes. A solver timeout is
"unknown", never "proved".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import z3

from kvspec.conformance.report import describe, format_counterexample
from kvspec.conformance.trace import write_events
from kvspec.conformance.witness import extend
from kvspec.judge import Finding
from kvspec.spec import Config, Illegal, apply, check, initial_state

from . import induction
from . import symbolic as sy
from .enact import EnactError, enact
from .parallel import Pool

Event = tuple[object, ...]

DEFAULTS = {"blocks": 4, "requests": 2, "depth": 2, "bound": 8, "block_size": 1, "tokens": 3}


ACTOR = {"arrive": "client", "abort": "client", "execute": "worker", "reset": "operator"}
"""Who takes each decision, as the heading of a counterexample's numbered step."""


class ModelSpecMismatch(AssertionError):
    """A counterexample of the symbolic model that the executable spec does not confirm."""


@dataclass
class BmcResult:
    verdict: str
    """``counterexample``, ``bounded-proof`` or ``unknown``."""
    fragment: sy.Fragment
    bound: int
    depth_reached: int
    """Deepest k fully checked (unsat) before the verdict."""
    decisions: list[Event] = field(default_factory=list)
    invariant: str | None = None
    message: str | None = None
    seconds: float = 0.0
    per_depth: list[tuple[int, str, float]] = field(default_factory=list)


class Unroller:
    """The transition relation unrolled step by step; ``solver`` holds the unrolling's
    assertions (an incremental solver with the proofs' settings, ``induction.SOLVER_PARAMS``,
    which ``bmc`` copies into a one-shot solver per depth)."""

    def __init__(self, model: sy.Model, timeout_s: float | None = None) -> None:
        self.model = m = model
        f = model.fragment
        self.solver = induction.new_solver()
        if timeout_s is not None:
            self.solver.set("timeout", max(1, int(timeout_s * 1000)))
        self.states = [m.initial()]
        self.selectors: list[Any] = []
        self.params: list[dict[sy.Instance, sy.Params]] = []
        # the workload: each request's prompt, max_tokens and priority, chosen by the solver
        self.workload: dict[int, sy.Params] = {}
        for r in m.R:
            w = m.fresh_params(("arrive", r), "w")
            self.workload[r] = w
            self.solver.add(w["plen"] >= 1, w["maxt"] >= 1, w["plen"] + w["maxt"] <= f.max_len)
            self.solver.add(w["prio"] >= 0, w["prio"] < f.priorities)
            for j in m.T:
                t = w["ptok"][j]
                self.solver.add(z3.If(w["plen"] > j, z3.And(t >= 1, t <= f.vocab), t == 0))

    def step(self) -> None:
        """Add one more decision."""
        m, t = self.model, len(self.selectors)
        f = m.fragment
        S = self.states[-1]
        sel = z3.Int(f"sel{t}")
        self.solver.add(sel >= 0, sel < len(m.instances))
        guards, succs, params = [], [], {}
        for i, inst in enumerate(m.instances):
            if inst[0] == "arrive":
                p = self.workload[inst[1]]
            else:
                p = m.fresh_params(inst, f"s{t}.{i}")
                if "n" in p:
                    self.solver.add(p["n"] >= 1, p["n"] <= f.max_len)
                for tok in p.get("smp", []):
                    self.solver.add(tok >= 1, tok <= f.vocab)
            params[inst] = p
            g, succ = m.apply(inst, S, p)
            guards.append(g)
            succs.append(succ)
            self.solver.add(z3.Implies(sel == i, g))
        nxt = m.fresh(f"x{t + 1}")
        for key, _ in m.schema:
            groups: dict[int, tuple[Any, list[int]]] = {}
            for i, succ in enumerate(succs):
                term = succ[key]
                groups.setdefault(term.get_id(), (term, []))[1].append(i)
            values = list(groups.values())
            value = values[-1][0]
            for term, members in reversed(values[:-1]):
                value = z3.If(sy.disj([sel == i for i in members]), term, value)
            self.solver.add(nxt[key] == value)
        self.states.append(nxt)
        self.selectors.append(sel)
        self.params.append(params)

    def violated(self, k: int) -> Any:
        return z3.Not(sy.conj(list(self.model.invariants(self.states[k]).values())))

    def decisions(self, mz: Any) -> list[Event]:
        """The path in the model ``mz`` as decision events."""
        m = self.model
        out: list[Event] = []

        def val(term: Any) -> int:
            return int(mz.eval(term, model_completion=True).as_long())

        for t, sel in enumerate(self.selectors):
            inst = m.instances[val(sel)]
            p = self.params[t][inst]
            kind = inst[0]
            S = self.states[t]
            if kind == "arrive":
                prompt = tuple(val(p["ptok"][j]) for j in range(val(p["plen"])))
                out.append(("arrive", inst[1], prompt, val(p["maxt"]), val(p["prio"])))
            elif kind in ("begin", "submit"):
                out.append((kind, val(p["sid"])))
            elif kind == "execute":
                out.append(("execute", val(p["sid"]), ()))
            elif kind == "schedule":
                out.append(("schedule", inst[1], val(p["n"]), 0))
            elif kind in ("preempt", "abort"):
                out.append((kind, inst[1]))
            elif kind == "commit":
                sampled = [
                    (val(S["eo", 0, r]), r, val(p["smp"][r]))
                    for r in m.R
                    if z3.is_true(mz.eval(p["has"][r], model_completion=True))
                ]
                out.append(
                    ("commit", val(p["sid"]), tuple((r, tok) for _, r, tok in sorted(sampled)))
                )
            else:
                out.append(("reset",))
        return out


def replay(
    model: sy.Model, decisions: list[Event], mz: Any = None, states: list[Any] | None = None
) -> tuple[list[tuple[str, list[Event]]], list[Event], Finding | None]:
    """Run decisions through the executable spec, checking every invariant after each; with a
    Z3 model and its states, also check that each spec state is the symbolic one. Returns the
    program (description, events), the event stream and the first finding."""
    s = initial_state(model.config)
    program: list[tuple[str, list[Event]]] = []
    events: list[Event] = []
    for t, decision in enumerate(decisions):
        try:
            effects = apply(s, decision)
        except Illegal as err:
            raise ModelSpecMismatch(
                f"decision {t + 1} {decision}: the spec refuses it: {err}"
            ) from None
        heading = describe(decision) if decision[0] == "arrive" else ACTOR.get(str(decision[0]))
        program.append((heading or "scheduler", [decision, *effects]))
        events += [decision, *effects]
        if mz is not None and states is not None:
            wrong = [
                name
                for name, cond in sy.same(model, states[t + 1], s)
                if not z3.is_true(mz.eval(cond, model_completion=True))
            ]
            if wrong:
                raise ModelSpecMismatch(
                    f"after decision {t + 1} {decision}: the symbolic state differs from the "
                    f"spec's on {', '.join(wrong[:6])}"
                )
        failure = check(s)
        if failure is not None:
            at = len(events) - 1 - len(effects)
            return program, events, Finding(failure.invariant, failure.sentence, at)
    return program, events, None


def bmc(
    fragment: sy.Fragment,
    max_depth: int,
    timeout_s: float | None = None,
    first: int = 1,
    progress: Callable[[int, str, float], None] | None = None,
) -> BmcResult:
    """Search depths first .. max_depth for a violation; confirm one by replaying it."""
    started = time.monotonic()
    model = sy.Model(fragment)
    un = Unroller(model, timeout_s)
    result = BmcResult("bounded-proof", fragment, max_depth, 0)
    for k in range(1, max_depth + 1):
        un.step()
        if k < first:
            continue
        t0 = time.monotonic()
        left = None
        if timeout_s is not None:
            left = timeout_s - (t0 - started)
            if left <= 0:
                result.verdict = "unknown"
                break
        # each depth is one query, on a one-shot solver that preprocesses the unrolling (the
        # equations of the states substituted away) before the search
        solver = induction.one_shot_solver(left)
        solver.add(*un.solver.assertions())
        solver.add(un.violated(k))
        answer = solver.check()
        result.per_depth.append((k, str(answer), time.monotonic() - t0))
        if progress is not None:
            progress(*result.per_depth[-1])
        if answer == z3.sat:
            mz = solver.model()
            decisions = un.decisions(mz)
            _, _, finding = replay(model, decisions, mz, un.states)
            if finding is None:
                raise ModelSpecMismatch(
                    f"Z3 found a violation after {k} decisions that the spec does not confirm: "
                    f"{decisions}"
                )
            result.verdict, result.decisions = "counterexample", decisions
            result.invariant, result.message = finding.invariant, finding.message
            break
        if answer == z3.unknown:
            result.verdict = "unknown"
            break
        result.depth_reached = k
    result.seconds = time.monotonic() - started
    return result


def make_fragment(
    policy: str,
    discipline: str,
    preemption: str,
    blocks: int,
    requests: int,
    depth: int,
    block_size: int = 1,
    tokens: int = 4,
    async_scheduling: bool = False,
    stale_output: str = "drop",
) -> sy.Fragment:
    """The fragment for a cell; raises ValueError on bad arguments (async scheduling or
    delivered stale output at depth 1, where they mean nothing, included)."""
    if depth < 2 and (async_scheduling or stale_output == "deliver"):
        raise ValueError("async scheduling and stale output deliver need depth >= 2")
    config = Config(
        num_blocks=blocks,
        block_size=block_size,
        depth=depth,
        policy=policy,
        discipline=discipline,
        preemption=preemption,
        token_budget=tokens * requests,
        max_running=requests,
        async_scheduling=async_scheduling,
        stale_output=stale_output,
    )
    return sy.Fragment(config, requests=requests, max_len=tokens)


def run_prove(
    policy: str,
    discipline: str = "vllm",
    preemption: str = "fcfs",
    blocks: int = DEFAULTS["blocks"],
    requests: int = DEFAULTS["requests"],
    depth: int = DEFAULTS["depth"],
    bound: int = DEFAULTS["bound"],
    out: str | Path | None = None,
    timeout_s: float = 120.0,
    *,
    block_size: int = DEFAULTS["block_size"],
    tokens: int = DEFAULTS["tokens"],
    method: str = "auto",
    async_scheduling: bool = False,
    stale_output: str = "drop",
) -> int:
    """``kvspec prove``: 0 proof (inductive, or bounded when induction fails), 1 counterexample
    (printed; events written to ``out``), 2 bad arguments, 3 unknown (solver timeout).
    ``method``: ``auto`` tries induction first, ``bmc`` only bounded model checking."""
    try:
        if not 1 <= bound <= 40:
            raise ValueError(f"bound must be 1..40, got {bound}")
        if method not in ("auto", "bmc"):
            raise ValueError(f"method must be auto or bmc, got {method!r}")
        fragment = make_fragment(
            policy,
            discipline,
            preemption,
            blocks,
            requests,
            depth,
            block_size,
            tokens,
            async_scheduling,
            stale_output,
        )
    except ValueError as err:
        sys.stderr.write(f"kvspec prove: error: {err}\n")
        return 2
    outcome = prove_cell(fragment, bound, timeout_s, method)
    cell = f"{policy}, {discipline}/{preemption}"
    cell += ", async" if async_scheduling else ""
    cell += ", stale output delivered" if stale_output == "deliver" else ""
    where = f"fragment: {fragment.describe()}"
    if outcome.verdict == "proved":
        assert outcome.induction is not None
        print(f"PROVED ({cell}): {induction.describe(outcome.induction)}")
        print(where + "; the proof leaves prompt tokens, priorities and samples unconstrained")
        print(
            "Unbounded in path length, bounded in size: larger pools, more requests or "
            "deeper pipelines are other models (bench/bench_prove.py covers a range)."
        )
        return 0
    result = outcome.bmc
    assert result is not None
    if result.verdict == "bounded-proof":
        print(
            f"BOUNDED PROOF ({cell}): no invariant violation is reachable from the initial state "
            f"in <= {bound} decisions, checked by Z3 bounded model checking in "
            f"{result.seconds:.1f} s."
        )
        print(where)
        print(
            "This is a bounded result (every path up to the bound, for these sizes), not an "
            f"inductive proof: longer paths and larger sizes are not covered; "
            f"{outcome.why_not_inductive}"
        )
        return 0
    if result.verdict == "unknown":
        print(
            f"UNKNOWN ({cell}): the solver gave no answer within {timeout_s:.0f} s; no "
            f"violation in <= {result.depth_reached} decisions (bounded), nothing claimed beyond."
        )
        print(where)
        return 3
    model = sy.Model(fragment)
    program, events, finding = replay(model, result.decisions)
    assert finding is not None
    print(
        f"COUNTEREXAMPLE ({cell}): {finding.invariant} fails after {len(result.decisions)} "
        f"decisions, the shortest for these sizes (Z3 bounded model checking, "
        f"{result.seconds:.1f} s); the executable spec confirms it."
    )
    print(where)
    print(format_counterexample(program, finding, fragment.config))
    print(outcome.engine)
    if out is not None:
        shown = extend(fragment.config, events, finding.invariant, finding.event)
        n = write_events(out, fragment.config, shown.events)
        print(f"wrote {n} events to {out}" + (f"; {shown.note}" if shown.note else ""))
    return 1


@dataclass
class ProveOutcome:
    """What ``kvspec prove`` found for one cell."""

    verdict: str
    """``proved`` (inductive), ``counterexample``, ``bounded-proof`` or ``unknown``."""
    induction: induction.InductionResult | None
    bmc: BmcResult | None
    why_not_inductive: str
    engine: str = ""
    """For a counterexample: what the reference engine did when forced through it."""
    engine_confirms: bool = False

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in (self.induction, self.bmc) if r is not None)

    @property
    def work_seconds(self) -> float:
        """Time the workers spent on this cell: its obligations, and the bounded model
        checking (in a multi-cell run, ``seconds`` includes waiting for other cells' jobs)."""
        ind = self.induction.work_seconds if self.induction is not None else 0.0
        return ind + (self.bmc.seconds if self.bmc is not None else 0.0)


def prove_cell(
    fragment: sy.Fragment,
    bound: int,
    timeout_s: float | None,
    method: str = "auto",
    workers: int | None = None,
) -> ProveOutcome:
    """Induction first (``auto``), then bounded model checking if the cell is not proved; a
    counterexample is confirmed by the executable spec (``bmc``) and enacted on the engine."""
    return prove_cells([fragment], bound, timeout_s, method, workers)[0]


def prove_cells(
    fragments: list[sy.Fragment],
    bound: int,
    timeout_s: float | None,
    method: str = "auto",
    workers: int | None = None,
) -> list[ProveOutcome]:
    """``prove_cell`` for several cells on one pool of ``workers`` processes (default: the
    cores available): every cell's obligations are queued in cell order, and a cell's bounded
    model checking starts, ahead of the queue, as soon as one of its obligations fails. Each
    cell's timeout counts from the start."""
    inductions: list[induction.CellInduction] = []
    bmcs: dict[int, BmcResult] = {}
    with Pool(workers) as pool:

        def start_bmc(n: int) -> None:
            bmcs[n] = None  # type: ignore[assignment]
            pool.submit(
                ("bmc", n), bmc, fragments[n], bound, timeout_s, priority=(-1, n), fresh=True
            )

        if method == "auto":
            for n, fragment in enumerate(fragments):
                cell = induction.CellInduction(fragment, ("ind", n), timeout_s, pool.slots)
                cell.submit(pool, rank=n)
                inductions.append(cell)
        else:
            for n in range(len(fragments)):
                start_bmc(n)
        for key, value in pool.results():
            if key[0] == "bmc":
                bmcs[key[1]] = value
                continue
            n = key[0][1]
            cell = inductions[n]
            cell.take(pool, key, value)
            if n not in bmcs and cell.failed():
                start_bmc(n)
    outcomes = []
    for n, fragment in enumerate(fragments):
        ind = inductions[n].result() if inductions else None
        if ind is not None and ind.verdict == "inductive":
            outcomes.append(ProveOutcome("proved", ind, None, ""))
            continue
        why = induction.describe(ind) if ind is not None else "induction not tried (--method bmc)"
        result = bmcs[n]
        outcome = ProveOutcome(result.verdict, ind, result, why)
        if result.verdict == "counterexample":
            assert result.invariant is not None
            outcome.engine, outcome.engine_confirms = confirm_on_engine(
                fragment, result.decisions, result.invariant
            )
        outcomes.append(outcome)
    return outcomes


def confirm_on_engine(
    fragment: sy.Fragment, decisions: list[Event], invariant: str
) -> tuple[str, bool]:
    """Does the reference engine, forced through the same decisions and judged in lockstep with
    the spec, violate the same invariant? One line for a reader, and the answer."""
    try:
        _, found = enact(fragment.config, decisions)
    except EnactError as err:
        return f"reference engine: could NOT enact the counterexample: {err}", False
    if found is None:
        return "reference engine: took every decision but NO violation was found", False
    if found.invariant != invariant:
        return (
            f"reference engine: took every decision and violated {found.invariant} instead of "
            f"{invariant}: {found.message}"
        ), False
    return (
        f"reference engine: forced through the same {len(decisions)} decisions, it violates "
        f"{found.invariant} too (judged in lockstep with the spec): {found.message}"
    ), True
