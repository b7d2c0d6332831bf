"""The KV-event wire format (vLLM 0.33.0's, which SGLang 0.5.23 shares), the capture file, and
the sequencer that puts received frames back in order.

**Frames.** A publisher sends each batch as a ZMQ multipart message ``(topic, seq, payload)``:
``seq`` an 8-byte big-endian sequence number, ``payload`` msgpack of an ``EventBatch``, an array
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``"type"``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). The structs below are ours, written
from reading vLLM's ``vllm/distributed/kvevents/frames.py`` and SGLang's
``sglang/srt/disaggregation/kvevents/frames.py``, in their field order; unknown fields are ignored
(both engines add fields between releases), missing required ones and wrong types are not. The
replay socket (a ROUTER) answers a request ``(b"", start_seq)`` with every buffered frame from
there on, then an end marker whose seq is -1.

**Capture file** (``kvspec-kv-events`` v1): JSON Lines. Line 1 is a header
``{"format": "kvspec-kv-events", "version": 1, "endpoint": ..., "replay": ... | null}``; every
further line is one frame as the subscriber received it, in that order:
``{"via": "pub" | "replay", "seq": N, "topic": "...", "payload": "<base64 msgpack>"}``, or
``{"via": "replay-end"}`` when a replay finished. ``kvspec watch --capture`` and the vLLM adapter
write them; ``kvspec check --kv-events`` judges them by replaying the same sequencer.

**Sequencer.** Delivers batches in sequence order: a frame past the next expected number opens a
gap, later frames are held while the replay socket is asked for the missing ones; a replay that
ends without them closes the gap unfilled (the later batches are delivered, and the stream's
``SequenceInOrder`` invariant reports the jump). Frames already delivered are dropped.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import orjson

from kvspec.spec.stream import Batch, Cleared, Removed, Stored, StreamEvent

FORMAT = "kvspec-kv-events"
VERSION = 1
END_SEQ = -1
MAX_HELD = 100_000
"""Frames held while a gap is open; past this the gap is given up as unfilled."""

ExternalHash = bytes | int


class WireBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    cache_salt: str | None = None
    """SGLang's (vLLM puts a cache salt in ``extra_keys``)."""


class WireBlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[ExternalHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_decode_batch = msgspec.msgpack.Decoder(WireBatch).decode
_encode = msgspec.msgpack.Encoder().encode


class FrameError(ValueError):
    """A frame that is not a KV-event batch; the message says what is wrong."""


def _tupled(value: Any) -> Any:
    """msgpack has no tuples: extra keys come back as lists; make them comparable values."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _event(wire: WireEvent) -> StreamEvent:
    if isinstance(wire, WireBlockStored):
        extra = None if wire.extra_keys is None else tuple(_tupled(e) for e in wire.extra_keys)
        salt = wire.cache_salt
        if salt is not None and extra is None:  # SGLang's salt scopes every block of the store
            extra = tuple(("salt", salt) for _ in wire.block_hashes)
        return Stored(
            tuple(wire.block_hashes),
            wire.parent_block_hash,
            tuple(wire.token_ids),
            wire.block_size,
            wire.medium,
            wire.group_idx,
            wire.lora_name,
            extra,
            wire.kv_cache_spec_kind,
        )
    if isinstance(wire, WireBlockRemoved):
        return Removed(tuple(wire.block_hashes), wire.medium, wire.group_idx)
    return Cleared()


def decode_batch(seq: int, payload: bytes) -> Batch:
    """A frame's payload as a ``Batch``; ``FrameError`` if it is not one."""
    try:
        wire = _decode_batch(payload)
    except msgspec.MsgspecError as err:
        raise FrameError(f"batch {seq}: not a KV-event batch: {err}") from None
    events = tuple(_event(e) for e in wire.events)
    return Batch(seq, events, wire.ts, wire.data_parallel_rank)


def encode_batch(batch: Batch) -> bytes:
    """A ``Batch`` in vLLM's wire form (for tests and fault injection)."""
    events: list[WireEvent] = []
    for e in batch.events:
        if isinstance(e, Stored):
            extra = None if e.extra_keys is None else [list(x) if isinstance(x, tuple) else x for x in e.extra_keys]  # fmt: skip
            events.append(
                WireBlockStored(
                    list(e.hashes),
                    e.parent,
                    list(e.tokens),
                    e.block_size,
                    medium=e.medium,
                    lora_name=e.lora_name,
                    extra_keys=extra,
                    group_idx=e.group,
                    kv_cache_spec_kind=e.kind,
                )
            )
        elif isinstance(e, Removed):
            events.append(WireBlockRemoved(list(e.hashes), e.medium, e.group))
        else:
            events.append(WireAllBlocksCleared())
    return _encode(WireBatch(batch.ts, events, batch.rank))


def parse_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise FrameError(f"a sequence number is 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


# -- the sequencer ------------------------------------------------------------------------------


@dataclass
class Sequencer:
    """Puts frames in sequence order (module docstring). ``expected`` None: start at the first
    frame that comes (a subscriber that joined late)."""

    expected: int | None = 0
    origin: int | None = None
    """Where the stream was taken up: the first frame's number when ``expected`` was None, else
    the first expected. A judge starts its view there; it joined late when that is not 0."""
    held: dict[int, bytes] = field(default_factory=dict)
    gaps_filled: int = 0
    gaps_lost: int = 0
    duplicates: int = 0

    @property
    def wanted(self) -> int | None:
        """The first missing sequence number while later frames are held, else None."""
        return self.expected if self.held else None

    def offer(self, seq: int, payload: bytes) -> list[tuple[int, bytes]]:
        """A received frame; returns the frames now deliverable, in order."""
        if self.expected is None:
            self.expected = seq
        if self.origin is None:
            self.origin = self.expected
        if seq < self.expected or seq in self.held:
            self.duplicates += 1
            return []
        if seq > self.expected:
            self.held[seq] = payload
            if len(self.held) > MAX_HELD:
                return self.give_up()
            return []
        ready = [(seq, payload)]
        self.expected = seq + 1
        if self.held:
            ready += self._drain()
            if not self.held:
                self.gaps_filled += 1
        return ready

    def start_at(self, seq: int) -> None:
        """The stream is known to start at ``seq`` (a replay found nothing buffered: 0)."""
        if self.expected is None:
            self.expected = self.origin = seq

    def give_up(self) -> list[tuple[int, bytes]]:
        """The replay could not fill the gap: deliver what is held, in order (the first one
        after the gap is where the stream's judge sees the jump)."""
        if not self.held:
            return []
        self.gaps_lost += 1
        self.expected = min(self.held)
        return self._drain()

    def _drain(self) -> list[tuple[int, bytes]]:
        ready = []
        while self.expected in self.held:
            ready.append((self.expected, self.held.pop(self.expected)))
            self.expected += 1  # type: ignore[operator]
        return ready


# -- the capture file ---------------------------------------------------------------------------


class CaptureError(ValueError):
    """An unreadable capture line; ``str`` is ``path:line: message``."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.line = line


@dataclass(frozen=True)
class Frame:
    via: str
    """``pub`` (the live socket), ``replay`` (the replay socket) or ``replay-end``."""
    seq: int = END_SEQ
    topic: bytes = b""
    payload: bytes = b""


class CaptureWriter:
    """Append received frames to a capture file, one line each, flushed per frame."""

    def __init__(self, path: str | Path, endpoint: str, replay: str | None) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        header = {"format": FORMAT, "version": VERSION, "endpoint": endpoint, "replay": replay}
        self.file.write(orjson.dumps(header) + b"\n")
        self.frames = 0

    def write(self, frame: Frame) -> None:
        if frame.via == "replay-end":
            line: dict[str, object] = {"via": "replay-end"}
        else:
            line = {
                "via": frame.via,
                "seq": frame.seq,
                "topic": frame.topic.decode("utf-8", "replace"),
                "payload": base64.b64encode(frame.payload).decode("ascii"),
            }
        self.file.write(orjson.dumps(line) + b"\n")
        self.file.flush()
        self.frames += 1

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_capture(
    path: str | Path, frames: list[Frame], endpoint: str = "-", replay: str | None = None
) -> int:
    with CaptureWriter(path, endpoint, replay) as writer:
        for frame in frames:
            writer.write(frame)
    return len(frames)


def read_header(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        first = f.readline()
    try:
        header = orjson.loads(first)
    except orjson.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CaptureError(path, 1, f"not a capture file (the first line is no {FORMAT} header)")
    if header.get("version") != VERSION:
        raise CaptureError(path, 1, f"capture version {header.get('version')!r}, expected 1")
    replay = header.get("replay")
    if replay is not None and not isinstance(replay, str):
        raise CaptureError(path, 1, "header field replay must be a string or null")
    return header


def iter_capture(path: str | Path) -> Iterator[tuple[int, Frame]]:
    """(line number, frame) for every frame line, validated; ``CaptureError`` on a bad one."""
    read_header(path)
    with open(path, "rb") as f:
        f.readline()
        for number, raw in enumerate(f, 2):
            if not raw.strip():
                continue
            yield number, _frame(path, number, raw)


def _frame(path: str | Path, number: int, raw: bytes) -> Frame:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise CaptureError(path, number, f"not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise CaptureError(path, number, "a frame line is a JSON object")
    via = obj.get("via")
    if via == "replay-end":
        return Frame("replay-end")
    if via not in ("pub", "replay"):
        raise CaptureError(path, number, f"via must be pub, replay or replay-end, not {via!r}")
    seq, topic, payload = obj.get("seq"), obj.get("topic", ""), obj.get("payload")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**63:
        raise CaptureError(path, number, f"seq must be an integer >= 0, not {seq!r}")
    if not isinstance(topic, str) or not isinstance(payload, str):
        raise CaptureError(path, number, "topic and payload must be strings")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise CaptureError(path, number, "payload is not base64") from None
    return Frame(via, seq, topic.encode("utf-8"), data)
