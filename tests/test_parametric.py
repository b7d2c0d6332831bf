"""Proofs for every size (``proofs/parametric.py``, ``proofs/all_sizes.py``, ``kvspec prove
--all-sizes``): the safe cells' invariant is inductive over unbounded sorts, planted bugs break
the proof, and the unsafe cells end in their shortest counterexample at the smallest sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvspec import twins
from kvspec.proofs import all_sizes
from kvspec.proofs import parametric as pm
from kvspec.spec.state import Config


def test_the_invariant_is_inductive_for_every_size() -> None:
    result = all_sizes.prove(stop_at_first=False)
    assert result.verdict == "proved", result.failed
    assert all(o.verdict == "unsat" for o in result.obligations)
    actions = {o.action for o in result.obligations}
    assert actions == {"initial", *pm.Model.ACTIONS}
    conjuncts = {o.conjunct for o in result.obligations}
    assert set(pm.SAFETY) | {"FreshHolders"} <= conjuncts


TAKE_AWAY = (
    "placeholders-resolve",
    "stale-dropped",
    "stale-samples-resolve",
    "one-position-blocks",
    "drafts-resolve",
)
"""Plants that only take something away from the model: the twin test refuses them
(``test_parametric_twin.py``), the proof cannot."""


@pytest.mark.parametrize("planted", [p for p in pm.PLANTS if p not in TAKE_AWAY])
def test_a_planted_bug_fails_the_proof(planted: str) -> None:
    """Each plant lets the model do something the spec must not."""
    result = all_sizes.prove(planted=planted, timeout_ms=10_000)
    assert result.verdict != "proved"
    failed = result.failed
    assert failed is not None and failed.verdict in ("sat", "unknown")


def test_the_eager_model_has_a_counterexample_to_induction_at_small_sizes() -> None:
    cti = all_sizes.find_cti("schedule", "PublishedWritten", "eager-publish")
    assert cti is not None and not cti.startswith("undecided")
    assert all_sizes.find_cti("schedule", "PublishedWritten") is None  # the real model: none


def _prove(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "prove", "--all-sizes", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("policy", all_sizes.SAFE_POLICIES)
def test_prove_all_sizes_proves_the_safe_policies(policy: str) -> None:
    done = _prove("--policy", policy, "--discipline", "general")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PROVED FOR EVERY SIZE" in done.stdout


def test_prove_all_sizes_proves_async_with_stale_output_dropped_or_delivered() -> None:
    done = _prove("--policy", "hide-uncommitted", "--depth", "2", "--async")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PROVED FOR EVERY SIZE" in done.stdout
    late = ("--depth", "2", "--async", "--stale-output", "deliver")
    done = _prove("--policy", "deferred", *late)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PROVED FOR EVERY SIZE (deferred, vllm/fcfs, async, stale output delivered" in (
        done.stdout
    )


def test_prove_all_sizes_says_why_a_rollback_policy_is_not_proved() -> None:
    """The rollback policies' vllm cells: no counterexample at the smallest sizes, and the
    reason the parametric model does not follow them, from its row of ``twins.py``."""
    problem = twins.refusal(all_sizes.FORM, Config(4, 1, policy="eager-rollback-fifo"))
    assert problem is not None and problem.what == "publish=at-schedule"
    assert "vllm" in str(problem) and "rollback" in str(problem)
    for policy in all_sizes.POLICIES:
        problem = twins.refusal(all_sizes.FORM, Config(4, 1, policy=policy))
        assert (problem is None) == (policy in all_sizes.SAFE_POLICIES)
        if problem is not None:  # every policy left out says why
            assert problem.what in twins.twin(all_sizes.FORM).unfollowed, policy


def test_prove_all_sizes_refutes_an_unsafe_cell_with_the_shortest_counterexample() -> None:
    done = _prove("--policy", "eager-unsafe", "--discipline", "general")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NOT INDUCTIVE" in done.stdout
    assert "counterexample to induction" in done.stdout
    assert "COUNTEREXAMPLE" in done.stdout and "NoUnwrittenPublish fails after 4" in done.stdout
