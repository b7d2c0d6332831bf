"""``BackgroundMonitor``: a ``Monitor`` whose judge runs in a child process. The engine's thread
only encodes its events and hands them to a pipe; the child judges them with an ordinary
synchronous ``Monitor`` (the fast path and its hand-over to the spec judge for the report: no
judging or report code here), so the report is the same, field for field.

The child is a fresh interpreter (``python -c``), started once, that reads on its stdin (a
reader thread takes all the pipe holds at each read, so the parent does not wait on a full pipe
while the judge is busy) and answers with single bytes on its stdout:

* parent -> child: two pickles, the parent's ``sys.path`` and ``(config, monitor options)``,
  then *frames*: ``B`` + 8-byte length + a batch (``batch_size`` events, fewer at close), or
  ``C`` + 8 zero bytes (close: give the verdict). A batch is pickles one after the other, each a
  *chunk*: a list of events (one ``feed_all`` call's, or its share of a batch), or
  ``(events, {index: hash})`` (events fed one by one with ``feed``);
* child -> parent: ``s`` (started), ``a`` per batch judged (the *ack*), ``f`` once, before the ack
  of the batch where a finding was made (the child then drops later batches, acking them), and
  at close ``r`` + 8-byte length + pickled ``(finding, report)``; ``x`` + length + a pickled
  exception if judging raised (e.g. ``FastPathDisagrees``), which the parent raises.

What the engine's thread pays, per event (``bench/bench_checker.py --monitor-only --baseline``,
``docs/notes/background-monitor.md``): the encoding, nothing else of note. Events are pickled
as they are fed, one pickle per ``feed_all`` call (or per ``PENDING`` events fed one by one),
into the batch's buffer, so the engine's event objects are freed when the engine drops them
(holding a batch of them a while longer costs the engine's allocator and collector measurably),
and in the pickler's *fast* mode: no memo (its bookkeeping of every tuple was a large share of
the pickling). Fast mode writes a value shared twice as two equal copies, which changes nothing for
events (immutable, compared by value; the judge never asks for identity); a cyclic value (which
fast mode refuses) is pickled again with the memo. Pickle, not a faster encoder (``msgspec``'s
MessagePack is faster on these events): an encoding that writes tuples and lists,
enums and ints, named tuples and tuples alike would hand the child events that differ from the
engine's where the synchronous ``Monitor`` would tell them apart (``isinstance(x, tuple)`` in
the judge, ``repr`` in the report); checking each event's types first was not tried. The rest
is per batch, a few microseconds for ``batch_size`` events: one write into a pipe widened to hold
the whole queue (``PIPE_BYTES``), and a look at the child's answers. An event that does not
pickle cannot be judged: ``UnsendableEvent`` (bad input, one line naming it), the child stopped.

Backpressure: at most ``queue_depth`` batches are sent and not yet acked; sending one more waits
for an ack, so memory stays bounded when the engine outruns the judge (the engine then runs at the
judge's speed). Hence the bound on how far the engine runs past an offending event: the parent
looks at the child's answers whenever a batch is full (and at close), and the batch that would
exceed the depth waits for the ack of the offending one, which comes after its ``f``: a
``Violation`` is raised fewer than ``(queue_depth + 1) * batch_size`` events after the offending
event (the report names that event, exactly as the synchronous ``Monitor``'s does). Batches hold
exactly ``batch_size`` events (a ``feed_all`` call's events are split where a batch fills), so
the bound does not depend on how the engine groups its calls.

Why a fresh interpreter and not ``multiprocessing``: ``fork`` copies a parent that may run
threads (torch's pools, an engine's workers) with their locks in an undefined state; ``spawn``
and ``forkserver`` re-import the user's ``__main__`` in the child (scripts without an
``if __name__ == "__main__"`` guard would run again). ``subprocess`` with pipes has neither
problem, and needs no shared memory or semaphores. The child dies with the parent: when the
parent exits or is killed its stdin reaches end of file and it returns (after at most the batch
it is judging); ``close``, a context exit (also on an exception) and the garbage collector wait
for or kill it. Pickle is safe here because the events are the program's own values (trusted).
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import BinaryIO

from kvspec.judge import Finding
from kvspec.spec import Config

from .monitor import MalformedEvent, Monitor, Violation
from .report import Report

Event = tuple[object, ...]

BATCH_SIZE = 1024
"""Events per message to the child: large enough that a send costs little per event."""
QUEUE_DEPTH = 8
"""Batches sent and not yet judged, at most: the engine runs past an offending event by fewer
than ``(QUEUE_DEPTH + 1) * BATCH_SIZE`` events (9,216) before the ``Violation``."""
PENDING = 64
"""Events fed one by one (``feed``) wait in a list until this many (or the batch is full), then
are pickled together: a pickle call costs about as much as a few events."""

BATCH, CLOSE = b"B", b"C"
"""The frames' tags (parent -> child)."""
_LENGTH = 8
"""Bytes of a frame's length, after its tag."""

