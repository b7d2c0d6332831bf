"""The background Monitor's encoding (conformance/background.py): what the engine's thread feeds
reaches the child whole, in order and in frames of exactly ``batch_size`` events, however the
engine groups its calls, and the child's report is the synchronous ``Monitor.fast``'s, field for
field. The frames are read back here with the child's own reader (``_read``, ``chunks``) from the
bytes the parent wrote; the verdicts come from a real child. Reports against fuzzed traces are in
``test_fastmodel.py``.
"""

from __future__ import annotations

import io
import itertools
import pickle
import queue
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_checker import safe_run

from kvspec.conformance import background
from kvspec.conformance.background import (
    BackgroundMonitor,
    Batch,
    Child,
    JudgeDied,
    UnsendableEvent,
    chunks,
)
from kvspec.conformance.monitor import MalformedEvent, Monitor, Violation
from kvspec.conformance.report import Report
from kvspec.conformance.trace import iter_trace, write_trace
from kvspec.spec import Config
from kvspec.spec.events import Event


@pytest.fixture(autouse=True)
def deadline() -> Iterator[None]:
    """A test that hangs fails instead (a torn frame leaves both processes waiting)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError("the background monitor hung")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


BATCH = 8
SIZES = [1, BATCH - 1, BATCH, BATCH + 1, 0, 1, 1, 2 * BATCH + 3, 3, 1, BATCH, 5, 1, 1, 1]
"""The engine's calls, cycled: 1 is a single ``feed``, any other size a ``feed_all`` of that
many (0: an empty call). Below, at and above the batch size, across batch boundaries."""


class Wire:
    """Every byte the parent writes to its child, read back as the child reads it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.written: list[bytes] = []
        write = Child._write

        def spy(child: Child, data: bytes | memoryview) -> None:
            self.written.append(bytes(data))
            write(child, data)

        monkeypatch.setattr(Child, "_write", spy)

    def batches(self) -> tuple[list[list[tuple[Event, str | None]]], bool]:
        """The batches the child would judge, each its (event, hash) pairs, and whether the
        stream ended with a close frame (not torn)."""
        source = io.BytesIO(b"".join(self.written))
        pickle.load(source)  # sys.path
        pickle.load(source)  # (config, options)
        inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        background._read(source, inbox)  # type: ignore[arg-type]
        messages = []
        while not inbox.empty():
            messages.append(inbox.get())
        closed = bool(messages) and messages[-1] is None
        batches = [
            [
                (event, (hashes or {}).get(i))
                for events, hashes in chunks(body)  # type: ignore[arg-type]
                for i, event in enumerate(events)
            ]
            for body in messages
            if isinstance(body, bytes)
        ]
        return batches, closed


def hashed_run(tmp_path: Path, requests: int = 40) -> tuple[Config, list[tuple[Event, str | None]]]:
    """A clean reference-engine run, each publish with its hash (as a trace file carries it)."""
    config, events = safe_run(requests)
    path = tmp_path / "run.jsonl"
    write_trace(path, config, events, hashes=True)
    read_config, read = iter_trace(path)
    return read_config, [(event, hash_) for _, event, hash_ in read]


def fed_as_an_engine_would(
    monitor: BackgroundMonitor | Monitor, stream: list[tuple[Event, str | None]]
) -> Iterator[int]:
    """Feed ``stream`` in calls of the sizes ``SIZES`` cycles through (single events with their
    hashes, lists without), yielding the events fed after each call."""
    at = 0
    for size in itertools.cycle(SIZES):
        if at >= len(stream):
            return
        if size == 1:
            monitor.feed(*stream[at])
        else:
            monitor.feed_all([event for event, _ in stream[at : at + size]])
        at = min(at + size, len(stream))
        yield at


def sync_outcome(config: Config, stream: list[tuple[Event, str | None]]) -> Report:
    """The synchronous ``Monitor.fast``'s report, fed the same calls."""
    monitor = Monitor.fast(config)
    try:
        with monitor:
            for _ in fed_as_an_engine_would(monitor, stream):
                pass
    except Violation as caught:
        return caught.report
    return monitor.report()


def without_hashes(stream: list[tuple[Event, str | None]]) -> list[tuple[Event, str | None]]:
    """What the child must receive: hashes only where the event was fed alone (``feed``)."""
    single = set()
    at = 0
    for size in itertools.cycle(SIZES):
        if at >= len(stream):
            break
        if size == 1:
            single.add(at)
        at += size
    return [(event, hash_ if i in single else None) for i, (event, hash_) in enumerate(stream)]


