"""Shared pytest setup: Hypothesis profiles, the fuzzer's counterexample of the seed bug, and the
order of a session that holds e2e tests beside the others.

Pick one with the HYPOTHESIS_PROFILE environment variable (default: ``dev``):

* ``dev``  -- Hypothesis defaults, no deadline (first calls into torch/z3 are slow).
* ``ci``   -- modest and reproducible: fixed seed, failing examples printed as blobs.
* ``fuzz`` -- long runs to hunt for bugs (100k examples per test).
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("fuzz", max_examples=100_000, deadline=None)

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Converted GGUF models (impl/llm/model_cache.py) go in the checkout, not the user's home: shared
# by the pytest workers and the commands they start, kept between runs.
os.environ.setdefault(
    "KVSPEC_MODEL_CACHE",
    str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "kvspec-models"),
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The e2e tests first, each file's in their order (a stable sort): in a session that runs
    both kinds (``make pytest-all``, CI's one session) the long e2e tests start while there is
    work left for the other worker, and the short ones fill the end, instead of a worker waiting
    on the last e2e test alone. A session of one kind keeps its order."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


@dataclass(frozen=True)
class SeedBugRun:
    """``kvspec fuzz --policy eager-unsafe --preemption priority --seed 1 --out PATH``, as the
    command line runs it, in its own process."""

    returncode: int
    stdout: str
    stderr: str
    path: Path


@pytest.fixture(scope="session")
def seed_bug_run(tmp_path_factory: pytest.TempPathFactory) -> SeedBugRun:
    """The fuzzer's counterexample of the seed bug, found once per test session and shared by the
    tests that read it (and by pytest-xdist's workers, through a file lock): the search is seeded,
    so it finds the bug at the same example on any machine, and its budget only bounds a run that
    would fail."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's
    path, record = root / "seed-bug.jsonl", root / "seed-bug.json"
    with FileLock(str(root / "seed-bug.lock")):
        if not record.exists():
            argv = ["fuzz", "--policy", "eager-unsafe", "--preemption", "priority", "--seed", "1"]
            done = subprocess.run(
                [sys.executable, "-m", "kvspec", *argv, "--seconds", "600", "--out", str(path)],
                capture_output=True,
                text=True,
            )
            record.write_text(json.dumps([done.returncode, done.stdout, done.stderr]))
    returncode, stdout, stderr = json.loads(record.read_text())
    return SeedBugRun(returncode, stdout, stderr, path)


@pytest.fixture(scope="session")
def vllm_case_sessions(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> object:
    """The plugin's case files judged in one vLLM session per release and pass, shared by this
    run's tests and xdist workers (``tests/vllm_case_sessions.py``)."""
    from vllm_case_sessions import CaseSessions

    return CaseSessions.of(request.session, tmp_path_factory)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """This process's preforked servers (``tests/preforked.py``) told to leave and waited for
    here, not at interpreter exit, which an xdist worker does not reach: so they leave no process
    behind and their CPU time counts with this process's children."""
    if "preforked" in sys.modules:
        sys.modules["preforked"].close()