_BOOT = (
    "import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
    "from kvspec.conformance.background import serve; serve()"
)


class JudgeDied(RuntimeError):
    """The child process ended without a verdict (its error, if any, is on stderr)."""


class UnsendableEvent(MalformedEvent):
    """An event that does not pickle (so cannot reach the child): bad input, not a finding, one
    line naming the event's number in the stream (``MalformedEvent``'s); the child is stopped,
    there is no verdict (``close`` raises ``JudgeDied``)."""

    def __init__(self, name: str, number: int, event: object, err: Exception) -> None:
        why = " ".join(f"{type(err).__name__}: {err}".split())
        super().__init__(name, number, event, f"the event does not pickle ({why})")

    def __reduce__(self) -> tuple[object, ...]:  # its message already made
        return (MalformedEvent, (self.name, self.number, self.event, self.why))


class BackgroundMonitor:
    """A ``Monitor`` judging in a child process: ``feed`` and ``feed_all`` only encode the events
    into the batch being filled and, every ``batch_size`` events, send it. A finding is raised
    (or returned) at the first ``feed`` that completes a batch, or at ``close``, after the child
    found it: fewer than ``(queue_depth + 1) * batch_size`` events after the offending one (at
    most ``queue_depth`` batches wait for the judge; the engine waits when they are that many).
    ``close()`` always waits for the verdict; leaving a ``with`` block on an exception kills the
    child. Events must not be mutated after ``feed``. ``judging``: ``fast`` (the default),
    ``spec`` or ``observed``, as the synchronous ``Monitor``'s named constructors."""

    def __init__(
        self,
        config: Config,
        judging: str = "fast",
        check_every: int = 1,
        raise_on_finding: bool = True,
        name: str = "<monitor>",
        window: int | None = None,
        batch_size: int = BATCH_SIZE,
        queue_depth: int = QUEUE_DEPTH,
    ) -> None:
        if judging not in JUDGINGS:
            raise ValueError(f"unknown judging {judging!r}; one of {', '.join(JUDGINGS)}")
        self.raise_on_finding = raise_on_finding
        self.name = name
        options = dict(judging=judging, check_every=check_every, name=name, window=window)
        self.child = Child(config, options, batch_size, queue_depth)
        self._pending: list[Event] = []
        self._hashes: dict[int, str] = {}
        """The hashes of the pending events, by their index in ``_pending``."""
        self._batch = Batch()

    def feed(self, event: Event, hash_: str | None = None) -> Finding | None:
        pending = self._pending
        if hash_ is not None:
            self._hashes[len(pending)] = hash_
        pending.append(event)
        if len(pending) < PENDING and self._batch.events + len(pending) < self.child.batch_size:
            return None
        self._put_pending()
        if self._batch.events < self.child.batch_size:
            return None
        return self._outcome(self._ship())

    def feed_all(self, events: Iterable[Event]) -> Finding | None:
        if self._pending:
            self._put_pending()
        if type(events) is not list:
            events = list(events)
        batch, size, start = self._batch, self.child.batch_size, 0
        if batch.events + len(events) < size:  # the common case: no batch fills, nothing sent
            self._put(events, events)
            result = self.child.result
            return None if result is None else result[0]
        while start < len(events):
            room = size - batch.events
            chunk = events if start == 0 and len(events) <= room else events[start : start + room]
            self._put(chunk, chunk)
            start += len(chunk)
            if batch.events >= size and self._outcome(self._ship()) is not None:
                break
        return self.finding

    @property
    def finding(self) -> Finding | None:
        """As far as the child has told so far."""
        result = self.child.result
        return None if result is None else result[0]

    @property
    def events_seen(self) -> int:
        """The events fed so far, or at a verdict the events judged."""
        child = self.child
        if child.result is not None:
            return child.result[1].events
        return child.events + self._batch.events + len(self._pending)

    def close(self) -> Finding | None:
        if self._pending:
            self._put_pending()
        finding = self.child.finish(self._batch)
        self._batch.clear()
        return self._outcome(finding)

    def report(self) -> Report:
        if self.child.result is not None:
            return self.child.result[1]
        return Report(self.name, 0, self.events_seen)

    def _put_pending(self) -> None:
        """The events fed one by one, into the batch: one chunk, with their hashes if any."""
        pending, hashes = self._pending, self._hashes
        self._pending, self._hashes = [], {}
        self._put((pending, hashes) if hashes else pending, pending)

    def _put(self, chunk: object, events: list[Event]) -> None:
        """``chunk`` (holding ``events``) into the batch; an event that does not pickle stops
        the child (no verdict without it) and raises ``UnsendableEvent`` naming it."""
        try:
            self._batch.put(chunk, len(events))
        except Exception as err:  # noqa: BLE001 - any pickling error: the event is named
            self.child.stop()
            raise self._unsendable(events, err) from None

    def _unsendable(self, events: list[Event], err: Exception) -> UnsendableEvent:
        first = self.child.events + self._batch.events + 1
        for number, event in enumerate(events, first):
            try:
                pickle.dumps(event, pickle.HIGHEST_PROTOCOL)
            except Exception as own:  # noqa: BLE001
                return UnsendableEvent(self.name, number, event, own)
        return UnsendableEvent(self.name, first, events[0] if events else None, err)

    def _ship(self) -> Finding | None:
        """Send the batch (full); the finding if the child has made one."""
        finding = self.child.send(self._batch)
        self._batch.clear()
        return finding

    def _outcome(self, finding: Finding | None) -> Finding | None:
        if finding is not None and self.raise_on_finding:
            raise Violation(self.report())
        return finding

    def __enter__(self) -> BackgroundMonitor:
        return self

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        if kind is None:
            self.close()
        else:
            self.child.stop()


