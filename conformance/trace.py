"""Trace format v1: how any engine hands its block-lifecycle events to kvspec.

JSON Lines. Line 1 is a header object; every further line is one JSON object ``{"ev": KIND, ...}``
with named fields, one per event of ``docs/events.md``. ``docs/trace-format.md`` documents every
field; ``trace-v1.schema.json`` (shipped in this package) is the JSON Schema of a line.

``iter_trace`` streams: it reads one line at a time and validates it completely before yielding
it, so a checker's memory does not grow with the file. Trace content is data: it is parsed with
a JSON parser and checked field by field, never evaluated, unpickled or imported.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import orjson

from kvspec.spec import OBSERVED_POLICIES, Config
from kvspec.spec.events import KINDS, REASONS

from . import budget
from .jsonwords import json_error, json_type
from .lockstep import Event

FORMAT = "kvspec-trace"
VERSION = 1
GUARANTEES = ("writes_before_reads", "steps_execute_in_order", "submitted_steps_write")
"""Execution guarantees the checker's model assumes; a v1 trace must declare them all true."""
MODEL_FIELDS = (
    "policy",
    "discipline",
    "preemption",
    "depth",
    "token_budget",
    "max_running",
    "stop_token",
    "async_scheduling",
    "stale_output",
)
JUDGING = ("strict", "observed")
"""How a trace is judged (header ``"judging"``, default strict; ``docs/adapters.md``, "Judging
modes"): observed for engines whose pool picks other free blocks or duplicates than the spec's, or
that register on their own (policy ``engine-registers``)."""

FIELDS: dict[str, tuple[tuple[str, str], ...]] = {name: kind.fields for name, kind in KINDS.items()}
"""Every event kind's fields (name, type) in tuple order: ``kvspec.spec.events.KINDS``, the one
vocabulary (its docstring says what each type admits)."""
OPTIONAL = {"publish": ("hash",)}
"""Optional fields of a line: a publish may carry the engine's opaque block hash."""
PRIVATE = "tokens-private traces (block hashes only, no token ids) are not supported yet"


MAX_BLOCKS = 1 << 24
"""The most blocks a trace may declare (16,777,216): the checkers keep state per block, and a
header claiming more is far more likely corrupt than an engine's real pool."""


