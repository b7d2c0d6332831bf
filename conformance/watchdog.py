"""A deadline over an engine under test: ``kvspec fuzz --seconds`` holds even when a third-party
engine's call never returns.

The fuzzer calls an engine's ``step()``, ``add_request()``, ... in the main thread. A call that
never returns would otherwise keep ``kvspec fuzz`` running, silent, until killed. ``Watchdog`` is
armed over the whole command's budget: the fuzzer marks each engine call (``calling``); at the
deadline plus ``GRACE`` a ``SIGALRM`` is delivered to the main thread, and if an engine call is
under way and has run for ``HUNG_AFTER`` (else the alarm comes again when it has), its handler
raises ``EngineHung`` there, carrying the engine's stack at that moment
(the frames of the interrupted call). That is a finding about the engine (exit 1, as an engine
that raises is): the run so far is reported as its counterexample, not shrunk (each try would
hang again), and written with ``--out``. ``EngineHung`` is a ``KeyboardInterrupt``, the one
exception Hypothesis passes through without recording, replaying or shrinking it.

A call blocked where Python's signal handlers cannot run (inside C code that never returns to the
interpreter) is caught by a thread instead, ``HARD_GRACE`` later (``STUCK_AFTER`` past the
deadline when no engine call is under way): it prints the finding and every
thread's stack on stderr and ends the process with exit 1 (an engine call under way) or 4 (none:
kvspec itself is stuck, an internal error). Where ``signal.setitimer`` is missing (Windows) or
the fuzzer runs outside the main thread, only that thread watches.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from types import FrameType

GRACE = 2.0
"""Seconds past the budget before an engine call under way is reported as hung."""

HUNG_AFTER = 10.0
"""The least time a call must have run to be called hung: a slow call that began just before
the deadline (a large engine built for one example) is given this long."""

HARD_GRACE = 5.0
"""Seconds past that before the thread ends a process whose handler could not run."""

STUCK_AFTER = 120.0
"""Seconds past the deadline before the thread ends a process stuck outside any engine call
(kvspec's own work: exit 4)."""

MAX_ALARM = 86_400.0
"""The furthest ahead an alarm is set (``setitimer`` refuses a time past the platform's
``time_t``: ``--seconds 1e308``); it is set again when it comes early."""

STACK_FRAMES = 12
"""The innermost frames of the hung call shown."""


class EngineHung(KeyboardInterrupt):
    """An engine call that did not return within the budget (a finding, exit 1)."""

    def __init__(self, call: str, seconds: float, stack: str) -> None:
        super().__init__(f"{call} did not return within {seconds:.1f} s")
        self.call, self.seconds, self.stack = call, seconds, stack

    @property
    def message(self) -> str:
        return f"{self.args[0]}; the engine's stack then:\n{self.stack}"


class Watchdog:
    """The deadline ``deadline`` (``time.monotonic``) over the engine calls marked ``calling``."""

    def __init__(self, deadline: float, grace: float = GRACE, hard_grace: float = HARD_GRACE):
        self.deadline, self.grace, self.hard_grace = deadline, grace, hard_grace
        self._calling: str | None = None
        self.since = time.monotonic()
        """When the call under way began."""
        self.started = time.monotonic()
        self.done = threading.Event()

    @property
    def calling(self) -> str | None:
        """What engine call is under way (set by the fuzzer around each), or None."""
        return self._calling

    @calling.setter
    def calling(self, call: str | None) -> None:
        if call is not None:
            self.since = time.monotonic()
        self._calling = call

    def _hung(self, signum: int, frame: FrameType | None) -> None:
        call, now = self.calling, time.monotonic()
        if now < self.deadline + self.grace:  # an alarm capped at MAX_ALARM: not yet
            signal.setitimer(signal.ITIMER_REAL, min(self.deadline + self.grace - now, MAX_ALARM))
            return
        if call is None:  # kvspec's own work ran late (the fuzzer's own checks end it): look
            signal.setitimer(signal.ITIMER_REAL, 0.2)  # again soon, for an engine call after it
            return
        if now - self.since < HUNG_AFTER:  # a slow call begun just now: give it its time
            signal.setitimer(signal.ITIMER_REAL, self.since + HUNG_AFTER - now)
            return
        stack = _engine_stack(frame) if frame else ""
        raise EngineHung(call, now - self.started, stack)

    def _watch(self) -> None:
        """The thread: ends the process when the alarm could not (``_hard_stop``)."""
        past = self.deadline + self.grace + self.hard_grace
        while not self.done.wait(0.5):
            now = time.monotonic()
            if now < past:
                continue
            if self.calling is not None and now - self.since >= HUNG_AFTER + self.hard_grace:
                self._hard_stop()
            if self.calling is None and now >= self.deadline + STUCK_AFTER:
                self._hard_stop()

    def _hard_stop(self) -> None:
        call = self.calling
        what = f"the engine's {call}" if call else "kvspec"
        sys.stderr.write(
            f"kvspec fuzz: {what} did not return within "
            f"{time.monotonic() - self.started:.1f} s and could not be interrupted; "
            "every thread's stack:\n"
        )
        sys.stderr.flush()
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(1 if call else 4)

    @contextlib.contextmanager
    def armed(self) -> Iterator[Watchdog]:
        """The deadline in force inside: the alarm (main thread, where it exists) and the
        thread; both disarmed at the end."""
        left = max(0.01, self.deadline - time.monotonic())
        use_alarm = hasattr(signal, "setitimer") and (
            threading.current_thread() is threading.main_thread()
        )
        previous = None
        if use_alarm:
            previous = signal.signal(signal.SIGALRM, self._hung)
            signal.setitimer(signal.ITIMER_REAL, min(left + self.grace, MAX_ALARM))
        hard = threading.Thread(target=self._watch, name="kvspec-watchdog", daemon=True)
        hard.start()
        try:
            yield self
        finally:
            self.done.set()
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)


def _engine_stack(frame: FrameType) -> str:
    """The stack of the interrupted call from the engine's first frame on (the frames under the
    fuzzer's ``_run``), at most ``STACK_FRAMES`` of the innermost."""
    frames = traceback.extract_stack(frame)
    calls = [i for i, f in enumerate(frames) if f.name in ("_run", "setup") and
             f.filename.endswith(os.path.join("conformance", "fuzz.py"))]  # fmt: skip
    engine = frames[calls[-1] + 1 :] if calls else frames
    return "".join(traceback.format_list(engine[-STACK_FRAMES:])).rstrip()


class OutOfTime(BaseException):
    """``time_limit``'s time is up (a ``BaseException``: an engine's ``except Exception`` does
    not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``OutOfTime`` in the main thread once ``seconds`` have passed inside (no limit off
    the main thread or without ``signal.setitimer``). For kvspec's own short checks of an engine
    before the fuzzing's ``Watchdog`` is armed: they give up, and the fuzzing reports the engine."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise OutOfTime

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, min(seconds, MAX_ALARM)))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


ACTIVE: Watchdog | None = None
"""The watchdog of the fuzzing under way in this process, or None (no deadline)."""


@contextlib.contextmanager
def watching(deadline: float | None) -> Iterator[Watchdog | None]:
    """``ACTIVE`` set to a ``Watchdog`` armed over ``deadline`` inside (nothing when None)."""
    global ACTIVE
    if deadline is None:
        yield None
        return
    dog = Watchdog(deadline)
    ACTIVE = dog
    try:
        with dog.armed():
            yield dog
    finally:
        ACTIVE = None