JUDGINGS = ("fast", "spec", "observed")


class Batch:
    """One frame being filled: the tag, room for the length, then a pickle per chunk, up to the
    buffer's position. Emptied (``clear``) once sent and filled again: one buffer and one pickler
    for the whole run."""

    def __init__(self) -> None:
        self.events = 0
        self.buffer = io.BytesIO()
        self.buffer.write(BATCH + bytes(_LENGTH))
        self._pickler = pickle.Pickler(self.buffer, pickle.HIGHEST_PROTOCOL)
        self._pickler.fast = True  # no memo: see the module's docstring

    def put(self, chunk: object, events: int) -> None:
        """Append ``chunk`` (a list of ``events`` events, or ``(that list, hashes)``)."""
        buffer = self.buffer
        at = buffer.tell()
        try:
            self._pickler.dump(chunk)
        except BaseException as err:
            buffer.seek(at)  # the batch as it was (what lies past the position is not sent)
            if type(err) is not ValueError:  # an unpicklable event (or an interrupt)
                raise
            # fast mode refuses a cycle: pickled again, with the memo
            buffer.write(pickle.dumps(chunk, pickle.HIGHEST_PROTOCOL))
        self.events += events

    def clear(self) -> None:
        """Empty, its memory kept (no truncate: the buffer is not shrunk and grown again at every
        batch, which costs page faults)."""
        self.buffer.seek(1 + _LENGTH)
        self.events = 0

    def frame(self) -> memoryview:
        """The frame, its length filled in (release the view before the batch is used again)."""
        end = self.buffer.tell()
        with self.buffer.getbuffer() as whole:
            view = whole[:end]
        view[1 : 1 + _LENGTH] = (end - 1 - _LENGTH).to_bytes(_LENGTH, "little")
        return view


