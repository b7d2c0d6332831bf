"""The engine's own books compared (``conformance/engine_view.py``): bugs planted in a hash index
or a free count that the events and the snapshot do not show at once are named, in the reference
engine, nano-vllm-fork and both vLLM releases (those two in their venvs, skipped where not
built); a correct engine's books agree; an adapter's malformed view is bad input."""

from __future__ import annotations

import json
import os
import subprocess
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import preforked
import pytest
from planted import BOOKS, Plant
from vllm_venvs import VENVS

from kvspec.conformance import adapter
from kvspec.conformance.adapter import ReferenceAdapter
from kvspec.conformance.engine_view import PoolView, compare_view
from kvspec.conformance.fuzz import run_cell
from kvspec.conformance.protocol import ProtocolError, check_adapter
from kvspec.judge.findings import explanation
from kvspec.spec import Config

ROOT = Path(__file__).resolve().parent.parent
NANO = ROOT / ".venv-nano"


@pytest.mark.parametrize("plant", BOOKS, ids=lambda p: p.name)
def test_a_bug_in_the_engine_s_books_is_named(plant: Plant) -> None:
    with plant.patch():
        result = run_cell("deferred", seconds=30, seed_value=0)
    assert result.failure is not None
    assert result.failure.finding.invariant == plant.expect, result.failure.finding


@pytest.mark.parametrize("plant", BOOKS, ids=lambda p: p.name)
def test_without_the_view_the_same_run_names_no_book(
    plant: Plant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the same seeded run reported before the view: a bare Disagreement or Illegal."""
    monkeypatch.delattr(adapter.ReferenceAdapter, "pool_view")
    with plant.patch():
        result = run_cell("deferred", seconds=30, seed_value=0)
    assert result.failure is not None
    assert result.failure.finding.invariant in ("Disagreement", "Illegal")


@pytest.mark.parametrize("engine", ["fast", "spec"])
def test_a_correct_engine_s_books_agree(engine: str) -> None:
    for policy in ("deferred", "eager-unsafe"):
        result = run_cell(policy, seconds=3, seed_value=1, engine=engine)
        assert result.failure is None, result.failure and result.failure.finding
        assert result.runs > 10


def _model() -> SimpleNamespace:
    """The fast model's shape: blocks 1 and 2 cached under two prefixes, 2 and 3 free."""
    return SimpleNamespace(
        config=SimpleNamespace(),
        key=[None, 10, 20, None],
        index={10: [1], 20: [2]},
        free=OrderedDict.fromkeys([2, 3]),
    )


def test_each_difference_of_the_books_is_named() -> None:
    good = PoolView(free_count=2, evictable=(2,), index=((2,), (1,)))
    assert compare_view(good, _model(), 7) is None
    cases = {
        "the engine's hash index holds blocks [3]": PoolView(index=((1,), (2,), (3,))),
        "blocks [2] were published": PoolView(index=((1,),)),
        "blocks [1, 2] are under one hash": PoolView(index=((1, 2),)),
        "holds blocks [1] under more than one hash": PoolView(index=((1,), (1,), (2,))),
        "the engine counts 3 free blocks": PoolView(free_count=3),
        "the engine counts blocks [] as evictable": PoolView(evictable=()),
    }
    for words, view in cases.items():
        found = compare_view(view, _model(), 7)
        assert found is not None and words in found.message, (words, found)
        assert found.event == 7
        assert found.invariant in ("HashIndexConsistent", "FreeCountExact", "EvictableExact")
        assert explanation(found.invariant)
    assert compare_view(None, _model(), 7) is None
    hybrid = _model()
    hybrid.config.groups = ("full", "sliding")  # docs/hybrid.md: not compared yet
    assert compare_view(PoolView(free_count=3), hybrid, 7) is None


def test_a_malformed_view_is_bad_input() -> None:
    class ListIndex(ReferenceAdapter):
        def pool_view(self) -> PoolView:
            view = super().pool_view()
            return PoolView(view.free_count, view.evictable, [list(b) for b in view.index or ()])  # type: ignore[arg-type]

    config = Config(num_blocks=6, block_size=2, policy="eager-unsafe")
    assert check_adapter(adapter.reference, config) > 0
    with pytest.raises(ProtocolError, match=r"pool_view\(\): index is a list, not a tuple"):
        check_adapter(ListIndex, config)


def _child(python: Path, engine: str, names: list[str]) -> dict[str, dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / ".pp")}
    argv = ["bench/planted_child.py", engine, "tests", "60", *names]
    if engine.startswith("vllm"):  # vLLM imported once (tests/preforked.py)
        env["VLLM_TARGET_DEVICE"] = "cpu"  # what planted_child.py sets before vLLM's import
        done = preforked.run(python, argv, cwd=ROOT, env=env, timeout=400)
    else:
        done = subprocess.run(
            [str(python), *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=400
        )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {str(row["name"]): row for row in rows}


@pytest.mark.skipif(not (NANO / ".stamp").exists(), reason="no .venv-nano: run make thirdparty")
def test_nano_s_used_set_left_behind_is_a_miscount() -> None:
    rows = _child(NANO / "bin" / "python", "nano", ["nano-used-left-behind"])
    assert rows["nano-used-left-behind"]["finding"] == "FreeCountExact", rows


@pytest.mark.e2e  # vLLM's objects in a process of each release's environment (make test-e2e)
@pytest.mark.parametrize("venv", VENVS)
def test_vllm_s_books_are_compared(venv: Path) -> None:
    names = ["vllm-index-left-behind", "vllm-free-miscount"]
    rows = _child(venv / "bin" / "python", "vllm", names)
    assert rows["vllm-index-left-behind"]["finding"] == "HashIndexConsistent", rows
    assert rows["vllm-free-miscount"]["finding"] == "FreeCountExact", rows
