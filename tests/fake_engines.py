"""Tiny engines that misbehave, for the tests of ``kvspec fuzz --target`` (``--target
fake_engines:NAME`` with this folder as the current one): each is the reference engine with one
fault, so that everything else about it is a well-behaved adapter."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

from kvspec.conformance.adapter import ReferenceAdapter
from kvspec.spec import Config


class Observed(ReferenceAdapter):
    """The reference engine judged observed (as an engine that registers on its own is)."""

    judging = "observed"


def observed(config: Config, choices: object) -> Observed:
    return Observed(config, choices)  # type: ignore[arg-type]


def exits(config: Config, choices: object) -> ReferenceAdapter:
    """A factory that calls ``sys.exit(0)`` (a script's habit)."""
    sys.exit(0)


CALLS = {"factory": 0}


def exits_later(config: Config, choices: object) -> ReferenceAdapter:
    """A factory that builds the first engine (the probe) and exits on the second."""
    CALLS["factory"] += 1
    if CALLS["factory"] > 1:
        raise SystemExit(3)
    return ReferenceAdapter(config, choices)  # type: ignore[arg-type]


class Hangs(ReferenceAdapter):
    """An engine whose step hangs once a request has run a few steps."""

    def __init__(self, config: Config, choices: object) -> None:
        super().__init__(config, choices)  # type: ignore[arg-type]
        self.steps = 0

    def step(self) -> bool:
        self.steps += 1
        if self.steps > 3:
            waiting_for_a_worker_that_never_answers()
        return super().step()


def waiting_for_a_worker_that_never_answers() -> None:
    while True:
        time.sleep(0.05)


def hangs(config: Config, choices: object) -> Hangs:
    return Hangs(config, choices)


class HangsSleeping(Hangs):
    """The same, blocked in one long call (a sleep) that does not return to Python."""

    def step(self) -> bool:
        self.steps += 1
        if self.steps > 3:
            time.sleep(10_000)
        return ReferenceAdapter.step(self)


def hangs_sleeping(config: Config, choices: object) -> HangsSleeping:
    return HangsSleeping(config, choices)


class NeverIdle(ReferenceAdapter):
    """An engine that says it did work on every step, forever, once it has finished its
    requests (a busy loop on an empty queue)."""

    def step(self) -> bool:
        super().step()
        return True


def never_idle(config: Config, choices: object) -> NeverIdle:
    return NeverIdle(config, choices)  # type: ignore[arg-type]


class SlowButFinishing(ReferenceAdapter):
    """A correct engine that spins ``SPIN`` busy steps before each real one: a run's requests
    may take more than ``RUN_OUT_STEPS`` steps in all, but one finishes far more often (slow, not
    livelocked). The longest busy stretch of the process is printed to stderr at its exit."""

    SPIN = 5
    LONGEST: dict[str, int | bool] = {"busy": 0, "said": False}

    def __init__(self, config: Config, choices: object) -> None:
        super().__init__(config, choices)  # type: ignore[arg-type]
        self.calls = 0
        self.busy = 0
        if not self.LONGEST.get("said"):  # the first engine of this process: say it at the exit
            self.LONGEST["said"] = True
            atexit.register(_say_longest_busy_stretch)

    def step(self) -> bool:
        self.calls += 1
        worked = bool(self.calls % (self.SPIN + 1) and self.live_requests()) or super().step()
        self.busy = self.busy + 1 if worked else 0
        self.LONGEST["busy"] = max(self.LONGEST["busy"], self.busy)
        return worked


def _say_longest_busy_stretch() -> None:
    print(f"longest busy stretch {SlowButFinishing.LONGEST['busy']}", file=sys.stderr)


def slow_but_finishing(config: Config, choices: object) -> SlowButFinishing:
    return SlowButFinishing(config, choices)


class MiscountsAfterThree(ReferenceAdapter):
    """An engine whose refcounts are off by one once three requests have arrived (a
    ``Disagreement``, found within the first examples, whose shrinking takes many runs)."""

    FAILED = {"runs": 0}
    STEP_SECONDS = 0.0

    def __init__(self, config: Config, choices: object) -> None:
        super().__init__(config, choices)  # type: ignore[arg-type]
        self.arrived = 0
        self.lied = False

    def add_request(self, *args: object, **kwargs: object) -> None:
        self.arrived += 1
        super().add_request(*args, **kwargs)  # type: ignore[arg-type]

    def step(self) -> bool:
        time.sleep(self.STEP_SECONDS)
        return super().step()

    def snapshot(self):  # type: ignore[no-untyped-def]
        counts, free = super().snapshot()  # type: ignore[misc]
        if self.arrived < 3:
            return counts, free
        if not self.lied:
            self.lied = True
            self.FAILED["runs"] += 1
        return (counts[0] + 1, *counts[1:]), free


def miscounts_slowly(config: Config, choices: object) -> MiscountsAfterThree:
    """Each step takes 20 ms: its shrinking runs long past a small --seconds."""
    engine = MiscountsAfterThree(config, choices)
    engine.STEP_SECONDS = 0.02
    return engine


def miscounts_then_ctrl_c(config: Config, choices: object) -> MiscountsAfterThree:
    """Ctrl-C (a real SIGINT to this process) once three runs have failed: while shrinking."""
    if MiscountsAfterThree.FAILED["runs"] >= 3:
        os.kill(os.getpid(), signal.SIGINT)
    return MiscountsAfterThree(config, choices)


BUILT = {"engines": 0}


def ctrl_c_on_the_tenth_engine(config: Config, choices: object) -> ReferenceAdapter:
    """A healthy engine; Ctrl-C (a real SIGINT to this process) when the tenth is built: the fuzz
    loop is under way and nothing has been found."""
    BUILT["engines"] += 1
    if BUILT["engines"] == 10:
        os.kill(os.getpid(), signal.SIGINT)
    return ReferenceAdapter(config, choices)  # type: ignore[arg-type]


def slow_factory(config: Config, choices: object) -> ReferenceAdapter:
    """A factory that takes 3 s per engine (a large engine built per example): slow, not hung."""
    time.sleep(3)
    return ReferenceAdapter(config, choices)  # type: ignore[arg-type]
