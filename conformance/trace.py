"""Events on disk: trace format v1 (how any engine hands its block-lifecycle events to kvspec) and
kvspec's own older event files (v0), read through one door and by the same rules.

v1 is JSON Lines. Line 1 is a header object; every further line is one JSON object
``{"ev": KIND, ...}`` with named fields, one per kind of ``spec/events.py``.
``docs/trace-format.md`` documents every field; ``trace-v1.schema.json`` (shipped in this package)
is the JSON Schema of a line. v0 event files (``kvspec fuzz --out`` and ``kvspec simulate --out``
without ``--format v1``) are a header ``{"format": "kvspec-events", "version": 0, "config": ...}``
then one JSON array per event tuple. Each v0 array is made into the v1 object of its kind and
validated by ``parse_object``, and a v0 header's ``config`` is checked field by field against the
same block cap and memory budget (``budget.py``) as a v1 header, so both formats accept the same
events and refuse the same ones with the same words: an unknown kind, a missing or extra value, a
block out of range are unreadable input (exit 2) in either, never a verdict about the engine.

``open_trace`` opens a file once, sniffs its format from the header once, and streams its events:
it reads one line at a time and validates it completely before yielding it, so a checker's memory
does not grow with the file; ``Trace.events(start)`` reads again from an earlier line (the fast
path's hand-over) on the same open file. ``Trace.lines`` and ``Trace.slow`` are the same reading
for a loop that decodes lines itself (``judge.core.FileFeed``, compiled): the raw lines, and the
validating reader for a line the fast decoder refuses. Trace content is data: it is parsed with a
JSON parser and checked field by field, never evaluated, unpickled or imported.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from pathlib import Path

import orjson

from kvspec import __version__
from kvspec.spec import OBSERVED_POLICIES, Config
from kvspec.spec.events import KINDS, OPTIONAL, REASONS, TRAILING, WHEN_SET, group_of
from kvspec.spec.state import Group

from . import budget
from .fastread import Error, Parts, decoder, parts
from .jsonwords import json_error, json_type

Event = tuple[object, ...]

FORMAT = "kvspec-trace"
VERSION = 1
V0_FORMAT = "kvspec-events"
"""kvspec's own older event files (``--format v0``, the default of ``fuzz`` and ``simulate``)."""
GUARANTEES = ("writes_before_reads", "steps_execute_in_order", "submitted_steps_write")
"""Execution guarantees the checker's model assumes; a v1 trace must declare them all true."""
HEADER_FIELDS = ("num_blocks", "block_size")
"""``Config`` fields written at the header's top level; every other one is a ``"model"`` field."""
FIRST_MODEL_FIELDS = (
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
"""The model fields of the first v1 traces, written always."""
MODEL_FIELDS = FIRST_MODEL_FIELDS + tuple(
    name
    for name in Config.__dataclass_fields__
    if name not in HEADER_FIELDS and name not in FIRST_MODEL_FIELDS
)
"""Every field of the spec's ``Config`` but ``HEADER_FIELDS``, the first ones first: derived,
so that a field added there is written and read with no edit here."""
WRITTEN_IF_NOT: dict[str, object] = {
    name: Config.__dataclass_fields__[name].default
    for name in MODEL_FIELDS
    if name not in FIRST_MODEL_FIELDS
}
"""Model fields added after older kvspec versions shipped (those not in ``FIRST_MODEL_FIELDS``),
written only when they differ from ``Config``'s default: a trace of a default configuration
still reads in those versions (a reader takes a missing field as its default)."""
JSON_TYPES = {
    "str": (lambda value: isinstance(value, str), "a string", False),
    "bool": (lambda value: isinstance(value, bool), "true or false", False),
    "int": (lambda value: _is_int(value), "an integer", True),
    "int | None": (lambda value: value is None or _is_int(value), "an integer or null", False),
    "float": (
        lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
        "a number",
        True,
    ),
}
"""How a model field is checked, by its ``Config`` annotation: (the test, what it must be,
whether the message names the JSON type it got). A field of another annotation is left to
``Config``'s own checks."""
JUDGING = ("strict", "observed")
"""How a trace is judged (header ``"judging"``, default strict; ``docs/adapters.md``, "Judging
modes"): observed for engines whose pool picks other free blocks or duplicates than the spec's, or
that register on their own (policy ``engine-registers``)."""

FIELDS: dict[str, tuple[tuple[str, str], ...]] = {name: kind.fields for name, kind in KINDS.items()}
"""Every event kind's fields (name, type) in tuple order: ``kvspec.spec.events.KINDS``, the one
vocabulary (its docstring says what each type admits)."""
PRIVATE = "tokens-private traces (block hashes only, no token ids) are not supported yet"


MAX_BLOCKS = 1 << 24
"""The most blocks a trace may declare (16,777,216): the checkers keep state per block, and a
header claiming more is far more likely corrupt than an engine's real pool."""


class TraceError(ValueError):
    """An unreadable trace: ``str`` is ``file:line: message``."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path, self.line, self.message = str(path), line, message


def _written(config: Config, names: Iterable[str]) -> dict[str, object]:
    """``config``'s fields ``names``, less those at their ``WRITTEN_IF_NOT`` default (the groups
    as a list of ``{"kind", "block_size", "window"}`` objects, ``groups_json``)."""
    fields = {name: getattr(config, name) for name in names}
    written = {k: v for k, v in fields.items() if k not in WRITTEN_IF_NOT or v != WRITTEN_IF_NOT[k]}
    if "groups" in written:
        written["groups"] = groups_json(config.groups)
    return written


def groups_json(groups: tuple[Group, ...]) -> list[dict[str, object]]:
    """The header's ``model.groups``: one object per group, in group order."""
    return [
        {"kind": g.kind, "block_size": g.block_size, "window": g.window}
        | ({"registers": g.registers} if g.registers is not None else {})
        | ({"chunk": g.chunk} if g.chunk is not None else {})
        for g in groups
    ]


