"""Hybrid models' native KV-event streams, judged in process and from their capture files.

* vLLM, every supported release (``tests/kv_stream_hybrid_checks.py`` run in each vLLM venv):
  ``hybrid.swa_factory``'s groups both store and remove, each event carrying its group and kind;
  ``hybrid.mamba_factory``'s Mamba ``align`` group sends stores with more tokens than hashes (the
  known finding ``vllm-mamba-store-tokens``): in process the judge reads them by name and the
  rest of the stream holds; from the capture ``kvspec check --kv-events`` reports the finding
  (``StoreConsistent``, exit 1) and holds with ``--known vllm-mamba-store-tokens`` (exit 0). A
  stored block whose parent was never announced is named ``ParentAnnounced`` both ways (exit 1).
* SGLang 0.5.23 (``tests/kv_stream_sglang_swa_checks.py`` in ``.venv-sglang``): the FULL + SWA
  tree's stream in both loops holds against the tree's FULL pages (SWA tombstones reached and
  still announced), in process and from the capture (exit 0); a lost ``BlockStored`` is named
  ``ViewEqualsCache`` in process and ``ParentAnnounced`` from the capture, an unannounced parent
  ``ParentAnnounced`` both ways (exit 1).
* SGLang 0.5.23 (``tests/kv_stream_sglang_mamba_checks.py``, one process): the FULL + MAMBA
  tree's stream holds against the tree's FULL pages (no group, no state announced; states hit,
  snapshots by copy and by donation, state evictions reached, and pages announced that no state
  extends; the fuzzer's generic slot counters, read from the adapter's events, equal the
  recorder's own), in process and from the capture (exit 0); a lost ``BlockStored`` is named
  ``ViewEqualsCache``, an unannounced parent ``ParentAnnounced``, a ``BlockRemoved`` sent twice
  ``RemovalNamesAnnounced`` (exit 1 from the capture)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from vllm_venvs import VENVS, run_in

ROOT = Path(__file__).resolve().parent.parent
KNOWN = "vllm-mamba-store-tokens"


def _run(venv: Path, folder: Path, model: str, *plant: str) -> list[list[str]]:
    done = run_in(venv, "tests/kv_stream_hybrid_checks.py", str(folder), model, *plant)
    return [line.split(" | ") for line in done.stdout.splitlines() if " | " in line]


@pytest.mark.e2e  # minutes per release: make test-e2e
@pytest.mark.parametrize("venv", VENVS)
def test_a_hybrid_models_stream_is_judged_per_group(venv: Path, tmp_path: Path) -> None:
    clean = _run(venv, tmp_path, "swa")
    assert len(clean) == 2, clean  # depths 1 and 2
    for said, counts, groups, checked, _ in clean:
        assert said == "none" and int(counts.split()[2]) >= 10, counts
        assert "stored groups [0, 1] removed groups [0, 1]" in groups, groups
        assert "'full_attention'" in groups and "'sliding_window'" in groups, groups
        assert checked.startswith("check exit 0"), checked
    planted = _run(venv, tmp_path, "swa", "vllm-stream-parent-unannounced")
    for said, _, _, checked, _ in planted:
        assert said.startswith("ParentAnnounced: "), said
        assert checked.startswith("check exit 1") and "ParentAnnounced" in checked, checked


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_a_mamba_models_stream_is_judged_with_its_known_finding_named(
    venv: Path, tmp_path: Path
) -> None:
    clean = _run(venv, tmp_path, "mamba")
    assert len(clean) == 2, clean
    for said, counts, groups, checked, known in clean:
        assert said == "none" and int(counts.split()[2]) >= 10, counts
        assert "stored groups [0, 1] removed groups [0, 1]" in groups, groups
        assert "'mamba'" in groups, groups
        sparse = int(groups.split(" sparse ")[1].split()[0])
        assert sparse >= 1 and f"known {{'{KNOWN}': {sparse}}}" in groups, groups
        assert checked.startswith("check exit 1") and "StoreConsistent" in checked, checked
        assert known.startswith("check exit 0") and f"known finding {KNOWN} met" in known, known
    planted = _run(venv, tmp_path, "mamba", "vllm-stream-parent-unannounced")
    for said, _, _, _, known in planted:
        assert said.startswith("ParentAnnounced: "), said
        assert known.startswith("check exit 1") and "ParentAnnounced" in known, known


def _sglang(folder: Path, *plant: str, script: str = "swa") -> list[list[str]]:
    venv = ROOT / ".venv-sglang"
    if not (venv / ".stamp").exists():
        pytest.skip("no .venv-sglang: run `make thirdparty` to build it")
    checks = f"tests/kv_stream_sglang_{script}_checks.py"
    done = subprocess.run(
        [str(venv / "bin" / "python"), checks, str(folder), *plant],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / ".pp")},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split(" | ") for line in done.stdout.splitlines() if " | " in line]


@pytest.mark.e2e
def test_sglangs_swa_tree_stream_is_judged_in_both_loops(tmp_path: Path) -> None:
    clean = _sglang(tmp_path)
    assert len(clean) == 5, clean  # swa_factory: three workloads; swa_sync_factory: two
    for run, said, counts, where, _, checked in clean:
        assert said == "none" and int(counts.split()[0]) >= 4, (run, counts)
        assert where == "stored in [('GPU', None)]", where  # SGLang names no group
        assert checked.startswith("check exit 0"), checked
    tombstones = [int(line[4].split()[0]) for line in clean]
    assert sum(tombstones) > 0, tombstones  # the view announced SWA-tombstoned pages, rightly
    lost = _sglang(tmp_path, "lost-store")
    assert len(lost) == 2, lost  # both loops
    for _, said, _, _, _, checked in lost:
        assert said.startswith("ViewEqualsCache: ") and "never announced" in said, said
        assert checked.startswith("check exit 1") and "ParentAnnounced" in checked, checked
    parent = _sglang(tmp_path, "unannounced-parent")
    for _, said, _, _, _, checked in parent:
        assert said.startswith("ParentAnnounced: ") and "0x5eed5eed" in said, said
        assert checked.startswith("check exit 1") and "ParentAnnounced" in checked, checked


@pytest.mark.e2e
def test_sglangs_mamba_tree_stream_is_judged_and_its_faults_named(tmp_path: Path) -> None:
    runs = {line[0]: line for line in _sglang(tmp_path, script="mamba")}
    assert len(runs) == 7, sorted(runs)  # four clean workloads, three planted faults
    clean = [line for run, line in runs.items() if run.endswith(" clean")]
    for run, said, counts, where, _, paths, counted, checked in clean:
        assert said == "none" and int(counts.split()[0]) >= 1, (run, said, counts)
        assert where == "stored in [('GPU', None)]", where  # SGLang names no group, no state
        assert checked.startswith("check exit 0"), (run, checked)
        recorded = dict(reversed(p.split(" ", 1)) for p in paths.split(", "))
        mine = [recorded[p] for p in ("states hit by copy", "snapshots by copy")]
        mine.append(recorded["snapshots by donation"])
        assert counted == "events: " + " ".join(mine), (run, paths, counted)  # generic counters
    reached = [dict(reversed(p.split(" ", 1)) for p in line[5].split(", ")) for line in clean]
    for path in ("states hit by copy", "snapshots by copy", "snapshots by donation"):
        assert sum(int(r[path]) for r in reached) > 0, (path, reached)
    stateless = {line[0].split()[1]: int(line[4].split()[0]) for line in clean}
    assert stateless["SHORT"] > 0 and stateless["HIT"] == 0, stateless  # fed by the states' keys
    named = {
        "lost-store": ("ViewEqualsCache", "ParentAnnounced"),
        "unannounced-parent": ("ParentAnnounced", "ParentAnnounced"),
        "double-removal": ("RemovalNamesAnnounced", "RemovalNamesAnnounced"),
    }
    for fault, (live, captured) in named.items():
        _, said, _, _, _, _, _, checked = runs[f"mamba_factory WORKLOAD {fault}"]
        assert said.startswith(f"{live}: "), (fault, said)
        assert checked.startswith("check exit 1") and captured in checked, (fault, checked)
