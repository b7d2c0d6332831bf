"""SGLang 0.5.23's hybrid linear-attention model through the adapter (``sglang_adapter/mamba.py``):
the tree cache SGLang builds for it (FULL + MAMBA over a ``HybridReqToTokenPool``), and the
full-group and slot-group events the adapter reads off it, held against SGLang's own state on
seeded random workloads after every loop iteration.

Run in ``.venv-sglang`` (``make thirdparty``) as a subprocess (``tests/sglang_mamba_checks.py``);
skipped with the reason without it.
"""

from __future__ import annotations

import pytest
from sglang_cases import needs_sglang, run_cases

# SGLang in a process of its own, once per xdist worker that runs a test here (make test-e2e)
pytestmark = pytest.mark.e2e

CASES = (
    "build",
    "replay:20",
    "python:10",
    "judge:mamba",
    "judge:retract",
    "judge:short",
    "judge:skip-cow",
    "judge:overlap",
    "extra",
    "judge:extra",
    "judge-trace",
)


@pytest.fixture(scope="module")
def case() -> dict[str, str]:
    """Each case's line, from one subprocess (SGLang takes seconds to import)."""
    return run_cases("tests/sglang_mamba_checks.py", CASES)


@needs_sglang
def test_sglang_resolves_the_model_to_no_buffer_and_builds_full_and_mamba(
    case: dict[str, str],
) -> None:
    """SGLang's ``auto`` strategy on the LFM2-like config: ``no_buffer``, overlap forced off;
    ``create_tree_cache``: ``UnifiedRadixCache`` with FULL and MAMBA over the Rust ``TreeCore``,
    on a ``HybridReqToTokenPool`` of 3 state slots per running request."""
    assert case["build"] == (
        "no_buffer overlap-off True UnifiedRadixCache FULL+MAMBA rust HybridReqToTokenPool "
        "slots 9 of Lfm2ForCausalLM"
    ), case["build"]


def _counts(line: str) -> tuple[dict[str, int], dict[str, int]]:
    import ast

    assert line.startswith("none {"), line
    kinds, _, paths = line[len("none ") :].partition("} {")
    return ast.literal_eval(kinds + "}"), ast.literal_eval("{" + paths)


@needs_sglang
@pytest.mark.parametrize("name", ["replay:20", "python:10"])
def test_the_events_replayed_are_sglangs_rows_slots_tree_states_and_free_slots(
    case: dict[str, str], name: str
) -> None:
    """After every loop iteration of 20 seeded workloads (10 over the Python ``TreeCore``, whose
    nodes also give each state's key length and lock count): no difference, and the paths the
    contract names were taken: states hit by copy, snapshots by copy and by donation, a copy
    dropped where the node had a state, evictions of states, retractions. Planted in the
    recorder, a snapshot one token late (``snapshot length differs``), a hit without its
    source (``hit 3 FULL pages and states {}``) and a lock not counted were each named."""
    kinds, paths = _counts(case[name])
    for kind in ("hit/g", "alloc/g", "snapshot/g", "evict", "unpublish", "preempt"):
        assert kinds.get(kind, 0) > 0, (kind, kinds)
    for path in (
        "states hit by copy",
        "snapshots by copy",
        "snapshots by donation",
        "state evictions",
        "states already cached (copy dropped)",
    ):
        assert paths.get(path, 0) > 0, (path, paths)


@needs_sglang
@pytest.mark.parametrize("name", ["judge:mamba", "judge:retract"])
def test_kvspec_fuzz_judges_the_mamba_factory_with_no_counterexample(
    case: dict[str, str], name: str
) -> None:
    """20 s of ``kvspec fuzz`` on ``mamba_factory`` and ``mamba_retract_factory`` (depth 1,
    seed 0): the spec's slot group follows every copy, snapshot and eviction SGLang made."""
    assert case[name].startswith("exit 0 False no counterexample"), case[name]


@needs_sglang
def test_a_planted_short_snapshot_is_named_state_at_its_boundary(case: dict[str, str]) -> None:
    """``mutants.ShortSnapshot``: SGLang's MAMBA component caches a running request's state one
    token short: ``StateAtItsBoundary``, within the 30 s."""
    line = case["judge:short"]
    assert line.startswith("exit 1 False counterexample found after"), line
    assert "violated: StateAtItsBoundary: group 1's block" in line, line


@needs_sglang
def test_a_planted_skipped_copy_on_write_is_named_hit_served_by_every_group(
    case: dict[str, str],
) -> None:
    """``mutants.SkipCow``: SGLang's match keeps the FULL hit but drops the state's copy into
    the request's slot: ``HitServedByEveryGroup`` (group 1 serves none of the hit), within the
    30 s."""
    line = case["judge:skip-cow"]
    assert line.startswith("exit 1 False counterexample found after"), line
    assert "violated: HitServedByEveryGroup:" in line and "not served by group 1 (slot)" in line


@needs_sglang
def test_the_overlap_loop_is_refused_by_name(case: dict[str, str]) -> None:
    """SGLang's auto strategy forces the loop without overlap for the model: a depth-2 cell
    exits 2 naming depth 1, no traceback."""
    words = case["judge:overlap"].split(maxsplit=3)
    assert words[:3] == ["exit", "2", "False"], case["judge:overlap"]
    assert "depth 1, not 2" in words[3], words[3]


@needs_sglang
def test_sglang_resolves_qwen3_next_to_extra_buffer_under_overlap(case: dict[str, str]) -> None:
    """SGLang's ``auto`` on the Qwen3-Next-like config (``mamba.EXTRA_MODEL``): ``extra_buffer``
    with its default overlap loop (overlap kept), ``no_buffer`` with overlap forced off once
    ``--disable-overlap-schedule`` is given: the strategy the spec's track slots model."""
    assert case["extra"] == (
        "Qwen3NextForCausalLM overlap extra_buffer overlap-off False; "
        "disabled no_buffer overlap-off True"
    ), case["extra"]


@needs_sglang
def test_the_extra_buffer_factory_is_refused_by_name(case: dict[str, str]) -> None:
    """``mamba_extra_factory`` (depth 2, the overlap loop SGLang keeps for it): exit 2, one line
    naming ``extra_buffer`` and why (the recorder reports no track slots yet), no traceback."""
    words = case["judge:extra"].split(maxsplit=3)
    assert words[:3] == ["exit", "2", "False"], case["judge:extra"]
    assert "extra_buffer refused" in words[3] and "Traceback" not in words[3], words[3]


@needs_sglang
def test_the_planted_short_snapshot_trace_file_is_judged_the_same_by_kvspec_check(
    case: dict[str, str],
) -> None:
    """The counterexample written as a v1 trace (its header's groups ``full`` and ``slot``, its
    ``{"ev": "snapshot", ..., "group": 1}``) reads back: ``kvspec check`` exits 1 naming
    ``StateAtItsBoundary``."""
    fuzz, check = case["judge-trace"].split("\n")
    assert fuzz.startswith("exit 1 False counterexample found after"), fuzz
    assert check.startswith("exit 1 False") and ": StateAtItsBoundary: group 1's block" in check
