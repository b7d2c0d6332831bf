"""Proofs for every size (``proofs/parametric.py``, ``proofs/all_sizes.py``, ``kvspec prove
--all-sizes``): the safe cells' invariant is inductive over unbounded sorts, planted bugs break
the proof, and the unsafe cells end in their shortest counterexample at the smallest sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvspec import twins
from kvspec.cli import main
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


FIRST_FAILURE = {
    "eager-publish": ("schedule", "NoUnwrittenPublish"),
    "no-evict": ("schedule", "NoUnwrittenPublish"),
    "lemma-too-strong": ("preempt", "PublishedIsHeld"),
    "hit-any-block": ("schedule", "NoUnwrittenRead"),
    "publish-failed-load": ("commit", "NoUnwrittenPublish"),
    "admit-while-stale": ("schedule", "NoUnwrittenRead"),
    "garbage-on-deliver": ("preempt", "NoUnwrittenRead"),
    "publish-partial-block": ("commit", "NoUnwrittenPublish"),
    "skip-reserved-write": ("schedule", "HeldBlocksHold"),
    "publish-rejected-drafts": ("commit", "NoUnwrittenPublish"),
    "move-back-keeps-writes": ("commit", "NoUnwrittenRead"),
    "recompute-rewrites-published": ("schedule", "HeldBlocksHold"),
}
"""Each plant's first obligation that is not discharged (docs/proofs.md). Over the unbounded
sorts Z3 answers them ``unknown``, at the query's time limit or before: naming the obligation
is what tells a plant's failure from a real obligation timing out on a loaded machine, so the
limit can be short."""


@pytest.mark.parametrize("planted", [p for p in pm.PLANTS if p not in TAKE_AWAY])
def test_a_planted_bug_fails_the_proof(planted: str) -> None:
    """Each plant lets the model do something the spec must not; the proof fails at the
    obligation that plant breaks (every obligation before it discharged)."""
    result = all_sizes.prove(planted=planted, timeout_ms=3_000)
    assert result.verdict != "proved"
    failed = result.failed
    assert failed is not None and failed.verdict in ("sat", "unknown")
    assert (failed.action, failed.conjunct) == FIRST_FAILURE[planted]
    assert all(o.verdict == "unsat" for o in result.obligations[:-1])


def test_the_eager_model_has_a_counterexample_to_induction_at_small_sizes() -> None:
    cti = all_sizes.find_cti("schedule", "PublishedWritten", "eager-publish")
    assert cti is not None and not cti.startswith("undecided")
    assert all_sizes.find_cti("schedule", "PublishedWritten") is None  # the real model: none


def _prove(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``kvspec prove --all-sizes ARGS`` in this process (the proof is Z3's; a fresh process
    adds only the imports): its exit code and what it printed."""
    code = main(["prove", "--all-sizes", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("policy", all_sizes.SAFE_POLICIES)
def test_prove_all_sizes_proves_the_safe_policies(
    policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _prove(capsys, "--policy", policy, "--discipline", "general")
    assert code == 0, out
    assert "PROVED FOR EVERY SIZE" in out


def test_prove_all_sizes_proves_async_with_stale_output_dropped_or_delivered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = _prove(capsys, "--policy", "hide-uncommitted", "--depth", "2", "--async")
    assert code == 0, out
    assert "PROVED FOR EVERY SIZE" in out
    late = ("--depth", "2", "--async", "--stale-output", "deliver")
    code, out = _prove(capsys, "--policy", "deferred", *late)
    assert code == 0, out
    assert "PROVED FOR EVERY SIZE (deferred, vllm/fcfs, async, stale output delivered" in out


def test_prove_all_sizes_proves_synchronous_drafts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _prove(capsys, "--policy", "deferred", "--spec-tokens", "3")
    assert code == 0, out
    assert "PROVED FOR EVERY SIZE (deferred, vllm/fcfs, up to 3 draft tokens;" in out


@pytest.mark.parametrize("policy", all_sizes.SAFE_POLICIES)
def test_prove_all_sizes_proves_async_drafts(
    policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Drafts under async scheduling: a rejection moves the later entries back
    (``Model._move_back``), and the invariant is still inductive."""
    code, out = _prove(capsys, "--policy", policy, "--async", "--depth", "2", "--spec-tokens", "2")
    assert code == 0, out
    assert f"PROVED FOR EVERY SIZE ({policy}, vllm/fcfs, async, up to 2 draft tokens;" in out


def test_a_move_back_that_keeps_the_old_writes_has_a_counterexample_to_induction() -> None:
    """The planted move-back (entries moved, their pending writes left where they were) over
    the unbounded sorts is ``unknown`` (``test_a_planted_bug_fails_the_proof``); at 1 request
    and 2 blocks the same obligation has a concrete counterexample to induction, and the real
    model has none there."""
    cti = all_sizes.find_cti("commit", "HeldBlocksHold", "move-back-keeps-writes", reqs=1)
    assert cti is not None and not cti.startswith("undecided"), cti
    assert all_sizes.find_cti("commit", "HeldBlocksHold", reqs=1) is None


def test_prove_all_sizes_with_drafts_fails_on_a_planted_bug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command's proof with a commit that publishes the positions its rejection rolled
    back (``publish-rejected-drafts``): not proved, exit 3, the failed obligation named."""
    proof = all_sizes.prove
    monkeypatch.setattr(
        all_sizes, "prove", lambda: proof(planted="publish-rejected-drafts", timeout_ms=3_000)
    )
    code, out = _prove(capsys, "--policy", "hide-uncommitted", "--spec-tokens", "2")
    assert code == 3, out
    assert "NOT PROVED FOR EVERY SIZE (hide-uncommitted, vllm/fcfs, up to 2 draft tokens)" in out
    assert "obligation commit / NoUnwrittenPublish" in out


@pytest.mark.parametrize(
    "args, code, said",
    [
        (("--spec-tokens", "2"), 2, "--spec-tokens needs --all-sizes"),
        (("--all-sizes", "--spec-tokens", "65"), 2, "--spec-tokens"),
        (("--all-sizes", "--spec-tokens", "-1"), 2, "--spec-tokens"),
        (
            ("--all-sizes", "--spec-tokens", "2", "--async", "--stale-output", "deliver"),
            3,
            "_move_back",
        ),
    ],
)
def test_prove_draft_counts_are_checked_before_any_proof(
    args: tuple[str, ...], code: int, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A draft count out of range or without --all-sizes is bad input (one line); drafts under
    async scheduling with stale output delivered are not proved for every size, and the answer
    says why (exit 3)."""
    assert main(["prove", "--policy", "deferred", *args]) == code
    out = capsys.readouterr()
    assert said in out.out + out.err
    if code == 2:
        assert out.out == "" and len(out.err.strip().splitlines()) == 1, out.err


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
    """In a fresh process, as a user runs it (the exit code through the interpreter's exit)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "prove", "--all-sizes"]
        + ["--policy", "eager-unsafe", "--discipline", "general"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NOT INDUCTIVE" in done.stdout
    assert "counterexample to induction" in done.stdout
    assert "COUNTEREXAMPLE" in done.stdout and "NoUnwrittenPublish fails after 4" in done.stdout