def test_calls_across_batch_boundaries_reach_the_child_whole_and_in_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Calls below, at and above the batch size, single feeds with hashes among them: the child
    receives exactly the events fed, in order, each single feed's hash with its event, in frames of
    exactly ``batch_size`` events but the last, sent at close; and its report is the synchronous
    one's, field for field."""
    config, stream = hashed_run(tmp_path)
    assert any(hash_ for _, hash_ in stream) and len(stream) > 20 * BATCH
    wire = Wire(monkeypatch)
    monitor = BackgroundMonitor(config, batch_size=BATCH, queue_depth=2)
    want = without_hashes(stream)
    with monitor:
        for fed in fed_as_an_engine_would(monitor, stream):
            assert monitor.events_seen == fed
        # before close (a torn frame would leave the child waiting for bytes that never come)
        batches, closed = wire.batches()
        assert not closed and [len(batch) for batch in batches] == [BATCH] * len(batches)
        assert [pair for batch in batches for pair in batch] == want[: len(batches) * BATCH]
    batches, closed = wire.batches()
    assert closed and [pair for batch in batches for pair in batch] == want
    assert all(len(batch) == BATCH for batch in batches[:-1]) and 0 < len(batches[-1]) <= BATCH
    report = monitor.report()
    assert report == sync_outcome(config, stream)
    assert (report.exit_code, report.events) == (0, len(stream))


def test_a_partial_batch_at_close_is_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """``close`` sends the events of a batch not yet full: none is lost, clean or buggy (the
    offending event in that last partial batch: the Violation comes at close, as the
    synchronous monitor's report)."""
    config, events = safe_run(10)
    events = events[: 3 * BATCH + 5]
    monitor = BackgroundMonitor(config, batch_size=BATCH)
    monitor.feed_all(events[:-3])
    for event in events[-3:]:
        monitor.feed(event)
    assert monitor.close() is None
    assert monitor.report() == sync_outcome(config, [(event, None) for event in events])
    assert monitor.report().events == len(events)
    bad = events[:-2] + [("free", 0)]
    want = sync_outcome(config, [(event, None) for event in bad])
    assert want.line == len(bad) and want.exit_code == 1
    wire = Wire(monkeypatch)
    monitor = BackgroundMonitor(config, batch_size=BATCH)
    monitor.feed_all(bad[:-3])
    for event in bad[-3:]:
        monitor.feed(event)
    with pytest.raises(Violation) as caught:
        monitor.close()
    assert caught.value.report == want
    batches, closed = wire.batches()
    assert closed and [len(batch) for batch in batches] == [BATCH] * 3 + [len(bad) - 3 * BATCH]