class Child:
    """The parent's side of the pipe: send batches, read acks, get the verdict."""

    def __init__(
        self, config: Config, options: dict[str, object], batch_size: int, queue_depth: int
    ) -> None:
        for name, value in (("batch_size", batch_size), ("queue_depth", queue_depth)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BackgroundMonitor: {name} must be a positive int, not {value!r}")
        self.batch_size = batch_size
        self.queue_depth = queue_depth
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        _widen(self.proc.stdin)
        self._in = self.proc.stdin
        self._out = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self._unread = b""
        self.sent = 0
        self.acked = 0
        self.events = 0
        """Events sent."""
        self.found = False
        self.result: tuple[Finding | None, Report] | None = None
        self._write(pickle.dumps(sys.path, pickle.HIGHEST_PROTOCOL))
        self._write(pickle.dumps((config, options), pickle.HIGHEST_PROTOCOL))
        if self._byte() != b"s":
            self.stop()
            raise JudgeDied("Monitor: the background judge did not start (see stderr)")

    def send(self, batch: Batch) -> Finding | None:
        """One batch to the child; at a finding (known from the child) the verdict instead."""
        if self.result is not None:
            return self.result[0]
        self._alive()
        self._answers(block=False)
        while not self.found and self.sent - self.acked >= self.queue_depth:
            self._answers(block=True)
        if self.found:
            return self.finish(Batch())
        with batch.frame() as frame:
            self._write(frame)
        self.sent += 1
        self.events += batch.events
        return None

    def finish(self, batch: Batch) -> Finding | None:
        """The last events, then the verdict (waits for the child to judge everything)."""
        if self.result is None:
            self._alive()
            if batch.events and not self.found:
                self.send(batch)
            if self.result is None:
                self._write(CLOSE + bytes(_LENGTH))
                while self.result is None:
                    self._answers(block=True)
                self.proc.wait()
                self._finalizer()  # closes the pipes
        return self.result[0]

    def stop(self) -> None:
        """Kill the child (an exception in the engine's code: no verdict wanted)."""
        self._finalizer()

    def _alive(self) -> None:
        if not self._finalizer.alive:
            raise JudgeDied("Monitor: the background judge was stopped (after an exception)")

    def _write(self, data: bytes | memoryview) -> None:
        try:
            self._in.write(data)  # type: ignore[union-attr]
            self._in.flush()  # type: ignore[union-attr]
        except (OSError, ValueError) as err:  # a broken or closed pipe
            self.stop()
            raise JudgeDied(f"Monitor: the background judge died ({err}; see stderr)") from None

    def _byte(self) -> bytes:
        if not self._unread:
            self._unread = os.read(self._out, 65536)
            if not self._unread:
                self.stop()
                raise JudgeDied(
                    f"Monitor: the background judge died (exit {self.proc.wait()}; see stderr)"
                )
        byte, self._unread = self._unread[:1], self._unread[1:]
        return byte

    def _answers(self, block: bool) -> None:
        """Take what the child said (waiting for at least one byte if ``block``)."""
        if not block and not self._unread and not select.select([self._out], [], [], 0)[0]:
            return
        byte = self._byte()
        while True:
            if byte == b"a":
                self.acked += 1
            elif byte == b"f":
                self.found = True
            elif byte in (b"r", b"x"):
                payload = self._payload()
                if byte == b"x":
                    self.stop()
                    raise payload  # type: ignore[misc]
                self.result = payload  # type: ignore[assignment]
                return
            else:
                self.stop()
                raise JudgeDied(f"Monitor: the background judge said {byte!r}")
            if not self._unread:
                return
            byte = self._byte()

    def _payload(self) -> object:
        size = int.from_bytes(self._take(8), "little")
        return pickle.loads(self._take(size))

    def _take(self, n: int) -> bytes:
        while len(self._unread) < n:
            more = os.read(self._out, max(65536, n - len(self._unread)))
            if not more:
                self.stop()
                raise JudgeDied("Monitor: the background judge died mid-answer (see stderr)")
            self._unread += more
        taken, self._unread = self._unread[:n], self._unread[n:]
        return taken


PIPE_BYTES = 1 << 20
"""The pipe to the child is widened to this (Linux; at most ``/proc/sys/fs/pipe-max-size``): a
batch of 1024 reference-engine events pickles to about 30 KB, so a full queue fits in it and a
send does not wait for the child's reader thread, which gets the child's GIL only every few
milliseconds while the judge runs."""


def _widen(pipe: object) -> None:
    try:
        import fcntl

        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)  # type: ignore[attr-defined]
    except (ImportError, AttributeError, OSError):
        pass  # not Linux, or a lower limit: the default pipe (64 KiB) works, more slowly


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


