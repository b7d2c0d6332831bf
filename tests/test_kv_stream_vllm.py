"""The streams vLLM's (every supported release) and SGLang 0.5.23's own publishers send over loopback while the
adapters drive them, judged in process against their caches (``tests/kv_stream_checks.py``, run
in each engine's venv; skipped without it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import preforked
import pytest
from vllm_venvs import VENVS

ROOT = Path(__file__).resolve().parent.parent


def _run(venv: str | Path, *argv: str) -> list[str]:
    python = ROOT / venv / "bin" / "python"
    if not (ROOT / venv / ".stamp").exists():
        pytest.skip(f"no {venv}: run `make thirdparty` to build it")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    if "vllm" in Path(venv).name:  # vLLM imported once (tests/preforked.py)
        done = preforked.run(python, ["tests/kv_stream_checks.py", *argv], cwd=ROOT, env=env)
    else:
        done = subprocess.run(
            [str(python), "tests/kv_stream_checks.py", *argv],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=600,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.mark.parametrize("venv", VENVS)
def test_vllms_stream_under_every_factory_and_with_planted_faults(venv: Path) -> None:
    *clean, dropped, duplicate = _run(venv, "vllm", "clean", "drop-removal", "duplicate")
    assert len(clean) == 5, clean
    cells = ("factory depth 1", "factory depth 2", "drop_factory depth 3", "sync_factory depth 2", "async_drop_factory depth 3")  # fmt: skip
    for line, where in zip(clean, cells, strict=True):
        words = line.split()
        assert words[0] == "none" and line.endswith(f"[{where}]"), line
        assert int(words[1]) >= 4 and int(words[3]) >= 6 and words[7] == "1", (
            line
        )  # batches, events, a clear
    assert dropped.startswith("ViewEqualsCache: ") and "no longer holds" in dropped, dropped
    # vLLM stores a hash twice (a block-aligned prompt recomputes its last block): by design
    assert duplicate.startswith("StoreNamesNewHash: "), duplicate


def test_sglangs_stream_with_a_planted_fault() -> None:
    *clean, dropped, duplicate = _run(
        ".venv-sglang", "sglang", "clean", "drop-removal", "duplicate"
    )
    assert len(clean) == 5, clean  # the default tree cache in both loops, then the other two
    for line in clean:
        words = line.split()
        assert words[0] == "none" and int(words[1]) >= 4 and int(words[3]) >= 6, line
    assert dropped.startswith("ViewEqualsCache: "), dropped
    assert duplicate.startswith("none"), duplicate  # SGLang's tree deduplicates on insert
