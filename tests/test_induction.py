"""Inductive proofs (proofs/induction.py, proofs/lemmas.py) and enacting counterexamples on
the reference engine (proofs/enact.py)."""

from __future__ import annotations

import pytest
import z3

from kvspec.proofs import induction, prove
from kvspec.proofs import lemmas as lm
from kvspec.proofs import symbolic as sy
from kvspec.proofs.enact import EnactError, enact
from kvspec.spec import Config

# Small sizes keep each proof to a few seconds; bench/bench_prove.py runs the default sizes.
SMALL = dict(blocks=3, requests=2, depth=1, block_size=1, tokens=3)


def fragment(policy: str, discipline: str = "vllm", preemption: str = "fcfs", **sizes: int):  # type: ignore[no-untyped-def]
    return prove.make_fragment(policy, discipline, preemption, **{**SMALL, **sizes})


@pytest.mark.parametrize(
    "cell",
    [
        ("deferred", "general", "fcfs", {}),
        ("hide-uncommitted", "vllm", "priority", {}),
        ("eager-rollback-single", "vllm", "priority", {"depth": 2}),
    ],
)
def test_safe_cells_are_inductive(cell) -> None:  # type: ignore[no-untyped-def]
    policy, discipline, preemption, sizes = cell
    result = induction.prove_inductive(fragment(policy, discipline, preemption, **sizes), 300)
    assert result.verdict == "inductive", induction.describe(result)
    assert result.instances == len(sy.Model(result.fragment).instances)
    assert "TablesEventuallyHold" in result.lemmas


def test_unsafe_cell_is_not_inductive() -> None:
    result = induction.prove_inductive(fragment("eager-unsafe", "general"), 300)
    assert result.verdict == "cti" and result.cti is not None
    assert result.cti.instance[0] == "preempt"
    assert {"NoUnwrittenRead", "NoUnwrittenPublish"} & set(result.cti.broken)
    assert "not inductive" in induction.describe(result)


def test_a_missing_lemma_leaves_a_counterexample_to_induction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = [lem for lem in lm.LEMMAS if lem.name != "TablesEventuallyHold"]
    monkeypatch.setattr(lm, "LEMMAS", kept)
    result = induction.prove_inductive(fragment("deferred"), 300)
    assert result.verdict == "cti" and result.cti is not None
    assert result.cti.pre  # the pre-state is shown to the reader


def test_a_model_bug_breaks_the_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deferred that (wrongly) registers at scheduling time, like eager-unsafe, is not proved."""
    original = sy.Model.on_schedule

    def eager(self, S, r, k, upto):  # type: ignore[no-untyped-def]
        return self.register(original(self, S, r, k, upto), r, upto)

    monkeypatch.setattr(sy.Model, "on_schedule", eager)
    result = induction.prove_inductive(fragment("deferred", "general"), 300)
    assert result.verdict == "cti"


ASYNC = dict(depth=2, async_scheduling=True)
"""Async scheduling with a step in flight while another is built: placeholders exist."""


@pytest.mark.parametrize("policy", ["deferred", "hide-uncommitted"])
def test_safe_async_cells_are_inductive(policy: str) -> None:
    """The async forms of the lemmas (known tokens plus placeholders in flight) make the safe
    async cells inductive; ``DeadEntriesReadWell`` is stated for synchronous cells only."""
    result = induction.prove_inductive(fragment(policy, **ASYNC), 300)
    assert result.verdict == "inductive", induction.describe(result)
    assert "DeadEntriesReadWell" not in result.lemmas
    synchronous = sy.Model(fragment(policy, depth=2))
    assert "DeadEntriesReadWell" in induction.conjunct_names(synchronous)


def test_dead_entries_read_well_is_not_stated_under_async(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stated under async scheduling too, ``DeadEntriesReadWell`` is not preserved at N=4: a
    withdrawn entry reads against its request's placeholders as seen now, not the ones it was
    scheduled with (a CTI at execute; the async proofs do without it)."""
    everywhere = [
        lm.Lemma(lem.name, lem.why, lem.predicate, lem.family)
        if lem.name == "DeadEntriesReadWell"
        else lem
        for lem in lm.LEMMAS
    ]
    monkeypatch.setattr(lm, "LEMMAS", everywhere)
    result = induction.prove_inductive(fragment("deferred", blocks=4, **ASYNC), 300)
    assert result.verdict == "cti" and result.cti is not None
    assert result.cti.instance[0] == "execute" and "DeadEntriesReadWell" in result.cti.broken