GROUP_FIELDS = ("kind", "block_size", "window", "registers", "chunk")


def groups_of(value: object, where: str) -> tuple[Group, ...]:
    """A header's ``groups`` (a list of ``{"kind", "block_size", "window"}`` objects, ``window``
    a state group's ``registers`` and a chunked group's ``chunk`` optional) as ``Group``s; ``ValueError`` naming ``where`` for anything else. What each group
    may be (kinds, block sizes, windows) is ``Config``'s to check."""
    if not isinstance(value, list):
        raise ValueError(f'"{where}" must be a list of group objects, got {json_type(value)}')
    groups = []
    for g, obj in enumerate(value):
        at = f'"{where}[{g}]"'
        if not isinstance(obj, dict):
            raise ValueError(f"{at} must be an object, got {json_type(obj)}")
        unknown = sorted(set(obj) - set(GROUP_FIELDS))
        if unknown:
            raise ValueError(f"{at}: unknown field {unknown[0]!r}")
        if not isinstance(obj.get("kind"), str):
            raise ValueError(f'{at}: "kind" must be a string')
        if not _is_int(obj.get("block_size")):
            raise ValueError(f'{at}: "block_size" must be an integer')
        window = obj.get("window")
        if window is not None and not _is_int(window):
            raise ValueError(f'{at}: "window" must be an integer or null')
        registers = obj.get("registers")
        if registers is not None and not isinstance(registers, str):
            raise ValueError(f'{at}: "registers" must be a string or null')
        chunk = obj.get("chunk")
        if chunk is not None and not _is_int(chunk):
            raise ValueError(f'{at}: "chunk" must be an integer or null')
        groups.append(Group(obj["kind"], obj["block_size"], window, registers, chunk))
    return tuple(groups)


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
        "model": _written(config, MODEL_FIELDS),
    }
    if judging != "strict":
        header["judging"] = judging
    return header


