"""Registration policies as trait records (``spec/policies.py``): the one registry every form reads
or is checked against, and a new combination of traits registered in it alone runs through the
spec, the fast and Z3 models, the reference engine and ``kvspec fuzz``."""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvspec import flow
from kvspec.judge.fastmodel import FastModel
from kvspec.reference import config as reference_config
from kvspec.reference import policies as reference_policies
from kvspec.spec import OBSERVED_POLICIES, Config, apply, initial_state
from kvspec.spec import policies as spec_policies
from kvspec.spec.policies import AXES, POLICIES, Traits

ROOT = Path(__file__).resolve().parents[1]
NEW = "eager-rollback-after-failures"
"""A policy no engine ships: ``eager-rollback-fifo`` whose buckets are committed after the load
failures are handled (``on-written``) instead of before them (``on-confirmed``)."""
NEW_TRAITS = Traits("at-schedule", "per-step", "unpublish", "on-written")


def test_the_reference_engine_names_the_spec_policies_with_the_same_traits() -> None:
    """The engine imports no spec: its own table must say what the registry says."""
    assert reference_config.PolicyTraits._fields == tuple(AXES)
    assert {n: tuple(t) for n, t in reference_config.POLICIES.items()} == {
        n: t.values() for n, t in POLICIES.items()
    }
    for axis, values in AXES.items():  # every value, by-engine its own registration's
        assert set(reference_policies.FOLLOWED[axis]) == set(values), axis
    # its own registration is the record of every observed policy (reference/own_registration.py)
    assert {n: tuple(t) for n, t in reference_config.OWN_POLICIES.items()} == {
        n: spec_policies.BY_ENGINE.values() for n in OBSERVED_POLICIES
    }


def test_the_trace_schema_names_every_registered_policy() -> None:
    schema = json.loads(
        importlib.resources.files("kvspec.conformance").joinpath("trace-v1.schema.json").read_text()
    )
    enums = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            policy = node.get("policy")
            if isinstance(policy, dict) and "enum" in policy:
                enums.append(policy["enum"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    assert enums and all(enum == [*POLICIES, *OBSERVED_POLICIES] for enum in enums)


def test_the_hostile_campaign_reads_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("kvspec_hostile", ROOT / "bench" / "hostile.py")
    assert spec is not None and spec.loader is not None
    hostile = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, hostile)
    spec.loader.exec_module(hostile)
    assert hostile.POLICIES == tuple(POLICIES)


def test_traits_refuse_what_means_nothing_by_name() -> None:
    with pytest.raises(ValueError, match="unknown publish trait 'at-lunch'"):
        Traits("at-lunch", "nothing", "nothing", "never")
    with pytest.raises(ValueError, match="have no meaning"):
        Traits("at-schedule", "nothing", "unpublish", "never")  # undo what nothing tracks
    with pytest.raises(ValueError, match="have no meaning"):
        Traits("hidden-until-written", "one-dict", "drop-hidden", "on-begin")
    with pytest.raises(ValueError, match="unknown policy"):
        Config(8, 4, policy=NEW)


def test_no_two_policies_share_their_traits() -> None:
    assert len(set(POLICIES.values())) == len(POLICIES)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> str:
    """The new policy, registered in ``spec.policies.POLICIES`` only."""
    monkeypatch.setitem(POLICIES, NEW, NEW_TRAITS)
    return NEW


def test_a_new_combination_of_traits_runs_through_every_form(registered: str) -> None:
    """Registered in the spec's registry alone: the spec, the fast model, the Z3 model, the
    reference engine and ``kvspec fuzz`` (lockstep, so the engine's effects are the spec's at
    every rule) all follow it."""
    config = Config(8, 4, policy=registered, token_budget=16)
    assert spec_policies.traits(config) is NEW_TRAITS
    s = initial_state(config)
    apply(s, ("arrive", 0, (1, 2, 3, 4, 5), 4, 0))
    apply(s, ("begin", 0))
    effects = apply(s, ("schedule", 0, 5))
    assert ("publish", 0, 0, s.requests[0].table[0]) in effects  # published at schedule
    assert s.steps[0].registrations == {0: [0]}  # tracked in the step's bucket
    FastModel(config)  # followed, not refused
    pytest.importorskip("z3")
    from kvspec.proofs.symbolic import Fragment, Model

    Model(Fragment(Config(4, 1, policy=registered)))

    result, judging = flow.fuzz(flow.Cell(policy=registered, loads=True), seconds=4.0)
    assert judging == "strict" and result.runs > 0 and result.commits > 0
    assert result.failure is None or result.failure.finding.invariant.startswith("No"), (
        result.failure
    )


def test_the_new_combination_differs_from_the_policy_it_varies(registered: str) -> None:
    """The traits matter: a failed load's eager registrations are rolled back under the new
    policy (its bucket is still there when the failure is handled), not under fifo."""
    published = {}
    for policy in (registered, "eager-rollback-fifo"):
        config = Config(8, 4, policy=policy, token_budget=16)
        s = initial_state(config)
        for decision in [
            ("arrive", 0, (1, 2, 3, 4, 5, 6, 7, 8, 9), 4, 0),
            ("begin", 0),
            ("schedule", 0, 0, 2),  # an asynchronous load of two blocks
            ("submit", 0),
            ("execute", 0, (0,)),
            ("commit", 0, ()),
        ]:
            apply(s, decision)
        published[policy] = dict(s.index)
    assert published[registered] == {} and published["eager-rollback-fifo"]


def test_a_trait_value_no_form_follows_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value added to an axis is refused by every form that does not follow it, never read as
    "register nothing"."""
    monkeypatch.setitem(AXES, "publish", (*AXES["publish"], "at-lunch"))
    odd = Traits("at-lunch", "nothing", "nothing", "never")
    monkeypatch.setitem(POLICIES, "odd", odd)
    with pytest.raises(ValueError, match="at-lunch"):
        FastModel(Config(8, 4, policy="odd"))
    with pytest.raises(ValueError, match="at-lunch"):
        reference_policies.make_policy(reference_config.PolicyTraits(*odd.values()), None)  # type: ignore[arg-type]
    own = reference_config.OWN_POLICIES["engine-registers"]  # no trait policy: the engine's own
    with pytest.raises(ValueError, match="own registration"):
        reference_policies.make_policy(own, None)  # type: ignore[arg-type]
    pytest.importorskip("z3")
    from kvspec.proofs.symbolic import Fragment

    with pytest.raises(ValueError, match="at-lunch"):
        Fragment(Config(4, 1, policy="odd"))


def test_traits_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICIES["deferred"].publish = "at-schedule"  # type: ignore[misc]