def test_the_synchronous_lengths_are_refuted_under_async(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Lengths`` with no placeholders counted (a live sampling entry ends at the known
    tokens, the synchronous fact): scheduling a token on a placeholder breaks it (the CTI of
    docs/proofs.md)."""
    monkeypatch.setattr(lm, "_sampling_before", lambda m, S, k, r: z3.IntVal(0))
    result = induction.prove_inductive(fragment("deferred", **ASYNC), 300)
    assert result.verdict == "cti" and result.cti is not None
    assert result.cti.instance[0] == "schedule" and "Lengths" in result.cti.broken


DELIVER = dict(depth=2, stale_output="deliver")
"""Stale output delivered: a preempted request's entries in submitted steps stay live."""


@pytest.mark.parametrize("timing", [{}, {"async_scheduling": True}])
def test_delivered_stale_output_is_inductive(timing: dict[str, bool]) -> None:
    result = induction.prove_inductive(fragment("deferred", **DELIVER, **timing), 300)
    assert result.verdict == "inductive", induction.describe(result)


def test_delivered_output_is_not_holding_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a live entry's request taken to hold its blocks, as without delivered output:
    preempting a request whose older step is in flight breaks it (a reachable state)."""
    monkeypatch.setattr(lm, "_holds_its_blocks", lambda m, S, k, r: S["elive", k, r])
    result = induction.prove_inductive(fragment("deferred", **DELIVER), 300)
    assert result.verdict == "cti" and result.cti is not None
    assert result.cti.instance[0] == "preempt"


def test_a_pending_write_names_its_placeholders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a live writer's placeholders named by no step (the lemma's step ids wrong):
    the first write that carries a placeholder refutes the lemma."""
    monkeypatch.setattr(lm, "_cells_before", lambda m, S, k, r: [z3.IntVal(-1)] * m.G)
    result = induction.prove_inductive(fragment("deferred", async_scheduling=True, **DELIVER), 300)
    assert result.verdict == "cti" and result.cti is not None
    assert "PendingKnownIsLength" in result.cti.broken


def test_an_async_model_bug_breaks_the_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that (wrongly) leaves its placeholders unresolved in written and pending
    contents: a later reader finds a placeholder where it expects the sampled token."""
    monkeypatch.setattr(sy.Model, "resolve", lambda self, S, r, sid: S)
    result = induction.prove_inductive(fragment("deferred", **ASYNC), 300)
    assert result.verdict == "cti"


ROLLBACK_ASYNC_LEMMAS = ["KnownDeadEntriesReadWell", "PlaceholderEntriesStartPastKnown"]
ROLLBACK_ASYNC_LEMMAS += ["NeededDeadWritesLand"]
"""What makes the rollback policies' vllm async cells inductive (docs/proofs.md, "The rollback
policies under async scheduling")."""


@pytest.mark.parametrize("policy", ["eager-rollback-single", "eager-rollback-fifo"])
def test_rollback_async_cells_are_inductive(policy: str) -> None:
    """A withdrawn entry's bad read garbles no block a live reader, a hit or a withdrawn entry
    that reads well needs; stated for these policies under async scheduling only."""
    result = induction.prove_inductive(fragment(policy, **ASYNC), 300)
    assert result.verdict == "inductive", induction.describe(result)
    assert set(ROLLBACK_ASYNC_LEMMAS) <= set(result.lemmas)
    for other in (fragment(policy, depth=2), fragment("deferred", **ASYNC)):
        assert not set(ROLLBACK_ASYNC_LEMMAS) & set(induction.conjunct_names(sy.Model(other)))


@pytest.mark.parametrize("missing", ROLLBACK_ASYNC_LEMMAS)
def test_each_rollback_async_lemma_is_needed(missing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: each lemma left out, eager-rollback-fifo vllm/fcfs async is not inductive (a
    CTI), so none of them is vacuous."""
    monkeypatch.setattr(lm, "LEMMAS", [lem for lem in lm.LEMMAS if lem.name != missing])
    result = induction.prove_inductive(fragment("eager-rollback-fifo", **ASYNC), 300)
    assert result.verdict == "cti" and result.cti is not None, missing


def test_a_finish_in_flight_keeps_the_single_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: ``SingleRecordIsNewestStep`` in its synchronous form (the record names a
    running request) under async scheduling: a commit that finishes the request named by the
    record while the newer step is in flight refutes it (a reachable state: begin clears it)."""
    monkeypatch.setattr(lm, "_finish_in_flight", lambda m: False)
    result = induction.prove_inductive(fragment("eager-rollback-single", **ASYNC), 300)
    assert result.verdict == "cti" and result.cti is not None
    assert "SingleRecordIsNewestStep" in result.cti.broken


@pytest.mark.parametrize("timing", [{}, {"async_scheduling": True}])
def test_rollback_delivered_output_is_inductive(timing: dict[str, bool]) -> None:
    """eager-rollback-fifo vllm/fcfs with stale output delivered, synchronous (not inductive
    before: a CTI at preempt breaking EntriesMatchTables) and async."""
    result = induction.prove_inductive(fragment("eager-rollback-fifo", **DELIVER, **timing), 300)
    assert result.verdict == "inductive", induction.describe(result)
    assert "StepEntriesShareAtSameIndex" in result.lemmas


@pytest.mark.parametrize("plant", ["no-same-index", "no-hit-from-writer"])
def test_rollback_delivered_output_needs_its_lemmas(
    plant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: ``StepEntriesShareAtSameIndex`` left out, or ``EntriesMatchTables`` without
    the rollback policies' hit on a block another request writes (``_shares_written_blocks``
    false, the deferring policies' term): a CTI at preempt breaking EntriesMatchTables."""
    if plant == "no-same-index":
        kept = [lem for lem in lm.LEMMAS if lem.name != "StepEntriesShareAtSameIndex"]
        monkeypatch.setattr(lm, "LEMMAS", kept)
    else:
        monkeypatch.setattr(lm, "_shares_written_blocks", lambda m: False)
    result = induction.prove_inductive(fragment("eager-rollback-fifo", **DELIVER), 300)
    assert result.verdict == "cti" and result.cti is not None
    assert result.cti.instance[0] == "preempt" and "EntriesMatchTables" in result.cti.broken


def test_base_case_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = lm.Lemma("NobodyArrives", "false once a request arrives", lambda m, S: S["nst"] == 1)
    monkeypatch.setattr(lm, "LEMMAS", [*lm.LEMMAS, wrong])
    result = induction.prove_inductive(fragment("deferred"), 300)
    assert result.verdict == "base-fails" and result.cti is not None
    assert result.cti.broken == ["NobodyArrives"]


def test_every_lemma_has_a_reason() -> None:
    names = [lem.name for lem in lm.LEMMAS]
    assert len(names) == len(set(names))
    assert all(lem.why.endswith(".") and len(lem.why) > 40 for lem in lm.LEMMAS)


# -- the reference engine, forced through decisions --------------------------------------------

CONSUMER = [
    ("arrive", 0, (1, 1), 1, 0),
    ("arrive", 1, (1, 1), 1, 0),
    ("begin", 0),
    ("schedule", 0, 2, 0),
    ("schedule", 1, 1, 0),
    ("preempt", 0),
]
"""The review's consumer scenario: r0 publishes block 1 eagerly, r1 hits it in the same step,
then r0 is preempted from the step."""


def config(policy: str) -> Config:
    return Config(
        num_blocks=4,
        block_size=1,
        depth=1,
        policy=policy,
        discipline="general",
        preemption="fcfs",
        token_budget=6,
        max_running=2,
    )


def test_engine_enacts_the_consumer_scenario_and_violates_what_the_spec_says() -> None:
    events, finding = enact(config("eager-rollback-fifo"), [*CONSUMER, ("submit", 0)])
    assert finding is not None and finding.invariant == "NoUnwrittenRead"
    assert ("publish", 0, 0, 1) in events and ("hit", 1, (1,)) in events


def test_engine_enacts_the_same_decisions_safely_under_deferred() -> None:
    decisions = [*CONSUMER, ("submit", 0), ("execute", 0, ()), ("commit", 0, ())]
    events, finding = enact(config("deferred"), decisions)
    assert finding is None
    commit = events.index(("commit", 0, ()))
    assert [e[:3] for e in events[commit:] if e[0] == "publish"] == [("publish", 1, 0)]


@pytest.mark.parametrize(
    "bad, message",
    [
        (("schedule", 0, 2, 0), "no step is building"),
        (("begin", 7), "numbered the step 0"),
        (("commit", 0, ()), "no such executed step"),
        (("dance",), "unknown decision"),
    ],
)
def test_engine_refuses_what_it_cannot_take(bad, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EnactError, match=message):
        enact(config("deferred"), [("arrive", 0, (1, 1), 1, 0), bad])


def test_z3_counterexample_is_confirmed_on_the_engine() -> None:
    f = prove.make_fragment("eager-unsafe", "general", "fcfs", 4, 1, 1, 1, 3)
    outcome = prove.prove_cell(f, 6, 120)
    assert outcome.verdict == "counterexample" and outcome.engine_confirms, outcome.engine
    assert outcome.induction is not None and outcome.induction.verdict == "cti"


@pytest.mark.parametrize("alone", ["commit", "every action, by parts"])
@pytest.mark.parametrize("policy", ["eager-unsafe", "deferred"])
def test_one_query_per_obligation_answers_as_the_conjuncts_one_by_one(
    policy: str, alone: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's fast path (all changed conjuncts in one query on a one-shot solver, then one
    by one only if that is not unsat) gives every obligation the answer and the failing
    conjunct of asking the conjuncts one by one, failing obligations included; so does asking
    each conjunct on its own one-shot solver first (``ASKED_ALONE``: commit past the default
    sizes, here at any size; then also every action, with every conjunct asked part by part,
    ``ASKED_BY_PARTS``)."""
    model = sy.Model(fragment(policy, "general"))
    actions = {inst[0] for inst in model.instances}
    if alone == "commit":
        monkeypatch.setattr(induction, "ASKED_ALONE", {"commit": 0})
    else:
        names = frozenset(induction.conjunct_names(model))
        monkeypatch.setattr(induction, "ASKED_ALONE", dict.fromkeys(actions, 0))
        monkeypatch.setattr(induction, "ASKED_BY_PARTS", dict.fromkeys(actions, names))
    prover = induction.Prover(fragment(policy, "general"))
    answers: list[str] = []
    first: dict[str, set[bool]] = {}
    for i, c in induction.obligations(prover.model):
        fast = prover.check(i, c, None)
        slow = prover.check(i, c, None, combined=False)
        assert (fast["answer"], fast["failing"]) == (slow["answer"], slow["failing"]), (i, c)
        assert all(q.conjunct != induction.ALL for q in slow["queries"])
        answers.append(fast["answer"])
        if fast["queries"]:
            action = prover.model.instances[i][0]
            first.setdefault(action, set()).add(fast["queries"][0].conjunct == induction.ALL)
    assert ("sat" in answers) == (policy == "eager-unsafe")
    # which obligations asked the one query first: all but commit's, or none
    assert first["commit"] == {False}
    assert first["schedule"] == {alone == "commit"}


def test_commit_asks_its_conjuncts_alone_past_the_default_sizes() -> None:
    """The default sizes (N=4, R=2, D=2) keep commit's one query, where it is the faster;
    larger ones ask commit's conjuncts alone, and never another action's."""

    def alone(action: str, blocks: int, requests: int, depth: int) -> bool:
        sizes = {"blocks": blocks, "requests": requests, "depth": depth}
        return induction.asks_alone(sy.Model(fragment("deferred", **sizes)), action)

    assert not alone("commit", 4, 2, 2)
    assert alone("commit", 5, 2, 2) and alone("commit", 4, 2, 3) and alone("commit", 6, 3, 3)
    assert not alone("schedule", 6, 3, 3) and not alone("execute", 6, 3, 3)


@pytest.mark.parametrize(
    "cell",
    [
        ("deferred", "vllm", "fcfs", {"depth": 2}, ("execute", "commit")),
        (
            "hide-uncommitted",
            "vllm",
            "priority",
            {"depth": 2, "async_scheduling": True},
            ("execute",),
        ),
        ("eager-rollback-fifo", "general", "fcfs", {"depth": 2, "requests": 3}, ("execute",)),
    ],
)
def test_cases_cover_the_guard_and_keep_the_successor(cell) -> None:  # type: ignore[no-untyped-def]
    """``Model.cases`` may split an instance only into cases whose guards together are the
    instance's guard and whose successors are the instance's under their guard (for any state,
    not only the strengthening's): then proving every case proves the instance. (Checked for
    the actions named; the others' cases are only counted, the check being slow at R=3.)"""
    policy, discipline, preemption, sizes, actions = cell
    model = sy.Model(fragment(policy, discipline, preemption, **{"blocks": 4, **sizes}))
    S = model.fresh("s")
    split = [inst for inst in model.instances if model.cases(inst) != [()]]
    assert {inst[0] for inst in split} == {"execute", "commit"}
    for inst in split:
        if inst[0] not in actions:
            continue
        params = model.fresh_params(inst, "p")
        guard, succ = model.apply(inst, S, params)
        guards = []
        for case in model.cases(inst):
            g, s = model.apply(inst, S, params, case)
            guards.append(g)
            differ = [s[key] != succ[key] for key, _ in model.schema if s[key] is not succ[key]]
            solver = z3.Solver()
            solver.add(g, z3.Or(z3.Not(guard), *differ))
            assert solver.check() == z3.unsat, (inst, case)
        solver = z3.Solver()
        solver.add(z3.Distinct(guard, z3.Or(*guards)))
        assert solver.check() == z3.unsat, inst
