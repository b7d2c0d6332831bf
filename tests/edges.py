"""Shared by the tests of the command line's edges: small traces, and running kvspec as a user does.

``seed_counterexample`` is the seed bug's counterexample as the fuzzer reports it: the decisions
of ``scenarios.SEED`` up to X's finish (the zombie is published, nobody has read it yet), each
followed by the spec's effects.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scenarios import SEED

from kvspec.spec import Config, apply, initial_state

KVSPEC = [sys.executable, "-m", "kvspec"]
SEED_CONFIG = Config(
    num_blocks=6, block_size=4, policy="eager-unsafe", preemption="priority", token_budget=12
)
SEED_UNREAD = SEED[: SEED.index(("commit", 2, ((2, 3),))) + 1]
"""The seed scenario before its consumer arrives: a NoUnwrittenPublish nobody has read."""


def with_effects(config: Config, decisions: list[tuple]) -> list[tuple[object, ...]]:
    """Each decision followed by the effects the spec computes for it."""
    s = initial_state(config)
    events: list[tuple[object, ...]] = []
    for decision in decisions:
        events.append(decision)
        events.extend(apply(s, decision))
    return events


def seed_counterexample() -> tuple[Config, list[tuple[object, ...]]]:
    return SEED_CONFIG, with_effects(SEED_CONFIG, SEED_UNREAD)


def run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None, **kw):  # type: ignore[no-untyped-def]
    """``python -m kvspec ARGV`` as a user runs it (its own process), text output."""
    full = dict(os.environ, **(env or {}))
    return subprocess.run(
        KVSPEC + argv, capture_output=True, text=True, cwd=cwd, env=full, timeout=600, **kw
    )


def one_line(stderr: str) -> bool:
    return stderr.count("\n") == 1 and "Traceback" not in stderr
