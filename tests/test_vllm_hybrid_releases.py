"""``tests/test_vllm_hybrid.py`` (vLLM's hybrid models: built from their ``config.json``, the
groups in the header and the events, what is not followed refused by name) in every supported
vLLM release's environment (``tests/vllm_venvs.py``), as subprocesses since vLLM's pins conflict
with ours."""

from __future__ import annotations

import os
from pathlib import Path

import preforked
import pytest
from vllm_venvs import VENVS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
def test_hybrid_models_on_every_release(venv: Path) -> None:
    argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:kvspec.pytest_plugin"]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = preforked.run(
        venv / "bin" / "python", [*argv, "tests/test_vllm_hybrid.py"], cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.parametrize("venv", VENVS)
@pytest.mark.parametrize(
    ("model", "code", "says"), [("swa", 1, "BUG: r2 hits"), ("mamba", 0, "no zombie hit")]
)
def test_the_hybrid_seed_question_on_every_release(
    venv: Path, model: str, code: int, says: str
) -> None:
    """``docs/findings/vllm_hybrid_seed.py`` (vLLM's objects only), on each release: under
    PRIORITY with eager registration a later request hits a sliding-window block no executed
    step wrote (exit 1); with a Mamba group the state is published unwritten but the
    coordinator's common hit stops before it in this workload (exit 0), as
    ``docs/findings/README.md`` says."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = preforked.run(
        venv / "bin" / "python", ["docs/findings/vllm_hybrid_seed.py", model], cwd=ROOT, env=env
    )
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-2000:]
    assert says in done.stdout, done.stdout[-2000:]


def test_the_protocol_takes_a_group_other_than_0_and_only_that() -> None:
    """An adapter's ``alloc``/``hit``/``publish`` may carry the trailing ``group`` of
    ``docs/hybrid.md``, in its canonical form (there only for a group other than 0)."""
    from kvspec.conformance.protocol import ProtocolError, check_event

    check_event(("hit", 0, (), 1))
    check_event(("publish", 0, 0, 3, 2))
    with pytest.raises(ProtocolError, match="group 0 is written without the field"):
        check_event(("hit", 0, (), 0))
    with pytest.raises(ProtocolError, match="a finish has 2 fields"):
        check_event(("finish", 0, "length", 1))
