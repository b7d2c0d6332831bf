"""``docs/findings/sglang_extra_buffer_missed_flip.py`` (SGLang 0.5.23's objects only, run in
``.venv-sglang``): under the overlap loop, non-lazy ``extra_buffer``, the first decode boundary
after a prefill is never flipped, and the next boundary's in-flight step writes the slot the tree
holds as a finished request's cached state (exit 1), at the shrunk sizes and at SGLang's default
track interval (256) and FLA chunk (64). With the flip made (``control``), or a prompt whose first
decode is not a boundary, the script exits 0: it tells a fixed SGLang from this one."""

from __future__ import annotations

import subprocess

import pytest
from sglang_cases import ROOT, VENV, needs_sglang

SCRIPT = "docs/findings/sglang_extra_buffer_missed_flip.py"
DEFAULTS = ("--prompt", "255", "--max-tokens", "258", "--interval", "256", "--chunk", "64")

pytestmark = [pytest.mark.e2e, needs_sglang]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV / "bin" / "python"), SCRIPT, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


def test_the_race_shows_at_the_shrunk_sizes() -> None:
    done = run()
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert (
        "step 3 formed: decode, seq_len 4, tracks into slot 2 (ping-pong [2, 3], next 0, last 0)"
        in done.stdout
    )
    assert "step 2 result: token 0, finished True, tree's cached states [2]" in done.stdout
    assert (
        "RACE: step 3 (in flight, seq_len 4) writes Mamba slot 2, which the tree holds"
        in done.stdout
    )
    assert (
        "a later request with r0's 4 tokens matches 2; its Mamba state is copied from slot 2"
        in done.stdout
    )


def test_the_race_shows_at_sglangs_default_interval_and_chunk() -> None:
    done = run(*DEFAULTS)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "track interval 256, mamba_chunk_size 64" in done.stdout
    assert "RACE: step 257 (in flight, seq_len 512) writes Mamba slot 3" in done.stdout


@pytest.mark.parametrize(
    "args", [("control",), ("race", "--prompt", "2")], ids=["flipped", "no-boundary"]
)
def test_no_race_with_the_flip_made_or_no_first_decode_boundary(args: tuple[str, ...]) -> None:
    done = run(*args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "no in-flight step writes a slot the tree holds as cached" in done.stdout
    assert "RACE" not in done.stdout
