"""The adapter protocol: the reference engine through it, and ``kvspec fuzz --target`` validation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.conformance.adapter import Adapter, ReferenceAdapter, load_factory, probe, reference
from kvspec.conformance.fuzz import run_cell
from kvspec.judge import Judge
from kvspec.reference.choices import DefaultChoices
from kvspec.spec import Config

KVSPEC = [sys.executable, "-m", "kvspec"]
CONFIG = Config(num_blocks=6, block_size=4, policy="eager-unsafe", preemption="priority")


def test_the_reference_adapter_is_an_adapter_and_judged_clean() -> None:
    adapter = reference(CONFIG, DefaultChoices())
    assert isinstance(adapter, Adapter)
    adapter.add_request(0, (1, 2, 3, 4, 5), 2, 0)
    adapter.add_request(1, (1, 2, 3, 4, 6), 2, 0)
    assert adapter.live_requests() == [0, 1]
    while adapter.step():
        pass
    assert adapter.live_requests() == []
    judge = Judge.spec(CONFIG)
    assert judge.feed_all(adapter.events) is None
    snapshot = adapter.snapshot()
    assert snapshot is not None and judge.compare(*snapshot) is None
    assert ("publish", 0, 0, 1) in adapter.events  # eager-unsafe registers block 1 for r0
    assert adapter.reset_prefix_cache() and adapter.events[-1] == ("unpublish", 1)


def test_an_engine_with_a_wrong_effect_is_a_disagreement() -> None:
    """The judge catches an adapter whose engine frees in the wrong order."""

    class Reversed(ReferenceAdapter):
        def step(self) -> bool:
            start = len(self.events)
            busy = super().step()
            frees = [i for i in range(start, len(self.events)) if self.events[i][0] == "free"]
            if len(frees) >= 2:
                a, b = frees[0], frees[1]
                self.events[a], self.events[b] = self.events[b], self.events[a]
            return busy

    result = run_cell("deferred", seconds=30, factory=lambda c, ch: Reversed(c, ch), seed_value=3)
    assert result.failure is not None
    assert result.failure.finding.invariant == "Disagreement"


def _refuses(config: Config, choices: object) -> Adapter:
    raise ValueError("this engine runs only deferred")


def _not_an_adapter(config: Config, choices: object) -> object:
    return object()


def _wrong_signature() -> object:
    return object()


NOT_CALLABLE = 3


@pytest.mark.parametrize(
    "target, fragment",
    [
        ("nocolon", "expected module:factory"),
        ("no_such_module_kvspec:f", "cannot import no_such_module_kvspec"),
        ("test_adapter:NOT_CALLABLE", "no callable 'NOT_CALLABLE'"),
        ("test_adapter:_refuses", "runs only deferred"),
        ("test_adapter:_not_an_adapter", "is not an adapter"),
        ("test_adapter:_wrong_signature", "the factory failed: TypeError"),
    ],
)
def test_bad_targets_exit_2_with_one_line(target: str, fragment: str) -> None:
    argv = ["fuzz", "--policy", "eager-unsafe", "--seconds", "1", "--target", target]
    env_path = str(Path(__file__).parent)
    done = subprocess.run(
        KVSPEC + argv, capture_output=True, text=True, env={"PYTHONPATH": env_path, **_env()}
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and fragment in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_loads_need_an_adapter_that_supports_them() -> None:
    class NoLoads(ReferenceAdapter):
        supports_loads = False

    with pytest.raises(ValueError, match="no external KV loads"):
        probe(lambda c, ch: NoLoads(c, ch), CONFIG, DefaultChoices(), "x", loads=True)
    assert load_factory("kvspec.conformance.adapter:reference") is reference


def test_cli_fuzzes_the_reference_target() -> None:
    argv = ["fuzz", "--policy", "deferred", "--depth", "1", "--seconds", "3"]
    argv += ["--target", "kvspec.conformance.adapter:reference"]
    done = subprocess.run(KVSPEC + argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("no counterexample for deferred")
    runs = int(done.stdout.split(" runs,")[0].rsplit(" ", 1)[1])
    assert runs > 0


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


OBSERVED = Config(num_blocks=6, block_size=4, policy="eager-unsafe", token_budget=16)
ADMIT_R0 = [("arrive", 0, (1, 2, 3, 4, 5), 2, 0), ("begin", 0), ("schedule", 0, 5, 0)]


def _judge_both(effects: list[tuple[object, ...]]) -> tuple[object, object]:
    strict, observed = Judge.spec(OBSERVED), Judge.spec(OBSERVED, observed=True)
    for judge in (strict, observed):
        judge.feed_all(ADMIT_R0 + effects + [("submit", 0)])
        judge.settle()
    return strict.finding, observed.finding


def test_observed_judging_takes_the_engines_free_block_choice() -> None:
    """The engine allocates blocks 3 and 1 where the spec's queue head gives 1 and 2."""
    effects = [("hit", 0, ()), ("alloc", 0, 3), ("alloc", 0, 1), ("publish", 0, 0, 3)]
    strict, observed = _judge_both(effects)
    assert strict is not None and strict.invariant == "Disagreement"
    assert observed is None


@pytest.mark.parametrize(
    "effects, fragment",
    [
        ([("hit", 0, ()), ("alloc", 0, 0), ("alloc", 0, 1), ("publish", 0, 0, 0)], "not free"),
        ([("hit", 0, ()), ("alloc", 0, 2), ("alloc", 0, 2)], "not free"),
        ([("hit", 0, (4,)), ("alloc", 0, 1)], "not published"),
        ([("hit", 0, ()), ("alloc", 0, 1), ("alloc", 0, 2), ("unpublish", 2)], "not published"),
    ],
)
def test_observed_judging_refuses_illegal_choices(
    effects: list[tuple[object, ...]], fragment: str
) -> None:
    _, observed = _judge_both(effects)
    assert observed is not None and observed.invariant == "Illegal"
    assert fragment in observed.message


def test_observed_judging_accepts_an_engine_dropping_a_registration() -> None:
    effects = [("hit", 0, ()), ("alloc", 0, 1), ("alloc", 0, 2), ("publish", 0, 0, 1)]
    effects += [("unpublish", 1)]
    strict, observed = _judge_both(effects)
    assert strict is not None and observed is None


def test_the_reference_engine_passes_observed_judging() -> None:
    class Observed(ReferenceAdapter):
        judging = "observed"

    result = run_cell(
        "deferred", "general", "priority", None, seconds=8, factory=lambda c, ch: Observed(c, ch)
    )
    assert result.failure is None, result.failure and result.failure.finding
    assert result.runs > 10
