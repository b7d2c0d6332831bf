"""The declared twins: every other executable form of the spec, what it must equal, and the tests
that show it, the way a TLA+ module says which module ``INSTANCE``s which and states the
``THEOREM`` that one refines the other.

``kvspec.spec`` is the definition. Every module below restates some of it in another form (for
speed, for a solver, for an engine) and would be worthless if it drifted; each declares
``TWIN_OF = "kvspec.spec"`` so that ``tests/test_twins.py`` can check that no form goes
unregistered and that every test named here exists. ``docs/architecture.md`` draws them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Twin:
    form: str
    """The module (or package) that restates the spec."""
    what: str
    equals: str
    """What it must equal: the theorem its tests check."""
    shown_by: tuple[str, ...]
    """The tests that show it (``tests/file.py::test_name``)."""


TWINS: tuple[Twin, ...] = (
    Twin(
        "kvspec.reference",
        "the reference engine: an independent, fast implementation of every policy",
        "its events are the spec's effects of its decisions, event by event, and its refcounts "
        "and free queue are the spec's after every workload step (lockstep fuzzing), under "
        "every policy, discipline, preemption and depth, with prefix caching on and off, "
        "with draft tokens (speculative decoding, synchronous and under async scheduling), and "
        "with deferred frees (``Config.defer_free``: its own step sequence numbers and fenced "
        "queue), deferred asynchronous loads (``Config.defer_loads``: a deferred load's "
        "request takes the newest counted step's sequence number), and with a sliding window "
        "(``Config.sliding_window``: its own window hit rule and skipped-block frees on its own "
        "count of the tokens in flight)",
        (
            "tests/test_reference.py::test_engine_conforms_to_spec",
            "tests/test_spec_defer.py::test_the_reference_engine_with_deferred_frees_conforms",
            "tests/test_spec_defer.py::test_the_reference_engine_with_deferred_loads_conforms",
            "tests/test_spec_no_caching.py::test_the_reference_engine_without_prefix_caching_conforms",
            "tests/test_spec_decode.py::test_the_reference_engine_with_drafts_conforms",
            "tests/test_async_spec_decode.py::test_the_reference_engine_with_drafts_under_async_conforms",
            "tests/test_spec_window.py::test_the_reference_engine_with_a_window_conforms",
            "tests/test_fuzz.py::test_safe_cells_hold_in_lockstep",
        ),
    ),
    Twin(
        "kvspec.conformance.judge.fastmodel",
        "the fast model: the state machine for speed, interned prefixes, prefix caching on "
        "and off (the reference traces and spec walks its tests draw include caching off); "
        "not speculative decoding, deferred frees nor a sliding window (``Config.spec_tokens`` "
        "> 0, ``Config.defer_free``, which ``Config.defer_loads`` needs, and "
        "``Config.sliding_window`` are refused by ``FastModel``, and ``kvspec check`` and "
        "``Monitor.fast`` judge such traces by the spec throughout)",
        "a judge over it reaches the spec judge's verdict (none, or the same invariant at the "
        "same event) and its state, exported, is the spec's before every decision",
        (
            "tests/test_fastmodel.py::test_fast_model_and_spec_agree_on_engine_traces",
            "tests/test_fastmodel.py::test_fast_model_and_spec_agree_on_traces_with_planted_bugs",
            "tests/test_fastmodel.py::test_check_prints_the_same_through_both_engines",
            "tests/test_spec_decode.py::test_the_fast_and_z3_models_refuse_drafts",
            "tests/test_spec_defer.py::test_the_fast_and_z3_models_refuse_deferred_frees",
            "tests/test_spec_defer.py::test_kvspec_check_judges_deferred_frees_by_the_spec",
            "tests/test_spec_window.py::test_the_fast_and_z3_models_refuse_a_window",
            "tests/test_spec_window.py::test_kvspec_check_judges_a_window_by_the_spec",
        ),
    ),
    Twin(
        "kvspec.conformance.judge.incremental",
        "the incremental invariants: each evaluated only where a decision changed the state "
        "(prefix caching on and off, draft tokens, synchronous and under async scheduling, and "
        "deferred frees: the traces and walks its tests draw include them); not a sliding "
        "window (``SpecModel`` judges ``Config.sliding_window`` with the full definitions)",
        "the full definitions of spec/invariants.py: the same first violation on every trace, "
        "and the same answer on every corrupted state",
        (
            "tests/test_incremental.py::test_incremental_and_full_checks_report_the_same_first_violation",
            "tests/test_async_spec_decode.py::test_incremental_checks_agree_with_the_full_ones",
            "tests/test_incremental.py::test_corrupting_a_changed_item_is_found_as_by_the_full_check",
            "tests/test_spec_window.py::test_the_fast_and_z3_models_refuse_a_window",
        ),
    ),
    Twin(
        "kvspec.proofs.symbolic",
        "the Z3 model: actions and invariants as Z3 terms at fixed sizes, synchronous and "
        "async scheduling (placeholders), stale output dropped or delivered; prefix caching on "
        "only (``Config.prefix_caching`` off is refused by ``Fragment``: a pool that publishes "
        "nothing has none of the registration races the proofs are about, and its batch free "
        "order would need its own free-queue terms); no draft tokens (``Config.spec_tokens`` "
        "> 0 is refused by ``Fragment``: the model's contents have no draft values and its "
        "commits one token per request); no deferred frees (``Config.defer_free`` is refused "
        "by ``Fragment``: the model has no holder but tables); no sliding window "
        "(``Config.sliding_window`` is refused by ``Fragment``: its tables have no null "
        "positions and its reads no window)",
        "it admits exactly the executable spec's successor of every (state, decision) pair "
        "the walks reach, and its invariants are the spec's there",
        (
            "tests/test_symbolic.py::test_z3_relation_admits_exactly_the_spec_successor",
            "tests/test_symbolic.py::test_z3_relation_admits_exactly_the_spec_successor_under_async",
            "tests/test_symbolic.py::test_agreement_covers_invariant_violations",
            "tests/test_spec_defer.py::test_the_fast_and_z3_models_refuse_deferred_frees",
            "tests/test_spec_window.py::test_the_fast_and_z3_models_refuse_a_window",
        ),
    ),
    Twin(
        "kvspec.proofs.lemmas",
        "the strengthening lemmas of the inductive proofs",
        "with the invariants, inductive for the safe cells (so true on every reachable state), "
        "and a counterexample to induction when one is removed",
        (
            "tests/test_induction.py::test_safe_cells_are_inductive",
            "tests/test_induction.py::test_a_missing_lemma_leaves_a_counterexample_to_induction",
        ),
    ),
    Twin(
        "kvspec.proofs.parametric",
        "the parametric model: the block lifecycle over unbounded sorts (requests, blocks, "
        "hashes; steps and positions as integers), for proofs at every size; synchronous or async "
        "(stale output dropped), "
        "block size 1, external loads and their failures, deferred and hide-uncommitted "
        "(``proofs/abstraction.py`` "
        "maps a spec state onto a finite instance)",
        "an over-approximation of the spec: every spec step in its fragment is one of its "
        "steps, every state the walks reach is inside its invariant, and its five safety "
        "predicates have the spec invariants' values there",
        (
            "tests/test_parametric_twin.py::test_every_spec_step_is_a_parametric_step",
            "tests/test_parametric_twin.py::test_the_twin_covers_withdrawn_writes_reuse_and_eviction",
            "tests/test_parametric_twin.py::test_the_twin_covers_sharing_and_failed_loads",
            "tests/test_parametric_twin.py::test_the_twin_covers_placeholders_resolved_and_discarded",
            "tests/test_parametric_twin.py::test_a_drifting_model_fails_the_twin_test",
            "tests/test_parametric.py::test_the_invariant_is_inductive_for_every_size",
            "tests/test_parametric.py::test_a_planted_bug_fails_the_proof",
        ),
    ),
    Twin(
        "kvspec.proofs.contracts",
        "CrossHair contracts: the spec's pool mechanisms as pure functions of a flat pool, "
        "with prefix caching on (``pool.free_batch``, the free without it, is not among them: "
        "the reference lockstep test shows it)",
        "the spec's pool functions, and the pool invariants preserved by each",
        (
            "tests/test_contracts.py::test_free_then_allocate_agree",
            "tests/test_contracts.py::test_crosshair_finds_planted_bugs",
            "tests/test_contracts.py::test_crosshair_spec_and_reference_agree",
        ),
    ),
    Twin(
        "kvspec.reference.contracts",
        "CrossHair contracts: the reference engine's pool as pure functions of the same flat pool",
        "the spec's contracts, function by function (CrossHair's diffbehavior)",
        ("tests/test_contracts.py::test_crosshair_spec_and_reference_agree",),
    ),
)
"""Every form, in the order of ``docs/architecture.md``."""