def _answer(out: object, tag: bytes, value: object) -> None:
    payload = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    out.write(tag + len(payload).to_bytes(8, "little") + payload)  # type: ignore[attr-defined]


_GONE = object()


def _read(source: BinaryIO, inbox: queue.SimpleQueue[object]) -> None:
    """The child's reader thread: take frames off the pipe as they come, so that the parent's
    writes never wait on a full pipe while the judge is busy (the parent's queue depth bounds
    what waits here). Each read takes all the pipe holds (``read1``, up to ``READ_BYTES``): the
    thread needs the GIL, which the judging thread gives up only every switch interval (5 ms),
    so a frame per read would drain the pipe slower than the engine fills it. A batch goes on
    as its bytes; unpickling is the judge's thread's."""
    pending = bytearray()
    while True:
        data = source.read1(READ_BYTES)  # type: ignore[attr-defined]
        if not data:  # end of input (a torn frame too): the parent is gone
            inbox.put(_GONE)
            return
        pending += data
        while len(pending) >= 1 + _LENGTH:
            tag, size = pending[:1], int.from_bytes(pending[1 : 1 + _LENGTH], "little")
            if tag == CLOSE:
                inbox.put(None)
                return
            if tag != BATCH:
                inbox.put(_GONE)  # not a frame: the stream is torn
                return
            if len(pending) < 1 + _LENGTH + size:
                break
            inbox.put(bytes(pending[1 + _LENGTH : 1 + _LENGTH + size]))
            del pending[: 1 + _LENGTH + size]


READ_BYTES = PIPE_BYTES
"""The most the child's reader takes off the pipe at once: all a widened pipe holds."""


def chunks(body: bytes) -> Iterable[tuple[list[Event], dict[int, str] | None]]:
    """A batch's chunks: each its events and their hashes (None: none)."""
    data = io.BytesIO(body)
    while data.tell() < len(body):
        chunk = pickle.load(data)
        yield (chunk, None) if type(chunk) is list else chunk


def serve() -> None:
    """The child: judge batches with a synchronous ``Monitor`` until close or end of input."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a stray print goes to stderr, not into the answers
    source = sys.stdin.buffer
    config, options = pickle.load(source)
    monitor = _synchronous(config, **options)
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    threading.Thread(target=_read, args=(source, inbox), daemon=True).start()
    out.write(b"s")
    finding: Finding | None = None
    try:
        while True:
            message = inbox.get()
            if message is _GONE:
                return  # the parent is gone
            if message is None:
                if finding is None:
                    finding = monitor.close()
                _answer(out, b"r", (finding, monitor.report()))
                return
            if finding is None:
                finding = _judge(monitor, message)  # type: ignore[arg-type]
                if finding is not None:
                    out.write(b"f")
            out.write(b"a")
    except BrokenPipeError:
        return
    except Exception as err:  # noqa: BLE001 - handed to the parent, which raises it
        try:
            _answer(out, b"x", err)
        except Exception:  # noqa: BLE001 - not picklable: its text then
            _answer(out, b"x", JudgeDied(f"Monitor: the background judge raised {err!r}"))


def _judge(monitor: Monitor, body: bytes) -> Finding | None:
    """Feed a batch's events to ``monitor``, up to a finding."""
    feed = monitor.feed
    for events, hashes in chunks(body):
        if hashes:
            for i, event in enumerate(events):
                if feed(event, hashes.get(i)) is not None:
                    return monitor.finding
        elif monitor.feed_all(events) is not None:
            return monitor.finding
    return monitor.finding


def _synchronous(
    config: Config, judging: str, check_every: int, name: str, window: int | None
) -> Monitor:
    """The child's synchronous ``Monitor`` for these options."""
    if judging == "spec":
        return Monitor.on_spec(config, check_every, raise_on_finding=False, name=name)
    if judging == "observed":
        return Monitor.observed(config, raise_on_finding=False, name=name)
    return Monitor.fast(config, raise_on_finding=False, name=name, window=window)
