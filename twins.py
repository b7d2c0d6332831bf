"""The declared twins: every other executable form of the spec, what it must equal, the tests
that show it, and what it follows, as a table, the way a TLA+ module says which module
``INSTANCE``s which and states the ``THEOREM`` that one refines the other.

``kvspec.spec`` is the definition. Every module below restates some of it in another form (for
speed, for a solver, for an engine) and would be worthless if it drifted; each declares
``TWIN_OF`` so that ``tests/test_twins.py`` can check that no form goes unregistered and that
every test named here exists. Each row is also the form's support, read by the form itself
(``follows``, ``refuse``) instead of decided in its own prose:

* ``features``: every configuration feature of ``spec/features.py``, followed (``FOLLOWS``) or
  refused (``Refused``, with the reason; the form raises ``NotFollowed`` naming it);
* ``invariants``: every invariant of ``spec/invariants.py``'s ``REGISTRY``, evaluated
  (``IMPLEMENTS``) or left out (``Exempt``, with the reason; an exemption that says the
  invariant holds on every state the form reaches is only valid when the form refuses whatever
  can break it, ``Invariant.broken_by``);
* ``traits``: per axis of ``spec/policies.py``'s ``AXES``, the values it follows.

A form with no configuration, or no invariants of its own, says so once for the whole column
(``Refused`` or ``Exempt`` in place of the mapping). ``problems()`` lists every gap;
``tests/test_twins.py`` fails on any, and checks that each declared refusal is the one the form
raises. ``docs/architecture.md`` draws the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvspec.spec.features import FEATURES
from kvspec.spec.invariants import REGISTRY
from kvspec.spec.policies import AXES, traits
from kvspec.spec.state import Config

FOLLOWS = "follows"
IMPLEMENTS = "implements"


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Exempt:
    reason: str
    unreachable: bool = False
    """The reason is that no state the form reaches violates it (only the spec's own actions
    change its state): valid only while the form refuses everything in ``broken_by``."""


class NotFollowed(ValueError):
    """A form was given a configuration feature or policy trait its row of the table refuses."""

    def __init__(self, form: str, what: str, message: str) -> None:
        super().__init__(message)
        self.form = form
        self.what = what
        """The feature's name, or ``axis=value`` for a trait."""


@dataclass(frozen=True)
class Twin:
    form: str
    """The module (or package) that restates the spec."""
    what: str
    equals: str
    """What it must equal: the theorem its tests check."""
    shown_by: tuple[str, ...]
    """The tests that show it (``tests/file.py::test_name``)."""
    label: str = ""
    """How a refusal names the form ("the fast model")."""
    features: Mapping[str, str | Refused] | Refused = Refused("")
    invariants: Mapping[str, str | Exempt] | Exempt = Exempt("")
    traits: Mapping[str, tuple[str, ...]] | Refused = Refused("")
    unfollowed: Mapping[str, str] = field(default_factory=dict)
    """Why a trait value the row does not follow is left out, by ``axis=value`` (its refusal
    says so)."""


def _all_axes_but(*refused: str) -> dict[str, tuple[str, ...]]:
    return {axis: tuple(v for v in values if v not in refused) for axis, values in AXES.items()}