def to_json(event: Event, hash_: str | None = None) -> dict[str, object]:
    """One event tuple as a v1 line object (tuples become lists)."""
    kind = str(event[0])
    line: dict[str, object] = {"ev": kind}
    fields = FIELDS[kind]
    for (name, _), value in zip(fields, event[1 : len(fields) + 1], strict=True):
        if name == "sampled":
            value = [list(pair) for pair in value]  # type: ignore[attr-defined]
        line[name] = list(value) if isinstance(value, tuple) else value
    if len(event) > len(fields) + 1 and kind in TRAILING and event[-1]:
        line[TRAILING[kind][0]] = event[-1]
    if len(event) > len(fields) + 1 and kind in WHEN_SET:  # 0 too: only its absence is unset
        line[WHEN_SET[kind][0]] = event[-1]
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
                    size = config.groups[group_of(event)].block_size if config.groups else bsz
                    prefix = tokens[event[1]][: (event[2] + 1) * size]  # type: ignore[index, operator]
                    hash_ = hashlib.blake2b(orjson.dumps(prefix), digest_size=16).hexdigest()
                elif kind == "finish":
                    tokens.pop(event[1], None)  # type: ignore[call-overload]
            out.write(orjson.dumps(to_json(event, hash_)) + b"\n")
            count += 1
    return count


def parse_header(raw: bytes, path: str | Path) -> Config:
    """A v1 header line as the spec ``Config`` it declares, or ``TraceError`` at line 1."""
    return _v1_header(_header_object(raw, path), path)[0]


def _header_object(raw: bytes, path: str | Path) -> dict[str, object]:
    if not raw.strip():
        raise TraceError(path, 1, "empty header line")
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise TraceError(path, 1, f"header is {json_error(raw, err)}") from None
    if not isinstance(header, dict):
        raise TraceError(path, 1, "the header must be a JSON object")
    return header


def _v1_header(header: dict, path: str | Path) -> tuple[Config, str]:  # type: ignore[type-arg]
    """The v1 header's ``Config`` and how the trace is judged (``JUDGING``)."""

    def bad(message: str) -> TraceError:
        return TraceError(path, 1, message)

    if header.get("format") == V0_FORMAT:
        raise bad("a kvspec event file (format v0), not a v1 trace: open it with open_trace")
    if header.get("format") != FORMAT:
        raise bad(
            f'not a kvspec trace (header "format" is {header.get("format")!r}; kvspec reads '
            f'"{FORMAT}", version 1, and its own event files, "{V0_FORMAT}")'
        )
    if type(header.get("version")) is not int or header.get("version") != VERSION:  # true == 1
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
    _claim(header["num_blocks"], path)
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
    for name, value in model.items():
        test, noun, named = JSON_TYPES.get(
            str(Config.__dataclass_fields__[name].type), (None, "", False)
        )
        if test is not None and not test(value):
            got = f", got {json_type(value)}" if named else ""
            raise bad(f'"model.{name}" must be {noun}{got}')
    _depth_claim(model.get("depth"), "model.depth", bad)
    judging = header.get("judging", "strict")
    if judging not in JUDGING:
        raise bad(f'"judging" must be one of {", ".join(JUDGING)}, got {judging!r}')
    if model.get("policy") in OBSERVED_POLICIES and judging != "observed":
        raise bad(f'policy {model["policy"]} needs "judging": "observed" (docs/adapters.md)')
    if "groups" in model:
        try:
            model = {**model, "groups": groups_of(model["groups"], "model.groups")}
        except ValueError as err:
            raise bad(str(err)) from None
    try:
        return Config(header["num_blocks"], header["block_size"], **model), judging
    except (ValueError, TypeError) as err:
        raise bad(f"bad model: {err}") from None


