"""A small process pool for the proofs: independent Z3 queries on several cores, same answers.

Z3 queries are CPU-bound and the Python API holds the GIL, so the proofs run in processes. The
pool forks its workers from the calling process (``fork`` start method), so they inherit the
imported modules, and whatever tests patched into them, without pickling any Z3 term; jobs and
results cross the pipe as plain data (names, numbers, tuples).

Two kinds of job:

* **pooled** jobs run in a long-lived worker, which keeps state between jobs (the proofs keep one
  solver per fragment there, with the strengthening asserted once, and push/pop each query). A
  pooled job's *verdict* (unsat, sat) does not depend on which worker ran it or what ran before;
  a model Z3 returns may.
* **fresh** jobs run in a process forked for them alone, from the caller, which builds no Z3
  terms itself: everything a fresh job returns, models included, is the same from run to run
  and for any number of workers (counterexamples, counterexamples to induction).

Jobs are dispatched by priority (lower first; any comparable value), then in submission order;
``cancel`` drops queued jobs. Where ``fork`` is not available, or with ``workers=0``, jobs run one at a time in
the calling process (same verdicts; models may differ).
"""

from __future__ import annotations

import heapq
import itertools
import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any


class JobFailed(RuntimeError):
    """A job raised an exception that could not be sent back, or its worker died: the
    worker's traceback, as text."""


def default_workers() -> int:
    """The cores this process may use (``KVSPEC_PROOF_WORKERS`` overrides)."""
    env = os.environ.get("KVSPEC_PROOF_WORKERS")
    if env is not None:
        return max(0, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


@dataclass(order=True)
class _Job:
    priority: Any
    seq: int
    key: Any = field(compare=False)
    fn: Callable[..., Any] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    fresh: bool = field(compare=False)


def _serve(conn: Connection) -> None:
    """A worker: run jobs until told to stop."""
    while True:
        message = conn.recv()
        if message is None:
            return
        key, fn, args = message
        conn.send((key, *_run(fn, args)))


def _run(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    try:
        return True, fn(*args)
    except Exception as err:  # reported to the caller, never swallowed
        text = traceback.format_exc()
        try:
            pickle.dumps(err)
        except Exception:
            return False, (None, text)
        return False, (err, text)


def _once(conn: Connection, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    conn.send((None, *_run(fn, args)))
    conn.close()


class Pool:
    """``submit`` jobs, then iterate ``results()`` for (key, result) as they finish."""

    def __init__(self, workers: int | None = None) -> None:
        n = default_workers() if workers is None else workers
        self.inline = n <= 0 or not can_fork()
        self.slots = max(1, n)
        self._ctx = multiprocessing.get_context("fork") if not self.inline else None
        self._queue: list[_Job] = []
        self._seq = itertools.count()
        self._idle: list[tuple[Any, Connection]] = []
        self._busy: dict[Connection, tuple[Any, Any, bool]] = {}
        self._started = 0

    # -- submitting -------------------------------------------------------------------------

    def submit(
        self,
        key: Any,
        fn: Callable[..., Any],
        *args: Any,
        priority: Any = 0,
        fresh: bool = False,
    ) -> None:
        heapq.heappush(self._queue, _Job(priority, next(self._seq), key, fn, args, fresh))

    def cancel(self, drop: Callable[[Any], bool]) -> None:
        """Drop the queued (not yet started) jobs whose key ``drop`` accepts."""
        self._queue = [job for job in self._queue if not drop(job.key)]
        heapq.heapify(self._queue)

    def pending(self) -> int:
        return len(self._queue) + len(self._busy)

    # -- running ----------------------------------------------------------------------------

    def results(self) -> Iterator[tuple[Any, Any]]:
        """Run the queue, yielding (key, result) as jobs finish; jobs may be submitted or
        cancelled between items. A job that raised raises ``JobFailed`` here."""
        if self.inline:
            while self._queue:
                job = heapq.heappop(self._queue)
                ok, value = _run(job.fn, job.args)
                yield job.key, _unwrap(ok, value)
            return
        while self._queue or self._busy:
            self._dispatch()
            ready = wait(list(self._busy))
            for conn in ready:
                assert isinstance(conn, Connection)
                key, proc, fresh = self._busy.pop(conn)
                try:
                    _, ok, value = conn.recv()
                except EOFError:
                    proc.join()
                    ok, value = False, (None, f"the worker of job {key!r} died ({proc.exitcode})")
                    fresh = True  # do not reuse it
                if fresh:
                    conn.close()
                    proc.join()
                else:
                    self._idle.append((proc, conn))
                yield key, _unwrap(ok, value)

    def _dispatch(self) -> None:
        assert self._ctx is not None
        while self._queue and len(self._busy) < self.slots:
            job = heapq.heappop(self._queue)
            if job.fresh:
                parent, child = self._ctx.Pipe()
                proc = self._ctx.Process(target=_once, args=(child, job.fn, job.args))
                proc.start()
                child.close()
                self._busy[parent] = (job.key, proc, True)
                continue
            if not self._idle:
                parent, child = self._ctx.Pipe()
                proc = self._ctx.Process(target=_serve, args=(child,))
                proc.start()
                child.close()
                self._started += 1
                self._idle.append((proc, parent))
            proc, conn = self._idle.pop()
            conn.send((job.key, job.fn, job.args))
            self._busy[conn] = (job.key, proc, False)

    def _stop_one(self) -> None:
        proc, conn = self._idle.pop(0)
        conn.send(None)
        conn.close()
        proc.join()

    def close(self) -> None:
        """Stop the workers (jobs still running are abandoned: their processes end)."""
        while self._idle:
            self._stop_one()
        for conn, (_, proc, _) in list(self._busy.items()):
            proc.terminate()
            proc.join()
            conn.close()
        self._busy.clear()
        self._queue.clear()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unwrap(ok: bool, value: Any) -> Any:
    """A job's result, or its exception raised again here (with the worker's traceback as a
    note), or ``JobFailed`` when the exception could not be sent."""
    if ok:
        return value
    err, text = value
    if err is None:
        raise JobFailed(text)
    if hasattr(err, "add_note"):
        err.add_note(f"in a proof worker:\n{text}")
    raise err
