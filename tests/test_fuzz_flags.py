"""``kvspec fuzz --spec-tokens K`` and ``--sliding-window W`` reach the reference engine's drafts
and sliding window (issue #31, "the fuzzer reaches what the plugin judges"): the coverage line
shows them exercised, and a bug planted where only they lead is found through the flag, and not
without it. Planted: a drafter that proposes K + 1 draft tokens (``Engine._propose``), and a
window that frees a block its next token still reads (``KVCacheManager.skipped`` one token
late)."""

from __future__ import annotations

import pytest

from kvspec.cli import main
from kvspec.conformance.fuzz import run_cell
from kvspec.reference import engine as engine_module
from kvspec.reference.kv_cache_manager import KVCacheManager


def _overdrafting(self: engine_module.Engine, drafting: list) -> None:
    for req in drafting:
        req.drafts = self.config.spec_tokens + 1  # the planted bug: one draft over K


def _late_window(self: KVCacheManager, processed: int) -> int:
    if self.window is None:
        return 0
    return max(0, processed - self.window + 1 + self.block_size) // self.block_size  # planted


def test_drafts_are_fuzzed_and_hold() -> None:
    result = run_cell("deferred", seconds=4.0, spec_tokens=2)
    assert result.failure is None, result.failure
    assert result.coverage.accepted_drafts > 10, result.coverage
    assert "accepted draft tokens" in result.coverage.line()


def test_a_planted_drafter_bug_is_found_only_through_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_module.Engine, "_propose", _overdrafting)
    assert run_cell("deferred", seconds=3.0).failure is None  # no drafts: unreachable
    found = run_cell("deferred", seconds=30.0, spec_tokens=2, shrink=False).failure
    assert found is not None, "the drafter's bug was not found with --spec-tokens 2"


def test_a_sliding_window_is_fuzzed_and_holds(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fuzz", "--policy", "deferred", "--sliding-window", "4", "--seconds", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "window 4" in out and "blocks freed before a window" in out, out


def test_a_planted_window_bug_is_found_through_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(KVCacheManager, "skipped", _late_window)
    assert run_cell("deferred", seconds=3.0).failure is None  # full attention: unreachable
    argv = ["fuzz", "--policy", "deferred", "--sliding-window", "4", "--seconds", "30"]
    code = main([*argv, "--no-shrink"])
    out = capsys.readouterr().out
    assert code == 1 and "counterexample found" in out, out


def test_the_flags_are_checked() -> None:
    assert main(["fuzz", "--policy", "deferred", "--spec-tokens", "-1"]) == 2
    assert main(["fuzz", "--policy", "deferred", "--sliding-window", "0"]) == 2
