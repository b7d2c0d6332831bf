"""A live subscription to an engine's KV events, and ``kvspec watch``.

``Subscriber`` connects a ZMQ SUB socket to a publisher (vLLM's or SGLang's
``ZmqEventPublisher``) and, when given one, a DEALER socket to its replay endpoint. Frames go
through a ``frames.Sequencer``; a gap is filled by asking the replay socket for everything from
the first missing number (``(b"", start_seq)``, answered frame by frame and closed by an end
marker); if the replay ends, or stays silent for ``replay_timeout`` seconds, without the missing
batches, the gap is given up and the stream's judge sees the jump. At start the subscriber asks
for a replay from 0 and holds live frames until it ends, so that a subscriber that connects after
the first batches (ZMQ's slow joiner) still sees the whole stream while the publisher's replay
buffer holds it. Every frame offered to the sequencer, and every end of a replay, is written to
the capture file in that order, so ``kvspec check --kv-events`` on the capture re-judges exactly
what was judged live.

pyzmq is an optional dependency (``pip install 'kvspec[zmq]'``).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from .frames import (
    END_SEQ,
    CaptureWriter,
    Frame,
    FrameError,
    Sequencer,
    decode_batch,
    parse_seq,
)
from .stream_judge import StreamJudge, ViewTooLarge


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise ValueError("this needs pyzmq: pip install 'kvspec[zmq]' (or pyzmq)") from None
    return zmq


class Subscriber:
    """Ordered batches from a live publisher (module docstring)."""

    def __init__(
        self,
        endpoint: str,
        replay: str | None = None,
        topic: str = "",
        capture: CaptureWriter | None = None,
        replay_timeout: float = 2.0,
        context: Any = None,
    ) -> None:
        zmq = _zmq()
        self.zmq = zmq
        self.context = context or zmq.Context.instance()
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay, topic
        self.capture = capture
        self.replay_timeout = replay_timeout
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._connect(self.sub, endpoint)
        self.dealer = None
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.sequencer = Sequencer(expected=None)
        self.asked: float | None = None
        """When the outstanding replay request was sent (None: none outstanding)."""
        self.starting = False
        self.held_live: list[tuple[int, bytes, bytes]] = []
        self.replays = 0
        if replay is not None:
            self.dealer = self.context.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self._connect(self.dealer, replay)
            self.poller.register(self.dealer, zmq.POLLIN)
            self.starting = True
            self._ask(0)

    def _connect(self, socket: Any, endpoint: str) -> None:
        """``ValueError`` (a bad argument) for an endpoint ZMQ refuses."""
        try:
            socket.connect(endpoint)
        except self.zmq.ZMQError as err:
            self.close()
            raise ValueError(f"cannot connect to {endpoint!r}: {err.strerror}") from None

    def _ask(self, start: int) -> None:
        assert self.dealer is not None
        self.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        self.asked = time.monotonic()
        self.replays += 1

    def poll(self, timeout: float) -> list[tuple[int, bytes]]:
        """Wait up to ``timeout`` seconds for frames; the batches now deliverable, in order.
        Raises ``FrameError`` for a frame that is not (topic, 8-byte seq, payload)."""
        ready: list[tuple[int, bytes]] = []
        events = dict(self.poller.poll(int(timeout * 1000)))
        zmq = self.zmq
        while True:
            got = False
            if events.get(self.dealer) or (self.dealer is not None and self._readable(self.dealer)):
                got = True
                ready += self._replay_frame(self.dealer.recv_multipart(zmq.NOBLOCK))
            if events.get(self.sub) or self._readable(self.sub):
                got = True
                ready += self._live_frame(self.sub.recv_multipart(zmq.NOBLOCK))
            events = {}
            if not got:
                break
        if self.asked is not None and time.monotonic() - self.asked > self.replay_timeout:
            ready += self._replay_ended()
        return ready

    def _readable(self, socket: Any) -> bool:
        return bool(socket.getsockopt(self.zmq.EVENTS) & self.zmq.POLLIN)

    def _live_frame(self, parts: list[bytes]) -> list[tuple[int, bytes]]:
        if len(parts) != 3:
            raise FrameError(f"a frame is (topic, seq, payload); got {len(parts)} parts")
        topic, seq_bytes, payload = parts
        seq = parse_seq(seq_bytes)
        if seq < 0:
            raise FrameError(f"sequence number {seq} on the live socket")
        if self.starting:
            self.held_live.append((seq, topic, payload))
            return []
        return self._offer(Frame("pub", seq, topic, payload))

    def _replay_frame(self, parts: list[bytes]) -> list[tuple[int, bytes]]:
        if len(parts) != 4 or parts[0] != b"":
            raise FrameError(
                f"a replay frame is (b'', topic, seq, payload); got {len(parts)} parts"
            )
        _, topic, seq_bytes, payload = parts
        seq = parse_seq(seq_bytes)
        if seq == END_SEQ:
            return self._replay_ended()
        if seq < 0:
            raise FrameError(f"sequence number {seq} on the replay socket")
        return self._offer(Frame("replay", seq, topic, payload))

    def _replay_ended(self) -> list[tuple[int, bytes]]:
        self.asked = None
        self._record(Frame("replay-end"))
        ready = self.sequencer.give_up() if self.sequencer.wanted is not None else []
        if self.starting:
            self.starting = False
            self.sequencer.start_at(0)  # if nothing was buffered, the stream starts at 0
            held, self.held_live = self.held_live, []
            for seq, topic, payload in held:
                ready += self._offer(Frame("pub", seq, topic, payload))
        return ready

    def _offer(self, frame: Frame) -> list[tuple[int, bytes]]:
        if self.topic and not frame.topic.startswith(self.topic.encode()):
            return []
        self._record(frame)
        ready = self.sequencer.offer(frame.seq, frame.payload)
        wanted = self.sequencer.wanted
        if wanted is not None and self.asked is None:
            if self.dealer is not None:
                self._ask(wanted)
            else:
                ready += self.sequencer.give_up()
        return ready

    def _record(self, frame: Frame) -> None:
        if self.capture is not None:
            self.capture.write(frame)

    def close(self) -> None:
        self.sub.close(linger=0)
        if getattr(self, "dealer", None) is not None:
            self.dealer.close(linger=0)


# -- kvspec watch -------------------------------------------------------------------------------


def summary_table(judge: StreamJudge, endpoint: str, sub: Subscriber) -> Any:
    from rich.table import Table

    stats, view = judge.stats, judge.view
    seconds = max(stats.seconds, 1e-9)
    table = Table(title=f"kvspec watch {endpoint}", show_header=False)
    rows = [
        ("batches judged", f"{stats.batches} (last seq {view.seq if view else '-'})"),
        ("events judged", f"{stats.events} ({stats.events / seconds:,.0f}/s)"),
        ("blocks stored / removed", f"{stats.stored} / {stats.removed}"),
        ("clears", str(stats.cleared)),
        ("blocks announced now", str(sum(view.held.values())) if view else "0"),
        (
            "gaps filled by replay / lost",
            f"{sub.sequencer.gaps_filled} / {sub.sequencer.gaps_lost}",
        ),
        ("verdict", judge.finding.invariant if judge.finding else "holds so far"),
    ]
    if judge.joined_at is not None:
        rows.append(("joined at batch", str(judge.joined_at)))
    for name, value in rows:
        table.add_row(name, value)
    return table


def check_endpoint(endpoint: str, what: str = "ENDPOINT") -> None:
    """``ValueError`` (exit 2, one line) for an endpoint that cannot be connected to: not
    ``tcp://``, ``ipc://`` or ``inproc://``; a TCP port outside 1..65535; a host that does not
    resolve. (ZMQ connects in the background and would wait for such an endpoint forever.)"""
    import socket

    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{what} {endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT)")
    if not endpoint.startswith("tcp://"):
        return
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} {endpoint!r}: expected tcp://HOST:PORT with a port 1..65535")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise ValueError(f"{what} {endpoint!r}: host {host!r} does not resolve ({err})") from None


def watch(
    endpoint: str,
    replay: str | None = None,
    topic: str = "",
    capture: str | None = None,
    capacity: int | None = None,
    invariants: list[str] | None = None,
    seconds: float | None = None,
    as_json: bool = False,
    out: Callable[[str], None] = print,
    known: Iterable[str] = (),
) -> int:
    """Judge a live stream until interrupted (or ``seconds``): 0 nothing found, 1 a violation
    (its report printed), 2 a malformed frame (one line on stderr), 3 no batch received (nothing
    was judged). ``known``: known engine findings read by name (``known_findings.py``)."""
    from rich.console import Console
    from rich.live import Live

    check_endpoint(endpoint)
    if replay:
        check_endpoint(replay, "--replay")
    judge = StreamJudge(invariants, capacity, known=known)
    writer = CaptureWriter(capture, endpoint, replay) if capture else None
    try:
        sub = Subscriber(endpoint, replay, topic, writer)
    except ValueError:
        if writer is not None:
            writer.close()
        raise
    console = Console(stderr=True)
    stop = {"now": False}

    def interrupted(signum: int, frame: object) -> None:
        stop["now"] = True

    # SIGINT and SIGTERM only set a flag that the loop reads between polls: a KeyboardInterrupt
    # raised at an arbitrary point could leave a lock of the live display taken (a `with lock:`
    # interrupted between the acquire and the block) and hang the exit.
    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    code = 0
    try:
        table = summary_table(judge, endpoint, sub)
        # Refreshed by this loop (no refresh thread of rich's own to join at the end).
        with Live(table, console=console, auto_refresh=False, transient=True) as live:
            shown = 0.0
            while not stop["now"]:
                if seconds is not None and time.monotonic() - started >= seconds:
                    break
                for seq, payload in sub.poll(0.1):
                    judge.take_up(sub.sequencer.origin)
                    if judge.feed(decode_batch(seq, payload)) is not None:
                        code = 1
                        break
                if code:
                    break
                if time.monotonic() - shown >= 0.25:
                    live.update(summary_table(judge, endpoint, sub), refresh=True)
                    shown = time.monotonic()
            live.update(summary_table(judge, endpoint, sub), refresh=True)
        console.print(summary_table(judge, endpoint, sub))  # the final summary stays
    except (FrameError, ViewTooLarge) as err:
        sys.stderr.write(f"kvspec watch: {endpoint}: {err}\n")
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sub.close()
        if writer is not None:
            writer.close()
    if code == 0 and judge.stats.batches == 0:  # nothing was judged: undecided, not "holds"
        out(f"{endpoint}: nothing received in {time.monotonic() - started:.1f} s: no batch judged")
        return 3
    report = judge.report(endpoint)
    if as_json:
        import orjson

        out(orjson.dumps({"exit": report.exit_code, "reports": [report.as_dict()]}, option=orjson.OPT_INDENT_2).decode())  # fmt: skip
    elif code:
        out(report.text())
    return code


class Loopback:
    """An engine's own publisher and a ``Subscriber`` on it in this process: what an adapter
    publishes comes back as a router would receive it (``adapters/*/kv_stream.py`` build the
    publisher, bound to ports the system picks, and say where it listens)."""

    RECEIVE_TIMEOUT = 10.0
    """Seconds to wait for a published batch to come back before giving it up."""

    def __init__(self, publisher: Any, endpoint: str, replay: str, topic: str) -> None:
        self.publisher = publisher
        self.endpoint, self.replay = endpoint, replay
        self.subscriber = Subscriber(endpoint, replay, topic, replay_timeout=1.0)
        self.published = 0
        """Batches handed to the publisher: the sequence number of the next one."""
        self.received: dict[int, bytes] = {}

    def publish(self, batch: Any) -> int:
        seq = self.published
        self.published += 1
        self.publisher.publish(batch)
        return seq

    def receive(self, upto: int) -> list[tuple[int, bytes]]:
        """The frames from the oldest not yet taken to ``upto``, in order (fewer if the publisher
        and its replay socket lost some: the stream's judge sees the gap)."""
        deadline = time.monotonic() + self.RECEIVE_TIMEOUT
        while upto not in self.received and time.monotonic() < deadline:
            for seq, payload in self.subscriber.poll(0.05):
                self.received[seq] = payload
        ready = sorted((seq, p) for seq, p in self.received.items() if seq <= upto)
        for seq, _ in ready:
            del self.received[seq]
        return ready
