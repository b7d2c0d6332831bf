"""A refusal raised mid-run ends ``kvspec fuzz`` as a factory's refusal does (issue #31).

The target here is the reference engine behind an adapter that, from its third engine step on,
refuses a feature (``refusal``, the adapter protocol's optional attribute) and, from then on,
misreports its pool (a mutant of the very feature refused). Judged on past the refusal, the run
would fail with a ``Disagreement``: an inverted verdict. The fuzzer must end the search at the
refusal instead: exit 2 with the feature named, the coverage line counting the run ended so.
(Planted against the fuzzer before the fix: exit 1, "counterexample found".)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.conformance.adapter import ReferenceAdapter
from kvspec.conformance.fuzz import run_cell
from kvspec.reference.choices import Choices
from kvspec.spec import Config

FEATURE = "a feature seen only at run time: the third step"


class RefusingAdapter(ReferenceAdapter):
    """The reference engine; from its third busy step on, refused and misreporting its pool."""

    def __init__(self, config: Config, choices: Choices) -> None:
        super().__init__(config, choices)
        self.refusal: str | None = None
        self.steps = 0

    def step(self) -> bool:
        busy = self.engine.step()
        self.steps += busy
        if self.steps >= 3 and self.refusal is None:
            self.refusal = FEATURE
        return busy

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        snapshot = self.engine.snapshot()
        if snapshot is None or self.refusal is None:
            return snapshot
        refcounts, free = snapshot
        return (refcounts[:-1] + (refcounts[-1] + 7,), free)  # the mutant: a wrong refcount


def refusing(config: Config, choices: Choices) -> RefusingAdapter:
    return RefusingAdapter(config, choices)


def test_a_mid_run_refusal_ends_the_search() -> None:
    result = run_cell("deferred", seconds=20.0, factory=refusing)
    assert result.failure is None, result.failure  # nothing judged past the refusal
    assert result.refusal == FEATURE
    assert result.coverage.refused_runs == 1
    assert "1 runs ended by a refusal" in result.coverage.line()


def test_kvspec_fuzz_exits_as_at_a_factory_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "refusing_target.py").write_text(
        "from tests_refusal import refusing\n".replace("tests_refusal", __name__)
    )
    monkeypatch.chdir(tmp_path)
    code = main(
        ["fuzz", "--policy", "deferred", "--seconds", "20", "--target", "refusing_target:refusing"]
    )
    out, err = capsys.readouterr()
    assert code == 2, out + err  # the exit code of a factory's refusal (bad input)
    assert "the engine refused mid-run, after" in err and FEATURE in err, err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert "1 runs ended by a refusal" in out, out
    assert "counterexample" not in out, out