@pytest.mark.parametrize("depth", [1, 3])
def test_a_finding_comes_within_the_bound_however_calls_are_grouped(
    monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """A bug anywhere in a run fed in mixed calls: the Violation (the synchronous report) comes
    before the engine has handed over ``(depth + 1) * batch_size`` events past the offending
    one, or at close when the run ends sooner."""
    handed: list[int] = []
    send = Child.send

    def spy(child: Child, batch: Batch) -> object:
        handed.append(child.events + batch.events)  # the events handed over at this send
        return send(child, batch)

    monkeypatch.setattr(Child, "send", spy)
    config, events = safe_run(30)
    frees = [i for i, event in enumerate(events) if event[0] == "free"]
    for late in (frees[2], frees[len(frees) // 2], frees[-3]):
        bad = [(event, None) for event in events[:late] + [("free", 0)] + events[late + 1 :]]
        want = sync_outcome(config, bad)
        assert want.exit_code == 1 and want.line is not None and want.line <= late + 1
        handed.clear()
        monitor = BackgroundMonitor(config, batch_size=BATCH, queue_depth=depth)
        raised = None
        try:
            with monitor:
                for fed in fed_as_an_engine_would(monitor, bad):
                    raised = fed
            raised = None
        except Violation as caught:
            assert caught.report == want
        else:
            pytest.fail("no Violation")
        if raised is None:  # at close: the run ended within the bound
            assert len(bad) - want.line < (depth + 1) * BATCH
        else:
            assert handed and handed[-1] - want.line < (depth + 1) * BATCH, (handed, want.line)


def body(batch: Batch) -> bytes:
    """A batch's pickles, as the child gets them (the frame's tag and length off)."""
    with batch.frame() as frame:
        return bytes(frame[1 + background._LENGTH :])


def test_a_cyclic_event_is_sent_with_the_memo_and_judged_as_the_synchronous_monitor_does() -> None:
    """Fast mode (no memo) refuses a cycle: that chunk is pickled again with the memo, the
    batch's other chunks untouched; the child gets the cycle back, and judges it as
    ``Monitor.fast`` does."""
    config, events = safe_run(3)
    loop: list[object] = []
    loop.append(loop)
    cyclic = ("commit", 0, loop)
    batch = Batch()
    batch.put(events[:3], 3)
    batch.put([cyclic, events[3]], 2)
    batch.put(events[4:6], 2)
    got = [event for chunk, _ in chunks(body(batch)) for event in chunk]
    assert got[:3] == events[:3] and got[4:] == events[3:6] and batch.events == 7
    assert got[3][2][0] is got[3][2]  # type: ignore[index]
    shared = (1, 2)
    batch = Batch()
    batch.put([("x", shared, shared)], 1)
    assert list(chunks(body(batch))) == [([("x", (1, 2), (1, 2))], None)]
    # Judged: a cyclic event is malformed (``trace.event_error``), for the synchronous monitor
    # and, raised in the child and handed over whole, for this one.
    for bad in (("execute", 0, loop), ("free", loop)):
        stream = [(event, None) for event in events[:4] + [bad] + events[4:20]]
        with pytest.raises(MalformedEvent) as sync_error:
            sync_outcome(config, stream)
        assert sync_error.value.number == 5
        monitor = BackgroundMonitor(config, batch_size=BATCH)
        with pytest.raises(MalformedEvent) as error:
            with monitor:
                for _ in fed_as_an_engine_would(monitor, stream):
                    pass
        assert str(error.value) == str(sync_error.value) and error.value.number == 5


@pytest.mark.parametrize("how", ["feed_all", "feed"])
def test_an_event_that_does_not_pickle_is_bad_input_named_in_one_line(how: str) -> None:
    """An event that cannot reach the child (here a lock in it): ``UnsendableEvent``, a
    ValueError (bad input; never a ``Violation``, never the pickler's own error) whose message is
    one line naming the event's number in the stream; the child is stopped and ``close`` says
    there is no verdict."""
    config, events = safe_run(10)
    at = 2 * BATCH + 3  # inside the third batch
    bad = ("free", threading.Lock())
    stream = events[:at] + [bad] + events[at : at + 2 * BATCH]
    monitor = BackgroundMonitor(config, batch_size=BATCH)
    with pytest.raises(UnsendableEvent) as caught:
        if how == "feed_all":
            monitor.feed_all(stream[:5])
            monitor.feed_all(stream[5:])
        else:
            for event in stream:
                monitor.feed(event)
    err = caught.value
    assert isinstance(err, ValueError) and not isinstance(err, Violation)
    assert err.number == at + 1 and err.event is bad
    message = str(err)
    assert "\n" not in message and message.startswith(f"<monitor>:{at + 1}: ")
    assert "does not pickle" in message and "lock" in message
    assert monitor.child.proc.poll() is not None
    with pytest.raises(JudgeDied, match="stopped"):
        monitor.close()


class Trickle(io.BytesIO):
    """A pipe that hands over its bytes in pieces of the given sizes, cycled (``read1``)."""

    def __init__(self, data: bytes, pieces: list[int]) -> None:
        super().__init__(data)
        self.pieces = itertools.cycle(pieces)

    def read1(self, size: int = -1) -> bytes:
        return super().read1(min(size, next(self.pieces)))


@pytest.mark.parametrize("pieces", [[1], [5, 3, 17], [4096], [1 << 20]])
def test_the_childs_reader_takes_frames_however_the_pipe_splits_them(
    pieces: list[int],
) -> None:
    """The child's reader takes what the pipe holds at once, so a read may end inside a frame
    or hold several: every batch comes out whole and in order, then the close; a stream cut
    inside a frame is the parent gone (never a batch cut short)."""
    config, events = safe_run(5)
    frames = []
    for start in range(0, 5 * BATCH, BATCH):
        batch = Batch()
        batch.put(events[start : start + BATCH], BATCH)
        with batch.frame() as frame:
            frames.append(bytes(frame))
    close = background.CLOSE + bytes(background._LENGTH)
    for stream, last in ((b"".join(frames) + close, None), (b"".join(frames)[:-3], "gone")):
        inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        background._read(Trickle(stream, pieces), inbox)  # type: ignore[arg-type]
        got = []
        while not inbox.empty():
            got.append(inbox.get())
        want = [frame[1 + background._LENGTH :] for frame in frames]
        if last is None:
            assert got == [*want, None]
        else:
            assert got == [*want[:-1], background._GONE]