ENGINE_ONLY = Exempt(
    "an engine, not a checker: its effects are judged by the spec's invariants in lockstep"
)
REACHED_BY_SPEC_ACTIONS = Exempt(
    "holds on every state the spec's actions reach (inductive at small sizes, docs/proofs.md; "
    "fuzzed in tests/test_incremental.py), and only the spec's actions change this form's state "
    "(strict judging)",
    unreachable=True,
)
GROUP_INVARIANTS = (
    "HitServedByEveryGroup",
    "NoUnwrittenStateRead",
    "NoReadOfRecycled",
    "StateAtItsBoundary",
    "CrossBlocksPrivate",
)
"""The invariants of several KV-cache groups (issue #36): vacuous with one group."""
ONE_GROUP = Exempt("vacuous with one KV-cache group; the form refuses several", unreachable=True)
NO_CONFIG = "takes no Config"
LOOKAHEAD = (
    "its hashes name a block's prefix alone (reference/hashing.py): judged by the spec only "
    "(the pytest plugin's vLLM tests with a lookahead block hasher)"
)
DECLARED = (
    "NoUnwrittenRead",
    "NoUnwrittenPublish",
    "RefcountIsOwnership",
    "SharedImpliesSamePrefix",
    "FreeQueueExact",
    "FreedAfterWrites",
    "HashIndexConsistent",
    "NullBlockPinned",
    "TableMatchesComputed",
    "StepsInOrder",
    "NoLeakAtQuiescence",
)
"""The invariants this table was written for, spelled out (not read from ``REGISTRY``): an
invariant added to the registry is in no row until someone declares it there."""
Z3_FEATURES: dict[str, str | Refused] = {
    "async_scheduling": FOLLOWS,
    "stale_output_deliver": FOLLOWS,
    "prefix_caching_off": Refused(
        "a pool that publishes nothing has none of the registration races the proofs are "
        "about, and its batch free order would need its own free-queue terms"
    ),
    "spec_tokens": Refused(
        "the model's contents have no draft values and its commits one token per request"
    ),
    "delay_load_registration": FOLLOWS,
    "defer_free": Refused("the model has no holder but tables"),
    "defer_loads": Refused("it needs defer_free, which the model refuses"),
    "sliding_window": Refused("its tables have no null positions and its reads no window"),
    "groups": Refused("its requests have one table and its pool one index"),
    "cross_attention": Refused("it has no cross-attention group (it refuses several groups)"),
    "slot_groups": Refused("it has no slot group (it refuses several groups)"),
    "chunked_local": Refused("its tables have no null positions and its reads no chunk"),
    "track_slots": Refused("it has no slot group, so no track slot (it refuses several groups)"),
    "loads": Refused("the fragment has no external KV loads (nor their failures)"),
    "bounded_hits": Refused("its hit is the longest cached prefix, never bounded"),
    "reset_running": Refused("its reset needs no step in flight and preempts nothing"),
    "hash_lookahead": Refused("its keys are prefixes: a block is keyed once computed"),
    "cache_aware_admission": Refused("its admissions take the queue's head in arrival order"),
    "trim_at_finish": Refused("it needs sliding_window, which the model refuses"),
}
"""The Z3 model's features (its ``Fragment``), which the lemmas share."""

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
        "count of the tokens in flight), and with several KV-cache groups (``Config.groups``: "
        "its coordinator's iterated hit, per-group tables, frees and registrations), chunked "
        "local attention among them, alone or after a full or window group, a cross-attention "
        "group after them (tables of a request's encoder tokens, allocated and written at "
        "admission, read whole, never hashed), and slot groups "
        "(SGLang's MAMBA: one slot per request; under the spec's policies in strict lockstep, "
        "and under its own registration, ``engine-registers``, judged by the observed judge with "
        "its pool compared after every decision: states snapshotted by copy (``no_buffer``) or "
        "through track slots (``extra_buffer``, depth 1), donated and hit by copy; window "
        "groups let go of by the engine itself, state and chunked groups freed at schedule)",
        (
            "tests/test_reference.py::test_engine_conforms_to_spec",
            "tests/test_spec_defer.py::test_the_reference_engine_with_deferred_frees_conforms",
            "tests/test_spec_defer.py::test_the_reference_engine_with_deferred_loads_conforms",
            "tests/test_spec_no_caching.py::test_the_reference_engine_without_prefix_caching_conforms",
            "tests/test_spec_decode.py::test_the_reference_engine_with_drafts_conforms",
            "tests/test_async_spec_decode.py::test_the_reference_engine_with_drafts_under_async_conforms",
            "tests/test_spec_window.py::test_the_reference_engine_with_a_window_conforms",
            "tests/test_spec_hitbound.py::test_the_reference_engine_with_bounded_reads_conforms",
            "tests/test_fuzz.py::test_safe_cells_hold_in_lockstep",
            "tests/test_reference_groups.py::test_the_reference_engine_with_groups_conforms",
            "tests/test_reference_groups.py::test_the_reference_engine_with_a_chunked_group_conforms",
            "tests/test_reference_cross.py::test_the_reference_engine_with_a_cross_group_conforms",
            "tests/test_reference_slots.py::test_the_reference_engine_with_a_slot_group_conforms",
            "tests/test_reference_slots.py::test_the_reference_engine_registering_on_its_own_is_judged_safe",
            "tests/test_reference_slots.py::test_the_reference_engine_with_track_slots_is_judged_safe",
            "tests/test_reference_own_groups.py::test_the_reference_engine_registering_on_its_own_with_skipping_groups_is_judged_safe",
        ),
        label="the reference engine",
        features={
            name: FOLLOWS
            for name in (
                "async_scheduling",
                "stale_output_deliver",
                "prefix_caching_off",
                "spec_tokens",
                "delay_load_registration",
                "defer_free",
                "defer_loads",
                "sliding_window",
                "loads",
                "bounded_hits",  # a request's read_limit (engine.add_request)
            )
        }
        | {"groups": FOLLOWS}
        | {"cross_attention": FOLLOWS}  # a cross group: tables of encoder tokens (add_request)
        | {"slot_groups": FOLLOWS}  # reference/slots.py, own_registration.py
        | {"chunked_local": FOLLOWS}  # its own chunk hit rule, skipped frees and reads
        | {"track_slots": FOLLOWS}  # EngineConfig.slot_buffer="extra_buffer", own_registration.py
        | {"hash_lookahead": Refused(LOOKAHEAD)}
        | {"reset_running": Refused("its reset preempts nothing: it needs no block in use")}
        | {"cache_aware_admission": Refused("it admits in queue order; the spec reorders")}
        | {"trim_at_finish": Refused("it has no KV connector: a finish frees its table whole")},
        invariants=ENGINE_ONLY,
        traits=dict(AXES),  # by-engine: its own registration (reference/own_registration.py)
    ),
    Twin(
        "kvspec.judge.fastmodel",
        "the fast model: the state machine for speed, interned prefixes; what it refuses "
        "(``features`` below) ``kvspec check`` and ``Monitor.fast`` judge by the spec",
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
            "tests/test_spec_hitbound.py::test_the_fast_model_takes_the_same_bound",
        ),
        label="the fast model",
        features={
            "async_scheduling": FOLLOWS,
            "stale_output_deliver": FOLLOWS,
            "prefix_caching_off": FOLLOWS,
            "spec_tokens": Refused("judged by the spec only (kvspec check, Monitor.fast)"),
            "delay_load_registration": FOLLOWS,
            "defer_free": Refused("judged by the spec only: the model has no deferred holders"),
            "defer_loads": Refused("judged by the spec only: it needs defer_free"),
            "sliding_window": Refused("judged by the spec only: no null positions, no window"),
            "groups": Refused("judged by the spec only: one table per request, one index"),
            "cross_attention": Refused("judged by the spec only: no cross-attention group"),
            "slot_groups": Refused("judged by the spec only: no slot group, no copies"),
            "chunked_local": Refused("judged by the spec only: no null positions, no chunk"),
            "track_slots": Refused("judged by the spec only: no slot group, no track write"),
            "loads": FOLLOWS,
            "bounded_hits": FOLLOWS,
            "hash_lookahead": Refused("judged by the spec only: its keys are prefixes"),
            "cache_aware_admission": Refused("judged by the spec only: its queue is not reordered"),
            "trim_at_finish": Refused("judged by the spec only: it needs sliding_window"),
            "reset_running": Refused("judged by the spec only: its reset needs no step in flight"),
        },
        invariants={
            "NoUnwrittenRead": IMPLEMENTS,
            "NoUnwrittenPublish": IMPLEMENTS,
            "RefcountIsOwnership": REACHED_BY_SPEC_ACTIONS,
            "SharedImpliesSamePrefix": REACHED_BY_SPEC_ACTIONS,
            "FreeQueueExact": REACHED_BY_SPEC_ACTIONS,
            "FreedAfterWrites": REACHED_BY_SPEC_ACTIONS,
            "HashIndexConsistent": REACHED_BY_SPEC_ACTIONS,
            "NullBlockPinned": REACHED_BY_SPEC_ACTIONS,
            "TableMatchesComputed": REACHED_BY_SPEC_ACTIONS,
            "StepsInOrder": REACHED_BY_SPEC_ACTIONS,
            "NoLeakAtQuiescence": REACHED_BY_SPEC_ACTIONS,
            **dict.fromkeys(GROUP_INVARIANTS, ONE_GROUP),
        },
        traits=_all_axes_but("by-engine"),
    ),
    Twin(
        "kvspec.judge.incremental",
        "the incremental invariants: each evaluated only where a decision changed the state; "
        "what it refuses (``features`` below) ``SpecModel`` judges with the full definitions",
        "the full definitions of spec/invariants.py: the same first violation on every trace, "
        "and the same answer on every corrupted state",
        (
            "tests/test_incremental.py::test_incremental_and_full_checks_report_the_same_first_violation",
            "tests/test_spec_reset.py::test_incremental_checks_agree_on_a_reset_beside_steps_in_flight",
            "tests/test_async_spec_decode.py::test_incremental_checks_agree_with_the_full_ones",
            "tests/test_incremental.py::test_corrupting_a_changed_item_is_found_as_by_the_full_check",
            "tests/test_spec_window.py::test_the_fast_and_z3_models_refuse_a_window",
        ),
        label="the incremental checks",
        features={
            "async_scheduling": FOLLOWS,
            "stale_output_deliver": FOLLOWS,
            "prefix_caching_off": FOLLOWS,
            "spec_tokens": FOLLOWS,
            "delay_load_registration": FOLLOWS,
            "defer_free": FOLLOWS,
            "defer_loads": FOLLOWS,
            "sliding_window": Refused(
                "its footprints do not restate the null-block positions: SpecModel judges a "
                "window with the full definitions"
            ),
            "groups": Refused(
                "its footprints know one table per request: SpecModel judges several groups "
                "with the full definitions"
            ),
            "cross_attention": Refused("it refuses several groups: SpecModel judges them"),
            "slot_groups": Refused("it refuses several groups: SpecModel judges them"),
            "chunked_local": Refused(
                "its footprints do not restate the null-block positions: SpecModel judges a "
                "chunked group with the full definitions"
            ),
            "track_slots": Refused("it refuses several groups: SpecModel judges them"),
            "loads": FOLLOWS,
            "bounded_hits": FOLLOWS,  # the spec's actions bound the hit; no invariant reads it
            "hash_lookahead": Refused(
                "its NoUnwrittenPublish reads a key as the prefix it names: SpecModel judges "
                "lookahead keys with the full definitions"
            ),
            "cache_aware_admission": FOLLOWS,  # the spec's actions reorder; no invariant reads the order
            "trim_at_finish": Refused(
                "it needs sliding_window: SpecModel judges it with the full definitions"
            ),
            "reset_running": FOLLOWS,  # the reset's footprint names the steps and its victims
        },
        invariants={
            **{name: IMPLEMENTS for name in DECLARED},
            **dict.fromkeys(GROUP_INVARIANTS, ONE_GROUP),
        },
        traits=dict(AXES),
    ),
    Twin(
        "kvspec.proofs.symbolic",
        "the Z3 model: actions and invariants as Z3 terms at fixed sizes (``Fragment``, which "
        "refuses what ``Z3_FEATURES`` refuses)",
        "it admits exactly the executable spec's successor of every (state, decision) pair "
        "the walks reach, and its invariants are the spec's there",
        (
            "tests/test_symbolic.py::test_z3_relation_admits_exactly_the_spec_successor",
            "tests/test_symbolic.py::test_z3_relation_admits_exactly_the_spec_successor_under_async",
            "tests/test_symbolic.py::test_agreement_covers_invariant_violations",
            "tests/test_spec_defer.py::test_the_fast_and_z3_models_refuse_deferred_frees",
            "tests/test_spec_window.py::test_the_fast_and_z3_models_refuse_a_window",
        ),
        label="the Z3 model",
        features=Z3_FEATURES,
        invariants={
            **{name: IMPLEMENTS for name in DECLARED if name != "FreedAfterWrites"},
            "FreedAfterWrites": Exempt(
                "vacuous without deferred frees, which the model refuses", unreachable=True
            ),
            **dict.fromkeys(GROUP_INVARIANTS, ONE_GROUP),
        },
        traits=_all_axes_but("by-engine"),
    ),
    Twin(
        "kvspec.proofs.lemmas",
        "the strengthening lemmas of the inductive proofs",
        "with the invariants, inductive for the safe cells (so true on every reachable state; "
        "the safe async and delivered-output cells too, by the lemmas' async forms), "
        "and a counterexample to induction when one is removed",
        (
            "tests/test_induction.py::test_safe_cells_are_inductive",
            "tests/test_induction.py::test_a_missing_lemma_leaves_a_counterexample_to_induction",
            "tests/test_induction.py::test_safe_async_cells_are_inductive",
            "tests/test_induction.py::test_the_synchronous_lengths_are_refuted_under_async",
            "tests/test_induction.py::test_delivered_stale_output_is_inductive",
        ),
        label="the lemmas",
        features=Z3_FEATURES,
        invariants=Exempt(
            "strengthening lemmas over the Z3 model: the spec's invariants are the Z3 model's row"
        ),
        traits=_all_axes_but("by-engine"),
    ),
    Twin(
        "kvspec.proofs.parametric",
        "the parametric model: the block lifecycle over unbounded sorts (requests, blocks, "
        "hashes; steps and positions as integers), for proofs at every size; synchronous or async "
        "(stale output dropped or delivered), "
        "any block size (a block of B positions is B one-position slots taken, freed and "
        "published together: slots held ahead of the computed positions, written later, "
        "``proofs/abstraction.py``), external loads and their failures (any block size), "
        "draft tokens (rejected ones rolled back; under async scheduling, with stale output "
        "dropped, the later entries moved back), "
        "deferred and hide-uncommitted "
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
            "tests/test_parametric_twin.py::test_the_twin_covers_stale_output_delivered",
            "tests/test_parametric_twin.py::test_the_twin_covers_a_discarded_stale_sample",
            "tests/test_parametric_twin.py::test_the_twin_covers_an_async_draft_rejection",
            "tests/test_parametric_twin.py::test_the_twin_covers_the_last_tokens_block_loaded",
            "tests/test_parametric_twin.py::test_every_spec_step_with_loads_at_larger_blocks_is_a_parametric_step",
            "tests/test_parametric_twin.py::test_a_drifting_model_fails_the_twin_test",
            "tests/test_parametric.py::test_the_invariant_is_inductive_for_every_size",
            "tests/test_parametric.py::test_a_planted_bug_fails_the_proof",
            "tests/test_twins.py::test_each_declared_refusal_is_the_refusal_the_form_raises",
        ),
        label="the parametric model",
        features={
            "async_scheduling": FOLLOWS,
            "stale_output_deliver": FOLLOWS,
            "prefix_caching_off": Refused(
                "a pool that publishes nothing has none of the races the proof is about"
            ),
            "spec_tokens": FOLLOWS,  # all_sizes.refusal refuses it with async and stale delivered
            "delay_load_registration": Refused(
                "its loads register with the schedule that took them"
            ),
            "defer_free": Refused("its only holders are tables"),
            "defer_loads": Refused("it needs defer_free, which the model refuses"),
            "sliding_window": Refused("its tables have no null positions and its reads no window"),
            "groups": Refused("its requests have one table and its pool one index"),
            "cross_attention": Refused("it refuses several groups"),
            "slot_groups": Refused("it refuses several groups"),
            "chunked_local": Refused("its tables have no null positions and its reads no chunk"),
            "track_slots": Refused("it refuses several groups"),
            "loads": FOLLOWS,
            # its lookup may hit any published blocks under the request's hashes: a bounded
            # hit is one of them
            "bounded_hits": FOLLOWS,
            "hash_lookahead": Refused("its hashes are prefixes: a block is keyed once computed"),
            "cache_aware_admission": Refused(
                "its admissions take the queue's head in arrival order"
            ),
            "trim_at_finish": Refused("it needs sliding_window, which the model refuses"),
            "reset_running": Refused("its reset needs no step in flight and preempts nothing"),
        },
        invariants={
            **{
                name: IMPLEMENTS
                for name in (
                    "NoUnwrittenRead",
                    "NoUnwrittenPublish",
                    "RefcountIsOwnership",
                    "SharedImpliesSamePrefix",
                )
            },
            "FreeQueueExact": Exempt(
                "stated as a set (a block is queued exactly when nobody holds it): the queue's "
                "order is the bounded proofs' (docs/proofs.md, 'Every size')"
            ),
            "FreedAfterWrites": Exempt(
                "vacuous without deferred frees, which the model refuses", unreachable=True
            ),
            **{
                name: Exempt("a bookkeeping invariant the bounded proofs carry, not restated here")
                for name in (
                    "HashIndexConsistent",
                    "NullBlockPinned",
                    "TableMatchesComputed",
                    "StepsInOrder",
                    "NoLeakAtQuiescence",
                )
            },
            **dict.fromkeys(GROUP_INVARIANTS, ONE_GROUP),
        },
        traits={
            "publish": ("hidden-until-written", "at-written"),
            "track": ("nothing", "per-step"),
            "leave": ("nothing", "drop-hidden"),
            "clear": ("never", "on-written"),
        },
        unfollowed={
            "publish=at-schedule": (
                "a block is published before its write runs, so its invariant "
                "(PublishedWritten, HeldBlocksHold) is false there: eager-unsafe is refuted by "
                "its counterexample, and so are the rollback policies under the general "
                "discipline; their vllm cells are safe only through that discipline's guards "
                "(no preemption after an admission in the same step, fcfs preempts only the "
                "unscheduled tail), which the model drops, through their rollback bookkeeping, "
                "which it does not keep, and through a withdrawn entry's writes landing intact, "
                "which it lets garble; per size they are inductive, synchronous and async, with "
                "lemmas saying which withdrawn writes land intact (docs/proofs.md, 'Every size', "
                "'The rollback policies under async scheduling')"
            ),
        },
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
        label="the spec's pool contracts",
        features=Refused(f"{NO_CONFIG}: pure functions of a flat pool, caching on"),
        invariants=Exempt("the pool invariants restated over a flat pool, function by function"),
        traits=Refused(f"{NO_CONFIG}: the pool publishes what it is told"),
    ),
    Twin(
        "kvspec.reference.contracts",
        "CrossHair contracts: the reference engine's pool as pure functions of the same flat pool",
        "the spec's contracts, function by function (CrossHair's diffbehavior)",
        ("tests/test_contracts.py::test_crosshair_spec_and_reference_agree",),
        label="the reference engine's pool contracts",
        features=Refused(f"{NO_CONFIG}: pure functions of a flat pool, caching on"),
        invariants=Exempt("the spec's contracts, function by function"),
        traits=Refused(f"{NO_CONFIG}: the pool publishes what it is told"),
    ),
    Twin(
        "kvspec.spec.pool_machine",
        "the block pool on its own (lookup, touch, allocate, free, publish, evict, reset) as a "
        "state machine of its own, for code that drives a pool with no scheduler",
        "the spec's pool mechanisms (spec/pool.py): the same refcounts, hashes, index and free "
        "queue after every operation of a random sequence, its batch free as ``free_batch``; "
        "alias, move, unpin and give (vLLM's partial prefix-cache hits) have no counterpart "
        "there, tests/test_pool_partial.py shows them",
        ("tests/test_twins.py::test_the_pool_machine_is_the_spec_pool",),
        label="the pool machine",
        features=Refused(f"{NO_CONFIG}: a block count and caching on or off (initial_pool)"),
        invariants=Exempt("its own pool invariants (POOL_INVARIANTS), over opaque keys"),
        traits=Refused(f"{NO_CONFIG}: the pool publishes what it is told"),
    ),
)
"""Every form, in the order of ``docs/architecture.md``."""


