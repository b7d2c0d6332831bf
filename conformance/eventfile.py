"""kvspec's own event files (format v0) read with the same rules as v1 traces, and telling them apart.

An event file (``kvspec fuzz --out``, ``kvspec simulate --out``; ``report.write_events``) is JSON
Lines: a header ``{"format": "kvspec-events", "version": 0, "config": {...}}``, then one JSON
array per event, ``[kind, value, ...]``, exactly as the engine emitted it. Each array is made into
the v1 object of its kind and validated by ``trace.parse_object``, so both formats accept the same
events and refuse the same ones with the same words: an unknown kind, a missing or extra value, a
block out of range are unreadable input (exit 2) in either, never a verdict about the engine.
The header's ``config`` is checked field by field (names and types) before a ``Config`` is made
from it, against the same block cap and memory budget as a v1 header.

``sniff`` says which format a file is in from its header's ``"format"``.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from kvspec.spec import OBSERVED_POLICIES, Config

from . import budget
from .jsonwords import json_error, json_type
from .lockstep import Event
from .trace import FIELDS, FORMAT, MAX_BLOCKS, TraceError, parse_object

V0_FORMAT = "kvspec-events"
V0_VERSION = 0
CONFIG_FIELDS: dict[str, tuple[type, ...]] = {
    "num_blocks": (int,),
    "block_size": (int,),
    "depth": (int,),
    "policy": (str,),
    "discipline": (str,),
    "preemption": (str,),
    "token_budget": (int,),
    "max_running": (int,),
    "stop_token": (int, type(None)),
    "async_scheduling": (bool,),
    "stale_output": (str,),
}
"""The fields of ``spec.Config`` and the JSON types each may have."""
REQUIRED = ("num_blocks", "block_size")


def sniff(path: str | Path) -> str:
    """``"v1"`` or ``"v0"`` from the header's ``"format"``; ``TraceError`` (line 1) for a file
    that is neither. A header that is not JSON is left to the v1 reader, which words it."""
    with open(path, "rb") as f:
        first = f.readline()
    try:
        header = orjson.loads(first)
    except orjson.JSONDecodeError:
        return "v1"
    kind = header.get("format") if isinstance(header, dict) else None
    if kind == FORMAT:
        return "v1"
    if kind == V0_FORMAT:
        return "v0"
    if not isinstance(header, dict):
        return "v1"
    raise TraceError(
        path,
        1,
        f'not a kvspec trace (header "format" is {kind!r}; kvspec reads "{FORMAT}", version 1, '
        f'and its own event files, "{V0_FORMAT}")',
    )


def parse_v0_header(raw: bytes, path: str | Path) -> Config:
    def bad(message: str) -> TraceError:
        return TraceError(path, 1, f"bad header: {message}")

    if not raw.strip():
        raise bad("empty header line")
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise bad(json_error(raw, err)) from None
    if not isinstance(header, dict):
        raise bad("the header must be a JSON object")
    if header.get("format") != V0_FORMAT:
        raise bad(f'not a kvspec event file (header "format" is {header.get("format")!r})')
    if header.get("version") != V0_VERSION:
        raise bad(f"unsupported event file version {header.get('version')!r} (this kvspec reads 0)")
    config = header.get("config")
    if not isinstance(config, dict):
        got = json_type(config) if "config" in header else "nothing"
        raise bad(f'"config" must be an object, got {got}')
    for name in config:
        if name not in CONFIG_FIELDS:
            raise bad(f'unknown "config" field {name!r} (known: {", ".join(CONFIG_FIELDS)})')
    for name in REQUIRED:
        if name not in config:
            raise bad(f'"config" needs "{name}"')
    for name, value in config.items():
        types = CONFIG_FIELDS[name]
        if bool in types:
            fits, want = isinstance(value, bool), "true or false"
        else:
            fits = not isinstance(value, bool) and isinstance(value, types)
            want = "an integer" if int in types else "a string"
            if type(None) in types:
                want += " or null"
        if not fits:
            raise bad(f'"config.{name}" must be {want}, got {json_type(value)}')
    if config["num_blocks"] > MAX_BLOCKS:
        raise bad(
            f'"num_blocks" {config["num_blocks"]} is more than the checker keeps ({MAX_BLOCKS})'
        )
    if config.get("policy") in OBSERVED_POLICIES:
        raise bad(
            f"policy {config['policy']} is judged observed, which only a v1 trace can declare "
            '("judging": "observed")'
        )
    try:
        budget.check_header(config["num_blocks"], path)
    except budget.OverBudget as err:
        raise bad(err.reason) from None
    try:
        return Config(**config)
    except ValueError as err:
        raise bad(str(err)) from None


def parse_v0_event(raw: bytes, num_blocks: int) -> Event:
    """One event line of a v0 file; ``ValueError`` with the reason (the v1 words)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        if not raw.strip():
            raise ValueError("empty line") from None
        raise ValueError(json_error(raw, err)) from None
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise ValueError("an event is a JSON array starting with its kind")
    kind, values = value[0], value[1:]
    fields = FIELDS.get(kind)
    if fields is None:
        raise ValueError(f"unknown event kind {kind!r}")
    if len(values) != len(fields):
        names = ", ".join(name for name, _ in fields) or "none"
        raise ValueError(
            f"{kind}: {len(fields)} values after the kind ({names}), got {len(values)}"
        )
    obj: dict[str, object] = {"ev": kind}
    obj.update((name, v) for (name, _), v in zip(fields, values, strict=True))
    return parse_object(obj, num_blocks)[0]


def read_events(path: str | Path) -> tuple[Config, list[Event]]:
    """A whole event file; ``TraceError`` (a ``ValueError``) naming ``file:line`` on bad input."""
    with open(path, "rb") as f:
        first = f.readline()
        if not first:
            raise TraceError(path, 1, "empty file")
        config = parse_v0_header(first, path)
        try:
            budget.check_read_whole(path, "reading the event file whole")
        except budget.OverBudget as err:
            raise TraceError(path, 1, err.reason) from None
        events = []
        n = config.num_blocks
        for number, line in enumerate(f, 2):
            try:
                events.append(parse_v0_event(line, n))
            except ValueError as err:
                raise TraceError(path, number, str(err)) from None
    return config, events
