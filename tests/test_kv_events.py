"""The KV-event readers (``conformance/kvevents/frames.py``, ``kv_watch.py``) and ``kvspec check
--kv-events``: real frames of vLLM 0.33.0 and SGLang 0.5.23, captures, gaps and the replay."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.conformance.kvevents.frames import (
    Frame,
    FrameError,
    Sequencer,
    decode_batch,
    encode_batch,
    write_capture,
)
from kvspec.conformance.kvevents.stream_judge import check_capture
from kvspec.spec.stream import Batch, Cleared, Removed, Stored

# vLLM 0.33.0's ZmqEventPublisher payload (msgspec.msgpack of its KVEventBatch) for a store of two
# sha256 hashes with a LoRA, per-block extra keys and the spec kind, a removal and a clear.
VLLM_FRAME = bytes.fromhex(
    "93cb3ff800000000000093de000ca474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392"
    "c420ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bbc4203e23e8160039594a33"
    "894f6564e1b1348bbd7a0088d42c4acb73eeaed59c009db1706172656e745f626c6f636b5f68617368c0a9746f"
    "6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f696407a66d656469756da3475055a9"
    "6c6f72615f6e616d65a178aa65787472615f6b6579739291a17892a17892a26d6d03a967726f75705f69647800"
    "b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6eaa73657373696f6e5f6964"
    "a17384a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c4203e23e8160039594a"
    "33894f6564e1b1348bbd7a0088d42c4acb73eeaed59c009da66d656469756da3475055a967726f75705f696478"
    "0081a474797065b0416c6c426c6f636b73436c656172656400"
)
# SGLang 0.5.23's (int64 hashes, a cache salt, attention-DP rank 1).
SGLANG_FRAME = bytes.fromhex(
    "93cb40000000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392fb09"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a65"
    "02a76c6f72615f6964c0a66d656469756da3475055aa63616368655f73616c74a473616c7483a474797065ac42"
    "6c6f636b52656d6f766564ac626c6f636b5f6861736865739109a66d656469756da347505581a474797065b041"
    "6c6c426c6f636b73436c656172656401"
)


def test_vllm_and_sglang_frames_decode() -> None:
    batch = decode_batch(4, VLLM_FRAME)
    assert batch.seq == 4 and batch.ts == 1.5 and batch.rank == 0
    store, removal, clear = batch.events
    assert isinstance(store, Stored) and isinstance(removal, Removed) and isinstance(clear, Cleared)
    assert len(store.hashes) == 2 and all(
        isinstance(h, bytes) and len(h) == 32 for h in store.hashes
    )
    assert store.parent is None and store.tokens == (1, 2, 3, 4) and store.block_size == 2
    assert (store.medium, store.group, store.lora_name) == ("GPU", 0, "x")
    assert store.extra_keys == (("x",), ("x", ("mm", 3)))
    assert removal.hashes == (store.hashes[1],) and removal.group == 0
    sg = decode_batch(0, SGLANG_FRAME)
    assert sg.rank == 1 and sg.events[0].hashes == (-5, 9)  # type: ignore[union-attr]
    assert sg.events[0].extra_keys == (("salt", "salt"), ("salt", "salt"))  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93",
        bytes.fromhex("93cb3ff8000000000000"),  # no events
        bytes.fromhex("93cb3ff800000000000091a474797065"),  # an event that is not a map
        VLLM_FRAME.replace(b"token_ids\x94\x01", b"token_ids\x94\xa1"),  # a token that is a str
        VLLM_FRAME.replace(b"BlockStored", b"BlockStorex"),  # an unknown kind
    ],
)
def test_malformed_frames_are_refused(payload: bytes) -> None:
    with pytest.raises(FrameError):
        decode_batch(0, payload)


def test_encode_decode_round_trip() -> None:
    batch = Batch(3, (Stored((1, 2), 9, (1, 2, 3, 4), 2, "GPU", 0, "x", ((1,), ("a", 2))), Removed((1,), "CPU", 1), Cleared()), 2.5, 0)  # fmt: skip
    assert decode_batch(3, encode_batch(batch)) == batch


def test_the_sequencer_fills_a_gap_and_gives_one_up() -> None:
    seq = Sequencer()
    assert seq.offer(0, b"a") == [(0, b"a")]
    assert seq.offer(2, b"c") == [] and seq.wanted == 1
    assert seq.offer(3, b"d") == [] and seq.wanted == 1
    assert seq.offer(1, b"b") == [(1, b"b"), (2, b"c"), (3, b"d")] and seq.gaps_filled == 1
    assert seq.offer(2, b"c") == [] and seq.duplicates == 1  # replayed again
    assert seq.offer(6, b"g") == [] and seq.give_up() == [(6, b"g")] and seq.gaps_lost == 1
    late = Sequencer(expected=None)
    assert late.offer(40, b"x") == [(40, b"x")] and late.origin == 40
    known = Sequencer(expected=None)
    known.start_at(0)
    assert known.offer(1, b"x") == [] and known.give_up() == [(1, b"x")] and known.origin == 0


def frames(*batches: Batch, via: str = "pub") -> list[Frame]:
    return [Frame(via, b.seq, b"", encode_batch(b)) for b in batches]


STORE = Batch(0, (Stored((1, 2), None, (1, 2, 3, 4), 2, "GPU", 0),))
EXTEND = Batch(1, (Stored((3,), 2, (5, 6), 2, "GPU", 0), Removed((3,), "GPU", 0)))
ORPHAN = Batch(2, (Removed((7,), "GPU", 0),))


def test_check_capture_exit_codes(tmp_path: Path) -> None:
    clean, bad, gap, filled = (tmp_path / f"{n}.jsonl" for n in ("clean", "bad", "gap", "filled"))
    write_capture(clean, frames(STORE, EXTEND))
    write_capture(bad, frames(STORE, EXTEND, ORPHAN))
    write_capture(gap, frames(STORE, Batch(2, ())))
    replayed = frames(Batch(2, ())) + frames(STORE, EXTEND, Batch(2, ()), via="replay")
    write_capture(filled, frames(STORE) + replayed + [Frame("replay-end")], replay="tcp://r")
    assert check_capture(clean).exit_code == 0
    report = check_capture(bad)
    assert (report.exit_code, report.invariant, report.line) == (1, "RemovalNamesAnnounced", 4)
    assert check_capture(gap).invariant == "SequenceInOrder"
    assert check_capture(filled).exit_code == 0  # the replay filled batch 1
    # a capture of a replay that did not fill it
    unfilled = tmp_path / "unfilled.jsonl"
    write_capture(unfilled, frames(STORE, Batch(2, ())) + [Frame("replay-end")], replay="tcp://r")
    assert check_capture(unfilled).invariant == "SequenceInOrder"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("not json\n", ":2: not JSON"),
        ('{"via": "pub", "seq": -1, "topic": "", "payload": ""}\n', ":2: seq must be"),
        ('{"via": "pub", "seq": 0, "topic": "", "payload": "!!"}\n', ":2: payload is not base64"),
        ('{"via": "mail"}\n', ":2: via must be"),
        (
            '{"via": "pub", "seq": 0, "topic": "", "payload": "AAAA"}\n',
            ":2: batch 0: not a KV-event",
        ),
    ],
)
def test_unreadable_captures_say_where(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"format": "kvspec-kv-events", "version": 1, "endpoint": "-", "replay": null}\n' + text)  # fmt: skip
    report = check_capture(path)
    assert report.exit_code == 2 and report.error is not None and where in report.error
    other = tmp_path / "other.jsonl"
    other.write_text('{"format": "kvspec-trace"}\n')
    assert check_capture(other).exit_code == 2


def test_kvspec_check_kv_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean, bad = tmp_path / "clean.jsonl", tmp_path / "bad.jsonl"
    write_capture(clean, frames(STORE, EXTEND))
    write_capture(bad, frames(STORE, EXTEND, ORPHAN))
    assert main(["check", "--kv-events", str(clean)]) == 0
    assert "holds (3 events" in capsys.readouterr().out
    html = tmp_path / "r.html"
    assert main(["check", "--kv-events", str(clean), "--kv-events", str(bad), "--json", "--html", str(html)]) == 1  # fmt: skip
    document = json.loads(capsys.readouterr().out)
    assert document["exit"] == 1
    violation = document["reports"][1]["violation"]
    assert violation["invariant"] == "RemovalNamesAnnounced" and violation["where"].endswith(":4")
    assert "RemovalNamesAnnounced" in html.read_text()
    assert main(["check", "--kv-events", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["check"]) == 2
    assert "name a TRACE" in capsys.readouterr().err


# -- the live subscriber, against a stand-in publisher speaking vLLM's protocol ------------------

zmq = pytest.importorskip("zmq")


class StandIn:
    """PUB + replay ROUTER as vLLM's ZmqEventPublisher runs them (its replay protocol), driven
    synchronously by the test; ``lose`` sequence numbers are not sent live (kept for replay),
    ``forget`` ones are not kept either."""

    def __init__(self, lose: set[int] = frozenset(), forget: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)  # a PUB that also says when a subscriber is up
        self.router = self.context.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: list[tuple[int, bytes]] = []
        self.lose, self.forget = lose, forget
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.lock = threading.Lock()
        self.thread.start()

    def wait_subscribed(self) -> None:
        assert self.pub.poll(10_000), "no subscriber came"
        self.pub.recv()  # the subscription message

    def send(self, batch: Batch) -> None:
        payload = encode_batch(batch)
        with self.lock:
            if batch.seq not in self.forget:
                self.buffer.append((batch.seq, payload))
        if batch.seq not in self.lose and batch.seq not in self.forget:
            self.pub.send_multipart((b"", batch.seq.to_bytes(8, "big"), payload))

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            with self.lock:
                buffered = [item for item in self.buffer if item[0] >= int.from_bytes(start, "big")]
            for seq, payload in buffered:
                self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            self.router.send_multipart(
                (client, b"", b"", (-1).to_bytes(8, "big", signed=True), b"")
            )

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(0)
        self.router.close(0)
        self.context.term()


def receive(sub: object, count: int) -> list[int]:
    got: list[int] = []
    for _ in range(200):
        got += [seq for seq, _ in sub.poll(0.05)]  # type: ignore[attr-defined]
        if len(got) >= count:
            break
    return got


@pytest.mark.parametrize(
    ("lose", "forget", "delivered"), [((), (), 5), ((2,), (), 5), ((), (2,), 4)]
)
def test_the_subscriber_recovers_gaps_through_the_replay_socket(
    tmp_path: Path, lose: tuple[int, ...], forget: tuple[int, ...], delivered: int
) -> None:
    from kvspec.conformance.kvevents.frames import CaptureWriter
    from kvspec.conformance.kvevents.watch import Subscriber

    stand_in = StandIn(set(lose), set(forget))
    for batch in (STORE, EXTEND):  # before anyone subscribed: only the replay buffer has them
        stand_in.send(batch)
    capture = tmp_path / "live.jsonl"
    writer = CaptureWriter(capture, stand_in.endpoint, stand_in.replay)
    sub = Subscriber(stand_in.endpoint, stand_in.replay, capture=writer, replay_timeout=1.0)
    try:
        batches = [STORE, EXTEND] + [Batch(i, ()) for i in range(2, 5)]
        got = receive(sub, 2)
        stand_in.wait_subscribed()
        for batch in batches[2:]:
            stand_in.send(batch)
        got += receive(sub, delivered - len(got))
    finally:
        sub.close()
        writer.close()
        stand_in.close()
    assert got == [b.seq for b in batches if b.seq not in forget]
    assert sub.sequencer.gaps_filled == (1 if lose else 0)
    assert sub.sequencer.gaps_lost == (1 if forget else 0)
    report = check_capture(capture)  # the capture re-judges what was judged live
    assert report.exit_code == (1 if forget else 0), report.text()
    if forget:
        assert report.invariant == "SequenceInOrder"


def test_kvspec_watch_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0 when the time is up with nothing found, 1 at a violation (its report printed), 2 with one
    line on stderr for a malformed frame."""
    from kvspec.conformance.kvevents.watch import watch

    for batches, code in (
        ([STORE, EXTEND], 0),
        ([STORE, EXTEND, ORPHAN], 1),
        ([STORE], 2),  # then a frame that is not a batch
    ):
        stand_in = StandIn()

        def feed(stand_in: StandIn = stand_in, batches: list[Batch] = batches, code: int = code) -> None:  # fmt: skip
            stand_in.wait_subscribed()
            time.sleep(0.2)  # the initial replay has ended
            for batch in batches:
                stand_in.send(batch)
            if code == 2:
                stand_in.pub.send_multipart((b"", (1).to_bytes(8, "big"), b"\x93junk"))

        sender = threading.Thread(target=feed)
        sender.start()
        try:
            got = watch(stand_in.endpoint, stand_in.replay, seconds=3, out=print)
        finally:
            sender.join()
            stand_in.close()
        captured = capsys.readouterr()
        assert got == code, (code, captured.out, captured.err)
        if code == 1:
            assert "RemovalNamesAnnounced" in captured.out and "minimal history" in captured.out
        if code == 2:
            assert captured.err.count("\n") == 1, captured.err  # one line, no summary, no traceback
            assert captured.err.startswith("kvspec watch: tcp://127.0.0.1:")
            assert "batch 1: not a KV-event batch" in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["foo"],
        ["tcp://127.0.0.1:notaport"],
        ["tcp://127.0.0.1:5999", "--replay", "bar"],
        ["tcp://127.0.0.1:5999", "--capture", "/nonexistent/c.jsonl"],
    ],
)
def test_kvspec_watch_refuses_bad_arguments_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["watch", *argv, "--seconds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvspec watch: error: "), err