def twin(form: str) -> Twin:
    """The row of ``form``; ``KeyError`` for a form that is not declared."""
    for t in TWINS:
        if t.form == form:
            return t
    raise KeyError(form)


def refusal(form: str, config: Config) -> NotFollowed | None:
    """What ``form``'s row refuses of ``config`` (its first refused feature that is on, else
    its first trait value not followed), or None when the form follows it all."""
    row = twin(form)
    label = row.label or form
    if isinstance(row.features, Refused):
        return NotFollowed(form, "config", f"{label} {row.features.reason}")
    for name, feature in FEATURES.items():
        support = row.features.get(name)
        if feature.on is None or not feature.on(config):
            continue
        if support is None:
            return NotFollowed(form, name, f"{label}: no support declared for {name}")
        if isinstance(support, Refused):
            return refused(form, name)
    if isinstance(row.traits, Refused):
        return NotFollowed(form, "policy", f"{label} {row.traits.reason}")
    t = traits(config)
    for axis, followed in row.traits.items():
        value = getattr(t, axis)
        if value not in followed:
            why = row.unfollowed.get(f"{axis}={value}")
            return NotFollowed(
                form,
                f"{axis}={value}",
                f"{label} does not follow the policy trait {axis}={value!r} of "
                f"{config.policy!r} (it follows {', '.join(followed)})"
                + (f": {why}" if why else ""),
            )
    return None