def _depth_claim(depth: object, name: str, bad: Callable[[str], TraceError]) -> None:
    """A header's steps in flight, within what ``kvspec fuzz --depth`` takes (``budget.MAX_DEPTH``)."""
    if _is_int(depth) and depth > budget.MAX_DEPTH:  # type: ignore[operator]  (< 1: Config's)
        raise bad(f'"{name}" must be 1..{budget.MAX_DEPTH} (as kvspec fuzz --depth), got {depth}')


def _claim(num_blocks: int, path: str | Path) -> None:
    """A header's claim of ``num_blocks`` against the block cap and the memory budget (both
    formats)."""
    if num_blocks > MAX_BLOCKS:
        raise TraceError(
            path, 1, f'"num_blocks" {num_blocks} is more than the checker keeps ({MAX_BLOCKS})'
        )
    try:
        budget.check_header(num_blocks, path)
    except budget.OverBudget as err:
        raise TraceError(path, 1, err.reason) from None


V0_CONFIG: dict[str, tuple[type, ...]] = {
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
    "prefix_caching": (bool,),
    "spec_tokens": (int,),
    "delay_load_registration": (bool,),
    "defer_free": (bool,),
    "sliding_window": (int, type(None)),
    "defer_loads": (bool,),
    "groups": (list,),
}
"""The fields of a v0 header's ``config`` (``spec.Config``'s) and the JSON types each may have."""


def _v0_header(header: dict, path: str | Path) -> tuple[Config, str]:  # type: ignore[type-arg]
    """A v0 header's ``config``, checked field by field before a ``Config`` is made of it."""

    def bad(message: str) -> TraceError:
        return TraceError(path, 1, f"bad header: {message}")

    if type(header.get("version")) is not int or header.get("version") != 0:  # false == 0
        raise TraceError(
            path,
            1,
            f"unsupported event file version {header.get('version')!r} (this kvspec reads 0)",
        )
    config = header.get("config")
    if not isinstance(config, dict):
        got = json_type(config) if "config" in header else "nothing"
        raise bad(f'"config" must be an object, got {got}')
    for name in config:
        if name not in V0_CONFIG:
            raise bad(f'unknown "config" field {name!r} (known: {", ".join(V0_CONFIG)})')
    for name in ("num_blocks", "block_size"):
        if name not in config:
            raise bad(f'"config" needs "{name}"')
    for name, value in config.items():
        types = V0_CONFIG[name]
        if list in types:
            fits, want = isinstance(value, list), "a list of group objects"
        elif bool in types:
            fits, want = isinstance(value, bool), "true or false"
        else:
            fits = not isinstance(value, bool) and isinstance(value, types)
            want = "an integer" if int in types else "a string"
            if type(None) in types:
                want += " or null"
        if not fits:
            raise bad(f'"config.{name}" must be {want}, got {json_type(value)}')
    _depth_claim(config.get("depth"), "config.depth", bad)
    if config.get("policy") in OBSERVED_POLICIES:
        raise bad(
            f"policy {config['policy']} is judged observed, which only a v1 trace can declare "
            '("judging": "observed")'
        )
    _claim(config["num_blocks"], path)
    if "groups" in config:
        try:
            config = {**config, "groups": groups_of(config["groups"], "config.groups")}
        except ValueError as err:
            raise bad(str(err)) from None
    try:
        return Config(**config), "strict"
    except (TypeError, ValueError) as err:
        raise bad(str(err)) from None


