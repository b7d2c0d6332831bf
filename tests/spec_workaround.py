"""A SPEC BUG found by the reference's async conformance runs, and the tests' workaround until the
spec is fixed (reported to the lead; ``spec/`` is not the reference's to edit).

``hide-uncommitted`` under async scheduling: a request that finishes at a commit while a later
step in flight holds hidden registrations for it (made when that later step was scheduled). At
that later step's commit ``spec.policies.on_written`` publishes them from the finished request's
empty table and raises IndexError, so the Judge, ``kvspec fuzz`` and ``kvspec demo`` crash on
such a run. A finished request left: its hidden entries should be dropped, as those of a
preempted or aborted one are (the reference skips them, ``reference/policies.py``).

``HIDDEN_AFTER_FINISH`` is the smallest scenario; ``test_reference.py`` has a strict xfail on it,
which starts failing (XPASS) once the spec is fixed: then delete this module and its uses.
"""

from __future__ import annotations

import pytest

from kvspec.spec import Config, apply, initial_state
from kvspec.spec.state import State, Step

HIDDEN_AFTER_FINISH = (
    ("arrive", 0, (1, 2, 3), 10, 0),
    ("begin", 0),
    ("schedule", 0, 3, 0),  # the prompt, hidden; samples position 3
    ("submit", 0),
    ("begin", 1),
    ("schedule", 0, 1, 0),  # position 3, a placeholder
    ("submit", 1),
    ("begin", 2),
    ("schedule", 0, 1, 0),  # position 4, a placeholder
    ("submit", 2),
    ("execute", 0, ()),
    ("commit", 0, ((0, 5),)),
    ("begin", 3),
    ("schedule", 0, 1, 0),  # position 5: hides block 3 (its token, sampled by step 0, is known)
    ("submit", 3),
    ("execute", 1, ()),
    ("commit", 1, ((0, 0),)),  # the stop token: r0 finishes while steps 2 and 3 hold it
    ("execute", 2, ()),
    ("commit", 2, ()),
    ("execute", 3, ()),
    ("commit", 3, ()),  # the spec publishes r0's hidden block 3 from its empty table
)
CONFIG = Config(
    num_blocks=10,
    block_size=1,
    depth=3,
    policy="hide-uncommitted",
    async_scheduling=True,
    stop_token=0,
)


def spec_has_the_hidden_after_finish_bug() -> bool:
    s = initial_state(CONFIG)
    try:
        for decision in HIDDEN_AFTER_FINISH:
            apply(s, decision)
    except IndexError:
        return True
    return False


def work_around_the_hidden_after_finish_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """WORKAROUND for hide-uncommitted async runs only: wrap the spec's ``on_written`` so that it
    drops a finished request's hidden entries first (what the reference does), so that the rest
    of the run is still judged. Does nothing once the spec is fixed."""
    if not spec_has_the_hidden_after_finish_bug():
        return
    from kvspec.spec import policies

    original = policies.on_written

    def on_written(s: State, step: Step) -> list[tuple[object, ...]]:
        if s.config.policy == "hide-uncommitted":
            regs = step.registrations
            for rid in [r for r in regs if s.requests[r].status == "finished"]:
                del regs[rid]
        return original(s, step)

    monkeypatch.setattr(policies, "on_written", on_written)