def refused(form: str, feature: str) -> NotFollowed:
    """The refusal ``form``'s row declares for ``feature`` (its message names both)."""
    row = twin(form)
    assert not isinstance(row.features, Refused)
    support = row.features[feature]
    assert isinstance(support, Refused)
    meaning = FEATURES[feature].meaning
    return NotFollowed(
        form, feature, f"{row.label} does not follow {meaning} ({feature}): {support.reason}"
    )


def follows(form: str, config: Config) -> bool:
    """Whether ``form`` follows every feature and trait of ``config``."""
    return refusal(form, config) is None


def refuse(form: str, config: Config) -> None:
    """Raise ``NotFollowed`` for what ``form`` does not follow of ``config``."""
    problem = refusal(form, config)
    if problem is not None:
        raise problem


def implemented(form: str) -> frozenset[str]:
    """The invariants ``form`` evaluates, by its row."""
    row = twin(form)
    if isinstance(row.invariants, Exempt):
        return frozenset()
    return frozenset(name for name, s in row.invariants.items() if s == IMPLEMENTS)


def problems() -> list[str]:
    """Every gap in the table: a feature, invariant or axis a row does not cover, a name it
    covers that the registries do not have, an exemption whose invariant a followed feature or
    trait can break."""
    out: list[str] = []
    for row in TWINS:
        if not row.label:
            out.append(f"{row.form}: no label")
        if not isinstance(row.features, Refused):
            missing = set(FEATURES) - set(row.features)
            extra = set(row.features) - set(FEATURES)
            out += [f"{row.form}: feature {n} neither followed nor refused" for n in missing]
            out += [f"{row.form}: unknown feature {n}" for n in extra]
        if not isinstance(row.traits, Refused):
            for axis, values in AXES.items():
                followed = row.traits.get(axis)
                if followed is None:
                    out.append(f"{row.form}: trait axis {axis} not declared")
                    continue
                out += [
                    f"{row.form}: unknown {axis} trait {v}" for v in followed if v not in values
                ]
        if isinstance(row.invariants, Exempt):
            continue
        missing = set(REGISTRY) - set(row.invariants)
        out += [f"{row.form}: invariant {n} neither implemented nor exempt" for n in missing]
        out += [f"{row.form}: unknown invariant {n}" for n in set(row.invariants) - set(REGISTRY)]
        for name, support in row.invariants.items():
            if not isinstance(support, Exempt) or not support.unreachable or name not in REGISTRY:
                continue
            for breaker in REGISTRY[name].broken_by:
                if _follows_breaker(row, breaker):
                    out.append(
                        f"{row.form}: {name} is exempt as unreachable, but {breaker}, which "
                        f"breaks it, is followed"
                    )
    return out


def _follows_breaker(row: Twin, breaker: str) -> bool:
    axis, _, value = breaker.partition("=")
    if value:
        return not isinstance(row.traits, Refused) and value in row.traits.get(axis, ())
    if isinstance(row.features, Refused):
        return False
    return row.features.get(breaker, FOLLOWS) == FOLLOWS