def parse_line(raw: bytes, num_blocks: int) -> tuple[Event, str | None]:
    """One v1 event line as ``(event tuple, hash or None)``; ``ValueError`` with the reason."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        if not raw.strip():
            raise ValueError("empty line") from None
        raise ValueError(json_error(raw, err)) from None
    return parse_object(obj, num_blocks)


def parse_object(obj: object, num_blocks: int) -> tuple[Event, str | None]:
    """One event as a decoded JSON object ``{"ev": KIND, ...}``, checked field by field."""
    if not isinstance(obj, dict):
        raise ValueError('an event is a JSON object {"ev": KIND, ...}')
    kind = obj.get("ev")
    fields = FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ValueError(f"unknown event kind {kind!r}")
    if kind == "arrive" and "tokens" not in obj and "hashes" in obj:
        raise ValueError(PRIVATE)
    trailing = TRAILING.get(str(kind))
    bounded = WHEN_SET.get(str(kind))
    optional: tuple[str, ...] = (
        *OPTIONAL.get(str(kind), ()),
        *(trailing or ())[:1],
        *(bounded or ())[:1],
    )
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
    if trailing is not None and trailing[0] in obj:  # canonical: present only when not 0
        group = _value(str(kind), trailing[0], trailing[1], obj[trailing[0]], num_blocks)
        if group:
            values.append(group)
    if bounded is not None and bounded[0] in obj:  # present exactly when set, 0 included
        values.append(_value(str(kind), bounded[0], bounded[1], obj[bounded[0]], num_blocks))
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
    if type_ == "true":  # a flag present only where set (WHEN_SET)
        if value is not True:
            raise ValueError(
                f"{where} must be true where present, got "
                f"{'false' if value is False else json_type(value)}"
            )
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


SPEC_DEFAULTS: dict[str, object] = {"schedule": 0, "execute": ()}
"""The decisions whose last field ``spec.actions`` defaults (nothing loaded, no load failed):
in-process, an event without it is that default (a trace line must carry every field)."""


def event_error(event: object, num_blocks: int, hash_: object = None) -> str | None:
    """Why an in-process event (a tuple, as an engine feeds a ``Monitor``) is not one of the
    format's events, or None: the same field checks as a trace line's (``parse_object``), a list
    field a tuple (of pairs, for ``sampled``), as the engines emit them and the compiled fast
    model takes them; a decision without its last field accepted where ``spec.actions`` has a
    default for it (``SPEC_DEFAULTS``). ``Monitor`` says when it asks (``_well_formed``)."""
    if not isinstance(event, tuple) or not event:
        return "an event is a non-empty tuple (KIND, field, ...)"
    kind = event[0]
    fields = FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return f"unknown event kind {kind!r}"
    if len(event) == len(fields) and kind in SPEC_DEFAULTS:  # the spec's shorthand
        event = (*event, SPEC_DEFAULTS[kind])
    trailing = TRAILING.get(kind)
    if trailing is not None and len(event) == len(fields) + 2:  # the optional group
        group = event[-1]
        if type(group) is not int or group < 1:  # the canonical tuple: group 0 goes unsaid
            return f'{kind}: a trailing "{trailing[0]}" must be an integer >= 1, got {group!r}'
        event = event[:-1]
    when_set = WHEN_SET.get(kind)
    if when_set is not None and len(event) == len(fields) + 2:  # its optional last field
        name, type_ = when_set
        if type_ == "true" and event[-1] is not True:
            return f'{kind}: "{name}" must be True where present, got {event[-1]!r}'
        if type_ == "nat" and (type(event[-1]) is not int or event[-1] < 0):
            return f'{kind}: "{name}" must be an integer >= 0, got {event[-1]!r}'
        event = event[:-1]
    if len(event) != len(fields) + 1:
        names = ", ".join(name for name, _ in fields)
        return f"{kind}: {len(event) - 1} fields, expected {len(fields)} ({names})"
    try:
        for (name, type_), value in zip(fields, event[1:], strict=True):
            if isinstance(value, list):
                return f'{kind}: "{name}" must be a tuple, got a list'
            if type_ == "sampled" and isinstance(value, tuple):
                if any(isinstance(pair, list) for pair in value):
                    return f'{kind}: "{name}" must be a tuple of (req, token) tuples'
                value = [list(x) if isinstance(x, tuple) else x for x in value]
            elif isinstance(value, tuple):
                value = list(value)
            _value(kind, name, type_, value, num_blocks)
    except ValueError as err:
        return str(err)
    if hash_ is not None and (kind not in OPTIONAL or not isinstance(hash_, str) or not hash_):
        return f"{kind}: the hash must be a non-empty string, on a publish only"
    return None


TraceEvent = tuple[int, Event, "str | None"]


class Trace:
    """An open trace file (v1 or v0): its ``config``, how it is judged (``judging``), its
    ``version``, and its events, each as ``(line number, event tuple, publish hash or None)``."""

    def __init__(self, path: str | Path, fast: bool = False) -> None:
        """Open ``path`` and read its header (``TraceError`` at line 1 when it is not one).
        ``fast``: v1 lines are decoded and validated by msgspec first (``fastread.py``), and by
        ``parse_line`` only when that fails (it accepts what msgspec is stricter about, such as
        ``x_`` fields, and gives the message)."""
        self.path = path
        self.file = open(path, "rb")  # noqa: SIM115 -- closed by close() or the context
        try:
            self.line_cap = budget.line_cap()
            """The longest line the memory budget can decode (``budget.LINE_PER_BYTE``)."""
            first = self.file.readline(self.line_cap + 1)
            if not first:
                raise TraceError(path, 1, "empty file")
            self._line_fits(first, 1)
            self.capped = os.fstat(self.file.fileno()).st_size > self.line_cap
            """Whether a line of this file could be over ``line_cap`` (read line by line then)."""
            header = _header_object(first, path)
            self.version = 0 if header.get("format") == V0_FORMAT else VERSION
            read = _v0_header if self.version == 0 else _v1_header
            self.config, self.judging = read(header, path)
        except BaseException:
            self.file.close()
            raise
        n = self.config.num_blocks
        line = v0_line if self.version == 0 else parse_line
        self._line: Callable[[bytes, int], tuple[Event, str | None]] = line
        self._decode: Callable[[bytes], object] = (
            decoder(n) if fast and self.version else lambda raw: line(raw, n)
        )
        self._refused: type[Exception] = Error if fast and self.version else ValueError
        self.parts: Parts | None = parts(n) if fast and self.version else None
        """The fast decoder's parts (``fastread.parts``), for a loop that decodes lines itself
        (``lines`` and ``slow``); None: every line goes to ``slow``."""

    def _line_fits(self, raw: bytes, number: int) -> None:
        """``TraceError`` at line ``number`` when ``raw`` is longer than the budget can judge."""
        if len(raw) > self.line_cap:
            length, part = len(raw), raw
            while part and not part.endswith(b"\n"):  # the line's length, for the advice
                part = self.file.readline(1 << 20)
                length += len(part)
            reason = budget.line_over(length, "").reason
            raise TraceError(self.path, number, f"decoding it: {reason}")

    def _capped_lines(self, number: int) -> Iterator[bytes]:
        """The file's lines from line ``number`` + 1, each read at most ``line_cap`` + 1 bytes
        and refused beyond (``_line_fits``): a file larger than the cap, line by line."""
        readline, cap = self.file.readline, self.line_cap + 1
        while raw := readline(cap):
            number += 1
            self._line_fits(raw, number)
            yield raw

    def lines(self, start: int = 2) -> Iterator[bytes]:
        """The raw lines from line ``start`` on (earlier lines skipped unread), for a loop that
        decodes them itself as ``events`` does: with ``parts``, and ``slow`` for any line the
        fast decoder refuses (or every line, without ``parts``)."""
        f = self.file
        f.seek(0)
        for _ in itertools.islice(self._capped_lines(0) if self.capped else f, start - 1):
            pass
        return self._capped_lines(start - 1) if self.capped else f

    def slow(self, raw: bytes, number: int) -> tuple[Event, str | None]:
        """Line ``number`` by ``parse_line`` (or a v0 line's reader): the event, or
        ``TraceError`` at that line."""
        try:
            return self._line(raw, self.config.num_blocks)
        except ValueError as err:
            raise TraceError(self.path, number, str(err)) from None

    def events(self, start: int = 2) -> Iterator[TraceEvent]:
        """The events from line ``start`` on (earlier lines are skipped unread); a line the
        decoder refuses goes to ``parse_line``, which accepts it or says what is wrong
        (``TraceError`` at that line)."""
        f, path, n = self.file, self.path, self.config.num_blocks
        decode, refused, line = self._decode, self._refused, self._line
        f.seek(0)
        number = start - 1
        for _ in itertools.islice(self._capped_lines(0) if self.capped else f, start - 1):
            pass
        for raw in self._capped_lines(number) if self.capped else f:
            number += 1
            try:
                got = decode(raw)
            except refused:
                try:
                    got = line(raw, n)
                except ValueError as err:
                    raise TraceError(path, number, str(err)) from None
            yield number, got[0], got[1]  # type: ignore[index]

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trace(path: str | Path, fast: bool = False) -> Trace:
    """Open a trace file of either format (``Trace``)."""
    return Trace(path, fast)


def iter_trace(
    path: str | Path, start: int = 2, fast: bool = False
) -> tuple[Config, Iterator[TraceEvent]]:
    """A trace's ``Config`` now (header errors raise here) and its events from line ``start``
    (the file is closed when the iterator is exhausted or collected)."""
    trace = Trace(path, fast)

    def events() -> Iterator[TraceEvent]:
        with trace:
            yield from trace.events(start)

    return trace.config, events()


def read_trace(path: str | Path) -> tuple[Config, list[Event]]:
    """A whole trace as ``(config, events)`` (hashes dropped): for small files; the file's size
    is priced against the memory budget first (``TraceError`` at line 1 when it does not fit)."""
    with Trace(path) as trace:
        try:
            budget.check_read_whole(path, "reading the trace whole")
        except budget.OverBudget as err:
            raise TraceError(path, 1, err.reason) from None
        return trace.config, [event for _, event, _ in trace.events()]


def v0_line(raw: bytes, num_blocks: int) -> tuple[Event, None]:
    """A v0 line: a JSON array, the event tuple as the engine emitted it, checked field by field
    as its v1 line would be (``ValueError`` naming what is wrong)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        if not raw.strip():
            raise ValueError("empty line") from None
        raise ValueError(json_error(raw, err)) from None
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise ValueError("an event is a JSON array starting with its kind")
    kind = value[0]
    fields = FIELDS.get(kind)
    if fields is None:
        raise ValueError(f"unknown event kind {kind!r}")
    optional = kind in TRAILING or kind in WHEN_SET
    if len(value) != len(fields) + 1 + (optional and len(value) == len(fields) + 2):
        names = ", ".join(name for name, _ in fields) or "none"
        raise ValueError(
            f"{kind}: {len(fields)} values after the kind ({names}), got {len(value) - 1}"
        )
    extra = {}
    if kind in TRAILING and len(value) == len(fields) + 2:  # the optional group
        extra = {TRAILING[kind][0]: value.pop()}
    elif kind in WHEN_SET and len(value) == len(fields) + 2:  # a bound, a preempting reset
        extra = {WHEN_SET[kind][0]: value.pop()}
    obj = {"ev": kind, **{name: v for (name, _), v in zip(fields, value[1:], strict=True)}}
    obj.update(extra)
    return parse_object(obj, num_blocks)[0], None


def _tuples(value: object) -> object:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def write_events(path: str | Path, config: Config, events: Iterable[Event]) -> int:
    """Write a v0 event file; return the number of events written."""
    count = 0
    with open(path, "wb") as out:
        header = {
            "format": V0_FORMAT,
            "version": 0,
            "config": _written(config, (f.name for f in fields(config))),
        }
        out.write(orjson.dumps(header) + b"\n")
        for event in events:
            out.write(orjson.dumps(event) + b"\n")
            count += 1
    return count


def read_events(path: str | Path) -> tuple[Config, list[Event]]:
    """A whole v0 event file as ``(config, events)``; ``ValueError`` naming file:line."""
    return read_trace(path)
