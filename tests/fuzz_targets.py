"""The fuzz targets as Hypothesis tests, for campaigns longer than one process (docs/fuzzing.md).

Each target is a lockstep state machine (``conformance/fuzz.py``) exposed as a
``RuleBasedStateMachine.TestCase``: HypoFuzz (``hypothesis fuzz -- tests/fuzz_targets.py``) runs
them with several workers that share one example database, and plain pytest replays what the
database holds. The file is not named ``test_*.py`` so that ``make test`` does not collect it:
some targets fail by design (the seed bug). Targets whose engine is not importable in the current
environment (vLLM, nano-vllm-fork) are left out.
"""

from __future__ import annotations

import importlib
import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kvspec.conformance.adapter import reference
from kvspec.conformance.fuzz import lockstep_machine

DATABASE = DirectoryBasedExampleDatabase(os.environ.get("KVSPEC_FUZZ_DB", ".hypothesis/examples"))
"""One example database for every worker and for the replay (``KVSPEC_FUZZ_DB``, default the
Hypothesis default folder): what one worker finds, the others and pytest start from. HypoFuzz
reads the database of the loaded settings profile, not a test's own settings, hence the profile."""
settings.register_profile("campaign", database=DATABASE, deadline=None)
settings.load_profile("campaign")
CAMPAIGN = settings(
    database=DATABASE,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)


def _target(factory: object = reference, depth: int | None = None, **cell: str) -> type:
    machine = lockstep_machine(depth=depth, factory=factory, **cell)  # type: ignore[arg-type]
    case = machine.TestCase
    case.settings = CAMPAIGN
    return case


# The reference engine: the seed bug (fails) and a safe cell (holds).
TestReferenceEagerPriority = _target(policy="eager-unsafe", preemption="priority")
TestReferenceDeferred = _target(policy="deferred", discipline="general", preemption="priority")


def _factory(module: str) -> object | None:
    try:
        return importlib.import_module(f"kvspec.conformance.adapters.{module}").factory
    except ImportError:
        return None


if (vllm := _factory("vllm_adapter")) is not None:
    TestVllmPriority = _target(vllm, 1, policy="eager-unsafe", preemption="priority")
    TestVllmFcfs = _target(vllm, 1, policy="eager-unsafe", preemption="fcfs")

if (nano := _factory("nano_vllm_adapter")) is not None:
    TestNanoVllm = _target(nano, 1, policy="eager-unsafe", discipline="general")
