"""vLLM's KV-event stream of a hybrid model (``hybrid.swa_factory``), in every supported release
(``tests/kv_stream_hybrid_checks.py`` run in each vLLM venv): both groups' ``BlockStored`` and
``BlockRemoved`` carry their group (``group_idx``) and kind, the stream holds in process and from
its capture file under ``kvspec check --kv-events`` (exit 0), and a stored block whose parent was
never announced is named ``ParentAnnounced`` both ways (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_venvs import VENVS, run_in

ROOT = Path(__file__).resolve().parent.parent


def _run(venv: Path, folder: Path, *plant: str) -> list[str]:
    done = run_in(venv, "tests/kv_stream_hybrid_checks.py", str(folder), *plant)
    return [line for line in done.stdout.splitlines() if " | " in line]


@pytest.mark.e2e  # minutes per release: make test-e2e
@pytest.mark.parametrize("venv", VENVS)
def test_a_hybrid_models_stream_is_judged_per_group(venv: Path, tmp_path: Path) -> None:
    clean = _run(venv, tmp_path)
    assert len(clean) == 2, clean  # depths 1 and 2
    for line in clean:
        said, counts, groups, checked = line.split(" | ")
        assert said == "none" and int(counts.split()[2]) >= 10, line
        assert "stored groups [0, 1] removed groups [0, 1]" in groups, line
        assert "'full_attention'" in groups and "'sliding_window'" in groups, line
        assert checked.startswith("check exit 0"), line
    planted = _run(venv, tmp_path, "vllm-stream-parent-unannounced")
    for line in planted:
        said, _, _, checked = line.split(" | ")
        assert said.startswith("ParentAnnounced: "), line
        assert checked.startswith("check exit 1") and "ParentAnnounced" in checked, line