class TraceError(ValueError):
    """An unreadable trace: ``str`` is ``file:line: message``."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path, self.line, self.message = str(path), line, message


def header_for(
    config: Config, engine: tuple[str, str], judging: str = "strict"
) -> dict[str, object]:
    header: dict[str, object] = {
        "format": FORMAT,
        "version": VERSION,
        "engine": {"name": engine[0], "version": engine[1]},
        "num_blocks": config.num_blocks,
        "block_size": config.block_size,
        "null_block": 0,
        "guarantees": {name: True for name in GUARANTEES},
        "model": {name: getattr(config, name) for name in MODEL_FIELDS},
    }
    if judging != "strict":
        header["judging"] = judging
    return header


def to_json(event: Event, hash_: str | None = None) -> dict[str, object]:
    """One event tuple as a v1 line object (tuples become lists)."""
    kind = str(event[0])
    line: dict[str, object] = {"ev": kind}
    for (name, _), value in zip(FIELDS[kind], event[1:], strict=True):
        if name == "sampled":
            value = [list(pair) for pair in value]  # type: ignore[attr-defined]
        line[name] = list(value) if isinstance(value, tuple) else value
    if hash_ is not None:
        line["hash"] = hash_
    return line


def write_trace(
    path: str | Path,
    config: Config,
    events: Iterable[Event],
    engine: tuple[str, str] | None = None,
    hashes: bool = False,
    judging: str = "strict",
) -> int:
    """Write a v1 trace; return the number of events. With ``hashes``, every publish carries an
    opaque chained hash (blake2b of the block's token prefix), as a real engine's would.
    ``judging``: how the trace must be judged (``JUDGING``)."""
    if engine is None:
        from kvspec import __version__

        engine = ("kvspec-reference", __version__)
    tokens: dict[int, list[int]] = {}
    count = 0
    bsz = config.block_size
    with open(path, "wb") as out:
        out.write(orjson.dumps(header_for(config, engine, judging)) + b"\n")
        for event in events:
            hash_ = None
            if hashes:
                kind = event[0]
                if kind == "arrive":
                    tokens[event[1]] = list(event[2])  # type: ignore[index, call-overload, arg-type]
                elif kind == "commit":
                    for rid, token in event[2]:  # type: ignore[attr-defined]
                        tokens[rid].append(token)
                elif kind == "publish":
                    prefix = tokens[event[1]][: (event[2] + 1) * bsz]  # type: ignore[index, operator]
                    hash_ = hashlib.blake2b(orjson.dumps(prefix), digest_size=16).hexdigest()
                elif kind == "finish":
                    tokens.pop(event[1], None)  # type: ignore[call-overload]
            out.write(orjson.dumps(to_json(event, hash_)) + b"\n")
            count += 1
    return count


def parse_header(raw: bytes, path: str | Path) -> Config:
    """The header line as the spec ``Config`` it declares, or ``TraceError`` at line 1."""

    def bad(message: str) -> TraceError:
        return TraceError(path, 1, message)

    if not raw.strip():
        raise bad("empty header line")
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise bad(f"header is {json_error(raw, err)}") from None
    if not isinstance(header, dict):
        raise bad("the header must be a JSON object")
    if header.get("format") == "kvspec-events":
        raise bad("a kvspec event file (format v0), not a v1 trace: read it with read_events")
    if header.get("format") != FORMAT:
        raise bad(f'not a kvspec trace (header "format" is {header.get("format")!r})')
    if header.get("version") != VERSION:
        raise bad(f"unsupported trace version {header.get('version')!r} (this kvspec reads 1)")
    if header.get("tokens", "present") == "private":
        raise bad(PRIVATE)
    engine = header.get("engine")
    if (
        not isinstance(engine, dict)
        or not isinstance(engine.get("name"), str)
        or not isinstance(engine.get("version"), str)
    ):
        raise bad('"engine" must be {"name": string, "version": string}')
    for name, low in (("num_blocks", 2), ("block_size", 1)):
        if not _is_int(header.get(name)) or header[name] < low:
            got = json_type(header[name]) if name in header else "nothing"
            raise bad(f'"{name}" must be an integer >= {low}, got {got}')
    if header["num_blocks"] > MAX_BLOCKS:
        raise bad(
            f'"num_blocks" {header["num_blocks"]} is more than the checker keeps ({MAX_BLOCKS})'
        )
    try:
        budget.check_header(header["num_blocks"], path)
    except budget.OverBudget as err:
        raise bad(err.reason) from None
    if header.get("null_block") != 0 or not _is_int(header.get("null_block")):
        raise bad('"null_block" must be 0')
    guarantees = header.get("guarantees")
    if not isinstance(guarantees, dict):
        raise bad('"guarantees" must be an object')
    for name in GUARANTEES:
        if guarantees.get(name) is not True:
            raise bad(f'the checker needs the guarantee "{name}": true')
    model = header.get("model")
    if not isinstance(model, dict):
        raise bad('"model" must be an object')
    unknown = sorted(set(model) - set(MODEL_FIELDS))
    if unknown:
        raise bad(f'unknown "model" field {unknown[0]!r}')
    for name in ("policy", "discipline", "preemption", "stale_output"):
        if name in model and not isinstance(model[name], str):
            raise bad(f'"model.{name}" must be a string')
    if "async_scheduling" in model and not isinstance(model["async_scheduling"], bool):
        raise bad('"model.async_scheduling" must be true or false')
    for name in ("depth", "token_budget", "max_running"):
        if name in model and not _is_int(model[name]):
            raise bad(f'"model.{name}" must be an integer, got {json_type(model[name])}')
    judging = header.get("judging", "strict")
    if judging not in JUDGING:
        raise bad(f'"judging" must be one of {", ".join(JUDGING)}, got {judging!r}')
    if model.get("policy") in OBSERVED_POLICIES and judging != "observed":
        raise bad(f'policy {model["policy"]} needs "judging": "observed" (docs/adapters.md)')
    if model.get("stop_token") is not None and not _is_int(model["stop_token"]):
        raise bad('"model.stop_token" must be an integer or null')
    try:
        return Config(header["num_blocks"], header["block_size"], **model)
    except (ValueError, TypeError) as err:
        raise bad(f"bad model: {err}") from None


def judging_of(path: str | Path) -> str:
    """The header's ``"judging"`` (``strict`` when absent or unreadable: the reader and
    ``parse_header`` report what is wrong with a file or a header)."""
    try:
        with open(path, "rb") as f:
            first = f.readline()
        header = orjson.loads(first)
    except (OSError, orjson.JSONDecodeError):
        return "strict"  # the reader reports it
    judging = header.get("judging", "strict") if isinstance(header, dict) else "strict"
    return judging if judging in JUDGING else "strict"


def parse_line(raw: bytes, num_blocks: int) -> tuple[Event, str | None]:
    """One event line as ``(event tuple, hash or None)``; ``ValueError`` with the reason."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        if not raw.strip():
            raise ValueError("empty line") from None
        raise ValueError(json_error(raw, err)) from None
    return parse_object(obj, num_blocks)


def parse_object(obj: object, num_blocks: int) -> tuple[Event, str | None]:
    """A decoded event line (``parse_line``, and a v0 event made into its v1 object)."""
    if not isinstance(obj, dict):
        raise ValueError('an event is a JSON object {"ev": KIND, ...}')
    kind = obj.get("ev")
    fields = FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ValueError(f"unknown event kind {kind!r}")
    if kind == "arrive" and "tokens" not in obj and "hashes" in obj:
        raise ValueError(PRIVATE)
    optional = OPTIONAL.get(kind, ())
    if len(obj) != len(fields) + 1:
        names = {name for name, _ in fields}
        for key in obj:
            if (
                key != "ev"
                and key not in names
                and key not in optional
                and not key.startswith("x_")
            ):
                raise ValueError(f'{kind}: unknown field "{key}"')
    values: list[object] = [kind]
    for name, type_ in fields:
        if name not in obj:
            raise ValueError(f'{kind}: missing field "{name}"')
        values.append(_value(kind, name, type_, obj[name], num_blocks))
    hash_ = obj.get("hash")
    if "hash" in obj and (not isinstance(hash_, str) or not hash_):  # null too (the schema)
        raise ValueError(f'{kind}: "hash" must be a non-empty string')
    return tuple(values), hash_


def _is_int(value: object) -> bool:
    return type(value) is int


def _value(kind: str, name: str, type_: str, value: object, num_blocks: int) -> object:
    where = f'{kind}: "{name}"'
    if type_ in ("id", "nat", "block"):
        if type(value) is not int:
            raise ValueError(f"{where} must be an integer, got {json_type(value)}")
        if value < 0:
            raise ValueError(f"{where} must be >= 0, got {value}")
        if type_ == "block" and value >= num_blocks:
            raise ValueError(f"{where}: block {value} is out of range (num_blocks {num_blocks})")
        return value
    if type_ == "int":
        if type(value) is not int:
            raise ValueError(f"{where} must be an integer, got {json_type(value)}")
        return value
    if type_ == "reason":
        if value not in REASONS:
            raise ValueError(f"{where} must be one of {', '.join(REASONS)}, got {value!r}")
        return value
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {json_type(value)}")
    if type_ == "sampled":
        pairs = []
        for pair in value:
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or any(type(x) is not int or x < 0 for x in pair)
            ):
                raise ValueError(f"{where} must be a list of [req, token] pairs of integers >= 0")
            pairs.append((pair[0], pair[1]))
        return tuple(pairs)
    if any(type(x) is not int or x < 0 for x in value):
        raise ValueError(f"{where} must be a list of integers >= 0")
    if type_ == "tokens" and not value:
        raise ValueError(f"{where} must not be empty")
    if type_ == "blocks" and any(x >= num_blocks for x in value):
        raise ValueError(f"{where}: a block id is out of range (num_blocks {num_blocks})")
    return tuple(value)


TraceEvent = tuple[int, Event, "str | None"]


def iter_trace(
    path: str | Path, start: int = 2, fast: bool = False
) -> tuple[Config, Iterator[TraceEvent]]:
    """Open a v1 trace: its ``Config`` now (header errors raise here), and an iterator of
    ``(line number, event tuple, publish hash or None)``, each line validated before it is
    yielded (``TraceError`` at the first bad line). The file is read one line at a time, from
    line ``start`` (earlier lines are skipped unread). ``fast``: lines are decoded and validated by
    msgspec first (``fastread.py``), and by ``parse_line`` only when that fails (it accepts what
    msgspec is stricter about, such as ``x_`` fields, and gives the message)."""
    f = open(path, "rb")  # noqa: SIM115 -- closed by the generator
    try:
        first = f.readline()
        if not first:
            raise TraceError(path, 1, "empty file")
        config = parse_header(first, path)
    except BaseException:
        f.close()
        raise
    n = config.num_blocks

    def numbered(
        decode: Callable[[bytes], object], refused: type[Exception]
    ) -> Iterator[TraceEvent]:
        """Lines from ``start`` on, decoded by ``decode``; a line it refuses goes to
        ``parse_line``, which accepts it or says what is wrong."""
        with f:
            number = start - 1
            for _ in itertools.islice(f, start - 2):
                pass
            for raw in f:
                number += 1
                try:
                    got = decode(raw)
                except refused:
                    try:
                        got = parse_line(raw, n)
                    except ValueError as err:
                        raise TraceError(path, number, str(err)) from None
                yield number, got[0], got[1]  # type: ignore[index]

    if fast:
        from .fastread import Error, decoder

        return config, numbered(decoder(n), Error)
    return config, numbered(lambda raw: parse_line(raw, n), ValueError)


def read_trace(path: str | Path) -> tuple[Config, list[Event]]:
    """A whole v1 trace as ``(config, events)`` (hashes dropped): for small files."""
    config, lines = iter_trace(path)
    return config, [event for _, event, _ in lines]
